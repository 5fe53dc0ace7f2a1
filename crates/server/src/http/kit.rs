//! What every resource module of the HTTP layer uses: the result type, the
//! caller's workspace, the body and sandbox extractors, and the JSON data
//! of the SSE events.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{FromRequest, FromRequestParts, Path, Request, State};
use axum::http::request::Parts;
use axum::http::StatusCode;
use axum::response::sse::Event as SseEvent;
use axum::response::{IntoResponse, Response};
use runcell_core::format_size;
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::error::ApiError;
use crate::state::{AppState, Entry};

pub(crate) type AppResult<T> = Result<T, ApiError>;
pub(crate) type St = State<Arc<AppState>>;

/// The workspace of the caller's key (put there by the auth middleware).
#[derive(Debug, Clone)]
pub struct Workspace(pub String);

/// A JSON body with runcell's error shapes: 413 over the size limit, 400
/// for anything malformed.
pub(crate) struct JsonBody<T>(pub(crate) T);

impl<T: DeserializeOwned> FromRequest<Arc<AppState>> for JsonBody<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &Arc<AppState>) -> Result<Self, Self::Rejection> {
        let bytes = RawBody::from_request(req, state).await?.0;
        if bytes.is_empty() {
            return Err(ApiError::bad_request(
                "The request body is empty; a JSON object is expected.",
            ));
        }
        parse_json(&bytes).map(JsonBody)
    }
}

/// A JSON body that may be absent (PandaStack's clients send none for a
/// bodiless POST): no bytes at all is `T::default()`.
pub(crate) struct OptionalJson<T>(pub(crate) T);

impl<T: DeserializeOwned + Default> FromRequest<Arc<AppState>> for OptionalJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &Arc<AppState>) -> Result<Self, Self::Rejection> {
        let bytes = RawBody::from_request(req, state).await?.0;
        if is_blank(&bytes) {
            return Ok(OptionalJson(T::default()));
        }
        parse_json(&bytes).map(OptionalJson)
    }
}

/// JSON's own whitespace (RFC 8259: space, tab, line feed, carriage
/// return), not ASCII's, which also counts the form feed.
fn is_json_space(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | b'\r')
}

/// An absent body: no bytes at all. Anything else is a body and must be a
/// JSON text, which holds a value (RFC 8259): whitespace alone (`" "`) or a
/// form feed is not JSON and must not pass for an absent body.
pub(crate) fn is_blank(bytes: &[u8]) -> bool {
    bytes.is_empty()
}

/// Parses a JSON body; the error names the field that is wrong
/// (`limits.cpu: invalid type ...`).
pub(crate) fn parse_json<T: DeserializeOwned>(bytes: &[u8]) -> AppResult<T> {
    // serde reads a struct from an array of its fields in order
    // (`[null, true]`); no route takes an array, so refuse one.
    if bytes.iter().find(|&&b| !is_json_space(b)) == Some(&b'[') {
        return Err(ApiError::bad_request(
            "The request body must be a JSON object, not an array.",
        ));
    }
    let de = &mut serde_json::Deserializer::from_slice(bytes);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let field = clip(e.path().to_string());
        let inner = e.into_inner();
        // serde_json calls some wrong types syntax errors (an integer
        // where an enum's name belongs is "expected value"): name the
        // field whenever the path is known.
        // Clipped first: serde may quote a huge value whole, and what the
        // type names are said in matters only for what is echoed.
        let inner = plain_types(&clip(inner.to_string()));
        if field.is_empty() || field == "." || field == "?" {
            ApiError::bad_request(format!(
                "The request body is not valid JSON for this route: {inner}."
            ))
        } else {
            ApiError::bad_request(format!(
                "The request body's field \"{field}\" is not valid: {inner}."
            ))
        }
    })
}

/// serde's message with its Rust type names said as a caller of a JSON API
/// knows them: `expected f64` is `expected a number`, `expected u64` is
/// `expected a whole number, 0 or more`.
fn plain_types(msg: &str) -> String {
    const EXPECTED: &str = "expected ";
    let mut out = String::with_capacity(msg.len());
    let mut rest = msg;
    while let Some(at) = rest.find(EXPECTED) {
        let (head, tail) = rest.split_at(at + EXPECTED.len());
        out.push_str(head);
        let len = tail
            .find(|c: char| !c.is_ascii_alphanumeric())
            .unwrap_or(tail.len());
        let (word, after) = tail.split_at(len);
        out.push_str(match word {
            "f32" | "f64" => "a number",
            "u8" | "u16" | "u32" | "u64" | "u128" | "usize" => "a whole number, 0 or more",
            "i8" | "i16" | "i32" | "i64" | "i128" | "isize" => "a whole number",
            other => other,
        });
        rest = after;
    }
    out.push_str(rest);
    out
}

/// At most this much of a caller's own text is echoed in an error (serde
/// quotes an unknown value whole: a 30 MB `isolation` must not come back).
const ECHO_LIMIT: usize = 256;

/// `s`, cut at [`ECHO_LIMIT`] bytes (on a character boundary) with the size
/// said.
pub(crate) fn clip(s: String) -> String {
    match runcell_protocol::text::clip(&s, ECHO_LIMIT) {
        std::borrow::Cow::Borrowed(_) => s,
        clipped => clipped.into_owned(),
    }
}

/// Raw body bytes, limited to the configured size.
pub(crate) struct RawBody(pub(crate) Bytes);

impl FromRequest<Arc<AppState>> for RawBody {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &Arc<AppState>) -> Result<Self, Self::Rejection> {
        let limit = state.config.max_body_bytes;
        let body = req.into_body();
        match axum::body::to_bytes(body, limit).await {
            Ok(b) => Ok(RawBody(b)),
            Err(_) => Err(ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!(
                    "The request body is larger than the {} allowed.",
                    format_size(limit as u64)
                ),
            )),
        }
    }
}

/// The sandbox `{id}` of the path, live and of the caller's workspace;
/// another workspace's sandbox is answered exactly as a missing one, and an
/// ended one of the caller's with its tombstone (always a 404).
pub(crate) struct OwnedSandbox(pub(crate) Arc<Entry>);

impl FromRequestParts<Arc<AppState>> for OwnedSandbox {
    type Rejection = Response;

    async fn from_request_parts(
        parts: &mut Parts,
        state: &Arc<AppState>,
    ) -> Result<Self, Self::Rejection> {
        let ws = workspace(parts).map_err(IntoResponse::into_response)?;
        let id = sandbox_id(parts, state).await?;
        owned(state, &ws, &id, parts.uri.path())
            .await
            .map(OwnedSandbox)
            .map_err(IntoResponse::into_response)
    }
}

/// [`OwnedSandbox`] with the request's body `B`: the body is read and
/// checked first, then the sandbox looked up (a malformed body is a 400
/// even for a missing sandbox).
pub(crate) struct Sandboxed<B>(pub(crate) Arc<Entry>, pub(crate) B);

impl<B> FromRequest<Arc<AppState>> for Sandboxed<B>
where
    B: FromRequest<Arc<AppState>, Rejection = ApiError> + Send,
{
    type Rejection = Response;

    async fn from_request(req: Request, state: &Arc<AppState>) -> Result<Self, Self::Rejection> {
        let (mut parts, body) = req.into_parts();
        let ws = workspace(&parts).map_err(IntoResponse::into_response)?;
        let id = sandbox_id(&mut parts, state).await?;
        let path = parts.uri.path().to_string();
        let body = B::from_request(Request::from_parts(parts, body), state)
            .await
            .map_err(IntoResponse::into_response)?;
        let entry = owned(state, &ws, &id, &path)
            .await
            .map_err(IntoResponse::into_response)?;
        Ok(Sandboxed(entry, body))
    }
}

fn workspace(parts: &Parts) -> AppResult<Workspace> {
    parts.extensions.get::<Workspace>().cloned().ok_or_else(|| {
        ApiError::internal("The request reached a sandbox route without a workspace.")
    })
}

async fn sandbox_id(parts: &mut Parts, state: &Arc<AppState>) -> Result<String, Response> {
    let Path(params) = Path::<Vec<(String, String)>>::from_request_parts(parts, state)
        .await
        .map_err(IntoResponse::into_response)?;
    params
        .into_iter()
        .find_map(|(k, v)| (k == "id").then_some(v))
        .ok_or_else(|| ApiError::internal("The route has no sandbox id.").into_response())
}

/// A sandbox of the key's workspace, live or hibernated, for the routes
/// that answer for a hibernated one without waking it (get, delete,
/// hibernate, wake, lifecycle).
pub(crate) enum Addressed {
    /// Running or paused.
    Live(Arc<Entry>),
    /// Hibernated: its record.
    Hibernated(Box<crate::registry::Record>),
}

impl FromRequestParts<Arc<AppState>> for Addressed {
    type Rejection = Response;

    async fn from_request_parts(
        parts: &mut Parts,
        state: &Arc<AppState>,
    ) -> Result<Self, Self::Rejection> {
        let ws = workspace(parts).map_err(IntoResponse::into_response)?;
        let id = sandbox_id(parts, state).await?;
        if let Some(e) = live(state, &ws, &id) {
            return Ok(Addressed::Live(e));
        }
        crate::service::Service(state)
            .hibernated(&ws.0, &id)
            .map(|r| Addressed::Hibernated(Box::new(r)))
            .ok_or_else(|| state.gone(&ws.0, &id).into_response())
    }
}

fn live(state: &AppState, ws: &Workspace, id: &str) -> Option<Arc<Entry>> {
    state.entry(id).filter(|e| {
        e.record
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .workspace
            == ws.0
    })
}

/// A live sandbox of the key's workspace; a hibernated one is woken first
/// (transparently: any call on it is activity).
async fn owned(
    state: &Arc<AppState>,
    ws: &Workspace,
    id: &str,
    path: &str,
) -> AppResult<Arc<Entry>> {
    // A call that talks to the agent waits out a hibernation, a wake or a
    // gVisor save (its agent lets go of every connection for a moment),
    // then finds the sandbox as it is (a wake takes the lock itself).
    if (is_work(path) || is_pause(path)) && live(state, ws, id).is_some() {
        state.settled(id).await;
    }
    let e = match live(state, ws, id) {
        Some(e) => e,
        None => crate::service::Service(state).wake(&ws.0, id).await?,
    };
    if is_work(path) && e.sandbox.is_paused() {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            format!("Sandbox {id} is paused; resume it first."),
        ));
    }
    Ok(e)
}

/// Whether a sandbox route talks to the sandbox's agent (exec, files,
/// code, a network or deadline change): a paused agent cannot answer, so
/// those get 409 instead of hanging. (GET lifecycle does not come here.)
fn is_work(path: &str) -> bool {
    // [v1 /] sandboxes / {id} / what... (the nested router strips `/v1`)
    let mut parts = path.split('/').skip_while(|p| *p != "sandboxes").skip(2);
    matches!(
        parts.next(),
        Some("exec" | "fs" | "repl" | "network" | "lifecycle")
    )
}

/// Whether a route pauses a sandbox: it tells the agent its deadline
/// first (`AppState::hold_deadline`), so it waits out a save as work does
/// (the agent of a gVisor sandbox being saved lets go of its connections),
/// but answers for a paused sandbox itself.
fn is_pause(path: &str) -> bool {
    path.ends_with("/pause")
}

#[cfg(test)]
mod tests {
    #[test]
    fn rust_type_names_in_a_refusal_are_said_in_json_words() {
        use super::plain_types;
        assert_eq!(
            plain_types("invalid type: string \"5\", expected f64 at line 1 column 9"),
            "invalid type: string \"5\", expected a number at line 1 column 9"
        );
        assert_eq!(
            plain_types("invalid value: integer `-1`, expected u64"),
            "invalid value: integer `-1`, expected a whole number, 0 or more"
        );
        assert_eq!(
            plain_types("expected i32, expected usize"),
            "expected a whole number, expected a whole number, 0 or more"
        );
        // Other words after `expected` stay as they are.
        for kept in [
            "invalid type: integer `1`, expected a string",
            "expected u8x",
            "expected value at line 1",
            "expected",
        ] {
            assert_eq!(plain_types(kept), kept);
        }
    }

    #[test]
    fn work_routes_are_the_ones_that_run_something_in_the_sandbox() {
        for p in [
            "/sandboxes/x/exec",
            "/v1/sandboxes/x/exec/stream",
            "/sandboxes/x/fs",
            "/sandboxes/x/fs/dir",
            "/sandboxes/x/repl/sessions/s/run",
            "/sandboxes/x/network",
            "/sandboxes/x/lifecycle",
        ] {
            assert!(super::is_work(p), "{p}");
        }
        for p in [
            "/sandboxes/x",
            "/sandboxes/x/resume",
            "/sandboxes/x/snapshots",
            "/sandboxes/fs",
            "/sandboxes",
        ] {
            assert!(!super::is_work(p), "{p}");
        }
    }
}

/// Output text with the truncation marker line when it was cut.
pub(crate) fn with_marker(mut text: String, truncated: bool, stream: &str, total: u64) -> String {
    if truncated {
        if !text.ends_with('\n') && !text.is_empty() {
            text.push('\n');
        }
        text.push_str(&runcell_core::truncation_marker(stream, total));
        text.push('\n');
    }
    text
}

/// An SSE event `name` whose data is `data` as JSON.
pub(crate) fn json_event(name: &'static str, data: &impl Serialize) -> SseEvent {
    SseEvent::default()
        .event(name)
        .data(serde_json::to_string(data).expect("event data serializes"))
}

/// The data of a `stdout`/`stderr` event.
#[derive(Serialize)]
pub(crate) struct Chunk<'a> {
    pub(crate) chunk: &'a str,
}

/// The data of an output event of an `exact_output` exec stream: the bytes,
/// base64.
#[derive(Serialize)]
pub(crate) struct Data<'a> {
    pub(crate) data: &'a str,
}

/// The data of a log `line` event.
#[derive(Serialize)]
pub(crate) struct Line<'a> {
    pub(crate) line: &'a str,
}

/// The data of the `exit` event that ends an exec stream.
#[derive(Serialize)]
pub(crate) struct Exit {
    pub(crate) exit_code: i32,
    pub(crate) oom_killed: bool,
    pub(crate) pids_limit: bool,
    /// With `exact_output`: the exec hit its timeout.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) timed_out: Option<bool>,
    /// With `exact_output`: the notes on limits hit, which then are not
    /// sent as `stderr` events.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) messages: Option<Vec<String>>,
}
