//! Work in progress is activity: an exec, an exec stream or a code cell that
//! runs longer than the sandbox's idle TTL is not reaped under it, and the
//! idle clock starts when the work ends. Needs root.

mod common;

use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value};

/// Whether the sandbox is still listed.
async fn alive(d: &Daemon, id: &str) -> bool {
    d.status(reqwest::Method::GET, &format!("/v1/sandboxes/{id}"), None)
        .await
        == 200
}

#[tokio::test(flavor = "multi_thread")]
async fn long_work_outlives_the_idle_ttl_and_the_clock_starts_when_it_ends() {
    let data = data_dir("activity");
    let d = Daemon::start(&data, free_port(), &["--warm-pool", "code-interpreter=0"]);

    // An exec three times longer than the TTL.
    let id = d.create(json!({"ttl_seconds": 2})).await;
    let started = Instant::now();
    let (status, body) = d.exec(&id, "sleep 6; echo finished").await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["stdout"], "finished\n", "{body}");
    assert!(started.elapsed() >= Duration::from_secs(6));
    // The idle clock started when the exec ended: still there a second
    // later, gone within TTL + reaper period + slack.
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert!(alive(&d, &id).await, "reaped before its idle TTL ran out");
    let until = Instant::now() + Duration::from_secs(4);
    while alive(&d, &id).await {
        assert!(Instant::now() < until, "not reaped after the work ended");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // A stream three times longer than the TTL ends with its exit event.
    let id = d.create(json!({"ttl_seconds": 2})).await;
    let text = d
        .exec_stream_text(
            &id,
            json!({"cmd": "for i in 1 2 3 4 5 6; do echo tick$i; sleep 1; done"}),
        )
        .await;
    assert!(text.contains("tick6"), "{text}");
    assert!(text.contains("event: exit"), "{text}");
    assert!(text.contains(r#""exit_code":0"#), "{text}");
    assert!(alive(&d, &id).await);
    d.req(reqwest::Method::DELETE, &format!("/v1/sandboxes/{id}"))
        .send()
        .await
        .unwrap();

    // A code cell three times longer than the TTL returns its value, and
    // the context's state is there for the next cell.
    let id = d.create(json!({"ttl_seconds": 2})).await;
    let sessions = format!("/v1/sandboxes/{id}/repl/sessions");
    let s = d.create_session(&id, json!({"language": "python"})).await;
    let sid = s["id"].as_str().unwrap().to_string();
    let run = |code: &str| {
        d.req(reqwest::Method::POST, &format!("{sessions}/{sid}/run"))
            .json(&json!({"code": code, "timeout_ms": 20000}))
    };
    let r = run("import time\ntime.sleep(6)\nx = 41\nx + 1")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert!(v.to_string().contains("42"), "{v}");
    let v: Value = run("x").send().await.unwrap().json().await.unwrap();
    assert!(v.to_string().contains("41"), "{v}");
    d.req(reqwest::Method::DELETE, &format!("/v1/sandboxes/{id}"))
        .send()
        .await
        .unwrap();
    drop(d);
    let _ = std::fs::remove_dir_all(&data);
}

#[tokio::test(flavor = "multi_thread")]
async fn work_does_not_extend_the_maximum_lifetime() {
    let data = data_dir("lifetime");
    let d = Daemon::start(
        &data,
        free_port(),
        &["--warm-pool", "code-interpreter=0", "--max-lifetime", "3s"],
    );
    let id = d.create(json!({"ttl_seconds": 3})).await;
    let started = Instant::now();
    let (status, _) = d.exec(&id, "sleep 20").await;
    // The sandbox is removed at its maximum lifetime, mid-exec.
    assert_ne!(status, 200);
    assert!(started.elapsed() < Duration::from_secs(10));
    let until = Instant::now() + Duration::from_secs(2);
    while alive(&d, &id).await {
        assert!(
            Instant::now() < until,
            "not removed at its maximum lifetime"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    drop(d);
    let _ = std::fs::remove_dir_all(&data);
}
