//! A client that goes away stops its work: when the HTTP client of an exec
//! or an exec stream hangs up or aborts (an SDK's AbortSignal, a client
//! timeout, a killed agent process), the exec's processes are killed, as
//! after a timeout, instead of running on unseen until their own timeout.
//! Over HTTP against a real daemon. Needs root.

mod common;
use common::*;

use std::time::{Duration, Instant};

use reqwest::Method;
use serde_json::json;

/// Waits until the process whose pid the exec wrote to `pidfile` is gone;
/// panics with `what` after 10 s.
async fn wait_process_gone(d: &Daemon, id: &str, pidfile: &str, what: &str) {
    let until = Instant::now() + Duration::from_secs(10);
    loop {
        let (code, r) = d
            .exec(
                id,
                &format!("kill -0 $(cat {pidfile}) 2>/dev/null && echo alive || echo gone"),
            )
            .await;
        assert_eq!(code, 200, "{r}");
        if r["stdout"] == "gone\n" {
            return;
        }
        assert!(
            Instant::now() < until,
            "{what}: the exec's process still runs 10 s after its client went away"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn an_exec_whose_client_goes_away_is_killed() {
    let d = Daemon::start(
        &data_dir("client-gone"),
        free_port(),
        &["--warm-pool", "code-interpreter=0"],
    );
    let id = d.create(json!({"template": "host"})).await;

    // A plain exec whose client gives up after 1 s.
    let r = d
        .req(Method::POST, &format!("/v1/sandboxes/{id}/exec"))
        .timeout(Duration::from_secs(1))
        .json(&json!({"cmd": "echo $$ > /tmp/plain.pid; exec sleep 60", "timeout_seconds": 120}))
        .send()
        .await;
    assert!(
        r.is_err(),
        "the exec answered before the client's timeout: {r:?}"
    );
    wait_process_gone(&d, &id, "/tmp/plain.pid", "exec").await;

    // An exec stream whose client reads the first event and hangs up.
    let mut resp = d
        .req(Method::POST, &format!("/v1/sandboxes/{id}/exec/stream"))
        .json(&json!({"cmd": "echo $$ > /tmp/stream.pid; echo started; exec sleep 60", "timeout_seconds": 120}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let first = resp.chunk().await.unwrap().expect("an event");
    assert!(
        String::from_utf8_lossy(&first).contains("started"),
        "{first:?}"
    );
    drop(resp);
    wait_process_gone(&d, &id, "/tmp/stream.pid", "exec stream").await;

    // The sandbox itself is fine, and an exec that is read to the end runs to the end.
    let (code, r) = d.exec(&id, "sleep 1; echo done").await;
    assert_eq!((code, r["stdout"].as_str()), (200, Some("done\n")), "{r}");
    d.delete_all().await;
}
