//! Choosing the isolation per sandbox and reporting what the host can run
//! (issue 13): `isolation` on create, shown by GET and list and kept across
//! a restart; a backend the host cannot run is a 400 that says why; a
//! default the host cannot run stops `serve` at start-up; `GET /v1/system`
//! reports the host's layers and every backend. Over HTTP against a real
//! daemon. Needs root.

mod common;
use common::*;

use reqwest::Method;
use serde_json::{json, Value};

#[tokio::test(flavor = "multi_thread")]
async fn isolation_is_chosen_per_sandbox_shown_and_kept_across_a_restart() {
    let data = data_dir("isolation-choice");
    let port = free_port();
    let mut d = Daemon::start(&data, port, &[]);

    // What the host enforces and runs.
    let sys: Value = d.get_ok("/v1/system").await;
    let layers: Vec<&str> = sys["layers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        layers,
        [
            "user_namespaces",
            "seccomp",
            "landlock",
            "cgroups",
            "oom_kill_reporting",
            "kvm"
        ],
        "{sys}"
    );
    // The kernel's Landlock ABI (the agent applies it: crates/core/tests/isolation.rs).
    assert!(sys["landlock_abi"].as_u64().unwrap() >= 1, "{sys}");
    let jail = &sys["backends"][0];
    assert_eq!(
        (&jail["name"], &jail["available"], &jail["default"]),
        (&json!("jail"), &json!(true), &json!(true)),
        "{sys}"
    );
    assert!(
        jail["detail"].as_str().unwrap().contains("Landlock"),
        "{sys}"
    );
    assert_eq!(sys["default_isolation"], "jail");
    for b in sys["backends"].as_array().unwrap() {
        assert!(!b["detail"].as_str().unwrap().is_empty(), "{b}");
    }
    // Without --allow-emulation this host (no usable KVM) cannot run a
    // microVM, and says so.
    let microvm = &sys["backends"][2];
    assert_eq!(microvm["name"], "microvm");
    assert_eq!(microvm["available"], false, "{sys}");

    // The default, and an explicit jail.
    let a = d.create_json(json!({"template": "host"})).await;
    assert_eq!(a["isolation"], "jail", "{a}");
    let b = d
        .create_json(json!({"template": "host", "isolation": "jail"}))
        .await;
    assert_eq!(b["isolation"], "jail", "{b}");
    let b_id = b["id"].as_str().unwrap().to_string();
    assert_eq!(d.sandbox(&b_id).await["isolation"], "jail");
    let list: Value = d.get_ok("/v1/sandboxes").await;
    assert!(
        list.as_array()
            .unwrap()
            .iter()
            .all(|s| s["isolation"] == "jail"),
        "{list}"
    );

    // A name that is not a backend, and a backend this host cannot run.
    expect_error(
        d.req(Method::POST, "/v1/sandboxes")
            .json(&json!({"template": "host", "isolation": "docker"})),
        400,
        "isolation",
    )
    .await;
    // Hostile values: a NUL, another type, and a huge name, which is not
    // echoed back whole.
    for bad in [json!("jail\u{0}"), json!(5), json!(["jail"])] {
        expect_error(
            d.req(Method::POST, "/v1/sandboxes")
                .json(&json!({"template": "host", "isolation": bad})),
            400,
            "",
        )
        .await;
    }
    let huge = "g".repeat(1 << 20);
    let r = d
        .req(Method::POST, "/v1/sandboxes")
        .json(&json!({"template": "host", "isolation": huge}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let body = r.text().await.unwrap();
    assert!(
        body.len() < 1024 && body.contains("isolation"),
        "{}",
        &body[..body.len().min(2000)]
    );
    let r = d
        .req(Method::POST, "/v1/sandboxes")
        .json(&json!({"template": "host", "isolation": "microvm"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let body: Value = r.json().await.unwrap();
    let msg = body["error"].as_str().unwrap();
    assert!(
        msg.contains("isolation") && msg.contains("microvm"),
        "the refusal must say what and why: {body}"
    );
    // The refusal made nothing.
    let list: Value = d.get_ok("/v1/sandboxes").await;
    assert_eq!(list.as_array().unwrap().len(), 2, "{list}");

    // gVisor runs here (CI installs runsc): the same API, another kernel.
    let gv = &sys["backends"][1];
    assert_eq!(
        (&gv["name"], &gv["available"]),
        (&json!("gvisor"), &json!(true)),
        "{sys}"
    );
    let g = d
        .create_json(json!({"template": "host", "isolation": "gvisor"}))
        .await;
    assert_eq!(g["isolation"], "gvisor", "{g}");
    let g_id = g["id"].as_str().unwrap().to_string();
    let (code, body) = d
        .exec(&g_id, "/usr/bin/python3 -c 'print(6*7)'; uname -r")
        .await;
    assert_eq!(code, 200, "{body}");
    let out = body["stdout"].as_str().unwrap();
    assert!(out.starts_with("42\n"), "{body}");
    // gVisor's own kernel answers, not the host's.
    let host = nix::sys::utsname::uname().unwrap();
    let host_release = host.release().to_string_lossy();
    assert!(
        !out.contains(host_release.as_ref()),
        "the host kernel answered: {body}"
    );
    d.delete(&g_id).await;

    // The CLI shows it.
    let (code, out, err) = runcell_cli(&d, &["sandbox", "get", &b_id]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("Isolation") && out.contains("jail"), "{out}");

    // Kept across a restart (re-attached by its backend).
    d.kill9();
    let d = Daemon::start(&data, port, &[]);
    assert_eq!(d.sandbox(&b_id).await["isolation"], "jail");
    let (code, body) = d.exec(&b_id, "echo still here").await;
    assert_eq!((code, body["stdout"].as_str()), (200, Some("still here\n")));
    d.delete_all().await;
}

#[test]
fn a_default_isolation_the_host_cannot_run_stops_serve_at_start_up() {
    require_root("isolation");
    let data = data_dir("isolation-default");
    let out = std::process::Command::new(RUNCELL)
        .args(["serve", "--layer-store", "tmpfs", "--listen"])
        .arg(format!("127.0.0.1:{}", free_port()))
        .arg("--data-dir")
        .arg(&data)
        .args([
            "--auto-build=false",
            "--standby",
            "0",
            "--default-isolation",
            "microvm",
        ])
        .output()
        .unwrap();
    // A start that fails leaves nothing mounted (the sandboxes' tmpfs).
    let left_mounted = is_mount_point(&data.join("sandboxes"));
    if !left_mounted {
        let _ = std::fs::remove_dir_all(&data);
    }
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "serve started: {err}");
    assert!(
        err.contains("default isolation") && err.contains("microvm"),
        "the refusal must name the setting and why: {err}"
    );
    assert!(
        !left_mounted,
        "the failed start left {}/sandboxes mounted",
        data.display()
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_microvm_runs_behind_the_same_api_when_emulation_is_allowed() {
    let data = data_dir("isolation-microvm");
    let d = Daemon::start(&data, free_port(), &["--allow-emulation", "--standby", "0"]);
    let sys: Value = d.get_ok("/v1/system").await;
    let vm = &sys["backends"][2];
    assert_eq!(
        (&vm["name"], &vm["available"]),
        (&json!("microvm"), &json!(true)),
        "{sys}"
    );
    let created = d
        .create_json(
            json!({"template": "host", "isolation": "microvm", "limits": {"memory_mb": 384}}),
        )
        .await;
    assert_eq!(created["isolation"], "microvm", "{created}");
    let id = created["id"].as_str().unwrap().to_string();
    let (code, body) = d
        .exec(&id, "uname -r; /usr/bin/python3 -c 'print(6*7)'")
        .await;
    assert_eq!(code, 200, "{body}");
    let out = body["stdout"].as_str().unwrap();
    // The guest's own kernel (Debian's cloud kernel), not the host's.
    assert!(
        out.contains("cloud-amd64") && out.ends_with("42\n"),
        "{body}"
    );
    d.delete(&id).await;
}

/// A gVisor sandbox pauses and resumes (saving files: `gvisor_state.rs`;
/// volumes: `gvisor_volumes.rs`).
#[tokio::test(flavor = "multi_thread")]
async fn gvisor_sandboxes_pause_and_resume() {
    let data = data_dir("iso-state");
    let d = Daemon::start(&data, free_port(), &[]);
    let id = d.create(json!({"isolation": "gvisor"})).await;
    // Pausing works: the host's freezer stops the sentry and its gofer.
    assert_eq!(d.exec(&id, "echo before > /tmp/p").await.0, 200);
    assert_eq!(act(&d, &id, "pause").await, 204);
    assert_eq!(d.sandbox(&id).await["status"], "paused");
    assert_eq!(d.exec(&id, "true").await.0, 409);
    assert_eq!(act(&d, &id, "resume").await, 204);
    let (s, body) = d.exec(&id, "cat /tmp/p").await;
    assert_eq!(
        (s, body["stdout"].as_str()),
        (200, Some("before\n")),
        "{body}"
    );
    // It still runs.
    assert_eq!(d.exec(&id, "true").await.0, 200);
    d.delete(&id).await;
}
