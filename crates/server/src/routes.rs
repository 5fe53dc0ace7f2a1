//! The `/v1` routes. Thin: parse, call the core, map errors. Shapes follow
//! the PandaStack v1 sandbox API (shared/pandastack-api.md); runcell's own
//! additions are extra fields the PandaStack clients ignore.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Extension, FromRequest, Path, Query, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::sse::Event as SseEvent;
use axum::response::{IntoResponse, Response};
use axum::routing::{delete as delete_route, get, post};
use axum::{Json, Router};
use runcell_core::{format_size, Output, RunOptions, SandboxLimits, SandboxOptions};
use runcell_egress::NetworkPolicy;
use runcell_protocol::{Command, FileStat};
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::{json, Value};

use crate::error::ApiError;
use crate::openapi::Security as DocSecurity;
use crate::registry::Record;
use crate::repl;
use crate::state::{now_ms, AppState, Entry};
use crate::views::*;

pub(crate) mod validate;

pub(crate) type AppResult<T> = Result<T, ApiError>;
pub(crate) type St = State<Arc<AppState>>;

/// The OpenAPI document, generated from the handlers and their types.
#[derive(utoipa::OpenApi)]
#[openapi(
    info(
        title = "runcell",
        description = "Sandboxes for AI agents: the PandaStack-compatible /v1 API plus runcell's additions. \
Every error is `{\"error\": \"...\"}` with `application/json`."
    ),
    servers((url = "/", description = "This daemon")),
    security(("bearer" = [])),
    modifiers(&DocSecurity),
    tags(
        (name = "sandboxes", description = "Create, list, inspect and delete sandboxes; their lifetime and network"),
        (name = "exec", description = "Run commands and read their output"),
        (name = "files", description = "Files in a sandbox"),
        (name = "code contexts", description = "Stateful interpreters (PandaStack REPL sessions)"),
        (name = "templates", description = "What sandboxes are made from"),
        (name = "account", description = "The caller's key"),
        (name = "system", description = "Health, metrics, this document and MCP; no key needed except for MCP")
    ),
    paths(
        healthz,
        metrics,
        openapi,
        crate::openapi::mcp,
        crate::openapi::mcp_stream,
        crate::openapi::mcp_end_session,
        me,
        create,
        list,
        get_one,
        delete,
        exec,
        exec_stream,
        fs_read,
        fs_write,
        fs_dir,
        fs_stat,
        logs,
        lifecycle,
        set_lifecycle,
        set_network,
        templates,
        template,
        repl::create,
        repl::list,
        repl::run,
        repl::restart,
        repl::delete
    ),
    components(schemas(
        SandboxView,
        LimitsView,
        NetworkView,
        NetworkPolicyReq,
        NetworkPolicyObject,
        ExecView,
        LifecycleView,
        FileView,
        DirView,
        WrittenView,
        TemplateView,
        TemplateDefaultsView,
        MeView,
        ErrorView,
        HealthView,
        ExecStreamEvent,
        LogEvent,
        SessionView,
        CellView,
        ExceptionView
    ))
)]
pub struct ApiDoc;

/// The OpenAPI 3.1 document of this API.
#[utoipa::path(get, path = "/v1/openapi.json", tag = "system", operation_id = "getOpenApi", security(()),
    responses((status = 200, description = "This document", content_type = "application/json", body = Object)))]
async fn openapi() -> Json<utoipa::openapi::OpenApi> {
    Json(crate::openapi::document())
}

/// Liveness: 200 while the daemon serves requests.
#[utoipa::path(get, path = "/healthz", tag = "system", operation_id = "getHealth", security(()),
    responses((status = 200, body = HealthView)))]
async fn healthz() -> Json<HealthView> {
    Json(HealthView {
        status: "ok".into(),
    })
}

/// The daemon's router.
pub fn router(state: Arc<AppState>) -> Router {
    let v1 = Router::new()
        .route("/me", get(me))
        .route("/openapi.json", get(openapi))
        .route("/sandboxes", get(list).post(create))
        .route("/sandboxes/{id}", get(get_one).delete(delete))
        .route("/sandboxes/{id}/exec", post(exec))
        .route("/sandboxes/{id}/exec/stream", post(exec_stream))
        .route("/sandboxes/{id}/fs", get(fs_read).put(fs_write))
        .route("/sandboxes/{id}/fs/dir", get(fs_dir))
        .route("/sandboxes/{id}/fs/stat", get(fs_stat))
        .route(
            "/sandboxes/{id}/lifecycle",
            get(lifecycle).patch(set_lifecycle),
        )
        .route("/sandboxes/{id}/logs", get(logs))
        .route("/sandboxes/{id}/network", axum::routing::patch(set_network))
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
            "/sandboxes/{id}/repl/sessions/{sid}/restart",
            post(repl::restart),
        )
        .route("/templates", get(templates))
        .route("/templates/{name}", get(template))
        .fallback(no_route)
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
        .route("/healthz", get(healthz))
        .route("/metrics", get(metrics))
        .nest("/v1", v1)
        .nest("/mcp", mcp)
        .layer(validate::catch_panics())
        .layer(axum::middleware::from_fn_with_state(state.clone(), observe))
        .fallback(no_route)
        .layer(axum::extract::DefaultBodyLimit::disable())
        // Outermost: every error, axum's own rejections too, is JSON.
        .layer(axum::middleware::from_fn(crate::rejection::json_errors))
        .with_state(state)
}

/// Prometheus metrics (text exposition format 0.0.4).
#[utoipa::path(get, path = "/metrics", tag = "system", operation_id = "getMetrics", security(()),
    responses((status = 200, description = "Prometheus text format", content_type = "text/plain; version=0.0.4; charset=utf-8", body = String)))]
async fn metrics(State(state): St) -> impl IntoResponse {
    let running = state
        .sandboxes
        .read()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .len();
    let pools: Vec<&crate::pool::WarmPool> = state.pools.all().map(|p| p.as_ref()).collect();
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
            ms = started.elapsed().as_millis() as u64,
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
            Ok(None) => "invalid api token",
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

/// The workspace of the caller's key.
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

/// Parses a JSON body; the error names the field that is wrong
/// (`limits.cpu: invalid type ...`).
pub(crate) fn parse_json<T: DeserializeOwned>(bytes: &[u8]) -> AppResult<T> {
    // serde reads a struct from an array of its fields in order
    // (`[null, true]`); no route takes an array, so refuse one.
    if bytes.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'[') {
        return Err(ApiError::bad_request(
            "The request body must be a JSON object, not an array.",
        ));
    }
    let de = &mut serde_json::Deserializer::from_slice(bytes);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let field = e.path().to_string();
        let inner = e.into_inner();
        let data = inner.classify() == serde_json::error::Category::Data;
        if !data || field.is_empty() || field == "." || field == "?" {
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

#[utoipa::path(get, path = "/v1/me", tag = "account", operation_id = "getMe",
    responses((status = 200, body = MeView), (status = 401, description = "Missing or unknown API key", body = ErrorView)))]
async fn me(Extension(ws): Extension<Workspace>) -> Json<MeView> {
    Json(MeView {
        user_id: ws.0,
        email: String::new(),
        current_org: None,
        orgs: Vec::new(),
        auth_method: "token".into(),
    })
}

/// runcell's per-sandbox limits in API form.
#[derive(Debug, Default, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
struct LimitsReq {
    // Numbers are read as sent and checked against their ranges in
    // `validate` (runcell_core::limits), so that a refusal names the field
    // and its range.
    #[schema(value_type = Option<u64>)]
    memory_mb: Option<f64>,
    cpu: Option<f64>,
    #[schema(value_type = Option<u64>)]
    pids: Option<f64>,
    #[schema(value_type = Option<u64>)]
    disk_mb: Option<f64>,
    timeout_seconds: Option<f64>,
    #[schema(value_type = Option<u64>)]
    output_bytes: Option<f64>,
}

#[derive(Debug, Deserialize, utoipa::ToSchema)]
struct CreateReq {
    template: Option<String>,
    #[schema(value_type = Option<i64>)]
    ttl_seconds: Option<f64>,
    persistent: Option<bool>,
    #[serde(default)]
    metadata: BTreeMap<String, String>,
    from_snapshot: Option<String>,
    #[serde(default)]
    limits: Option<LimitsReq>,
    #[serde(default)]
    env: BTreeMap<String, String>,
    /// Network egress policy: `"none"`, `"open"`, or
    /// `{"mode": "allowlist", "allow": ["pypi.org", "*.example.com:443"], "presets": ["package-index"]}`.
    /// Default: the template's, else `none`.
    #[serde(default)]
    #[schema(value_type = Option<NetworkPolicyReq>)]
    network: Option<NetworkPolicy>,
}

/// The network view of a sandbox.
pub(crate) fn network_view(sandbox: &runcell_core::Sandbox) -> NetworkView {
    match sandbox.network() {
        Some(r) => NetworkView {
            mode: r.policy.mode.to_string(),
            allow: r.policy.allow.iter().map(ToString::to_string).collect(),
            presets: r.policy.presets.clone(),
            bytes_in: r.bytes_in,
            bytes_out: r.bytes_out,
            connections_allowed: r.connections_allowed,
            connections_refused: r.connections_refused,
            refused_hosts: r.refused_hosts,
        },
        // No egress socket (made without one, or by an older version and
        // re-attached after a restart): nothing leaves.
        None => NetworkView {
            mode: "none".into(),
            allow: Vec::new(),
            presets: Vec::new(),
            bytes_in: 0,
            bytes_out: 0,
            connections_allowed: 0,
            connections_refused: 0,
            refused_hosts: Vec::new(),
        },
    }
}

fn limits_view(l: &SandboxLimits) -> LimitsView {
    LimitsView {
        memory_mb: l.memory_bytes >> 20,
        cpu: l.cpu_millis as f64 / 1000.0,
        pids: l.pids,
        disk_mb: l.disk_bytes >> 20,
        timeout_seconds: l.timeout.as_secs_f64(),
        output_bytes: l.output_bytes,
    }
}

fn limits_json(l: &SandboxLimits) -> Value {
    serde_json::to_value(limits_view(l)).expect("limits serialize")
}

pub(crate) use runcell_core::rfc3339;

fn sandbox_view(e: &Entry) -> SandboxView {
    let r = e
        .record
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let l = e.sandbox.limits();
    SandboxView {
        id: r.id.clone(),
        template: r.template.clone(),
        cpu: (l.cpu_millis as f64 / 1000.0).ceil().max(1.0) as u64,
        memory_mb: l.memory_bytes >> 20,
        status: "running".into(),
        metadata: r.metadata.clone(),
        created_at: rfc3339(r.created_at),
        persistent: r.persistent,
        ttl_seconds: r.ttl_seconds,
        limits: limits_view(l),
        network: network_view(&e.sandbox),
        boot_ms: None,
    }
}

fn sandbox_json(e: &Entry) -> Value {
    serde_json::to_value(sandbox_view(e)).expect("sandbox serializes")
}

#[utoipa::path(post, path = "/v1/sandboxes", tag = "sandboxes", operation_id = "createSandbox", request_body = CreateReq,
    responses((status = 201, description = "Created and running", body = SandboxView), (status = 400, description = "Invalid input: the error names the field", body = ErrorView), (status = 401, description = "Missing or unknown API key", body = ErrorView), (status = 413, description = "The request body is larger than the daemon allows", body = ErrorView), (status = 429, description = "A per-workspace quota (sandboxes, memory or disk) is reached; retry after Retry-After seconds", body = ErrorView, headers(("Retry-After" = u64, description = "Seconds to wait"))), (status = 503, description = "No capacity, or the sandbox failed to start; retry after Retry-After seconds", body = ErrorView, headers(("Retry-After" = u64, description = "Seconds to wait")))))]
async fn create(
    State(state): St,
    Extension(ws): Extension<Workspace>,
    JsonBody(mut req): JsonBody<CreateReq>,
) -> AppResult<(StatusCode, Json<Value>)> {
    // Keys the caller may not set are the server's to stamp.
    for reserved in ["workspace", "kind", "app.id"] {
        req.metadata.remove(reserved);
    }
    req.metadata.insert("workspace".into(), ws.0.clone());
    if req.from_snapshot.is_some() {
        return Err(ApiError::bad_request(
            "Snapshots are not supported by this runcell version.",
        ));
    }
    let ttl = match req.ttl_seconds {
        Some(t) => validate::ttl(&state, t)?,
        None => state.config.default_ttl_seconds,
    };
    validate::env("env", &req.env)?;
    let requested = req.template.clone().unwrap_or_else(|| "host".into());
    let resolved = resolve_alias(&state, &requested);
    let building_instead = resolved != requested && state.auto_builds.in_progress(&requested);
    if building_instead {
        tracing::info!(
            template = %requested,
            "{requested} is still being built; this sandbox is served from {resolved}"
        );
    }
    let template = state.runtime.template(&resolved).map_err(|_| {
        let mut installed =
            runcell_core::Template::installed(state.config.templates_dir.as_deref());
        installed.extend(state.config.aliases.keys().cloned());
        // An installed template can share its name with an alias: name it once.
        let mut seen = std::collections::HashSet::new();
        installed.retain(|n| seen.insert(n.clone()));
        ApiError::bad_request(format!(
            "unknown template \"{requested}\"; installed templates: {}",
            installed.join(", ")
        ))
    })?;
    // The template's declared defaults, then what the request asks for.
    let mut limits = apply_limits(
        &state,
        template.defaults.apply(state.config.default_limits),
        req.limits.unwrap_or_default(),
    )?;
    // A template's default above the operator's maximum is lowered to it
    // (a request above it was refused by the bounds).
    limits.output_bytes = limits.output_bytes.min(state.config.max_output_bytes);
    // The request's network policy, else the template's, else none.
    let network = match req.network.take() {
        Some(p) => p,
        None => match &template.defaults.network {
            Some(s) => NetworkPolicy::parse_setting(s).map_err(|e| {
                ApiError::bad_request(format!(
                    "The template's default network policy is invalid: {e}"
                ))
            })?,
            None => NetworkPolicy::none(),
        },
    };
    // Capacity: live sandboxes plus creates in flight.
    struct Slot<'a>(&'a std::sync::atomic::AtomicUsize);
    impl Drop for Slot<'_> {
        fn drop(&mut self) {
            self.0.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
        }
    }
    let in_flight = state
        .creating
        .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
    let _slot = Slot(&state.creating);
    let live = state
        .sandboxes
        .read()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .len();
    if live + in_flight >= state.config.max_sandboxes {
        return Err(retry_later(
            StatusCode::SERVICE_UNAVAILABLE,
            format!(
                "no capacity: {live} sandboxes are running and the limit is {}; retry later",
                state.config.max_sandboxes
            ),
            5,
        ));
    }
    // The workspace's own share, held until the sandbox is live.
    let _quota = crate::quota::reserve(&state, &ws.0, &limits)?;
    let started = std::time::Instant::now();
    let (warm, pool) = state.pools.claim(&template.name, &limits);
    if let Some(pool) = pool {
        // Top the pool up behind this request.
        let st = state.clone();
        tokio::spawn(async move { pool.refill(&st.runtime).await });
    }
    let (sandbox, warm_context) = match warm {
        Some(w) => {
            // Pooled sandboxes are made with no network.
            if network.has_egress() {
                if let Err(e) = w.sandbox.set_network(network.clone()).await {
                    let _ = w.sandbox.destroy().await;
                    return Err(ApiError::from(e));
                }
            }
            (w.sandbox, w.context)
        }
        None => (
            create_sandbox(&state, &template, limits, network).await?,
            None,
        ),
    };
    let now = now_ms();
    let record = Record {
        id: sandbox.id().to_string(),
        workspace: ws.0.clone(),
        template: requested,
        metadata: req.metadata,
        limits: limits_json(&limits),
        env: req.env,
        ttl_seconds: ttl,
        persistent: req.persistent.unwrap_or(false),
        created_at: now / 1000,
        last_activity_ms: now,
        status: "running".into(),
        end_reason: None,
    };
    // The policy too, so a restarted daemon serves its egress the same way.
    let recorded = state
        .registry
        .put(&record)
        .and_then(|()| match sandbox.network() {
            Some(n) => state.registry.set_network(&record.id, &n.policy),
            None => Ok(()),
        });
    if let Err(e) = recorded {
        let _ = sandbox.destroy().await;
        return Err(ApiError::internal(format!(
            "The sandbox could not be recorded: {e}"
        )));
    }
    let entry = Arc::new(Entry {
        sandbox,
        record: std::sync::Mutex::new(record),
        template,
        log: crate::logs::SandboxLog::default(),
        persisted: Default::default(),
        warm_context: std::sync::Mutex::new(warm_context),
    });
    state.touch(&entry).await;
    let mut body = sandbox_json(&entry);
    body["boot_ms"] = json!(started.elapsed().as_millis() as u64);
    if building_instead {
        // Served from the alias's target while the template is being built.
        body["alias_of"] = json!(entry.template.name);
        body["building"] = json!(true);
    }
    state
        .metrics
        .creations
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    state.metrics.create_latency.observe(started.elapsed());
    let id = entry.sandbox.id().to_string();
    state
        .sandboxes
        .write()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .insert(id, entry);
    Ok((StatusCode::CREATED, Json(body)))
}

/// A refusal the PandaStack Python client retries: 503/429 with
/// Retry-After and a JSON error.
fn retry_later(status: StatusCode, message: String, after_secs: u64) -> ApiError {
    let mut e = ApiError::new(status, message);
    e.retry_after = Some(after_secs);
    e
}

fn apply_limits(state: &AppState, l: SandboxLimits, req: LimitsReq) -> AppResult<SandboxLimits> {
    let asked = runcell_core::limits::LimitsRequest {
        memory_mb: req.memory_mb,
        cpu: req.cpu,
        pids: req.pids,
        disk_mb: req.disk_mb,
        timeout_seconds: req.timeout_seconds,
        output_bytes: req.output_bytes,
    };
    Ok(validate::bounds(state).apply(l, &asked)?)
}

#[utoipa::path(get, path = "/v1/sandboxes", tag = "sandboxes", operation_id = "listSandboxes", params(("metadata.KEY" = Option<String>, Query, description = "Only sandboxes whose metadata KEY equals the value; several are ANDed")),
    responses((status = 200, body = Vec<SandboxView>), (status = 400, description = "Invalid input: the error names the field", body = ErrorView), (status = 401, description = "Missing or unknown API key", body = ErrorView)))]
async fn list(
    State(state): St,
    Extension(ws): Extension<Workspace>,
    Query(query): Query<Vec<(String, String)>>,
) -> Json<Vec<Value>> {
    let filters: Vec<(String, String)> = query
        .into_iter()
        .filter_map(|(k, v)| k.strip_prefix("metadata.").map(|k| (k.to_string(), v)))
        .collect();
    let entries: Vec<Arc<Entry>> = state
        .sandboxes
        .read()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .values()
        .cloned()
        .collect();
    let mut out: Vec<(i64, Value)> = entries
        .iter()
        .filter(|e| {
            let r = e
                .record
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            r.workspace == ws.0 && filters.iter().all(|(k, v)| r.metadata.get(k) == Some(v))
        })
        .map(|e| {
            let created = e
                .record
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .created_at;
            (created, sandbox_json(e))
        })
        .collect();
    out.sort_by_key(|(t, _)| *t);
    Json(out.into_iter().map(|(_, v)| v).collect())
}

/// A sandbox of the caller's workspace; another workspace's sandbox is
/// answered exactly as a missing one.
/// A fresh sandbox (the warm pool had none for this request).
async fn create_sandbox(
    state: &AppState,
    template: &runcell_core::Template,
    limits: SandboxLimits,
    network: NetworkPolicy,
) -> AppResult<runcell_core::Sandbox> {
    state
        .runtime
        .create(SandboxOptions {
            template: template.name.clone(),
            limits,
            tied_to_process: false,
            max_lifetime: Some(state.config.max_lifetime),
            network: Some(network),
        })
        .await
        .map_err(|e| match e {
            // Nothing is left of a failed start (the jail cleans up), so a
            // retry cannot duplicate anything.
            runcell_core::Error::Jail(_) => retry_later(
                StatusCode::SERVICE_UNAVAILABLE,
                format!(
                    "The sandbox could not be started: {}",
                    ApiError::from(e).message
                ),
                1,
            ),
            other => ApiError::from(other),
        })
}

pub(crate) fn find(state: &AppState, ws: &Workspace, id: &str) -> AppResult<Arc<Entry>> {
    state
        .entry(id)
        .filter(|e| {
            e.record
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .workspace
                == ws.0
        })
        .ok_or_else(|| state.gone(&ws.0, id))
}

#[utoipa::path(get, path = "/v1/sandboxes/{id}", tag = "sandboxes", operation_id = "getSandbox", params(("id" = String, Path, description = "The sandbox id")),
    responses((status = 200, body = SandboxView), (status = 400, description = "Invalid input: the error names the field", body = ErrorView), (status = 401, description = "Missing or unknown API key", body = ErrorView), (status = 404, description = "No such sandbox in the key's workspace", body = ErrorView)))]
async fn get_one(
    State(state): St,
    Extension(ws): Extension<Workspace>,
    Path(id): Path<String>,
) -> AppResult<Json<Value>> {
    let e = find(&state, &ws, &id)?;
    Ok(Json(sandbox_json(&e)))
}

/// Replaces the network policy of a running sandbox.
#[utoipa::path(patch, path = "/v1/sandboxes/{id}/network", tag = "sandboxes", operation_id = "setNetwork", params(("id" = String, Path, description = "The sandbox id")), request_body(content = NetworkPolicyReq, description = "The new policy, as in create"),
    responses((status = 200, body = NetworkView), (status = 400, description = "Invalid input: the error names the field", body = ErrorView), (status = 401, description = "Missing or unknown API key", body = ErrorView), (status = 404, description = "No such sandbox in the key's workspace", body = ErrorView), (status = 409, description = "The sandbox stopped running during the request", body = ErrorView), (status = 413, description = "The request body is larger than the daemon allows", body = ErrorView)))]
async fn set_network(
    State(state): St,
    Extension(ws): Extension<Workspace>,
    Path(id): Path<String>,
    JsonBody(policy): JsonBody<NetworkPolicy>,
) -> AppResult<Json<NetworkView>> {
    let e = find(&state, &ws, &id)?;
    e.sandbox
        .set_network(policy)
        .await
        .map_err(|err| match err {
            runcell_core::Error::NoEgress => ApiError::bad_request(err.to_string()),
            other => ApiError::from(other),
        })?;
    if let Some(n) = e.sandbox.network() {
        state.registry.set_network(&id, &n.policy).map_err(|err| {
            ApiError::internal(format!("The policy could not be recorded: {err}"))
        })?;
    }
    tracing::info!(sandbox = %id, mode = %e.sandbox.network().map(|n| n.policy.mode.to_string()).unwrap_or_default(), "network policy changed");
    Ok(Json(network_view(&e.sandbox)))
}

#[utoipa::path(delete, path = "/v1/sandboxes/{id}", tag = "sandboxes", operation_id = "deleteSandbox", params(("id" = String, Path, description = "The sandbox id")),
    responses((status = 204, description = "Deleted: every process is killed"), (status = 400, description = "Invalid input: the error names the field", body = ErrorView), (status = 401, description = "Missing or unknown API key", body = ErrorView), (status = 404, description = "No such sandbox in the key's workspace", body = ErrorView)))]
async fn delete(
    State(state): St,
    Extension(ws): Extension<Workspace>,
    Path(id): Path<String>,
) -> AppResult<StatusCode> {
    drop(find(&state, &ws, &id)?);
    if state.remove(&id, "deleted by the API").await {
        Ok(StatusCode::NO_CONTENT)
    } else {
        Err(ApiError::no_sandbox())
    }
}

#[derive(Debug, Deserialize, utoipa::ToSchema)]
struct ExecReq {
    cmd: String,
    timeout_seconds: Option<f64>,
    #[serde(default)]
    env: BTreeMap<String, String>,
    cwd: Option<String>,
    /// Keep the processes the command leaves behind running after it returns.
    #[serde(default)]
    background: bool,
}

fn run_options(state: &AppState, e: &Entry, req: &ExecReq) -> AppResult<RunOptions> {
    if req.cmd.trim().is_empty() {
        return Err(ApiError::bad_request("cmd required"));
    }
    let timeout = match req.timeout_seconds {
        Some(t) => validate::bounds(state).timeout("timeout_seconds", t)?,
        None => e.sandbox.limits().timeout,
    };
    let mut env = e
        .record
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .env
        .clone();
    env.extend(req.env.clone());
    validate::run(&req.cmd, &req.env, &env, req.cwd.as_deref())?;
    Ok(RunOptions {
        env,
        cwd: req.cwd.clone(),
        timeout: Some(timeout),
        background: req.background,
        ..RunOptions::default()
    })
}

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

#[utoipa::path(post, path = "/v1/sandboxes/{id}/exec", tag = "exec", operation_id = "execCommand", params(("id" = String, Path, description = "The sandbox id")), request_body = ExecReq,
    responses((status = 200, body = ExecView), (status = 400, description = "Invalid input: the error names the field", body = ErrorView), (status = 401, description = "Missing or unknown API key", body = ErrorView), (status = 404, description = "No such sandbox in the key's workspace", body = ErrorView), (status = 409, description = "The sandbox stopped running during the request", body = ErrorView), (status = 413, description = "The request body is larger than the daemon allows", body = ErrorView), (status = 500, description = "The exec timed out: `error` contains \"timeout\", with the ExecView fields", body = ErrorView)))]
async fn exec(
    State(state): St,
    Extension(ws): Extension<Workspace>,
    Path(id): Path<String>,
    JsonBody(req): JsonBody<ExecReq>,
) -> AppResult<Response> {
    let e = find(&state, &ws, &id)?;
    let opts = run_options(&state, &e, &req)?;
    state.touch(&e).await;
    let started = std::time::Instant::now();
    // The output is held once (at most the output limit per stream, which
    // the agent enforces), then moved into the answer without a copy.
    let (mut stdout, mut stderr) = (Vec::new(), Vec::new());
    let outcome = e
        .sandbox
        .exec_streaming(Command::Shell(req.cmd.clone()), &opts, |s, b| {
            e.log.append(s, b);
            match s {
                Output::Stdout => stdout.extend_from_slice(b),
                Output::Stderr => stderr.extend_from_slice(b),
            }
        })
        .await?;
    state.metrics.exec_latency.observe(started.elapsed());
    state.touch(&e).await;
    let x = &outcome.exit;
    let view = ExecView {
        stdout: with_marker(
            crate::stream::into_text(stdout),
            x.stdout_truncated,
            "stdout",
            x.stdout_bytes,
        ),
        stderr: with_marker(
            crate::stream::into_text(stderr),
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
        return crate::stream::exec_answer(view, len).await;
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
    responses((status = 200, description = "SSE: `stdout`/`stderr` events {chunk}, then one `exit` {exit_code, oom_killed, pids_limit} or `error` {error}", content_type = "text/event-stream", body = ExecStreamEvent), (status = 400, description = "Invalid input: the error names the field", body = ErrorView), (status = 401, description = "Missing or unknown API key", body = ErrorView), (status = 404, description = "No such sandbox in the key's workspace", body = ErrorView), (status = 413, description = "The request body is larger than the daemon allows", body = ErrorView)))]
async fn exec_stream(
    State(state): St,
    Extension(ws): Extension<Workspace>,
    Path(id): Path<String>,
    JsonBody(req): JsonBody<ExecReq>,
) -> AppResult<impl IntoResponse> {
    let e = find(&state, &ws, &id)?;
    let opts = run_options(&state, &e, &req)?;
    state.touch(&e).await;
    let (tx, response) = crate::stream::sse_channel();
    tokio::spawn(async move {
        let result = stream_exec(&e, &req.cmd, &opts, tx).await;
        state.touch(&e).await;
        if let Err(err) = result {
            tracing::info!(sandbox = %e.sandbox.id(), "exec stream ended: {err}");
        }
    });
    Ok(response)
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
}

/// Runs an exec and sends its output as SSE events at the client's pace: a
/// client that reads slowly holds back the program (the pipes, the agent's
/// connection of this exec and the stream's buffer are all bounded); one
/// that stops reading for the stall limit gets an `error` event and the exec
/// is killed.
async fn stream_exec(
    e: &Entry,
    cmd: &str,
    opts: &RunOptions,
    mut tx: crate::stream::SseSender,
) -> Result<(), StreamError> {
    use crate::stream::{error_event, SendError, Utf8Carry};
    use runcell_core::RunEvent;
    let mut run = match e
        .sandbox
        .exec_start(Command::Shell(cmd.to_string()), opts)
        .await
    {
        Ok(r) => r,
        Err(err) => {
            let _ = tx.send(error_event(&ApiError::from(err).message)).await;
            return Ok(());
        }
    };
    let (mut out, mut err) = (Utf8Carry::default(), Utf8Carry::default());
    let outcome = loop {
        let next = match run.next().await {
            Ok(n) => n,
            Err(err) => {
                let _ = tx.send(error_event(&ApiError::from(err).message)).await;
                return Ok(());
            }
        };
        let (stream, bytes) = match next {
            RunEvent::Output(s, b) => (s, b),
            RunEvent::Done(o) => break o,
        };
        e.log.append(stream, &bytes);
        if tx.is_closed() {
            // The client went away: the exec runs on (as a request whose
            // client hung up does), its output only logged.
            continue;
        }
        let (name, text) = match stream {
            Output::Stdout => ("stdout", out.push(&bytes)),
            Output::Stderr => ("stderr", err.push(&bytes)),
        };
        if text.is_empty() {
            continue;
        }
        let event = SseEvent::default()
            .event(name)
            .data(json!({ "chunk": text }).to_string());
        drop(text);
        if tx.send(event).await == Err(SendError::Stalled) {
            tracing::warn!(
                sandbox = %e.sandbox.id(),
                "an exec stream's client read nothing for {} s: ended the stream and killed the exec",
                crate::stream::STALL_LIMIT.as_secs()
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
    let last = if outcome.exit.timed_out {
        error_event(&format!(
            "exec timeout after {}s",
            runcell_core::format_secs(outcome.timeout)
        ))
    } else {
        for m in outcome.messages() {
            let ev = SseEvent::default()
                .event("stderr")
                .data(json!({"chunk": format!("{m}\n")}).to_string());
            if tx.send(ev).await.is_err() {
                return Ok(());
            }
        }
        SseEvent::default().event("exit").data(
            json!({"exit_code": outcome.status(), "oom_killed": outcome.oom_killed, "pids_limit": outcome.pids_limit})
                .to_string(),
        )
    };
    let _ = tx.send(last).await;
    Ok(())
}

#[derive(Debug, Deserialize)]
struct PathQuery {
    path: Option<String>,
}

fn need_path(q: &PathQuery) -> AppResult<&str> {
    match q.path.as_deref() {
        None | Some("") => Err(ApiError::bad_request(
            "The path query parameter is required.",
        )),
        Some(p) => absolute(p),
    }
}

fn absolute(p: &str) -> AppResult<&str> {
    runcell_core::limits::check_path("path", p)?;
    if p.starts_with('/') {
        Ok(p)
    } else {
        Err(ApiError::bad_request(format!(
            "path must be absolute, got \"{p}\""
        )))
    }
}

#[utoipa::path(get, path = "/v1/sandboxes/{id}/fs", tag = "files", operation_id = "readFile", params(("id" = String, Path, description = "The sandbox id"), ("path" = String, Query, pattern = "^/", description = "Absolute path in the sandbox")),
    responses((status = 200, description = "The file's bytes", content_type = "application/octet-stream", body = Vec<u8>), (status = 400, description = "Invalid input: the error names the field", body = ErrorView), (status = 401, description = "Missing or unknown API key", body = ErrorView), (status = 403, description = "The sandbox's user may not do that", body = ErrorView), (status = 404, description = "No such sandbox, or no such file", body = ErrorView), (status = 409, description = "The sandbox stopped running during the request", body = ErrorView), (status = 413, description = "The file is larger than the daemon sends", body = ErrorView)))]
async fn fs_read(
    State(state): St,
    Extension(ws): Extension<Workspace>,
    Path(id): Path<String>,
    Query(q): Query<PathQuery>,
) -> AppResult<Response> {
    let e = find(&state, &ws, &id)?;
    let path = need_path(&q)?;
    state.touch(&e).await;
    let data = e
        .sandbox
        .read_file(path, state.config.max_body_bytes as u64)
        .await?;
    Ok(([(header::CONTENT_TYPE, "application/octet-stream")], data).into_response())
}

#[utoipa::path(put, path = "/v1/sandboxes/{id}/fs", tag = "files", operation_id = "writeFile", params(("id" = String, Path, description = "The sandbox id"), ("path" = String, Query, pattern = "^/", description = "Absolute path in the sandbox")), request_body(content = Vec<u8>, content_type = "application/octet-stream", description = "The file's bytes"),
    responses((status = 200, body = WrittenView), (status = 400, description = "Invalid input: the error names the field", body = ErrorView), (status = 401, description = "Missing or unknown API key", body = ErrorView), (status = 403, description = "The sandbox's user may not do that", body = ErrorView), (status = 404, description = "No such sandbox, or no such file", body = ErrorView), (status = 409, description = "The sandbox stopped running during the request", body = ErrorView), (status = 413, description = "The request body is larger than the daemon allows", body = ErrorView), (status = 507, description = "The sandbox's disk is full", body = ErrorView)))]
async fn fs_write(
    State(state): St,
    Extension(ws): Extension<Workspace>,
    Path(id): Path<String>,
    Query(q): Query<PathQuery>,
    body: RawBody,
) -> AppResult<Json<Value>> {
    let e = find(&state, &ws, &id)?;
    let path = need_path(&q)?.to_string();
    state.touch(&e).await;
    let bytes = e.sandbox.write_file(&path, &body.0).await?;
    Ok(Json(
        serde_json::to_value(WrittenView { path, bytes }).expect("serializes"),
    ))
}

fn entry_json(s: &FileStat) -> Value {
    let kind = if s.is_symlink {
        "l"
    } else if s.is_dir {
        "d"
    } else {
        "f"
    };
    serde_json::to_value(file_view(s, kind)).expect("serializes")
}

fn file_view(s: &FileStat, kind: &str) -> FileView {
    FileView {
        name: s.name.clone(),
        is_dir: s.is_dir,
        size: s.size,
        mode: kind.into(),
        mtime: s.mtime,
        permissions: format!("{:o}", s.mode),
    }
}

#[utoipa::path(get, path = "/v1/sandboxes/{id}/fs/dir", tag = "files", operation_id = "listDirectory", params(("id" = String, Path, description = "The sandbox id"), ("path" = Option<String>, Query, pattern = "^(/.*)?$", description = "Absolute path of a directory; `/` when absent or empty")),
    responses((status = 200, body = DirView), (status = 400, description = "Invalid input: the error names the field", body = ErrorView), (status = 401, description = "Missing or unknown API key", body = ErrorView), (status = 403, description = "The sandbox's user may not do that", body = ErrorView), (status = 404, description = "No such sandbox, or no such file", body = ErrorView), (status = 409, description = "The sandbox stopped running during the request", body = ErrorView)))]
async fn fs_dir(
    State(state): St,
    Extension(ws): Extension<Workspace>,
    Path(id): Path<String>,
    Query(q): Query<PathQuery>,
) -> AppResult<Json<Value>> {
    let e = find(&state, &ws, &id)?;
    let path = q
        .path
        .clone()
        .filter(|p| !p.is_empty())
        .unwrap_or_else(|| "/".into());
    absolute(&path)?;
    let entries = e.sandbox.list_dir(&path).await?;
    let entries: Vec<Value> = entries.iter().map(entry_json).collect();
    Ok(Json(json!({"path": path, "entries": entries})))
}

#[utoipa::path(get, path = "/v1/sandboxes/{id}/fs/stat", tag = "files", operation_id = "statFile", params(("id" = String, Path, description = "The sandbox id"), ("path" = String, Query, pattern = "^/", description = "Absolute path in the sandbox")),
    responses((status = 200, body = FileView), (status = 400, description = "Invalid input: the error names the field", body = ErrorView), (status = 401, description = "Missing or unknown API key", body = ErrorView), (status = 403, description = "The sandbox's user may not do that", body = ErrorView), (status = 404, description = "No such sandbox, or no such file", body = ErrorView), (status = 409, description = "The sandbox stopped running during the request", body = ErrorView)))]
async fn fs_stat(
    State(state): St,
    Extension(ws): Extension<Workspace>,
    Path(id): Path<String>,
    Query(q): Query<PathQuery>,
) -> AppResult<Json<Value>> {
    let e = find(&state, &ws, &id)?;
    let path = need_path(&q)?;
    match e.sandbox.stat(path).await {
        Ok(s) => Ok(Json(entry_json(&s))),
        Err(err) => {
            let mut api = ApiError::from(err);
            if api.status == StatusCode::NOT_FOUND {
                api.message = "file does not exist".into();
            }
            Err(api)
        }
    }
}

#[derive(Debug, Deserialize)]
struct LogsQuery {
    stream: Option<String>,
    follow: Option<String>,
}

/// The output of the sandbox's execs: a plain-text snapshot, or with
/// `follow` (1, true or yes) an SSE stream of `line` events.
#[utoipa::path(get, path = "/v1/sandboxes/{id}/logs", tag = "exec", operation_id = "getLogs", params(("id" = String, Path, description = "The sandbox id"), ("stream" = Option<String>, Query, description = "`stdout`, `stderr` or `both` (default)"), ("follow" = Option<String>, Query, description = "`1`, `true` or `yes`: an SSE stream of `line` events {line} that follows new output")),
    responses((status = 200, description = "The output of the sandbox's execs: plain text, or with follow an SSE stream", content((String = "text/plain; charset=utf-8"), (LogEvent = "text/event-stream"))), (status = 400, description = "Invalid input: the error names the field", body = ErrorView), (status = 401, description = "Missing or unknown API key", body = ErrorView), (status = 404, description = "No such sandbox in the key's workspace", body = ErrorView)))]
async fn logs(
    State(state): St,
    Extension(ws): Extension<Workspace>,
    Path(id): Path<String>,
    Query(q): Query<LogsQuery>,
) -> AppResult<Response> {
    let e = find(&state, &ws, &id)?;
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
    let (mut tx, response) = crate::stream::sse_channel();
    let line_event = |text: &str| {
        SseEvent::default()
            .event("line")
            .data(json!({"line": text}).to_string())
    };
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
            if sent == Err(crate::stream::SendError::Stalled) {
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

fn lifecycle_json(r: &Record) -> Value {
    serde_json::to_value(LifecycleView {
        ttl_seconds: r.ttl_seconds,
        persistent: r.persistent,
        idle_seconds: (now_ms() - r.last_activity_ms).max(0) / 1000,
    })
    .expect("serializes")
}

#[utoipa::path(get, path = "/v1/sandboxes/{id}/lifecycle", tag = "sandboxes", operation_id = "getLifecycle", params(("id" = String, Path, description = "The sandbox id")),
    responses((status = 200, body = LifecycleView), (status = 400, description = "Invalid input: the error names the field", body = ErrorView), (status = 401, description = "Missing or unknown API key", body = ErrorView), (status = 404, description = "No such sandbox in the key's workspace", body = ErrorView)))]
async fn lifecycle(
    State(state): St,
    Extension(ws): Extension<Workspace>,
    Path(id): Path<String>,
) -> AppResult<Json<Value>> {
    let e = find(&state, &ws, &id)?;
    let r = e
        .record
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    Ok(Json(lifecycle_json(&r)))
}

#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
struct LifecycleReq {
    #[schema(value_type = Option<i64>)]
    ttl_seconds: Option<f64>,
    persistent: Option<bool>,
}

#[utoipa::path(patch, path = "/v1/sandboxes/{id}/lifecycle", tag = "sandboxes", operation_id = "setLifecycle", params(("id" = String, Path, description = "The sandbox id")), request_body = LifecycleReq,
    responses((status = 200, body = LifecycleView), (status = 400, description = "Invalid input: the error names the field", body = ErrorView), (status = 401, description = "Missing or unknown API key", body = ErrorView), (status = 404, description = "No such sandbox in the key's workspace", body = ErrorView), (status = 409, description = "The sandbox stopped running during the request", body = ErrorView), (status = 413, description = "The request body is larger than the daemon allows", body = ErrorView)))]
async fn set_lifecycle(
    State(state): St,
    Extension(ws): Extension<Workspace>,
    Path(id): Path<String>,
    JsonBody(req): JsonBody<LifecycleReq>,
) -> AppResult<Json<Value>> {
    let e = find(&state, &ws, &id)?;
    let ttl = req
        .ttl_seconds
        .map(|t| validate::ttl(&state, t))
        .transpose()?;
    let (record, deadline) = {
        let mut r = e
            .record
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(t) = ttl {
            r.ttl_seconds = t;
        }
        if let Some(p) = req.persistent {
            r.persistent = p;
        }
        (r.clone(), state.agent_deadline(&r))
    };
    state
        .registry
        .put(&record)
        .map_err(|err| ApiError::internal(format!("The change could not be recorded: {err}")))?;
    e.sandbox.set_deadline(Some(deadline)).await?;
    Ok(Json(lifecycle_json(&record)))
}

/// The template an alias names, unless a template of that name is installed
/// (an installed `code-interpreter` wins over the built-in alias).
fn resolve_alias(state: &AppState, name: &str) -> String {
    match state.config.aliases.get(name) {
        Some(target) if state.runtime.template(name).is_err() => target.clone(),
        _ => name.to_string(),
    }
}

fn template_json(state: &AppState, name: &str, alias_of: Option<&str>) -> AppResult<Value> {
    let t = state
        .runtime
        .template(alias_of.unwrap_or(name))
        .map_err(ApiError::from)?;
    let l = t.defaults.apply(state.config.default_limits);
    let d = t.defaults;
    Ok(serde_json::to_value(TemplateView {
        name: name.into(),
        rootfs_path: String::new(),
        size_bytes: t.size_bytes,
        cpu: (l.cpu_millis as f64 / 1000.0).ceil().max(1.0) as u64,
        memory_mb: l.memory_bytes >> 20,
        is_global: true,
        description: t.description,
        alias_of: alias_of.map(str::to_string),
        defaults: TemplateDefaultsView {
            memory_bytes: d.memory_bytes,
            cpu_millis: d.cpu_millis,
            timeout_secs: d.timeout_secs,
            network: d.network,
            preload: d.preload,
        },
        created_at: (t.created_unix > 0).then_some(t.created_unix),
    })
    .expect("serializes"))
}

#[utoipa::path(get, path = "/v1/templates", tag = "templates", operation_id = "listTemplates",
    responses((status = 200, body = Vec<TemplateView>), (status = 401, description = "Missing or unknown API key", body = ErrorView)))]
async fn templates(State(state): St) -> AppResult<Json<Vec<Value>>> {
    let mut out = Vec::new();
    for name in runcell_core::Template::installed(state.config.templates_dir.as_deref()) {
        out.push(template_json(&state, &name, None)?);
    }
    for (alias, target) in &state.config.aliases {
        if resolve_alias(&state, alias) == *alias {
            continue; // an installed template of that name is listed already
        }
        if let Ok(mut v) = template_json(&state, alias, Some(target)) {
            with_build(&state, alias, &mut v);
            out.push(v);
        }
    }
    Ok(Json(out))
}

#[utoipa::path(get, path = "/v1/templates/{name}", tag = "templates", operation_id = "getTemplate", params(("name" = String, Path, description = "Template name or alias")),
    responses((status = 200, body = TemplateView), (status = 400, description = "Invalid input: the error names the field", body = ErrorView), (status = 401, description = "Missing or unknown API key", body = ErrorView), (status = 404, description = "No such template", body = ErrorView)))]
async fn template(State(state): St, Path(name): Path<String>) -> AppResult<Json<Value>> {
    let resolved = resolve_alias(&state, &name);
    let alias = (resolved != name).then_some(resolved);
    let mut view = template_json(&state, &name, alias.as_deref())
        .map_err(|_| ApiError::new(StatusCode::NOT_FOUND, "template not found"))?;
    with_build(&state, &name, &mut view);
    Ok(Json(view))
}

/// Adds a background build's progress (`--auto-build`) to a template view:
/// `build` {state, step, error, ...}, and `building: true` while an alias
/// serves it in the meantime.
fn with_build(state: &AppState, name: &str, view: &mut Value) {
    if let Some(status) = state.auto_builds.status(name) {
        view["build"] = json!(status);
        view["building"] = json!(state.auto_builds.in_progress(name));
    }
}
