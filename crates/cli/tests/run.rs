//! `runcell run` end to end, every sandbox made by the `runcell` process
//! itself (`--daemon never`): the real binary, real sandboxes. Needs root.
//! The cases are in `run_cases/`; `run_daemon.rs` runs them through a daemon.

use std::process::Command;
use std::time::Duration;

mod run_cases;

const STATE: &str = "/run/runcell-test/cli";

/// `runcell` run in its own process.
#[derive(Debug)]
pub struct Runner;

fn runner() -> Runner {
    let euid = nix::unistd::geteuid().as_raw();
    assert_eq!(
        euid, 0,
        "these tests create real sandboxes and must run as root (CI runs them as root)"
    );
    Runner
}

impl Runner {
    fn cmd(&self) -> Command {
        let mut c = Command::new(env!("CARGO_BIN_EXE_runcell"));
        c.env("RUNCELL_STATE_DIR", STATE)
            // A daemon running on this host must not take these runs.
            .env("RUNCELL_RUN_DAEMON", "never");
        c
    }

    /// Sandboxes of killed runs die with their owner (the next run sweeps
    /// their directories): nothing to wait for.
    fn nothing_left(&self, _within: Duration) -> bool {
        true
    }
}
