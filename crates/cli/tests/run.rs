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

/// The first sandbox id (a UUID) in `line`, whatever colours surround it.
fn sandbox_id_in(line: &str) -> Option<String> {
    let b = line.as_bytes();
    (0..b.len().saturating_sub(35)).find_map(|i| {
        let s = &line.get(i..i + 36)?;
        let ok = s.char_indices().all(|(j, c)| {
            if [8, 13, 18, 23].contains(&j) {
                c == '-'
            } else {
                c.is_ascii_hexdigit()
            }
        });
        ok.then(|| s.to_string())
    })
}

/// Ctrl-C (or SIGTERM) while `runcell run` is still making its sandbox is
/// caught like one during the run: the program never runs on, the sandbox
/// is destroyed, nothing is left for a later sweep, and the exit status is
/// 130. The signal is sent at the moment the jail says the sandbox is
/// prepared (its debug log), before it is started.
#[test]
fn an_interrupt_while_the_sandbox_is_made_destroys_it() {
    use std::io::BufRead as _;
    let _ = runner();
    let state = format!("/run/runcell-test/cli-interrupt-{}", std::process::id());
    for (round, sig) in [
        nix::sys::signal::Signal::SIGINT,
        nix::sys::signal::Signal::SIGTERM,
    ]
    .into_iter()
    .cycle()
    .take(6)
    .enumerate()
    {
        let mut child = Command::new(env!("CARGO_BIN_EXE_runcell"))
            .env("RUNCELL_STATE_DIR", &state)
            .env("RUNCELL_RUN_DAEMON", "never")
            .env("RUNCELL_LOG", "runcell_jail=debug")
            .args([
                "run",
                "python",
                "-c",
                "import time; print('ran'); time.sleep(30)",
            ])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("runcell runs");
        let mut lines = std::io::BufReader::new(child.stderr.take().unwrap()).lines();
        let mut seen = Vec::new();
        let id = loop {
            let line = lines
                .next()
                .unwrap_or_else(|| panic!("round {round}: no 'sandbox prepared' line: {seen:#?}"))
                .unwrap();
            let hit = line.contains("sandbox prepared");
            seen.push(line);
            if hit {
                break sandbox_id_in(seen.last().unwrap()).expect("the line names the sandbox");
            }
        };
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(child.id() as i32), sig).unwrap();
        seen.extend(lines.map_while(Result::ok));
        let out = child.wait_with_output().unwrap();
        assert_eq!(
            out.status.code(),
            Some(130),
            "round {round}: {sig} while the sandbox was made ended runcell with {}; stderr: {seen:#?}",
            out.status
        );
        assert!(
            seen.iter()
                .any(|l| l.contains("interrupted; the sandbox was destroyed")),
            "round {round}: {seen:#?}"
        );
        assert_eq!(
            String::from_utf8_lossy(&out.stdout),
            "",
            "round {round}: the program ran on"
        );
        let left: Vec<_> = std::fs::read_dir(&state)
            .map(|d| d.flatten().map(|e| e.file_name()).collect())
            .unwrap_or_default();
        assert!(left.is_empty(), "round {round}: left in {state}: {left:?}");
        for controller in ["memory", "pids"] {
            let cg = format!("/sys/fs/cgroup/{controller}/runcell/{id}");
            assert!(
                !std::path::Path::new(&cg).exists(),
                "round {round}: {cg} is left"
            );
        }
    }
    let _ = std::fs::remove_dir(&state);
}
