//! The isolation-backend seam: how a sandbox's isolation is made, found
//! again and removed, whatever does the isolating.
//!
//! A [`Backend`] makes sandboxes in two phases, so a pool can do the slow
//! half ahead of demand: [`Backend::prepare`] gives a [`Prepared`] sandbox
//! (isolation made, agent running, waiting for its spec; nothing depends on
//! what will run in it), and [`Prepared::start`] sends it a [`StartSpec`]
//! and gives a running [`Instance`]. Every backend runs the same
//! `runcell-agent` as PID 1 of the sandbox and speaks the same protocol to
//! it over the instance's [`AgentChannel`], so everything above the seam
//! (exec, code, files, contexts, egress) is shared.
//!
//! The traits are object-safe: a [`Runtime`](crate::Runtime) holds an
//! `Arc<dyn Backend>`. Their methods block (process creation, cgroup
//! writes, waiting for the agent); the runtime calls them on tokio's
//! blocking pool.
//!
//! Re-attaching after a restart needs only the sandbox's id: a backend
//! records what it needs to find a sandbox again in that sandbox's
//! directory under the runtime's state directory (the jail: `jail.json`).
//!
//! The first backend is [`JailBackend`], the namespace jail of
//! `runcell-jail`; [`GvisorBackend`] runs the same agent in a gVisor
//! (`runsc`) container, and [`MicrovmBackend`] in a QEMU microVM.

mod gvisor;
mod jail;
pub mod microvm;
pub mod probe_cache;

use std::fmt;
use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::time::Duration;

pub use gvisor::{
    find_runsc, host_pids, probe, probe_checkpoint, probe_platform, GvisorBackend, GvisorError,
    GvisorInfo, Platform, SENTRY_MEMORY,
};
pub use jail::JailBackend;
pub use microvm::{MicrovmBackend, MicrovmConfig, MicrovmError, MicrovmInfo};
pub use runcell_jail::cgroup::{Counters, Kills};
pub use runcell_jail::{BindMount, EgressSocket, Limits, RootfsSpec, SandboxUser};

/// Errors of a backend.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// The namespace jail failed.
    #[error(transparent)]
    Jail(#[from] runcell_jail::SpawnError),
    /// The gVisor backend failed.
    #[error(transparent)]
    Gvisor(#[from] GvisorError),
    /// The microVM backend failed.
    #[error(transparent)]
    Microvm(#[from] MicrovmError),
    /// The backend cannot do this.
    #[error("A {isolation} sandbox cannot {what} (only the namespace jail can, for now).")]
    Unsupported {
        /// The sandbox's isolation.
        isolation: Isolation,
        /// What was asked, as a verb phrase.
        what: &'static str,
    },
}

impl BackendError {
    /// Whether a failed start may be retried with another sandbox: the
    /// agent died or its setup channel broke while it started (nothing of
    /// the caller's ran yet), as opposed to a refused limit, a missing
    /// binary or a timeout.
    pub fn is_transient(&self) -> bool {
        use runcell_jail::SpawnError as S;
        match self {
            BackendError::Jail(e) => matches!(e, S::Setup(_) | S::AgentDied(_)),
            BackendError::Gvisor(e) => e.is_transient(),
            BackendError::Microvm(e) => matches!(e, MicrovmError::AgentGone(_)),
            BackendError::Unsupported { .. } => false,
        }
    }
}

/// A kind of isolation a sandbox can run under, chosen per sandbox.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum Isolation {
    /// The namespace jail (`runcell-jail`): namespaces, an overlay root,
    /// seccomp, Landlock and cgroups, on the host's kernel.
    Jail,
    /// gVisor (`runsc`): a user-space kernel between the sandbox and the host.
    Gvisor,
    /// A QEMU microVM with its own guest kernel.
    Microvm,
}

impl Isolation {
    /// Every kind, in order of strength.
    pub const ALL: [Isolation; 3] = [Isolation::Jail, Isolation::Gvisor, Isolation::Microvm];

    /// Its name in the API (`jail`, `gvisor`, `microvm`).
    pub fn as_str(self) -> &'static str {
        match self {
            Isolation::Jail => "jail",
            Isolation::Gvisor => "gvisor",
            Isolation::Microvm => "microvm",
        }
    }
}

impl fmt::Display for Isolation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An isolation name that is not one of `jail`, `gvisor`, `microvm`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("Unknown isolation {0:?}: expected one of jail, gvisor, microvm.")]
pub struct UnknownIsolation(pub String);

impl std::str::FromStr for Isolation {
    type Err = UnknownIsolation;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Isolation::ALL
            .into_iter()
            .find(|i| i.as_str() == s)
            .ok_or_else(|| UnknownIsolation(s.to_string()))
    }
}

/// What the prepare phase takes: nothing about what will run.
#[derive(Debug, Clone)]
pub struct PrepareSpec {
    /// Sandbox id, a plain name (normally a UUID).
    pub id: String,
    /// Limits to prepare with (a claim may change them before it starts).
    pub limits: Limits,
    /// Keep the host's network (template builds only). Such a sandbox gets
    /// no egress socket, whatever it is started with.
    pub host_network: bool,
}

/// What the start phase takes: what runs in the sandbox and how.
#[derive(Debug, Clone)]
pub struct StartSpec {
    /// Root filesystem.
    pub rootfs: RootfsSpec,
    /// Limits.
    pub limits: Limits,
    /// The unprivileged user code runs as.
    pub user: SandboxUser,
    /// Stop the sandbox when the [`Instance`] value goes away.
    pub tied_to_process: bool,
    /// Hard deadline (unix ms) the agent enforces by itself.
    pub deadline_unix_ms: Option<u64>,
    /// Environment of every process (the template's `ENV`).
    pub env: std::collections::BTreeMap<String, String>,
    /// Default working directory (the template's `WORKDIR`).
    pub workdir: Option<String>,
    /// The egress socket.
    pub egress: EgressSocket,
    /// Saved sandbox files laid over the template, topmost first (a
    /// snapshot's, a fork parent's, a hibernated sandbox's).
    pub state_layers: Vec<PathBuf>,
    /// Host directories bound into the sandbox (volumes).
    pub mounts: Vec<BindMount>,
    /// A memory image ([`Instance::checkpoint`]) to restore instead of
    /// starting afresh: the sandbox's processes (and its agent, with the
    /// spec it started with) go on where they were. Its files must be
    /// those it had then (`state_layers`).
    pub memory_image: Option<PathBuf>,
}

/// How the host reaches a sandbox's agent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AgentChannel {
    /// A unix socket the host binds and the agent accepts on.
    Unix(PathBuf),
}

/// Makes, finds and removes sandboxes of one kind of isolation.
pub trait Backend: Send + Sync + fmt::Debug {
    /// The kind of isolation it provides.
    fn isolation(&self) -> Isolation;

    /// Does the slow, spec-independent half of creating a sandbox.
    fn prepare(&self, spec: &PrepareSpec) -> Result<Box<dyn Prepared>, BackendError>;

    /// Finds a running sandbox again (after a restart of the host process).
    fn attach(&self, id: &str) -> Result<Box<dyn Instance>, BackendError>;

    /// Ids of the sandboxes (running, dead or half made) with state on
    /// this host.
    fn list(&self) -> Vec<String>;

    /// Whether the sandbox `id` is dead and its leftovers may be removed:
    /// gone, or never finished starting and older than `grace` (so one
    /// that another process is creating right now is left alone).
    fn is_dead(&self, id: &str, grace: Duration) -> bool;

    /// Kills the sandbox `id` if it runs and removes everything it had.
    fn remove(&self, id: &str) -> Result<(), BackendError>;

    /// Removes every sandbox that [`Backend::is_dead`] with `grace`;
    /// returns the ids removed.
    fn sweep(&self, grace: Duration) -> Vec<String> {
        self.list()
            .into_iter()
            .filter(|id| self.is_dead(id, grace) && self.remove(id).is_ok())
            .collect()
    }
}

/// A sandbox whose isolation and agent are ready, waiting for its spec.
/// Dropping it kills it and removes what it had.
pub trait Prepared: Send + fmt::Debug {
    /// The id it will have.
    fn id(&self) -> &str;

    /// Applies `limits` ahead of [`Prepared::start`], so limits the host
    /// refuses fail before the sandbox is used up.
    fn set_limits(&self, limits: &Limits) -> Result<(), BackendError>;

    /// Puts back the limits it was prepared with (after
    /// [`Prepared::set_limits`] failed half-way), so it can serve another claim.
    fn reset_limits(&self) -> Result<(), BackendError>;

    /// Whether its agent is still waiting.
    fn is_alive(&self) -> bool;

    /// Does what it can of starting with `spec` ahead of a claim, which
    /// is likely to ask for the same (the last claim's spec): the jail
    /// lays out that root filesystem. A start with another spec works as
    /// without it. Returns at once; nothing by default.
    fn build_ahead(&mut self, spec: &StartSpec) -> Result<(), BackendError> {
        let _ = spec;
        Ok(())
    }

    /// Sends the spec and waits until the sandbox is ready.
    fn start(self: Box<Self>, spec: &StartSpec) -> Result<Box<dyn Instance>, BackendError>;
}

/// A running sandbox, host side.
pub trait Instance: Send + Sync + fmt::Debug {
    /// The sandbox id.
    fn id(&self) -> &str;

    /// Host pid of the process that holds the sandbox (the jail: its agent).
    fn pid(&self) -> i32;

    /// Where its agent listens.
    fn agent_channel(&self) -> AgentChannel;

    /// The listener of its egress socket, for the host's proxy (once;
    /// `None` without one, and for re-attached sandboxes).
    fn take_egress_listener(&mut self) -> Option<UnixListener>;

    /// Binds its egress socket again after a restart (the old one died
    /// with the process that listened on it). `None`: it has none.
    fn rebind_egress(&mut self) -> Result<Option<UnixListener>, BackendError>;

    /// Resource counters (OOM kills, pids-limit hits, memory, CPU).
    fn counters(&self) -> Counters;

    /// The kill counters alone, as cheaply as the backend can read them.
    fn kills(&self) -> Kills {
        self.counters().into()
    }

    /// Whether it is still running.
    fn is_alive(&self) -> bool;

    /// Kills every process in it without waiting for the teardown.
    fn kill(&self);

    /// The kind of isolation it runs under.
    fn isolation(&self) -> Isolation;

    /// Freezes every process in it; they keep their memory.
    fn freeze(&self) -> Result<(), BackendError> {
        Err(BackendError::Unsupported {
            isolation: self.isolation(),
            what: "be paused",
        })
    }

    /// Thaws it after [`Instance::freeze`].
    fn thaw(&self) -> Result<(), BackendError> {
        Err(BackendError::Unsupported {
            isolation: self.isolation(),
            what: "be resumed",
        })
    }

    /// Whether it is frozen.
    fn is_frozen(&self) -> bool {
        false
    }

    /// Copies what it wrote (its writable layer) into the new directory
    /// `dest`, as a state layer ([`StartSpec::state_layers`]); it must be
    /// frozen. Returns the bytes the copy takes.
    fn export_layer(&self, dest: &std::path::Path) -> Result<u64, BackendError> {
        let _ = dest;
        Err(BackendError::Unsupported {
            isolation: self.isolation(),
            what: "save its files",
        })
    }

    /// Saves its processes and memory into the new directory `image`, for
    /// [`StartSpec::memory_image`]; its processes end (their files stay
    /// where [`Instance::export_layer`] copies them from). On failure the
    /// sandbox may have ended too.
    fn checkpoint(&self, image: &std::path::Path) -> Result<(), BackendError> {
        let _ = image;
        Err(BackendError::Unsupported {
            isolation: self.isolation(),
            what: "save its memory",
        })
    }

    /// Saves its processes and memory into the new directory `image` and
    /// its files into the new directory `layer` (as
    /// [`Instance::export_layer`]), both of one instant, then runs on from
    /// that instant with its memory (gVisor: `runsc checkpoint`, which
    /// stops it, the copy, then `runsc restore` of the same image under the
    /// same id). Its agent's host connections were closed: connect again.
    /// Returns the bytes the layer takes. On failure nothing is left at
    /// `image` or `layer`, and the sandbox may have ended
    /// ([`Instance::is_alive`]).
    fn save_running(
        &self,
        image: &std::path::Path,
        layer: &std::path::Path,
    ) -> Result<u64, BackendError> {
        let _ = (image, layer);
        Err(BackendError::Unsupported {
            isolation: self.isolation(),
            what: "save its memory and run on",
        })
    }

    /// Whether its writable layer is at its size limit, where the host
    /// knows better than the agent's `statvfs` (a btrfs stage); `None`:
    /// the agent's report stands.
    fn layer_full(&self) -> Option<bool> {
        None
    }

    /// Kills every process in it, waits, and removes everything it had.
    fn destroy(self: Box<Self>) -> Result<(), BackendError>;
}
