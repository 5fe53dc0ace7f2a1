//! The host's connection to a sandbox agent: many concurrent requests over
//! one unix socket, each answered by a stream of events.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use runcell_protocol::{
    read_frame, write_frame, ClientMessage, CodecError, ErrorKind, Event, Frame, Request,
    ServerMessage, PROTOCOL_VERSION,
};
use tokio::io::BufReader;
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

type Pending = Arc<Mutex<HashMap<u64, mpsc::Sender<(Event, Vec<u8>)>>>>;

/// A connection to one agent.
#[derive(Debug)]
pub struct AgentClient {
    writer: tokio::sync::Mutex<OwnedWriteHalf>,
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
        let reader = spawn_reader(rd, pending.clone());
        Ok(Self {
            writer: tokio::sync::Mutex::new(wr),
            pending,
            next_id: AtomicU64::new(1),
            reader: Mutex::new(reader),
            sandbox_id,
            path: path.to_path_buf(),
            work: Arc::default(),
        })
    }

    /// Connects again (the agent closed its connections, as a gVisor
    /// agent does for a checkpoint): requests from here on go over the new
    /// connection; those that waited on the old one have ended.
    pub async fn reconnect(&self) -> Result<(), ClientError> {
        let (rd, wr, _) = open(&self.path, None).await?;
        let mut writer = self.writer.lock().await;
        let mut reader = self
            .reader
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        reader.abort();
        self.pending
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clear();
        *writer = wr;
        *reader = spawn_reader(rd, self.pending.clone());
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
        let pending: Pending = Arc::new(Mutex::new(HashMap::from([(ID, tx)])));
        let reader = spawn_reader(rd, pending.clone());
        let conn = Box::new(Self {
            writer: tokio::sync::Mutex::new(wr),
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
        self.pending
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(id, tx);
        let frame = Frame::with_body(ClientMessage { id, request }, body);
        let sent = write_frame(&mut *self.writer.lock().await, &frame).await;
        if let Err(e) = sent {
            self.pending
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .remove(&id);
            return Err(e.into());
        }
        Ok(Replies {
            rx,
            id,
            own: None,
            _work: work,
        })
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

/// Connects to the agent at `path`, sends `first` if given, and reads the
/// agent's hello: the connection's halves and the sandbox id it reported.
async fn open(
    path: &Path,
    first: Option<&Frame<ClientMessage>>,
) -> Result<(Reader, OwnedWriteHalf, String), ClientError> {
    // However deep the sandbox's directory is (sun_path holds 107 bytes).
    let short = runcell_jail::socket::SocketPath::new(path).map_err(ClientError::Connect)?;
    let stream = UnixStream::connect(short.path())
        .await
        .map_err(ClientError::Connect)?;
    drop(short);
    let (rd, mut wr) = stream.into_split();
    if let Some(frame) = first {
        write_frame(&mut wr, frame).await?;
    }
    let mut rd = BufReader::new(rd);
    let hello: Frame<ServerMessage> = read_frame(&mut rd).await?.ok_or(ClientError::Closed)?;
    let sandbox_id = match hello.header.event {
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
            sandbox_id
        }
        other => return Err(ClientError::Unexpected(Box::new(other))),
    };
    Ok((rd, wr, sandbox_id))
}

/// Reads the agent's replies on `rd` and hands them to their requests in
/// `p`; when the connection ends, every request still waiting ends too.
fn spawn_reader(mut rd: Reader, p: Pending) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
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
                    map.remove(&id)
                } else {
                    map.get(&id).cloned()
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
        p.lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clear();
    })
}

impl Drop for AgentClient {
    fn drop(&mut self) {
        self.reader
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .abort();
    }
}
