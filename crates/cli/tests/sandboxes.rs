//! `runcell serve` over real HTTP: sandbox lifecycle (idle TTL, persistent),
//! many concurrent clients and the capacity limit, templates, files, limits
//! and the lifecycle routes. Needs root.

mod common;

use std::time::{Duration, Instant};

use common::*;
use reqwest::Method;
use serde_json::{json, Value};

#[tokio::test(flavor = "multi_thread")]
async fn idle_ttl_is_enforced_within_two_seconds_and_persistent_is_exempt() {
    let data = data_dir("ttl");
    let d = Daemon::start(&data, free_port(), &[]);
    let short = d.create(json!({"ttl_seconds": 1})).await;
    let pinned = d
        .create(json!({"ttl_seconds": 1, "persistent": true}))
        .await;
    // The idle TTL is enforced: gone within 4 s.
    ended_answer(&d, &short, Duration::from_secs(4)).await;
    let (s, body) = d.exec(&pinned, "true").await;
    assert_eq!(
        s, 200,
        "a persistent sandbox must survive its idle TTL: {body}"
    );
    let life: Value = d.get(&format!("/v1/sandboxes/{pinned}/lifecycle")).await;
    assert_eq!(life["persistent"], true);
    d.delete_all().await;
    drop(d);
    let _ = std::fs::remove_dir_all(&data);
}

#[tokio::test(flavor = "multi_thread")]
async fn sixty_four_concurrent_clients_and_a_capacity_limit() {
    let data = data_dir("load");
    let d = std::sync::Arc::new(Daemon::start(
        &data,
        free_port(),
        &["--standby", "0", "--max-sandboxes", "80"],
    ));
    let mut tasks = Vec::new();
    for i in 0..64 {
        let d = d.clone();
        tasks.push(tokio::spawn(async move {
            let id = d
                .create(json!({"metadata": {"client": i.to_string()}}))
                .await;
            let (s, body) = d.exec(&id, &format!("python3 -c 'print({i} * 2)'")).await;
            assert_eq!(
                (s, body["stdout"].as_str().unwrap().to_string()),
                (200, format!("{}\n", i * 2)),
                "{body}"
            );
            d.delete(&id).await;
        }));
    }
    for t in tasks {
        t.await.expect("a client failed");
    }
    let list: Vec<Value> = d.get("/v1/sandboxes").await;
    assert!(list.is_empty());
    // Teardown finishes just after DELETE answers.
    let until = Instant::now() + Duration::from_secs(5);
    loop {
        let left: Vec<_> = std::fs::read_dir(data.join("sandboxes")).unwrap().collect();
        if left.is_empty() {
            break;
        }
        assert!(
            Instant::now() < until,
            "sandbox directories left behind: {left:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    drop(d);

    // Past the configured maximum, creates are refused with Retry-After and
    // nothing is made.
    let data2 = data_dir("cap");
    let d = Daemon::start(
        &data2,
        free_port(),
        &["--standby", "0", "--max-sandboxes", "2"],
    );
    d.create(json!({})).await;
    d.create(json!({})).await;
    let r = d
        .req(reqwest::Method::POST, "/v1/sandboxes")
        .json(&json!({}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 503);
    assert_eq!(r.headers()["retry-after"], "5");
    let body: Value = r.json().await.unwrap();
    assert!(
        body["error"].as_str().unwrap().contains("limit is 2"),
        "{body}"
    );
    assert_eq!(
        std::fs::read_dir(data2.join("sandboxes")).unwrap().count(),
        2
    );
    d.delete_all().await;
    drop(d);
    let _ = std::fs::remove_dir_all(&data);
    let _ = std::fs::remove_dir_all(&data2);
}

#[tokio::test(flavor = "multi_thread")]
async fn templates_files_lifecycle_and_limits_through_the_api() {
    let data = data_dir("routes");
    let d = Daemon::start(&data, free_port(), &[]);
    let get = |path: String| d.req(reqwest::Method::GET, &path).send();
    // Templates: the built-in one and the aliases; unknown is 404.
    let list: Vec<Value> = d.get("/v1/templates").await;
    let names: Vec<&str> = list.iter().map(|t| t["name"].as_str().unwrap()).collect();
    assert_eq!(names, vec!["host", "code-interpreter", "ubuntu-24.04"]);
    let t: Value = d.get("/v1/templates/code-interpreter").await;
    assert_eq!(t["alias_of"], "host");
    assert_eq!(
        get("/v1/templates/nope".into()).await.unwrap().status(),
        404
    );

    // Limits ride on create and are enforced.
    let sb = d
        .create_json(json!({"limits": {"memory_mb": 64, "pids": 32, "timeout_seconds": 5}}))
        .await;
    assert_eq!(
        (
            sb["limits"]["memory_mb"].as_u64(),
            sb["limits"]["pids"].as_u64()
        ),
        (Some(64), Some(32))
    );
    let id = sb["id"].as_str().unwrap().to_string();
    let (s, body) = d.exec(&id, "python3 -c 'x = bytearray(256 << 20)'").await;
    assert_eq!(
        (s, body["oom_killed"].as_bool(), body["exit_code"].as_i64()),
        (200, Some(true), Some(137)),
        "{body}"
    );
    assert_eq!(
        d.status(
            reqwest::Method::POST,
            "/v1/sandboxes",
            Some(json!({"limits": {"memory_mb": 1}}))
        )
        .await,
        400
    );
    assert_eq!(
        d.status(
            reqwest::Method::POST,
            "/v1/sandboxes",
            Some(json!({"limits": {"gpus": 1}}))
        )
        .await,
        400
    );

    // Files: write, list, stat (PandaStack's mode letters), errors.
    let r = d
        .req(
            reqwest::Method::PUT,
            &format!("/v1/sandboxes/{id}/fs?path=/home/user/d/a.txt"),
        )
        .body("hello")
        .send()
        .await
        .unwrap();
    let w: Value = r.json().await.unwrap();
    assert_eq!(
        (w["path"].as_str(), w["bytes"].as_u64()),
        (Some("/home/user/d/a.txt"), Some(5))
    );
    let dir: Value = d
        .get(&format!("/v1/sandboxes/{id}/fs/dir?path=/home/user/d"))
        .await;
    assert_eq!(dir["entries"][0]["name"], "a.txt");
    assert_eq!(dir["entries"][0]["mode"], "f");
    let st: Value = d
        .get(&format!("/v1/sandboxes/{id}/fs/stat?path=/home/user/d"))
        .await;
    assert_eq!(
        (st["is_dir"].as_bool(), st["mode"].as_str()),
        (Some(true), Some("d"))
    );
    let r = get(format!("/v1/sandboxes/{id}/fs/stat?path=/home/user/none"))
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    assert_eq!(
        r.json::<Value>().await.unwrap()["error"],
        "file does not exist"
    );
    let r = get(format!("/v1/sandboxes/{id}/fs/dir?path=/home/user/none"))
        .await
        .unwrap();
    assert_eq!(r.status(), 404);

    // Lifecycle: PATCH either field; bad input is 400.
    let patch = |body: &'static str| {
        d.req(
            reqwest::Method::PATCH,
            &format!("/v1/sandboxes/{id}/lifecycle"),
        )
        .header("content-type", "application/json")
        .body(body)
        .send()
    };
    let l: Value = patch(r#"{"ttl_seconds": 900}"#)
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(
        (l["ttl_seconds"].as_u64(), l["persistent"].as_bool()),
        (Some(900), Some(false))
    );
    let l: Value = patch(r#"{"persistent": true}"#)
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(
        (l["ttl_seconds"].as_u64(), l["persistent"].as_bool()),
        (Some(900), Some(true))
    );
    assert_eq!(patch("").await.unwrap().status(), 400);
    assert_eq!(patch(r#"{"ttl_seconds": -1}"#).await.unwrap().status(), 400);
    d.delete_all().await;
    drop(d);
    let _ = std::fs::remove_dir_all(&data);
}

/// A sandbox whose processes all died (its agent with them; here killed
/// from the host, as an operator or the kernel might) answers what it is
/// asked before the daemon notices with 409 "no longer running" and why,
/// never a 500 about a socket: the API fuzzing once got `500 The agent
/// connection failed: Broken pipe` from a file request in that window.
/// Then it is reaped, and asking for it says it stopped.
#[tokio::test(flavor = "multi_thread")]
async fn a_sandbox_whose_agent_died_answers_409_not_a_socket_error() {
    let data = data_dir("agent-died");
    let d = Daemon::start(&data, free_port(), &[]);
    let mut ended = 0;
    for _ in 0..3 {
        let id = d.create(json!({})).await;
        // Its connection to the agent is open and in use.
        let (s, body) = d.exec(&id, "true").await;
        assert_eq!(s, 200, "{body}");
        let r = d
            .req(
                Method::GET,
                &format!("/v1/sandboxes/{id}/fs/stat?path=/tmp"),
            )
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let pids: Vec<String> = host_processes()
            .into_iter()
            .filter(|p| p.in_cgroup_of(&id))
            .map(|p| p.pid.to_string())
            .collect();
        assert!(!pids.is_empty(), "no process of {id} on the host");
        let killed = std::process::Command::new("kill")
            .arg("-KILL")
            .args(&pids)
            .status()
            .unwrap();
        assert!(killed.success());
        // At once, before the reaper's next look (every half second).
        let base = format!("/v1/sandboxes/{id}");
        let asks = [
            d.req(Method::GET, &format!("{base}/fs/stat?path=/tmp")),
            d.req(Method::PUT, &format!("{base}/fs?path=/tmp/x"))
                .body("231"),
            d.req(Method::GET, &format!("{base}/fs?path=/etc/hostname")),
            d.req(Method::GET, &format!("{base}/fs/dir?path=/")),
            d.req(Method::POST, &format!("{base}/exec"))
                .json(&json!({"cmd": "true"})),
            d.req(Method::POST, &format!("{base}/repl/sessions"))
                .json(&json!({"language": "python"})),
        ];
        let answers = futures_util::future::join_all(asks.into_iter().map(|rb| async move {
            let r = rb.send().await.unwrap();
            (r.status().as_u16(), r.text().await.unwrap())
        }))
        .await;
        for (status, text) in answers {
            assert!(
                status == 409 || status == 404,
                "a request to a sandbox whose agent died: {status} {text}"
            );
            let v: Value = serde_json::from_str(&text).unwrap();
            let msg = v["error"].as_str().unwrap_or_default();
            if status == 409 {
                assert!(msg.contains("no longer running"), "{msg}");
                ended += 1;
            } else {
                assert!(msg.contains("stopped"), "{msg}");
            }
        }
        let why = ended_answer(&d, &id, Duration::from_secs(5)).await;
        assert_eq!(why["end_reason"], "sandbox stopped", "{why}");
    }
    // The reaper may have been first now and then, not every time.
    assert!(
        ended > 0,
        "no request reached a sandbox whose agent had died"
    );
    d.delete_all().await;
    drop(d);
    let _ = std::fs::remove_dir_all(&data);
}

/// A paused sandbox's idle clock stops, and so must its agent's: paused
/// past its idle TTL and the agent's 30 s grace, then resumed, it used to
/// stop at once (the agent, thawed, found its own deadline passed before
/// the resume could move it). It runs on, and idles out as usual after.
#[tokio::test(flavor = "multi_thread")]
async fn a_sandbox_paused_past_its_idle_ttl_runs_on_when_resumed() {
    let data = data_dir("paused-long");
    let d = Daemon::start(&data, free_port(), &[]);
    let id = d.create(json!({"ttl_seconds": 1})).await;
    assert_eq!(act(&d, &id, "pause").await, 204);
    tokio::time::sleep(Duration::from_secs(33)).await;
    assert_eq!(act(&d, &id, "resume").await, 204);
    // Time for an agent that stops itself to have done so.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (s, body) = d.exec(&id, "echo still here").await;
    assert_eq!(s, 200, "{body}");
    assert_eq!(body["stdout"], "still here\n", "{body}");
    // Its idle TTL applies again from the resume.
    let why = ended_answer(&d, &id, Duration::from_secs(5)).await;
    assert_eq!(why["end_reason"], "idle ttl expired", "{why}");
    drop(d);
    let _ = std::fs::remove_dir_all(&data);
}
