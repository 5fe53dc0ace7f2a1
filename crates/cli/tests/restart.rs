//! `runcell serve` restarts over real HTTP: a SIGKILLed daemon re-attaches
//! its sandboxes, reaps expired ones and cleans orphans; a SIGTERMed one lets
//! running requests finish; config files and flags. Needs root.

mod common;

use std::process::Command;
use std::time::Duration;

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
    assert_eq!(
        d.status(
            reqwest::Method::GET,
            &format!("/v1/sandboxes/{expire}"),
            None
        )
        .await,
        404
    );
    assert!(!data.join("sandboxes").join(&expire).exists());
    assert!(!orphan.exists(), "the orphan directory was not removed");
    // Metadata filters see it.
    let list: Vec<Value> = d.get("/v1/sandboxes?metadata.threadId=t1").await;
    assert_eq!(list.len(), 1);
    assert_eq!(list[0]["id"], keep.as_str());
    d.delete(&keep).await;
    wait_gone(&data.join("sandboxes").join(&keep)).await;
    drop(d);
    let _ = std::fs::remove_dir_all(&data);
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
    let got: Value = d.get(&format!("/v1/sandboxes/{id}")).await;
    assert_eq!(got["ttl_seconds"], 420, "{got}");
    assert_eq!(got["limits"]["timeout_seconds"], 9.0, "{got}");
    d.create(json!({})).await;
    assert_eq!(
        d.status(reqwest::Method::POST, "/v1/sandboxes", Some(json!({})))
            .await,
        503
    );

    // SIGTERM during an exec: the exec finishes, then the daemon exits.
    let req = d
        .req(reqwest::Method::POST, &format!("/v1/sandboxes/{id}/exec"))
        .json(&json!({"cmd": "sleep 1; echo done"}));
    let running =
        tokio::spawn(async move { req.send().await.unwrap().json::<Value>().await.unwrap() });
    tokio::time::sleep(Duration::from_millis(300)).await;
    d.sigterm();
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

/// Live (not zombie) host processes in sandbox `id`'s cgroups.
fn live_processes_of(id: &str) -> Vec<i32> {
    host_processes()
        .into_iter()
        .filter(|p| p.in_cgroup_of(id) && p.state != 'Z')
        .map(|p| p.pid)
        .collect()
}

/// The idle TTL holds with no daemon at all: the agent is started with its
/// deadline (the idle TTL plus the daemon's 30 s grace), so a sandbox whose
/// daemon was SIGKILLed right after creating it, and never came back, ends
/// by itself: not before its TTL and the grace, and soon after them.
#[tokio::test(flavor = "multi_thread")]
async fn a_sandbox_ends_by_itself_after_its_ttl_when_its_daemon_is_gone() {
    let data = data_dir("agent-deadline");
    let port = free_port();
    let mut d = Daemon::start(&data, port, &[]);
    let id = d.create(json!({"ttl_seconds": 2})).await;
    let created = std::time::Instant::now();
    d.kill9();
    assert!(
        !live_processes_of(&id).is_empty(),
        "the sandbox's processes were not found"
    );
    // Past its TTL, within the grace the agent leaves a daemon to reap it.
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert!(
        !live_processes_of(&id).is_empty(),
        "the sandbox ended within the agent's grace"
    );
    // The TTL plus the grace: the agent stops the sandbox.
    let until = created + Duration::from_secs(2 + 30 + 15);
    while !live_processes_of(&id).is_empty() {
        assert!(
            std::time::Instant::now() < until,
            "the sandbox outlived its TTL and the grace by 15 s: {:?}",
            live_processes_of(&id)
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    assert!(
        created.elapsed() >= Duration::from_secs(2 + 30 - 1),
        "the sandbox ended {:?} after it was made, before its TTL and grace",
        created.elapsed()
    );
    // A daemon started again finds it ended and removes what is left.
    drop(d);
    let d = Daemon::start(&data, port, &[]);
    assert_eq!(
        d.status(reqwest::Method::GET, &format!("/v1/sandboxes/{id}"), None)
            .await,
        404
    );
    wait_gone(&data.join("sandboxes").join(&id)).await;
    drop(d);
    let _ = std::fs::remove_dir_all(&data);
}
