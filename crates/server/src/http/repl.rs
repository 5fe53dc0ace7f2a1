//! Code contexts over HTTP: the PandaStack `repl/sessions` routes, for
//! Python, JavaScript and bash, with runcell's extra fields.

use std::time::Duration;

use axum::extract::Path;
use axum::http::StatusCode;
use axum::Json;
use runcell_core::{CellEvent, ClientError, ContextOptions, Output};
use runcell_protocol::{ContextInfo, ErrorKind, Language};
use serde::Deserialize;

use super::kit::{with_marker, AppResult, JsonBody, OwnedSandbox, RawBody, Sandboxed, St};
use crate::error::ApiError;
use crate::state::{AppState, Entry};
use crate::validate;
use crate::views::{CellView, ErrorView, ExceptionView, SessionView};

/// A missing session is a 404 with PandaStack's message.
fn session_error(e: runcell_core::Error) -> ApiError {
    match &e {
        runcell_core::Error::Agent(ClientError::Agent {
            kind: ErrorKind::NotFound,
            ..
        }) => ApiError::new(StatusCode::NOT_FOUND, "session not found"),
        _ => e.into(),
    }
}

fn view(e: &Entry, c: &ContextInfo) -> SessionView {
    SessionView {
        id: c.id.clone(),
        session_id: c.id.clone(),
        sandbox_id: e.sandbox.id().to_string(),
        language: c.language.name().into(),
        created_at: runcell_core::rfc3339((c.created_unix_ms / 1000) as i64),
        cells: c.cells,
        restarts: c.restarts,
        preload_errors: c.preload_errors.clone(),
    }
}

#[derive(Debug, Deserialize, utoipa::ToSchema)]
pub(crate) struct CreateSessionReq {
    /// `python` (default), `javascript` or `bash`, with the usual aliases.
    language: Option<String>,
    /// Working directory.
    cwd: Option<String>,
    /// Extra environment variables.
    #[serde(default, alias = "env")]
    envs: std::collections::BTreeMap<String, String>,
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/repl/sessions", tag = "code contexts", operation_id = "createSession", params(("id" = String, Path, description = "The sandbox id")), request_body(content = Option<CreateSessionReq>, description = "May be empty: a Python session"),
    responses((status = 201, body = SessionView), (status = 400, description = "Invalid input: the error names the field", body = ErrorView), (status = 401, description = "Missing or unknown API key", body = ErrorView), (status = 404, description = "No such sandbox in the key's workspace", body = ErrorView), (status = 409, description = "The sandbox stopped running during the request", body = ErrorView), (status = 413, description = "The request body is larger than the daemon allows", body = ErrorView)))]
pub(crate) async fn create(
    axum::extract::State(state): St,
    Sandboxed(e, RawBody(body)): Sandboxed<RawBody>,
) -> AppResult<(StatusCode, Json<SessionView>)> {
    // An empty body means a Python session with defaults.
    let req: CreateSessionReq = if super::kit::is_blank(&body) {
        CreateSessionReq {
            language: None,
            cwd: None,
            envs: Default::default(),
        }
    } else {
        super::kit::parse_json(&body)?
    };
    let language: Language = req
        .language
        .as_deref()
        .unwrap_or("python")
        .parse()
        .map_err(|e: runcell_protocol::UnknownLanguage| ApiError::bad_request(e.to_string()))?;
    validate::env("envs", &req.envs)?;
    if let Some(cwd) = &req.cwd {
        runcell_core::limits::check_path("cwd", cwd)?;
    }
    state.touch(&e).await;
    let mut env = e
        .record
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .env
        .clone();
    env.extend(req.envs);
    // A sandbox from the warm pool comes with a Python context that has
    // already imported the template's modules: the first plain Python
    // session takes it.
    if language == Language::Python && req.cwd.is_none() && env.is_empty() {
        let warm = e
            .warm_context
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        if let Some(info) = warm {
            return Ok((StatusCode::CREATED, Json(view(&e, &info))));
        }
    }
    let mut opts = ContextOptions::new(language);
    opts.cwd = req.cwd;
    opts.env = env;
    let info = e.sandbox.create_context(opts).await?;
    Ok((StatusCode::CREATED, Json(view(&e, &info))))
}

#[utoipa::path(get, path = "/v1/sandboxes/{id}/repl/sessions", tag = "code contexts", operation_id = "listSessions", params(("id" = String, Path, description = "The sandbox id")),
    responses((status = 200, body = Vec<SessionView>), (status = 400, description = "Invalid input: the error names the field", body = ErrorView), (status = 401, description = "Missing or unknown API key", body = ErrorView), (status = 404, description = "No such sandbox in the key's workspace", body = ErrorView), (status = 409, description = "The sandbox stopped running during the request", body = ErrorView)))]
pub(crate) async fn list(OwnedSandbox(e): OwnedSandbox) -> AppResult<Json<Vec<SessionView>>> {
    let contexts = e.sandbox.list_contexts().await?;
    // The warm context is not a session until someone creates one.
    let warm = e
        .warm_context
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .as_ref()
        .map(|c| c.id.clone());
    Ok(Json(
        contexts
            .iter()
            .filter(|c| Some(&c.id) != warm.as_ref())
            .map(|c| view(&e, c))
            .collect(),
    ))
}

#[utoipa::path(delete, path = "/v1/sandboxes/{id}/repl/sessions/{sid}", tag = "code contexts", operation_id = "deleteSession", params(("id" = String, Path, description = "The sandbox id"), ("sid" = String, Path, description = "The session id")),
    responses((status = 204, description = "Closed"), (status = 400, description = "Invalid input: the error names the field", body = ErrorView), (status = 401, description = "Missing or unknown API key", body = ErrorView), (status = 404, description = "No such sandbox or session", body = ErrorView), (status = 409, description = "The sandbox stopped running during the request", body = ErrorView)))]
pub(crate) async fn delete(
    Path((_, sid)): Path<(String, String)>,
    OwnedSandbox(e): OwnedSandbox,
) -> AppResult<StatusCode> {
    e.sandbox
        .delete_context(&sid)
        .await
        .map_err(session_error)?;
    Ok(StatusCode::NO_CONTENT)
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/repl/sessions/{sid}/restart", tag = "code contexts", operation_id = "restartSession", params(("id" = String, Path, description = "The sandbox id"), ("sid" = String, Path, description = "The session id")),
    responses((status = 200, body = SessionView), (status = 400, description = "Invalid input: the error names the field", body = ErrorView), (status = 401, description = "Missing or unknown API key", body = ErrorView), (status = 404, description = "No such sandbox or session", body = ErrorView), (status = 409, description = "The sandbox stopped running during the request", body = ErrorView)))]
pub(crate) async fn restart(
    axum::extract::State(state): St,
    Path((_, sid)): Path<(String, String)>,
    OwnedSandbox(e): OwnedSandbox,
) -> AppResult<Json<SessionView>> {
    state.touch(&e).await;
    let info = e
        .sandbox
        .restart_context(&sid)
        .await
        .map_err(session_error)?;
    Ok(Json(view(&e, &info)))
}

#[derive(Debug, Deserialize, utoipa::ToSchema)]
pub(crate) struct RunReq {
    /// The cell's source code.
    code: String,
    /// Timeout in milliseconds; the sandbox's default when absent or not
    /// positive; at most the daemon's `--max-exec-timeout`.
    #[schema(value_type = Option<i64>)]
    timeout_ms: Option<f64>,
}

fn cell_timeout(state: &AppState, e: &Entry, req: &RunReq) -> AppResult<Duration> {
    match req.timeout_ms {
        Some(ms) if ms > 0.0 || ms.is_nan() => {
            Ok(validate::bounds(&state.config).timeout_ms("timeout_ms", ms)?)
        }
        _ => Ok(e.sandbox.limits().timeout),
    }
}

/// A cell's code and timeout, checked before anything runs.
fn checked(state: &AppState, e: &Entry, req: &RunReq) -> AppResult<Duration> {
    if req.code.trim().is_empty() {
        return Err(ApiError::bad_request("code required"));
    }
    validate::code(&req.code)?;
    cell_timeout(state, e, req)
}

/// Runs a cell to its end, handing each output chunk and result to `on` as
/// it comes, and returns the whole answer.
async fn execute(
    state: &AppState,
    e: &Entry,
    sid: &str,
    code: &str,
    timeout: Duration,
    mut on: impl FnMut(&CellEvent<'_>),
) -> AppResult<CellView> {
    state.touch(e).await;
    let started = std::time::Instant::now();
    let (mut stdout, mut stderr, mut results) = (Vec::new(), Vec::new(), Vec::new());
    let report = e
        .sandbox
        .run_cell_streaming(sid, code, Some(timeout), |ev| {
            on(&ev);
            match ev {
                CellEvent::Output(s, b) => {
                    e.log.append(s, b);
                    match s {
                        Output::Stdout => stdout.extend_from_slice(b),
                        Output::Stderr => stderr.extend_from_slice(b),
                    }
                }
                CellEvent::Result(r) => results.push(r),
            }
        })
        .await
        .map_err(session_error)?;
    state.metrics.exec_latency.observe(started.elapsed());
    state.touch(e).await;
    let o = &report.outcome;
    let mut messages = Vec::new();
    if o.timed_out || o.crashed.is_some() {
        // Only the sentences about a timeout or crash name the language.
        let language = e
            .sandbox
            .list_contexts()
            .await?
            .into_iter()
            .find(|c| c.id == sid)
            .map_or(Language::Python, |c| c.language);
        messages = o.messages(language, runcell_protocol::units::millis(timeout));
    } else if o.results_dropped > 0 {
        messages = o.messages(Language::Python, 0);
    }
    if report.oom_killed {
        messages.push(format!(
            "The sandbox ran out of memory (limit {}) and a process was killed.",
            runcell_core::format_size(e.sandbox.limits().memory_bytes)
        ));
    }
    for (name, truncated, total) in [
        ("stdout", o.stdout_truncated, o.stdout_bytes),
        ("stderr", o.stderr_truncated, o.stderr_bytes),
    ] {
        if truncated {
            messages.push(runcell_core::truncation_marker(name, total));
        }
    }
    let error = match (&o.error, &o.crashed) {
        (Some(x), _) => Some(x.traceback.clone()),
        (None, Some(_)) => Some(messages.join(" ")),
        (None, None) => None,
    };
    Ok(CellView {
        stdout: with_marker(
            super::stream::into_text(stdout),
            o.stdout_truncated,
            "stdout",
            o.stdout_bytes,
        ),
        stderr: with_marker(
            super::stream::into_text(stderr),
            o.stderr_truncated,
            "stderr",
            o.stderr_bytes,
        ),
        exit: o.exit_code,
        exit_code: o.exit_code,
        results,
        duration_ms: o.duration_ms,
        error,
        exception: o.error.as_ref().map(|x| ExceptionView {
            name: x.name.clone(),
            value: x.value.clone(),
            traceback: x.traceback.clone(),
        }),
        timed_out: o.timed_out,
        state_lost: o.state_lost,
        crashed: o.crashed.clone(),
        oom_killed: report.oom_killed,
        stdout_truncated: o.stdout_truncated,
        stderr_truncated: o.stderr_truncated,
        stdout_bytes: o.stdout_bytes,
        stderr_bytes: o.stderr_bytes,
        messages,
    })
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/repl/sessions/{sid}/run", tag = "code contexts", operation_id = "runCell", params(("id" = String, Path, description = "The sandbox id"), ("sid" = String, Path, description = "The session id")), request_body = RunReq,
    responses((status = 200, body = CellView), (status = 400, description = "Invalid input: the error names the field", body = ErrorView), (status = 401, description = "Missing or unknown API key", body = ErrorView), (status = 404, description = "No such sandbox or session", body = ErrorView), (status = 409, description = "The sandbox stopped running during the request", body = ErrorView), (status = 413, description = "The request body is larger than the daemon allows", body = ErrorView), (status = 500, description = "The cell timed out: `error` contains \"timeout\", with the CellView fields", body = ErrorView)))]
pub(crate) async fn run(
    axum::extract::State(state): St,
    Path((_, sid)): Path<(String, String)>,
    Sandboxed(e, JsonBody(req)): Sandboxed<JsonBody<RunReq>>,
) -> AppResult<axum::response::Response> {
    let timeout = checked(&state, &e, &req)?;
    let view = execute(&state, &e, &sid, &req.code, timeout, |_| {}).await?;
    if !view.timed_out {
        let len = view.stdout.len() + view.stderr.len();
        return super::stream::exec_answer(view, len).await;
    }
    // The PandaStack clients raise SandboxTimeout for a 5xx whose message
    // contains "timeout" (contract, section 8.2).
    let first = view.messages.first().cloned().unwrap_or_default();
    let body = serde_json::to_value(view).expect("cell result serializes");
    let mut err = ApiError::internal(format!(
        "cell timeout after {}s: {first}",
        runcell_core::format_secs(timeout),
    ));
    err.extra = body.as_object().cloned();
    Err(err)
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/repl/sessions/{sid}/run/stream", tag = "code contexts", operation_id = "runCellStream", params(("id" = String, Path, description = "The sandbox id"), ("sid" = String, Path, description = "The session id")), request_body = RunReq,
    responses((status = 409, description = "The sandbox is paused: resume it first", body = ErrorView), (status = 200, description = "SSE, while the cell runs: `stdout`/`stderr` events {chunk}, a `result` event per rich result (a MIME bundle), then one `done` event with the whole CellView (a timeout too: `timed_out` is true), or `error` {error}", content_type = "text/event-stream", body = CellView), (status = 400, description = "Invalid input: the error names the field", body = ErrorView), (status = 401, description = "Missing or unknown API key", body = ErrorView), (status = 404, description = "No such sandbox in the key's workspace", body = ErrorView), (status = 413, description = "The request body is larger than the daemon allows", body = ErrorView)))]
pub(crate) async fn run_stream(
    axum::extract::State(state): St,
    Path((_, sid)): Path<(String, String)>,
    Sandboxed(e, JsonBody(req)): Sandboxed<JsonBody<RunReq>>,
) -> AppResult<axum::response::Response> {
    use super::stream::{error_event, Utf8Carry};
    use axum::response::sse::Event as SseEvent;
    let timeout = checked(&state, &e, &req)?;
    // A missing session is a 404 before the stream starts, as for `run`.
    if !e.sandbox.list_contexts().await?.iter().any(|c| c.id == sid) {
        return Err(ApiError::new(StatusCode::NOT_FOUND, "session not found"));
    }
    let (mut tx, response) = super::stream::sse_channel();
    tokio::spawn(async move {
        // The cell's callback cannot wait; events queue here and go out at
        // the client's pace. The queue holds at most one cell's output,
        // which the sandbox's output limit bounds.
        let (events, mut queue) = tokio::sync::mpsc::unbounded_channel::<SseEvent>();
        let forward = tokio::spawn(async move {
            while let Some(ev) = queue.recv().await {
                if tx.send(ev).await.is_err() {
                    break;
                }
            }
            tx
        });
        let (mut out, mut err) = (Utf8Carry::default(), Utf8Carry::default());
        let result = execute(&state, &e, &sid, &req.code, timeout, |ev| {
            let event = match ev {
                CellEvent::Output(s, b) => {
                    let (name, text) = match s {
                        Output::Stdout => ("stdout", out.push(b)),
                        Output::Stderr => ("stderr", err.push(b)),
                    };
                    if text.is_empty() {
                        return;
                    }
                    SseEvent::default()
                        .event(name)
                        .data(serde_json::json!({ "chunk": text }).to_string())
                }
                CellEvent::Result(r) => SseEvent::default()
                    .event("result")
                    .data(serde_json::to_string(r).unwrap_or_else(|_| "{}".into())),
            };
            let _ = events.send(event);
        })
        .await;
        let last = match result {
            Ok(view) => SseEvent::default()
                .event("done")
                .data(serde_json::to_string(&view).expect("cell result serializes")),
            Err(e) => error_event(&e.message),
        };
        let _ = events.send(last);
        drop(events);
        // Ends the stream once the last event is out (or the client left).
        let _ = forward.await;
    });
    Ok(response)
}
