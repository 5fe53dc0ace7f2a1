//! Pause and resume, snapshots (`/v1/sandboxes/{id}/snapshots`,
//! `/v1/snapshots`) and forks (`fork`, `fork-tree`, `promote`).

use std::collections::BTreeMap;

use axum::extract::{Extension, Path, Query};
use axum::http::StatusCode;
use axum::Json;
use serde::{Deserialize, Serialize};

use super::kit::{Addressed, AppResult, OptionalJson, OwnedSandbox, Sandboxed, St, Workspace};
use super::sandboxes::sandbox_view;
use crate::error::ApiError;
use crate::service::Service;
use crate::snapshots::{ForkSpec, Snapshot};
use crate::state::AppState;
use crate::views::{ErrorView, SandboxView};

/// A snapshot: a sandbox's files at one instant.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub(crate) struct SnapshotView {
    /// Its id (`snap-…`).
    id: String,
    /// The sandbox it was taken of.
    sandbox_id: String,
    /// The owning workspace.
    workspace: String,
    /// The sandbox's template (a create from the snapshot uses it).
    template: String,
    /// RFC 3339.
    created_at: String,
    /// Bytes its own layer takes on disk (what the sandbox wrote), and its
    /// memory image where it has one.
    size_bytes: u64,
    /// Whether memory (running processes, code contexts' variables) is
    /// part of it: never with the namespace jail, which saves files only,
    /// nor with a microVM (which saves memory only to hibernate); with
    /// gVisor unless the checkpoint failed or the sandbox was paused.
    memory: bool,
}

fn snapshot_view(state: &std::sync::Arc<AppState>, s: Snapshot) -> SnapshotView {
    SnapshotView {
        memory: Service(state).snapshot_has_memory(&s.id),
        id: s.id,
        sandbox_id: s.sandbox_id,
        workspace: s.workspace,
        template: s.template,
        created_at: runcell_core::rfc3339(s.created_ms / 1000),
        size_bytes: s.size_bytes,
    }
}

/// The list of snapshots.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub(crate) struct SnapshotList {
    snapshots: Vec<SnapshotView>,
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/pause", tag = "sandboxes", operation_id = "pauseSandbox", params(("id" = String, Path, description = "The sandbox id")),
    responses((status = 400, description = "The sandbox's isolation cannot do this (the error says which)", body = ErrorView), (status = 204, description = "Paused: its processes are frozen and keep their memory; exec, files and code answer 409 until it is resumed; the idle TTL does not run"), (status = 401, description = "Missing or unknown API key", body = ErrorView), (status = 404, description = "No such sandbox in the key's workspace", body = ErrorView), (status = 409, description = "Already paused", body = ErrorView)))]
pub(crate) async fn pause(
    axum::extract::State(state): St,
    OwnedSandbox(e): OwnedSandbox,
) -> AppResult<StatusCode> {
    Service(&state).set_paused(&e, true).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/hibernate", tag = "sandboxes", operation_id = "hibernateSandbox", params(("id" = String, Path, description = "The sandbox id")),
    responses((status = 409, description = "The sandbox stopped running", body = ErrorView), (status = 204, description = "Hibernated (or already): its processes ended and its memory is freed; its files are kept, and the next exec, file or code call wakes it. Code contexts do not survive (`state_lost`), except in a gVisor sandbox or a microVM, whose memory is saved (runsc checkpoint; QEMU's migration to a file) and restored at the wake."), (status = 400, description = "Its isolation cannot save its files", body = ErrorView), (status = 401, description = "Missing or unknown API key", body = ErrorView), (status = 404, description = "No such sandbox in the key's workspace", body = ErrorView)))]
pub(crate) async fn hibernate(
    axum::extract::State(state): St,
    sandbox: Addressed,
) -> AppResult<StatusCode> {
    if let Addressed::Live(e) = sandbox {
        Service(&state).hibernate(e).await?;
    }
    Ok(StatusCode::NO_CONTENT)
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/wake", tag = "sandboxes", operation_id = "wakeSandbox", params(("id" = String, Path, description = "The sandbox id")),
    responses((status = 204, description = "Running (woken if it was hibernated)"), (status = 401, description = "Missing or unknown API key", body = ErrorView), (status = 404, description = "No such sandbox in the key's workspace", body = ErrorView), (status = 503, description = "It could not be woken", body = ErrorView)))]
pub(crate) async fn wake(
    axum::extract::State(state): St,
    Extension(ws): Extension<Workspace>,
    sandbox: Addressed,
) -> AppResult<StatusCode> {
    if let Addressed::Hibernated(r) = sandbox {
        Service(&state).wake(&ws.0, &r.id).await?;
    }
    Ok(StatusCode::NO_CONTENT)
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/resume", tag = "sandboxes", operation_id = "resumeSandbox", params(("id" = String, Path, description = "The sandbox id")),
    responses((status = 400, description = "The sandbox's isolation cannot do this (the error says which)", body = ErrorView), (status = 204, description = "Running again where it was"), (status = 401, description = "Missing or unknown API key", body = ErrorView), (status = 404, description = "No such sandbox in the key's workspace", body = ErrorView), (status = 409, description = "Not paused", body = ErrorView)))]
pub(crate) async fn resume(
    axum::extract::State(state): St,
    OwnedSandbox(e): OwnedSandbox,
) -> AppResult<StatusCode> {
    Service(&state).set_paused(&e, false).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/snapshots", tag = "snapshots", operation_id = "snapshotSandbox", params(("id" = String, Path, description = "The sandbox id")),
    responses((status = 409, description = "The sandbox stopped running", body = ErrorView), (status = 400, description = "The sandbox's isolation cannot do this (the error says which)", body = ErrorView), (status = 201, description = "Its files now, saved (the sandbox is frozen for the copy and runs on); a gVisor sandbox's or a microVM's memory too (`memory: true`: gVisor is checkpointed, which stops it for about a second, and restored in place; a microVM's memory migrates to a file and the guest is continued)", body = SnapshotView), (status = 401, description = "Missing or unknown API key", body = ErrorView), (status = 404, description = "No such sandbox in the key's workspace", body = ErrorView), (status = 507, description = "The workspace's snapshot quota is used up", body = ErrorView)))]
pub(crate) async fn create(
    axum::extract::State(state): St,
    Extension(ws): Extension<Workspace>,
    OwnedSandbox(e): OwnedSandbox,
) -> AppResult<(StatusCode, Json<SnapshotView>)> {
    let snap = Service(&state).snapshot(&ws.0, &e).await?;
    Ok((StatusCode::CREATED, Json(snapshot_view(&state, snap))))
}

#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub(crate) struct ListQuery {
    /// Only snapshots of this sandbox.
    sandbox_id: Option<String>,
}

#[utoipa::path(get, path = "/v1/snapshots", tag = "snapshots", operation_id = "listSnapshots", params(ListQuery),
    responses((status = 200, description = "Newest first", body = SnapshotList), (status = 401, description = "Missing or unknown API key", body = ErrorView)))]
pub(crate) async fn list(
    axum::extract::State(state): St,
    Extension(ws): Extension<Workspace>,
    Query(q): Query<ListQuery>,
) -> AppResult<Json<SnapshotList>> {
    let snaps = state
        .registry
        .with_conn(|c| crate::snapshots::list(c, &ws.0, q.sandbox_id.as_deref()))
        .map_err(|e| ApiError::internal(e.to_string()))?;
    Ok(Json(SnapshotList {
        snapshots: snaps
            .into_iter()
            .map(|s| snapshot_view(&state, s))
            .collect(),
    }))
}

#[utoipa::path(get, path = "/v1/snapshots/{id}", tag = "snapshots", operation_id = "getSnapshot", params(("id" = String, Path, description = "The snapshot id")),
    responses((status = 200, body = SnapshotView), (status = 401, description = "Missing or unknown API key", body = ErrorView), (status = 404, description = "No such snapshot in the key's workspace", body = ErrorView)))]
pub(crate) async fn get_one(
    axum::extract::State(state): St,
    Extension(ws): Extension<Workspace>,
    Path(id): Path<String>,
) -> AppResult<Json<SnapshotView>> {
    state
        .registry
        .with_conn(|c| crate::snapshots::get(c, &ws.0, &id))
        .map_err(|e| ApiError::internal(e.to_string()))?
        .map(|s| Json(snapshot_view(&state, s)))
        .ok_or_else(|| ApiError::new(StatusCode::NOT_FOUND, "snapshot not found"))
}

#[utoipa::path(delete, path = "/v1/snapshots/{id}", tag = "snapshots", operation_id = "deleteSnapshot", params(("id" = String, Path, description = "The snapshot id")),
    responses((status = 204, description = "Deleted (its files go once no sandbox started from it uses them)"), (status = 401, description = "Missing or unknown API key", body = ErrorView), (status = 404, description = "No such snapshot in the key's workspace", body = ErrorView)))]
pub(crate) async fn delete(
    axum::extract::State(state): St,
    Extension(ws): Extension<Workspace>,
    Path(id): Path<String>,
) -> AppResult<StatusCode> {
    Service(&state).delete_snapshot(&ws.0, &id)?;
    Ok(StatusCode::NO_CONTENT)
}

/// A fork request (every field optional; the body may be empty).
#[derive(Debug, Default, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct ForkReq {
    /// Metadata over the parent's (together held to a create's limits).
    #[serde(default)]
    metadata: BTreeMap<String, String>,
    /// The child's idle TTL; the parent's when absent.
    #[schema(value_type = Option<i64>)]
    ttl_seconds: Option<f64>,
    /// fork-tree only: how many children, 1 to 16.
    #[schema(value_type = Option<u64>)]
    count: Option<f64>,
}

/// A forked sandbox.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub(crate) struct ForkView {
    #[serde(flatten)]
    sandbox: SandboxView,
    /// The parent.
    forked_from: String,
    /// Whether the parent's running processes (and code contexts'
    /// variables) came along: never with the namespace jail or a microVM,
    /// which fork files only; with gVisor unless its checkpoint or restore
    /// failed (then `state_lost` says so).
    memory: bool,
}

/// The children of a fork tree.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub(crate) struct ForkTreeView {
    /// The tree's id (each child's `metadata.fork_tree_id`).
    tree_id: String,
    children: Vec<ForkView>,
}

fn fork_view(
    state: &std::sync::Arc<AppState>,
    c: &crate::service::Created,
    parent: &str,
) -> ForkView {
    let mut sandbox = sandbox_view(state, &c.entry);
    sandbox.boot_ms = Some(runcell_protocol::units::millis(c.boot));
    ForkView {
        sandbox,
        forked_from: parent.to_string(),
        memory: c.memory,
    }
}

/// Most children of one fork tree.
const MAX_TREE: usize = 16;

#[utoipa::path(post, path = "/v1/sandboxes/{id}/fork", tag = "snapshots", operation_id = "forkSandbox", params(("id" = String, Path, description = "The parent sandbox id")), request_body = Option<ForkReq>,
    responses((status = 409, description = "The sandbox stopped running", body = ErrorView), (status = 201, description = "A new sandbox whose files start as the parent's now (copy-on-write); with gVisor or a microVM its processes and memory too (`memory: true`), unless the restore failed (`memory: false`, `state_lost: true`)", body = ForkView), (status = 400, description = "Invalid input: the error names the field", body = ErrorView), (status = 401, description = "Missing or unknown API key", body = ErrorView), (status = 404, description = "No such sandbox in the key's workspace", body = ErrorView), (status = 429, description = "A per-workspace quota is reached", body = ErrorView), (status = 503, description = "No capacity; retry after Retry-After seconds", body = ErrorView)))]
pub(crate) async fn fork(
    axum::extract::State(state): St,
    Extension(ws): Extension<Workspace>,
    Sandboxed(e, OptionalJson(req)): Sandboxed<OptionalJson<ForkReq>>,
) -> AppResult<(StatusCode, Json<ForkView>)> {
    if req.count.is_some() {
        return Err(ApiError::bad_request(
            "count: a fork makes one sandbox; use fork-tree for several.",
        ));
    }
    let parent = e.sandbox.id().to_string();
    let spec = ForkSpec {
        metadata: req.metadata,
        ttl_seconds: req.ttl_seconds,
    };
    let children = Service(&state).fork(&ws.0, &e, spec, 1, None).await?;
    Ok((
        StatusCode::CREATED,
        Json(fork_view(&state, &children[0], &parent)),
    ))
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/fork-tree", tag = "snapshots", operation_id = "forkTree", params(("id" = String, Path, description = "The parent sandbox id")), request_body = ForkReq,
    responses((status = 409, description = "The sandbox stopped running", body = ErrorView), (status = 201, description = "`count` children sharing one copy of the parent's files; fewer when capacity ran out after the first", body = ForkTreeView), (status = 400, description = "Invalid input: the error names the field", body = ErrorView), (status = 401, description = "Missing or unknown API key", body = ErrorView), (status = 404, description = "No such sandbox in the key's workspace", body = ErrorView), (status = 503, description = "No capacity; retry after Retry-After seconds", body = ErrorView)))]
pub(crate) async fn fork_tree(
    axum::extract::State(state): St,
    Extension(ws): Extension<Workspace>,
    Sandboxed(e, OptionalJson(req)): Sandboxed<OptionalJson<ForkReq>>,
) -> AppResult<(StatusCode, Json<ForkTreeView>)> {
    let count = match req.count {
        Some(n) if n.fract() == 0.0 && (1.0..=MAX_TREE as f64).contains(&n) => {
            runcell_protocol::units::saturating_u64(n)
        }
        Some(n) => {
            return Err(ApiError::bad_request(format!(
                "count must be a whole number from 1 to {MAX_TREE}, not {n}."
            )))
        }
        None => return Err(ApiError::bad_request("count is required (1 to 16).")),
    };
    let count = usize::try_from(count).unwrap_or(1);
    let parent = e.sandbox.id().to_string();
    let tree = format!("tree-{}", uuid::Uuid::new_v4());
    let spec = ForkSpec {
        metadata: req.metadata,
        ttl_seconds: req.ttl_seconds,
    };
    let children = Service(&state)
        .fork(&ws.0, &e, spec, count, Some(&tree))
        .await?;
    Ok((
        StatusCode::CREATED,
        Json(ForkTreeView {
            tree_id: tree,
            children: children
                .iter()
                .map(|c| fork_view(&state, c, &parent))
                .collect(),
        }),
    ))
}

/// A promote request.
#[derive(Debug, Default, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct PromoteReq {
    /// Delete the tree's other sandboxes.
    #[serde(default)]
    cleanup_siblings: bool,
    /// The tree; the sandbox's `metadata.fork_tree_id` when absent.
    tree_id: Option<String>,
}

/// What a promote did.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub(crate) struct PromoteView {
    /// The promoted sandbox.
    winner: String,
    /// Its former tree.
    #[serde(skip_serializing_if = "Option::is_none")]
    tree_id: Option<String>,
    /// Siblings deleted.
    deleted: Vec<String>,
    /// Siblings that could not be deleted, and why.
    failures: BTreeMap<String, String>,
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/promote", tag = "snapshots", operation_id = "promoteSandbox", params(("id" = String, Path, description = "The forked sandbox id")), request_body = Option<PromoteReq>,
    responses((status = 200, description = "Independent of its tree; with cleanup_siblings, the others are deleted", body = PromoteView), (status = 400, description = "Invalid input: the error names the field", body = ErrorView), (status = 401, description = "Missing or unknown API key", body = ErrorView), (status = 404, description = "No such sandbox in the key's workspace", body = ErrorView)))]
pub(crate) async fn promote(
    axum::extract::State(state): St,
    Extension(ws): Extension<Workspace>,
    Sandboxed(e, OptionalJson(req)): Sandboxed<OptionalJson<PromoteReq>>,
) -> AppResult<Json<PromoteView>> {
    let winner = e.sandbox.id().to_string();
    // A tree is named by a metadata value (`fork_tree_id`): no longer.
    if let Some(t) = &req.tree_id {
        runcell_core::limits::check_len(
            "tree_id",
            t,
            runcell_core::limits::MAX_METADATA_VALUE_BYTES,
            ", a metadata value's limit",
        )
        .map_err(crate::error::ApiError::from)?;
    }
    let p = Service(&state)
        .promote(&ws.0, &e, req.tree_id, req.cleanup_siblings)
        .await?;
    Ok(Json(PromoteView {
        winner,
        tree_id: p.tree_id,
        deleted: p.deleted,
        failures: p.failures,
    }))
}
