//! Accepts host connections and dispatches requests.

use std::os::unix::net::UnixListener as StdListener;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use runcell_jail::confine::Confinement;
use runcell_jail::inside::Bootstrap;
use runcell_jail::InitSpec;
use runcell_protocol::{
    read_frame, write_frame, AgentStats, ClientMessage, CodecError, ErrorKind, Event, Frame,
    Request, ServerMessage, PROTOCOL_VERSION,
};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{mpsc, watch};

use crate::reaper::Reaper;
use crate::shared::{send, send_error, Outbox, Shared};
use crate::{checkpoint, context, egress, exec, files, procs};

/// Errors that stop the agent.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The listening socket could not be used.
    #[error("The agent socket could not be used.")]
    Listener(#[source] std::io::Error),
    /// SIGCHLD handling could not be set up.
    #[error("Could not install the child reaper.")]
    Reaper(#[source] std::io::Error),
}

/// State shared by every connection.
#[derive(Debug)]
struct Agent {
    /// What the handlers read: spec, reaper, egress.
    shared: Shared,
    started: Instant,
    deadline: watch::Sender<Option<u64>>,
    /// Running execs, by (connection, request id).
    running: exec::RunningExecs,
    /// Code contexts.
    contexts: context::Contexts,
    /// What Landlock applied to the sandbox.
    confinement: Confinement,
}

/// A host connection: a unix socket (jail) or a multiplexed stream (microVM).
pub trait Conn: AsyncRead + AsyncWrite + Send + Unpin + 'static {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin + 'static> Conn for T {}

/// Serves, on the listener the jail's host bound, until shutdown. With
/// `checkpointable` (gVisor), `SIGUSR1` makes it drop every host socket for
/// a checkpoint and listen again once resumed ([`checkpoint`]).
pub async fn run(
    boot: Bootstrap,
    confinement: Confinement,
    checkpointable: bool,
) -> Result<(), ServeError> {
    let std_listener = StdListener::from(boot.listener);
    std_listener
        .set_nonblocking(true)
        .map_err(ServeError::Listener)?;
    let mut listener = UnixListener::from_std(std_listener).map_err(ServeError::Listener)?;
    if checkpointable {
        let mut usr1 =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::user_defined1())
                .map_err(ServeError::Listener)?;
        tokio::spawn(async move {
            while usr1.recv().await.is_some() {
                checkpoint::signal();
            }
        });
    }
    let std_sock = std::os::unix::net::UnixStream::from(boot.setup);
    std_sock
        .set_nonblocking(true)
        .map_err(ServeError::Listener)?;
    let setup = UnixStream::from_std(std_sock).map_err(ServeError::Listener)?;
    let (tx, rx) = mpsc::channel::<Box<dyn Conn>>(16);
    tokio::spawn(async move {
        loop {
            let accepted = tokio::select! {
                a = listener.accept() => a,
                () = checkpoint::quiesced() => {
                    // No host socket may stay open: the listener goes
                    // first, then the connections close, then the host
                    // checkpoints; once resumed, listen again.
                    drop(listener);
                    checkpoint::hold().await;
                    listener = loop {
                        let _ = std::fs::remove_file(runcell_jail::gvisor::AGENT_SOCKET);
                        match UnixListener::bind(runcell_jail::gvisor::AGENT_SOCKET) {
                            Ok(l) => break l,
                            Err(e) => {
                                tracing::error!("could not listen again after a checkpoint: {e}");
                                tokio::time::sleep(Duration::from_millis(100)).await;
                            }
                        }
                    };
                    continue;
                }
            };
            let (stream, _) = match accepted {
                Ok(s) => s,
                Err(e) => {
                    tracing::warn!("accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
            };
            if tx.send(Box::new(stream)).await.is_err() {
                return;
            }
        }
    });
    serve(boot.spec, Box::new(setup), rx, confinement).await
}

/// Serves the connections from `incoming` until shutdown. `setup` is the
/// channel the spec came over: its end means the host is gone.
pub async fn serve(
    spec: InitSpec,
    setup: Box<dyn Conn>,
    mut incoming: mpsc::Receiver<Box<dyn Conn>>,
    confinement: Confinement,
) -> Result<(), ServeError> {
    let reaper = Reaper::start().map_err(ServeError::Reaper)?;
    let (deadline, deadline_rx) = watch::channel(spec.deadline_unix_ms);
    let egress = egress::Egress::new(spec.egress_socket.is_some());
    if spec.egress_enabled {
        if let Err(e) = egress.set(true).await {
            tracing::error!("{e}");
        }
    }
    let agent = Arc::new(Agent {
        shared: Shared {
            egress,
            spec,
            reaper,
        },
        started: Instant::now(),
        deadline,
        running: exec::RunningExecs::default(),
        contexts: context::Contexts::default(),
        confinement,
    });
    tokio::spawn(enforce_deadline(deadline_rx));
    if agent.shared.spec.exit_on_host_close {
        let mut sock = setup;
        tokio::spawn(async move {
            let mut buf = [0u8; 64];
            // Any read result other than data means the owning host process is gone.
            while let Ok(n) = sock.read(&mut buf).await {
                if n == 0 {
                    break;
                }
            }
            tracing::info!("host closed the setup socket; stopping the sandbox");
            shutdown();
        });
    } else {
        drop(setup);
    }
    let mut next_conn = 0u64;
    while let Some(stream) = incoming.recv().await {
        next_conn += 1;
        tokio::spawn(connection(agent.clone(), next_conn, stream));
    }
    Ok(())
}

/// Kills every process in the sandbox and exits; the kernel then tears down
/// the namespaces.
pub fn shutdown() -> ! {
    procs::kill_all();
    std::process::exit(0)
}

async fn enforce_deadline(mut rx: watch::Receiver<Option<u64>>) {
    loop {
        let deadline = *rx.borrow_and_update();
        match deadline {
            None => {
                if rx.changed().await.is_err() {
                    return;
                }
            }
            Some(ms) => {
                let now = runcell_protocol::units::unix_millis(SystemTime::now());
                let wait = Duration::from_millis(ms.saturating_sub(now));
                tokio::select! {
                    _ = tokio::time::sleep(wait) => {
                        tracing::info!("deadline reached; stopping the sandbox");
                        shutdown();
                    }
                    changed = rx.changed() => if changed.is_err() { return },
                }
            }
        }
    }
}

async fn connection(agent: Arc<Agent>, conn: u64, stream: Box<dyn Conn>) {
    // Counted until both halves are gone (declared first, dropped last).
    let _open = checkpoint::open();
    let (rd, mut wr) = tokio::io::split(stream);
    // A frame's length, header and body in one read when they are there.
    let mut rd = tokio::io::BufReader::new(rd);
    let (tx, mut rx) = mpsc::channel::<Frame<ServerMessage>>(64);
    let writer = tokio::spawn(async move {
        loop {
            // A checkpoint closes the connection, queued replies and all.
            let frame = tokio::select! {
                f = rx.recv() => f,
                () = checkpoint::quiesced() => None,
            };
            let Some(frame) = frame else { break };
            match write_frame(&mut wr, &frame).await {
                Ok(()) => {}
                // Nothing was written: answer that request with an error and
                // keep the connection (and every other request on it).
                Err(e @ (CodecError::TooLarge { .. } | CodecError::Encode(_))) => {
                    let reply = Frame::new(ServerMessage {
                        id: frame.header.id,
                        event: Event::Error {
                            kind: ErrorKind::TooLarge,
                            message: format!(
                                "The reply is too large to send: {e} (a directory with too many entries?)"
                            ),
                        },
                    });
                    if let Err(e) = write_frame(&mut wr, &reply).await {
                        tracing::debug!("connection {conn} write failed: {e}");
                        return;
                    }
                }
                Err(e) => {
                    tracing::debug!("connection {conn} write failed: {e}");
                    return;
                }
            }
        }
    });
    send(
        &tx,
        0,
        Event::Hello {
            version: PROTOCOL_VERSION,
            agent_version: env!("CARGO_PKG_VERSION").into(),
            sandbox_id: crate::vm::sandbox_id()
                .unwrap_or_else(|| agent.shared.spec.sandbox_id.clone()),
        },
        Vec::new(),
    )
    .await;
    loop {
        let read = tokio::select! {
            r = read_frame(&mut rd) => r,
            () = checkpoint::quiesced() => Ok(None),
        };
        let frame: Frame<ClientMessage> = match read {
            Ok(Some(f)) => f,
            Ok(None) => break,
            Err(e) => {
                tracing::warn!("connection {conn}: {e}");
                break;
            }
        };
        let ClientMessage { id, request } = frame.header;
        tokio::spawn(handle(
            agent.clone(),
            conn,
            id,
            request,
            frame.body,
            tx.clone(),
        ));
    }
    // The host hung up (its HTTP client went away or aborted the request,
    // or the daemon died): an exec whose output nobody can read any more is
    // killed, process tree and all, as after a timeout.
    let orphaned: Vec<exec::Running> = agent
        .running
        .lock()
        .expect("running lock")
        .iter()
        .filter(|((c, _), _)| *c == conn)
        .map(|(_, r)| *r)
        .collect();
    for r in orphaned {
        tracing::info!(
            "connection {conn} closed: killing its exec (supervisor {})",
            r.supervisor
        );
        exec::kill_exec(&agent.shared, r.supervisor).await;
    }
    drop(tx);
    let _ = writer.await;
}

async fn handle(
    agent: Arc<Agent>,
    conn: u64,
    id: u64,
    request: Request,
    body: Vec<u8>,
    out: Outbox,
) {
    match request {
        Request::Exec(req) => {
            exec::exec(
                &agent.shared,
                &agent.running,
                conn,
                id,
                exec::What::Exec(req),
                body,
                &out,
            )
            .await
        }
        Request::RunCode(req) => {
            exec::exec(
                &agent.shared,
                &agent.running,
                conn,
                id,
                exec::What::Code(req),
                body,
                &out,
            )
            .await
        }
        Request::Signal { exec_id, signal } => {
            let running = agent
                .running
                .lock()
                .expect("running lock")
                .get(&(conn, exec_id))
                .copied();
            match (running, nix::sys::signal::Signal::try_from(signal)) {
                (Some(r), Ok(sig)) => {
                    if sig == nix::sys::signal::Signal::SIGKILL {
                        exec::kill_exec(&agent.shared, r.supervisor).await;
                    } else {
                        procs::signal_group(r.command, sig);
                    }
                    send(&out, id, Event::Done, Vec::new()).await;
                }
                (None, _) => {
                    send_error(
                        &out,
                        id,
                        ErrorKind::InvalidInput,
                        format!("No running exec has id {exec_id}."),
                    )
                    .await
                }
                (_, Err(_)) => {
                    send_error(
                        &out,
                        id,
                        ErrorKind::InvalidInput,
                        format!("{signal} is not a signal number."),
                    )
                    .await
                }
            }
        }
        Request::ReadFile { path, max_bytes } => {
            files::read(&agent.shared, id, &path, max_bytes, &out).await
        }
        Request::WriteFile { path, append, mode } => {
            files::write(&agent.shared, id, &path, append, mode, body, &out).await
        }
        Request::ListDir { path } => files::list(&agent.shared, id, &path, &out).await,
        Request::Stat { path } => files::stat(&agent.shared, id, &path, &out).await,
        Request::MakeDir { path } => files::make_dir(&agent.shared, id, &path, &out).await,
        Request::Remove { path } => files::remove(&agent.shared, id, &path, &out).await,
        Request::Stats => {
            let (processes, rss_bytes) = procs::usage();
            let (disk_total_bytes, disk_used_bytes) = match nix::sys::statvfs::statvfs("/") {
                Ok(s) => {
                    let f = s.fragment_size();
                    (s.blocks() * f, (s.blocks() - s.blocks_free()) * f)
                }
                Err(_) => (0, 0),
            };
            let stats = AgentStats {
                processes,
                rss_bytes,
                disk_used_bytes,
                disk_total_bytes,
                agent_rss_bytes: procs::self_rss(),
                uptime_ms: runcell_protocol::units::millis(agent.started.elapsed()),
                landlock_abi: agent.confinement.abi,
            };
            send(&out, id, Event::Stats(stats), Vec::new()).await;
        }
        Request::SetDeadline { unix_ms } => {
            agent.deadline.send_replace(unix_ms);
            send(&out, id, Event::Done, Vec::new()).await;
        }
        Request::SetEgress { enabled } => match agent.shared.egress.set(enabled).await {
            Ok(()) => {
                send(&out, id, Event::Done, Vec::new()).await;
            }
            Err(e) => {
                let mut message = e.to_string();
                if let Some(cause) = std::error::Error::source(&e) {
                    message.push_str(&format!(
                        " ({cause}; is a process in the sandbox using that port?)"
                    ));
                }
                send_error(&out, id, ErrorKind::InvalidInput, message).await
            }
        },
        Request::Shutdown => {
            send(&out, id, Event::Done, Vec::new()).await;
            // Give the writer a moment to flush the reply.
            tokio::time::sleep(Duration::from_millis(5)).await;
            shutdown();
        }
        Request::Ping => {
            send(&out, id, Event::Done, Vec::new()).await;
        }
        Request::ContextCreate(req) => {
            context::create(&agent.shared, &agent.contexts, id, req, &out).await
        }
        Request::ContextRun {
            context_id,
            timeout_ms,
            output_limit,
        } => {
            let timeout = Duration::from_millis(timeout_ms);
            let cell = context::Cell {
                timeout,
                output_limit,
                code: body,
            };
            context::run(&agent.shared, &agent.contexts, id, &context_id, cell, &out).await
        }
        Request::ContextRestart { context_id } => {
            context::restart(&agent.shared, &agent.contexts, id, &context_id, &out).await
        }
        Request::ContextDelete { context_id } => {
            context::delete(&agent.contexts, id, &context_id, &out).await
        }
        Request::ContextList => context::list(&agent.contexts, id, &out).await,
    }
}
