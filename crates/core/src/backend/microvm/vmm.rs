//! The virtual machine monitor: everything that depends on which VMM runs
//! the guest is here, behind [`Vmm`]. The first is QEMU's `microvm`
//! machine ([`Qemu`]); another VMM (Firecracker, Cloud Hypervisor) needs
//! only to boot the same kernel and initramfs with the same command line,
//! attach the template image as the first virtio block device (read-only),
//! and give the guest a virtio-serial port named
//! [`PORT_NAME`](super::PORT_NAME) whose host end is a unix socket the host
//! connects to (Firecracker, which has no virtio-serial, would carry the
//! same multiplexed channel over its vsock's unix socket instead).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use super::MicrovmError;

/// How a guest's CPU runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Accel {
    /// Hardware virtualisation (`/dev/kvm`).
    Kvm,
    /// QEMU's software emulation (slow; only when the operator allows it).
    Tcg,
}

impl Accel {
    /// Its name (`kvm`, `tcg`).
    pub fn as_str(self) -> &'static str {
        match self {
            Accel::Kvm => "kvm",
            Accel::Tcg => "tcg",
        }
    }
}

/// One guest to boot.
#[derive(Debug, Clone)]
pub struct GuestSpec<'a> {
    /// The kernel image.
    pub kernel: &'a Path,
    /// The initramfs (its `/init` is the agent).
    pub initramfs: &'a Path,
    /// The kernel command line.
    pub cmdline: &'a str,
    /// The template image, attached read-only as the first block device.
    pub root_image: &'a Path,
    /// Guest memory, MiB.
    pub memory_mib: u64,
    /// Virtual CPUs.
    pub vcpus: u32,
    /// The host end of the agent's port: a unix socket the VMM listens on.
    pub channel: &'a Path,
    /// Where the guest's serial console goes.
    pub console_log: &'a Path,
    /// Where the VMM writes its pid.
    pub pidfile: &'a Path,
    /// CPU acceleration.
    pub accel: Accel,
}

/// Starts guests. Implementations keep the whole command line of their VMM.
pub trait Vmm: Send + Sync + std::fmt::Debug {
    /// The VMM's name, for messages.
    fn name(&self) -> &str;

    /// Starts the guest detached from the calling process (it outlives it,
    /// in a session of its own) and returns the VMM's pid once it runs.
    fn launch(&self, guest: &GuestSpec<'_>) -> Result<i32, MicrovmError>;
}

/// QEMU's `microvm` machine, with PCI (ECAM described by ACPI: Debian's
/// cloud kernel has no `virtio_mmio.device=` support).
#[derive(Debug, Clone)]
pub struct Qemu {
    binary: PathBuf,
}

impl Qemu {
    /// QEMU at `binary` (normally `qemu-system-x86_64`).
    pub fn new(binary: PathBuf) -> Self {
        Self { binary }
    }

    /// The binary.
    pub fn binary(&self) -> &Path {
        &self.binary
    }

    fn args(guest: &GuestSpec<'_>) -> Vec<String> {
        let (accel, cpu) = match guest.accel {
            Accel::Kvm => ("kvm", "host"),
            Accel::Tcg if guest.vcpus > 1 => ("tcg,thread=multi", "max"),
            Accel::Tcg => ("tcg", "max"),
        };
        let p = |p: &Path| p.display().to_string();
        vec![
            "-M".into(),
            "microvm,pcie=on,acpi=on".into(),
            "-accel".into(),
            accel.into(),
            "-cpu".into(),
            cpu.into(),
            "-m".into(),
            format!("{}M", guest.memory_mib),
            "-smp".into(),
            guest.vcpus.to_string(),
            "-nodefaults".into(),
            "-no-user-config".into(),
            "-display".into(),
            "none".into(),
            // The guest ends by rebooting (panic=-1 when its agent exits):
            // QEMU then exits instead.
            "-no-reboot".into(),
            "-serial".into(),
            format!("file:{}", p(guest.console_log)),
            "-kernel".into(),
            p(guest.kernel),
            "-initrd".into(),
            p(guest.initramfs),
            "-append".into(),
            guest.cmdline.into(),
            "-drive".into(),
            format!(
                "id=root,file={},format=raw,if=none,readonly=on",
                p(guest.root_image)
            ),
            "-device".into(),
            "virtio-blk-pci,drive=root".into(),
            "-device".into(),
            "virtio-serial-pci,id=vser".into(),
            "-chardev".into(),
            format!(
                "socket,id=agent,path={},server=on,wait=off",
                p(guest.channel)
            ),
            "-device".into(),
            format!(
                "virtserialport,bus=vser.0,chardev=agent,name={}",
                super::PORT_NAME
            ),
            "-pidfile".into(),
            p(guest.pidfile),
            "-daemonize".into(),
        ]
    }
}

impl Vmm for Qemu {
    fn name(&self) -> &str {
        "qemu"
    }

    fn launch(&self, guest: &GuestSpec<'_>) -> Result<i32, MicrovmError> {
        let _ = std::fs::remove_file(guest.pidfile);
        // -daemonize: the first process exits once the VM is set up, and
        // the VM's process runs on in a session of its own, so it outlives
        // the daemon (a sandbox tied to its process is stopped by its agent
        // when the host's end of the channel closes).
        let out = Command::new(&self.binary)
            .args(Self::args(guest))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .output()
            .map_err(|e| MicrovmError::Spawn(self.binary.clone(), e))?;
        if !out.status.success() {
            return Err(MicrovmError::VmmFailed(
                String::from_utf8_lossy(&out.stderr).trim().to_string(),
            ));
        }
        let t0 = Instant::now();
        loop {
            if let Some(pid) = read_pidfile(guest.pidfile) {
                return Ok(pid);
            }
            if t0.elapsed() > Duration::from_secs(5) {
                return Err(MicrovmError::VmmFailed(format!(
                    "QEMU wrote no pid to {}",
                    guest.pidfile.display()
                )));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

/// The pid in a VMM's pidfile.
pub fn read_pidfile(path: &Path) -> Option<i32> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}
