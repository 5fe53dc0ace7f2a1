//! Sandboxes that outlive their processes, across a SIGKILL of the daemon:
//! a snapshot, a paused, a hibernated sandbox and a volume are all there
//! after a restart, and nothing a fork or snapshot was making is left
//! half-made. Real daemon, real HTTP; needs root.

mod common;

use std::time::Duration;

use common::*;
use serde_json::{json, Value};

/// The daemon's own default layer store (`auto`: btrfs on the test hosts),
/// named because the test harness defaults to tmpfs.
const AUTO: &[&str] = &["--layer-store", "auto"];

#[tokio::test(flavor = "multi_thread")]
async fn snapshots_paused_hibernated_sandboxes_and_volumes_survive_a_sigkill() {
    let data = data_dir("persist");
    let port = free_port();
    let mut d = Daemon::start(&data, port, AUTO);

    let (s, vol) = d
        .post("/v1/volumes", json!({"name": "keep", "size_mb": 16}))
        .await;
    assert_eq!(s, 201, "{vol}");
    let with_vol = d
        .create(json!({"volumes": [{"name": "keep"}], "ttl_seconds": 600}))
        .await;
    let (s, body) = d.exec(&with_vol, "echo on-volume > /mnt/keep/f").await;
    assert_eq!(s, 200, "{body}");

    let (source, snap_id) = snapshotted_source(&d).await;

    let paused = d.create(json!({"ttl_seconds": 600})).await;
    assert_eq!(d.exec(&paused, "echo p > ~/p").await.0, 200);
    assert_eq!(act(&d, &paused, "pause").await, 204);

    let sleeper = d
        .create(json!({"ttl_seconds": 600, "persistent": true}))
        .await;
    assert_eq!(d.exec(&sleeper, "echo h > ~/h").await.0, 200);
    assert_eq!(act(&d, &sleeper, "hibernate").await, 204);

    // What a killed daemon was copying: a layer no record names.
    let half = data.join("states/l-00000000-0000-0000-0000-00000000dead");
    std::fs::create_dir_all(half.join("root/home")).unwrap();
    d.kill9();
    tokio::time::sleep(Duration::from_millis(500)).await;

    let d = Daemon::start(&data, port, AUTO).remove_data_on_drop();
    assert!(!half.exists(), "a half-made layer was left");
    // The snapshot is listed and starts sandboxes.
    let list: Value = d.get("/v1/snapshots").await;
    assert_eq!(list["snapshots"][0]["id"], snap_id.as_str(), "{list}");
    let restored = d.create(json!({"from_snapshot": snap_id})).await;
    let (_, body) = d.exec(&restored, "cat ~/s").await;
    assert_eq!(body["stdout"], "snap\n", "{body}");
    // The paused one is still paused (work is refused), and resumes.
    assert_eq!(d.sandbox(&paused).await["status"], "paused");
    assert_eq!(d.exec(&paused, "true").await.0, 409);
    assert_eq!(act(&d, &paused, "resume").await, 204);
    let (_, body) = d.exec(&paused, "cat ~/p").await;
    assert_eq!(body["stdout"], "p\n", "{body}");
    // The hibernated one wakes with its files.
    assert_eq!(d.sandbox(&sleeper).await["status"], "hibernated");
    let (s, body) = d.exec(&sleeper, "cat ~/h").await;
    assert_eq!((s, body["stdout"].as_str()), (200, Some("h\n")), "{body}");
    // The volume kept its data, and the sandbox that had it still has it.
    let (_, body) = d.exec(&with_vol, "cat /mnt/keep/f").await;
    assert_eq!(body["stdout"], "on-volume\n", "{body}");
    let v: Value = d.get("/v1/volumes/keep").await;
    assert_eq!(v["attached_to"], json!([with_vol]), "{v}");

    for id in [&with_vol, &source, &restored, &paused, &sleeper] {
        d.delete(id).await;
    }
    delete_ok(&d, "/v1/volumes/keep").await;
    delete_ok(&d, &format!("/v1/snapshots/{snap_id}")).await;
    // Nothing is left on disk of any of it once the sandboxes are gone.
    for id in [&with_vol, &source, &restored, &paused, &sleeper] {
        wait_gone(&data.join("sandboxes").join(id)).await;
    }
    // (Saved with btrfs, layers are in the store's states/; copies in
    // states/.) The store's subvolumes go in the background.
    let until = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let layers: Vec<_> = ["states", "store/states"]
            .iter()
            .flat_map(|dir| std::fs::read_dir(data.join(dir)).into_iter().flatten())
            .flatten()
            .map(|e| e.file_name())
            .collect();
        if layers.is_empty() {
            break;
        }
        assert!(std::time::Instant::now() < until, "layers left: {layers:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let volumes: Vec<_> = std::fs::read_dir(data.join("volumes"))
        .map(|d| d.flatten().map(|e| e.file_name()).collect())
        .unwrap_or_default();
    assert!(volumes.is_empty(), "volume files left: {volumes:?}");
}

/// Another workspace's key gets a 404 for a paused, a hibernated and a
/// running sandbox alike, on every route of issue 14, and never wakes,
/// resumes, snapshots or forks it; its snapshots and volumes are invisible.
#[tokio::test(flavor = "multi_thread")]
async fn another_workspace_cannot_touch_saved_state() {
    let data = data_dir("persist-tenancy");
    let d = Daemon::start(&data, free_port(), AUTO).remove_data_on_drop();
    let other = key_cmd(&data, &["create", "--workspace", "team-b", "--name", "t"])
        .trim()
        .to_string();
    let running = d.create(json!({})).await;
    let paused = d.create(json!({})).await;
    let asleep = d.create(json!({"persistent": true})).await;
    for (id, op) in [(&paused, "pause"), (&asleep, "hibernate")] {
        let path = format!("/v1/sandboxes/{id}/{op}");
        let s = d
            .status(reqwest::Method::POST, &path, Some(json!({})))
            .await;
        assert_eq!(s, 204, "{path}");
    }
    let (s, snap) = d
        .post(&format!("/v1/sandboxes/{running}/snapshots"), json!({}))
        .await;
    assert_eq!(s, 201, "{snap}");
    let (s, _) = d
        .post("/v1/volumes", json!({"name": "mine", "size_mb": 8}))
        .await;
    assert_eq!(s, 201);
    for id in [&running, &paused, &asleep] {
        for (method, path) in [
            (reqwest::Method::GET, format!("/v1/sandboxes/{id}")),
            (reqwest::Method::POST, format!("/v1/sandboxes/{id}/exec")),
            (
                reqwest::Method::GET,
                format!("/v1/sandboxes/{id}/fs?path=/etc/passwd"),
            ),
            (reqwest::Method::POST, format!("/v1/sandboxes/{id}/pause")),
            (reqwest::Method::POST, format!("/v1/sandboxes/{id}/resume")),
            (reqwest::Method::POST, format!("/v1/sandboxes/{id}/wake")),
            (
                reqwest::Method::POST,
                format!("/v1/sandboxes/{id}/hibernate"),
            ),
            (
                reqwest::Method::POST,
                format!("/v1/sandboxes/{id}/snapshots"),
            ),
            (reqwest::Method::POST, format!("/v1/sandboxes/{id}/fork")),
            (reqwest::Method::POST, format!("/v1/sandboxes/{id}/promote")),
            (reqwest::Method::DELETE, format!("/v1/sandboxes/{id}")),
        ] {
            let body = if path.ends_with("/exec") {
                json!({"cmd": "true"})
            } else {
                json!({})
            };
            let r = d
                .req_as(&other, method.clone(), &path)
                .json(&body)
                .send()
                .await
                .unwrap();
            assert_eq!(
                r.status(),
                404,
                "{method} {path} with another workspace's key"
            );
        }
    }
    // Nothing changed for the owner.
    assert_eq!(d.sandbox(&paused).await["status"], "paused");
    assert_eq!(d.sandbox(&asleep).await["status"], "hibernated");
    assert_eq!(d.sandbox(&running).await["status"], "running");
    let snaps: Value = d.get_as(&other, "/v1/snapshots").await;
    assert_eq!(snaps["snapshots"], json!([]));
    let id = snap["id"].as_str().unwrap();
    let r = d
        .req_as(&other, reqwest::Method::GET, &format!("/v1/snapshots/{id}"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    let r = d
        .req_as(&other, reqwest::Method::POST, "/v1/sandboxes")
        .json(&json!({"from_snapshot": id}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    let vols: Value = d.get_as(&other, "/v1/volumes").await;
    assert_eq!(vols["items"], json!([]));
    let r = d
        .req_as(&other, reqwest::Method::POST, "/v1/sandboxes")
        .json(&json!({"volumes": [{"name": "mine"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(
        r.status(),
        400,
        "another workspace's volume is unknown to it"
    );
    for id in [&running, &paused, &asleep] {
        d.delete(id).await;
    }
    delete_ok(&d, "/v1/volumes/mine").await;
}
