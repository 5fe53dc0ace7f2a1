//! Landlock under the mount namespace: the last filesystem fence.
//!
//! After the agent has pivoted into the sandbox's root it restricts itself
//! (and so every process it will start) to file access *beneath that root*.
//! Inside the sandbox this changes nothing a program can see: the root is
//! the whole visible tree. What it stops is a path that leads out of the
//! tree some other way: a host directory reached through a `/proc/<pid>/root`
//! or `/proc/<pid>/cwd` magic link, a mount moved in by a trick that slipped
//! past seccomp, a directory fd from outside. Landlock judges by where an
//! inode really lives, not by the path used to reach it, and a restricted
//! process can neither mount nor `pivot_root` nor drop the domain.
//!
//! Where the kernel supports them (ABI 6), signals and abstract unix
//! sockets are scoped to the sandbox too: nothing in it can signal, or
//! connect to an abstract socket of, a process outside its domain.
//!
//! The ruleset is best effort across kernels: every right the running
//! kernel's ABI knows is handled, and the [`Confinement`] says which ABI
//! was used and whether the ruleset was fully enforced. A kernel without
//! Landlock (or gVisor, which does not implement it) gives
//! [`Confinement::abi`] 0.

use std::path::Path;

use landlock::{
    Access, AccessFs, CompatLevel, Compatible, Ruleset, RulesetAttr, RulesetCreatedAttr,
    RulesetStatus, Scope, ABI,
};
use serde::{Deserialize, Serialize};

/// The newest ABI this code has been checked against. Newer kernels are
/// used at this level (their extra rights stay unhandled, i.e. allowed).
const ABI_USED: ABI = ABI::V6;

/// Errors restricting a process.
#[derive(Debug, thiserror::Error)]
pub enum ConfineError {
    /// The ruleset could not be built or applied.
    #[error("Could not restrict the sandbox with Landlock.")]
    Ruleset(#[source] landlock::RulesetError),
    /// The root could not be opened for the rule.
    #[error("Could not open {0} for the Landlock rule.")]
    Root(String, #[source] landlock::PathFdError),
}

/// How far Landlock holds a process.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Enforcement {
    /// Every right of [`ABI_USED`] is handled by the kernel.
    Full,
    /// The kernel is older: some rights are not handled (see the ABI).
    Partial,
    /// The kernel has no Landlock (or it is disabled): nothing applied.
    None,
}

/// What [`confine_beneath`] applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Confinement {
    /// The Landlock ABI version the kernel offers (0: none).
    pub abi: u32,
    /// How far the ruleset is enforced.
    pub enforcement: Enforcement,
}

impl Confinement {
    /// Nothing applied (ABI 0).
    pub fn none() -> Self {
        Self {
            abi: 0,
            enforcement: Enforcement::None,
        }
    }

    /// A sentence for reports: what this confinement covers.
    pub fn describe(&self) -> String {
        match self.enforcement {
            Enforcement::None => "not applied (the kernel has no Landlock)".into(),
            e => format!(
                "{} (ABI {}): file access only beneath the sandbox's own root{}",
                if e == Enforcement::Full {
                    "enforced"
                } else {
                    "partly enforced"
                },
                self.abi,
                if self.abi >= 6 {
                    "; signals and abstract unix sockets scoped to the sandbox"
                } else {
                    ""
                }
            ),
        }
    }
}

/// Restricts the calling thread, and every process it starts from now on,
/// to file access beneath `root` (every right the kernel handles is
/// allowed there and nowhere else), and on ABI 6 scopes signals and
/// abstract unix sockets to its domain. Sets `no_new_privs`. Irreversible.
///
/// Call it single-threaded (the domain applies to the calling thread and
/// what it forks), after the last mount.
pub fn confine_beneath(root: &Path) -> Result<Confinement, ConfineError> {
    let abi = crate::sys::landlock_abi().unwrap_or(0);
    let access = AccessFs::from_all(ABI_USED);
    let fd = landlock::PathFd::new(root)
        .map_err(|e| ConfineError::Root(root.display().to_string(), e))?;
    let status = Ruleset::default()
        .set_compatibility(CompatLevel::BestEffort)
        .handle_access(access)
        .and_then(|r| r.scope(Scope::from_all(ABI_USED)))
        .and_then(|r| r.create())
        .and_then(|r| r.add_rule(landlock::PathBeneath::new(fd, access)))
        .and_then(|r| r.restrict_self())
        .map_err(ConfineError::Ruleset)?;
    let enforcement = match status.ruleset {
        RulesetStatus::FullyEnforced => Enforcement::Full,
        RulesetStatus::PartiallyEnforced => Enforcement::Partial,
        RulesetStatus::NotEnforced => Enforcement::None,
    };
    Ok(Confinement {
        abi: if enforcement == Enforcement::None {
            0
        } else {
            abi
        },
        enforcement,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;

    /// Runs the check `name` in a fresh process (this test binary again,
    /// running only [`child`]): a domain is irreversible and must not land
    /// on the test runner, and forking the multi-threaded runner is unsafe.
    fn in_child(name: &str, args: &[&Path], envs: &[(&str, String)]) -> std::process::Output {
        let mut cmd = Command::new(std::env::current_exe().unwrap());
        cmd.args([
            "--exact",
            "confine::tests::child",
            "--ignored",
            "--nocapture",
        ])
        .env("RUNCELL_CONFINE_CHECK", name);
        for (i, a) in args.iter().enumerate() {
            cmd.env(format!("RUNCELL_CONFINE_ARG{i}"), a);
        }
        cmd.envs(envs.iter().map(|(k, v)| (*k, v)));
        cmd.output().unwrap()
    }

    fn arg(i: usize) -> std::path::PathBuf {
        std::env::var_os(format!("RUNCELL_CONFINE_ARG{i}"))
            .expect("argument")
            .into()
    }

    /// The confined side of the tests below; run only by [`in_child`].
    #[test]
    #[ignore = "run by the other tests in a process of its own"]
    fn child() {
        let check = std::env::var("RUNCELL_CONFINE_CHECK").expect("started by in_child");
        let root = arg(0);
        let c = confine_beneath(&root).expect("confine");
        assert_eq!(c.enforcement, Enforcement::Full, "{c:?}");
        assert!(c.abi >= 1);
        match check.as_str() {
            "files" => {
                let outside = arg(1);
                assert_eq!(std::fs::read_to_string(root.join("inside")).unwrap(), "in");
                std::fs::write(root.join("new"), "x").expect("writing beneath the root");
                // The path used does not matter, where the inode lives does.
                for p in [outside.clone(), root.join("link"), "/etc/hostname".into()] {
                    let e = std::fs::read(&p).expect_err(&format!("{} was readable", p.display()));
                    assert_eq!(e.kind(), std::io::ErrorKind::PermissionDenied, "{p:?}");
                }
                // What it starts inherits the domain: a program outside the
                // root cannot even be executed.
                let e = Command::new("/bin/cat").arg(&outside).status().unwrap_err();
                assert_eq!(e.kind(), std::io::ErrorKind::PermissionDenied);
            }
            "signal" => {
                let pid: i32 = std::env::var("RUNCELL_CONFINE_PID")
                    .unwrap()
                    .parse()
                    .unwrap();
                let r = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid),
                    nix::sys::signal::Signal::SIGTERM,
                );
                assert_eq!(r, Err(nix::errno::Errno::EPERM));
            }
            other => panic!("unknown check {other}"),
        }
        println!("CONFINE-CHECK-PASSED");
    }

    fn assert_passed(out: &std::process::Output) {
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && stdout.contains("CONFINE-CHECK-PASSED"),
            "the confined process failed its checks:\n{stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    #[test]
    fn a_confined_process_reaches_only_what_lies_beneath_its_root() {
        let abi = crate::sys::landlock_abi();
        assert!(
            abi.is_ok(),
            "this test needs a kernel with Landlock: {abi:?}"
        );
        let root = tempfile::tempdir().unwrap();
        std::fs::write(root.path().join("inside"), "in").unwrap();
        // A host file outside the root, and a symlink inside pointing at it.
        let outside = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(outside.path(), "host secret").unwrap();
        std::os::unix::fs::symlink(outside.path(), root.path().join("link")).unwrap();
        assert_passed(&in_child("files", &[root.path(), outside.path()], &[]));
    }

    #[test]
    fn a_confined_process_cannot_signal_outside_its_domain() {
        let abi = crate::sys::landlock_abi().expect("Landlock");
        assert!(
            abi >= 6,
            "the CI kernel has Landlock ABI {abi}; this test needs 6"
        );
        let root = tempfile::tempdir().unwrap();
        // A process outside the domain (started before it exists).
        let mut victim = Command::new("/bin/sleep").arg("30").spawn().unwrap();
        let out = in_child(
            "signal",
            &[root.path()],
            &[("RUNCELL_CONFINE_PID", victim.id().to_string())],
        );
        let alive = victim.try_wait().unwrap().is_none();
        let _ = victim.kill();
        let _ = victim.wait();
        assert_passed(&out);
        assert!(alive, "the host process was killed");
    }
}
