//! The routes that are about the daemon, not a sandbox: health, metrics
//! and the caller's key.

use axum::extract::{Extension, State};
use axum::http::header;
use axum::response::IntoResponse;
use axum::Json;

use super::kit::{St, Workspace};
use crate::views::{ErrorView, HealthView, MeView};

/// Liveness: 200 while the daemon serves requests.
#[utoipa::path(get, path = "/healthz", tag = "system", operation_id = "getHealth", security(()),
    responses((status = 200, body = HealthView)))]
pub(crate) async fn healthz() -> Json<HealthView> {
    Json(HealthView {
        status: "ok".into(),
    })
}

/// Prometheus metrics (text exposition format 0.0.4).
#[utoipa::path(get, path = "/metrics", tag = "system", operation_id = "getMetrics", security(()),
    responses((status = 200, description = "Prometheus text format", content_type = "text/plain; version=0.0.4; charset=utf-8", body = String)))]
pub(crate) async fn metrics(State(state): St) -> impl IntoResponse {
    let running = state
        .sandboxes
        .read()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .len();
    let pools: Vec<_> = state.pools.all().iter().map(|p| p.sample()).collect();
    let mut text = state.metrics.render_with_pools(
        &[("running", running)],
        state.runtime.standby_ready(),
        &pools,
    );
    crate::metrics::render_egress(&mut text, &state.runtime.egress().totals);
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
}

#[utoipa::path(get, path = "/v1/me", tag = "account", operation_id = "getMe",
    responses((status = 200, body = MeView), (status = 401, description = "Missing or unknown API key", body = ErrorView)))]
pub(crate) async fn me(Extension(ws): Extension<Workspace>) -> Json<MeView> {
    Json(MeView {
        user_id: ws.0,
        email: String::new(),
        current_org: None,
        orgs: Vec::new(),
        auth_method: "token".into(),
    })
}
