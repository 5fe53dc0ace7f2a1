//! Sandbox lifecycle for runcell, independent of any API surface.
//!
//! A [`Runtime`] knows where sandboxes live on the host and how to start
//! their agent; [`Runtime::create`] returns a [`Sandbox`] that runs commands
//! and code, moves files and reports resource use, and is destroyed with
//! [`Sandbox::destroy`].
//!
//! ```no_run
//! # async fn demo() -> Result<(), runcell_core::Error> {
//! use runcell_core::{Runtime, RuntimeConfig, SandboxOptions, RunOptions};
//! use runcell_protocol::Language;
//!
//! let runtime = Runtime::new(RuntimeConfig::default())?;
//! let sandbox = runtime.create(SandboxOptions::default()).await?;
//! let result = sandbox
//!     .run_code(Language::Python, "print(6*7)", &RunOptions::default())
//!     .await?;
//! assert_eq!(result.stdout, b"42\n");
//! sandbox.destroy().await?;
//! # Ok(()) }
//! ```

pub mod backend;
pub mod build;
mod client;
mod context;
pub mod host;
pub mod limits;
mod runtime;
mod sandbox;
pub mod signals;
mod template;
mod time;

pub use client::{AgentClient, ClientError};
pub use context::{CellEvent, CellReport, CellRun, ContextOptions, MimeBundle};
pub use limits::{
    format_secs, format_size, parse_duration, parse_size, DurationError, SandboxLimits, SizeError,
};
pub use runtime::{find_agent, Runtime, RuntimeConfig, SandboxOptions};
pub use sandbox::{
    truncation_marker, ExecOutcome, ExecResult, ExecRun, FirstProgram, FirstRun, Output, RunEvent,
    RunOptions, Sandbox, StartedRun,
};
pub use template::{
    layer_path, Manifest, Template, TemplateDefaults, TemplateError, DEFAULT_TEMPLATE, LAYERS_DIR,
};
pub use time::{rfc3339, timestamp};

/// Errors from the core.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The isolation backend could not create, find or remove the sandbox.
    #[error(transparent)]
    Jail(#[from] backend::BackendError),
    /// Talking to the agent failed.
    #[error(transparent)]
    Agent(#[from] ClientError),
    /// A template problem.
    #[error(transparent)]
    Template(#[from] TemplateError),
    /// A blocking task was lost.
    #[error("An internal task failed.")]
    Task(#[source] tokio::task::JoinError),
    /// The sandbox has no egress socket.
    #[error("This sandbox was created without egress, so its network policy cannot be changed (sandboxes re-attached after a daemon restart lose their egress).")]
    NoEgress,
    /// The egress socket could not be served.
    #[error("The sandbox's egress socket could not be served.")]
    EgressSocket(#[source] std::io::Error),
    /// The sandbox ended while a request ran, and its counters say why.
    #[error("The sandbox is no longer running: {0}.")]
    Ended(String),
    /// The host cannot run the isolation asked for.
    #[error("This host cannot run {0} sandboxes: {1}.")]
    IsolationUnavailable(backend::Isolation, String),
    /// The agent binary could not be found.
    #[error("The sandbox agent binary (runcell-agent) was not found next to {0}; build the workspace or set RUNCELL_AGENT.")]
    AgentNotFound(std::path::PathBuf),
}
