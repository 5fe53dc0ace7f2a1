//! Many byte streams over one byte channel (a microVM's virtio-serial port).
//!
//! The microVM backend has a single channel between the host and the guest
//! agent, but the protocol opens many connections (one shared, one per exec
//! or code run). The multiplexer carries each as a *stream* in small frames:
//!
//! ```text
//! +--------------+----------+-----------+-----------------+
//! | stream: u32  | kind: u8 | len: u32  | payload (len)   |
//! +--------------+----------+-----------+-----------------+
//! ```
//!
//! (big-endian). Kinds: `OPEN` (a new stream), `DATA`, `EOF` (the sender
//! writes no more; the other direction stays open), `CREDIT` (payload: a
//! `u32` of bytes the receiver delivered), `RESET` (the stream is gone) and
//! `HELLO`. Either side may open streams; the host uses odd ids, the guest
//! even ids.
//!
//! Each side starts by sending `HELLO`; a side that receives one drops
//! every stream it still has (a previous host's, which may have gone and
//! come back before the guest noticed), so both start from nothing. The
//! guest speaks first: the host sends nothing before the guest's `HELLO`
//! ([`wait_hello`]), so nothing the host sends reaches a port the guest has
//! not opened yet (the guest's write succeeds only once the port is up at
//! both ends).
//!
//! Flow control: a side sends at most [`WINDOW`] bytes of a stream that the
//! other side has not acknowledged with `CREDIT`, and acknowledges only what
//! its local end has taken. So a slow reader of one stream holds up only
//! that stream, and neither side buffers more than [`WINDOW`] bytes per
//! stream, whatever the other does (a side that overruns the window has
//! its stream reset).
//!
//! Each stream reaches its user as one end of a [`tokio::io::DuplexStream`].
//! When the channel ends (the host went away), every stream ends with it.

use std::collections::HashMap;
use std::io;
use std::sync::atomic::{AtomicU32, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, DuplexStream};
use tokio::sync::{mpsc, Semaphore};

/// Bytes of one stream in flight, not yet acknowledged, at most.
pub const WINDOW: u32 = 256 << 10;
/// Payload of one `DATA` frame, at most.
pub const MAX_CHUNK: u32 = 32 << 10;

const OPEN: u8 = 1;
const DATA: u8 = 2;
const EOF: u8 = 3;
const CREDIT: u8 = 4;
const RESET: u8 = 5;
const HELLO: u8 = 6;

/// Which end of the channel this is (they number their streams apart).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// The host: odd stream ids.
    Host,
    /// The guest: even stream ids.
    Guest,
}

/// Errors of the multiplexer.
#[derive(Debug, thiserror::Error)]
pub enum MuxError {
    /// The channel failed.
    #[error("The multiplexed channel failed.")]
    Io(#[from] io::Error),
    /// The other side sent a frame this side cannot read.
    #[error("The other side of the multiplexed channel sent a bad frame: {0}.")]
    BadFrame(String),
    /// The channel is closed.
    #[error("The multiplexed channel is closed.")]
    Closed,
}

/// What both ends of a stream's pumps and the reader share.
#[derive(Debug)]
struct StreamEntry {
    /// Payloads for the local end (`None` after `EOF`).
    inbound: Option<mpsc::UnboundedSender<Vec<u8>>>,
    /// Bytes received and not yet acknowledged (checked against the window).
    unacked: Arc<AtomicU32>,
    /// Bytes this side may still send.
    credit: Arc<Semaphore>,
    tasks: Vec<tokio::task::AbortHandle>,
}

#[derive(Debug)]
struct Inner {
    streams: Mutex<HashMap<u32, StreamEntry>>,
    out: mpsc::Sender<Vec<u8>>,
    next_id: AtomicU32,
}

/// Opens streams on a running multiplexer. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Opener {
    inner: Arc<Inner>,
}

impl Opener {
    /// Opens a new stream; the other side receives it as an incoming one.
    pub async fn open(&self) -> Result<DuplexStream, MuxError> {
        let id = self.inner.next_id.fetch_add(2, Ordering::Relaxed);
        let local = register(&self.inner, id);
        self.inner
            .out
            .send(encode(id, OPEN, &[]))
            .await
            .map_err(|_| MuxError::Closed)?;
        Ok(local)
    }
}

fn encode(id: u32, kind: u8, payload: &[u8]) -> Vec<u8> {
    let mut f = Vec::with_capacity(9 + payload.len());
    f.extend_from_slice(&id.to_be_bytes());
    f.push(kind);
    // Payloads are at most MAX_CHUNK (or 4 bytes of credit).
    f.extend_from_slice(&u32::try_from(payload.len()).unwrap_or(0).to_be_bytes());
    f.extend_from_slice(payload);
    f
}

/// Creates the stream `id`: its entry, its two pumps, and the local end.
fn register(inner: &Arc<Inner>, id: u32) -> DuplexStream {
    let window = usize::try_from(WINDOW).unwrap_or(usize::MAX);
    let (local, remote) = tokio::io::duplex(window);
    let (mut rd, mut wr) = tokio::io::split(remote);
    let (tx, mut rx) = mpsc::unbounded_channel::<Vec<u8>>();
    let credit = Arc::new(Semaphore::new(window));
    let unacked = Arc::new(AtomicU32::new(0));
    let halves = Arc::new(AtomicU8::new(2));

    // Local end -> channel, within the credit the other side gave.
    let out = inner.out.clone();
    let send_credit = credit.clone();
    let weak = Arc::downgrade(inner);
    let halves_out = halves.clone();
    let outbound = tokio::spawn(async move {
        let mut buf = vec![0u8; usize::try_from(MAX_CHUNK).unwrap_or(32 << 10)];
        loop {
            let n = match rd.read(&mut buf).await {
                Ok(0) => {
                    let _ = out.send(encode(id, EOF, &[])).await;
                    break;
                }
                Ok(n) => n,
                Err(_) => {
                    let _ = out.send(encode(id, RESET, &[])).await;
                    break;
                }
            };
            let Ok(permits) = send_credit
                .acquire_many(u32::try_from(n).unwrap_or(MAX_CHUNK))
                .await
            else {
                break;
            };
            permits.forget();
            if out.send(encode(id, DATA, &buf[..n])).await.is_err() {
                break;
            }
        }
        finish(&weak, id, &halves_out);
    });

    // Channel -> local end, acknowledging what the local end took.
    let out = inner.out.clone();
    let weak = Arc::downgrade(inner);
    let halves_in = halves.clone();
    let acked = unacked.clone();
    let inbound = tokio::spawn(async move {
        while let Some(data) = rx.recv().await {
            if wr.write_all(&data).await.is_err() {
                let _ = out.send(encode(id, RESET, &[])).await;
                break;
            }
            let n = u32::try_from(data.len()).unwrap_or(0);
            acked.fetch_sub(n, Ordering::AcqRel);
            if out
                .send(encode(id, CREDIT, &n.to_be_bytes()))
                .await
                .is_err()
            {
                break;
            }
        }
        let _ = wr.shutdown().await;
        finish(&weak, id, &halves_in);
    });

    inner.streams.lock().expect("mux lock").insert(
        id,
        StreamEntry {
            inbound: Some(tx),
            unacked,
            credit,
            tasks: vec![outbound.abort_handle(), inbound.abort_handle()],
        },
    );
    local
}

/// One pump of stream `id` finished; the last one removes the entry.
fn finish(inner: &std::sync::Weak<Inner>, id: u32, halves: &AtomicU8) {
    if halves.fetch_sub(1, Ordering::AcqRel) == 1 {
        if let Some(inner) = inner.upgrade() {
            inner.streams.lock().expect("mux lock").remove(&id);
        }
    }
}

/// Runs a multiplexer over a channel split into `reader` and `writer`.
///
/// Returns an [`Opener`] for streams this side opens and the future that
/// runs the channel: it resolves when the channel ends (end of file or an
/// error), after ending every stream. Streams the other side opens are sent
/// to `incoming`.
pub fn run<R, W>(
    side: Side,
    reader: R,
    writer: W,
    incoming: mpsc::Sender<DuplexStream>,
) -> (
    Opener,
    impl std::future::Future<Output = Result<(), MuxError>> + Send,
)
where
    R: AsyncRead + Unpin + Send + 'static,
    W: AsyncWrite + Unpin + Send + 'static,
{
    let (out, out_rx) = mpsc::channel::<Vec<u8>>(64);
    let inner = Arc::new(Inner {
        streams: Mutex::new(HashMap::new()),
        out,
        next_id: AtomicU32::new(match side {
            Side::Host => 1,
            Side::Guest => 2,
        }),
    });
    let opener = Opener {
        inner: inner.clone(),
    };
    // First in the queue, before any stream this side opens: the channel
    // was just made, so there is room.
    let _ = inner.out.try_send(encode(0, HELLO, &[]));
    let fut = async move {
        let write = tokio::spawn(write_loop(writer, out_rx));
        let result = read_loop(&inner, reader, &incoming).await;
        // End every stream: their local ends see end of file or a broken pipe.
        let entries: Vec<StreamEntry> = inner
            .streams
            .lock()
            .expect("mux lock")
            .drain()
            .map(|(_, e)| e)
            .collect();
        for e in entries {
            for t in e.tasks {
                t.abort();
            }
        }
        write.abort();
        result
    };
    (opener, fut)
}

/// Waits for the other side's `HELLO` on a new channel, before [`run`]
/// (which then must not see it again). Anything else first is an error.
pub async fn wait_hello<R: AsyncRead + Unpin>(reader: &mut R) -> Result<(), MuxError> {
    let mut head = [0u8; 9];
    reader.read_exact(&mut head).await?;
    if head != encode(0, HELLO, &[])[..] {
        return Err(MuxError::BadFrame(format!(
            "{head:?} where a HELLO was expected"
        )));
    }
    Ok(())
}

async fn write_loop<W: AsyncWrite + Unpin>(mut writer: W, mut rx: mpsc::Receiver<Vec<u8>>) {
    while let Some(frame) = rx.recv().await {
        if writer.write_all(&frame).await.is_err() {
            return;
        }
        // Batch what is already queued before flushing.
        while let Ok(more) = rx.try_recv() {
            if writer.write_all(&more).await.is_err() {
                return;
            }
        }
        if writer.flush().await.is_err() {
            return;
        }
    }
}

async fn read_loop<R: AsyncRead + Unpin>(
    inner: &Arc<Inner>,
    mut reader: R,
    incoming: &mpsc::Sender<DuplexStream>,
) -> Result<(), MuxError> {
    let mut head = [0u8; 9];
    loop {
        match reader.read_exact(&mut head).await {
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e.into()),
        }
        let id = u32::from_be_bytes([head[0], head[1], head[2], head[3]]);
        let kind = head[4];
        let len = u32::from_be_bytes([head[5], head[6], head[7], head[8]]);
        if len > MAX_CHUNK {
            return Err(MuxError::BadFrame(format!(
                "a frame of {len} bytes (at most {MAX_CHUNK})"
            )));
        }
        let mut payload = vec![0u8; usize::try_from(len).unwrap_or(0)];
        reader.read_exact(&mut payload).await?;
        match kind {
            OPEN => {
                let local = register(inner, id);
                if incoming.send(local).await.is_err() {
                    tracing::debug!("mux: an incoming stream was refused (nobody accepts)");
                }
            }
            DATA => {
                let overrun = {
                    let mut streams = inner.streams.lock().expect("mux lock");
                    let Some(entry) = streams.get_mut(&id) else {
                        continue;
                    };
                    let pending = entry.unacked.fetch_add(len, Ordering::AcqRel) + len;
                    let delivered = pending <= WINDOW
                        && entry
                            .inbound
                            .as_ref()
                            .is_some_and(|tx| tx.send(payload).is_ok());
                    if delivered {
                        None
                    } else {
                        streams.remove(&id)
                    }
                };
                if let Some(e) = overrun {
                    tracing::debug!("mux: stream {id} overran its window or is closed; reset");
                    for t in e.tasks {
                        t.abort();
                    }
                    let _ = inner.out.send(encode(id, RESET, &[])).await;
                }
            }
            EOF => {
                if let Some(entry) = inner.streams.lock().expect("mux lock").get_mut(&id) {
                    entry.inbound = None;
                }
            }
            CREDIT => {
                let n = payload
                    .get(..4)
                    .map(|b| u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
                    .ok_or_else(|| MuxError::BadFrame("a credit without its count".into()))?;
                if let Some(entry) = inner.streams.lock().expect("mux lock").get(&id) {
                    entry
                        .credit
                        .add_permits(usize::try_from(n).unwrap_or(0).min(Semaphore::MAX_PERMITS));
                }
            }
            RESET => {
                if let Some(e) = inner.streams.lock().expect("mux lock").remove(&id) {
                    for t in e.tasks {
                        t.abort();
                    }
                }
            }
            HELLO => {
                let old: Vec<StreamEntry> = inner
                    .streams
                    .lock()
                    .expect("mux lock")
                    .drain()
                    .map(|(_, e)| e)
                    .collect();
                if !old.is_empty() {
                    tracing::info!(
                        "mux: a new host connected; {} old streams dropped",
                        old.len()
                    );
                }
                for e in old {
                    for t in e.tasks {
                        t.abort();
                    }
                }
            }
            other => return Err(MuxError::BadFrame(format!("unknown frame kind {other}"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two multiplexers joined by an in-memory channel, started as the
    /// microVM's are: the host waits for the guest's HELLO.
    async fn pair() -> (
        Opener,
        mpsc::Receiver<DuplexStream>,
        (Opener, mpsc::Receiver<DuplexStream>),
    ) {
        let (a, b) = tokio::io::duplex(64 << 10);
        let (mut ar, aw) = tokio::io::split(a);
        let (br, bw) = tokio::io::split(b);
        let (host_in, host_rx) = mpsc::channel(8);
        let (guest_in, guest_rx) = mpsc::channel(8);
        let (guest, gf) = run(Side::Guest, br, bw, guest_in);
        tokio::spawn(gf);
        wait_hello(&mut ar).await.unwrap();
        let (host, hf) = run(Side::Host, ar, aw, host_in);
        tokio::spawn(hf);
        (host, guest_rx, (guest, host_rx))
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn streams_carry_bytes_both_ways_and_end_separately() {
        let (host, mut incoming, _guest) = pair().await;
        let mut a = host.open().await.unwrap();
        let mut b = host.open().await.unwrap();
        let mut ga = incoming.recv().await.unwrap();
        let mut gb = incoming.recv().await.unwrap();
        a.write_all(b"hello a").await.unwrap();
        b.write_all(b"hello b").await.unwrap();
        let mut buf = [0u8; 7];
        gb.read_exact(&mut buf).await.unwrap();
        assert_eq!(&buf, b"hello b");
        ga.read_exact(&mut buf).await.unwrap();
        assert_eq!(&buf, b"hello a");
        // A large transfer crosses many windows.
        let big: Vec<u8> = (0..3_000_000u32)
            .map(|i| u8::try_from(i % 251).unwrap())
            .collect();
        let sent = big.clone();
        let writer = tokio::spawn(async move {
            ga.write_all(&sent).await.unwrap();
            ga.shutdown().await.unwrap();
            ga
        });
        let mut got = Vec::new();
        a.read_to_end(&mut got).await.unwrap();
        assert_eq!(got.len(), big.len());
        assert!(got == big);
        let _ga = writer.await.unwrap();
        // The other stream still works after the first ended one way.
        gb.write_all(b"still").await.unwrap();
        let mut buf = [0u8; 5];
        b.read_exact(&mut buf).await.unwrap();
        assert_eq!(&buf, b"still");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_stream_nobody_reads_does_not_hold_up_another() {
        let (host, mut incoming, _guest) = pair().await;
        let mut slow = host.open().await.unwrap();
        let mut fast = host.open().await.unwrap();
        let _slow_guest = incoming.recv().await.unwrap();
        let mut fast_guest = incoming.recv().await.unwrap();
        // Fill the slow stream far past its window: the writer blocks.
        let stuck = tokio::spawn(async move {
            let junk = vec![0u8; 4 << 20];
            let _ = slow.write_all(&junk).await;
        });
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        assert!(
            !stuck.is_finished(),
            "the slow stream took more than its window"
        );
        fast.write_all(b"ping").await.unwrap();
        let mut buf = [0u8; 4];
        tokio::time::timeout(
            std::time::Duration::from_secs(5),
            fast_guest.read_exact(&mut buf),
        )
        .await
        .expect("the fast stream was held up")
        .unwrap();
        assert_eq!(&buf, b"ping");
        stuck.abort();
    }
}
