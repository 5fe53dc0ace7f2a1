//! Daemon state: the live sandboxes, the registry, activity and reaping.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use runcell_core::{Runtime, Sandbox, SandboxLimits, Template};

pub use crate::clock::now_ms;
use crate::registry::{Record, Registry};

/// What the reaper compares between ticks to tell a quiet daemon.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HeapActivity {
    /// Sandboxes created so far.
    pub creations: u64,
    /// Sandboxes live.
    pub live: usize,
    /// Teardowns of deleted sandboxes still running: they free what the
    /// sandbox held after its removal counted.
    pub teardowns: usize,
    /// The daemon's threads: the runtime's blocking threads end 10 s after
    /// their last task, and each leaves its allocator cache behind.
    pub threads: usize,
}

/// Settings of `runcell serve`.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    /// Address to listen on.
    pub listen: SocketAddr,
    /// Data directory (registry, API key, sandbox state).
    pub data_dir: PathBuf,
    /// Installed templates.
    pub templates_dir: Option<PathBuf>,
    /// Template aliases (name → installed template).
    pub aliases: BTreeMap<String, String>,
    /// Idle TTL when a create request gives none.
    pub default_ttl_seconds: u64,
    /// Lifetime no sandbox may exceed, persistent or not.
    pub max_lifetime: Duration,
    /// Limits of a sandbox whose create request gives none.
    pub default_limits: SandboxLimits,
    /// Largest `timeout_seconds` an exec may ask for.
    pub max_exec_timeout: Duration,
    /// Largest request body.
    pub max_body_bytes: usize,
    /// Largest `limits.output_bytes` a create request may ask for (the
    /// memory one exec answer may take is proportional to it).
    pub max_output_bytes: u64,
    /// Prepared sandboxes kept ready.
    pub standby: usize,
    /// Cgroup parent name.
    pub cgroup_parent: String,
    /// Most sandboxes alive at once; creates beyond it get 503 + Retry-After.
    pub max_sandboxes: usize,
    /// Warm pool sizes by template name.
    pub warm_pools: BTreeMap<String, usize>,
    /// Template of the sandboxes the `/mcp` tools create.
    pub mcp_template: String,
    /// Private or loopback destinations the operator opens to sandbox
    /// egress (`--egress-allow-private`); never settable through the API.
    pub egress_allow_private: Vec<runcell_egress::PrivateException>,
    /// What one workspace may hold at once.
    pub workspace_quota: crate::quota::WorkspaceQuota,
    /// How long an ended sandbox's tombstone (why and when it ended) is
    /// kept; never less than the maximum lifetime.
    pub tombstone_retention: Duration,
    /// Build the bundled `code-interpreter` recipe in the background on
    /// start when it is not installed, and point the `code-interpreter`
    /// alias at it once it is ready.
    pub auto_build: bool,
    /// The isolation of a sandbox whose request and template name none.
    pub default_isolation: runcell_core::backend::Isolation,
    /// Run microVMs under TCG emulation where KVM cannot run a guest (slow:
    /// for tests and hosts that accept it).
    pub allow_emulation: bool,
    /// Disk the snapshots of one workspace may take, bytes.
    pub snapshot_quota_bytes: u64,
    /// Disk the volumes of one workspace may take, MiB.
    pub volume_quota_mb: u64,
    /// Hibernate persistent sandboxes when their idle TTL runs out
    /// (instead of leaving them running); a sandbox's own `on_idle` wins.
    pub idle_hibernate: bool,
    /// Cluster mode (`--cluster`): `None` is a single node.
    pub cluster: Option<crate::cluster::ClusterConfig>,
    /// Where jail sandboxes' writable layers live (`--layer-store`).
    pub layer_store: crate::store::LayerStoreKind,
}

impl Default for ServeConfig {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:7070".parse().expect("valid address"),
            data_dir: PathBuf::from("/var/lib/runcell"),
            templates_dir: None,
            aliases: [
                ("code-interpreter".to_string(), "host".to_string()),
                ("ubuntu-24.04".to_string(), "host".to_string()),
            ]
            .into(),
            default_ttl_seconds: 300,
            max_lifetime: Duration::from_secs(24 * 3600),
            default_limits: SandboxLimits::default(),
            max_exec_timeout: Duration::from_secs(3600),
            max_body_bytes: 32 << 20,
            max_output_bytes: 64 << 20,
            standby: 2,
            cgroup_parent: "runcell".into(),
            max_sandboxes: 64,
            warm_pools: [("code-interpreter".to_string(), 2)].into(),
            mcp_template: runcell_core::DEFAULT_TEMPLATE.into(),
            egress_allow_private: Vec::new(),
            workspace_quota: Default::default(),
            tombstone_retention: Duration::from_secs(7 * 24 * 3600),
            auto_build: true,
            default_isolation: runcell_core::backend::Isolation::Jail,
            allow_emulation: false,
            snapshot_quota_bytes: 10 << 30,
            idle_hibernate: false,
            volume_quota_mb: 10 << 10,
            cluster: None,
            layer_store: Default::default(),
        }
    }
}

/// A live sandbox and its record.
#[derive(Debug)]
pub struct Entry {
    /// The sandbox.
    pub sandbox: Sandbox,
    /// Its record (mirrors the registry).
    pub record: Mutex<Record>,
    /// Whether the template was a directory template or `host`.
    pub template: Template,
    /// The output of its execs.
    pub log: crate::logs::SandboxLog,
    /// When activity was last written to the registry (ms) and the agent
    /// deadline last sent, to write each at most about once a second.
    pub persisted: Mutex<(i64, u64)>,
    /// The Python context a warm-pool sandbox came with, until a session
    /// claims it.
    pub warm_context: Mutex<Option<runcell_protocol::ContextInfo>>,
}

impl Entry {
    /// A live sandbox with its record, as the daemon keeps it.
    pub fn new(
        sandbox: Sandbox,
        record: Record,
        template: Template,
        warm_context: Option<runcell_protocol::ContextInfo>,
    ) -> Arc<Self> {
        Arc::new(Entry {
            sandbox,
            record: Mutex::new(record),
            template,
            log: crate::logs::SandboxLog::default(),
            persisted: Default::default(),
            warm_context: Mutex::new(warm_context),
        })
    }
}

/// Shared daemon state.
#[derive(Debug)]
pub struct AppState {
    /// Settings.
    pub config: ServeConfig,
    /// Sandbox runtime.
    pub runtime: Runtime,
    /// Registry.
    pub registry: Registry,
    /// Live sandboxes.
    pub sandboxes: RwLock<HashMap<String, Arc<Entry>>>,
    /// Counters and histograms for /metrics.
    pub metrics: crate::metrics::Metrics,
    /// Creates in progress (they count against the capacity).
    pub creating: std::sync::atomic::AtomicUsize,
    /// Warm pools by template.
    pub pools: crate::pool::WarmPools,
    /// Teardowns of deleted sandboxes still running in the background.
    pub teardowns: Arc<std::sync::atomic::AtomicUsize>,
    /// Teardowns allowed to run at once ([`TEARDOWN_SLOTS`]): each holds a
    /// blocking thread, and a wave of deletes otherwise started one thread
    /// per sandbox (hundreds), each leaving memory in the allocator.
    pub teardown_slots: Arc<tokio::sync::Semaphore>,
    /// Creates in progress per workspace, with the limits they asked for.
    pub reservations: crate::quota::Reservations,
    /// When tombstones were last pruned (unix ms).
    pub last_prune_ms: std::sync::atomic::AtomicI64,
    /// The activity the reaper saw at its last tick and at its last heap
    /// trim ([`AppState::trim_heap_when_quiet`]).
    pub heap_activity: Mutex<(HeapActivity, HeapActivity)>,
    /// Templates being built in the background (`--auto-build`).
    pub auto_builds: Arc<crate::autobuild::AutoBuilds>,
    /// What this host enforces and which backends it runs, probed at start
    /// (`GET /v1/system`).
    pub system: runcell_core::host::SystemReport,
    /// Layers being saved, not yet recorded (kept from collection).
    pub saving_layers: Mutex<std::collections::HashSet<String>>,
    /// Volumes creates in flight are attaching (workspace, name).
    pub attaching: Mutex<std::collections::HashSet<(String, String)>>,
    /// One lock per sandbox that hibernates or wakes ([`AppState::sandbox_lock`]).
    pub transitions: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// This node's membership of a cluster (`--cluster`), if any.
    pub cluster: Option<Arc<crate::cluster::Cluster>>,
    /// Where jail sandboxes' writable layers live (`--layer-store`).
    pub layer_store: crate::store::LayerStore,
}

/// Teardowns of deleted sandboxes that run at once. Their processes are
/// killed at the delete; what is queued is the removal of the cgroup and
/// the directories, which on 2 cores is no faster with more in parallel.
pub const TEARDOWN_SLOTS: usize = 8;

/// Grace the agent's own deadline gives the daemon to reap first.
const AGENT_DEADLINE_GRACE_MS: i64 = 30_000;

impl AppState {
    /// A live sandbox.
    pub fn entry(&self, id: &str) -> Option<Arc<Entry>> {
        self.sandboxes
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(id)
            .cloned()
    }

    /// The agent-enforced deadline for a record: idle TTL (plus grace) unless
    /// persistent, and never past the maximum lifetime. It holds even while
    /// the daemon is down.
    pub fn agent_deadline(&self, r: &Record) -> u64 {
        agent_deadline(r, self.max_lifetime_ms())
    }

    /// The agent-enforced deadline of a sandbox recorded at `now_ms` with
    /// this idle TTL, as [`AppState::agent_deadline`] gives it for that
    /// record: what a create starts the agent with, so that the create's
    /// first touch has no deadline to send.
    pub fn first_agent_deadline(&self, now_ms: i64, ttl_seconds: u64, persistent: bool) -> u64 {
        deadline(
            now_ms / 1000,
            now_ms,
            ttl_seconds,
            persistent,
            self.max_lifetime_ms(),
        )
    }

    /// The maximum lifetime in milliseconds.
    fn max_lifetime_ms(&self) -> i64 {
        i64::try_from(self.config.max_lifetime.as_millis()).unwrap_or(i64::MAX)
    }

    /// Gives the agent of a sandbox about to be paused the deadline it
    /// keeps while paused: its maximum lifetime only. The idle clock stops
    /// while it is paused (the reaper's too), but a frozen agent's clock
    /// runs on: thawed past its idle deadline, it would stop the sandbox at
    /// once, before the resume could move that deadline.
    pub async fn hold_deadline(&self, entry: &Entry) -> Result<(), runcell_core::Error> {
        let hard = {
            let r = entry
                .record
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            deadline(
                r.created_at,
                r.last_activity_ms,
                r.ttl_seconds,
                true,
                self.max_lifetime_ms(),
            )
        };
        entry.sandbox.set_deadline(Some(hard)).await?;
        // What the resume's touch compares with: it sends the idle one.
        entry
            .persisted
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .1 = hard;
        Ok(())
    }

    /// Records activity on a sandbox (exec, file access, code run). The
    /// in-memory time is exact; the registry and the agent's deadline (both
    /// only backstops for a daemon that is down) are updated at most about
    /// once a second per sandbox.
    pub async fn touch(&self, entry: &Entry) {
        let now = now_ms();
        let (id, deadline) = {
            let mut r = entry
                .record
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            r.last_activity_ms = now;
            (r.id.clone(), self.agent_deadline(&r))
        };
        let (write_registry, send_deadline) = {
            let mut p = entry
                .persisted
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let write = now - p.0 >= 1000;
            // A paused agent cannot answer (the request would wait until
            // it is resumed): its deadline is sent after the resume.
            let send = deadline.abs_diff(p.1) >= 1000 && !entry.sandbox.is_paused();
            if write {
                p.0 = now;
            }
            if send {
                p.1 = deadline;
            }
            (write, send)
        };
        if write_registry {
            if let Err(e) = self.registry.touch(&id, now) {
                tracing::warn!(sandbox = %id, "could not record activity: {e}");
            }
        }
        if send_deadline {
            if let Err(e) = entry.sandbox.set_deadline(Some(deadline)).await {
                // A delete that ran meanwhile (a client deleting right after
                // its exec) stopped the agent: nothing to move, nothing wrong.
                if self.entry(&id).is_none() {
                    tracing::debug!(sandbox = %id, "the agent's deadline was not moved: the sandbox was deleted meanwhile");
                } else {
                    tracing::warn!(sandbox = %id, "could not move the agent's deadline: {e}");
                }
            }
        }
    }

    /// Removes a sandbox: destroys it and records why.
    pub async fn remove(&self, id: &str, reason: &str) -> bool {
        let Some(entry) = self.take_live(id, reason) else {
            return false;
        };
        self.dispose(id, entry, reason).await;
        true
    }

    /// The first half of [`Self::remove`], which takes no wait: the sandbox
    /// leaves the live map and its end is recorded, so every request from
    /// now on gets 404 with `reason`, and its processes are sent SIGKILL
    /// (out of the map it no longer counts against any quota, so nothing
    /// of it may run on). A route that answers first and ends the sandbox
    /// after (`delete_after`) calls this before its answer goes out, and
    /// [`Self::dispose`] after: a client that asks again at once never
    /// finds the sandbox still there.
    pub fn take_live(&self, id: &str, reason: &str) -> Option<Arc<Entry>> {
        let entry = {
            let mut live = self
                .sandboxes
                .write()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let entry = live.remove(id)?;
            // Recorded before the lock goes: a request that no longer finds
            // the sandbox live finds why it ended, never a plain "not found".
            // (Lock order: this map, then the registry's connection; nothing
            // takes them the other way round. The update is one indexed row.)
            if let Err(e) = self
                .registry
                .end(id, crate::registry::Ended::Deleted, reason)
            {
                tracing::warn!(sandbox = %id, "could not record the removal: {e}");
            }
            entry
        };
        entry.sandbox.kill();
        Some(entry)
    }

    /// The second half of [`Self::remove`]: destroys a sandbox
    /// [`Self::take_live`] took and killed, and frees the saved files
    /// nothing uses any more.
    pub async fn dispose(&self, id: &str, entry: Arc<Entry>, reason: &str) {
        tracing::info!(sandbox = %id, reason, "removing sandbox");
        self.metrics.reaped(reason);
        match Arc::try_unwrap(entry) {
            Ok(entry) => {
                // Every process was sent SIGKILL (`take_live`); the kernel's
                // teardown of a large interpreter takes tens of milliseconds,
                // which the caller need not wait for. The cgroup and
                // directory go once it is done (a failure is found again by
                // the next restart).
                let id = id.to_string();
                let pending = self.teardowns.clone();
                let slots = self.teardown_slots.clone();
                pending.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
                tokio::spawn(async move {
                    // The semaphore is never closed: the Err arm is unreachable.
                    let _slot = slots.acquire_owned().await;
                    if let Err(e) = entry.sandbox.destroy().await {
                        tracing::warn!(sandbox = %id, "destroy failed: {e}");
                    }
                    pending.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
                });
            }
            Err(shared) => {
                // A request still holds it: kill it now; the handle goes with the request.
                let _ = self.runtime.remove_sandbox(shared.sandbox.id()).await;
            }
        }
        // Its saved files go once nothing else uses them. A sandbox without
        // a lineage (no saved files, volumes or idle rule) used no layer, so
        // its end frees none: the scan of every snapshot and lineage and of
        // the layer directories is skipped (it ran on every delete).
        let had_lineage = self
            .registry
            .with_conn(|c| crate::snapshots::has_lineage(c, id))
            .unwrap_or(true);
        if had_lineage {
            crate::snapshots::collect_unused(self);
        }
    }

    /// Takes a live sandbox out of the daemon and destroys it, waiting for
    /// the teardown (its id may be started again at once, by a wake); its
    /// record is left as the caller set it.
    pub async fn release(&self, id: &str) {
        let entry = self
            .sandboxes
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(id);
        let Some(entry) = entry else { return };
        match Arc::try_unwrap(entry) {
            Ok(entry) => {
                if let Err(e) = entry.sandbox.destroy().await {
                    tracing::warn!(sandbox = %id, "destroy failed: {e}");
                }
            }
            Err(shared) => {
                let _ = self.runtime.remove_sandbox(shared.sandbox.id()).await;
            }
        }
    }

    /// The lock one sandbox's hibernation and wake take, so they never
    /// overlap.
    pub fn sandbox_lock(&self, id: &str) -> Arc<tokio::sync::Mutex<()>> {
        self.transitions
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .entry(id.to_string())
            .or_default()
            .clone()
    }

    /// Forgets the locks no one holds. A lock nobody has a handle to is
    /// unlocked and awaited by no one, so a new one made later is the
    /// same; without this the map kept one entry per sandbox that was ever
    /// hibernated, woken, snapshotted or forked.
    fn prune_sandbox_locks(&self) {
        self.transitions
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .retain(|_, lock| Arc::strong_count(lock) > 1);
    }

    /// How many per-sandbox locks are kept (`/metrics`).
    pub fn sandbox_locks(&self) -> usize {
        self.transitions
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .len()
    }

    /// Waits until no hibernation, wake or memory save (a gVisor snapshot
    /// or fork, which stops the sandbox for a moment) of `id` holds its
    /// lock.
    pub async fn settled(&self, id: &str) {
        let lock = self
            .transitions
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(id)
            .cloned();
        if let Some(lock) = lock {
            drop(lock.lock().await);
        }
    }

    /// Whether a hibernation or wake of `id` holds its lock right now.
    fn in_transition(&self, id: &str) -> bool {
        self.transitions
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(id)
            .is_some_and(|l| l.try_lock().is_err())
    }

    /// Reaps expired and dead sandboxes. Runs every half second.
    ///
    /// Work in progress (an exec, a stream, a code cell, a file transfer) is
    /// activity: a busy sandbox is touched instead of reaped, so its idle
    /// clock starts when its last piece of work ends. The maximum lifetime
    /// applies all the same.
    pub async fn reap_once(self: &Arc<Self>) {
        self.prune_sandbox_locks();
        let now = now_ms();
        let max = self.max_lifetime_ms();
        let mut expired = Vec::new();
        let mut busy = Vec::new();
        let mut idle = Vec::new();
        for (id, e) in self
            .sandboxes
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .iter()
        {
            let working = e.sandbox.work_in_progress() > 0;
            let r = e
                .record
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if now.saturating_sub(r.created_at.saturating_mul(1000)) > max {
                expired.push((id.clone(), "maximum lifetime reached".to_string()));
            } else if !e.sandbox.is_alive() {
                // One being hibernated may stop on purpose (a gVisor
                // checkpoint ends its processes): its hibernation goes on.
                if !self.in_transition(id) {
                    // Read before the removal takes its cgroup.
                    let reason = match e.sandbox.end_cause() {
                        Some(cause) => format!("sandbox stopped: {cause}"),
                        None => "sandbox stopped".to_string(),
                    };
                    expired.push((id.clone(), reason));
                }
            } else if working {
                busy.push(e.clone());
            } else if e.sandbox.is_paused() {
                // The idle clock stops while paused (the lifetime does not).
            } else if now.saturating_sub(r.last_activity_ms) > ttl_ms(r.ttl_seconds) {
                idle.push((e.clone(), r.clone()));
            }
        }
        for e in busy {
            self.touch(&e).await;
        }
        for (e, r) in idle {
            let service = crate::service::Service(self);
            let lineage = service.lineage_of(&r.id);
            match service.on_idle(&r, &lineage) {
                crate::snapshots::OnIdle::Hibernate => {
                    if let Err(err) = service.hibernate(e).await {
                        tracing::warn!(sandbox = %r.id, "could not hibernate an idle sandbox: {}", err.message);
                    }
                }
                crate::snapshots::OnIdle::Delete if !r.persistent => {
                    expired.push((r.id.clone(), "idle ttl expired".to_string()));
                }
                crate::snapshots::OnIdle::Delete => {}
            }
        }
        // A hibernated sandbox lives no longer than a running one.
        for r in crate::service::Service(self).expired_hibernated(now, max) {
            let _ = crate::service::Service(self).delete_hibernated(&r, "maximum lifetime reached");
        }
        for (id, reason) in expired {
            self.remove(&id, &reason).await;
        }
        self.prune_tombstones(now);
        self.trim_heap_when_quiet();
    }

    /// Gives the allocator's free memory back once activity has stopped:
    /// when a reaper tick finds no create, no removal and no teardown
    /// ending since the previous one, but some since the last trim (a
    /// trim while teardowns ran left what they freed afterwards: 1.5 MiB
    /// after a round of 500). A burst of hundreds of sandboxes
    /// leaves megabytes free inside glibc's arenas, which it keeps (the
    /// daemon's RSS stepped up with each round of 500 created and deleted);
    /// trimming during the burst would only fault the same pages in again.
    /// The registry's SQLite page cache goes first: it fills to its 2 MB
    /// as tombstones accumulate and would otherwise stay full.
    pub fn trim_heap_when_quiet(&self) {
        let now = HeapActivity {
            creations: self
                .metrics
                .creations
                .load(std::sync::atomic::Ordering::Relaxed),
            live: self
                .sandboxes
                .read()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .len(),
            teardowns: self.teardowns.load(std::sync::atomic::Ordering::Acquire),
            threads: runcell_jail::thread_count().unwrap_or(0),
        };
        let trim = time_to_trim(
            &mut self
                .heap_activity
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
            now,
        );
        if trim {
            // SQLite's page cache first, so what it frees is trimmed too.
            if let Err(e) = self.registry.release_memory() {
                tracing::debug!("the registry kept its cache: {e}");
            }
            let released = runcell_jail::trim_heap();
            tracing::debug!(
                released,
                "gave free heap memory back after a burst of sandboxes"
            );
        }
    }

    /// Removes tombstones older than the retention (at most once a minute).
    pub fn prune_tombstones(&self, now: i64) {
        use std::sync::atomic::Ordering;
        let last = self.last_prune_ms.load(Ordering::Acquire);
        if now.saturating_sub(last) < 60_000 {
            return;
        }
        self.last_prune_ms.store(now, Ordering::Release);
        let keep = self
            .config
            .tombstone_retention
            .max(self.config.max_lifetime);
        let keep_ms = i64::try_from(keep.as_millis()).unwrap_or(i64::MAX);
        match self.registry.prune(now.saturating_sub(keep_ms)) {
            Ok(0) => {}
            Ok(n) => tracing::info!(pruned = n, "removed old tombstones from the registry"),
            Err(e) => tracing::warn!("could not prune the registry: {e}"),
        }
    }

    /// The answer for a sandbox id that is not live for this workspace: why
    /// and when it ended if it was the workspace's and its tombstone is
    /// still kept, else a plain "not found" (another workspace's sandbox is
    /// answered exactly as a missing one). Always a 404.
    pub fn gone(&self, workspace: &str, id: &str) -> crate::error::ApiError {
        let tomb = match self.registry.tombstone(id) {
            Ok(Some(t)) if t.workspace == workspace => t,
            _ => return crate::error::ApiError::no_sandbox(),
        };
        let at = runcell_core::rfc3339(tomb.ended_at_ms.div_euclid(1000));
        let message = match tomb.reason.as_str() {
            "idle ttl expired" => format!(
                "sandbox {id} expired after {} s idle at {at}",
                tomb.ttl_seconds
            ),
            "maximum lifetime reached" => {
                format!("sandbox {id} reached its maximum lifetime and was removed at {at}")
            }
            "deleted by the API" => format!("sandbox {id} was deleted at {at}"),
            reason => format!("sandbox {id} ended at {at}: {reason}"),
        };
        let mut err = crate::error::ApiError::new(axum::http::StatusCode::NOT_FOUND, message);
        err.extra = Some(
            [
                ("end_reason".to_string(), tomb.reason.into()),
                ("ended_at".to_string(), at.into()),
            ]
            .into_iter()
            .collect(),
        );
        err
    }
}

/// An idle TTL in milliseconds, saturating.
fn ttl_ms(ttl_seconds: u64) -> i64 {
    i64::try_from(ttl_seconds)
        .unwrap_or(i64::MAX)
        .saturating_mul(1000)
}

/// The agent-enforced deadline (unix ms) of a record when no sandbox may
/// live longer than `max_lifetime_ms`: see [`AppState::agent_deadline`].
fn agent_deadline(r: &Record, max_lifetime_ms: i64) -> u64 {
    deadline(
        r.created_at,
        r.last_activity_ms,
        r.ttl_seconds,
        r.persistent,
        max_lifetime_ms,
    )
}

/// [`agent_deadline`] of a record's times (`created_at` in seconds) and TTL.
fn deadline(
    created_at: i64,
    last_activity_ms: i64,
    ttl_seconds: u64,
    persistent: bool,
    max_lifetime_ms: i64,
) -> u64 {
    let hard = created_at
        .saturating_mul(1000)
        .saturating_add(max_lifetime_ms);
    let idle = last_activity_ms
        .saturating_add(ttl_ms(ttl_seconds))
        .saturating_add(AGENT_DEADLINE_GRACE_MS);
    let deadline = if persistent { hard } else { idle.min(hard) };
    u64::try_from(deadline).unwrap_or(0)
}

/// Whether a reaper tick that sees `now` should trim the heap, given
/// `seen` (the previous tick's activity, the last trim's): when nothing
/// moved since the previous tick and no teardown runs (eight running for
/// longer than a tick look still), but something moved since the last
/// trim. Records `now` in `seen`.
fn time_to_trim(seen: &mut (HeapActivity, HeapActivity), now: HeapActivity) -> bool {
    let quiet = seen.0 == now && now.teardowns == 0;
    seen.0 = now;
    let trim = quiet && seen.1 != now;
    if trim {
        seen.1 = now;
    }
    trim
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A burst of creates and deletes trims once, on the first quiet tick
    /// after its last teardown has ended, not while teardowns still free
    /// memory; again once the burst's blocking threads have ended (each
    /// leaves its allocator cache); an idle daemon never trims again.
    /// (Once at start-up too, when its threads have started.)
    #[test]
    fn the_heap_is_trimmed_after_the_last_teardown_and_the_last_thread() {
        let at = |creations, live, teardowns, threads| HeapActivity {
            creations,
            live,
            teardowns,
            threads,
        };
        let mut seen = Default::default();
        let ticks = [
            // Start-up: its threads started since the (empty) last trim.
            (at(0, 0, 0, 4), false),
            (at(0, 0, 0, 4), true),
            (at(0, 0, 0, 4), false),
            (at(200, 200, 0, 12), false),
            (at(500, 0, 8, 17), false),
            (at(500, 0, 8, 17), false),
            (at(500, 0, 3, 17), false),
            (at(500, 0, 0, 17), false),
            (at(500, 0, 0, 17), true),
            (at(500, 0, 0, 17), false),
            (at(500, 0, 0, 3), false),
            (at(500, 0, 0, 3), true),
            (at(500, 0, 0, 3), false),
            (at(500, 0, 0, 3), false),
        ];
        for (i, (now, want)) in ticks.into_iter().enumerate() {
            assert_eq!(time_to_trim(&mut seen, now), want, "tick {i}: {now:?}");
        }
    }

    fn record(ttl_seconds: u64, persistent: bool) -> Record {
        Record {
            id: "a".into(),
            workspace: "w".into(),
            template: "host".into(),
            metadata: Default::default(),
            limits: Default::default(),
            env: Default::default(),
            ttl_seconds,
            persistent,
            created_at: 1_000,
            last_activity_ms: 2_000_000,
            status: "running".into(),
            end_reason: None,
            isolation: runcell_core::backend::Isolation::Jail,
        }
    }

    /// The idle TTL plus the grace, never past the maximum lifetime; a
    /// persistent sandbox gets the maximum lifetime only; huge TTLs
    /// saturate instead of wrapping.
    #[test]
    fn the_agent_deadline_is_the_idle_ttl_plus_grace_capped_by_the_lifetime() {
        let day = 24 * 3600 * 1000;
        assert_eq!(
            agent_deadline(&record(60, false), day),
            2_000_000 + 60_000 + 30_000
        );
        assert_eq!(
            agent_deadline(&record(60, true), day),
            1_000_000 + day.unsigned_abs()
        );
        assert_eq!(
            agent_deadline(&record(u64::MAX, false), day),
            1_000_000 + day.unsigned_abs()
        );
        assert_eq!(agent_deadline(&record(60, false), 1_000), 1_001_000);
    }
}
