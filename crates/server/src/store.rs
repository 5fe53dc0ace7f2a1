//! The layer store (`runcell serve --layer-store`): where jail sandboxes'
//! writable layers live and how a save (snapshot, fork, hibernation)
//! keeps them.
//!
//! - `tmpfs`: a size-capped tmpfs per sandbox (in its mount namespace);
//!   a save copies it to `<data>/states/<key>` with `cp -a`, so it takes
//!   time and disk in proportion to what the sandbox wrote.
//! - `btrfs`: a btrfs file system in the sparse image `<data>/store.img`,
//!   made once (with quotas on) and loop-mounted `nosuid,nodev` at
//!   `<data>/store` (left mounted across restarts, mounted again at start
//!   if not). Each sandbox's writable layer is the subvolume
//!   `stages/<id>`, capped by a qgroup limit; a save is a read-only
//!   snapshot `states/<key>` of it, O(1) whatever it holds, and every
//!   fork of it shares its extents.
//! - `auto` (the default): `btrfs` where the kernel has btrfs and
//!   `mkfs.btrfs` is installed (or the image exists) and the image mounts,
//!   `tmpfs` otherwise; [`LayerStore::reason`] says which and why.
//!
//! A daemon that stops gracefully with no live sandbox unmounts the store
//! ([`LayerStore::release`]; the loop device goes with it, `mount -o loop`
//! sets autoclear); the image stays and the next start mounts it again.
//! A killed daemon leaves it mounted, and the next start uses that mount.
//!
//! A data directory that is itself on btrfs is not used directly: the
//! disk limit needs quotas, which would have to be turned on for that
//! whole file system.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Which layer store the daemon uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LayerStoreKind {
    /// A tmpfs per sandbox; saves copy it.
    Tmpfs,
    /// A subvolume per sandbox on a loop-mounted btrfs image; saves are
    /// snapshots.
    Btrfs,
    /// `btrfs` where this host can, `tmpfs` otherwise.
    #[default]
    Auto,
}

impl std::str::FromStr for LayerStoreKind {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "tmpfs" => Ok(Self::Tmpfs),
            "btrfs" => Ok(Self::Btrfs),
            "auto" => Ok(Self::Auto),
            other => Err(format!(
                "{other:?} is not a layer store: say tmpfs, btrfs or auto."
            )),
        }
    }
}

/// Errors setting up the btrfs layer store.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// This host cannot have one.
    #[error("The btrfs layer store is unavailable: {0}")]
    Unavailable(String),
    /// A step of making or mounting it failed.
    #[error("The btrfs layer store at {path} could not be prepared ({what}).")]
    Io {
        /// What was being done.
        what: &'static str,
        /// The path involved.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// `mkfs.btrfs` or `mount` failed.
    #[error("The btrfs layer store could not be prepared: {0}")]
    Command(String),
    /// Turning quotas on failed.
    #[error("The btrfs layer store could not get quotas (the disk limit needs them).")]
    Quota(#[source] runcell_jail::btrfs::BtrfsError),
}

/// The layer store in use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LayerStore {
    /// A tmpfs per sandbox.
    Tmpfs {
        /// Why this store (the setting, or why `auto` could not have btrfs).
        reason: String,
    },
    /// The btrfs store mounted at `root`.
    Btrfs {
        /// Its mount point (`<data>/store`).
        root: PathBuf,
        /// Why this store.
        reason: String,
    },
}

impl LayerStore {
    /// The directory of sandboxes' stages (subvolumes), with btrfs.
    pub fn stages(&self) -> Option<PathBuf> {
        match self {
            Self::Tmpfs { .. } => None,
            Self::Btrfs { root, .. } => Some(root.join("stages")),
        }
    }

    /// The directory of state layers (snapshots), with btrfs.
    pub fn states(&self) -> Option<PathBuf> {
        match self {
            Self::Tmpfs { .. } => None,
            Self::Btrfs { root, .. } => Some(root.join("states")),
        }
    }

    /// `tmpfs` or `btrfs`.
    pub fn name(&self) -> &'static str {
        match self {
            Self::Tmpfs { .. } => "tmpfs",
            Self::Btrfs { .. } => "btrfs",
        }
    }

    /// Why this store runs: the setting that asked for it, or, with
    /// `auto`, what made btrfs possible or not.
    pub fn reason(&self) -> &str {
        match self {
            Self::Tmpfs { reason } | Self::Btrfs { reason, .. } => reason,
        }
    }

    /// For a stopping daemon whose sandboxes are all gone (no live one
    /// overlays a layer in the store or writes to a stage): unmounts the
    /// btrfs store, and with it goes its loop device (autoclear). The
    /// image stays, with every snapshot and hibernated sandbox in it; the
    /// next start mounts it again. Returns whether it was unmounted: a
    /// stage left in `stages/` (a sandbox this daemon does not know of)
    /// keeps it mounted.
    pub fn release(&self) -> Result<bool, StoreError> {
        let Self::Btrfs { root, .. } = self else {
            return Ok(false);
        };
        let stages = root.join("stages");
        let left = std::fs::read_dir(&stages)
            .map_err(io("listing", &stages))?
            .count();
        if left > 0 {
            tracing::info!(
                stages = left,
                "the layer store stays mounted: sandboxes still have stages in it"
            );
            return Ok(false);
        }
        if !is_mounted(root) {
            return Ok(false);
        }
        run(runcell_jail::host_tools::command("umount").arg(root))?;
        Ok(true)
    }
}

/// Whether this host can have the btrfs store (`runcell doctor`): the
/// path of `mkfs.btrfs`, or why not.
pub fn btrfs_possible() -> Result<PathBuf, String> {
    if !kernel_has_btrfs() {
        return Err("the kernel has no btrfs (/proc/filesystems)".into());
    }
    find_mkfs().ok_or_else(|| MKFS_MISSING.into())
}

const MKFS_MISSING: &str = "mkfs.btrfs is not installed (apt-get install btrfs-progs)";

fn find_mkfs() -> Option<PathBuf> {
    runcell_jail::host_tools::find("mkfs.btrfs")
}

fn io(what: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> StoreError {
    let path = path.to_path_buf();
    move |source| StoreError::Io { what, path, source }
}

/// Sets up the layer store `kind` asks for in `data_dir`.
pub fn open(data_dir: &Path, kind: LayerStoreKind) -> Result<LayerStore, StoreError> {
    match kind {
        LayerStoreKind::Tmpfs => Ok(LayerStore::Tmpfs {
            reason: "--layer-store tmpfs asks for it".into(),
        }),
        LayerStoreKind::Btrfs => {
            open_btrfs(data_dir).map(|root| LayerStore::Btrfs {
                root,
                reason: "--layer-store btrfs asks for it".into(),
            })
        }
        LayerStoreKind::Auto => match open_btrfs(data_dir) {
            Ok(root) => Ok(LayerStore::Btrfs {
                root,
                reason: "auto: the kernel has btrfs and the store's image is made and mounted (mkfs.btrfs is installed)".into(),
            }),
            Err(e) => {
                let reason = format!("auto: btrfs is not possible here ({e})");
                tracing::info!("layer store: tmpfs; {reason}");
                Ok(LayerStore::Tmpfs { reason })
            }
        },
    }
}

fn kernel_has_btrfs() -> bool {
    std::fs::read_to_string("/proc/filesystems").is_ok_and(|f| {
        f.lines()
            .any(|l| l.split_whitespace().last() == Some("btrfs"))
    })
}

fn open_btrfs(data_dir: &Path) -> Result<PathBuf, StoreError> {
    let data_dir = &std::path::absolute(data_dir).unwrap_or_else(|_| data_dir.to_path_buf());
    let image = data_dir.join("store.img");
    let root = data_dir.join("store");
    if !kernel_has_btrfs() {
        return Err(StoreError::Unavailable(
            "the kernel has no btrfs (/proc/filesystems)".into(),
        ));
    }
    std::fs::create_dir_all(&root).map_err(io("creating", &root))?;
    if !is_mounted(&root) {
        let fresh = !image.exists();
        if fresh {
            if find_mkfs().is_none() {
                return Err(StoreError::Unavailable(MKFS_MISSING.into()));
            }
            make_image(data_dir, &image)?;
        }
        run(runcell_jail::host_tools::command("mount")
            .args(["-o", "loop,nosuid,nodev,noatime"])
            .arg(&image)
            .arg(&root))?;
        if fresh {
            match runcell_jail::btrfs::enable_quota(&root) {
                Ok(mode) => tracing::info!(quotas = mode, "made the btrfs layer store"),
                Err(e) => {
                    // Not left half-made: a later start would find the
                    // image and use it without quotas (no disk limit).
                    let _ = run(runcell_jail::host_tools::command("umount").arg(&root));
                    let _ = std::fs::remove_file(&image);
                    return Err(StoreError::Quota(e));
                }
            }
        }
    }
    if !runcell_jail::btrfs::is_btrfs(&root) {
        return Err(StoreError::Unavailable(format!(
            "{} is mounted but is not btrfs",
            root.display()
        )));
    }
    // Sandbox agents (an unprivileged host uid) traverse these to their
    // stage and to the state layers they overlay, never list them.
    for d in [root.clone(), root.join("stages"), root.join("states")] {
        std::fs::create_dir_all(&d).map_err(io("creating", &d))?;
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o711))
            .map_err(io("setting the mode of", &d))?;
    }
    Ok(root)
}

/// A sparse image as large as the data directory's file system (the
/// store never holds more than the disk under it), at least 8 GiB,
/// formatted btrfs with single metadata (one file on one disk: a second
/// copy protects nothing).
fn make_image(data_dir: &Path, image: &Path) -> Result<(), StoreError> {
    let size = nix::sys::statvfs::statvfs(data_dir)
        .map(|s| s.blocks().saturating_mul(s.fragment_size()))
        .unwrap_or(0)
        .max(8 << 30);
    let tmp = image.with_extension("img.tmp");
    let file = std::fs::File::create(&tmp).map_err(io("creating", &tmp))?;
    file.set_len(size).map_err(io("sizing", &tmp))?;
    drop(file);
    let made = run(runcell_jail::host_tools::command("mkfs.btrfs")
        .args(["-q", "-f", "-m", "single"])
        .arg(&tmp));
    if let Err(e) = made {
        let _ = std::fs::remove_file(&tmp);
        return Err(match e {
            StoreError::Command(m) if m.contains("No such file") => {
                StoreError::Unavailable(MKFS_MISSING.into())
            }
            e => e,
        });
    }
    // Renamed once whole: a killed start never leaves a half-made image.
    std::fs::rename(&tmp, image).map_err(io("renaming", image))
}

/// Whether `path` is a mount point in the daemon's mount namespace.
pub(crate) fn is_mounted(path: &Path) -> bool {
    let want = path.to_string_lossy();
    std::fs::read_to_string("/proc/self/mountinfo")
        .map(|m| {
            m.lines()
                .any(|l| l.split(' ').nth(4) == Some(want.as_ref()))
        })
        .unwrap_or(false)
}

fn run(cmd: &mut Command) -> Result<(), StoreError> {
    let out = cmd
        .output()
        .map_err(|e| StoreError::Command(format!("{:?}: {e}", cmd.get_program())))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(StoreError::Command(format!(
            "{:?} failed: {}",
            cmd.get_program(),
            String::from_utf8_lossy(&out.stderr).trim()
        )))
    }
}
