//! The btrfs layer store: each jail sandbox's writable layer (its "stage")
//! is a btrfs subvolume, so a save is a read-only subvolume snapshot (O(1)
//! whatever the layer holds) and the disk limit a qgroup limit.
//!
//! Only the host calls these (as real root), through the btrfs ioctls of
//! `linux/btrfs.h`. Sandboxed code cannot: the seccomp filter refuses every
//! btrfs ioctl (a subvolume it made inside its stage would escape the
//! stage's qgroup).

use std::ffi::OsStr;
use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// Errors of the btrfs layer store.
#[derive(Debug, thiserror::Error)]
pub enum BtrfsError {
    /// A btrfs operation on a path failed.
    #[error("Could not {what} {path}.")]
    Op {
        /// What was being done.
        what: &'static str,
        /// The path involved.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// A name cannot be a subvolume name.
    #[error("{0:?} is not a plain subvolume name.")]
    BadName(PathBuf),
}

fn op(what: &'static str, path: &Path) -> impl FnOnce(io::Error) -> BtrfsError {
    let path = path.to_path_buf();
    move |source| BtrfsError::Op { what, path, source }
}

const MAGIC: u64 = 0x94;
const IOC_WRITE: u64 = 1;
const IOC_READ: u64 = 2;

const fn ioc(dir: u64, nr: u64, size: usize) -> u64 {
    // `size` is a struct size below 16 KiB (14 bits), checked by the
    // compile-time assertions below.
    (dir << 30) | ((size as u64) << 16) | (MAGIC << 8) | nr
}

/// `struct btrfs_ioctl_vol_args_v2`.
#[repr(C)]
struct VolArgsV2 {
    fd: i64,
    transid: u64,
    flags: u64,
    unused: [u64; 4],
    name: [u8; 4040],
}

/// `struct btrfs_ioctl_quota_ctl_args`.
#[repr(C)]
struct QuotaCtlArgs {
    cmd: u64,
    status: u64,
}

/// `struct btrfs_ioctl_qgroup_limit_args`.
#[repr(C)]
struct QgroupLimitArgs {
    qgroupid: u64,
    flags: u64,
    max_rfer: u64,
    max_excl: u64,
    rsv_rfer: u64,
    rsv_excl: u64,
}

/// `struct btrfs_ioctl_ino_lookup_args`.
#[repr(C)]
struct InoLookupArgs {
    treeid: u64,
    objectid: u64,
    name: [u8; 4080],
}

/// `struct btrfs_ioctl_fs_info_args`.
#[repr(C)]
struct FsInfoArgs {
    max_id: u64,
    num_devices: u64,
    fsid: [u8; 16],
    rest: [u8; 992],
}

const _: () = assert!(std::mem::size_of::<VolArgsV2>() == 4096);
const _: () = assert!(std::mem::size_of::<InoLookupArgs>() == 4096);
const _: () = assert!(std::mem::size_of::<FsInfoArgs>() == 1024);

const SNAP_CREATE_V2: u64 = ioc(IOC_WRITE, 23, std::mem::size_of::<VolArgsV2>());
const SUBVOL_CREATE_V2: u64 = ioc(IOC_WRITE, 24, std::mem::size_of::<VolArgsV2>());
const SNAP_DESTROY_V2: u64 = ioc(IOC_WRITE, 63, std::mem::size_of::<VolArgsV2>());
const QUOTA_CTL: u64 = ioc(
    IOC_READ | IOC_WRITE,
    40,
    std::mem::size_of::<QuotaCtlArgs>(),
);
const QGROUP_LIMIT: u64 = ioc(IOC_READ, 43, std::mem::size_of::<QgroupLimitArgs>());
const INO_LOOKUP: u64 = ioc(
    IOC_READ | IOC_WRITE,
    18,
    std::mem::size_of::<InoLookupArgs>(),
);
const FS_INFO: u64 = ioc(IOC_READ, 31, std::mem::size_of::<FsInfoArgs>());
const START_SYNC: u64 = ioc(IOC_READ, 24, std::mem::size_of::<u64>());
const WAIT_SYNC: u64 = ioc(IOC_WRITE, 22, std::mem::size_of::<u64>());

const SUBVOL_RDONLY: u64 = 1 << 1;
const QUOTA_ENABLE: u64 = 1;
const QUOTA_ENABLE_SIMPLE: u64 = 4;
const QGROUP_LIMIT_MAX_RFER: u64 = 1;
/// The inode number of every subvolume's root directory.
const FIRST_FREE_OBJECTID: u64 = 256;

fn ioctl<T>(fd: &File, request: u64, arg: &mut T) -> io::Result<()> {
    // SAFETY: `request` is a btrfs ioctl whose argument is the `#[repr(C)]`
    // struct `T` (sizes asserted above, encoded in the request), which
    // lives for the call; the kernel reads and writes only within it.
    let rc = unsafe { libc::ioctl(fd.as_raw_fd(), request as libc::c_ulong, arg as *mut T) };
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

fn open_dir(path: &Path) -> io::Result<File> {
    OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
}

fn split(path: &Path) -> Result<(&Path, &OsStr), BtrfsError> {
    match (path.parent(), path.file_name()) {
        (Some(parent), Some(name)) if name.len() < 4040 && name != ".." => Ok((parent, name)),
        _ => Err(BtrfsError::BadName(path.to_path_buf())),
    }
}

fn vol_args(name: &OsStr) -> VolArgsV2 {
    let mut args = VolArgsV2 {
        fd: 0,
        transid: 0,
        flags: 0,
        unused: [0; 4],
        name: [0; 4040],
    };
    args.name[..name.len()].copy_from_slice(name.as_bytes());
    args
}

/// Whether `path` is on a btrfs file system.
pub fn is_btrfs(path: &Path) -> bool {
    nix::sys::statfs::statfs(path)
        .is_ok_and(|s| s.filesystem_type() == nix::sys::statfs::BTRFS_SUPER_MAGIC)
}

/// Whether `path` is the root of a btrfs subvolume.
pub fn is_subvolume(path: &Path) -> bool {
    fs::symlink_metadata(path).is_ok_and(|m| m.is_dir() && m.ino() == FIRST_FREE_OBJECTID)
        && is_btrfs(path)
}

/// Creates the subvolume `path` (its parent must exist, on btrfs).
pub fn create_subvolume(path: &Path) -> Result<(), BtrfsError> {
    let (parent, name) = split(path)?;
    let dir = open_dir(parent).map_err(op("open", parent))?;
    let mut args = vol_args(name);
    ioctl(&dir, SUBVOL_CREATE_V2, &mut args).map_err(op("create the subvolume", path))
}

/// Snapshots the subvolume `src` as `dest` (a new name in a directory of
/// the same file system), read-only if asked. O(1): the two share every
/// extent until one of them is written.
pub fn snapshot(src: &Path, dest: &Path, read_only: bool) -> Result<(), BtrfsError> {
    let (parent, name) = split(dest)?;
    let source = open_dir(src).map_err(op("open", src))?;
    let dir = open_dir(parent).map_err(op("open", parent))?;
    let mut args = vol_args(name);
    args.fd = i64::from(source.as_raw_fd());
    if read_only {
        args.flags = SUBVOL_RDONLY;
    }
    ioctl(&dir, SNAP_CREATE_V2, &mut args).map_err(op("snapshot the subvolume into", dest))
}

/// Deletes the subvolume `path` (the file system frees its extents in the
/// background). A subvolume nested inside it is deleted first.
pub fn delete_subvolume(path: &Path) -> Result<(), BtrfsError> {
    let (parent, name) = split(path)?;
    let dir = open_dir(parent).map_err(op("open", parent))?;
    let mut args = vol_args(name);
    let mut tries = 0;
    loop {
        match ioctl(&dir, SNAP_DESTROY_V2, &mut args) {
            Ok(()) => return Ok(()),
            Err(e) if e.raw_os_error() == Some(libc::ENOTEMPTY) && tries == 0 => {
                // Holds a nested subvolume (made by the host, never by a
                // sandbox): delete those, then this one.
                for nested in nested_subvolumes(path) {
                    delete_subvolume(&nested)?;
                }
            }
            // Still a mount point in a namespace the kernel is tearing down.
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) && tries < 50 => {
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            Err(e) => return Err(op("delete the subvolume", path)(e)),
        }
        tries += 1;
    }
}

fn nested_subvolumes(root: &Path) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    let dev = fs::symlink_metadata(root).map(|m| m.dev()).ok();
    while let Some(d) = stack.pop() {
        for entry in fs::read_dir(&d).into_iter().flatten().flatten() {
            let Ok(meta) = entry.metadata() else { continue };
            if !meta.is_dir() {
                continue;
            }
            // A nested subvolume has its own device number and inode 256.
            if meta.ino() == FIRST_FREE_OBJECTID && Some(meta.dev()) != dev {
                found.push(entry.path());
            } else {
                stack.push(entry.path());
            }
        }
    }
    found
}

/// Removes a layer directory: a subvolume by deleting it (O(1)), anything
/// else file by file.
pub fn remove_tree(path: &Path) -> io::Result<()> {
    if is_subvolume(path) {
        return delete_subvolume(path).map_err(io::Error::other);
    }
    match fs::remove_dir_all(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// Turns quotas on for the file system of `mount` (once, when the store is
/// made): simple quotas where the kernel has them (they account each
/// extent to the subvolume that wrote it, and snapshots and deletions cost
/// no rescans), full qgroups otherwise.
pub fn enable_quota(mount: &Path) -> Result<&'static str, BtrfsError> {
    let dir = open_dir(mount).map_err(op("open", mount))?;
    let mut args = QuotaCtlArgs {
        cmd: QUOTA_ENABLE_SIMPLE,
        status: 0,
    };
    if ioctl(&dir, QUOTA_CTL, &mut args).is_ok() {
        return Ok("simple");
    }
    let mut args = QuotaCtlArgs {
        cmd: QUOTA_ENABLE,
        status: 0,
    };
    ioctl(&dir, QUOTA_CTL, &mut args).map_err(op("enable quotas on", mount))?;
    Ok("full")
}

/// Caps what the subvolume `path` references at `bytes`: writes beyond it
/// fail with `EDQUOT`.
pub fn limit(path: &Path, bytes: u64) -> Result<(), BtrfsError> {
    let dir = open_dir(path).map_err(op("open", path))?;
    let mut args = QgroupLimitArgs {
        qgroupid: 0, // The subvolume of the descriptor.
        flags: QGROUP_LIMIT_MAX_RFER,
        max_rfer: bytes,
        max_excl: 0,
        rsv_rfer: 0,
        rsv_excl: 0,
    };
    ioctl(&dir, QGROUP_LIMIT, &mut args).map_err(op("limit the size of", path))
}

/// Bytes the subvolume whose qgroup directory ([`qgroup_dir`]) is `q`
/// references, as its qgroup counts them (as of the last transaction
/// commit, which a snapshot makes). `None` where quotas are off or the
/// counter cannot be read.
pub fn referenced_bytes(q: &Path) -> Option<u64> {
    read_u64(&q.join("referenced"))
}

/// Whether the subvolume `path` is at its qgroup limit: what it
/// references plus what is reserved for writes not yet committed is within
/// 1% (at least 1 MiB) of the limit, so a write failed or would fail with
/// `EDQUOT`. `None` where it has no limit or the counters are unreadable.
/// The counters move at transaction commits: what a sandbox deleted since
/// the last one still counts. So a layer that looks full is checked again
/// after a commit (not a flush of every file's data: rare, and cheap).
/// `q` is the subvolume's qgroup directory ([`qgroup_dir`]), which a caller
/// that asks often looks up once.
pub fn at_limit(path: &Path, q: &Path) -> Option<bool> {
    let limit = read_u64(&q.join("max_referenced")).filter(|l| *l > 0)?;
    let margin = (limit / 100).max(1 << 20);
    let full = || {
        let used = [
            "referenced",
            "rsv_data",
            "rsv_meta_prealloc",
            "rsv_meta_pertrans",
        ]
        .iter()
        .filter_map(|f| read_u64(&q.join(f)))
        .fold(0u64, u64::saturating_add);
        used.saturating_add(margin) >= limit
    };
    if !full() {
        return Some(false);
    }
    commit(path).ok()?;
    Some(full())
}

/// Commits the current transaction of the file system of `path` and waits
/// for it (`BTRFS_IOC_START_SYNC`, `BTRFS_IOC_WAIT_SYNC`).
fn commit(path: &Path) -> io::Result<()> {
    let dir = open_dir(path)?;
    let mut transid = 0u64;
    ioctl(&dir, START_SYNC, &mut transid)?;
    ioctl(&dir, WAIT_SYNC, &mut transid)
}

fn read_u64(path: &Path) -> Option<u64> {
    fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// The sysfs directory of the qgroup of the subvolume `path`, where its
/// counters and limit are read (the subvolume's id and the file system's
/// id, which it is named by, never change). `None` where it cannot be told.
pub fn qgroup_dir(path: &Path) -> Option<PathBuf> {
    let dir = open_dir(path).ok()?;
    let mut lookup = InoLookupArgs {
        treeid: 0,
        objectid: FIRST_FREE_OBJECTID,
        name: [0; 4080],
    };
    ioctl(&dir, INO_LOOKUP, &mut lookup).ok()?;
    let mut info = FsInfoArgs {
        max_id: 0,
        num_devices: 0,
        fsid: [0; 16],
        rest: [0; 992],
    };
    ioctl(&dir, FS_INFO, &mut info).ok()?;
    let f = info.fsid;
    let uuid = format!(
        "{:02x}{:02x}{:02x}{:02x}-{:02x}{:02x}-{:02x}{:02x}-{:02x}{:02x}-{:02x}{:02x}{:02x}{:02x}{:02x}{:02x}",
        f[0], f[1], f[2], f[3], f[4], f[5], f[6], f[7], f[8], f[9], f[10], f[11], f[12], f[13], f[14], f[15]
    );
    Some(PathBuf::from(format!(
        "/sys/fs/btrfs/{uuid}/qgroups/0_{}",
        lookup.treeid
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ioctl_numbers_match_linux_btrfs_h() {
        assert_eq!(SNAP_CREATE_V2, 0x5000_9417);
        assert_eq!(SUBVOL_CREATE_V2, 0x5000_9418);
        assert_eq!(SNAP_DESTROY_V2, 0x5000_943f);
        assert_eq!(QUOTA_CTL, 0xc010_9428);
        assert_eq!(QGROUP_LIMIT, 0x8030_942b);
        assert_eq!(INO_LOOKUP, 0xd000_9412);
        assert_eq!(FS_INFO, 0x8400_941f);
        assert_eq!(START_SYNC, 0x8008_9418);
        assert_eq!(WAIT_SYNC, 0x4008_9416);
    }
}
