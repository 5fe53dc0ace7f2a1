//! The `/v1` HTTP API. One module per resource parses a request, calls the
//! [service](crate::service) or the sandbox, and answers a typed view
//! ([`crate::views`]); `kit` holds what they share (the result type, the
//! body and sandbox extractors, SSE data). Shapes follow the PandaStack v1
//! sandbox API (shared/pandastack-api.md); runcell's own additions are
//! extra fields the PandaStack clients ignore. This module assembles the
//! router and its middlewares.

mod exec;
mod files;
pub(crate) mod kit;
mod network;
mod openapi;
mod panics;
mod rejection;
mod repl;
pub(crate) mod run;
pub(crate) mod sandboxes;
mod snapshots;
mod stream;
mod system;
mod templates;
mod volumes;

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{delete as delete_route, get, post};
use axum::Router;
use serde_json::Value;

use kit::{St, Workspace};

use crate::error::ApiError;
use crate::state::AppState;

/// The daemon's router.
pub fn router(state: Arc<AppState>) -> Router {
    let v1 = Router::new()
        .route("/me", get(system::me))
        .route("/system", get(system::system))
        .route("/openapi.json", get(openapi::openapi))
        .route("/sandboxes", get(sandboxes::list).post(sandboxes::create))
        .route(
            "/sandboxes/{id}",
            get(sandboxes::get_one).delete(sandboxes::delete),
        )
        .route("/sandboxes/{id}/exec", post(exec::exec))
        .route("/sandboxes/{id}/exec/stream", post(exec::exec_stream))
        .route("/run", post(run::run))
        .route(
            "/sandboxes/{id}/fs",
            get(files::fs_read).put(files::fs_write),
        )
        .route("/sandboxes/{id}/fs/dir", get(files::fs_dir))
        .route("/sandboxes/{id}/fs/stat", get(files::fs_stat))
        .route(
            "/sandboxes/{id}/lifecycle",
            get(sandboxes::lifecycle).patch(sandboxes::set_lifecycle),
        )
        .route("/sandboxes/{id}/logs", get(exec::logs))
        .route(
            "/sandboxes/{id}/network",
            axum::routing::patch(network::set_network),
        )
        .route(
            "/sandboxes/{id}/repl/sessions",
            get(repl::list).post(repl::create),
        )
        .route(
            "/sandboxes/{id}/repl/sessions/{sid}",
            delete_route(repl::delete),
        )
        .route("/sandboxes/{id}/repl/sessions/{sid}/run", post(repl::run))
        .route(
            "/sandboxes/{id}/repl/sessions/{sid}/run/stream",
            post(repl::run_stream),
        )
        .route(
            "/sandboxes/{id}/repl/sessions/{sid}/restart",
            post(repl::restart),
        )
        .route("/sandboxes/{id}/pause", post(snapshots::pause))
        .route("/sandboxes/{id}/resume", post(snapshots::resume))
        .route("/sandboxes/{id}/hibernate", post(snapshots::hibernate))
        .route("/sandboxes/{id}/wake", post(snapshots::wake))
        .route("/sandboxes/{id}/snapshots", post(snapshots::create))
        .route("/sandboxes/{id}/fork", post(snapshots::fork))
        .route("/sandboxes/{id}/fork-tree", post(snapshots::fork_tree))
        .route("/sandboxes/{id}/promote", post(snapshots::promote))
        .route("/snapshots", get(snapshots::list))
        .route(
            "/snapshots/{id}",
            get(snapshots::get_one).delete(snapshots::delete),
        )
        .route("/volumes", get(volumes::list).post(volumes::create))
        .route(
            "/volumes/{name}",
            get(volumes::get_one).delete(volumes::delete),
        )
        .route("/templates", get(templates::templates))
        .route("/templates/{name}", get(templates::template))
        .route("/cluster", get(crate::cluster::routes::status))
        .route(
            "/cluster/drain",
            post(crate::cluster::routes::drain).delete(crate::cluster::routes::undrain),
        )
        .fallback(no_route)
        // Cluster mode: forwarding, placement, listing (inside the key check).
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            crate::cluster::forward::layer,
        ))
        .layer(axum::middleware::from_fn_with_state(state.clone(), auth));
    // MCP over streamable HTTP. Its tools call this daemon's /v1 API with
    // the key of the MCP request, so they see exactly what the key may see.
    let own = state.config.listen;
    let own_url = if own.ip().is_unspecified() {
        format!("http://127.0.0.1:{}", own.port())
    } else {
        format!("http://{own}")
    };
    let mcp = Router::new()
        .fallback_service(runcell_mcp::http_service(
            own_url,
            state.config.mcp_template.clone(),
        ))
        .layer(axum::middleware::from_fn_with_state(state.clone(), auth));
    Router::new()
        .route("/healthz", get(system::healthz))
        .route("/metrics", get(system::metrics))
        .nest("/v1", v1)
        .nest("/mcp", mcp)
        .layer(panics::catch_panics())
        .layer(axum::middleware::from_fn_with_state(state.clone(), observe))
        .fallback(no_route)
        .layer(axum::extract::DefaultBodyLimit::disable())
        // Outermost: every error, axum's own rejections too, is JSON.
        .layer(axum::middleware::from_fn(rejection::json_errors))
        .with_state(state)
}

/// One span per request (with the sandbox id when the path names one), and
/// API errors counted by route template and status.
async fn observe(State(state): St, req: Request, next: Next) -> Response {
    let route = req
        .extensions()
        .get::<axum::extract::MatchedPath>()
        .map(|p| p.as_str().to_string())
        .unwrap_or_else(|| "unmatched".into());
    let path = req.uri().path().to_string();
    let sandbox = path
        .strip_prefix("/v1/sandboxes/")
        .and_then(|rest| rest.split('/').next())
        .unwrap_or("")
        .to_string();
    let span =
        tracing::info_span!("request", method = %req.method(), route = %route, sandbox = %sandbox);
    let started = std::time::Instant::now();
    let resp = {
        use tracing::Instrument;
        next.run(req).instrument(span.clone()).await
    };
    let status = resp.status();
    span.in_scope(|| {
        tracing::debug!(
            status = status.as_u16(),
            ms = runcell_protocol::units::millis(started.elapsed()),
            "request done"
        )
    });
    if status.is_client_error() || status.is_server_error() {
        state.metrics.error(&route, status.as_u16());
    }
    resp
}

async fn no_route() -> ApiError {
    ApiError::new(StatusCode::NOT_FOUND, "There is no such route in this API.")
}

/// Bearer-token check for every /v1 route.
async fn auth(State(state): St, req: Request, next: Next) -> Response {
    // The API description is public, as /healthz and /metrics are.
    if req.uri().path().ends_with("/openapi.json") {
        return next.run(req).await;
    }
    let header_token = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| {
            let (scheme, token) = v.split_once(' ')?;
            scheme
                .eq_ignore_ascii_case("bearer")
                .then(|| token.trim().to_string())
        });
    let query_token = req.uri().query().and_then(|q| {
        q.split('&')
            .find_map(|kv| kv.strip_prefix("access_token=").map(str::to_string))
    });
    let detail = match header_token.or(query_token) {
        None => "missing bearer token",
        Some(t) => match state
            .registry
            .with_conn(|c| crate::keys::workspace_of(c, &t))
        {
            Ok(Some(ws)) => {
                let mut req = req;
                req.extensions_mut().insert(Workspace(ws));
                return next.run(req).await;
            }
            // In cluster mode, a key of another node's registry.
            Ok(None) => match crate::cluster::forward::key_workspace(&state, &t).await {
                Ok(Some(ws)) => {
                    let mut req = req;
                    req.extensions_mut().insert(Workspace(ws));
                    return next.run(req).await;
                }
                Ok(None) => "invalid api token",
                Err(resp) => return resp,
            },
            Err(e) => {
                return ApiError::internal(format!("The key store failed: {e}")).into_response()
            }
        },
    };
    let mut err = ApiError::new(StatusCode::UNAUTHORIZED, "unauthorized");
    err.extra = Some(
        [("detail".to_string(), Value::from(detail))]
            .into_iter()
            .collect(),
    );
    err.into_response()
}
