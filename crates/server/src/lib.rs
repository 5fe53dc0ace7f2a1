//! `runcell serve`: the daemon. It owns the sandboxes it creates, records
//! them in SQLite, enforces their TTLs, and serves the `/v1` HTTP API that
//! the PandaStack clients and runcell's own clients speak.

mod autobuild;
mod clock;
pub mod cluster;
mod error;
mod http;
pub mod keys;
mod limits;
mod logs;
mod metrics;
mod pool;
mod quota;
mod registry;
pub mod sandbox_dir;
mod service;
mod snapshots;
mod state;
pub mod store;
mod validate;
pub mod views;
mod volumes;

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use runcell_core::{Runtime, RuntimeConfig};

pub use error::ApiError;
pub use http::router;
pub use limits::StoredLimits;
pub use metrics::Metrics;
pub use quota::WorkspaceQuota;
pub use registry::{Record, Registry, RegistryError};
pub use state::{AppState, ServeConfig};

/// Errors starting or running the daemon.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The data directory is unusable.
    #[error("The data directory {0} could not be prepared.")]
    DataDir(std::path::PathBuf, #[source] std::io::Error),
    /// The registry failed.
    #[error(transparent)]
    Registry(#[from] RegistryError),
    /// The sandbox runtime failed.
    #[error(transparent)]
    Core(#[from] runcell_core::Error),
    /// `--default-isolation` names a backend this host cannot run.
    #[error(
        "The default isolation cannot be used (`runcell doctor` says what this host can run)."
    )]
    DefaultIsolation(#[source] runcell_core::Error),
    /// The listener failed.
    #[error("Could not listen on {0}.")]
    Listen(std::net::SocketAddr, #[source] std::io::Error),
    /// Serving failed.
    #[error("The HTTP server failed.")]
    Http(#[source] std::io::Error),
    /// Cluster mode could not start.
    #[error(transparent)]
    Cluster(#[from] cluster::ClusterError),
    /// The layer store (`--layer-store`) could not be set up.
    #[error(transparent)]
    Store(#[from] store::StoreError),
    /// The sandboxes' directory could not be set up.
    #[error(transparent)]
    SandboxDir(#[from] sandbox_dir::SandboxDirError),
    /// Sandboxes could not reach their directories: every create would fail.
    #[error(
        "Sandboxes cannot reach the {what} {dir}: {blocker} (mode {mode:o}, owner {uid}:{gid}) \
         does not let the sandboxes' host user {sandbox_uid} traverse it. Fix: `chmod o+x {blocker}`, \
         or choose a directory outside it, e.g. --{flag} /var/lib/runcell{suffix}."
    )]
    Untraversable {
        /// Which directory (`data directory` or `templates directory`).
        what: &'static str,
        /// The directory.
        dir: std::path::PathBuf,
        /// The ancestor that blocks.
        blocker: std::path::PathBuf,
        /// Its mode bits.
        mode: u32,
        /// Its owner.
        uid: u32,
        /// Its group.
        gid: u32,
        /// The host uid of root in a sandbox.
        sandbox_uid: u32,
        /// The flag that chooses the directory.
        flag: &'static str,
        /// Path suffix of the suggested directory.
        suffix: &'static str,
    },
}

/// Checks that the sandboxes' host user (root of a sandbox is the
/// unprivileged host id `uid`) can traverse `dir` and each of its existing
/// ancestors: a sandbox mounts its writable layer and template from there,
/// so otherwise every create fails.
fn check_traversable(
    dir: &std::path::Path,
    uid: u32,
    what: &'static str,
    flag: &'static str,
    suffix: &'static str,
) -> Result<(), ServeError> {
    use std::os::unix::fs::MetadataExt;
    let dir = std::path::absolute(dir).unwrap_or_else(|_| dir.to_path_buf());
    for ancestor in dir.ancestors() {
        let Ok(meta) = fs::metadata(ancestor) else {
            continue; // Not made yet: created with the usual modes.
        };
        let mode = meta.mode() & 0o7777;
        let ok = if meta.uid() == uid {
            mode & 0o100 != 0
        } else if meta.gid() == uid {
            mode & 0o010 != 0
        } else {
            mode & 0o001 != 0
        };
        if !ok {
            return Err(ServeError::Untraversable {
                what,
                dir: dir.clone(),
                blocker: ancestor.to_path_buf(),
                mode,
                uid: meta.uid(),
                gid: meta.gid(),
                sandbox_uid: uid,
                flag,
                suffix,
            });
        }
    }
    Ok(())
}

/// Gives the daemon the usual umask, 022, whatever it was started with
/// (as Docker's daemon does). Sandboxes reach what the daemon makes for
/// them as another host user (their agent is an unprivileged host uid):
/// under a service's `UMask=0077` a volume's directories came out 0700, and
/// every sandbox given a volume failed to start ("bind-mounting ... failed:
/// Permission denied"). What must stay private says so itself: the API key
/// and the registry are written 0600, and the data directory is 0711.
fn set_umask() {
    use nix::sys::stat::{umask, Mode};
    let was = umask(Mode::from_bits_truncate(0o022));
    if was.bits() != 0o022 {
        tracing::info!(
            was = format!("{:03o}", was.bits()),
            "the daemon runs with umask 022 (sandboxes must read what it makes for them)"
        );
    }
}

/// Raises the daemon's soft limit on open files to its hard limit (as Go
/// programs and containerd do at start). Each live sandbox holds a few
/// descriptors in the daemon (its agent's connection, its pidfd, its
/// egress socket): under systemd's default soft limit of 1024 creates
/// failed with "Too many open files" at 334 live sandboxes, whatever
/// `--max-sandboxes` said. Sandboxes' programs do not inherit it: they
/// start with a soft limit of 1024 ([`runcell_jail::inside::drop_privileges`]).
fn raise_open_files_limit() {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    let Ok((soft, hard)) = getrlimit(Resource::RLIMIT_NOFILE) else {
        return;
    };
    if soft >= hard {
        return;
    }
    match setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
        Ok(()) => tracing::debug!(soft, hard, "raised the open files limit to its hard limit"),
        Err(e) => tracing::warn!(
            soft,
            hard,
            "could not raise the open files limit, which caps the live sandboxes: {e}"
        ),
    }
}

/// Builds the state, reconciles with what survived a restart, and serves
/// until SIGINT or SIGTERM. Sandboxes keep running across a restart.
pub async fn serve(config: ServeConfig, grace: Duration) -> Result<(), ServeError> {
    let mut stop = stop_signals();
    set_umask();
    raise_open_files_limit();
    fs::create_dir_all(&config.data_dir)
        .map_err(|e| ServeError::DataDir(config.data_dir.clone(), e))?;
    // Sandbox agents (an unprivileged host uid) must traverse it to their directories.
    fs::set_permissions(&config.data_dir, fs::Permissions::from_mode(0o711))
        .map_err(|e| ServeError::DataDir(config.data_dir.clone(), e))?;
    let sandbox_uid = RuntimeConfig::default().id_map.host_base;
    check_traversable(
        &config.data_dir,
        sandbox_uid,
        "data directory",
        "data-dir",
        "",
    )?;
    if let Some(dir) = &config.templates_dir {
        check_traversable(
            dir,
            sandbox_uid,
            "templates directory",
            "templates-dir",
            "/templates",
        )?;
    }
    let registry = Registry::open(&config.data_dir.join("registry.db"))?;
    registry
        .with_conn(|c| volumes::init(c).map_err(std::io::Error::other))
        .map_err(|e| ServeError::DataDir(config.data_dir.clone(), e))?;
    registry
        .with_conn(snapshots::init)
        .map_err(|e| ServeError::DataDir(config.data_dir.clone(), std::io::Error::other(e)))?;
    let created = registry
        .with_conn(|c| keys::bootstrap(c, &config.data_dir))
        .map_err(|e| ServeError::DataDir(config.data_dir.clone(), e))?;
    // Before any sandbox is prepared: a standby's mount namespace is a
    // copy of the host's at its clone, and must see the store mounted.
    let layer_store = store::open(&config.data_dir, config.layer_store)?;
    tracing::info!(
        layer_store = layer_store.name(),
        reason = layer_store.reason(),
        "layer store"
    );
    // Also before: the jail sandboxes' directories are on a tmpfs mounted
    // there (their namespaces copy the mount table at their clone).
    let sandbox_dir = sandbox_dir::open(&config.data_dir.join("sandboxes"))?;
    match &sandbox_dir {
        sandbox_dir::SandboxDir::Tmpfs { .. } => {
            tracing::info!("sandbox directories: on a tmpfs")
        }
        sandbox_dir::SandboxDir::Disk { reason } => {
            tracing::info!("sandbox directories: on the data directory's disk; {reason}")
        }
    }
    let runtime = Runtime::new(RuntimeConfig {
        state_dir: config.data_dir.join("sandboxes"),
        stage_store: layer_store.stages(),
        templates_dir: config.templates_dir.clone(),
        cgroup_parent: config.cgroup_parent.clone(),
        standby: config.standby,
        ..RuntimeConfig::default()
    })?
    .with_egress(runcell_egress::EgressConfig {
        allow_private: config.egress_allow_private.clone(),
        ..Default::default()
    });
    // Every backend this host can run; the default must be one of them.
    let host_options = runcell_core::host::HostOptions {
        allow_emulation: config.allow_emulation,
    };
    let (runtime, report) = runcell_core::host::equip(runtime, &host_options);
    for b in &report.backends {
        tracing::info!(backend = b.name, available = b.available, "{}", b.detail);
    }
    let runtime = runtime
        .with_default_isolation(config.default_isolation)
        .map_err(ServeError::DefaultIsolation)?;
    let pools = pool::WarmPools::new(&runtime, &config.warm_pools, config.default_limits);
    let cluster = match &config.cluster {
        Some(c) => Some(cluster::Cluster::connect(c.clone()).await?),
        None => None,
    };
    let state = Arc::new(AppState {
        config: config.clone(),
        pools,
        teardowns: Default::default(),
        teardown_slots: Arc::new(tokio::sync::Semaphore::new(state::TEARDOWN_SLOTS)),
        runtime,
        registry,
        sandboxes: RwLock::new(Default::default()),
        metrics: Metrics::default(),
        creating: Default::default(),
        reservations: Default::default(),
        last_prune_ms: Default::default(),
        heap_activity: Default::default(),
        auto_builds: Default::default(),
        system: report,
        transitions: Default::default(),
        attaching: Default::default(),
        saving_layers: Default::default(),
        cluster,
        layer_store,
    });
    reconcile(&state).await;
    if let Some(c) = &state.cluster {
        c.start(state.clone());
    }
    volumes::mount_all(&state);
    snapshots::collect_at_start(&state);
    if state.config.auto_build {
        let target = state
            .config
            .aliases
            .get(autobuild::NAME)
            .cloned()
            .unwrap_or_else(|| "host".into());
        // Once built, its warm pool (`--warm-pool code-interpreter=N`)
        // starts at once rather than at the next refill round.
        let ready = state.clone();
        autobuild::start(
            &state.runtime,
            &state.auto_builds,
            &state.config.data_dir,
            target,
            move || {
                for pool in ready.pools.ensure(&ready.runtime) {
                    let st = ready.clone();
                    tokio::spawn(async move { pool.refill(&st.runtime).await });
                }
            },
        );
    }
    state.runtime.warm_up().await;
    // Warm pools fill in the background (a Python context importing pandas
    // takes a while) and are topped up and renewed every 30 s.
    let filler = state.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(30));
        loop {
            tick.tick().await;
            let st = filler.clone();
            survive("warm pool refill", async move {
                // A configured pool whose template was installed since
                // start-up (a first-run build, `runcell template build`)
                // starts now.
                st.pools.ensure(&st.runtime);
                for p in st.pools.all() {
                    p.refill(&st.runtime).await;
                }
            })
            .await;
        }
    });

    let reaper = state.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_millis(500));
        loop {
            tick.tick().await;
            let st = reaper.clone();
            survive("reaper", async move { st.reap_once().await }).await;
        }
    });

    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .map_err(|e| ServeError::Listen(config.listen, e))?;
    let addr = listener
        .local_addr()
        .map_err(|e| ServeError::Listen(config.listen, e))?;
    println!("runcell is listening on http://{addr}");
    if let Some(path) = created {
        println!(
            "A new API key (workspace \"default\") was written to {}.",
            path.display()
        );
        println!("More keys: runcell key create --workspace NAME");
    }
    println!(
        "  curl -H \"Authorization: Bearer $(cat {})\" http://{addr}/v1/sandboxes",
        config.data_dir.join("api-key").display()
    );
    println!(
        "  export PANDASTACK_API=http://{addr} PANDASTACK_API_KEY=$(cat {})",
        config.data_dir.join("api-key").display()
    );
    println!(
        "  export RUNCELL_URL=http://{addr} RUNCELL_API_KEY=$(cat {})",
        config.data_dir.join("api-key").display()
    );
    tracing::info!(%addr, "listening");
    // On SIGTERM/SIGINT: stop accepting, give running requests `grace` to
    // finish, then stop anyway. Sandboxes keep running either way.
    let stopping = Arc::new(tokio::sync::Notify::new());
    let notify = stopping.clone();
    // No Nagle: an SSE stream's small writes (an exec's `exit` event, then
    // the body's end) would otherwise each wait for the client's delayed
    // ACK, up to 40 ms, on a connection the client reuses (`runcell run`:
    // create, exec/stream, delete on one connection).
    use axum::serve::ListenerExt as _;
    let listener = listener.tap_io(|tcp| {
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!("could not set TCP_NODELAY on a connection: {e}");
        }
    });
    let server = axum::serve(listener, router(state.clone())).with_graceful_shutdown(async move {
        stop.recv().await;
        tracing::info!(
            ?grace,
            "stopping: no new connections; waiting for running requests"
        );
        notify.notify_one();
    });
    tokio::select! {
        r = server => r.map_err(ServeError::Http)?,
        _ = async { stopping.notified().await; tokio::time::sleep(grace).await } => {
            tracing::warn!("the shutdown grace period ended with requests still running");
        }
    }
    if let Some(c) = &state.cluster {
        c.leave().await;
    }
    state.pools.close();
    for p in state.pools.all() {
        p.drain().await;
    }
    // Let the teardowns of deleted sandboxes finish (cgroups, directories).
    let until = std::time::Instant::now() + Duration::from_secs(10);
    while state.teardowns.load(std::sync::atomic::Ordering::Acquire) > 0
        && std::time::Instant::now() < until
    {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    release_layer_store(&state).await;
    release_volumes(&state).await;
    release_sandbox_dir(&state, sandbox_dir).await;
    tracing::info!("stopped; sandboxes keep running and are re-attached by the next start");
    Ok(())
}

/// On a graceful stop: with no live sandbox left, the btrfs layer store
/// is unmounted (its loop device goes too); the image keeps every
/// snapshot and hibernated sandbox for the next start, which mounts it
/// again. A live sandbox (running or paused, whatever its backend: its
/// mount namespace holds the store, and a layer in it may be its lower)
/// keeps it mounted for the next start to re-attach to.
async fn release_layer_store(state: &Arc<AppState>) {
    if state.layer_store.stages().is_none() {
        return;
    }
    // The standbys' stages are in the store, and their namespaces hold it.
    state.runtime.close_standbys().await;
    if !nothing_live(state, "the layer store stays mounted") {
        return;
    }
    let store = state.layer_store.clone();
    match tokio::task::spawn_blocking(move || store.release()).await {
        Ok(Ok(true)) => tracing::info!("unmounted the layer store; the next start mounts it again"),
        Ok(Ok(false)) => {}
        Ok(Err(e)) => tracing::warn!("the layer store stays mounted: {e}"),
        Err(e) => tracing::warn!("the layer store stays mounted: {e}"),
    }
}

/// On a graceful stop with no live sandbox: every volume is unmounted (its
/// loop device goes too), as the store is; the next start mounts them
/// again. A live sandbox may have one bound in its mount namespace, and a
/// second mount of the same image by the next start would corrupt it, so
/// then they all stay mounted for the next start to use.
async fn release_volumes(state: &Arc<AppState>) {
    if !nothing_live(state, "the volumes stay mounted") {
        return;
    }
    let store = volumes::Store::new(&state.config.data_dir);
    match tokio::task::spawn_blocking(move || store.release_all()).await {
        Ok(0) => {}
        Ok(n) => tracing::info!(
            volumes = n,
            "unmounted the volumes; the next start mounts them again"
        ),
        Err(e) => tracing::warn!("the volumes may stay mounted: {e}"),
    }
}

/// Whether no sandbox is live (running or paused: the registry's
/// `running`), so that what a live one would hold (the layer store, the
/// volumes) may be released; otherwise logs `kept` (what stays) and why.
fn nothing_live(state: &AppState, kept: &str) -> bool {
    match state.registry.with_status("running") {
        Ok(r) if r.is_empty() => true,
        Ok(r) => {
            tracing::info!(
                sandboxes = r.len(),
                "{kept} for the sandboxes that keep running"
            );
            false
        }
        Err(e) => {
            tracing::warn!("{kept}: could not read the registry: {e}");
            false
        }
    }
}

/// On a graceful stop: the standbys go (nothing would hand them out), and
/// with no live sandbox left the sandboxes' tmpfs is unmounted; the next
/// start mounts it again. A live sandbox keeps it, with its files there,
/// for the next start to re-attach to.
async fn release_sandbox_dir(state: &Arc<AppState>, dir: sandbox_dir::SandboxDir) {
    if !matches!(dir, sandbox_dir::SandboxDir::Tmpfs { .. }) {
        return;
    }
    state.runtime.close_standbys().await;
    // Dropping it releases it (and logs what happened).
    if let Err(e) = tokio::task::spawn_blocking(move || drop(dir)).await {
        tracing::warn!("the sandboxes' tmpfs may stay mounted: {e}");
    }
}

/// SIGINT and SIGTERM, caught from the first line of [`serve`]: a signal
/// that comes while the daemon starts (a supervisor stopping it right
/// after it said it is listening, or earlier) stops it gracefully once it
/// is up, with the layer store released, rather than ending it by the
/// signal's default action with the store left mounted.
fn stop_signals() -> runcell_core::signals::Caught {
    use tokio::signal::unix::SignalKind;
    runcell_core::signals::Caught::catch(&[SignalKind::interrupt(), SignalKind::terminate()])
        .unwrap_or_else(|e| {
            tracing::warn!(
                "SIGINT and SIGTERM cannot be caught ({e}): a signal ends the daemon without releasing the layer store"
            );
            runcell_core::signals::Caught::nothing()
        })
}

/// Runs one round of a background loop as its own task, so that a panic in
/// it (release builds unwind) is logged and the loop goes on, instead of
/// silently ending the reaper or the pool filler for good.
async fn survive(
    what: &'static str,
    round: impl std::future::Future<Output = ()> + Send + 'static,
) {
    if let Err(e) = tokio::spawn(round).await {
        tracing::error!("a {what} round failed: {e}; the next round runs as usual");
    }
}

/// After a (re)start: re-attach live sandboxes, reap expired and dead ones,
/// and remove anything on the host the registry does not know.
async fn reconcile(state: &Arc<AppState>) {
    let running = match state.registry.with_status("running") {
        Ok(r) => r,
        Err(e) => {
            tracing::error!("could not read the registry: {e}");
            Vec::new()
        }
    };
    let now = state::now_ms();
    let mut known = std::collections::HashSet::new();
    for rec in running {
        known.insert(rec.id.clone());
        let expired = (!rec.persistent
            && now - rec.last_activity_ms > rec.ttl_seconds as i64 * 1000)
            || now - rec.created_at * 1000
                > i64::try_from(state.config.max_lifetime.as_millis()).unwrap_or(i64::MAX);
        if expired {
            let _ = state.runtime.remove_sandbox(&rec.id).await;
            let _ = state.registry.end(
                &rec.id,
                registry::Ended::Deleted,
                "expired while the daemon was down",
            );
            tracing::info!(sandbox = %rec.id, "reaped: expired while the daemon was down");
            continue;
        }
        let template_name = state
            .config
            .aliases
            .get(&rec.template)
            .cloned()
            .unwrap_or(rec.template.clone());
        let template = state
            .runtime
            .template(&template_name)
            .unwrap_or_else(|_| runcell_core::Template::host());
        let limits = rec.limits.over(state.config.default_limits);
        // Its egress is served again with the policy it had.
        let network = state.registry.network(&rec.id).unwrap_or_else(|e| {
            tracing::warn!(sandbox = %rec.id, "its network policy is unreadable: {e}");
            None
        });
        match state
            .runtime
            .attach(&rec.id, rec.isolation, template.clone(), limits, network)
            .await
        {
            Ok(sandbox) => {
                tracing::info!(sandbox = %rec.id, "re-attached");
                let entry = state::Entry::new(sandbox, rec.clone(), template, None);
                state
                    .sandboxes
                    .write()
                    .expect("sandboxes lock")
                    .insert(rec.id.clone(), entry);
            }
            Err(e) => {
                tracing::warn!(sandbox = %rec.id, "could not re-attach, marking failed: {e}");
                let _ = state.runtime.remove_sandbox(&rec.id).await;
                let _ = state.registry.end(
                    &rec.id,
                    registry::Ended::Failed,
                    "not running after a daemon restart",
                );
            }
        }
    }
    // Anything in our state directory that the registry does not list as
    // running is an orphan: kill it and remove it. Orphans are found through
    // the state directory only: the cgroup parent is shared with other
    // runcell processes (`runcell run`, other daemons) whose sandboxes are
    // not ours to judge.
    for id in state.runtime.list() {
        if !known.contains(&id) {
            tracing::info!(sandbox = %id, "removing an orphaned sandbox");
            let _ = state.runtime.remove_sandbox(&id).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    #[tokio::test]
    async fn a_background_round_that_panics_does_not_end_the_loop() {
        super::survive("test", async { panic!("one bad round") }).await;
        let ran = Arc::new(AtomicBool::new(false));
        let r = ran.clone();
        super::survive("test", async move { r.store(true, Ordering::SeqCst) }).await;
        assert!(ran.load(Ordering::SeqCst));
    }
}
