//! Where sandboxes live on the host and how they are created.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use runcell_jail::IdMap;

use crate::backend::{
    AgentChannel, Backend, BindMount, EgressSocket, Instance, Isolation, JailBackend, PrepareSpec,
    Prepared, StartSpec,
};
use crate::limits::SandboxLimits;
use crate::sandbox::Sandbox;
use crate::template::Template;
use crate::{AgentClient, Error};
use runcell_egress::{proxy, Egress, EgressConfig, NetworkPolicy};

/// Host-wide settings.
#[derive(Debug, Clone)]
pub struct RuntimeConfig {
    /// Directory holding one subdirectory per running sandbox.
    pub state_dir: PathBuf,
    /// Directory of installed templates (besides the built-in `host`).
    pub templates_dir: Option<PathBuf>,
    /// The agent binary; found next to the current executable when absent.
    pub agent: Option<PathBuf>,
    /// Cgroup parent name.
    pub cgroup_parent: String,
    /// Host id range that sandbox ids map to.
    pub id_map: IdMap,
    /// Log filter for agents (`RUST_LOG` syntax).
    pub agent_log: Option<String>,
    /// Sandboxes kept prepared (namespaces, cgroup and agent ready, waiting
    /// for a spec) so creation skips the slow half. For long-lived processes
    /// such as the daemon; 0 for one-shot use.
    pub standby: usize,
    /// The btrfs layer store's directory of stages (see
    /// [`runcell_jail::PrepareConfig::stage_store`]): each jail sandbox's
    /// writable layer is a subvolume there and saving it a snapshot.
    /// `None`: a tmpfs per sandbox, saved by copying.
    pub stage_store: Option<PathBuf>,
    /// Fork each jail sandbox's agent from one started agent instead of
    /// an exec per sandbox ([`runcell_jail::forkserver`]): for long-lived
    /// processes; `false` for one-shot use, where starting the fork server
    /// costs what it would save.
    pub fork_server: bool,
}

impl Default for RuntimeConfig {
    fn default() -> Self {
        Self {
            state_dir: PathBuf::from("/run/runcell/sandboxes"),
            templates_dir: None,
            agent: std::env::var_os("RUNCELL_AGENT").map(PathBuf::from),
            cgroup_parent: "runcell".into(),
            id_map: IdMap::default(),
            agent_log: std::env::var("RUNCELL_AGENT_LOG").ok(),
            standby: 0,
            stage_store: None,
            fork_server: true,
        }
    }
}

/// Options for one sandbox.
#[derive(Debug, Clone)]
pub struct SandboxOptions {
    /// Template name.
    pub template: String,
    /// Limits.
    pub limits: SandboxLimits,
    /// Stop the sandbox when this process exits (one-shot use from a CLI).
    pub tied_to_process: bool,
    /// Hard lifetime after which the agent stops the sandbox by itself.
    pub max_lifetime: Option<Duration>,
    /// Network egress policy. `None`: no egress socket at all (the policy
    /// cannot be changed later); `Some` (even of mode `none`): the sandbox
    /// gets an egress socket served by this process's proxy.
    pub network: Option<NetworkPolicy>,
    /// The isolation backend; the runtime's default when absent.
    pub isolation: Option<Isolation>,
    /// The sandbox's id; a new one when absent. Given (waking a hibernated
    /// sandbox under its old id), the sandbox is prepared for it, not
    /// taken from the standby pool.
    pub id: Option<String>,
    /// Saved sandbox files laid over the template, topmost first (see
    /// [`Sandbox::save_layer`]).
    pub state_layers: Vec<PathBuf>,
    /// Host directories bound into the sandbox (volumes; the jail only).
    pub mounts: Vec<BindMount>,
    /// A memory image to restore ([`Sandbox::checkpoint`]; gVisor only),
    /// with `state_layers` the files it had then and `id` its id.
    pub memory_image: Option<PathBuf>,
    /// Made for one request that follows at once (`POST /v1/run`): the
    /// create does not wait for the agent's hello (the request's own
    /// connection reads and checks it), so an agent that dies after it
    /// reported ready fails that request rather than the create.
    pub one_shot: bool,
    /// A program to start as soon as the sandbox is up, before the create
    /// returns: its answer is [`Sandbox::take_first_run`]. Saves a caller
    /// that runs one program at once the work between its create and its
    /// request (`POST /v1/run`: the daemon's record of the sandbox).
    pub first_run: Option<crate::FirstRun>,
}

impl Default for SandboxOptions {
    fn default() -> Self {
        Self {
            template: "host".into(),
            limits: SandboxLimits::default(),
            tied_to_process: true,
            max_lifetime: None,
            network: None,
            isolation: None,
            id: None,
            state_layers: Vec::new(),
            mounts: Vec::new(),
            memory_image: None,
            one_shot: false,
            first_run: None,
        }
    }
}

/// Creates and finds sandboxes, through its isolation [`Backend`]s: one
/// per kind of [`Isolation`] the host can run, and a default.
#[derive(Debug, Clone)]
pub struct Runtime {
    config: RuntimeConfig,
    /// The backends this runtime can create sandboxes with.
    backends: std::collections::BTreeMap<Isolation, Arc<dyn Backend>>,
    /// Why each other kind cannot run here.
    unavailable: std::collections::BTreeMap<Isolation, String>,
    /// What a sandbox gets when it does not ask.
    default_isolation: Isolation,
    /// Standbys of the default backend.
    pool: Arc<Pool>,
    egress: EgressConfig,
}

/// How long after a claim the standby pool is refilled.
const REFILL_DELAY: Duration = Duration::from_millis(100);

/// Prepared sandboxes waiting to be claimed. Each is claimed at most once.
#[derive(Debug, Default)]
struct Pool {
    ready: Mutex<std::collections::VecDeque<Box<dyn Prepared>>>,
    /// The spec of the last claim that a standby could have served (no
    /// saved files, no volumes): standbys prepared from now on build
    /// ahead with it ([`Prepared::build_ahead`]), as the next claim is
    /// likely to ask for the same.
    expected: Mutex<Option<StartSpec>>,
    refilling: AtomicBool,
    /// Set by [`Runtime::close_standbys`]: no more are prepared.
    closed: AtomicBool,
}

impl Runtime {
    /// A runtime with `config` whose sandboxes are namespace jails
    /// ([`JailBackend`]); fails if the agent binary cannot be found.
    pub fn new(config: RuntimeConfig) -> Result<Self, Error> {
        let agent = match &config.agent {
            Some(p) => p.clone(),
            None => find_agent()?,
        };
        let backend = JailBackend::new(
            agent,
            config.state_dir.clone(),
            config.cgroup_parent.clone(),
            config.id_map,
            config.agent_log.clone(),
        )
        .with_stage_store(config.stage_store.clone())
        .with_fork_server(config.fork_server);
        Ok(Self::with_backend(config, Arc::new(backend)))
    }

    /// A runtime whose only backend, and so its default, is `backend`.
    pub fn with_backend(config: RuntimeConfig, backend: Arc<dyn Backend>) -> Self {
        let default_isolation = backend.isolation();
        Self {
            config,
            backends: [(default_isolation, backend)].into(),
            unavailable: Default::default(),
            default_isolation,
            pool: Arc::default(),
            egress: EgressConfig::default(),
        }
    }

    /// Adds a backend (replacing one of the same kind).
    pub fn add_backend(mut self, backend: Arc<dyn Backend>) -> Self {
        self.unavailable.remove(&backend.isolation());
        self.backends.insert(backend.isolation(), backend);
        self
    }

    /// Records why `isolation` cannot run on this host, for the error a
    /// create that asks for it gets.
    pub fn mark_unavailable(mut self, isolation: Isolation, why: impl Into<String>) -> Self {
        if !self.backends.contains_key(&isolation) {
            self.unavailable.insert(isolation, why.into());
        }
        self
    }

    /// Makes `isolation` the default (it must have a backend). The
    /// standby pool keeps sandboxes of the default backend.
    pub fn with_default_isolation(mut self, isolation: Isolation) -> Result<Self, Error> {
        self.backend_for(isolation)?;
        self.default_isolation = isolation;
        Ok(self)
    }

    /// The isolation sandboxes get when they do not ask.
    pub fn default_isolation(&self) -> Isolation {
        self.default_isolation
    }

    /// The kinds of isolation this runtime can create sandboxes with.
    pub fn isolations(&self) -> Vec<Isolation> {
        self.backends.keys().copied().collect()
    }

    /// The backend of `isolation`, or why this host cannot run it.
    pub fn backend_for(&self, isolation: Isolation) -> Result<Arc<dyn Backend>, Error> {
        self.backends.get(&isolation).cloned().ok_or_else(|| {
            Error::IsolationUnavailable(
                isolation,
                self.unavailable
                    .get(&isolation)
                    .cloned()
                    .unwrap_or_else(|| "this runcell was not started with it".into()),
            )
        })
    }

    fn default_backend(&self) -> Arc<dyn Backend> {
        self.backends[&self.default_isolation].clone()
    }

    /// Sets the operator's egress settings (private destinations opened,
    /// shared totals) for sandboxes created from now on.
    pub fn with_egress(mut self, egress: EgressConfig) -> Self {
        self.egress = egress;
        self
    }

    /// The egress settings.
    pub fn egress(&self) -> &EgressConfig {
        &self.egress
    }

    /// What a sandbox of `template` with `opts` is started with.
    fn start_spec(template: &Template, opts: &SandboxOptions, host_network: bool) -> StartSpec {
        let deadline_unix_ms = opts
            .max_lifetime
            .map(|d| runcell_protocol::units::unix_millis(SystemTime::now() + d));
        let egress = match &opts.network {
            Some(policy) if !host_network => EgressSocket::Socket {
                enabled: policy.has_egress(),
            },
            _ => EgressSocket::None,
        };
        StartSpec {
            rootfs: template.rootfs.clone(),
            limits: opts.limits.jail(),
            user: template.user.clone().unwrap_or_default(),
            tied_to_process: opts.tied_to_process,
            deadline_unix_ms,
            env: template.env.clone(),
            workdir: template.workdir.clone(),
            egress,
            state_layers: opts.state_layers.clone(),
            mounts: opts.mounts.clone(),
            memory_image: opts.memory_image.clone(),
        }
    }

    /// What a new sandbox is prepared with.
    fn prepare_spec(opts: &SandboxOptions, host_network: bool) -> PrepareSpec {
        let limits = &opts.limits;
        PrepareSpec {
            id: opts
                .id
                .clone()
                .unwrap_or_else(|| uuid::Uuid::new_v4().to_string()),
            limits: limits.jail(),
            host_network,
        }
    }

    /// Number of prepared sandboxes waiting.
    pub fn standby_ready(&self) -> usize {
        self.pool
            .ready
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .len()
    }

    /// Fills the standby pool and waits until it is full.
    pub async fn warm_up(&self) {
        self.refill_now().await;
    }

    /// Destroys the standbys and prepares no more (a stopping daemon that
    /// unmounts the layer store their stages are in). A refill under way
    /// is waited for, at most 10 s.
    pub async fn close_standbys(&self) {
        self.pool.closed.store(true, Ordering::Release);
        let until = std::time::Instant::now() + Duration::from_secs(10);
        while self.pool.refilling.load(Ordering::Acquire) && std::time::Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let ready: Vec<_> = self
            .pool
            .ready
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .drain(..)
            .collect();
        // Dropping one kills its agent and removes its stage (blocking).
        let _ = tokio::task::spawn_blocking(move || drop(ready)).await;
    }

    fn refill(&self) {
        if self.config.standby == 0
            || self.pool.closed.load(Ordering::Acquire)
            || self.pool.refilling.swap(true, Ordering::AcqRel)
        {
            return;
        }
        let rt = self.clone();
        tokio::spawn(async move {
            // Debounced: a burst of claims is refilled in one batch, and on
            // cgroup v1 back-to-back migrations share one RCU grace period
            // instead of each stalling forks and exits host-wide.
            tokio::time::sleep(REFILL_DELAY).await;
            rt.refill_now().await;
        });
    }

    async fn refill_now(&self) {
        self.pool.refilling.store(true, Ordering::Release);
        while self.standby_ready() < self.config.standby
            && !self.pool.closed.load(Ordering::Acquire)
        {
            let spec = Self::prepare_spec(&SandboxOptions::default(), false);
            let backend = self.default_backend();
            let ahead = self
                .pool
                .expected
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .clone();
            let prepare = move || {
                let mut standby = backend.prepare(&spec)?;
                if let Some(ahead) = &ahead {
                    standby.build_ahead(ahead)?;
                }
                Ok::<_, crate::backend::BackendError>(standby)
            };
            match tokio::task::spawn_blocking(prepare).await {
                Ok(Ok(standby)) => self
                    .pool
                    .ready
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .push_back(standby),
                Ok(Err(e)) => {
                    tracing::warn!("could not prepare a standby sandbox: {e}");
                    break;
                }
                Err(e) => {
                    tracing::warn!("standby preparation task failed: {e}");
                    break;
                }
            }
        }
        self.pool.refilling.store(false, Ordering::Release);
    }

    /// The settings.
    pub fn config(&self) -> &RuntimeConfig {
        &self.config
    }

    /// Looks up a template.
    pub fn template(&self, name: &str) -> Result<Template, Error> {
        Ok(Template::find(self.config.templates_dir.as_deref(), name)?)
    }

    /// Creates a sandbox and connects to its agent.
    #[tracing::instrument(skip_all, fields(template = %opts.template))]
    pub async fn create(&self, opts: SandboxOptions) -> Result<Sandbox, Error> {
        let template = self.template(&opts.template)?;
        self.create_from(template, opts, false).await
    }

    /// Creates a sandbox from a template value (`opts.template` is not
    /// looked at). `host_network` keeps the host's network namespace: only
    /// the template builder asks for it, so no API request can.
    pub(crate) async fn create_from(
        &self,
        template: Template,
        opts: SandboxOptions,
        host_network: bool,
    ) -> Result<Sandbox, Error> {
        match self.start_one(&template, &opts, host_network).await {
            // Nothing of the caller's ran yet: one more try with another
            // sandbox hides a transient failure (e.g. an agent lost to a
            // race) instead of failing a run for it.
            Err(e) if is_transient(&e) => {
                tracing::warn!(
                    "a sandbox failed while starting, before any code ran; retrying once: {e}"
                );
                self.start_one(&template, &opts, host_network).await
            }
            r => r,
        }
    }

    /// One attempt at [`Runtime::create_from`].
    async fn start_one(
        &self,
        template: &Template,
        opts: &SandboxOptions,
        host_network: bool,
    ) -> Result<Sandbox, Error> {
        let template = template.clone();
        let opts = opts.clone();
        let isolation = opts.isolation.unwrap_or(self.default_isolation);
        let backend = self.backend_for(isolation)?;
        let unsupported = |what| {
            Err(Error::Jail(crate::backend::BackendError::Unsupported {
                isolation,
                what,
            }))
        };
        // The jail's setup and gVisor's host-side composition refuse a
        // symlink a saved layer planted; a microVM's layers are disk images.
        if opts.memory_image.is_some() && isolation == Isolation::Jail {
            return unsupported("restore its memory");
        }
        // Standbys already have their own network namespace, and are of the
        // default backend. A sandbox with a given id is prepared for it,
        // and so is one with bind mounts: a standby's mount namespace was
        // copied before a volume mounted since was there to copy.
        let standby = if host_network
            || isolation != self.default_isolation
            || opts.id.is_some()
            || !opts.mounts.is_empty()
        {
            None
        } else {
            self.pool
                .ready
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .pop_front()
        };
        let network = opts.network.clone().filter(|_| !host_network);
        let spec = Self::start_spec(&template, &opts, host_network);
        let deadline_unix_ms = spec.deadline_unix_ms;
        if self.config.standby > 0
            && !host_network
            && isolation == self.default_isolation
            && spec.state_layers.is_empty()
            && spec.mounts.is_empty()
            && spec.memory_image.is_none()
        {
            *self
                .pool
                .expected
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(spec.clone());
        }
        let started = match standby {
            Some(standby) => {
                let r = tokio::task::spawn_blocking(move || {
                    // Limits the kernel refuses fail here, before the
                    // standby is used up; it then goes back to the pool.
                    if let Err(e) = standby.set_limits(&spec.limits) {
                        let back = (standby.reset_limits().is_ok() && standby.is_alive())
                            .then_some(standby);
                        return Err((e, back));
                    }
                    standby.start(&spec).map_err(|e| (e, None))
                })
                .await
                .map_err(Error::Task)?;
                r.map_err(|(e, back)| {
                    if let Some(standby) = back {
                        self.pool
                            .ready
                            .lock()
                            .unwrap_or_else(std::sync::PoisonError::into_inner)
                            .push_front(standby);
                    }
                    e
                })
            }
            None => {
                let prepare = Self::prepare_spec(&opts, host_network);
                tokio::task::spawn_blocking(move || backend.prepare(&prepare)?.start(&spec))
                    .await
                    .map_err(Error::Task)?
            }
        };
        // Refill only now, whether or not the start worked (a failed start
        // used up its standby): preparing migrates a process between
        // cgroups, which on cgroup v1 holds a host-wide lock that also
        // stalls this sandbox's first fork.
        self.refill();
        let mut jail = started?;
        let id = jail.id().to_string();
        let agent = match connect(jail.as_ref(), opts.one_shot).await {
            Ok(a) => a,
            Err(e) => {
                let _ = tokio::task::spawn_blocking(move || jail.destroy()).await;
                return Err(e.into());
            }
        };
        let egress = match (network, jail.take_egress_listener()) {
            (Some(policy), Some(listener)) => {
                match proxy_task(&id, policy, self.egress.clone(), listener) {
                    Ok(e) => Some(e),
                    Err(e) => {
                        let _ = tokio::task::spawn_blocking(move || jail.destroy()).await;
                        return Err(Error::EgressSocket(e));
                    }
                }
            }
            _ => None,
        };
        tracing::debug!(sandbox = %id, "sandbox ready");
        let mut sandbox = Sandbox::new(jail, agent, template, opts.limits, isolation);
        sandbox.started_with_deadline(deadline_unix_ms);
        sandbox.egress = egress;
        if let Some(first) = &opts.first_run {
            // A failure here may be retried with another sandbox (see
            // `is_transient`): an agent greets a connection before it reads
            // a request on it, so a request whose greeting never came never
            // ran.
            if let Err(e) = sandbox.start_first(first).await {
                let _ = sandbox.destroy().await;
                return Err(e);
            }
        }
        Ok(sandbox)
    }

    /// Reconnects to a running sandbox (e.g. after a restart). With
    /// `network` (the policy it had), its egress socket is bound again and
    /// served by this process's proxy with that policy, and the agent is
    /// told whether egress is on, so the sandbox's egress behaves as before.
    pub async fn attach(
        &self,
        id: &str,
        isolation: Isolation,
        template: Template,
        limits: SandboxLimits,
        network: Option<NetworkPolicy>,
    ) -> Result<Sandbox, Error> {
        let backend = self.backend_for(isolation)?;
        let owned = id.to_string();
        let rebind = network.is_some();
        let (jail, listener) = tokio::task::spawn_blocking(move || {
            let mut jail = backend.attach(&owned)?;
            let listener = if rebind {
                jail.rebind_egress()
            } else {
                Ok(None)
            };
            Ok::<_, crate::backend::BackendError>((jail, listener))
        })
        .await
        .map_err(Error::Task)??;
        // A paused sandbox's agent cannot answer the handshake: thawed for
        // it, then frozen again.
        let paused = jail.is_frozen();
        if paused {
            jail.thaw()?;
        }
        let agent = match connect(jail.as_ref(), false).await {
            Ok(a) => a,
            Err(e) => {
                if paused {
                    let _ = jail.freeze();
                }
                return Err(e.into());
            }
        };
        let mut sandbox = Sandbox::new(jail, agent, template, limits, isolation);
        // Egress that cannot be served again leaves the sandbox running
        // without it (nothing leaves), which is said, not silent.
        match (network, listener) {
            (Some(policy), Ok(Some(listener))) => {
                match proxy_task(id, policy.clone(), self.egress.clone(), listener) {
                    Ok(handle) => {
                        sandbox.egress = Some(handle);
                        if let Err(e) = sandbox.set_network(policy).await {
                            tracing::warn!(sandbox = %id, "could not restore its egress policy: {e}");
                        }
                    }
                    Err(e) => {
                        tracing::warn!(sandbox = %id, "could not serve its egress socket: {e}")
                    }
                }
            }
            (Some(policy), Ok(None)) if policy.has_egress() => tracing::warn!(
                sandbox = %id,
                "it has no egress directory (made by an older version): its egress stays off"
            ),
            (Some(_), Err(e)) => {
                tracing::warn!(sandbox = %id, "could not bind its egress socket again: {e}")
            }
            _ => {}
        }
        if paused {
            sandbox.pause()?;
        }
        Ok(sandbox)
    }

    /// Ids of the sandboxes with state on this host.
    pub fn list(&self) -> Vec<String> {
        let mut ids: Vec<String> = self.backends.values().flat_map(|b| b.list()).collect();
        ids.sort();
        ids.dedup();
        ids
    }

    /// Ids of the sandboxes of one backend with state on this host.
    pub fn list_of(&self, isolation: Isolation) -> Vec<String> {
        self.backends
            .get(&isolation)
            .map(|b| b.list())
            .unwrap_or_default()
    }

    /// Kills the sandbox `id` if it still runs and removes what it had (its
    /// cgroup and directory), whether or not this process holds it: for
    /// orphans, sandboxes that could not be re-attached, and a sandbox a
    /// request still holds when it is deleted.
    pub async fn remove_sandbox(&self, id: &str) -> Result<(), Error> {
        let all: Vec<Arc<dyn Backend>> = self.backends.values().cloned().collect();
        let id = id.to_string();
        tokio::task::spawn_blocking(move || {
            // Whichever backend holds it (each keeps its own state
            // directory); with no trace in any, each removes what it may
            // have left (a half-made sandbox, a process by its directory).
            let holders: Vec<_> = all
                .iter()
                .filter(|b| b.list().contains(&id))
                .cloned()
                .collect();
            let backends = if holders.is_empty() { all } else { holders };
            let mut first_err = None;
            for b in backends {
                if let Err(e) = b.remove(&id) {
                    first_err.get_or_insert(e);
                }
            }
            first_err.map_or(Ok(()), Err)
        })
        .await
        .map_err(Error::Task)??;
        Ok(())
    }

    /// Removes every sandbox whose agent is no longer running (left behind by
    /// a process that was killed), with its cgroup and directory. Returns the
    /// ids removed.
    pub fn sweep_dead(&self) -> Vec<String> {
        // Ready timeout plus margin: younger half-made sandboxes belong to
        // a process that is still creating them.
        self.backends
            .values()
            .flat_map(|b| b.sweep(Duration::from_secs(60)))
            .collect()
    }
}

/// Connects to a sandbox's agent; `one_shot` without waiting for its
/// hello ([`SandboxOptions::one_shot`]).
async fn connect(
    instance: &dyn Instance,
    one_shot: bool,
) -> Result<AgentClient, crate::ClientError> {
    match instance.agent_channel() {
        AgentChannel::Unix(path) if one_shot => {
            AgentClient::connect_unchecked(&path, instance.id()).await
        }
        AgentChannel::Unix(path) => AgentClient::connect(&path).await,
    }
}

/// Whether a failed start may be retried: the agent died or its connection
/// broke while it started (nothing of the caller's ran in it yet), as
/// opposed to a refused limit, a missing template or binary, or a timeout.
fn is_transient(e: &Error) -> bool {
    if let Error::Jail(e) = e {
        return e.is_transient();
    }
    matches!(
        e,
        Error::Agent(
            crate::ClientError::Connect(_)
                | crate::ClientError::Codec(_)
                | crate::ClientError::Closed
        )
        // The same, told as the sandbox's end (`Sandbox::talk`).
        | Error::Ended(_)
    )
}

/// Starts the proxy for one sandbox on its egress socket.
fn proxy_task(
    id: &str,
    policy: NetworkPolicy,
    config: EgressConfig,
    listener: std::os::unix::net::UnixListener,
) -> std::io::Result<crate::sandbox::EgressHandle> {
    listener.set_nonblocking(true)?;
    let listener = tokio::net::UnixListener::from_std(listener)?;
    let state = Arc::new(Egress::new(id.to_string(), policy, config));
    let task = tokio::spawn(proxy::serve(listener, state.clone()));
    Ok(crate::sandbox::EgressHandle { state, task })
}

/// `runcell-agent` next to the current executable, or one directory up
/// (cargo puts test binaries in `target/<profile>/deps`).
pub fn find_agent() -> Result<PathBuf, Error> {
    let exe = std::env::current_exe().unwrap_or_else(|_| PathBuf::from("runcell"));
    let dir = exe.parent().unwrap_or(Path::new("/"));
    for candidate in [dir.join("runcell-agent"), dir.join("../runcell-agent")] {
        if candidate.is_file() {
            return Ok(candidate.canonicalize().unwrap_or(candidate));
        }
    }
    Err(Error::AgentNotFound(exe))
}
