//! One running sandbox, seen from the host.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::backend::{Counters, Instance, Isolation, Kills};
use runcell_protocol::{
    AgentStats, Command, ErrorKind, Event, ExecRequest, ExecUser, ExitInfo, FileStat, Language,
    Request, RunCodeRequest,
};

use crate::client::{AgentClient, ClientError, Replies};
use crate::limits::{format_secs, format_size, SandboxLimits};
use crate::template::Template;
use crate::Error;

/// Which stream a chunk of output came from.
pub use runcell_protocol::Stream as Output;

/// Options for one run.
#[derive(Debug, Clone, Default)]
pub struct RunOptions {
    /// Extra environment variables.
    pub env: BTreeMap<String, String>,
    /// Working directory (the user's home when absent).
    pub cwd: Option<String>,
    /// Wall-clock limit; the sandbox's default when absent.
    pub timeout: Option<Duration>,
    /// Standard input (exec only).
    pub stdin: Vec<u8>,
    /// Arguments after the source file (code runs only).
    pub args: Vec<String>,
    /// Run as this user instead of the sandbox user (exec only). Only the
    /// template builder sets it; no API request can.
    pub user: Option<ExecUser>,
    /// Keep the processes the command leaves behind running after it returns
    /// (exec only). By default they are all killed when the command exits.
    pub background: bool,
}

/// A program a sandbox starts as soon as it is up
/// ([`crate::SandboxOptions::first_run`]): what [`Sandbox::run_code_start`]
/// or [`Sandbox::exec_start`] take.
#[derive(Debug, Clone)]
pub struct FirstRun {
    /// What runs.
    pub program: FirstProgram,
    /// How it runs (its timeout, when absent, the sandbox's).
    pub opts: RunOptions,
}

/// The program of a [`FirstRun`].
#[derive(Debug, Clone)]
pub enum FirstProgram {
    /// Source code in a language.
    Code {
        /// Its language.
        language: Language,
        /// The source.
        code: String,
    },
    /// A command.
    Command(Command),
}

/// A run started with its sandbox, before anyone asked for its events
/// ([`Sandbox::take_first_run`]); [`Sandbox::resume_run`] reads it. Dropped
/// unread, it closes its connection and the agent kills its processes, as
/// for any client that goes away.
#[derive(Debug)]
pub struct StartedRun {
    replies: Replies,
    timeout: Duration,
    before: Kills,
}

/// How a run ended, with the limits it hit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecOutcome {
    /// Exit status, durations and output totals.
    pub exit: ExitInfo,
    /// The timeout that applied.
    pub timeout: Duration,
    /// A process of this sandbox was killed for exceeding the memory limit
    /// during the run.
    pub oom_killed: bool,
    /// A fork failed during the run because the process limit was reached.
    pub pids_limit: bool,
    /// The limit hit ended the whole sandbox, not one process (gVisor's
    /// Sentry is one host process: the kernel's OOM killer takes it all).
    pub sandbox_ended: bool,
    /// The memory limit, for messages.
    pub memory_limit: u64,
    /// The process limit, for messages.
    pub pids_max: u64,
    /// The disk limit, for messages.
    pub disk_limit: u64,
}

impl ExecOutcome {
    /// The status a shell would report: the exit code, 128 + signal, or 124
    /// for a timeout (as timeout(1) does).
    pub fn status(&self) -> i32 {
        if self.exit.timed_out {
            124
        } else {
            self.exit.status()
        }
    }

    /// Plain sentences about every limit the run hit, for people and models.
    pub fn messages(&self) -> Vec<String> {
        let mut out = Vec::new();
        if self.exit.timed_out {
            out.push(format!(
                "Execution exceeded the {} s timeout and was stopped.",
                format_secs(self.timeout)
            ));
        }
        if self.oom_killed && self.sandbox_ended {
            out.push(format!(
                "The sandbox ran out of memory (limit {}) and was stopped: under gVisor a memory limit ends the whole sandbox.",
                format_size(self.memory_limit)
            ));
        } else if self.oom_killed {
            out.push(format!(
                "The sandbox ran out of memory (limit {}) and a process was killed.",
                format_size(self.memory_limit)
            ));
        }
        if self.exit.disk_full {
            out.push(format!(
                "The sandbox's disk is full (limit {}); writes fail with \"No space left on device\" (\"Disk quota exceeded\" with the btrfs layer store).",
                format_size(self.disk_limit)
            ));
        }
        if self.exit.files_full {
            out.push(format!(
                "The sandbox holds as many files as its disk allows ({} for {}); creating more fails with \"No space left on device\".",
                runcell_jail::inside::inode_limit(self.disk_limit),
                format_size(self.disk_limit)
            ));
        }
        if self.pids_limit {
            out.push(format!(
                "The sandbox reached its process limit ({}); new processes could not be started.",
                self.pids_max
            ));
        }
        for (name, truncated, total) in [
            ("stdout", self.exit.stdout_truncated, self.exit.stdout_bytes),
            ("stderr", self.exit.stderr_truncated, self.exit.stderr_bytes),
        ] {
            if truncated {
                out.push(truncation_marker(name, total));
            }
        }
        out
    }
}

/// The marker appended where output was cut.
pub fn truncation_marker(stream: &str, total: u64) -> String {
    // The human size only where it says more than the byte count.
    if total < 1024 {
        return format!("[runcell: {stream} truncated; the program wrote {total} bytes in total]");
    }
    format!(
        "[runcell: {stream} truncated; the program wrote {total} bytes ({}) in total]",
        format_size(total)
    )
}

/// A finished run with its (capped) output collected.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecResult {
    /// How it ended.
    pub outcome: ExecOutcome,
    /// Stdout, at most the output limit.
    pub stdout: Vec<u8>,
    /// Stderr, at most the output limit.
    pub stderr: Vec<u8>,
}

/// A running sandbox.
#[derive(Debug)]
pub struct Sandbox {
    jail: Option<Box<dyn Instance>>,
    agent: AgentClient,
    template: Template,
    limits: SandboxLimits,
    isolation: Isolation,
    pub(crate) egress: Option<EgressHandle>,
    /// The highest kill counters read so far: they only grow, and a
    /// sandbox that ended may have lost its cgroup (and their values) to the
    /// reaper before an exec asks why it ended.
    seen: std::sync::Mutex<Kills>,
    /// The run of [`crate::SandboxOptions::first_run`], until taken.
    first: std::sync::Mutex<Option<StartedRun>>,
    /// The deadline (unix ms) its agent stops it at, as last sent; 0 while
    /// unknown (a sandbox re-attached after a restart, until it is sent).
    deadline_ms: std::sync::atomic::AtomicU64,
}

/// A sandbox's egress state and the proxy task serving its socket (stopped
/// when the sandbox value goes away).
#[derive(Debug)]
pub(crate) struct EgressHandle {
    pub(crate) state: std::sync::Arc<runcell_egress::Egress>,
    pub(crate) task: tokio::task::JoinHandle<()>,
}

impl Drop for EgressHandle {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Sandbox {
    pub(crate) fn new(
        jail: Box<dyn Instance>,
        agent: AgentClient,
        template: Template,
        limits: SandboxLimits,
        isolation: Isolation,
    ) -> Self {
        Self {
            jail: Some(jail),
            agent,
            template,
            limits,
            isolation,
            egress: None,
            seen: std::sync::Mutex::new(Kills::default()),
            first: std::sync::Mutex::new(None),
            deadline_ms: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// Notes the deadline its agent was started with.
    pub(crate) fn started_with_deadline(&self, unix_ms: Option<u64>) {
        self.deadline_ms
            .store(unix_ms.unwrap_or(0), std::sync::atomic::Ordering::Relaxed);
    }

    /// Runs `talk`, a conversation with the agent. When the connection
    /// itself failed (the agent could not be reached, or closed it before
    /// answering), the sandbox has usually ended: the error then says so,
    /// and why, as far as its counters and deadline tell ([`Error::Ended`]),
    /// not how a socket failed. Its processes can take a moment to go after
    /// the agent's sockets closed: it is waited for (at most
    /// [`ENDING_WAIT`], and only on this failure's path).
    pub(crate) async fn talk<T>(
        &self,
        talk: impl std::future::Future<Output = Result<T, ClientError>>,
    ) -> Result<T, Error> {
        match talk.await {
            Ok(v) => Ok(v),
            Err(e) if e.is_connection_lost() => {
                let until = tokio::time::Instant::now() + ENDING_WAIT;
                while self.is_alive() {
                    if tokio::time::Instant::now() >= until {
                        return Err(e.into());
                    }
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                Err(Error::Ended(
                    self.end_cause()
                        .unwrap_or_else(|| "its agent exited".to_string()),
                ))
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Starts `first` (as the sandbox comes up) and keeps it for
    /// [`Sandbox::take_first_run`].
    pub(crate) async fn start_first(&self, first: &FirstRun) -> Result<(), Error> {
        let run = self.start_program(&first.program, &first.opts).await?;
        let ExecRun {
            replies,
            timeout,
            before,
            ..
        } = run;
        *self
            .first
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(StartedRun {
            replies,
            timeout,
            before,
        });
        Ok(())
    }

    /// Starts `program`: [`Sandbox::run_code_start`] for code,
    /// [`Sandbox::exec_start`] for a command.
    pub async fn start_program(
        &self,
        program: &FirstProgram,
        opts: &RunOptions,
    ) -> Result<ExecRun<'_>, Error> {
        match program {
            FirstProgram::Code { language, code } => {
                self.run_code_start(*language, code, opts).await
            }
            FirstProgram::Command(command) => self.exec_start(command.clone(), opts).await,
        }
    }

    /// The run of [`crate::SandboxOptions::first_run`], started when the
    /// sandbox came up: `None` once taken, or when it had none.
    pub fn take_first_run(&self) -> Option<StartedRun> {
        self.first
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take()
    }

    /// Reads a run [`Sandbox::take_first_run`] gave, as the run
    /// [`Sandbox::run_code_start`] or [`Sandbox::exec_start`] would have
    /// started.
    pub fn resume_run(&self, run: StartedRun) -> ExecRun<'_> {
        ExecRun {
            sandbox: self,
            replies: run.replies,
            timeout: run.timeout,
            before: run.before,
        }
    }

    /// The isolation it runs under.
    pub fn isolation(&self) -> Isolation {
        self.isolation
    }

    /// Freezes every process in it (the cgroup freezer): they keep their
    /// memory and use no CPU until [`Sandbox::resume`]. Blocks briefly.
    pub fn pause(&self) -> Result<(), Error> {
        Ok(self.jail().freeze()?)
    }

    /// Thaws it after [`Sandbox::pause`].
    pub fn resume(&self) -> Result<(), Error> {
        Ok(self.jail().thaw()?)
    }

    /// Whether it is paused.
    pub fn is_paused(&self) -> bool {
        self.jail().is_frozen()
    }

    /// Saves what it wrote (its writable layer: installed packages, files)
    /// into the new directory `dest`, as a state layer another sandbox can
    /// start from ([`SandboxOptions::state_layers`](crate::SandboxOptions)).
    /// It is frozen for the copy, so the layer is one instant of it, and
    /// runs again afterwards unless it was paused. Processes and memory are
    /// not saved. Returns the bytes the layer takes; on failure nothing is
    /// left at `dest`. Blocks for the copy.
    pub fn save_layer(&self, dest: &std::path::Path) -> Result<u64, Error> {
        let jail = self.jail();
        let was_frozen = jail.is_frozen();
        if !was_frozen {
            jail.freeze()?;
        }
        let saved = jail.export_layer(dest);
        if !was_frozen {
            if let Err(e) = jail.thaw() {
                tracing::warn!(sandbox = %jail.id(), "could not thaw it after saving its files: {e}");
            }
        }
        if saved.is_err() {
            // A half-made copy, or a snapshot (a subvolume).
            let _ = runcell_jail::btrfs::remove_tree(dest);
        }
        Ok(saved?)
    }

    /// Saves its processes and memory into the new directory `image`
    /// (gVisor: `runsc checkpoint`, after its agent dropped every host
    /// socket), then its files into the new directory `layer` as
    /// [`Sandbox::save_layer`] does. The sandbox's processes have ended
    /// afterwards, whatever the outcome: destroy it. A start with both
    /// (`SandboxOptions::memory_image`, `state_layers`) goes on where it
    /// was. Returns the bytes the layer takes and whether the memory was
    /// saved: when it could not be, the files still are (nothing is left
    /// at `image`), and the error says why not.
    pub fn checkpoint(
        &self,
        image: &std::path::Path,
        layer: &std::path::Path,
    ) -> Result<(u64, Result<(), Error>), Error> {
        let jail = self.jail();
        let memory = jail.checkpoint(image).map_err(Error::from);
        if memory.is_err() {
            let _ = std::fs::remove_dir_all(image);
            // Whatever runs still must not write while its files are copied.
            if jail.is_alive() && !jail.is_frozen() {
                jail.freeze()?;
            }
        }
        let saved = jail.export_layer(layer);
        if saved.is_err() {
            let _ = std::fs::remove_dir_all(layer);
            let _ = std::fs::remove_dir_all(image);
        }
        Ok((saved?, memory))
    }

    /// Saves its processes and memory into the new directory `image` and
    /// its files into the new directory `layer`, of one instant, and runs
    /// on with its memory (gVisor: checkpoint, copy, restore in place);
    /// then [`Sandbox::reconnect`]. Where the memory cannot be saved and it
    /// still runs (a paused sandbox, or an agent that did not let go of its
    /// connections), its files are saved as [`Sandbox::save_layer`] does,
    /// and the inner error says why not. Returns the bytes the layer takes.
    /// An error: nothing was saved, and it may have ended (`is_alive`).
    pub fn save_running(
        &self,
        image: &std::path::Path,
        layer: &std::path::Path,
    ) -> Result<(u64, Result<(), Error>), Error> {
        let jail = self.jail();
        let why_not = if jail.is_frozen() {
            // Its agent cannot let go of its connections while frozen.
            Error::Jail(crate::backend::BackendError::Unsupported {
                isolation: self.isolation,
                what: "save the memory of a paused sandbox",
            })
        } else {
            match jail.save_running(image, layer) {
                Ok(bytes) => return Ok((bytes, Ok(()))),
                Err(e) => Error::from(e),
            }
        };
        if !jail.is_alive() {
            return Err(why_not);
        }
        Ok((self.save_layer(layer)?, Err(why_not)))
    }

    /// Connects to its agent again, after [`Sandbox::save_running`].
    pub async fn reconnect(&self) -> Result<(), Error> {
        Ok(self.agent.reconnect().await?)
    }

    /// The network policy and egress counters; `None` for a sandbox made
    /// without egress (or re-attached after a restart, whose egress socket
    /// died with the previous process).
    pub fn network(&self) -> Option<runcell_egress::EgressReport> {
        self.egress.as_ref().map(|e| e.state.report())
    }

    /// The shared egress state (policy and counters).
    pub fn egress_state(&self) -> Option<std::sync::Arc<runcell_egress::Egress>> {
        self.egress.as_ref().map(|e| e.state.clone())
    }

    /// Changes the network policy of the running sandbox: the proxy checks
    /// new requests against it, and the agent turns its proxy listener and
    /// the proxy environment of new processes on or off.
    pub async fn set_network(&self, policy: runcell_egress::NetworkPolicy) -> Result<(), Error> {
        let Some(e) = &self.egress else {
            return Err(Error::NoEgress);
        };
        let enabled = policy.has_egress();
        let previous = e.state.policy();
        e.state.set_policy(policy);
        if let Err(err) = self
            .talk(self.agent.call(Request::SetEgress { enabled }, Vec::new()))
            .await
        {
            // The agent kept its old state (for instance, sandboxed code
            // holds 127.0.0.1:3128): so does the proxy.
            e.state.set_policy(previous);
            return Err(err);
        }
        Ok(())
    }

    fn jail(&self) -> &dyn Instance {
        self.jail.as_deref().expect("present until destroy")
    }

    /// The sandbox id.
    pub fn id(&self) -> &str {
        self.jail().id()
    }

    /// The template it was made from.
    pub fn template(&self) -> &Template {
        &self.template
    }

    /// Its limits.
    pub fn limits(&self) -> &SandboxLimits {
        &self.limits
    }

    /// Host pid of the agent.
    pub fn agent_pid(&self) -> i32 {
        self.jail().pid()
    }

    pub(crate) fn agent(&self) -> &AgentClient {
        &self.agent
    }

    /// Cgroup counters. The kill counters never go back, even once the
    /// cgroup is gone.
    pub fn counters(&self) -> Counters {
        let mut now = self.jail().counters();
        let kills = self.seen_kills(now.into());
        now.oom_kills = kills.oom_kills;
        now.pids_limit_hits = kills.pids_limit_hits;
        now
    }

    /// The kill counters alone (what a run compares before and after it),
    /// which never go back either.
    pub fn kills(&self) -> Kills {
        self.seen_kills(self.jail().kills())
    }

    fn seen_kills(&self, now: Kills) -> Kills {
        let mut seen = self
            .seen
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        seen.oom_kills = seen.oom_kills.max(now.oom_kills);
        seen.pids_limit_hits = seen.pids_limit_hits.max(now.pids_limit_hits);
        *seen
    }

    /// Why a sandbox that is no longer running ended, as far as its
    /// counters tell: a sentence fragment such as "it ran out of memory
    /// (limit 512 MiB)", or `None` when they name nothing.
    pub fn end_cause(&self) -> Option<String> {
        let c = self.kills();
        if c.oom_kills > 0 {
            return Some(format!(
                "it ran out of memory (limit {})",
                crate::format_size(self.limits.memory_bytes)
            ));
        }
        if c.pids_limit_hits > 0 {
            return Some(format!(
                "it reached its process limit ({})",
                self.limits.pids
            ));
        }
        let deadline = self.deadline_ms.load(std::sync::atomic::Ordering::Relaxed);
        let now = runcell_protocol::units::unix_millis(std::time::SystemTime::now());
        if deadline > 0 && now >= deadline {
            return Some(
                "its agent stopped it at its deadline (its idle timeout or maximum lifetime passed)"
                    .to_string(),
            );
        }
        None
    }

    /// Requests of work in progress on this sandbox (execs, code runs, cells,
    /// file operations): while there are any, the sandbox is not idle.
    pub fn work_in_progress(&self) -> usize {
        self.agent.work_in_progress()
    }

    /// Starts a command; its output and end are read from the returned run
    /// at the caller's pace (a slow reader holds back the process, not the
    /// daemon's memory nor the sandbox's other requests).
    pub async fn exec_start(
        &self,
        command: Command,
        opts: &RunOptions,
    ) -> Result<ExecRun<'_>, Error> {
        let timeout = opts.timeout.unwrap_or(self.limits.timeout);
        let req = Request::Exec(ExecRequest {
            command,
            env: opts.env.clone(),
            cwd: opts.cwd.clone(),
            timeout_ms: Some(runcell_protocol::units::millis(timeout)),
            output_limit: self.limits.output_bytes,
            user: opts.user.clone(),
            background: opts.background,
        });
        self.start(req, opts.stdin.clone(), timeout).await
    }

    /// Starts source code, like [`Sandbox::exec_start`].
    pub async fn run_code_start(
        &self,
        language: Language,
        code: &str,
        opts: &RunOptions,
    ) -> Result<ExecRun<'_>, Error> {
        let timeout = opts.timeout.unwrap_or(self.limits.timeout);
        let req = Request::RunCode(RunCodeRequest {
            language,
            args: opts.args.clone(),
            env: opts.env.clone(),
            cwd: opts.cwd.clone(),
            timeout_ms: Some(runcell_protocol::units::millis(timeout)),
            output_limit: self.limits.output_bytes,
        });
        self.start(req, code.as_bytes().to_vec(), timeout).await
    }

    async fn start(
        &self,
        req: Request,
        body: Vec<u8>,
        timeout: Duration,
    ) -> Result<ExecRun<'_>, Error> {
        let before = self.kills();
        let replies = self.talk(self.agent.request_own(req, body)).await?;
        Ok(ExecRun {
            sandbox: self,
            replies,
            timeout,
            before,
        })
    }

    /// Runs a command, calling `on_output` for each chunk as it arrives.
    pub async fn exec_streaming(
        &self,
        command: Command,
        opts: &RunOptions,
        mut on_output: impl FnMut(Output, &[u8]),
    ) -> Result<ExecOutcome, Error> {
        let mut run = self.exec_start(command, opts).await?;
        run.drive(&mut on_output).await
    }

    /// Runs source code, calling `on_output` for each chunk as it arrives.
    pub async fn run_code_streaming(
        &self,
        language: Language,
        code: &str,
        opts: &RunOptions,
        mut on_output: impl FnMut(Output, &[u8]),
    ) -> Result<ExecOutcome, Error> {
        let mut run = self.run_code_start(language, code, opts).await?;
        run.drive(&mut on_output).await
    }

    /// Runs a command and collects its output.
    pub async fn exec(&self, command: Command, opts: &RunOptions) -> Result<ExecResult, Error> {
        let (mut stdout, mut stderr) = (Vec::new(), Vec::new());
        let outcome = self
            .exec_streaming(command, opts, |s, b| {
                collect(&mut stdout, &mut stderr, s, b)
            })
            .await?;
        Ok(ExecResult {
            outcome,
            stdout,
            stderr,
        })
    }

    /// Runs source code and collects its output.
    pub async fn run_code(
        &self,
        language: Language,
        code: &str,
        opts: &RunOptions,
    ) -> Result<ExecResult, Error> {
        let (mut stdout, mut stderr) = (Vec::new(), Vec::new());
        let outcome = self
            .run_code_streaming(language, code, opts, |s, b| {
                collect(&mut stdout, &mut stderr, s, b)
            })
            .await?;
        Ok(ExecResult {
            outcome,
            stdout,
            stderr,
        })
    }

    /// Reads a file (at most `max_bytes`).
    pub async fn read_file(&self, path: &str, max_bytes: u64) -> Result<Vec<u8>, Error> {
        let request = Request::ReadFile {
            path: path.into(),
            max_bytes,
        };
        self.talk(async {
            let mut replies = self.agent.request(request, Vec::new()).await?;
            let mut data = Vec::new();
            loop {
                match replies.next().await? {
                    (Event::Data, body) => data.extend_from_slice(&body),
                    (Event::FileEnd { .. }, _) => return Ok(data),
                    (Event::Error { kind, message }, _) => {
                        return Err(ClientError::Agent { kind, message })
                    }
                    (other, _) => return Err(ClientError::Unexpected(Box::new(other))),
                }
            }
        })
        .await
    }

    /// Writes a file, creating parent directories. Large contents are sent in chunks.
    pub async fn write_file(&self, path: &str, data: &[u8]) -> Result<u64, Error> {
        let chunk = runcell_protocol::MAX_BODY / 2;
        let mut written = 0u64;
        let mut first = true;
        let mut rest = data;
        loop {
            let (now, later) = rest.split_at(rest.len().min(chunk));
            let req = Request::WriteFile {
                path: path.into(),
                append: !first,
                mode: None,
            };
            match self.talk(self.agent.call(req, now.to_vec())).await? {
                (Event::Written { bytes }, _) => written += bytes,
                (other, _) => return Err(ClientError::Unexpected(Box::new(other)).into()),
            }
            first = false;
            rest = later;
            if rest.is_empty() {
                return Ok(written);
            }
        }
    }

    /// Lists a directory.
    pub async fn list_dir(&self, path: &str) -> Result<Vec<FileStat>, Error> {
        match self
            .talk(
                self.agent
                    .call(Request::ListDir { path: path.into() }, Vec::new()),
            )
            .await?
        {
            (Event::Dir { entries }, _) => Ok(entries),
            (other, _) => Err(ClientError::Unexpected(Box::new(other)).into()),
        }
    }

    /// Stats a path.
    pub async fn stat(&self, path: &str) -> Result<FileStat, Error> {
        match self
            .talk(
                self.agent
                    .call(Request::Stat { path: path.into() }, Vec::new()),
            )
            .await?
        {
            (Event::Stat(s), _) => Ok(s),
            (other, _) => Err(ClientError::Unexpected(Box::new(other)).into()),
        }
    }

    /// Whether the agent is still running.
    pub fn is_alive(&self) -> bool {
        self.jail().is_alive()
    }

    /// Sets the agent's own deadline (unix ms), after which it stops the
    /// sandbox even if no host is left to do it.
    pub async fn set_deadline(&self, unix_ms: Option<u64>) -> Result<(), Error> {
        self.talk(
            self.agent
                .call(Request::SetDeadline { unix_ms }, Vec::new()),
        )
        .await?;
        self.deadline_ms
            .store(unix_ms.unwrap_or(0), std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }

    /// Resource use reported by the agent.
    pub async fn stats(&self) -> Result<AgentStats, Error> {
        match self
            .talk(self.agent.call(Request::Stats, Vec::new()))
            .await?
        {
            (Event::Stats(s), _) => Ok(s),
            (other, _) => Err(ClientError::Unexpected(Box::new(other)).into()),
        }
    }

    /// Asks the agent to stop every process and exit, then removes what is left.
    pub async fn shutdown(self) -> Result<(), Error> {
        match self.agent.call(Request::Shutdown, Vec::new()).await {
            Ok(_) => {}
            // Gone already: what is left is removed all the same.
            Err(e) if e.is_connection_lost() => {}
            Err(e) => return Err(e.into()),
        }
        self.destroy().await
    }

    /// Kills every process in the sandbox (SIGKILL to its PID 1, which takes
    /// the whole pid namespace with it) without waiting for the teardown.
    pub fn kill(&self) {
        self.jail().kill();
    }

    /// Kills every process in the sandbox and removes it.
    #[tracing::instrument(skip_all, fields(sandbox = %self.id()))]
    pub async fn destroy(mut self) -> Result<(), Error> {
        let jail = self.jail.take().expect("present until destroy");
        tokio::task::spawn_blocking(move || jail.destroy())
            .await
            .map_err(Error::Task)??;
        Ok(())
    }
}

/// How long a run whose agent went away waits for its sandbox to end
/// before it answers that the agent's connection closed.
const ENDING_WAIT: Duration = Duration::from_secs(5);

fn collect(stdout: &mut Vec<u8>, stderr: &mut Vec<u8>, stream: Output, bytes: &[u8]) {
    match stream {
        Output::Stdout => stdout.extend_from_slice(bytes),
        Output::Stderr => stderr.extend_from_slice(bytes),
    }
}

/// What a running exec produced next.
#[derive(Debug)]
pub enum RunEvent {
    /// A chunk of output.
    Output(Output, Vec<u8>),
    /// The run ended.
    Done(ExecOutcome),
}

/// A started exec or code run, read at the caller's pace.
#[derive(Debug)]
pub struct ExecRun<'a> {
    sandbox: &'a Sandbox,
    replies: Replies,
    timeout: Duration,
    before: Kills,
}

impl ExecRun<'_> {
    /// The next chunk of output, or the end. The agent enforces the timeout;
    /// should it stall, this gives up 30 s after it.
    pub async fn next(&mut self) -> Result<RunEvent, Error> {
        let backstop = self.timeout + Duration::from_secs(30);
        loop {
            let event = match tokio::time::timeout(backstop, self.replies.next()).await {
                Err(_) => return Err(ClientError::Closed.into()),
                // The agent is gone: if the memory limit took the sandbox
                // with it (a gVisor sandbox is one host process), say so
                // by name rather than "connection closed".
                Ok(Err(ClientError::Closed)) => return self.closed().await,
                Ok(r) => r?,
            };
            return match event {
                (Event::ExecStarted { .. }, _) => continue,
                (Event::Stdout, body) => Ok(RunEvent::Output(Output::Stdout, body)),
                (Event::Stderr, body) => Ok(RunEvent::Output(Output::Stderr, body)),
                (Event::ExecExited(mut exit), _) => {
                    let after = self.sandbox.kills();
                    // A btrfs stage: the agent's statvfs sees the whole
                    // store (and no file count); its qgroup says.
                    if let Some(full) = self.sandbox.jail().layer_full() {
                        exit.disk_full = full;
                        exit.files_full = false;
                    }
                    let limits = &self.sandbox.limits;
                    let (guest_oom, guest_pids) = (exit.oom_killed, exit.pids_limit);
                    Ok(RunEvent::Done(ExecOutcome {
                        exit,
                        timeout: self.timeout,
                        // The host's counters (the jail, gVisor's OOM), or
                        // the sandbox's own kernel as the agent read it
                        // (gVisor's pids, a microVM guest's).
                        oom_killed: after.oom_kills > self.before.oom_kills || guest_oom,
                        pids_limit: after.pids_limit_hits > self.before.pids_limit_hits
                            || guest_pids,
                        sandbox_ended: false,
                        memory_limit: limits.memory_bytes,
                        pids_max: limits.pids,
                        disk_limit: limits.disk_bytes,
                    }))
                }
                (Event::Error { kind, message }, _) => {
                    Err(ClientError::Agent { kind, message }.into())
                }
                (other, _) => Err(ClientError::Unexpected(Box::new(other)).into()),
            };
        }
    }

    /// The answer for a run whose agent went away. The sandbox is ending,
    /// but its processes can take a while to go (a gVisor sandbox after a
    /// fork storm: seconds, thousands of host threads) and its counters say
    /// why only then; the OOM killer counts its kill only after sending it,
    /// and the sandbox's end can reach the channel first. So the sandbox is
    /// waited for (up to [`ENDING_WAIT`]) and, once gone, looked at again
    /// for a moment before its end is called unexplained.
    async fn closed(&self) -> Result<RunEvent, Error> {
        let alive_until = tokio::time::Instant::now() + ENDING_WAIT;
        let mut looks_when_gone = 0;
        loop {
            if self.sandbox.kills().oom_kills > self.before.oom_kills {
                return Ok(RunEvent::Done(self.ended_by_oom()));
            }
            if self.sandbox.is_alive() {
                if tokio::time::Instant::now() >= alive_until {
                    break;
                }
            } else {
                looks_when_gone += 1;
                if looks_when_gone >= 10 {
                    break;
                }
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        match self.sandbox.end_cause() {
            Some(cause) if !self.sandbox.is_alive() => Err(Error::Ended(cause)),
            _ => Err(ClientError::Closed.into()),
        }
    }

    /// The end of a run whose sandbox the memory limit stopped.
    fn ended_by_oom(&self) -> ExecOutcome {
        let limits = &self.sandbox.limits;
        ExecOutcome {
            exit: ExitInfo {
                exit_code: None,
                signal: Some(9),
                timed_out: false,
                duration_ms: 0,
                stdout_bytes: 0,
                stderr_bytes: 0,
                stdout_truncated: false,
                stderr_truncated: false,
                disk_full: false,
                files_full: false,
                pids_limit: false,
                oom_killed: true,
            },
            timeout: self.timeout,
            oom_killed: true,
            pids_limit: false,
            sandbox_ended: true,
            memory_limit: limits.memory_bytes,
            pids_max: limits.pids,
            disk_limit: limits.disk_bytes,
        }
    }

    /// Kills the run's process tree (its end still arrives through `next`).
    pub async fn kill(&self) -> Result<(), Error> {
        Ok(self.replies.kill().await?)
    }

    /// Reads the run to its end, calling `on_output` for each chunk.
    pub async fn drive(
        &mut self,
        on_output: &mut impl FnMut(Output, &[u8]),
    ) -> Result<ExecOutcome, Error> {
        loop {
            match self.next().await? {
                RunEvent::Output(s, b) => on_output(s, &b),
                RunEvent::Done(o) => return Ok(o),
            }
        }
    }
}

impl ClientError {
    /// The agent's error kind, if this is an agent error.
    pub fn kind(&self) -> Option<ErrorKind> {
        match self {
            ClientError::Agent { kind, .. } => Some(*kind),
            _ => None,
        }
    }
}
