//! `/v1/sandboxes`: create, list, inspect, delete, lifecycle.

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::extract::{Extension, Query};
use axum::http::StatusCode;
use axum::Json;
use runcell_egress::NetworkPolicy;
use serde::{Deserialize, Serialize};

use super::kit::{Addressed, AppResult, JsonBody, Sandboxed, St, Workspace};
use super::network::network_view;
use crate::limits::LimitsReq;
use crate::registry::Record;
use crate::service::{CreateSpec, Created, LifecycleChange, Service};
use crate::state::{now_ms, AppState, Entry};
use crate::views::{ErrorView, LifecycleView, NetworkPolicyReq, SandboxView};

#[derive(Debug, Default, Deserialize, utoipa::ToSchema)]
pub(crate) struct CreateReq {
    template: Option<String>,
    #[schema(value_type = Option<i64>)]
    ttl_seconds: Option<f64>,
    persistent: Option<bool>,
    /// The caller's string pairs, kept with the sandbox: at most 64 keys,
    /// a key 256 bytes, a value 4 KiB, 16 KiB in all.
    #[serde(default)]
    metadata: BTreeMap<String, String>,
    from_snapshot: Option<String>,
    #[serde(default)]
    limits: Option<LimitsReq>,
    #[serde(default)]
    pub(super) env: BTreeMap<String, String>,
    /// Network egress policy: `"none"`, `"open"`, or
    /// `{"mode": "allowlist", "allow": ["pypi.org", "*.example.com:443"], "presets": ["package-index"]}`.
    /// Default: the template's, else `none`.
    #[serde(default)]
    #[schema(value_type = Option<NetworkPolicyReq>)]
    network: Option<NetworkPolicy>,
    /// Isolation backend (runcell extension): `jail` (namespaces, seccomp,
    /// Landlock, cgroups), `gvisor` (runsc's user-space kernel) or
    /// `microvm` (a QEMU microVM). Default: the template's
    /// `runcell.isolation` label, else the daemon's `--default-isolation`.
    /// One this host cannot run is a 400 saying why (`GET /v1/system`).
    #[serde(default)]
    #[schema(value_type = Option<crate::views::IsolationName>)]
    isolation: Option<runcell_core::backend::Isolation>,
    /// What the sandbox becomes when its idle TTL runs out (runcell
    /// extension): `delete`, or `hibernate` (its processes end, its files
    /// stay, the next call wakes it). Default: `hibernate` for a persistent
    /// sandbox when the daemon runs with `--idle-hibernate`, else `delete`.
    #[serde(default)]
    on_idle: Option<crate::snapshots::OnIdle>,
    /// Volumes to mount (`POST /v1/volumes` makes them): each at
    /// `/mnt/<name>` unless `path` says where; read-write unless
    /// `read_only`. A volume has one read-write sandbox at a time.
    #[serde(default)]
    volumes: Vec<crate::volumes::VolumeAttach>,
    /// Cluster mode (runcell extension): the node to create the sandbox on,
    /// by name (`GET /v1/cluster` lists the nodes). One without a live
    /// lease is a 503. A single node ignores it.
    // Read by the cluster layer (`cluster::forward::place`) from the body.
    #[allow(dead_code)]
    node: Option<String>,
    /// Cluster mode (runcell extension): labels the node must carry, e.g.
    /// `{"zone": "a"}` (every pair must match, as a Kubernetes
    /// `nodeSelector`; nodes get theirs from `runcell serve --node-label`).
    /// The least loaded matching node gets the sandbox; no live matching
    /// node is a 503 naming the selector and the nodes' labels, a
    /// malformed selector (Kubernetes label syntax) a 400. A single node
    /// checks its syntax and ignores it.
    #[serde(default)]
    node_selector: Option<BTreeMap<String, String>>,
}

impl CreateReq {
    /// Checks the syntax of `node_selector` (a single node ignores it).
    pub(crate) fn check_selector(&self) -> AppResult<()> {
        match &self.node_selector {
            Some(selector) => crate::cluster::labels::check_selector(selector)
                .map_err(|e| crate::error::ApiError::bad_request(format!("node_selector: {e}"))),
            None => Ok(()),
        }
    }
}

impl From<CreateReq> for CreateSpec {
    fn from(r: CreateReq) -> Self {
        CreateSpec {
            template: r.template,
            ttl_seconds: r.ttl_seconds,
            persistent: r.persistent,
            metadata: r.metadata,
            from_snapshot: r.from_snapshot,
            limits: r.limits,
            env: r.env,
            network: r.network,
            isolation: r.isolation,
            lineage: crate::snapshots::Lineage {
                on_idle: r.on_idle,
                ..Default::default()
            },
            volumes: r.volumes,
            ..CreateSpec::default()
        }
    }
}

/// A live sandbox's view.
pub(crate) fn sandbox_view(state: &Arc<AppState>, e: &Entry) -> SandboxView {
    let r = e
        .record
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let l = e.sandbox.limits();
    let lineage = Service(state).lineage_of(&r.id);
    SandboxView {
        on_idle: Service(state).on_idle(&r, &lineage),
        from_snapshot: lineage.from_snapshot,
        forked_from: lineage.forked_from,
        state_lost: lineage.state_lost,
        volumes: crate::volumes::shown(&lineage.volumes),
        id: r.id.clone(),
        template: r.template.clone(),
        cpu: crate::limits::whole_cores(l),
        memory_mb: l.memory_bytes >> 20,
        status: if e.sandbox.is_paused() {
            "paused"
        } else {
            "running"
        }
        .into(),
        metadata: r.metadata.clone(),
        created_at: runcell_core::rfc3339(r.created_at),
        persistent: r.persistent,
        ttl_seconds: r.ttl_seconds,
        limits: crate::limits::view(l),
        network: network_view(&e.sandbox),
        isolation: r.isolation.as_str().into(),
        boot_ms: None,
    }
}

/// A hibernated sandbox's view, from its record.
pub(crate) fn record_view(state: &Arc<AppState>, r: &Record) -> SandboxView {
    let l = r.limits.over(state.config.default_limits);
    let lineage = Service(state).lineage_of(&r.id);
    let policy = state.registry.network(&r.id).ok().flatten();
    SandboxView {
        id: r.id.clone(),
        template: r.template.clone(),
        cpu: crate::limits::whole_cores(&l),
        memory_mb: l.memory_bytes >> 20,
        status: r.status.clone(),
        metadata: r.metadata.clone(),
        created_at: runcell_core::rfc3339(r.created_at),
        persistent: r.persistent,
        ttl_seconds: r.ttl_seconds,
        limits: crate::limits::view(&l),
        network: crate::views::NetworkView {
            mode: policy
                .as_ref()
                .map(|p| p.mode.to_string())
                .unwrap_or_else(|| "none".into()),
            allow: policy
                .as_ref()
                .map(|p| p.allow.iter().map(ToString::to_string).collect())
                .unwrap_or_default(),
            presets: policy.map(|p| p.presets).unwrap_or_default(),
            bytes_in: 0,
            bytes_out: 0,
            connections_allowed: 0,
            connections_refused: 0,
            refused_hosts: Vec::new(),
        },
        isolation: r.isolation.as_str().into(),
        boot_ms: None,
        on_idle: Service(state).on_idle(r, &lineage),
        from_snapshot: lineage.from_snapshot,
        forked_from: lineage.forked_from,
        state_lost: lineage.state_lost,
        volumes: crate::volumes::shown(&lineage.volumes),
    }
}

/// The answer to a create: the sandbox, and when the requested template is
/// an alias (not installed yet, or being built), what serves it.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub(crate) struct CreatedView {
    #[serde(flatten)]
    sandbox: SandboxView,
    /// The template the sandbox was made from when the requested one is an
    /// alias (e.g. `code-interpreter` served from `host` until installed).
    #[serde(skip_serializing_if = "Option::is_none")]
    alias_of: Option<String>,
    /// `true` while the requested template is being built.
    #[serde(skip_serializing_if = "Option::is_none")]
    building: Option<bool>,
}

#[utoipa::path(post, path = "/v1/sandboxes", tag = "sandboxes", operation_id = "createSandbox", request_body = CreateReq,
    responses((status = 409, description = "A volume asked for read-write is attached read-write elsewhere", body = ErrorView), (status = 404, description = "from_snapshot names no snapshot of the key's workspace", body = ErrorView), (status = 201, description = "Created and running", body = CreatedView), (status = 400, description = "Invalid input: the error names the field", body = ErrorView), (status = 401, description = "Missing or unknown API key", body = ErrorView), (status = 413, description = "The request body is larger than the daemon allows", body = ErrorView), (status = 429, description = "A per-workspace quota (sandboxes, memory or disk) is reached; retry after Retry-After seconds", body = ErrorView, headers(("Retry-After" = u64, description = "Seconds to wait"))), (status = 503, description = "No capacity, or the sandbox failed to start, or (cluster mode) no live node is named by `node` or matches `node_selector`, or the node named is draining (the message names them); retry after Retry-After seconds", body = ErrorView, headers(("Retry-After" = u64, description = "Seconds to wait")))))]
pub(crate) async fn create(
    axum::extract::State(state): St,
    Extension(ws): Extension<Workspace>,
    JsonBody(req): JsonBody<CreateReq>,
) -> AppResult<(StatusCode, Json<CreatedView>)> {
    req.check_selector()?;
    let created = Service(&state).create_sandbox(&ws.0, req.into()).await?;
    Ok((StatusCode::CREATED, Json(created_view(&state, created))))
}

/// The answer to a create.
pub(crate) fn created_view(state: &Arc<AppState>, created: Created) -> CreatedView {
    let mut sandbox = sandbox_view(state, &created.entry);
    sandbox.boot_ms = Some(runcell_protocol::units::millis(created.boot));
    // Served from the alias's target (while the template is being built,
    // or because no template of that name is installed).
    CreatedView {
        sandbox,
        alias_of: created.alias_of,
        building: created.building_instead.then_some(true),
    }
}

#[utoipa::path(get, path = "/v1/sandboxes", tag = "sandboxes", operation_id = "listSandboxes", params(("metadata.KEY" = Option<String>, Query, description = "Only sandboxes whose metadata KEY equals the value; several are ANDed")),
    responses((status = 200, body = Vec<SandboxView>), (status = 400, description = "Invalid input: the error names the field", body = ErrorView), (status = 401, description = "Missing or unknown API key", body = ErrorView)))]
pub(crate) async fn list(
    axum::extract::State(state): St,
    Extension(ws): Extension<Workspace>,
    Query(query): Query<Vec<(String, String)>>,
) -> Json<Vec<SandboxView>> {
    let filters: Vec<(String, String)> = query
        .into_iter()
        .filter_map(|(k, v)| k.strip_prefix("metadata.").map(|k| (k.to_string(), v)))
        .collect();
    let entries = Service(&state).list(&ws.0, &filters);
    let mut views: Vec<SandboxView> = entries.iter().map(|e| sandbox_view(&state, e)).collect();
    views.extend(
        Service(&state)
            .list_hibernated(&ws.0, &filters)
            .iter()
            .map(|r| record_view(&state, r)),
    );
    Json(views)
}

#[utoipa::path(get, path = "/v1/sandboxes/{id}", tag = "sandboxes", operation_id = "getSandbox", params(("id" = String, Path, description = "The sandbox id")),
    responses((status = 200, body = SandboxView), (status = 400, description = "Invalid input: the error names the field", body = ErrorView), (status = 401, description = "Missing or unknown API key", body = ErrorView), (status = 404, description = "No such sandbox in the key's workspace", body = ErrorView)))]
pub(crate) async fn get_one(
    axum::extract::State(state): St,
    sandbox: Addressed,
) -> Json<SandboxView> {
    Json(match sandbox {
        Addressed::Live(e) => sandbox_view(&state, &e),
        Addressed::Hibernated(r) => record_view(&state, &r),
    })
}

#[utoipa::path(delete, path = "/v1/sandboxes/{id}", tag = "sandboxes", operation_id = "deleteSandbox", params(("id" = String, Path, description = "The sandbox id")),
    responses((status = 204, description = "Deleted: every process is killed"), (status = 400, description = "Invalid input: the error names the field", body = ErrorView), (status = 401, description = "Missing or unknown API key", body = ErrorView), (status = 404, description = "No such sandbox in the key's workspace", body = ErrorView)))]
pub(crate) async fn delete(
    axum::extract::State(state): St,
    sandbox: Addressed,
) -> AppResult<StatusCode> {
    let e = match sandbox {
        Addressed::Live(e) => e,
        Addressed::Hibernated(r) => {
            Service(&state).delete_hibernated(&r.id, "deleted by the API")?;
            return Ok(StatusCode::NO_CONTENT);
        }
    };
    let id = e.sandbox.id().to_string();
    // Not held while it is removed (its teardown then runs in the background).
    drop(e);
    Service(&state).kill(&id).await?;
    Ok(StatusCode::NO_CONTENT)
}

fn lifecycle_view(r: &Record) -> LifecycleView {
    LifecycleView {
        ttl_seconds: r.ttl_seconds,
        persistent: r.persistent,
        idle_seconds: (now_ms() - r.last_activity_ms).max(0) / 1000,
    }
}

#[utoipa::path(get, path = "/v1/sandboxes/{id}/lifecycle", tag = "sandboxes", operation_id = "getLifecycle", params(("id" = String, Path, description = "The sandbox id")),
    responses((status = 200, body = LifecycleView), (status = 400, description = "Invalid input: the error names the field", body = ErrorView), (status = 401, description = "Missing or unknown API key", body = ErrorView), (status = 404, description = "No such sandbox in the key's workspace", body = ErrorView)))]
pub(crate) async fn lifecycle(sandbox: Addressed) -> Json<LifecycleView> {
    match sandbox {
        Addressed::Live(e) => {
            let r = e
                .record
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            Json(lifecycle_view(&r))
        }
        Addressed::Hibernated(r) => Json(lifecycle_view(&r)),
    }
}

#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct LifecycleReq {
    #[schema(value_type = Option<i64>)]
    ttl_seconds: Option<f64>,
    persistent: Option<bool>,
}

#[utoipa::path(patch, path = "/v1/sandboxes/{id}/lifecycle", tag = "sandboxes", operation_id = "setLifecycle", params(("id" = String, Path, description = "The sandbox id")), request_body = LifecycleReq,
    responses((status = 200, body = LifecycleView), (status = 400, description = "Invalid input: the error names the field", body = ErrorView), (status = 401, description = "Missing or unknown API key", body = ErrorView), (status = 404, description = "No such sandbox in the key's workspace", body = ErrorView), (status = 409, description = "The sandbox stopped running during the request", body = ErrorView), (status = 413, description = "The request body is larger than the daemon allows", body = ErrorView)))]
pub(crate) async fn set_lifecycle(
    axum::extract::State(state): St,
    Sandboxed(e, JsonBody(req)): Sandboxed<JsonBody<LifecycleReq>>,
) -> AppResult<Json<LifecycleView>> {
    let change = LifecycleChange {
        ttl_seconds: req.ttl_seconds,
        persistent: req.persistent,
    };
    let record = Service(&state).set_lifecycle(&e, change).await?;
    Ok(Json(lifecycle_view(&record)))
}
