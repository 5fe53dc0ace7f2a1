//! The daemon harness for the integration tests: `runcell-testkit` (shared
//! with the benchmarks) plus what only these tests need: the test defaults
//! for `runcell serve`, data directories under /run/runcell-test, and keys
//! made with `runcell key`. Needs root.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;

pub use runcell_testkit::*;

/// The `runcell` binary under test.
pub const RUNCELL: &str = env!("CARGO_BIN_EXE_runcell");

/// Fails the test plainly unless it runs as root.
pub fn require_root(what: &str) {
    assert!(
        nix::unistd::geteuid().is_root(),
        "the {what} tests must run as root"
    );
}

/// Starting the test binary's daemon with the test defaults.
pub trait StartDaemon {
    /// Starts `runcell serve` on 127.0.0.1:`port` with its data in `data`,
    /// a standby pool of 1 (unless `extra` sets `--standby`), the tmpfs
    /// layer store (unless `extra` sets `--layer-store`) and
    /// `code-interpreter` served from `host` rather than each test daemon
    /// bootstrapping Debian (unless `extra` sets `--auto-build`).
    fn start(data: &Path, port: u16, extra: &[&str]) -> Daemon;
}

impl StartDaemon for Daemon {
    fn start(data: &Path, port: u16, extra: &[&str]) -> Daemon {
        require_root("daemon");
        let mut args: Vec<&str> = Vec::new();
        if !extra.contains(&"--standby") {
            args.extend(["--standby", "1"]);
        }
        if !extra.iter().any(|a| a.starts_with("--auto-build")) {
            args.push("--auto-build=false");
        }
        // The tmpfs layer store unless the test names one: the default
        // (`auto`, btrfs here) makes and mounts an image per data
        // directory, about 0.2 s a daemon, over 100 daemons a run.
        // persistence.rs and layer_store.rs run with `auto`.
        if !extra.iter().any(|a| a.starts_with("--layer-store")) {
            args.extend(["--layer-store", "tmpfs"]);
        }
        // `scripts/test.sh` runs the hostile-code suites once per backend.
        let isolation = std::env::var("RUNCELL_TEST_ISOLATION").ok();
        if let Some(i) = &isolation {
            if !extra.contains(&"--default-isolation") {
                args.extend(["--default-isolation", i.as_str()]);
            }
        }
        args.extend(extra);
        Daemon::spawn(Path::new(RUNCELL), data, port, args)
    }
}

/// A fresh (removed) data directory for the test named `name`.
pub fn data_dir(name: &str) -> PathBuf {
    let d = PathBuf::from(format!(
        "/run/runcell-test/daemon-{name}-{}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// Runs `runcell key --data-dir data ARGS` (which must succeed) and returns
/// its output.
pub fn key_cmd(data: &Path, args: &[&str]) -> String {
    let out = Command::new(RUNCELL)
        .arg("key")
        .arg("--data-dir")
        .arg(data)
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// Creates an API key for `workspace` in the daemon's data directory (the
/// `runcell key` command) and returns it.
pub fn new_key(data: &Path, workspace: &str) -> String {
    key_cmd(
        data,
        &["create", "--workspace", workspace, "--name", "test"],
    )
    .trim()
    .to_string()
}

/// Runs `runcell ARGS` against the daemon `d` (RUNCELL_URL and
/// RUNCELL_API_KEY set, stdin empty): exit code, stdout, stderr.
pub fn runcell_cli(d: &Daemon, args: &[&str]) -> (i32, String, String) {
    let out = Command::new(RUNCELL)
        .args(args)
        .env("RUNCELL_URL", &d.url)
        .env("RUNCELL_API_KEY", &d.key)
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Runs `code` in code context `sid` of sandbox `id`: (status, answer).
pub async fn cell(d: &Daemon, id: &str, sid: &str, code: &str) -> (u16, serde_json::Value) {
    let r = d
        .req(
            reqwest::Method::POST,
            &format!("/v1/sandboxes/{id}/repl/sessions/{sid}/run"),
        )
        .json(&serde_json::json!({ "code": code }))
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap())
}

/// The host's mount table lines (the test's mount namespace, the
/// daemon's) that mention `what`.
pub fn mounts_mentioning(what: &str) -> Vec<String> {
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap()
        .lines()
        .filter(|l| l.contains(what))
        .map(str::to_string)
        .collect()
}

/// The host directory the only volume of the daemon with data directory
/// `data` is mounted on (`<data>/volumes/*.mnt`).
pub fn volume_on_host(data: &Path) -> PathBuf {
    let mut mnts: Vec<PathBuf> = std::fs::read_dir(data.join("volumes"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "mnt"))
        .collect();
    assert_eq!(mnts.len(), 1, "{mnts:?}");
    mnts.remove(0)
}

/// (uid, gid) of `path` on the host.
pub fn owner(path: &Path) -> (u32, u32) {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(path).unwrap();
    (m.uid(), m.gid())
}

/// The jail's default id map: sandbox uid `U` is host uid `HOST_BASE + U`.
pub const HOST_BASE: u32 = 1_000_000_000;

/// Runs `cmd` in sandbox `id`: (exit code, stdout, stderr).
pub async fn sh(d: &Daemon, id: &str, cmd: &str) -> (i64, String, String) {
    let (s, body) = d.exec(id, cmd).await;
    assert_eq!(s, 200, "{cmd}: {body}");
    (
        body["exit_code"].as_i64().unwrap(),
        body["stdout"].as_str().unwrap().to_string(),
        body["stderr"].as_str().unwrap().to_string(),
    )
}

/// Runs `cmd` in sandbox `id` and fails unless it succeeds: its stdout.
pub async fn ok(d: &Daemon, id: &str, cmd: &str) -> String {
    let (code, out, err) = sh(d, id, cmd).await;
    assert_eq!(code, 0, "{cmd}: {out}{err}");
    out
}

/// Fails unless sandbox `id`, which mounts the volume whose host directory
/// is `on_host` read-only at `at` (holding a file `f`), can neither create,
/// append to nor remove anything there (each refused as a read-only file
/// system), and nothing reached the host.
pub async fn assert_cannot_write(d: &Daemon, id: &str, at: &str, on_host: &Path) {
    for cmd in [
        format!("echo x > {at}/new"),
        format!("echo x >> {at}/f"),
        format!("mkdir {at}/dir"),
        format!("rm {at}/f"),
    ] {
        let (code, _, err) = sh(d, id, &cmd).await;
        assert_ne!(code, 0, "{cmd} wrote on a read-only volume");
        assert!(err.contains("Read-only file system"), "{cmd}: {err}");
    }
    assert!(!on_host.join("new").exists() && !on_host.join("dir").exists());
}

/// A new sandbox (TTL 600 s) whose `~/s` holds `snap`, and a snapshot of
/// it: (sandbox, snapshot).
pub async fn snapshotted_source(d: &Daemon) -> (String, String) {
    let source = d.create(serde_json::json!({"ttl_seconds": 600})).await;
    assert_eq!(d.exec(&source, "echo snap > ~/s").await.0, 200);
    let (s, snap) = d
        .post(
            &format!("/v1/sandboxes/{source}/snapshots"),
            serde_json::json!({}),
        )
        .await;
    assert_eq!(s, 201, "{snap}");
    let snap_id = snap["id"].as_str().unwrap().to_string();
    (source, snap_id)
}

/// `DELETE path` (a snapshot, a volume), which must answer 204.
pub async fn delete_ok(d: &Daemon, path: &str) {
    assert_eq!(
        d.status(reqwest::Method::DELETE, path, None).await,
        204,
        "DELETE {path}"
    );
}

/// `POST /v1/sandboxes/{id}/{action}` (`pause`, `resume`, `hibernate`,
/// `wake`) with an empty body: the status.
pub async fn act(d: &Daemon, id: &str, action: &str) -> u16 {
    d.status(
        reqwest::Method::POST,
        &format!("/v1/sandboxes/{id}/{action}"),
        Some(serde_json::json!({})),
    )
    .await
}

/// A host process as the tests look at it.
pub struct HostProcess {
    pub pid: i32,
    /// Its command name.
    pub comm: String,
    /// Its state letter (`Z`: a zombie).
    pub state: char,
    /// Its working directory.
    pub cwd: PathBuf,
    /// Its `/proc/PID/cgroup` lines.
    pub cgroups: String,
}

impl HostProcess {
    /// Whether it is in a cgroup named by sandbox `id`.
    pub fn in_cgroup_of(&self, id: &str) -> bool {
        let suffix = format!("/{id}");
        self.cgroups.lines().any(|l| l.ends_with(&suffix))
    }
}

/// Every process on the host (one that exits while it is read is left out).
pub fn host_processes() -> Vec<HostProcess> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        let state = stat
            .rsplit_once(") ")
            .and_then(|(_, rest)| rest.chars().next())
            .unwrap_or('?');
        out.push(HostProcess {
            pid,
            comm: std::fs::read_to_string(format!("/proc/{pid}/comm"))
                .unwrap_or_default()
                .trim()
                .to_string(),
            state,
            cwd: std::fs::read_link(format!("/proc/{pid}/cwd")).unwrap_or_default(),
            cgroups: std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap_or_default(),
        });
    }
    out
}

/// Waits (up to `within`) until asking for sandbox `id` answers 404, and
/// gives that answer: an ended sandbox says why it ended.
pub async fn ended_answer(d: &Daemon, id: &str, within: std::time::Duration) -> serde_json::Value {
    let until = std::time::Instant::now() + within;
    loop {
        let r = d
            .req(reqwest::Method::GET, &format!("/v1/sandboxes/{id}"))
            .send()
            .await
            .unwrap();
        if r.status() == 404 {
            return r.json().await.unwrap();
        }
        assert!(
            std::time::Instant::now() < until,
            "sandbox {id} is still there after {within:?}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}
