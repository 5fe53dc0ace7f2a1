//! `LD_PRELOAD` library for gVisor sandboxes (part of the jail).
//!
//! The gVisor release Debian ships (runsc 20221219) refuses `statx` and
//! `fstatat` with `AT_NO_AUTOMOUNT` (EINVAL), which coreutils passes: `ls -l`,
//! `stat`, `cp -a`, `find -newer` all fail. The flag only matters on an
//! automount point, of which a sandbox has none (and Linux implies it for
//! `fstatat` since 4.11), so these wrappers drop it and make the system call
//! themselves. Everything else is glibc's. The gVisor backend mounts this
//! library read-only at `/run/runcell/gvisor-shim.so` and names it in
//! `LD_PRELOAD` for every process; the jail and microVM backends do not use it.

use libc::{c_char, c_int, c_long, c_uint, c_void};

/// The flag this gVisor refuses.
const AT_NO_AUTOMOUNT: c_int = 0x800;

/// `statx(2)` without `AT_NO_AUTOMOUNT`.
///
/// # Safety
/// The caller's contract for `statx`: `path` a C string, `buf` a
/// `struct statx` to write.
#[no_mangle]
pub unsafe extern "C" fn statx(
    dirfd: c_int,
    path: *const c_char,
    flags: c_int,
    mask: c_uint,
    buf: *mut c_void,
) -> c_int {
    // SAFETY: the caller's arguments go to the kernel (gVisor's Sentry)
    // unchanged but for one flag bit; `syscall` sets errno on failure, as
    // statx(3) does.
    let r = unsafe {
        libc::syscall(
            libc::SYS_statx,
            dirfd,
            path,
            flags & !AT_NO_AUTOMOUNT,
            mask,
            buf,
        )
    };
    ret(r)
}

/// `fstatat(2)` without `AT_NO_AUTOMOUNT` (x86_64's `struct stat` is the
/// kernel's, so `newfstatat` fills it directly).
///
/// # Safety
/// The caller's contract for `fstatat`.
#[no_mangle]
pub unsafe extern "C" fn fstatat(
    dirfd: c_int,
    path: *const c_char,
    buf: *mut c_void,
    flags: c_int,
) -> c_int {
    // SAFETY: as for `statx`: the caller's arguments, one flag bit cleared.
    let r = unsafe {
        libc::syscall(
            libc::SYS_newfstatat,
            dirfd,
            path,
            buf,
            flags & !AT_NO_AUTOMOUNT,
        )
    };
    ret(r)
}

/// `fstatat64`: the same call on x86_64.
///
/// # Safety
/// The caller's contract for `fstatat64`.
#[no_mangle]
pub unsafe extern "C" fn fstatat64(
    dirfd: c_int,
    path: *const c_char,
    buf: *mut c_void,
    flags: c_int,
) -> c_int {
    // SAFETY: forwards the caller's own arguments.
    unsafe { fstatat(dirfd, path, buf, flags) }
}

/// A system call's result as an `int` (0 or -1 with errno set).
fn ret(r: c_long) -> c_int {
    c_int::try_from(r).unwrap_or(-1)
}
