//! The standby pool: prepared sandboxes are handed out once, start clean,
//! refill in the background and die with the runtime.

mod common;

use std::time::{Duration, Instant};

use common::*;
use runcell_core::{Runtime, RuntimeConfig, SandboxOptions};

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
    // The claimed sandbox got the limits asked for, not the standby's defaults.
    let r = sh(&a, "cat /proc/self/status | grep -c . ; echo ok").await;
    assert!(text(&r.stdout).contains("ok"));
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

    // Dropping the runtime kills the standbys and removes their state.
    drop(rt);
    for id in now {
        assert!(!std::path::Path::new(&format!("/run/runcell-test/pool/{id}")).exists());
        assert!(
            !std::path::Path::new(&format!("/sys/fs/cgroup/pids/runcell-test-pool/{id}")).exists()
        );
    }
}
