//! Sandbox starts that fail, or that race with another process sweeping the
//! same state directory, leave nothing behind and do not hurt anyone else.

mod common;

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use runcell_core::{Runtime, RuntimeConfig, SandboxLimits, SandboxOptions};

fn config(name: &str, standby: usize) -> RuntimeConfig {
    RuntimeConfig {
        state_dir: PathBuf::from(format!("/run/runcell-test/{name}")),
        cgroup_parent: format!("runcell-test-{name}"),
        standby,
        ..RuntimeConfig::default()
    }
}

/// Every cgroup directory under `parent`, in every mounted hierarchy (v1:
/// one per controller; v2: the unified one), as `hierarchy/name`.
fn cgroup_dirs(parent: &str) -> Vec<String> {
    let mut roots: Vec<PathBuf> = vec![PathBuf::from("/sys/fs/cgroup")];
    roots.extend(
        std::fs::read_dir("/sys/fs/cgroup")
            .expect("/sys/fs/cgroup must exist")
            .flatten()
            .map(|e| e.path()),
    );
    let mut out = Vec::new();
    for root in roots {
        let dir = root.join(parent);
        for e in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                out.push(format!(
                    "{}/{}",
                    root.display(),
                    e.file_name().to_string_lossy()
                ));
            }
        }
    }
    out.sort();
    out
}

fn entries(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

/// Limits the cgroup files refuse (the daemon's request validation rejects
/// these earlier; the jail must still clean up when the kernel says no).
fn refused_limits() -> SandboxLimits {
    SandboxLimits {
        pids: 1 << 40,
        ..limits()
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_start_the_kernel_refuses_leaves_no_cgroup_directory_or_process() {
    require_root();
    let cfg = config("lifecycle-refused", 0);
    let rt = Runtime::new(cfg.clone()).unwrap();
    rt.sweep_dead();
    assert_eq!(cgroup_dirs(&cfg.cgroup_parent), Vec::<String>::new());
    for _ in 0..3 {
        let err = rt
            .create(SandboxOptions {
                limits: refused_limits(),
                ..SandboxOptions::default()
            })
            .await
            .expect_err("pids 2^40 is refused by the kernel");
        let msg = format!("{err}");
        assert!(!msg.is_empty());
    }
    assert_eq!(
        cgroup_dirs(&cfg.cgroup_parent),
        Vec::<String>::new(),
        "a failed start left cgroup directories"
    );
    assert_eq!(entries(&cfg.state_dir), Vec::<String>::new());
    assert!(host_processes_with(&cfg.state_dir.display().to_string()).is_empty());
    // And the runtime still works.
    let sb = sandbox(&rt, limits()).await;
    assert_eq!(sh(&sb, "echo ok").await.stdout, b"ok\n");
    sb.destroy().await.unwrap();
    assert_eq!(cgroup_dirs(&cfg.cgroup_parent), Vec::<String>::new());
}

#[tokio::test(flavor = "multi_thread")]
async fn a_refused_start_does_not_drain_the_standby_pool() {
    require_root();
    let cfg = config("lifecycle-standby", 2);
    let rt = Runtime::new(cfg.clone()).unwrap();
    rt.sweep_dead();
    rt.warm_up().await;
    assert_eq!(rt.standby_ready(), 2);
    let standbys = entries(&cfg.state_dir);
    for _ in 0..4 {
        rt.create(SandboxOptions {
            limits: refused_limits(),
            ..SandboxOptions::default()
        })
        .await
        .expect_err("pids 2^40 is refused by the kernel");
    }
    // Give a (wrong) refill time to show.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(rt.standby_ready(), 2, "failed starts drained the pool");
    let names: Vec<String> = cgroup_dirs(&cfg.cgroup_parent)
        .iter()
        .map(|d| d.rsplit('/').next().unwrap().to_string())
        .collect();
    for n in &names {
        assert!(
            standbys.contains(n),
            "cgroup {n} belongs to no standby sandbox"
        );
    }
    assert_eq!(entries(&cfg.state_dir), standbys);
    // The standbys that went through a refused start still work, with the
    // limits asked for next.
    for _ in 0..2 {
        let sb = sandbox(&rt, limits()).await;
        assert!(standbys.contains(&sb.id().to_string()));
        assert_eq!(sh(&sb, "echo ok").await.stdout, b"ok\n");
        sb.destroy().await.unwrap();
    }
}

/// `runcell run` sweeps the state directory of dead sandboxes when it
/// starts; a sweep by one process must never take a sandbox another process
/// is starting (it did while `jail.json` was half written: "Connection reset
/// by peer" about once in 300 runs at concurrency 2).
#[tokio::test(flavor = "multi_thread")]
async fn sweeping_while_sandboxes_start_never_kills_one() {
    require_root();
    let cfg = config("lifecycle-sweep", 0);
    let rt = Runtime::new(cfg.clone()).unwrap();
    rt.sweep_dead();
    let stop = Arc::new(AtomicBool::new(false));
    let sweeps = Arc::new(AtomicUsize::new(0));
    // Ids whose owner began to destroy them: a sweeper may help remove
    // those, never any other (the retry of a failed start would hide a
    // killed start from the owner, so this is checked on the sweepers' side).
    let destroying = Arc::new(Mutex::new(HashSet::<String>::new()));
    let sweepers: Vec<_> = (0..2)
        .map(|_| {
            let other = Runtime::new(cfg.clone()).unwrap();
            let (stop, sweeps, destroying) = (stop.clone(), sweeps.clone(), destroying.clone());
            std::thread::spawn(move || {
                let mut wrong = Vec::new();
                while !stop.load(Ordering::Relaxed) {
                    for id in other.sweep_dead() {
                        if !destroying.lock().unwrap().contains(&id) {
                            wrong.push(id);
                        }
                    }
                    sweeps.fetch_add(1, Ordering::Relaxed);
                }
                wrong
            })
        })
        .collect();
    let started = Instant::now();
    let mut failures = Vec::new();
    let mut n = 0;
    while n < 200 && started.elapsed() < Duration::from_secs(60) {
        n += 1;
        let r = async {
            let sb = rt
                .create(SandboxOptions {
                    limits: limits(),
                    ..SandboxOptions::default()
                })
                .await?;
            let out = sb
                .exec(
                    runcell_protocol::Command::Shell("echo ok".into()),
                    &Default::default(),
                )
                .await;
            destroying.lock().unwrap().insert(sb.id().to_string());
            sb.destroy().await?;
            out
        }
        .await;
        match r {
            Ok(r) if r.stdout == b"ok\n" => {}
            Ok(r) => failures.push(format!("run {n}: {r:?}")),
            Err(e) => failures.push(format!("run {n}: {e:#}")),
        }
    }
    stop.store(true, Ordering::Relaxed);
    let wrong: Vec<String> = sweepers
        .into_iter()
        .flat_map(|t| t.join().unwrap())
        .collect();
    eprintln!(
        "{n} starts, {} concurrent sweeps",
        sweeps.load(Ordering::Relaxed)
    );
    assert!(
        failures.is_empty() && wrong.is_empty(),
        "{} of {n} starts failed ({failures:?}); the sweepers removed {} starting or running sandboxes: {wrong:?}",
        failures.len(),
        wrong.len()
    );
}

/// The cloned child has a parent-death signal while it is prepared, and that
/// signal follows the *thread* that cloned it: tokio's blocking threads exit
/// after 10 s idle. Prepared and started sandboxes must survive that.
#[tokio::test(flavor = "multi_thread")]
async fn standbys_outlive_the_thread_that_prepared_them() {
    require_root();
    let cfg = config("lifecycle-pdeath", 2);
    let rt = Runtime::new(cfg.clone()).unwrap();
    rt.sweep_dead();
    rt.warm_up().await;
    let standbys = entries(&cfg.state_dir);
    assert_eq!(standbys.len(), 2);
    let started = sandbox(&rt, limits()).await;
    // Past the blocking pool's 10 s keep-alive: the preparing threads are gone.
    tokio::time::sleep(Duration::from_secs(12)).await;
    assert_eq!(sh(&started, "echo ok").await.stdout, b"ok\n");
    let next = sandbox(&rt, limits()).await;
    assert!(standbys.contains(&next.id().to_string()));
    assert_eq!(sh(&next, "echo ok").await.stdout, b"ok\n");
    started.destroy().await.unwrap();
    next.destroy().await.unwrap();
}

/// A program given with the create (`first_run`) is started as the sandbox
/// comes up, before the create returns: read, it answers as a run started
/// after the create would (the environment, the output, the status); left
/// unread and dropped, its processes are killed as for a client that went
/// away, and the sandbox goes on.
#[tokio::test(flavor = "multi_thread")]
async fn a_first_run_starts_with_its_sandbox_and_ends_with_its_answer() {
    use runcell_core::{FirstProgram, FirstRun, RunOptions};
    use runcell_protocol::{Command, Language};
    require_root();
    let rt = Runtime::new(config("first-run", 1)).expect("runtime");
    rt.warm_up().await;
    let with_first = |program| SandboxOptions {
        limits: limits(),
        one_shot: true,
        first_run: Some(FirstRun {
            program,
            opts: RunOptions {
                env: [("M".to_string(), "7".to_string())].into(),
                ..RunOptions::default()
            },
        }),
        ..SandboxOptions::default()
    };
    let sb = rt
        .create(with_first(FirstProgram::Code {
            language: Language::Python,
            code: "import os, sys; print(os.environ['M']); sys.exit(3)".into(),
        }))
        .await
        .expect("create");
    let run = sb.take_first_run().expect("the first run was started");
    assert!(sb.take_first_run().is_none(), "taken once");
    let mut out = Vec::new();
    let outcome = sb
        .resume_run(run)
        .drive(&mut |_, b: &[u8]| out.extend_from_slice(b))
        .await
        .expect("the first run's answer");
    assert_eq!(text(&out), "7\n");
    assert_eq!(outcome.status(), 3);
    sb.destroy().await.expect("destroy");

    // A sleep no other process on the host has: found by its arguments.
    let secs = format!("37.{}", std::process::id());
    let sb = rt
        .create(with_first(FirstProgram::Command(Command::Argv(vec![
            "/bin/sleep".into(),
            secs.clone(),
        ]))))
        .await
        .expect("create");
    let run = sb.take_first_run().expect("the first run was started");
    let deadline = Instant::now() + Duration::from_secs(5);
    while host_processes_with(&secs).is_empty() {
        assert!(Instant::now() < deadline, "the first run never started");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    drop(run);
    let deadline = Instant::now() + Duration::from_secs(5);
    while !host_processes_with(&secs).is_empty() {
        assert!(
            Instant::now() < deadline,
            "the dropped run's process is still there"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(text(&sh(&sb, "echo alive").await.stdout), "alive\n");
    sb.destroy().await.expect("destroy");
}
