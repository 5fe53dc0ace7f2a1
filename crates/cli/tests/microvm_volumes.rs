//! Volumes in microVM sandboxes (virtio-fs, one `virtiofsd` per volume on
//! an idmapped bind of the volume), under TCG emulation: a microVM writes
//! a volume with the same owners on the volume's disk as a jail sandbox
//! (`host_base + uid`); it snapshots and hibernates its files only
//! (`memory: false`) and wakes with the volume mounted again; a jail
//! sandbox after it reads and appends; a read-only microVM reads that and
//! cannot write (`EROFS`, refused by the host's mount its `virtiofsd`
//! serves); deleting leaves no `virtiofsd` and no mount behind. Real
//! daemon, real HTTP, real QEMU guests; needs root, QEMU, `virtiofsd`
//! (`qemu-system-common`) and the microVM kernel with its fuse and
//! virtiofs modules (`scripts/microvm-assets.sh`).

mod common;

use std::path::Path;

use common::*;
use reqwest::Method;
use serde_json::{json, Value};

/// A microVM sandbox with `volumes` that lives long enough for the test.
fn vm(volumes: Value) -> Value {
    json!({
        "template": "host",
        "isolation": "microvm",
        "ttl_seconds": 600,
        "limits": {"memory_mb": 256},
        "volumes": volumes,
    })
}

/// Live host processes (QEMU, virtiofsd) naming the sandbox's directory
/// or its short link: (pid, command line).
fn processes_of(data: &Path, id: &str) -> Vec<(u32, String)> {
    let dir = data
        .join("sandboxes-microvm")
        .join(id)
        .to_string_lossy()
        .into_owned();
    let link = format!("/run/runcell/vm-links/{id}/");
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| Some((e.file_name().to_string_lossy().parse::<u32>().ok()?, e)))
        .filter(|(_, e)| {
            std::fs::read_to_string(e.path().join("stat"))
                .ok()
                .and_then(|s| s.rsplit_once(')').map(|(_, r)| !r.trim().starts_with('Z')))
                .unwrap_or(false)
        })
        .filter_map(|(pid, e)| {
            let c = std::fs::read(e.path().join("cmdline")).ok()?;
            Some((pid, String::from_utf8_lossy(&c).replace('\0', " ")))
        })
        .filter(|(_, c)| c.contains(&dir) || c.contains(&link))
        .collect()
}

/// The `virtiofsd` processes of the sandbox.
fn virtiofsds(data: &Path, id: &str) -> Vec<u32> {
    processes_of(data, id)
        .into_iter()
        .filter(|(_, c)| c.contains("virtiofsd"))
        .map(|(pid, _)| pid)
        .collect()
}

/// Deletes `id` and checks that nothing of it is left on the host: its
/// directory, its QEMU and virtiofsd processes, its mounts.
async fn delete_leaving_nothing(d: &Daemon, data: &Path, id: &str) {
    d.delete(id).await;
    wait_gone(&data.join("sandboxes-microvm").join(id)).await;
    let t0 = std::time::Instant::now();
    while !processes_of(data, id).is_empty() && t0.elapsed().as_secs() < 5 {
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert_eq!(processes_of(data, id), Vec::new(), "{id}: processes left");
    assert_eq!(
        mounts_mentioning(id),
        Vec::<String>::new(),
        "{id}: mounts left"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn microvms_share_volumes_with_jail_sandboxes_with_the_same_owners() {
    let t_all = std::time::Instant::now();
    let data = data_dir("microvm-volumes");
    let port = free_port();
    let args = ["--allow-emulation", "--standby", "0"];
    let mut d = Daemon::start(&data, port, &args);
    let (s, body) = d
        .post("/v1/volumes", json!({"name": "shared", "size_mb": 8}))
        .await;
    assert_eq!(s, 201, "{body}");
    let on_host = volume_on_host(&data);
    let data_str = data.display().to_string();
    let mounts_before = mounts_mentioning(&data_str);

    // A microVM writer: its own kernel, and its files are its user's
    // inside and a jail sandbox user's on the volume's disk.
    let t0 = std::time::Instant::now();
    let a = d.create(vm(json!([{"name": "shared"}]))).await;
    eprintln!("microvm with a volume ready in {:?}", t0.elapsed());
    assert!(ok(&d, &a, "uname -r").await.contains("cloud"));
    let out = ok(
        &d,
        &a,
        "echo vm-1 > /mnt/shared/f && mkdir /mnt/shared/from-vm \
         && echo y > /mnt/shared/from-vm/y && echo home > ~/marker \
         && id -u && stat -c '%u:%g' /mnt/shared/f",
    )
    .await;
    assert_eq!(out, "1000\n1000:1000\n");
    for p in ["f", "from-vm", "from-vm/y"] {
        assert_eq!(
            owner(&on_host.join(p)),
            (HOST_BASE + 1000, HOST_BASE + 1000),
            "{p} on the volume's disk"
        );
    }
    // Served by a virtiofsd of its own; the daemon's copy of the bind is
    // gone once the guest mounted it (the virtiofsd holds its own).
    assert!(
        !virtiofsds(&data, &a).is_empty(),
        "{:?}",
        processes_of(&data, &a)
    );
    assert_eq!(mounts_mentioning(&a), Vec::<String>::new());

    // One writer at a time, whatever the isolation of the second.
    let (s, body) = d
        .post(
            "/v1/sandboxes",
            json!({"isolation": "jail", "volumes": [{"name": "shared"}]}),
        )
        .await;
    assert_eq!(s, 409, "{body}");

    // Saves carry its files only: QEMU cannot migrate a guest with
    // virtio-fs devices.
    let (s, snap) = d
        .post(&format!("/v1/sandboxes/{a}/snapshots"), json!({}))
        .await;
    assert_eq!(s, 201, "{snap}");
    assert_eq!(snap["memory"], false, "{snap}");
    assert_eq!(ok(&d, &a, "cat /mnt/shared/f").await, "vm-1\n");
    assert_eq!(act(&d, &a, "hibernate").await, 204);
    assert_eq!(d.sandbox(&a).await["status"], "hibernated");
    assert!(!data.join("memory").join(&a).exists(), "a memory image");
    assert_eq!(processes_of(&data, &a), Vec::new());
    // The wake boots it on its files, with the volume mounted again.
    let t0 = std::time::Instant::now();
    assert_eq!(
        ok(&d, &a, "cat ~/marker /mnt/shared/from-vm/y").await,
        "home\ny\n"
    );
    eprintln!(
        "wake of a microvm with a volume to its first exec: {:?}",
        t0.elapsed()
    );
    assert_eq!(d.sandbox(&a).await["state_lost"], true);
    assert!(!virtiofsds(&data, &a).is_empty());
    delete_leaving_nothing(&d, &data, &a).await;
    let snap_path = format!("/v1/snapshots/{}", snap["id"].as_str().unwrap());
    assert_eq!(d.status(Method::DELETE, &snap_path, None).await, 204);

    // A jail sandbox after it reads and appends.
    let j = d
        .create(json!({"isolation": "jail", "volumes": [{"name": "shared"}]}))
        .await;
    assert_eq!(
        ok(
            &d,
            &j,
            "cat /mnt/shared/f && echo jail-2 >> /mnt/shared/f \
             && echo j >> /mnt/shared/from-vm/y && stat -c '%u:%g' /mnt/shared/from-vm/y"
        )
        .await,
        "vm-1\n1000:1000\n"
    );
    d.delete(&j).await;

    // A read-only microVM reads that, at the path it asked for, and
    // cannot write: the host's mount its virtiofsd serves refuses.
    let t0 = std::time::Instant::now();
    let r = d
        .create(vm(
            json!([{"name": "shared", "read_only": true, "path": "/data"}]),
        ))
        .await;
    eprintln!(
        "read-only microvm with a volume ready in {:?}",
        t0.elapsed()
    );
    assert_eq!(
        ok(&d, &r, "cat /data/f /data/from-vm/y").await,
        "vm-1\njail-2\ny\nj\n"
    );
    assert_cannot_write(&d, &r, "/data", &on_host).await;
    let fs = virtiofsds(&data, &r);
    let host_ro = fs.iter().any(|pid| {
        std::fs::read_to_string(format!("/proc/{pid}/mountinfo"))
            .unwrap_or_default()
            .lines()
            .any(|l| {
                let f: Vec<&str> = l.split(' ').collect();
                f.len() > 5 && f[4] == "/" && f[5].starts_with("ro,") && l.contains("idmapped")
            })
    });
    assert!(host_ro, "no read-only idmapped root among virtiofsd {fs:?}");

    // Its virtiofsd outlives a SIGKILL of the daemon, as its QEMU does:
    // the restarted daemon re-attaches the guest, which reads on, and its
    // delete still leaves nothing behind.
    d.kill9();
    let d = Daemon::start(&data, port, &args);
    assert_eq!(ok(&d, &r, "cat /data/f").await, "vm-1\njail-2\n");
    assert_eq!(virtiofsds(&data, &r), fs);
    delete_leaving_nothing(&d, &data, &r).await;

    assert_eq!(mounts_mentioning(&data_str), mounts_before);
    assert_eq!(
        d.status(Method::DELETE, "/v1/volumes/shared", None).await,
        204
    );
    eprintln!("microvm volumes test: {:?}", t_all.elapsed());
}
