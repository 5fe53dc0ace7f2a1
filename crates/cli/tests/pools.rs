//! Warm pools of `runcell serve`: each pooled sandbox is handed out once with
//! a ready code context, and the pool refills. Needs root.

mod common;

use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value};

/// The value of a metric sample line, e.g. `runcell_warm_pool_ready{template="host"}`.
async fn metric(d: &Daemon, sample: &str) -> f64 {
    let text = d.metrics().await;
    metric_value(&text, sample).unwrap_or_else(|| panic!("no sample {sample} in:\n{text}"))
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
        let listed: Vec<Value> = d.get(&sessions).await;
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
        let (_, v) = d.post(&format!("{sessions}/{sid}/run"), json!({"code": "import os\nprint(sorted(k for k in globals() if not k.startswith('_')), os.path.exists('/tmp/mark'))\nopen('/tmp/mark', 'w').write('x')\nsecret = 1"})).await;
        assert_eq!(v["stdout"], "['os'] False\n", "create {n}: {v}");
        // A second python session is a new interpreter, not the warm one again.
        let (_, other) = d.post(&sessions, json!({})).await;
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
