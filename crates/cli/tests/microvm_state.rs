//! MicroVM sandboxes that outlive their processes (issue 14), under TCG
//! emulation (this host's KVM cannot run a guest): pause and resume stop
//! and continue the guest (exec answers 409 meanwhile); snapshots and forks
//! carry the guest's writable disk, copy-on-write, and its memory (a code
//! context's variable is in the fork and the snapshot's sandbox, and the
//! source runs on with it); hibernation saves the guest's memory to a file
//! and the wake restores it, so a code context's
//! variables and a background process are still there, also after the
//! daemon was SIGKILLed in between. Deleting leaves nothing behind. Real
//! daemon, real HTTP, real QEMU guests; needs root, QEMU, qemu-img and the
//! microVM kernel (`scripts/microvm-assets.sh`).

mod common;

use common::*;
use reqwest::Method;
use serde_json::{json, Value};

/// The two tests take turns: each boots and saves TCG guests, and on this
/// 2-core machine two at once double every boot.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// A microVM sandbox that lives long enough for the test.
fn vm(extra: Value) -> Value {
    let mut body = json!({
        "template": "host",
        "isolation": "microvm",
        "ttl_seconds": 600,
        "limits": {"memory_mb": 384},
    });
    if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
        b.extend(e.clone());
    }
    body
}

/// Host processes (QEMU) still naming the sandbox's directory.
fn leftovers(data: &std::path::Path, id: &str) -> Vec<String> {
    let needle = data
        .join("sandboxes-microvm")
        .join(id)
        .to_string_lossy()
        .into_owned();
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().parse::<u32>().is_ok())
        .filter_map(|e| std::fs::read(e.path().join("cmdline")).ok())
        .map(|c| String::from_utf8_lossy(&c).replace('\0', " "))
        .filter(|c| c.contains(&needle))
        .collect()
}

fn entries(dir: &std::path::Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread")]
async fn microvms_pause_resume_snapshot_and_fork_their_files_and_memory() {
    let _turn = ONE_AT_A_TIME.lock().await;
    // Deep enough that the VMM's sockets (channel, control, QMP) are
    // reached through the short link (`sun_path` holds 108 bytes).
    let data = data_dir("microvm-state-in-a-deep-data-directory");
    let port = free_port();
    let args = ["--allow-emulation", "--standby", "0"];
    let mut d = Daemon::start(&data, port, &args);
    // What this host was found to do, probed for real.
    let sys: Value = d.get_ok("/v1/system").await;
    let microvm = sys["backends"]
        .as_array()
        .unwrap()
        .iter()
        .find(|b| b["name"] == "microvm")
        .unwrap()
        .clone();
    assert_eq!(
        (
            &microvm["pause"],
            &microvm["save_files"],
            &microvm["save_memory"]
        ),
        (&json!(true), &json!(true), &json!(true)),
        "{microvm}"
    );

    let id = d.create(vm(json!({}))).await;
    let (s, body) = d
        .exec(
            &id,
            "echo kept > ~/f && mkdir -p ~/deep/er && echo d > ~/deep/er/x",
        )
        .await;
    assert_eq!(s, 200, "{body}");

    // Paused: the guest is stopped, work answers 409 by name, and the
    // resumed guest carries on.
    let path = |what: &str| format!("/v1/sandboxes/{id}/{what}");
    assert_eq!(
        d.status(Method::POST, &path("pause"), Some(json!({})))
            .await,
        204
    );
    assert_eq!(d.sandbox(&id).await["status"], "paused");
    let (s, body) = d.exec(&id, "echo no").await;
    assert_eq!(s, 409, "{body}");
    assert!(
        body["error"].as_str().unwrap_or("").contains("paused"),
        "{body}"
    );
    // Its clock stands still while it is stopped; the resume sets it.
    tokio::time::sleep(std::time::Duration::from_secs(3)).await;
    assert_eq!(
        d.status(Method::POST, &path("pause"), Some(json!({})))
            .await,
        409
    );
    assert_eq!(
        d.status(Method::POST, &path("resume"), Some(json!({})))
            .await,
        204
    );
    assert_eq!(d.sandbox(&id).await["status"], "running");
    assert_clock_is_the_hosts(&d, &id).await;
    let (s, body) = d.exec(&id, "cat ~/f").await;
    assert_eq!(
        (s, body["stdout"].as_str()),
        (200, Some("kept\n")),
        "{body}"
    );

    // A snapshot carries the guest's files and memory: the file written
    // just before it is there (the guest flushed its disk first), and so
    // is a code context's variable; the source runs on with both.
    let session = d.create_session(&id, json!({"language": "python"})).await;
    let sid = session["id"].as_str().unwrap().to_string();
    let (s, body) = cell(&d, &id, &sid, "x = 42").await;
    assert_eq!(s, 200, "{body}");
    let (s, body) = d.exec(&id, "echo late > ~/late").await;
    assert_eq!(s, 200, "{body}");
    let t0 = std::time::Instant::now();
    let (s, snap) = d.post(&path("snapshots"), json!({})).await;
    eprintln!("microvm snapshot with memory: {:?}", t0.elapsed());
    assert_eq!(s, 201, "{snap}");
    assert_eq!(snap["memory"], true, "{snap}");
    let (_, body) = cell(&d, &id, &sid, "x += 1\nprint(x)").await;
    assert_eq!(
        body["stdout"], "43\n",
        "the source after its snapshot: {body}"
    );
    // Without limits of its own it takes the source's (the saved guest's).
    let t0 = std::time::Instant::now();
    let from = d
        .create_json(json!({"from_snapshot": snap["id"], "ttl_seconds": 600}))
        .await;
    eprintln!("microvm create from a memory snapshot: {:?}", t0.elapsed());
    assert_eq!(from["isolation"], "microvm", "{from}");
    assert_ne!(from["state_lost"], true, "{from}");
    let from = from["id"].as_str().unwrap().to_string();
    let (_, body) = d.exec(&from, "cat ~/f ~/deep/er/x ~/late").await;
    assert_eq!(body["stdout"], "kept\nd\nlate\n", "{body}");
    let (s, body) = cell(&d, &from, &sid, "print(x)").await;
    assert_eq!((s, &body["stdout"]), (200, &json!("42\n")), "{body}");
    assert_clock_is_the_hosts(&d, &from).await;

    // Its files are disk images: they start microVMs only, said plainly.
    let (s, body) = d
        .post(
            "/v1/sandboxes",
            json!({"from_snapshot": snap["id"], "isolation": "jail"}),
        )
        .await;
    assert_eq!(s, 400, "{body}");
    assert!(
        body["error"].as_str().unwrap_or("").contains("microvm"),
        "{body}"
    );

    // The parent writes on after the snapshot; the snapshot does not change.
    let (s, _) = d.exec(&id, "echo after > ~/after").await;
    assert_eq!(s, 200);

    // A fork starts with the parent's files and memory now and goes its
    // own way.
    let t0 = std::time::Instant::now();
    let (s, fork) = d.post(&path("fork"), json!({})).await;
    eprintln!("microvm fork with memory: {:?}", t0.elapsed());
    assert_eq!(s, 201, "{fork}");
    assert_eq!(fork["memory"], true, "{fork}");
    assert_ne!(fork["state_lost"], true, "{fork}");
    assert_eq!(fork["isolation"], "microvm", "{fork}");
    let child = fork["id"].as_str().unwrap().to_string();
    let (s, body) = cell(&d, &child, &sid, "x += 100\nprint(x)").await;
    assert_eq!((s, &body["stdout"]), (200, &json!("143\n")), "{body}");
    let (_, body) = cell(&d, &id, &sid, "print(x)").await;
    assert_eq!(body["stdout"], "43\n", "the parent after its fork: {body}");
    let (_, body) = d
        .exec(&child, "cat ~/f ~/after && echo mine > ~/child")
        .await;
    assert_eq!(body["stdout"], "kept\nafter\n", "{body}");
    let (_, body) = d.exec(&id, "ls ~").await;
    let listing = body["stdout"].as_str().unwrap();
    assert!(
        !listing.contains("child") && listing.contains("after"),
        "{body}"
    );
    let (_, body) = d.exec(&from, "ls ~").await;
    assert!(
        !body["stdout"].as_str().unwrap().contains("after"),
        "{body}"
    );

    // A restarted daemon finds the guests again and saves them on: the
    // parent's disk has been switched to new overlays twice.
    d.kill9();
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let d = Daemon::start(&data, port, &args);
    let (s, body) = d.exec(&id, "echo again > ~/again").await;
    assert_eq!(s, 200, "{body}");
    let (s, snap2) = d.post(&path("snapshots"), json!({})).await;
    assert_eq!(s, 201, "{snap2}");
    assert_eq!(snap2["memory"], true, "{snap2}");
    let (_, body) = d.exec(&id, "cat ~/f ~/again").await;
    assert_eq!(body["stdout"], "kept\nagain\n", "{body}");
    // A memory image that does not load: the sandbox starts on the
    // snapshot's files and says what it lost.
    let image = data
        .join("snapshot-memory")
        .join(snap2["id"].as_str().unwrap())
        .join("memory");
    std::fs::write(&image, b"not a migration stream").unwrap();
    let lost = d
        .create_json(json!({"from_snapshot": snap2["id"], "ttl_seconds": 600}))
        .await;
    assert_eq!(lost["state_lost"], true, "{lost}");
    let lost = lost["id"].as_str().unwrap().to_string();
    let (_, body) = d.exec(&lost, "cat ~/again").await;
    assert_eq!(body["stdout"], "again\n", "{body}");
    let (s, body) = cell(&d, &lost, &sid, "print(x)").await;
    assert_eq!(s, 404, "no context came with the files: {body}");
    d.delete(&lost).await;
    let snap2_path = format!("/v1/snapshots/{}", snap2["id"].as_str().unwrap());
    assert_eq!(d.status(Method::DELETE, &snap2_path, None).await, 204);

    for s in [&id, &from, &child] {
        d.delete(s).await;
    }
    let snap_path = format!("/v1/snapshots/{}", snap["id"].as_str().unwrap());
    assert_eq!(d.status(Method::DELETE, &snap_path, None).await, 204);
    // Nothing is left: no guest, no sandbox directory, no layer.
    for s in [&id, &from, &child] {
        wait_gone(&data.join("sandboxes-microvm").join(s)).await;
        assert_eq!(leftovers(&data, s), Vec::<String>::new());
    }
    assert_eq!(entries(&data.join("states")), Vec::<String>::new());
    assert_eq!(entries(&data.join("snapshot-memory")), Vec::<String>::new());
}

/// Hibernation of a microVM saves its memory (QEMU's migration to a file):
/// a code context's variables and a background process are still there
/// after the wake, also when the daemon was SIGKILLed and restarted in
/// between, and a second round works as the first.
#[tokio::test(flavor = "multi_thread")]
async fn a_hibernated_microvm_wakes_with_its_memory_even_after_a_sigkill() {
    let _turn = ONE_AT_A_TIME.lock().await;
    let data = data_dir("vm-mem");
    let port = free_port();
    let args = ["--allow-emulation", "--standby", "0"];
    let mut d = Daemon::start(&data, port, &args);
    let id = d.create(vm(json!({"persistent": true}))).await;
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
        let v: Value = r.json().await.unwrap();
        assert_eq!(status, 200, "{v}");
        v
    };
    ok(run(&d, "x = 42")).await;
    let (s, body) = d
        .exec_json(
            &id,
            json!({
                "cmd": "sleep 600 </dev/null >/dev/null 2>&1 & echo $! > ~/bg; echo file > ~/f",
                "background": true,
            }),
        )
        .await;
    assert_eq!(s, 200, "{body}");

    let hibernate = format!("/v1/sandboxes/{id}/hibernate");
    assert_eq!(
        d.status(Method::POST, &hibernate, Some(json!({}))).await,
        204
    );
    assert_eq!(d.sandbox(&id).await["status"], "hibernated");
    assert!(data.join("memory").join(&id).is_dir(), "no memory image");
    // Its guest is gone from the host while it sleeps.
    assert!(!data.join("sandboxes-microvm").join(&id).exists());
    assert_eq!(leftovers(&data, &id), Vec::<String>::new());

    d.kill9();
    tokio::time::sleep(std::time::Duration::from_secs(3)).await;
    let d = Daemon::start(&data, port, &args);
    // A cell wakes it, and the variable is still there.
    let v = ok(run(&d, "print(x)")).await;
    assert_eq!(v["stdout"], "42\n", "{v}");
    let view = d.sandbox(&id).await;
    assert_eq!(
        (&view["status"], &view["isolation"]),
        (&json!("running"), &json!("microvm")),
        "{view}"
    );
    assert_ne!(view["state_lost"], true, "{view}");
    // Its clock was saved with it, a daemon restart ago; the wake set it.
    assert_clock_is_the_hosts(&d, &id).await;
    let (_, body) = d
        .exec(&id, "cat ~/f; kill -0 $(cat ~/bg) && echo alive")
        .await;
    assert_eq!(body["stdout"], "file\nalive\n", "{body}");
    assert!(
        !data.join("memory").join(&id).exists(),
        "the image was kept"
    );

    // Again, with an explicit wake: every restore serves again.
    assert_eq!(
        d.status(Method::POST, &hibernate, Some(json!({}))).await,
        204
    );
    assert_eq!(act(&d, &id, "wake").await, 204);
    let v = ok(run(&d, "x += 1\nprint(x)")).await;
    assert_eq!(v["stdout"], "43\n", "{v}");

    d.delete(&id).await;
    wait_gone(&data.join("sandboxes-microvm").join(&id)).await;
    assert_eq!(leftovers(&data, &id), Vec::<String>::new());
    assert_eq!(entries(&data.join("memory")), Vec::<String>::new());
    assert_eq!(entries(&data.join("states")), Vec::<String>::new());
}

/// The guest's clock reads the host's time (within a second and a half:
/// an exec under TCG takes a while), not the time it stood still at.
async fn assert_clock_is_the_hosts(d: &Daemon, id: &str) {
    let (s, body) = d.exec(id, "date +%s.%N").await;
    assert_eq!(s, 200, "{body}");
    let guest: f64 = body["stdout"].as_str().unwrap().trim().parse().unwrap();
    let host = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    assert!(
        (host - guest).abs() < 1.5,
        "the guest's clock is {:.1} s off the host's",
        host - guest
    );
}
