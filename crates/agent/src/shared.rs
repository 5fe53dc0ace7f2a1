//! What the agent's request handlers (`exec`, `context`, `files`) share and
//! how they answer: the sandbox's spec, the child reaper and the egress
//! listener, and the outbox of a connection. The handlers import this and
//! `server` imports them, so no handler reaches back into the server.

use runcell_jail::InitSpec;
use runcell_protocol::{ErrorKind, Event, Frame, ServerMessage};
use tokio::sync::mpsc;

use crate::egress::Egress;
use crate::reaper::Reaper;

/// Sends events back to one connection.
pub type Outbox = mpsc::Sender<Frame<ServerMessage>>;

/// The sandbox-wide state every handler reads.
#[derive(Debug)]
pub struct Shared {
    /// The sandbox spec.
    pub spec: InitSpec,
    /// Exit statuses.
    pub reaper: Reaper,
    /// The egress proxy listener.
    pub egress: Egress,
}

/// Sends one event for request `id`.
pub async fn send(out: &Outbox, id: u64, event: Event, body: Vec<u8>) -> bool {
    out.send(Frame::with_body(ServerMessage { id, event }, body))
        .await
        .is_ok()
}

/// Sends an error event.
pub async fn send_error(out: &Outbox, id: u64, kind: ErrorKind, message: String) {
    send(out, id, Event::Error { kind, message }, Vec::new()).await;
}
