//! `POST /v1/run` (runcell extension): a sandbox made, one program run in
//! it and the sandbox deleted, in one request. What `runcell run` through a
//! daemon sends; it saves a one-shot run the round trip between its create
//! and its exec (the sandbox's agent hears of the program as soon as the
//! sandbox is up, not after the client has read the create's answer and
//! sent another request).

use axum::extract::State;
use axum::response::Response;
use axum::Extension;
use serde::Deserialize;

use super::exec::ExecReq;
use super::kit::{json_event, AppResult, JsonBody, St, Workspace};
use super::sandboxes::{created_view, CreateReq};
use crate::service::{CreateSpec, Service};
use crate::views::ErrorView;

/// The fields of a create request (`sandbox`), which its errors name.
pub(crate) const SANDBOX_FIELDS: &[&str] = &[
    "template",
    "ttl_seconds",
    "persistent",
    "metadata",
    "from_snapshot",
    "limits",
    "env",
    "network",
    "isolation",
    "on_idle",
    "volumes",
    "node",
    "node_selector",
];

/// The fields of an exec request (`exec`), which its errors name.
const EXEC_FIELDS: &[&str] = &[
    "cmd",
    "timeout_seconds",
    "env",
    "cwd",
    "background",
    "language",
    "args",
    "exact_output",
    "delete_after",
];

/// Why a sandbox made by `POST /v1/run` ended once its program had run.
const DELETED_AFTER_RUN: &str = "deleted after its run (POST /v1/run)";

#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct RunReq {
    /// The sandbox to make, as `POST /v1/sandboxes` takes it (all of it
    /// optional: the default template, limits and no network).
    #[serde(default)]
    sandbox: CreateReq,
    /// The program to run in it, as `exec/stream` takes it (`delete_after`
    /// is implied).
    exec: ExecReq,
}

#[utoipa::path(post, path = "/v1/run", tag = "exec", operation_id = "runOnce", request_body = RunReq,
    responses((status = 200, description = "SSE: one `sandbox` event (the sandbox as `POST /v1/sandboxes` answers it), then the exec's events as `exec/stream` sends them; the sandbox is deleted once the stream ends, however it ended", content_type = "text/event-stream", body = crate::views::ExecStreamEvent), (status = 400, description = "Invalid input: the error names the field (`sandbox.…` or `exec.…`); nothing was made", body = ErrorView), (status = 401, description = "Missing or unknown API key", body = ErrorView), (status = 404, description = "sandbox.from_snapshot names no snapshot of the key's workspace", body = ErrorView), (status = 413, description = "The request body is larger than the daemon allows", body = ErrorView), (status = 429, description = "A per-workspace quota is reached; retry after Retry-After seconds", body = ErrorView), (status = 503, description = "No capacity, or the sandbox failed to start; retry after Retry-After seconds", body = ErrorView)))]
pub(crate) async fn run(
    State(state): St,
    Extension(ws): Extension<Workspace>,
    JsonBody(req): JsonBody<RunReq>,
) -> AppResult<Response> {
    let RunReq { sandbox, exec } = req;
    // The program is checked before anything is made: a bad one leaves
    // nothing behind. A fresh sandbox starts it as soon as it is up, before
    // the daemon records it.
    let first_run = super::exec::first_run(&state, &exec, sandbox.env.clone())
        .map_err(|e| e.within("exec", EXEC_FIELDS))?;
    sandbox
        .check_selector()
        .map_err(|e| e.within("sandbox", SANDBOX_FIELDS))?;
    let spec = CreateSpec {
        first_run: Some(first_run),
        ..sandbox.into()
    };
    let mut created = Service(&state)
        .create_sandbox(&ws.0, spec)
        .await
        .map_err(|e| e.within("sandbox", SANDBOX_FIELDS))?;
    let started = created.first.take();
    let e = created.entry.clone();
    let first = json_event("sandbox", &created_view(&state, created));
    let opts = match super::exec::run_options(&state, &e, &exec) {
        Ok(o) => o,
        Err(err) => {
            state.remove(e.sandbox.id(), DELETED_AFTER_RUN).await;
            return Err(err.within("exec", EXEC_FIELDS));
        }
    };
    Ok(super::exec::stream_answer(
        state,
        e,
        exec,
        opts,
        Some(first),
        Some(DELETED_AFTER_RUN),
        started,
    )
    .await)
}
