//! The agent's command line, the only public surface of the `runcell-agent`
//! binary (it has no library target): it runs only as `runcell-agent init`
//! inside a sandbox the host prepared, and refuses to be run by hand before
//! touching anything. These run without root.
//!
//! The protocol loop, exec and file operations are private to the binary;
//! they are tested through the host (`crates/core/tests`, as root).

use std::process::{Command, Output};

fn agent(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_runcell-agent"))
        .args(args)
        .output()
        .expect("run runcell-agent")
}

#[test]
fn version_names_the_agent_and_its_version() {
    let out = agent(&["--version"]);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        format!("runcell-agent {}\n", env!("CARGO_PKG_VERSION"))
    );
    assert!(out.stderr.is_empty(), "{out:?}");
}

#[test]
fn run_by_hand_it_refuses_with_a_usage_error_and_says_who_starts_it() {
    for args in [&[][..], &["serve"][..], &["--help"][..], &["INIT"][..]] {
        let out = agent(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {out:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("runs inside a sandbox and is started by runcell"),
            "{args:?}: {err}"
        );
        assert!(out.stdout.is_empty(), "{args:?}: {out:?}");
    }
}

#[test]
fn a_fork_server_run_by_hand_without_its_socket_exits_at_once() {
    let out = agent(&["fork-server"]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("fork server") && err.contains("not a socket"),
        "{err}"
    );
    assert!(out.stdout.is_empty(), "{out:?}");
}
