//! Output on its way to HTTP clients: bounded SSE streams with a stall
//! limit, UTF-8 text from byte chunks, the operator's cap on output limits.
//!
//! Every stream has a small bounded buffer. A producer that cannot hand an
//! event over within [`STALL_LIMIT`] (the client stopped reading) gives up:
//! the stream ends with an `error` event, delivered ahead of what is still
//! buffered, and the producer stops what feeds it (an exec is killed).

use std::convert::Infallible;
use std::time::Duration;

use axum::http::header;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use serde_json::json;
use tokio::sync::{mpsc, oneshot};

use crate::error::ApiError;

/// Events buffered per stream (each at most one chunk of output, 64 KiB
/// before JSON escaping).
pub(crate) const STREAM_EVENTS: usize = 16;
/// How long a stream's client may read nothing while events wait for it.
pub(crate) const STALL_LIMIT: Duration = Duration::from_secs(10);

/// The sending side of an SSE stream.
#[derive(Debug)]
pub(crate) struct SseSender {
    tx: mpsc::Sender<SseEvent>,
    abort: Option<oneshot::Sender<SseEvent>>,
}

/// Why an event could not be sent.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum SendError {
    /// The client went away.
    Gone,
    /// The client read nothing for [`STALL_LIMIT`]; the stream was ended
    /// with an error event.
    Stalled,
}

impl SseSender {
    /// Sends an event, waiting at most [`STALL_LIMIT`] for room.
    pub(crate) async fn send(&mut self, event: SseEvent) -> Result<(), SendError> {
        if self.abort.is_none() {
            return Err(SendError::Stalled);
        }
        match tokio::time::timeout(STALL_LIMIT, self.tx.send(event)).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(_)) => Err(SendError::Gone),
            Err(_) => {
                self.fail(format!(
                    "The client stopped reading the stream for {} s; it was ended.",
                    STALL_LIMIT.as_secs()
                ));
                Err(SendError::Stalled)
            }
        }
    }

    /// Ends the stream with an `error` event ahead of anything buffered.
    pub(crate) fn fail(&mut self, message: String) {
        if let Some(abort) = self.abort.take() {
            let _ = abort.send(error_event(&message));
        }
    }

    /// Whether the client went away.
    pub(crate) fn is_closed(&self) -> bool {
        self.tx.is_closed()
    }

    /// Resolves when the client goes away.
    pub(crate) async fn closed(&self) {
        self.tx.closed().await
    }
}

/// An `error` event.
pub(crate) fn error_event(message: &str) -> SseEvent {
    SseEvent::default()
        .event("error")
        .data(json!({ "error": message }).to_string())
}

/// A bounded SSE stream and the response that serves it, with `: ping`
/// keep-alives every 15 s. The stream ends when the sender is gone (after
/// what it buffered) or at once after [`SseSender::fail`].
pub(crate) fn sse_channel() -> (SseSender, Response) {
    let (tx, rx) = mpsc::channel::<SseEvent>(STREAM_EVENTS);
    let (abort_tx, abort_rx) = oneshot::channel::<SseEvent>();
    let stream = futures_util::stream::unfold(Some((rx, Some(abort_rx))), |state| async move {
        let (mut rx, mut abort) = state?;
        loop {
            let Some(a) = abort.as_mut() else {
                let ev = rx.recv().await?;
                return Some((Ok::<_, Infallible>(ev), Some((rx, None))));
            };
            tokio::select! {
                biased;
                got = a => match got {
                    // The error goes out first; then the stream ends.
                    Ok(ev) => return Some((Ok(ev), None)),
                    Err(_) => abort = None,
                },
                ev = rx.recv() => return ev.map(|ev| (Ok(ev), Some((rx, abort)))),
            }
        }
    });
    let sse = Sse::new(stream).keep_alive(
        KeepAlive::new()
            .interval(Duration::from_secs(15))
            .text("ping"),
    );
    // Without a charset, Python's requests decodes the stream as ISO-8859-1.
    let response = (
        [
            (header::CONTENT_TYPE, "text/event-stream; charset=utf-8"),
            (header::CACHE_CONTROL, "no-cache"),
            (header::HeaderName::from_static("x-accel-buffering"), "no"),
        ],
        sse,
    )
        .into_response();
    (
        SseSender {
            tx,
            abort: Some(abort_tx),
        },
        response,
    )
}

/// Splits a byte stream into valid UTF-8 text without breaking characters
/// across chunks: at most the 3 bytes of an unfinished character are carried
/// to the next chunk, so the work is linear in the bytes.
#[derive(Debug, Default)]
pub(crate) struct Utf8Carry(Vec<u8>);

impl Utf8Carry {
    pub(crate) fn push(&mut self, bytes: &[u8]) -> String {
        let mut all = std::mem::take(&mut self.0);
        all.extend_from_slice(bytes);
        let keep = incomplete_tail(&all);
        self.0 = all.split_off(all.len() - keep);
        into_text(all)
    }
}

/// How many bytes at the end of `b` start a character that is not complete yet.
fn incomplete_tail(b: &[u8]) -> usize {
    for back in 1..=b.len().min(3) {
        let c = b[b.len() - back];
        if c & 0xC0 == 0x80 {
            continue; // a continuation byte: look further back
        }
        let need = match c {
            0xC2..=0xDF => 2,
            0xE0..=0xEF => 3,
            0xF0..=0xF4 => 4,
            _ => return 0,
        };
        // Incomplete only if what follows is a valid prefix of it.
        return match std::str::from_utf8(&b[b.len() - back..]) {
            Err(e) if need > back && e.error_len().is_none() => back,
            _ => 0,
        };
    }
    0
}

/// Answers this large are encoded on the big-answer lane.
const BIG_ANSWER: usize = 64 << 10;

/// A JSON exec answer. A large output takes a while to encode (every newline
/// of a short-line flood is an escape), so large answers are encoded on a
/// blocking thread, one at a time for the whole daemon: the async workers
/// stay free for everybody's requests, and however many sandboxes flood at
/// once, their encoding takes at most one core.
pub(crate) async fn exec_answer<T: serde::Serialize + Send + 'static>(
    value: T,
    output_len: usize,
) -> Result<Response, ApiError> {
    static LANE: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(1);
    let encode = move || serde_json::to_vec(&value);
    let bytes = if output_len < BIG_ANSWER {
        encode()
    } else {
        let _turn = LANE
            .acquire()
            .await
            .map_err(|e| ApiError::internal(format!("Could not encode the answer: {e}")))?;
        tokio::task::spawn_blocking(encode)
            .await
            .map_err(|e| ApiError::internal(format!("Could not encode the answer: {e}")))?
    }
    .map_err(|e| ApiError::internal(format!("Could not encode the answer: {e}")))?;
    Ok(([(header::CONTENT_TYPE, "application/json")], bytes).into_response())
}

/// Bytes as text, without a copy when they are valid UTF-8.
pub(crate) fn into_text(bytes: Vec<u8>) -> String {
    String::from_utf8(bytes).unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utf8_is_never_split() {
        let mut c = Utf8Carry::default();
        let s = "héllo → wörld 🎉";
        let mut out = String::new();
        for b in s.as_bytes() {
            out.push_str(&c.push(&[*b]));
        }
        assert_eq!(out, s);
        // Invalid bytes become U+FFFD once, an unfinished character waits.
        assert_eq!(c.push(&[0xff, b'a', 0xe2, 0x82]), "\u{fffd}a");
        assert_eq!(c.push(&[0xac]), "€");
    }
}
