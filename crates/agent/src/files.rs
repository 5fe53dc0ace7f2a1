//! File operations, performed with the sandbox user's file-system identity so
//! permissions and ownership are exactly what code in the sandbox would get.

use std::fs::{self, OpenOptions};
use std::io::{self, Read, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::Path;

use nix::unistd::{setfsgid, setfsuid, Gid, Uid};
use runcell_protocol::{ErrorKind, Event, FileStat};

use crate::server::{send, send_error, Agent, Outbox};

const CHUNK: usize = 1 << 20;

/// Runs `f` with the sandbox user's fsuid/fsgid. `f` must not `.await`
/// (the identity belongs to the thread, and the runtime is single-threaded).
fn as_user<T>(agent: &Agent, f: impl FnOnce() -> T) -> T {
    let u = &agent.spec.user;
    setfsgid(Gid::from_raw(u.gid));
    setfsuid(Uid::from_raw(u.uid));
    let r = f();
    setfsuid(Uid::from_raw(0));
    setfsgid(Gid::from_raw(0));
    r
}

fn check_path(path: &str) -> Result<&Path, (ErrorKind, String)> {
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

fn classify(what: &str, path: &str, e: io::Error) -> (ErrorKind, String) {
    let kind = match e.kind() {
        io::ErrorKind::NotFound => ErrorKind::NotFound,
        io::ErrorKind::PermissionDenied => ErrorKind::PermissionDenied,
        io::ErrorKind::InvalidInput => ErrorKind::InvalidInput,
        _ if e.raw_os_error() == Some(libc::ENOSPC) => ErrorKind::NoSpace,
        _ if e.raw_os_error() == Some(libc::ENOTDIR) || e.raw_os_error() == Some(libc::EISDIR) => {
            ErrorKind::InvalidInput
        }
        _ => ErrorKind::Other,
    };
    (kind, format!("Could not {what} {path}: {e}."))
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

/// Reads a file and streams it as `Data` chunks.
pub async fn read(agent: &Agent, id: u64, path: &str, max_bytes: u64, out: &Outbox) {
    let p = match check_path(path) {
        Ok(p) => p,
        Err((k, m)) => return send_error(out, id, k, m).await,
    };
    let opened = as_user(agent, || fs::File::open(p));
    let mut file = match opened.and_then(|f| f.metadata().map(|m| (f, m))) {
        Ok((_, m)) if m.is_dir() => {
            return send_error(
                out,
                id,
                ErrorKind::InvalidInput,
                format!("{path} is a directory."),
            )
            .await
        }
        Ok((_, m)) if m.len() > max_bytes => {
            let msg = format!(
                "{path} is {} bytes, more than the {max_bytes} allowed.",
                m.len()
            );
            return send_error(out, id, ErrorKind::TooLarge, msg).await;
        }
        Ok((f, _)) => f,
        Err(e) => {
            let (k, m) = classify("read", path, e);
            return send_error(out, id, k, m).await;
        }
    };
    let mut size = 0u64;
    let mut buf = vec![0u8; CHUNK];
    loop {
        match file.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                size += n as u64;
                if size > max_bytes {
                    let msg =
                        format!("{path} grew past the {max_bytes} bytes allowed while being read.");
                    return send_error(out, id, ErrorKind::TooLarge, msg).await;
                }
                if !send(out, id, Event::Data, buf[..n].to_vec()).await {
                    return;
                }
            }
            Err(e) => {
                let (k, m) = classify("read", path, e);
                return send_error(out, id, k, m).await;
            }
        }
    }
    send(out, id, Event::FileEnd { size }, Vec::new()).await;
}

/// Writes `data` to a file, creating parent directories.
pub async fn write(
    agent: &Agent,
    id: u64,
    path: &str,
    append: bool,
    mode: Option<u32>,
    data: &[u8],
    out: &Outbox,
) {
    let p = match check_path(path) {
        Ok(p) => p,
        Err((k, m)) => return send_error(out, id, k, m).await,
    };
    let result = as_user(agent, || -> io::Result<()> {
        if let Some(parent) = p.parent() {
            fs::create_dir_all(parent)?;
        }
        let mut f = OpenOptions::new()
            .write(true)
            .create(true)
            .append(append)
            .truncate(!append)
            .mode(mode.unwrap_or(0o644))
            .open(p)?;
        f.write_all(data)
    });
    match result {
        Ok(()) => {
            send(
                out,
                id,
                Event::Written {
                    bytes: data.len() as u64,
                },
                Vec::new(),
            )
            .await;
        }
        Err(e) => {
            let (k, m) = classify("write", path, e);
            send_error(out, id, k, m).await
        }
    }
}

/// Lists a directory.
pub async fn list(agent: &Agent, id: u64, path: &str, out: &Outbox) {
    let p = match check_path(path) {
        Ok(p) => p,
        Err((k, m)) => return send_error(out, id, k, m).await,
    };
    let result = as_user(agent, || -> io::Result<Vec<FileStat>> {
        let mut entries = Vec::new();
        for entry in fs::read_dir(p)? {
            let entry = entry?;
            let name = entry.file_name().to_string_lossy().into_owned();
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
    });
    match result {
        Ok(entries) => {
            send(out, id, Event::Dir { entries }, Vec::new()).await;
        }
        Err(e) => {
            let (k, m) = classify("list", path, e);
            send_error(out, id, k, m).await
        }
    }
}

/// Stats a path (following a final symlink, and saying it was one).
pub async fn stat(agent: &Agent, id: u64, path: &str, out: &Outbox) {
    let p = match check_path(path) {
        Ok(p) => p,
        Err((k, m)) => return send_error(out, id, k, m).await,
    };
    let result = as_user(agent, || -> io::Result<FileStat> {
        let lmeta = fs::symlink_metadata(p)?;
        let is_link = lmeta.file_type().is_symlink();
        let meta = if is_link {
            fs::metadata(p).unwrap_or(lmeta)
        } else {
            lmeta
        };
        let name = p
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "/".into());
        Ok(to_stat(name, &meta, is_link))
    });
    match result {
        Ok(s) => {
            send(out, id, Event::Stat(s), Vec::new()).await;
        }
        Err(e) => {
            let (k, m) = classify("stat", path, e);
            send_error(out, id, k, m).await
        }
    }
}

/// Creates a directory and its parents.
pub async fn make_dir(agent: &Agent, id: u64, path: &str, out: &Outbox) {
    let p = match check_path(path) {
        Ok(p) => p,
        Err((k, m)) => return send_error(out, id, k, m).await,
    };
    match as_user(agent, || fs::create_dir_all(p)) {
        Ok(()) => {
            send(out, id, Event::Done, Vec::new()).await;
        }
        Err(e) => {
            let (k, m) = classify("create", path, e);
            send_error(out, id, k, m).await
        }
    }
}

/// Removes a file or a directory tree.
pub async fn remove(agent: &Agent, id: u64, path: &str, out: &Outbox) {
    let p = match check_path(path) {
        Ok(p) => p,
        Err((k, m)) => return send_error(out, id, k, m).await,
    };
    let result = as_user(agent, || match fs::symlink_metadata(p) {
        Ok(m) if m.is_dir() => fs::remove_dir_all(p),
        Ok(_) => fs::remove_file(p),
        Err(e) => Err(e),
    });
    match result {
        Ok(()) => {
            send(out, id, Event::Done, Vec::new()).await;
        }
        Err(e) => {
            let (k, m) = classify("remove", path, e);
            send_error(out, id, k, m).await
        }
    }
}
