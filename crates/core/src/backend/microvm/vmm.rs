//! The virtual machine monitor: everything that depends on which VMM runs
//! the guest is here, behind [`Vmm`]. The first is QEMU's `microvm`
//! machine ([`Qemu`]); another VMM (Firecracker, Cloud Hypervisor) needs
//! only to boot the same kernel and initramfs with the same command line,
//! attach the template image as the first virtio block device (read-only)
//! and the sandbox's writable disk as the second, and give the guest a
//! virtio-serial port named [`PORT_NAME`](super::PORT_NAME) whose host end
//! is a unix socket the host connects to, and one named
//! [`CONTROL_PORT_NAME`](super::CONTROL_PORT_NAME) likewise (Firecracker,
//! which has no virtio-serial, would carry the same multiplexed channel
//! over its vsock's unix socket instead). Pausing, saving memory and
//! switching the writable disk to a new overlay are the VMM's too
//! ([`Vmm::pause`] and the rest); QEMU does them over QMP. A VMM that
//! cannot leaves them to their defaults, which say so.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::json;

use super::qmp::Qmp;
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
    /// The sandbox's writable disk (a qcow2 overlay), the second block
    /// device, with the node name the VMM gives it.
    pub disk: Option<(&'a Path, &'a str)>,
    /// The host end of the control port: a unix socket the VMM listens on.
    pub control: &'a Path,
    /// The VMM's own control socket (QEMU: QMP).
    pub monitor: &'a Path,
    /// A memory image ([`Vmm::save_memory`]) to start from instead of
    /// booting: the guest is left paused where it was saved.
    pub incoming: Option<&'a Path>,
    /// Host directories shared with the guest (volumes), each served by a
    /// `virtiofsd` on a vhost-user socket. Such a guest's RAM is shared
    /// with those processes, and the VMM cannot save its memory.
    pub shared_dirs: &'a [SharedDir],
}

/// A directory shared with the guest over virtio-fs.
#[derive(Debug, Clone)]
pub struct SharedDir {
    /// The tag the guest mounts it by.
    pub tag: String,
    /// The vhost-user socket its `virtiofsd` listens on.
    pub socket: PathBuf,
}

/// Starts guests. Implementations keep the whole command line of their VMM.
pub trait Vmm: Send + Sync + std::fmt::Debug {
    /// The VMM's name, for messages.
    fn name(&self) -> &str;

    /// Starts the guest detached from the calling process (it outlives it,
    /// in a session of its own) and returns the VMM's pid once it runs.
    /// With [`GuestSpec::incoming`], returns once the memory is loaded,
    /// the guest paused.
    fn launch(&self, guest: &GuestSpec<'_>) -> Result<i32, MicrovmError>;

    /// Stops the guest's vCPUs (its memory stays as it is).
    fn pause(&self, monitor: &Path) -> Result<(), MicrovmError> {
        let _ = monitor;
        Err(MicrovmError::Unsupported("pausing with this VMM"))
    }

    /// Runs a paused guest again.
    fn resume(&self, monitor: &Path) -> Result<(), MicrovmError> {
        let _ = monitor;
        Err(MicrovmError::Unsupported("resuming with this VMM"))
    }

    /// Whether the guest is paused (`None`: cannot tell).
    fn is_paused(&self, monitor: &Path) -> Option<bool> {
        let _ = monitor;
        None
    }

    /// Makes the new, empty qcow2 overlay `file` (whose backing file is
    /// the image `node` writes to) the guest's writable disk, under the
    /// node name `new_node`; the guest is paused. From then on the image
    /// of `node` is not written again.
    fn switch_disk(
        &self,
        monitor: &Path,
        node: &str,
        new_node: &str,
        file: &Path,
    ) -> Result<(), MicrovmError> {
        let _ = (monitor, node, new_node, file);
        Err(MicrovmError::Unsupported(
            "saving the writable disk with this VMM",
        ))
    }

    /// The node name and file of the image the guest's writable disk
    /// writes to now (`None`: cannot tell), to put right a record a host
    /// that died during [`Vmm::switch_disk`] left behind.
    fn active_disk(&self, monitor: &Path) -> Option<(String, PathBuf)> {
        let _ = monitor;
        None
    }

    /// Saves the paused guest's memory and device state into the new file
    /// `image` and waits until it is complete.
    fn save_memory(&self, monitor: &Path, image: &Path) -> Result<(), MicrovmError> {
        let _ = (monitor, image);
        Err(MicrovmError::Unsupported("saving memory with this VMM"))
    }
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
        let mut args: Vec<String> = vec![
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
            "-chardev".into(),
            format!(
                "socket,id=control,path={},server=on,wait=off",
                p(guest.control)
            ),
            "-device".into(),
            format!(
                "virtserialport,bus=vser.0,chardev=control,name={}",
                super::CONTROL_PORT_NAME
            ),
            "-qmp".into(),
            format!("unix:{},server=on,wait=off", p(guest.monitor)),
            "-pidfile".into(),
            p(guest.pidfile),
            "-daemonize".into(),
        ];
        if let Some((disk, node)) = guest.disk {
            // Second on the bus: the guest's /dev/vdb. Its backing chain
            // (saved layers, the blank file system) opens from its header.
            let at = args
                .iter()
                .position(|a| a == "virtio-serial-pci,id=vser")
                .map_or(args.len(), |i| i - 1);
            args.splice(
                at..at,
                [
                    "-blockdev".into(),
                    format!(
                        "driver=qcow2,node-name={node},file.driver=file,file.filename={}",
                        p(disk)
                    ),
                    "-device".into(),
                    format!("virtio-blk-pci,drive={node}"),
                ],
            );
        }
        if !guest.shared_dirs.is_empty() {
            // vhost-user devices need the guest's RAM in memory the
            // virtiofsd processes can map: a shared memfd as the machine's
            // memory backend (its size is `-m`'s).
            args[1] = "microvm,pcie=on,acpi=on,memory-backend=mem".into();
            args.push("-object".into());
            args.push(format!(
                "memory-backend-memfd,id=mem,size={}M,share=on",
                guest.memory_mib
            ));
            for (n, dir) in guest.shared_dirs.iter().enumerate() {
                args.push("-chardev".into());
                args.push(format!("socket,id=fs{n},path={}", p(&dir.socket)));
                args.push("-device".into());
                args.push(format!("vhost-user-fs-pci,chardev=fs{n},tag={}", dir.tag));
            }
        }
        if let Some(image) = guest.incoming {
            args.push("-incoming".into());
            args.push(format!("exec:cat {}", shell_quote(image)));
        }
        args
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
        let pid = loop {
            if let Some(pid) = read_pidfile(guest.pidfile) {
                break pid;
            }
            // A QEMU that could not load its memory image exits (and
            // removes its pidfile) right after daemonizing: its monitor,
            // bound before it did, no longer answers.
            if guest.incoming.is_some()
                && t0.elapsed() > Duration::from_millis(200)
                && Qmp::connect(guest.monitor).is_err()
            {
                return Err(MicrovmError::Vmm(
                    "the memory image did not load (QEMU exited)".into(),
                ));
            }
            if t0.elapsed() > Duration::from_secs(5) {
                return Err(MicrovmError::VmmFailed(format!(
                    "QEMU wrote no pid to {}",
                    guest.pidfile.display()
                )));
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        if guest.incoming.is_some() {
            // Loading the memory takes a while; the guest is then paused,
            // as it was when saved.
            let t0 = Instant::now();
            loop {
                let status = Qmp::connect(guest.monitor).and_then(|mut q| q.status());
                // One that exited (the image did not load) answers no more.
                let alive = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None).is_ok();
                match status.as_deref() {
                    Ok("inmigrate") | Err(_) if alive && t0.elapsed() < INCOMING_TIMEOUT => {
                        std::thread::sleep(Duration::from_millis(20))
                    }
                    Ok("paused") | Ok("running") => break,
                    Ok(other) => {
                        kill(pid);
                        return Err(MicrovmError::Vmm(format!(
                            "the memory image did not load (the guest is {other})"
                        )));
                    }
                    Err(e) => {
                        kill(pid);
                        return Err(MicrovmError::Vmm(format!(
                            "the memory image did not load: {e}"
                        )));
                    }
                }
            }
        }
        Ok(pid)
    }

    fn pause(&self, monitor: &Path) -> Result<(), MicrovmError> {
        Qmp::connect(monitor)?.execute("stop", None).map(drop)
    }

    fn resume(&self, monitor: &Path) -> Result<(), MicrovmError> {
        Qmp::connect(monitor)?.execute("cont", None).map(drop)
    }

    fn is_paused(&self, monitor: &Path) -> Option<bool> {
        let status = Qmp::connect(monitor).and_then(|mut q| q.status()).ok()?;
        Some(status != "running")
    }

    fn switch_disk(
        &self,
        monitor: &Path,
        node: &str,
        new_node: &str,
        file: &Path,
    ) -> Result<(), MicrovmError> {
        let mut q = Qmp::connect(monitor)?;
        q.execute(
            "blockdev-add",
            Some(json!({
                "driver": "qcow2",
                "node-name": new_node,
                "file": {"driver": "file", "filename": file.display().to_string()},
                "backing": null,
            })),
        )?;
        let switched = q.execute(
            "blockdev-snapshot",
            Some(json!({"node": node, "overlay": new_node})),
        );
        if switched.is_err() {
            let _ = q.execute("blockdev-del", Some(json!({"node-name": new_node})));
        }
        switched.map(drop)
    }

    fn active_disk(&self, monitor: &Path) -> Option<(String, PathBuf)> {
        let devices = Qmp::connect(monitor)
            .and_then(|mut q| q.execute("query-block", None))
            .ok()?;
        devices.as_array()?.iter().find_map(|d| {
            let inserted = &d["inserted"];
            let node = inserted["node-name"].as_str()?;
            let file = inserted["file"].as_str()?;
            (node.starts_with('w') && !inserted["ro"].as_bool().unwrap_or(false))
                .then(|| (node.to_string(), PathBuf::from(file)))
        })
    }

    fn save_memory(&self, monitor: &Path, image: &Path) -> Result<(), MicrovmError> {
        let mut q = Qmp::connect(monitor)?;
        q.execute(
            "migrate",
            Some(json!({"uri": format!("exec:cat > {}", shell_quote(image))})),
        )?;
        let t0 = Instant::now();
        loop {
            let r = q.execute("query-migrate", None)?;
            match r["status"].as_str().unwrap_or("") {
                "completed" => return Ok(()),
                "failed" | "cancelled" => {
                    let why = r["error-desc"].as_str().unwrap_or("no reason given");
                    return Err(MicrovmError::Vmm(format!("the migration failed: {why}")));
                }
                _ if t0.elapsed() > SAVE_TIMEOUT => {
                    let _ = q.execute("migrate_cancel", None);
                    return Err(MicrovmError::Vmm(format!(
                        "saving the memory took more than {} s",
                        SAVE_TIMEOUT.as_secs()
                    )));
                }
                _ => std::thread::sleep(Duration::from_millis(10)),
            }
        }
    }
}

/// How long loading a memory image may take.
const INCOMING_TIMEOUT: Duration = Duration::from_secs(30);
/// How long saving one may take.
const SAVE_TIMEOUT: Duration = Duration::from_secs(60);

fn kill(pid: i32) {
    let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::SIGKILL);
}

fn shell_quote(p: &Path) -> String {
    format!("'{}'", p.display().to_string().replace('\'', r"'\''"))
}

/// The pid in a VMM's pidfile.
pub fn read_pidfile(path: &Path) -> Option<i32> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}
