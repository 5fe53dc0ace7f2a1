//! The btrfs layer store (`runcell serve --layer-store btrfs`): each
//! sandbox writes to its own subvolume, and a snapshot, fork or
//! hibernation is a read-only subvolume snapshot of it. Real daemon, real
//! HTTP, a real loop-mounted btrfs image; needs root and mkfs.btrfs
//! (scripts/install-deps.sh installs btrfs-progs).

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value};

fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// Waits (up to 10 s) until `dir` holds exactly `want`.
async fn wait_names(dir: &Path, want: &[&str]) {
    let until = Instant::now() + Duration::from_secs(10);
    loop {
        let have = names(dir);
        if have == want {
            return;
        }
        assert!(
            Instant::now() < until,
            "{} holds {have:?}, not {want:?}",
            dir.display()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn btrfs_saves_are_snapshots_forks_are_private_and_nothing_is_left() {
    require_root("the btrfs layer store");
    assert!(
        Path::new("/usr/sbin/mkfs.btrfs").exists() || Path::new("/sbin/mkfs.btrfs").exists(),
        "mkfs.btrfs is missing: scripts/install-deps.sh installs btrfs-progs"
    );
    let data = data_dir("btrfs-store");
    let port = free_port();
    let args = ["--layer-store", "btrfs"];
    let mut d = Daemon::start(&data, port, &args);
    let store = data.join("store");

    let system: Value = d.get("/v1/system").await;
    assert_eq!(system["layer_store"]["kind"], "btrfs", "{system}");
    assert_eq!(system["layer_store"]["copy_on_write"], true, "{system}");

    // A sandbox's writable layer is its own subvolume.
    let parent = d
        .create(json!({"ttl_seconds": 600, "limits": {"disk_mb": 128}}))
        .await;
    assert!(names(&store.join("stages")).contains(&parent));
    let (s, body) = d
        .exec(
            &parent,
            "echo base > ~/base && mkdir -p /tmp/d && head -c 40000000 /dev/urandom > /tmp/d/big && sync",
        )
        .await;
    assert_eq!(s, 200, "{body}");

    // A snapshot of 40 MB is a subvolume snapshot: no copy.
    let t = Instant::now();
    let (s, snap) = d
        .post(&format!("/v1/sandboxes/{parent}/snapshots"), json!({}))
        .await;
    let took = t.elapsed();
    assert_eq!(s, 201, "{snap}");
    assert!(
        took < Duration::from_millis(1000),
        "a snapshot took {took:?}"
    );
    assert!(
        snap["size_bytes"].as_u64().unwrap() >= 40_000_000,
        "the snapshot's size is what the sandbox wrote: {snap}"
    );
    let snap_id = snap["id"].as_str().unwrap().to_string();

    // Three forks share one layer; what each writes is its own.
    let (s, tree) = d
        .post(
            &format!("/v1/sandboxes/{parent}/fork-tree"),
            json!({"count": 3}),
        )
        .await;
    assert_eq!(s, 201, "{tree}");
    let kids: Vec<String> = tree["children"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["id"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(kids.len(), 3, "{tree}");
    for (i, kid) in kids.iter().enumerate() {
        let (s, body) = d
            .exec(
                kid,
                &format!("cat ~/base && cmp -s /tmp/d/big /tmp/d/big && echo {i} > ~/mine && rm /tmp/d/big"),
            )
            .await;
        assert_eq!(
            (s, body["stdout"].as_str()),
            (200, Some("base\n")),
            "{body}"
        );
    }
    for (i, kid) in kids.iter().enumerate() {
        let (_, body) = d.exec(kid, "cat ~/mine; ls /tmp/d").await;
        assert_eq!(body["stdout"], format!("{i}\n"), "{body}");
    }
    let (_, body) = d
        .exec(&parent, "ls ~; test -f /tmp/d/big && echo kept")
        .await;
    assert_eq!(body["stdout"], "base\nkept\n", "{body}");

    // The disk limit is the subvolume's qgroup limit, reported by name,
    // and the sandbox recovers once it deletes.
    let small = d
        .create(json!({"ttl_seconds": 600, "limits": {"disk_mb": 32}}))
        .await;
    let (_, body) = d
        .exec(&small, "head -c 64000000 /dev/zero > /tmp/fill; echo rc=$?")
        .await;
    let out = format!("{}{}", body["stdout"], body["stderr"]);
    assert!(out.contains("Disk quota exceeded"), "{body}");
    let messages = body["messages"].to_string();
    assert!(
        messages.contains("disk is full") && messages.contains("32 MiB"),
        "{body}"
    );
    assert!(!messages.contains("as many files"), "{body}");
    let r = d
        .req(
            reqwest::Method::PUT,
            &format!("/v1/sandboxes/{small}/fs?path=/tmp/more"),
        )
        .body(vec![b'x'; 2 << 20])
        .send()
        .await
        .unwrap();
    let s = r.status().as_u16();
    let err = r.text().await.unwrap();
    assert_eq!(s, 507, "a write beyond the limit: {err}");
    let (_, body) = d
        .exec(
            &small,
            "rm /tmp/fill && echo ok > /tmp/after && cat /tmp/after",
        )
        .await;
    assert_eq!(body["stdout"], "ok\n", "{body}");

    // Sandboxed code gets no btrfs ioctl: a subvolume of its own would
    // escape its stage's limit (and the host's snapshots of it).
    let (_, body) = d
        .exec(
            &small,
            "btrfs subvolume create /tmp/sv; echo rc=$?; test -e /tmp/sv && echo made",
        )
        .await;
    let out = format!("{}{}", body["stdout"], body["stderr"]);
    assert!(
        out.contains("rc=1") && out.contains("Operation not permitted") && !out.contains("made"),
        "{body}"
    );

    // Hibernation saves a snapshot; the sandbox's stage goes.
    let sleeper = d
        .create(json!({"ttl_seconds": 600, "persistent": true}))
        .await;
    assert_eq!(d.exec(&sleeper, "echo zz > ~/h").await.0, 200);
    assert_eq!(act(&d, &sleeper, "hibernate").await, 204);
    assert!(!names(&store.join("stages")).contains(&sleeper));

    // What a killed daemon left: a stage with no sandbox, a snapshot no
    // record names.
    let orphan_stage = store.join("stages/0rphan-stage");
    let half = store.join("states/l-00000000-0000-0000-0000-00000000dead");
    for p in [&orphan_stage, &half] {
        let ok = std::process::Command::new("btrfs")
            .args(["-q", "subvolume", "create"])
            .arg(p)
            .status()
            .unwrap()
            .success();
        assert!(ok, "could not make {}", p.display());
    }
    d.kill9();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let d = Daemon::start(&data, port, &args);
    assert!(!orphan_stage.exists(), "an orphan stage was left");
    assert!(!half.exists(), "a half-made layer was left");
    // Live sandboxes kept their stages and files; the hibernated one wakes.
    let (_, body) = d.exec(&kids[1], "cat ~/mine").await;
    assert_eq!(body["stdout"], "1\n", "{body}");
    // A re-attached sandbox saves as before (its stage is in its state file).
    let (s, grandkid) = d
        .post(&format!("/v1/sandboxes/{}/fork", kids[1]), json!({}))
        .await;
    assert_eq!(s, 201, "{grandkid}");
    let grandkid = grandkid["id"].as_str().unwrap().to_string();
    let (_, body) = d.exec(&grandkid, "cat ~/mine ~/base").await;
    assert_eq!(body["stdout"], "1\nbase\n", "{body}");
    let (s, body) = d.exec(&sleeper, "cat ~/h").await;
    assert_eq!((s, body["stdout"].as_str()), (200, Some("zz\n")), "{body}");
    let restored = d.create(json!({"from_snapshot": snap_id})).await;
    let (_, body) = d.exec(&restored, "cat ~/base && wc -c < /tmp/d/big").await;
    assert_eq!(body["stdout"], "base\n40000000\n", "{body}");
    // A re-attached sandbox's disk limit is still reported by name (the
    // daemon finds its stage's qgroup again).
    let (_, body) = d
        .exec(&small, "head -c 64000000 /dev/zero > /tmp/fill; echo rc=$?")
        .await;
    let messages = body["messages"].to_string();
    assert!(
        messages.contains("disk is full") && messages.contains("32 MiB"),
        "{body}"
    );

    // Nothing is left once everything is deleted.
    let all = [&parent, &small, &sleeper, &restored, &grandkid]
        .into_iter()
        .chain(kids.iter())
        .cloned()
        .collect::<Vec<_>>();
    for id in &all {
        d.delete(id).await;
    }
    delete_ok(&d, &format!("/v1/snapshots/{snap_id}")).await;
    for id in &all {
        wait_gone(&data.join("sandboxes").join(id)).await;
    }
    // (The stages left are the standbys': sandboxes prepared ahead.)
    let stages = names(&store.join("stages"));
    assert!(!all.iter().any(|id| stages.contains(id)), "{stages:?}");
    wait_names(&store.join("states"), &[]).await;

    // With no sandbox left, a graceful stop unmounts the store and frees
    // its loop device; the image stays for the next start.
    drop(d);
    assert!(
        !is_mount_point(&store),
        "{} is still mounted",
        store.display()
    );
    wait_no_loop(&data.join("store.img")).await;
    std::fs::remove_dir_all(&data).unwrap();
}

/// The loop devices backing `image` (`losetup -j`).
fn loop_devices(image: &Path) -> Vec<String> {
    let out = std::process::Command::new("losetup")
        .arg("-j")
        .arg(image)
        .output()
        .expect("losetup (util-linux) runs");
    assert!(out.status.success(), "{out:?}");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_string)
        .collect()
}

/// Waits (up to 5 s) until no loop device backs `image` (autoclear frees
/// it once the last reference goes).
async fn wait_no_loop(image: &Path) {
    let until = Instant::now() + Duration::from_secs(5);
    loop {
        let left = loop_devices(image);
        if left.is_empty() {
            return;
        }
        assert!(Instant::now() < until, "loop devices left: {left:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The store's count of transaction commits (`commit_stats` in sysfs, found
/// through the loop device that backs `image`).
fn store_commits(image: &Path) -> u64 {
    let dev = loop_devices(image)
        .first()
        .and_then(|l| l.split(':').next())
        .and_then(|d| d.strip_prefix("/dev/"))
        .map(str::to_string)
        .expect("a loop device backs the store");
    let fs = std::fs::read_dir("/sys/fs/btrfs")
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .find(|p| p.join("devices").join(&dev).exists())
        .expect("the store's btrfs in sysfs");
    let stats = std::fs::read_to_string(fs.join("commit_stats")).unwrap();
    stats
        .lines()
        .find_map(|l| l.strip_prefix("commits "))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("no commit count in {stats}"))
}

/// Ending a sandbox does not commit the transaction of the store every
/// sandbox shares: its overlays are mounted `volatile`, so their unmount
/// syncs nothing (it was a commit per sandbox, about 3 ms of CPU each),
/// while a snapshot still holds everything written before it.
#[tokio::test(flavor = "multi_thread")]
async fn ending_sandboxes_does_not_commit_the_shared_store() {
    require_root("the btrfs layer store");
    let data = data_dir("btrfs-commits");
    let d = Daemon::start(&data, free_port(), &["--layer-store", "btrfs"]);
    let image = data.join("store.img");
    // The standby pool is full and the start's own writes committed.
    let warm = d.create(json!({"ttl_seconds": 600})).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let before = store_commits(&image);
    let ended = 8;
    for i in 0..ended {
        let id = d.create(json!({"ttl_seconds": 600})).await;
        let (s, body) = d.exec(&id, &format!("echo {i} > ~/f && cat ~/f")).await;
        assert_eq!(
            (s, body["stdout"].clone()),
            (200, json!(format!("{i}\n"))),
            "{body}"
        );
        d.delete(&id).await;
        wait_gone(&data.join("sandboxes").join(&id)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let commits = store_commits(&image) - before;
    // The file system's own periodic commit (every 30 s) may fall in.
    assert!(
        commits <= 2,
        "{ended} sandboxes ended with {commits} commits of the store"
    );

    // Nothing is lost to a save for it: a snapshot of a sandbox that just
    // wrote, restored, has every byte.
    let (s, body) = d
        .exec(
            &warm,
            "head -c 5000000 /dev/urandom > ~/big && md5sum < ~/big",
        )
        .await;
    assert_eq!(s, 200, "{body}");
    let sum = body["stdout"].as_str().unwrap().to_string();
    let (s, snap) = d
        .post(&format!("/v1/sandboxes/{warm}/snapshots"), json!({}))
        .await;
    assert_eq!(s, 201, "{snap}");
    let restored = d
        .create(json!({"from_snapshot": snap["id"], "ttl_seconds": 600}))
        .await;
    let (_, body) = d.exec(&restored, "md5sum < ~/big").await;
    assert_eq!(body["stdout"].as_str(), Some(sum.as_str()), "{body}");
    for id in [&warm, &restored] {
        d.delete(id).await;
    }
    delete_ok(
        &d,
        &format!("/v1/snapshots/{}", snap["id"].as_str().unwrap()),
    )
    .await;
    drop(d);
    wait_no_loop(&image).await;
    std::fs::remove_dir_all(&data).unwrap();
}

/// `runcell serve` on its built-in defaults (`--layer-store auto`) gets the
/// btrfs store here (the test host has btrfs and mkfs.btrfs), and what it
/// costs the host is dealt with: a graceful stop with no live sandbox
/// unmounts the store and the volumes and frees their loop devices, a stop
/// with one keeps them for the sandbox, a SIGKILLed daemon's mount is re-used; hibernated
/// sandboxes, snapshots and volumes survive every kind of restart.
#[tokio::test(flavor = "multi_thread")]
async fn default_store_is_btrfs_released_on_a_graceful_stop_and_nothing_is_lost() {
    require_root("the btrfs layer store");
    let data = data_dir("auto-store");
    let port = free_port();
    let store = data.join("store");
    let image = data.join("store.img");
    // The daemon's own default: no --layer-store at all.
    let start = || Daemon::spawn(Path::new(RUNCELL), &data, port, ["--auto-build=false"]);
    let mut d = start();

    let system: Value = d.get("/v1/system").await;
    assert_eq!(system["layer_store"]["kind"], "btrfs", "{system}");
    assert_eq!(system["layer_store"]["copy_on_write"], true, "{system}");
    let reason = system["layer_store"]["reason"].as_str().unwrap_or_default();
    assert!(
        reason.starts_with("auto:") && reason.contains("mkfs.btrfs"),
        "{system}"
    );
    assert!(is_mount_point(&store));
    assert_eq!(loop_devices(&image).len(), 1);
    // The sandboxes' own directories (sockets, logs, mount points) are on
    // a tmpfs of the daemon's, with the same lifetime rules as the store.
    let sandboxes = data.join("sandboxes");
    let on_tmpfs = |p: &Path| {
        nix::sys::statfs::statfs(p)
            .is_ok_and(|s| s.filesystem_type() == nix::sys::statfs::TMPFS_MAGIC)
    };
    assert!(is_mount_point(&sandboxes) && on_tmpfs(&sandboxes));

    // A hibernated sandbox, a snapshot and a volume with data on it.
    let sleeper = d
        .create(json!({"ttl_seconds": 600, "persistent": true}))
        .await;
    assert_eq!(d.exec(&sleeper, "echo zz > ~/h").await.0, 200);
    assert_eq!(act(&d, &sleeper, "hibernate").await, 204);
    let (source, snap_id) = snapshotted_source(&d).await;
    d.delete(&source).await;
    let (s, vol) = d
        .post("/v1/volumes", json!({"name": "keep", "size_mb": 16}))
        .await;
    assert_eq!(s, 201, "{vol}");
    let writer = d
        .create(json!({"volumes": [{"name": "keep"}], "ttl_seconds": 600}))
        .await;
    assert_eq!(d.exec(&writer, "echo vol > /mnt/keep/f").await.0, 200);
    d.delete(&writer).await;
    // The volume's image and its mount point on the host.
    let volume_file = |ext: &str| {
        std::fs::read_dir(data.join("volumes"))
            .unwrap()
            .map(|e| e.unwrap().path())
            .find(|p| p.extension().is_some_and(|x| x == ext))
            .unwrap()
    };
    let (vol_image, vol_mount) = (volume_file("img"), volume_file("mnt"));
    assert!(is_mount_point(&vol_mount));

    // A live sandbox keeps the store mounted through a graceful stop (its
    // mount namespace holds it), and the next start re-attaches it.
    let live = d.create(json!({"ttl_seconds": 600})).await;
    assert_eq!(d.exec(&live, "echo alive > ~/l").await.0, 200);
    d.stop();
    assert!(is_mount_point(&store), "unmounted under a live sandbox");
    assert!(
        is_mount_point(&sandboxes),
        "the sandboxes' tmpfs went under a live sandbox"
    );
    assert!(sandboxes.join(&live).join("agent.sock").exists());
    assert!(
        is_mount_point(&vol_mount),
        "a volume unmounted under a live sandbox"
    );
    drop(d);
    let mut d = start();
    assert_eq!(loop_devices(&image).len(), 1, "a second loop device");
    let (_, body) = d.exec(&live, "cat ~/l").await;
    assert_eq!(body["stdout"], "alive\n", "{body}");
    d.delete(&live).await;
    wait_gone(&data.join("sandboxes").join(&live)).await;

    // No live sandbox: a graceful stop unmounts the store and frees its
    // loop device; the image stays.
    d.stop();
    assert!(!is_mount_point(&store), "the store is still mounted");
    assert!(
        !is_mount_point(&sandboxes),
        "the sandboxes' tmpfs is still mounted"
    );
    wait_no_loop(&image).await;
    assert!(image.exists());
    // And so are the volumes, as the store: nothing of the daemon's stays
    // mounted on the host once it is stopped with nothing live.
    assert!(!is_mount_point(&vol_mount), "a volume is still mounted");
    wait_no_loop(&vol_image).await;
    drop(d);

    // The next start mounts it again; nothing was lost.
    let mut d = start();
    assert!(is_mount_point(&store));
    assert_eq!(loop_devices(&image).len(), 1);
    assert_eq!(d.sandbox(&sleeper).await["status"], "hibernated");
    let (s, body) = d.exec(&sleeper, "cat ~/h").await;
    assert_eq!((s, body["stdout"].as_str()), (200, Some("zz\n")), "{body}");
    let restored = d.create(json!({"from_snapshot": snap_id})).await;
    let (_, body) = d.exec(&restored, "cat ~/s").await;
    assert_eq!(body["stdout"], "snap\n", "{body}");
    let reader = d
        .create(json!({"volumes": [{"name": "keep"}], "ttl_seconds": 600}))
        .await;
    let (_, body) = d.exec(&reader, "cat /mnt/keep/f").await;
    assert_eq!(body["stdout"], "vol\n", "{body}");

    // A SIGKILLed daemon leaves the store mounted; the next start uses
    // that mount (no second loop device) and its sandboxes go on.
    d.kill9();
    assert!(is_mount_point(&store));
    drop(d);
    let d = start();
    assert_eq!(loop_devices(&image).len(), 1, "a second loop device");
    let (_, body) = d.exec(&restored, "cat ~/s").await;
    assert_eq!(body["stdout"], "snap\n", "{body}");

    for id in [&sleeper, &restored, &reader] {
        d.delete(id).await;
    }
    delete_ok(&d, &format!("/v1/snapshots/{snap_id}")).await;
    delete_ok(&d, "/v1/volumes/keep").await;
    for id in [&sleeper, &restored, &reader] {
        wait_gone(&data.join("sandboxes").join(id)).await;
    }
    // Dropping it stops it gracefully: nothing mounted, no loop device.
    drop(d.remove_data_on_drop());
    assert!(!is_mount_point(&store));
    wait_no_loop(&image).await;
    assert!(!data.exists(), "the data directory was left");
}

/// Starts `runcell serve` on a data directory with the store already made,
/// with its log (`RUNCELL_LOG=info`) and stdout as lines on a channel.
fn serve_with_output(data: &Path) -> (std::process::Child, std::sync::mpsc::Receiver<String>) {
    use std::io::BufRead as _;
    use std::process::Stdio;
    let mut child = serve_command(Path::new(RUNCELL), free_port())
        .arg("--data-dir")
        .arg(data)
        .arg("--auto-build=false")
        .env("RUNCELL_LOG", "info")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("runcell serve starts");
    let (tx, rx) = std::sync::mpsc::channel();
    let out = child.stdout.take().unwrap();
    let err = child.stderr.take().unwrap();
    for r in [
        Box::new(out) as Box<dyn std::io::Read + Send>,
        Box::new(err) as Box<dyn std::io::Read + Send>,
    ] {
        let tx = tx.clone();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(r).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
    }
    (child, rx)
}

/// A SIGTERM that comes while the daemon starts (its store mounted, not
/// yet listening) or at once after it says it listens (a supervisor or a
/// test stopping it as soon as it is up) is a graceful stop like any
/// other: exit 0, the store unmounted, its loop device freed. Caught from
/// the first line of `serve`, the signal never finds its default action.
#[test]
fn a_sigterm_while_the_daemon_starts_is_a_graceful_stop() {
    require_root("the btrfs layer store");
    let data = data_dir("early-sigterm");
    let store = data.join("store");
    let image = data.join("store.img");
    for round in 0..16 {
        // Even rounds: at the log line that says the store is open (before
        // the listener exists); odd rounds: at the first line on stdout.
        let at = if round % 2 == 0 {
            "layer store"
        } else {
            "is listening"
        };
        let (mut child, lines) = serve_with_output(&data);
        let mut seen = Vec::new();
        loop {
            let line = lines
                .recv_timeout(Duration::from_secs(30))
                .unwrap_or_else(|e| panic!("round {round}: no {at:?} line ({e}); saw {seen:#?}"));
            let hit = line.contains(at);
            seen.push(line);
            if hit {
                break;
            }
        }
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(child.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        )
        .unwrap();
        let status = child.wait().unwrap();
        seen.extend(lines.try_iter());
        assert!(
            status.success(),
            "round {round}: SIGTERM at {at:?} ended the daemon with {status}; its output: {seen:#?}"
        );
        assert!(
            !is_mount_point(&store),
            "round {round}: SIGTERM at {at:?} left {} mounted; output: {seen:#?}",
            store.display()
        );
        assert!(image.exists(), "round {round}: the store's image is gone");
    }
    let until = Instant::now() + Duration::from_secs(5);
    while !loop_devices(&image).is_empty() {
        assert!(
            Instant::now() < until,
            "loop devices left: {:?}",
            loop_devices(&image)
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    std::fs::remove_dir_all(&data).unwrap();
}

/// Starts the test binary's daemon through a shell script (`{script}`
/// lines, then `exec runcell "$@"`): the way a service manager would
/// start it, with its umask, environment, limits or working directory.
/// The script is `<data>.sh`, removed once the daemon listens; the
/// daemon's own arguments go through it.
fn daemon_started_by(data: &Path, script: &str, args: &[&str]) -> Daemon {
    use std::os::unix::fs::PermissionsExt;
    let wrapper = data.with_extension("sh");
    std::fs::create_dir_all(data.parent().unwrap()).unwrap();
    std::fs::write(
        &wrapper,
        format!("#!/bin/sh\n{script}\nexec {RUNCELL} \"$@\"\n"),
    )
    .unwrap();
    std::fs::set_permissions(&wrapper, std::fs::Permissions::from_mode(0o755)).unwrap();
    let d = Daemon::spawn(&wrapper, data, free_port(), args);
    // The shell has exec'd the daemon by the time it listens.
    let _ = std::fs::remove_file(&wrapper);
    d
}

/// Makes volume `name`, writes to it from a new sandbox and reads it back:
/// the sandbox, still running.
async fn through_a_volume(d: &Daemon, name: &str) -> String {
    let (s, vol) = d
        .post("/v1/volumes", json!({"name": name, "size_mb": 16}))
        .await;
    assert_eq!(s, 201, "{vol}");
    let id = d
        .create(json!({"volumes": [{"name": name}], "ttl_seconds": 120}))
        .await;
    let cmd = format!("echo v > /mnt/{name}/f && cat /mnt/{name}/f");
    assert_eq!(ok(d, &id, &cmd).await, "v\n");
    id
}

/// A daemon started with a strict umask (a hardened service's
/// `UMask=0077`) serves as any other: what it makes for sandboxes (a
/// volume's directories, the store's, a run's code file) stays reachable
/// by them, and its own secrets stay private. Under umask 077 a sandbox
/// given a volume failed to start ("bind-mounting ... Permission denied")
/// and a run's code file was unreadable to its user.
#[tokio::test(flavor = "multi_thread")]
async fn a_daemon_started_with_a_strict_umask_serves_as_any_other() {
    use std::os::unix::fs::PermissionsExt;
    require_root("the btrfs layer store");
    let data = data_dir("strict-umask");
    let d = daemon_started_by(&data, "umask 077", &["--auto-build=false"]);
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&data.join("api-key")), 0o600);
    assert_eq!(mode(&data.join("registry.db")), 0o600);

    let id = through_a_volume(&d, "strict").await;
    assert_eq!(ok(&d, &id, "umask").await, "0022\n");
    // A snapshot of it, and a sandbox started from the snapshot.
    assert_eq!(ok(&d, &id, "echo kept > ~/k").await, "");
    let (s, snap) = d
        .post(&format!("/v1/sandboxes/{id}/snapshots"), json!({}))
        .await;
    assert_eq!(s, 201, "{snap}");
    let restored = d
        .create(json!({"from_snapshot": snap["id"], "ttl_seconds": 120}))
        .await;
    assert_eq!(ok(&d, &restored, "cat ~/k").await, "kept\n");
    // A one-shot run: its code is a file the sandbox's user must read.
    let (code, out, err) = runcell_cli(&d, &["run", "python", "-c", "print(6*7)"]);
    assert_eq!((code, out.as_str()), (0, "42\n"), "{err}");
    d.delete(&id).await;
    d.delete(&restored).await;
}

/// A daemon started with an empty environment (`env -i`, as some init
/// systems and cron start services) finds the host programs it runs in
/// the system's directories: it made no volume ("mkfs.ext4: No such file
/// or directory") and fell back to the tmpfs store ("mkfs.btrfs is not
/// installed") when it looked on the C library's default path alone.
#[tokio::test(flavor = "multi_thread")]
async fn a_daemon_started_with_an_empty_environment_finds_its_host_tools() {
    require_root("the btrfs layer store");
    let data = data_dir("empty-env");
    // `exec env -i runcell ...`: the script's own last line then execs
    // nothing (it is never reached).
    let script = format!("exec /usr/bin/env -i {RUNCELL} \"$@\"");
    let d = daemon_started_by(&data, &script, &["--auto-build=false"]);
    let system: Value = d.get("/v1/system").await;
    assert_eq!(system["layer_store"]["kind"], "btrfs", "{system}");
    let id = through_a_volume(&d, "bare").await;
    d.delete(&id).await;
}

/// `runcell serve --data-dir data`, a path relative to where it starts:
/// the daemon works as with an absolute one. Every sandbox's setup failed
/// ("bind-mounting data/sandboxes/<id>/egress failed: No such file or
/// directory"): the agent was handed paths relative to a directory it had
/// left.
#[tokio::test(flavor = "multi_thread")]
async fn a_relative_data_directory_works_as_an_absolute_one() {
    require_root("the btrfs layer store");
    let data = data_dir("relative");
    // Started in the data directory's parent, with every argument under it
    // made relative to it.
    let under = format!("{}/", data.parent().unwrap().display());
    let script = format!(
        "cd '{under}' || exit 1\n\
         for a; do shift; case \"$a\" in '{under}'*) a=\"${{a#'{under}'}}\";; esac; set -- \"$@\" \"$a\"; done"
    );
    let d = daemon_started_by(&data, &script, &["--auto-build=false"]);
    let cmdline = std::fs::read(format!("/proc/{}/cmdline", d.child.id())).unwrap();
    let name = data.file_name().unwrap().to_string_lossy().into_owned();
    assert!(
        cmdline.split(|&b| b == 0).any(|a| a == name.as_bytes()),
        "the daemon was not given a relative data directory"
    );
    let id = d.create(json!({"ttl_seconds": 120})).await;
    assert_eq!(ok(&d, &id, "echo ok").await, "ok\n");
    let with = through_a_volume(&d, "rel").await;
    d.delete(&id).await;
    d.delete(&with).await;
}

/// A daemon started with a low soft limit on open files (systemd's
/// default is 1024) holds as many sandboxes as it is allowed: it raises
/// its own to the hard limit. At 1024, creates failed with "Too many open
/// files" at 334 live sandboxes. Sandboxed programs start with a soft
/// limit of 1024 whatever the daemon's, and the hard limit it has.
#[tokio::test(flavor = "multi_thread")]
async fn a_daemon_started_with_few_open_files_holds_its_sandboxes() {
    require_root("sandboxes");
    let data = data_dir("few-files");
    let args = [
        "--auto-build=false",
        "--layer-store",
        "tmpfs",
        "--standby",
        "1",
        "--max-sandboxes",
        "200",
    ];
    let d = daemon_started_by(&data, "ulimit -Sn 256 || exit 1", &args);
    let hard = std::fs::read_to_string(format!("/proc/{}/limits", d.child.id()))
        .unwrap()
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .and_then(|l| l.split_whitespace().nth(4).map(str::to_string))
        .unwrap();
    // 150 live sandboxes: past what 256 descriptors held (about 80).
    let mut ids = Vec::new();
    for _ in 0..150 {
        ids.push(d.create(json!({"ttl_seconds": 120})).await);
    }
    assert_eq!(
        ok(&d, &ids[149], "ulimit -Sn; ulimit -Hn").await,
        format!("1024\n{hard}\n")
    );
    for id in &ids {
        d.delete(id).await;
    }
}
