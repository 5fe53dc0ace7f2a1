//! MicroVMs as a [`Backend`]: every sandbox is a QEMU `microvm` machine
//! with its own guest kernel (Debian's cloud kernel), whose init is
//! `runcell-agent vm-init`.
//!
//! * Boot files: the kernel and its virtio modules come from
//!   `scripts/microvm-assets.sh` (in [`MicrovmConfig::kernel_dir`]); the
//!   initramfs (the agent, its shared libraries, the modules) is built here
//!   at first use, per agent build, into [`MicrovmConfig::cache_dir`].
//! * Root: the template's tree as a read-only ext4 image, built once per
//!   template content and cached; the guest overlays it with its private
//!   writable disk (`/dev/vdb`, ext4 of the disk limit), as the jail
//!   overlays its writable layer. That disk is a qcow2 overlay in the
//!   sandbox's directory on a chain of read-only images ending in a blank
//!   file system of that size (cached per size): the writable layer lives
//!   on the host's disk, not in guest memory, and is saved copy-on-write.
//! * Saving ([`Instance::export_layer`]): the guest flushes its file
//!   systems (`sync` over the control port, [`CONTROL_PORT_NAME`]), the VMM
//!   stops it, and its current disk image becomes read-only: it is
//!   hard-linked into the new layer directory with the images below it,
//!   and the guest goes on writing to a new, empty overlay on top
//!   ([`Vmm::switch_disk`]). A layer directory is a whole chain of
//!   hard links whose headers name their backing files by bare file name
//!   (relative to their own directory), so it stands alone: a sandbox
//!   started from it (a fork, a wake, a snapshot's) links the chain into
//!   its own directory and adds its own overlay. Nothing is copied; a save
//!   takes the same time whatever the sandbox wrote.
//! * Memory ([`Instance::checkpoint`]): the stopped guest's memory and
//!   device state migrate to a file ([`Vmm::save_memory`], QEMU's
//!   `migrate` to `exec:cat`); a start with that image
//!   ([`StartSpec::memory_image`]) launches the same machine with
//!   `-incoming` on a disk with the same content, continues it and
//!   re-attaches as after a daemon restart. Processes and code contexts go
//!   on where they were; the host sets the guest's clock (`T`) and, for a
//!   new sandbox (a fork, a snapshot's), its sandbox id (`I`). A snapshot
//!   or fork ([`Instance::save_running`]) saves the files and the memory
//!   the same way, then continues the same VMM (`cont`): the source runs
//!   on with its memory and its channel. The saved guest's RAM, vCPUs and
//!   limits must be the new sandbox's, else the restore is refused.
//! * Pause: the VMM stops the guest's vCPUs (QMP `stop`/`cont`); its
//!   memory stays.
//! * Limits: memory and processes are the `memory.max` and `pids.max` of
//!   a guest cgroup v2 the agent puts itself in (`runcell.memory=` and
//!   `runcell.pids=` on the kernel command line), whose event counters the
//!   agent reads to report hits by name in each run's exit; the guest's RAM
//!   (`-m`) is the memory limit plus room for its kernel and agent. CPU is
//!   its number of vCPUs (`-smp`, rounded up), disk the size of the file
//!   system on its writable disk.
//! * Channel: one virtio-serial port, multiplexed
//!   ([`runcell_protocol::mux`]); the host end is a unix socket QEMU
//!   listens on, and a forwarder in the host process serves
//!   `<dir>/agent.sock` over it ([`forward`]), so the rest of runcell sees
//!   the usual [`AgentChannel::Unix`]. Egress goes the other way over the
//!   same port.
//! * Lifetime: QEMU runs daemonized (its own session), so sandboxes outlive
//!   the daemon; a restarted daemon re-attaches by id (`vm.json` and
//!   `qemu.pid` in the sandbox's directory) and starts a new forwarder; the
//!   guest's streams end when the old one goes and the agent serves the
//!   new one's. A sandbox tied to its process stops when the process's end
//!   of the channel closes (the agent exits; the guest kernel panics and
//!   QEMU, told not to reboot, exits).
//! * Volumes (`microvm/volumes.rs`): one `virtiofsd` per volume, sharing an
//!   idmapped bind of it (the jail's owners on disk), a `vhost-user-fs`
//!   device each and the guest's RAM as a shared memfd; vm-init mounts
//!   them where the jail's setup binds them from. QEMU cannot migrate such
//!   a guest, so its saves carry its files only.
//! * Acceleration: KVM when `/dev/kvm` can run a guest ([`probe`] tries),
//!   else QEMU's emulation (TCG) if the operator allowed it.
//!
//! The prepare phase only makes the sandbox's directory: the guest boots in
//! [`Prepared::start`], when the template (hence the image) is known.

mod assets;
mod forward;
mod qmp;
mod vmm;
mod volumes;

use std::fs;
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use runcell_jail::InitSpec;

pub use assets::Assets;
pub use vmm::{Accel, GuestSpec, Qemu, SharedDir, Vmm};
pub use volumes::VolumeError;

use super::{
    AgentChannel, Backend, BackendError, Counters, EgressSocket, Instance, Limits, PrepareSpec,
    Prepared, RootfsSpec, StartSpec,
};

/// The name of the guest's virtio-serial port for the agent's channel.
pub const PORT_NAME: &str = "runcell.agent";
/// The name of the guest's virtio-serial port for the host's control
/// requests (`S`: flush the file systems; `R`: restart the channel;
/// `T<ns>`: set the clock; `I<id>`: the sandbox id; the agent's `vm-init`).
pub const CONTROL_PORT_NAME: &str = "runcell.ctl";
/// In the state directory: the blank disks every sandbox's chain ends in
/// (not a sandbox: its name is no sandbox id).
const BLANKS: &str = ".blank-disks";
/// In a layer directory: which of its images is the top of the chain.
const LAYER_CHAIN: &str = "chain.json";
/// In a memory image directory: the saved memory and device state.
const MEMORY_FILE: &str = "memory";
/// In a memory image directory: the machine that memory belongs to.
const MEMORY_MACHINE: &str = "machine.json";
/// How long the guest may take to flush its file systems before a save.
const SYNC_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a guest may take from launch to its agent being ready.
const BOOT_TIMEOUT: Duration = Duration::from_secs(60);
/// Guest memory below this cannot boot the kernel and agent.
const MIN_MEMORY_MIB: u64 = 128;
/// Guest memory beyond the sandbox's limit, for the guest's kernel, its
/// initramfs (the agent, in memory) and the agent: the sandbox's processes
/// are held to the limit by the guest's cgroup (`runcell.memory=`), so its
/// OOM killer, not the guest's global one, meets a memory bomb.
const GUEST_OVERHEAD_MIB: u64 = 128;
/// Where the guest mounts the template image (vm-init's `LOWER`).
const GUEST_LOWER: &str = "/run/vm/lower";
/// The guest's staging directory for the writable layer.
const GUEST_STAGE: &str = "/run/vm/stage";
/// The guest's egress socket (vm-init's `EGRESS_DIR/sock`).
const GUEST_EGRESS: &str = "/run/vm/egress/sock";

/// Errors of the microVM backend.
#[derive(Debug, thiserror::Error)]
pub enum MicrovmError {
    /// The machine cannot run microVMs as configured.
    #[error("MicroVMs are not available: {0}")]
    Unavailable(String),
    /// The guest kernel is missing.
    #[error("The microVM kernel is missing at {0} (run scripts/microvm-assets.sh).")]
    NoKernel(PathBuf),
    /// A program could not be started.
    #[error("Could not run {0}.")]
    Spawn(PathBuf, #[source] std::io::Error),
    /// The VMM refused to start the guest.
    #[error("The VMM could not start the guest: {0}")]
    VmmFailed(String),
    /// Reading or writing a boot file failed.
    #[error("Preparing the microVM's files failed while {0}.")]
    Asset(String, #[source] std::io::Error),
    /// Building a template image failed.
    #[error("Building the template's image failed: {0}")]
    ImageBuild(String),
    /// The channel to the guest failed.
    #[error("The channel to the guest failed.")]
    Channel(#[source] std::io::Error),
    /// The multiplexer failed.
    #[error("The channel to the guest failed.")]
    Mux(#[source] runcell_protocol::mux::MuxError),
    /// The guest's agent went away while it started.
    #[error("The guest's agent went away before it was ready; its console ended with: {0}")]
    AgentGone(String),
    /// The guest's agent could not build the sandbox.
    #[error("The guest could not set up the sandbox: {0}")]
    Guest(String),
    /// The guest did not become ready in time.
    #[error("The guest was not ready within {0:?}; its console ended with: {1}")]
    Timeout(Duration, String),
    /// The sandbox id is not a plain name.
    #[error("{0:?} is not a valid sandbox id.")]
    BadId(String),
    /// No running guest has this id.
    #[error("Sandbox {0} is not running.")]
    NotRunning(String),
    /// Its state file is unreadable.
    #[error("The state of sandbox {0} is unreadable.")]
    BadState(String, #[source] serde_json::Error),
    /// What the sandbox asks for is not supported in a microVM.
    #[error("MicroVM sandboxes do not support {0}.")]
    Unsupported(&'static str),
    /// Removing the sandbox's directory failed.
    #[error("Could not remove {0}.")]
    Remove(PathBuf, #[source] std::io::Error),
    /// The VMM refused or failed a request about a running guest.
    #[error("The VMM failed: {0}")]
    Vmm(String),
    /// A saved guest is not the sandbox asked for.
    #[error("The saved guest cannot start this sandbox: {0}.")]
    Mismatch(String),
    /// Saving or restoring the sandbox's state failed.
    #[error("Saving or restoring the sandbox's state failed while {0}.")]
    State(String, #[source] std::io::Error),
    /// The sandbox's volumes could not be shared with its guest.
    #[error(transparent)]
    Volume(#[from] VolumeError),
}

/// Settings of the microVM backend.
#[derive(Debug, Clone)]
pub struct MicrovmConfig {
    /// The agent binary (becomes the initramfs's `/init`).
    pub agent: PathBuf,
    /// One directory per sandbox (this backend's own, never the jail's).
    pub state_dir: PathBuf,
    /// The kernel and modules from `scripts/microvm-assets.sh`.
    pub kernel_dir: PathBuf,
    /// Initramfs and template images.
    pub cache_dir: PathBuf,
    /// QEMU.
    pub qemu: PathBuf,
    /// `qemu-img` (makes the writable disks' overlays).
    pub qemu_img: PathBuf,
    /// Run guests under emulation (TCG) when KVM cannot run them.
    pub allow_emulation: bool,
    /// The agents' log filter (`RUST_LOG` syntax), on the guest console.
    pub agent_log: Option<String>,
    /// `virtiofsd` (QEMU's C one), which serves volumes to guests.
    pub virtiofsd: PathBuf,
    /// The jail's id map: a volume's files are owned on disk by
    /// `host_base + U` for the sandbox's user `U`, whatever the isolation.
    pub id_map: runcell_jail::IdMap,
}

impl MicrovmConfig {
    /// Defaults for `agent` and `state_dir`: assets in
    /// `/var/cache/runcell/microvm`, `qemu-system-x86_64` on `PATH`.
    pub fn new(agent: PathBuf, state_dir: PathBuf, allow_emulation: bool) -> Self {
        Self {
            agent,
            state_dir,
            kernel_dir: PathBuf::from(DEFAULT_ASSETS),
            cache_dir: PathBuf::from(DEFAULT_ASSETS),
            qemu: PathBuf::from("qemu-system-x86_64"),
            qemu_img: PathBuf::from("qemu-img"),
            allow_emulation,
            agent_log: None,
            virtiofsd: PathBuf::from(DEFAULT_VIRTIOFSD),
            id_map: runcell_jail::IdMap::default(),
        }
    }
}

/// Where `scripts/microvm-assets.sh` puts the kernel by default.
pub const DEFAULT_ASSETS: &str = "/var/cache/runcell/microvm";
/// Where Debian's `qemu-system-common` installs `virtiofsd`.
pub const DEFAULT_VIRTIOFSD: &str = "/usr/lib/qemu/virtiofsd";

/// What [`probe`] found.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct MicrovmInfo {
    /// `qemu-system-x86_64 --version`'s first line.
    pub qemu_version: String,
    /// How guests run.
    pub accel: Accel,
    /// The guest kernel.
    pub kernel: PathBuf,
    /// Why KVM is not used (when `accel` is TCG).
    pub kvm_unusable: Option<String>,
}

/// Whether microVMs can run here, with the default assets and QEMU on
/// `PATH`: for `runcell doctor` and `GET /v1/system`. `Err` says why not.
pub fn probe(allow_emulation: bool) -> Result<MicrovmInfo, String> {
    probe_with(
        Path::new("qemu-system-x86_64"),
        Path::new(DEFAULT_ASSETS),
        allow_emulation,
    )
}

/// [`probe`] with a given QEMU and kernel directory.
pub fn probe_with(
    qemu: &Path,
    kernel_dir: &Path,
    allow_emulation: bool,
) -> Result<MicrovmInfo, String> {
    let version = std::process::Command::new(qemu)
        .arg("--version")
        .output()
        .map_err(|_| format!("{} is not installed", qemu.display()))?;
    let qemu_version = String::from_utf8_lossy(&version.stdout)
        .lines()
        .next()
        .unwrap_or("")
        .to_string();
    // Every guest's writable disk is a qcow2 overlay qemu-img makes.
    let qemu_img = qemu.with_file_name("qemu-img");
    let qemu_img = if qemu.components().count() > 1 {
        qemu_img
    } else {
        PathBuf::from("qemu-img")
    };
    if std::process::Command::new(&qemu_img)
        .arg("--version")
        .output()
        .is_err()
    {
        return Err(format!(
            "{} is not installed (Debian's qemu-utils)",
            qemu_img.display()
        ));
    }
    let kernel = kernel_dir.join("vmlinuz");
    if !kernel.is_file() || !kernel_dir.join("modules/order").is_file() {
        return Err(format!(
            "the guest kernel is missing in {} (run scripts/microvm-assets.sh)",
            kernel_dir.display()
        ));
    }
    match kvm_usable(qemu, &kernel) {
        Ok(()) => Ok(MicrovmInfo {
            qemu_version,
            accel: Accel::Kvm,
            kernel,
            kvm_unusable: None,
        }),
        Err(why) if allow_emulation => Ok(MicrovmInfo {
            qemu_version,
            accel: Accel::Tcg,
            kernel,
            kvm_unusable: Some(why),
        }),
        Err(why) => Err(format!(
            "/dev/kvm cannot run a guest: {why}; emulation not allowed (--allow-emulation)"
        )),
    }
}

/// How long a test guest under KVM may take to print its banner. A guest
/// that KVM runs prints it within a fraction of a second; one it cannot run
/// (this project's machines: `/dev/kvm` opens, the guest never starts)
/// prints nothing at all.
const KVM_PROBE_TIMEOUT: Duration = Duration::from_secs(4);

/// Tries KVM for real: boots the kernel with no initramfs under KVM; it
/// must get as far as printing its banner. Cached per process, and per
/// boot ([`super::probe_cache`]): either answer is kept, since a guest KVM
/// runs prints its banner well within the time allowed even on a loaded
/// machine.
fn kvm_usable(qemu: &Path, kernel: &Path) -> Result<(), String> {
    static RESULT: OnceLock<Result<(), String>> = OnceLock::new();
    RESULT
        .get_or_init(|| {
            if let Err(e) = fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open("/dev/kvm")
            {
                return Err(format!("/dev/kvm cannot be opened ({e})"));
            }
            let qemu_bin =
                runcell_jail::host_tools::find(qemu).unwrap_or_else(|| qemu.to_path_buf());
            super::probe_cache::per_boot(
                "kvm",
                &[&qemu_bin, kernel],
                |_| true,
                || boot_test_guest(qemu, kernel),
            )
        })
        .clone()
}

/// Whether a guest's memory can be saved to a file and loaded again here
/// (for hibernation with memory), tried for real once per boot
/// ([`super::probe_cache`]): a guest of the machine and devices sandboxes
/// get (virtio-blk, virtio-serial ports, PCIe over ACPI), held before its
/// first instruction, migrates to a file, and a second VMM loads it.
/// `Err` says why not.
pub fn probe_memory_save() -> Result<(), String> {
    static RESULT: OnceLock<Result<(), String>> = OnceLock::new();
    RESULT
        .get_or_init(|| {
            let qemu = Path::new("qemu-system-x86_64");
            let kernel = Path::new(DEFAULT_ASSETS).join("vmlinuz");
            if !kernel.is_file() {
                return Err(format!(
                    "the guest kernel is missing at {}",
                    kernel.display()
                ));
            }
            let qemu_bin =
                runcell_jail::host_tools::find(qemu).unwrap_or_else(|| qemu.to_path_buf());
            super::probe_cache::per_boot(
                "microvm-memory",
                &[&qemu_bin, &kernel],
                // A failure (a loaded machine, a slow start) is tried
                // again by the next daemon.
                Result::is_ok,
                || migrate_test_guest(qemu, &kernel),
            )
        })
        .clone()
}

fn migrate_test_guest(qemu: &Path, kernel: &Path) -> Result<(), String> {
    let dir = std::env::temp_dir().join(format!("runcell-vm-memory-probe-{}", std::process::id()));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).map_err(|e| format!("no temporary directory ({e})"))?;
    let result = (|| {
        let disk = dir.join("disk.raw");
        fs::write(&disk, vec![0u8; 1 << 20]).map_err(|e| format!("writing a test disk: {e}"))?;
        let image = dir.join("memory");
        let run = |monitor: &Path, incoming: Option<&Path>| {
            let mut cmd = std::process::Command::new(qemu);
            cmd.args([
                "-M",
                "microvm,pcie=on,acpi=on",
                "-accel",
                "tcg",
                "-cpu",
                "max",
            ])
            .args(["-m", "64M", "-S", "-nodefaults", "-no-user-config"])
            .args(["-display", "none", "-kernel"])
            .arg(kernel)
            .arg("-drive")
            .arg(format!(
                "id=d,file={},format=raw,if=none,readonly=on",
                disk.display()
            ))
            .args(["-device", "virtio-blk-pci,drive=d"])
            .args(["-device", "virtio-serial-pci,id=vser"])
            .args(["-chardev", "null,id=c", "-device"])
            .arg(format!(
                "virtserialport,bus=vser.0,chardev=c,name={PORT_NAME}"
            ))
            .arg("-qmp")
            .arg(format!("unix:{},server=on,wait=off", monitor.display()))
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped());
            if let Some(i) = incoming {
                cmd.arg("-incoming")
                    .arg(format!("exec:cat {}", i.display()));
            }
            cmd.spawn()
                .map_err(|e| format!("could not run {} ({e})", qemu.display()))
        };
        let wait_status = |monitor: &Path, want: &[&str]| -> Result<String, String> {
            let t0 = Instant::now();
            loop {
                let status = qmp::Qmp::connect(monitor).and_then(|mut q| q.status());
                match status {
                    Ok(s) if want.contains(&s.as_str()) => return Ok(s),
                    _ if t0.elapsed() > Duration::from_secs(10) => {
                        return Err(format!("the test guest stayed {status:?}"))
                    }
                    _ => std::thread::sleep(Duration::from_millis(20)),
                }
            }
        };
        let m1 = dir.join("q1.sock");
        let mut first = run(&m1, None)?;
        let saved = wait_status(&m1, &["prelaunch", "paused"]).and_then(|_| {
            Qemu::new(qemu.to_path_buf())
                .save_memory(&m1, &image)
                .map_err(|e| e.to_string())
        });
        let _ = first.kill();
        let _ = first.wait();
        saved?;
        let m2 = dir.join("q2.sock");
        let mut second = run(&m2, Some(&image))?;
        let loaded = wait_status(&m2, &["paused", "prelaunch", "running"]);
        let _ = second.kill();
        let _ = second.wait();
        loaded.map(drop)
    })();
    let _ = fs::remove_dir_all(&dir);
    result
}

/// Boots `kernel` under KVM with no initramfs and watches its console for
/// the banner; the guest is killed as soon as it appears.
fn boot_test_guest(qemu: &Path, kernel: &Path) -> Result<(), String> {
    let dir = tempfile_dir().map_err(|e| format!("no temporary directory ({e})"))?;
    let log = dir.join("console.log");
    let mut child = std::process::Command::new(qemu)
        .args([
            "-M", "microvm", "-accel", "kvm", "-cpu", "host", "-m", "128M",
        ])
        .args(["-nodefaults", "-no-user-config", "-display", "none"])
        .args(["-no-reboot", "-serial"])
        .arg(format!("file:{}", log.display()))
        .arg("-kernel")
        .arg(kernel)
        .args(["-append", "console=ttyS0 panic=-1 reboot=t"])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .map_err(|e| format!("could not run {} ({e})", qemu.display()))?;
    let booted = || {
        fs::read_to_string(&log)
            .unwrap_or_default()
            .contains("Linux version")
    };
    let t0 = Instant::now();
    let status = loop {
        if booted() {
            break None;
        }
        match child.try_wait() {
            Ok(Some(s)) => break Some(s),
            Ok(None) if t0.elapsed() < KVM_PROBE_TIMEOUT => {
                std::thread::sleep(Duration::from_millis(20))
            }
            _ => break None,
        }
    };
    let _ = child.kill();
    let _ = child.wait();
    let mut stderr = String::new();
    if let Some(mut e) = child.stderr.take() {
        let _ = std::io::Read::read_to_string(&mut e, &mut stderr);
    }
    let ok = booted();
    let _ = fs::remove_dir_all(&dir);
    if ok {
        return Ok(());
    }
    let why = stderr
        .lines()
        .find(|l| l.contains("error") || l.contains("failed"))
        .or_else(|| stderr.lines().next())
        .map(|l| l.trim().to_string());
    Err(match (status, why) {
        (_, Some(w)) if !w.is_empty() => format!("QEMU under KVM failed: {w}"),
        (None, _) => format!(
            "a test guest under KVM printed nothing in {} s",
            KVM_PROBE_TIMEOUT.as_secs()
        ),
        (Some(s), _) => format!("a test guest under KVM exited ({s}) before booting"),
    })
}

fn tempfile_dir() -> std::io::Result<PathBuf> {
    let dir = std::env::temp_dir().join(format!("runcell-kvm-probe-{}", std::process::id()));
    fs::create_dir_all(&dir)?;
    Ok(dir)
}

/// Sandboxes in QEMU microVMs.
#[derive(Debug, Clone)]
pub struct MicrovmBackend {
    config: MicrovmConfig,
    assets: Assets,
    vmm: Arc<dyn Vmm>,
    accel: Arc<Mutex<Option<Accel>>>,
}

impl MicrovmBackend {
    /// A backend with `config`, running guests under QEMU.
    pub fn new(config: MicrovmConfig) -> Self {
        let vmm: Arc<dyn Vmm> = Arc::new(Qemu::new(config.qemu.clone()));
        Self::with_vmm(config, vmm)
    }

    /// A backend with `config`, running guests under `vmm`.
    pub fn with_vmm(config: MicrovmConfig, vmm: Arc<dyn Vmm>) -> Self {
        let assets = Assets {
            kernel_dir: config.kernel_dir.clone(),
            cache_dir: config.cache_dir.clone(),
        };
        Self {
            config,
            assets,
            vmm,
            accel: Arc::default(),
        }
    }

    /// The directory holding one subdirectory per sandbox.
    pub fn state_dir(&self) -> &Path {
        &self.config.state_dir
    }

    /// How guests run here (probed once), or why they cannot.
    pub fn accel(&self) -> Result<Accel, MicrovmError> {
        let mut slot = self.accel.lock().expect("accel lock");
        if let Some(a) = *slot {
            return Ok(a);
        }
        let info = probe_with(
            &self.config.qemu,
            &self.config.kernel_dir,
            self.config.allow_emulation,
        )
        .map_err(MicrovmError::Unavailable)?;
        if let Some(why) = &info.kvm_unusable {
            tracing::warn!("microVMs run under emulation (TCG), slowly: {why}");
        }
        *slot = Some(info.accel);
        Ok(info.accel)
    }

    /// Stops this process's forwarder for sandbox `id`, as this process's
    /// death would: the guest's streams end (a sandbox tied to its process
    /// stops; any other keeps running and can be attached again).
    pub fn detach(&self, id: &str) -> Result<(), MicrovmError> {
        forward::stop(&self.dir(id)?);
        Ok(())
    }

    /// Builds (or finds) the image of a template, ahead of its first sandbox.
    pub fn template_image(&self, rootfs: &RootfsSpec) -> Result<PathBuf, MicrovmError> {
        self.assets.template_image(rootfs)
    }

    fn dir(&self, id: &str) -> Result<PathBuf, MicrovmError> {
        runcell_jail::check_id(id).map_err(|_| MicrovmError::BadId(id.into()))?;
        Ok(self.config.state_dir.join(id))
    }

    /// Makes the sandbox's writable disk in `dir`: a new overlay on the
    /// chain of the topmost saved layer (a fork's, a wake's, a snapshot's),
    /// else on the blank file system of `disk_bytes`.
    fn make_disk(
        &self,
        dir: &Path,
        layers: &[PathBuf],
        disk_bytes: u64,
    ) -> Result<DiskChain, MicrovmError> {
        let below = match layers.first() {
            Some(layer) => read_chain(layer)?,
            None => {
                let blank = self.assets.blank_disk(disk_bytes)?;
                let name = blank
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_default();
                // A copy beside the sandboxes (once, where the cache is on
                // another file system), so every disk links it.
                let local = self.config.state_dir.join(BLANKS).join(&name);
                if !local.is_file() {
                    let tmp = local.with_extension(format!("tmp-{}", std::process::id()));
                    fs::create_dir_all(self.config.state_dir.join(BLANKS)).map_err(|e| {
                        MicrovmError::State("making the blank disks' directory".into(), e)
                    })?;
                    let _ = fs::remove_file(&tmp);
                    link_or_copy(&blank, &tmp)?;
                    fs::rename(&tmp, &local).map_err(|e| {
                        MicrovmError::State(format!("publishing {}", local.display()), e)
                    })?;
                }
                link_or_copy(&local, &dir.join(&name))?;
                vec![name]
            }
        };
        if let Some(layer) = layers.first() {
            for f in &below {
                link_or_copy(&layer.join(f), &dir.join(f))?;
            }
        }
        let base = &below[0];
        let size = assets::image_size(&dir.join(base))?;
        let format = if base.ends_with(".qcow2") {
            "qcow2"
        } else {
            "raw"
        };
        let top = format!("{}.qcow2", uuid::Uuid::new_v4());
        assets::create_overlay(
            &self.config.qemu_img,
            &dir.join(&top),
            Path::new(base),
            format,
            size,
        )?;
        let mut files = vec![top];
        files.extend(below);
        Ok(DiskChain {
            files,
            node: "w0".into(),
            next: 1,
        })
    }

    fn boot(
        &self,
        prepared: &MicrovmPrepared,
        spec: &StartSpec,
    ) -> Result<VmInstance, MicrovmError> {
        let t0 = Instant::now();
        let accel = self.accel()?;
        let dir = prepared.dir.clone();
        let disk = self.make_disk(&dir, &spec.state_layers, spec.limits.disk_bytes)?;
        if let Some(image) = &spec.memory_image {
            if !spec.mounts.is_empty() {
                return Err(MicrovmError::Unsupported(
                    "restoring the memory of a guest with volumes",
                ));
            }
            return self.restore(prepared, spec, image, disk, accel);
        }
        if spec.mounts.is_empty() {
            return self.boot_on(prepared, spec, disk, accel, t0, &[]);
        }
        let shared = volumes::start(
            &dir,
            &spec.mounts,
            self.config.id_map,
            &self.config.virtiofsd,
            |name| socket_path(&dir, name),
        )?;
        let booted = self.boot_on(prepared, spec, disk, accel, t0, &shared);
        match &booted {
            // Each virtiofsd has its own copy of its bind by now (the
            // guest mounted every volume before its agent was ready).
            Ok(_) => volumes::detach_stage(&dir),
            Err(_) => volumes::stop(&dir),
        }
        booted
    }

    /// Boots the guest of `prepared` on `disk`, with `shared` directories.
    fn boot_on(
        &self,
        prepared: &MicrovmPrepared,
        spec: &StartSpec,
        disk: DiskChain,
        accel: Accel,
        t0: Instant,
        shared: &[SharedDir],
    ) -> Result<VmInstance, MicrovmError> {
        let dir = prepared.dir.clone();
        let id = prepared.id.clone();
        let limits = spec.limits;
        let image = self.assets.template_image(&spec.rootfs)?;
        let initramfs = self.assets.initramfs(&self.config.agent)?;
        let t_assets = t0.elapsed();

        // The host proxy's end of egress: bound here, served by the runtime.
        let egress = match spec.egress {
            EgressSocket::Socket { enabled } if !prepared.host_network => {
                let sockets = dir.join("egress");
                fs::create_dir_all(&sockets).map_err(|e| {
                    MicrovmError::Asset(format!("creating {}", sockets.display()), e)
                })?;
                Some((bind_egress(&sockets)?, enabled))
            }
            _ => None,
        };
        let init = InitSpec {
            sandbox_id: id.clone(),
            hostname: "sandbox".into(),
            staging_dir: PathBuf::from(GUEST_STAGE),
            rootfs: RootfsSpec::Directory {
                path: PathBuf::from(GUEST_LOWER),
            },
            disk_bytes: limits.disk_bytes,
            user: spec.user.clone(),
            exit_on_host_close: spec.tied_to_process,
            deadline_unix_ms: spec.deadline_unix_ms,
            host_network: false,
            env: spec.env.clone(),
            workdir: spec.workdir.clone(),
            egress_socket: egress.as_ref().map(|_| PathBuf::from(GUEST_EGRESS)),
            egress_enabled: egress.as_ref().is_some_and(|(_, on)| *on),
            // Saved files are the writable disk's chain (`make_disk`).
            state_layers: Vec::new(),
            // Volumes: vm-init mounts the nth shared directory (its tag)
            // at the nth source, and the jail's setup binds it in.
            mounts: spec
                .mounts
                .iter()
                .enumerate()
                .map(|(n, m)| runcell_jail::BindMount {
                    source: Path::new(volumes::GUEST_VOLUMES).join(n.to_string()),
                    target: m.target.clone(),
                    read_only: m.read_only,
                })
                .collect(),
            ahead: false,
        };
        let spec_json = serde_json::to_vec(&init).unwrap_or_default();

        let (memory_mib, vcpus) = guest_size(&limits);
        let mut cmdline = String::from(
            "console=ttyS0 panic=-1 reboot=t quiet loglevel=3 random.trust_cpu=on \
             tsc=reliable no_timer_check",
        );
        // microvm has no HPET, and under emulation calibrating the TSC
        // against the PIT fails now and then, which hangs the boot: give
        // the kernel the host's TSC rate (what QEMU's guests read).
        // The process and memory limits, applied by the guest's init
        // (vm-init) to the guest cgroup it and the sandbox live in.
        cmdline.push_str(&limit_args(&limits));
        if let Some(khz) = host_tsc_khz() {
            cmdline.push_str(&format!(" tsc_early_khz={khz}"));
        }
        if let Some(filter) = &self.config.agent_log {
            if !filter.contains(char::is_whitespace) {
                cmdline.push_str(&format!(" RUST_LOG={filter}"));
            }
        }
        // The writable disk, mounted by vm-init as the staging directory.
        cmdline.push_str(" runcell.disk=vdb");
        cmdline.push_str(" -- vm-init");
        let machine = Machine {
            kernel: self.assets.kernel(),
            initramfs,
            cmdline,
            root_image: image,
            memory_mib,
            vcpus,
        };
        let channel = channel_path(&dir)?;
        let pid = self.launch(&dir, &machine, &disk, accel, None, shared)?;
        let state = StateFile {
            id: id.clone(),
            pid,
            vmm: self.vmm.name().to_string(),
            accel,
            memory_mib,
            vcpus,
            machine: Some(machine),
            disk: Some(disk.clone()),
            volumes: shared.len(),
        };
        state.write(&dir)?;
        let t_launch = t0.elapsed();
        let forwarder = forward::start(forward::ForwardConfig {
            dir: dir.clone(),
            channel,
            spec: Some(spec_json),
            timeout: BOOT_TIMEOUT,
            kick: None,
        });
        let forwarder = match forwarder {
            Ok(f) => f,
            Err(e) => {
                kill_vm(&dir, pid);
                return Err(e);
            }
        };
        tracing::info!(
            sandbox = %id,
            accel = accel.as_str(),
            assets_ms = runcell_protocol::units::millis(t_assets),
            launch_ms = runcell_protocol::units::millis(t_launch - t_assets),
            boot_ms = runcell_protocol::units::millis(t0.elapsed() - t_launch),
            "microvm ready"
        );
        Ok(VmInstance::new(
            self,
            id,
            dir,
            pid,
            egress.map(|(l, _)| l),
            spec.tied_to_process,
            forwarder,
            Some(disk),
            false,
        ))
    }

    /// Launches the guest `machine` in `dir` on `disk`, from the memory
    /// image `incoming` if given (then paused).
    fn launch(
        &self,
        dir: &Path,
        machine: &Machine,
        disk: &DiskChain,
        accel: Accel,
        incoming: Option<&Path>,
        shared_dirs: &[SharedDir],
    ) -> Result<i32, MicrovmError> {
        self.vmm.launch(&GuestSpec {
            kernel: &machine.kernel,
            initramfs: &machine.initramfs,
            cmdline: &machine.cmdline,
            root_image: &machine.root_image,
            memory_mib: machine.memory_mib,
            vcpus: machine.vcpus,
            channel: &channel_path(dir)?,
            console_log: &dir.join("console.log"),
            pidfile: &dir.join("qemu.pid"),
            accel,
            disk: Some((&dir.join(&disk.files[0]), &disk.node)),
            control: &socket_path(dir, "ctl.sock")?,
            monitor: &socket_path(dir, "qmp.sock")?,
            incoming,
            shared_dirs,
        })
    }

    /// Starts the guest saved in the memory image `image` (on `disk`, whose
    /// content is what it had then): the same machine, its memory loaded,
    /// continued, and its agent's channel taken up as after a restart.
    fn restore(
        &self,
        prepared: &MicrovmPrepared,
        spec: &StartSpec,
        image: &Path,
        disk: DiskChain,
        accel: Accel,
    ) -> Result<VmInstance, MicrovmError> {
        let t0 = Instant::now();
        let dir = prepared.dir.clone();
        let raw = fs::read(image.join(MEMORY_MACHINE))
            .map_err(|e| MicrovmError::State("reading the saved machine".into(), e))?;
        let machine: Machine = serde_json::from_slice(&raw)
            .map_err(|e| MicrovmError::BadState(prepared.id.clone(), e))?;
        // A fork, a snapshot's sandbox or a wake runs with the limits it
        // was saved with: only a sandbox that asks for the same takes it.
        if let Some(why) = limits_differ(&machine, &spec.limits) {
            return Err(MicrovmError::Mismatch(why));
        }
        for f in [&machine.kernel, &machine.initramfs, &machine.root_image] {
            if !f.is_file() {
                return Err(MicrovmError::State(
                    format!("finding {} (the saved guest's)", f.display()),
                    std::io::ErrorKind::NotFound.into(),
                ));
            }
        }
        let egress = match spec.egress {
            EgressSocket::Socket { .. } if !prepared.host_network => {
                let sockets = dir.join("egress");
                fs::create_dir_all(&sockets).map_err(|e| {
                    MicrovmError::Asset(format!("creating {}", sockets.display()), e)
                })?;
                Some(bind_egress(&sockets)?)
            }
            _ => None,
        };
        let pid = self.launch(
            &dir,
            &machine,
            &disk,
            accel,
            Some(&image.join(MEMORY_FILE)),
            &[],
        )?;
        let state = StateFile {
            id: prepared.id.clone(),
            pid,
            vmm: self.vmm.name().to_string(),
            accel,
            memory_mib: machine.memory_mib,
            vcpus: machine.vcpus,
            machine: Some(machine),
            disk: Some(disk.clone()),
            volumes: 0,
        };
        let started = state.write(&dir).and_then(|()| {
            self.vmm.resume(&socket_path(&dir, "qmp.sock")?)?;
            forward::start(forward::ForwardConfig {
                dir: dir.clone(),
                channel: channel_path(&dir)?,
                spec: None,
                timeout: Duration::from_secs(10),
                kick: Some(socket_path(&dir, "ctl.sock")?),
            })
        });
        let forwarder = match started {
            Ok(f) => f,
            Err(e) => {
                kill_vm(&dir, pid);
                return Err(e);
            }
        };
        tracing::info!(
            sandbox = %prepared.id,
            ms = runcell_protocol::units::millis(t0.elapsed()),
            "microvm restored from its memory image"
        );
        Ok(VmInstance::new(
            self,
            prepared.id.clone(),
            dir,
            pid,
            egress,
            spec.tied_to_process,
            forwarder,
            Some(disk),
            false,
        ))
    }
}

/// A guest's RAM (MiB) and vCPUs for `limits`.
fn guest_size(limits: &Limits) -> (u64, u32) {
    let memory_mib = limits
        .memory_bytes
        .div_ceil(1 << 20)
        .saturating_add(GUEST_OVERHEAD_MIB)
        .max(MIN_MEMORY_MIB);
    let host_cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let vcpus = u32::try_from(limits.cpu_millis.div_ceil(1000).max(1))
        .unwrap_or(1)
        .min(u32::try_from(host_cpus).unwrap_or(1));
    (memory_mib, vcpus)
}

/// The kernel command line's limits, applied by the guest's init
/// (vm-init) to the guest cgroup it and the sandbox live in.
fn limit_args(limits: &Limits) -> String {
    format!(
        " runcell.pids={} runcell.memory={}",
        limits.pids, limits.memory_bytes
    )
}

/// Why a guest saved as `machine` cannot become a sandbox with `limits`
/// (its RAM, vCPUs and cgroup limits are the saved guest's), if it cannot.
fn limits_differ(machine: &Machine, limits: &Limits) -> Option<String> {
    let (memory_mib, vcpus) = guest_size(limits);
    if machine.memory_mib != memory_mib || machine.vcpus != vcpus {
        return Some(format!(
            "the saved guest has {} MiB and {} vCPUs, this sandbox {memory_mib} MiB and {vcpus}",
            machine.memory_mib, machine.vcpus
        ));
    }
    let args = limit_args(limits);
    if !machine.cmdline.contains(&format!("{args} ")) {
        return Some(format!(
            "the saved guest's limits are not this sandbox's ({})",
            args.trim()
        ));
    }
    None
}

/// The host CPU's clock rate in kHz, from `/proc/cpuinfo`.
fn host_tsc_khz() -> Option<u64> {
    let info = fs::read_to_string("/proc/cpuinfo").ok()?;
    let mhz = info
        .lines()
        .find(|l| l.starts_with("cpu MHz"))?
        .split(':')
        .nth(1)?
        .trim();
    let (whole, frac) = mhz.split_once('.').unwrap_or((mhz, "0"));
    let frac: String = frac.chars().chain("000".chars()).take(3).collect();
    let khz = whole.parse::<u64>().ok()? * 1000 + frac.parse::<u64>().ok()?;
    (khz > 0).then_some(khz)
}

/// What `vm.json` records.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct StateFile {
    id: String,
    pid: i32,
    vmm: String,
    accel: Accel,
    memory_mib: u64,
    vcpus: u32,
    /// The machine it runs (absent: made by an older version).
    #[serde(default)]
    machine: Option<Machine>,
    /// Its writable disk (absent: an older version's guest, whose
    /// writable layer is a tmpfs in its memory).
    #[serde(default)]
    disk: Option<DiskChain>,
    /// How many volumes it has (each a virtiofsd; its memory cannot be
    /// saved).
    #[serde(default)]
    volumes: usize,
}

impl StateFile {
    fn write(&self, dir: &Path) -> Result<(), MicrovmError> {
        let tmp = dir.join("vm.json.tmp");
        fs::write(&tmp, serde_json::to_vec(self).unwrap_or_default())
            .and_then(|()| fs::rename(&tmp, dir.join("vm.json")))
            .map_err(|e| MicrovmError::Asset("writing vm.json".into(), e))
    }

    fn read(dir: &Path, id: &str) -> Result<Self, MicrovmError> {
        let raw = fs::read(dir.join("vm.json")).map_err(|_| MicrovmError::NotRunning(id.into()))?;
        serde_json::from_slice(&raw).map_err(|e| MicrovmError::BadState(id.into(), e))
    }
}

/// What a guest boots (a restore must launch the same machine).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
struct Machine {
    kernel: PathBuf,
    initramfs: PathBuf,
    cmdline: String,
    root_image: PathBuf,
    memory_mib: u64,
    vcpus: u32,
}

/// A writable disk: image file names in the sandbox's (or a layer's)
/// directory, the one the guest writes to first, each backed by the next
/// (the last is a blank file system, raw), and the VMM's node name of the
/// first.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
struct DiskChain {
    files: Vec<String>,
    node: String,
    /// The number of the next node name (`w<next>`).
    next: u32,
}

/// The chain of images a saved layer holds, top first.
fn read_chain(layer: &Path) -> Result<Vec<String>, MicrovmError> {
    let raw = fs::read(layer.join(LAYER_CHAIN)).map_err(|e| {
        if e.kind() == std::io::ErrorKind::NotFound {
            MicrovmError::Unsupported("starting from files another isolation saved")
        } else {
            MicrovmError::State(format!("reading {}", layer.display()), e)
        }
    })?;
    let files: Vec<String> = serde_json::from_slice(&raw).map_err(|e| {
        MicrovmError::State("decoding a layer's chain".into(), std::io::Error::other(e))
    })?;
    let plain = |f: &String| !f.is_empty() && !f.contains('/') && f != "." && f != "..";
    if files.is_empty() || !files.iter().all(plain) {
        return Err(MicrovmError::State(
            format!("reading {}", layer.display()),
            std::io::ErrorKind::InvalidData.into(),
        ));
    }
    Ok(files)
}

/// Hard-links `from` at `to` (the images are never written once shared),
/// or where they are on different file systems, copies it (sparse,
/// reflinked where the file system can).
fn link_or_copy(from: &Path, to: &Path) -> Result<(), MicrovmError> {
    match fs::hard_link(from, to) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) if e.raw_os_error() == Some(nix::libc::EXDEV) => {
            let ok = runcell_jail::host_tools::command("cp")
                .args(["--reflink=auto", "--sparse=always"])
                .arg(from)
                .arg(to)
                .status()
                .is_ok_and(|s| s.success());
            if ok {
                Ok(())
            } else {
                Err(MicrovmError::State(
                    format!("copying {}", from.display()),
                    e,
                ))
            }
        }
        Err(e) => Err(MicrovmError::State(
            format!("linking {}", from.display()),
            e,
        )),
    }
}

/// Bytes a file takes on disk.
fn allocated(path: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    fs::metadata(path).map_or(0, |m| m.blocks().saturating_mul(512))
}

/// Asks the guest over its control port to flush its file systems, and
/// waits (up to [`SYNC_TIMEOUT`]) for its answer.
fn guest_sync(dir: &Path) -> Result<(), MicrovmError> {
    use std::io::{Read, Write};
    let path = socket_path(dir, "ctl.sock")?;
    let short = runcell_jail::socket::SocketPath::new(&path).map_err(MicrovmError::Channel)?;
    let mut s =
        std::os::unix::net::UnixStream::connect(short.path()).map_err(MicrovmError::Channel)?;
    s.set_read_timeout(Some(SYNC_TIMEOUT))
        .map_err(MicrovmError::Channel)?;
    s.write_all(b"S").map_err(MicrovmError::Channel)?;
    let mut answer = [0u8; 1];
    s.read_exact(&mut answer).map_err(MicrovmError::Channel)?;
    Ok(())
}

/// The control request that sets the guest's clock to the host's now:
/// `T<nanoseconds since the epoch>\n` (see the agent's `control_loop`).
pub(crate) fn clock_request() -> String {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    format!("T{}\n", now.as_nanos())
}

/// Sets the guest's clock to the host's, which stood still while the
/// guest was stopped (a pause, a save). A guest whose agent cannot (an
/// older one ignores the request) keeps its own; that is logged, not an
/// error.
fn guest_set_clock(dir: &Path) {
    use std::io::{Read, Write};
    let attempt = || -> std::io::Result<()> {
        let path = socket_path(dir, "ctl.sock").map_err(std::io::Error::other)?;
        let short = runcell_jail::socket::SocketPath::new(&path)?;
        let mut s = std::os::unix::net::UnixStream::connect(short.path())?;
        s.set_read_timeout(Some(Duration::from_secs(1)))?;
        s.write_all(clock_request().as_bytes())?;
        let mut answer = [0u8; 1];
        s.read_exact(&mut answer)
    };
    if let Err(e) = attempt() {
        tracing::debug!("microvm: the guest's clock was not set: {e}");
    }
}

/// Whether `pid` is the VMM of the sandbox in `dir` (its command line
/// names the sandbox's pidfile: immune to pid reuse).
fn is_our_vmm(dir: &Path, pid: i32) -> bool {
    let Ok(cmdline) = fs::read(format!("/proc/{pid}/cmdline")) else {
        return false;
    };
    let needle = dir.join("qemu.pid");
    let needle = needle.as_os_str().as_encoded_bytes();
    let running = fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| s.rsplit_once(')').map(|(_, rest)| rest.trim().to_string()))
        .is_some_and(|rest| !rest.starts_with('Z'));
    running && cmdline.windows(needle.len()).any(|w| w == needle)
}

/// The VMM pid recorded in `dir`, if that process still runs it.
fn running_pid(dir: &Path) -> Option<i32> {
    vmm::read_pidfile(&dir.join("qemu.pid")).filter(|&pid| is_our_vmm(dir, pid))
}

/// Kills the VMM of `dir` and waits (up to 5 s) until it is gone, and
/// its volumes' virtiofsd processes with it.
fn kill_vm(dir: &Path, pid: i32) {
    forward::stop(dir);
    if volumes::has_volumes(dir) {
        kill_only_vm(dir, pid);
        volumes::stop(dir);
    } else {
        kill_only_vm(dir, pid);
    }
}

fn kill_only_vm(dir: &Path, pid: i32) {
    if !is_our_vmm(dir, pid) {
        return;
    }
    let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::SIGKILL);
    let t0 = Instant::now();
    while is_our_vmm(dir, pid) && t0.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Where short links to sandbox directories live, for the VMM's socket.
const SHORT_LINKS: &str = "/run/runcell/vm-links";

/// The path the VMM binds its channel socket at: `<dir>/vm.sock`, or where
/// that is longer than `sun_path` holds (a deep data directory), the same
/// socket through a short link to `dir` (the VMM binds a path it is given;
/// the socket itself lands in `dir`).
fn channel_path(dir: &Path) -> Result<PathBuf, MicrovmError> {
    socket_path(dir, "vm.sock")
}

/// The path of the socket `name` in `dir` the VMM binds (see
/// [`channel_path`]).
fn socket_path(dir: &Path, name: &str) -> Result<PathBuf, MicrovmError> {
    let full = dir.join(name);
    if full.as_os_str().len() <= runcell_jail::socket::MAX_SOCKET_PATH {
        return Ok(full);
    }
    let id = dir.file_name().unwrap_or_default();
    let links = Path::new(SHORT_LINKS);
    let link = links.join(id);
    fs::create_dir_all(links)
        .and_then(|()| {
            let _ = fs::remove_file(&link);
            std::os::unix::fs::symlink(dir, &link)
        })
        .map_err(|e| MicrovmError::Asset(format!("linking {}", link.display()), e))?;
    Ok(link.join(name))
}

fn remove_dir(dir: &Path) -> Result<(), MicrovmError> {
    // No virtiofsd and no bind of a volume outlives the sandbox.
    if volumes::has_volumes(dir) {
        volumes::stop(dir);
    }
    if let Some(name) = dir.file_name() {
        let _ = fs::remove_file(Path::new(SHORT_LINKS).join(name));
    }
    match fs::remove_dir_all(dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(MicrovmError::Remove(dir.to_path_buf(), e)),
    }
}

fn bind_egress(sockets: &Path) -> Result<UnixListener, MicrovmError> {
    use std::os::unix::fs::PermissionsExt;
    let path = sockets.join("sock");
    let _ = fs::remove_file(&path);
    let listener = runcell_jail::socket::bind(&path)
        .map_err(|e| MicrovmError::Asset(format!("binding {}", path.display()), e))?;
    fs::set_permissions(&path, fs::Permissions::from_mode(0o600))
        .map_err(|e| MicrovmError::Asset(format!("securing {}", path.display()), e))?;
    Ok(listener)
}

impl Backend for MicrovmBackend {
    fn isolation(&self) -> super::Isolation {
        super::Isolation::Microvm
    }

    fn prepare(&self, spec: &PrepareSpec) -> Result<Box<dyn Prepared>, BackendError> {
        self.accel()?;
        let dir = self.dir(&spec.id)?;
        fs::create_dir_all(&dir)
            .map_err(|e| MicrovmError::Asset(format!("creating {}", dir.display()), e))?;
        // Its sockets (the agent's, QEMU's end of the port, egress) are the
        // host's alone.
        {
            use std::os::unix::fs::PermissionsExt;
            fs::set_permissions(&dir, fs::Permissions::from_mode(0o700))
                .map_err(|e| MicrovmError::Asset(format!("securing {}", dir.display()), e))?;
        }
        Ok(Box::new(MicrovmPrepared {
            backend: self.clone(),
            id: spec.id.clone(),
            dir,
            limits: Mutex::new(spec.limits),
            prepared_limits: spec.limits,
            host_network: spec.host_network,
            started: false,
        }))
    }

    fn attach(&self, id: &str) -> Result<Box<dyn Instance>, BackendError> {
        let dir = self.dir(id)?;
        let state = StateFile::read(&dir, id)?;
        if !is_our_vmm(&dir, state.pid) {
            return Err(MicrovmError::NotRunning(id.into()).into());
        }
        let forwarder = forward::start(forward::ForwardConfig {
            dir: dir.clone(),
            channel: channel_path(&dir)?,
            spec: None,
            timeout: Duration::from_secs(5),
            kick: None,
        })?;
        let monitor = socket_path(&dir, "qmp.sock").ok();
        let paused = monitor
            .as_deref()
            .and_then(|m| self.vmm.is_paused(m))
            .unwrap_or(false);
        // A host that died while switching the guest to a new overlay may
        // have left the record one image behind: the VMM knows.
        let mut state = state;
        if let (Some(chain), Some((node, file))) = (
            state.disk.as_mut(),
            monitor.as_deref().and_then(|m| self.vmm.active_disk(m)),
        ) {
            let name = file
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            if node != chain.node && !chain.files.contains(&name) && dir.join(&name).is_file() {
                tracing::warn!(sandbox = %id, "its disk record was one save behind; put right");
                chain.files.insert(0, name);
                chain.next = chain
                    .next
                    .max(node.trim_start_matches('w').parse::<u32>().unwrap_or(0) + 1);
                chain.node = node;
                state.write(&dir)?;
            }
        }
        Ok(Box::new(VmInstance::new(
            self,
            id.into(),
            dir,
            state.pid,
            None,
            false,
            forwarder,
            state.disk,
            paused,
        )))
    }

    fn list(&self) -> Vec<String> {
        let Ok(entries) = fs::read_dir(&self.config.state_dir) else {
            return Vec::new();
        };
        let mut ids: Vec<String> = entries
            .flatten()
            .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
            .filter_map(|e| e.file_name().into_string().ok())
            .filter(|id| runcell_jail::check_id(id).is_ok())
            .collect();
        ids.sort();
        ids
    }

    fn is_dead(&self, id: &str, grace: Duration) -> bool {
        let Ok(dir) = self.dir(id) else {
            return false;
        };
        if running_pid(&dir).is_some() {
            return false;
        }
        if dir.join("vm.json").exists() {
            return true;
        }
        fs::metadata(&dir)
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| t.elapsed().ok())
            .is_some_and(|age| age > grace)
    }

    fn remove(&self, id: &str) -> Result<(), BackendError> {
        let dir = self.dir(id)?;
        if let Some(pid) = running_pid(&dir) {
            kill_vm(&dir, pid);
        } else {
            forward::stop(&dir);
        }
        Ok(remove_dir(&dir)?)
    }
}

/// A sandbox whose directory exists; its guest boots in `start`.
#[derive(Debug)]
struct MicrovmPrepared {
    backend: MicrovmBackend,
    id: String,
    dir: PathBuf,
    limits: Mutex<Limits>,
    prepared_limits: Limits,
    host_network: bool,
    started: bool,
}

impl Prepared for MicrovmPrepared {
    fn id(&self) -> &str {
        &self.id
    }

    fn set_limits(&self, limits: &Limits) -> Result<(), BackendError> {
        *self.limits.lock().expect("limits lock") = *limits;
        Ok(())
    }

    fn reset_limits(&self) -> Result<(), BackendError> {
        *self.limits.lock().expect("limits lock") = self.prepared_limits;
        Ok(())
    }

    fn is_alive(&self) -> bool {
        self.dir.is_dir()
    }

    fn start(mut self: Box<Self>, spec: &StartSpec) -> Result<Box<dyn Instance>, BackendError> {
        let backend = self.backend.clone();
        match backend.boot(&self, spec) {
            Ok(vm) => {
                self.started = true;
                Ok(Box::new(vm))
            }
            Err(MicrovmError::AgentGone(_)) => {
                Err(MicrovmError::AgentGone(console_tail(&self.dir)).into())
            }
            Err(MicrovmError::Timeout(t, _)) => {
                Err(MicrovmError::Timeout(t, console_tail(&self.dir)).into())
            }
            Err(e) => {
                tracing::warn!(sandbox = %self.id, "microvm failed to start: {e}; console: {}",
                    console_tail(&self.dir));
                Err(e.into())
            }
        }
    }
}

/// The last lines of a guest's console that are not kernel messages (the
/// agent's), and the kernel's panic line, for error reports.
fn console_tail(dir: &Path) -> String {
    let text = fs::read_to_string(dir.join("console.log")).unwrap_or_default();
    let mut lines: Vec<&str> = text
        .lines()
        .filter(|l| !l.starts_with('[') || l.contains("Kernel panic"))
        .collect();
    if lines.is_empty() {
        lines = text.lines().collect();
    }
    lines[lines.len().saturating_sub(6)..].join(" | ")
}

impl Drop for MicrovmPrepared {
    fn drop(&mut self) {
        if !self.started {
            if let Some(pid) = running_pid(&self.dir) {
                kill_vm(&self.dir, pid);
            }
            let _ = remove_dir(&self.dir);
        }
    }
}

/// A running guest, host side.
#[derive(Debug)]
struct VmInstance {
    id: String,
    dir: PathBuf,
    pid: i32,
    egress: Option<UnixListener>,
    tied: bool,
    _forwarder: Option<Arc<forward::Forwarder>>,
    vmm: Arc<dyn Vmm>,
    qemu_img: PathBuf,
    /// Its writable disk (`None`: an older version's guest).
    disk: Mutex<Option<DiskChain>>,
    /// Its vCPUs are stopped (pause, or a save under way).
    paused: AtomicBool,
    /// Its memory was saved and its VMM ended ([`Instance::checkpoint`]).
    saved: AtomicBool,
}

impl VmInstance {
    #[allow(clippy::too_many_arguments)]
    fn new(
        backend: &MicrovmBackend,
        id: String,
        dir: PathBuf,
        pid: i32,
        egress: Option<UnixListener>,
        tied: bool,
        forwarder: Arc<forward::Forwarder>,
        disk: Option<DiskChain>,
        paused: bool,
    ) -> Self {
        Self {
            id,
            dir,
            pid,
            egress,
            tied,
            _forwarder: Some(forwarder),
            vmm: backend.vmm.clone(),
            qemu_img: backend.config.qemu_img.clone(),
            disk: Mutex::new(disk),
            paused: AtomicBool::new(paused),
            saved: AtomicBool::new(false),
        }
    }

    fn monitor(&self) -> Result<PathBuf, MicrovmError> {
        socket_path(&self.dir, "qmp.sock")
    }

    /// Flushes the guest's file systems, then stops it.
    fn stop(&self) -> Result<(), MicrovmError> {
        if let Err(e) = guest_sync(&self.dir) {
            tracing::warn!(sandbox = %self.id, "the guest did not flush its files before the pause: {e}");
        }
        self.vmm.pause(&self.monitor()?)?;
        self.paused.store(true, Ordering::SeqCst);
        Ok(())
    }

    /// Links the disk's whole chain into `dest` and names its top.
    fn link_chain(&self, chain: &DiskChain, dest: &Path) -> Result<u64, MicrovmError> {
        for f in &chain.files {
            link_or_copy(&self.dir.join(f), &dest.join(f))?;
        }
        fs::write(
            dest.join(LAYER_CHAIN),
            serde_json::to_vec(&chain.files).unwrap_or_default(),
        )
        .map_err(|e| MicrovmError::State(format!("writing {}", dest.display()), e))?;
        Ok(allocated(&dest.join(&chain.files[0])))
    }

    fn save_disk(&self, dest: &Path) -> Result<u64, MicrovmError> {
        let mut slot = self.disk.lock().expect("disk lock");
        let Some(chain) = slot.clone() else {
            return Err(MicrovmError::Unsupported(
                "saving files in a guest an older version started (its files are in its memory)",
            ));
        };
        fs::create_dir(dest)
            .map_err(|e| MicrovmError::State(format!("creating {}", dest.display()), e))?;
        let bytes = self.link_chain(&chain, dest)?;
        if self.saved.load(Ordering::SeqCst) || !is_our_vmm(&self.dir, self.pid) {
            // Nothing writes to it any more.
            return Ok(bytes);
        }
        // The guest goes on on a new overlay; the image just linked is
        // read-only from now on.
        let top = format!("{}.qcow2", uuid::Uuid::new_v4());
        let size = assets::image_size(&self.dir.join(&chain.files[0]))?;
        assets::create_overlay(
            &self.qemu_img,
            &self.dir.join(&top),
            Path::new(&chain.files[0]),
            "qcow2",
            size,
        )?;
        let node = format!("w{}", chain.next);
        if let Err(e) =
            self.vmm
                .switch_disk(&self.monitor()?, &chain.node, &node, &self.dir.join(&top))
        {
            let _ = fs::remove_file(self.dir.join(&top));
            return Err(e);
        }
        let mut files = vec![top];
        files.extend(chain.files.iter().cloned());
        let next = DiskChain {
            files,
            node,
            next: chain.next + 1,
        };
        *slot = Some(next.clone());
        drop(slot);
        if let Ok(mut state) = StateFile::read(&self.dir, &self.id) {
            state.disk = Some(next);
            state.write(&self.dir)?;
        }
        Ok(bytes)
    }

    /// Saves the running guest's files into `layer` and its memory into
    /// `image`, of one instant, and runs it on: stopped and flushed, its
    /// disk chain linked and switched to a new overlay, its memory migrated
    /// (QEMU leaves the source stopped, its disks released), then continued
    /// (`cont` takes the disks back). Its agent's channel never closed.
    fn save_and_run_on(&self, image: &Path, layer: &Path) -> Result<u64, MicrovmError> {
        let t0 = Instant::now();
        let machine = self.machine_for_memory()?;
        self.stop()?;
        let saved = self.save_disk(layer).and_then(|bytes| {
            let t_disk = t0.elapsed();
            self.write_memory(image, &machine)?;
            Ok((bytes, t_disk))
        });
        let t_memory = t0.elapsed();
        // Whatever came of it, the guest runs on (with its memory).
        let resumed = self.vmm.resume(&self.monitor()?);
        if resumed.is_ok() {
            self.paused.store(false, Ordering::SeqCst);
            guest_set_clock(&self.dir);
        }
        let (bytes, t_disk) = saved?;
        resumed?;
        tracing::debug!(
            sandbox = %self.id,
            disk_us = runcell_protocol::units::micros(t_disk),
            memory_us = runcell_protocol::units::micros(t_memory - t_disk),
            resume_us = runcell_protocol::units::micros(t0.elapsed() - t_memory),
            image_bytes = allocated(&image.join(MEMORY_FILE)),
            "microvm saved and running on"
        );
        Ok(bytes)
    }

    /// The machine a memory image of this guest records, or why none can
    /// be taken.
    fn machine_for_memory(&self) -> Result<Machine, MicrovmError> {
        let state = StateFile::read(&self.dir, &self.id)?;
        let Some(machine) = state.machine else {
            return Err(MicrovmError::Unsupported(
                "saving the memory of a guest an older version started",
            ));
        };
        if self.disk.lock().expect("disk lock").is_none() {
            return Err(MicrovmError::Unsupported(
                "saving the memory of a guest an older version started",
            ));
        }
        // QEMU refuses to migrate a guest with vhost-user-fs devices.
        if state.volumes > 0 {
            return Err(MicrovmError::Unsupported(
                "saving the memory of a guest with volumes (QEMU cannot migrate its virtio-fs devices)",
            ));
        }
        Ok(machine)
    }

    /// Migrates the stopped guest's memory into the new directory `image`
    /// with the machine it belongs to.
    fn write_memory(&self, image: &Path, machine: &Machine) -> Result<(), MicrovmError> {
        fs::create_dir_all(image)
            .map_err(|e| MicrovmError::State(format!("creating {}", image.display()), e))?;
        fs::write(
            image.join(MEMORY_MACHINE),
            serde_json::to_vec(machine).unwrap_or_default(),
        )
        .map_err(|e| MicrovmError::State(format!("writing {}", image.display()), e))?;
        self.vmm
            .save_memory(&self.monitor()?, &image.join(MEMORY_FILE))
    }

    fn save_memory(&self, image: &Path) -> Result<(), MicrovmError> {
        let machine = self.machine_for_memory()?;
        if !self.paused.load(Ordering::SeqCst) {
            self.stop()?;
        }
        self.write_memory(image, &machine)?;
        // The memory is saved: this guest must not run on (its disk is
        // what the image goes with).
        self.saved.store(true, Ordering::SeqCst);
        kill_vm(&self.dir, self.pid);
        Ok(())
    }
}

impl Instance for VmInstance {
    fn isolation(&self) -> super::Isolation {
        super::Isolation::Microvm
    }

    fn id(&self) -> &str {
        &self.id
    }

    fn pid(&self) -> i32 {
        self.pid
    }

    fn agent_channel(&self) -> AgentChannel {
        AgentChannel::Unix(self.dir.join("agent.sock"))
    }

    fn take_egress_listener(&mut self) -> Option<UnixListener> {
        self.egress.take()
    }

    fn rebind_egress(&mut self) -> Result<Option<UnixListener>, BackendError> {
        let sockets = self.dir.join("egress");
        if !sockets.is_dir() {
            return Ok(None);
        }
        Ok(Some(bind_egress(&sockets)?))
    }

    fn counters(&self) -> Counters {
        Counters::default()
    }

    fn is_alive(&self) -> bool {
        is_our_vmm(&self.dir, self.pid)
    }

    fn freeze(&self) -> Result<(), BackendError> {
        Ok(self.stop()?)
    }

    fn thaw(&self) -> Result<(), BackendError> {
        self.vmm.resume(&self.monitor()?)?;
        self.paused.store(false, Ordering::SeqCst);
        guest_set_clock(&self.dir);
        Ok(())
    }

    fn is_frozen(&self) -> bool {
        self.paused.load(Ordering::SeqCst)
    }

    fn export_layer(&self, dest: &Path) -> Result<u64, BackendError> {
        let saved = self.save_disk(dest);
        if saved.is_err() {
            let _ = fs::remove_dir_all(dest);
        }
        Ok(saved?)
    }

    fn checkpoint(&self, image: &Path) -> Result<(), BackendError> {
        let saved = self.save_memory(image);
        if saved.is_err() {
            let _ = fs::remove_dir_all(image);
        }
        Ok(saved?)
    }

    fn save_running(&self, image: &Path, layer: &Path) -> Result<u64, BackendError> {
        let saved = self.save_and_run_on(image, layer);
        if saved.is_err() {
            let _ = fs::remove_dir_all(image);
            let _ = fs::remove_dir_all(layer);
        }
        Ok(saved?)
    }

    fn kill(&self) {
        if is_our_vmm(&self.dir, self.pid) {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(self.pid),
                nix::sys::signal::SIGKILL,
            );
        }
    }

    fn destroy(mut self: Box<Self>) -> Result<(), BackendError> {
        self.tied = false;
        kill_vm(&self.dir, self.pid);
        Ok(remove_dir(&self.dir)?)
    }
}

impl Drop for VmInstance {
    fn drop(&mut self) {
        if self.tied {
            kill_vm(&self.dir, self.pid);
        }
    }
}
