//! Volumes of a microVM: one `virtiofsd` per volume, each serving an
//! idmapped bind of the volume's host directory to the guest over a
//! `vhost-user-fs` device.
//!
//! A jail sandbox's user `U` is host uid `host_base + U`, so that is who
//! owns its files on a volume's disk. The C `virtiofsd` (QEMU 7.2's) has
//! no uid translation: it creates files with the guest's own ids. It is
//! therefore given, as its shared directory, a bind of the volume mounted
//! through the inverse of the jail's id map
//! ([`runcell_jail::idmap_mount::bind_idmapped`], as for gVisor): through
//! it, the guest's `U` is stored as `host_base + U` and read back as `U`.
//! Read-only is that bind's `MS_RDONLY`, whatever the guest does.
//!
//! The binds are made under `<dir>/volumes`, a small private tmpfs of the
//! daemon's mount namespace, only for as long as the guest boots: each
//! `virtiofsd` (`-o sandbox=namespace`) takes its own copy of the mount
//! into a mount namespace of its own once QEMU connects, and the guest's
//! init has mounted every volume before its agent reports ready. The
//! daemon then detaches its own copy ([`detach_stage`]), so nothing stays
//! mounted on the host: the mounts live as long as the `virtiofsd`
//! processes, which end when their QEMU does (or are killed, [`stop`]).

use std::fs;
use std::io;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use nix::mount::{mount, MsFlags};

use super::vmm::SharedDir;

/// In a sandbox's directory: the private tmpfs the binds are made on.
const STAGE: &str = "volumes";
/// In a sandbox's directory: the log of the `n`th volume's `virtiofsd`
/// (its presence also says the sandbox has volumes to clean up).
fn log_name(n: usize) -> String {
    format!("virtiofsd-{n}.log")
}
/// Where the guest mounts the `n`th volume (vm-init's `VOLUMES`): the
/// source of the spec's bind mount.
pub(super) const GUEST_VOLUMES: &str = "/run/vm/volumes";
/// The `vhost-user-fs` tag of the `n`th volume (vm-init's `VOLUME_TAG`).
const TAG_PREFIX: &str = "runcell-vol";
/// How long a `virtiofsd` may take to listen on its socket.
const LISTEN_TIMEOUT: Duration = Duration::from_secs(5);

/// Errors of a microVM's volumes.
#[derive(Debug, thiserror::Error)]
pub enum VolumeError {
    /// The path a volume is to appear at is not a plain absolute path.
    #[error("The volume path {0} is not an absolute path below /.")]
    BadTarget(PathBuf),
    /// The volumes' directory could not be prepared.
    #[error("Could not prepare {path} for the volumes.")]
    Stage {
        /// The directory.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// The idmapped bind of a volume failed.
    #[error("Could not mount volume {target} for the microVM.")]
    Mount {
        /// Where the sandbox would see it.
        target: String,
        /// Why.
        #[source]
        source: runcell_jail::idmap_mount::IdmapMountError,
    },
    /// `virtiofsd` could not be started.
    #[error("Could not run {path} for volume {target}.")]
    Spawn {
        /// The `virtiofsd` binary.
        path: PathBuf,
        /// Where the sandbox would see the volume.
        target: String,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// `virtiofsd` exited or did not listen in time.
    #[error("virtiofsd did not start for volume {target}: {log}")]
    NotReady {
        /// Where the sandbox would see the volume.
        target: String,
        /// The end of its log.
        log: String,
    },
}

/// The guest's tag of the `n`th volume.
pub(super) fn tag(n: usize) -> String {
    format!("{TAG_PREFIX}{n}")
}

/// Whether `target` is an absolute path of plain names below `/`.
fn sane(target: &Path) -> bool {
    target.is_absolute()
        && target.components().count() >= 2
        && target.components().all(|c| {
            matches!(
                c,
                std::path::Component::RootDir | std::path::Component::Normal(_)
            )
        })
}

/// Starts one `virtiofsd` per volume of `mounts` for the sandbox in `dir`
/// (each sharing an idmapped bind of the volume, read-only if asked) and
/// returns the devices the guest needs, in order; `socket` names each
/// one's vhost-user socket. On an error, what was started is stopped.
pub(super) fn start(
    dir: &Path,
    mounts: &[runcell_jail::BindMount],
    map: runcell_jail::IdMap,
    virtiofsd: &Path,
    socket: impl Fn(&str) -> Result<PathBuf, super::MicrovmError>,
) -> Result<Vec<SharedDir>, super::MicrovmError> {
    let started = start_all(dir, mounts, map, virtiofsd, socket);
    if started.is_err() {
        stop(dir);
    }
    started
}

fn start_all(
    dir: &Path,
    mounts: &[runcell_jail::BindMount],
    map: runcell_jail::IdMap,
    virtiofsd: &Path,
    socket: impl Fn(&str) -> Result<PathBuf, super::MicrovmError>,
) -> Result<Vec<SharedDir>, super::MicrovmError> {
    if let Some(m) = mounts.iter().find(|m| !sane(&m.target)) {
        return Err(VolumeError::BadTarget(m.target.clone()).into());
    }
    let stage = dir.join(STAGE);
    let at_stage = |source: io::Error| VolumeError::Stage {
        path: stage.clone(),
        source,
    };
    fs::create_dir_all(&stage).map_err(at_stage)?;
    // A tmpfs of its own, private: nothing bound below it propagates to
    // another mount namespace, and one detach ends them all.
    mount(
        Some("tmpfs"),
        &stage,
        Some("tmpfs"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
        Some("size=64k,mode=0700"),
    )
    .map_err(|e| at_stage(e.into()))?;
    mount(
        None::<&str>,
        &stage,
        None::<&str>,
        MsFlags::MS_PRIVATE,
        None::<&str>,
    )
    .map_err(|e| at_stage(e.into()))?;
    let mut shared = Vec::with_capacity(mounts.len());
    for (n, m) in mounts.iter().enumerate() {
        let target = m.target.display().to_string();
        let at = stage.join(n.to_string());
        fs::create_dir(&at).map_err(at_stage)?;
        runcell_jail::idmap_mount::bind_idmapped(&m.source, &at, map, m.read_only).map_err(
            |source| VolumeError::Mount {
                target: target.clone(),
                source,
            },
        )?;
        let sock = socket(&format!("fs{n}.sock"))?;
        let _ = fs::remove_file(&sock);
        let log_path = dir.join(log_name(n));
        let log = fs::File::create(&log_path).map_err(at_stage)?;
        let spawn_err = |source| VolumeError::Spawn {
            path: virtiofsd.to_path_buf(),
            target: target.clone(),
            source,
        };
        let mut child = Command::new(virtiofsd)
            .arg(format!("--socket-path={}", sock.display()))
            .arg("-o")
            .arg(format!("source={}", at.display()))
            // Its own mount, pid and network namespaces, with its root the
            // shared directory: the copy of the bind it keeps is its own.
            .args(["-o", "sandbox=namespace", "-o", "cache=auto"])
            .args(["-o", "log_level=warn", "-f"])
            .stdin(Stdio::null())
            .stdout(log.try_clone().map_err(spawn_err)?)
            .stderr(log)
            // Not in the daemon's process group: a signal meant for the
            // daemon's group leaves it to its guest.
            .process_group(0)
            .spawn()
            .map_err(spawn_err)?;
        let t0 = Instant::now();
        let ready = loop {
            if sock.exists() {
                break true;
            }
            if !matches!(child.try_wait(), Ok(None)) || t0.elapsed() > LISTEN_TIMEOUT {
                break false;
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        // Reaped by a thread of its own when it ends (with its QEMU).
        let _ = std::thread::Builder::new()
            .name("virtiofsd-reaper".into())
            .spawn(move || {
                let _ = child.wait();
            });
        if !ready {
            return Err(VolumeError::NotReady {
                target,
                log: log_tail(&log_path),
            }
            .into());
        }
        shared.push(SharedDir {
            tag: tag(n),
            socket: sock,
        });
    }
    Ok(shared)
}

fn log_tail(path: &Path) -> String {
    let text = fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    lines[lines.len().saturating_sub(4)..].join(" | ")
}

/// Detaches the daemon's own copy of the volumes' binds in `dir` (each
/// `virtiofsd` keeps its own) and removes their directory. Detaching what
/// is not mounted is not an error.
pub(super) fn detach_stage(dir: &Path) {
    let stage = dir.join(STAGE);
    if fs::symlink_metadata(&stage).is_err() {
        return;
    }
    if let Err(e) = runcell_jail::gvisor::unmount_rootfs(&stage) {
        tracing::warn!(dir = %dir.display(), "could not detach the volumes' mounts: {e}");
    }
    let _ = fs::remove_dir_all(&stage);
}

/// Whether the sandbox in `dir` was given volumes.
pub(super) fn has_volumes(dir: &Path) -> bool {
    dir.join(log_name(0)).exists()
}

/// Kills every `virtiofsd` of the sandbox in `dir` and waits (up to 5 s)
/// until they are gone, then detaches the host's binds if still there.
pub(super) fn stop(dir: &Path) {
    let needles = socket_needles(dir);
    let t0 = Instant::now();
    loop {
        let pids = processes_matching(&needles);
        if pids.is_empty() || t0.elapsed() > Duration::from_secs(5) {
            if !pids.is_empty() {
                tracing::warn!(dir = %dir.display(), ?pids, "virtiofsd processes did not end");
            }
            break;
        }
        for pid in pids {
            let _ =
                nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::SIGKILL);
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    detach_stage(dir);
}

/// What a `virtiofsd` of `dir` has on its command line: its socket's
/// path, in the sandbox's directory or through its short link.
fn socket_needles(dir: &Path) -> Vec<Vec<u8>> {
    let mut out = vec![format!("--socket-path={}/fs", dir.display()).into_bytes()];
    if let Some(id) = dir.file_name() {
        out.push(
            format!(
                "--socket-path={}/fs",
                Path::new(super::SHORT_LINKS).join(id).display()
            )
            .into_bytes(),
        );
    }
    out
}

/// Live (not zombie) processes whose command line holds one of `needles`.
fn processes_matching(needles: &[Vec<u8>]) -> Vec<i32> {
    let Ok(entries) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            let Ok(cmdline) = fs::read(format!("/proc/{pid}/cmdline")) else {
                return false;
            };
            let live = fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .and_then(|s| s.rsplit_once(')').map(|(_, rest)| rest.trim().to_string()))
                .is_some_and(|rest| !rest.starts_with('Z'));
            live && needles
                .iter()
                .any(|n| cmdline.windows(n.len()).any(|w| w == n.as_slice()))
        })
        .collect()
}
