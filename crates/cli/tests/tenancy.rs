//! What one tenant can do to the others and what the daemon keeps about
//! them: per-workspace quotas, tombstones that say why a sandbox ended, and
//! a registry only the daemon's user can read. Needs root.

mod common;

use std::time::Duration;

use common::*;
use serde_json::{json, Value};

/// Creates a sandbox with `key`; returns the status and body.
async fn create_as(d: &Daemon, key: &str, body: Value) -> (u16, Value) {
    let r = d
        .req_as(key, reqwest::Method::POST, "/v1/sandboxes")
        .json(&body)
        .send()
        .await
        .unwrap();
    (r.status().as_u16(), r.json().await.unwrap())
}

#[tokio::test(flavor = "multi_thread")]
async fn one_workspace_cannot_take_every_slot() {
    let data = data_dir("quota");
    let d = Daemon::start(
        &data,
        free_port(),
        &[
            "--standby",
            "0",
            "--warm-pool",
            "code-interpreter=0",
            "--max-sandboxes",
            "4",
            "--workspace-max-memory",
            "1G",
        ],
    );
    let other = new_key(&data, "team-b");
    // By default a workspace may hold all but one in sixteen (at least one)
    // of the daemon's slots: 3 of 4 here.
    let mut mine = Vec::new();
    for _ in 0..3 {
        let (s, b) = create_as(&d, &d.key, json!({"limits": {"memory_mb": 256}})).await;
        assert_eq!(s, 201, "{b}");
        mine.push(b["id"].as_str().unwrap().to_string());
    }
    let r = d
        .req(reqwest::Method::POST, "/v1/sandboxes")
        .json(&json!({"limits": {"memory_mb": 256}}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 429);
    assert_eq!(r.headers()["retry-after"], "5");
    let b: Value = r.json().await.unwrap();
    assert!(
        b["error"].as_str().unwrap().contains("workspace quota"),
        "{b}"
    );
    // The other workspace still gets the last slot.
    let (s, b) = create_as(&d, &other, json!({})).await;
    assert_eq!(s, 201, "{b}");
    let theirs = b["id"].as_str().unwrap().to_string();

    // The memory quota counts the limits of live sandboxes: with 2 x 256 MiB
    // held, 768 MiB more would exceed 1 GiB even with a free slot.
    d.req(
        reqwest::Method::DELETE,
        &format!("/v1/sandboxes/{}", mine[0]),
    )
    .send()
    .await
    .unwrap();
    let (s, b) = create_as(&d, &d.key, json!({"limits": {"memory_mb": 768}})).await;
    assert_eq!(s, 429, "{b}");
    assert!(b["error"].as_str().unwrap().contains("memory"), "{b}");
    let (s, b) = create_as(&d, &d.key, json!({"limits": {"memory_mb": 256}})).await;
    assert_eq!(s, 201, "{b}");

    d.delete_all().await;
    d.req_as(
        &other,
        reqwest::Method::DELETE,
        &format!("/v1/sandboxes/{theirs}"),
    )
    .send()
    .await
    .unwrap();
    drop(d);
    let _ = std::fs::remove_dir_all(&data);
}

/// A sandbox being removed is never answered as unknown: a client that no
/// longer finds it live finds why it ended. Raced with a client asking as
/// fast as it can while the sandbox is deleted.
#[tokio::test(flavor = "multi_thread")]
async fn a_sandbox_being_deleted_is_never_answered_as_unknown() {
    let data = data_dir("tomb-race");
    let d = Daemon::start(&data, free_port(), &["--warm-pool", "code-interpreter=0"]);
    for round in 0..20 {
        let id = d.create(json!({})).await;
        let path = format!("/v1/sandboxes/{id}");
        let poll = async {
            loop {
                let r = d.req(reqwest::Method::GET, &path).send().await.unwrap();
                if r.status() == 404 {
                    return r.json::<Value>().await.unwrap();
                }
            }
        };
        let delete = async {
            tokio::time::sleep(Duration::from_millis(5)).await;
            d.req(reqwest::Method::DELETE, &path).send().await.unwrap()
        };
        let (body, deleted) = tokio::join!(poll, delete);
        assert_eq!(deleted.status(), 204, "round {round}");
        assert_eq!(
            body["end_reason"], "deleted by the API",
            "round {round}: {body}"
        );
    }
    drop(d);
    let _ = std::fs::remove_dir_all(&data);
}

#[tokio::test(flavor = "multi_thread")]
async fn an_ended_sandbox_says_why_and_when_to_its_owner_only() {
    let data = data_dir("tomb");
    let d = Daemon::start(&data, free_port(), &["--warm-pool", "code-interpreter=0"]);
    let other = new_key(&data, "team-b");
    let id = d
        .create(json!({"ttl_seconds": 1, "env": {"API_TOKEN": "tok-5ecret-77"}}))
        .await;
    let body = ended_answer(&d, &id, Duration::from_secs(5)).await;
    let msg = body["error"].as_str().unwrap();
    assert!(
        msg.starts_with(&format!("sandbox {id} expired after 1 s idle at 20")),
        "{body}"
    );
    assert_eq!(body["end_reason"], "idle ttl expired");
    // exec and files say the same, still as a 404 (the SDKs' NotFoundError).
    let (s, b) = d.exec(&id, "true").await;
    assert_eq!((s, b["error"].as_str()), (404, Some(msg)));
    // Another workspace learns nothing.
    let r = d
        .req_as(&other, reqwest::Method::GET, &format!("/v1/sandboxes/{id}"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    let b: Value = r.json().await.unwrap();
    assert_eq!(b, json!({"error": "sandbox not found"}));

    let id = d.create(json!({})).await;
    d.req(reqwest::Method::DELETE, &format!("/v1/sandboxes/{id}"))
        .send()
        .await
        .unwrap();
    let b: Value = d.get(&format!("/v1/sandboxes/{id}")).await;
    assert!(
        b["error"]
            .as_str()
            .unwrap()
            .starts_with(&format!("sandbox {id} was deleted at 20")),
        "{b}"
    );

    // The registry and its journal are the daemon's alone, and an ended
    // sandbox's environment (the caller's secrets) is not kept.
    use std::os::unix::fs::PermissionsExt;
    for f in [
        "registry.db",
        "registry.db-wal",
        "registry.db-shm",
        "api-key",
    ] {
        let mode = std::fs::metadata(data.join(f))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o077, 0, "{f} is readable by others: {mode:o}");
    }
    drop(d);
    let mut stored = std::fs::read(data.join("registry.db")).unwrap();
    stored.extend(std::fs::read(data.join("registry.db-wal")).unwrap_or_default());
    let needle = b"tok-5ecret-77";
    assert!(
        !stored.windows(needle.len()).any(|w| w == needle),
        "an ended sandbox's secret is still in the registry files"
    );
    let _ = std::fs::remove_dir_all(&data);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_standby_sandbox_takes_a_larger_memory_limit_than_it_was_prepared_with() {
    let data = data_dir("memraise");
    let d = Daemon::start(
        &data,
        free_port(),
        &["--standby", "1", "--warm-pool", "code-interpreter=0"],
    );
    // The standby was prepared with the 1 GiB default; cgroup v1 refuses a
    // memory limit above memory+swap, so raising must write memsw first.
    for mb in [1537, 2048, 64] {
        let (s, b) = create_as(&d, &d.key, json!({"limits": {"memory_mb": mb}})).await;
        assert_eq!(s, 201, "memory_mb {mb}: {b}");
        assert_eq!(b["limits"]["memory_mb"], mb, "{b}");
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    d.delete_all().await;
    drop(d);
    let _ = std::fs::remove_dir_all(&data);
}
