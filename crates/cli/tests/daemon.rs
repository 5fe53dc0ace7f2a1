//! `runcell serve` over real HTTP: lifecycle promises and bad input. Needs root.

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value};

#[tokio::test(flavor = "multi_thread")]
async fn sigkill_mid_exec_then_restart_reattaches_reaps_and_cleans() {
    let data = data_dir("restart");
    let port = free_port();
    let mut d = Daemon::start(&data, port, &[]);
    let keep = d
        .create(json!({"ttl_seconds": 600, "metadata": {"threadId": "t1"}}))
        .await;
    let expire = d.create(json!({"ttl_seconds": 1})).await;
    let (s, _) = d.exec(&keep, "echo kept > /home/user/f").await;
    assert_eq!(s, 200);
    // SIGKILL the daemon in the middle of an exec.
    let long = {
        let req = d
            .req(reqwest::Method::POST, &format!("/v1/sandboxes/{keep}/exec"))
            .json(&json!({"cmd": "sleep 30"}));
        tokio::spawn(async move { req.send().await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    d.kill9();
    let _ = long.await;
    // An orphan the registry does not know: a directory and cgroup left by hand.
    let orphan = data.join("sandboxes/00000000-0000-0000-0000-00000000dead");
    std::fs::create_dir_all(&orphan).unwrap();
    tokio::time::sleep(Duration::from_millis(1500)).await;

    let d = Daemon::start(&data, port, &[]);
    // The live one is back, with its files.
    let (s, body) = d.exec(&keep, "cat /home/user/f").await;
    assert_eq!(
        (s, body["stdout"].as_str().unwrap()),
        (200, "kept\n"),
        "{body}"
    );
    // The one whose TTL passed while the daemon was down is gone.
    let r = d
        .req(reqwest::Method::GET, &format!("/v1/sandboxes/{expire}"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    assert!(!data.join("sandboxes").join(&expire).exists());
    assert!(!orphan.exists(), "the orphan directory was not removed");
    // Metadata filters see it.
    let list: Vec<Value> = d
        .req(reqwest::Method::GET, "/v1/sandboxes?metadata.threadId=t1")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(list.len(), 1);
    assert_eq!(list[0]["id"], keep.as_str());
    let r = d
        .req(reqwest::Method::DELETE, &format!("/v1/sandboxes/{keep}"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 204);
    wait_gone(&data.join("sandboxes").join(&keep)).await;
    drop(d);
    let _ = std::fs::remove_dir_all(&data);
}

#[tokio::test(flavor = "multi_thread")]
async fn idle_ttl_is_enforced_within_two_seconds_and_persistent_is_exempt() {
    let data = data_dir("ttl");
    let d = Daemon::start(&data, free_port(), &[]);
    let short = d.create(json!({"ttl_seconds": 1})).await;
    let pinned = d
        .create(json!({"ttl_seconds": 1, "persistent": true}))
        .await;
    let started = Instant::now();
    loop {
        let r = d
            .req(reqwest::Method::GET, &format!("/v1/sandboxes/{short}"))
            .send()
            .await
            .unwrap();
        if r.status() == 404 {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(4),
            "the idle TTL was not enforced"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (s, body) = d.exec(&pinned, "true").await;
    assert_eq!(
        s, 200,
        "a persistent sandbox must survive its idle TTL: {body}"
    );
    let life: Value = d
        .req(
            reqwest::Method::GET,
            &format!("/v1/sandboxes/{pinned}/lifecycle"),
        )
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(life["persistent"], true);
    d.delete_all().await;
    drop(d);
    let _ = std::fs::remove_dir_all(&data);
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_input_gets_clear_errors() {
    let data = data_dir("bad");
    let d = Daemon::start(&data, free_port(), &["--max-body", "1M"]);
    let post = |path: &str, body: &'static str| {
        d.req(reqwest::Method::POST, path)
            .header("content-type", "application/json")
            .body(body)
    };
    expect_error(post("/v1/sandboxes", "{not json"), 400, "not valid JSON").await;
    expect_error(
        post("/v1/sandboxes", r#"{"template":"cobol-99"}"#),
        400,
        "installed templates: host",
    )
    .await;
    expect_error(
        post("/v1/sandboxes", r#"{"ttl_seconds":-5}"#),
        400,
        "ttl_seconds must be a whole number between 0 and",
    )
    .await;
    expect_error(
        post("/v1/sandboxes/nope/exec", r#"{"cmd":"true"}"#),
        404,
        "sandbox not found",
    )
    .await;
    let id = d.create(json!({})).await;
    let fs = |method, path: &str| d.req(method, &format!("/v1/sandboxes/{id}/fs?path={path}"));
    expect_error(
        fs(reqwest::Method::PUT, "/tmp/big").body(vec![0u8; 2 << 20]),
        413,
        "larger than",
    )
    .await;
    expect_error(fs(reqwest::Method::GET, "etc/passwd"), 400, "absolute").await;
    expect_error(fs(reqwest::Method::GET, "/no/such"), 404, "No such file").await;
    expect_error(
        reqwest::Client::new()
            .get(format!("{}/v1/sandboxes", d.url))
            .bearer_auth("wrong"),
        401,
        "unauthorized",
    )
    .await;
    // The sandbox lost nothing through all that.
    let (s, body) = d.exec(&id, "echo fine").await;
    assert_eq!((s, body["stdout"].as_str().unwrap()), (200, "fine\n"));
    let list: Vec<Value> = d
        .req(reqwest::Method::GET, "/v1/sandboxes")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(list.len(), 1);
    // The sandbox's log has the output of its execs, as text and as SSE.
    let log = d
        .req(
            reqwest::Method::GET,
            &format!("/v1/sandboxes/{id}/logs?stream=stdout"),
        )
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert_eq!(log, "fine\n");
    let follow = d
        .req(
            reqwest::Method::GET,
            &format!("/v1/sandboxes/{id}/logs?follow=true"),
        )
        .send()
        .await
        .unwrap();
    assert!(follow.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/event-stream"));
    let (s, _) = d.exec(&id, "echo live").await;
    assert_eq!(s, 200);
    let mut body = follow.bytes_stream();
    let mut seen = String::new();
    use futures_util::StreamExt;
    while !seen.contains("live") {
        let chunk = tokio::time::timeout(Duration::from_secs(5), body.next())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        seen.push_str(&String::from_utf8_lossy(&chunk));
    }
    assert!(
        seen.contains("event: line\ndata: {\"line\":\"fine\\n\"}"),
        "{seen}"
    );
    assert!(seen.contains("{\"line\":\"live\\n\"}"), "{seen}");
    // The OpenAPI document is generated from the handlers (no key needed).
    let doc: Value = reqwest::get(format!("{}/v1/openapi.json", d.url))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert!(doc["openapi"].as_str().unwrap().starts_with("3."), "{doc}");
    for path in [
        "/v1/sandboxes",
        "/v1/sandboxes/{id}/exec",
        "/v1/sandboxes/{id}/fs",
        "/v1/sandboxes/{id}/lifecycle",
        "/v1/templates",
    ] {
        assert!(
            doc["paths"].get(path).is_some(),
            "{path} missing from the OpenAPI document"
        );
    }
    let exec_schema = &doc["components"]["schemas"]["ExecView"]["properties"];
    assert!(
        exec_schema.get("oom_killed").is_some() && exec_schema.get("exit_code").is_some(),
        "{exec_schema}"
    );
    // The errors and the creation show up in the metrics (no key needed).
    let text = reqwest::get(format!("{}/metrics", d.url))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(text.contains("runcell_sandbox_creations_total 1"), "{text}");
    assert!(
        text.contains("runcell_sandboxes{state=\"running\"} 1"),
        "{text}"
    );
    assert!(
        text.contains("runcell_api_errors_total{route=\"/v1/sandboxes\",status=\"400\"} 3"),
        "{text}"
    );
    assert!(
        text.contains("route=\"/v1/sandboxes/{id}/fs\",status=\"413\"} 1"),
        "{text}"
    );
    let _ = (d.port, &d.data);
    d.delete_all().await;
    drop(d);
    let _ = std::fs::remove_dir_all(&data);
}

#[tokio::test(flavor = "multi_thread")]
async fn workspaces_only_see_their_own_sandboxes_and_keys_can_be_revoked() {
    let data = data_dir("ws");
    let d = Daemon::start(&data, free_port(), &[]);
    let key_cmd = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_runcell"))
            .arg("key")
            .arg("--data-dir")
            .arg(&data)
            .args(args)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    };
    let other_key = key_cmd(&["create", "--workspace", "team-b", "--name", "test"])
        .trim()
        .to_string();
    assert!(other_key.starts_with("rc_"));
    // The database never holds the key itself.
    let db = std::fs::read(data.join("registry.db")).unwrap();
    assert!(!String::from_utf8_lossy(&db).contains(&other_key[3..]));
    let other = |method: reqwest::Method, path: &str| {
        reqwest::Client::new()
            .request(method, format!("{}{path}", d.url))
            .bearer_auth(&other_key)
    };
    let mine = d
        .create(json!({"metadata": {"workspace": "team-b", "kind": "x", "threadId": "t"}}))
        .await;
    // Reserved metadata is stamped by the server.
    let got: Value = d
        .req(reqwest::Method::GET, &format!("/v1/sandboxes/{mine}"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(got["metadata"]["workspace"], "default");
    assert!(got["metadata"].get("kind").is_none());
    assert_eq!(got["metadata"]["threadId"], "t");
    // Another workspace sees nothing of it.
    for (m, p) in [
        (reqwest::Method::GET, format!("/v1/sandboxes/{mine}")),
        (reqwest::Method::DELETE, format!("/v1/sandboxes/{mine}")),
        (
            reqwest::Method::GET,
            format!("/v1/sandboxes/{mine}/fs?path=/etc/passwd"),
        ),
    ] {
        let r = other(m, &p).send().await.unwrap();
        assert_eq!(r.status(), 404, "{p}");
    }
    let r = other(reqwest::Method::POST, &format!("/v1/sandboxes/{mine}/exec"))
        .json(&json!({"cmd": "true"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    let list: Vec<Value> = other(reqwest::Method::GET, "/v1/sandboxes")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert!(list.is_empty(), "{list:?}");
    let me: Value = other(reqwest::Method::GET, "/v1/me")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(me["user_id"], "team-b");
    // The owner still has it.
    let (s, _) = d.exec(&mine, "true").await;
    assert_eq!(s, 200);
    // Revoked keys stop working at once.
    let listing = key_cmd(&["ls"]);
    assert!(
        listing.contains("team-b") && listing.contains(&other_key[..11]),
        "{listing}"
    );
    key_cmd(&["revoke", &other_key[..11]]);
    let r = other(reqwest::Method::GET, "/v1/sandboxes")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
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
            let r = d
                .req(reqwest::Method::DELETE, &format!("/v1/sandboxes/{id}"))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 204);
        }));
    }
    for t in tasks {
        t.await.expect("a client failed");
    }
    let list: Vec<Value> = d
        .req(reqwest::Method::GET, "/v1/sandboxes")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
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
async fn config_file_flags_win_and_sigterm_lets_running_requests_finish() {
    let data = data_dir("conf");
    std::fs::create_dir_all(&data).unwrap();
    let conf = data.join("runcell.toml");
    std::fs::write(
        &conf,
        "default_ttl = \"7m\"\nmax_sandboxes = 1\nexec_timeout = \"9s\"\n[aliases]\nbase = \"host\"\n",
    )
    .unwrap();
    // An invalid file is a clear error, not a silent default.
    std::fs::write(data.join("bad.toml"), "no_such_setting = 1\n").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_runcell"))
        .args(["serve", "--config"])
        .arg(data.join("bad.toml"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("no_such_setting"));

    let conf_arg = conf.display().to_string();
    // The flag wins over the file (max_sandboxes 2, not 1).
    let mut d = Daemon::start(
        &data,
        free_port(),
        &["--config", &conf_arg, "--max-sandboxes", "2"],
    );
    let id = d.create(json!({"template": "base"})).await;
    let got: Value = d
        .req(reqwest::Method::GET, &format!("/v1/sandboxes/{id}"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(got["ttl_seconds"], 420, "{got}");
    assert_eq!(got["limits"]["timeout_seconds"], 9.0, "{got}");
    d.create(json!({})).await;
    let r = d
        .req(reqwest::Method::POST, "/v1/sandboxes")
        .json(&json!({}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 503);

    // SIGTERM during an exec: the exec finishes, then the daemon exits.
    let req = d
        .req(reqwest::Method::POST, &format!("/v1/sandboxes/{id}/exec"))
        .json(&json!({"cmd": "sleep 1; echo done"}));
    let running =
        tokio::spawn(async move { req.send().await.unwrap().json::<Value>().await.unwrap() });
    tokio::time::sleep(Duration::from_millis(300)).await;
    // SAFETY: kill sends a signal to our own child; no memory is involved.
    unsafe { libc::kill(d.child.id() as i32, libc::SIGTERM) };
    let body = running.await.unwrap();
    assert_eq!(body["stdout"], "done\n", "{body}");
    let status = d.child.wait().unwrap();
    assert!(status.success(), "{status}");
    // The sandboxes outlived the daemon and are there for the next start.
    let d = Daemon::start(
        &data,
        free_port(),
        &["--config", &conf_arg, "--max-sandboxes", "2"],
    );
    let (s, _) = d.exec(&id, "true").await;
    assert_eq!(s, 200);
    d.delete_all().await;
    drop(d);
    let _ = std::fs::remove_dir_all(&data);
}

#[tokio::test(flavor = "multi_thread")]
async fn templates_files_lifecycle_and_limits_through_the_api() {
    let data = data_dir("routes");
    let d = Daemon::start(&data, free_port(), &[]);
    let get = |path: String| d.req(reqwest::Method::GET, &path).send();
    // Templates: the built-in one and the aliases; unknown is 404.
    let list: Vec<Value> = get("/v1/templates".into())
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let names: Vec<&str> = list.iter().map(|t| t["name"].as_str().unwrap()).collect();
    assert_eq!(names, vec!["host", "code-interpreter", "ubuntu-24.04"]);
    let t: Value = get("/v1/templates/code-interpreter".into())
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(t["alias_of"], "host");
    assert_eq!(
        get("/v1/templates/nope".into()).await.unwrap().status(),
        404
    );

    // Limits ride on create and are enforced.
    let r = d
        .req(reqwest::Method::POST, "/v1/sandboxes")
        .json(&json!({"limits": {"memory_mb": 64, "pids": 32, "timeout_seconds": 5}}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    let sb: Value = r.json().await.unwrap();
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
    let r = d
        .req(reqwest::Method::POST, "/v1/sandboxes")
        .json(&json!({"limits": {"memory_mb": 1}}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let r = d
        .req(reqwest::Method::POST, "/v1/sandboxes")
        .json(&json!({"limits": {"gpus": 1}}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);

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
    let dir: Value = get(format!("/v1/sandboxes/{id}/fs/dir?path=/home/user/d"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(dir["entries"][0]["name"], "a.txt");
    assert_eq!(dir["entries"][0]["mode"], "f");
    let st: Value = get(format!("/v1/sandboxes/{id}/fs/stat?path=/home/user/d"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
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

#[tokio::test(flavor = "multi_thread")]
async fn code_contexts_over_http_keep_state_return_rich_results_and_survive_timeouts() {
    use base64::Engine;
    let data = data_dir("repl");
    let d = Daemon::start(&data, free_port(), &[]);
    let id = d.create(json!({})).await;
    let sessions = format!("/v1/sandboxes/{id}/repl/sessions");
    let r = d
        .req(reqwest::Method::POST, &sessions)
        .json(&json!({"language": "python"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    let s: Value = r.json().await.unwrap();
    let sid = s["id"].as_str().unwrap().to_string();
    assert_eq!(sid.len(), 16);
    assert_eq!(
        (s["session_id"].as_str(), s["language"].as_str()),
        (Some(sid.as_str()), Some("python"))
    );
    let run = |code: &str, timeout_ms: Option<u64>| {
        let mut body = json!({ "code": code });
        if let Some(t) = timeout_ms {
            body["timeout_ms"] = json!(t);
        }
        d.req(reqwest::Method::POST, &format!("{sessions}/{sid}/run"))
            .json(&body)
    };
    let ok = |rb: reqwest::RequestBuilder| async move {
        let r = rb.send().await.unwrap();
        let status = r.status().as_u16();
        let v: Value = r.json().await.unwrap();
        assert_eq!(status, 200, "{v}");
        v
    };

    ok(run("import pandas as pd\nrows = [1, 2]", None)).await;
    let v = ok(run("print(len(rows))\npd.DataFrame({'a': rows})", None)).await;
    assert_eq!(v["stdout"], "2\n");
    assert_eq!(
        (v["exit"].as_i64(), v["exit_code"].as_i64()),
        (Some(0), Some(0))
    );
    assert!(
        v["results"][0]["text/html"]
            .as_str()
            .unwrap()
            .contains("<table"),
        "{v}"
    );
    assert!(v.get("error").is_none());

    let v = ok(run(
        "import matplotlib.pyplot as plt\nfig = plt.figure(figsize=(2, 1), dpi=50)\nplt.plot([0, 1])",
        None,
    ))
    .await;
    let png = v["results"]
        .as_array()
        .unwrap()
        .iter()
        .find_map(|b| b["image/png"].as_str())
        .expect("a PNG result");
    let png = base64::engine::general_purpose::STANDARD
        .decode(png)
        .unwrap();
    assert_eq!(&png[16..24], &[0, 0, 0, 100, 0, 0, 0, 50]);

    let v = ok(run("x = 1\n1 / 0", None)).await;
    assert_eq!(v["exit"], 1);
    assert_eq!(v["exception"]["name"], "ZeroDivisionError");
    let tb = v["error"].as_str().unwrap();
    assert!(
        tb.contains("line 2") && tb.contains("1 / 0") && tb.contains("ZeroDivisionError"),
        "{tb}"
    );
    assert!(v["stderr"].as_str().unwrap().contains("ZeroDivisionError"));

    // A timeout: 500 whose error contains "timeout" (the SDKs raise
    // SandboxTimeout), with a plain message; the context keeps working.
    let r = run("while True: pass", Some(500)).send().await.unwrap();
    assert_eq!(r.status(), 500);
    let v: Value = r.json().await.unwrap();
    let err = v["error"].as_str().unwrap();
    assert!(
        err.starts_with("cell timeout after 0.5s") && err.contains("interrupted"),
        "{err}"
    );
    assert_eq!(v["timed_out"], true);
    assert_eq!(v["state_lost"], false);
    assert_eq!(
        ok(run("x + len(rows)", None)).await["results"][0]["text/plain"],
        "3"
    );

    // A crash is reported in `error` and the next cell runs in a fresh interpreter.
    let v = ok(run("import os; os._exit(5)", None)).await;
    assert_eq!(v["exit"], 5);
    assert_eq!(v["state_lost"], true);
    let err = v["error"].as_str().unwrap();
    assert!(
        err.contains("exited with code 5") && err.contains("lost"),
        "{err}"
    );
    assert_eq!(
        ok(run("'x' in globals()", None)).await["results"][0]["text/plain"],
        "False"
    );

    // JavaScript and bash sessions too; list shows all three.
    for (lang, code, want) in [
        ("javascript", "let a = 6; a * 7", "42"),
        ("bash", "echo $((6 * 7))", ""),
    ] {
        let r = d
            .req(reqwest::Method::POST, &sessions)
            .json(&json!({ "language": lang }))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 201);
        let other: Value = r.json().await.unwrap();
        let r = d
            .req(
                reqwest::Method::POST,
                &format!("{sessions}/{}/run", other["id"].as_str().unwrap()),
            )
            .json(&json!({ "code": code }))
            .send()
            .await
            .unwrap();
        let v: Value = r.json().await.unwrap();
        if want.is_empty() {
            assert_eq!(v["stdout"], "42\n", "{v}");
        } else {
            assert_eq!(v["results"][0]["text/plain"], want, "{v}");
        }
    }
    let list: Vec<Value> = d
        .req(reqwest::Method::GET, &sessions)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(list.len(), 3);
    assert!(list
        .iter()
        .any(|s| s["id"] == sid.as_str() && s["restarts"] == 1));

    // Bad input: unknown language, empty code, bad JSON, missing session and sandbox.
    expect_error(
        d.req(reqwest::Method::POST, &sessions)
            .json(&json!({"language": "cobol"})),
        400,
        "cobol",
    )
    .await;
    expect_error(run("  ", None), 400, "code required").await;
    expect_error(
        d.req(reqwest::Method::POST, &format!("{sessions}/{sid}/run"))
            .body("{"),
        400,
        "not valid JSON",
    )
    .await;
    expect_error(
        d.req(
            reqwest::Method::POST,
            &format!("{sessions}/0000000000000000/run"),
        )
        .json(&json!({"code": "1"})),
        404,
        "session not found",
    )
    .await;
    expect_error(
        d.req(reqwest::Method::POST, "/v1/sandboxes/nope/repl/sessions")
            .json(&json!({})),
        404,
        "sandbox not found",
    )
    .await;
    let r = d
        .req(reqwest::Method::DELETE, &format!("{sessions}/{sid}"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 204);
    expect_error(
        d.req(reqwest::Method::DELETE, &format!("{sessions}/{sid}")),
        404,
        "session not found",
    )
    .await;
    d.delete_all().await;
}

/// The value of a metric sample line, e.g. `runcell_warm_pool_ready{template="host"}`.
async fn metric(d: &Daemon, sample: &str) -> f64 {
    let text = reqwest::get(format!("{}/metrics", d.url))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix(sample)?.trim().parse().ok())
        .unwrap_or_else(|| panic!("no sample {sample} in:\n{text}"))
}

async fn wait_metric(d: &Daemon, sample: &str, want: f64) {
    let until = Instant::now() + Duration::from_secs(30);
    while metric(d, sample).await != want {
        assert!(Instant::now() < until, "{sample} never reached {want}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn warm_pool_hands_out_each_sandbox_once_with_a_ready_context_and_refills() {
    let data = data_dir("warm");
    let d = Daemon::start(&data, free_port(), &["--warm-pool", "host=2"]);
    let ready = "runcell_warm_pool_ready{template=\"host\"}";
    wait_metric(&d, ready, 2.0).await;
    assert_eq!(
        metric(&d, "runcell_warm_pool_size{template=\"host\"}").await,
        2.0
    );

    // Two creates take the two pooled sandboxes; each gets its own warm
    // Python context, which the first plain python session returns.
    let mut seen = Vec::new();
    for n in 0..2 {
        let id = d.create(json!({"template": "host"})).await;
        let sessions = format!("/v1/sandboxes/{id}/repl/sessions");
        let listed: Vec<Value> = d
            .req(reqwest::Method::GET, &sessions)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert!(
            listed.is_empty(),
            "the warm context is not a session yet: {listed:?}"
        );
        let t = Instant::now();
        let r = d
            .req(reqwest::Method::POST, &sessions)
            .json(&json!({"language": "python"}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 201);
        assert!(
            t.elapsed() < Duration::from_millis(500),
            "the warm context was not used: {:?}",
            t.elapsed()
        );
        let s: Value = r.json().await.unwrap();
        let sid = s["id"].as_str().unwrap();
        assert_eq!(s["cells"], 0);
        // Nothing from anyone else: a fresh interpreter and a fresh disk.
        let r = d
            .req(reqwest::Method::POST, &format!("{sessions}/{sid}/run"))
            .json(&json!({"code": "import os\nprint(sorted(k for k in globals() if not k.startswith('_')), os.path.exists('/tmp/mark'))\nopen('/tmp/mark', 'w').write('x')\nsecret = 1"}))
            .send()
            .await
            .unwrap();
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["stdout"], "['os'] False\n", "create {n}: {v}");
        // A second python session is a new interpreter, not the warm one again.
        let r = d
            .req(reqwest::Method::POST, &sessions)
            .json(&json!({}))
            .send()
            .await
            .unwrap();
        let other: Value = r.json().await.unwrap();
        assert_ne!(other["id"], s["id"]);
        seen.push(id);
    }
    assert_ne!(seen[0], seen[1]);
    assert_eq!(
        metric(&d, "runcell_warm_pool_hits_total{template=\"host\"}").await,
        2.0
    );
    // The pool refills in the background with new sandboxes.
    wait_metric(&d, ready, 2.0).await;
    // Different limits than the pool's are a miss, served by a fresh sandbox.
    let id = d
        .create(json!({"template": "host", "limits": {"memory_mb": 300}}))
        .await;
    assert!(!seen.contains(&id));
    assert_eq!(
        metric(&d, "runcell_warm_pool_misses_total{template=\"host\"}").await,
        1.0
    );
    assert!(
        metric(
            &d,
            "runcell_warm_pool_refill_seconds_count{template=\"host\"}"
        )
        .await
            >= 4.0
    );
    d.delete_all().await;
}

/// Runs `runcell context ...` against `d`, with the code on stdin when given.
fn context_cli(d: &Daemon, args: &[&str], stdin: Option<&str>) -> (i32, String, String) {
    use std::io::Write;
    let mut child = Command::new(env!("CARGO_BIN_EXE_runcell"))
        .arg("context")
        .args(args)
        .env("RUNCELL_URL", &d.url)
        .env("RUNCELL_API_KEY", &d.key)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut input = child.stdin.take().unwrap();
    if let Some(s) = stdin {
        input.write_all(s.as_bytes()).unwrap();
    }
    drop(input);
    let out = child.wait_with_output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test(flavor = "multi_thread")]
async fn the_cli_creates_runs_lists_and_removes_contexts() {
    let data = data_dir("ctxcli");
    let d = Daemon::start(&data, free_port(), &[]);
    let sb = d.create(json!({})).await;
    let (code, out, err) = context_cli(&d, &["create", &sb], None);
    assert_eq!(code, 0, "{err}");
    let ctx = out.trim().to_string();
    assert_eq!(ctx.len(), 16, "{out}");

    let (code, out, _) = context_cli(
        &d,
        &["run", &sb, &ctx, "-c", "x = 6\nprint('hi')\nx * 7"],
        None,
    );
    assert_eq!((code, out.as_str()), (0, "hi\n42\n"));
    // Code from stdin; state persisted; images are described or saved.
    let (code, out, _) = context_cli(&d, &["run", &sb, &ctx], Some("x + 1"));
    assert_eq!((code, out.as_str()), (0, "7\n"));
    let dir = data.join("images");
    std::fs::create_dir_all(&dir).unwrap();
    let plot = "import matplotlib.pyplot as plt\nplt.figure(figsize=(1, 1), dpi=20)\nplt.plot([1, 2]); None";
    let (code, out, err) = context_cli(
        &d,
        &[
            "run",
            &sb,
            &ctx,
            "-c",
            plot,
            "--save-images",
            dir.to_str().unwrap(),
        ],
        None,
    );
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("[image/png saved to"), "{out}");
    assert_eq!(
        &std::fs::read(dir.join("result-1.png")).unwrap()[1..4],
        b"PNG"
    );
    // An exception: traceback on stderr, status 1. A timeout: 124 and the message.
    let (code, _, err) = context_cli(&d, &["run", &sb, &ctx, "-c", "1 / 0"], None);
    assert_eq!(code, 1);
    assert!(err.contains("ZeroDivisionError"), "{err}");
    let (code, _, err) = context_cli(
        &d,
        &[
            "run",
            &sb,
            &ctx,
            "-c",
            "while True: pass",
            "--timeout",
            "1s",
        ],
        None,
    );
    assert_eq!(code, 124);
    assert!(err.contains("timed out after 1s"), "{err}");
    // --json gives the daemon's fields.
    let (_, out, _) = context_cli(&d, &["--json", "run", &sb, &ctx, "-c", "x"], None);
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["results"][0]["text/plain"], "6");

    let (_, out, _) = context_cli(&d, &["ls", &sb], None);
    assert!(out.contains(&ctx) && out.contains("python"), "{out}");
    let (code, _, _) = context_cli(&d, &["restart", &sb, &ctx], None);
    assert_eq!(code, 0);
    let (code, _, _) = context_cli(&d, &["rm", &sb, &ctx], None);
    assert_eq!(code, 0);
    let (code, _, err) = context_cli(&d, &["rm", &sb, &ctx], None);
    assert_eq!(code, 1);
    assert!(err.contains("session not found (HTTP 404)"), "{err}");
    // A daemon that is not there is named plainly.
    let mut child = Command::new(env!("CARGO_BIN_EXE_runcell"))
        .args([
            "context",
            "ls",
            &sb,
            "--url",
            "http://127.0.0.1:9",
            "--api-key",
            "k",
        ])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut err = String::new();
    std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut err).unwrap();
    assert!(!child.wait().unwrap().success());
    assert!(
        err.contains("Could not reach the runcell daemon at http://127.0.0.1:9"),
        "{err}"
    );
    d.delete_all().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn the_rust_client_covers_the_api_against_a_live_daemon() {
    use runcell_client::{Client, ExecOptions};
    use std::collections::BTreeMap;
    let data = data_dir("client");
    let d = Daemon::start(&data, free_port(), &[]);
    let c = Client::new(&d.url, &d.key);
    let meta: BTreeMap<String, String> = [("threadId".to_string(), "t-9".to_string())].into();
    let sb = c
        .create_sandbox(&json!({"metadata": meta, "ttl_seconds": 120}))
        .await
        .unwrap();
    let other = c.create_sandbox(&json!({})).await.unwrap();
    let listed = c.list_sandboxes(&meta).await.unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].id, sb.id);
    assert_eq!(c.list_sandboxes(&BTreeMap::new()).await.unwrap().len(), 2);
    assert_eq!(
        c.get_sandbox(&sb.id).await.unwrap().fields["metadata"]["threadId"],
        "t-9"
    );

    let r = c
        .exec(
            &sb.id,
            "echo out; echo err >&2; exit 3",
            &ExecOptions::default(),
        )
        .await
        .unwrap();
    assert_eq!(
        (r.stdout.as_str(), r.stderr.as_str(), r.exit_code),
        ("out\n", "err\n", 3)
    );
    let opts = ExecOptions {
        timeout: Some(Duration::from_millis(500)),
        ..ExecOptions::default()
    };
    let r = c.exec(&sb.id, "sleep 10", &opts).await.unwrap();
    assert!(r.timed_out && r.exit_code == 124, "{r:?}");

    c.write_file(&sb.id, "/tmp/d/x.bin", vec![0, 1, 2, 255])
        .await
        .unwrap();
    assert_eq!(
        c.read_file(&sb.id, "/tmp/d/x.bin").await.unwrap(),
        vec![0, 1, 2, 255]
    );
    let entries = c.list_dir(&sb.id, "/tmp/d").await.unwrap();
    assert_eq!((entries[0].name.as_str(), entries[0].size), ("x.bin", 4));
    assert!(c.logs(&sb.id).await.unwrap().contains("out\n"));
    let l = c.set_lifecycle(&sb.id, Some(900), None).await.unwrap();
    assert_eq!(l["ttl_seconds"], 900);

    // Errors are typed and worded.
    let e = c.get_sandbox("nope").await.unwrap_err();
    assert_eq!(e.status(), Some(404));
    let e = c.read_file(&sb.id, "/nope").await.unwrap_err();
    assert_eq!(e.status(), Some(404));
    let e = c
        .create_sandbox(&json!({"template": "nope"}))
        .await
        .unwrap_err();
    assert!(
        e.status() == Some(400) && e.to_string().contains("installed templates"),
        "{e}"
    );
    let e = Client::new(&d.url, "bad-key")
        .list_sandboxes(&BTreeMap::new())
        .await
        .unwrap_err();
    assert_eq!(e.status(), Some(401));

    c.delete_sandbox(&sb.id).await.unwrap();
    c.delete_sandbox(&other.id).await.unwrap();
    assert_eq!(
        c.delete_sandbox(&sb.id).await.unwrap_err().status(),
        Some(404)
    );
    d.delete_all().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn the_cli_manages_sandboxes_exec_code_cp_and_logs() {
    let data = data_dir("cli");
    let d = Daemon::start(&data, free_port(), &[]);
    let cli = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_runcell"))
            .args(args)
            .env("RUNCELL_URL", &d.url)
            .env("RUNCELL_API_KEY", &d.key)
            .stdin(Stdio::null())
            .output()
            .unwrap();
        (
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (code, out, err) = cli(&[
        "sandbox",
        "create",
        "--meta",
        "threadId=abc",
        "--ttl",
        "10m",
    ]);
    assert_eq!(code, 0, "{err}");
    let id = out.trim().to_string();
    let (_, other, _) = cli(&["sandbox", "create"]);
    let other = other.trim().to_string();
    // Without a URL flag or key in the environment, the key file the daemon
    // wrote is used (RUNCELL_DATA_DIR points at it).
    let out = Command::new(env!("CARGO_BIN_EXE_runcell"))
        .args(["sandbox", "ls", "--url", &d.url])
        .env_remove("RUNCELL_API_KEY")
        .env("RUNCELL_DATA_DIR", &d.data)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains(&id));

    let (_, out, _) = cli(&["sandbox", "ls", "--meta", "threadId=abc"]);
    assert!(out.contains(&id) && !out.contains(&other), "{out}");
    let (_, out, _) = cli(&["sandbox", "ls", "--json"]);
    assert_eq!(
        serde_json::from_str::<Value>(&out)
            .unwrap()
            .as_array()
            .unwrap()
            .len(),
        2
    );
    let (_, out, _) = cli(&["sandbox", "get", &id, "--json"]);
    assert_eq!(
        serde_json::from_str::<Value>(&out).unwrap()["ttl_seconds"],
        600
    );
    assert_eq!(cli(&["sandbox", "ttl", &id, "30m"]).0, 0);
    let (_, out, _) = cli(&["sandbox", "get", &id, "--json"]);
    assert_eq!(
        serde_json::from_str::<Value>(&out).unwrap()["ttl_seconds"],
        1800
    );

    // One argument after -- is a shell line; more are the program's argv.
    let (code, out, err) = cli(&["exec", &id, "--", "echo hello; echo oops >&2; exit 4"]);
    assert_eq!((code, out.as_str(), err.as_str()), (4, "hello\n", "oops\n"));
    let (code, _, err) = cli(&["exec", "--timeout", "1s", &id, "--", "sleep", "5"]);
    assert_eq!(code, 124);
    assert!(err.contains("timeout"), "{err}");

    // code: one context per language, kept between calls.
    assert_eq!(cli(&["code", &id, "-c", "n = 20"]).0, 0);
    let (code, out, _) = cli(&["code", &id, "-c", "n * 2 + 2"]);
    assert_eq!((code, out.as_str()), (0, "42\n"));
    let (_, out, _) = cli(&["code", &id, "--lang", "javascript", "-c", "typeof n"]);
    assert_eq!(out, "'undefined'\n");

    let local = data.join("local.txt");
    std::fs::write(&local, "from the host\n").unwrap();
    let dst = format!("{id}:/home/user/in.txt");
    assert_eq!(cli(&["cp", local.to_str().unwrap(), &dst]).0, 0);
    let (_, out, _) = cli(&["exec", &id, "--", "cat", "/home/user/in.txt"]);
    assert_eq!(out, "from the host\n");
    let back = data.join("back.txt");
    assert_eq!(cli(&["cp", &dst, back.to_str().unwrap()]).0, 0);
    assert_eq!(std::fs::read_to_string(&back).unwrap(), "from the host\n");
    let (code, _, err) = cli(&["cp", "a", "b"]);
    assert_eq!(code, 2);
    assert!(err.contains("SANDBOX:/absolute/path"), "{err}");

    let (_, out, _) = cli(&["logs", &id]);
    assert!(
        out.contains("hello") && out.contains("from the host"),
        "{out}"
    );
    // logs -f prints what is there and then new lines as they come.
    let mut follow = Command::new(env!("CARGO_BIN_EXE_runcell"))
        .args(["logs", "-f", &id])
        .env("RUNCELL_URL", &d.url)
        .env("RUNCELL_API_KEY", &d.key)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let reader = std::thread::spawn({
        let stdout = follow.stdout.take().unwrap();
        move || {
            use std::io::BufRead;
            std::io::BufReader::new(stdout)
                .lines()
                .map_while(Result::ok)
                .find(|l| l == "late line")
                .is_some()
        }
    });
    std::thread::sleep(Duration::from_millis(300));
    cli(&["exec", &id, "--", "echo", "late", "line"]);
    assert_eq!(cli(&["sandbox", "kill", &id, &other]).0, 0);
    assert!(reader.join().unwrap(), "logs -f did not print the new line");
    let _ = follow.kill();
    let _ = follow.wait();
    let (code, _, err) = cli(&["sandbox", "get", &id]);
    assert_eq!(code, 1);
    // The tombstone says when it ended, still as a 404.
    assert!(
        err.contains(&format!("sandbox {id} was deleted at")) && err.contains("(HTTP 404)"),
        "{err}"
    );
    d.delete_all().await;
}
