//! Host side of the jail: create, watch and destroy a sandbox.
//!
//! Creating a sandbox:
//! 1. make its directory (`<state>/<id>`), bind the agent's listening socket
//!    there and create its cgroup;
//! 2. `clone` a child into new user, pid, mount, net, ipc and uts namespaces;
//!    the child is PID 1 of its pid namespace and waits;
//! 3. write the child's uid/gid maps (root inside = an unprivileged host id),
//!    put it in the cgroup, and let it go;
//! 4. the child becomes root of its user namespace and execs `runcell-agent
//!    init`, which reads the [`InitSpec`] from the setup socket, builds the root
//!    filesystem ([`crate::inside::bootstrap`]) and reports ready.
//!
//! Destroying it kills PID 1 of its pid namespace (so the kernel kills every
//! process in it, double-forked daemons included), removes the cgroup and the
//! directory. The mounts lived only in the sandbox's mount namespace and are
//! gone with it.

use std::ffi::CString;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::cgroup::{Cgroup, CgroupError, Counters, Hierarchy};
use crate::spec::{IdMap, InitSpec, Limits, RootfsSpec, SandboxUser};
use crate::sys;

/// Errors creating, attaching to or destroying a sandbox.
#[derive(Debug, thiserror::Error)]
pub enum SpawnError {
    /// Copying the sandbox's writable layer failed.
    #[error(transparent)]
    Export(#[from] crate::layer::LayerError),
    /// The btrfs layer store failed (the stage's subvolume, its limit or
    /// its snapshot).
    #[error(transparent)]
    Store(#[from] crate::btrfs::BtrfsError),
    /// Not running as root.
    #[error(
        "runcell needs root to create sandboxes (it writes uid maps and cgroups); run it as root."
    )]
    NotRoot,
    /// The agent binary is missing.
    #[error("The sandbox agent binary {0} was not found; build it with `cargo build` or set RUNCELL_AGENT.")]
    AgentMissing(PathBuf),
    /// A file operation in the sandbox's host directory failed.
    #[error("Could not prepare {path} for the sandbox.")]
    Io {
        /// The path involved.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// Cgroup setup or teardown failed.
    #[error(transparent)]
    Cgroup(#[from] CgroupError),
    /// clone(2) failed.
    #[error("Could not create the sandbox's namespaces (clone failed).")]
    Clone(#[source] io::Error),
    /// Talking to the starting agent failed.
    #[error("Lost contact with the sandbox while it started.")]
    Setup(#[source] io::Error),
    /// The agent could not be executed.
    #[error("The sandbox agent could not be started.")]
    AgentExec(#[source] io::Error),
    /// The agent reported a setup failure.
    #[error("The sandbox could not be set up: {0}")]
    SetupFailed(String),
    /// The agent exited before it was ready.
    #[error("The sandbox agent exited while starting. Its log ends with: {0}")]
    AgentDied(String),
    /// The agent did not report within the timeout.
    #[error("The sandbox did not become ready within {0:?}. The agent's log ends with: {1}")]
    ReadyTimeout(Duration, String),
    /// No live sandbox with that id.
    #[error("Sandbox {0} is not running.")]
    NotRunning(String),
    /// The sandbox's state file is unreadable.
    #[error("The state of sandbox {0} is unreadable.")]
    BadState(String, #[source] serde_json::Error),
    /// The id is not a plain name.
    #[error("The sandbox id {0:?} is not a plain name (1 to 64 letters, digits, '-', '_' or '.', not starting with '.').")]
    BadId(String),
}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> SpawnError + '_ {
    move |source| SpawnError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// What [`Standby::prepare`] needs: where the sandbox lives and how its
/// namespaces, cgroup and agent process are made. Nothing here depends on
/// what will run in it.
#[derive(Debug, Clone)]
pub struct PrepareConfig {
    /// Sandbox id: a plain name (see [`check_id`]), normally a UUID.
    pub id: String,
    /// The `runcell-agent` binary.
    pub agent: PathBuf,
    /// Directory that holds one subdirectory per sandbox.
    pub state_dir: PathBuf,
    /// Cgroup parent name, e.g. `runcell`.
    pub cgroup_parent: String,
    /// Limits the cgroup is created with (a claim may change them with
    /// [`Standby::set_limits`]; [`Standby::reset_limits`] restores these).
    pub limits: Limits,
    /// Id mapping.
    pub id_map: IdMap,
    /// How long to wait for the child to acknowledge its go-ahead.
    pub setup_timeout: Duration,
    /// Log filter for the agent (`RUST_LOG` syntax), written to `agent.log`.
    pub agent_log: Option<String>,
    /// Keep the host's network namespace (no `CLONE_NEWNET`). Only template
    /// builds set this, for `RUN apt-get ...`; such a sandbox never gets an
    /// egress socket.
    pub host_network: bool,
    /// The btrfs layer store's directory of stages: the sandbox's writable
    /// layer is the subvolume `<stage_store>/<id>` (made here and capped
    /// at `disk_bytes` by a qgroup limit; a start with another `disk_bytes`
    /// sets it again) instead of a tmpfs, so a
    /// save is a snapshot of it ([`Jail::export_layer`]). `None`: a tmpfs.
    pub stage_store: Option<PathBuf>,
    /// Fork the agent from this fork server (of the same agent binary)
    /// instead of an exec per sandbox; `None` for one-shot use. Should it
    /// fail, the agent is exec'd.
    pub fork_server: Option<std::sync::Arc<crate::forkserver::ForkServer>>,
}

/// What [`Standby::start`] needs: what runs in the sandbox and how.
#[derive(Debug, Clone)]
pub struct StartConfig {
    /// Root filesystem.
    pub rootfs: RootfsSpec,
    /// Limits (the cgroup's, and `disk_bytes` for the writable layer).
    pub limits: Limits,
    /// The unprivileged user code runs as.
    pub user: SandboxUser,
    /// Stop the sandbox when this process (the [`Jail`] value) goes away.
    pub exit_on_host_close: bool,
    /// Hard deadline (unix ms) enforced by the agent itself.
    pub deadline_unix_ms: Option<u64>,
    /// How long to wait for the agent to report ready.
    pub ready_timeout: Duration,
    /// Environment of every process in the sandbox (the template's `ENV`).
    pub env: std::collections::BTreeMap<String, String>,
    /// Default working directory (the template's `WORKDIR`).
    pub workdir: Option<String>,
    /// Whether the sandbox gets an egress socket.
    pub egress: EgressSocket,
    /// Layers of saved sandbox files over the template, topmost first
    /// ([`InitSpec::state_layers`]).
    pub state_layers: Vec<PathBuf>,
    /// Host directories bound into the sandbox (volumes).
    pub mounts: Vec<crate::BindMount>,
}

/// A sandbox's egress socket.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EgressSocket {
    /// None: nothing can leave, and the policy cannot be changed later.
    #[default]
    None,
    /// `<dir>/egress/sock` is bound for the host's proxy and mounted in the
    /// sandbox (take its listener with [`Jail::take_egress_listener`]);
    /// `enabled` starts the agent's proxy listener at once (the policy is
    /// not `none`). Ignored for a sandbox prepared with `host_network`.
    Socket {
        /// Start the agent's proxy listener at once.
        enabled: bool,
    },
}

/// Checks that `id` is a plain name that stays inside the state directory
/// and the cgroup parent when joined to them: 1 to 64 ASCII letters, digits,
/// `-`, `_` or `.`, not starting with `.`.
pub fn check_id(id: &str) -> Result<(), SpawnError> {
    let plain = !id.is_empty()
        && id.len() <= 64
        && !id.starts_with('.')
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
    if plain {
        Ok(())
    } else {
        Err(SpawnError::BadId(id.into()))
    }
}

/// What is written to `<dir>/jail.json` so a later process can find the sandbox.
#[derive(Debug, Serialize, Deserialize)]
struct StateFile {
    id: String,
    pid: i32,
    start_time: u64,
    cgroup_parent: String,
    /// The stage's subvolume (btrfs layer store).
    #[serde(default)]
    stage: Option<PathBuf>,
}

/// A running sandbox (host side).
#[derive(Debug)]
pub struct Jail {
    id: String,
    dir: PathBuf,
    pid: i32,
    pidfd: OwnedFd,
    cgroup: Cgroup,
    /// The writable layer's subvolume (btrfs layer store), or `None`: a tmpfs.
    stage: Option<PathBuf>,
    /// The stage's qgroup directory in sysfs, looked up once: every exec's
    /// end reads its counters ([`Jail::layer_full`]).
    qgroup: OnceLock<PathBuf>,
    /// Held open for `exit_on_host_close` sandboxes: when it closes, the agent exits.
    _host_end: Option<UnixStream>,
    /// The egress socket's listener, until the host's proxy takes it.
    egress: Option<UnixListener>,
}

fn hierarchy() -> Result<&'static Hierarchy, CgroupError> {
    static H: OnceLock<Hierarchy> = OnceLock::new();
    if let Some(h) = H.get() {
        return Ok(h);
    }
    let h = Hierarchy::detect()?;
    // Once per process, before the first sandbox is moved into its cgroup.
    crate::cgroup::dynmods::enable();
    Ok(H.get_or_init(|| h))
}

/// Kills and cleans up a half-created sandbox unless defused.
#[derive(Debug)]
struct Cleanup {
    armed: bool,
    dir: PathBuf,
    pid: Option<i32>,
    cgroup: Option<Cgroup>,
    stage: Option<PathBuf>,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        if let Some(pid) = self.pid {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
            let _ = nix::sys::wait::waitpid(nix::unistd::Pid::from_raw(pid), None);
        }
        // A cgroup that cannot be removed (processes that would not die, a
        // host out of file descriptors) keeps the sandbox's directory, so
        // the host's next sweep ([`Jail::remove`]) finds the sandbox and
        // tries again, rather than leaving a cgroup no one knows of.
        let cgroup_gone = match &self.cgroup {
            Some(cg) => cg
                .destroy(Duration::from_secs(2))
                .inspect_err(|e| {
                    tracing::warn!(dir = %self.dir.display(), "a sandbox that failed to start keeps its directory: its cgroup stays ({e})");
                })
                .is_ok(),
            None => true,
        };
        if let Some(stage) = &self.stage {
            let _ = crate::btrfs::remove_tree(stage);
        }
        if cgroup_gone {
            let _ = fs::remove_dir_all(&self.dir);
        }
    }
}

/// A sandbox that is half made: its namespaces, cgroup and agent process
/// exist, and the agent waits for its spec. Preparing is the slow part of
/// creation (clone, id maps, and on cgroup v1 a cgroup migration that waits
/// for an RCU grace period); a pool of standbys takes it off the critical
/// path. Dropping a standby kills it and removes what it had.
#[derive(Debug)]
pub struct Standby {
    id: String,
    /// The writable layer's subvolume (btrfs layer store).
    stage: Option<PathBuf>,
    /// Its qgroup directory, looked up while preparing, off a claim's path.
    qgroup: Option<PathBuf>,
    host_network: bool,
    /// The limits it was prepared with, restored when others are refused.
    prepared_limits: Limits,
    /// The memory, pids and CPU limits its cgroup has now, when known (not
    /// after a write that failed half-way): [`Standby::start`] writes only
    /// limits that differ, so a claim checked by [`Standby::set_limits`]
    /// or made with the prepared limits costs no cgroup write at start.
    cgroup_limits: std::sync::Mutex<Option<CgroupLimits>>,
    /// Fixed by the prepare phase, needed by the start phase.
    cgroup_parent: String,
    /// Root of the sandbox on the host (owner of its egress directory).
    root_id: u32,
    /// A spec was sent ahead ([`Standby::build_ahead`]).
    built_ahead: bool,
    pidfd: OwnedFd,
    host_end: UnixStream,
    cleanup: Cleanup,
}

/// The limits a sandbox's cgroup enforces (the disk limit is its layer's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct CgroupLimits {
    memory_bytes: u64,
    pids: u64,
    cpu_millis: u64,
}

impl CgroupLimits {
    fn of(l: &Limits) -> Self {
        Self {
            memory_bytes: l.memory_bytes,
            pids: l.pids,
            cpu_millis: l.cpu_millis,
        }
    }
}

impl Jail {
    /// Creates a sandbox and waits until its agent is ready.
    pub fn spawn(prepare: &PrepareConfig, start: &StartConfig) -> Result<Jail, SpawnError> {
        Standby::prepare(prepare)?.start(start)
    }
}

impl Standby {
    /// Does everything that does not depend on the sandbox's spec.
    pub fn prepare(cfg: &PrepareConfig) -> Result<Standby, SpawnError> {
        check_id(&cfg.id)?;
        if !nix::unistd::geteuid().is_root() {
            return Err(SpawnError::NotRoot);
        }
        let hierarchy = hierarchy()?;
        let t0 = std::time::Instant::now();
        let agent =
            File::open(&cfg.agent).map_err(|_| SpawnError::AgentMissing(cfg.agent.clone()))?;

        fs::create_dir_all(&cfg.state_dir).map_err(io_err(&cfg.state_dir))?;
        fs::set_permissions(&cfg.state_dir, fs::Permissions::from_mode(0o711))
            .map_err(io_err(&cfg.state_dir))?;
        let dir = cfg.state_dir.join(&cfg.id);
        fs::create_dir(&dir).map_err(io_err(&dir))?;
        let mut cleanup = Cleanup {
            armed: true,
            dir: dir.clone(),
            pid: None,
            cgroup: None,
            stage: None,
        };
        let staging = dir.join("rootfs");
        fs::create_dir(&staging).map_err(io_err(&staging))?;
        // Root inside (the agent) must reach the staging directory during setup.
        let root = Some(nix::unistd::Uid::from_raw(cfg.id_map.host_base));
        let root_gid = Some(nix::unistd::Gid::from_raw(cfg.id_map.host_base));
        let mut owned = vec![dir.clone(), staging.clone()];
        if let Some(store) = &cfg.stage_store {
            let stage = store.join(&cfg.id);
            crate::btrfs::create_subvolume(&stage)?;
            cleanup.stage = Some(stage.clone());
            // Capped now at the prepared limit: a start with the same
            // `disk_bytes` (the default) sets nothing.
            crate::btrfs::limit(&stage, cfg.limits.disk_bytes.max(1 << 20))?;
            owned.push(stage);
        }
        for d in &owned {
            nix::unistd::chown(d.as_path(), root, root_gid).map_err(|e| io_err(d)(e.into()))?;
            fs::set_permissions(d, fs::Permissions::from_mode(0o700)).map_err(io_err(d))?;
        }

        let sock_path = dir.join("agent.sock");
        let listener = crate::socket::bind(&sock_path).map_err(io_err(&sock_path))?;
        let log_path = dir.join("agent.log");
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .mode(0o600)
            .open(&log_path)
            .map_err(io_err(&log_path))?;
        let devnull = OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/null")
            .map_err(io_err(Path::new("/dev/null")))?;
        let (mut host_end, mut child_end) = UnixStream::pair().map_err(SpawnError::Setup)?;

        cleanup.cgroup = Some(Cgroup::create(
            hierarchy,
            &cfg.cgroup_parent,
            &cfg.id,
            &cfg.limits,
        )?);

        // Everything the child needs is allocated before clone: after it, the
        // child may only make async-signal-safe calls.
        let argv0 = CString::new("runcell-agent").expect("no NUL");
        let argv1 = CString::new("init").expect("no NUL");
        let argv = [argv0.as_ptr(), argv1.as_ptr(), std::ptr::null()];
        let log_env = cfg
            .agent_log
            .as_ref()
            .and_then(|l| CString::new(format!("RUST_LOG={l}")).ok());
        let mut envp: Vec<*const libc::c_char> = log_env.iter().map(|c| c.as_ptr()).collect();
        envp.push(std::ptr::null());
        let empty = CString::new("").expect("no NUL");
        let dir_c = CString::new(dir.as_os_str().as_bytes()).map_err(|_| {
            io_err(&dir)(io::Error::new(
                io::ErrorKind::InvalidInput,
                "the path contains a NUL byte",
            ))
        })?;
        let mut flags = libc::CLONE_NEWUSER
            | libc::CLONE_NEWPID
            | libc::CLONE_NEWNS
            | libc::CLONE_NEWIPC
            | libc::CLONE_NEWUTS;
        if !cfg.host_network {
            flags |= libc::CLONE_NEWNET;
        }
        let attach = Attach {
            map: format!("0 {} {}\n", cfg.id_map.host_base, cfg.id_map.count),
            cgroup: cleanup.cgroup.as_ref(),
            timeout: cfg.setup_timeout,
            log_path: &log_path,
        };
        // A sandbox on the host's network is never forked: the fork
        // server's clones always get a network namespace of their own.
        let server = cfg.fork_server.as_ref().filter(|_| !cfg.host_network);
        let forked = server.and_then(|server| {
            let fds = crate::forkserver::AgentFds {
                setup: child_end.as_raw_fd(),
                listener: listener.as_raw_fd(),
                log: log.as_raw_fd(),
                devnull: devnull.as_raw_fd(),
            };
            server
                .fork(flags, fds, &dir)
                .map_err(
                    |e| tracing::warn!(sandbox = %cfg.id, "starting the agent with an exec: {e}"),
                )
                .ok()
        });
        let pidfd = match forked {
            Some(pid) => {
                // The fork server's child is this process's child
                // (CLONE_PARENT); it holds its own copy of the child's end.
                cleanup.pid = Some(pid);
                drop(child_end);
                attach.run(&mut host_end, &std::sync::atomic::AtomicI32::new(pid))?
            }
            None => {
                // A fork server that was asked and failed may have received
                // the child's end, or even cloned a child with it before it
                // went: the exec'd agent gets a setup socket of its own, and
                // such a child reads the end of the old one and exits.
                if server.is_some() {
                    (host_end, child_end) = UnixStream::pair().map_err(SpawnError::Setup)?;
                }
                let child = ChildStart {
                    fds: ChildFds {
                        dir: dir_c.as_ptr(),
                        setup: child_end.as_raw_fd(),
                        listener: listener.as_raw_fd(),
                        log: log.as_raw_fd(),
                        devnull: devnull.as_raw_fd(),
                        agent: agent.as_raw_fd(),
                    },
                    argv: argv.as_ptr(),
                    envp: envp.as_ptr(),
                    empty: empty.as_ptr(),
                };
                let (cloned, attached) =
                    exec_agent(flags, child, &attach, &mut host_end, child_end)?;
                let pid = cloned.map_err(SpawnError::Clone)?;
                cleanup.pid = Some(pid);
                attached?
            }
        };
        drop(listener);
        drop(log);
        drop(devnull);
        drop(agent);
        drop(staging);
        tracing::debug!(
            sandbox = %cfg.id,
            us = crate::sys::micros(t0.elapsed()),
            "sandbox prepared"
        );
        let stage = cleanup.stage.clone();
        Ok(Standby {
            qgroup: stage.as_deref().and_then(crate::btrfs::qgroup_dir),
            stage,
            id: cfg.id.clone(),
            host_network: cfg.host_network,
            prepared_limits: cfg.limits,
            cgroup_limits: std::sync::Mutex::new(Some(CgroupLimits::of(&cfg.limits))),
            cgroup_parent: cfg.cgroup_parent.clone(),
            root_id: cfg.id_map.host_base,
            built_ahead: false,
            pidfd,
            host_end,
            cleanup,
        })
    }

    /// The id the sandbox will have.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// Applies `limits` to the standby's cgroup ahead of [`Standby::start`],
    /// so that limits the kernel refuses fail before the standby is used up
    /// (see [`Standby::reset_limits`]).
    pub fn set_limits(&self, limits: &Limits) -> Result<(), SpawnError> {
        let Some(cg) = &self.cleanup.cgroup else {
            return Ok(());
        };
        let mut known = self
            .cgroup_limits
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let want = CgroupLimits::of(limits);
        if *known == Some(want) {
            return Ok(());
        }
        *known = None;
        cg.set_limits(limits)?;
        *known = Some(want);
        Ok(())
    }

    /// Puts back the limits the standby was prepared with (after
    /// [`Standby::set_limits`] failed half-way), so it can serve another claim.
    pub fn reset_limits(&self) -> Result<(), SpawnError> {
        self.set_limits(&self.prepared_limits)
    }

    /// Whether the standby's agent is still waiting for its spec.
    pub fn is_alive(&self) -> bool {
        !sys::pidfd_wait_exit(self.pidfd.as_raw_fd(), 0).unwrap_or(true)
    }

    /// Sends `cfg`'s spec ahead of a claim, marked [`InitSpec::ahead`]: the
    /// agent lays out that root filesystem now, off the claim's path, and
    /// a [`Standby::start`] that asks for the same root only enters it
    /// (one whose root differs gets its own, built then, as without this).
    /// Returns at once: the agent reports nothing for it, and a failure
    /// there shows only as the claim's start building its root itself.
    /// Once per standby; the deadline and host tie are the claim's.
    pub fn build_ahead(&mut self, cfg: &StartConfig) -> Result<(), SpawnError> {
        if self.built_ahead {
            return Ok(());
        }
        let egress = self.egress_dir(cfg)?;
        let enabled = egress.as_ref().is_some_and(|(_, on)| *on);
        let socket = egress.map(|(dir, _)| dir.join(EGRESS_SOCKET_NAME));
        let mut spec = self.init_spec(cfg, socket, enabled);
        spec.ahead = true;
        spec.deadline_unix_ms = None;
        spec.exit_on_host_close = false;
        send_spec(&mut self.host_end, &spec)?;
        self.built_ahead = true;
        Ok(())
    }

    /// The egress directory `cfg` asks for, made (owned by root of the
    /// sandbox, 0700), and whether egress starts enabled.
    fn egress_dir(&self, cfg: &StartConfig) -> Result<Option<(PathBuf, bool)>, SpawnError> {
        // The host's network namespace has no use for the proxy.
        let enabled = match cfg.egress {
            EgressSocket::Socket { enabled } if !self.host_network => enabled,
            _ => return Ok(None),
        };
        let sockets = self.cleanup.dir.join(EGRESS_DIR);
        fs::create_dir_all(&sockets).map_err(io_err(&sockets))?;
        // Only root of the sandbox (the agent) may enter it, not the
        // sandbox user.
        let root = nix::unistd::Uid::from_raw(self.root_id);
        let root_gid = nix::unistd::Gid::from_raw(self.root_id);
        nix::unistd::chown(sockets.as_path(), Some(root), Some(root_gid))
            .map_err(|e| io_err(&sockets)(e.into()))?;
        fs::set_permissions(&sockets, fs::Permissions::from_mode(0o700))
            .map_err(io_err(&sockets))?;
        Ok(Some((sockets, enabled)))
    }

    /// The agent's spec for `cfg`.
    fn init_spec(
        &self,
        cfg: &StartConfig,
        egress_socket: Option<PathBuf>,
        egress_enabled: bool,
    ) -> InitSpec {
        let dir = &self.cleanup.dir;
        InitSpec {
            sandbox_id: self.id.clone(),
            hostname: format!("runcell-{}", &self.id[..self.id.len().min(8)]),
            staging_dir: self.stage.clone().unwrap_or_else(|| dir.join("rootfs")),
            rootfs: cfg.rootfs.clone(),
            disk_bytes: cfg.limits.disk_bytes,
            user: cfg.user.clone(),
            exit_on_host_close: cfg.exit_on_host_close,
            deadline_unix_ms: cfg.deadline_unix_ms,
            host_network: self.host_network,
            env: cfg.env.clone(),
            workdir: cfg.workdir.clone(),
            egress_socket,
            egress_enabled,
            state_layers: cfg.state_layers.clone(),
            mounts: cfg.mounts.clone(),
            ahead: false,
        }
    }

    /// Sends the spec and waits until the sandbox is ready.
    pub fn start(mut self, cfg: &StartConfig) -> Result<Jail, SpawnError> {
        let t0 = std::time::Instant::now();
        let dir = self.cleanup.dir.clone();
        let pid = self.cleanup.pid.expect("prepared");
        self.set_limits(&cfg.limits)?;
        if let Some(stage) = &self.stage {
            if cfg.limits.disk_bytes != self.prepared_limits.disk_bytes {
                crate::btrfs::limit(stage, cfg.limits.disk_bytes.max(1 << 20))?;
            }
        }
        let egress = match self.egress_dir(cfg)? {
            Some((sockets, enabled)) => Some((bind_egress(&sockets)?, enabled)),
            None => None,
        };
        let spec = self.init_spec(
            cfg,
            egress.as_ref().map(|((_, path), _)| path.clone()),
            egress.as_ref().is_some_and(|(_, on)| *on),
        );
        send_spec(&mut self.host_end, &spec)?;
        let state = StateFile {
            id: self.id.clone(),
            pid,
            start_time: start_time(pid).unwrap_or(0),
            cgroup_parent: self.cgroup_parent.clone(),
            stage: self.stage.clone(),
        };
        // Written while the agent finishes its root, off the create's path
        // (nothing in it depends on the answer, and a start that fails
        // removes the directory with it). Whole or not at all (a temporary
        // file renamed over): other
        // processes sweeping the same state directory read it to tell a
        // live sandbox from a dead one, and a half-written file looked dead.
        let state_path = dir.join("jail.json");
        let tmp_path = dir.join("jail.json.tmp");
        fs::write(
            &tmp_path,
            serde_json::to_vec(&state).expect("state serializes"),
        )
        .map_err(io_err(&tmp_path))?;
        fs::rename(&tmp_path, &state_path).map_err(io_err(&state_path))?;
        let host_end = &mut self.host_end;
        host_end
            .set_read_timeout(Some(cfg.ready_timeout))
            .map_err(SpawnError::Setup)?;
        read_status(host_end, cfg.ready_timeout, &dir.join("agent.log")).map_err(|e| match e {
            SpawnError::ReadyTimeout(t, log) => {
                SpawnError::ReadyTimeout(t, format!("{log} [agent {}]", agent_state(pid)))
            }
            other => other,
        })?;
        host_end.set_read_timeout(None).map_err(SpawnError::Setup)?;
        tracing::debug!(
            sandbox = %self.id,
            setup_us = crate::sys::micros(t0.elapsed()),
            "sandbox started"
        );

        let cgroup = self.cleanup.cgroup.take().expect("created in prepare");
        self.cleanup.armed = false;
        Ok(Jail {
            id: self.id,
            dir,
            pid,
            pidfd: self.pidfd,
            cgroup,
            stage: self.stage,
            qgroup: self.qgroup.map(OnceLock::from).unwrap_or_default(),
            _host_end: cfg.exit_on_host_close.then_some(self.host_end),
            egress: egress.map(|((l, _), _)| l),
        })
    }
}

/// Sends the agent a spec: its length (4 bytes, big-endian), then JSON.
fn send_spec(host_end: &mut UnixStream, spec: &InitSpec) -> Result<(), SpawnError> {
    let spec = serde_json::to_vec(spec).expect("spec serializes");
    let mut msg = Vec::with_capacity(4 + spec.len());
    let len = u32::try_from(spec.len())
        .map_err(|_| SpawnError::Setup(io::Error::other("the sandbox spec is over 4 GiB")))?;
    msg.extend_from_slice(&len.to_be_bytes());
    msg.extend_from_slice(&spec);
    host_end.write_all(&msg).map_err(SpawnError::Setup)
}

impl Jail {
    /// Finds a running sandbox again (after a restart of the host process).
    pub fn attach(state_dir: &Path, id: &str) -> Result<Jail, SpawnError> {
        check_id(id)?;
        let dir = state_dir.join(id);
        let raw = fs::read(dir.join("jail.json")).map_err(|_| SpawnError::NotRunning(id.into()))?;
        let state: StateFile =
            serde_json::from_slice(&raw).map_err(|e| SpawnError::BadState(id.into(), e))?;
        if start_time(state.pid) != Some(state.start_time) || !running(state.pid) {
            // Reap it if it is our zombie child.
            sys::reap(state.pid);
            return Err(SpawnError::NotRunning(id.into()));
        }
        let pidfd = sys::pidfd_open(state.pid).map_err(|_| SpawnError::NotRunning(id.into()))?;
        // The pid could have been reused between the check and the open.
        if start_time(state.pid) != Some(state.start_time) {
            return Err(SpawnError::NotRunning(id.into()));
        }
        let cgroup = Cgroup::open(hierarchy()?, &state.cgroup_parent, id);
        Ok(Jail {
            id: id.into(),
            dir,
            pid: state.pid,
            pidfd,
            cgroup,
            stage: state.stage,
            qgroup: OnceLock::new(),
            _host_end: None,
            egress: None,
        })
    }

    /// Binds the egress socket again (after a restart: the old one died
    /// with the process that listened on it) in the sandbox's egress
    /// directory, which the sandbox sees through a bind mount, so its agent
    /// reaches the new socket. `None`: the sandbox was made without egress
    /// (or by a version that mounted the socket file itself).
    pub fn rebind_egress(&mut self) -> Result<Option<UnixListener>, SpawnError> {
        let sockets = self.dir.join(EGRESS_DIR);
        if !sockets.is_dir() {
            return Ok(None);
        }
        let (listener, _) = bind_egress(&sockets)?;
        Ok(Some(listener))
    }

    /// Whether the sandbox `id` is dead and its leftovers may be removed: its
    /// agent is gone, or it never finished starting and is older than
    /// `grace` (so a sandbox that another process is creating right now is
    /// left alone).
    pub fn is_dead(state_dir: &Path, id: &str, grace: Duration) -> bool {
        if check_id(id).is_err() {
            return false;
        }
        let dir = state_dir.join(id);
        if dir.join("jail.json").exists() {
            match Jail::attach(state_dir, id) {
                Ok(_) => return false,
                Err(SpawnError::NotRunning(_)) => return true,
                // Unreadable: judge it by its age like a half-made one.
                Err(_) => {}
            }
        }
        let age = fs::metadata(&dir)
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| t.elapsed().ok());
        age.is_some_and(|a| a > grace)
    }

    /// Removes what is left of a sandbox that is not running (its cgroup,
    /// directory and, with a btrfs layer store, its stage
    /// `<stage_store>/<id>`), or destroys it if it still is.
    pub fn remove(
        state_dir: &Path,
        cgroup_parent: &str,
        id: &str,
        stage_store: Option<&Path>,
    ) -> Result<(), SpawnError> {
        check_id(id)?;
        if let Ok(jail) = Jail::attach(state_dir, id) {
            return jail.destroy();
        }
        let dir = state_dir.join(id);
        // A child left behind by a killed host process is found by its
        // working directory (the sandbox's directory until the agent enters
        // the sandbox's root) as well as by its cgroup.
        kill_processes_in_dir(&dir);
        let cg = Cgroup::open(hierarchy()?, cgroup_parent, id);
        if cg.exists() {
            cg.destroy(Duration::from_secs(2))?;
        }
        if let Some(store) = stage_store {
            crate::btrfs::remove_tree(&store.join(id)).map_err(io_err(&store.join(id)))?;
        }
        match fs::remove_dir_all(&dir) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => Err(io_err(&dir)(e)),
            _ => Ok(()),
        }
    }

    /// Sends SIGKILL to the agent, PID 1 of the sandbox's pid namespace: the
    /// kernel then kills every process in it. Returns at once; [`Jail::destroy`]
    /// waits for the teardown and removes what is left.
    pub fn kill(&self) {
        let _ = sys::pidfd_send_signal(self.pidfd.as_raw_fd(), libc::SIGKILL);
        self.thaw_if_frozen();
    }

    /// A frozen process dies of SIGKILL only once thawed.
    fn thaw_if_frozen(&self) {
        if self.cgroup.is_frozen() {
            if let Err(e) = self.cgroup.thaw() {
                tracing::warn!(sandbox = %self.id, "could not thaw a paused sandbox: {e}");
            }
        }
    }

    /// Freezes every process of the sandbox (cgroup freezer): they keep
    /// their memory and run again on [`Jail::thaw`].
    pub fn freeze(&self) -> Result<(), SpawnError> {
        Ok(self.cgroup.freeze()?)
    }

    /// Thaws a frozen sandbox.
    pub fn thaw(&self) -> Result<(), SpawnError> {
        Ok(self.cgroup.thaw()?)
    }

    /// Whether the sandbox is frozen.
    pub fn is_frozen(&self) -> bool {
        self.cgroup.is_frozen()
    }

    /// Copies what the sandbox wrote (its writable layer) into `dest`, a
    /// new directory, as a state layer ([`InitSpec::state_layers`]):
    /// `root/` holds what was written to the root and, for the `host`
    /// template, `upper/<key>/` what was written over each host path. The
    /// sandbox must be frozen, so the copy is one instant of it. Returns
    /// the bytes copied.
    ///
    /// With a btrfs layer store the layer is a read-only snapshot of the
    /// stage's subvolume instead (`dest` must be on the store's file
    /// system): O(1) whatever the stage holds. It then holds the stage as
    /// it is (`upper/root/` where the root is an overlay, `root/` where it
    /// is the stage's own directory), which
    /// [`crate::inside::state_root`] reads; the bytes returned are what the
    /// stage references.
    pub fn export_layer(&self, dest: &Path) -> Result<u64, SpawnError> {
        match &self.stage {
            Some(stage) => {
                if !self.is_alive() {
                    return Err(SpawnError::NotRunning(self.id.clone()));
                }
                crate::btrfs::snapshot(stage, dest, true)?;
                Ok(self
                    .qgroup()
                    .and_then(crate::btrfs::referenced_bytes)
                    .unwrap_or(0))
            }
            None => crate::layer::export(self.pid, dest).map_err(SpawnError::Export),
        }
    }

    /// The writable layer's subvolume, with a btrfs layer store.
    pub fn stage(&self) -> Option<&Path> {
        self.stage.as_deref()
    }

    /// Whether the writable layer is at its size limit, where the agent
    /// cannot tell (a btrfs stage: its `statvfs` shows the whole store,
    /// and no count of files); `None` for a tmpfs.
    pub fn layer_full(&self) -> Option<bool> {
        let stage = self.stage.as_deref()?;
        Some(
            self.qgroup()
                .and_then(|q| crate::btrfs::at_limit(stage, q))
                .unwrap_or(false),
        )
    }

    /// The stage's qgroup directory (btrfs layer store), looked up until
    /// a lookup works, then kept.
    fn qgroup(&self) -> Option<&Path> {
        if let Some(q) = self.qgroup.get() {
            return Some(q);
        }
        let q = crate::btrfs::qgroup_dir(self.stage.as_deref()?)?;
        Some(self.qgroup.get_or_init(|| q))
    }

    /// The sandbox id.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// Host pid of the agent (PID 1 inside).
    pub fn pid(&self) -> i32 {
        self.pid
    }

    /// The sandbox's host directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The agent's socket.
    pub fn socket_path(&self) -> PathBuf {
        self.dir.join("agent.sock")
    }

    /// The listener of the sandbox's egress socket, for the host's proxy
    /// (once; `None` without one, and for re-attached sandboxes).
    pub fn take_egress_listener(&mut self) -> Option<UnixListener> {
        self.egress.take()
    }

    /// Cgroup counters (OOM kills, pids-limit hits, memory, CPU).
    pub fn counters(&self) -> Counters {
        self.cgroup.counters()
    }

    /// Its cgroup's kill counters only.
    pub fn kills(&self) -> crate::cgroup::Kills {
        self.cgroup.kills()
    }

    /// Whether the agent is still running.
    pub fn is_alive(&self) -> bool {
        !sys::pidfd_wait_exit(self.pidfd.as_raw_fd(), 0).unwrap_or(true)
    }

    /// Kills every process in the sandbox and removes its cgroup and directory.
    pub fn destroy(self) -> Result<(), SpawnError> {
        let t0 = std::time::Instant::now();
        let _ = sys::pidfd_send_signal(self.pidfd.as_raw_fd(), libc::SIGKILL);
        self.thaw_if_frozen();
        // Init of a pid namespace exits only after every process in it is gone.
        let _ = sys::pidfd_wait_exit(self.pidfd.as_raw_fd(), 5000);
        sys::reap(self.pid);
        let t_kill = t0.elapsed();
        self.cgroup.destroy(Duration::from_secs(5))?;
        if let Some(stage) = &self.stage {
            crate::btrfs::remove_tree(stage).map_err(io_err(stage))?;
        }
        tracing::debug!(
            sandbox = %self.id,
            kill_us = crate::sys::micros(t_kill),
            cgroup_us = crate::sys::micros(t0.elapsed() - t_kill),
            "sandbox destroyed"
        );
        match fs::remove_dir_all(&self.dir) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => Err(io_err(&self.dir)(e)),
            _ => Ok(()),
        }
    }
}

/// SIGKILLs every process whose working directory is `dir` (or below) and
/// waits briefly for them to go.
fn kill_processes_in_dir(dir: &Path) {
    let until = std::time::Instant::now() + Duration::from_secs(2);
    loop {
        let pids = sys::processes_in_dir(dir);
        if pids.is_empty() || std::time::Instant::now() >= until {
            return;
        }
        for pid in pids {
            tracing::info!(pid, dir = %dir.display(), "killing a process left behind in a sandbox directory");
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
            sys::reap(pid);
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Ids of the sandboxes that have a directory under `state_dir`.
pub fn list_sandboxes(state_dir: &Path) -> Vec<String> {
    let mut ids: Vec<String> = fs::read_dir(state_dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .collect();
    ids.sort();
    ids
}

fn read_status(sock: &mut UnixStream, timeout: Duration, log: &Path) -> Result<(), SpawnError> {
    let map_read = |e: io::Error| match e.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => {
            SpawnError::ReadyTimeout(timeout, log_tail(log))
        }
        io::ErrorKind::UnexpectedEof => SpawnError::AgentDied(log_tail(log)),
        _ => SpawnError::Setup(e),
    };
    match read_setup_answer(sock).map_err(map_read)? {
        SetupAnswer::Ready => Ok(()),
        SetupAnswer::ExecFailed(errno) => {
            Err(SpawnError::AgentExec(io::Error::from_raw_os_error(errno)))
        }
        SetupAnswer::Failed(msg) => Err(SpawnError::SetupFailed(msg)),
    }
}

/// What a starting agent answered its host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SetupAnswer {
    /// `R`: ready.
    Ready,
    /// `X` and an errno: the agent could not be executed.
    ExecFailed(i32),
    /// `E`, a big-endian length and a sentence (or an unknown status byte).
    Failed(String),
}

/// Reads a starting agent's answer (the framing of
/// [`crate::inside::report_error`]); every backend's host side uses it.
pub fn read_setup_answer(sock: &mut impl Read) -> io::Result<SetupAnswer> {
    let mut tag = [0u8; 1];
    sock.read_exact(&mut tag)?;
    Ok(match tag[0] {
        b'R' => SetupAnswer::Ready,
        b'X' => {
            let mut errno = [0u8; 4];
            sock.read_exact(&mut errno)?;
            SetupAnswer::ExecFailed(i32::from_ne_bytes(errno))
        }
        b'E' => {
            let mut len = [0u8; 4];
            sock.read_exact(&mut len)?;
            let len = usize::try_from(u32::from_be_bytes(len)).unwrap_or(usize::MAX);
            let mut msg = vec![0u8; len.min(64 << 10)];
            sock.read_exact(&mut msg)?;
            SetupAnswer::Failed(String::from_utf8_lossy(&msg).into_owned())
        }
        other => SetupAnswer::Failed(format!("unexpected setup status byte {other:#x}")),
    })
}

/// The last lines of an agent's log, for error messages.
pub fn log_tail(log: &Path) -> String {
    let text = fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    let tail = lines[lines.len().saturating_sub(5)..].join(" | ");
    if tail.is_empty() {
        "(empty)".into()
    } else {
        tail
    }
}

/// A one-line description of where a process is (for timeout diagnostics).
fn agent_state(pid: i32) -> String {
    let read = |f: &str| {
        fs::read_to_string(format!("/proc/{pid}/{f}"))
            .map(|s| s.trim().to_string())
            .unwrap_or_else(|_| "?".into())
    };
    let stat = read("stat");
    let state = stat
        .rfind(')')
        .and_then(|i| stat.get(i + 2..i + 3))
        .unwrap_or("gone")
        .to_string();
    format!(
        "state {state}, wchan {}, syscall {}",
        read("wchan"),
        read("syscall")
    )
}

/// Whether a process exists and is not a zombie.
fn running(pid: i32) -> bool {
    fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            s.rfind(')')
                .map(|i| s[i + 2..].starts_with(|c| c != 'Z' && c != 'X'))
        })
        .unwrap_or(false)
}

/// Start time of a process in clock ticks since boot (field 22 of /proc/pid/stat).
fn start_time(pid: i32) -> Option<u64> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after_comm = &stat[stat.rfind(')')? + 2..];
    after_comm.split(' ').nth(19)?.parse().ok()
}

struct ChildFds {
    /// The sandbox's host directory (NUL-terminated), entered at once.
    dir: *const libc::c_char,
    setup: RawFd,
    listener: RawFd,
    log: RawFd,
    devnull: RawFd,
    agent: RawFd,
}

/// What the cloned child needs, built before the clone (it may not
/// allocate): its fds and the agent's arguments and environment
/// (NUL-terminated arrays of C strings) and the empty path of `execveat`.
struct ChildStart {
    fds: ChildFds,
    argv: *const *const libc::c_char,
    envp: *const *const libc::c_char,
    empty: *const libc::c_char,
}

/// The host's half of preparing a sandbox while the cloned child waits
/// (the cloning thread is suspended until the child execs, so another
/// thread runs it).
struct Attach<'a> {
    /// The uid and gid map line.
    map: String,
    cgroup: Option<&'a Cgroup>,
    /// How long the child may take to answer.
    timeout: Duration,
    /// The agent's log, whose tail says why a child died.
    log_path: &'a Path,
}

impl Attach<'_> {
    /// Waits for the child to say it runs, writes its id maps, moves it
    /// into the cgroup, lets it go and waits for its acknowledgement; gives
    /// its pidfd. `tid` holds the child's pid once it runs. On any failure
    /// it shuts the setup socket down, so a child still waiting reads the
    /// end of the stream and exits, and the cloning thread resumes.
    fn run(
        &self,
        host_end: &mut UnixStream,
        tid: &std::sync::atomic::AtomicI32,
    ) -> Result<OwnedFd, SpawnError> {
        let r = self.steps(host_end, tid);
        if r.is_err() {
            let _ = host_end.shutdown(std::net::Shutdown::Both);
        }
        r
    }

    fn steps(
        &self,
        host_end: &mut UnixStream,
        tid: &std::sync::atomic::AtomicI32,
    ) -> Result<OwnedFd, SpawnError> {
        host_end
            .set_read_timeout(Some(self.timeout))
            .map_err(SpawnError::Setup)?;
        self.expect(host_end, b'C')?;
        // Stored by the kernel before the child ran, so before its byte.
        let pid = tid.load(std::sync::atomic::Ordering::SeqCst);
        let pidfd = sys::pidfd_open(pid).map_err(SpawnError::Setup)?;
        for file in ["uid_map", "gid_map"] {
            let path = PathBuf::from(format!("/proc/{pid}/{file}"));
            fs::write(&path, &self.map).map_err(io_err(&path))?;
        }
        if let Some(cg) = self.cgroup {
            cg.add_process(pid)?;
        }
        // Let the child exec the agent, which then waits for its spec. The
        // child first acknowledges that it dropped its parent-death signal.
        host_end.write_all(b"G").map_err(SpawnError::Setup)?;
        self.expect(host_end, b'A')?;
        host_end.set_read_timeout(None).map_err(SpawnError::Setup)?;
        Ok(pidfd)
    }

    /// Reads one byte from the child: `want`, or the error that says why not.
    fn expect(&self, host_end: &mut UnixStream, want: u8) -> Result<(), SpawnError> {
        let mut got = [0u8; 1];
        match host_end.read_exact(&mut got) {
            Ok(()) if got[0] == want => Ok(()),
            Ok(()) => Err(SpawnError::SetupFailed(format!(
                "unexpected byte {:#x} from the sandbox's first process, expected {:?}",
                got[0], want as char
            ))),
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => {
                Err(SpawnError::AgentDied(log_tail(self.log_path)))
            }
            Err(e) => Err(SpawnError::Setup(e)),
        }
    }
}

/// Clones the sandbox's first process sharing this process's memory
/// ([`sys::clone_vfork`]) to exec the agent (`child`), while a helper
/// thread gives it its id maps and cgroup (`attach`). Gives the clone's
/// result (the pid) and the attach's (the pidfd).
fn exec_agent(
    flags: libc::c_int,
    mut child: ChildStart,
    attach: &Attach<'_>,
    host_end: &mut UnixStream,
    child_end: UnixStream,
) -> Result<(io::Result<i32>, Result<OwnedFd, SpawnError>), SpawnError> {
    let mut stack = Box::new([0u8; sys::VFORK_STACK]);
    let tid = std::sync::atomic::AtomicI32::new(0);
    // The child shares this process's memory and the cloning thread is
    // suspended until it execs (`clone_vfork`), but it must wait for its
    // id maps and cgroup first: another thread gives it those.
    std::thread::scope(|scope| {
        let helper = std::thread::Builder::new()
            .name("runcell-attach".into())
            .spawn_scoped(scope, || attach.run(host_end, &tid))
            .map_err(SpawnError::Setup)?;
        // SAFETY: `child_start` runs only `child_exec`, which makes raw,
        // async-signal-safe syscalls on data built before the clone
        // (`child`, the argument and environment arrays, the C strings),
        // all alive in the caller's frame while this thread is suspended,
        // writes none of it, and ends in execveat or _exit.
        let cloned = unsafe {
            sys::clone_vfork(
                flags,
                child_start,
                std::ptr::addr_of_mut!(child).cast(),
                &mut stack,
                &tid,
            )
        };
        // The helper waits for the child's first byte: if the clone
        // failed or the child died before it, closing our copy of the
        // child's end makes that wait end.
        drop(child_end);
        let attached = match helper.join() {
            Ok(r) => r,
            Err(panic) => std::panic::resume_unwind(panic),
        };
        Ok((cloned, attached))
    })
}

/// The entry point of the child of [`sys::clone_vfork`]: `arg` is the
/// prepare's [`ChildStart`].
extern "C" fn child_start(arg: *mut libc::c_void) -> libc::c_int {
    // SAFETY: `arg` points to the ChildStart in `Standby::prepare`'s frame,
    // which lives, unchanged, while the cloning thread is suspended (until
    // this child execs or exits); child_exec only reads it.
    unsafe {
        let start = &*arg.cast::<ChildStart>();
        child_exec(&start.fds, start.argv, start.envp, start.empty)
    }
}

/// The child's side of clone: say it runs, wait for the go-ahead, become
/// root of the new user namespace, arrange fds 0-4 and exec the agent.
///
/// # Safety
///
/// Must only be called in the child of [`sys::clone_vfork`] (see its
/// contract). Uses only raw, async-signal-safe syscalls on data built before
/// the clone, writes no memory but its own stack, and never returns.
unsafe fn child_exec(
    fds: &ChildFds,
    argv: *const *const libc::c_char,
    envp: *const *const libc::c_char,
    empty: *const libc::c_char,
) -> ! {
    // SAFETY: every call below is a raw syscall wrapper on valid fds and on
    // pointers to memory that was allocated before the clone and stays alive
    // (the child never frees it); none of them allocates or takes a lock.
    unsafe {
        // First, before anything can block: keep only the fds the agent
        // needs. The child inherited every fd of the host process: its
        // listening sockets, and the host ends of the setup sockets of this
        // and of other sandboxes being prepared. Holding those while it waits
        // would keep a killed host's port bound and hide the host's death
        // (no end of stream on the setup socket) forever.
        let mut keep = [fds.setup, fds.listener, fds.log, fds.devnull, fds.agent];
        sys::close_all_except(&mut keep);
        // While it is being prepared the child must die with the host. The
        // signal fires when the *thread* that cloned us exits, so it is
        // cleared once the host said go (below); a started sandbox
        // outlives the host by design. Should the host already be gone, the
        // read of the go-ahead sees the end of the setup socket.
        libc::prctl(
            libc::PR_SET_PDEATHSIG,
            libc::SIGKILL as libc::c_ulong,
            0,
            0,
            0,
        );
        // Move the fds we keep above 10 first so the dup2s below cannot clobber them.
        let high = |fd: RawFd| libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 10);
        let (setup, listener, log, devnull) = (
            high(fds.setup),
            high(fds.listener),
            high(fds.log),
            high(fds.devnull),
        );
        // Say it runs (the host then writes its id maps), and wait for the
        // go-ahead. SIGPIPE is blocked: a host that gave up makes the write
        // fail and the read see the end of the stream.
        let running = b'C';
        let mut go = 0u8;
        if setup < 0
            || libc::write(setup, (&running as *const u8).cast(), 1) != 1
            || libc::read(setup, (&mut go as *mut u8).cast(), 1) != 1
            || go != b'G'
        {
            libc::_exit(126);
        }
        libc::prctl(libc::PR_SET_PDEATHSIG, 0, 0, 0, 0);
        let ack = b'A';
        if libc::write(setup, (&ack as *const u8).cast(), 1) != 1 {
            libc::_exit(126);
        }
        // The uid/gid maps are written now: become root of the user namespace
        // so that exec keeps the namespace's capabilities. Raw syscalls: the
        // libc wrappers would try to change the credentials of every thread
        // the parent had (which do not exist here) and wait forever.
        if libc::syscall(libc::SYS_setgroups, 0, std::ptr::null::<libc::gid_t>()) != 0
            || libc::syscall(libc::SYS_setresgid, 0, 0, 0) != 0
            || libc::syscall(libc::SYS_setresuid, 0, 0, 0) != 0
        {
            report_errno_and_exit(setup);
        }
        // Live in the sandbox's directory (reachable now that we are its
        // owner), so that a restarted host finds a child its predecessor
        // left behind by its working directory too, not only by its cgroup.
        if libc::chdir(fds.dir) != 0 {
            report_errno_and_exit(setup);
        }
        // Every signal stays blocked until the agent runs (clone_vfork: no
        // handler of the host may run on the memory this child shares with
        // it); the agent unblocks them first thing (inside::bootstrap).
        // Ignored signals survive exec: a daemon started with `cmd &` from a
        // script ignores SIGINT, and the sandbox must not inherit that.
        crate::inside::reset_signal_dispositions();
        if libc::dup2(devnull, 0) < 0
            || libc::dup2(devnull, 1) < 0
            || libc::dup2(log, 2) < 0
            || libc::dup2(setup, 3) < 0
            || libc::dup2(listener, 4) < 0
        {
            report_errno_and_exit(setup);
        }
        libc::syscall(
            libc::SYS_execveat,
            fds.agent,
            empty,
            argv,
            envp,
            libc::AT_EMPTY_PATH,
        );
        report_errno_and_exit(3);
    }
}

/// # Safety
///
/// Same contract as [`child_exec`].
pub(crate) unsafe fn report_errno_and_exit(fd: RawFd) -> ! {
    // SAFETY: __errno_location returns this thread's errno slot; write and
    // _exit are async-signal-safe.
    unsafe {
        let errno = *libc::__errno_location();
        let mut msg = [b'X', 0, 0, 0, 0];
        msg[1..].copy_from_slice(&errno.to_ne_bytes());
        libc::write(fd, msg.as_ptr().cast(), msg.len());
        libc::_exit(127);
    }
}

/// The directory of a sandbox's egress socket, in its state directory.
const EGRESS_DIR: &str = "egress";

/// Binds `<sockets>/sock` (replacing a dead one), owned by the owner of
/// `sockets` (root of the sandbox), 0600: connecting needs write permission,
/// so only the agent can, not the sandbox user.
/// The egress socket's name in its directory.
const EGRESS_SOCKET_NAME: &str = "sock";

fn bind_egress(sockets: &Path) -> Result<(UnixListener, PathBuf), SpawnError> {
    use std::os::unix::fs::MetadataExt;
    let owner = fs::metadata(sockets).map_err(io_err(sockets))?;
    // As long as the former `<dir>/egress.sock`: socket paths are short.
    let path = sockets.join(EGRESS_SOCKET_NAME);
    let _ = fs::remove_file(&path);
    let listener = crate::socket::bind(&path).map_err(io_err(&path))?;
    nix::unistd::chown(
        path.as_path(),
        Some(nix::unistd::Uid::from_raw(owner.uid())),
        Some(nix::unistd::Gid::from_raw(owner.gid())),
    )
    .map_err(|e| io_err(&path)(e.into()))?;
    fs::set_permissions(&path, fs::Permissions::from_mode(0o600)).map_err(io_err(&path))?;
    Ok((listener, path))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prepare_config(state_dir: &Path, id: &str) -> PrepareConfig {
        PrepareConfig {
            id: id.into(),
            agent: PathBuf::from("/nonexistent/runcell-agent"),
            state_dir: state_dir.into(),
            cgroup_parent: "runcell-test".into(),
            limits: Limits::default(),
            id_map: IdMap::default(),
            setup_timeout: Duration::from_secs(1),
            agent_log: None,
            host_network: false,
            stage_store: None,
            fork_server: None,
        }
    }

    #[test]
    fn ids_are_plain_names() {
        for good in ["0b6f6a52-9a4c-4c43-a6b1-1f1f5d3c9e20", "a", "build_1.x"] {
            assert!(check_id(good).is_ok(), "{good}");
        }
        let long = "a".repeat(65);
        for bad in [
            "",
            ".",
            "..",
            "../x",
            "a/b",
            ".hidden",
            "a b",
            "é",
            long.as_str(),
        ] {
            assert!(
                matches!(check_id(bad), Err(SpawnError::BadId(_))),
                "{bad:?} was accepted"
            );
        }
    }

    #[test]
    fn a_sandbox_with_a_path_for_an_id_is_never_prepared() {
        let tmp = tempfile::tempdir().unwrap();
        let state = tmp.path().join("state");
        let err = Standby::prepare(&prepare_config(&state, "../escaped")).unwrap_err();
        assert!(matches!(err, SpawnError::BadId(_)), "{err}");
        assert!(!tmp.path().join("escaped").exists());
        assert!(!state.exists(), "nothing is made for a refused id");
    }

    /// A sandbox that failed half-way keeps its directory while its cgroup
    /// stays, so the next sweep removes both; then nothing is left.
    #[test]
    fn a_failed_start_whose_cgroup_stays_keeps_its_directory_for_the_sweep() {
        let tmp = tempfile::tempdir().unwrap();
        let state = tmp.path().join("state");
        let id = "half-made";
        let dir = state.join(id);
        fs::create_dir_all(&dir).unwrap();
        let h = hierarchy().expect("cgroups (run as root)");
        let parent = format!("runcell-unit-cleanup-{}", std::process::id());
        let cgroup = Cgroup::create(h, &parent, id, &Limits::default()).unwrap();
        // A child cgroup makes its directory busy, as processes that do not
        // die would.
        let held = cgroup.dirs()[0].join("held");
        fs::create_dir(&held).unwrap();
        drop(Cleanup {
            armed: true,
            dir: dir.clone(),
            pid: None,
            cgroup: Some(cgroup),
            stage: None,
        });
        assert!(dir.exists(), "the directory went while its cgroup stayed");
        assert!(list_sandboxes(&state).contains(&id.to_string()));
        fs::remove_dir(&held).unwrap();
        Jail::remove(&state, &parent, id, None).unwrap();
        assert!(!dir.exists());
        assert!(!Cgroup::open(h, &parent, id).exists(), "the cgroup stayed");
        for d in Cgroup::open(h, &parent, id).dirs() {
            let _ = fs::remove_dir(d.parent().unwrap());
        }
    }

    #[test]
    fn removing_by_a_path_for_an_id_leaves_what_is_outside_alone() {
        let tmp = tempfile::tempdir().unwrap();
        let state = tmp.path().join("state");
        let outside = tmp.path().join("precious");
        fs::create_dir_all(&state).unwrap();
        fs::create_dir_all(&outside).unwrap();
        let err = Jail::remove(&state, "runcell-test", "../precious", None).unwrap_err();
        assert!(matches!(err, SpawnError::BadId(_)), "{err}");
        assert!(outside.exists());
        assert!(!Jail::is_dead(&state, "../precious", Duration::ZERO));
    }
}
