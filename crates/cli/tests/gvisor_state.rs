//! gVisor sandboxes that outlive their processes: snapshots, forks and
//! hibernation carry their files (the host-side writable layer), and
//! deleting them leaves nothing behind. Real daemon, real HTTP; needs root
//! and runsc.

mod common;

use common::*;
use reqwest::Method;
use serde_json::json;

#[tokio::test(flavor = "multi_thread")]
async fn gvisor_sandboxes_snapshot_fork_and_hibernate_their_files() {
    let data = data_dir("gv-state");
    let d = Daemon::start(&data, free_port(), &[]);
    let id = d
        .create(json!({"isolation": "gvisor", "ttl_seconds": 600, "persistent": true}))
        .await;
    let (s, body) = d
        .exec(&id, "echo kept > ~/f && mkdir -p ~/deep/er && echo d > ~/deep/er/x")
        .await;
    assert_eq!(s, 200, "{body}");

    // A snapshot starts gVisor sandboxes with its files.
    let (s, snap) = d
        .post(&format!("/v1/sandboxes/{id}/snapshots"), json!({}))
        .await;
    assert_eq!(s, 201, "{snap}");
    assert_eq!(snap["memory"], false, "{snap}");
    let from = d
        .create_json(json!({"from_snapshot": snap["id"], "ttl_seconds": 600}))
        .await;
    assert_eq!(from["isolation"], "gvisor", "{from}");
    let from = from["id"].as_str().unwrap().to_string();
    let (_, body) = d.exec(&from, "cat ~/f ~/deep/er/x").await;
    assert_eq!(body["stdout"], "kept\nd\n", "{body}");

    // A fork starts with the parent's files and then goes its own way.
    let (s, fork) = d.post(&format!("/v1/sandboxes/{id}/fork"), json!({})).await;
    assert_eq!(s, 201, "{fork}");
    assert_eq!(fork["memory"], false, "{fork}");
    let child = fork["id"].as_str().unwrap().to_string();
    let (_, body) = d.exec(&child, "cat ~/f && echo mine > ~/child").await;
    assert_eq!(body["stdout"], "kept\n", "{body}");
    let (_, body) = d.exec(&id, "ls ~").await;
    assert!(!body["stdout"].as_str().unwrap().contains("child"), "{body}");

    // Hibernation keeps the files; the next call wakes it.
    assert_eq!(
        d.status(
            Method::POST,
            &format!("/v1/sandboxes/{id}/hibernate"),
            Some(json!({}))
        )
        .await,
        204
    );
    assert_eq!(d.sandbox(&id).await["status"], "hibernated");
    let (s, body) = d.exec(&id, "cat ~/f").await;
    assert_eq!((s, body["stdout"].as_str()), (200, Some("kept\n")), "{body}");
    assert_eq!(d.sandbox(&id).await["isolation"], "gvisor");

    for s in [&id, &from, &child] {
        d.delete(s).await;
    }
    let snap_path = format!("/v1/snapshots/{}", snap["id"].as_str().unwrap());
    assert_eq!(d.status(Method::DELETE, &snap_path, None).await, 204);
    // Nothing is left: no sandbox directory (runsc's state, mounts), no layer.
    for s in [&id, &from, &child] {
        wait_gone(&data.join("sandboxes-gvisor").join(s)).await;
    }
    let layers: Vec<_> = std::fs::read_dir(data.join("states"))
        .map(|d| d.flatten().map(|e| e.file_name()).collect())
        .unwrap_or_default();
    assert!(layers.is_empty(), "layers left: {layers:?}");
}
