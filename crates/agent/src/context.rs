//! Code contexts: long-lived interpreters (Python, Node.js, bash) whose state
//! persists from one cell to the next.
//!
//! Each context is a driver program (`drivers/`) running as the sandbox user
//! with two private pipes: fd 3 carries cells in, fd 4 carries events out
//! (one JSON object per line: `ready`, `result`, `done`). Its stdout and
//! stderr are separate pipes, pumped for the whole life of the interpreter and
//! forwarded to whichever cell is running, capped like exec output. Since
//! events never share a pipe with output, nothing user code prints can be read
//! as an event.

use std::collections::BTreeMap;
use std::io::Write;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use nix::sys::signal::Signal;
use runcell_jail::SandboxCommand;
use runcell_protocol::{
    CellError, CellOutcome, ContextCreateRequest, ContextInfo, ErrorKind, Event, Language,
};
use serde::Deserialize;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::unix::pipe;
use tokio::sync::{mpsc, oneshot};

use crate::exec::base_env;
use crate::procs;
use crate::reaper::Exit;
use crate::shared::{send, send_error, Outbox, Shared};

/// Where the drivers are written inside the sandbox (root-owned, read-only to
/// the sandbox user).
const DRIVER_DIR: &str = "/run/runcell/drivers";
/// Where bash cells are stored while they run.
const CELL_DIR: &str = "/run/runcell/cells";
const PYTHON_DRIVER: &str = include_str!("drivers/python.py");
const NODE_DRIVER: &str = include_str!("drivers/node.js");
const BASH_DRIVER: &str = include_str!("drivers/bash.sh");

/// How long an interpreter gets to start and import its preload modules.
const READY_TIMEOUT: Duration = Duration::from_secs(60);
/// How long an interrupted cell gets to come back before the interpreter is
/// killed and restarted.
const INTERRUPT_GRACE: Duration = Duration::from_secs(2);
/// Longest event line read from a driver; longer lines are dropped.
const MAX_EVENT_LINE: usize = 6 << 20;
/// Total size of the results one cell may return.
const MAX_RESULTS_BYTES: usize = 32 << 20;
/// Stderr kept from an interpreter that fails to start.
const STARTUP_STDERR: usize = 4096;

/// Every context of the sandbox.
#[derive(Debug, Default)]
pub struct Contexts {
    map: Mutex<BTreeMap<String, Arc<Context>>>,
}

#[derive(Debug)]
struct Context {
    request: ContextCreateRequest,
    info: Mutex<ContextInfo>,
    /// The interpreter; locked for the whole of a cell or a restart, so cells
    /// of one context run one at a time.
    kernel: tokio::sync::Mutex<Option<Kernel>>,
}

/// One interpreter process and its pipes.
#[derive(Debug)]
struct Kernel {
    pid: i32,
    exited: oneshot::Receiver<Exit>,
    ctrl: pipe::Sender,
    events: EventReader,
    stdout: mpsc::Sender<PumpCmd>,
    stderr: mpsc::Sender<PumpCmd>,
}

/// Where a pump sends what it reads.
#[derive(Debug)]
enum Sink {
    /// Nowhere (between cells).
    Discard,
    /// Keep the first bytes (while the interpreter starts, to explain a failure).
    Capture(Vec<u8>),
    /// To a running cell.
    Forward {
        out: Outbox,
        id: u64,
        event: Event,
        limit: u64,
    },
}

#[derive(Debug)]
enum PumpCmd {
    Start(Sink),
    /// Read everything already in the pipe, then report and go back to discarding.
    Finish(oneshot::Sender<PumpReport>),
}

#[derive(Debug, Default)]
struct PumpReport {
    total: u64,
    truncated: bool,
    captured: Vec<u8>,
}

/// A driver event.
#[derive(Debug, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum DriverEvent {
    Ready {
        #[serde(default)]
        preload_errors: Vec<String>,
    },
    Result {
        bundle: serde_json::Map<String, serde_json::Value>,
    },
    Done {
        exit_code: i32,
        error: Option<CellError>,
    },
}

/// Reads newline-delimited events with a line cap, so a driver (or code that
/// writes to its descriptor) cannot make the agent buffer without bound.
#[derive(Debug)]
struct EventReader {
    rx: pipe::Receiver,
    buf: Vec<u8>,
    skipping: bool,
    dropped: u32,
}

enum Line {
    Event(DriverEvent),
    Eof,
}

impl EventReader {
    async fn next(&mut self) -> Line {
        loop {
            if let Some(nl) = self.buf.iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = self.buf.drain(..=nl).collect();
                if std::mem::take(&mut self.skipping) {
                    continue;
                }
                match serde_json::from_slice::<DriverEvent>(&line) {
                    Ok(ev) => return Line::Event(ev),
                    Err(e) => {
                        tracing::debug!("ignoring a malformed driver event: {e}");
                        continue;
                    }
                }
            }
            if self.buf.len() > MAX_EVENT_LINE {
                self.buf.clear();
                if !self.skipping {
                    self.dropped += 1;
                }
                self.skipping = true;
            }
            let mut chunk = [0u8; 64 * 1024];
            match self.rx.read(&mut chunk).await {
                Ok(0) | Err(_) => return Line::Eof,
                Ok(n) => self.buf.extend_from_slice(&chunk[..n]),
            }
        }
    }
}

fn now_ms() -> u64 {
    runcell_protocol::units::unix_millis(SystemTime::now())
}

fn new_id() -> String {
    let mut b = [0u8; 8];
    if std::fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut b))
        .is_err()
    {
        b = (now_ms() ^ u64::from(std::process::id()).rotate_left(32)).to_be_bytes();
    }
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn install_drivers() -> std::io::Result<()> {
    std::fs::create_dir_all(DRIVER_DIR)?;
    std::fs::set_permissions(DRIVER_DIR, std::fs::Permissions::from_mode(0o755))?;
    std::fs::create_dir_all(CELL_DIR)?;
    std::fs::set_permissions(CELL_DIR, std::fs::Permissions::from_mode(0o755))?;
    for (name, text) in [
        ("python.py", PYTHON_DRIVER),
        ("node.js", NODE_DRIVER),
        ("bash.sh", BASH_DRIVER),
    ] {
        let path = Path::new(DRIVER_DIR).join(name);
        if !path.exists() {
            let tmp = path.with_extension("tmp");
            std::fs::write(&tmp, text)?;
            std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o644))?;
            std::fs::rename(&tmp, &path)?;
        }
    }
    Ok(())
}

fn argv(language: Language) -> Vec<String> {
    let v: &[&str] = match language {
        Language::Python => &["python3", "/run/runcell/drivers/python.py"],
        Language::Javascript => &["node", "/run/runcell/drivers/node.js"],
        Language::Bash => &[
            "bash",
            "--noprofile",
            "--norc",
            "/run/runcell/drivers/bash.sh",
        ],
    };
    v.iter().map(|s| s.to_string()).collect()
}

/// A pump: reads one output pipe for the life of the interpreter.
async fn pump(fd: OwnedFd, mut cmds: mpsc::Receiver<PumpCmd>) {
    let Ok(mut rx) = pipe::Receiver::from_owned_fd(fd) else {
        return;
    };
    let mut sink = Sink::Discard;
    let (mut total, mut forwarded) = (0u64, 0u64);
    let mut buf = vec![0u8; 64 * 1024];
    let mut open = true;
    loop {
        tokio::select! {
            r = rx.read(&mut buf), if open => match r {
                Ok(0) | Err(_) => open = false,
                Ok(n) => deliver(&mut sink, &buf[..n], &mut total, &mut forwarded).await,
            },
            cmd = cmds.recv() => match cmd {
                None => return,
                Some(PumpCmd::Start(s)) => {
                    sink = s;
                    total = 0;
                    forwarded = 0;
                }
                Some(PumpCmd::Finish(ack)) => {
                    // Everything the interpreter wrote before it reported the
                    // cell done is already in the pipe: take it. A plain
                    // read(2), not `try_read`: that answers WouldBlock
                    // without reading while the reactor has not yet seen
                    // the pipe become readable, which lost a cell's last
                    // line now and then.
                    while open {
                        match nix::unistd::read(&rx, &mut buf) {
                            Ok(0) => open = false,
                            Ok(n) => deliver(&mut sink, &buf[..n], &mut total, &mut forwarded).await,
                            Err(nix::errno::Errno::EINTR) => {}
                            Err(_) => break,
                        }
                    }
                    let captured = match std::mem::replace(&mut sink, Sink::Discard) {
                        Sink::Capture(v) => v,
                        _ => Vec::new(),
                    };
                    let _ = ack.send(PumpReport { total, truncated: total > forwarded, captured });
                }
            },
        }
    }
}

async fn deliver(sink: &mut Sink, data: &[u8], total: &mut u64, forwarded: &mut u64) {
    *total += data.len() as u64;
    match sink {
        Sink::Discard => {}
        Sink::Capture(v) => {
            let room = STARTUP_STDERR.saturating_sub(v.len());
            v.extend_from_slice(&data[..room.min(data.len())]);
        }
        Sink::Forward {
            out,
            id,
            event,
            limit,
        } => {
            if *forwarded < *limit {
                let room = usize::try_from(*limit - *forwarded).unwrap_or(usize::MAX);
                let take = room.min(data.len());
                *forwarded += take as u64;
                if !send(out, *id, event.clone(), data[..take].to_vec()).await {
                    *forwarded = *limit;
                }
            }
        }
    }
}

async fn finish(pump: &mpsc::Sender<PumpCmd>) -> PumpReport {
    let (tx, rx) = oneshot::channel();
    if pump.send(PumpCmd::Finish(tx)).await.is_err() {
        return PumpReport::default();
    }
    rx.await.unwrap_or_default()
}

fn describe_exit(language: Language, exit: Option<Exit>) -> String {
    match exit {
        Some(Exit::Signal(s)) => {
            let name = Signal::try_from(s)
                .map(|s| s.as_str().to_string())
                .unwrap_or_else(|_| format!("signal {s}"));
            format!("The {language} interpreter was killed by {name} while running this cell.")
        }
        Some(Exit::Code(c)) => {
            format!("The {language} interpreter exited with code {c} while running this cell.")
        }
        None => format!("The {language} interpreter stopped while running this cell."),
    }
}

impl Kernel {
    /// Starts an interpreter and waits until it is ready.
    async fn start(
        agent: &Shared,
        request: &ContextCreateRequest,
    ) -> Result<(Kernel, Vec<String>), (ErrorKind, String)> {
        let language = request.language;
        install_drivers().map_err(|e| {
            (
                ErrorKind::Other,
                format!("Could not install the {language} driver in the sandbox: {e}."),
            )
        })?;
        let user = &agent.spec.user;
        let cwd = request
            .cwd
            .clone()
            .or_else(|| agent.spec.workdir.clone())
            .unwrap_or_else(|| user.home.clone());
        if !Path::new(&cwd).is_dir() {
            return Err((
                ErrorKind::InvalidInput,
                format!("The working directory {cwd} does not exist in the sandbox."),
            ));
        }
        let mut env = base_env(
            agent,
            &runcell_protocol::ExecUser {
                name: user.name.clone(),
                uid: user.uid,
                gid: user.gid,
                home: user.home.clone(),
            },
        );
        agent.egress.apply_env(&mut env);
        env.extend(agent.spec.env.clone());
        env.extend(request.env.clone());
        if language == Language::Python {
            env.insert("RUNCELL_PRELOAD".into(), request.preload.join(","));
            env.entry("MPLBACKEND".into())
                .or_insert_with(|| "Agg".into());
        }
        let pipe_err = |e: nix::Error| {
            (
                ErrorKind::Other,
                format!("Could not create the context's pipes: {e}."),
            )
        };
        let (ctrl_r, ctrl_w) =
            nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(pipe_err)?;
        let (ev_r, ev_w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(pipe_err)?;
        let argv = argv(language);
        let mut cmd = Command::new(&argv[0]);
        cmd.args(&argv[1..])
            .env_clear()
            .envs(&env)
            .current_dir(&cwd)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        // Cells in at fd 3, events out at fd 4.
        cmd.as_user_with_fds(user.uid, user.gid, &[ctrl_r.as_fd(), ev_w.as_fd()]);
        let mut child = cmd.spawn().map_err(|e| {
            (
                ErrorKind::SpawnFailed,
                format!(
                    "Could not start the {language} interpreter (`{}`): {e}. Does this template have it?",
                    argv[0]
                ),
            )
        })?;
        let pid = child.id() as i32;
        let exited = agent.reaper.watch(pid);
        drop((ctrl_r, ev_w));
        let stdout = child.stdout.take().map(OwnedFd::from);
        let stderr = child.stderr.take().map(OwnedFd::from);
        drop(child);
        let spawn_pump = |fd: Option<OwnedFd>| {
            let (tx, rx) = mpsc::channel(4);
            if let Some(fd) = fd {
                tokio::spawn(pump(fd, rx));
            }
            tx
        };
        let stdout = spawn_pump(stdout);
        let stderr = spawn_pump(stderr);
        let io_err = |e: std::io::Error| {
            (
                ErrorKind::Other,
                format!("Could not open the context's pipes: {e}."),
            )
        };
        let mut kernel = Kernel {
            pid,
            exited,
            ctrl: pipe::Sender::from_owned_fd(ctrl_w).map_err(io_err)?,
            events: EventReader {
                rx: pipe::Receiver::from_owned_fd(ev_r).map_err(io_err)?,
                buf: Vec::new(),
                skipping: false,
                dropped: 0,
            },
            stdout,
            stderr,
        };
        let _ = kernel
            .stderr
            .send(PumpCmd::Start(Sink::Capture(Vec::new())))
            .await;
        let ready = tokio::time::timeout(READY_TIMEOUT, async {
            loop {
                match kernel.events.next().await {
                    Line::Event(DriverEvent::Ready { preload_errors }) => {
                        return Some(preload_errors)
                    }
                    Line::Event(_) => continue,
                    Line::Eof => return None,
                }
            }
        })
        .await;
        let report = finish(&kernel.stderr).await;
        match ready {
            Ok(Some(errors)) => Ok((kernel, errors)),
            other => {
                procs::kill_tree(pid).await;
                let why = match other {
                    Err(_) => format!("did not become ready within {}s", READY_TIMEOUT.as_secs()),
                    _ => "exited while starting".into(),
                };
                let stderr = String::from_utf8_lossy(&report.captured);
                Err((
                    ErrorKind::SpawnFailed,
                    format!(
                        "The {language} interpreter {why}.{}",
                        if stderr.trim().is_empty() {
                            String::new()
                        } else {
                            format!(" Its stderr:\n{}", stderr.trim_end())
                        }
                    ),
                ))
            }
        }
    }

    async fn kill(self) {
        procs::kill_tree(self.pid).await;
    }
}

impl Contexts {
    fn get(&self, id: &str) -> Option<Arc<Context>> {
        self.map.lock().expect("contexts lock").get(id).cloned()
    }
}

fn not_found(id: &str) -> (ErrorKind, String) {
    (
        ErrorKind::NotFound,
        format!("No context has id \"{id}\" in this sandbox."),
    )
}

/// Starts a context.
pub async fn create(
    agent: &Shared,
    contexts: &Contexts,
    id: u64,
    request: ContextCreateRequest,
    out: &Outbox,
) {
    match Kernel::start(agent, &request).await {
        Ok((kernel, preload_errors)) => {
            let info = ContextInfo {
                id: new_id(),
                language: request.language,
                cwd: request
                    .cwd
                    .clone()
                    .or_else(|| agent.spec.workdir.clone())
                    .unwrap_or_else(|| agent.spec.user.home.clone()),
                created_unix_ms: now_ms(),
                cells: 0,
                restarts: 0,
                pid: kernel.pid,
                preload_errors,
            };
            let ctx = Arc::new(Context {
                request,
                info: Mutex::new(info.clone()),
                kernel: tokio::sync::Mutex::new(Some(kernel)),
            });
            contexts
                .map
                .lock()
                .expect("contexts lock")
                .insert(info.id.clone(), ctx);
            send(out, id, Event::Context { context: info }, Vec::new()).await;
        }
        Err((kind, msg)) => send_error(out, id, kind, msg).await,
    }
}

/// Lists contexts.
pub async fn list(contexts: &Contexts, id: u64, out: &Outbox) {
    let mut list: Vec<ContextInfo> = contexts
        .map
        .lock()
        .expect("contexts lock")
        .values()
        .map(|c| c.info.lock().expect("context info").clone())
        .collect();
    list.sort_by_key(|c| c.created_unix_ms);
    send(out, id, Event::Contexts { contexts: list }, Vec::new()).await;
}

/// Stops a context and forgets it.
pub async fn delete(contexts: &Contexts, id: u64, context_id: &str, out: &Outbox) {
    let removed = contexts
        .map
        .lock()
        .expect("contexts lock")
        .remove(context_id);
    match removed {
        Some(ctx) => {
            // Kill first: a running cell holds the kernel lock until it sees the exit.
            let pid = ctx.info.lock().expect("context info").pid;
            procs::kill_tree(pid).await;
            if let Some(k) = ctx.kernel.lock().await.take() {
                k.kill().await;
            }
            send(out, id, Event::Done, Vec::new()).await;
        }
        None => {
            let (kind, msg) = not_found(context_id);
            send_error(out, id, kind, msg).await
        }
    }
}

/// Restarts a context's interpreter (its state is lost).
pub async fn restart(agent: &Shared, contexts: &Contexts, id: u64, context_id: &str, out: &Outbox) {
    let Some(ctx) = contexts.get(context_id) else {
        let (kind, msg) = not_found(context_id);
        return send_error(out, id, kind, msg).await;
    };
    let pid = ctx.info.lock().expect("context info").pid;
    procs::kill_tree(pid).await;
    let mut slot = ctx.kernel.lock().await;
    if let Some(k) = slot.take() {
        k.kill().await;
    }
    match respawn(agent, &ctx, &mut slot).await {
        Ok(()) => {
            let info = ctx.info.lock().expect("context info").clone();
            send(out, id, Event::Context { context: info }, Vec::new()).await;
        }
        Err((kind, msg)) => send_error(out, id, kind, msg).await,
    }
}

async fn respawn(
    agent: &Shared,
    ctx: &Context,
    slot: &mut Option<Kernel>,
) -> Result<(), (ErrorKind, String)> {
    let (kernel, errors) = Kernel::start(agent, &ctx.request).await?;
    let mut info = ctx.info.lock().expect("context info");
    info.pid = kernel.pid;
    info.restarts += 1;
    info.preload_errors = errors;
    *slot = Some(kernel);
    Ok(())
}

/// One cell to run: its code, time limit and output limit.
#[derive(Debug)]
pub struct Cell {
    /// How long it may run before it is interrupted.
    pub timeout: Duration,
    /// Bytes of each of stdout and stderr forwarded.
    pub output_limit: u64,
    /// The source code.
    pub code: Vec<u8>,
}

/// Runs one cell.
pub async fn run(
    agent: &Shared,
    contexts: &Contexts,
    id: u64,
    context_id: &str,
    cell: Cell,
    out: &Outbox,
) {
    let Cell {
        timeout,
        output_limit,
        code,
    } = cell;
    let Some(ctx) = contexts.get(context_id) else {
        let (kind, msg) = not_found(context_id);
        return send_error(out, id, kind, msg).await;
    };
    let language = ctx.request.language;
    let mut slot = ctx.kernel.lock().await;
    let mut outcome = CellOutcome::default();
    if slot.is_none() {
        // The interpreter could not be restarted after an earlier crash.
        if let Err((kind, msg)) = respawn(agent, &ctx, &mut slot).await {
            return send_error(out, id, kind, msg).await;
        }
        outcome.state_lost = true;
    }
    let Some(kernel) = slot.as_mut() else {
        return;
    };
    let started = Instant::now();
    // Limit hits the sandbox's own kernel counts (a microVM guest's).
    let hits_before = crate::limits::hits();
    let frame = match cell_frame(language, &code) {
        Ok(f) => f,
        Err(e) => {
            return send_error(
                out,
                id,
                ErrorKind::Other,
                format!("Could not store the cell in the sandbox: {e}."),
            )
            .await
        }
    };
    for (pump, event) in [
        (&kernel.stdout, Event::Stdout),
        (&kernel.stderr, Event::Stderr),
    ] {
        let _ = pump
            .send(PumpCmd::Start(Sink::Forward {
                out: out.clone(),
                id,
                event,
                limit: output_limit,
            }))
            .await;
    }
    ctx.info.lock().expect("context info").cells += 1;
    let dropped_before = kernel.events.dropped;
    let mut results_bytes = 0usize;
    let mut dead: Option<Option<Exit>> = None;
    let mut deadline = tokio::time::Instant::now() + timeout;
    let mut interrupted = false;
    if kernel.ctrl.write_all(&frame.bytes).await.is_err() {
        dead = Some(None);
    }
    while dead.is_none() {
        tokio::select! {
            line = kernel.events.next() => match line {
                Line::Event(DriverEvent::Result { bundle }) => {
                    let body = serde_json::to_vec(&bundle).unwrap_or_default();
                    if results_bytes + body.len() > MAX_RESULTS_BYTES || body.len() > runcell_protocol::MAX_BODY {
                        outcome.results_dropped += 1;
                    } else {
                        results_bytes += body.len();
                        send(out, id, Event::Result, body).await;
                    }
                }
                Line::Event(DriverEvent::Done { exit_code, error }) => {
                    outcome.exit_code = exit_code;
                    outcome.error = error;
                    break;
                }
                Line::Event(DriverEvent::Ready { .. }) => {}
                Line::Eof => {
                    let exit = (&mut kernel.exited).await.ok();
                    dead = Some(exit);
                }
            },
            exit = &mut kernel.exited => dead = Some(exit.ok()),
            _ = tokio::time::sleep_until(deadline) => {
                outcome.timed_out = true;
                if interrupted {
                    // It did not come back from the interrupt.
                    procs::kill_tree(kernel.pid).await;
                    let exit = (&mut kernel.exited).await.ok();
                    dead = Some(exit);
                } else {
                    interrupted = true;
                    procs::signal_group(kernel.pid, Signal::SIGINT);
                    deadline = tokio::time::Instant::now() + INTERRUPT_GRACE;
                }
            }
        }
    }
    let out_report = finish(&kernel.stdout).await;
    let err_report = finish(&kernel.stderr).await;
    if let Some(path) = frame.file {
        let _ = std::fs::remove_file(path);
    }
    outcome.stdout_bytes = out_report.total;
    outcome.stdout_truncated = out_report.truncated;
    outcome.stderr_bytes = err_report.total;
    outcome.stderr_truncated = err_report.truncated;
    outcome.results_dropped += kernel.events.dropped - dropped_before;
    outcome.oom_killed = crate::limits::hits().since(hits_before).1;
    if let Some(exit) = dead {
        if !outcome.timed_out {
            outcome.crashed = Some(describe_exit(language, exit));
        }
        outcome.exit_code = match exit {
            Some(Exit::Code(c)) => c,
            Some(Exit::Signal(s)) => 128 + s,
            None => -1,
        };
        outcome.state_lost = true;
        if let Some(k) = slot.take() {
            k.kill().await;
        }
        if let Err((_, msg)) = respawn(agent, &ctx, &mut slot).await {
            tracing::warn!("context {context_id}: could not restart the interpreter: {msg}");
        }
    }
    outcome.duration_ms = runcell_protocol::units::millis(started.elapsed());
    send(out, id, Event::CellDone(outcome), Vec::new()).await;
}

struct CellFrame {
    bytes: Vec<u8>,
    file: Option<String>,
}

/// What is written to the driver for one cell: the code itself, length-prefixed,
/// or for bash the path of a file holding it (the shell sources it).
fn cell_frame(language: Language, code: &[u8]) -> std::io::Result<CellFrame> {
    match language {
        Language::Bash => {
            let path = format!("{CELL_DIR}/{}.sh", new_id());
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o644)
                .open(&path)?;
            f.write_all(code)?;
            Ok(CellFrame {
                bytes: format!("{path}\n").into_bytes(),
                file: Some(path),
            })
        }
        _ => {
            let mut bytes = format!("{}\n", code.len()).into_bytes();
            bytes.extend_from_slice(code);
            Ok(CellFrame { bytes, file: None })
        }
    }
}
