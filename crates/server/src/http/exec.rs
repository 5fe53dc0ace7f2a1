//! `/v1/sandboxes/{id}/exec`, `exec/stream` and `logs`: running commands
//! and reading their output.

use std::collections::BTreeMap;
use std::time::Duration;

use axum::extract::{Query, State};
use axum::http::header;
use axum::response::sse::Event as SseEvent;
use axum::response::{IntoResponse, Response};
use runcell_core::{Output, RunOptions};
use runcell_protocol::Command;
use serde::Deserialize;

use super::kit::{
    json_event, with_marker, AppResult, Chunk, Data, Exit, JsonBody, Line, OwnedSandbox, Sandboxed,
    St,
};
use crate::error::ApiError;
use crate::state::{AppState, Entry};
use crate::validate;
use crate::views::{ErrorView, ExecStreamEvent, ExecView, LogEvent};

#[derive(Debug, Deserialize, utoipa::ToSchema)]
pub(crate) struct ExecReq {
    cmd: String,
    timeout_seconds: Option<f64>,
    #[serde(default)]
    env: BTreeMap<String, String>,
    cwd: Option<String>,
    /// Keep the processes the command leaves behind running after it returns.
    #[serde(default)]
    background: bool,
    /// Run source code instead of a shell line (runcell extension): `cmd`
    /// is then a program in this language (`python`, `javascript` or
    /// `bash`), run as `runcell run` runs it: the language's interpreter on
    /// a file holding the code, followed by `args`.
    language: Option<String>,
    /// Arguments of the program given with `language`.
    #[serde(default)]
    args: Vec<String>,
    /// `exec/stream` only (runcell extension, what `runcell run` uses):
    /// output events carry `{"data": base64}`, the bytes exactly as
    /// written, and the notes on limits come only in the closing `exit`
    /// event (`messages`, `timed_out`), which also ends a timed-out exec.
    #[serde(default)]
    exact_output: bool,
    /// Delete the sandbox once this exec has run, however it ended
    /// (runcell extension, what `runcell run` uses): the answer, or the
    /// stream's closing event, goes out first; a request refused before
    /// the exec runs (a 4xx) leaves the sandbox as it is. Saves a one-shot
    /// run the round trip of its `DELETE`.
    #[serde(default)]
    delete_after: bool,
}

/// Why a sandbox deleted by its exec's `delete_after` ended.
const DELETED_AFTER_EXEC: &str = "deleted after its exec (delete_after)";

/// What an exec request runs.
fn command(req: &ExecReq) -> AppResult<Option<runcell_protocol::Language>> {
    match &req.language {
        None if !req.args.is_empty() => Err(ApiError::bad_request(
            "args needs language: a shell command line takes its arguments in cmd",
        )),
        None => Ok(None),
        Some(l) => l
            .parse()
            .map(Some)
            .map_err(|e: runcell_protocol::UnknownLanguage| {
                ApiError::bad_request(format!("language: {e}"))
            }),
    }
}

/// The options an exec request runs with in the sandbox `e`.
pub(super) fn run_options(state: &AppState, e: &Entry, req: &ExecReq) -> AppResult<RunOptions> {
    let env = e
        .record
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .env
        .clone();
    checked_options(state, req, env, e.sandbox.limits().timeout)
}

/// An exec request as the program a sandbox is made for and starts as soon
/// as it is up (`POST /v1/run`), checked as [`checked_options`] checks it
/// with the sandbox's environment `env`; its timeout, unless it gives one,
/// is the sandbox's.
pub(super) fn first_run(
    state: &AppState,
    req: &ExecReq,
    env: BTreeMap<String, String>,
) -> AppResult<runcell_core::FirstRun> {
    let mut opts = checked_options(state, req, env, Duration::ZERO)?;
    if req.timeout_seconds.is_none() {
        opts.timeout = None;
    }
    Ok(runcell_core::FirstRun {
        program: program(req),
        opts,
    })
}

/// What a checked exec request runs: its code in its language, else its
/// command line.
fn program(req: &ExecReq) -> runcell_core::FirstProgram {
    match command(req) {
        Ok(Some(language)) => runcell_core::FirstProgram::Code {
            language,
            code: req.cmd.clone(),
        },
        // Checked before: a language that is not one was refused.
        Ok(None) | Err(_) => runcell_core::FirstProgram::Command(Command::Shell(req.cmd.clone())),
    }
}

/// Checks an exec request that runs with the sandbox environment `env`
/// and, unless it gives its own, the timeout `timeout`; answers the options
/// it runs with.
pub(super) fn checked_options(
    state: &AppState,
    req: &ExecReq,
    mut env: BTreeMap<String, String>,
    timeout: Duration,
) -> AppResult<RunOptions> {
    let code = command(req)?.is_some();
    if !code && req.cmd.trim().is_empty() {
        return Err(ApiError::bad_request("cmd required"));
    }
    let timeout = match req.timeout_seconds {
        Some(t) => validate::bounds(&state.config).timeout("timeout_seconds", t)?,
        None => timeout,
    };
    env.extend(req.env.clone());
    if code {
        validate::code_run(&req.cmd, &req.args, &req.env, &env, req.cwd.as_deref())?;
    } else {
        validate::run(&req.cmd, &req.env, &env, req.cwd.as_deref())?;
    }
    Ok(RunOptions {
        env,
        args: req.args.clone(),
        cwd: req.cwd.clone(),
        timeout: Some(timeout),
        background: req.background,
        ..RunOptions::default()
    })
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/exec", tag = "exec", operation_id = "execCommand", params(("id" = String, Path, description = "The sandbox id")), request_body = ExecReq,
    responses((status = 200, body = ExecView), (status = 400, description = "Invalid input: the error names the field", body = ErrorView), (status = 401, description = "Missing or unknown API key", body = ErrorView), (status = 404, description = "No such sandbox in the key's workspace", body = ErrorView), (status = 409, description = "The sandbox stopped running during the request", body = ErrorView), (status = 413, description = "The request body is larger than the daemon allows", body = ErrorView), (status = 500, description = "The exec timed out: `error` contains \"timeout\", with the ExecView fields", body = ErrorView)))]
pub(crate) async fn exec(
    State(state): St,
    Sandboxed(e, JsonBody(req)): Sandboxed<JsonBody<ExecReq>>,
) -> AppResult<Response> {
    let opts = run_options(&state, &e, &req)?;
    // Dropped as this returns its answer (before it is written), or with
    // this request should the client go away mid-exec (which kills the
    // exec): the sandbox goes either way.
    let _delete = DeleteAfter(
        req.delete_after
            .then(|| (state.clone(), e.sandbox.id().to_string())),
    );
    run_and_answer(&state, e, &req, &opts).await
}

/// Deletes a sandbox (its exec asked so with `delete_after`) when dropped.
struct DeleteAfter(Option<(std::sync::Arc<AppState>, String)>);

impl Drop for DeleteAfter {
    fn drop(&mut self) {
        if let Some((state, id)) = self.0.take() {
            // Out of the live map now, before the answer goes out (this
            // runs as the handler returns it): a client that asks at once
            // gets 404 with the reason, never the sandbox still there. The
            // teardown is what comes after the answer.
            if let Some(entry) = state.take_live(&id, DELETED_AFTER_EXEC) {
                tokio::spawn(async move { state.dispose(&id, entry, DELETED_AFTER_EXEC).await });
            }
        }
    }
}

/// Runs a checked exec and answers it whole.
async fn run_and_answer(
    state: &AppState,
    e: std::sync::Arc<Entry>,
    req: &ExecReq,
    opts: &RunOptions,
) -> AppResult<Response> {
    state.touch(&e).await;
    let started = std::time::Instant::now();
    // The output is held once (at most the output limit per stream, which
    // the agent enforces), then moved into the answer without a copy.
    let (mut stdout, mut stderr) = (Vec::new(), Vec::new());
    let collect = |s: Output, b: &[u8]| {
        e.log.append(s, b);
        match s {
            Output::Stdout => stdout.extend_from_slice(b),
            Output::Stderr => stderr.extend_from_slice(b),
        }
    };
    let outcome = match command(req)? {
        Some(language) => {
            e.sandbox
                .run_code_streaming(language, &req.cmd, opts, collect)
                .await?
        }
        None => {
            e.sandbox
                .exec_streaming(Command::Shell(req.cmd.clone()), opts, collect)
                .await?
        }
    };
    state.metrics.exec_latency.observe(started.elapsed());
    state.touch(&e).await;
    let x = &outcome.exit;
    let view = ExecView {
        stdout: with_marker(
            super::stream::into_text(stdout),
            x.stdout_truncated,
            "stdout",
            x.stdout_bytes,
        ),
        stderr: with_marker(
            super::stream::into_text(stderr),
            x.stderr_truncated,
            "stderr",
            x.stderr_bytes,
        ),
        exit_code: outcome.status(),
        duration_ms: x.duration_ms,
        timed_out: x.timed_out,
        oom_killed: outcome.oom_killed,
        pids_limit: outcome.pids_limit,
        stdout_truncated: x.stdout_truncated,
        stderr_truncated: x.stderr_truncated,
        stdout_bytes: x.stdout_bytes,
        stderr_bytes: x.stderr_bytes,
        messages: outcome.messages(),
    };
    if !x.timed_out {
        let len = view.stdout.len() + view.stderr.len();
        return super::stream::exec_answer(view, len).await;
    }
    // The PandaStack clients raise SandboxTimeout for a 5xx whose message
    // contains "timeout" (see the API contract, section 6).
    let body = serde_json::to_value(view).expect("exec result serializes");
    let mut err = ApiError::internal(format!(
        "exec timeout after {}s: context deadline exceeded",
        runcell_core::format_secs(outcome.timeout)
    ));
    err.extra = body.as_object().cloned();
    Err(err)
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/exec/stream", tag = "exec", operation_id = "execCommandStream", params(("id" = String, Path, description = "The sandbox id")), request_body = ExecReq,
    responses((status = 409, description = "The sandbox is paused: resume it first", body = ErrorView), (status = 200, description = "SSE: `stdout`/`stderr` events {chunk}, then one `exit` {exit_code, oom_killed, pids_limit} or `error` {error}", content_type = "text/event-stream", body = ExecStreamEvent), (status = 400, description = "Invalid input: the error names the field", body = ErrorView), (status = 401, description = "Missing or unknown API key", body = ErrorView), (status = 404, description = "No such sandbox in the key's workspace", body = ErrorView), (status = 413, description = "The request body is larger than the daemon allows", body = ErrorView)))]
pub(crate) async fn exec_stream(
    State(state): St,
    Sandboxed(e, JsonBody(req)): Sandboxed<JsonBody<ExecReq>>,
) -> AppResult<impl IntoResponse> {
    let opts = run_options(&state, &e, &req)?;
    state.touch(&e).await;
    let delete = req.delete_after.then_some(DELETED_AFTER_EXEC);
    Ok(stream_answer(state, e, req, opts, None, delete, None).await)
}

/// Starts a checked exec in `e` and answers its SSE stream, `first` its
/// first event; with `delete` the sandbox is then deleted for that reason
/// (when the stream ends, however it ended), else touched. `started`: the
/// exec's program, started with the sandbox (`POST /v1/run`), whose events
/// the stream then reads instead of starting it.
pub(super) async fn stream_answer(
    state: std::sync::Arc<AppState>,
    e: std::sync::Arc<Entry>,
    req: ExecReq,
    opts: RunOptions,
    first: Option<SseEvent>,
    delete: Option<&'static str>,
    started: Option<runcell_core::StartedRun>,
) -> Response {
    let (mut tx, response) = super::stream::sse_channel();
    if let Some(event) = first {
        // The stream's buffer is empty: this takes no wait.
        let _ = tx.send(event).await;
    }
    let (begun, begun_rx) = tokio::sync::oneshot::channel();
    tokio::spawn(async move {
        let id = e.sandbox.id().to_string();
        let result = stream_exec(&e, &req, &opts, &mut tx, begun, started).await;
        // With `delete`, the sandbox leaves the live map before the closing
        // event goes out: a client that asks once it has read it gets 404
        // with the reason, never the sandbox still there.
        let taken = match delete {
            Some(reason) => {
                drop(e);
                state.take_live(&id, reason).map(|entry| (entry, reason))
            }
            None => {
                state.touch(&e).await;
                None
            }
        };
        let result = match result {
            Ok(last) => tx.send(last).await.map_err(|e| match e {
                super::stream::SendError::Gone => StreamError::Gone,
                super::stream::SendError::Stalled => StreamError::Stalled,
            }),
            Err(err) => Err(err),
        };
        drop(tx);
        if let Some((entry, reason)) = taken {
            state.dispose(&id, entry, reason).await;
        }
        if let Err(err) = result {
            tracing::info!(sandbox = %id, "exec stream ended: {err}");
        }
    });
    // The answer goes out once the program has started (or failed to): the
    // task starting it runs at once on this thread while this waits, rather
    // than after the answer's headers are written, which took a wake-up
    // of its own before the sandbox's agent heard of the exec.
    let _ = begun_rx.await;
    response.into_response()
}

/// Why an exec stream ended early.
#[derive(Debug, thiserror::Error)]
enum StreamError {
    /// The sandbox failed the exec.
    #[error(transparent)]
    Run(#[from] runcell_core::Error),
    /// The client read nothing for the stall limit.
    #[error("the client stopped reading; the exec was killed")]
    Stalled,
    /// The client closed the stream.
    #[error("the client went away; the exec was killed")]
    Gone,
}

/// Runs an exec and sends its output as SSE events at the client's pace: a
/// client that reads slowly holds back the program (the pipes, the agent's
/// connection of this exec and the stream's buffer are all bounded); one
/// that stops reading for the stall limit gets an `error` event and the exec
/// is killed. Returns the stream's closing event (`exit`, or `error` for a
/// failure or a timeout) for the caller to send.
async fn stream_exec(
    e: &Entry,
    req: &ExecReq,
    opts: &RunOptions,
    tx: &mut super::stream::SseSender,
    begun: tokio::sync::oneshot::Sender<()>,
    started: Option<runcell_core::StartedRun>,
) -> Result<SseEvent, StreamError> {
    use super::stream::{error_event, SendError, Utf8Carry};
    use runcell_core::RunEvent;
    let started = match started {
        Some(run) => Ok(e.sandbox.resume_run(run)),
        None => e.sandbox.start_program(&program(req), opts).await,
    };
    let _ = begun.send(());
    let mut run = match started {
        Ok(r) => r,
        Err(err) => return Ok(error_event(&ApiError::from(err).message)),
    };
    let (mut out, mut err) = (Utf8Carry::default(), Utf8Carry::default());
    let outcome = loop {
        let next = tokio::select! {
            next = run.next() => next,
            // The client went away while the program printed nothing.
            () = tx.closed() => return Err(StreamError::Gone),
        };
        let next = match next {
            Ok(n) => n,
            Err(err) => return Ok(error_event(&ApiError::from(err).message)),
        };
        let (stream, bytes) = match next {
            RunEvent::Output(s, b) => (s, b),
            RunEvent::Done(o) => break o,
        };
        e.log.append(stream, &bytes);
        if tx.is_closed() {
            // The client went away (or aborted): nobody reads this exec any
            // more. Dropping `run` closes its agent connection, and the
            // agent kills the exec's processes, as for a plain exec whose
            // client hung up.
            return Err(StreamError::Gone);
        }
        let name = match stream {
            Output::Stdout => "stdout",
            Output::Stderr => "stderr",
        };
        let event = if req.exact_output {
            use base64::Engine as _;
            let data = base64::engine::general_purpose::STANDARD.encode(&bytes);
            json_event(name, &Data { data: &data })
        } else {
            let text = match stream {
                Output::Stdout => out.push(&bytes),
                Output::Stderr => err.push(&bytes),
            };
            if text.is_empty() {
                continue;
            }
            json_event(name, &Chunk { chunk: &text })
        };
        if tx.send(event).await == Err(SendError::Stalled) {
            tracing::warn!(
                sandbox = %e.sandbox.id(),
                "an exec stream's client read nothing for {} s: ended the stream and killed the exec",
                super::stream::STALL_LIMIT.as_secs()
            );
            if let Err(err) = run.kill().await {
                tracing::warn!(sandbox = %e.sandbox.id(), "could not kill the stalled exec: {err}");
            }
            // Read to the end (bounded: the process tree is dead), so the
            // agent's connection of this exec closes cleanly.
            let drain = async { while matches!(run.next().await, Ok(RunEvent::Output(..))) {} };
            let _ = tokio::time::timeout(Duration::from_secs(10), drain).await;
            return Err(StreamError::Stalled);
        }
    };
    let last = if req.exact_output {
        json_event(
            "exit",
            &Exit {
                exit_code: outcome.status(),
                oom_killed: outcome.oom_killed,
                pids_limit: outcome.pids_limit,
                timed_out: Some(outcome.exit.timed_out),
                messages: Some(outcome.messages()),
            },
        )
    } else if outcome.exit.timed_out {
        error_event(&format!(
            "exec timeout after {}s",
            runcell_core::format_secs(outcome.timeout)
        ))
    } else {
        for m in outcome.messages() {
            let ev = json_event(
                "stderr",
                &Chunk {
                    chunk: &format!("{m}\n"),
                },
            );
            if tx.send(ev).await.is_err() {
                return Err(StreamError::Gone);
            }
        }
        json_event(
            "exit",
            &Exit {
                exit_code: outcome.status(),
                oom_killed: outcome.oom_killed,
                pids_limit: outcome.pids_limit,
                timed_out: None,
                messages: None,
            },
        )
    };
    Ok(last)
}

#[derive(Debug, Deserialize)]
pub(crate) struct LogsQuery {
    stream: Option<String>,
    follow: Option<String>,
}

/// The output of the sandbox's execs: a plain-text snapshot, or with
/// `follow` (1, true or yes) an SSE stream of `line` events.
#[utoipa::path(get, path = "/v1/sandboxes/{id}/logs", tag = "exec", operation_id = "getLogs", params(("id" = String, Path, description = "The sandbox id"), ("stream" = Option<String>, Query, description = "`stdout`, `stderr` or `both` (default)"), ("follow" = Option<String>, Query, description = "`1`, `true` or `yes`: an SSE stream of `line` events {line} that follows new output")),
    responses((status = 200, description = "The output of the sandbox's execs: plain text, or with follow an SSE stream", content((String = "text/plain; charset=utf-8"), (LogEvent = "text/event-stream"))), (status = 400, description = "Invalid input: the error names the field", body = ErrorView), (status = 401, description = "Missing or unknown API key", body = ErrorView), (status = 404, description = "No such sandbox in the key's workspace", body = ErrorView)))]
pub(crate) async fn logs(
    Query(q): Query<LogsQuery>,
    OwnedSandbox(e): OwnedSandbox,
) -> AppResult<Response> {
    let want = match q.stream.as_deref().unwrap_or("both") {
        "stdout" => Some(Output::Stdout),
        "stderr" => Some(Output::Stderr),
        "both" | "" => None,
        other => {
            return Err(ApiError::bad_request(format!(
                "stream must be stdout, stderr or both, not \"{other}\"."
            )))
        }
    };
    let keep = move |s: Output| want.is_none_or(|w| w == s);
    let follow = q
        .follow
        .as_deref()
        .is_some_and(|f| ["1", "true", "yes"].contains(&f.to_ascii_lowercase().as_str()));
    if !follow {
        let text: String = e.log.snapshot(keep).into_iter().map(|l| l.text).collect();
        return Ok(([(header::CONTENT_TYPE, "text/plain; charset=utf-8")], text).into_response());
    }
    let mut follower = e.log.follow();
    drop(e);
    let (mut tx, response) = super::stream::sse_channel();
    let line_event = |text: &str| json_event("line", &Line { line: text });
    tokio::spawn(async move {
        use crate::logs::Followed;
        if tx.send(SseEvent::default().comment("open")).await.is_err() {
            return;
        }
        loop {
            let got = tokio::select! {
                got = follower.next() => got,
                _ = tx.closed() => return,
            };
            let sent = match got {
                Some(Followed::Lines(lines)) => {
                    let mut sent = Ok(());
                    for l in lines.iter().filter(|l| keep(l.stream)) {
                        sent = tx.send(line_event(&l.text)).await;
                        if sent.is_err() {
                            break;
                        }
                    }
                    sent
                }
                Some(Followed::Missed(n)) => {
                    tx.send(SseEvent::default().comment(format!("{n} bytes dropped")))
                        .await
                }
                // The sandbox is gone: end the stream.
                None => return,
            };
            if sent == Err(super::stream::SendError::Stalled) {
                tracing::info!("a log stream's client read nothing for a while; ended it");
                return;
            }
            if sent.is_err() {
                return;
            }
        }
    });
    Ok(response)
}
