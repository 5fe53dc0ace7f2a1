//! Churn (issue 15, "Density"): rounds of sandboxes created, used,
//! hibernated and woken, then deleted all at once through the API must
//! leave the daemon holding what it held before: no per-sandbox lock, no
//! task, no queued teardown. Read from the daemon's own gauges in
//! `/metrics` (bounded structures, not its RSS, which the allocator
//! decides). Needs root.

mod common;
use common::*;

use std::time::{Duration, Instant};

use futures_util::future::join_all;
use serde_json::json;

const ROUNDS: usize = 3;
/// More than the daemon's concurrent teardowns (8), so deletes queue.
const PER_ROUND: usize = 12;

/// The daemon's own gauges once its teardowns are done: (tasks, locks).
async fn settled(d: &Daemon) -> (f64, f64) {
    let until = Instant::now() + Duration::from_secs(30);
    loop {
        let text = d.metrics().await;
        let gauge = |name: &str| {
            metric_value(&text, &format!("{name} "))
                .unwrap_or_else(|| panic!("{name} is missing from /metrics:\n{text}"))
        };
        let (teardowns, tasks, locks) = (
            gauge("runcell_sandbox_teardowns"),
            gauge("runcell_daemon_tasks"),
            gauge("runcell_daemon_sandbox_locks"),
        );
        if teardowns == 0.0 {
            return (tasks, locks);
        }
        assert!(
            Instant::now() < until,
            "{teardowns} teardowns still pending after 30 s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn churn_leaves_no_per_sandbox_state_in_the_daemon() {
    let data = data_dir("churn");
    let mut d = Daemon::start(
        &data,
        free_port(),
        &["--warm-pool", "code-interpreter=0", "--max-sandboxes", "32"],
    );
    // One round trip first, so the baseline has the pool refilled.
    let warm = d.create(json!({})).await;
    ok(&d, &warm, "true").await;
    d.delete(&warm).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let (tasks_before, locks_before) = settled(&d).await;
    assert_eq!(locks_before, 0.0);

    for round in 0..ROUNDS {
        let mut ids = Vec::new();
        for _ in 0..PER_ROUND {
            let id = d.create(json!({"persistent": true})).await;
            ok(&d, &id, "echo kept > ~/f").await;
            ids.push(id);
        }
        // Half of them hibernate and wake: each takes the sandbox's lock.
        for id in ids.iter().step_by(2) {
            assert_eq!(act(&d, id, "hibernate").await, 204, "hibernate {id}");
            assert_eq!(act(&d, id, "wake").await, 204, "wake {id}");
            assert_eq!(ok(&d, id, "cat ~/f").await.trim(), "kept");
        }
        // All deleted at once: the teardowns queue behind their slots.
        join_all(ids.iter().map(|id| d.delete(id))).await;

        // A lock left per sandbox would be 6 more each round; a task left
        // per sandbox 12. Two tasks of slack: a connection of the client
        // that is still closing, a standby refill that is still running.
        let until = Instant::now() + Duration::from_secs(15);
        loop {
            let (tasks, locks) = settled(&d).await;
            if locks == 0.0 && tasks <= tasks_before + 2.0 {
                break;
            }
            assert!(
                Instant::now() < until,
                "after round {round} the daemon still holds {locks} sandbox locks and \
                 {tasks} tasks (before: {tasks_before} tasks)"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    let listed: Vec<serde_json::Value> = d.get("/v1/sandboxes").await;
    assert!(listed.is_empty(), "sandboxes still listed: {listed:?}");
    d.stop();
    let _ = std::fs::remove_dir_all(&data);
}
