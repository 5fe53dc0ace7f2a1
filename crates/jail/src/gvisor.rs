//! gVisor (`runsc`) support, both sides of it.
//!
//! Under gVisor the namespaces, `/proc`, `/dev` and the pivot are runsc's
//! work, and the agent (the container's init) has no host fds handed to
//! it. So:
//!
//! * the host composes the sandbox's root filesystem itself
//!   ([`compose_rootfs`]): a tmpfs of `disk_bytes` at the sandbox's
//!   staging directory holds the writable layer, with the template's
//!   directories overlaid read-only below it exactly as the jail does, and
//!   the generated `/etc` files. runsc's gofer serves that directory as
//!   the container's root, so what the sandbox writes lands on the capped
//!   tmpfs, on the host, and [`unmount_rootfs`] removes it;
//! * the agent ([`bootstrap`]) reaches the host through a bind-mounted
//!   directory ([`HOST_DIR`]) and gVisor's host unix-socket support: it
//!   connects to the host's setup socket, reads the same [`InitSpec`]
//!   framing as [`crate::inside::bootstrap`], binds its own listening
//!   socket there (a host socket the host connects to), and answers `R`
//!   or `E` + message.

use std::fs;
use std::io::{self, Write};
use std::os::fd::OwnedFd;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};

use nix::mount::{mount, umount2, MntFlags, MsFlags};
use nix::unistd::{chown, Gid, Uid};

use crate::inside::{
    bind, inode_limit, inside, mkdir, mkdir_if_missing, overlay_options, overlay_template,
    read_spec, report_error, step, synthesize_etc, Bootstrap, SetupError, Upper,
};
use crate::spec::{InitSpec, RootfsSpec};

/// Where the sandbox sees its host directory (bind-mounted from the
/// sandbox's host state directory; only root of the sandbox may enter it).
pub const HOST_DIR: &str = "/run/runcell/host";

/// The host's setup socket, as the sandbox sees it.
pub const SETUP_SOCKET: &str = "/run/runcell/host/setup.sock";

/// The agent's listening socket, as the sandbox sees it (a host socket in
/// the sandbox's host directory, `agent.sock`).
pub const AGENT_SOCKET: &str = "/run/runcell/host/agent.sock";

/// Written by the agent once it holds no host socket, so the host may
/// checkpoint the sandbox (`runsc checkpoint` cannot save one).
pub const QUIESCED_MARKER: &str = "/run/runcell/host/quiesced";

/// Written by the host to let a quiesced agent listen and serve again.
pub const RESUME_MARKER: &str = "/run/runcell/host/resume";

/// Where the agent binary is bind-mounted (read-only, root-owned).
pub const AGENT_PATH: &str = "/run/runcell/agent";

/// The agent's argument (after `gvisor-init`) that gives it the sandbox's
/// process limit: `--pids=N`.
pub const PIDS_ARG: &str = "--pids=";

/// The agent's argument that gives it its log filter: `--log=FILTER`.
pub const LOG_ARG: &str = "--log=";

/// The files of a process's `/proc` directory that show its memory,
/// arguments or environment.
const AGENT_PROC_FILES: [&str; 5] = ["environ", "cmdline", "auxv", "maps", "smaps"];

/// Hides the agent's `/proc/1` files that this gVisor lets every process
/// read (it ignores that the agent is not dumpable, which is what hides
/// them in the jail): `environ`, `cmdline`, `auxv`, `maps` and `smaps` of
/// `/proc/1` and `/proc/1/task/1` become binds of an empty root-owned
/// read-only file.
/// (The agent's other threads, `/proc/<tid>`, still show the process's
/// arguments and environment: the host starts the agent with an empty
/// environment and nothing secret in its arguments.) Runs in the agent,
/// which needs `CAP_SYS_ADMIN`, after runsc mounted `/proc`.
pub fn hide_agent_proc() -> Result<(), SetupError> {
    // An empty file only root may write (this gVisor refuses recursive and
    // read-only binds, so permissions keep it unwritable).
    let empty = Path::new(PROC_MASK);
    fs::write(empty, b"").map_err(step(format!("creating {PROC_MASK}")))?;
    fs::set_permissions(empty, fs::Permissions::from_mode(0o444))
        .map_err(step(format!("making {PROC_MASK} read-only")))?;
    for dir in ["/proc/1", "/proc/1/task/1"] {
        for f in AGENT_PROC_FILES {
            let target = Path::new(dir).join(f);
            mount(
                Some(empty),
                &target,
                None::<&str>,
                MsFlags::MS_BIND,
                None::<&str>,
            )
            .map_err(step(format!("masking {}", target.display())))?;
        }
    }
    Ok(())
}

/// `CAP_SYS_ADMIN`'s number.
const CAP_SYS_ADMIN: u32 = 21;

/// Drops `CAP_SYS_ADMIN` from the calling thread's bounding, effective,
/// permitted and inheritable sets, once the agent has mounted what it needs
/// ([`limit_pids`], [`hide_agent_proc`]): nothing it starts afterwards, a
/// template build's root steps included, can unmount the masks or touch
/// the pids cgroup. Capabilities are per thread: call it while the agent
/// has one thread (before its runtime starts). Needs `CAP_SETPCAP`.
pub fn drop_sys_admin() -> Result<(), SetupError> {
    #[repr(C)]
    struct Header {
        version: u32,
        pid: i32,
    }
    #[repr(C)]
    #[derive(Default, Clone, Copy)]
    struct Data {
        effective: u32,
        permitted: u32,
        inheritable: u32,
    }
    const VERSION_3: u32 = 0x2008_0522;
    let failed =
        |what: &str| step(format!("dropping CAP_SYS_ADMIN ({what})"))(io::Error::last_os_error());
    // SAFETY: prctl with scalar arguments.
    if unsafe { libc::prctl(libc::PR_CAPBSET_DROP, CAP_SYS_ADMIN, 0, 0, 0) } < 0 {
        return Err(failed("bounding set"));
    }
    let mut header = Header {
        version: VERSION_3,
        pid: 0,
    };
    let mut data = [Data::default(); 2];
    // SAFETY: capget writes one header and two data structs (version 3),
    // both valid, properly laid out locals.
    if unsafe { libc::syscall(libc::SYS_capget, &mut header, data.as_mut_ptr()) } < 0 {
        return Err(failed("capget"));
    }
    let keep = !(1u32 << CAP_SYS_ADMIN);
    data[0].effective &= keep;
    data[0].permitted &= keep;
    data[0].inheritable &= keep;
    // SAFETY: capset reads the header and two data structs set up above.
    if unsafe { libc::syscall(libc::SYS_capset, &header, data.as_ptr()) } < 0 {
        return Err(failed("capset"));
    }
    Ok(())
}

/// The empty file bound over the agent's `/proc` files.
const PROC_MASK: &str = "/run/runcell/proc-mask";

/// Where the agent mounts gVisor's cgroupfs (pids controller), in a
/// directory only root of the sandbox may enter.
pub const CGROUP_DIR: &str = "/run/runcell/cgroup";

/// Enforces the sandbox's process limit with gVisor's own cgroups (the
/// agent's side, before anything else runs): mounts gVisor's cgroupfs
/// with the pids controller at [`CGROUP_DIR`], makes the cgroup
/// `sandbox` with `pids.max` = `max`, moves the calling process (the
/// agent, so everything it starts) into it, unmounts the hierarchy (which
/// lives on with its tasks) and returns its open `pids.current`. gVisor
/// checks every fork and clone against that count (its cgroupfs keeps no
/// `pids.events`, so the caller samples it). Needs `CAP_SYS_ADMIN` and
/// `CAP_DAC_OVERRIDE` in the sandbox. Also returns gVisor's `job`
/// hierarchy, still open, where each exec gets a cgroup of its own
/// ([`ExecGroups`]).
pub fn limit_pids(max: u64) -> Result<(fs::File, ExecGroups), SetupError> {
    let dir = Path::new(CGROUP_DIR);
    mkdir_if_missing(dir, 0o700)?;
    mount(
        Some("cgroup"),
        dir,
        Some("cgroup"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
        Some("pids"),
    )
    .map_err(step("mounting gVisor's pids cgroup"))?;
    let group = dir.join("sandbox");
    match fs::create_dir(&group) {
        Err(e) if e.kind() != io::ErrorKind::AlreadyExists => {
            return Err(step("creating the sandbox's pids cgroup")(e))
        }
        _ => {}
    }
    let write = |file: &str, value: String| {
        fs::write(group.join(file), value).map_err(step(format!("writing the sandbox's {file}")))
    };
    write("pids.max", max.to_string())?;
    write("cgroup.procs", std::process::id().to_string())?;
    let current = fs::File::open(group.join("pids.current"))
        .map_err(step("opening the sandbox's pids.current"))?;
    // Out of reach from here on: root of the sandbox (a template build's
    // step) has CAP_DAC_OVERRIDE and could raise pids.max through the
    // mount. The hierarchy lives on with its tasks and the open file.
    umount2(dir, MntFlags::MNT_DETACH).map_err(step("unmounting gVisor's pids cgroup"))?;
    // Exec cgroups live in a hierarchy of their own: gVisor's pids
    // controller is not hierarchical (a child cgroup escapes its parent's
    // `pids.max`), so every process stays in the one pids cgroup above, and
    // membership of an exec is kept by gVisor's `job` controller, which
    // limits nothing.
    mount(
        Some("cgroup"),
        dir,
        Some("cgroup"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
        Some("job"),
    )
    .map_err(step("mounting gVisor's job cgroup"))?;
    let groups = fs::File::open(dir).map_err(step("opening gVisor's job cgroup"));
    umount2(dir, MntFlags::MNT_DETACH).map_err(step("unmounting gVisor's job cgroup"))?;
    Ok((
        current,
        ExecGroups {
            dir: groups?,
            next: std::sync::atomic::AtomicU64::new(0),
        },
    ))
}

/// gVisor's `job` cgroup hierarchy (out of the sandbox's reach: it is
/// unmounted, only the agent holds it open), where every exec gets a cgroup
/// of its own. This gVisor has no child subreaper: a process
/// that leaves its session is re-parented to the agent, out of its exec
/// supervisor's sight, but never out of its cgroup, which the supervisor
/// empties ([`crate::inside::supervise_exec`]).
#[derive(Debug)]
pub struct ExecGroups {
    dir: fs::File,
    next: std::sync::atomic::AtomicU64,
}

/// One exec's cgroup; removed when dropped (left in place while processes
/// the exec left running on purpose, `background`, are in it).
#[derive(Debug)]
pub struct ExecGroup<'a> {
    groups: &'a ExecGroups,
    name: String,
    procs_write: OwnedFd,
    procs_read: OwnedFd,
}

impl ExecGroups {
    /// Makes a new exec cgroup, its `cgroup.procs` open (close-on-exec).
    pub fn create(&self) -> io::Result<ExecGroup<'_>> {
        use nix::fcntl::{openat, OFlag};
        use nix::sys::stat::{mkdirat, Mode};
        let n = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let name = format!("exec-{n}");
        mkdirat(&self.dir, name.as_str(), Mode::from_bits_truncate(0o755))?;
        let procs = format!("{name}/cgroup.procs");
        let open = |flags: OFlag| {
            openat(
                &self.dir,
                procs.as_str(),
                flags | OFlag::O_CLOEXEC,
                Mode::empty(),
            )
        };
        let made = open(OFlag::O_WRONLY).and_then(|w| open(OFlag::O_RDONLY).map(|r| (w, r)));
        match made {
            Ok((procs_write, procs_read)) => Ok(ExecGroup {
                groups: self,
                name,
                procs_write,
                procs_read,
            }),
            Err(e) => {
                let _ = nix::unistd::unlinkat(
                    &self.dir,
                    name.as_str(),
                    nix::unistd::UnlinkatFlags::RemoveDir,
                );
                Err(e.into())
            }
        }
    }
}

impl ExecGroup<'_> {
    /// The descriptors the exec's supervisor uses.
    pub fn fds(&self) -> crate::inside::ExecGroupFds {
        use std::os::fd::AsRawFd;
        crate::inside::ExecGroupFds {
            procs_write: self.procs_write.as_raw_fd(),
            procs_read: self.procs_read.as_raw_fd(),
        }
    }
}

impl Drop for ExecGroup<'_> {
    fn drop(&mut self) {
        // Busy while a background process lives in it: gVisor keeps the
        // empty directory's few bytes until the sandbox ends.
        let _ = nix::unistd::unlinkat(
            &self.groups.dir,
            self.name.as_str(),
            nix::unistd::UnlinkatFlags::RemoveDir,
        );
    }
}

/// Builds the root filesystem of a gVisor sandbox on the host, at
/// `<stage>/root`, and returns that path.
///
/// `stage` is first bind-mounted on itself and made a private mount, so
/// nothing mounted below it propagates to other mount namespaces; a tmpfs
/// of `spec.disk_bytes` (its files capped by [`inode_limit`]) is mounted on
/// it and holds every writable layer. The template's directories are
/// overlaid read-only as for the jail, and the directories and `/etc`
/// files every sandbox has are created. `/proc` and `/dev` are runsc's.
pub fn compose_rootfs(spec: &InitSpec, stage: &Path) -> Result<PathBuf, SetupError> {
    mkdir(stage, 0o700)?;
    bind(stage, stage, false)?;
    mount(
        None::<&str>,
        stage,
        None::<&str>,
        MsFlags::MS_PRIVATE,
        None::<&str>,
    )
    .map_err(step("making the sandbox's mounts private"))?;
    mount(
        Some("tmpfs"),
        stage,
        Some("tmpfs"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
        Some(
            format!(
                "size={},nr_inodes={},mode=0755",
                spec.disk_bytes.max(1 << 20),
                inode_limit(spec.disk_bytes)
            )
            .as_str(),
        ),
    )
    .map_err(step("mounting the writable layer"))?;
    let root = stage.join("root");
    for d in ["root", "upper", "work"] {
        mkdir(&stage.join(d), 0o755)?;
    }
    overlay_template(
        spec,
        stage,
        &root,
        overlay_layers_absolute,
        false,
        Upper::Volatile,
    )?;
    if !spec.state_layers.is_empty() {
        refuse_planted_symlinks(&spec.user.home, &root)?;
    }
    populate(spec, &root, stage)?;
    Ok(root)
}

/// The paths under a gVisor sandbox's root that this (host) process
/// creates, writes or mounts on while composing it, or that runsc binds
/// from the host (`/tmp`'s source is the root's own `tmp`).
const SETUP_PATHS: [&str; 18] = [
    "proc",
    "dev",
    "etc",
    "tmp",
    "var/tmp",
    "run",
    "run/runcell",
    "run/runcell/host",
    "run/runcell/egress",
    "run/runcell/agent",
    "run/runcell/gvisor-shim.so",
    "root",
    "etc/passwd",
    "etc/group",
    "etc/hostname",
    "etc/hosts",
    "etc/resolv.conf",
    "etc/nsswitch.conf",
];

/// Fails if a saved layer (what a sandbox wrote) made a path the host
/// composes through a symlink. The jail's setup runs in the sandbox's own
/// mount namespace; this runs in the daemon's, where such a link would
/// steer a write or a mount onto the host's own files.
fn refuse_planted_symlinks(home: &str, root: &Path) -> Result<(), SetupError> {
    for rel in SETUP_PATHS
        .iter()
        .copied()
        .chain([home.trim_start_matches('/')])
    {
        let mut at = root.to_path_buf();
        for c in Path::new(rel).components() {
            let std::path::Component::Normal(name) = c else {
                continue;
            };
            at.push(name);
            if fs::symlink_metadata(&at).is_ok_and(|m| m.file_type().is_symlink()) {
                return Err(step(format!("preparing /{rel}"))(io::Error::new(
                    io::ErrorKind::InvalidData,
                    "a saved layer made it a symlink",
                )));
            }
        }
    }
    Ok(())
}

/// Copies the writable layer of a gVisor sandbox composed at `stage` (by
/// [`compose_rootfs`]) into `dest` (which must not exist), in the state
/// layer format of [`crate::layer`]: `root/` is what was written over the
/// root, `upper/<key>/` what was written over each host path of the
/// `host` template. The sandbox's writes reach the host's files at once
/// (gVisor's gofer writes through, mapped files included), so the copy is
/// current once the sandbox is frozen or stopped. Returns the bytes the
/// copy takes on disk.
pub fn export_layer(stage: &Path, dest: &Path) -> Result<u64, crate::layer::LayerError> {
    use crate::inside::STATE_ROOT;
    use crate::layer::LayerError;
    let upper = stage.join("upper");
    fs::metadata(&upper).map_err(LayerError::Unreachable)?;
    if fs::symlink_metadata(dest).is_ok() {
        return Err(LayerError::Exists(dest.to_path_buf()));
    }
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| LayerError::Io { path, source }
    };
    fs::create_dir_all(dest).map_err(io(dest))?;
    let overlaid = upper.join(STATE_ROOT);
    if overlaid.is_dir() {
        copy_tree(&overlaid, &dest.join(STATE_ROOT), false)?;
    } else {
        // The `host` template's root is the stage's own directory, with
        // the host paths mounted on it: those are other file systems.
        copy_tree(&stage.join(STATE_ROOT), &dest.join(STATE_ROOT), true)?;
    }
    for entry in fs::read_dir(&upper).map_err(LayerError::Unreachable)? {
        let entry = entry.map_err(LayerError::Unreachable)?;
        if entry.file_name() == STATE_ROOT {
            continue;
        }
        fs::create_dir_all(dest.join("upper")).map_err(io(dest))?;
        copy_tree(
            &entry.path(),
            &dest.join("upper").join(entry.file_name()),
            false,
        )?;
    }
    Ok(crate::layer::disk_usage(dest))
}

/// `cp -a` (no symlink followed; owners, modes, xattrs, device nodes and
/// hard links kept) of the directory `src` as `dst`.
fn copy_tree(
    src: &Path,
    dst: &Path,
    one_file_system: bool,
) -> Result<(), crate::layer::LayerError> {
    let mut cmd = crate::host_tools::command("cp");
    cmd.arg("-a");
    if one_file_system {
        cmd.arg("--one-file-system");
    }
    let out =
        cmd.arg("--")
            .arg(src)
            .arg(dst)
            .output()
            .map_err(|e| crate::layer::LayerError::Copy {
                what: src.display().to_string(),
                stderr: e.to_string(),
            })?;
    if out.status.success() {
        Ok(())
    } else {
        Err(crate::layer::LayerError::Copy {
            what: src.display().to_string(),
            stderr: String::from_utf8_lossy(&out.stderr)
                .chars()
                .take(4096)
                .collect(),
        })
    }
}

/// Overlays a layered template's layers (topmost first) at `target`, with
/// absolute layer paths: the jail's version changes the working directory
/// to shorten them, which a multi-threaded host process must not do.
fn overlay_layers_absolute(
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
    let lowerdir: Vec<String> = lowers.iter().map(|l| l.display().to_string()).collect();
    let opts = overlay_options(&lowerdir.join(":"), upper, work, kind);
    // The mount options must fit in one page.
    if opts.len() >= 4000 {
        return Err(bad(format!(
            "{} layers are too many for one overlay mount",
            lowers.len()
        )));
    }
    mkdir(upper, 0o755)?;
    mkdir(work, 0o755)?;
    mkdir(target, 0o755)?;
    mount(
        Some("overlay"),
        target,
        Some("overlay"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
        Some(opts.as_str()),
    )
    .map_err(step(format!("overlaying {} layers", lowers.len())))
}

/// Creates the directories every sandbox has (and the mount points runsc
/// binds the agent, its host directory and its egress directory on), the
/// user's home and the generated `/etc` files. A layered root is a
/// complete image: what it has is kept.
fn populate(spec: &InitSpec, root: &Path, stage: &Path) -> Result<(), SetupError> {
    let user = &spec.user;
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
    for d in [HOST_DIR, "/run/runcell/egress"] {
        mkdir_if_missing(&inside(root, Path::new(d)), 0o700)?;
    }
    let agent = inside(root, Path::new(AGENT_PATH));
    if fs::symlink_metadata(&agent).is_err() {
        fs::write(&agent, b"").map_err(step("creating the agent's mount point"))?;
    }
    let home = inside(root, Path::new(&user.home));
    if !layered || mkdir_if_missing(&home, 0o755)? {
        mkdir(&home, 0o755)?;
        chown(
            &home,
            Some(Uid::from_raw(user.uid)),
            Some(Gid::from_raw(user.gid)),
        )
        .map_err(step("giving the home directory to the sandbox user"))?;
    }
    synthesize_etc(spec, &root.join("etc"), stage, layered)
}

/// Bind-mounts the host's `source` (a file or a directory) at `dest` of
/// the composed `root` ([`compose_rootfs`]), read-only if asked, making
/// the mount point where missing. runsc's gofer serves what is mounted
/// below the root with the root itself, so a host bind here costs a mount
/// call, where a bind mount in the container's spec costs runsc a gofer
/// mount of its own at every start.
pub fn bind_into(
    root: &Path,
    source: &Path,
    dest: &str,
    read_only: bool,
) -> Result<(), SetupError> {
    let target = inside(root, Path::new(dest));
    if fs::symlink_metadata(&target).is_err() {
        if let Some(parent) = target.parent() {
            fs::create_dir_all(parent).map_err(step(format!("creating {dest}'s directory")))?;
        }
        if source.is_dir() {
            mkdir(&target, 0o700)?;
        } else {
            fs::write(&target, b"").map_err(step(format!("creating {dest}'s mount point")))?;
        }
    }
    bind(source, &target, read_only)
}

/// Unmounts what [`compose_rootfs`] mounted at `stage` (the whole tree at
/// once, lazily). Unmounting what is not mounted is not an error.
pub fn unmount_rootfs(stage: &Path) -> Result<(), SetupError> {
    // The tmpfs and the bind below it: two mounts stacked on `stage`.
    for _ in 0..4 {
        if !is_mount_point(stage) {
            return Ok(());
        }
        match umount2(stage, MntFlags::MNT_DETACH) {
            Ok(()) => {}
            Err(nix::errno::Errno::EINVAL | nix::errno::Errno::ENOENT) => return Ok(()),
            Err(e) => return Err(step(format!("unmounting {}", stage.display()))(e)),
        }
    }
    Ok(())
}

/// Whether `path` is a mount point in this process's mount namespace.
pub fn is_mount_point(path: &Path) -> bool {
    let Ok(info) = fs::read_to_string("/proc/self/mountinfo") else {
        return false;
    };
    let want = path.to_string_lossy();
    // Field 5 is the mount point, with spaces and the like octal-escaped.
    info.lines()
        .filter_map(|l| l.split(' ').nth(4))
        .any(|m| m == want)
}

/// The agent's side under gVisor: connects to the host's setup socket,
/// reads the spec, binds the agent's listening socket, and reports `R` (or
/// `E` + message) to the host. The setup socket's end of stream then means
/// the host is gone, as for the jail.
pub fn bootstrap() -> Result<Bootstrap, SetupError> {
    let mut sock = UnixStream::connect(SETUP_SOCKET).map_err(SetupError::Spec)?;
    let result = read_spec(&mut sock).and_then(|spec| {
        tracing::debug!(sandbox = %spec.sandbox_id, "spec received");
        // A socket left by an agent of a former life is in the way.
        let _ = fs::remove_file(AGENT_SOCKET);
        let listener =
            UnixListener::bind(AGENT_SOCKET).map_err(step(format!("binding {AGENT_SOCKET}")))?;
        Ok((spec, listener))
    });
    match result {
        Ok((spec, listener)) => {
            sock.write_all(b"R").map_err(SetupError::Spec)?;
            Ok(Bootstrap {
                spec,
                setup: OwnedFd::from(sock),
                listener: OwnedFd::from(listener),
            })
        }
        Err(e) => {
            report_error(&mut sock, &e);
            Err(e)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    /// Needs root, as the agent is (the jail crate's tests run as root).
    #[test]
    fn file_access_switches_on_one_thread_only_and_back() {
        assert!(
            nix::unistd::geteuid().is_root(),
            "this test switches file ids and must run as root"
        );
        let tmp = tempfile::tempdir().unwrap();
        fs::set_permissions(
            tmp.path(),
            std::os::unix::fs::PermissionsExt::from_mode(0o777),
        )
        .unwrap();
        let dir = tmp.path().to_path_buf();
        let (tx, rx) = std::sync::mpsc::channel();
        let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
        let worker = std::thread::spawn(move || {
            crate::inside::set_file_user(65534, 65534).unwrap();
            fs::write(dir.join("as-nobody"), b"x").unwrap();
            tx.send(()).unwrap();
            // The main thread writes while this one is still switched.
            go_rx.recv().unwrap();
            crate::inside::set_file_user(0, 0).unwrap();
            fs::write(dir.join("as-root-again"), b"x").unwrap();
        });
        rx.recv().unwrap();
        fs::write(tmp.path().join("main-thread"), b"x").unwrap();
        go_tx.send(()).unwrap();
        worker.join().unwrap();
        let owner = |name: &str| {
            let m = fs::metadata(tmp.path().join(name)).unwrap();
            (m.uid(), m.gid())
        };
        assert_eq!(owner("as-nobody"), (65534, 65534));
        assert_eq!(owner("main-thread"), (0, 0));
        assert_eq!(owner("as-root-again"), (0, 0));
    }

    #[test]
    fn a_symlink_a_saved_layer_planted_on_a_setup_path_is_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        fs::create_dir_all(root.join("etc")).unwrap();
        fs::create_dir_all(root.join("home/u")).unwrap();
        refuse_planted_symlinks("/home/u", root).unwrap();
        // /tmp's source is bound by runsc from the host: a link to / would
        // hand the sandbox the host's root.
        std::os::unix::fs::symlink("/", root.join("tmp")).unwrap();
        let e = refuse_planted_symlinks("/home/u", root).unwrap_err();
        assert!(e.to_string().contains("/tmp"), "{e}");
        fs::remove_file(root.join("tmp")).unwrap();
        std::os::unix::fs::symlink("/etc/shadow", root.join("etc/hosts")).unwrap();
        assert!(refuse_planted_symlinks("/home/u", root).is_err());
        fs::remove_file(root.join("etc/hosts")).unwrap();
        fs::remove_dir(root.join("home/u")).unwrap();
        std::os::unix::fs::symlink("/root", root.join("home/u")).unwrap();
        assert!(refuse_planted_symlinks("/home/u", root).is_err());
    }

    #[test]
    fn mount_points_are_read_from_mountinfo() {
        assert!(is_mount_point(Path::new("/")));
        assert!(is_mount_point(Path::new("/proc")));
        let tmp = tempfile::tempdir().unwrap();
        assert!(!is_mount_point(&tmp.path().join("nothing")));
        // Unmounting what is not mounted is not an error.
        unmount_rootfs(&tmp.path().join("nothing")).unwrap();
    }
}
