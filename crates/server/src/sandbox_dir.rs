//! Where the daemon keeps its jail sandboxes' host-side files: a tmpfs
//! mounted at `<data>/sandboxes`.
//!
//! Each sandbox has a directory there (`<id>/`: the agent's socket and log,
//! the mount point its root is built on, its egress sockets, `jail.json`),
//! made by a pool refill and removed at its teardown. On the data
//! directory's own file system (ext4 on this project's hosts) that is inode
//! allocation, journal writes and eviction for every sandbox: about 0.5 ms
//! of the daemon's CPU per create and delete, measured side by side (README,
//! benchmark). Nothing in it needs to outlive the machine: a reboot ends
//! every sandbox, and the registry, on disk, keeps what ran.
//!
//! - The mount stays when the daemon stops or is killed while sandboxes
//!   live (the next start re-attaches to them through their files there,
//!   and uses the mount as it is); a graceful stop with none left unmounts
//!   it ([`SandboxDir::release`]).
//! - A directory on disk that still holds sandboxes (left by a daemon from
//!   before this) is used as it is; the first start that finds it empty
//!   mounts the tmpfs.
//! - Another file system mounted there (not a tmpfs) is used as it is and
//!   never unmounted.
//! - Where the mount is refused (no `CAP_SYS_ADMIN` in the daemon's mount
//!   namespace), the directory stays on the data directory's file system.
//!
//! Memory: the files are small, and what an agent writes to its log is
//! charged to the memory cgroup of the sandbox whose agent wrote it, so it
//! counts against that sandbox's limit and goes with its directory.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use nix::mount::{MntFlags, MsFlags};

/// Why setting up or releasing the directory failed.
#[derive(Debug, thiserror::Error)]
pub enum SandboxDirError {
    /// A file operation on the directory failed.
    #[error("Could not {what} {path}.")]
    Io {
        /// What was being done.
        what: &'static str,
        /// The directory.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// Unmounting the tmpfs failed.
    #[error("Could not unmount the tmpfs at {0}.")]
    Unmount(PathBuf, #[source] nix::Error),
}

/// What the sandboxes' directory is on. Dropping it releases it
/// ([`SandboxDir::release`]), so a start that fails after mounting it
/// leaves no mount behind.
#[derive(Debug)]
pub enum SandboxDir {
    /// A tmpfs runcell mounted (now or at an earlier start).
    Tmpfs {
        /// Its mount point.
        path: PathBuf,
    },
    /// The data directory's own file system.
    Disk {
        /// Why not a tmpfs.
        reason: String,
    },
}

impl SandboxDir {
    /// Its file system: `tmpfs` or `disk`.
    pub fn name(&self) -> &'static str {
        match self {
            Self::Tmpfs { .. } => "tmpfs",
            Self::Disk { .. } => "disk",
        }
    }

    /// For a stopping daemon: unmounts the tmpfs when no sandbox has a
    /// directory in it (one that does lives on, and the next start
    /// re-attaches to it there). Returns whether it was unmounted.
    pub fn release(&self) -> Result<bool, SandboxDirError> {
        let Self::Tmpfs { path } = self else {
            return Ok(false);
        };
        if !crate::store::is_mounted(path) || has_entries(path)? {
            return Ok(false);
        }
        nix::mount::umount2(path.as_path(), MntFlags::empty())
            .map_err(|e| SandboxDirError::Unmount(path.clone(), e))?;
        Ok(true)
    }
}

impl Drop for SandboxDir {
    fn drop(&mut self) {
        match self.release() {
            Ok(true) => tracing::info!("unmounted the sandboxes' tmpfs"),
            Ok(false) => {}
            Err(e) => tracing::warn!("the sandboxes' tmpfs stays mounted: {e}"),
        }
    }
}

/// Sets up `dir` (`<data>/sandboxes`) for the jail's sandboxes: a tmpfs
/// there unless it already holds sandboxes on disk or the mount is refused
/// (see the module documentation). Call it before any sandbox is made: a
/// sandbox's mount namespace is a copy of the host's at its clone.
pub fn open(dir: &Path) -> Result<SandboxDir, SandboxDirError> {
    let io = |what, source| SandboxDirError::Io {
        what,
        path: dir.to_path_buf(),
        source,
    };
    std::fs::create_dir_all(dir).map_err(|e| io("make", e))?;
    if crate::store::is_mounted(dir) {
        let tmpfs = nix::sys::statfs::statfs(dir)
            .is_ok_and(|s| s.filesystem_type() == nix::sys::statfs::TMPFS_MAGIC);
        return Ok(if tmpfs {
            SandboxDir::Tmpfs {
                path: dir.to_path_buf(),
            }
        } else {
            // Someone else's mount: used as it is, and never unmounted.
            SandboxDir::Disk {
                reason: "another file system is mounted there".into(),
            }
        });
    }
    if has_entries(dir)? {
        return Ok(SandboxDir::Disk {
            reason: "it holds sandboxes from an earlier start; the first start that finds it \
                     empty mounts a tmpfs there"
                .into(),
        });
    }
    // Sandbox agents (an unprivileged host uid) traverse it to their own
    // directories, which are theirs alone (0700); nothing in it runs.
    let mounted = nix::mount::mount(
        Some("tmpfs"),
        dir,
        Some("tmpfs"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
        Some("mode=0711"),
    );
    match mounted {
        Ok(()) => Ok(SandboxDir::Tmpfs {
            path: dir.to_path_buf(),
        }),
        Err(e) => {
            std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o711))
                .map_err(|e| io("set the permissions of", e))?;
            Ok(SandboxDir::Disk {
                reason: format!("mounting a tmpfs there was refused: {e}"),
            })
        }
    }
}

fn has_entries(dir: &Path) -> Result<bool, SandboxDirError> {
    let mut entries = std::fs::read_dir(dir).map_err(|source| SandboxDirError::Io {
        what: "list",
        path: dir.to_path_buf(),
        source,
    })?;
    Ok(entries.next().is_some())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_empty_directory_gets_a_tmpfs_which_stays_while_sandboxes_live() {
        assert!(
            nix::unistd::geteuid().is_root(),
            "this test mounts a tmpfs: run it as root"
        );
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("sandboxes");
        let opened = open(&dir).unwrap();
        assert_eq!(opened.name(), "tmpfs", "{opened:?}");
        assert!(crate::store::is_mounted(&dir));
        let mode = std::fs::metadata(&dir).unwrap().permissions().mode() & 0o7777;
        assert_eq!(mode, 0o711, "sandbox agents traverse it, and only that");
        // A sandbox lives: a restart uses the mount as it is, and a stop
        // leaves it for the next start.
        std::fs::create_dir(dir.join("a-live-sandbox")).unwrap();
        assert_eq!(open(&dir).unwrap().name(), "tmpfs");
        assert!(!opened.release().unwrap());
        assert!(crate::store::is_mounted(&dir));
        assert!(dir.join("a-live-sandbox").is_dir());
        // None left: a stop unmounts it.
        std::fs::remove_dir(dir.join("a-live-sandbox")).unwrap();
        assert!(opened.release().unwrap());
        assert!(!crate::store::is_mounted(&dir));
    }

    #[test]
    fn someone_elses_mount_there_is_used_as_it_is_and_never_unmounted() {
        assert!(
            nix::unistd::geteuid().is_root(),
            "this test mounts a ramfs: run it as root"
        );
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("sandboxes");
        std::fs::create_dir(&dir).unwrap();
        nix::mount::mount(
            Some("ramfs"),
            &dir,
            Some("ramfs"),
            MsFlags::empty(),
            None::<&str>,
        )
        .unwrap();
        let opened = open(&dir).unwrap();
        let released = opened.release();
        let still = crate::store::is_mounted(&dir);
        nix::mount::umount2(dir.as_path(), MntFlags::empty()).unwrap();
        assert_eq!(opened.name(), "disk", "{opened:?}");
        assert!(!released.unwrap() && still, "unmounted another's mount");
    }

    #[test]
    fn a_directory_holding_sandboxes_stays_on_disk() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("sandboxes");
        std::fs::create_dir_all(dir.join("a-live-sandbox")).unwrap();
        let opened = open(&dir).unwrap();
        assert_eq!(opened.name(), "disk", "{opened:?}");
        assert!(!crate::store::is_mounted(&dir));
        assert!(!opened.release().unwrap());
        assert!(dir.join("a-live-sandbox").is_dir());
    }
}
