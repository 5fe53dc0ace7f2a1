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
    fn supervise_as(&mut self, uid: u32, gid: u32, keep_background: bool) -> &mut Self;

    /// [`supervise_as`](Self::supervise_as) where orphans do not come back
    /// to the supervisor (gVisor): it joins the exec's own cgroup first and
    /// kills what is listed there ([`inside::ExecGroupFds`]; the descriptors
    /// must stay open until `spawn` returns).
    fn supervise_in_group(
        &mut self,
        uid: u32,
        gid: u32,
        keep_background: bool,
        group: inside::ExecGroupFds,
    ) -> &mut Self;

    /// The child gets `fds[i]` at descriptor `3 + i` (without close-on-exec)
    /// and then runs as `uid`/`gid` ([`inside::drop_privileges`]). At most
    /// [`MAX_EXTRA_FDS`] descriptors: `spawn` fails with `EINVAL` for more.
    /// The descriptors must stay open until `spawn` returns (a closed one
    /// makes `spawn` fail with `EBADF`).
    fn as_user_with_fds(&mut self, uid: u32, gid: u32, fds: &[BorrowedFd<'_>]) -> &mut Self;
}

impl SandboxCommand for Command {
    fn supervise_as(&mut self, uid: u32, gid: u32, keep_background: bool) -> &mut Self {
        // SAFETY: supervise_exec makes only async-signal-safe syscalls and
        // never allocates; the closure captures plain integers.
        unsafe { self.pre_exec(move || inside::supervise_exec(uid, gid, keep_background, None)) }
    }

    fn supervise_in_group(
        &mut self,
        uid: u32,
        gid: u32,
        keep_background: bool,
        group: inside::ExecGroupFds,
    ) -> &mut Self {
        // SAFETY: as supervise_as; the closure captures two descriptor
        // numbers more, which the supervisor only writes to and reads.
        unsafe {
            self.pre_exec(move || inside::supervise_exec(uid, gid, keep_background, Some(group)))
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
        let status = Command::new("/bin/sh")
            .args(["-c", "exit 7"])
            .supervise_as(uid, gid, false)
            .status()
            .unwrap();
        assert_eq!(status.code(), Some(7));
    }
}
