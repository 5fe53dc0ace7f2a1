//! File operations, performed with the sandbox user's file-system identity so
//! permissions and ownership are exactly what code in the sandbox would get.
//!
//! Every operation runs on tokio's blocking pool (bounded in `main`), never
//! on the runtime thread: one slow or stuck file (a FIFO, a huge tree to
//! remove) must not hold up the sandbox's other requests. The fsuid switch
//! is per thread, so it is made on the thread that does the I/O.
//!
//! Paths are resolved without following /proc magic links (`/proc/<pid>/fd/*`,
//! `cwd`, `root`, `exe`), and nothing under the agent's own `/proc/<pid>` or
//! that of a process the sandbox user does not own is served: those would
//! show the agent's memory layout, its sockets and the host's paths.
//! Reads and writes touch regular files only, opened without blocking.

use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::Path;

use nix::fcntl::{openat2, OFlag, OpenHow, ResolveFlag, AT_FDCWD};
use nix::sys::stat::Mode;
use runcell_protocol::{ErrorKind, Event, FileStat, Frame, ServerMessage};

use crate::shared::{send, send_error, Outbox, Shared};

const CHUNK: usize = 1 << 20;

/// Why an operation failed: the kind the host maps to a status, and a sentence.
type Failure = (ErrorKind, String);

/// The sandbox user's ids, for the worker thread.
#[derive(Debug, Clone, Copy)]
struct User {
    uid: u32,
    gid: u32,
}

fn user(agent: &Shared) -> User {
    User {
        uid: agent.spec.user.uid,
        gid: agent.spec.user.gid,
    }
}

/// Runs `f` accessing files as the user on the current thread (its fsuid,
/// or under gVisor its effective ids), then back. An agent that cannot
/// switch (never seen: it is root) stops rather than act as root for the
/// user.
fn as_user<T>(u: User, f: impl FnOnce() -> T) -> T {
    switch_file_user(u.uid, u.gid);
    let r = f();
    switch_file_user(0, 0);
    r
}

fn switch_file_user(uid: u32, gid: u32) {
    if let Err(e) = runcell_jail::inside::set_file_user(uid, gid) {
        tracing::error!("could not switch file access to uid {uid}: {e}");
        std::process::abort();
    }
}

/// Runs blocking file work on the blocking pool.
async fn off_thread<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, Failure> + Send + 'static,
) -> Result<T, Failure> {
    match tokio::task::spawn_blocking(f).await {
        Ok(r) => r,
        Err(e) => Err((
            ErrorKind::Other,
            format!("The file operation failed inside the agent: {e}."),
        )),
    }
}

fn check_path(path: &str) -> Result<&Path, Failure> {
    if !path.starts_with('/') {
        return Err((
            ErrorKind::InvalidInput,
            format!("The path \"{path}\" must be absolute."),
        ));
    }
    if path.contains('\0') {
        return Err((
            ErrorKind::InvalidInput,
            "The path contains a NUL byte.".into(),
        ));
    }
    Ok(Path::new(path))
}

/// Maps every errno to the kind of answer it deserves: the caller's mistake
/// (400, 403, 404, 413, 507) or, for genuine failures of the sandbox (out
/// of memory or descriptors, I/O errors), `Other`.
fn classify(what: &str, path: &str, e: io::Error) -> Failure {
    let kind = match e.raw_os_error() {
        Some(libc::ENOENT) => ErrorKind::NotFound,
        Some(
            libc::EACCES
            | libc::EPERM
            | libc::EROFS
            | libc::ETXTBSY
            | libc::EBUSY
            | libc::EXDEV
            | libc::ELOOP,
        ) => ErrorKind::PermissionDenied,
        Some(libc::ENOSPC | libc::EDQUOT) => ErrorKind::NoSpace,
        Some(libc::EFBIG) => ErrorKind::TooLarge,
        Some(
            libc::EISDIR
            | libc::ENOTDIR
            | libc::EEXIST
            | libc::ENOTEMPTY
            | libc::ENAMETOOLONG
            | libc::EINVAL
            | libc::ENXIO
            | libc::ENODEV
            | libc::EOPNOTSUPP
            | libc::EMLINK
            | libc::EOVERFLOW,
        ) => ErrorKind::InvalidInput,
        _ => match e.kind() {
            io::ErrorKind::NotFound => ErrorKind::NotFound,
            io::ErrorKind::PermissionDenied => ErrorKind::PermissionDenied,
            io::ErrorKind::InvalidInput => ErrorKind::InvalidInput,
            _ => ErrorKind::Other,
        },
    };
    let mut message = format!("Could not {what} {path}: {e}.");
    match e.raw_os_error() {
        Some(libc::EROFS) => message.push_str(" That part of the sandbox is read-only."),
        Some(libc::ELOOP) => message.push_str(
            " The files API does not follow symbolic-link loops or the magic links under /proc/<pid>.",
        ),
        Some(libc::ENOSPC | libc::EDQUOT) => message.push_str(
            " The sandbox's disk (bytes or its number of files) is full; delete files or create the sandbox with a larger disk_mb.",
        ),
        _ => {}
    }
    (kind, message)
}

fn errno(e: nix::errno::Errno) -> io::Error {
    io::Error::from_raw_os_error(e as i32)
}

/// Opens `path` (as the calling thread's fsuid) without following magic
/// links, then refuses it if it is private to the agent.
fn open_checked(
    what: &str,
    path: &str,
    flags: OFlag,
    mode: Mode,
    owner: u32,
) -> Result<File, Failure> {
    let how = OpenHow::new()
        .flags(flags | OFlag::O_CLOEXEC)
        .mode(mode)
        .resolve(ResolveFlag::RESOLVE_NO_MAGICLINKS);
    let fd: OwnedFd = match openat2(AT_FDCWD, path, how) {
        // gVisor (release 20221219) has no openat2.
        Err(nix::errno::Errno::ENOSYS) => open_without_openat2(path, flags, mode),
        other => other,
    }
    .map_err(|e| classify(what, path, errno(e)))?;
    refuse_private(&fd, what, path, owner)?;
    Ok(File::from(fd))
}

/// `open(2)` for kernels without `openat2` (gVisor): a path naming a magic
/// link under `/proc/<pid>` itself is refused with `ELOOP`, as
/// `RESOLVE_NO_MAGICLINKS` would. One reached through a symbolic link the
/// sandbox made (`/tmp/agent` -> `/proc/1`, then `/tmp/agent/fd/3`) passes
/// the kernel's ptrace-access check, since the opening thread is the
/// agent's own: a file that is one the agent holds open is refused
/// ([`held_by_the_agent`]), and the rest is [`refuse_private`]'s.
fn open_without_openat2(path: &str, flags: OFlag, mode: Mode) -> nix::Result<OwnedFd> {
    let mut parts = Path::new(path).components().skip_while(|c| {
        matches!(
            c,
            std::path::Component::RootDir | std::path::Component::CurDir
        )
    });
    let in_proc = parts.next().is_some_and(|c| c.as_os_str() == "proc");
    if in_proc
        && parts.any(|c| {
            ["root", "cwd", "exe", "fd", "map_files"]
                .iter()
                .any(|m| c.as_os_str() == *m)
        })
    {
        return Err(nix::errno::Errno::ELOOP);
    }
    let fd = nix::fcntl::open(path, flags | OFlag::O_CLOEXEC, mode)?;
    if held_by_the_agent(&fd) {
        return Err(nix::errno::Errno::ELOOP);
    }
    Ok(fd)
}

/// Whether `fd` is a regular file the agent also holds open under another
/// descriptor (so it was most likely reached through one of the agent's
/// `/proc/<pid>/fd` magic links; a file another request happens to have
/// open at the same moment is refused too, which a retry fixes).
fn held_by_the_agent(fd: &OwnedFd) -> bool {
    let own = fd.as_raw_fd().to_string();
    let Ok(me) = fs::metadata(format!("/proc/self/fd/{own}")) else {
        return false;
    };
    if !me.is_file() {
        return false;
    }
    fs::read_dir("/proc/self/fd")
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.file_name() != own.as_str())
        .filter_map(|e| fs::metadata(e.path()).ok())
        .any(|m| m.dev() == me.dev() && m.ino() == me.ino())
}

/// Refuses an open file that lies in the agent's `/proc/<pid>` or in that of
/// a process `owner` does not own.
fn refuse_private(fd: &OwnedFd, what: &str, path: &str, owner: u32) -> Result<(), Failure> {
    let denied = || {
        (
            ErrorKind::PermissionDenied,
            format!(
                "Could not {what} {path}: it belongs to a process the sandbox user does not own, which the files API does not show."
            ),
        )
    };
    let real = fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd()))
        .map_err(|e| classify(what, path, e))?;
    let real = real.to_string_lossy();
    if !real.starts_with('/') {
        return Err(denied());
    }
    let Some(rest) = real.strip_prefix("/proc/") else {
        return Ok(());
    };
    let Ok(pid) = rest.split('/').next().unwrap_or("").parse::<u32>() else {
        return Ok(());
    };
    if pid == std::process::id() {
        return Err(denied());
    }
    match fs::metadata(format!("/proc/{pid}")) {
        Ok(m) if m.uid() == owner => Ok(()),
        _ => Err(denied()),
    }
}

/// What kind of file a non-regular file is, for messages.
fn type_name(t: fs::FileType) -> &'static str {
    if t.is_dir() {
        "a directory"
    } else if t.is_fifo() {
        "a FIFO (named pipe)"
    } else if t.is_socket() {
        "a socket"
    } else if t.is_char_device() {
        "a character device"
    } else if t.is_block_device() {
        "a block device"
    } else if t.is_symlink() {
        "a symbolic link"
    } else {
        "not a regular file"
    }
}

fn not_regular(path: &str, t: fs::FileType, verb: &str) -> Failure {
    (
        ErrorKind::InvalidInput,
        format!(
            "{path} is {}; only regular files can be {verb} through the files API.",
            type_name(t)
        ),
    )
}

fn to_stat(name: String, meta: &fs::Metadata, is_symlink: bool) -> FileStat {
    FileStat {
        name,
        is_dir: meta.is_dir(),
        is_symlink,
        size: meta.len(),
        mode: meta.permissions().mode() & 0o7777,
        mtime: meta.mtime(),
    }
}

fn frame(id: u64, event: Event, body: Vec<u8>) -> Frame<ServerMessage> {
    Frame::with_body(ServerMessage { id, event }, body)
}

/// Reads a file and streams it as `Data` chunks.
pub async fn read(agent: &Shared, id: u64, path: &str, max_bytes: u64, out: &Outbox) {
    if let Err((k, m)) = check_path(path) {
        return send_error(out, id, k, m).await;
    }
    let (u, path, tx) = (user(agent), path.to_string(), out.clone());
    let result = off_thread(move || {
        // O_PATH first: nothing but a regular file is ever opened for reading
        // (opening a FIFO or a device can block or have effects).
        let located = as_user(u, || {
            open_checked("read", &path, OFlag::O_PATH, Mode::empty(), u.uid)
        })?;
        let meta = match located.metadata() {
            // gVisor (20221219) cannot fstat an O_PATH descriptor of a
            // socket: ask by path (the type is all that is needed here; the
            // reopen below goes through the descriptor again).
            Err(e) if e.raw_os_error() == Some(libc::EBADF) => as_user(u, || fs::metadata(&path)),
            other => other,
        }
        .map_err(|e| classify("read", &path, e))?;
        if !meta.is_file() {
            return Err(not_regular(&path, meta.file_type(), "read"));
        }
        if meta.len() > max_bytes {
            let msg = format!(
                "{path} is {} bytes, more than the {max_bytes} allowed.",
                meta.len()
            );
            return Err((ErrorKind::TooLarge, msg));
        }
        let reopen = format!("/proc/self/fd/{}", located.as_raw_fd());
        let mut file = as_user(u, || {
            fs::OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
                .open(&reopen)
        })
        .map_err(|e| classify("read", &path, e))?;
        drop(located);
        let mut size = 0u64;
        let mut buf = vec![0u8; CHUNK];
        loop {
            match file.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => {
                    size += n as u64;
                    if size > max_bytes {
                        let msg = format!(
                            "{path} grew past the {max_bytes} bytes allowed while being read."
                        );
                        return Err((ErrorKind::TooLarge, msg));
                    }
                    if tx
                        .blocking_send(frame(id, Event::Data, buf[..n].to_vec()))
                        .is_err()
                    {
                        return Ok(None);
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(classify("read", &path, e)),
            }
        }
        Ok(Some(size))
    })
    .await;
    match result {
        Ok(Some(size)) => {
            send(out, id, Event::FileEnd { size }, Vec::new()).await;
        }
        Ok(None) => {}
        Err((k, m)) => send_error(out, id, k, m).await,
    }
}

/// Writes `data` to a file, creating parent directories.
pub async fn write(
    agent: &Shared,
    id: u64,
    path: &str,
    append: bool,
    mode: Option<u32>,
    data: Vec<u8>,
    out: &Outbox,
) {
    let p = match check_path(path) {
        Ok(p) => p.to_path_buf(),
        Err((k, m)) => return send_error(out, id, k, m).await,
    };
    let (u, path_s) = (user(agent), path.to_string());
    let len = data.len() as u64;
    let result = off_thread(move || {
        let path = path_s.as_str();
        let mut f = as_user(u, || {
            if let Some(parent) = p.parent() {
                fs::create_dir_all(parent).map_err(|e| classify("write", path, e))?;
            }
            let mut flags = OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_NONBLOCK | OFlag::O_NOCTTY;
            if append {
                flags |= OFlag::O_APPEND;
            }
            let mode = Mode::from_bits_truncate(mode.unwrap_or(0o644) & 0o7777);
            open_checked("write", path, flags, mode, u.uid).map_err(|(k, m)| {
                // ENXIO: a FIFO with no reader, a socket or a device; say which.
                match fs::metadata(path) {
                    Ok(meta) if !meta.is_file() => not_regular(path, meta.file_type(), "written"),
                    _ => (k, m),
                }
            })
        })?;
        let meta = f.metadata().map_err(|e| classify("write", path, e))?;
        if !meta.is_file() {
            return Err(not_regular(path, meta.file_type(), "written"));
        }
        if !append {
            f.set_len(0).map_err(|e| classify("write", path, e))?;
        }
        f.write_all(&data).map_err(|e| classify("write", path, e))
    })
    .await;
    match result {
        Ok(()) => {
            send(out, id, Event::Written { bytes: len }, Vec::new()).await;
        }
        Err((k, m)) => send_error(out, id, k, m).await,
    }
}

/// Lists a directory.
pub async fn list(agent: &Shared, id: u64, path: &str, out: &Outbox) {
    if let Err((k, m)) = check_path(path) {
        return send_error(out, id, k, m).await;
    }
    let (u, path) = (user(agent), path.to_string());
    let result = off_thread(move || {
        as_user(u, || {
            let dir = open_checked(
                "list",
                &path,
                OFlag::O_RDONLY | OFlag::O_DIRECTORY,
                Mode::empty(),
                u.uid,
            )?;
            let at = format!("/proc/self/fd/{}", dir.as_raw_fd());
            let mut entries = Vec::new();
            for entry in fs::read_dir(&at).map_err(|e| classify("list", &path, e))? {
                let entry = entry.map_err(|e| classify("list", &path, e))?;
                let name = entry.file_name().to_string_lossy().into_owned();
                // lstat and stat only: nothing in the directory is opened.
                let Ok(lmeta) = entry.metadata() else {
                    continue;
                };
                let is_link = lmeta.file_type().is_symlink();
                let meta = if is_link {
                    fs::metadata(entry.path()).unwrap_or(lmeta)
                } else {
                    lmeta
                };
                entries.push(to_stat(name, &meta, is_link));
            }
            Ok(entries)
        })
    })
    .await;
    match result {
        Ok(entries) => {
            send(out, id, Event::Dir { entries }, Vec::new()).await;
        }
        Err((k, m)) => send_error(out, id, k, m).await,
    }
}

/// Stats a path (following a final symlink, and saying it was one).
pub async fn stat(agent: &Shared, id: u64, path: &str, out: &Outbox) {
    if let Err((k, m)) = check_path(path) {
        return send_error(out, id, k, m).await;
    }
    let (u, path) = (user(agent), path.to_string());
    let result = off_thread(move || {
        as_user(u, || {
            let link = open_checked(
                "stat",
                &path,
                OFlag::O_PATH | OFlag::O_NOFOLLOW,
                Mode::empty(),
                u.uid,
            )?;
            let lmeta = link.metadata().map_err(|e| classify("stat", &path, e))?;
            let is_link = lmeta.file_type().is_symlink();
            let meta = if is_link {
                match open_checked("stat", &path, OFlag::O_PATH, Mode::empty(), u.uid) {
                    Ok(target) => target.metadata().unwrap_or(lmeta),
                    Err((ErrorKind::PermissionDenied, m)) => {
                        return Err((ErrorKind::PermissionDenied, m))
                    }
                    // A dangling link: describe the link itself.
                    Err(_) => lmeta,
                }
            } else {
                lmeta
            };
            let name = Path::new(&path)
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_else(|| "/".into());
            Ok(to_stat(name, &meta, is_link))
        })
    })
    .await;
    match result {
        Ok(s) => {
            send(out, id, Event::Stat(s), Vec::new()).await;
        }
        Err((k, m)) => send_error(out, id, k, m).await,
    }
}

/// Creates a directory and its parents.
pub async fn make_dir(agent: &Shared, id: u64, path: &str, out: &Outbox) {
    if let Err((k, m)) = check_path(path) {
        return send_error(out, id, k, m).await;
    }
    let (u, path) = (user(agent), path.to_string());
    let result = off_thread(move || {
        as_user(u, || fs::create_dir_all(&path)).map_err(|e| classify("create", &path, e))
    })
    .await;
    match result {
        Ok(()) => {
            send(out, id, Event::Done, Vec::new()).await;
        }
        Err((k, m)) => send_error(out, id, k, m).await,
    }
}

/// Removes a file or a directory tree.
pub async fn remove(agent: &Shared, id: u64, path: &str, out: &Outbox) {
    if let Err((k, m)) = check_path(path) {
        return send_error(out, id, k, m).await;
    }
    let (u, path) = (user(agent), path.to_string());
    let result = off_thread(move || {
        as_user(u, || match fs::symlink_metadata(&path) {
            Ok(m) if m.is_dir() => fs::remove_dir_all(&path),
            Ok(_) => fs::remove_file(&path),
            Err(e) => Err(e),
        })
        .map_err(|e| classify("remove", &path, e))
    })
    .await;
    match result {
        Ok(()) => {
            send(out, id, Event::Done, Vec::new()).await;
        }
        Err((k, m)) => send_error(out, id, k, m).await,
    }
}
