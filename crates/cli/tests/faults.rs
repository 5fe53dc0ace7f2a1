//! Fault injection: SIGKILL the daemon at random points of create, exec,
//! delete and standby preparation, restart it on the same port and data
//! directory each time, and check that it binds, re-attaches every live
//! sandbox and leaves nothing of its own behind. Needs root.
//!
//! The points are drawn from a seed (printed; set `RUNCELL_FAULT_SEED` to
//! replay a run, `RUNCELL_FAULT_KILLS` for more rounds).

mod common;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value};

/// xorshift64*: enough to spread kill points, and replayable from a seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    /// A random index into a non-empty slice of `len`.
    fn index(&mut self, len: usize) -> usize {
        usize::try_from(self.below(len as u64)).expect("below len")
    }
}

fn env_u64(name: &str, default: u64) -> u64 {
    match std::env::var(name) {
        Ok(v) => v
            .parse()
            .unwrap_or_else(|_| panic!("{name}={v} is not a number")),
        Err(_) => default,
    }
}

fn dirs_in(dir: &Path) -> BTreeSet<String> {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect()
}

/// Cgroup directories named `id` in any hierarchy (the daemon's cgroup
/// parent is shared with other daemons; the id is this daemon's own).
fn cgroup_dirs_named(id: &str) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut roots = vec![PathBuf::from("/sys/fs/cgroup")];
    roots.extend(
        std::fs::read_dir("/sys/fs/cgroup")
            .expect("/sys/fs/cgroup must exist")
            .flatten()
            .map(|e| e.path()),
    );
    for root in roots {
        for parent in std::fs::read_dir(&root).into_iter().flatten().flatten() {
            let d = parent.path().join(id);
            if d.is_dir() {
                out.push(d);
            }
        }
    }
    out
}

/// Host processes that belong to sandbox `id` of the daemon whose sandboxes
/// live in `sandboxes`: working directory in its directory, or in a cgroup
/// named by it.
fn processes_of(sandboxes: &Path, id: &str) -> Vec<String> {
    let dir = sandboxes.join(id);
    host_processes()
        .into_iter()
        .filter(|p| p.cwd.starts_with(&dir) || p.in_cgroup_of(id))
        .map(|p| format!("{} ({})", p.pid, p.comm))
        .collect()
}

/// Host mounts whose mount point is under `dir`, but for the daemon's own
/// tmpfs for its sandboxes' directories (`<dir>/sandboxes`).
fn mounts_under(dir: &Path) -> Vec<String> {
    let prefix = dir.display().to_string();
    let own = dir.join("sandboxes").display().to_string();
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap()
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .filter(|m| m.starts_with(&prefix) && *m != own)
        .map(str::to_string)
        .collect()
}

async fn listed(d: &Daemon) -> Vec<String> {
    let list: Vec<Value> = d
        .req(reqwest::Method::GET, "/v1/sandboxes")
        .timeout(Duration::from_secs(10))
        .send()
        .await
        .expect("list sandboxes")
        .json()
        .await
        .unwrap();
    list.iter()
        .map(|s| s["id"].as_str().unwrap().to_string())
        .collect()
}

/// Starts the daemon and waits until it answers HTTP itself: a port that
/// accepts connections is not enough (a leftover child of a killed daemon
/// holding the listening socket accepts them into a backlog nobody reads).
async fn restart(data: &Path, port: u16, round: u32) -> Daemon {
    let mut d = Daemon::start(data, port, &["--standby", "2"]);
    let until = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(status) = d.child.try_wait().unwrap() {
            panic!(
                "round {round}: the restarted daemon exited ({status}); was its port still held (\"Address already in use\")?"
            );
        }
        let r = d
            .req(reqwest::Method::GET, "/healthz")
            .timeout(Duration::from_secs(2))
            .send()
            .await;
        if matches!(&r, Ok(r) if r.status() == 200) {
            return d;
        }
        assert!(
            Instant::now() < until,
            "round {round}: the restarted daemon does not answer /healthz on its port ({r:?})"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Kills the daemon without running its Drop (which would signal the pid
/// again after it was reaped).
fn kill(d: Daemon) {
    let mut d = std::mem::ManuallyDrop::new(d);
    d.kill9();
}

#[tokio::test(flavor = "multi_thread")]
async fn sigkill_at_random_points_then_restart_binds_reattaches_and_leaves_nothing() {
    let seed = env_u64("RUNCELL_FAULT_SEED", 0x5eed_0010_2026);
    let kills =
        u32::try_from(env_u64("RUNCELL_FAULT_KILLS", 40)).expect("RUNCELL_FAULT_KILLS fits a u32");
    eprintln!("fault seed {seed:#x} ({kills} kills); replay with RUNCELL_FAULT_SEED={seed}");
    let mut rng = Rng(seed.max(1));
    let data = data_dir("faults");
    let sandboxes = data.join("sandboxes");
    let port = free_port();
    let started = Instant::now();
    let mut d = restart(&data, port, 0).await;
    let mut live: Vec<String> = Vec::new();
    let mut ops = std::collections::BTreeMap::<&str, u32>::new();

    for round in 1..=kills {
        // The operation in flight when the daemon is killed.
        let op = match rng.below(7) {
            0 if live.len() < 4 => "create",
            1 if !live.is_empty() => "exec",
            2 if !live.is_empty() => "delete",
            3 | 5 => "standby",
            4 | 6 => "startup",
            _ if live.is_empty() => "create",
            _ => "exec",
        };
        *ops.entry(op).or_default() += 1;
        let delay = Duration::from_millis(rng.below(300));
        let target = (!live.is_empty()).then(|| live[rng.index(live.len())].clone());
        let req = match op {
            "create" | "standby" => d
                .req(reqwest::Method::POST, "/v1/sandboxes")
                .json(&json!({"ttl_seconds": 600})),
            "startup" => d.req(reqwest::Method::GET, "/healthz"),
            "exec" => d
                .req(
                    reqwest::Method::POST,
                    &format!("/v1/sandboxes/{}/exec", target.as_ref().unwrap()),
                )
                .json(&json!({"cmd": "echo a > /tmp/f; sleep 0.1; cat /tmp/f"})),
            _ => d.req(
                reqwest::Method::DELETE,
                &format!("/v1/sandboxes/{}", target.as_ref().unwrap()),
            ),
        };
        let in_flight = tokio::spawn(req.timeout(Duration::from_secs(30)).send());
        let in_flight = if op == "standby" {
            // The claim above starts a refill of the standby pool about
            // 100 ms after the create: kill during that preparation, a few
            // milliseconds after the new standby's directory appears.
            let had = dirs_in(&sandboxes);
            let _ = in_flight.await;
            let until = Instant::now() + Duration::from_secs(3);
            while dirs_in(&sandboxes).is_subset(&had) && Instant::now() < until {
                std::thread::sleep(Duration::from_micros(500));
            }
            std::thread::sleep(delay / 30);
            None
        } else {
            tokio::time::sleep(delay).await;
            Some(in_flight)
        };
        kill(d);
        if let Some(r) = in_flight {
            let _ = r.await;
        }
        if op == "startup" {
            // Kill a starting daemon while it reconciles and fills its
            // standby pool (before it even binds its port).
            let mut starting = std::process::Command::new(env!("CARGO_BIN_EXE_runcell"))
                .args([
                    "serve",
                    "--layer-store",
                    "tmpfs",
                    "--standby",
                    "2",
                    "--listen",
                ])
                .arg(format!("127.0.0.1:{port}"))
                .arg("--data-dir")
                .arg(&data)
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .spawn()
                .unwrap();
            tokio::time::sleep(Duration::from_millis(50) + delay).await;
            starting.kill().unwrap();
            starting.wait().unwrap();
        }
        // What the killed daemon left: every sandbox directory it had.
        let before = dirs_in(&sandboxes);

        d = restart(&data, port, round).await;
        live = listed(&d).await;
        for id in &live {
            let (status, body) = d.exec(id, "echo ok").await;
            assert_eq!(
                (status, body["stdout"].as_str()),
                (200, Some("ok\n")),
                "round {round} ({op} after {delay:?}): listed sandbox {id} does not answer: {body}"
            );
        }
        let now = dirs_in(&sandboxes);
        let standbys: BTreeSet<&String> = now.iter().filter(|id| !live.contains(id)).collect();
        for id in before.iter().chain(now.iter()) {
            if live.contains(id) || (standbys.contains(id) && !before.contains(id)) {
                continue;
            }
            // Left by the killed daemon and not re-attached: nothing of it may remain.
            assert!(
                !sandboxes.join(id).exists(),
                "round {round} ({op} after {delay:?}): the directory of {id} remains"
            );
            assert_eq!(
                cgroup_dirs_named(id),
                Vec::<PathBuf>::new(),
                "round {round} ({op} after {delay:?}): cgroups of {id} remain"
            );
            assert_eq!(
                processes_of(&sandboxes, id),
                Vec::<String>::new(),
                "round {round} ({op} after {delay:?}): processes of {id} remain"
            );
        }
        assert!(
            standbys.len() <= 2,
            "round {round}: more unlisted sandboxes than standbys: {standbys:?}"
        );
        assert_eq!(mounts_under(&data), Vec::<String>::new());
    }
    eprintln!(
        "{kills} kills ({ops:?}) in {:?}; seed {seed:#x}",
        started.elapsed()
    );
    d.delete_all().await;
    assert_eq!(
        listed(&d).await,
        Vec::<String>::new(),
        "sandboxes are still listed after deleting every one"
    );
    // The standbys of the last daemon are removed by the next start (one
    // without a pool), as any orphan is; then nothing of it remains.
    let standbys = dirs_in(&sandboxes);
    drop(d);
    let d = Daemon::start(&data, port, &["--standby", "0"]);
    assert_eq!(listed(&d).await, Vec::<String>::new());
    drop(d);
    assert_eq!(dirs_in(&sandboxes), BTreeSet::new());
    for id in &standbys {
        assert_eq!(cgroup_dirs_named(id), Vec::<PathBuf>::new());
        assert_eq!(processes_of(&sandboxes, id), Vec::<String>::new());
    }
    let _ = std::fs::remove_dir_all(&data);
}
