//! Shared set-up for the integration tests. They create real sandboxes, so
//! they need root: without it they fail with a clear message (never skip).

#![allow(dead_code)]

use std::path::PathBuf;
use std::time::Duration;

use runcell_core::backend::Isolation;
use runcell_core::{
    ExecResult, RunOptions, Runtime, RuntimeConfig, Sandbox, SandboxLimits, SandboxOptions,
};
use runcell_protocol::{Command, Language};

/// Fails the test loudly unless running as root.
pub fn require_root() {
    let euid = nix::unistd::geteuid().as_raw();
    assert_eq!(
        euid, 0,
        "these tests create real sandboxes and must run as root (CI runs them as root); run `sudo ./scripts/test.sh`"
    );
}

/// A runtime whose state and cgroups are private to one test binary.
pub fn runtime(name: &str) -> Runtime {
    require_root();
    let cfg = RuntimeConfig {
        state_dir: PathBuf::from(format!("/run/runcell-test/{name}")),
        cgroup_parent: format!("runcell-test-{name}"),
        agent_log: Some("debug".into()),
        ..RuntimeConfig::default()
    };
    let rt = Runtime::new(cfg)
        .expect("runcell-agent must be built (cargo build --workspace) before the tests run");
    match isolation() {
        Isolation::Jail => rt,
        other => {
            let (rt, _) = runcell_core::host::equip(rt, &Default::default());
            rt.with_default_isolation(other).unwrap_or_else(|e| {
                panic!("RUNCELL_TEST_ISOLATION={other}, but this host cannot run it: {e}")
            })
        }
    }
}

/// The backend the suite runs against: `RUNCELL_TEST_ISOLATION` (jail,
/// gvisor, microvm), the jail by default. `scripts/test.sh` runs the
/// hostile-code suites once per backend.
pub fn isolation() -> Isolation {
    match std::env::var("RUNCELL_TEST_ISOLATION") {
        Ok(s) => s
            .parse()
            .unwrap_or_else(|e| panic!("RUNCELL_TEST_ISOLATION: {e}")),
        Err(_) => Isolation::Jail,
    }
}

/// Limits with a short timeout, for tests.
pub fn limits() -> SandboxLimits {
    SandboxLimits {
        timeout: Duration::from_secs(20),
        ..SandboxLimits::default()
    }
}

pub async fn sandbox(rt: &Runtime, limits: SandboxLimits) -> Sandbox {
    rt.create(SandboxOptions {
        limits,
        ..SandboxOptions::default()
    })
    .await
    .expect("sandbox creation")
}

pub async fn sh(sb: &Sandbox, script: &str) -> ExecResult {
    sb.exec(Command::Shell(script.into()), &RunOptions::default())
        .await
        .expect("exec")
}

pub async fn py(sb: &Sandbox, code: &str) -> ExecResult {
    sb.run_code(Language::Python, code, &RunOptions::default())
        .await
        .expect("run_code")
}

pub fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Host processes whose command line contains `marker`.
pub fn host_processes_with(marker: &str) -> Vec<i32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .map(|c| String::from_utf8_lossy(&c).contains(marker))
                .unwrap_or(false)
        })
        .collect()
}

pub fn unique(prefix: &str) -> String {
    format!("{prefix}-{}-{}", std::process::id(), rand_suffix())
}

fn rand_suffix() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(
        std::time::SystemTime::now()
            .elapsed()
            .map(runcell_protocol::units::micros)
            .unwrap_or(0),
    );
    h.finish()
}
