//! The exec fork server (sandbox side, gVisor): a small copy of the agent,
//! forked while the agent is still single-threaded, that starts each
//! exec's supervisor ([`crate::inside::supervise_exec`]) for it.
//!
//! Why: under gVisor's ptrace platform a process is expensive to copy. The
//! agent, once its runtime runs, is a large multi-threaded process; forking
//! it for every exec's supervisor (and breaking copy-on-write on the pages
//! the child touches) cost about 9 ms of each exec. The fork server is
//! forked at start-up, before any thread exists, so it is small, and being
//! single-threaded it may allocate freely after its own forks. An exec is
//! one message to it: the supervisor's settings and program
//! ([`crate::inside::ExecImage`]), and the exec's descriptors (standard
//! streams, a report pipe, its cgroup) passed as `SCM_RIGHTS`.
//!
//! The supervisor is the fork server's child (this gVisor ignores
//! `CLONE_PARENT`), so the agent cannot wait for it: the supervisor reports
//! on a pipe that it started the command (its own pid and the command's)
//! or why it could not, and later the command's wait status, just before
//! it exits the same way. [`Zygote::spawn`] blocks until the first report,
//! as [`std::process::Command::spawn`] does; [`Started::report`] then
//! gives the exit (or the end of the pipe, when the supervisor was
//! killed). The fork server reaps a supervisor only when the agent says so
//! ([`Zygote::reap`]), after it has read that exit: until then the
//! supervisor's pid cannot be reused, so the agent may signal it. The reap
//! message brings a pipe's write end, which the fork server closes once it
//! has collected the supervisor: the agent answers an exec only then, so an
//! exec that was answered has left no zombie behind (as one the agent
//! forked and waited for itself). A supervisor still exiting when the
//! message comes is looked for again on a short, growing timer, so none
//! stays a zombie waiting for some later message.
//!
//! The fork itself is taken off the exec's path where it can be: the fork
//! server keeps a spare supervisor, forked ahead and waiting for a request
//! of its own. Requests travel on a socket of their own (the exec socket),
//! read by the spare when there is one and by the fork server otherwise;
//! reap messages on another (the control socket), read by the fork server
//! only. A spare that took a request says so on a pipe once its command
//! has started (its first report), and the fork server makes no new spare
//! while that exec runs (a fork then would compete with the command
//! starting). It makes one at start-up, for the sandbox's first exec, and
//! after each reap once the sandbox has run two execs (one that runs a
//! single exec, the common one-shot run, pays for no spare it never uses);
//! an exec that finds no spare is forked for at once, as before. Under
//! gVisor's ptrace platform that fork is about 2 ms of an exec's start
//! (measured in the agent: 10.3 ms from request to command started
//! without a spare, 8.5 with one).
//!
//! The fork server holds no descriptor but its sockets, runs with the
//! agent's credentials, seccomp filter, Landlock domain and process-limit
//! cgroup (it is one process of the sandbox's count), is not dumpable (the
//! agent's setting when it forks) and dies with the agent
//! (`PR_SET_PDEATHSIG`); a spare dies with the fork server until it takes
//! a request. Should it be gone, [`Zygote::spawn`] says so
//! ([`ZygoteError::Gone`]) and the agent forks supervisors itself again.

use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, IntoRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::Mutex;
use std::time::Duration;

use crate::inside::{ExecGroupFds, ExecImage};

/// The most bytes of one request (settings, program, arguments and
/// environment); the agent's own request limits keep far below it.
const MAX_REQUEST: usize = 256 << 20;

/// How long [`Zygote::spawn`] waits for the supervisor's report.
const REPORT_WAIT: Duration = Duration::from_secs(10);

/// A request's first bytes: a tag and the length of what follows.
const MAGIC: u32 = u32::from_le_bytes(*b"RCZ1");
/// A request to reap a supervisor: this tag and its pid, with the write
/// end of a pipe (closed once it is collected) as `SCM_RIGHTS`.
const MAGIC_REAP: u32 = u32::from_le_bytes(*b"RCZ0");

/// The report's kinds: the command started, or the errno of why not.
const STARTED: i32 = 1;
const FAILED: i32 = 2;
/// The command's wait status, the supervisor's last report.
const EXITED: i32 = 3;

/// Why an exec could not be started through the fork server.
#[derive(Debug, thiserror::Error)]
pub enum ZygoteError {
    /// The fork server is gone or its socket broke: start supervisors
    /// another way.
    #[error("The exec fork server is gone.")]
    Gone(#[source] io::Error),
    /// The supervisor could not start the command (the program is missing,
    /// not executable, the directory does not exist...).
    #[error("The command could not start.")]
    Start {
        /// Why.
        #[source]
        error: io::Error,
        /// Comes to its end once the fork server has collected the
        /// supervisor that reported it (`None`: there was none); the exec
        /// should be answered only then (see [`Zygote::reap`]).
        collected: Option<OwnedFd>,
    },
    /// As `Start`, before the supervisor (when there was one) is reaped.
    #[error("The command could not start.")]
    Failed {
        /// Why.
        #[source]
        error: io::Error,
        /// The supervisor that reported it (0 when the fork server could
        /// not fork one).
        supervisor: i32,
    },
    /// `start` was called with more than one thread running.
    #[error("The exec fork server must be started while the agent is single-threaded ({0} threads run).")]
    Threaded(usize),
    /// Setting it up failed.
    #[error("Could not start the exec fork server.")]
    Setup(#[source] io::Error),
}

/// The agent's end of the fork server.
#[derive(Debug)]
pub struct Zygote {
    /// Exec requests (read by the spare supervisor, or the fork server).
    exec: Mutex<UnixStream>,
    /// Reap messages (read by the fork server).
    control: Mutex<UnixStream>,
    pid: i32,
}

/// The fork server's descriptors for its sockets (placed there at start).
const CONTROL_FD: RawFd = 3;
const EXEC_FD: RawFd = 4;

/// In a spare that took a request: the write end of its pipe to the fork
/// server, written (and closed by the supervisor's descriptor sweep) with
/// its first report. -1 elsewhere.
static TAKEN_FD: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(-1);

/// What a spare writes on its pipe when it took a request.
const TAKEN: u8 = b'T';

/// Execs a sandbox runs before the fork server keeps a spare after each.
const SPARE_AFTER: u64 = 2;

/// One exec to start: what [`crate::SandboxCommand::supervise_as`] takes,
/// plus what std would otherwise set up in the child (standard streams and
/// working directory).
#[derive(Debug)]
pub struct Spawn<'a> {
    /// The sandbox user the command runs as.
    pub uid: u32,
    /// Its group.
    pub gid: u32,
    /// Leave what the command starts running when it exits.
    pub keep_background: bool,
    /// The command's working directory.
    pub cwd: &'a str,
    /// The command's program, arguments and environment.
    pub image: &'a ExecImage,
    /// The command's standard input (read end of a pipe, say).
    pub stdin: BorrowedFd<'a>,
    /// The command's standard output.
    pub stdout: BorrowedFd<'a>,
    /// The command's standard error.
    pub stderr: BorrowedFd<'a>,
    /// The exec's own cgroup, as for [`crate::inside::supervise_exec`].
    pub group: Option<ExecGroupFds>,
}

/// A started exec.
#[derive(Debug)]
pub struct Started {
    /// The supervisor, the fork server's child.
    pub supervisor: i32,
    /// The command, the supervisor's child.
    pub command: i32,
    /// Where the supervisor reports the command's wait status as it exits
    /// ([`exit_status`] reads it).
    pub report: OwnedFd,
}

/// The command's wait status from a supervisor's last report (`bytes`,
/// what was read from [`Started::report`] up to its end); `None` when the
/// supervisor ended without one (it was killed).
pub fn exit_status(bytes: &[u8]) -> Option<libc::c_int> {
    let b: &[u8; 12] = bytes.get(..12)?.try_into().ok()?;
    let word = |i: usize| i32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
    (word(0) == EXITED).then(|| word(4))
}

impl Zygote {
    /// Forks the fork server. Call only while the process is
    /// single-threaded (checked: [`ZygoteError::Threaded`] otherwise).
    pub fn start() -> Result<Self, ZygoteError> {
        let threads = std::fs::read_dir("/proc/self/task")
            .map_err(ZygoteError::Setup)?
            .count();
        if threads != 1 {
            return Err(ZygoteError::Threaded(threads));
        }
        let (exec, exec_server) = UnixStream::pair().map_err(ZygoteError::Setup)?;
        let (control, control_server) = UnixStream::pair().map_err(ZygoteError::Setup)?;
        // SAFETY: the process is single-threaded (checked above), so the
        // child is a complete copy that may allocate and lock; it runs
        // `serve`, which never returns.
        match unsafe { libc::fork() } {
            -1 => Err(ZygoteError::Setup(io::Error::last_os_error())),
            0 => {
                drop((exec, control));
                serve(control_server, exec_server)
            }
            pid => Ok(Self {
                exec: Mutex::new(exec),
                control: Mutex::new(control),
                pid,
            }),
        }
    }

    /// The fork server's pid.
    pub fn pid(&self) -> i32 {
        self.pid
    }

    /// Starts one exec: its supervisor, which starts the command. Returns
    /// once the command runs (or could not start). The caller must watch
    /// for the supervisor's exit before it lets its reaper run.
    pub fn spawn(&self, req: &Spawn<'_>) -> Result<Started, ZygoteError> {
        let (report_r, report_w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)
            .map_err(|e| ZygoteError::Setup(e.into()))?;
        let payload = encode(req);
        let mut fds = vec![
            req.stdin.as_raw_fd(),
            req.stdout.as_raw_fd(),
            req.stderr.as_raw_fd(),
            report_w.as_raw_fd(),
        ];
        if let Some(g) = req.group {
            fds.extend([g.procs_write, g.procs_read]);
        }
        let len = u32::try_from(payload.len())
            .ok()
            .filter(|&n| n as usize <= MAX_REQUEST)
            .ok_or_else(|| ZygoteError::Start {
                error: io::Error::new(
                    io::ErrorKind::InvalidInput,
                    "the command's arguments and environment are too large",
                ),
                collected: None,
            })?;
        let mut header = [0u8; 8];
        header[..4].copy_from_slice(&MAGIC.to_le_bytes());
        header[4..].copy_from_slice(&len.to_le_bytes());
        {
            let sock = self.exec.lock().unwrap_or_else(|p| p.into_inner());
            crate::socket::send_with_fds(&sock, &header, &fds).map_err(ZygoteError::Gone)?;
            (&*sock).write_all(&payload).map_err(ZygoteError::Gone)?;
        }
        drop(report_w);
        match read_report(report_r) {
            // The supervisor exits after its report: asked to be reaped now;
            // the caller answers once `collected` says it is.
            Err(ZygoteError::Failed { error, supervisor }) => {
                let collected = match supervisor {
                    0 => None,
                    pid => Some(self.reap(pid)?),
                };
                Err(ZygoteError::Start { error, collected })
            }
            r => r,
        }
    }
}

impl Zygote {
    /// Lets the fork server reap `supervisor`, whose exit the agent has read
    /// from its report: its pid may be reused from then on. Returns a pipe's
    /// read end that comes to its end once the fork server has collected
    /// the supervisor (or is gone).
    pub fn reap(&self, supervisor: i32) -> Result<OwnedFd, ZygoteError> {
        let (done_r, done_w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)
            .map_err(|e| ZygoteError::Setup(e.into()))?;
        let mut msg = [0u8; 8];
        msg[..4].copy_from_slice(&MAGIC_REAP.to_le_bytes());
        msg[4..].copy_from_slice(&supervisor.to_le_bytes());
        let sock = self.control.lock().unwrap_or_else(|p| p.into_inner());
        crate::socket::send_with_fds(&sock, &msg, &[done_w.as_raw_fd()])
            .map_err(ZygoteError::Gone)?;
        Ok(done_r)
    }
}

/// Waits for a supervisor's first report.
fn read_report(report: OwnedFd) -> Result<Started, ZygoteError> {
    let mut buf = [0u8; 12];
    let mut got = 0;
    let mut file = std::fs::File::from(report);
    let deadline = std::time::Instant::now() + REPORT_WAIT;
    while got < buf.len() {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        let ms = i32::try_from(left.as_millis()).unwrap_or(i32::MAX);
        match crate::sys::wait_readable(file.as_raw_fd(), ms) {
            Ok(true) => {}
            Ok(false) => {
                return Err(ZygoteError::Gone(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "no report from the exec supervisor",
                )))
            }
            Err(e) => return Err(ZygoteError::Gone(e)),
        }
        match file.read(&mut buf[got..]) {
            Ok(0) => {
                return Err(ZygoteError::Gone(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "the exec supervisor ended before it reported",
                )))
            }
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(ZygoteError::Gone(e)),
        }
    }
    let word = |i: usize| i32::from_le_bytes([buf[i], buf[i + 1], buf[i + 2], buf[i + 3]]);
    match word(0) {
        STARTED => Ok(Started {
            supervisor: word(4),
            command: word(8),
            report: file.into(),
        }),
        _ => Err(ZygoteError::Failed {
            error: io::Error::from_raw_os_error(word(4)),
            supervisor: word(8),
        }),
    }
}

/// Writes a report (a fixed 12 bytes, below `PIPE_BUF`: one write).
/// Async-signal-safe.
pub(crate) fn report(fd: RawFd, kind: i32, a: i32, b: i32) {
    let mut buf = [0u8; 12];
    buf[..4].copy_from_slice(&kind.to_le_bytes());
    buf[4..8].copy_from_slice(&a.to_le_bytes());
    buf[8..].copy_from_slice(&b.to_le_bytes());
    // SAFETY: writes from a live stack buffer of its length.
    unsafe { libc::write(fd, buf.as_ptr().cast(), buf.len()) };
    // A spare's first report: the fork server may make the next one now,
    // and this supervisor no longer dies with it (as one it forked for a
    // request does not).
    let taken = TAKEN_FD.swap(-1, std::sync::atomic::Ordering::Relaxed);
    if taken >= 0 {
        let byte = [TAKEN];
        // SAFETY: writes one byte from a live stack buffer; prctl on scalars.
        unsafe {
            libc::write(taken, byte.as_ptr().cast(), 1);
            libc::prctl(libc::PR_SET_PDEATHSIG, 0, 0, 0, 0);
        }
    }
}

/// Reports the command's wait status (the supervisor exits right after).
pub(crate) fn report_exited(fd: RawFd, status: libc::c_int) {
    report(fd, EXITED, status, 0);
}

/// Reports that the command started: this process's pid and `command`'s.
pub(crate) fn report_started(fd: RawFd, command: libc::pid_t) {
    // SAFETY: getpid has no preconditions.
    let me = unsafe { libc::getpid() };
    report(fd, STARTED, me, command);
}

/// The request's payload: ids, flags, then length-prefixed strings (the
/// directory, then the program, the arguments and the environment of the
/// image and, with [`FALLBACK`] set, of its fallback).
fn encode(req: &Spawn<'_>) -> Vec<u8> {
    let mut out = Vec::with_capacity(256);
    let put = |out: &mut Vec<u8>, n: u32| out.extend_from_slice(&n.to_le_bytes());
    put(&mut out, req.uid);
    put(&mut out, req.gid);
    let fallback = req.image.fallback();
    put(
        &mut out,
        u32::from(req.keep_background)
            | (u32::from(req.group.is_some()) << 1)
            | if fallback.is_some() { FALLBACK } else { 0 },
    );
    let string = |out: &mut Vec<u8>, s: &[u8]| {
        out.extend_from_slice(&(s.len() as u32).to_le_bytes());
        out.extend_from_slice(s);
    };
    string(&mut out, req.cwd.as_bytes());
    for image in std::iter::once(req.image).chain(fallback) {
        let (path, args, env) = image.parts();
        string(&mut out, path.to_bytes());
        for list in [args, env] {
            out.extend_from_slice(&(list.len() as u32).to_le_bytes());
            for s in list {
                string(&mut out, s.to_bytes());
            }
        }
    }
    out
}

/// The request's flag saying a fallback image follows the image.
const FALLBACK: u32 = 4;

/// An image as [`encode`] wrote it, at `at` of `buf`.
fn take_image(buf: &[u8], at: &mut usize) -> io::Result<ExecImage> {
    let path = take_cstring(buf, at)?;
    let args = take_list(buf, at)?;
    let env = take_list(buf, at)?;
    Ok(ExecImage::from_parts(path, args, env))
}

/// A decoded request, in the fork server.
struct Request {
    uid: u32,
    gid: u32,
    keep_background: bool,
    cwd: std::ffi::CString,
    image: ExecImage,
    stdio: [OwnedFd; 3],
    report: OwnedFd,
    group: Option<(OwnedFd, OwnedFd)>,
}

/// Reads `n` bytes at `at` of `buf`, moving `at`.
fn take<'b>(buf: &'b [u8], at: &mut usize, n: usize) -> io::Result<&'b [u8]> {
    let bad = || io::Error::new(io::ErrorKind::InvalidData, "a malformed exec request");
    let end = at.checked_add(n).ok_or_else(bad)?;
    let s = buf.get(*at..end).ok_or_else(bad)?;
    *at = end;
    Ok(s)
}

fn take_u32(buf: &[u8], at: &mut usize) -> io::Result<u32> {
    let b = take(buf, at, 4)?;
    Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
}

fn take_cstring(buf: &[u8], at: &mut usize) -> io::Result<std::ffi::CString> {
    let n = take_u32(buf, at)? as usize;
    std::ffi::CString::new(take(buf, at, n)?)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "a NUL byte in an exec request"))
}

fn take_list(buf: &[u8], at: &mut usize) -> io::Result<Vec<std::ffi::CString>> {
    let n = take_u32(buf, at)? as usize;
    // Each string takes at least its 4-byte length: a count beyond that is
    // malformed (and must not reserve memory for it).
    if n > buf.len() / 4 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "a malformed exec request",
        ));
    }
    (0..n).map(|_| take_cstring(buf, at)).collect()
}

/// What the agent asks of the fork server.
enum Message {
    /// Start an exec.
    Spawn(Box<Request>),
    /// Reap this supervisor, then close this descriptor.
    Reap(libc::pid_t, OwnedFd),
}

/// Receives one message; `None` when the agent closed its end.
fn receive(sock: &mut UnixStream) -> io::Result<Option<Message>> {
    let mut header = [0u8; 8];
    let (got, mut fds) = crate::socket::recv_with_fds(sock, &mut header)?;
    if got == 0 {
        return Ok(None);
    }
    sock.read_exact(&mut header[got..])?;
    let bad = |what: &str| io::Error::new(io::ErrorKind::InvalidData, what.to_string());
    let second = [header[4], header[5], header[6], header[7]];
    match u32::from_le_bytes([header[0], header[1], header[2], header[3]]) {
        MAGIC_REAP if fds.len() == 1 => {
            let done = fds
                .pop()
                .ok_or_else(|| bad("a reap message without its pipe"))?;
            return Ok(Some(Message::Reap(i32::from_le_bytes(second), done)));
        }
        MAGIC => {}
        _ => return Err(bad("an exec request without its tag")),
    }
    let len = u32::from_le_bytes(second) as usize;
    if len > MAX_REQUEST {
        return Err(bad("an exec request too large"));
    }
    let mut payload = vec![0u8; len];
    sock.read_exact(&mut payload)?;
    let at = &mut 0;
    let uid = take_u32(&payload, at)?;
    let gid = take_u32(&payload, at)?;
    let flags = take_u32(&payload, at)?;
    let cwd = take_cstring(&payload, at)?;
    let mut image = take_image(&payload, at)?;
    if flags & FALLBACK != 0 {
        image = image.or_else(take_image(&payload, at)?);
    }
    let grouped = flags & 2 != 0;
    if fds.len() != if grouped { 6 } else { 4 } {
        return Err(bad("an exec request with the wrong descriptors"));
    }
    let group = if grouped {
        let read = fds.pop();
        let write = fds.pop();
        write.zip(read)
    } else {
        None
    };
    let report = fds.pop().ok_or_else(|| bad("no report pipe"))?;
    let stderr = fds.pop().ok_or_else(|| bad("no stderr"))?;
    let stdout = fds.pop().ok_or_else(|| bad("no stdout"))?;
    let stdin = fds.pop().ok_or_else(|| bad("no stdin"))?;
    Ok(Some(Message::Spawn(Box::new(Request {
        uid,
        gid,
        keep_background: flags & 1 != 0,
        cwd,
        image,
        stdio: [stdin, stdout, stderr],
        report,
        group,
    }))))
}

/// The fork server's loop: one supervisor per request (a spare's, or
/// forked for it), until the agent closes its end.
fn serve(control: UnixStream, exec: UnixStream) -> ! {
    // SAFETY: prctl, close_range, fcntl, open and dup2 on scalars and a
    // static path; the sockets stay open (moved to CONTROL_FD and EXEC_FD,
    // by way of descriptors above both, everything above is closed).
    let mut control = unsafe {
        libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0);
        let (c, e) = (control.into_raw_fd(), exec.into_raw_fd());
        let high_c = libc::fcntl(c, libc::F_DUPFD_CLOEXEC, 16);
        let high_e = libc::fcntl(e, libc::F_DUPFD_CLOEXEC, 16);
        if high_c < 0
            || high_e < 0
            || libc::dup3(high_c, CONTROL_FD, libc::O_CLOEXEC) != CONTROL_FD
            || libc::dup3(high_e, EXEC_FD, libc::O_CLOEXEC) != EXEC_FD
        {
            libc::_exit(1);
        }
        // Originals among the standard descriptors (an agent without them)
        // are closed here, those above the sockets by the sweep below.
        for fd in [c, e] {
            if fd < CONTROL_FD {
                libc::close(fd);
            }
        }
        libc::syscall(
            libc::SYS_close_range,
            (EXEC_FD + 1) as u32,
            crate::sys::MAX_FD,
            0u32,
        );
        // Standard descriptors the agent lacks are /dev/null here, so the
        // descriptors requests bring always land above the sockets.
        for fd in 0..3 {
            if libc::fcntl(fd, libc::F_GETFD) < 0 {
                let null = libc::open(c"/dev/null".as_ptr(), libc::O_RDWR);
                if null != fd && null >= 0 {
                    libc::dup2(null, fd);
                    libc::close(null);
                }
            }
        }
        UnixStream::from_raw_fd(CONTROL_FD)
    };
    // This process changes no disposition and no capability from here on:
    // its supervisors reset and drop only what it has.
    crate::inside::note_inherited();
    // SAFETY: getpid has no preconditions.
    let me = unsafe { libc::getpid() };
    let mut exiting = Exiting::default();
    // The spare for the sandbox's first exec, made while the agent sets up.
    let mut spare = fork_spare(me, &mut exiting);
    // Supervisors started so far (spares taken and forks for a request).
    let mut started: u64 = 0;
    loop {
        let watched = spare.as_ref().map_or(EXEC_FD, |s| s.taken.as_raw_fd());
        let (control_ready, other_ready) = wait_either(CONTROL_FD, watched, exiting.next_look());
        // Reap messages first: the agent answers the exec it ends once the
        // supervisor is collected, so the spare made here is there for the
        // next exec.
        if control_ready {
            match receive(&mut control) {
                Ok(Some(Message::Reap(pid, done))) => {
                    exiting.add(pid, done);
                    if spare.is_none() && started >= SPARE_AFTER {
                        spare = fork_spare(me, &mut exiting);
                    }
                }
                Ok(None) => stop(0, ""),
                Ok(Some(Message::Spawn(_))) => stop(1, "an exec request on the control socket"),
                Err(e) => stop(1, &e.to_string()),
            }
            continue;
        }
        exiting.collect();
        if !other_ready {
            continue;
        }
        if let Some(s) = spare.take() {
            if s.was_taken() {
                started += 1;
                continue;
            }
            // It ended without a request: the agent closed its end, or a
            // request was malformed, or it was killed. Either way the
            // stream may be cut mid-request: stop (the agent then forks
            // supervisors itself).
            // SAFETY: waits for our own child, which has closed its pipe.
            unsafe { libc::waitpid(s.pid, std::ptr::null_mut(), 0) };
            stop(0, "");
        }
        // No spare: this process reads the request and forks for it.
        let mut sock = std::mem::ManuallyDrop::new(
            // SAFETY: EXEC_FD is this process's open exec socket; the
            // wrapper is never dropped, so it stays open.
            unsafe { UnixStream::from_raw_fd(EXEC_FD) },
        );
        let req = match receive(&mut sock) {
            Ok(Some(Message::Spawn(r))) => r,
            Ok(None) => stop(0, ""),
            Ok(Some(Message::Reap(..))) => stop(1, "a reap message on the exec socket"),
            Err(e) => stop(1, &e.to_string()),
        };
        started += 1;
        // SAFETY: this process is single-threaded (it was forked from a
        // single-threaded agent and starts no thread), so the child is a
        // complete copy that may allocate; it runs `supervisor`, which
        // never returns.
        let pid = unsafe { libc::fork() };
        match pid {
            0 => {
                exiting.forget_in_child();
                supervisor(*req)
            }
            p if p < 0 => {
                let errno = io::Error::last_os_error()
                    .raw_os_error()
                    .unwrap_or(libc::EAGAIN);
                report(req.report.as_raw_fd(), FAILED, errno, 0);
            }
            _ => {}
        }
        // The request's descriptors close here: only the supervisor holds them.
    }
}

/// Ends the fork server (saying why, when it is an error).
fn stop(code: i32, why: &str) -> ! {
    if code != 0 {
        eprintln!("runcell-agent exec fork server: {why}; stopping");
    }
    // SAFETY: _exit(2) ends the process without running any Rust code.
    unsafe { libc::_exit(code) }
}

/// Blocks until `a` or `b` is readable (or at its end), or for at most
/// `timeout_ms` (-1: no limit); says which were ready.
fn wait_either(a: RawFd, b: RawFd, timeout_ms: i32) -> (bool, bool) {
    let mut fds = [
        libc::pollfd {
            fd: a,
            events: libc::POLLIN,
            revents: 0,
        },
        libc::pollfd {
            fd: b,
            events: libc::POLLIN,
            revents: 0,
        },
    ];
    loop {
        // SAFETY: fds is a valid pollfd array of length 2 for the call.
        let rc = unsafe { libc::poll(fds.as_mut_ptr(), 2, timeout_ms) };
        if rc >= 0 {
            return (fds[0].revents != 0, fds[1].revents != 0);
        }
        if io::Error::last_os_error().kind() != io::ErrorKind::Interrupted {
            stop(1, "poll failed");
        }
    }
}

/// Supervisors the agent let go whose exit is not collected yet, each with
/// the pipe end whose closing tells the agent it is.
///
/// One exits right after its last report, so it is usually collected at
/// once. One that is not (still dying: its memory is being freed) must not
/// hold up the next exec, nor stay a zombie until some later message: the
/// fork server looks again after 1 ms, then ever less often, up to every
/// [`LOOK_MAX_MS`].
#[derive(Default)]
struct Exiting {
    waiting: Vec<(libc::pid_t, OwnedFd)>,
    /// How long the next wait for a message may last before looking again.
    patience_ms: i32,
}

/// The longest the fork server leaves an exiting supervisor unlooked at.
const LOOK_MAX_MS: i32 = 100;

impl Exiting {
    /// The agent let `pid` go; `done` is closed once it is collected.
    fn add(&mut self, pid: libc::pid_t, done: OwnedFd) {
        self.waiting.push((pid, done));
        for _ in 0..REAP_TRIES {
            self.collect();
            if self.waiting.last().is_none_or(|(p, _)| *p != pid) {
                break;
            }
            std::thread::sleep(std::time::Duration::from_micros(100));
        }
        self.patience_ms = 1;
    }

    /// Collects every one that has exited, closing its pipe end.
    fn collect(&mut self) {
        self.waiting.retain(|(p, _)| !collected(*p));
    }

    /// How long to wait for a message before looking again (-1: no limit,
    /// none is waited for); each call doubles the next.
    fn next_look(&mut self) -> i32 {
        if self.waiting.is_empty() {
            return -1;
        }
        let t = self.patience_ms.clamp(1, LOOK_MAX_MS);
        self.patience_ms = (t * 2).min(LOOK_MAX_MS);
        t
    }

    /// In a child just forked: closes its copies of the pipe ends, so that
    /// only the fork server's close tells the agent.
    fn forget_in_child(&mut self) {
        self.waiting.clear();
    }
}

/// A supervisor forked ahead, waiting for a request on the exec socket.
struct Spare {
    pid: libc::pid_t,
    /// Where it says it took one (or, at its end, that it is gone).
    taken: OwnedFd,
}

impl Spare {
    /// Reads what the spare said: whether it took a request (`false`: it
    /// is gone without one).
    fn was_taken(&self) -> bool {
        let mut byte = [0u8; 1];
        loop {
            // SAFETY: reads one byte into a live stack buffer.
            let n = unsafe { libc::read(self.taken.as_raw_fd(), byte.as_mut_ptr().cast(), 1) };
            if n >= 0 || io::Error::last_os_error().kind() != io::ErrorKind::Interrupted {
                return n == 1 && byte[0] == TAKEN;
            }
        }
    }
}

/// Forks a spare supervisor; `None` when the fork fails (the process
/// limit is full, say): requests are then forked for as they come.
fn fork_spare(server: libc::pid_t, exiting: &mut Exiting) -> Option<Spare> {
    let (taken_r, taken_w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).ok()?;
    // SAFETY: this process is single-threaded, so the child is a complete
    // copy that may allocate; it runs `spare`, which never returns.
    match unsafe { libc::fork() } {
        0 => {
            drop(taken_r);
            exiting.forget_in_child();
            spare(server, taken_w)
        }
        pid if pid > 0 => Some(Spare {
            pid,
            taken: taken_r,
        }),
        _ => None,
    }
}

/// A spare: dies with the fork server until it takes a request (so the
/// agent's requests never wait on a socket nobody reads), then says so
/// with its first report and becomes that request's supervisor.
fn spare(server: libc::pid_t, taken: OwnedFd) -> ! {
    // SAFETY: prctl and getppid on scalars.
    unsafe {
        libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0);
        if libc::getppid() != server {
            libc::_exit(0);
        }
    }
    let mut sock = std::mem::ManuallyDrop::new(
        // SAFETY: EXEC_FD is the exec socket this copy of the fork server
        // holds open; the wrapper is never dropped.
        unsafe { UnixStream::from_raw_fd(EXEC_FD) },
    );
    match receive(&mut sock) {
        Ok(Some(Message::Spawn(req))) => {
            TAKEN_FD.store(taken.into_raw_fd(), std::sync::atomic::Ordering::Relaxed);
            supervisor(*req)
        }
        // The agent closed its end, or sent something else: the fork
        // server sees this pipe end and stops.
        // SAFETY: _exit(2) ends the process without running any Rust code.
        _ => unsafe { libc::_exit(0) },
    }
}

/// How many times (100 µs apart) the fork server looks for a supervisor's
/// exit right after the agent let it go, before looking on a timer.
const REAP_TRIES: usize = 20;

/// Whether the fork server's child `pid` has exited, and is now collected.
fn collected(pid: libc::pid_t) -> bool {
    // SAFETY: waits for our own child without blocking; writes nothing
    // (null status).
    unsafe { libc::waitpid(pid, std::ptr::null_mut(), libc::WNOHANG) != 0 }
}

/// The supervisor, just forked: sets up what std would in a child (standard
/// streams, directory, signal dispositions), then supervises the command.
fn supervisor(req: Request) -> ! {
    let fail = |report: RawFd, e: io::Error| -> ! {
        report_failure(report, &e);
        // SAFETY: _exit(2) ends the process without running any Rust code.
        unsafe { libc::_exit(127) }
    };
    // The request's descriptors were received above 3 (the fork server's
    // socket), all close-on-exec: none collides with the standard streams
    // placed here or the cgroup list `supervise_exec` places at 3.
    let report = req.report.as_raw_fd();
    // SAFETY: dup2/signal/sigprocmask/chdir on scalars and the request's
    // live strings; this process is a single-threaded copy.
    unsafe {
        for (i, fd) in req.stdio.iter().enumerate() {
            if libc::dup2(fd.as_raw_fd(), i as libc::c_int) < 0 {
                fail(report, io::Error::last_os_error());
            }
        }
        // What Rust's runtime ignores (SIGPIPE) the command must not: std
        // resets it in every child it starts.
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        let mut none: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut none);
        libc::sigprocmask(libc::SIG_SETMASK, &none, std::ptr::null_mut());
        if libc::chdir(req.cwd.as_ptr()) < 0 {
            fail(report, io::Error::last_os_error());
        }
    }
    let group = req.group.as_ref().map(|(w, r)| ExecGroupFds {
        procs_write: w.as_raw_fd(),
        procs_read: r.as_raw_fd(),
    });
    // Returns only when the command could not start.
    let e = crate::inside::supervise_exec(
        req.uid,
        req.gid,
        req.keep_background,
        group,
        &req.image,
        Some(report),
    )
    .err()
    .unwrap_or_else(|| io::Error::from_raw_os_error(libc::ECHILD));
    fail(report, e)
}

/// Reports why the command could not start, and this supervisor's pid
/// (for the agent to have it reaped).
fn report_failure(fd: RawFd, e: &io::Error) {
    // SAFETY: getpid has no preconditions.
    let me = unsafe { libc::getpid() };
    report(fd, FAILED, e.raw_os_error().unwrap_or(libc::EIO), me);
}
