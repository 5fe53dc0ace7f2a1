//! Creating and destroying many sandboxes leaves nothing behind: no process,
//! mount, cgroup or directory. (Alone in its binary so no other test's
//! sandboxes are counted.)

mod common;

use std::time::{Duration, Instant};

use common::*;

#[derive(Debug, PartialEq, Eq)]
struct HostState {
    agents: usize,
    mounts: usize,
    cgroups: Vec<String>,
    dirs: Vec<String>,
    zombies: usize,
}

fn snapshot(parent: &str, state_dir: &str) -> HostState {
    let me = std::process::id().to_string();
    let procs: Vec<String> = std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter(|e| {
            e.file_name()
                .to_str()
                .is_some_and(|n| n.parse::<u32>().is_ok())
        })
        .filter_map(|e| std::fs::read_to_string(e.path().join("stat")).ok())
        .collect();
    let cgroups = ["memory", "pids", "cpu", "cpuacct", "unified"]
        .iter()
        .flat_map(|c| {
            std::fs::read_dir(format!("/sys/fs/cgroup/{c}/{parent}"))
                .into_iter()
                .flatten()
                .flatten()
                .filter(|e| e.path().is_dir())
                .map(|e| format!("{c}/{}", e.file_name().to_string_lossy()))
                .collect::<Vec<_>>()
        })
        .collect();
    HostState {
        agents: procs
            .iter()
            .filter(|s| s.contains("(runcell-agent)"))
            .count(),
        mounts: std::fs::read_to_string("/proc/self/mountinfo")
            .unwrap()
            .lines()
            .count(),
        cgroups,
        dirs: std::fs::read_dir(state_dir)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect(),
        // Our own unreaped children (zombies of other processes are not ours).
        zombies: procs
            .iter()
            .filter(|s| {
                s.rfind(')').is_some_and(|i| {
                    let f: Vec<&str> = s[i + 2..].split(' ').collect();
                    f.first() == Some(&"Z") && f.get(1) == Some(&me.as_str())
                })
            })
            .count(),
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn two_hundred_sandboxes_leave_nothing_behind() {
    let rt = runtime("leaks");
    let state_dir = "/run/runcell-test/leaks";
    // Warm up (cgroup parents, state directory), then measure.
    sandbox(&rt, limits()).await.destroy().await.unwrap();
    let before = snapshot("runcell-test-leaks", state_dir);
    let started = Instant::now();
    for i in 0..200 {
        let sb = sandbox(&rt, limits()).await;
        if i % 20 == 0 {
            // Some of them run a process that leaves a background child behind.
            let r = sh(&sb, "sleep 60 & echo $!").await;
            assert!(!r.stdout.is_empty());
        }
        sb.destroy().await.unwrap();
    }
    let per_sandbox = started.elapsed() / 200;
    let after = snapshot("runcell-test-leaks", state_dir);
    // Compared with the state before the loop: other runcell processes on
    // the host (a daemon, other tests) may have sandboxes of their own.
    assert_eq!(after, before, "something was left behind");
    assert!(
        after.cgroups.is_empty() && after.dirs.is_empty(),
        "{after:?}"
    );
    eprintln!("create+destroy averaged {per_sandbox:?} over 200 sandboxes");
    assert!(per_sandbox < Duration::from_secs(1));
}
