//! The host's connection to a sandbox agent: many concurrent requests over
//! one unix socket, each answered by a stream of events.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use runcell_protocol::{
    read_frame, write_frame, ClientMessage, CodecError, ErrorKind, Event, Frame, Request,
    ServerMessage, PROTOCOL_VERSION,
};
use tokio::io::{AsyncWriteExt as _, BufReader};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::UnixStream;
use tokio::sync::mpsc;

/// The agent's side of a connection, buffered: a frame's length, header
/// and body come in one read when they are there, not one read each.
type Reader = BufReader<OwnedReadHalf>;

/// Errors talking to an agent.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// Could not connect.
    #[error("Could not connect to the sandbox agent.")]
    Connect(#[source] std::io::Error),
    /// The framing failed.
    #[error(transparent)]
    Codec(#[from] CodecError),
    /// The agent speaks another protocol version.
    #[error("The sandbox agent speaks protocol version {agent}, this runcell speaks {ours}.")]
    Version {
        /// The agent's version.
        agent: u32,
        /// Ours.
        ours: u32,
    },
    /// The connection closed before the answer was complete.
    #[error("The sandbox agent closed the connection (the sandbox may have been stopped).")]
    Closed,
    /// The agent answered with an error.
    #[error("{message}")]
    Agent {
        /// The kind of failure.
        kind: ErrorKind,
        /// The agent's message.
        message: String,
    },
    /// The agent answered with an unexpected event.
    #[error("The sandbox agent sent an unexpected reply.")]
    Unexpected(Box<Event>),
}

impl ClientError {
    /// Whether the connection itself failed (the agent could not be
    /// reached, or went away before it answered), as opposed to an answer
    /// the agent gave.
    pub fn is_connection_lost(&self) -> bool {
        matches!(
            self,
            ClientError::Connect(_) | ClientError::Closed | ClientError::Codec(CodecError::Io(_))
        )
    }
}

/// The requests waiting for their answers, by id: the connection each went
/// on (its generation) and where its events go.
type Pending = Arc<Mutex<HashMap<u64, (u64, mpsc::Sender<(Event, Vec<u8>)>)>>>;

/// A connection to one agent.
///
/// The connection heals: one the agent closed (a gVisor checkpoint that
/// failed part-way, a frame it could not read) or one a request left with
/// half a frame on it (its caller went away while it was being sent) is
/// replaced before the next request goes out, and a request the closed
/// connection refused goes again on the new one. Nothing of it had reached
/// the agent, which acts on whole frames only.
#[derive(Debug)]
pub struct AgentClient {
    writer: tokio::sync::Mutex<OwnedWriteHalf>,
    /// Set while a frame is being written, cleared once it is whole: still
    /// set when no write is under way, the connection carries part of a
    /// frame and the agent would read what follows as its rest.
    torn: AtomicBool,
    /// The generation of the current connection (one more per replacement).
    generation: AtomicU64,
    pending: Pending,
    next_id: AtomicU64,
    reader: Mutex<tokio::task::JoinHandle<()>>,
    sandbox_id: String,
    path: PathBuf,
    /// Requests that use the sandbox (execs, code, cells, files) whose
    /// answer is still being read, on this connection or on connections of
    /// their own.
    work: Arc<AtomicUsize>,
}

/// The events answering one request.
#[derive(Debug)]
pub struct Replies {
    rx: mpsc::Receiver<(Event, Vec<u8>)>,
    /// The request id (to signal a running exec).
    pub id: u64,
    /// The connection of its own, for [`AgentClient::request_own`].
    own: Option<Box<AgentClient>>,
    _work: Option<WorkGuard>,
}

/// Counts one request of work in progress for as long as it lives.
#[derive(Debug)]
struct WorkGuard(Arc<AtomicUsize>);

impl WorkGuard {
    fn new(counter: &Arc<AtomicUsize>) -> Self {
        counter.fetch_add(1, Ordering::AcqRel);
        Self(counter.clone())
    }
}

impl Drop for WorkGuard {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Whether a request is the sandbox's user doing work (which keeps an idle
/// TTL from expiring) rather than the host managing it.
fn is_work(request: &Request) -> bool {
    !matches!(
        request,
        Request::Stats
            | Request::SetDeadline { .. }
            | Request::SetEgress { .. }
            | Request::Shutdown
            | Request::Ping
            | Request::ContextList
    )
}

impl Replies {
    /// The next event, or `Closed` if the connection ended first.
    pub async fn next(&mut self) -> Result<(Event, Vec<u8>), ClientError> {
        self.rx.recv().await.ok_or(ClientError::Closed)
    }

    /// Sends SIGKILL to the exec this answers (its whole process tree)
    /// without waiting for the agent's reply, which may be queued behind
    /// output nobody reads. Only for [`AgentClient::request_own`] replies.
    pub async fn kill(&self) -> Result<(), ClientError> {
        let Some(conn) = &self.own else {
            return Err(ClientError::Closed);
        };
        let signal = Request::Signal {
            exec_id: self.id,
            signal: 9,
        };
        conn.request(signal, Vec::new()).await.map(drop)
    }
}

impl AgentClient {
    /// Connects and checks the agent's hello.
    pub async fn connect(path: &Path) -> Result<Self, ClientError> {
        let (rd, wr, sandbox_id) = open(path, None).await?;
        let pending: Pending = Arc::default();
        let reader = spawn_reader(rd, pending.clone(), 0);
        Ok(Self {
            writer: tokio::sync::Mutex::new(wr),
            torn: AtomicBool::new(false),
            generation: AtomicU64::new(0),
            pending,
            next_id: AtomicU64::new(1),
            reader: Mutex::new(reader),
            sandbox_id,
            path: path.to_path_buf(),
            work: Arc::default(),
        })
    }

    /// Connects without waiting for the agent's hello, for a sandbox made
    /// for one request that follows at once (`POST /v1/run`): requests go
    /// out at once and wait in the socket until the agent serves, instead of
    /// after a round trip to it. The hello is still read and checked first,
    /// by the connection's reader; a bad one ends the connection and every
    /// request on it. `sandbox_id` is the id the agent was started with.
    pub async fn connect_unchecked(path: &Path, sandbox_id: &str) -> Result<Self, ClientError> {
        let (rd, wr) = dial(path, &[])?.0.into_split();
        let pending: Pending = Arc::default();
        let p = pending.clone();
        let reader = tokio::spawn(async move {
            let mut rd = BufReader::new(rd);
            match read_hello(&mut rd).await {
                Ok(_) => read_replies(rd, p, 0).await,
                Err(e) => {
                    tracing::warn!("agent connection: {e}");
                    end_generation(&p, 0);
                }
            }
        });
        Ok(Self {
            writer: tokio::sync::Mutex::new(wr),
            torn: AtomicBool::new(false),
            generation: AtomicU64::new(0),
            pending,
            next_id: AtomicU64::new(1),
            reader: Mutex::new(reader),
            sandbox_id: sandbox_id.to_string(),
            path: path.to_path_buf(),
            work: Arc::default(),
        })
    }

    /// Connects again (the agent closed its connections, as a gVisor
    /// agent does for a checkpoint): requests from here on go over the new
    /// connection; those that waited on the old one have ended.
    pub async fn reconnect(&self) -> Result<(), ClientError> {
        let mut writer = self.writer.lock().await;
        self.replace(&mut writer).await
    }

    /// Replaces the connection whose writing half `writer` is (its lock
    /// held): the requests that waited on it end.
    async fn replace(&self, writer: &mut OwnedWriteHalf) -> Result<(), ClientError> {
        let (rd, wr, _) = open(&self.path, None).await?;
        let mut reader = self
            .reader
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        reader.abort();
        let old = self.generation.fetch_add(1, Ordering::AcqRel);
        end_generation(&self.pending, old);
        *writer = wr;
        *reader = spawn_reader(rd, self.pending.clone(), old + 1);
        self.torn.store(false, Ordering::Release);
        Ok(())
    }

    /// Whether the current connection can carry no more requests: the
    /// agent closed it (its replies ended) or a frame on it was cut off.
    fn broken(&self) -> bool {
        self.torn.load(Ordering::Acquire)
            || self
                .reader
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .is_finished()
    }

    /// Writes `frame` whole on `writer`, or marks the connection torn.
    async fn send(
        &self,
        writer: &mut OwnedWriteHalf,
        frame: &Frame<ClientMessage>,
    ) -> Result<(), CodecError> {
        self.torn.store(true, Ordering::Release);
        write_frame(writer, frame).await?;
        self.torn.store(false, Ordering::Release);
        Ok(())
    }

    /// Sends a request on a new connection of its own, which lives as long
    /// as the returned replies: a consumer that reads them slowly then holds
    /// back only this request's producer (through the socket, up to the
    /// process writing the output), never the other requests to the sandbox.
    pub async fn request_own(
        &self,
        request: Request,
        body: Vec<u8>,
    ) -> Result<Replies, ClientError> {
        // Counted as this sandbox's work, not the new connection's.
        let work = is_work(&request).then(|| WorkGuard::new(&self.work));
        // The request goes out with the connection, before the agent's
        // hello is read (it is still read and checked): this agent's hello
        // was checked when it was first reached, and a running agent does
        // not change its protocol, so waiting for it first only added a
        // round trip to the agent to every exec.
        const ID: u64 = 1;
        let frame = Frame::with_body(ClientMessage { id: ID, request }, body);
        let (rd, wr, sandbox_id) = open(&self.path, Some(&frame)).await?;
        let (tx, rx) = mpsc::channel(16);
        let pending: Pending = Arc::new(Mutex::new(HashMap::from([(ID, (0, tx))])));
        let reader = spawn_reader(rd, pending.clone(), 0);
        let conn = Box::new(Self {
            writer: tokio::sync::Mutex::new(wr),
            torn: AtomicBool::new(false),
            generation: AtomicU64::new(0),
            pending,
            next_id: AtomicU64::new(ID + 1),
            reader: Mutex::new(reader),
            sandbox_id,
            path: self.path.clone(),
            work: Arc::default(),
        });
        Ok(Replies {
            rx,
            id: ID,
            own: Some(conn),
            _work: work,
        })
    }

    /// The sandbox id the agent reported.
    pub fn sandbox_id(&self) -> &str {
        &self.sandbox_id
    }

    /// Requests of work in progress (execs, code runs, cells, file
    /// operations) whose answers are still being read.
    pub fn work_in_progress(&self) -> usize {
        self.work.load(Ordering::Acquire)
    }

    /// Sends a request and returns the stream of its events.
    pub async fn request(&self, request: Request, body: Vec<u8>) -> Result<Replies, ClientError> {
        let work = is_work(&request).then(|| WorkGuard::new(&self.work));
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = mpsc::channel(16);
        let frame = Frame::with_body(ClientMessage { id, request }, body);
        let mut writer = self.writer.lock().await;
        if self.broken() {
            self.replace(&mut writer).await?;
        }
        self.expect(id, tx.clone());
        let sent = match self.send(&mut writer, &frame).await {
            // The agent closed the connection: the request goes again on a
            // new one (nothing of it was acted on; see the type's doc).
            Err(CodecError::Io(e)) => {
                tracing::debug!(sandbox = %self.sandbox_id, "agent connection lost ({e}): connecting again");
                match self.replace(&mut writer).await {
                    Ok(()) => {
                        self.expect(id, tx);
                        self.send(&mut writer, &frame).await.map_err(Into::into)
                    }
                    Err(e) => Err(e),
                }
            }
            other => other.map_err(Into::into),
        };
        if let Err(e) = sent {
            self.pending
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .remove(&id);
            return Err(e);
        }
        Ok(Replies {
            rx,
            id,
            own: None,
            _work: work,
        })
    }

    /// Registers request `id`'s answers as expected on the current
    /// connection.
    fn expect(&self, id: u64, tx: mpsc::Sender<(Event, Vec<u8>)>) {
        let generation = self.generation.load(Ordering::Acquire);
        self.pending
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(id, (generation, tx));
    }

    /// Sends a request that has a single answer and returns it, turning an
    /// agent error into [`ClientError::Agent`].
    pub async fn call(
        &self,
        request: Request,
        body: Vec<u8>,
    ) -> Result<(Event, Vec<u8>), ClientError> {
        let mut replies = self.request(request, body).await?;
        match replies.next().await? {
            (Event::Error { kind, message }, _) => Err(ClientError::Agent { kind, message }),
            other => Ok(other),
        }
    }
}

/// The largest body of a first request [`open`] writes as the socket
/// connects (larger ones are written without the copy that takes).
const SMALL_FIRST_BODY: usize = 64 << 10;

/// Connects to the agent at `path`, sends `first` if given, and reads the
/// agent's hello: the connection's halves and the sandbox id it reported.
async fn open(
    path: &Path,
    first: Option<&Frame<ClientMessage>>,
) -> Result<(Reader, OwnedWriteHalf, String), ClientError> {
    // A request (its code or its input at most 64 KiB) is encoded in
    // memory (a `Vec` takes the write at once) and written as the socket
    // connects; a larger one is not copied, and goes out through the
    // runtime.
    let mut bytes = Vec::new();
    let (small, large) = match first {
        Some(f) if f.body.len() <= SMALL_FIRST_BODY => (Some(f), None),
        other => (None, other),
    };
    if let Some(frame) = small {
        write_frame(&mut bytes, frame).await?;
    }
    let (stream, sent) = dial(path, &bytes)?;
    let (rd, mut wr) = stream.into_split();
    if sent < bytes.len() {
        wr.write_all(&bytes[sent..])
            .await
            .map_err(CodecError::from)?;
    }
    if let Some(frame) = large {
        write_frame(&mut wr, frame).await?;
    }
    let mut rd = BufReader::new(rd);
    let sandbox_id = read_hello(&mut rd).await?;
    Ok((rd, wr, sandbox_id))
}

/// Connects to the agent's socket at `path` and writes what of `first` the
/// socket takes at once: the stream, and how many bytes of `first` went.
///
/// A unix socket's connect completes at once (or fails, `EAGAIN` when the
/// agent's backlog is full, as the runtime's own connect does), and bytes
/// written before the stream is handed to the runtime go out now: the
/// runtime treats a new socket as not yet writable until its reactor has
/// polled it, a turn that on a multi-threaded runtime was often a wake-up
/// of another thread (0.1-0.3 ms here) before the agent heard of the
/// request.
fn dial(path: &Path, first: &[u8]) -> Result<(UnixStream, usize), ClientError> {
    use std::io::Write as _;
    // However deep the sandbox's directory is (sun_path holds 107 bytes).
    let short = runcell_jail::socket::SocketPath::new(path).map_err(ClientError::Connect)?;
    let std_stream =
        connect_now(short.path()).map_err(|e| ClientError::Connect(std::io::Error::from(e)))?;
    drop(short);
    let mut sent = 0;
    while sent < first.len() {
        match (&std_stream).write(&first[sent..]) {
            Ok(0) => break,
            Ok(n) => sent += n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(CodecError::from(e).into()),
        }
    }
    let stream = UnixStream::from_std(std_stream).map_err(ClientError::Connect)?;
    Ok((stream, sent))
}

/// A non-blocking connect to the unix socket at `path`.
fn connect_now(path: &Path) -> Result<std::os::unix::net::UnixStream, nix::errno::Errno> {
    use nix::sys::socket::{connect, socket, AddressFamily, SockFlag, SockType, UnixAddr};
    use std::os::fd::AsRawFd as _;
    let fd = socket(
        AddressFamily::Unix,
        SockType::Stream,
        SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC,
        None,
    )?;
    connect(fd.as_raw_fd(), &UnixAddr::new(path)?)?;
    Ok(std::os::unix::net::UnixStream::from(fd))
}

/// Reads and checks the agent's hello, the first frame of every
/// connection: the sandbox id it reports.
async fn read_hello(rd: &mut Reader) -> Result<String, ClientError> {
    let hello: Frame<ServerMessage> = read_frame(rd).await?.ok_or(ClientError::Closed)?;
    match hello.header.event {
        Event::Hello {
            version,
            sandbox_id,
            ..
        } => {
            if version != PROTOCOL_VERSION {
                return Err(ClientError::Version {
                    agent: version,
                    ours: PROTOCOL_VERSION,
                });
            }
            Ok(sandbox_id)
        }
        other => Err(ClientError::Unexpected(Box::new(other))),
    }
}

/// Reads the agent's replies on `rd`, connection `generation`, and hands
/// them to their requests in `p`; when the connection ends, every request
/// still waiting on it ends too.
fn spawn_reader(rd: Reader, p: Pending, generation: u64) -> tokio::task::JoinHandle<()> {
    tokio::spawn(read_replies(rd, p, generation))
}

/// The loop of [`spawn_reader`].
async fn read_replies(mut rd: Reader, p: Pending, generation: u64) {
    loop {
        let frame: Frame<ServerMessage> = match read_frame(&mut rd).await {
            Ok(Some(f)) => f,
            Ok(None) => break,
            Err(e) => {
                tracing::warn!("agent connection: {e}");
                break;
            }
        };
        let ServerMessage { id, event } = frame.header;
        let last = event.is_final();
        let tx = {
            let mut map = p.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            if last {
                map.remove(&id).map(|(_, tx)| tx)
            } else {
                map.get(&id).map(|(_, tx)| tx.clone())
            }
        };
        if let Some(tx) = tx {
            // Awaiting here applies backpressure all the way to the
            // process, and stalls every request of this connection:
            // a request whose reader may be slow (exec output) gets
            // a connection of its own (`request_own`).
            let _ = tx.send((event, frame.body)).await;
        }
    }
    end_generation(&p, generation);
}

/// Ends the requests that wait on connection `generation` (or an older
/// one): those sent on a newer connection are not its.
fn end_generation(p: &Pending, generation: u64) {
    p.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .retain(|_, (g, _)| *g > generation);
}

impl Drop for AgentClient {
    fn drop(&mut self) {
        self.reader
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;
    use tokio::net::UnixListener;

    /// An agent's side of one connection: accepted on `listener` once the
    /// test lets it, greeting with protocol `version`.
    async fn agent_side(listener: &UnixListener, version: u32) -> (Reader, OwnedWriteHalf) {
        let (stream, _) = listener.accept().await.expect("accept");
        let (rd, mut wr) = stream.into_split();
        let hello = Frame::new(ServerMessage {
            id: 0,
            event: Event::Hello {
                version,
                agent_version: "test".into(),
                sandbox_id: "sb".into(),
            },
        });
        write_frame(&mut wr, &hello).await.expect("hello");
        (BufReader::new(rd), wr)
    }

    /// An agent's socket nobody has accepted on yet, a client connected to
    /// it unchecked, and a request that client sent at once.
    async fn asked_before_hello() -> (tempfile::TempDir, UnixListener, AgentClient, Replies) {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("agent.sock");
        let listener = UnixListener::bind(&path).expect("bind");
        let client = AgentClient::connect_unchecked(&path, "sb")
            .await
            .expect("connect");
        let replies = client
            .request(Request::Ping, Vec::new())
            .await
            .expect("sent");
        (dir, listener, client, replies)
    }

    #[tokio::test]
    async fn a_request_sent_before_the_agent_greets_is_answered_after_its_hello() {
        let (_dir, listener, client, mut replies) = asked_before_hello().await;
        let (mut rd, mut wr) = agent_side(&listener, PROTOCOL_VERSION).await;
        let asked: Frame<ClientMessage> = read_frame(&mut rd).await.expect("read").expect("frame");
        assert_eq!(asked.header.request, Request::Ping);
        let done = Frame::new(ServerMessage {
            id: asked.header.id,
            event: Event::Done,
        });
        write_frame(&mut wr, &done).await.expect("answer");
        let (event, _) = tokio::time::timeout(Duration::from_secs(5), replies.next())
            .await
            .expect("answered in time")
            .expect("answered");
        assert_eq!(event, Event::Done);
        assert_eq!(client.sandbox_id(), "sb");
    }

    #[tokio::test]
    async fn an_agent_of_another_protocol_ends_the_requests_sent_before_its_hello() {
        let (_dir, listener, _client, mut replies) = asked_before_hello().await;
        // The wrong hello; the connection is kept open, so only the check
        // can end the request.
        let _agent = agent_side(&listener, PROTOCOL_VERSION + 1).await;
        let ended = tokio::time::timeout(Duration::from_secs(5), replies.next())
            .await
            .expect("ended in time, not left waiting");
        assert!(matches!(ended, Err(ClientError::Closed)), "{ended:?}");
    }

    #[tokio::test]
    async fn a_first_request_larger_than_the_socket_holds_arrives_whole() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("agent.sock");
        let listener = UnixListener::bind(&path).expect("bind");
        // Several times what a unix socket buffers, written through the
        // runtime once the agent reads.
        let body = vec![7u8; 4 << 20];
        let frame = Frame::with_body(
            ClientMessage {
                id: 1,
                request: Request::Ping,
            },
            body.clone(),
        );
        let agent = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(50)).await;
            let (mut rd, wr) = agent_side(&listener, PROTOCOL_VERSION).await;
            let got: Frame<ClientMessage> =
                read_frame(&mut rd).await.expect("read").expect("frame");
            (got, wr)
        });
        let (_rd, _wr, id) =
            tokio::time::timeout(Duration::from_secs(10), open(&path, Some(&frame)))
                .await
                .expect("opened in time")
                .expect("opened");
        assert_eq!(id, "sb");
        let (got, _wr) = agent.await.expect("agent");
        assert_eq!(got.header.id, 1);
        assert_eq!(got.body, body);
    }

    /// Answers one request on a connection accepted on `listener`: the
    /// request it read.
    async fn answer_one(listener: &UnixListener) -> (Request, OwnedWriteHalf) {
        let (mut rd, mut wr) = agent_side(listener, PROTOCOL_VERSION).await;
        let asked: Frame<ClientMessage> = read_frame(&mut rd).await.expect("read").expect("frame");
        let done = Frame::new(ServerMessage {
            id: asked.header.id,
            event: Event::Done,
        });
        write_frame(&mut wr, &done).await.expect("answer");
        (asked.header.request, wr)
    }

    /// A request after the agent closed the connection, at once (its
    /// write may fail) or once the client saw the close (`settle`).
    async fn ask_after_the_agent_closed(settle: Duration) {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("agent.sock");
        let listener = UnixListener::bind(&path).expect("bind");
        let accept = tokio::spawn(async move {
            // The first connection, closed at once (as a gVisor agent
            // does for a checkpoint, or one that read a bad frame).
            drop(agent_side(&listener, PROTOCOL_VERSION).await);
            answer_one(&listener).await
        });
        let client = AgentClient::connect(&path).await.expect("connect");
        tokio::time::sleep(settle).await;
        let mut replies = client
            .request(Request::Ping, Vec::new())
            .await
            .expect("sent on a new connection");
        let (event, _) = tokio::time::timeout(Duration::from_secs(5), replies.next())
            .await
            .expect("answered in time")
            .expect("answered");
        assert_eq!(event, Event::Done);
        let (request, _wr) = accept.await.expect("agent");
        assert_eq!(request, Request::Ping);
    }

    #[tokio::test]
    async fn a_request_after_the_agent_closed_the_connection_goes_on_a_new_one() {
        ask_after_the_agent_closed(Duration::ZERO).await;
        ask_after_the_agent_closed(Duration::from_millis(100)).await;
    }

    #[tokio::test]
    async fn a_request_dropped_while_being_sent_leaves_no_half_frame_for_the_next() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("agent.sock");
        let listener = UnixListener::bind(&path).expect("bind");
        let (first_tx, first_rx) = tokio::sync::oneshot::channel();
        let accept = tokio::spawn(async move {
            // The first connection is not read: a large request fills it.
            let first = agent_side(&listener, PROTOCOL_VERSION).await;
            let _ = first_tx.send(first);
            answer_one(&listener).await
        });
        let client = AgentClient::connect(&path).await.expect("connect");
        let (mut first_rd, _first_wr) = first_rx.await.expect("first connection");
        let large = client.request(Request::Ping, vec![1u8; 4 << 20]);
        // Its caller goes away part-way (an HTTP client that hung up).
        assert!(tokio::time::timeout(Duration::from_millis(200), large)
            .await
            .is_err());
        let mut replies = tokio::time::timeout(
            Duration::from_secs(5),
            client.request(Request::Ping, Vec::new()),
        )
        .await
        .expect("sent in time, not behind the half frame")
        .expect("sent");
        let (event, _) = tokio::time::timeout(Duration::from_secs(5), replies.next())
            .await
            .expect("answered in time, on a new connection")
            .expect("answered");
        assert_eq!(event, Event::Done);
        let (request, _wr) = accept.await.expect("agent");
        assert_eq!(request, Request::Ping);
        // The old connection ends with the half frame, never with the
        // small request appended to it.
        let rest = tokio::time::timeout(
            Duration::from_secs(5),
            read_frame::<ClientMessage, _>(&mut first_rd),
        )
        .await
        .expect("the old connection ended");
        assert!(rest.is_err(), "{rest:?}");
    }
}
