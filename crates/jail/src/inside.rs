//! Sandbox side of the jail, run by the agent as PID 1 of the new namespaces
//! before it serves anything.
//!
//! [`bootstrap`] reads the [`InitSpec`] from the setup socket (fd 3), builds the
//! root filesystem and pivots into it:
//!
//! * a tmpfs of `disk_bytes` holds everything writable: the root directory
//!   itself (host template) or the overlay's upper layer (directory template);
//!   its number of files is capped too ([`inode_limit`]);
//! * template directories are overlaid read-only below it, so writes go to
//!   the tmpfs and never reach the template or the host;
//! * fresh `/proc` (with sensitive files masked), a minimal `/dev` of bind-mounted
//!   host nodes (`null`, `zero`, `full`, `random`, `urandom`, `tty`), a private
//!   devpts, and a synthesized `/etc` (passwd, group, hosts, resolv.conf);
//! * `pivot_root` into it and detach the old root, so no other host path is
//!   reachable.

use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::fs::{symlink, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use nix::mount::{mount, umount2, MntFlags, MsFlags};
use nix::sched::{unshare, CloneFlags};
use nix::sys::statvfs::{statvfs, FsFlags};
use nix::unistd::{chdir, chown, pivot_root, sethostname, Gid, Uid};

use crate::spec::{InitSpec, RootfsSpec, STAGE_FD};

/// Errors building the sandbox from inside.
#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    /// The setup socket failed or sent garbage.
    #[error("Could not read the sandbox spec from the host.")]
    Spec(#[source] io::Error),
    /// The spec was not valid JSON.
    #[error("The sandbox spec from the host is invalid.")]
    BadSpec(#[source] serde_json::Error),
    /// A setup step failed.
    #[error("{step} failed: {source}")]
    Step {
        /// What was being done.
        step: String,
        /// The cause.
        #[source]
        source: io::Error,
    },
}

pub(crate) fn step<E: Into<io::Error>>(what: impl Into<String>) -> impl FnOnce(E) -> SetupError {
    let step = what.into();
    move |e| SetupError::Step {
        step,
        source: e.into(),
    }
}

/// The result of a successful bootstrap.
#[derive(Debug)]
pub struct Bootstrap {
    /// What the host asked for.
    pub spec: InitSpec,
    /// The setup socket (fd 3). Its end of stream means the host is gone.
    pub setup: OwnedFd,
    /// The agent's listening socket (fd 4), bound by the host outside the sandbox.
    pub listener: OwnedFd,
}

/// Takes fds 3 and 4, reads the spec, builds the sandbox and reports to the
/// host. On failure the error is reported to the host as well.
pub fn bootstrap() -> Result<Bootstrap, SetupError> {
    // The host's child execs the agent with every signal blocked
    // (spawn::child_exec, sys::clone_vfork); one sent meanwhile is
    // delivered now, with the default action.
    nix::sys::signal::sigprocmask(
        nix::sys::signal::SigmaskHow::SIG_SETMASK,
        Some(&nix::sys::signal::SigSet::empty()),
        None,
    )
    .map_err(step("unblocking signals"))?;
    // SAFETY: the host's spawner (spawn::child_exec) hands the agent exactly
    // these two fds; nothing else in this process owns them.
    let (setup, listener) = unsafe { (OwnedFd::from_raw_fd(3), OwnedFd::from_raw_fd(4)) };
    for fd in [&setup, &listener] {
        nix::fcntl::fcntl(
            fd,
            nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::FD_CLOEXEC),
        )
        .map_err(step("marking the setup fds close-on-exec"))?;
    }
    let mut sock = File::from(setup);
    let result = read_spec(&mut sock).and_then(|spec| {
        tracing::debug!(sandbox = %spec.sandbox_id, ahead = spec.ahead, "spec received");
        // We were moved into our cgroup before we started: make it our root.
        unshare(CloneFlags::CLONE_NEWCGROUP).map_err(step("unsharing the cgroup namespace"))?;
        let spec = if spec.ahead {
            claim_ahead(&spec, &mut sock)?
        } else {
            lay_root(&spec, Enter::Pivot)?;
            spec
        };
        enter_root(&spec, Enter::Pivot)?;
        Ok(spec)
    });
    match result {
        Ok(spec) => {
            sock.write_all(b"R").map_err(SetupError::Spec)?;
            Ok(Bootstrap {
                spec,
                setup: sock.into(),
                listener,
            })
        }
        Err(e) => {
            report_error(&mut sock, &e);
            Err(e)
        }
    }
}

/// Reports a setup failure to the host: `E`, a big-endian length, the
/// message. Best effort: the host may be gone already.
pub(crate) fn report_error(sock: &mut impl Write, e: &SetupError) {
    let msg = e.to_string();
    let mut out = vec![b'E'];
    // An error sentence is far below 4 GiB; cut it if not.
    let msg = &msg.as_bytes()[..msg.len().min(64 << 10)];
    out.extend_from_slice(&u32::try_from(msg.len()).unwrap_or(0).to_be_bytes());
    out.extend_from_slice(msg);
    let _ = sock.write_all(&out);
}

pub(crate) fn read_spec(sock: &mut impl Read) -> Result<InitSpec, SetupError> {
    let mut len = [0u8; 4];
    sock.read_exact(&mut len).map_err(SetupError::Spec)?;
    let mut buf = vec![0u8; (u32::from_be_bytes(len) as usize).min(1 << 20)];
    sock.read_exact(&mut buf).map_err(SetupError::Spec)?;
    serde_json::from_slice(&buf).map_err(SetupError::BadSpec)
}

/// How the agent leaves its old root once the new one is built.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Enter {
    /// `pivot_root` and detach the old root (the jail: the old root is the host's).
    Pivot,
    /// Move the new root over `/` and `chroot` into it (a microVM guest,
    /// whose old root is its initramfs: `pivot_root` refuses to leave it,
    /// and it holds nothing but the agent, its libraries and modules).
    MoveAndChroot,
}

/// Lays out the root of a spec a standby's host sent ahead of any claim
/// ([`InitSpec::ahead`]), then waits for the claim's spec and returns it,
/// its root laid out: the one laid ahead when the claim builds the same
/// root (the writable layer resized in place if need be), else the
/// claim's own, laid out after the first is taken apart. Only the claim's
/// spec can fail the sandbox: a layout ahead that failed is taken apart
/// and done again for the claim, which then reports its own error.
fn claim_ahead(ahead: &InitSpec, sock: &mut File) -> Result<InitSpec, SetupError> {
    let sources = host_sources(ahead);
    let laid = lay_root(ahead, Enter::Pivot);
    if let Err(e) = &laid {
        tracing::debug!("laying out the root ahead of the claim failed: {e}");
    }
    let spec = read_spec(sock)?;
    tracing::debug!(sandbox = %spec.sandbox_id, "spec of the claim received");
    if spec.ahead {
        return Err(step("reading the claim's spec")(io::Error::new(
            io::ErrorKind::InvalidData,
            "a second spec was sent ahead",
        )));
    }
    let kept = match laid {
        Ok(on_disk) if ahead.builds_same_root(&spec) && host_sources(&spec) == sources => {
            resize_writable_layer(&spec, on_disk, ahead.disk_bytes)
                .map_err(|e| tracing::debug!("resizing the writable layer failed: {e}"))
                .is_ok()
        }
        _ => false,
    };
    if kept {
        tracing::debug!("the root laid out ahead is the claim's");
    } else {
        take_apart(&ahead.staging_dir)?;
        lay_root(&spec, Enter::Pivot)?;
    }
    Ok(spec)
}

/// The host paths a root laid out from `spec` is made of (the template's
/// directories or layers, host paths and `/etc` entries, saved layers,
/// volumes), each as its device and inode: a root laid out ahead is kept
/// only if none was replaced since (a template deleted and built again at
/// the same path, a host file renamed over), as the mounts still show
/// what was there when they were made.
fn host_sources(spec: &InitSpec) -> Vec<Option<(u64, u64)>> {
    use std::os::unix::fs::MetadataExt;
    let mut paths: Vec<PathBuf> = match &spec.rootfs {
        RootfsSpec::Directory { path } => vec![path.clone()],
        RootfsSpec::Layers { lowers, persist } => {
            lowers.iter().cloned().chain(persist.clone()).collect()
        }
        RootfsSpec::Host { paths, etc } => paths
            .iter()
            .cloned()
            .chain(etc.iter().map(|name| Path::new("/etc").join(name)))
            .collect(),
    };
    paths.extend(spec.state_layers.iter().cloned());
    paths.extend(spec.mounts.iter().map(|m| m.source.clone()));
    paths
        .iter()
        .map(|p| fs::symlink_metadata(p).ok().map(|m| (m.dev(), m.ino())))
        .collect()
}

/// Gives the writable layer laid out for `laid_bytes` the claim's size:
/// a tmpfs is remounted with the claim's size and inode cap (which the
/// kernel refuses below what it holds); a btrfs stage is capped by the
/// host.
fn resize_writable_layer(
    spec: &InitSpec,
    on_disk: bool,
    laid_bytes: u64,
) -> Result<(), SetupError> {
    if on_disk || spec.disk_bytes == laid_bytes {
        return Ok(());
    }
    mount(
        None::<&str>,
        &spec.staging_dir,
        None::<&str>,
        MsFlags::MS_REMOUNT | MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
        Some(tmpfs_size_options(spec.disk_bytes).as_str()),
    )
    .map_err(step("resizing the writable layer"))
}

/// The size options of a writable layer's tmpfs of `disk_bytes`.
fn tmpfs_size_options(disk_bytes: u64) -> String {
    format!(
        "size={},nr_inodes={}",
        disk_bytes.max(1 << 20),
        inode_limit(disk_bytes)
    )
}

/// Takes apart what [`lay_root`] laid out under `stage`, whole or in part,
/// leaving the stage as the host made it: the descriptor kept on it
/// closed, every mount under it detached, and on a btrfs stage (the
/// writable layer itself, not a mount) the directories it made removed.
fn take_apart(stage: &Path) -> Result<(), SetupError> {
    use std::os::unix::fs::MetadataExt;
    // The descriptor is closed only if it is the stage's: a layout that
    // failed early may not have taken it.
    // SAFETY: fstat only writes the struct it is given; a descriptor that
    // is not open fails with EBADF.
    let kept = unsafe {
        let mut st: libc::stat = std::mem::zeroed();
        (libc::fstat(STAGE_FD, &mut st) == 0).then_some(st)
    };
    if let (Some(kept), Ok(now)) = (kept, fs::metadata(stage)) {
        if kept.st_dev == now.dev() && kept.st_ino == now.ino() {
            // SAFETY: STAGE_FD is the descriptor `keep_stage_open` leaked
            // on the stage (checked just above); nothing else owns it.
            drop(unsafe { OwnedFd::from_raw_fd(STAGE_FD) });
        }
    }
    // Not a mount point when the layout failed before it: nothing to detach.
    let _ = umount2(&stage.join("root"), MntFlags::MNT_DETACH);
    if crate::btrfs::is_subvolume(stage) {
        for d in ["root", "upper", "work", "shm"] {
            let path = stage.join(d);
            if fs::symlink_metadata(&path).is_ok() {
                fs::remove_dir_all(&path).map_err(step("taking apart the root laid out ahead"))?;
            }
        }
    } else {
        let _ = umount2(stage, MntFlags::MNT_DETACH);
    }
    Ok(())
}

/// Builds the sandbox's root inside a microVM guest, as [`bootstrap`] does
/// in a jail, from a spec the agent received itself: the template image is
/// already mounted (read-only) where `spec.rootfs` says, and `/dev`,
/// `/proc` and `/sys` of the guest are mounted. Ends inside the new root.
pub fn build_in_vm(spec: &InitSpec) -> Result<(), SetupError> {
    build_root(spec, Enter::MoveAndChroot)
}

/// Whether `path` is the root of a mount (its device differs from its
/// parent's).
fn is_mount_point(path: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    let parent = path.parent().unwrap_or(Path::new("/"));
    match (fs::metadata(path), fs::metadata(parent)) {
        (Ok(a), Ok(b)) => a.dev() != b.dev(),
        _ => false,
    }
}

fn build_root(spec: &InitSpec, enter: Enter) -> Result<(), SetupError> {
    lay_root(spec, enter)?;
    enter_root(spec, enter)
}

/// Lays out the sandbox's root filesystem under the stage: the writable
/// layer, the template overlaid, `/etc`, `/proc`, `/dev` and the volumes.
/// Returns whether the writable layer is the stage itself (on disk).
fn lay_root(spec: &InitSpec, enter: Enter) -> Result<bool, SetupError> {
    let t0 = std::time::Instant::now();
    // Nothing we mount may propagate back to the host.
    mount(
        None::<&str>,
        "/",
        None::<&str>,
        MsFlags::MS_REC | MsFlags::MS_PRIVATE,
        None::<&str>,
    )
    .map_err(step("making mounts private"))?;

    let stage = &spec.staging_dir;
    // With the btrfs layer store the host made the stage a subvolume of
    // its own, capped by a qgroup limit (on a `nosuid,nodev` mount): it is
    // the writable layer as it is. Otherwise a tmpfs of `disk_bytes`.
    // In a microVM, the guest's init may have mounted the sandbox's
    // writable disk there: it is the writable layer as it is too.
    let on_disk = match enter {
        Enter::Pivot => crate::btrfs::is_subvolume(stage),
        Enter::MoveAndChroot => is_mount_point(stage),
    };
    if !on_disk {
        mount(
            Some("tmpfs"),
            stage,
            Some("tmpfs"),
            MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
            Some(format!("{},mode=0755", tmpfs_size_options(spec.disk_bytes)).as_str()),
        )
        .map_err(step("mounting the writable layer"))?;
    }
    if enter == Enter::Pivot {
        keep_stage_open(stage)?;
    }
    let root = stage.join("root");
    for d in ["root", "upper", "work", "shm"] {
        mkdir(&stage.join(d), 0o755)?;
    }
    fs::set_permissions(stage.join("shm"), fs::Permissions::from_mode(0o1777))
        .map_err(step("preparing /dev/shm"))?;

    // A microVM's stage is its own disk, whose copies mount this layer's
    // work directory again: not volatile there (see `Upper`).
    let own = match enter {
        Enter::Pivot => Upper::Volatile,
        Enter::MoveAndChroot => Upper::Synced,
    };
    overlay_template(spec, stage, &root, overlay_layers, true, own)?;

    let t_root = t0.elapsed();
    if !spec.state_layers.is_empty() {
        // Setup writes and mounts at these paths; a sandbox saved them.
        for d in [
            "proc",
            "dev",
            "dev/shm",
            "dev/pts",
            "etc",
            "tmp",
            "var/tmp",
            "run",
            "run/runcell",
            "root",
            "sys",
        ] {
            refuse_symlinks(&root, Path::new("/").join(d).as_path())?;
        }
        refuse_symlinks(&root, Path::new(&spec.user.home))?;
    }
    populate(spec, &root, stage)?;
    bind_mounts(spec, &root)?;
    tracing::debug!(
        root_us = crate::sys::micros(t_root),
        populate_us = crate::sys::micros(t0.elapsed() - t_root),
        "sandbox filesystem laid out"
    );
    Ok(on_disk)
}

/// Enters the root [`lay_root`] laid out, and sets the host name and
/// loopback up.
fn enter_root(spec: &InitSpec, enter: Enter) -> Result<(), SetupError> {
    let t0 = std::time::Instant::now();
    let root = spec.staging_dir.join("root");
    chdir(&root).map_err(step("entering the new root"))?;
    match enter {
        Enter::Pivot => {
            pivot_root(".", ".").map_err(step("pivot_root"))?;
            // The old root is now stacked on top of "/": detach it.
            umount2(".", MntFlags::MNT_DETACH).map_err(step("detaching the old root"))?;
        }
        Enter::MoveAndChroot => {
            mount(Some("."), "/", None::<&str>, MsFlags::MS_MOVE, None::<&str>)
                .map_err(step("moving the new root over /"))?;
            nix::unistd::chroot(".").map_err(step("entering the new root (chroot)"))?;
        }
    }
    chdir("/").map_err(step("entering /"))?;

    sethostname(&spec.hostname).map_err(step("setting the host name"))?;
    // In the host's network namespace loopback is the host's (already up, and
    // not ours to change).
    if !spec.host_network {
        crate::sys::loopback_up().map_err(step("bringing up loopback"))?;
    }
    tracing::debug!(
        pivot_us = crate::sys::micros(t0.elapsed()),
        "sandbox filesystem entered"
    );
    Ok(())
}

/// Bytes of disk per file the writable layer may hold (ext4's default
/// ratio is one inode per 16 KiB; small files are common in sandboxes).
const BYTES_PER_INODE: u64 = 4096;

/// The number of files (inodes) the writable layer may hold. Every inode of
/// a tmpfs lives in memory whatever its size, so without a cap a million
/// empty files exhaust the sandbox's memory while `df` shows almost nothing
/// used; proportional to the disk size, it keeps their memory well below it.
pub fn inode_limit(disk_bytes: u64) -> u64 {
    (disk_bytes / BYTES_PER_INODE).max(1024)
}

/// Makes directory `path` (and its missing parents, as `mkdir -p` would)
/// and gives it `mode`; an existing directory is given `mode` too.
///
/// A directory it makes is made with `mode` at once, and the `chmod` after
/// is skipped when the umask cannot have taken a bit of it: a sandbox's
/// root has a few dozen such directories, made on every start (one system
/// call each, not three: no `chmod`, and no `stat` after a refused
/// `mkdir`). As with `mkdir(1)`, a directory made inside a set-group-ID
/// directory keeps the bit it inherits.
pub(crate) fn mkdir(path: &Path, mode: u32) -> Result<(), SetupError> {
    use std::os::unix::fs::DirBuilderExt;
    let make = || fs::DirBuilder::new().mode(mode).create(path);
    let made = match make() {
        Ok(()) => true,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            if let Some(parent) = path.parent() {
                fs::create_dir_all(parent)
                    .map_err(step(format!("creating {}", parent.display())))?;
            }
            match make() {
                Ok(()) => true,
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists && path.is_dir() => false,
                Err(e) => return Err(step(format!("creating {}", path.display()))(e)),
            }
        }
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists && path.is_dir() => false,
        Err(e) => return Err(step(format!("creating {}", path.display()))(e)),
    };
    if made && umask().is_some_and(|mask| mode & mask == 0) {
        return Ok(());
    }
    fs::set_permissions(path, fs::Permissions::from_mode(mode))
        .map_err(step(format!("setting the mode of {}", path.display())))
}

/// Reads what the root's setup caches per process ([`umask`]): a fork
/// server calls it before it forks any agent.
pub(crate) fn warm_up() {
    let _ = umask();
}

/// This process's umask, read once from `/proc/self/status` (the `umask`
/// call can only read it by changing it, which would race with any other
/// thread making a file meanwhile); `None` where the kernel does not say,
/// and [`mkdir`] then always sets the mode. Nothing in the jail changes the
/// umask, and a forked agent inherits it with this cache.
fn umask() -> Option<u32> {
    static UMASK: std::sync::OnceLock<Option<u32>> = std::sync::OnceLock::new();
    *UMASK.get_or_init(|| {
        let status = fs::read_to_string("/proc/self/status").ok()?;
        let field = status.lines().find_map(|l| l.strip_prefix("Umask:"))?;
        u32::from_str_radix(field.trim(), 8).ok()
    })
}

/// Overlays layers (topmost first) at a target with an upper and a work
/// directory: the jail's [`overlay_layers`] or gVisor's host-side one.
pub(crate) type OverlayLayers =
    fn(&[PathBuf], &Path, &Path, &Path, Upper) -> Result<(), SetupError>;

/// Overlays the template of `spec` at `root` (on the writable layer in
/// `stage`): a directory, layers (with `layered`, which takes them topmost
/// first), or the host's paths and named `/etc` entries. `bind_root` binds
/// `root` to itself first for a host template, so it is a mount point
/// `pivot_root` accepts. The jail and gVisor's host-side composition share it.
pub(crate) fn overlay_template(
    spec: &InitSpec,
    stage: &Path,
    root: &Path,
    layered: OverlayLayers,
    bind_root: bool,
    own: Upper,
) -> Result<(), SetupError> {
    // A snapshot's (or a hibernated sandbox's) files lie between the
    // template and the writable layer.
    let state_roots: Vec<PathBuf> = spec.state_layers.iter().map(|l| state_root(l)).collect();
    let upper = stage.join("upper").join(STATE_ROOT);
    let work = stage.join("work").join(STATE_ROOT);
    match &spec.rootfs {
        RootfsSpec::Directory { path } if state_roots.is_empty() => {
            overlay(path, root, &upper, &work, own)
        }
        RootfsSpec::Directory { path } => {
            let lowers: Vec<PathBuf> = state_roots.into_iter().chain([path.clone()]).collect();
            layered(&lowers, root, &upper, &work, own)
        }
        RootfsSpec::Layers { lowers, persist } => {
            let (upper, work, kind) = match persist {
                Some(dir) => (dir.join("diff"), dir.join("work"), Upper::Synced),
                None => (upper, work, own),
            };
            let lowers: Vec<PathBuf> = state_roots.into_iter().chain(lowers.clone()).collect();
            layered(&lowers, root, &upper, &work, kind)
        }
        RootfsSpec::Host { paths, etc } => {
            if !state_roots.is_empty() {
                // The root directory itself becomes an overlay of the
                // saved root over nothing, a mount point `pivot_root` accepts.
                layered(&state_roots, root, &upper, &work, own)?;
            } else if bind_root {
                bind(root, root, false)?;
            }
            for p in paths {
                host_path(p, root, stage, &spec.state_layers, own)?;
            }
            mkdir(&root.join("etc"), 0o755)?;
            for name in etc {
                host_etc_entry(name, root)?;
            }
            Ok(())
        }
    }
}

/// Creates a directory that is missing, leaving an existing one alone: in a
/// layered root a chmod would copy the directory up into the writable layer
/// (and, in a template build, into the next layer).
pub(crate) fn mkdir_if_missing(path: &Path, mode: u32) -> Result<bool, SetupError> {
    if fs::symlink_metadata(path).is_ok_and(|m| m.is_dir()) {
        return Ok(false);
    }
    mkdir(path, mode).map(|()| true)
}

/// Whether an overlay syncs its writable layer's file system.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Upper {
    /// Mounted `volatile`: the overlay never syncs the file system under
    /// it. For a sandbox's writable layer in a stage on the host (jail,
    /// gVisor), which is thrown away or saved by a snapshot of the stage
    /// (a btrfs snapshot flushes what the subvolume holds first, a tmpfs
    /// stage is copied). Without it every overlay's unmount at a sandbox's
    /// end synced its upper file system: with the btrfs layer store, a
    /// transaction commit of the whole store (and its write-out through the
    /// loop device) per sandbox, about 3 ms of CPU; and a sandbox's `fsync`
    /// or `syncfs` there reached the store every sandbox shares.
    Volatile,
    /// Synced as usual: a template build's layer, which outlives the
    /// sandbox, and a microVM's writable layer, on a disk of its own whose
    /// copies (a snapshot, a fork) mount the same work directory again,
    /// which overlayfs refuses after a volatile mount (its
    /// `work/incompat/volatile` marker).
    Synced,
}

/// The mount options of an overlay of `lowerdir` (already joined).
pub(crate) fn overlay_options(lowerdir: &str, upper: &Path, work: &Path, kind: Upper) -> String {
    let volatile = match kind {
        Upper::Volatile => ",volatile",
        Upper::Synced => "",
    };
    format!(
        "lowerdir={lowerdir},upperdir={},workdir={},userxattr{volatile}",
        upper.display(),
        work.display()
    )
}

pub(crate) fn overlay(
    lower: &Path,
    target: &Path,
    upper: &Path,
    work: &Path,
    kind: Upper,
) -> Result<(), SetupError> {
    mkdir(upper, 0o755)?;
    mkdir(work, 0o755)?;
    mkdir(target, 0o755)?;
    let opts = overlay_options(&lower.display().to_string(), upper, work, kind);
    mount(
        Some("overlay"),
        target,
        Some("overlay"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
        Some(opts.as_str()),
    )
    .map_err(step(format!("overlaying {}", lower.display())))
}

/// Overlays the layers of a layered template (topmost first) as the root.
/// Layer paths are given relative to their common parent (the mount
/// options must fit in one page, and a template may have many layers).
pub(crate) fn overlay_layers(
    lowers: &[PathBuf],
    target: &Path,
    upper: &Path,
    work: &Path,
    kind: Upper,
) -> Result<(), SetupError> {
    let bad = |what: String| SetupError::Step {
        step: "overlaying the template's layers".into(),
        source: io::Error::new(io::ErrorKind::InvalidInput, what),
    };
    if lowers.is_empty() {
        return Err(bad("the template has no layers".into()));
    }
    for p in lowers.iter().map(PathBuf::as_path).chain([upper, work]) {
        if !p.is_absolute() || p.to_string_lossy().contains([':', ',', '\\']) {
            return Err(bad(format!(
                "{} is not an absolute path without ':', ',' or '\\'",
                p.display()
            )));
        }
    }
    mkdir(upper, 0o755)?;
    mkdir(work, 0o755)?;
    mkdir(target, 0o755)?;
    let mut base = lowers[0].parent().unwrap_or(Path::new("/")).to_path_buf();
    while !lowers.iter().all(|l| l.starts_with(&base)) {
        base = base.parent().unwrap_or(Path::new("/")).to_path_buf();
    }
    let lowerdir: Vec<String> = lowers
        .iter()
        .map(|l| l.strip_prefix(&base).unwrap_or(l).display().to_string())
        .collect();
    let opts = overlay_options(&lowerdir.join(":"), upper, work, kind);
    // Relative lowerdirs are resolved against the working directory.
    chdir(&base).map_err(step(format!("entering {}", base.display())))?;
    let mounted = mount(
        Some("overlay"),
        target,
        Some("overlay"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
        Some(opts.as_str()),
    )
    .map_err(step(format!(
        "overlaying {} layers from {}",
        lowers.len(),
        base.display()
    )));
    chdir("/").map_err(step("leaving the layer directory"))?;
    mounted
}

/// Bind-mounts `src` on `dst`, read-only if asked, keeping the flags the
/// kernel locks on mounts inherited from the host (nosuid, nodev, noexec).
pub(crate) fn bind(src: &Path, dst: &Path, read_only: bool) -> Result<(), SetupError> {
    let what = format!("bind-mounting {}", src.display());
    mount(
        Some(src),
        dst,
        None::<&str>,
        MsFlags::MS_BIND | MsFlags::MS_REC,
        None::<&str>,
    )
    .map_err(step(what.clone()))?;
    if !read_only {
        return Ok(());
    }
    let locked = statvfs(src).map_err(step(what.clone()))?.flags();
    let mut flags = MsFlags::MS_BIND | MsFlags::MS_REMOUNT | MsFlags::MS_RDONLY;
    for (fs_flag, ms_flag) in [
        (FsFlags::ST_NOSUID, MsFlags::MS_NOSUID),
        (FsFlags::ST_NODEV, MsFlags::MS_NODEV),
        (FsFlags::ST_NOEXEC, MsFlags::MS_NOEXEC),
        (FsFlags::ST_NOATIME, MsFlags::MS_NOATIME),
        (FsFlags::ST_NODIRATIME, MsFlags::MS_NODIRATIME),
        (FsFlags::ST_RELATIME, MsFlags::MS_RELATIME),
    ] {
        if locked.contains(fs_flag) {
            flags |= ms_flag;
        }
    }
    mount(None::<&str>, dst, None::<&str>, flags, None::<&str>).map_err(step(what))
}

pub(crate) fn inside(root: &Path, abs: &Path) -> PathBuf {
    root.join(abs.strip_prefix("/").unwrap_or(abs))
}

/// Mirrors one host path of the `host` template: a symlink is copied, a
/// directory is overlaid (read-only lower, private upper).
pub(crate) fn host_path(
    p: &Path,
    root: &Path,
    stage: &Path,
    state_layers: &[PathBuf],
    own: Upper,
) -> Result<(), SetupError> {
    let meta = match fs::symlink_metadata(p) {
        Ok(m) => m,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(step(format!("inspecting {}", p.display()))(e)),
    };
    let target = inside(root, p);
    if let Some(parent) = target.parent() {
        // The root itself for a top-level path: made already.
        mkdir_if_missing(parent, 0o755)?;
    }
    if let Some(parent) = p.parent().filter(|_| !state_layers.is_empty()) {
        refuse_symlinks(root, parent)?;
    }
    if meta.file_type().is_symlink() {
        let link = fs::read_link(p).map_err(step(format!("reading {}", p.display())))?;
        // A saved layer may hold the entry already (the link, or what a
        // sandbox put there): the host's link wins.
        clear(&target)?;
        return symlink(&link, &target).map_err(step(format!("linking {}", p.display())));
    }
    if !state_layers.is_empty() {
        refuse_symlinks(root, p)?;
    }
    let key = host_path_key(p);
    let upper = stage.join("upper").join(&key);
    let work = stage.join("work").join(&key);
    // What earlier sandboxes wrote over this host path, topmost first.
    let saved: Vec<PathBuf> = state_layers
        .iter()
        .map(|l| l.join("upper").join(&key))
        .filter(|d| d.is_dir())
        .collect();
    if saved.is_empty() {
        overlay(p, &target, &upper, &work, own)
    } else {
        let lowers: Vec<PathBuf> = saved.into_iter().chain([p.to_path_buf()]).collect();
        overlay_layers(&lowers, &target, &upper, &work, own)
    }
}

/// The name of the writable layer of a host path of the `host` template
/// (`/usr` → `_usr`), under the stage's `upper` (and a state layer's).
pub fn host_path_key(p: &Path) -> String {
    p.display().to_string().replace('/', "_")
}

/// The directory of a state layer (and of the stage's `upper`) that holds
/// what was written to the root itself; a `host` template's host paths
/// have their own, named by [`host_path_key`].
pub const STATE_ROOT: &str = "root";

/// The directory of state layer `layer` that holds what was written to the
/// root: `upper/root/` in a snapshot of a btrfs stage whose root was an
/// overlay (the stage as it was: its `root/` is then the empty mount
/// point), `root/` otherwise (a copied layer, or a stage whose root was
/// its own directory). Both are directories the agent made in its stage,
/// never something a sandbox could have put there.
pub fn state_root(layer: &Path) -> PathBuf {
    let overlaid = layer.join("upper").join(STATE_ROOT);
    if fs::symlink_metadata(&overlaid).is_ok_and(|m| m.is_dir()) {
        overlaid
    } else {
        layer.join(STATE_ROOT)
    }
}

/// Keeps the stage (the writable layer's tmpfs) open on [`STAGE_FD`] for
/// the host to snapshot: after `pivot_root` no path leads to it.
fn keep_stage_open(stage: &Path) -> Result<(), SetupError> {
    use nix::fcntl::{fcntl, open, FcntlArg, OFlag};
    let fd = open(
        stage,
        OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        nix::sys::stat::Mode::empty(),
    )
    .map_err(step("opening the writable layer"))?;
    if std::os::fd::AsRawFd::as_raw_fd(&fd) == STAGE_FD {
        // The lowest free descriptor was the one we want: keep it open.
        let _ = std::os::fd::IntoRawFd::into_raw_fd(fd);
        return Ok(());
    }
    let kept = fcntl(&fd, FcntlArg::F_DUPFD_CLOEXEC(STAGE_FD))
        .map_err(step("keeping the writable layer open"))?;
    if kept != STAGE_FD {
        // SAFETY: `fcntl` just returned this descriptor; we close our copy.
        drop(unsafe { OwnedFd::from_raw_fd(kept) });
        return Err(step("keeping the writable layer open")(io::Error::other(
            format!("descriptor {STAGE_FD} is taken"),
        )));
    }
    // The descriptor stays open for the agent's whole life.
    Ok(())
}

/// Fails if a component of `abs` under `root` is a symlink. Before
/// `pivot_root` an absolute symlink resolves against the host's root, so
/// a root holding files a sandbox wrote (a state layer) must not steer
/// where setup creates, writes or mounts.
fn refuse_symlinks(root: &Path, abs: &Path) -> Result<(), SetupError> {
    let mut at = root.to_path_buf();
    for c in abs.components() {
        if let std::path::Component::Normal(name) = c {
            at.push(name);
            if fs::symlink_metadata(&at).is_ok_and(|m| m.file_type().is_symlink()) {
                return Err(step(format!("preparing {}", abs.display()))(
                    io::Error::new(
                        io::ErrorKind::InvalidData,
                        "a saved layer made it a symlink",
                    ),
                ));
            }
        }
    }
    Ok(())
}

/// Binds the spec's host directories (volumes) into the new root.
fn bind_mounts(spec: &InitSpec, root: &Path) -> Result<(), SetupError> {
    for m in &spec.mounts {
        let bad = m.target.components().any(|c| {
            matches!(
                c,
                std::path::Component::ParentDir | std::path::Component::CurDir
            )
        });
        if !m.target.is_absolute() || bad || m.target == Path::new("/") {
            return Err(step("binding a volume")(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{} is not an absolute path below /", m.target.display()),
            )));
        }
        refuse_symlinks(root, &m.target)?;
        let target = inside(root, &m.target);
        mkdir_if_missing(&target, 0o755)?;
        bind(&m.source, &target, m.read_only)?;
    }
    Ok(())
}

pub(crate) fn host_etc_entry(name: &str, root: &Path) -> Result<(), SetupError> {
    if name.contains('/') && name.split('/').any(|c| c == ".." || c.is_empty()) {
        return Ok(());
    }
    let src = Path::new("/etc").join(name);
    let meta = match fs::symlink_metadata(&src) {
        Ok(m) => m,
        Err(_) => return Ok(()),
    };
    let dst = root.join("etc").join(name);
    // A saved layer may hold the entry already, as anything (a symlink
    // out of the root among them): the host's entry replaces it.
    clear(&dst)?;
    if meta.file_type().is_symlink() {
        let link = fs::read_link(&src).map_err(step(format!("reading {}", src.display())))?;
        return symlink(&link, &dst).map_err(step(format!("linking {}", src.display())));
    }
    if meta.is_dir() {
        mkdir(&dst, 0o755)?;
    } else {
        File::create(&dst).map_err(step(format!("creating {}", dst.display())))?;
    }
    bind(&src, &dst, true)
}

/// Removes whatever is at `path` (never following a symlink); nothing
/// there is fine.
fn clear(path: &Path) -> Result<(), SetupError> {
    let removed = match fs::symlink_metadata(path) {
        Err(_) => return Ok(()),
        Ok(m) if m.is_dir() => fs::remove_dir_all(path),
        Ok(_) => fs::remove_file(path),
    };
    removed.map_err(step(format!("replacing {}", path.display())))
}

fn write_file(path: &Path, content: &str) -> Result<(), SetupError> {
    // Remove first: in a directory template the file may be a symlink into the
    // lower layer.
    let _ = fs::remove_file(path);
    fs::write(path, content).map_err(step(format!("writing {}", path.display())))
}

/// Creates the directories, /etc files, /proc and /dev every sandbox has.
fn populate(spec: &InitSpec, root: &Path, stage: &Path) -> Result<(), SetupError> {
    let user = &spec.user;
    // A layered root is a complete image: keep what it has and write nothing
    // into it (a template build persists every write into its next layer).
    let layered = matches!(spec.rootfs, RootfsSpec::Layers { .. });
    for (d, mode) in [
        ("proc", 0o555),
        ("dev", 0o755),
        ("etc", 0o755),
        ("tmp", 0o1777),
        ("var/tmp", 0o1777),
        ("run", 0o755),
        ("root", 0o700),
    ] {
        if layered {
            mkdir_if_missing(&root.join(d), mode)?;
        } else {
            mkdir(&root.join(d), mode)?;
        }
    }
    let home = inside(root, Path::new(&user.home));
    let make_home = if layered {
        mkdir_if_missing(&home, 0o755)?
    } else {
        mkdir(&home, 0o755)?;
        true
    };
    if make_home {
        chown(
            &home,
            Some(Uid::from_raw(user.uid)),
            Some(Gid::from_raw(user.gid)),
        )
        .map_err(step("giving the home directory to the sandbox user"))?;
    }

    synthesize_etc(spec, &root.join("etc"), stage, layered)?;

    // /proc: a fresh instance for our pid namespace, with host-wide knobs masked.
    let proc_dir = root.join("proc");
    mount(
        Some("proc"),
        &proc_dir,
        Some("proc"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
        None::<&str>,
    )
    .map_err(step("mounting /proc"))?;
    for ro in ["sys", "sysrq-trigger", "irq", "bus", "fs"] {
        let p = proc_dir.join(ro);
        if p.exists() {
            bind(&p, &p, true)?;
        }
    }
    for masked in ["kcore", "keys", "timer_list", "sched_debug", "kallsyms"] {
        let p = proc_dir.join(masked);
        if p.exists() {
            bind(Path::new("/dev/null"), &p, true)?;
        }
    }

    // /dev: host device nodes bound in (a tmpfs we mount cannot hold usable nodes).
    let dev = root.join("dev");
    mount(
        Some("tmpfs"),
        &dev,
        Some("tmpfs"),
        MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC,
        Some("size=64k,mode=0755"),
    )
    .map_err(step("mounting /dev"))?;
    for node in ["null", "zero", "full", "random", "urandom", "tty"] {
        let dst = dev.join(node);
        File::create(&dst).map_err(step(format!("creating /dev/{node}")))?;
        bind(&Path::new("/dev").join(node), &dst, false)?;
    }
    for (link, to) in [
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
        ("ptmx", "pts/ptmx"),
        ("core", "/proc/kcore"),
    ] {
        symlink(to, dev.join(link)).map_err(step(format!("linking /dev/{link}")))?;
    }
    let pts = dev.join("pts");
    mkdir(&pts, 0o755)?;
    mount(
        Some("devpts"),
        &pts,
        Some("devpts"),
        MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC,
        Some("newinstance,ptmxmode=0666,mode=0620"),
    )
    .map_err(step("mounting /dev/pts"))?;
    let shm = dev.join("shm");
    mkdir(&shm, 0o1777)?;
    // Shared memory lives in the writable layer, under the same size cap.
    bind(&stage.join("shm"), &shm, false)?;

    // The egress socket: the host's proxy for this sandbox. The host made its
    // directory 0700 and the socket 0600, both owned by root of the sandbox,
    // so only the agent can connect. The directory is bind-mounted, not the
    // socket: a restarted daemon binds a new socket in it, which the agent
    // then reaches (a file bind mount would pin the dead socket's inode).
    if let Some(sock) = &spec.egress_socket {
        let src = sock.parent().ok_or_else(|| {
            step("finding the egress socket's directory")(io::Error::from(io::ErrorKind::NotFound))
        })?;
        let dst = inside(root, Path::new(crate::spec::EGRESS_SOCKET));
        let dst = dst.parent().expect("EGRESS_SOCKET is in a directory");
        if let Some(parent) = dst.parent() {
            mkdir_if_missing(parent, 0o755)?;
        }
        mkdir_if_missing(dst, 0o700)?;
        bind(src, dst, false)?;
    }
    Ok(())
}

/// Writes the generated `/etc` files. In a layered root they are written to
/// the writable layer's tmpfs and bind-mounted over the image's (which are
/// created empty when missing), and the image's `passwd`, `group` and
/// `nsswitch.conf` are kept. A sandbox in the host's network namespace sees
/// the host's `resolv.conf` and `hosts`, read-only.
pub(crate) fn synthesize_etc(
    spec: &InitSpec,
    etc: &Path,
    stage: &Path,
    layered: bool,
) -> Result<(), SetupError> {
    let user = &spec.user;
    let (uid, gid, name, home) = (user.uid, user.gid, &user.name, &user.home);
    let generated = stage.join("etc");
    if layered {
        mkdir(&generated, 0o755)?;
    }
    let place = |file: &str, content: &str| -> Result<(), SetupError> {
        let dst = etc.join(file);
        if !layered {
            return write_file(&dst, content);
        }
        let src = generated.join(file);
        write_file(&src, content)?;
        bind_over(&src, &dst)
    };
    let keep_image = |file: &str| layered && fs::symlink_metadata(etc.join(file)).is_ok();
    if !keep_image("passwd") {
        place(
            "passwd",
            &format!(
                "root:x:0:0:root:/root:/bin/bash\n\
                 {name}:x:{uid}:{gid}:{name}:{home}:/bin/bash\n\
                 nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
            ),
        )?;
    }
    if !keep_image("group") {
        place(
            "group",
            &format!("root:x:0:\n{name}:x:{gid}:\nnogroup:x:65534:\n"),
        )?;
    }
    place("hostname", &format!("{}\n", spec.hostname))?;
    if spec.host_network {
        for file in ["resolv.conf", "hosts"] {
            let dst = etc.join(file);
            ensure_file(&dst)?;
            bind(&Path::new("/etc").join(file), &dst, true)?;
        }
    } else {
        place(
            "hosts",
            &format!(
                "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n127.0.1.1\t{}\n",
                spec.hostname
            ),
        )?;
        // No network by default: no resolver. Lookups fail at once instead of hanging.
        place("resolv.conf", "# runcell: this sandbox has no network\n")?;
    }
    if !keep_image("nsswitch.conf") {
        place(
            "nsswitch.conf",
            "passwd: files\ngroup: files\nshadow: files\nhosts: files dns\n",
        )?;
    }
    Ok(())
}

/// Makes `path` a regular file to mount on: a symlink there (which a mount
/// would follow) is replaced by an empty file.
fn ensure_file(path: &Path) -> Result<(), SetupError> {
    match fs::symlink_metadata(path) {
        Ok(m) if m.is_file() => Ok(()),
        Ok(_) => {
            let _ = fs::remove_file(path);
            File::create(path)
                .map(drop)
                .map_err(step(format!("creating {}", path.display())))
        }
        Err(_) => File::create(path)
            .map(drop)
            .map_err(step(format!("creating {}", path.display()))),
    }
}

/// Bind-mounts a generated file over an image's file, read-only.
fn bind_over(src: &Path, dst: &Path) -> Result<(), SetupError> {
    ensure_file(dst)?;
    bind(src, dst, true)
}

/// The soft limit on open files every sandboxed program starts with (the
/// hard limit is the host's; the program may raise its own up to it).
pub const SANDBOX_OPEN_FILES: libc::rlim_t = 1024;

/// Turns a freshly forked child into the unprivileged sandbox user. Called in
/// `pre_exec`, so it uses only async-signal-safe calls.
///
/// New session (no controlling terminal), OOM score raised to 500 so the OOM
/// killer always picks user code before the agent (raising needs no privilege;
/// lowering the agent's would need CAP_SYS_RESOURCE on the host), capability bounding set emptied, groups and ids set
/// to the sandbox user (which drops all capabilities), core dumps off, and
/// a soft limit of [`SANDBOX_OPEN_FILES`] open files.
///
/// `uid` 0 is root of the sandbox's user namespace (an unprivileged host
/// uid), which only template builds ask for (`RUN apt-get ...`): it keeps
/// the namespace's capabilities (the bounding set is left alone) but gets
/// the same session, OOM score, `no_new_privs`, core-dump and open-files
/// settings.
pub fn drop_privileges(uid: u32, gid: u32) -> io::Result<()> {
    fn check(rc: libc::c_int) -> io::Result<()> {
        if rc < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(())
        }
    }
    fn check_long(rc: libc::c_long) -> io::Result<()> {
        if rc < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(())
        }
    }
    // SAFETY: each call is a plain syscall with valid scalar or static
    // arguments; none allocates, so they are safe between fork and exec.
    unsafe {
        check(libc::setsid())?;
        let fd = libc::open(
            c"/proc/self/oom_score_adj".as_ptr(),
            libc::O_WRONLY | libc::O_CLOEXEC,
        );
        if fd >= 0 {
            libc::write(fd, b"500".as_ptr().cast(), 3);
            libc::close(fd);
        }
        // Root of the sandbox (a template build's step) keeps its
        // capabilities. Everyone else drops only what the bounding set
        // holds, where that was noted (`note_inherited`); otherwise every
        // capability the kernel knows.
        if uid != 0 {
            let bounding = BOUNDING_SET.load(Ordering::Relaxed);
            for cap in (0..=63).filter(|c| bounding & (1u64 << c) != 0) {
                if libc::prctl(libc::PR_CAPBSET_DROP, cap, 0, 0, 0) < 0
                    && *libc::__errno_location() == libc::EINVAL
                {
                    break;
                }
            }
        }
        // A kernel without ambient capabilities (gVisor's) refuses the
        // call with EINVAL: there are then none to clear.
        if libc::prctl(
            libc::PR_CAP_AMBIENT,
            libc::PR_CAP_AMBIENT_CLEAR_ALL,
            0,
            0,
            0,
        ) < 0
            && *libc::__errno_location() != libc::EINVAL
        {
            return Err(io::Error::last_os_error());
        }
        // Raw syscalls, not the libc wrappers, which coordinate a credential
        // change across all threads of the process (see spawn::child_exec).
        check_long(libc::syscall(
            libc::SYS_setgroups,
            0,
            std::ptr::null::<libc::gid_t>(),
        ))?;
        check_long(libc::syscall(libc::SYS_setresgid, gid, gid, gid))?;
        check_long(libc::syscall(libc::SYS_setresuid, uid, uid, uid))?;
        check(libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0))?;
        let no_core = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        check(libc::setrlimit(libc::RLIMIT_CORE, &no_core))?;
        // Open files: a soft limit of SANDBOX_OPEN_FILES, the hard limit as
        // inherited (the program may raise its own up to it), as containerd
        // gives containers; not whatever the daemon was started with (its
        // own soft limit is raised to serve many sandboxes).
        let mut files = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        check(libc::getrlimit(libc::RLIMIT_NOFILE, &mut files))?;
        files.rlim_cur = files.rlim_max.min(SANDBOX_OPEN_FILES);
        check(libc::setrlimit(libc::RLIMIT_NOFILE, &files))?;
    }
    reset_signal_dispositions();
    Ok(())
}

/// Makes the calling thread, and only it, access files as `uid`/`gid`
/// (`0`/`0`: as root again), for file operations the agent does on the
/// sandbox user's behalf. Uses the thread's fsuid/fsgid; where the kernel
/// has none (gVisor answers `setfsuid` with `ENOSYS`) the thread's
/// effective ids instead, keeping root as the saved id so it can switch
/// back. Raw system calls: the libc wrappers of `setresuid` would change
/// every thread of the agent.
pub fn set_file_user(uid: u32, gid: u32) -> io::Result<()> {
    const UNCHANGED: libc::c_long = -1;
    // Only root may change the group: drop it first, regain it last.
    let user_last = |calls: [libc::c_long; 2]| {
        if uid == 0 {
            [calls[1], calls[0]]
        } else {
            calls
        }
    };
    let id = |call: libc::c_long| {
        libc::c_long::from(
            if call == libc::SYS_setfsuid || call == libc::SYS_setresuid {
                uid
            } else {
                gid
            },
        )
    };
    // SAFETY: plain system calls on scalars; errno is read on this thread.
    unsafe {
        let [first, second] = user_last([libc::SYS_setfsgid, libc::SYS_setfsuid]);
        // setfsuid/setfsgid answer the previous id, even when they refuse;
        // only a kernel without them answers -1 (ENOSYS).
        if libc::syscall(first, id(first)) != -1 || *libc::__errno_location() != libc::ENOSYS {
            libc::syscall(second, id(second));
            return Ok(());
        }
        let set = |call: libc::c_long| libc::syscall(call, UNCHANGED, id(call), UNCHANGED) == 0;
        if user_last([libc::SYS_setresgid, libc::SYS_setresuid])
            .into_iter()
            .all(set)
        {
            Ok(())
        } else {
            Err(io::Error::last_os_error())
        }
    }
}

/// The signals this process ignores (bit `n - 1` for signal `n`), as
/// [`note_inherited`] noted them; all bits (not noted) means every signal.
static IGNORED_SIGNALS: AtomicU64 = AtomicU64::new(u64::MAX);

/// The capabilities in this process's bounding set (bit `n` for capability
/// `n`), as [`note_inherited`] noted them; all bits (not noted) means every
/// capability the kernel knows.
static BOUNDING_SET: AtomicU64 = AtomicU64::new(u64::MAX);

fn signal_bit(sig: libc::c_int) -> u64 {
    u32::try_from(sig - 1)
        .ok()
        .and_then(|n| 1u64.checked_shl(n))
        .unwrap_or(u64::MAX)
}

/// Notes which signals this process ignores and which capabilities its
/// bounding set holds, so that [`drop_privileges`] in the processes it
/// forks resets and drops only those instead of every one: each is a
/// system call, and under gVisor's ptrace platform a system call costs
/// 15-40 µs, about 2 ms of every exec for the 70 a full sweep makes.
///
/// Only for a process that ignores no further signal afterwards (the exec
/// fork server, which changes none): a signal ignored after the note would
/// pass to the programs it starts. The bounding set can only shrink, so an
/// older note covers it. Where `/proc/self/status` cannot be read or lacks
/// the bounding set, that part stays "every capability".
pub fn note_inherited() {
    let mut ignored = 0u64;
    for sig in 1..libc::SIGRTMIN() {
        if sig == libc::SIGKILL || sig == libc::SIGSTOP {
            continue;
        }
        // SAFETY: sigaction(2) with a null new action only reads the
        // disposition into the local, zeroed struct.
        let ignores = unsafe {
            let mut old: libc::sigaction = std::mem::zeroed();
            libc::sigaction(sig, std::ptr::null(), &mut old) < 0
                || old.sa_sigaction == libc::SIG_IGN
        };
        if ignores {
            ignored |= signal_bit(sig);
        }
    }
    IGNORED_SIGNALS.store(ignored, Ordering::Relaxed);
    let bounding = fs::read_to_string("/proc/self/status").ok().and_then(|s| {
        s.lines()
            .find_map(|l| l.strip_prefix("CapBnd:"))
            .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
    });
    if let Some(b) = bounding {
        BOUNDING_SET.store(b, Ordering::Relaxed);
    }
}

/// Sets every ignored signal back to its default action (every signal,
/// where [`note_inherited`] did not note which). Handlers are reset by exec
/// anyway; ignored signals are not, and would otherwise pass from whoever
/// started the host process to sandboxed code (Python then never sees
/// SIGINT as KeyboardInterrupt). Only makes async-signal-safe syscalls.
pub fn reset_signal_dispositions() {
    // Only the ignored ones, where they were noted (`note_inherited`).
    let ignored = IGNORED_SIGNALS.load(Ordering::Relaxed);
    for sig in 1..libc::SIGRTMIN() {
        if sig == libc::SIGKILL || sig == libc::SIGSTOP || ignored & signal_bit(sig) == 0 {
            continue;
        }
        // SAFETY: signal(2) with SIG_DFL touches no memory; invalid numbers
        // just fail with EINVAL.
        unsafe {
            libc::signal(sig, libc::SIG_DFL);
        }
    }
}

/// Places `fds[i]` at descriptor `3 + i` in a child between fork and exec,
/// without close-on-exec, so the program it runs inherits them there. Only
/// makes async-signal-safe syscalls.
pub fn place_fds(fds: &[std::os::fd::RawFd]) -> io::Result<()> {
    let mut high = [0 as libc::c_int; 8];
    if fds.len() > high.len() {
        return Err(io::Error::from_raw_os_error(libc::EINVAL));
    }
    // SAFETY: fcntl/dup2/close on descriptors this process owns; no memory is
    // touched but the local array. Copying every descriptor above the target
    // range first means no dup2 overwrites a source still to be copied.
    unsafe {
        for (i, &fd) in fds.iter().enumerate() {
            let h = libc::fcntl(fd, libc::F_DUPFD, 64);
            if h < 0 {
                return Err(io::Error::last_os_error());
            }
            high[i] = h;
        }
        // At most 8 descriptors (checked above): targets 3 to 10.
        for (&h, target) in high[..fds.len()].iter().zip(3..) {
            if libc::dup2(h, target) < 0 {
                return Err(io::Error::last_os_error());
            }
            libc::close(h);
        }
    }
    Ok(())
}

/// Signals the exec supervisor waits for: its children's exits, and SIGTERM
/// from the agent, which means "kill everything this exec started now".
fn supervisor_signals() -> libc::sigset_t {
    // SAFETY: sigemptyset/sigaddset only write to the local set.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGCHLD);
        libc::sigaddset(&mut set, libc::SIGTERM);
        set
    }
}

/// Turns a freshly forked child (in `pre_exec`) into the supervisor of one
/// exec: it starts the user's command (`image`, after [`drop_privileges`])
/// itself, and returns only an error, when the command could not start
/// (which std then reports to the spawning agent).
///
/// The supervisor stays root of the sandbox (so the sandbox user cannot
/// signal it), marks itself a child subreaper and forks the command. Every
/// process the command starts is therefore its descendant until it exits,
/// whatever it does to detach: orphans (`cmd &` of an exited shell,
/// `nohup`, `setsid`, double forks) are re-parented to the supervisor, not
/// to the agent. When the command exits, the supervisor kills every process
/// left (unless `keep_background`), reaps them, and exits with the
/// command's status: the same code, or killed by the same signal. SIGTERM
/// from the agent (a timeout or a kill request) makes it kill everything at
/// once. It closes every descriptor it inherited, so it holds none of the
/// command's pipes and none of the agent's sockets.
///
/// `group`: where the sandbox has no child subreaper (gVisor), the exec's
/// own cgroup ([`ExecGroupFds`]): the supervisor joins it before it forks
/// the command, so everything the command starts is in it whatever it does
/// to detach (a `setsid` orphan is re-parented to the agent, not to us),
/// and the supervisor kills every process listed there.
///
/// Only async-signal-safe calls are made (it runs between fork and exec of
/// a possibly multi-threaded agent); it never allocates.
pub fn supervise_exec(
    uid: u32,
    gid: u32,
    keep_background: bool,
    group: Option<ExecGroupFds>,
    image: &ExecImage,
    report: Option<libc::c_int>,
) -> io::Result<()> {
    let set = supervisor_signals();
    if let Some(g) = group {
        join_group(g.procs_write)?;
    }
    // SAFETY: plain syscalls on scalars, the local signal sets and the
    // child's arguments and stack, which live in this frame until the
    // child has called execve or exited; no memory is allocated.
    unsafe {
        // gVisor (release 20221219) refuses it with EINVAL: the command's
        // orphans then go to the agent, which reaps them but does not kill
        // them when the command exits. Any other failure is an error.
        if libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) < 0
            && *libc::__errno_location() != libc::EINVAL
        {
            return Err(io::Error::last_os_error());
        }
        // Blocked before the clone so no exit is missed; the command gets
        // the empty mask std set up for it back.
        let mut old: libc::sigset_t = std::mem::zeroed();
        if libc::sigprocmask(libc::SIG_BLOCK, &set, &mut old) < 0 {
            return Err(io::Error::last_os_error());
        }
        // The command shares this process's memory until it calls execve
        // (CLONE_VM | CLONE_VFORK, as posix_spawn does): no copy of the
        // address space to make, and no copy-on-write faults, which under
        // gVisor's ptrace platform cost as much as a second fork. It runs
        // on a stack in this frame and says why it could not start in
        // `args.error`, which this process reads once it runs again.
        let mut args = CommandStart {
            uid,
            gid,
            mask: old,
            image,
            error: 0,
        };
        // Not zeroed: the command touches only the top of it, and zeroing
        // 64 KiB in a process just forked was a memset and sixteen page
        // faults on every exec.
        let mut stack = std::mem::MaybeUninit::<[u8; COMMAND_STACK]>::uninit();
        let top = stack.as_mut_ptr().cast::<u8>().add(COMMAND_STACK);
        // 16-byte alignment, as the x86-64 and aarch64 ABIs require.
        let top = top.sub(top as usize % 16);
        let main = libc::clone(
            start_command,
            top.cast(),
            libc::CLONE_VM | libc::CLONE_VFORK | libc::SIGCHLD,
            std::ptr::addr_of_mut!(args).cast(),
        );
        if main < 0 {
            return Err(io::Error::last_os_error());
        }
        if args.error != 0 {
            libc::waitpid(main, std::ptr::null_mut(), 0);
            return Err(io::Error::from_raw_os_error(args.error));
        }
        // Started through the fork server: say so (and the pids) on the
        // report pipe, which the descriptor sweep below then closes.
        if let Some(fd) = report {
            crate::zygote::report_started(fd, main);
        }
        // Hold nothing of the agent's or of the command's stdio: the command's
        // pipes must close when the last process of the exec is gone, and
        // std's exec-error pipe must close so the agent's spawn returns.
        let null = libc::open(c"/dev/null".as_ptr(), libc::O_RDWR);
        if null >= 0 {
            for fd in 0..3 {
                libc::dup2(null, fd);
            }
        }
        // The exec's cgroup list stays open, at GROUP_FD.
        let first = match group {
            Some(g) if libc::dup2(g.procs_read, GROUP_FD) == GROUP_FD => GROUP_FD + 1,
            Some(_) => return Err(io::Error::last_os_error()),
            None => 3,
        };
        // The fork server's report pipe stays open: the exit goes there too.
        let ranges: [(libc::c_uint, libc::c_uint); 2] = match report.filter(|&fd| fd >= first) {
            Some(k) => [
                (first as libc::c_uint, (k - 1) as libc::c_uint),
                ((k + 1) as libc::c_uint, crate::sys::MAX_FD),
            ],
            None => [(first as libc::c_uint, crate::sys::MAX_FD), (1, 0)],
        };
        for (from, to) in ranges {
            if from > to {
                continue;
            }
            if libc::syscall(libc::SYS_close_range, from, to, 0u32) < 0 {
                // Kernels before 5.9: close what a process normally has open.
                for fd in from..=to.min(4095) {
                    libc::close(fd as libc::c_int);
                }
            }
        }
        let status = supervise(main, &set, keep_background, group.is_some());
        if let Some(fd) = report {
            crate::zygote::report_exited(fd, status);
        }
        exit_like(status)
    }
}

/// The stack the command runs on between its clone and its execve.
const COMMAND_STACK: usize = 64 * 1024;

/// What the command's first moments need, in the supervisor's frame.
struct CommandStart<'a> {
    uid: u32,
    gid: u32,
    mask: libc::sigset_t,
    image: &'a ExecImage,
    /// Why the command could not start (an errno), 0 if it did.
    error: libc::c_int,
}

/// The command between its clone and its execve: restores the signal
/// mask, drops to the sandbox user ([`drop_privileges`]) and runs the
/// program. Only async-signal-safe calls; it shares the supervisor's memory
/// (which is stopped until this calls execve or exits) and writes nothing
/// of it but `error`.
extern "C" fn start_command(arg: *mut libc::c_void) -> libc::c_int {
    // SAFETY: `arg` is the supervisor's live CommandStart (see
    // supervise_exec); the supervisor does not run until this process
    // calls execve or exits, so nothing else touches it.
    let start = unsafe { &mut *arg.cast::<CommandStart<'_>>() };
    // SAFETY: restores the mask from a valid set; no memory is written.
    unsafe { libc::sigprocmask(libc::SIG_SETMASK, &start.mask, std::ptr::null_mut()) };
    let error = match drop_privileges(start.uid, start.gid) {
        Err(e) => e.raw_os_error().unwrap_or(libc::EPERM),
        Ok(()) => {
            // The image, else (if it could not be run) its fallback: an
            // execve that fails changes nothing, so the fallback starts
            // from where the first would have.
            let mut next = Some(start.image);
            let mut error = 0;
            while let Some(image) = next {
                // SAFETY: the path and both arrays are NUL-terminated and
                // live in the ExecImage the agent holds until spawn returns.
                error = unsafe {
                    libc::execve(
                        image.path.as_ptr(),
                        image.argv.as_ptr(),
                        image.envp.as_ptr(),
                    );
                    *libc::__errno_location()
                };
                next = image.fallback.as_deref();
            }
            error
        }
    };
    start.error = if error == 0 { libc::ENOEXEC } else { error };
    // SAFETY: _exit(2) ends this process without running any Rust code.
    unsafe { libc::_exit(127) }
}

/// The program an exec's command runs, laid out before the fork: the
/// command's first moments ([`supervise_exec`]) may not allocate.
#[derive(Debug)]
pub struct ExecImage {
    path: std::ffi::CString,
    /// The arguments and environment as C strings, owned here; `argv` and
    /// `envp` point into them and end with a null pointer.
    _strings: Vec<std::ffi::CString>,
    argv: Vec<*const libc::c_char>,
    envp: Vec<*const libc::c_char>,
    /// What runs instead if this image cannot be ([`ExecImage::or_else`]).
    fallback: Option<Box<ExecImage>>,
}

// SAFETY: the raw pointers point into `_strings`, which the image owns and
// never changes after it is made; sharing or moving it moves only those
// immutable heap buffers.
unsafe impl Send for ExecImage {}
// SAFETY: as for Send: nothing in the image is ever written after `new`.
unsafe impl Sync for ExecImage {}

impl ExecImage {
    /// `program` (found on the `PATH` of `env` unless it has a slash) with
    /// `argv` (its first element is the program's name as given) and the
    /// environment `env`. A string with a NUL byte is `InvalidInput`; a
    /// program not found is `NotFound`.
    pub fn new<'a>(
        program: &str,
        argv: &[String],
        env: impl IntoIterator<Item = (&'a String, &'a String)>,
    ) -> io::Result<Self> {
        use std::ffi::CString;
        let nul = |_| io::Error::new(io::ErrorKind::InvalidInput, "a NUL byte in a command");
        let env: Vec<CString> = env
            .into_iter()
            .map(|(k, v)| CString::new(format!("{k}={v}")).map_err(nul))
            .collect::<io::Result<_>>()?;
        let path_var = env
            .iter()
            .find_map(|e| e.to_bytes().strip_prefix(b"PATH="))
            .map(|p| String::from_utf8_lossy(p).into_owned());
        let path = CString::new(find_program(program, path_var.as_deref())?).map_err(nul)?;
        let args: Vec<CString> = argv
            .iter()
            .map(|a| CString::new(a.as_str()).map_err(nul))
            .collect::<io::Result<_>>()?;
        Ok(Self::from_parts(path, args, env))
    }

    /// The image of `path` with `args` and `env` as they are (no `PATH`
    /// search).
    pub(crate) fn from_parts(
        path: std::ffi::CString,
        args: Vec<std::ffi::CString>,
        env: Vec<std::ffi::CString>,
    ) -> Self {
        let argv = args
            .iter()
            .map(|a| a.as_ptr())
            .chain([std::ptr::null()])
            .collect();
        let envp = env
            .iter()
            .map(|e| e.as_ptr())
            .chain([std::ptr::null()])
            .collect();
        let mut strings = args;
        strings.extend(env);
        Self {
            path,
            _strings: strings,
            argv,
            envp,
            fallback: None,
        }
    }

    /// This image, and `fallback` to run instead if `execve` refuses it
    /// (any error: the program cannot be run by the exec's user, is not an
    /// executable format, is gone). A failed `execve` has no effect, so
    /// the fallback starts exactly as it would have without the attempt.
    /// Its own fallback, if any, is dropped: one attempt more at most.
    pub fn or_else(mut self, mut fallback: ExecImage) -> Self {
        fallback.fallback = None;
        self.fallback = Some(Box::new(fallback));
        self
    }

    /// The image run if this one cannot be.
    pub(crate) fn fallback(&self) -> Option<&ExecImage> {
        self.fallback.as_deref()
    }

    /// The program's path, its arguments and its environment.
    pub(crate) fn parts(&self) -> (&std::ffi::CStr, &[std::ffi::CString], &[std::ffi::CString]) {
        let argc = self.argv.len() - 1;
        (&self.path, &self._strings[..argc], &self._strings[argc..])
    }
}

/// `program` as execve wants it: itself if it has a slash, else the first
/// executable file of that name on `path` (`/usr/bin:/bin` without one).
fn find_program(program: &str, path: Option<&str>) -> io::Result<String> {
    use std::os::unix::fs::PermissionsExt;
    if program.contains('/') {
        return Ok(program.to_string());
    }
    if program.is_empty() {
        return Err(io::Error::from_raw_os_error(libc::ENOENT));
    }
    path.unwrap_or("/usr/bin:/bin")
        .split(':')
        .map(|dir| if dir.is_empty() { "." } else { dir })
        .map(|dir| format!("{dir}/{program}"))
        .find(|p| fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0))
        .ok_or_else(|| io::Error::from_raw_os_error(libc::ENOENT))
}

/// The descriptors of an exec's own cgroup (gVisor's pids hierarchy),
/// opened by the agent with close-on-exec: its `cgroup.procs` for writing
/// (the supervisor joins) and for reading (the supervisor lists what to
/// kill).
#[derive(Debug, Clone, Copy)]
pub struct ExecGroupFds {
    /// `cgroup.procs`, open for writing.
    pub procs_write: libc::c_int,
    /// `cgroup.procs`, open for reading.
    pub procs_read: libc::c_int,
}

/// Where the supervisor keeps the exec cgroup's `cgroup.procs` open.
const GROUP_FD: libc::c_int = 3;

/// Writes the calling process's pid to `procs` (a `cgroup.procs`).
fn join_group(procs: libc::c_int) -> io::Result<()> {
    let mut digits = [0u8; 12];
    // SAFETY: getpid has no preconditions.
    let mut n = unsafe { libc::getpid() }.unsigned_abs();
    let mut d = digits.len();
    loop {
        d -= 1;
        digits[d] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    let text = &digits[d..];
    // SAFETY: writes from a live stack buffer of its length.
    let w = unsafe { libc::write(procs, text.as_ptr().cast(), text.len()) };
    if w < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// SIGKILLs every process listed in the exec's cgroup ([`GROUP_FD`]) but
/// the supervisor; returns whether there were any.
fn kill_group() -> bool {
    // SAFETY: getpid has no preconditions.
    let me = unsafe { libc::getpid() };
    let mut buf = [0u8; 4096];
    let mut offset: libc::off_t = 0;
    let mut pid: libc::pid_t = 0;
    let mut in_number = false;
    let mut found = false;
    loop {
        // SAFETY: reads into a live stack buffer of its length.
        let n = unsafe { libc::pread(GROUP_FD, buf.as_mut_ptr().cast(), buf.len(), offset) };
        let Ok(len) = usize::try_from(n) else { break };
        if len == 0 {
            break;
        }
        offset = offset.saturating_add(libc::off_t::try_from(len).unwrap_or(0));
        for &b in &buf[..len] {
            if b.is_ascii_digit() {
                pid = pid
                    .saturating_mul(10)
                    .saturating_add(libc::pid_t::from(b - b'0'));
                in_number = true;
            } else if in_number {
                if pid != me && pid > 1 {
                    // SAFETY: kill(2) on a pid; no memory is touched.
                    unsafe { libc::kill(pid, libc::SIGKILL) };
                    found = true;
                }
                pid = 0;
                in_number = false;
            }
        }
    }
    if in_number && pid != me && pid > 1 {
        // SAFETY: kill(2) on a pid; no memory is touched.
        unsafe { libc::kill(pid, libc::SIGKILL) };
        found = true;
    }
    found
}

/// The supervisor's loop; returns the command's wait status.
fn supervise(
    main: libc::pid_t,
    set: &libc::sigset_t,
    keep_background: bool,
    group: bool,
) -> libc::c_int {
    let mut main_status: Option<libc::c_int> = None;
    let mut killing = false;
    loop {
        let mut no_children = false;
        loop {
            let mut st: libc::c_int = 0;
            // SAFETY: waitpid writes only to the local status.
            let r = unsafe { libc::waitpid(-1, &mut st, libc::WNOHANG) };
            if r > 0 {
                if r == main {
                    main_status = Some(st);
                }
                continue;
            }
            if r < 0 && io::Error::last_os_error().raw_os_error() == Some(libc::ECHILD) {
                no_children = true;
            }
            break;
        }
        if let Some(st) = main_status {
            if keep_background && !killing {
                return st;
            }
            if no_children {
                // Where orphans are not re-parented to us (gVisor has no
                // child subreaper), what stayed in the command's process
                // group is still reachable through it: kill until the group
                // is empty (a member may fork between two rounds), for at
                // most a second.
                // With the exec's own cgroup, what left the group (a
                // `setsid`) is killed too, until the cgroup holds only us.
                for _ in 0..500 {
                    // SAFETY: kill(2) on a process group id; no memory is touched.
                    let in_pgroup = unsafe { libc::kill(-main, libc::SIGKILL) } == 0;
                    let in_cgroup = group && kill_group();
                    if !in_pgroup && !in_cgroup {
                        break;
                    }
                    let pause = libc::timespec {
                        tv_sec: 0,
                        tv_nsec: 2_000_000,
                    };
                    // SAFETY: sleeps; writes nothing (null remainder).
                    unsafe { libc::nanosleep(&pause, std::ptr::null_mut()) };
                }
                return st;
            }
            killing = true;
        } else if no_children {
            // Cannot happen (the command is our child until reaped); exit 1.
            return 1 << 8;
        }
        if killing {
            // The command leads its own session and process group
            // (drop_privileges): one call reaches every process that stayed
            // in it, also where /proc/<pid>/task/<tid>/children is missing
            // (gVisor), which kill_children walks.
            // SAFETY: kill(2) on a process group id; no memory is touched.
            unsafe { libc::kill(-main, libc::SIGKILL) };
            kill_children();
            if group {
                kill_group();
            }
        }
        let tick = libc::timespec {
            tv_sec: 0,
            tv_nsec: 2_000_000,
        };
        // SAFETY: waits for a blocked signal; writes nothing (null info).
        let sig = unsafe {
            if killing {
                libc::sigtimedwait(set, std::ptr::null_mut(), &tick)
            } else {
                libc::sigwaitinfo(set, std::ptr::null_mut())
            }
        };
        if sig == libc::SIGTERM {
            killing = true;
        }
    }
}

/// Most processes one kill round walks; the rest are found on later rounds
/// (the pids limit keeps a sandbox far below it).
const KILL_WALK: usize = 8192;

/// SIGKILLs every descendant of the calling (single-threaded) process: its
/// children as listed in /proc/thread-self/children, then theirs through
/// `/proc/<pid>/task/<pid>/children`, depth first. Each is killed before its
/// children are read, so it cannot fork more (a pending SIGKILL fails
/// fork). What a round misses (children of other threads, forks racing the
/// walk) is re-parented to us when its parent dies and killed next round.
fn kill_children() {
    let mut stack = [0 as libc::pid_t; KILL_WALK];
    let mut len = read_children(c"/proc/thread-self/children", &mut stack, 0);
    let mut path = [0u8; 64];
    while len > 0 {
        len -= 1;
        let pid = stack[len];
        // SAFETY: kill(2) on a pid; no memory is touched.
        unsafe { libc::kill(pid, libc::SIGKILL) };
        if let Some(p) = children_path(pid, &mut path) {
            len = read_children(p, &mut stack, len);
        }
    }
}

/// Writes `/proc/<pid>/task/<pid>/children` into `buf`, NUL-terminated.
fn children_path(pid: libc::pid_t, buf: &mut [u8; 64]) -> Option<&std::ffi::CStr> {
    let mut digits = [0u8; 12];
    let mut n = pid.unsigned_abs();
    let mut d = digits.len();
    loop {
        d -= 1;
        digits[d] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    let digits = &digits[d..];
    let mut at = 0;
    for part in [
        b"/proc/".as_slice(),
        digits,
        b"/task/",
        digits,
        b"/children\0",
    ] {
        buf.get_mut(at..at + part.len())?.copy_from_slice(part);
        at += part.len();
    }
    std::ffi::CStr::from_bytes_with_nul(&buf[..at]).ok()
}

/// Appends the pids listed in a `children` file to `stack[len..]`; returns
/// the new length.
fn read_children(path: &std::ffi::CStr, stack: &mut [libc::pid_t], mut len: usize) -> usize {
    // SAFETY: open/read/close on a local buffer; nothing is allocated.
    unsafe {
        let fd = libc::open(path.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC);
        if fd < 0 {
            return len;
        }
        let mut buf = [0u8; 4096];
        let mut pid: libc::pid_t = 0;
        let mut push = |pid: libc::pid_t, len: &mut usize| {
            if pid > 0 && *len < stack.len() {
                stack[*len] = pid;
                *len += 1;
            }
        };
        loop {
            let n = libc::read(fd, buf.as_mut_ptr().cast(), buf.len());
            // Negative is an error, zero the end of the file.
            let Ok(n @ 1..) = usize::try_from(n) else {
                break;
            };
            for &b in &buf[..n] {
                if b.is_ascii_digit() {
                    pid = pid
                        .saturating_mul(10)
                        .saturating_add((b - b'0') as libc::pid_t);
                } else {
                    push(pid, &mut len);
                    pid = 0;
                }
            }
        }
        push(pid, &mut len);
        libc::close(fd);
    }
    len
}

/// Exits with the same wait status as `status`: the same code, or killed by
/// the same signal (the supervisor is non-dumpable, so that dumps no core).
fn exit_like(status: libc::c_int) -> ! {
    if libc::WIFSIGNALED(status) {
        let sig = libc::WTERMSIG(status);
        // SAFETY: resets one disposition, unblocks every signal and sends
        // `sig` to ourselves; nothing touches memory but the local set.
        unsafe {
            libc::signal(sig, libc::SIG_DFL);
            let mut none: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut none);
            libc::sigprocmask(libc::SIG_SETMASK, &none, std::ptr::null_mut());
            libc::kill(libc::getpid(), sig);
            libc::_exit(128 + sig)
        }
    }
    let code = if libc::WIFEXITED(status) {
        libc::WEXITSTATUS(status)
    } else {
        1
    };
    // SAFETY: _exit(2) ends the process without running any Rust code.
    unsafe { libc::_exit(code) }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mode_of(p: &Path) -> u32 {
        fs::symlink_metadata(p).unwrap().permissions().mode() & 0o7777
    }

    #[test]
    fn mkdir_gives_every_directory_its_mode_whatever_the_umask() {
        // The umask this process runs with is read from /proc.
        let mask = umask().expect("/proc/self/status says the umask");
        let dir = tempfile::tempdir().unwrap();
        // Modes the umask leaves alone, and ones it would cut (sticky and
        // group-writable bits included): each ends up exactly as asked.
        for (name, mode) in [
            ("plain", 0o755),
            ("private", 0o700),
            ("proc", 0o555),
            ("tmp", 0o1777),
            ("shared", 0o775),
        ] {
            let p = dir.path().join(name);
            mkdir(&p, mode).unwrap();
            assert_eq!(mode_of(&p), mode, "{name} (umask {mask:o})");
        }
        // Missing parents are made (with the umask's default mode, as
        // `mkdir -p` makes them), the directory itself with its mode.
        let deep = dir.path().join("var/tmp");
        mkdir(&deep, 0o1777).unwrap();
        assert_eq!(mode_of(&deep), 0o1777);
        assert_eq!(mode_of(&dir.path().join("var")), 0o777 & !mask);
        // An existing directory is given the mode asked for.
        let existing = dir.path().join("plain");
        mkdir(&existing, 0o711).unwrap();
        assert_eq!(mode_of(&existing), 0o711);
        // Something else in the way is an error naming the path.
        let file = dir.path().join("file");
        fs::write(&file, "x").unwrap();
        let e = mkdir(&file, 0o755).unwrap_err().to_string();
        assert!(e.contains("file"), "{e}");
        // mkdir_if_missing leaves an existing directory's mode alone.
        assert!(!mkdir_if_missing(&existing, 0o755).unwrap());
        assert_eq!(mode_of(&existing), 0o711);
        assert!(mkdir_if_missing(&dir.path().join("new"), 0o750).unwrap());
        assert_eq!(mode_of(&dir.path().join("new")), 0o750);
    }
}
