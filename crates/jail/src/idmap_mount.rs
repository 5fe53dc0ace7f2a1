//! Idmapped bind mounts (`open_tree` + `mount_setattr(MOUNT_ATTR_IDMAP)` +
//! `move_mount`, Linux 5.12+): a host directory shown at another path with
//! its owners shifted, so that a process writing there as uid `U` leaves
//! files owned by `host_base + U` on disk, and sees files on disk owned by
//! `host_base + U` as its own.
//!
//! gVisor sandboxes use it for volumes: a jail sandbox's user `U` is host
//! uid `host_base + U` (its user namespace maps `0 host_base count`), while
//! gVisor's gofer writes files with the sandbox's own, unmapped ids. The
//! gofer is handed a bind of the volume mounted through the inverse map
//! (`host_base 0 count`), so both kinds of sandbox keep the same owners on
//! the volume's disk.

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use crate::spec::IdMap;

/// Errors of an idmapped bind mount.
#[derive(Debug, thiserror::Error)]
pub enum IdmapMountError {
    /// The id map does not fit in 32-bit ids.
    #[error("The id map {0:?} runs past the largest uid.")]
    BadMap(IdMap),
    /// A path has a NUL byte.
    #[error("The path {0:?} has a NUL byte.")]
    BadPath(std::path::PathBuf),
    /// A step failed.
    #[error("Could not {step} for {path}.")]
    Step {
        /// What was being done.
        step: &'static str,
        /// The path it was done for.
        path: String,
        /// Why it failed.
        #[source]
        source: io::Error,
    },
}

fn step(step: &'static str, path: &Path) -> impl FnOnce(io::Error) -> IdmapMountError {
    let path = path.display().to_string();
    move |source| IdmapMountError::Step { step, path, source }
}

fn cstring(path: &Path) -> Result<std::ffi::CString, IdmapMountError> {
    std::ffi::CString::new(path.as_os_str().as_bytes())
        .map_err(|_| IdmapMountError::BadPath(path.to_path_buf()))
}

/// A user namespace whose uid and gid maps are `map` inverted: its ids
/// `host_base..host_base+count` are this namespace's `0..count`. Only its
/// descriptor is kept; the process made to hold it is killed and reaped
/// before this returns (the namespace lives on while the descriptor does).
fn inverse_userns(map: IdMap, source: &Path) -> Result<OwnedFd, IdmapMountError> {
    map.host_base
        .checked_add(map.count)
        .ok_or(IdmapMountError::BadMap(map))?;
    let mut pipe = [0i32; 2];
    // SAFETY: `pipe` is a valid array of two ints for pipe2 to fill.
    if unsafe { libc::pipe2(pipe.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(step("make a pipe", source)(io::Error::last_os_error()));
    }
    // SAFETY: pipe2 succeeded, so both are open descriptors owned by nobody else.
    let (read_end, write_end) =
        unsafe { (OwnedFd::from_raw_fd(pipe[0]), OwnedFd::from_raw_fd(pipe[1])) };
    // SAFETY: the child branch only makes async-signal-safe raw syscalls
    // (close, read, _exit) on descriptors it already has, and never returns.
    let pid = unsafe { crate::sys::clone_fork(libc::CLONE_NEWUSER as libc::c_ulong) }
        .map_err(step("clone a user namespace", source))?;
    if pid == 0 {
        // SAFETY: in the freshly cloned child: closing its copy of the
        // write end makes the read below end when the parent's copy
        // closes (the parent dropped it, or died), then it exits.
        unsafe {
            libc::close(write_end.as_raw_fd());
            let mut b = 0u8;
            libc::read(read_end.as_raw_fd(), std::ptr::addr_of_mut!(b).cast(), 1);
            libc::_exit(0);
        }
    }
    drop(read_end);
    let made = (|| {
        let line = format!("{} 0 {}\n", map.host_base, map.count);
        for file in ["uid_map", "gid_map"] {
            let path = format!("/proc/{pid}/{file}");
            std::fs::write(&path, &line).map_err(step("write the namespace's id map", source))?;
        }
        File::open(format!("/proc/{pid}/ns/user"))
            .map(OwnedFd::from)
            .map_err(step("open the user namespace", source))
    })();
    drop(write_end);
    // SAFETY: `pid` is our unreaped child, so the id names it and no other
    // process; kill and waitpid take plain integers.
    unsafe {
        libc::kill(pid, libc::SIGKILL);
        let mut status = 0;
        while libc::waitpid(pid, &mut status, 0) < 0
            && io::Error::last_os_error().raw_os_error() == Some(libc::EINTR)
        {}
    }
    made
}

/// Mounts a bind of the mount at `source` on `target` (an existing
/// directory), with ids shifted down by `map`: a file owned on disk by
/// `map.host_base + U` shows as owned by `U`, and one created there by
/// (fs)uid `U` is owned on disk by `map.host_base + U`. Ids outside the
/// map show as the overflow id and cannot create files. `nosuid` and
/// `nodev`, and read-only if `read_only` (the kernel refuses every write
/// with `EROFS`, whatever the process above asks).
pub fn bind_idmapped(
    source: &Path,
    target: &Path,
    map: IdMap,
    read_only: bool,
) -> Result<(), IdmapMountError> {
    let src = cstring(source)?;
    let dst = cstring(target)?;
    let userns = inverse_userns(map, source)?;
    // SAFETY: `src` is a NUL-terminated path that outlives the call; the
    // flags are plain integers.
    let tree = unsafe {
        libc::syscall(
            libc::SYS_open_tree,
            libc::AT_FDCWD,
            src.as_ptr(),
            libc::OPEN_TREE_CLONE | libc::OPEN_TREE_CLOEXEC,
        )
    };
    if tree < 0 {
        return Err(step("clone the mount", source)(io::Error::last_os_error()));
    }
    let tree = i32::try_from(tree)
        .map_err(|_| step("clone the mount", source)(io::Error::other("bad descriptor")))?;
    // SAFETY: open_tree returned a new descriptor that nothing else owns.
    let tree = unsafe { OwnedFd::from_raw_fd(tree) };
    let mut set = libc::MOUNT_ATTR_IDMAP | libc::MOUNT_ATTR_NOSUID | libc::MOUNT_ATTR_NODEV;
    if read_only {
        set |= libc::MOUNT_ATTR_RDONLY;
    }
    let attr = libc::mount_attr {
        attr_set: set,
        attr_clr: 0,
        propagation: 0,
        userns_fd: u64::try_from(userns.as_raw_fd()).unwrap_or(u64::MAX),
    };
    // SAFETY: `tree` is an open detached mount, the empty path is a
    // NUL-terminated literal, and `attr` is a valid `mount_attr` whose
    // size is passed with it; all outlive the call.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            tree.as_raw_fd(),
            c"".as_ptr(),
            libc::AT_EMPTY_PATH,
            std::ptr::addr_of!(attr),
            std::mem::size_of::<libc::mount_attr>(),
        )
    };
    if rc != 0 {
        return Err(step("idmap the mount", source)(io::Error::last_os_error()));
    }
    drop(userns);
    // SAFETY: `tree` is an open detached mount, both paths are
    // NUL-terminated and outlive the call.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_move_mount,
            tree.as_raw_fd(),
            c"".as_ptr(),
            libc::AT_FDCWD,
            dst.as_ptr(),
            libc::MOVE_MOUNT_F_EMPTY_PATH,
        )
    };
    if rc != 0 {
        return Err(step("mount the idmapped bind", target)(
            io::Error::last_os_error(),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    /// Needs root (it mounts): the owners shift both ways, and read-only
    /// holds. A tmpfs is the source, as a volume's ext4 would be.
    #[test]
    fn owners_shift_both_ways_and_read_only_holds() {
        assert!(
            nix::unistd::geteuid().is_root(),
            "this test mounts; run it as root"
        );
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("src");
        let rw = dir.path().join("rw");
        let ro = dir.path().join("ro");
        for d in [&src, &rw, &ro] {
            std::fs::create_dir(d).unwrap();
        }
        nix::mount::mount(
            Some("tmpfs"),
            &src,
            Some("tmpfs"),
            nix::mount::MsFlags::empty(),
            Some("size=1m"),
        )
        .unwrap();
        let map = IdMap {
            host_base: 1_000_000_000,
            count: 65_536,
        };
        let base = map.host_base;
        std::os::unix::fs::chown(&src, Some(base + 1000), Some(base + 1000)).unwrap();
        std::fs::write(src.join("jail"), b"x").unwrap();
        std::os::unix::fs::chown(src.join("jail"), Some(base + 1000), Some(base + 1000)).unwrap();
        bind_idmapped(&src, &rw, map, false).unwrap();
        bind_idmapped(&src, &ro, map, true).unwrap();
        let seen = std::fs::metadata(rw.join("jail")).unwrap();
        assert_eq!((seen.uid(), seen.gid()), (1000, 1000));
        std::fs::write(rw.join("gvisor"), b"y").unwrap();
        std::os::unix::fs::chown(rw.join("gvisor"), Some(1000), Some(1000)).unwrap();
        let on_disk = std::fs::metadata(src.join("gvisor")).unwrap();
        assert_eq!((on_disk.uid(), on_disk.gid()), (base + 1000, base + 1000));
        let refused = std::fs::write(ro.join("nope"), b"z").unwrap_err();
        assert_eq!(refused.raw_os_error(), Some(libc::EROFS));
        for m in [&ro, &rw, &src] {
            nix::mount::umount2(m.as_path(), nix::mount::MntFlags::MNT_DETACH).unwrap();
        }
    }
}
