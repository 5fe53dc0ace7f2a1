//! The `/v1/cluster` routes: `GET /v1/cluster` (this node, the live nodes,
//! the etcd requests made), `POST /v1/cluster/drain` (take no creates) and
//! `DELETE /v1/cluster/drain` (take creates again). `?node=NAME` names
//! another node: the request is forwarded to it (behind a Service the node
//! that answers is anyone's). A daemon started without `--cluster` answers
//! all three with a 404 saying so.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use axum::extract::{OriginalUri, Query, Request, State};
use axum::http::{StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use utoipa::ToSchema;

use super::forward::{forward, store_down, FORWARDED_BY};
use super::{Cluster, EtcdOps, NodeInfo};
use crate::error::ApiError;
use crate::http::kit::St;
use crate::state::AppState;
use crate::views::ErrorView;

/// `GET /v1/cluster`, and the answer of a drain.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct ClusterView {
    /// The node that answered (the drained one, for a drain).
    node: String,
    /// Whether that node drains: it takes no creates; its sandboxes go on.
    /// Kept in its registry, so it survives a restart.
    draining: bool,
    /// Whether the node list below is fresh (etcd answered within 4 s).
    store_reachable: bool,
    /// The live nodes (with a lease), by name; empty while etcd is
    /// unreachable.
    nodes: Vec<NodeInfo>,
    /// etcd requests this node made since it started.
    etcd_ops: EtcdOpsView,
}

/// etcd requests made by a node.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct EtcdOpsView {
    /// Made while serving API requests (routing, keys, publishing a create
    /// or a delete, listing).
    requests: OpsView,
    /// Made by the once-a-second round (lease, node record, keys, sandbox
    /// records, node list).
    background: OpsView,
}

/// Reads and writes.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct OpsView {
    /// Range requests.
    reads: u64,
    /// Puts, deletes and transactions.
    writes: u64,
}

impl OpsView {
    fn of(ops: &EtcdOps) -> Self {
        OpsView {
            reads: ops.reads.load(Ordering::Relaxed),
            writes: ops.writes.load(Ordering::Relaxed),
        }
    }
}

fn view(cluster: &Cluster) -> ClusterView {
    let nodes = cluster.live_nodes();
    let store_reachable = nodes.is_some();
    let mut list: Vec<NodeInfo> = nodes.unwrap_or_default().into_values().collect();
    list.sort_by(|a, b| a.name.cmp(&b.name));
    ClusterView {
        node: cluster.name().into(),
        draining: cluster.is_draining(),
        store_reachable,
        nodes: list,
        etcd_ops: EtcdOpsView {
            requests: OpsView::of(&cluster.ops),
            background: OpsView::of(&cluster.background),
        },
    }
}

/// The 404 of a daemon without `--cluster`.
fn not_clustered() -> Response {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "This daemon is not part of a cluster: it was started without --cluster.",
    )
    .into_response()
}

/// This node, the live nodes of the cluster (address, capacity, free
/// slots, templates, backends, labels, draining) and the etcd requests
/// this node made.
#[utoipa::path(get, path = "/v1/cluster", tag = "cluster", operation_id = "getCluster",
    responses(
        (status = 200, description = "This node and the live nodes", body = ClusterView),
        (status = 401, description = "Missing or unknown API key", body = ErrorView),
        (status = 404, description = "This daemon is not part of a cluster (started without --cluster)", body = ErrorView)))]
pub(crate) async fn status(State(state): St) -> Response {
    match &state.cluster {
        Some(c) => axum::Json(view(c)).into_response(),
        None => not_clustered(),
    }
}

/// Drains a node: it takes no creates (placement skips it, and a create
/// that names it is a 503) until it is undrained; its sandboxes go on
/// until deleted or expired. The flag is kept in the node's registry, so
/// it survives a restart of the node.
#[utoipa::path(post, path = "/v1/cluster/drain", tag = "cluster", operation_id = "drainNode",
    params(("node" = Option<String>, Query, description = "The node to drain (default: the node that answers); the request is forwarded to it")),
    responses(
        (status = 200, description = "The node drains; its view", body = ClusterView),
        (status = 401, description = "Missing or unknown API key", body = ErrorView),
        (status = 404, description = "No live node of that name, or this daemon is not part of a cluster", body = ErrorView),
        (status = 500, description = "The node's registry could not record the flag (it is unchanged)", body = ErrorView),
        (status = 503, description = "etcd is unreachable (the node cannot be looked up) or the node is lost; retry after Retry-After seconds", body = ErrorView,
            headers(("Retry-After" = u64, description = "Seconds to wait")))))]
pub(crate) async fn drain(
    State(state): St,
    OriginalUri(uri): OriginalUri,
    req: Request,
) -> Response {
    set(&state, true, uri, req).await
}

/// Undrains a node: it takes creates again.
#[utoipa::path(delete, path = "/v1/cluster/drain", tag = "cluster", operation_id = "undrainNode",
    params(("node" = Option<String>, Query, description = "The node to undrain (default: the node that answers); the request is forwarded to it")),
    responses(
        (status = 200, description = "The node takes creates again; its view", body = ClusterView),
        (status = 401, description = "Missing or unknown API key", body = ErrorView),
        (status = 404, description = "No live node of that name, or this daemon is not part of a cluster", body = ErrorView),
        (status = 500, description = "The node's registry could not record the flag (it is unchanged)", body = ErrorView),
        (status = 503, description = "etcd is unreachable (the node cannot be looked up) or the node is lost; retry after Retry-After seconds", body = ErrorView,
            headers(("Retry-After" = u64, description = "Seconds to wait")))))]
pub(crate) async fn undrain(
    State(state): St,
    OriginalUri(uri): OriginalUri,
    req: Request,
) -> Response {
    set(&state, false, uri, req).await
}

async fn set(state: &Arc<AppState>, on: bool, uri: Uri, req: Request) -> Response {
    let Some(cluster) = state.cluster.clone() else {
        return not_clustered();
    };
    let target = Query::<HashMap<String, String>>::try_from_uri(&uri)
        .ok()
        .and_then(|q| q.0.get("node").cloned())
        .filter(|n| n != cluster.name());
    // A request another node forwarded is always for this node.
    let forwarded = req.headers().contains_key(FORWARDED_BY);
    if let Some(name) = target.filter(|_| !forwarded) {
        return match cluster.node(&name).await {
            Ok(Some(n)) => forward(&cluster, &n, None, uri, req).await,
            Ok(None) => ApiError::new(
                StatusCode::NOT_FOUND,
                format!(
                    "Node {} is not in the cluster (no live lease).",
                    crate::http::kit::clip(name)
                ),
            )
            .into_response(),
            Err(e) => store_down("the node to drain cannot be looked up", &e),
        };
    }
    if let Err(e) = cluster.set_draining(state, on) {
        tracing::warn!("{e}");
        return ApiError::internal(format!("{e}")).into_response();
    }
    if on {
        tracing::info!("draining: this node takes no more creates (recorded in its registry)");
    } else {
        tracing::info!("no longer draining: this node takes creates again");
    }
    axum::Json(view(&cluster)).into_response()
}
