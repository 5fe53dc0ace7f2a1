//! gVisor (`runsc`) as a [`Backend`]: each sandbox is a runsc container
//! whose init is `runcell-agent gvisor-init`, so sandboxed code talks to
//! gVisor's user-space kernel, not to the host's.
//!
//! Per sandbox, `<state>/<id>/` holds:
//!
//! * `rootfs/`: the root filesystem the host composes
//!   ([`runcell_jail::gvisor::compose_rootfs`]): a tmpfs of the disk limit
//!   holding the writable layer over the template's read-only layers,
//!   mounted on the host (privately) until the sandbox is removed; the
//!   container's root is `rootfs/root`, served by runsc's gofer, so a full
//!   writable layer fails with `ENOSPC` as in the jail; its
//!   `volumes/<i>` are the sandbox's volumes, idmapped binds
//!   ([`runcell_jail::idmap_mount`]) that the spec hands runsc as bind
//!   mounts;
//! * `bundle/config.json`: the OCI bundle written at start;
//! * `host/` (0700, bind-mounted at [`HOST_DIR`]): `setup.sock`, bound by
//!   the host, to which the agent connects for its spec, and `agent.sock`,
//!   which the agent binds (gVisor's `--host-uds=all` makes both host
//!   sockets) and the host connects to;
//! * `egress/` (0700, bind-mounted at `/run/runcell/egress`): the egress
//!   socket, as for the jail;
//! * `runsc/`: runsc's own state (`runsc --root`), private to the sandbox
//!   and removed with its directory;
//! * `gvisor.json`: the sandbox process's (the sentry's) pid and start
//!   time, written once it is ready: [`Backend::attach`] finds the sandbox
//!   again by it after a restart; `agent.log`: the container's stdout and
//!   stderr (the agent's log, and runsc's errors).
//!
//! Setting `RUNCELL_RUNSC_DEBUG` to a directory makes runsc write its debug
//! logs and an strace of the sandbox there.
//!
//! Limits: memory and CPU are the cgroup's (`<cgroup_parent>/<id>`, which
//! the backend creates before runsc joins it, so its counters outlive the
//! sandbox). gVisor runs every sandboxed process inside one host process
//! (the sentry), so the host's OOM killer can only kill the whole sandbox
//! when the memory limit is hit: `counters().oom_kills` then counts it and
//! the sandbox is dead. The host's pids controller sees the sentry's
//! threads, not sandboxed processes, and a limit hit there crashes the
//! sentry; the pids limit is therefore enforced inside gVisor, by its own
//! pids cgroup, which the agent mounts and joins before it starts anything
//! (`pids.max` from [`runcell_jail::gvisor::PIDS_ARG`]) and whose count it
//! samples to report hits by name; `RLIMIT_NPROC` is a backstop above it,
//! and the host cgroup only gets a backstop of [`host_pids`]. The cgroup's memory
//! limit is the sandbox's plus [`SENTRY_MEMORY`] for gVisor itself.

use std::fs::{self, OpenOptions};
use std::io::{self, Read, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use runcell_jail::cgroup::{Cgroup, CgroupError, Hierarchy};
use runcell_jail::gvisor::{AGENT_PATH, HOST_DIR};
use runcell_jail::log_tail;

/// Where the preload library (`crates/jail/shim`) is mounted in the sandbox.
const SHIM_PATH: &str = "/run/runcell/gvisor-shim.so";
/// Where the egress directory is mounted in the sandbox.
const EGRESS_DIR_IN_SANDBOX: &str = "/run/runcell/egress";

/// The preload library built next to the agent.
fn shim_path(agent: &Path) -> PathBuf {
    agent.with_file_name("libruncell_gvisor_shim.so")
}

/// `env` with the preload library first in `LD_PRELOAD` (after a
/// template's own, which it keeps): this gVisor refuses `AT_NO_AUTOMOUNT`,
/// which coreutils passes, and the library drops it.
fn with_shim(
    mut env: std::collections::BTreeMap<String, String>,
) -> std::collections::BTreeMap<String, String> {
    let preload = match env.get("LD_PRELOAD") {
        Some(p) if !p.is_empty() => format!("{SHIM_PATH}:{p}"),
        _ => SHIM_PATH.to_string(),
    };
    env.insert("LD_PRELOAD".into(), preload);
    env
}
use runcell_jail::{InitSpec, EGRESS_SOCKET, WAIT_TICK};
use serde::{Deserialize, Serialize};

use super::{
    AgentChannel, Backend, BackendError, Counters, EgressSocket, Instance, Kills, Limits,
    PrepareSpec, Prepared, StartSpec,
};

/// How long the host waits for runsc to start a container and for its
/// agent to connect and report ready.
const SETUP_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a restored sandbox's agent gets to serve again (once `runsc
/// restore` returned; it is ready within milliseconds). Past it the wake
/// falls back to the files (`state_lost`).
const RESTORE_READY_TIMEOUT: Duration = Duration::from_secs(4);
/// When a restored agent that does not serve yet is sent `SIGUSR1` (see
/// [`GvisorPrepared::finish_restore`]).
const RESTORE_NUDGE_AFTER: Duration = Duration::from_millis(500);

/// Memory the cgroup allows on top of the sandbox's limit, for gVisor's
/// sentry and its page tables.
pub const SENTRY_MEMORY: u64 = 64 << 20;

/// Errors of the gVisor backend.
#[derive(Debug, thiserror::Error)]
pub enum GvisorError {
    /// runsc is not installed.
    #[error("gVisor's runsc was not found at {0}; install it (apt install runsc).")]
    RunscMissing(PathBuf),
    /// The agent binary is missing.
    #[error("The sandbox agent binary {0} was not found; build it with `cargo build` or set RUNCELL_AGENT.")]
    AgentMissing(PathBuf),
    /// The preload library is missing.
    #[error("The gVisor preload library {0} was not found next to the agent; build the workspace (`cargo build`), which makes it.")]
    ShimMissing(PathBuf),
    /// Not running as root.
    #[error("runcell needs root to create gVisor sandboxes (it mounts their root filesystems and creates cgroups); run it as root.")]
    NotRoot,
    /// The id is not a plain name.
    #[error("The sandbox id {0:?} is not a plain name (1 to 64 letters, digits, '-', '_' or '.', not starting with '.').")]
    BadId(String),
    /// A runsc command failed.
    #[error("`runsc {command}` failed ({status}): {output}")]
    Runsc {
        /// The subcommand.
        command: String,
        /// How it ended.
        status: String,
        /// The end of what it (and the container) wrote.
        output: String,
    },
    /// A runsc command could not be run at all.
    #[error("Could not run `runsc {command}`.")]
    RunscExec {
        /// The subcommand.
        command: String,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// A file operation in the sandbox's host directory failed.
    #[error("Could not prepare {path} for the sandbox.")]
    Io {
        /// The path involved.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// Building or removing the root filesystem failed.
    #[error("Could not build the sandbox's root filesystem.")]
    Rootfs(#[source] runcell_jail::inside::SetupError),
    /// A volume could not be mounted for the sandbox.
    #[error("Could not mount volume {target} for the sandbox.")]
    Volume {
        /// Where the sandbox would see it.
        target: String,
        /// Why.
        #[source]
        source: runcell_jail::idmap_mount::IdmapMountError,
    },
    /// Cgroup setup or teardown failed.
    #[error(transparent)]
    Cgroup(#[from] CgroupError),
    /// Talking to the starting agent failed.
    #[error("Lost contact with the sandbox while it started.")]
    Setup(#[source] io::Error),
    /// The agent reported a setup failure.
    #[error("The sandbox could not be set up: {0}")]
    SetupFailed(String),
    /// The container exited before its agent was ready.
    #[error("The gVisor sandbox exited while starting. Its log ends with: {0}")]
    AgentDied(String),
    /// The agent did not report within the timeout.
    #[error("The gVisor sandbox did not become ready within {0:?}. Its log ends with: {1}")]
    ReadyTimeout(Duration, String),
    /// No live sandbox with that id.
    #[error("Sandbox {0} is not running.")]
    NotRunning(String),
    /// A checkpoint could not be taken.
    #[error("The gVisor sandbox could not be checkpointed: {0}")]
    Checkpoint(String),
    /// Copying the sandbox's writable layer failed.
    #[error("Could not save the sandbox's files.")]
    Export(#[source] runcell_jail::layer::LayerError),
    /// The sandbox's state file is unreadable.
    #[error("The state of sandbox {0} is unreadable.")]
    BadState(String, #[source] serde_json::Error),
}

impl GvisorError {
    /// Whether a failed start may be retried with another sandbox.
    pub fn is_transient(&self) -> bool {
        matches!(self, GvisorError::Setup(_) | GvisorError::AgentDied(_))
    }
}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> GvisorError + '_ {
    move |source| GvisorError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// A gVisor platform: how the sentry intercepts the sandbox's system calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Platform {
    /// `ptrace`: works everywhere, slowest system calls.
    Ptrace,
    /// `kvm`: needs a usable `/dev/kvm`.
    Kvm,
}

impl Platform {
    /// Its name for `runsc --platform`.
    pub fn as_str(self) -> &'static str {
        match self {
            Platform::Ptrace => "ptrace",
            Platform::Kvm => "kvm",
        }
    }
}

/// What [`probe`] found.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct GvisorInfo {
    /// The runsc binary.
    pub runsc: PathBuf,
    /// Its version (`runsc --version`, first line).
    pub version: String,
    /// The platform sandboxes run on.
    pub platform: Platform,
}

/// The runsc binary: `explicit`, or the first `runsc` on `PATH` or in the
/// system's directories ([`runcell_jail::host_tools`]), or
/// `/usr/bin/runsc` (reported missing if absent).
pub fn find_runsc(explicit: Option<&Path>) -> PathBuf {
    if let Some(p) = explicit {
        return p.to_path_buf();
    }
    runcell_jail::host_tools::find("runsc").unwrap_or_else(|| PathBuf::from("/usr/bin/runsc"))
}

/// Whether gVisor sandboxes can run here: runsc is installed, this process
/// is root, and runsc runs a trivial container (`runsc do true`) on the
/// [`Platform::Ptrace`] platform (the KVM platform hangs at boot on hosts
/// whose `/dev/kvm` cannot run a guest, so it is not tried). The trial run
/// takes about a third of a second; its success is kept for the rest of
/// the boot ([`super::probe_cache`]). The error is a sentence saying why not.
pub fn probe(runsc: Option<&Path>) -> Result<GvisorInfo, String> {
    let runsc = find_runsc(runsc);
    if !runsc.is_file() {
        return Err(GvisorError::RunscMissing(runsc).to_string());
    }
    let out = Command::new(&runsc)
        .arg("--version")
        .output()
        .map_err(|e| format!("Could not run {}: {e}.", runsc.display()))?;
    let version = String::from_utf8_lossy(&out.stdout)
        .lines()
        .next()
        .unwrap_or("")
        .trim()
        .to_string();
    if !out.status.success() || version.is_empty() {
        return Err(format!(
            "{} --version failed: {}",
            runsc.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    if !nix::unistd::geteuid().is_root() {
        return Err(GvisorError::NotRoot.to_string());
    }
    let platform = Platform::Ptrace;
    // A success is kept for this boot (a failure may be a loaded moment).
    super::probe_cache::per_boot("runsc", &[&runsc], Result::is_ok, || {
        probe_platform(&runsc, platform, Duration::from_secs(10))
    })?;
    Ok(GvisorInfo {
        runsc,
        version,
        platform,
    })
}

/// Whether `runsc` runs a trivial container (`runsc do true`) on
/// `platform` within `timeout`; the error says why not. On a host whose
/// `/dev/kvm` cannot run a guest, [`Platform::Kvm`] hangs until the
/// timeout (then everything the attempt started is killed).
pub fn probe_platform(runsc: &Path, platform: Platform, timeout: Duration) -> Result<(), String> {
    static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let root = std::env::temp_dir().join(format!(
        "runcell-runsc-probe-{}-{}",
        std::process::id(),
        N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    ));
    let mut child = Command::new(runsc)
        .arg("--root")
        .arg(&root)
        .args(["--network=none", "--platform", platform.as_str()])
        .args(["do", "true"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("Could not run {}: {e}.", runsc.display()))?;
    let deadline = Instant::now() + timeout;
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break Some(status),
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(5)),
            _ => break None,
        }
    };
    let result = match status {
        Some(s) if s.success() => Ok(()),
        Some(s) => {
            let mut err = String::new();
            if let Some(mut e) = child.stderr.take() {
                let _ = e.read_to_string(&mut err);
            }
            Err(format!(
                "runsc cannot run a sandbox here on the {} platform ({s}): {}",
                platform.as_str(),
                err.trim()
            ))
        }
        None => {
            let _ = child.kill();
            let _ = child.wait();
            Err(format!(
                "runsc did not run a sandbox on the {} platform within {timeout:?}.",
                platform.as_str()
            ))
        }
    };
    // `runsc do` runs itself again in new namespaces: what it started may
    // outlive it, or still be starting, when it is killed. Kill until
    // nothing has been seen for a while.
    let until = Instant::now() + Duration::from_secs(2);
    let mut quiet_since = Instant::now();
    while Instant::now() < until && quiet_since.elapsed() < Duration::from_millis(100) {
        let left = processes_mentioning(&root);
        if !left.is_empty() {
            quiet_since = Instant::now();
        }
        for pid in left {
            kill_pid(pid);
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let _ = fs::remove_dir_all(&root);
    result
}

/// Whether `runsc checkpoint` and `runsc restore` work here on `platform`:
/// a container running `/bin/sleep` on the host's root (read-only) is
/// started, checkpointed into an image (which stops it), and restored from
/// it under the same id, which must then run. Takes about a second; the
/// error is a sentence with runsc's own words. Runs at most 30 s;
/// everything it started is killed and removed.
pub fn probe_checkpoint(runsc: &Path, platform: Platform) -> Result<(), String> {
    static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let dir = std::env::temp_dir().join(format!(
        "runcell-runsc-ckpt-probe-{}-{}",
        std::process::id(),
        N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    ));
    let result = checkpoint_round_trip(runsc, platform, &dir);
    let until = Instant::now() + Duration::from_secs(2);
    loop {
        let left = processes_mentioning(&dir);
        if left.is_empty() || Instant::now() >= until {
            break;
        }
        for pid in left {
            kill_pid(pid);
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let _ = fs::remove_dir_all(&dir);
    result
}

fn checkpoint_round_trip(runsc: &Path, platform: Platform, dir: &Path) -> Result<(), String> {
    let bundle = dir.join("bundle");
    let image = dir.join("image");
    let log = dir.join("log");
    fs::create_dir_all(&bundle)
        .map_err(|e| format!("Could not make {}: {e}.", bundle.display()))?;
    let config = serde_json::json!({
        "ociVersion": "1.0.2",
        "process": {"user": {"uid": 65534, "gid": 65534}, "args": ["/bin/sleep", "60"],
                    "env": ["PATH=/usr/bin:/bin"], "cwd": "/"},
        "root": {"path": "/", "readonly": true},
        "mounts": [{"destination": "/proc", "type": "proc", "source": "proc"}],
        "linux": {"namespaces": [{"type": "pid"}, {"type": "ipc"}, {"type": "uts"},
                                 {"type": "mount"}, {"type": "network"}]},
    });
    fs::write(bundle.join("config.json"), config.to_string())
        .map_err(|e| format!("Could not write the probe's bundle: {e}."))?;
    let step = |args: &[&std::ffi::OsStr], what: &str| -> Result<(), String> {
        let out =
            fs::File::create(&log).map_err(|e| format!("Could not write the probe's log: {e}."))?;
        let mut cmd = Command::new(runsc);
        cmd.arg("--root")
            .arg(dir.join("state"))
            .args(["--network=none", "--platform", platform.as_str()])
            .args(args)
            .stdin(Stdio::null())
            .stdout(out.try_clone().map_err(|e| e.to_string())?)
            .stderr(out);
        run_checked(&mut cmd, what, &log, Duration::from_secs(30)).map_err(|e| {
            // runsc's first line of failure (its Go stack traces follow).
            let text = e.to_string();
            let short = text
                .lines()
                .find(|l| l.contains("failed") || l.contains("error"))
                .unwrap_or(&text)
                .chars()
                .take(600)
                .collect::<String>();
            format!("`runsc {what}` does not work here: {short}")
        })
    };
    let os = |s: &str| std::ffi::OsString::from(s);
    let (b, i) = (
        bundle.clone().into_os_string(),
        image.clone().into_os_string(),
    );
    let id = os("probe");
    step(
        &[&os("run"), &os("--detach"), &os("--bundle"), &b, &id],
        "run",
    )?;
    step(
        &[&os("checkpoint"), &os("--image-path"), &i, &id],
        "checkpoint",
    )?;
    step(&[&os("delete"), &id], "delete")?;
    step(
        &[
            &os("restore"),
            &os("--detach"),
            &os("--bundle"),
            &b,
            &os("--image-path"),
            &i,
            &id,
        ],
        "restore",
    )?;
    let state = Command::new(runsc)
        .arg("--root")
        .arg(dir.join("state"))
        .args(["state", "probe"])
        .output()
        .map_err(|e| format!("Could not run `runsc state`: {e}."))?;
    let text = String::from_utf8_lossy(&state.stdout);
    if text.contains("\"running\"") {
        Ok(())
    } else {
        Err(format!(
            "`runsc restore` left the container not running: {}",
            text.trim()
        ))
    }
}

/// Sandboxes in gVisor containers (runsc), on the host's cgroups.
#[derive(Debug, Clone)]
pub struct GvisorBackend {
    runsc: PathBuf,
    agent: PathBuf,
    state_dir: PathBuf,
    cgroup_parent: String,
    platform: Platform,
    agent_log: Option<String>,
    /// The jail's id map: volumes are mounted through its inverse.
    id_map: runcell_jail::IdMap,
}

impl GvisorBackend {
    /// A gVisor backend that runs `runsc` (found on `PATH` when `None`) on
    /// the ptrace platform, starts `agent` in each container, keeps one
    /// directory per sandbox in `state_dir` (which must not be the jail's:
    /// each backend sweeps its whole directory) and one cgroup per sandbox
    /// under `cgroup_parent`, and has agents log with the filter
    /// `agent_log`.
    pub fn new(
        runsc: Option<PathBuf>,
        agent: PathBuf,
        state_dir: PathBuf,
        cgroup_parent: String,
        agent_log: Option<String>,
    ) -> Self {
        Self {
            runsc: find_runsc(runsc.as_deref()),
            agent,
            state_dir,
            cgroup_parent,
            platform: Platform::Ptrace,
            agent_log,
            id_map: runcell_jail::IdMap::default(),
        }
    }

    /// The same backend with the jail's id map `map` (the default map
    /// otherwise): a volume's files, owned on disk by `map.host_base + U`
    /// as a jail sandbox's user `U` writes them, are shown to a gVisor
    /// sandbox as owned by `U`, and its writes are stored the same way.
    pub fn with_id_map(mut self, map: runcell_jail::IdMap) -> Self {
        self.id_map = map;
        self
    }

    /// The same backend on `platform` (e.g. [`Platform::Kvm`] on a host
    /// where `runsc --platform=kvm do true` works; not this one, where it
    /// hangs at boot).
    pub fn with_platform(mut self, platform: Platform) -> Self {
        self.platform = platform;
        self
    }

    /// The platform its sandboxes run on.
    pub fn platform(&self) -> Platform {
        self.platform
    }

    /// The runsc binary it runs.
    pub fn runsc(&self) -> &Path {
        &self.runsc
    }

    /// The directory holding one subdirectory per sandbox.
    pub fn state_dir(&self) -> &Path {
        &self.state_dir
    }

    /// `runsc kill <id> USR1`: asks a running agent to quiesce for a
    /// checkpoint, or a quiesced one to serve again
    /// (`runcell-agent`'s `checkpoint::signal`). runsc's output goes to
    /// `log`.
    fn signal_agent(&self, dir: &Path, id: &str, log: &Path) -> Result<(), GvisorError> {
        let out = OpenOptions::new()
            .create(true)
            .append(true)
            .mode(0o600)
            .open(log)
            .map_err(io_err(log))?;
        run_checked(
            self.runsc_cmd(dir)
                .args(["kill", id, "USR1"])
                .stdin(Stdio::null())
                .stdout(out.try_clone().map_err(io_err(log))?)
                .stderr(out),
            "kill USR1",
            log,
            SETUP_TIMEOUT,
        )
    }

    /// `runsc` with the global flags of a container of the sandbox in
    /// `dir` (for `run` and `restore`).
    fn container_cmd(&self, dir: &Path, host_network: bool) -> Command {
        let mut cmd = self.runsc_cmd(dir);
        cmd.arg(if host_network {
            "--network=host"
        } else {
            "--network=none"
        })
        .args(["--host-uds=all", "--overlay2=none"]);
        // Debugging aid: runsc's debug logs and an strace of the sandbox's
        // system calls, in that directory.
        if let Some(debug) = std::env::var_os("RUNCELL_RUNSC_DEBUG") {
            let mut log = std::ffi::OsString::from("--debug-log=");
            log.push(PathBuf::from(debug).join(""));
            cmd.args(["--debug", "--strace"]).arg(log);
        }
        cmd
    }

    fn runsc_cmd(&self, dir: &Path) -> Command {
        let mut cmd = Command::new(&self.runsc);
        cmd.arg("--root")
            .arg(dir.join(RUNSC_DIR))
            .arg("--platform")
            .arg(self.platform.as_str());
        cmd
    }

    /// Kills and removes whatever sandbox `id` has left: its container,
    /// processes, mounts, cgroup and directory. `started`: the sandbox
    /// started (its `runsc run` returned), so every process of it is in
    /// its cgroup; otherwise a `runsc run` may still be starting outside
    /// it, and processes are looked for by their command lines too.
    fn remove_all(&self, id: &str, dir: &Path, started: bool) -> Result<(), GvisorError> {
        let t0 = Instant::now();
        // The sentry, the gofer and what they run are in the sandbox's
        // cgroup: killing it (thawed first: a frozen process dies of
        // SIGKILL only once thawed) takes them all.
        let cg = Cgroup::open(hierarchy()?, &self.cgroup_parent, id);
        if cg.exists() {
            cg.destroy(Duration::from_secs(5))?;
        }
        let t_kill = t0.elapsed();
        if !started {
            // Every process runsc made for the sandbox (the sentry, the
            // gofer, a `runsc run` still starting) names its bundle.
            // Killing them is enough: runsc's state for it is in the
            // directory removed below. (`runsc delete --force` does the
            // same but then waits for the sentry to be reaped, which an
            // orphan's init may take a second to do.)
            let bundle = dir.join("bundle");
            let until = Instant::now() + Duration::from_secs(5);
            loop {
                let left = processes_mentioning(&bundle);
                if left.is_empty() {
                    break;
                }
                if Instant::now() >= until {
                    tracing::warn!(sandbox = %id, ?left, "processes of a gVisor sandbox outlived SIGKILL");
                    break;
                }
                for pid in left {
                    kill_pid(pid);
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            // A `runsc run` killed while starting may have made the cgroup
            // after the first look.
            if cg.exists() {
                cg.destroy(Duration::from_secs(5))?;
            }
        }
        let stage = dir.join(ROOTFS_DIR);
        runcell_jail::gvisor::unmount_rootfs(&stage).map_err(GvisorError::Rootfs)?;
        tracing::debug!(
            sandbox = %id,
            kill_us = runcell_protocol::units::micros(t_kill),
            total_us = runcell_protocol::units::micros(t0.elapsed()),
            "gvisor sandbox removed"
        );
        match fs::remove_dir_all(dir) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => Err(io_err(dir)(e)),
            _ => Ok(()),
        }
    }

    fn attach_sandbox(&self, id: &str) -> Result<GvisorSandbox, GvisorError> {
        check_id(id)?;
        let dir = self.state_dir.join(id);
        let raw = fs::read(dir.join(STATE_FILE)).map_err(|_| GvisorError::NotRunning(id.into()))?;
        let state: StateFile =
            serde_json::from_slice(&raw).map_err(|e| GvisorError::BadState(id.into(), e))?;
        if !alive(state.pid, state.start_time) {
            return Err(GvisorError::NotRunning(id.into()));
        }
        Ok(GvisorSandbox {
            id: id.into(),
            dir,
            sentry: std::sync::Mutex::new((state.pid, state.start_time)),
            host_network: state.host_network,
            cgroup: Cgroup::open(hierarchy()?, &state.cgroup_parent, id),
            backend: self.clone(),
            _host_end: None,
            egress: None,
        })
    }
}

/// runsc's state directory, in the sandbox's directory.
const RUNSC_DIR: &str = "runsc";
/// The root filesystem's staging directory.
const ROOTFS_DIR: &str = "rootfs";
/// The directory bind-mounted at [`HOST_DIR`].
const HOST_SUBDIR: &str = "host";
/// Where, in the root filesystem's stage, the volumes' idmapped binds are.
const VOLUMES_SUBDIR: &str = "volumes";
/// The directory of the egress socket.
const EGRESS_DIR: &str = "egress";
/// The state file written once the sandbox is ready.
const STATE_FILE: &str = "gvisor.json";

/// What is written to `<dir>/gvisor.json` so a later process can find the sandbox.
#[derive(Debug, Serialize, Deserialize)]
struct StateFile {
    id: String,
    pid: i32,
    start_time: u64,
    cgroup_parent: String,
    /// It shares the host's network (a restore in place needs to know).
    #[serde(default)]
    host_network: bool,
}

/// Writes `<dir>/gvisor.json`, whole or not at all: a sweeping process
/// must not take a half-written file for a dead sandbox.
fn write_state(dir: &Path, state: &StateFile) -> Result<(), GvisorError> {
    let state_path = dir.join(STATE_FILE);
    let tmp_path = dir.join("gvisor.json.tmp");
    fs::write(
        &tmp_path,
        serde_json::to_vec(state).expect("state serializes"),
    )
    .map_err(io_err(&tmp_path))?;
    fs::rename(&tmp_path, &state_path).map_err(io_err(&state_path))
}

fn check_id(id: &str) -> Result<(), GvisorError> {
    runcell_jail::check_id(id).map_err(|_| GvisorError::BadId(id.into()))
}

fn hierarchy() -> Result<&'static Hierarchy, CgroupError> {
    static H: OnceLock<Hierarchy> = OnceLock::new();
    if let Some(h) = H.get() {
        return Ok(h);
    }
    let h = Hierarchy::detect()?;
    Ok(H.get_or_init(|| h))
}

/// The host pids limit of a sandbox whose processes are limited to `pids`
/// by gVisor's pids cgroup: a backstop for the sentry's host threads, far
/// enough above that gVisor never meets it first. Under the ptrace
/// platform a fork the cgroup refuses has already made the child's address
/// space (a host stub process), so a fork bomb at the limit churns host
/// threads: at 512, 16 × pids + 1024 (9,216) was met in about half of the
/// bash bombs of `crates/cli/tests/exec_lifetime.rs` (sampled peaks over
/// 8,500), crashing the sentry; 24 × pids + 2048 held at 512. At 128 the
/// same bomb peaked at 2,300 to 4,500 host tasks (11 runs, 2026-12-01),
/// against 24 × 128 + 2048 = 5,120: too close (the sentry crashed in some
/// test runs), so the backstop is never below 8,192, about twice those
/// peaks. (Not more at 512: a higher backstop there let a bomb that timed
/// out churn for longer before its kill won.) The stubs keep their threads
/// after the processes are gone (a bombed sandbox with five processes held
/// 4,385 host tasks until deleted), which docs/SECURITY.md counts against
/// the host's `pid_max`.
pub fn host_pids(pids: u64) -> u64 {
    pids.saturating_mul(24).saturating_add(2048).max(8192)
}

/// The `RLIMIT_NPROC` of a sandbox whose process limit is `pids`: a
/// backstop above gVisor's pids cgroup (which enforces `pids` and is where
/// hits are counted), so the cgroup always refuses first.
fn nproc_backstop(pids: u64) -> u64 {
    pids.saturating_mul(2).saturating_add(64)
}

/// The cgroup limits of a sandbox with `limits`.
fn host_limits(limits: &Limits) -> Limits {
    Limits {
        memory_bytes: limits.memory_bytes.saturating_add(SENTRY_MEMORY),
        pids: host_pids(limits.pids),
        ..*limits
    }
}

impl Backend for GvisorBackend {
    fn isolation(&self) -> super::Isolation {
        super::Isolation::Gvisor
    }

    fn prepare(&self, spec: &PrepareSpec) -> Result<Box<dyn Prepared>, BackendError> {
        Ok(Box::new(GvisorPrepared::prepare(self, spec)?))
    }

    fn attach(&self, id: &str) -> Result<Box<dyn Instance>, BackendError> {
        Ok(Box::new(self.attach_sandbox(id)?))
    }

    fn list(&self) -> Vec<String> {
        runcell_jail::list_sandboxes(&self.state_dir)
    }

    fn is_dead(&self, id: &str, grace: Duration) -> bool {
        if check_id(id).is_err() {
            return false;
        }
        let dir = self.state_dir.join(id);
        if dir.join(STATE_FILE).exists() {
            match self.attach_sandbox(id) {
                Ok(_) => return false,
                Err(GvisorError::NotRunning(_)) => return true,
                Err(_) => {}
            }
        }
        let age = fs::metadata(&dir)
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| t.elapsed().ok());
        age.is_some_and(|a| a > grace)
    }

    fn remove(&self, id: &str) -> Result<(), BackendError> {
        check_id(id)?;
        Ok(self.remove_all(id, &self.state_dir.join(id), false)?)
    }
}

/// A gVisor sandbox being made: its directory, cgroup and setup socket
/// exist. The container itself is made by [`Prepared::start`], because its
/// root filesystem is the template's, known only then.
#[derive(Debug)]
struct GvisorPrepared {
    backend: GvisorBackend,
    id: String,
    dir: PathBuf,
    host_network: bool,
    prepared_limits: Limits,
    cgroup: Cgroup,
    setup: UnixListener,
    /// Removes everything unless the sandbox started.
    armed: bool,
}

impl Drop for GvisorPrepared {
    fn drop(&mut self) {
        if self.armed {
            if let Err(e) = self.backend.remove_all(&self.id, &self.dir, false) {
                tracing::warn!(sandbox = %self.id, "could not clean up a gVisor sandbox: {e}");
            }
        }
    }
}

impl GvisorPrepared {
    fn prepare(backend: &GvisorBackend, spec: &PrepareSpec) -> Result<Self, GvisorError> {
        check_id(&spec.id)?;
        if !nix::unistd::geteuid().is_root() {
            return Err(GvisorError::NotRoot);
        }
        if !backend.runsc.is_file() {
            return Err(GvisorError::RunscMissing(backend.runsc.clone()));
        }
        if !backend.agent.is_file() {
            return Err(GvisorError::AgentMissing(backend.agent.clone()));
        }
        let shim = shim_path(&backend.agent);
        if !shim.is_file() {
            return Err(GvisorError::ShimMissing(shim));
        }
        let hierarchy = hierarchy()?;
        let state_dir = &backend.state_dir;
        fs::create_dir_all(state_dir).map_err(io_err(state_dir))?;
        fs::set_permissions(state_dir, fs::Permissions::from_mode(0o711))
            .map_err(io_err(state_dir))?;
        let dir = state_dir.join(&spec.id);
        fs::create_dir(&dir).map_err(io_err(&dir))?;
        fs::set_permissions(&dir, fs::Permissions::from_mode(0o700)).map_err(io_err(&dir))?;
        let host = dir.join(HOST_SUBDIR);
        let made = fs::create_dir(&host)
            .and_then(|()| fs::set_permissions(&host, fs::Permissions::from_mode(0o700)))
            .map_err(io_err(&host))
            .and_then(|()| {
                let path = host.join("setup.sock");
                let l = runcell_jail::socket::bind(&path).map_err(io_err(&path))?;
                l.set_nonblocking(true).map_err(io_err(&path))?;
                Ok(l)
            })
            .and_then(|setup| {
                let cgroup = Cgroup::create(
                    hierarchy,
                    &backend.cgroup_parent,
                    &spec.id,
                    &host_limits(&spec.limits),
                )?;
                Ok((setup, cgroup))
            });
        let (setup, cgroup) = match made {
            Ok(v) => v,
            Err(e) => {
                let _ = backend.remove_all(&spec.id, &dir, false);
                return Err(e);
            }
        };
        Ok(GvisorPrepared {
            backend: backend.clone(),
            id: spec.id.clone(),
            dir,
            host_network: spec.host_network,
            prepared_limits: spec.limits,
            cgroup,
            setup,
            armed: true,
        })
    }

    fn start_sandbox(mut self, spec: &StartSpec) -> Result<GvisorSandbox, GvisorError> {
        let t0 = Instant::now();
        let dir = self.dir.clone();
        self.cgroup.set_limits(&host_limits(&spec.limits))?;
        let egress_enabled = match spec.egress {
            EgressSocket::Socket { enabled } if !self.host_network => Some(enabled),
            _ => None,
        };
        let hostname = format!("runcell-{}", &self.id[..self.id.len().min(8)]);
        let init = InitSpec {
            sandbox_id: self.id.clone(),
            hostname: hostname.clone(),
            staging_dir: dir.join(ROOTFS_DIR),
            rootfs: spec.rootfs.clone(),
            disk_bytes: spec.limits.disk_bytes,
            user: spec.user.clone(),
            exit_on_host_close: spec.tied_to_process,
            deadline_unix_ms: spec.deadline_unix_ms,
            host_network: self.host_network,
            env: with_shim(spec.env.clone()),
            workdir: spec.workdir.clone(),
            // The agent only needs to know it has one; it connects to
            // EGRESS_SOCKET, where the egress directory is mounted.
            egress_socket: egress_enabled.map(|_| PathBuf::from(EGRESS_SOCKET)),
            egress_enabled: egress_enabled.unwrap_or(false),
            state_layers: spec.state_layers.clone(),
            // runsc mounts the volumes (the spec's mounts), not the agent.
            mounts: Vec::new(),
            ahead: false,
        };
        let root = runcell_jail::gvisor::compose_rootfs(&init, &dir.join(ROOTFS_DIR))
            .map_err(GvisorError::Rootfs)?;
        let volumes = self.mount_volumes(&spec.mounts)?;
        let egress = if egress_enabled.is_some() {
            let sockets = dir.join(EGRESS_DIR);
            fs::create_dir_all(&sockets).map_err(io_err(&sockets))?;
            fs::set_permissions(&sockets, fs::Permissions::from_mode(0o700))
                .map_err(io_err(&sockets))?;
            Some(bind_egress(&sockets)?)
        } else {
            None
        };
        // The agent, the preload library and the host's directories go
        // into the composed root on the host, not in the spec's mounts:
        // runsc serves them with the root instead of a gofer mount each.
        let shim = shim_path(&self.backend.agent);
        let host_dir = dir.join(HOST_SUBDIR);
        let egress_dir = dir.join(EGRESS_DIR);
        let mut binds = vec![
            (self.backend.agent.as_path(), AGENT_PATH, true),
            (shim.as_path(), SHIM_PATH, true),
            (host_dir.as_path(), HOST_DIR, false),
        ];
        if egress.is_some() {
            binds.push((egress_dir.as_path(), EGRESS_DIR_IN_SANDBOX, false));
        }
        for (source, dest, read_only) in binds {
            runcell_jail::gvisor::bind_into(&root, source, dest, read_only)
                .map_err(GvisorError::Rootfs)?;
        }
        let t_rootfs = t0.elapsed();

        let bundle = dir.join("bundle");
        fs::create_dir_all(&bundle).map_err(io_err(&bundle))?;
        let config = self.oci_config(spec, &root, &hostname, &volumes);
        let config_path = bundle.join("config.json");
        fs::write(
            &config_path,
            serde_json::to_vec_pretty(&config).expect("config serializes"),
        )
        .map_err(io_err(&config_path))?;

        let log_path = dir.join("agent.log");
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .mode(0o600)
            .open(&log_path)
            .map_err(io_err(&log_path))?;
        let pid_file = dir.join("sandbox.pid");
        let mut cmd = self.backend.container_cmd(&dir, self.host_network);
        let out = log.try_clone().map_err(io_err(&log_path))?;
        cmd.stdin(Stdio::null()).stdout(out).stderr(log);
        if let Some(image) = &spec.memory_image {
            // The sandbox's processes and agent go on where they were; the
            // agent already has its spec.
            allow_resume(&dir)?;
            restore_cmd(&mut cmd, image, &bundle, &pid_file, &self.id);
            run_checked(&mut cmd, "restore", &log_path, CHECKPOINT_TIMEOUT)?;
            return self.finish_restore(&log_path, &pid_file, egress, t0);
        }
        cmd.arg("run")
            .arg("--detach")
            .arg("--bundle")
            .arg(&bundle)
            .arg("--pid-file")
            .arg(&pid_file)
            .arg(&self.id);
        run_checked(&mut cmd, "run", &log_path, SETUP_TIMEOUT)?;
        let t_run = t0.elapsed();
        let pid: i32 = fs::read_to_string(&pid_file)
            .map_err(io_err(&pid_file))?
            .trim()
            .parse()
            .map_err(|_| {
                io_err(&pid_file)(io::Error::new(
                    io::ErrorKind::InvalidData,
                    "runsc wrote no pid",
                ))
            })?;
        let start_time =
            start_time(pid).ok_or_else(|| GvisorError::AgentDied(log_tail(&log_path)))?;

        // The agent connects once it runs.
        let deadline = Instant::now() + SETUP_TIMEOUT;
        let mut host_end = loop {
            match self.setup.accept() {
                Ok((s, _)) => break s,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    if !alive(pid, start_time) {
                        return Err(GvisorError::AgentDied(log_tail(&log_path)));
                    }
                    if Instant::now() >= deadline {
                        return Err(GvisorError::ReadyTimeout(
                            SETUP_TIMEOUT,
                            log_tail(&log_path),
                        ));
                    }
                    std::thread::sleep(WAIT_TICK);
                }
                Err(e) => return Err(GvisorError::Setup(e)),
            }
        };
        host_end
            .set_nonblocking(false)
            .map_err(GvisorError::Setup)?;
        let spec_bytes = serde_json::to_vec(&init).expect("spec serializes");
        let len = u32::try_from(spec_bytes.len())
            .map_err(|_| GvisorError::Setup(io::Error::other("the sandbox spec is over 4 GiB")))?;
        let mut msg = Vec::with_capacity(4 + spec_bytes.len());
        msg.extend_from_slice(&len.to_be_bytes());
        msg.extend_from_slice(&spec_bytes);
        host_end.write_all(&msg).map_err(GvisorError::Setup)?;
        host_end
            .set_read_timeout(Some(
                deadline
                    .saturating_duration_since(Instant::now())
                    .max(Duration::from_millis(1)),
            ))
            .map_err(GvisorError::Setup)?;
        read_status(&mut host_end, &log_path)?;
        host_end
            .set_read_timeout(None)
            .map_err(GvisorError::Setup)?;

        let state = StateFile {
            id: self.id.clone(),
            pid,
            start_time,
            cgroup_parent: self.backend.cgroup_parent.clone(),
            host_network: self.host_network,
        };
        write_state(&dir, &state)?;
        tracing::debug!(
            sandbox = %self.id,
            rootfs_us = runcell_protocol::units::micros(t_rootfs),
            runsc_us = runcell_protocol::units::micros(t_run - t_rootfs),
            setup_us = runcell_protocol::units::micros(t0.elapsed() - t_run),
            "gvisor sandbox started"
        );
        self.armed = false;
        Ok(GvisorSandbox {
            id: self.id.clone(),
            dir: dir.clone(),
            sentry: std::sync::Mutex::new((pid, start_time)),
            host_network: self.host_network,
            cgroup: self.cgroup.clone(),
            backend: self.backend.clone(),
            _host_end: spec.tied_to_process.then_some(host_end),
            egress: egress.map(|(l, _)| l),
        })
    }

    /// The end of a start by `runsc restore`: waits until the restored
    /// agent listens again (it found [`runcell_jail::gvisor::RESUME_MARKER`],
    /// written before the restore). One that does not within
    /// [`RESTORE_NUDGE_AFTER`] is also sent `SIGUSR1`, which tells a
    /// quiesced agent to serve whatever its file lookups saw.
    fn finish_restore(
        mut self,
        log_path: &Path,
        pid_file: &Path,
        egress: Option<(UnixListener, PathBuf)>,
        t0: Instant,
    ) -> Result<GvisorSandbox, GvisorError> {
        let t_restore = t0.elapsed();
        let (pid, start_time, nudged) =
            wait_restored(&self.backend, &self.dir, &self.id, log_path, pid_file)?;
        write_state(
            &self.dir,
            &StateFile {
                id: self.id.clone(),
                pid,
                start_time,
                cgroup_parent: self.backend.cgroup_parent.clone(),
                host_network: self.host_network,
            },
        )?;
        tracing::debug!(
            sandbox = %self.id,
            restore_us = runcell_protocol::units::micros(t_restore),
            resume_us = runcell_protocol::units::micros(t0.elapsed() - t_restore),
            nudged,
            "gvisor sandbox restored"
        );
        self.armed = false;
        Ok(GvisorSandbox {
            id: self.id.clone(),
            dir: self.dir.clone(),
            sentry: std::sync::Mutex::new((pid, start_time)),
            host_network: self.host_network,
            cgroup: self.cgroup.clone(),
            backend: self.backend.clone(),
            _host_end: None,
            egress: egress.map(|(l, _)| l),
        })
    }

    /// Mounts each volume of `mounts` at `<stage>/volumes/<i>`, idmapped
    /// through the inverse of the jail's id map (and read-only there if
    /// asked), and returns the OCI bind mounts that hand them to runsc.
    ///
    /// gVisor's gofer creates files with the sandbox's own ids (`U`), where
    /// a jail sandbox's user is `host_base + U` on the host; through the
    /// idmapped bind both leave and see the same owners on the volume's
    /// disk. Read-only is the host mount's, so the gofer's writes fail
    /// with `EROFS` whatever gVisor would allow. The mounts are under the
    /// stage's private tmpfs, so they go with it ([`runcell_jail::gvisor::unmount_rootfs`]).
    /// Spec mounts, unlike binds into the root, are served with runsc's
    /// `shared` file access (`--file-access-mounts`, its default), so
    /// gVisor revalidates what it cached when another sandbox changed it.
    fn mount_volumes(
        &self,
        mounts: &[runcell_jail::BindMount],
    ) -> Result<Vec<serde_json::Value>, GvisorError> {
        let base = self.dir.join(ROOTFS_DIR).join(VOLUMES_SUBDIR);
        let mut out = Vec::with_capacity(mounts.len());
        for (i, m) in mounts.iter().enumerate() {
            let target = m.target.display().to_string();
            let sane = m.target.is_absolute()
                && m.target.components().count() >= 2
                && m.target.components().all(|c| {
                    matches!(
                        c,
                        std::path::Component::RootDir | std::path::Component::Normal(_)
                    )
                });
            if !sane {
                return Err(GvisorError::Volume {
                    target,
                    source: runcell_jail::idmap_mount::IdmapMountError::BadPath(m.target.clone()),
                });
            }
            let at = base.join(i.to_string());
            fs::create_dir_all(&at).map_err(io_err(&at))?;
            runcell_jail::idmap_mount::bind_idmapped(
                &m.source,
                &at,
                self.backend.id_map,
                m.read_only,
            )
            .map_err(|source| GvisorError::Volume {
                target: target.clone(),
                source,
            })?;
            out.push(serde_json::json!({
                "destination": m.target,
                "type": "bind",
                "source": at,
                "options": ["rbind", if m.read_only { "ro" } else { "rw" }, "nosuid", "nodev"],
            }));
        }
        Ok(out)
    }

    /// The OCI runtime spec of the sandbox's container.
    fn oci_config(
        &self,
        spec: &StartSpec,
        root: &Path,
        hostname: &str,
        volumes: &[serde_json::Value],
    ) -> serde_json::Value {
        use serde_json::json;
        let caps = [
            "CAP_CHOWN",
            "CAP_DAC_OVERRIDE",
            "CAP_DAC_READ_SEARCH",
            "CAP_FOWNER",
            "CAP_FSETID",
            "CAP_KILL",
            "CAP_SETGID",
            "CAP_SETUID",
            "CAP_SETPCAP",
            "CAP_NET_BIND_SERVICE",
            "CAP_SYS_CHROOT",
            "CAP_SYS_RESOURCE",
            "CAP_AUDIT_WRITE",
            // Only for the agent to mount gVisor's pids cgroup and mask
            // its /proc/1 files; it drops it before it serves anything.
            "CAP_SYS_ADMIN",
        ];
        // The agent's arguments carry its settings and its environment is
        // empty: sandboxed code can read the environment of every agent
        // thread under this gVisor (see `hide_agent_proc`), so nothing
        // lives there.
        let mut args = vec![
            AGENT_PATH.to_string(),
            "gvisor-init".to_string(),
            format!("{}{}", runcell_jail::gvisor::PIDS_ARG, spec.limits.pids),
        ];
        if let Some(l) = &self.backend.agent_log {
            args.push(format!("{}{l}", runcell_jail::gvisor::LOG_ARG));
        }
        let env: Vec<String> = Vec::new();
        let mut mounts = vec![
            json!({"destination": "/proc", "type": "proc", "source": "proc"}),
            json!({"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
                   "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]}),
            json!({"destination": "/dev/pts", "type": "devpts", "source": "devpts",
                   "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"]}),
            json!({"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
                   "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"]}),
            // runsc mounts a tmpfs of its own on /tmp unless the spec names
            // one: in the Sentry's memory, outside the disk limit. The
            // root's own /tmp (on the capped writable layer) instead.
            json!({"destination": "/tmp", "type": "bind",
                   "source": root.join("tmp"), "options": ["rbind", "rw"]}),
        ];
        mounts.extend(volumes.iter().cloned());
        let mut namespaces = vec![
            json!({"type": "pid"}),
            json!({"type": "ipc"}),
            json!({"type": "uts"}),
            json!({"type": "mount"}),
        ];
        if !self.host_network {
            namespaces.push(json!({"type": "network"}));
        }
        json!({
            "ociVersion": "1.0.2",
            "process": {
                "terminal": false,
                "user": {"uid": 0, "gid": 0},
                "args": args,
                "env": env,
                "cwd": "/",
                "capabilities": {
                    "bounding": caps, "effective": caps, "permitted": caps,
                },
                "rlimits": [
                    {"type": "RLIMIT_NPROC", "hard": nproc_backstop(spec.limits.pids),
                     "soft": nproc_backstop(spec.limits.pids)},
                    {"type": "RLIMIT_NOFILE", "hard": 1_048_576u64, "soft": 1_048_576u64},
                ],
                "noNewPrivileges": false,
            },
            "root": {"path": root, "readonly": false},
            "hostname": hostname,
            "mounts": mounts,
            "linux": {
                "cgroupsPath": format!("/{}/{}", self.backend.cgroup_parent, self.id),
                "namespaces": namespaces,
            },
        })
    }
}

impl Prepared for GvisorPrepared {
    fn id(&self) -> &str {
        &self.id
    }

    fn set_limits(&self, limits: &Limits) -> Result<(), BackendError> {
        Ok(self
            .cgroup
            .set_limits(&host_limits(limits))
            .map_err(GvisorError::from)?)
    }

    fn reset_limits(&self) -> Result<(), BackendError> {
        self.set_limits(&self.prepared_limits)
    }

    fn is_alive(&self) -> bool {
        self.dir.join(HOST_SUBDIR).join("setup.sock").exists()
    }

    fn start(self: Box<Self>, spec: &StartSpec) -> Result<Box<dyn Instance>, BackendError> {
        Ok(Box::new(self.start_sandbox(spec)?))
    }
}

/// A running gVisor sandbox, host side.
#[derive(Debug)]
struct GvisorSandbox {
    id: String,
    dir: PathBuf,
    /// The sandbox process (gVisor's sentry) on the host, and its start
    /// time: a restore in place ([`Instance::save_running`]) makes another.
    sentry: std::sync::Mutex<(i32, u64)>,
    host_network: bool,
    cgroup: Cgroup,
    backend: GvisorBackend,
    /// Held open for `tied_to_process` sandboxes: when it closes, the agent exits.
    _host_end: Option<UnixStream>,
    egress: Option<UnixListener>,
}

impl Instance for GvisorSandbox {
    fn isolation(&self) -> super::Isolation {
        super::Isolation::Gvisor
    }

    fn id(&self) -> &str {
        &self.id
    }

    fn pid(&self) -> i32 {
        self.sentry().0
    }

    fn agent_channel(&self) -> AgentChannel {
        AgentChannel::Unix(self.dir.join(HOST_SUBDIR).join("agent.sock"))
    }

    fn take_egress_listener(&mut self) -> Option<UnixListener> {
        self.egress.take()
    }

    fn rebind_egress(&mut self) -> Result<Option<UnixListener>, BackendError> {
        let sockets = self.dir.join(EGRESS_DIR);
        if !sockets.is_dir() {
            return Ok(None);
        }
        Ok(Some(bind_egress(&sockets)?.0))
    }

    fn counters(&self) -> Counters {
        self.cgroup.counters()
    }

    fn kills(&self) -> Kills {
        self.cgroup.kills()
    }

    fn is_alive(&self) -> bool {
        let (pid, start_time) = self.sentry();
        alive(pid, start_time)
    }

    fn kill(&self) {
        let (pid, start_time) = self.sentry();
        if alive(pid, start_time) {
            kill_pid(pid);
        }
        // A frozen process dies of SIGKILL only once thawed.
        if self.cgroup.is_frozen() {
            let _ = self.cgroup.thaw();
        }
    }

    fn destroy(self: Box<Self>) -> Result<(), BackendError> {
        Ok(self.backend.remove_all(&self.id, &self.dir, true)?)
    }

    // The sentry, the gofer and every process they run are in the
    // sandbox's host cgroup: the host's freezer stops them all at once.
    fn freeze(&self) -> Result<(), BackendError> {
        self.cgroup
            .freeze()
            .map_err(|e| GvisorError::from(e).into())
    }

    fn thaw(&self) -> Result<(), BackendError> {
        self.cgroup.thaw().map_err(|e| GvisorError::from(e).into())
    }

    fn is_frozen(&self) -> bool {
        self.cgroup.is_frozen()
    }

    fn checkpoint(&self, image: &Path) -> Result<(), BackendError> {
        Ok(self.checkpoint_to(image)?)
    }

    // Checkpointed (which stops it), copied, restored in place: this runsc
    // hangs in `checkpoint --leave-running`.
    fn save_running(&self, image: &Path, layer: &Path) -> Result<u64, BackendError> {
        let t0 = Instant::now();
        self.checkpoint_to(image)?;
        let t_checkpoint = t0.elapsed();
        let saved = runcell_jail::gvisor::export_layer(&self.dir.join(ROOTFS_DIR), layer)
            .map_err(GvisorError::Export);
        let t_copy = t0.elapsed();
        let restored = self.restore_in_place(image);
        let done = saved.and_then(|bytes| restored.map(|()| bytes));
        if done.is_err() {
            let _ = fs::remove_dir_all(image);
            let _ = fs::remove_dir_all(layer);
        }
        tracing::debug!(
            sandbox = %self.id,
            checkpoint_us = runcell_protocol::units::micros(t_checkpoint),
            copy_us = runcell_protocol::units::micros(t_copy - t_checkpoint),
            restore_us = runcell_protocol::units::micros(t0.elapsed() - t_copy),
            ok = done.is_ok(),
            "gvisor sandbox saved and running on"
        );
        Ok(done?)
    }

    // The writable layer is on the host (`rootfs/upper`, written through
    // by the gofer): a copy of it, taken while the sandbox is frozen or
    // after it stopped.
    fn export_layer(&self, dest: &Path) -> Result<u64, BackendError> {
        runcell_jail::gvisor::export_layer(&self.dir.join(ROOTFS_DIR), dest)
            .map_err(|e| GvisorError::Export(e).into())
    }
}

impl GvisorSandbox {
    /// The sentry's pid and start time.
    fn sentry(&self) -> (i32, u64) {
        *self
            .sentry
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Runs the sandbox on from `image`, a checkpoint of it that stopped
    /// it: the stopped container is deleted (its root filesystem, cgroup
    /// and host directory stay) and `runsc restore` starts it again under
    /// the same id, where it was.
    fn restore_in_place(&self, image: &Path) -> Result<(), GvisorError> {
        let t0 = Instant::now();
        let log_path = self.dir.join("agent.log");
        // What `runsc delete` does for it, without waiting as it does for
        // the stopped sentry to be reaped (by an init that may take a
        // second): its processes are gone (the gofer ends with the
        // sentry), then runsc's record of it, alone in its `--root`.
        let bundle = self.dir.join("bundle");
        let until = Instant::now() + SETUP_TIMEOUT;
        loop {
            let left = processes_mentioning(&bundle);
            if left.is_empty() {
                break;
            }
            if Instant::now() >= until {
                return Err(GvisorError::Checkpoint(format!(
                    "its processes outlived the checkpoint: {left:?}"
                )));
            }
            for pid in left {
                kill_pid(pid);
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        let runsc_root = self.dir.join(RUNSC_DIR);
        fs::remove_dir_all(&runsc_root).map_err(io_err(&runsc_root))?;
        let t_delete = t0.elapsed();
        allow_resume(&self.dir)?;
        let pid_file = self.dir.join("sandbox.pid");
        let _ = fs::remove_file(&pid_file);
        let out = OpenOptions::new()
            .create(true)
            .append(true)
            .mode(0o600)
            .open(&log_path)
            .map_err(io_err(&log_path))?;
        let mut cmd = self.backend.container_cmd(&self.dir, self.host_network);
        cmd.stdin(Stdio::null())
            .stdout(out.try_clone().map_err(io_err(&log_path))?)
            .stderr(out);
        restore_cmd(&mut cmd, image, &bundle, &pid_file, &self.id);
        run_checked(&mut cmd, "restore", &log_path, CHECKPOINT_TIMEOUT)?;
        let t_restore = t0.elapsed();
        let (pid, start_time, _) =
            wait_restored(&self.backend, &self.dir, &self.id, &log_path, &pid_file)?;
        tracing::debug!(
            sandbox = %self.id,
            delete_us = runcell_protocol::units::micros(t_delete),
            restore_us = runcell_protocol::units::micros(t_restore - t_delete),
            resume_us = runcell_protocol::units::micros(t0.elapsed() - t_restore),
            "gvisor sandbox restored in place"
        );
        *self
            .sentry
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = (pid, start_time);
        write_state(
            &self.dir,
            &StateFile {
                id: self.id.clone(),
                pid,
                start_time,
                cgroup_parent: self.backend.cgroup_parent.clone(),
                host_network: self.host_network,
            },
        )
    }

    /// `runsc checkpoint` into `image`, once the agent dropped its host
    /// sockets (runsc cannot save one: "Cannot save endpoint with bound
    /// host socket"). The sandbox is stopped afterwards, also when runsc
    /// failed part-way.
    fn checkpoint_to(&self, image: &Path) -> Result<(), GvisorError> {
        let t0 = Instant::now();
        let host = self.dir.join(HOST_SUBDIR);
        let quiesced = host.join(marker_name(runcell_jail::gvisor::QUIESCED_MARKER));
        let resume = host.join(marker_name(runcell_jail::gvisor::RESUME_MARKER));
        let log_path = self.dir.join("agent.log");
        let log = |what: &str| -> Result<fs::File, GvisorError> {
            let _ = what;
            OpenOptions::new()
                .create(true)
                .append(true)
                .mode(0o600)
                .open(&log_path)
                .map_err(io_err(&log_path))
        };
        if self.cgroup.is_frozen() {
            self.cgroup.thaw()?;
        }
        let _ = fs::remove_file(&quiesced);
        let _ = fs::remove_file(&resume);
        self.backend.signal_agent(&self.dir, &self.id, &log_path)?;
        let deadline = Instant::now() + QUIESCE_TIMEOUT;
        while !quiesced.exists() {
            if !self.is_alive() {
                return Err(GvisorError::NotRunning(self.id.clone()));
            }
            if Instant::now() >= deadline {
                // Let it serve again: a second signal (it may have looked
                // for the marker already, and gVisor caches the miss).
                let _ = fs::write(&resume, b"");
                let _ = self.backend.signal_agent(&self.dir, &self.id, &log_path);
                return Err(GvisorError::Checkpoint(format!(
                    "its agent did not let go of its host connections within {QUIESCE_TIMEOUT:?}"
                )));
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        let t_quiesce = t0.elapsed();
        if fs::symlink_metadata(image).is_ok() {
            let _ = fs::write(&resume, b"");
            return Err(GvisorError::Io {
                path: image.to_path_buf(),
                source: io::Error::from(io::ErrorKind::AlreadyExists),
            });
        }
        fs::create_dir_all(image).map_err(io_err(image))?;
        fs::set_permissions(image, fs::Permissions::from_mode(0o700)).map_err(io_err(image))?;
        let out = log("checkpoint")?;
        let done = run_checked(
            self.backend
                .runsc_cmd(&self.dir)
                .arg("checkpoint")
                .arg("--image-path")
                .arg(image)
                .arg(&self.id)
                .stdin(Stdio::null())
                .stdout(out.try_clone().map_err(io_err(&log_path))?)
                .stderr(out),
            "checkpoint",
            &log_path,
            CHECKPOINT_TIMEOUT,
        );
        if let Err(e) = done {
            let _ = fs::remove_dir_all(image);
            // A failed checkpoint leaves the container stopped here.
            let _ = fs::write(&resume, b"");
            return Err(e);
        }
        tracing::debug!(
            sandbox = %self.id,
            quiesce_us = runcell_protocol::units::micros(t_quiesce),
            checkpoint_us = runcell_protocol::units::micros(t0.elapsed() - t_quiesce),
            "gvisor sandbox checkpointed"
        );
        Ok(())
    }
}

/// Makes the host directory of the sandbox in `dir` ready for a restored
/// agent: what a former life left (its socket, its quiesce marker) goes,
/// and the marker that lets it serve again
/// ([`runcell_jail::gvisor::RESUME_MARKER`]) is there before it runs. A
/// marker written after `runsc restore` returned came too late for an
/// agent that had already looked for it (gVisor caches the miss): about
/// one restore in three never served again.
fn allow_resume(dir: &Path) -> Result<(), GvisorError> {
    let host = dir.join(HOST_SUBDIR);
    for stale in [
        host.join("agent.sock"),
        host.join(marker_name(runcell_jail::gvisor::QUIESCED_MARKER)),
    ] {
        let _ = fs::remove_file(stale);
    }
    let resume = host.join(marker_name(runcell_jail::gvisor::RESUME_MARKER));
    fs::write(&resume, b"").map_err(io_err(&resume))
}

/// `runsc restore` of `image` as container `id` of `bundle`, detached.
fn restore_cmd(cmd: &mut Command, image: &Path, bundle: &Path, pid_file: &Path, id: &str) {
    cmd.arg("restore")
        .arg("--image-path")
        .arg(image)
        .arg("--detach")
        .arg("--bundle")
        .arg(bundle)
        .arg("--pid-file")
        .arg(pid_file)
        .arg(id);
}

/// After `runsc restore` returned: the restored sentry's pid and start
/// time, once its agent listens again (it found the marker
/// [`allow_resume`] wrote), and whether it had to be nudged: one that does
/// not serve within [`RESTORE_NUDGE_AFTER`] is also sent `SIGUSR1`, which
/// tells a quiesced agent to serve whatever its file lookups saw.
fn wait_restored(
    backend: &GvisorBackend,
    dir: &Path,
    id: &str,
    log_path: &Path,
    pid_file: &Path,
) -> Result<(i32, u64, bool), GvisorError> {
    let pid: i32 = fs::read_to_string(pid_file)
        .map_err(io_err(pid_file))?
        .trim()
        .parse()
        .map_err(|_| {
            io_err(pid_file)(io::Error::new(
                io::ErrorKind::InvalidData,
                "runsc wrote no pid",
            ))
        })?;
    let start_time = start_time(pid).ok_or_else(|| GvisorError::AgentDied(log_tail(log_path)))?;
    let socket = dir.join(HOST_SUBDIR).join("agent.sock");
    let since = Instant::now();
    let deadline = since + RESTORE_READY_TIMEOUT;
    let mut nudged = false;
    loop {
        // Only the restored agent binds it ([`allow_resume`] removed what
        // was left).
        if socket.exists() {
            let short = runcell_jail::socket::SocketPath::new(&socket).map_err(io_err(&socket))?;
            if UnixStream::connect(short.path()).is_ok() {
                return Ok((pid, start_time, nudged));
            }
        }
        if !alive(pid, start_time) {
            return Err(GvisorError::AgentDied(log_tail(log_path)));
        }
        if !nudged && since.elapsed() >= RESTORE_NUDGE_AFTER {
            nudged = true;
            tracing::info!(sandbox = %id, "a restored gVisor sandbox does not serve yet; signalling its agent");
            if let Err(e) = backend.signal_agent(dir, id, log_path) {
                tracing::warn!(sandbox = %id, "could not signal a restored agent: {e}");
            }
        }
        if Instant::now() >= deadline {
            return Err(GvisorError::ReadyTimeout(
                RESTORE_READY_TIMEOUT,
                log_tail(log_path),
            ));
        }
        std::thread::sleep(WAIT_TICK);
    }
}

/// The file name of a marker in the host directory.
fn marker_name(in_sandbox: &str) -> &str {
    in_sandbox.rsplit('/').next().unwrap_or(in_sandbox)
}

/// How long the agent gets to drop its host sockets before a checkpoint.
const QUIESCE_TIMEOUT: Duration = Duration::from_secs(5);

/// How long `runsc checkpoint` and `runsc restore` may take (a sandbox
/// with a large memory writes and reads it all; 100 MB took about a second).
const CHECKPOINT_TIMEOUT: Duration = Duration::from_secs(120);

/// Binds `<sockets>/sock` (replacing a dead one), 0600 and owned by root:
/// only root of the sandbox (the agent) may connect to it.
fn bind_egress(sockets: &Path) -> Result<(UnixListener, PathBuf), GvisorError> {
    let path = sockets.join("sock");
    let _ = fs::remove_file(&path);
    let listener = runcell_jail::socket::bind(&path).map_err(io_err(&path))?;
    fs::set_permissions(&path, fs::Permissions::from_mode(0o600)).map_err(io_err(&path))?;
    Ok((listener, path))
}

/// Runs a runsc command whose output goes to `log`; fails with the log's
/// tail if it fails or outlives [`SETUP_TIMEOUT`].
fn run_checked(
    cmd: &mut Command,
    what: &str,
    log: &Path,
    timeout: Duration,
) -> Result<(), GvisorError> {
    let mut child = cmd.spawn().map_err(|source| GvisorError::RunscExec {
        command: what.into(),
        source,
    })?;
    let deadline = Instant::now() + timeout;
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if Instant::now() < deadline => std::thread::sleep(WAIT_TICK),
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(GvisorError::ReadyTimeout(timeout, log_tail(log)));
            }
            Err(source) => {
                return Err(GvisorError::RunscExec {
                    command: what.into(),
                    source,
                })
            }
        }
    };
    if status.success() {
        Ok(())
    } else {
        Err(GvisorError::Runsc {
            command: what.into(),
            status: status.to_string(),
            output: log_tail(log),
        })
    }
}

/// Reads the agent's setup status: `R`, or `E` + length + message.
fn read_status(sock: &mut UnixStream, log: &Path) -> Result<(), GvisorError> {
    let map_read = |e: io::Error| match e.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => {
            GvisorError::ReadyTimeout(SETUP_TIMEOUT, log_tail(log))
        }
        io::ErrorKind::UnexpectedEof => GvisorError::AgentDied(log_tail(log)),
        _ => GvisorError::Setup(e),
    };
    match runcell_jail::read_setup_answer(sock).map_err(map_read)? {
        runcell_jail::SetupAnswer::Ready => Ok(()),
        runcell_jail::SetupAnswer::ExecFailed(errno) => Err(GvisorError::SetupFailed(format!(
            "the agent could not be executed: {}",
            io::Error::from_raw_os_error(errno)
        ))),
        runcell_jail::SetupAnswer::Failed(msg) => Err(GvisorError::SetupFailed(msg)),
    }
}

fn kill_pid(pid: i32) {
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGKILL,
    );
}

/// Running (not zombie) runsc processes (`runsc`, `runsc-sandbox`,
/// `runsc-gofer`, ...) whose command line contains `path`. Others that
/// merely name it (an operator's `cat`) are left alone.
fn processes_mentioning(path: &Path) -> Vec<i32> {
    fn is_runsc(cmdline: &[u8]) -> bool {
        let argv0 = cmdline.split(|&b| b == 0).next().unwrap_or_default();
        let name = argv0.rsplit(|&b| b == b'/').next().unwrap_or_default();
        name.starts_with(b"runsc")
    }
    let needle = path.as_os_str().as_encoded_bytes();
    let me = std::process::id();
    fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|&pid| u32::try_from(pid).is_ok_and(|p| p != me))
        .filter(|pid| {
            fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|c| is_runsc(&c) && c.windows(needle.len()).any(|w| w == needle))
                && start_time(*pid).is_some_and(|t| alive(*pid, t))
        })
        .collect()
}

/// Whether process `pid` runs (not a zombie) and started at `start_time`.
fn alive(pid: i32, start_time_ticks: u64) -> bool {
    let Ok(stat) = fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    let Some(after_comm) = stat.rfind(')').and_then(|i| stat.get(i + 2..)) else {
        return false;
    };
    let running = after_comm.starts_with(|c| c != 'Z' && c != 'X');
    running && after_comm.split(' ').nth(19).and_then(|s| s.parse().ok()) == Some(start_time_ticks)
}

/// Start time of a process in clock ticks since boot (field 22 of /proc/pid/stat).
fn start_time(pid: i32) -> Option<u64> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after_comm = stat.get(stat.rfind(')')? + 2..)?;
    after_comm.split(' ').nth(19)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn backend(state_dir: &Path) -> GvisorBackend {
        GvisorBackend::new(
            Some(PathBuf::from("/nonexistent/runsc")),
            PathBuf::from("/nonexistent/runcell-agent"),
            state_dir.into(),
            format!("runcell-unit-gvisor-{}", std::process::id()),
            None,
        )
    }

    #[test]
    fn sweep_removes_a_half_made_sandbox_past_its_grace_and_keeps_a_young_one() {
        let tmp = tempfile::tempdir().unwrap();
        let b = backend(tmp.path());
        // Left behind by a process killed while starting it: a directory
        // with a bundle and runsc state but no state file.
        std::fs::create_dir_all(tmp.path().join("orphan/bundle")).unwrap();
        std::fs::create_dir_all(tmp.path().join("orphan/runsc")).unwrap();
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(
            b.sweep(Duration::from_millis(10)),
            vec!["orphan".to_string()]
        );
        assert!(!tmp.path().join("orphan").exists());

        std::fs::create_dir_all(tmp.path().join("young")).unwrap();
        assert!(b.sweep(Duration::from_secs(60)).is_empty());
        assert!(tmp.path().join("young").exists());
    }

    #[test]
    fn a_sandbox_whose_sentry_is_gone_is_dead_and_removed() {
        let tmp = tempfile::tempdir().unwrap();
        let b = backend(tmp.path());
        let dir = tmp.path().join("gone");
        std::fs::create_dir_all(&dir).unwrap();
        let mut child = std::process::Command::new("/bin/true").spawn().unwrap();
        let pid = child.id();
        child.wait().unwrap();
        std::fs::write(
            dir.join(STATE_FILE),
            format!(r#"{{"id":"gone","pid":{pid},"start_time":1,"cgroup_parent":"runcell-unit"}}"#),
        )
        .unwrap();
        assert!(b.is_dead("gone", Duration::from_secs(60)));
        assert!(b.attach("gone").is_err());
        assert_eq!(b.sweep(Duration::from_secs(60)), vec!["gone".to_string()]);
        assert!(!dir.exists());
    }

    #[test]
    fn ids_that_are_paths_are_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let outside = tmp.path().join("precious");
        std::fs::create_dir_all(&outside).unwrap();
        let b = backend(&tmp.path().join("state"));
        assert!(matches!(
            b.remove("../precious"),
            Err(BackendError::Gvisor(GvisorError::BadId(_)))
        ));
        assert!(!b.is_dead("../precious", Duration::ZERO));
        assert!(outside.exists());
    }

    #[test]
    fn the_host_limits_leave_room_for_the_sentry() {
        let l = Limits {
            memory_bytes: 256 << 20,
            pids: 64,
            cpu_millis: 500,
            disk_bytes: 1 << 30,
        };
        let h = host_limits(&l);
        assert_eq!(h.memory_bytes, (256 << 20) + SENTRY_MEMORY);
        assert_eq!(h.pids, 8192, "at least 8,192 for a small limit");
        assert_eq!(host_pids(512), 512 * 24 + 2048);
        assert_eq!((h.cpu_millis, h.disk_bytes), (500, 1 << 30));
        assert_eq!(host_pids(u64::MAX), u64::MAX);
    }
}
