//! The standby pool: prepared sandboxes are handed out once, start clean,
//! refill in the background and die with the runtime.

mod common;

use std::time::{Duration, Instant};

use common::*;
use runcell_core::{ExecResult, Runtime, RuntimeConfig, SandboxLimits, SandboxOptions};

#[tokio::test(flavor = "multi_thread")]
async fn standby_sandboxes_are_used_once_start_clean_and_die_with_the_runtime() {
    require_root();
    let rt = Runtime::new(RuntimeConfig {
        state_dir: "/run/runcell-test/pool".into(),
        cgroup_parent: "runcell-test-pool".into(),
        standby: 2,
        ..RuntimeConfig::default()
    })
    .unwrap();
    rt.sweep_dead();
    rt.warm_up().await;
    assert_eq!(rt.standby_ready(), 2);
    let standby_ids = rt.list();
    assert_eq!(standby_ids.len(), 2);

    let a = rt
        .create(SandboxOptions {
            limits: limits(),
            ..SandboxOptions::default()
        })
        .await
        .unwrap();
    let b = rt
        .create(SandboxOptions {
            limits: limits(),
            ..SandboxOptions::default()
        })
        .await
        .unwrap();
    assert_ne!(a.id(), b.id());
    assert!(standby_ids.contains(&a.id().to_string()) && standby_ids.contains(&b.id().to_string()));
    // Nothing is shared between two sandboxes from the pool.
    sh(&a, "echo mine > /tmp/a.txt").await;
    let r = sh(&b, "cat /tmp/a.txt").await;
    assert!(text(&r.stderr).contains("No such file"));
    // Claimed with the limits it was prepared with: its cgroup has them.
    assert_eq!(cgroup_limits(a.id()), (1 << 30, 512, 100_000));
    let (ida, idb) = (a.id().to_string(), b.id().to_string());
    a.destroy().await.unwrap();
    b.destroy().await.unwrap();

    // The pool refills in the background with new sandboxes.
    let until = Instant::now() + Duration::from_secs(10);
    while rt.standby_ready() < 2 && Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(rt.standby_ready(), 2);
    let now = rt.list();
    assert!(
        !now.contains(&ida) && !now.contains(&idb),
        "a used sandbox went back to the pool"
    );

    // A claim with other limits gets those, not the standby's.
    let c = rt
        .create(SandboxOptions {
            limits: SandboxLimits {
                memory_bytes: 256 << 20,
                pids: 64,
                cpu_millis: 500,
                ..limits()
            },
            ..SandboxOptions::default()
        })
        .await
        .unwrap();
    assert!(now.contains(&c.id().to_string()), "not from the pool");
    assert_eq!(cgroup_limits(c.id()), (256 << 20, 64, 50_000));
    let r = sh(&c, "echo ok").await;
    assert_eq!(text(&r.stdout), "ok\n");
    c.destroy().await.unwrap();
    // Refilled again (the refill holds the runtime until it is done).
    let until = Instant::now() + Duration::from_secs(10);
    while rt.standby_ready() < 2 && Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let now = rt.list();

    // Dropping the runtime kills the standbys and removes their state.
    drop(rt);
    for id in now {
        assert!(
            !std::path::Path::new(&format!("/run/runcell-test/pool/{id}")).exists(),
            "{id} is left"
        );
        assert!(
            !std::path::Path::new(&format!("/sys/fs/cgroup/pids/runcell-test-pool/{id}")).exists()
        );
    }
}

/// The memory limit, pids limit and CPU quota (per 100 ms period) of a
/// sandbox's cgroup, read on the host (cgroup v1, as on the test host).
fn cgroup_limits(id: &str) -> (u64, u64, u64) {
    let read = |controller: &str, file: &str| -> u64 {
        let path = format!("/sys/fs/cgroup/{controller}/runcell-test-pool/{id}/{file}");
        let s = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
        s.trim()
            .parse()
            .unwrap_or_else(|e| panic!("{path}: {s:?}: {e}"))
    };
    assert_eq!(read("cpu", "cpu.cfs_period_us"), 100_000);
    (
        read("memory", "memory.limit_in_bytes"),
        read("pids", "pids.max"),
        read("cpu", "cpu.cfs_quota_us"),
    )
}

/// A standby prepared after a claim lays out that claim's root ahead: the
/// next claim that asks for the same root only enters it (resized to its
/// own disk limit), and one that asks for another root gets its own,
/// with nothing left of the first and its files where a snapshot reads
/// them.
#[tokio::test(flavor = "multi_thread")]
async fn a_standby_lays_out_the_last_claims_root_ahead_and_serves_any_claim_as_asked() {
    require_root();
    let state = std::path::PathBuf::from("/run/runcell-test/pool-ahead");
    let rt = Runtime::new(RuntimeConfig {
        state_dir: state.clone(),
        cgroup_parent: "runcell-test-pool-ahead".into(),
        standby: 1,
        agent_log: Some("runcell_jail=debug".into()),
        ..RuntimeConfig::default()
    })
    .unwrap();
    rt.sweep_dead();
    rt.warm_up().await;
    let refilled = |rt: &Runtime| {
        let rt = rt.clone();
        async move {
            let until = Instant::now() + Duration::from_secs(10);
            while rt.standby_ready() < 1 && Instant::now() < until {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            assert_eq!(rt.standby_ready(), 1, "the pool was not refilled");
        }
    };
    let with_disk = |disk_bytes: u64| SandboxOptions {
        limits: SandboxLimits {
            disk_bytes,
            ..limits()
        },
        ..SandboxOptions::default()
    };
    let log = |id: &str| std::fs::read_to_string(state.join(id).join("agent.log")).unwrap();
    let disk_kib = |r: ExecResult| -> u64 {
        let out = text(&r.stdout);
        out.split_whitespace().nth(1).unwrap().parse().unwrap()
    };
    const KEPT: &str = "the root laid out ahead is the claim's";

    // The first claim takes a standby prepared before any claim.
    let first = rt.create(with_disk(64 << 20)).await.unwrap();
    assert!(
        log(first.id()).contains("ahead=false"),
        "{}",
        log(first.id())
    );
    first.destroy().await.unwrap();
    refilled(&rt).await;

    // The same root with half the disk: entered as laid out, resized.
    let same = rt.create(with_disk(32 << 20)).await.unwrap();
    assert!(log(same.id()).contains(KEPT), "{}", log(same.id()));
    let r = sh(&same, "df -k / | tail -1").await;
    assert_eq!(disk_kib(r), 32 << 10);
    let r = sh(&same, "head -c 40M /dev/zero > /tmp/big; echo rc=$?").await;
    assert!(text(&r.stdout).contains("rc=1"), "{}", text(&r.stdout));
    same.destroy().await.unwrap();
    refilled(&rt).await;

    // Another root (an egress socket mounted in it): the one laid out
    // ahead is taken apart and the claim's built.
    let other = rt
        .create(SandboxOptions {
            network: Some(runcell_egress::NetworkPolicy::default()),
            ..with_disk(48 << 20)
        })
        .await
        .unwrap();
    let text_log = log(other.id());
    assert!(
        text_log.contains("spec of the claim received"),
        "{text_log}"
    );
    assert!(!text_log.contains(KEPT), "{text_log}");
    let r = sh(
        &other,
        "df -k / | tail -1; ls /tmp | wc -l; test -d /run/runcell/egress && echo egress",
    )
    .await;
    let out = text(&r.stdout);
    assert_eq!(disk_kib(r), 48 << 10, "{out}");
    assert!(out.contains("\n0\negress\n"), "{out}");
    // Its files are in the writable layer a snapshot reads.
    sh(&other, "echo kept > /home/user/mark").await;
    let saved = std::env::temp_dir().join(format!("runcell-ahead-{}", other.id()));
    other.save_layer(&saved).unwrap();
    let mark = walk_find(&saved, "mark");
    assert_eq!(
        mark.as_deref()
            .map(std::fs::read_to_string)
            .transpose()
            .unwrap()
            .as_deref(),
        Some("kept\n"),
        "the saved layer of {} lacks the file written",
        saved.display()
    );
    std::fs::remove_dir_all(&saved).unwrap();
    other.destroy().await.unwrap();
}

/// The first file named `name` under `dir`.
fn walk_find(dir: &std::path::Path, name: &str) -> Option<std::path::PathBuf> {
    for entry in std::fs::read_dir(dir).ok()? {
        let path = entry.ok()?.path();
        if path.file_name().is_some_and(|n| n == name) {
            return Some(path);
        }
        if path.is_dir() && !path.is_symlink() {
            if let Some(found) = walk_find(&path, name) {
                return Some(found);
            }
        }
    }
    None
}

/// A template built again at the same path while a standby holds its root
/// laid out ahead (its old directories still mounted there, emptied): the
/// claim gets the template as it is now.
#[tokio::test(flavor = "multi_thread")]
async fn a_template_replaced_after_its_root_was_laid_out_ahead_is_served_as_it_is_now() {
    require_root();
    let base = std::path::PathBuf::from("/run/runcell-test/pool-replaced");
    let _ = std::fs::remove_dir_all(base.join("templates"));
    let rootfs = base.join("templates/mini/rootfs");
    let make_root = |version: &str| {
        // dash and what it loads, as `sh` and `bash` (what `sh()` runs):
        // enough for `bash -c` of plain shell.
        for file in [
            "/usr/bin/dash",
            "/lib/x86_64-linux-gnu/libc.so.6",
            "/lib64/ld-linux-x86-64.so.2",
        ] {
            let real = std::fs::canonicalize(file).unwrap();
            let dst = rootfs.join(file.trim_start_matches('/'));
            std::fs::create_dir_all(dst.parent().unwrap()).unwrap();
            std::fs::copy(&real, &dst).unwrap();
        }
        std::os::unix::fs::symlink("usr/bin", rootfs.join("bin")).unwrap();
        std::os::unix::fs::symlink("dash", rootfs.join("usr/bin/sh")).unwrap();
        std::os::unix::fs::symlink("dash", rootfs.join("usr/bin/bash")).unwrap();
        std::fs::write(rootfs.join("version"), version).unwrap();
    };
    make_root("1");
    let rt = Runtime::new(RuntimeConfig {
        state_dir: base.join("state"),
        cgroup_parent: "runcell-test-pool-replaced".into(),
        templates_dir: Some(base.join("templates")),
        standby: 1,
        ..RuntimeConfig::default()
    })
    .unwrap();
    rt.sweep_dead();
    rt.warm_up().await;
    let mini = || SandboxOptions {
        template: "mini".into(),
        limits: limits(),
        ..SandboxOptions::default()
    };
    let first = rt.create(mini()).await.unwrap();
    assert_eq!(version(&first).await, "1\n");
    first.destroy().await.unwrap();
    let until = Instant::now() + Duration::from_secs(10);
    while rt.standby_ready() < 1 && Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Let the standby lay the root out before the template goes.
    tokio::time::sleep(Duration::from_millis(300)).await;

    std::fs::remove_dir_all(&rootfs).unwrap();
    make_root("2");
    let second = rt.create(mini()).await.unwrap();
    assert_eq!(version(&second).await, "2\n");
    second.destroy().await.unwrap();
    drop(rt);
    let _ = std::fs::remove_dir_all(base.join("templates"));
}

/// What `/version` in the sandbox says.
async fn version(sb: &runcell_core::Sandbox) -> String {
    text(&sh(sb, "read v < /version; echo $v").await.stdout)
}
