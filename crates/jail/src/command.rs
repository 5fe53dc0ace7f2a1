//! Safe ways to start a process as the sandbox user.
//!
//! [`std::os::unix::process::CommandExt::pre_exec`] is `unsafe`: its closure
//! runs between `fork` and `exec` of a possibly multi-threaded process, where
//! only async-signal-safe calls are allowed. The closures here call only
//! [`inside`](crate::inside) functions that keep that rule, on values
//! captured by copy, so callers (the agent) need no `unsafe` of their own.

use std::os::fd::{AsRawFd, BorrowedFd, RawFd};
use std::os::unix::process::CommandExt as _;
use std::process::Command;

use crate::inside;

/// The most descriptors [`SandboxCommand::as_user_with_fds`] places (the
/// size of [`inside::place_fds`]'s scratch array).
pub const MAX_EXTRA_FDS: usize = 8;

/// Turning a [`Command`] into one that runs as the sandbox user.
pub trait SandboxCommand {
    /// The child becomes the supervisor of one exec
    /// ([`inside::supervise_exec`]): it forks the command, which runs as
    /// `uid`/`gid` ([`inside::drop_privileges`]), and it kills whatever the
    /// command leaves behind when it exits, unless `keep_background`.
    /// `spawn` returns once the supervisor has forked the command.
    ///
    /// Where orphans do not come back to the supervisor (gVisor), `group`
    /// is the exec's own cgroup: the supervisor joins it first and kills
    /// what is listed there ([`inside::ExecGroupFds`]; the descriptors must
    /// stay open until `spawn` returns).
    ///
    /// The command is `image` (std's own program and arguments are not
    /// used): std sets up its standard streams, directory and the rest as
    /// usual, then the supervisor starts it.
    fn supervise_as(
        &mut self,
        uid: u32,
        gid: u32,
        keep_background: bool,
        group: Option<inside::ExecGroupFds>,
        image: inside::ExecImage,
    ) -> &mut Self;

    /// The child gets `fds[i]` at descriptor `3 + i` (without close-on-exec)
    /// and then runs as `uid`/`gid` ([`inside::drop_privileges`]). At most
    /// [`MAX_EXTRA_FDS`] descriptors: `spawn` fails with `EINVAL` for more.
    /// The descriptors must stay open until `spawn` returns (a closed one
    /// makes `spawn` fail with `EBADF`).
    fn as_user_with_fds(&mut self, uid: u32, gid: u32, fds: &[BorrowedFd<'_>]) -> &mut Self;
}

impl SandboxCommand for Command {
    fn supervise_as(
        &mut self,
        uid: u32,
        gid: u32,
        keep_background: bool,
        group: Option<inside::ExecGroupFds>,
        image: inside::ExecImage,
    ) -> &mut Self {
        // SAFETY: supervise_exec makes only async-signal-safe syscalls and
        // never allocates; the closure captures plain integers (ids, the
        // group's two descriptor numbers, which the supervisor only writes
        // to and reads) and the image, laid out before the fork and only
        // read in the child.
        unsafe {
            self.pre_exec(move || {
                inside::supervise_exec(uid, gid, keep_background, group, &image, None)
            })
        }
    }

    fn as_user_with_fds(&mut self, uid: u32, gid: u32, fds: &[BorrowedFd<'_>]) -> &mut Self {
        // Copied into a fixed array now, before the fork: the child may not
        // allocate. Too many descriptors fail in the child with EINVAL.
        let mut raw: [RawFd; MAX_EXTRA_FDS] = [-1; MAX_EXTRA_FDS];
        let too_many = fds.len() > MAX_EXTRA_FDS;
        let n = fds.len().min(MAX_EXTRA_FDS);
        for (slot, fd) in raw.iter_mut().zip(fds) {
            *slot = fd.as_raw_fd();
        }
        // SAFETY: place_fds and drop_privileges make only async-signal-safe
        // syscalls on the copied descriptor numbers and ids; nothing is
        // allocated or locked in the child.
        unsafe {
            self.pre_exec(move || {
                if too_many {
                    return Err(std::io::Error::from_raw_os_error(libc::EINVAL));
                }
                inside::place_fds(&raw[..n])?;
                inside::drop_privileges(uid, gid)
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;
    use std::process::Stdio;

    fn me() -> (u32, u32) {
        (
            nix::unistd::getuid().as_raw(),
            nix::unistd::getgid().as_raw(),
        )
    }

    #[test]
    fn a_child_gets_its_descriptors_at_3_and_up() {
        let (uid, gid) = me();
        let (r, w) = nix::unistd::pipe().unwrap();
        let out = Command::new("/bin/sh")
            .args(["-c", "echo through-fd-4 >&4"])
            .stdout(Stdio::null())
            .as_user_with_fds(uid, gid, &[r.as_fd(), w.as_fd()])
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        drop(w);
        let mut got = String::new();
        std::io::Read::read_to_string(&mut std::fs::File::from(r), &mut got).unwrap();
        assert_eq!(got, "through-fd-4\n");
    }

    #[test]
    fn more_descriptors_than_places_fail_the_spawn() {
        let (uid, gid) = me();
        let (r, _w) = nix::unistd::pipe().unwrap();
        let fds = vec![r.as_fd(); MAX_EXTRA_FDS + 1];
        let err = Command::new("/bin/true")
            .as_user_with_fds(uid, gid, &fds)
            .spawn()
            .unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::EINVAL));
    }

    #[test]
    fn a_supervised_command_reports_its_status() {
        let (uid, gid) = me();
        let argv = ["sh", "-c", "exit 7"].map(String::from);
        let image = inside::ExecImage::new("sh", &argv, &env()).unwrap();
        let status = Command::new("/bin/sh")
            .supervise_as(uid, gid, false, None, image)
            .status()
            .unwrap();
        assert_eq!(status.code(), Some(7));
    }

    fn env() -> std::collections::BTreeMap<String, String> {
        [("PATH".to_string(), "/usr/bin:/bin".to_string())].into()
    }

    #[test]
    fn a_supervised_command_gets_its_arguments_environment_and_streams() {
        let (uid, gid) = me();
        let argv = ["sh", "-c", "echo \"$0 $1 $GREETING\"", "zero", "one"].map(String::from);
        let mut env = env();
        env.insert("GREETING".into(), "hello".into());
        let image = inside::ExecImage::new("sh", &argv, &env).unwrap();
        let out = Command::new("ignored")
            .stdout(Stdio::piped())
            .supervise_as(uid, gid, false, None, image)
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        assert_eq!(String::from_utf8_lossy(&out.stdout), "zero one hello\n");
    }

    #[test]
    fn a_command_that_cannot_start_fails_the_spawn() {
        let (uid, gid) = me();
        // Not on PATH: found wanting before the fork.
        let argv = ["no-such-program-here".to_string()];
        let err = inside::ExecImage::new("no-such-program-here", &argv, &env()).unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::NotFound);
        // A path that is not executable: execve refuses it in the child,
        // and the spawn reports why.
        let dir = std::env::temp_dir().join(format!("runcell-noexec-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("data");
        std::fs::write(&file, "not a program").unwrap();
        let path = file.to_str().unwrap().to_string();
        let argv = [path.clone()];
        let image = inside::ExecImage::new(&path, &argv, &env()).unwrap();
        let err = Command::new("ignored")
            .supervise_as(uid, gid, false, None, image)
            .spawn()
            .unwrap_err();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(err.raw_os_error(), Some(libc::EACCES), "{err}");
    }

    #[test]
    fn an_image_that_cannot_run_hands_over_to_its_fallback() {
        let (uid, gid) = me();
        let dir = std::env::temp_dir().join(format!("runcell-fallback-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("data");
        std::fs::write(&file, "not a program").unwrap();
        let path = file.to_str().unwrap().to_string();
        let fallback = || {
            let argv = ["sh", "-c", "echo \"fell back $0 $WHICH\"", "zero"].map(String::from);
            let mut env = env();
            env.insert("WHICH".into(), "second".into());
            inside::ExecImage::new("sh", &argv, &env).unwrap()
        };
        // The first cannot be run (no execute permission): the fallback
        // runs, with its own arguments and environment.
        let first = inside::ExecImage::new(&path, std::slice::from_ref(&path), &env()).unwrap();
        let out = Command::new("ignored")
            .stdout(Stdio::piped())
            .supervise_as(uid, gid, false, None, first.or_else(fallback()))
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        assert_eq!(
            String::from_utf8_lossy(&out.stdout),
            "fell back zero second\n"
        );
        // One that runs leaves its fallback alone.
        let argv = ["sh", "-c", "echo first"].map(String::from);
        let first = inside::ExecImage::new("sh", &argv, &env()).unwrap();
        let out = Command::new("ignored")
            .stdout(Stdio::piped())
            .supervise_as(uid, gid, false, None, first.or_else(fallback()))
            .output()
            .unwrap();
        assert_eq!(String::from_utf8_lossy(&out.stdout), "first\n");
        // Neither can: the spawn says why the fallback could not.
        let gone = dir.join("gone").to_str().unwrap().to_string();
        let first = inside::ExecImage::new(&path, std::slice::from_ref(&path), &env()).unwrap();
        let second = inside::ExecImage::new(&gone, std::slice::from_ref(&gone), &env()).unwrap();
        let err = Command::new("ignored")
            .supervise_as(uid, gid, false, None, first.or_else(second))
            .spawn()
            .unwrap_err();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(err.raw_os_error(), Some(libc::ENOENT), "{err}");
    }
}
