//! Messages exchanged between host and agent.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::Language;

/// A request from the host. `id` is chosen by the host and echoed on every
/// event that answers it, so many requests can run at once on one connection.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClientMessage {
    /// Request id, unique per connection.
    pub id: u64,
    /// The request.
    #[serde(flatten)]
    pub request: Request,
}

/// An event from the agent, answering the request with the same `id`
/// (`id` 0 is used for [`Event::Hello`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServerMessage {
    /// The request this event belongs to.
    pub id: u64,
    /// The event.
    #[serde(flatten)]
    pub event: Event,
}

/// What to run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Command {
    /// An argv vector; `argv[0]` is looked up on the sandbox's PATH.
    Argv(Vec<String>),
    /// A shell command line, run with `/bin/bash -c`.
    Shell(String),
}

/// Start a process. The frame body is the process's whole standard input
/// (closed once written).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExecRequest {
    /// What to run.
    pub command: Command,
    /// Extra environment variables (added to the sandbox's base environment).
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Working directory; the sandbox user's home when absent.
    #[serde(default)]
    pub cwd: Option<String>,
    /// Wall-clock limit in milliseconds; no limit when absent.
    #[serde(default)]
    pub timeout_ms: Option<u64>,
    /// Bytes of each of stdout and stderr that are forwarded; the rest is counted.
    pub output_limit: u64,
    /// Who the process runs as; the sandbox user when absent. Only the
    /// template builder sets it (`RUN` steps run as root of the sandbox, or
    /// as the recipe's `USER`); the API never does.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<ExecUser>,
    /// Keep the processes the command leaves behind (`cmd &`, daemons)
    /// running after it returns. By default every process the exec started,
    /// however it detached (background jobs, `nohup`, `setsid`, double
    /// forks), is killed when the command itself exits.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub background: bool,
}

/// A user other than the sandbox user, for [`ExecRequest::user`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExecUser {
    /// User name (`USER`, `LOGNAME`).
    pub name: String,
    /// Uid inside the sandbox; 0 is root of the sandbox's user namespace.
    pub uid: u32,
    /// Gid inside the sandbox.
    pub gid: u32,
    /// Home directory (`HOME`, and the working directory when none is given).
    pub home: String,
}

/// Run source code in a language. The frame body is the source code.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunCodeRequest {
    /// The language.
    pub language: Language,
    /// Arguments passed to the program after the source file.
    #[serde(default)]
    pub args: Vec<String>,
    /// Extra environment variables.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Working directory; the sandbox user's home when absent.
    #[serde(default)]
    pub cwd: Option<String>,
    /// Wall-clock limit in milliseconds.
    #[serde(default)]
    pub timeout_ms: Option<u64>,
    /// Bytes of each of stdout and stderr that are forwarded; the rest is counted.
    pub output_limit: u64,
}

/// A request from host to agent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Request {
    /// Start a process; answered by `ExecStarted`, output events, then `ExecExited`.
    Exec(ExecRequest),
    /// Run code; answered like `Exec`.
    RunCode(RunCodeRequest),
    /// Send a signal to the process tree of a running exec (by its request id).
    Signal {
        /// The request id of the exec.
        exec_id: u64,
        /// The signal number.
        signal: i32,
    },
    /// Read a file; answered by `Data` chunks then `FileEnd`.
    ReadFile {
        /// Absolute path inside the sandbox.
        path: String,
        /// Refuse files larger than this.
        max_bytes: u64,
    },
    /// Write the frame body to a file (parents are created); answered by `Written`.
    WriteFile {
        /// Absolute path inside the sandbox.
        path: String,
        /// Append instead of truncating.
        #[serde(default)]
        append: bool,
        /// Permission bits for a new file.
        #[serde(default)]
        mode: Option<u32>,
    },
    /// List a directory; answered by `Dir`.
    ListDir {
        /// Absolute path inside the sandbox.
        path: String,
    },
    /// Stat a path; answered by `Stat`.
    Stat {
        /// Absolute path inside the sandbox.
        path: String,
    },
    /// Create a directory and its parents; answered by `Done`.
    MakeDir {
        /// Absolute path inside the sandbox.
        path: String,
    },
    /// Remove a file or a directory tree; answered by `Done`.
    Remove {
        /// Absolute path inside the sandbox.
        path: String,
    },
    /// Report resource use; answered by `Stats`.
    Stats,
    /// Set (or clear) the agent's hard deadline, a unix time in milliseconds
    /// after which the agent stops the sandbox by itself; answered by `Done`.
    SetDeadline {
        /// Unix time in milliseconds, or none for no deadline.
        unix_ms: Option<u64>,
    },
    /// Turn the sandbox's egress proxy listener (`127.0.0.1:3128`) and the
    /// proxy environment of new processes on or off (the host changed the
    /// network policy); answered by `Done`, or an error when the sandbox has
    /// no egress socket.
    SetEgress {
        /// On for `allowlist` and `open`, off for `none`.
        enabled: bool,
    },
    /// Stop every process and exit; answered by `Done` just before exiting.
    Shutdown,
    /// Liveness check; answered by `Done`.
    Ping,
    /// Start a code context (a long-lived interpreter); answered by `Context`
    /// once the interpreter is ready.
    ContextCreate(ContextCreateRequest),
    /// Run a cell in a context. The frame body is the source code. Answered by
    /// `Stdout`/`Stderr` chunks and `Result` events, then `CellDone`.
    ContextRun {
        /// The context.
        context_id: String,
        /// Wall-clock limit in milliseconds; the interpreter is interrupted,
        /// then restarted if it does not come back.
        timeout_ms: u64,
        /// Bytes of each of stdout and stderr that are forwarded.
        output_limit: u64,
    },
    /// Kill a context's interpreter and start a fresh one; answered by `Context`.
    ContextRestart {
        /// The context.
        context_id: String,
    },
    /// Stop a context; answered by `Done`.
    ContextDelete {
        /// The context.
        context_id: String,
    },
    /// List contexts; answered by `Contexts`.
    ContextList,
}

/// Start a code context.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ContextCreateRequest {
    /// The interpreter's language.
    pub language: Language,
    /// Working directory; the sandbox user's home when absent.
    #[serde(default)]
    pub cwd: Option<String>,
    /// Extra environment variables.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Python modules imported before the context reports ready.
    #[serde(default)]
    pub preload: Vec<String>,
}

/// A code context.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ContextInfo {
    /// Id, unique within the sandbox (16 hex digits).
    pub id: String,
    /// Language.
    pub language: Language,
    /// Working directory it started in.
    pub cwd: String,
    /// Creation time, unix milliseconds.
    pub created_unix_ms: u64,
    /// Cells run so far.
    pub cells: u64,
    /// Times the interpreter was restarted (state lost each time).
    pub restarts: u64,
    /// The interpreter's pid inside the sandbox.
    pub pid: i32,
    /// Preload modules that failed to import, with the error.
    #[serde(default)]
    pub preload_errors: Vec<String>,
}

/// An exception raised by a cell.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CellError {
    /// Exception class name (`ZeroDivisionError`).
    pub name: String,
    /// Its message.
    pub value: String,
    /// The formatted traceback, showing the cell's own lines.
    pub traceback: String,
}

/// How a cell ended.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CellOutcome {
    /// 0, 1 after an uncaught exception, the `SystemExit`/`exit` code, or
    /// 128 + signal when the interpreter died.
    pub exit_code: i32,
    /// The uncaught exception, if any.
    pub error: Option<CellError>,
    /// Wall-clock duration in milliseconds.
    pub duration_ms: u64,
    /// Total bytes written to stdout (including any not forwarded).
    pub stdout_bytes: u64,
    /// Total bytes written to stderr (including any not forwarded).
    pub stderr_bytes: u64,
    /// Stdout was cut at the output limit.
    pub stdout_truncated: bool,
    /// Stderr was cut at the output limit.
    pub stderr_truncated: bool,
    /// The cell ran past its timeout.
    pub timed_out: bool,
    /// The interpreter died during the cell (crash, `os._exit`, or killed
    /// after a timeout): a sentence saying how.
    pub crashed: Option<String>,
    /// A fresh interpreter was started; everything defined before is gone.
    pub state_lost: bool,
    /// Results dropped because they exceeded the size limit.
    pub results_dropped: u32,
    /// A process was killed for exceeding the memory limit during the
    /// cell, as counted by a microVM guest's kernel (the host counts the
    /// jail's and gVisor's).
    #[serde(default)]
    pub oom_killed: bool,
}

impl CellOutcome {
    /// Plain sentences about what went wrong, for people and models.
    pub fn messages(&self, language: Language, timeout_ms: u64) -> Vec<String> {
        let mut m = Vec::new();
        if self.timed_out {
            let secs = timeout_ms as f64 / 1000.0;
            if self.state_lost {
                m.push(format!(
                    "The cell timed out after {secs}s and the {language} interpreter did not respond to the interrupt, so it was killed and restarted: variables, imports and other state from earlier cells are lost."
                ));
            } else {
                m.push(format!(
                    "The cell timed out after {secs}s and was interrupted; the context's earlier state is kept."
                ));
            }
        } else if let Some(c) = &self.crashed {
            m.push(format!(
                "{c} The interpreter was restarted: variables, imports and other state from earlier cells are lost."
            ));
        }
        if self.results_dropped > 0 {
            m.push(format!(
                "{} result(s) were dropped because they were larger than the limit.",
                self.results_dropped
            ));
        }
        m
    }
}

/// Which output stream a chunk came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Stream {
    /// Standard output.
    Stdout,
    /// Standard error.
    Stderr,
}

/// How a process ended.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExitInfo {
    /// Exit code when the process exited normally.
    pub exit_code: Option<i32>,
    /// Signal number when the process was killed by a signal.
    pub signal: Option<i32>,
    /// The run exceeded its timeout and its process tree was killed.
    pub timed_out: bool,
    /// Wall-clock duration in milliseconds.
    pub duration_ms: u64,
    /// Total bytes written to stdout (including any not forwarded).
    pub stdout_bytes: u64,
    /// Total bytes written to stderr (including any not forwarded).
    pub stderr_bytes: u64,
    /// Stdout was cut at the output limit.
    pub stdout_truncated: bool,
    /// Stderr was cut at the output limit.
    pub stderr_truncated: bool,
    /// When the run ended the writable layer had no free space left.
    #[serde(default)]
    pub disk_full: bool,
    /// When the run ended the writable layer held as many files as its cap
    /// allows (creating more fails with ENOSPC while `df` shows free space).
    #[serde(default)]
    pub files_full: bool,
    /// A fork failed during the run because the sandbox's process limit was
    /// reached, as counted by a kernel the host cannot read (gVisor's own
    /// cgroups, a microVM guest's); the jail's hits are counted by the host.
    #[serde(default)]
    pub pids_limit: bool,
    /// A process was killed for exceeding the memory limit during the run,
    /// as counted by a microVM guest's kernel (the host counts the jail's
    /// and gVisor's).
    #[serde(default)]
    pub oom_killed: bool,
}

impl ExitInfo {
    /// The conventional shell status: the exit code, or 128 + signal.
    pub fn status(&self) -> i32 {
        match (self.exit_code, self.signal) {
            (Some(c), _) => c,
            (None, Some(s)) => 128 + s,
            (None, None) => -1,
        }
    }
}

/// File type and size.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileStat {
    /// Base name.
    pub name: String,
    /// Is a directory.
    pub is_dir: bool,
    /// Is a symbolic link.
    pub is_symlink: bool,
    /// Size in bytes.
    pub size: u64,
    /// Permission bits.
    pub mode: u32,
    /// Modification time, unix seconds.
    pub mtime: i64,
}

/// Resource use as seen from inside the sandbox.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AgentStats {
    /// Processes in the sandbox, the agent included.
    pub processes: u64,
    /// Sum of resident memory of those processes.
    pub rss_bytes: u64,
    /// Bytes used on the writable layer.
    pub disk_used_bytes: u64,
    /// Size of the writable layer.
    pub disk_total_bytes: u64,
    /// The agent's own resident memory.
    pub agent_rss_bytes: u64,
    /// Milliseconds since the agent started.
    pub uptime_ms: u64,
    /// The Landlock ABI the agent confined the sandbox with (file access
    /// only beneath its root); 0 when the kernel offers none (or under
    /// gVisor, which does not implement it).
    #[serde(default)]
    pub landlock_abi: u32,
}

/// Kinds of request failure.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorKind {
    /// The path does not exist.
    NotFound,
    /// The request is invalid (relative path, bad argument, unknown exec id).
    InvalidInput,
    /// Permission denied inside the sandbox.
    PermissionDenied,
    /// The writable layer is full.
    NoSpace,
    /// The file is larger than allowed.
    TooLarge,
    /// The command could not be started (not found, not executable).
    SpawnFailed,
    /// Anything else.
    Other,
}

/// An event from agent to host.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "ev", rename_all = "snake_case")]
pub enum Event {
    /// First message on every connection.
    Hello {
        /// [`crate::PROTOCOL_VERSION`] of the agent.
        version: u32,
        /// The agent's crate version.
        agent_version: String,
        /// The sandbox id the agent was started for.
        sandbox_id: String,
    },
    /// A process started.
    ExecStarted {
        /// Its pid inside the sandbox.
        pid: i32,
    },
    /// A chunk of stdout (body).
    Stdout,
    /// A chunk of stderr (body).
    Stderr,
    /// The process ended; last event of an exec.
    ExecExited(ExitInfo),
    /// A chunk of file contents (body).
    Data,
    /// End of a file read.
    FileEnd {
        /// Bytes sent.
        size: u64,
    },
    /// A file was written.
    Written {
        /// Bytes written by this request.
        bytes: u64,
    },
    /// Directory entries.
    Dir {
        /// Entries, in no particular order.
        entries: Vec<FileStat>,
    },
    /// A stat result.
    Stat(FileStat),
    /// Resource use.
    Stats(AgentStats),
    /// The request succeeded with nothing to report.
    Done,
    /// A context was started or restarted.
    Context {
        /// The context (not flattened: its `id` would clash with the message's).
        context: ContextInfo,
    },
    /// Every context of the sandbox.
    Contexts {
        /// The contexts, oldest first.
        contexts: Vec<ContextInfo>,
    },
    /// A rich result of a cell: the body is a JSON object mapping MIME types
    /// to strings (a MIME bundle; binary types are base64).
    Result,
    /// A cell finished; last event of a `ContextRun`.
    CellDone(CellOutcome),
    /// The request failed; last event of that request.
    Error {
        /// The kind of failure.
        kind: ErrorKind,
        /// A sentence for the user.
        message: String,
    },
}

impl Event {
    /// Whether this event ends the request it answers.
    pub fn is_final(&self) -> bool {
        !matches!(
            self,
            Event::ExecStarted { .. } | Event::Stdout | Event::Stderr | Event::Data | Event::Result
        )
    }
}
