//! The gVisor backend, for real: sandboxes made by `runsc` through
//! `Runtime::with_backend`. They need root and an installed runsc
//! (scripts/install-deps.sh installs it); without either they fail.

mod common;

use std::path::PathBuf;
use std::sync::Arc;

use common::*;
use runcell_core::backend::{probe, GvisorBackend};
use runcell_core::{find_agent, Runtime, RuntimeConfig};

/// A runtime whose sandboxes are gVisor containers, with state and
/// cgroups private to this test binary.
fn gvisor_runtime(name: &str) -> (Runtime, PathBuf) {
    require_root();
    if let Err(why) = probe(None) {
        panic!("these tests need gVisor: {why}");
    }
    let state = PathBuf::from(format!("/run/runcell-test/gvisor-{name}"));
    let cgroup = format!("runcell-test-gvisor-{name}");
    let agent = find_agent()
        .expect("runcell-agent must be built (cargo build -p runcell-agent) before the tests run");
    let backend = GvisorBackend::new(
        None,
        agent,
        state.clone(),
        cgroup.clone(),
        Some("debug".into()),
    );
    let cfg = RuntimeConfig {
        state_dir: state.clone(),
        cgroup_parent: cgroup,
        agent_log: Some("debug".into()),
        ..RuntimeConfig::default()
    };
    (Runtime::with_backend(cfg, Arc::new(backend)), state)
}

#[tokio::test(flavor = "multi_thread")]
async fn exec_runs_python_under_gvisor() {
    let (rt, _) = gvisor_runtime("exec");
    let sb = sandbox(&rt, limits()).await;
    let r = sh(&sb, "/usr/bin/python3 -c 'import sys; print(\"out\"); print(\"err\", file=sys.stderr); sys.exit(3)'; ").await;
    eprintln!("{r:?}");
    let r = sh(&sb, "dmesg | head -3; id; hostname; ls -la /run/runcell; cat /proc/self/status | grep -i seccomp").await;
    eprintln!("{}\n{}", text(&r.stdout), text(&r.stderr));
    sb.destroy().await.unwrap();
}
