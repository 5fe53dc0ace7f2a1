//! The standby pool: prepared sandboxes are handed out once, start clean,
//! refill in the background and die with the runtime.

mod common;

use std::time::{Duration, Instant};

use common::*;
use runcell_core::{Runtime, RuntimeConfig, SandboxLimits, SandboxOptions};

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
