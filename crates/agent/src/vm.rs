//! `runcell-agent vm-init`: PID 1 of a microVM guest.
//!
//! The kernel starts the agent from its initramfs. It mounts the guest's
//! `/dev`, `/proc` and `/sys`, loads the virtio drivers (Debian's kernel
//! builds them as modules; the initramfs lists them in load order in
//! [`MODULE_ORDER`]), mounts the template image (`/dev/vda`, read-only) and
//! opens the virtio-serial port named [`PORT_NAME`]. Everything from the
//! host arrives over that port, multiplexed ([`runcell_protocol::mux`]): the
//! first stream the host opens carries the [`InitSpec`] exactly as a jail's
//! setup socket does (`u32` length, JSON; answered `R`, or `E` and an error
//! sentence), and every later stream is one protocol connection.
//!
//! When the host side of the port closes (the daemon restarted), every
//! stream ends; the agent keeps running and serves the streams of the next
//! host that connects. The egress socket goes the other way: the agent
//! listens on [`EGRESS_DIR`]`/sock` (which the sandbox sees at
//! [`runcell_jail::EGRESS_SOCKET`]) and opens a stream to the host for
//! every connection.
//!
//! When the agent exits (shutdown, deadline), the kernel panics and, booted
//! with `panic=-1` under a VMM told not to reboot, the VM ends.

use std::fs;
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nix::mount::{mount, MsFlags};
use runcell_jail::InitSpec;
use runcell_protocol::mux::{self, Opener, Side};
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, DuplexStream, ReadBuf};
use tokio::net::unix::pipe;
use tokio::sync::mpsc;

use crate::server::{self, Conn};

/// The name of the virtio-serial port the host talks over.
pub const PORT_NAME: &str = "runcell.agent";
/// The name of the virtio-serial port of the host's control requests
/// ([`control_loop`]): flush the writable disk before a save.
pub const CONTROL_PORT_NAME: &str = "runcell.ctl";
/// The kernel command line parameter naming the writable disk (a block
/// device the host made, an ext4 file system), mounted as the staging
/// directory: the writable layer then lives on the host's disk, where the
/// host can save it, instead of in guest memory.
const DISK_PARAM: &str = "runcell.disk=";
/// The initramfs file listing the modules to load, in order (one file name
/// a line, in the same directory).
pub const MODULE_ORDER: &str = "/lib/modules/order";
/// Where the template image is mounted (the host names it as the root
/// directory in the spec).
const LOWER: &str = "/run/vm/lower";
/// The block device of the template image.
const ROOT_DEVICE: &str = "/dev/vda";
/// Where the agent listens for the sandbox's egress connections.
const EGRESS_DIR: &str = "/run/vm/egress";
/// How long the guest waits for its devices to appear.
const DEVICE_TIMEOUT: Duration = Duration::from_secs(20);

/// Errors of the guest's start.
#[derive(Debug, thiserror::Error)]
pub enum VmInitError {
    /// A setup step failed.
    #[error("{step} failed")]
    Step {
        /// What was being done.
        step: String,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// The sandbox could not be built.
    #[error(transparent)]
    Setup(#[from] runcell_jail::inside::SetupError),
    /// The agent could not serve.
    #[error(transparent)]
    Serve(#[from] server::ServeError),
}

fn step<E: Into<io::Error>>(what: impl Into<String>) -> impl FnOnce(E) -> VmInitError {
    let step = what.into();
    move |e| VmInitError::Step {
        step,
        source: e.into(),
    }
}

/// Runs the guest's init; returns only on failure (or when the agent stops).
pub fn main(started: Instant) -> ExitCode {
    match run(started) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let mut msg = e.to_string();
            let mut src = std::error::Error::source(&e);
            while let Some(s) = src {
                msg.push_str(&format!(": {s}"));
                src = s.source();
            }
            tracing::error!("vm-init: {msg}");
            ExitCode::FAILURE
        }
    }
}

fn run(started: Instant) -> Result<(), VmInitError> {
    mount_basics()?;
    limit_pids()?;
    load_modules()?;
    tracing::debug!(
        us = runcell_protocol::units::micros(started.elapsed()),
        "modules loaded"
    );
    let port = wait_for_port(PORT_NAME)?;
    wait_for(Path::new(ROOT_DEVICE))?;
    let restart = Arc::new(tokio::sync::Notify::new());
    if let Ok(control) = wait_for_port(CONTROL_PORT_NAME) {
        let restart = restart.clone();
        // Forked while this process has one thread, before the filter.
        let clock = match runcell_jail::clock::clock_keeper() {
            Ok(fd) => Some(fs::File::from(fd)),
            Err(e) => {
                tracing::warn!("the guest clock cannot be set after a restore: {e}");
                None
            }
        };
        std::thread::Builder::new()
            .name("control".into())
            .spawn(move || control_loop(&control, &restart, clock))
            .map_err(step("starting the control thread"))?;
    }
    fs::create_dir_all(LOWER).map_err(step(format!("creating {LOWER}")))?;
    mount(
        Some(ROOT_DEVICE),
        LOWER,
        Some("ext4"),
        MsFlags::MS_RDONLY | MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
        None::<&str>,
    )
    .map_err(step("mounting the template image"))?;
    tracing::debug!(
        us = runcell_protocol::units::micros(started.elapsed()),
        "devices ready"
    );
    let runtime = tokio::runtime::Builder::new_current_thread()
        .max_blocking_threads(crate::FILE_THREADS + 2)
        .enable_all()
        .build()
        .map_err(step("starting the runtime"))?;
    runtime.block_on(serve(port, restart))
}

fn mount_basics() -> Result<(), VmInitError> {
    for (src, dst, fstype) in [
        ("devtmpfs", "/dev", "devtmpfs"),
        ("proc", "/proc", "proc"),
        ("sysfs", "/sys", "sysfs"),
        ("tmpfs", "/run", "tmpfs"),
    ] {
        fs::create_dir_all(dst).map_err(step(format!("creating {dst}")))?;
        mount(
            Some(src),
            dst,
            Some(fstype),
            MsFlags::MS_NOSUID,
            None::<&str>,
        )
        .map_err(step(format!("mounting {dst}")))?;
    }
    Ok(())
}

/// The kernel command line parameter with the sandbox's process limit.
const PIDS_PARAM: &str = "runcell.pids=";
/// The kernel command line parameter with the sandbox's memory limit, in bytes.
const MEMORY_PARAM: &str = "runcell.memory=";
/// The guest cgroup the agent and everything it starts live in.
const SANDBOX_CGROUP: &str = "/sys/fs/cgroup/sandbox";

/// Puts the agent (and so everything it starts) in a guest cgroup v2 whose
/// `pids.max` and `memory.max` are the `runcell.pids=` and
/// `runcell.memory=` of the kernel command line, as the jail's cgroup does
/// on the host (without a parameter: no limit of that kind). The guest
/// kernel's own counters of that cgroup (`pids.events`, `memory.events`)
/// then report hits by name ([`crate::limits::watch_events`]); the guest
/// has some memory beyond `memory.max` for its kernel and the agent, so the
/// cgroup's OOM killer, not the guest's global one, meets a memory bomb.
fn limit_pids() -> Result<(), VmInitError> {
    let cmdline = fs::read_to_string("/proc/cmdline").map_err(step("reading /proc/cmdline"))?;
    let param = |name: &str| {
        cmdline
            .split_whitespace()
            .find_map(|w| w.strip_prefix(name))
            .and_then(|n| n.parse::<u64>().ok())
    };
    let (pids, memory) = (param(PIDS_PARAM), param(MEMORY_PARAM));
    if pids.is_none() && memory.is_none() {
        return Ok(());
    }
    let root = Path::new("/sys/fs/cgroup");
    mount(
        Some("cgroup2"),
        root,
        Some("cgroup2"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
        None::<&str>,
    )
    .map_err(step("mounting the guest's cgroups"))?;
    let group = PathBuf::from(SANDBOX_CGROUP);
    let write = |path: PathBuf, value: String| {
        fs::write(&path, value).map_err(step(format!("writing {}", path.display())))
    };
    write(root.join("cgroup.subtree_control"), "+pids +memory".into())?;
    fs::create_dir_all(&group).map_err(step("creating the guest's sandbox cgroup"))?;
    if let Some(max) = pids {
        write(group.join("pids.max"), max.to_string())?;
    }
    if let Some(max) = memory {
        write(group.join("memory.max"), max.to_string())?;
        // No swap in the guest; say so should the kernel have some.
        let _ = fs::write(group.join("memory.swap.max"), "0");
    }
    write(group.join("cgroup.procs"), std::process::id().to_string())?;
    crate::limits::watch_events(&group).map_err(step("opening the sandbox cgroup's events"))
}

fn load_modules() -> Result<(), VmInitError> {
    let order =
        fs::read_to_string(MODULE_ORDER).map_err(step(format!("reading {MODULE_ORDER}")))?;
    let dir = Path::new(MODULE_ORDER)
        .parent()
        .unwrap_or(Path::new("/"))
        .to_path_buf();
    let mut pending: Vec<&str> = order
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    // In the listed order; a module whose dependencies are not loaded yet
    // fails (ENOENT: unknown symbols) and is tried again after the others.
    loop {
        let mut failed = Vec::new();
        let mut last_error = None;
        for name in &pending {
            let path = dir.join(name);
            let file =
                fs::File::open(&path).map_err(step(format!("opening {}", path.display())))?;
            if let Err(e) = runcell_jail::finit_module(&file) {
                failed.push(*name);
                last_error = Some((name.to_string(), e));
            }
        }
        if failed.is_empty() {
            return Ok(());
        }
        if failed.len() == pending.len() {
            let (name, e) = last_error.expect("a failure");
            return Err(step(format!("loading the module {name}"))(e));
        }
        pending = failed;
    }
}

fn wait_for(path: &Path) -> Result<(), VmInitError> {
    let t0 = Instant::now();
    while !path.exists() {
        if t0.elapsed() > DEVICE_TIMEOUT {
            return Err(step(format!("waiting for {}", path.display()))(
                io::Error::from(io::ErrorKind::TimedOut),
            ));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    Ok(())
}

/// Finds the device of the port named `port_name`.
fn wait_for_port(port_name: &str) -> Result<PathBuf, VmInitError> {
    let t0 = Instant::now();
    loop {
        if let Ok(entries) = fs::read_dir("/sys/class/virtio-ports") {
            for e in entries.flatten() {
                let name = fs::read_to_string(e.path().join("name")).unwrap_or_default();
                if name.trim() == port_name {
                    let dev = Path::new("/dev").join(e.file_name());
                    wait_for(&dev)?;
                    return Ok(dev);
                }
            }
        }
        if t0.elapsed() > DEVICE_TIMEOUT {
            return Err(step(format!("waiting for the port {port_name}"))(
                io::Error::from(io::ErrorKind::TimedOut),
            ));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The opener of the current host connection (none while the host is away).
type CurrentOpener = Arc<Mutex<Option<Opener>>>;

async fn serve(port: PathBuf, restart: Arc<tokio::sync::Notify>) -> Result<(), VmInitError> {
    let (in_tx, mut in_rx) = mpsc::channel::<DuplexStream>(16);
    let opener: CurrentOpener = Arc::default();
    let port = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(&port)
        .map_err(step(format!("opening {}", port.display())))?;
    tokio::spawn(port_loop(port, in_tx, opener.clone(), restart));

    // The first stream of the first host carries the spec.
    let Some(mut setup) = in_rx.recv().await else {
        return Err(step("waiting for the host")(io::Error::from(
            io::ErrorKind::UnexpectedEof,
        )));
    };
    let spec = read_spec(&mut setup).await?;
    tracing::debug!(sandbox = %spec.sandbox_id, "spec received");
    fs::create_dir_all(&spec.staging_dir).map_err(step("creating the staging directory"))?;
    mount_disk(&spec.staging_dir)?;
    mount_volumes(&spec)?;
    if spec.egress_socket.is_some() {
        egress_listener(opener.clone())?;
    }
    let built = runcell_jail::inside::build_in_vm(&spec).and_then(|()| {
        // Installed on every thread (the runtime has some by now), so every
        // process the agent starts inherits it.
        let filter = runcell_jail::seccomp::filter().map_err(|e| {
            runcell_jail::inside::SetupError::Step {
                step: "building the seccomp filter".into(),
                source: io::Error::other(e.to_string()),
            }
        })?;
        runcell_jail::seccomp::install_all_threads(&filter).map_err(|e| {
            runcell_jail::inside::SetupError::Step {
                step: "installing the seccomp filter".into(),
                source: io::Error::other(e.to_string()),
            }
        })
    });
    match built {
        Ok(()) => {
            setup
                .write_all(b"R")
                .await
                .map_err(step("reporting ready"))?;
        }
        Err(e) => {
            let msg = e.to_string();
            let msg = &msg.as_bytes()[..msg.len().min(64 << 10)];
            let mut out = vec![b'E'];
            out.extend_from_slice(&u32::try_from(msg.len()).unwrap_or(0).to_be_bytes());
            out.extend_from_slice(msg);
            let _ = setup.write_all(&out).await;
            let _ = setup.flush().await;
            tokio::time::sleep(Duration::from_millis(50)).await;
            return Err(e.into());
        }
    }
    if let Err(e) = nix::sys::prctl::set_dumpable(false) {
        tracing::warn!("could not make the agent non-dumpable: {e}");
    }
    let (conn_tx, conn_rx) = mpsc::channel::<Box<dyn Conn>>(16);
    tokio::spawn(async move {
        while let Some(s) = in_rx.recv().await {
            if conn_tx.send(Box::new(s)).await.is_err() {
                return;
            }
        }
    });
    // No Landlock here: the runtime is multi-threaded by now (a domain
    // covers only the calling thread before ABI 8), and the guest kernel
    // is this sandbox's own; the agent reports ABI 0.
    server::serve(
        spec,
        Box::new(setup),
        conn_rx,
        runcell_jail::confine::Confinement::none(),
    )
    .await?;
    Ok(())
}

async fn read_spec(setup: &mut DuplexStream) -> Result<InitSpec, VmInitError> {
    let mut len = [0u8; 4];
    setup
        .read_exact(&mut len)
        .await
        .map_err(step("reading the spec"))?;
    let len = usize::try_from(u32::from_be_bytes(len))
        .unwrap_or(usize::MAX)
        .min(1 << 20);
    let mut buf = vec![0u8; len];
    setup
        .read_exact(&mut buf)
        .await
        .map_err(step("reading the spec"))?;
    serde_json::from_slice(&buf).map_err(step("decoding the spec"))
}

/// Serves the port for ever: one multiplexer per host connection. The
/// port stays open (its node is not in the sandbox's `/dev`); each
/// connection works on duplicates of it.
async fn port_loop(
    port: fs::File,
    incoming: mpsc::Sender<DuplexStream>,
    current: CurrentOpener,
    restart: Arc<tokio::sync::Notify>,
) {
    let mut logged = false;
    loop {
        // Non-blocking (set when opened): a read returns end of file while
        // the host is away, and no write is ever left blocked in a thread
        // (it would write stale bytes to the next host). The port is a
        // character device, not a FIFO: tokio's pipe ends drive any
        // pollable file.
        let ends = port.try_clone().and_then(|r| {
            let w = port.try_clone()?;
            Ok((
                PortReader(pipe::Receiver::from_file_unchecked(r)?),
                PortWriter(pipe::Sender::from_file_unchecked(w)?),
            ))
        });
        let (r, w) = match ends {
            Ok(p) => p,
            Err(e) => {
                if !logged {
                    tracing::warn!("could not use the host's port: {e}");
                    logged = true;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let (opener, channel) = mux::run(Side::Guest, r, w, incoming.clone());
        *current.lock().expect("opener lock") = Some(opener);
        tokio::select! {
            ended = channel => {
                if let Err(e) = ended {
                    tracing::info!("host channel ended: {e}");
                }
            }
            // The host asked (a guest restored from a memory image: its
            // previous host is gone, unseen): start anew at once.
            () = restart.notified() => tracing::info!("host channel restarted"),
        }
        *current.lock().expect("opener lock") = None;
        // The host is away (a read returns end of file until it is back).
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The reading end of the port. A virtio port's read returns one buffer
/// the host sent, often less than asked while more are queued; tokio's own
/// `AsyncRead` takes a short read for "drained" and waits for the next
/// wake-up, which never comes once the host waits for credit. This one
/// reads until the port says it would block.
struct PortReader(pipe::Receiver);

impl AsyncRead for PortReader {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        loop {
            ready!(self.0.poll_read_ready(cx))?;
            match self.0.try_read(buf.initialize_unfilled()) {
                Ok(n) => {
                    buf.advance(n);
                    return Poll::Ready(Ok(()));
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
    }
}

/// The writing end of the port: a write takes at most 32 KiB, which is no
/// sign that the port is full (see [`PortReader`]).
struct PortWriter(pipe::Sender);

impl AsyncWrite for PortWriter {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        loop {
            ready!(self.0.poll_write_ready(cx))?;
            match self.0.try_write(data) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                r => return Poll::Ready(r),
            }
        }
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

/// Listens on the guest's egress socket and carries every connection to
/// the host over a stream of its own.
fn egress_listener(current: CurrentOpener) -> Result<(), VmInitError> {
    use std::os::unix::fs::PermissionsExt;
    fs::create_dir_all(EGRESS_DIR).map_err(step(format!("creating {EGRESS_DIR}")))?;
    fs::set_permissions(EGRESS_DIR, fs::Permissions::from_mode(0o700))
        .map_err(step(format!("setting the mode of {EGRESS_DIR}")))?;
    let path = Path::new(EGRESS_DIR).join("sock");
    let listener =
        tokio::net::UnixListener::bind(&path).map_err(step("binding the egress socket"))?;
    tokio::spawn(async move {
        loop {
            let Ok((mut conn, _)) = listener.accept().await else {
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            };
            let opener = current.lock().expect("opener lock").clone();
            let Some(opener) = opener else {
                tracing::warn!("egress: the host is away; connection refused");
                continue;
            };
            tokio::spawn(async move {
                match opener.open().await {
                    Ok(mut stream) => {
                        let _ = tokio::io::copy_bidirectional(&mut conn, &mut stream).await;
                    }
                    Err(e) => tracing::warn!("egress: {e}"),
                }
            });
        }
    });
    Ok(())
}

/// Mounts the writable disk named on the kernel command line
/// (`runcell.disk=vdb`) at `stage`, where the sandbox's writable layer is
/// made (the jail's setup then leaves it as it is, instead of mounting a
/// tmpfs there). A disk that was used before (a wake, a fork) keeps what
/// the sandbox wrote. Without the parameter: nothing (a tmpfs, in memory).
fn mount_disk(stage: &Path) -> Result<(), VmInitError> {
    let cmdline = fs::read_to_string("/proc/cmdline").map_err(step("reading /proc/cmdline"))?;
    let Some(name) = cmdline
        .split_whitespace()
        .find_map(|w| w.strip_prefix(DISK_PARAM))
        .filter(|n| !n.is_empty() && n.chars().all(|c| c.is_ascii_alphanumeric()))
    else {
        return Ok(());
    };
    let device = Path::new("/dev").join(name);
    wait_for(&device)?;
    mount(
        Some(&device),
        stage,
        Some("ext4"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
        None::<&str>,
    )
    .map_err(step("mounting the writable disk"))
}

/// Where the host's volumes are mounted: the `n`th at `VOLUMES/<n>`,
/// which is the source the spec's `n`th bind mount names.
const VOLUMES: &str = "/run/vm/volumes";
/// The virtio-fs tag of the `n`th volume (the host's `vhost-user-fs`
/// device): `VOLUME_TAG<n>`.
const VOLUME_TAG: &str = "runcell-vol";

/// Mounts each volume the host shares (one virtio-fs device per volume,
/// in the spec's order) where the spec's bind mount takes it from; the
/// jail's setup then binds it at its path in the sandbox. Read-only is
/// the host's (its `virtiofsd` serves a read-only mount) and the guest's
/// mount says so too. Owners are the sandbox's ids as the host stores
/// them through its id map, so the sandbox's user owns what it wrote.
fn mount_volumes(spec: &InitSpec) -> Result<(), VmInitError> {
    for (n, m) in spec.mounts.iter().enumerate() {
        let at = Path::new(VOLUMES).join(n.to_string());
        if m.source != at {
            return Err(step(format!(
                "mounting the volume at {}",
                m.target.display()
            ))(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("its source {} is not {}", m.source.display(), at.display()),
            )));
        }
        fs::create_dir_all(&at).map_err(step(format!("creating {}", at.display())))?;
        let mut flags = MsFlags::MS_NOSUID | MsFlags::MS_NODEV;
        if m.read_only {
            flags |= MsFlags::MS_RDONLY;
        }
        mount(
            Some(format!("{VOLUME_TAG}{n}").as_str()),
            &at,
            Some("virtiofs"),
            flags,
            None::<&str>,
        )
        .map_err(step(format!(
            "mounting the volume at {} (virtio-fs)",
            m.target.display()
        )))?;
    }
    Ok(())
}

/// Serves the host's control port for ever, on a thread of its own (a
/// request is answered even while the agent's runtime is busy). One byte
/// a request: `S` flushes every file system to its disk (`sync`), so a
/// copy of the writable disk the host takes next holds what the sandbox
/// wrote; answered `S`. `R` starts the agent's channel anew (its streams
/// end and it says `HELLO` again): a host that restored this guest from a
/// memory image asks, since the guest never saw its previous host go;
/// answered `R`. `T<nanoseconds since the epoch>\n` sets the guest's
/// clock (through the clock keeper: [`runcell_jail::clock`]), which stood
/// still while the guest was stopped or saved; answered `T`. Digits are
/// neither `S` nor `R`, so an older agent ignores the time. While the host
/// is away a read returns end of file.
/// The sandbox id the host gave a guest restored from another sandbox's
/// memory (a fork's, a snapshot's): its spec still names the saved one.
static SANDBOX_ID: std::sync::Mutex<Option<String>> = std::sync::Mutex::new(None);

/// The sandbox this guest now is, where the host renamed it (`I<id>` on
/// the control port, after a restore into a new sandbox).
pub(crate) fn sandbox_id() -> Option<String> {
    SANDBOX_ID
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .clone()
}

fn control_loop(port: &Path, restart: &tokio::sync::Notify, mut clock: Option<fs::File>) {
    use std::io::{Read, Write};
    let mut file = match fs::OpenOptions::new().read(true).write(true).open(port) {
        Ok(f) => f,
        Err(e) => {
            tracing::warn!("could not open the control port: {e}");
            return;
        }
    };
    let mut buf = [0u8; 64];
    // The digits of a time being read (after a `T`, until its newline).
    let mut time: Option<Vec<u8>> = None;
    // A sandbox id being read (after an `I`, until its newline).
    let mut id: Option<Vec<u8>> = None;
    loop {
        match file.read(&mut buf) {
            Ok(0) | Err(_) => std::thread::sleep(Duration::from_millis(20)),
            Ok(n) => {
                for &b in &buf[..n] {
                    if let Some(name) = id.as_mut() {
                        if b != b'\n' {
                            if name.len() < 64 {
                                name.push(b);
                            }
                            continue;
                        }
                        let name = String::from_utf8_lossy(name).into_owned();
                        if runcell_jail::check_id(&name).is_ok() {
                            *SANDBOX_ID
                                .lock()
                                .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(name);
                        }
                        id = None;
                        let _ = file.write_all(b"I");
                        continue;
                    }
                    if let Some(digits) = time.as_mut() {
                        if b != b'\n' {
                            if digits.len() < 32 {
                                digits.push(b);
                            }
                            continue;
                        }
                        digits.push(b'\n');
                        if let Some(keeper) = clock.as_mut() {
                            let _ = keeper.write_all(digits);
                        }
                        time = None;
                        let _ = file.write_all(b"T");
                        continue;
                    }
                    match b {
                        b'T' => time = Some(Vec::new()),
                        b'I' => id = Some(Vec::new()),
                        b'S' => {
                            nix::unistd::sync();
                            let _ = file.write_all(b"S");
                        }
                        b'R' => {
                            // Only a channel that is up restarts: no
                            // permit is kept for a later one (a second
                            // HELLO would reset the new host's streams).
                            restart.notify_waiters();
                            let _ = file.write_all(b"R");
                        }
                        _ => {}
                    }
                }
            }
        }
    }
}
