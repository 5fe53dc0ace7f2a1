//! Getting out of the way of a gVisor checkpoint (`runsc checkpoint`).
//!
//! runsc cannot save a sandbox that holds a host unix socket: it fails with
//! "Cannot save endpoint with bound host socket", and the container is
//! stopped. The agent's listening socket, the host's connections to it and
//! the egress connections are all host sockets (`--host-uds=all`). So on
//! `SIGUSR1` (sent by the host with `runsc kill <id> USR1`) the agent
//! quiesces: it stops listening and removes [`AGENT_SOCKET`], closes every
//! host connection (an exec in flight on one is killed, as when its client
//! goes away), then writes [`QUIESCED`] in the host directory and waits.
//! Its processes keep running, and their memory (code contexts' variables
//! included) is what the checkpoint saves. It serves again once the host
//! writes [`RESUME`] there or sends `SIGUSR1` again ([`signal`]); then it
//! removes both markers and binds its socket again.
//!
//! The marker is written before `runsc restore` starts the restored
//! sandbox, never after: gVisor serves the sandbox's root (the host
//! directory included) as its own (exclusive file access) and caches what
//! a lookup did not find, so a restored agent that looked for the marker
//! before the host wrote it would never see it (about one restore in
//! three, when the marker came after `runsc restore` returned). The
//! signal is for a live agent, whose earlier lookups are cached: the host
//! gives up a checkpoint with it, and nudges a restored agent that is slow
//! to serve.

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use runcell_jail::gvisor::{AGENT_SOCKET, QUIESCED_MARKER, RESUME_MARKER};
use tokio::sync::{watch, Notify};

/// The marker the agent writes once it holds no host socket.
const QUIESCED: &str = QUIESCED_MARKER;
/// The marker the host writes to let it serve again.
const RESUME: &str = RESUME_MARKER;

/// How long open host connections get to close.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(5);

struct State {
    quiesce: watch::Sender<bool>,
    /// Set by a `SIGUSR1` while quiescing: serve again.
    resume: AtomicBool,
    open: AtomicUsize,
    closed: Notify,
}

fn state() -> &'static State {
    static S: OnceLock<State> = OnceLock::new();
    S.get_or_init(|| State {
        quiesce: watch::Sender::new(false),
        resume: AtomicBool::new(false),
        open: AtomicUsize::new(0),
        closed: Notify::new(),
    })
}

/// Counts one open host socket for as long as it lives.
#[derive(Debug)]
pub struct Open(());

impl Drop for Open {
    fn drop(&mut self) {
        let s = state();
        s.open.fetch_sub(1, Ordering::AcqRel);
        s.closed.notify_waiters();
    }
}

/// Registers a host connection (to be closed before a checkpoint).
pub fn open() -> Open {
    state().open.fetch_add(1, Ordering::AcqRel);
    Open(())
}

/// Completes once the agent is asked to quiesce (at once if it is).
pub async fn quiesced() {
    let mut rx = state().quiesce.subscribe();
    let _ = rx.wait_for(|q| *q).await;
}

/// Whether a quiesce is under way.
pub fn is_quiescing() -> bool {
    *state().quiesce.borrow()
}

/// Starts quiescing: every connection sees [`quiesced`] complete.
fn begin() {
    let s = state();
    s.resume.store(false, Ordering::Release);
    s.quiesce.send_replace(true);
}

/// What the host's `SIGUSR1` means: quiesce for a checkpoint ([`begin`]),
/// or, while quiescing, serve again (as [`RESUME`] does).
pub fn signal() {
    if is_quiescing() {
        state().resume.store(true, Ordering::Release);
    } else {
        begin();
    }
}

/// The listener's side, once it stopped listening: waits for every host
/// connection to close, reports [`QUIESCED`], waits for [`RESUME`], and
/// ends the quiesce. The caller then binds its socket again.
pub async fn hold() {
    let _ = std::fs::remove_file(AGENT_SOCKET);
    let s = state();
    let until = Instant::now() + CLOSE_TIMEOUT;
    loop {
        let closed = s.closed.notified();
        if s.open.load(Ordering::Acquire) == 0 {
            break;
        }
        if Instant::now() >= until {
            tracing::warn!(
                open = s.open.load(Ordering::Acquire),
                "host connections still open at the checkpoint"
            );
            break;
        }
        let _ = tokio::time::timeout(Duration::from_millis(50), closed).await;
    }
    if let Err(e) = std::fs::write(QUIESCED, b"") {
        tracing::error!("could not report the quiesce: {e}");
    }
    tracing::info!("quiesced for a checkpoint; waiting to resume");
    while !s.resume.load(Ordering::Acquire) && !Path::new(RESUME).exists() {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let _ = std::fs::remove_file(RESUME);
    let _ = std::fs::remove_file(QUIESCED);
    s.quiesce.send_replace(false);
    tracing::info!("resumed after a checkpoint");
}
