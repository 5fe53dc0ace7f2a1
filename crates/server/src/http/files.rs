//! `/v1/sandboxes/{id}/fs`: files in a sandbox.

use axum::extract::{Query, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use runcell_protocol::FileStat;
use serde::Deserialize;

use super::kit::{AppResult, OwnedSandbox, RawBody, Sandboxed, St};
use crate::error::ApiError;
use crate::views::{DirView, ErrorView, FileView, WrittenView};

#[derive(Debug, Deserialize)]
pub(crate) struct PathQuery {
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
pub(crate) async fn fs_read(
    State(state): St,
    Query(q): Query<PathQuery>,
    OwnedSandbox(e): OwnedSandbox,
) -> AppResult<Response> {
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
pub(crate) async fn fs_write(
    State(state): St,
    Query(q): Query<PathQuery>,
    Sandboxed(e, body): Sandboxed<RawBody>,
) -> AppResult<Json<WrittenView>> {
    let path = need_path(&q)?.to_string();
    state.touch(&e).await;
    let bytes = e.sandbox.write_file(&path, &body.0).await?;
    Ok(Json(WrittenView { path, bytes }))
}

fn file_view(s: &FileStat) -> FileView {
    let kind = if s.is_symlink {
        "l"
    } else if s.is_dir {
        "d"
    } else {
        "f"
    };
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
pub(crate) async fn fs_dir(
    Query(q): Query<PathQuery>,
    OwnedSandbox(e): OwnedSandbox,
) -> AppResult<Json<DirView>> {
    let path = q
        .path
        .clone()
        .filter(|p| !p.is_empty())
        .unwrap_or_else(|| "/".into());
    absolute(&path)?;
    let entries = e.sandbox.list_dir(&path).await?;
    let entries = entries.iter().map(file_view).collect();
    Ok(Json(DirView { path, entries }))
}

#[utoipa::path(get, path = "/v1/sandboxes/{id}/fs/stat", tag = "files", operation_id = "statFile", params(("id" = String, Path, description = "The sandbox id"), ("path" = String, Query, pattern = "^/", description = "Absolute path in the sandbox")),
    responses((status = 200, body = FileView), (status = 400, description = "Invalid input: the error names the field", body = ErrorView), (status = 401, description = "Missing or unknown API key", body = ErrorView), (status = 403, description = "The sandbox's user may not do that", body = ErrorView), (status = 404, description = "No such sandbox, or no such file", body = ErrorView), (status = 409, description = "The sandbox stopped running during the request", body = ErrorView)))]
pub(crate) async fn fs_stat(
    Query(q): Query<PathQuery>,
    OwnedSandbox(e): OwnedSandbox,
) -> AppResult<Json<FileView>> {
    let path = need_path(&q)?;
    match e.sandbox.stat(path).await {
        Ok(s) => Ok(Json(file_view(&s))),
        Err(err) => {
            let mut api = ApiError::from(err);
            if api.status == StatusCode::NOT_FOUND {
                api.message = "file does not exist".into();
            }
            Err(api)
        }
    }
}
