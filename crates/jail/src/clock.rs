//! A microVM guest's clock, set on the host's word.
//!
//! A guest restored from a memory image, or resumed after a pause, wakes
//! with the clock it had when it stopped: hours behind after a long
//! hibernation. Its agent learns the host's time over the control port,
//! but the seccomp filter it installs on all its threads refuses
//! `clock_settime` (so that no sandboxed process sets a clock). A process
//! forked before the filter, that holds nothing but the read end of a pipe
//! and does nothing but set the clock to what comes through it, does it
//! instead.

use std::io::{self, Read};
use std::os::fd::OwnedFd;

/// Forks the clock keeper and returns the pipe to it: each line written
/// (`<nanoseconds since the epoch>\n`) sets `CLOCK_REALTIME`; it exits at
/// the pipe's end.
///
/// Call it while the process is single-threaded (the child runs ordinary
/// code after the fork) and before the seccomp filter is installed.
pub fn clock_keeper() -> io::Result<OwnedFd> {
    let (read, write) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)?;
    // SAFETY: the caller is single-threaded (documented above), so the
    // child's copy of the process is consistent and may allocate.
    match unsafe { nix::unistd::fork() }? {
        nix::unistd::ForkResult::Child => {
            drop(write);
            keep(std::fs::File::from(read));
            // SAFETY: ends the child at once, without running the parent's
            // exit handlers on its copy of their state.
            unsafe { libc::_exit(0) }
        }
        nix::unistd::ForkResult::Parent { .. } => {
            drop(read);
            Ok(write)
        }
    }
}

/// Sets the clock to each time read, until the pipe ends.
fn keep(mut pipe: std::fs::File) {
    let mut line = Vec::new();
    let mut byte = [0u8; 1];
    while let Ok(1) = pipe.read(&mut byte) {
        if byte[0] != b'\n' {
            if line.len() < 32 {
                line.push(byte[0]);
            }
            continue;
        }
        if let Some((tv_sec, tv_nsec)) = parse(&line) {
            let ts = libc::timespec { tv_sec, tv_nsec };
            // SAFETY: reads the local timespec only. A failure (not
            // allowed, out of range) leaves the clock as it was.
            unsafe { libc::clock_settime(libc::CLOCK_REALTIME, &ts) };
        }
        line.clear();
    }
}

/// A time as the keeper reads it: decimal nanoseconds since the epoch, as
/// seconds and nanoseconds.
fn parse(line: &[u8]) -> Option<(i64, i64)> {
    let nanos: u128 = std::str::from_utf8(line).ok()?.trim().parse().ok()?;
    let secs = i64::try_from(nanos / 1_000_000_000).ok()?;
    let sub = i64::try_from(nanos % 1_000_000_000).ok()?;
    Some((secs, sub))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_are_decimal_nanoseconds() {
        assert_eq!(
            parse(b"1764590000123456789"),
            Some((1_764_590_000, 123_456_789))
        );
        assert!(parse(b"").is_none());
        assert!(parse(b"12x").is_none());
        assert!(parse(&[b'9'; 40]).is_none());
    }
}
