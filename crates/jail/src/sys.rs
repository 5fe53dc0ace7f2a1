//! Thin wrappers over syscalls that neither std nor nix cover.

use std::io;
use std::os::fd::{FromRawFd, OwnedFd, RawFd};

/// Opens a pidfd for `pid`.
pub fn pidfd_open(pid: i32) -> io::Result<OwnedFd> {
    // SAFETY: pidfd_open takes a pid and a flags word and returns a new fd or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    let fd = RawFd::try_from(fd).map_err(|_| io::Error::other("pidfd_open returned no fd"))?;
    // SAFETY: the kernel just returned this fd to us; nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Sends `signal` to the process behind `pidfd` (immune to pid reuse).
pub fn pidfd_send_signal(pidfd: RawFd, signal: i32) -> io::Result<()> {
    // SAFETY: plain syscall with an fd, a signal number and null siginfo.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            pidfd,
            signal,
            std::ptr::null::<libc::siginfo_t>(),
            0,
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Waits until the pidfd reports that its process exited, up to `timeout_ms`.
/// Returns whether it exited.
pub fn pidfd_wait_exit(pidfd: RawFd, timeout_ms: i32) -> io::Result<bool> {
    wait_readable(pidfd, timeout_ms)
}

/// Waits until `fd` is readable (or at its end), up to `timeout_ms`.
/// Returns whether it is.
pub fn wait_readable(fd: RawFd, timeout_ms: i32) -> io::Result<bool> {
    let mut pfd = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    loop {
        // SAFETY: pfd is a valid pollfd array of length 1 for the duration of the call.
        let rc = unsafe { libc::poll(&mut pfd, 1, timeout_ms) };
        if rc < 0 {
            let err = io::Error::last_os_error();
            if err.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(err);
        }
        return Ok(rc > 0);
    }
}

/// Reaps `pid` if it is our child and has exited; ignores processes that are not ours.
pub fn reap(pid: i32) -> Option<i32> {
    let mut status = 0;
    // SAFETY: waitpid writes the status into a valid local.
    let rc = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
    (rc == pid).then_some(status)
}

/// Brings the loopback interface of the current network namespace up.
pub fn loopback_up() -> io::Result<()> {
    // SAFETY: creating a datagram socket has no memory-safety preconditions.
    let sock = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if sock < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the kernel returned a new fd that nothing else owns.
    let sock = unsafe { OwnedFd::from_raw_fd(sock) };
    use std::os::fd::AsRawFd;
    // SAFETY: ifreq is plain old data; all-zero is a valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in req.ifr_name.iter_mut().zip(b"lo\0") {
        *dst = *src as libc::c_char;
    }
    // SAFETY: SIOCGIFFLAGS reads the interface named in req and fills in its flags.
    if unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCGIFFLAGS, &mut req) } < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: ifru_flags is the active union member after SIOCGIFFLAGS.
    unsafe {
        req.ifr_ifru.ifru_flags |= UP_AND_RUNNING;
    }
    // SAFETY: SIOCSIFFLAGS reads req, which names "lo" and carries the new flags.
    if unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCSIFFLAGS, &req) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Clones the calling process into new namespaces, fork-style (the child runs
/// on a copy of the caller's stack and returns 0).
///
/// # Safety
///
/// In the child only async-signal-safe operations may run before `execve` or
/// `_exit`: the caller may be multi-threaded, and the child has one thread
/// whose copies of locks may be held forever.
pub unsafe fn clone_fork(flags: libc::c_ulong) -> io::Result<i32> {
    // SAFETY: a null stack makes the child use a copy-on-write copy of the
    // parent's stack, exactly like fork(); the caller upholds the
    // async-signal-safety contract in the child.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_clone,
            flags | libc::SIGCHLD as libc::c_ulong,
            0usize,
            0usize,
            0usize,
            0usize,
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    i32::try_from(rc).map_err(|_| io::Error::other(format!("the kernel returned pid {rc}")))
}

/// Bytes of the stack a [`clone_vfork`] child runs on until it execs.
pub const VFORK_STACK: usize = 64 * 1024;

/// Clones the calling process into new namespaces as `posix_spawn` does:
/// the child shares this process's memory (`CLONE_VM | CLONE_VFORK`) and
/// runs `main(arg)` on `stack`, and the calling thread is suspended until
/// the child calls `execve` or exits. Nothing of the caller's address space
/// is copied, and neither side takes copy-on-write faults afterwards: for
/// a large multi-threaded host (the daemon) that copy and those faults cost
/// more than the namespaces. The child's pid (in the caller's pid
/// namespace) is stored in `tid` before the child runs
/// (`CLONE_PARENT_SETTID`), so another thread can act on it meanwhile.
/// Every signal is blocked in the calling thread across the clone, so the
/// child starts with all of them blocked and no handler of this process
/// can run on the memory it shares; it must exec or exit without
/// unblocking them (exec resets the handlers; the new program unblocks).
///
/// # Safety
///
/// `main` must make only async-signal-safe calls on memory that stays valid
/// while the caller is suspended, write no memory of this process but its
/// own stack (not even through libc: a failing wrapper writes the suspended
/// thread's `errno`, which is harmless only because that thread reads
/// nothing but this call's result), and end in `execve` or `_exit`. The
/// child's fd table is a copy, as with fork.
pub unsafe fn clone_vfork(
    flags: libc::c_int,
    main: extern "C" fn(*mut libc::c_void) -> libc::c_int,
    arg: *mut libc::c_void,
    stack: &mut [u8; VFORK_STACK],
    tid: &std::sync::atomic::AtomicI32,
) -> io::Result<i32> {
    // SAFETY: sigset_t is plain data; all zeroes is a valid (empty) set.
    let (mut all, mut old): (libc::sigset_t, libc::sigset_t) =
        unsafe { (std::mem::zeroed(), std::mem::zeroed()) };
    // SAFETY: valid pointers to the local sets. Blocking every signal in
    // this thread (restored below) only delays their delivery to it.
    unsafe {
        libc::sigfillset(&mut all);
        libc::pthread_sigmask(libc::SIG_SETMASK, &all, &mut old);
    }
    // 16-byte alignment, as the x86-64 and aarch64 ABIs require.
    let end = stack.len() - (stack.as_ptr() as usize + stack.len()) % 16;
    // SAFETY: `end` is within the array; the child runs on it while this
    // thread is suspended (CLONE_VFORK), so nothing else uses the array. The
    // kernel writes the child's pid to `tid` (an atomic: another thread
    // reads it) before the child runs; the caller upholds `main`'s contract.
    let rc = unsafe {
        let top = stack.as_mut_ptr().add(end);
        libc::clone(
            main,
            top.cast(),
            flags | libc::CLONE_VM | libc::CLONE_VFORK | libc::CLONE_PARENT_SETTID | libc::SIGCHLD,
            arg,
            tid.as_ptr(),
        )
    };
    let err = io::Error::last_os_error();
    // SAFETY: restores the mask saved above.
    unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &old, std::ptr::null_mut()) };
    if rc < 0 {
        return Err(err);
    }
    Ok(rc)
}

/// Closes every file descriptor of the calling process except those in
/// `keep` (which it sorts in place). Async-signal-safe: meant for the child
/// of [`clone_fork`] or [`clone_vfork`], which inherits every descriptor of the (multi-threaded)
/// parent, including ones opened by other threads without `O_CLOEXEC` and
/// the host ends of other sandboxes' setup sockets.
///
/// # Safety
///
/// Closes descriptors that other code in this process may still believe it
/// owns: only call it in a child that will `execve` or `_exit` and uses no
/// descriptor but those in `keep`.
pub unsafe fn close_all_except(keep: &mut [RawFd]) {
    // Insertion sort: no allocation, no locks.
    for i in 1..keep.len() {
        let mut j = i;
        while j > 0 && keep[j - 1] > keep[j] {
            keep.swap(j - 1, j);
            j -= 1;
        }
    }
    let mut lo: u32 = 0;
    for &fd in keep.iter() {
        // A negative descriptor is no descriptor.
        let Ok(fd) = u32::try_from(fd) else { continue };
        if fd < lo {
            continue;
        }
        if fd > lo {
            // SAFETY: the caller guarantees nothing in this process uses the
            // descriptors being closed.
            unsafe { close_range(lo, fd - 1) };
        }
        lo = fd + 1;
    }
    // SAFETY: as above.
    unsafe { close_range(lo, MAX_FD) };
}

/// The highest descriptor number there can be (descriptors are C ints).
/// `close_range` up to it closes every one; gVisor refuses `u32::MAX`
/// (above `i32::MAX`) with EINVAL, which cost a sandbox thousands of
/// one-by-one closes per exec.
pub(crate) const MAX_FD: u32 = 0x7fff_ffff;

/// # Safety
///
/// Same contract as [`close_all_except`].
unsafe fn close_range(lo: u32, hi: u32) {
    // SAFETY: close_range takes two descriptor numbers and a flags word.
    let rc = unsafe { libc::syscall(libc::SYS_close_range, lo, hi, 0u32) };
    if rc == 0 {
        return;
    }
    // Kernels before 5.9: close one by one, up to the descriptor limit.
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into a valid local.
    let max = if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } == 0 {
        lim.rlim_cur.min(1 << 20) as u32
    } else {
        1 << 16
    };
    for fd in lo..=hi.min(max) {
        // SAFETY: closing a descriptor number; EBADF for unused ones is harmless.
        unsafe { libc::close(fd as i32) };
    }
}

/// Pids of the processes whose working directory is `dir` or below it
/// (found through `/proc/<pid>/cwd`). The spawner makes a cloned child
/// enter its sandbox's directory before it execs the agent, so a child left
/// behind by a killed host process can be found this way as well as by its
/// cgroup.
pub fn processes_in_dir(dir: &std::path::Path) -> Vec<i32> {
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            std::fs::read_link(format!("/proc/{pid}/cwd")).is_ok_and(|cwd| cwd.starts_with(dir))
        })
        .collect()
}

/// Landlock's ABI version, or why the kernel has none (ENOSYS: not built
/// in; EOPNOTSUPP: disabled at boot).
pub fn landlock_abi() -> io::Result<u32> {
    const LANDLOCK_CREATE_RULESET_VERSION: libc::c_uint = 1;
    // SAFETY: with a null attribute pointer, size 0 and the VERSION flag the
    // syscall only returns the ABI version; it creates no ruleset or fd.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_landlock_create_ruleset,
            std::ptr::null::<libc::c_void>(),
            0usize,
            LANDLOCK_CREATE_RULESET_VERSION,
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    u32::try_from(rc).map_err(|_| io::Error::other(format!("an ABI version of {rc}")))
}

/// The KVM API version `/dev/kvm` answers (12 on every kernel since 2.6.22).
pub fn kvm_api_version() -> io::Result<i32> {
    use std::os::fd::AsRawFd;
    const KVM_GET_API_VERSION: libc::c_ulong = 0xAE00;
    let kvm = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")?;
    // SAFETY: KVM_GET_API_VERSION takes no argument and returns an int; the
    // fd is open for the duration of the call.
    let rc = unsafe { libc::ioctl(kvm.as_raw_fd(), KVM_GET_API_VERSION, 0) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(rc)
}

/// Whole microseconds in `d`, saturating (for timing logs).
pub fn micros(d: std::time::Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

/// IFF_UP | IFF_RUNNING as the `short` ifreq carries (0x1 | 0x40).
#[allow(
    clippy::cast_possible_truncation,
    reason = "both flags are in the low 16 bits"
)]
const UP_AND_RUNNING: libc::c_short = (libc::IFF_UP | libc::IFF_RUNNING) as libc::c_short;

/// Loads the kernel module in `file` (a microVM guest loads its virtio
/// drivers this way before it can reach its devices).
pub fn finit_module(file: &std::fs::File) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let params = c"";
    // SAFETY: finit_module takes an open fd, a NUL-terminated parameter
    // string that outlives the call, and a flags word; it reads nothing else.
    let rc = unsafe { libc::syscall(libc::SYS_finit_module, file.as_raw_fd(), params.as_ptr(), 0) };
    if rc < 0 {
        let e = io::Error::last_os_error();
        // Already loaded (built in, or loaded as a dependency): fine.
        if e.raw_os_error() == Some(libc::EEXIST) {
            return Ok(());
        }
        return Err(e);
    }
    Ok(())
}

/// Gives the allocator's free heap memory back to the kernel (glibc's
/// `malloc_trim`): free pages inside its arenas, not only at their tops,
/// which glibc keeps by itself once a burst of large frees has raised its
/// trim threshold. Returns whether any memory was released. A long-lived
/// host (the daemon) calls it when a burst of sandboxes has ended, so its
/// resident memory returns towards its idle size.
#[cfg(target_env = "gnu")]
pub fn trim_heap() -> bool {
    // SAFETY: malloc_trim takes a padding size and touches only the
    // allocator's own state, under its own locks; no pointer is passed.
    unsafe { libc::malloc_trim(0) == 1 }
}

/// Without glibc there is no `malloc_trim`: nothing is released.
#[cfg(not(target_env = "gnu"))]
pub fn trim_heap() -> bool {
    false
}

/// Threads of this process now (`/proc/self/stat`'s 20th field), or `None`
/// where procfs cannot be read. A thread that ends leaves its allocator
/// cache and stack behind for the next trim ([`trim_heap`]).
pub fn thread_count() -> Option<usize> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // The name (field 2) is in parentheses and may hold spaces or `)`:
    // the fields after it start after the last `)`, with field 3.
    let (_, rest) = stat.rsplit_once(')')?;
    rest.split_whitespace().nth(17)?.parse().ok()
}

#[cfg(test)]
mod tests {
    /// Runs the test `name` of this module again in a process of its own
    /// (this test binary, only that test) and returns `false` there, where
    /// the caller then runs its body; `true` here, once it has passed.
    /// For tests that read process-wide state (its heap, its threads),
    /// which the other tests running beside them would change.
    fn passed_in_own_process(name: &str) -> bool {
        const CHILD: &str = "RUNCELL_SYS_TEST_CHILD";
        if std::env::var_os(CHILD).is_some() {
            return false;
        }
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                &format!("sys::tests::{name}"),
                "--test-threads=1",
                "--nocapture",
            ])
            .env(CHILD, "1")
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).to_string()
            + &String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{text}");
        assert!(text.contains("1 passed"), "{text}");
        true
    }

    /// A thread that starts is counted, and no longer once it has ended.
    #[test]
    fn threads_are_counted_as_they_start_and_end() {
        if passed_in_own_process("threads_are_counted_as_they_start_and_end") {
            return;
        }
        let before = super::thread_count().expect("a thread count");
        let (started, end) = (std::sync::Barrier::new(2), std::sync::Barrier::new(2));
        let during = std::thread::scope(|s| {
            s.spawn(|| {
                started.wait();
                end.wait();
            });
            started.wait();
            let during = super::thread_count();
            end.wait();
            during
        });
        assert_eq!(during, Some(before + 1));
        // The scope has joined the thread; the kernel may count it a moment
        // longer, until its exit is complete.
        let until = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while super::thread_count() != Some(before) {
            assert!(
                std::time::Instant::now() < until,
                "an ended thread is still counted: {:?} against {before}",
                super::thread_count()
            );
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }

    /// Resident pages of this process (`/proc/self/statm`).
    fn resident_pages() -> u64 {
        let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
        statm.split_whitespace().nth(1).unwrap().parse().unwrap()
    }

    /// Memory freed below a live allocation stays resident until trimmed:
    /// `trim_heap` gives it back. The allocations run in a process of their
    /// own: in this one, the other tests' frees decide where glibc puts the
    /// blocks.
    #[cfg(target_env = "gnu")]
    #[test]
    fn trimming_gives_freed_heap_memory_back() {
        if passed_in_own_process("trimming_gives_freed_heap_memory_back") {
            return;
        }
        // 32 MiB in chunks below glibc's mmap threshold (so on the heap),
        // each followed by a small block that stays: freed, the chunks
        // cannot join the top of the heap, which glibc trims by itself.
        let mut chunks = Vec::new();
        let mut pins = Vec::new();
        for _ in 0..512 {
            chunks.push(vec![1u8; 64 << 10]);
            pins.push(vec![2u8; 2000]);
        }
        drop(chunks);
        let freed = resident_pages();
        assert!(super::trim_heap(), "nothing was released");
        let after = resident_pages();
        assert!(pins.iter().all(|p| p[0] == 2));
        // 32 MiB is 8192 pages; at least half of them must go.
        assert!(
            freed.saturating_sub(after) > 4096,
            "resident pages: {freed} once freed, {after} once trimmed"
        );
    }
}
