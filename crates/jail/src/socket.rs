//! Unix socket paths of any length.
//!
//! `sun_path` holds 107 bytes, and a sandbox's sockets live under its state
//! directory (`<data dir>/sandboxes-gvisor/<uuid>/host/setup.sock`), which an
//! operator's data directory can push past that. A longer path is reached
//! through a descriptor of its directory, `/proc/self/fd/N/<name>`, which is
//! short whatever the directory's own path.

use std::fs::File;
use std::io::{self, IoSliceMut};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};

/// The longest path `sun_path` takes (108 bytes with its NUL).
pub const MAX_SOCKET_PATH: usize = 107;

/// A path to a unix socket that fits `sun_path`; it holds the directory
/// open while in use, so keep it alive until the bind or connect is done.
#[derive(Debug)]
pub struct SocketPath {
    _dir: Option<File>,
    path: PathBuf,
}

impl SocketPath {
    /// `path` itself when it is short enough, else the same socket through
    /// its directory's descriptor.
    pub fn new(path: &Path) -> io::Result<Self> {
        if path.as_os_str().len() <= MAX_SOCKET_PATH {
            return Ok(Self {
                _dir: None,
                path: path.to_path_buf(),
            });
        }
        let (Some(parent), Some(name)) = (path.parent(), path.file_name()) else {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{} is not a socket path", path.display()),
            ));
        };
        let dir = File::open(parent)?;
        let path = PathBuf::from(format!("/proc/self/fd/{}", dir.as_raw_fd())).join(name);
        if path.as_os_str().len() > MAX_SOCKET_PATH {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("the socket name {name:?} is too long"),
            ));
        }
        Ok(Self {
            _dir: Some(dir),
            path,
        })
    }

    /// The path to bind or connect to.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// Binds a listening unix socket at `path`, however long.
pub fn bind(path: &Path) -> io::Result<UnixListener> {
    let p = SocketPath::new(path)?;
    UnixListener::bind(p.path())
}

/// Sends all of `msg` on `sock`, with `fds` passed alongside its first
/// bytes (`SCM_RIGHTS`); `MSG_NOSIGNAL`, so a peer that is gone is an
/// `EPIPE` error, not a signal.
pub(crate) fn send_with_fds(sock: &UnixStream, msg: &[u8], fds: &[RawFd]) -> io::Result<()> {
    use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};
    use std::io::Write;
    let sent = sendmsg::<()>(
        sock.as_raw_fd(),
        &[std::io::IoSlice::new(msg)],
        &[ControlMessage::ScmRights(fds)],
        MsgFlags::MSG_NOSIGNAL,
        None,
    )?;
    let mut rest = sock;
    rest.write_all(&msg[sent..])
}

/// Receives into `buf` what one `recvmsg` gives, with the descriptors
/// passed alongside (`SCM_RIGHTS`, at most 8, close-on-exec): the bytes
/// read (0 at the end of the stream) and the descriptors, owned.
pub(crate) fn recv_with_fds(
    sock: &UnixStream,
    buf: &mut [u8],
) -> io::Result<(usize, Vec<OwnedFd>)> {
    use nix::sys::socket::{recvmsg, ControlMessageOwned, MsgFlags};
    let mut space = nix::cmsg_space!([RawFd; 8]);
    let mut iov = [IoSliceMut::new(buf)];
    let msg = recvmsg::<()>(
        sock.as_raw_fd(),
        &mut iov,
        Some(&mut space),
        MsgFlags::MSG_CMSG_CLOEXEC,
    )?;
    let mut raw = Vec::new();
    for c in msg.cmsgs()? {
        if let ControlMessageOwned::ScmRights(r) = c {
            raw.extend(r);
        }
    }
    // SAFETY: each descriptor was just received in SCM_RIGHTS and is owned
    // by nothing else in this process.
    let fds = raw
        .into_iter()
        .map(|fd| unsafe { OwnedFd::from_raw_fd(fd) })
        .collect();
    Ok((msg.bytes, fds))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_socket_deeper_than_sun_path_binds_and_connects() {
        let tmp = tempfile::tempdir().unwrap();
        let deep = tmp.path().join("d".repeat(60)).join("e".repeat(60));
        std::fs::create_dir_all(&deep).unwrap();
        let path = deep.join("agent.sock");
        assert!(path.as_os_str().len() > MAX_SOCKET_PATH);
        // What the plain call says, and what this module does instead.
        assert!(UnixListener::bind(&path).is_err());
        let listener = bind(&path).unwrap();
        assert!(path.exists(), "the socket lives at its real path");
        let sp = SocketPath::new(&path).unwrap();
        let _client = std::os::unix::net::UnixStream::connect(sp.path()).unwrap();
        let (_server, _) = listener.accept().unwrap();
        // A short path is used as it is.
        let short = tmp.path().join("s.sock");
        assert_eq!(SocketPath::new(&short).unwrap().path(), short);
    }
}
