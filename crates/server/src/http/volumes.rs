//! `/v1/volumes`: named persistent volumes of a workspace.

use axum::extract::{Extension, Path};
use axum::http::StatusCode;
use axum::Json;
use serde::{Deserialize, Serialize};

use super::kit::{AppResult, JsonBody, St, Workspace};
use crate::error::ApiError;
use crate::service::Service;
use crate::views::ErrorView;
use crate::volumes::VolumeView;

/// A volume to make.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct CreateVolumeReq {
    /// 1 to 63 of `a-z 0-9 _ -`, starting with a letter or digit; unique in the workspace.
    name: String,
    /// Size, MiB: 1 to 65536, within the workspace's volume quota.
    #[schema(value_type = u64)]
    size_mb: f64,
}

/// The volumes of the workspace.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub(crate) struct VolumeList {
    items: Vec<VolumeView>,
}

#[utoipa::path(post, path = "/v1/volumes", tag = "volumes", operation_id = "createVolume", request_body = CreateVolumeReq,
    responses((status = 201, description = "Made (an ext4 file system of that size)", body = VolumeView), (status = 400, description = "Invalid input: the error names the field", body = ErrorView), (status = 401, description = "Missing or unknown API key", body = ErrorView), (status = 409, description = "A volume of that name exists", body = ErrorView), (status = 429, description = "Beyond the workspace's volume quota", body = ErrorView), (status = 507, description = "The host could not make it", body = ErrorView)))]
pub(crate) async fn create(
    axum::extract::State(state): St,
    Extension(ws): Extension<Workspace>,
    JsonBody(req): JsonBody<CreateVolumeReq>,
) -> AppResult<(StatusCode, Json<VolumeView>)> {
    let size = req.size_mb;
    if !(size.fract() == 0.0 && (1.0..=crate::volumes::MAX_SIZE_MB as f64).contains(&size)) {
        return Err(ApiError::bad_request(format!(
            "size_mb must be a whole number from 1 to {}, not {size}.",
            crate::volumes::MAX_SIZE_MB
        )));
    }
    crate::volumes::check_name(&req.name)?;
    let size = runcell_protocol::units::saturating_u64(size);
    let v = Service(&state).create_volume(&ws.0, req.name, size).await?;
    Ok((StatusCode::CREATED, Json(Service(&state).volume_view(&v))))
}

#[utoipa::path(get, path = "/v1/volumes", tag = "volumes", operation_id = "listVolumes",
    responses((status = 200, description = "By name", body = VolumeList), (status = 401, description = "Missing or unknown API key", body = ErrorView)))]
pub(crate) async fn list(
    axum::extract::State(state): St,
    Extension(ws): Extension<Workspace>,
) -> AppResult<Json<VolumeList>> {
    let vols = state
        .registry
        .with_conn(|c| crate::volumes::list(c, Some(&ws.0)))
        .map_err(|e| ApiError::internal(e.to_string()))?;
    Ok(Json(VolumeList {
        items: vols
            .iter()
            .map(|v| Service(&state).volume_view(v))
            .collect(),
    }))
}

#[utoipa::path(get, path = "/v1/volumes/{name}", tag = "volumes", operation_id = "getVolume", params(("name" = String, Path, description = "The volume's name")),
    responses((status = 200, body = VolumeView), (status = 401, description = "Missing or unknown API key", body = ErrorView), (status = 404, description = "No such volume in the key's workspace", body = ErrorView)))]
pub(crate) async fn get_one(
    axum::extract::State(state): St,
    Extension(ws): Extension<Workspace>,
    Path(name): Path<String>,
) -> AppResult<Json<VolumeView>> {
    let v = state
        .registry
        .with_conn(|c| crate::volumes::get(c, &ws.0, &name))
        .map_err(|e| ApiError::internal(e.to_string()))?
        .ok_or_else(|| {
            ApiError::new(
                StatusCode::NOT_FOUND,
                format!("volume {:?} not found", super::kit::clip(name)),
            )
        })?;
    Ok(Json(Service(&state).volume_view(&v)))
}

#[utoipa::path(delete, path = "/v1/volumes/{name}", tag = "volumes", operation_id = "deleteVolume", params(("name" = String, Path, description = "The volume's name")),
    responses((status = 204, description = "Deleted with its data"), (status = 401, description = "Missing or unknown API key", body = ErrorView), (status = 404, description = "No such volume in the key's workspace", body = ErrorView), (status = 409, description = "A sandbox (running or hibernated) has it", body = ErrorView)))]
pub(crate) async fn delete(
    axum::extract::State(state): St,
    Extension(ws): Extension<Workspace>,
    Path(name): Path<String>,
) -> AppResult<StatusCode> {
    Service(&state).delete_volume(&ws.0, &name).await?;
    Ok(StatusCode::NO_CONTENT)
}
