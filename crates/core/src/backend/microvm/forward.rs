//! The host end of a guest's channel: a thread that connects to the VMM's
//! unix socket (the host end of the guest's virtio-serial port), runs the
//! multiplexer over it, accepts on `<dir>/agent.sock` and carries every
//! connection as a stream of its own; streams the guest opens (egress) are
//! carried to `<dir>/egress/sock`, the host proxy's listener.
//!
//! The thread belongs to the host process: when that process dies, the VMM
//! sees its socket close and the guest's streams end; a restarted process
//! runs a new forwarder ([`Forwarder::start`] without a spec) and the agent
//! serves the new streams. At most one forwarder per sandbox runs in a
//! process (the VMM accepts one connection at a time).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use runcell_protocol::mux::{self, Side};
use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{mpsc, watch};

use super::MicrovmError;

/// How long a re-attaching host waits for a running guest's `HELLO`.
const HELLO_PATIENCE: Duration = Duration::from_secs(2);

/// A running forwarder; stops when told to or when the guest's channel ends.
#[derive(Debug)]
pub struct Forwarder {
    stop: watch::Sender<bool>,
    done: watch::Receiver<bool>,
}

impl Forwarder {
    /// Stops it (the guest's streams end; the guest keeps running).
    pub fn stop(&self) {
        self.stop.send_replace(true);
    }

    /// Whether it still runs.
    pub fn is_running(&self) -> bool {
        !*self.done.borrow()
    }
}

/// The forwarders of this process, by sandbox directory.
fn registry() -> &'static Mutex<HashMap<PathBuf, Arc<Forwarder>>> {
    static R: OnceLock<Mutex<HashMap<PathBuf, Arc<Forwarder>>>> = OnceLock::new();
    R.get_or_init(Mutex::default)
}

/// Stops the forwarder of `dir`, if this process runs one.
pub fn stop(dir: &Path) {
    if let Some(f) = registry().lock().expect("forwarders").remove(dir) {
        f.stop();
    }
}

/// What a new forwarder needs.
#[derive(Debug)]
pub struct ForwardConfig {
    /// The sandbox directory (holds `agent.sock`, `egress/sock`).
    pub dir: PathBuf,
    /// The VMM's socket for the guest's port.
    pub channel: PathBuf,
    /// The spec to send on the first stream (a new guest); `None` when
    /// re-attaching to a running one.
    pub spec: Option<Vec<u8>>,
    /// How long to wait for the guest to take the spec and report ready.
    pub timeout: Duration,
    /// The guest's control socket, to tell a guest that was restored from
    /// a memory image (and so missed its previous host's going) to start
    /// its channel anew once connected: its `HELLO` then comes at once,
    /// instead of after [`HELLO_PATIENCE`].
    pub kick: Option<PathBuf>,
}

/// Starts the forwarder of a sandbox (or returns the one that runs) and,
/// for a new guest, waits until its agent is ready.
pub fn start(cfg: ForwardConfig) -> Result<Arc<Forwarder>, MicrovmError> {
    let mut reg = registry().lock().expect("forwarders");
    if let Some(f) = reg.get(&cfg.dir) {
        if f.is_running() && cfg.spec.is_none() {
            return Ok(f.clone());
        }
        f.stop();
        reg.remove(&cfg.dir);
    }
    drop(reg);
    let (stop_tx, stop_rx) = watch::channel(false);
    let (done_tx, done_rx) = watch::channel(false);
    let (ready_tx, ready_rx) = std::sync::mpsc::channel::<Result<(), MicrovmError>>();
    let dir = cfg.dir.clone();
    let timeout = cfg.timeout;
    std::thread::Builder::new()
        .name("microvm-forward".into())
        .spawn(move || {
            let rt = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => {
                    let _ = ready_tx.send(Err(MicrovmError::Channel(e)));
                    return;
                }
            };
            rt.block_on(run(cfg, stop_rx, ready_tx));
            done_tx.send_replace(true);
        })
        .map_err(MicrovmError::Channel)?;
    let result = ready_rx
        .recv_timeout(timeout + Duration::from_secs(1))
        .unwrap_or(Err(MicrovmError::Timeout(timeout, String::new())));
    let fwd = Arc::new(Forwarder {
        stop: stop_tx,
        done: done_rx,
    });
    if let Err(e) = result {
        fwd.stop();
        return Err(e);
    }
    registry()
        .lock()
        .expect("forwarders")
        .insert(dir, fwd.clone());
    Ok(fwd)
}

async fn run(
    cfg: ForwardConfig,
    mut stop: watch::Receiver<bool>,
    ready: std::sync::mpsc::Sender<Result<(), MicrovmError>>,
) {
    let deadline = tokio::time::Instant::now() + cfg.timeout;
    let setup = async {
        let chan = connect(&cfg.channel, deadline).await?;
        if let Some(control) = &cfg.kick {
            let id = cfg
                .dir
                .file_name()
                .map(|n| n.to_string_lossy().into_owned());
            kick(control, id.as_deref().unwrap_or_default()).await;
        }
        let (mut r, w) = chan.into_split();
        // The guest speaks first (its port is then open at both ends). A
        // guest that is already serving (re-attach) and did not notice the
        // previous host go says nothing: go ahead after a while, and our
        // HELLO resets its streams.
        let patience = if cfg.spec.is_some() {
            cfg.timeout
        } else {
            HELLO_PATIENCE
        };
        let hello = async {
            if cfg.kick.is_some() {
                skip_to_hello(&mut r).await
            } else {
                mux::wait_hello(&mut r).await
            }
        };
        match tokio::time::timeout(patience, hello).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(MicrovmError::Mux(e)),
            Err(_) if cfg.spec.is_none() => {}
            Err(_) => return Err(MicrovmError::Timeout(cfg.timeout, String::new())),
        }
        let (in_tx, in_rx) = mpsc::channel::<DuplexStream>(16);
        let (opener, channel) = mux::run(Side::Host, r, w, in_tx);
        let channel = tokio::spawn(channel);
        let setup_stream = match &cfg.spec {
            Some(spec) => Some(
                tokio::time::timeout_at(deadline, send_spec(&opener, spec))
                    .await
                    .map_err(|_| MicrovmError::Timeout(cfg.timeout, String::new()))??,
            ),
            None => None,
        };
        let sock = cfg.dir.join("agent.sock");
        let _ = std::fs::remove_file(&sock);
        let listener = {
            let l = runcell_jail::socket::bind(&sock).map_err(MicrovmError::Channel)?;
            l.set_nonblocking(true).map_err(MicrovmError::Channel)?;
            UnixListener::from_std(l).map_err(MicrovmError::Channel)?
        };
        Ok::<_, MicrovmError>((opener, channel, in_rx, setup_stream, listener))
    };
    let (opener, mut channel, mut in_rx, _setup_stream, listener) = match setup.await {
        Ok(v) => v,
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    let _ = ready.send(Ok(()));
    let egress = cfg.dir.join("egress/sock");
    loop {
        tokio::select! {
            _ = stop.changed() => break,
            _ = &mut channel => {
                tracing::debug!(dir = %cfg.dir.display(), "guest channel ended");
                break;
            }
            accepted = listener.accept() => {
                let Ok((mut conn, _)) = accepted else { continue };
                let opener = opener.clone();
                tokio::spawn(async move {
                    match opener.open().await {
                        Ok(mut stream) => {
                            let _ = tokio::io::copy_bidirectional(&mut conn, &mut stream).await;
                        }
                        Err(e) => tracing::debug!("microvm: {e}"),
                    }
                });
            }
            Some(mut stream) = in_rx.recv() => {
                let egress = egress.clone();
                tokio::spawn(async move {
                    let short = runcell_jail::socket::SocketPath::new(&egress);
                    let conn = match &short {
                        Ok(p) => UnixStream::connect(p.path()).await,
                        Err(e) => Err(std::io::Error::new(e.kind(), e.to_string())),
                    };
                    match conn {
                        Ok(mut conn) => {
                            let _ = tokio::io::copy_bidirectional(&mut stream, &mut conn).await;
                        }
                        Err(e) => tracing::debug!("microvm egress: {e}"),
                    }
                });
            }
        }
    }
    channel.abort();
}

/// Reads until the guest's `HELLO` (a 9-byte frame: stream 0, kind 6, no
/// payload), skipping what a restored guest still sent its previous host
/// (frames, or the end of one) before it started anew. Byte by byte, so
/// nothing after the `HELLO` is consumed.
async fn skip_to_hello<R: tokio::io::AsyncRead + Unpin>(
    reader: &mut R,
) -> Result<(), mux::MuxError> {
    const HELLO: [u8; 9] = [0, 0, 0, 0, 6, 0, 0, 0, 0];
    let mut window = [0u8; 9];
    let mut seen = 0usize;
    loop {
        let b = reader.read_u8().await?;
        window.rotate_left(1);
        window[8] = b;
        seen = seen.saturating_add(1);
        if seen >= 9 && window == HELLO {
            return Ok(());
        }
    }
}

/// Asks the guest over its control port (`R`) to start its channel anew,
/// sets its clock (`T`) and tells it its sandbox id (`I`: a fork's guest
/// was saved as its parent); quietly does nothing where it cannot.
async fn kick(control: &Path, id: &str) {
    let Ok(short) = runcell_jail::socket::SocketPath::new(control) else {
        return;
    };
    let attempt = async {
        let mut s = UnixStream::connect(short.path()).await?;
        s.write_all(b"R").await?;
        let mut answer = [0u8; 1];
        s.read_exact(&mut answer).await?;
        // Its clock stood still since the image was saved.
        s.write_all(super::clock_request().as_bytes()).await?;
        if tokio::time::timeout(Duration::from_secs(1), s.read_exact(&mut answer))
            .await
            .is_err()
        {
            tracing::debug!("microvm: the restored guest's clock was not set");
        }
        s.write_all(format!("I{id}\n").as_bytes()).await?;
        if tokio::time::timeout(Duration::from_secs(1), s.read_exact(&mut answer))
            .await
            .is_err()
        {
            tracing::debug!("microvm: the restored guest did not take its sandbox id");
        }
        Ok::<_, std::io::Error>(())
    };
    if let Err(e) = tokio::time::timeout(HELLO_PATIENCE, attempt)
        .await
        .unwrap_or_else(|_| Err(std::io::ErrorKind::TimedOut.into()))
    {
        tracing::debug!("microvm: the guest's channel was not restarted: {e}");
    }
}

/// Connects to the VMM's socket, which appears as the VMM starts.
async fn connect(path: &Path, deadline: tokio::time::Instant) -> Result<UnixStream, MicrovmError> {
    loop {
        let short = runcell_jail::socket::SocketPath::new(path).map_err(MicrovmError::Channel)?;
        match UnixStream::connect(short.path()).await {
            Ok(s) => return Ok(s),
            Err(e) if tokio::time::Instant::now() >= deadline => {
                return Err(MicrovmError::Channel(e))
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
        }
    }
}

/// Sends the spec on a new stream and waits for `R` (ready) or `E` and the
/// guest's error sentence. The stream stays open: its end tells a guest
/// tied to this process that the process is gone.
async fn send_spec(opener: &mux::Opener, spec: &[u8]) -> Result<DuplexStream, MicrovmError> {
    let mut s = opener.open().await.map_err(MicrovmError::Mux)?;
    let len = u32::try_from(spec.len()).unwrap_or(u32::MAX);
    s.write_all(&len.to_be_bytes())
        .await
        .map_err(MicrovmError::Channel)?;
    s.write_all(spec).await.map_err(MicrovmError::Channel)?;
    let mut status = [0u8; 1];
    s.read_exact(&mut status)
        .await
        .map_err(|_| MicrovmError::AgentGone(String::new()))?;
    match status[0] {
        b'R' => Ok(s),
        _ => {
            let mut len = [0u8; 4];
            let _ = s.read_exact(&mut len).await;
            let len = usize::try_from(u32::from_be_bytes(len))
                .unwrap_or(0)
                .min(64 << 10);
            let mut msg = vec![0u8; len];
            let _ = s.read_exact(&mut msg).await;
            Err(MicrovmError::Guest(
                String::from_utf8_lossy(&msg).into_owned(),
            ))
        }
    }
}
