//! The namespace jail (`runcell-jail`) as a [`Backend`].

use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::time::Duration;

use runcell_jail::{IdMap, Jail, PrepareConfig, Standby, StartConfig};

use super::{
    AgentChannel, Backend, BackendError, Counters, Instance, Kills, Limits, PrepareSpec, Prepared,
    StartSpec,
};

/// How long the host waits for a jail's child to acknowledge its go-ahead,
/// and for its agent to report ready.
const SETUP_TIMEOUT: Duration = Duration::from_secs(10);

/// Sandboxes in Linux namespaces with an overlay root, seccomp and cgroups.
#[derive(Debug, Clone)]
pub struct JailBackend {
    agent: PathBuf,
    state_dir: PathBuf,
    cgroup_parent: String,
    id_map: IdMap,
    agent_log: Option<String>,
    stage_store: Option<PathBuf>,
    fork_server: Option<std::sync::Arc<runcell_jail::forkserver::ForkServer>>,
}

impl JailBackend {
    /// A jail backend that starts `agent`, keeps one directory per sandbox
    /// in `state_dir` and one cgroup per sandbox under `cgroup_parent`,
    /// maps sandbox ids to `id_map`, and has agents log with the filter
    /// `agent_log`.
    pub fn new(
        agent: PathBuf,
        state_dir: PathBuf,
        cgroup_parent: String,
        id_map: IdMap,
        agent_log: Option<String>,
    ) -> Self {
        Self {
            agent,
            state_dir,
            cgroup_parent,
            id_map,
            agent_log,
            stage_store: None,
            fork_server: None,
        }
    }

    /// Forks each sandbox's agent from one started agent (a fork server)
    /// instead of an exec per sandbox: for a long-lived host, where it
    /// saves the agent's start-up per sandbox; a one-shot host execs.
    pub fn with_fork_server(mut self, on: bool) -> Self {
        self.fork_server = on.then(|| {
            std::sync::Arc::new(runcell_jail::forkserver::ForkServer::new(
                self.agent.clone(),
                self.agent_log.clone(),
            ))
        });
        self
    }

    /// Makes each sandbox's writable layer a btrfs subvolume in
    /// `stage_store` (the btrfs layer store), or a tmpfs with `None`.
    pub fn with_stage_store(mut self, stage_store: Option<PathBuf>) -> Self {
        self.stage_store = stage_store;
        self
    }

    /// The directory holding one subdirectory per sandbox.
    pub fn state_dir(&self) -> &Path {
        &self.state_dir
    }
}

impl Backend for JailBackend {
    fn isolation(&self) -> super::Isolation {
        super::Isolation::Jail
    }

    fn prepare(&self, spec: &PrepareSpec) -> Result<Box<dyn Prepared>, BackendError> {
        let cfg = PrepareConfig {
            id: spec.id.clone(),
            agent: self.agent.clone(),
            state_dir: self.state_dir.clone(),
            cgroup_parent: self.cgroup_parent.clone(),
            limits: spec.limits,
            id_map: self.id_map,
            setup_timeout: SETUP_TIMEOUT,
            agent_log: self.agent_log.clone(),
            host_network: spec.host_network,
            stage_store: self.stage_store.clone(),
            fork_server: self.fork_server.clone(),
        };
        Ok(Box::new(Standby::prepare(&cfg)?))
    }

    fn attach(&self, id: &str) -> Result<Box<dyn Instance>, BackendError> {
        Ok(Box::new(Jail::attach(&self.state_dir, id)?))
    }

    /// Sandboxes with a directory, and stages of the layer store whose
    /// sandbox has none (left by a host killed while removing one), so
    /// the daemon's reconcile removes those too.
    fn list(&self) -> Vec<String> {
        let mut ids = runcell_jail::list_sandboxes(&self.state_dir);
        if let Some(store) = &self.stage_store {
            ids.extend(runcell_jail::list_sandboxes(store));
            ids.sort();
            ids.dedup();
        }
        ids
    }

    fn is_dead(&self, id: &str, grace: Duration) -> bool {
        Jail::is_dead(&self.state_dir, id, grace)
    }

    fn remove(&self, id: &str) -> Result<(), BackendError> {
        Ok(Jail::remove(
            &self.state_dir,
            &self.cgroup_parent,
            id,
            self.stage_store.as_deref(),
        )?)
    }
}

impl Prepared for Standby {
    fn id(&self) -> &str {
        Standby::id(self)
    }

    fn set_limits(&self, limits: &Limits) -> Result<(), BackendError> {
        Ok(Standby::set_limits(self, limits)?)
    }

    fn reset_limits(&self) -> Result<(), BackendError> {
        Ok(Standby::reset_limits(self)?)
    }

    fn is_alive(&self) -> bool {
        Standby::is_alive(self)
    }

    fn build_ahead(&mut self, spec: &StartSpec) -> Result<(), BackendError> {
        Ok(Standby::build_ahead(self, &start_config(spec))?)
    }

    fn start(self: Box<Self>, spec: &StartSpec) -> Result<Box<dyn Instance>, BackendError> {
        Ok(Box::new(Standby::start(*self, &start_config(spec))?))
    }
}

fn start_config(spec: &StartSpec) -> StartConfig {
    StartConfig {
        rootfs: spec.rootfs.clone(),
        limits: spec.limits,
        user: spec.user.clone(),
        exit_on_host_close: spec.tied_to_process,
        deadline_unix_ms: spec.deadline_unix_ms,
        ready_timeout: SETUP_TIMEOUT,
        env: spec.env.clone(),
        workdir: spec.workdir.clone(),
        egress: spec.egress,
        state_layers: spec.state_layers.clone(),
        mounts: spec.mounts.clone(),
    }
}

impl Instance for Jail {
    fn id(&self) -> &str {
        Jail::id(self)
    }

    fn pid(&self) -> i32 {
        Jail::pid(self)
    }

    fn agent_channel(&self) -> AgentChannel {
        AgentChannel::Unix(self.socket_path())
    }

    fn take_egress_listener(&mut self) -> Option<UnixListener> {
        Jail::take_egress_listener(self)
    }

    fn rebind_egress(&mut self) -> Result<Option<UnixListener>, BackendError> {
        Ok(Jail::rebind_egress(self)?)
    }

    fn counters(&self) -> Counters {
        Jail::counters(self)
    }

    fn kills(&self) -> Kills {
        Jail::kills(self)
    }

    fn is_alive(&self) -> bool {
        Jail::is_alive(self)
    }

    fn kill(&self) {
        Jail::kill(self)
    }

    fn destroy(self: Box<Self>) -> Result<(), BackendError> {
        Ok(Jail::destroy(*self)?)
    }

    fn isolation(&self) -> super::Isolation {
        super::Isolation::Jail
    }

    fn freeze(&self) -> Result<(), BackendError> {
        Ok(Jail::freeze(self)?)
    }

    fn thaw(&self) -> Result<(), BackendError> {
        Ok(Jail::thaw(self)?)
    }

    fn is_frozen(&self) -> bool {
        Jail::is_frozen(self)
    }

    fn export_layer(&self, dest: &Path) -> Result<u64, BackendError> {
        Ok(Jail::export_layer(self, dest)?)
    }

    fn layer_full(&self) -> Option<bool> {
        Jail::layer_full(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn backend(state_dir: &Path) -> JailBackend {
        JailBackend::new(
            PathBuf::from("/nonexistent/runcell-agent"),
            state_dir.into(),
            format!("runcell-unit-{}", std::process::id()),
            IdMap::default(),
            None,
        )
    }

    #[test]
    fn sweep_removes_a_half_made_sandbox_past_its_grace_and_keeps_a_young_one() {
        let tmp = tempfile::tempdir().unwrap();
        let b = backend(tmp.path());
        // Left behind by a process killed while preparing: a directory with
        // no state file and no process.
        std::fs::create_dir_all(tmp.path().join("orphan/rootfs")).unwrap();
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(
            b.sweep(Duration::from_millis(10)),
            vec!["orphan".to_string()]
        );
        assert!(!tmp.path().join("orphan").exists());

        // One another process is preparing right now is not touched.
        std::fs::create_dir_all(tmp.path().join("young")).unwrap();
        assert!(b.sweep(Duration::from_secs(60)).is_empty());
        assert!(tmp.path().join("young").exists());
    }

    #[test]
    fn a_sandbox_whose_agent_is_gone_is_dead_and_removed() {
        let tmp = tempfile::tempdir().unwrap();
        let b = backend(tmp.path());
        let dir = tmp.path().join("gone");
        std::fs::create_dir_all(&dir).unwrap();
        // A state file naming a process that exited.
        let mut child = std::process::Command::new("/bin/true").spawn().unwrap();
        let pid = child.id();
        child.wait().unwrap();
        std::fs::write(
            dir.join("jail.json"),
            format!(r#"{{"id":"gone","pid":{pid},"start_time":1,"cgroup_parent":"runcell-unit"}}"#),
        )
        .unwrap();
        assert!(b.is_dead("gone", Duration::from_secs(60)));
        assert!(b.attach("gone").is_err());
        assert_eq!(b.sweep(Duration::from_secs(60)), vec!["gone".to_string()]);
        assert!(!dir.exists());
    }
}
