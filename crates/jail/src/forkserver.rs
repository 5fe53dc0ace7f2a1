//! The agent fork server (host side, jail): one started `runcell-agent`
//! from which each sandbox's first process is forked, instead of an
//! `execve` of the agent per sandbox.
//!
//! Why: every `execve` of the agent paid for the dynamic loader's
//! relocations and glibc's and libgcc's start-up, whose `cpuid` probing
//! alone costs about 1 ms of CPU per process in a virtual machine (each
//! `cpuid` is a trap to the hypervisor), on top of the exec itself: about
//! 1.5 ms of an 8 ms agent per sandbox (`perf record -a`). A long-lived
//! host (the daemon, a library runtime) asks the fork server instead;
//! one-shot use (`runcell run`, template builds) execs the agent as before,
//! since starting a fork server for one sandbox costs that exec and a fork.
//!
//! The fork server is `runcell-agent fork-server`, started by the host with
//! an empty environment (the agent's log filter aside), one end of a socket
//! pair on its standard input, and nothing else. It is single-threaded and
//! stays small (it allocates nothing between requests). A request carries
//! the clone flags (the sandbox's namespaces), the sandbox's directory and,
//! as `SCM_RIGHTS`, the four descriptors the agent starts with (setup
//! socket, listening socket, log, `/dev/null`). It clones with those
//! namespaces and `CLONE_PARENT`, so the new process is the host's child
//! exactly as an exec'd agent is (the host waits for it, `pidfd`s it, and
//! it outlives the fork server), answers its pid, and waits for the next.
//! The child does what the exec path's child does before its `execve`
//! (`spawn::child_exec`): keeps only its four descriptors, says `C`, waits
//! for the host's id maps and cgroup (`G`), acknowledges (`A`), becomes root
//! of its user namespace, enters the sandbox's directory, resets signal
//! dispositions, places its descriptors at 0-4, and then runs the agent's
//! `init` path from [`crate::inside::bootstrap`] on, as if it had been
//! exec'd (`runcell-agent`'s `main`).
//!
//! A forked agent shares the fork server's address-space layout, stack
//! canary and hash keys with its siblings. No sandbox can reach another's
//! agent, but so that a layout learned in one sandbox is worth little, a
//! fork server serves [`FORKS_PER_SERVER`] sandboxes and is then replaced
//! by a fresh exec (new layout). Should the fork server die or answer
//! wrongly, the host drops it, execs that sandbox's agent itself, and starts
//! a new fork server for the next one. The fork server exits when the host
//! closes its end (the host died or dropped it).

use std::io::{self, Read, Write};
use std::os::fd::{FromRawFd, IntoRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;

use crate::sys;

/// Sandboxes one fork server starts before a fresh one replaces it.
pub const FORKS_PER_SERVER: u32 = 64;

/// The agent's argument that makes it a fork server.
pub const FORK_SERVER_ARG: &str = "fork-server";

/// How long the host waits for the fork server to take a request and
/// answer it (a clone: well under a millisecond); as long as it waits for
/// a sandbox's first process to say it runs.
const ANSWER_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// The most bytes of a sandbox directory's path in a request.
const MAX_DIR: usize = 4096;

/// Why the fork server could not start a sandbox's first process.
#[derive(Debug, thiserror::Error)]
pub enum ForkServerError {
    /// The fork server could not be started.
    #[error("The agent fork server {0} could not be started.")]
    Start(PathBuf, #[source] io::Error),
    /// Talking to the fork server failed (it died, or answered nonsense).
    #[error("Lost contact with the agent fork server.")]
    Lost(#[source] io::Error),
    /// The fork server's clone failed.
    #[error("The agent fork server could not create the sandbox's namespaces.")]
    Clone(#[source] io::Error),
}

/// The host's handle on a fork server, started on first use.
#[derive(Debug)]
pub struct ForkServer {
    agent: PathBuf,
    agent_log: Option<String>,
    running: Mutex<Option<Running>>,
}

#[derive(Debug)]
struct Running {
    sock: UnixStream,
    child: Child,
    forks: u32,
}

impl Running {
    /// Stops it off the caller's path (a create's): [`Running::stop`] on
    /// a thread of its own.
    fn retire(self) {
        let spawned = std::thread::Builder::new()
            .name("runcell-forksrv-stop".into())
            .spawn(move || self.stop());
        if let Err(e) = spawned {
            tracing::warn!("could not stop a retired agent fork server: {e}");
        }
    }

    /// Closes the socket (the fork server exits on the end of it) and
    /// collects the process.
    fn stop(self) {
        let Running {
            sock, mut child, ..
        } = self;
        drop(sock);
        // It exits at once on the end of its socket; a wedged one is killed.
        for _ in 0..200 {
            if !matches!(child.try_wait(), Ok(None)) {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        let _ = child.kill();
        let _ = child.wait();
    }
}

/// The descriptors a sandbox's first process starts with.
#[derive(Debug, Clone, Copy)]
pub struct AgentFds {
    /// The setup socket (the child's end).
    pub setup: RawFd,
    /// The agent's listening socket.
    pub listener: RawFd,
    /// The agent's log (its standard error).
    pub log: RawFd,
    /// `/dev/null` (its standard input and output).
    pub devnull: RawFd,
}

impl ForkServer {
    /// A fork server of `agent`, whose sandboxes log with `agent_log`
    /// (`RUST_LOG` syntax); started on the first [`ForkServer::fork`].
    pub fn new(agent: PathBuf, agent_log: Option<String>) -> Self {
        Self {
            agent,
            agent_log,
            running: Mutex::new(None),
        }
    }

    /// The agent binary it runs.
    pub fn agent(&self) -> &Path {
        &self.agent
    }

    /// Forks a sandbox's first process into new namespaces (`flags`, the
    /// `CLONE_NEW*` set, with a network namespace always) with `fds`, to
    /// live in `dir`; gives its pid. The process is this process's child.
    /// On an error the caller execs the agent itself; the next call starts
    /// a new fork server.
    pub fn fork(
        &self,
        flags: libc::c_int,
        fds: AgentFds,
        dir: &Path,
    ) -> Result<i32, ForkServerError> {
        let mut running = self
            .running
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if running
            .as_ref()
            .is_some_and(|r| r.forks >= FORKS_PER_SERVER)
        {
            if let Some(old) = running.take() {
                old.retire();
            }
        }
        if running.is_none() {
            *running = Some(self.start()?);
        }
        let server = running.as_mut().expect("started above");
        match request(&mut server.sock, flags, fds, dir) {
            Ok(Ok(pid)) => {
                server.forks += 1;
                Ok(pid)
            }
            // The clone itself failed: the fork server is fine.
            Ok(Err(e)) => Err(ForkServerError::Clone(e)),
            Err(e) => {
                if let Some(old) = running.take() {
                    old.retire();
                }
                Err(ForkServerError::Lost(e))
            }
        }
    }

    fn start(&self) -> Result<Running, ForkServerError> {
        let err = |e| ForkServerError::Start(self.agent.clone(), e);
        let (ours, theirs) = UnixStream::pair().map_err(err)?;
        // A wedged fork server must not wedge every create behind it: past
        // this it is given up (and killed), and the agent exec'd.
        ours.set_read_timeout(Some(ANSWER_WAIT)).map_err(err)?;
        ours.set_write_timeout(Some(ANSWER_WAIT)).map_err(err)?;
        let mut cmd = Command::new(&self.agent);
        cmd.arg(FORK_SERVER_ARG)
            .env_clear()
            .stdin(Stdio::from(OwnedFd::from(theirs)))
            .stdout(Stdio::null())
            .stderr(Stdio::inherit());
        if let Some(filter) = &self.agent_log {
            cmd.env("RUST_LOG", filter);
        }
        let child = cmd.spawn().map_err(err)?;
        tracing::debug!(pid = child.id(), "agent fork server started");
        Ok(Running {
            sock: ours,
            child,
            forks: 0,
        })
    }
}

impl Drop for ForkServer {
    fn drop(&mut self) {
        let running = self
            .running
            .get_mut()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        if let Some(r) = running {
            r.stop();
        }
    }
}

/// Sends one request and reads its answer: the pid, or the clone's error
/// (outer error: the conversation failed).
fn request(
    sock: &mut UnixStream,
    flags: libc::c_int,
    fds: AgentFds,
    dir: &Path,
) -> io::Result<io::Result<i32>> {
    let dir = dir.as_os_str().as_bytes();
    if dir.len() > MAX_DIR {
        return Ok(Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "the sandbox directory's path is too long",
        )));
    }
    let mut msg = Vec::with_capacity(8 + dir.len());
    msg.extend_from_slice(&flags.to_le_bytes());
    msg.extend_from_slice(&(dir.len() as u32).to_le_bytes());
    msg.extend_from_slice(dir);
    let passed = [fds.setup, fds.listener, fds.log, fds.devnull];
    crate::socket::send_with_fds(sock, &msg, &passed)?;
    let mut answer = [0u8; 4];
    sock.read_exact(&mut answer)?;
    let n = i32::from_le_bytes(answer);
    Ok(if n > 0 {
        Ok(n)
    } else {
        Err(io::Error::from_raw_os_error(-n))
    })
}

/// The fork server's loop (`runcell-agent fork-server`, its socket on
/// standard input). Returns `Ok(false)` when the host closed the socket
/// (the fork server then exits), and `Ok(true)` in a forked child, which
/// has become a sandbox's first process (see the module's documentation)
/// and goes on as the agent's `init`.
pub fn serve() -> io::Result<bool> {
    let stdin = nix::sys::stat::fstat(std::io::stdin()).map_err(io::Error::from)?;
    if stdin.st_mode & libc::S_IFMT != libc::S_IFSOCK {
        return Err(io::Error::other(
            "runcell starts the fork server with its socket as standard input, which is not a socket here",
        ));
    }
    if let Err(e) = own_tcp_tables() {
        tracing::warn!("sandboxes share the host's TCP connection table: {e}");
    }
    // Read once here, so that no forked agent reads it again.
    crate::inside::warm_up();
    // SAFETY: the host started the fork server with its socket as standard
    // input; nothing else in this process owns descriptor 0.
    let mut sock = UnixStream::from(unsafe { OwnedFd::from_raw_fd(0) });
    // Standard output is /dev/null; standard error stays the host's, where
    // the fork server's own errors go.
    loop {
        let handled = match receive(&mut sock) {
            Ok(None) => return Ok(false),
            Ok(Some((flags, dir, fds))) => handle(&mut sock, flags, &dir, fds),
            Err(e) => Err(e),
        };
        match handled {
            Ok(Handled::Served) => {}
            Ok(Handled::Child) => {
                // Closed already (close_all_except in become_agent), and its
                // number is the child's standard input now: not closed again.
                let _ = sock.into_raw_fd();
                return Ok(true);
            }
            // The host went away mid-request: as at the end of the socket.
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::BrokenPipe | io::ErrorKind::ConnectionReset
                ) =>
            {
                return Ok(false)
            }
            Err(e) => return Err(e),
        }
    }
}

/// Buckets in the TCP connection table of each sandbox's network namespace
/// (the kernel rounds up to a power of two): room for a busy test server,
/// and half as many connections in `TIME_WAIT` at once.
pub const SANDBOX_TCP_BUCKETS: u32 = 1024;

/// The sysctl that gives network namespaces made from the writer's a TCP
/// table of their own (Linux 6.1).
const CHILD_TCP_TABLE: &str = "/proc/sys/net/ipv4/tcp_child_ehash_entries";

/// Moves the fork server into a network namespace of its own in which
/// [`CHILD_TCP_TABLE`] is set, so that every sandbox's network namespace,
/// made by this process's clones, gets a TCP connection table of its own.
///
/// Why: a network namespace that shares the host's table (the kernel's
/// default) makes its teardown walk that whole table for connections in
/// `TIME_WAIT` (262,144 buckets on a 24 GiB host): about 0.5 ms of a
/// kernel worker's CPU for every sandbox deleted, half of the namespace's
/// teardown. With a table of its own, only its own buckets are walked. The
/// setting is made here rather than on the host, where it would change
/// every container's network namespace; the sandbox's namespace is new and
/// its own either way (network namespaces have no hierarchy: the fork
/// server's is neither reachable from a sandbox nor used for anything).
fn own_tcp_tables() -> io::Result<()> {
    if !Path::new(CHILD_TCP_TABLE).exists() {
        return Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "this kernel has no per-namespace TCP tables (Linux 6.1 and later)",
        ));
    }
    nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET)?;
    // /proc/sys/net is the namespace of whoever opens it: now the new one.
    std::fs::write(CHILD_TCP_TABLE, SANDBOX_TCP_BUCKETS.to_string())
}

/// What [`handle`] did: answered a request, or is the forked child.
enum Handled {
    Served,
    Child,
}

/// Clones for one request and answers it (in the fork server), or
/// prepares the child to go on as the agent (in the child).
fn handle(
    sock: &mut UnixStream,
    flags: libc::c_int,
    dir: &std::ffi::CStr,
    fds: Vec<OwnedFd>,
) -> io::Result<Handled> {
    let Ok(fds) = <[OwnedFd; 4]>::try_from(fds) else {
        reply(sock, -libc::EINVAL)?;
        return Ok(Handled::Served);
    };
    let clone_flags = namespaces(flags) | libc::CLONE_PARENT as libc::c_ulong;
    // SAFETY: this process is single-threaded (the agent starts no
    // thread before it serves), so the child may run any code; it
    // returns to the agent's `main` and never into the loop.
    match unsafe { sys::clone_fork(clone_flags) } {
        Ok(0) => {
            // The socket goes with every other descriptor the child does
            // not keep (close_all_except in become_agent).
            become_agent(fds.map(IntoRawFd::into_raw_fd), dir);
            Ok(Handled::Child)
        }
        Ok(pid) => {
            drop(fds);
            reply(sock, pid).map(|()| Handled::Served)
        }
        Err(e) => {
            drop(fds);
            reply(sock, -e.raw_os_error().unwrap_or(libc::EIO)).map(|()| Handled::Served)
        }
    }
}

/// Only the namespace flags of a request are honoured, and a sandbox
/// always gets a network namespace of its own: the fork server's is not
/// the host's ([`own_tcp_tables`]), and one shared would join sandboxes.
fn namespaces(flags: libc::c_int) -> libc::c_ulong {
    let allowed = libc::CLONE_NEWUSER
        | libc::CLONE_NEWPID
        | libc::CLONE_NEWNS
        | libc::CLONE_NEWIPC
        | libc::CLONE_NEWUTS;
    ((flags & allowed) | libc::CLONE_NEWNET) as libc::c_ulong
}

fn reply(sock: &mut UnixStream, n: i32) -> io::Result<()> {
    sock.write_all(&n.to_le_bytes())
}

type Request = (libc::c_int, std::ffi::CString, Vec<OwnedFd>);

/// Reads one request; `None` at the end of the socket.
fn receive(sock: &mut UnixStream) -> io::Result<Option<Request>> {
    let mut header = [0u8; 8];
    let (got, fds) = crate::socket::recv_with_fds(sock, &mut header)?;
    if got == 0 {
        return Ok(None);
    }
    sock.read_exact(&mut header[got..])?;
    let flags = i32::from_le_bytes([header[0], header[1], header[2], header[3]]);
    let len = u32::from_le_bytes([header[4], header[5], header[6], header[7]]) as usize;
    if len > MAX_DIR {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "a request's directory is too long",
        ));
    }
    let mut dir = vec![0u8; len];
    sock.read_exact(&mut dir)?;
    let dir = std::ffi::CString::new(dir).map_err(|_| {
        io::Error::new(io::ErrorKind::InvalidData, "a NUL in a request's directory")
    })?;
    Ok(Some((flags, dir, fds)))
}

/// The forked child, up to where an exec'd agent would start: the same
/// steps as the exec path's child before its `execve` (see
/// `spawn::child_exec`). Exits (126, or 127 with the errno reported on the
/// setup socket) on any failure.
fn become_agent(fds: [RawFd; 4], dir: &std::ffi::CStr) {
    let [setup, listener, log, devnull] = fds;
    // SAFETY: single-threaded; every descriptor but the four kept is one
    // this child will never use (the fork server's socket among them), and
    // each call below is a plain system call on valid descriptors and on
    // locals.
    unsafe {
        let mut keep = [setup, listener, log, devnull];
        sys::close_all_except(&mut keep);
        // Above 10 first, so the dup2s below cannot clobber them.
        let high = |fd: RawFd| libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 10);
        let (setup, listener, log, devnull) =
            (high(setup), high(listener), high(log), high(devnull));
        // Say it runs (the host then writes its id maps and moves it into
        // the sandbox's cgroup), and wait for the go-ahead. A host that gave
        // up, or died, makes the write fail or the read see the end.
        let running = b'C';
        let mut go = 0u8;
        if setup < 0
            || listener < 0
            || log < 0
            || devnull < 0
            || libc::send(setup, (&running as *const u8).cast(), 1, libc::MSG_NOSIGNAL) != 1
            || libc::read(setup, (&mut go as *mut u8).cast(), 1) != 1
            || go != b'G'
        {
            libc::_exit(126);
        }
        let ack = b'A';
        if libc::send(setup, (&ack as *const u8).cast(), 1, libc::MSG_NOSIGNAL) != 1 {
            libc::_exit(126);
        }
        if libc::syscall(libc::SYS_setgroups, 0, std::ptr::null::<libc::gid_t>()) != 0
            || libc::syscall(libc::SYS_setresgid, 0, 0, 0) != 0
            || libc::syscall(libc::SYS_setresuid, 0, 0, 0) != 0
            || libc::chdir(dir.as_ptr()) != 0
        {
            crate::spawn::report_errno_and_exit(setup);
        }
        // Ignored signals pass to what the agent starts: none may be
        // (the fork server was started by a host that may ignore some).
        // Broken pipes are errors, not deaths, as for any Rust program
        // (its start-up ignores SIGPIPE; an exec'd agent's did).
        crate::inside::reset_signal_dispositions();
        libc::signal(libc::SIGPIPE, libc::SIG_IGN);
        if libc::dup2(devnull, 0) < 0
            || libc::dup2(devnull, 1) < 0
            || libc::dup2(log, 2) < 0
            || libc::dup2(setup, 3) < 0
            || libc::dup2(listener, 4) < 0
        {
            crate::spawn::report_errno_and_exit(setup);
        }
        // The high copies go (an exec would have closed them).
        let mut placed = [0, 1, 2, 3, 4];
        sys::close_all_except(&mut placed);
    }
}
