//! Running processes as the sandbox user, with streamed, capped output and a
//! wall-clock timeout that kills the whole process tree.

use std::collections::BTreeMap;
use std::io::Write;
use std::os::fd::OwnedFd;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use runcell_jail::gvisor::ExecGroups;
use runcell_jail::inside::{ExecGroupFds, ExecImage};
use runcell_jail::zygote::{Spawn, Zygote, ZygoteError};
use runcell_jail::SandboxCommand;
use runcell_protocol::{
    Command as Cmd, ErrorKind, Event, ExecRequest, ExecUser, ExitInfo, RunCodeRequest,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::unix::pipe;
use tokio::sync::oneshot;

use crate::procs;
use crate::reaper::Exit;
use crate::shared::{send, send_error, Outbox, Shared};
use runcell_protocol::units::micros;

/// An exec or a code run.
#[derive(Debug)]
pub enum What {
    /// A command.
    Exec(ExecRequest),
    /// Source code in a language.
    Code(RunCodeRequest),
}

/// How long output is still read after the process exits, for pipes that its
/// background children hold open.
const DRAIN_GRACE: Duration = Duration::from_millis(200);
/// After the grace, how long the pipe must stay empty for the pump to stop.
const EMPTY_WAIT: Duration = Duration::from_millis(20);
/// Bytes still read after the grace while the pipe never runs empty (a
/// process left behind keeps writing); the output is then reported as cut.
/// Well above what a pipe can hold when its writer exits (the kernel's
/// `pipe-max-size`, 1 MiB by default, plus a read in flight), so output
/// written before the exit is never mistaken for a writer left behind.
const POST_EXIT_MAX: u64 = 4 << 20;
/// Directory for code files (root-owned, readable by the sandbox user).
const CODE_DIR: &str = "/run/runcell/code";

static CODE_SEQ: AtomicU64 = AtomicU64::new(0);

/// The environment every process in the sandbox starts with, for `user`.
pub(crate) fn base_env(agent: &Shared, user: &ExecUser) -> BTreeMap<String, String> {
    let u = user;
    [
        (
            "PATH",
            "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        ),
        ("HOME", u.home.as_str()),
        ("USER", u.name.as_str()),
        ("LOGNAME", u.name.as_str()),
        ("SHELL", "/bin/bash"),
        ("LANG", "C.UTF-8"),
        ("TMPDIR", "/tmp"),
        ("PYTHONUNBUFFERED", "1"),
        ("HOSTNAME", agent.spec.hostname.as_str()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect()
}

struct Plan {
    argv: Vec<String>,
    /// The shell line `argv` runs with bash, for a string command: it may
    /// run without the shell ([`crate::shell`]).
    line: Option<String>,
    user: Option<ExecUser>,
    env: BTreeMap<String, String>,
    cwd: Option<String>,
    timeout_ms: Option<u64>,
    output_limit: u64,
    stdin: Vec<u8>,
    code_file: Option<String>,
    background: bool,
}

fn plan(agent: &Shared, what: What, body: Vec<u8>) -> Result<Plan, (ErrorKind, String)> {
    match what {
        What::Exec(r) => {
            let (argv, line) = match r.command {
                Cmd::Argv(v) if v.is_empty() => {
                    return Err((ErrorKind::InvalidInput, "The command is empty.".into()))
                }
                Cmd::Argv(v) => (v, None),
                Cmd::Shell(s) => (vec!["/bin/bash".into(), "-c".into(), s.clone()], Some(s)),
            };
            Ok(Plan {
                argv,
                line,
                user: r.user,
                env: r.env,
                cwd: r.cwd,
                timeout_ms: r.timeout_ms,
                output_limit: r.output_limit,
                stdin: body,
                code_file: None,
                background: r.background,
            })
        }
        What::Code(r) => {
            let n = CODE_SEQ.fetch_add(1, Ordering::Relaxed);
            let path = format!("{CODE_DIR}/cell{n}.{}", r.language.extension());
            write_code(&path, &body).map_err(|e| {
                (
                    ErrorKind::Other,
                    format!("Could not store the code in the sandbox: {e}"),
                )
            })?;
            let mut argv = vec![r.language.interpreter().to_string(), path.clone()];
            argv.extend(r.args);
            let _ = agent;
            Ok(Plan {
                argv,
                line: None,
                user: None,
                env: r.env,
                cwd: r.cwd,
                timeout_ms: r.timeout_ms,
                output_limit: r.output_limit,
                stdin: Vec::new(),
                code_file: Some(path),
                background: false,
            })
        }
    }
}

fn write_code(path: &str, code: &[u8]) -> std::io::Result<()> {
    std::fs::create_dir_all(CODE_DIR)?;
    std::fs::set_permissions(CODE_DIR, std::fs::Permissions::from_mode(0o755))?;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o644)
        .open(path)?;
    f.write_all(code)
}

/// Runs a process and streams its events to `out`.
pub async fn exec(
    agent: &Shared,
    running: &RunningExecs,
    conn: u64,
    id: u64,
    what: What,
    body: Vec<u8>,
    out: &Outbox,
) {
    let received = mark();
    let plan = match plan(agent, what, body) {
        Ok(p) => p,
        Err((kind, msg)) => return send_error(out, id, kind, msg).await,
    };
    let code_file = plan.code_file.clone();
    run(agent, running, conn, id, plan, out, received).await;
    if let Some(f) = code_file {
        let _ = std::fs::remove_file(f);
    }
}

/// The sandbox's pids cgroup, where each exec gets a cgroup of its own
/// (gVisor only: see [`runcell_jail::gvisor::ExecGroups`]).
static EXEC_GROUPS: std::sync::OnceLock<ExecGroups> = std::sync::OnceLock::new();

/// Runs every exec from now on in a cgroup of its own under `groups`.
pub fn use_exec_groups(groups: ExecGroups) {
    let _ = EXEC_GROUPS.set(groups);
}

async fn run(
    agent: &Shared,
    running: &RunningExecs,
    conn: u64,
    id: u64,
    plan: Plan,
    out: &Outbox,
    received: Option<Instant>,
) {
    let planned = mark();
    let user = plan.user.clone().unwrap_or_else(|| {
        let u = &agent.spec.user;
        ExecUser {
            name: u.name.clone(),
            uid: u.uid,
            gid: u.gid,
            home: u.home.clone(),
        }
    });
    // The request's directory, else the template's WORKDIR, else home.
    let cwd = plan
        .cwd
        .clone()
        .or_else(|| agent.spec.workdir.clone())
        .unwrap_or_else(|| user.home.clone());
    if !Path::new(&cwd).is_dir() {
        return send_error(
            out,
            id,
            ErrorKind::InvalidInput,
            format!("The working directory {cwd} does not exist in the sandbox."),
        )
        .await;
    }
    let mut env = base_env(agent, &user);
    agent.egress.apply_env(&mut env);
    env.extend(agent.spec.env.clone());
    env.extend(plan.env);
    // The supervisor starts the command. Under gVisor (no child subreaper)
    // it does so in a cgroup of the exec's own, which it empties when the
    // command ends.
    let group = match EXEC_GROUPS.get().map(ExecGroups::create) {
        Some(Ok(g)) => Some(g),
        Some(Err(e)) => {
            return send_error(
                out,
                id,
                ErrorKind::SpawnFailed,
                format!("Could not make the exec's process group: {e}."),
            )
            .await;
        }
        None => None,
    };
    let grouped = mark();
    // The command as the supervisor starts it: found on the command's own
    // PATH and laid out now, since the supervisor may not allocate.
    // A shell line that is one simple command starts its program without
    // the shell, which stays as the fallback.
    let direct = plan
        .line
        .as_deref()
        .and_then(|line| crate::shell::direct(line, &env, &cwd));
    let image = ExecImage::new(&plan.argv[0], &plan.argv, &env).and_then(|shell| match direct {
        Some(d) => Ok(ExecImage::new(&d.path, &d.argv, &d.env)?.or_else(shell)),
        None => Ok(shell),
    });
    let image = match image {
        Ok(i) => i,
        Err(e) => {
            return send_error(
                out,
                id,
                ErrorKind::SpawnFailed,
                format!("Could not start `{}`: {e}.", plan.argv[0]),
            )
            .await;
        }
    };
    let fds = group.as_ref().map(|g| g.fds());
    // Limit hits the sandbox's own kernel counts (gVisor, microVM).
    let hits_before = crate::limits::hits();
    let watching = crate::limits::active();
    let started = Instant::now();
    let spec = Start {
        program: &plan.argv[0],
        env: &env,
        cwd: &cwd,
        user: &user,
        background: plan.background,
        image,
        group: fds,
    };
    // No `.await` from the start to `watch`: the reaper, which runs on this
    // (single) runtime thread, must not reap the supervisor before.
    let child = match start(spec) {
        Ok(c) => c,
        Err((e, collected)) => {
            // Its supervisor reported why and is exiting: answer once it
            // is collected, as for an exec that ran.
            if let Some(fd) = collected {
                until_collected(fd, "an exec supervisor that failed").await;
            }
            return send_error(
                out,
                id,
                ErrorKind::SpawnFailed,
                format!("Could not start `{}`: {e}.", plan.argv[0]),
            )
            .await;
        }
    };
    let spawned = mark();
    let supervisor = child.supervisor;
    let exited = agent.reaper.watch(supervisor);
    if let Some(report) = child.report {
        tokio::spawn(relay_exit(agent.reaper.clone(), supervisor, report));
    }
    let pid = child.command;
    running.lock().expect("running lock").insert(
        (conn, id),
        Running {
            supervisor,
            command: pid,
        },
    );
    let (stdin, stdout, stderr) = (child.stdin, child.stdout, child.stderr);

    send(out, id, Event::ExecStarted { pid }, Vec::new()).await;
    let announced = mark();

    if let Some(fd) = stdin {
        let data = plan.stdin;
        tokio::spawn(async move {
            if let Ok(mut tx) = pipe::Sender::from_owned_fd(fd) {
                let _ = tx.write_all(&data).await;
            }
        });
    }
    let limit = plan.output_limit;
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let pump_out = tokio::spawn(pump(
        stdout,
        limit,
        out.clone(),
        id,
        Event::Stdout,
        stop_rx.clone(),
    ));
    let pump_err = tokio::spawn(pump(stderr, limit, out.clone(), id, Event::Stderr, stop_rx));

    let timeout = plan.timeout_ms.map(Duration::from_millis);
    let (exit, timed_out) = wait(agent, supervisor, exited, timeout).await;
    let reaped = mark();
    // Let the pumps read what is buffered, then stop them even if a background
    // process keeps the pipes open.
    let stop = tokio::spawn(async move {
        tokio::time::sleep(DRAIN_GRACE).await;
        let _ = stop_tx.send(true);
    });
    let (out_total, out_trunc) = pump_out.await.unwrap_or((0, false));
    let (err_total, err_trunc) = pump_err.await.unwrap_or((0, false));
    stop.abort();
    running.lock().expect("running lock").remove(&(conn, id));
    let drained = mark();

    let (exit_code, signal) = match exit {
        Some(Exit::Code(c)) => (Some(c), None),
        Some(Exit::Signal(s)) => (None, Some(s)),
        None => (None, None),
    };
    let (disk_full, files_full) = match nix::sys::statvfs::statvfs("/") {
        Ok(s) => (s.blocks_available() == 0, s.files_available() == 0),
        Err(_) => (false, false),
    };
    let (pids_limit, oom_killed) = crate::limits::hits().since(hits_before);
    drop(watching);
    let info = ExitInfo {
        disk_full,
        files_full,
        pids_limit,
        oom_killed,
        exit_code,
        signal,
        timed_out,
        duration_ms: runcell_protocol::units::millis(started.elapsed()),
        stdout_bytes: out_total,
        stderr_bytes: err_total,
        stdout_truncated: out_trunc,
        stderr_truncated: err_trunc,
    };
    send(out, id, Event::ExecExited(info), Vec::new()).await;
    // Where an exec's time goes, from its request's arrival (microseconds).
    if let Some(received) = received {
        let at = |t: Option<Instant>| t.map_or(0, |t| micros(t.duration_since(received)));
        tracing::debug!(
            planned = at(planned),
            grouped = at(grouped),
            started = at(Some(started)),
            spawned = at(spawned),
            announced = at(announced),
            reaped = at(reaped),
            drained = at(drained),
            answered = at(Some(Instant::now())),
            "exec done"
        );
    }
}

/// Now, where exec timings are logged (debug); otherwise no clock read at
/// all: for about the first second of a gVisor sandbox (until the Sentry's
/// clock is calibrated) every read is a system call, 15-40 µs there.
fn mark() -> Option<Instant> {
    tracing::enabled!(tracing::Level::DEBUG).then(Instant::now)
}

/// The exec fork server (gVisor: see [`runcell_jail::zygote`]), when the
/// agent started one.
static ZYGOTE: std::sync::OnceLock<Zygote> = std::sync::OnceLock::new();
/// Set once the fork server failed: supervisors are forked here again.
static ZYGOTE_GONE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Starts every exec's supervisor through `zygote` from now on.
pub fn use_zygote(zygote: Zygote) {
    let _ = ZYGOTE.set(zygote);
}

/// What starting one exec takes.
struct Start<'a> {
    program: &'a str,
    env: &'a BTreeMap<String, String>,
    cwd: &'a str,
    user: &'a ExecUser,
    background: bool,
    image: ExecImage,
    group: Option<ExecGroupFds>,
}

/// A started exec: its supervisor, its command and the agent's ends of the
/// command's standard streams.
struct Child {
    supervisor: i32,
    command: i32,
    stdin: Option<OwnedFd>,
    stdout: Option<OwnedFd>,
    stderr: Option<OwnedFd>,
    /// The fork server's report pipe, which gives the exit; `None` for the
    /// agent's own child, whose exit the reaper gives.
    report: Option<OwnedFd>,
}

/// Starts an exec's supervisor, which starts the command: through the fork
/// server where there is one, else by forking the agent. Returns once the
/// command runs. Blocks the runtime thread meanwhile, as a fork does. On
/// failure, also what comes to its end once a fork server's supervisor that
/// reported it is collected ([`until_collected`]).
fn start(spec: Start<'_>) -> Result<Child, (std::io::Error, Option<OwnedFd>)> {
    use std::os::fd::AsFd;
    if let Some(z) = ZYGOTE
        .get()
        .filter(|_| !ZYGOTE_GONE.load(Ordering::Relaxed))
    {
        let pipe = || {
            nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)
                .map_err(|e| (std::io::Error::from(e), None))
        };
        let (in_r, in_w) = pipe()?;
        let (out_r, out_w) = pipe()?;
        let (err_r, err_w) = pipe()?;
        let req = Spawn {
            uid: spec.user.uid,
            gid: spec.user.gid,
            keep_background: spec.background,
            cwd: spec.cwd,
            image: &spec.image,
            stdin: in_r.as_fd(),
            stdout: out_w.as_fd(),
            stderr: err_w.as_fd(),
            group: spec.group,
        };
        match z.spawn(&req) {
            Ok(s) => {
                return Ok(Child {
                    supervisor: s.supervisor,
                    command: s.command,
                    stdin: Some(in_w),
                    stdout: Some(out_r),
                    stderr: Some(err_r),
                    report: Some(s.report),
                })
            }
            Err(ZygoteError::Start { error, collected }) => return Err((error, collected)),
            Err(e) => {
                tracing::warn!(
                    "{e} ({}); forking exec supervisors from the agent from now on",
                    std::error::Error::source(&e)
                        .map(|s| s.to_string())
                        .unwrap_or_default()
                );
                ZYGOTE_GONE.store(true, Ordering::Relaxed);
            }
        }
    }
    let mut cmd = Command::new(spec.program);
    cmd.env_clear()
        .envs(spec.env)
        .current_dir(spec.cwd)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    cmd.supervise_as(
        spec.user.uid,
        spec.user.gid,
        spec.background,
        spec.group,
        spec.image,
    );
    let mut child = cmd.spawn().map_err(|e| (e, None))?;
    let supervisor = child.id() as i32;
    // spawn returns once the supervisor has forked the command (it closes
    // std's exec-error pipe only then), so the command is its first child.
    let command = procs::first_child(supervisor).unwrap_or(supervisor);
    Ok(Child {
        supervisor,
        command,
        stdin: child.stdin.take().map(OwnedFd::from),
        stdout: child.stdout.take().map(OwnedFd::from),
        stderr: child.stderr.take().map(OwnedFd::from),
        report: None,
    })
}

/// Reads the exit a supervisor started by the fork server reports, lets the
/// fork server reap it, and once it is collected hands the exit to whoever
/// waits for the supervisor (as the reaper does for the agent's own
/// children): an exec is answered only when its supervisor is gone.
async fn relay_exit(reaper: crate::reaper::Reaper, supervisor: i32, report: OwnedFd) {
    let mut bytes = Vec::new();
    if let Ok(mut rx) = pipe::Receiver::from_owned_fd(report) {
        let _ = rx.read_to_end(&mut bytes).await;
    }
    let exit = match runcell_jail::zygote::exit_status(&bytes) {
        Some(st) if libc::WIFSIGNALED(st) => Exit::Signal(libc::WTERMSIG(st)),
        Some(st) if libc::WIFEXITED(st) => Exit::Code(libc::WEXITSTATUS(st)),
        Some(_) => Exit::Code(1),
        // Ended without a word: killed (only the agent's SIGKILL can).
        None => Exit::Signal(libc::SIGKILL),
    };
    // From here on the pid is not the agent's to signal: it may be reused.
    let waiter = reaper.let_go(supervisor);
    if let Some(z) = ZYGOTE.get() {
        match z.reap(supervisor) {
            Ok(done) => until_collected(done, &format!("exec supervisor {supervisor}")).await,
            Err(e) => tracing::warn!("{e}: supervisor {supervisor} stays a zombie"),
        }
    }
    if let Some(tx) = waiter {
        let _ = tx.send(exit);
    }
}

/// How long an exec's answer waits for the fork server to collect its
/// supervisor, which has exited (it closed its report pipe as it did).
const REAP_WAIT: Duration = Duration::from_secs(2);

/// Waits until `done`, from [`Zygote::reap`], comes to its end: the fork
/// server has collected the supervisor (`what`). Gives up, saying so, after
/// [`REAP_WAIT`].
async fn until_collected(done: OwnedFd, what: &str) {
    let collected = async {
        if let Ok(mut rx) = pipe::Receiver::from_owned_fd(done) {
            let mut byte = [0u8; 1];
            let _ = rx.read(&mut byte).await;
        }
    };
    if tokio::time::timeout(REAP_WAIT, collected).await.is_err() {
        tracing::warn!("{what} was not collected within {REAP_WAIT:?}; answering anyway");
    }
}

async fn wait(
    agent: &Shared,
    supervisor: i32,
    mut exited: oneshot::Receiver<Exit>,
    timeout: Option<Duration>,
) -> (Option<Exit>, bool) {
    let sleep = async {
        match timeout {
            Some(t) => tokio::time::sleep(t).await,
            None => std::future::pending().await,
        }
    };
    tokio::select! {
        e = &mut exited => (e.ok(), false),
        _ = sleep => {
            kill_exec(agent, supervisor).await;
            (exited.await.ok(), true)
        }
    }
}

/// The running execs, by (connection, request id).
pub type RunningExecs = std::sync::Mutex<std::collections::HashMap<(u64, u64), Running>>;

/// A running exec: its supervisor (see
/// [`runcell_jail::inside::supervise_exec`]) and the command itself.
#[derive(Debug, Clone, Copy)]
pub struct Running {
    /// The supervisor, parent of every process of the exec.
    pub supervisor: i32,
    /// The command, leader of its own session and process group.
    pub command: i32,
}

/// How long the supervisor gets to kill an exec's processes before the
/// agent helps.
const KILL_GRACE: Duration = Duration::from_secs(5);
/// How long the agent then helps before it kills the supervisor too.
const KILL_HELP: Duration = Duration::from_secs(30);

/// Kills every process of an exec: SIGTERM asks its supervisor to SIGKILL
/// them all and exit. Should it not be gone after [`KILL_GRACE`] (processes
/// stuck in memory reclaim die slowly), the agent also kills the tree below
/// it, leaving the supervisor alive so orphans keep going to it and not to
/// the agent; only after [`KILL_HELP`] more is the supervisor killed too.
pub async fn kill_exec(agent: &Shared, supervisor: i32) {
    use nix::sys::signal::{kill, Signal};
    // Only while it is unreaped does the number still name the supervisor.
    if !agent.reaper.is_waiting(supervisor) {
        return;
    }
    let pid = nix::unistd::Pid::from_raw(supervisor);
    if kill(pid, Signal::SIGTERM).is_err() {
        return;
    }
    let started = Instant::now();
    let mut warned = false;
    while started.elapsed() < KILL_GRACE + KILL_HELP {
        tokio::time::sleep(Duration::from_millis(5)).await;
        if !agent.reaper.is_waiting(supervisor) || procs::is_zombie(supervisor) {
            return;
        }
        if started.elapsed() >= KILL_GRACE {
            if !warned {
                tracing::warn!(
                    "exec supervisor {supervisor} is slow to stop; killing its tree too"
                );
                warned = true;
            }
            procs::kill_below(supervisor);
        }
    }
    if agent.reaper.is_waiting(supervisor) {
        tracing::warn!("exec supervisor {supervisor} did not stop; killing it");
        procs::kill_tree(supervisor).await;
    }
}

/// Forwards up to `limit` bytes of a pipe as events and counts the rest.
/// Memory use is one buffer, whatever the process prints.
///
/// Returns the bytes read and whether the output was cut: beyond `limit`, or
/// because a process the exec left behind was still writing when the pump
/// stopped. Output the process wrote before it exited is always read and
/// counted, however slowly the host takes it: after `stop` the pump ends
/// only once the pipe stays empty for [`EMPTY_WAIT`] (or after
/// [`POST_EXIT_MAX`] more bytes, reported as cut).
async fn pump(
    fd: Option<OwnedFd>,
    limit: u64,
    out: Outbox,
    id: u64,
    event: Event,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> (u64, bool) {
    let Some(fd) = fd else { return (0, false) };
    let Ok(mut rx) = pipe::Receiver::from_owned_fd(fd) else {
        return (0, false);
    };
    // Read into its spare capacity: never zeroed (an exec that prints
    // nothing touches none of it).
    let mut buf: Vec<u8> = Vec::with_capacity(64 * 1024);
    let mut total = 0u64;
    let mut forwarded = 0u64;
    let mut after_stop = 0u64;
    let mut cut = false;
    loop {
        buf.clear();
        let n = if *stop.borrow() {
            // After the grace, read on while data keeps coming (the pump may
            // have been held back by a slow host for longer than the grace,
            // with the pipe still full); stop once it stays empty.
            match tokio::time::timeout(EMPTY_WAIT, rx.read_buf(&mut buf)).await {
                Ok(Ok(0)) | Ok(Err(_)) | Err(_) => break,
                Ok(Ok(n)) => n,
            }
        } else {
            tokio::select! {
                r = rx.read_buf(&mut buf) => match r { Ok(0) | Err(_) => break, Ok(n) => n },
                _ = stop.wait_for(|s| *s) => continue,
            }
        };
        total += n as u64;
        if *stop.borrow() {
            after_stop += n as u64;
            if after_stop > POST_EXIT_MAX {
                cut = true;
                break;
            }
        }
        if forwarded < limit {
            let take = usize::try_from(limit - forwarded)
                .unwrap_or(usize::MAX)
                .min(n);
            forwarded += take as u64;
            if !send(&out, id, event.clone(), buf[..take].to_vec()).await {
                // The host went away; keep draining so the process is not blocked.
                forwarded = limit;
            }
        }
    }
    (total, cut || total > forwarded)
}

#[cfg(test)]
mod tests {
    use super::*;
    use runcell_protocol::{Frame, ServerMessage};
    use tokio::sync::mpsc;

    /// A pipe whose writer (a thread standing for the process) writes `n`
    /// bytes and then exits, or keeps writing forever when `n` is `None`;
    /// `stop` is set as soon as it exits (the grace is over at once).
    fn pipe_with(n: Option<usize>) -> (OwnedFd, tokio::sync::watch::Receiver<bool>) {
        let (rd, wr) = nix::unistd::pipe().unwrap();
        // A large pipe (as a program may make its stdout): much is still in
        // it when the writer exits.
        nix::fcntl::fcntl(&wr, nix::fcntl::FcntlArg::F_SETPIPE_SZ(1 << 20)).unwrap();
        let (stop_tx, stop) = tokio::sync::watch::channel(false);
        std::thread::spawn(move || {
            let mut f = std::fs::File::from(wr);
            let block = vec![b'y'; 4096];
            let mut left = n.unwrap_or(usize::MAX);
            let mut written = 0;
            while left > 0 {
                let k = left.min(block.len());
                if f.write_all(&block[..k]).is_err() {
                    return;
                }
                left -= k;
                written += k;
                if n.is_none() && written == 256 << 10 {
                    // The exec's process is gone; this one was left behind.
                    stop_tx.send_replace(true);
                }
            }
            drop(f);
            stop_tx.send_replace(true);
        });
        (rd, stop)
    }

    /// Takes frames slowly, as a busy host does, and counts their bytes.
    fn slow_host(mut rx: mpsc::Receiver<Frame<ServerMessage>>) -> tokio::task::JoinHandle<usize> {
        tokio::spawn(async move {
            let mut got = 0;
            while let Some(f) = rx.recv().await {
                got += f.body.len();
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            got
        })
    }

    #[tokio::test]
    async fn output_written_before_exit_is_never_dropped() {
        // The process exits and the grace is over (stop is set) while a
        // slow host still holds the pump back with the pipe full: everything
        // the process wrote is read, forwarded and counted.
        let n = 4 << 20;
        let (tx, rx) = mpsc::channel(1);
        let host = slow_host(rx);
        let (fd, stop) = pipe_with(Some(n));
        let (total, cut) = pump(Some(fd), u64::MAX, tx, 1, Event::Stdout, stop).await;
        assert_eq!((total, cut), (n as u64, false));
        assert_eq!(host.await.unwrap(), n);
    }

    #[tokio::test]
    async fn a_writer_left_behind_is_cut_and_reported() {
        let (tx, rx) = mpsc::channel(1);
        let host = slow_host(rx);
        let (fd, stop) = pipe_with(None);
        let (total, cut) = pump(Some(fd), u64::MAX, tx, 1, Event::Stdout, stop).await;
        assert!(
            cut,
            "output still being written when the pump stopped must be reported as cut ({total})"
        );
        assert!(
            total > POST_EXIT_MAX && total < 4 * POST_EXIT_MAX,
            "{total}"
        );
        host.await.unwrap();
    }
}
