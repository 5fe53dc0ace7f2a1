//! The OpenAPI document: generated from the handlers and their types, with
//! what is not a handler's annotation (the bearer security scheme, the
//! public operations, and `/mcp`), and the route that serves it.

use axum::Json;
use utoipa::openapi::security::{Http, HttpAuthScheme, SecurityScheme};
use utoipa::openapi::OpenApi;
use utoipa::Modify;

use super::{exec, files, network, repl, run, sandboxes, snapshots, system, templates, volumes};
use crate::views::*;

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
    modifiers(&Security),
    tags(
        (name = "sandboxes", description = "Create, list, inspect and delete sandboxes; their lifetime and network"),
        (name = "exec", description = "Run commands and read their output"),
        (name = "files", description = "Files in a sandbox"),
        (name = "code contexts", description = "Stateful interpreters (PandaStack REPL sessions)"),
        (name = "templates", description = "What sandboxes are made from"),
        (name = "account", description = "The caller's key"),
        (name = "cluster", description = "Cluster mode (`runcell serve --cluster`): the nodes, and draining one; a single node answers 404"),
        (name = "system", description = "Health, metrics, this document and MCP; no key needed except for MCP")
    ),
    paths(
        system::healthz,
        system::metrics,
        openapi,
        mcp,
        mcp_stream,
        mcp_end_session,
        system::me,
        system::system,
        sandboxes::create,
        sandboxes::list,
        sandboxes::get_one,
        sandboxes::delete,
        exec::exec,
        exec::exec_stream,
        run::run,
        files::fs_read,
        files::fs_write,
        files::fs_dir,
        files::fs_stat,
        exec::logs,
        sandboxes::lifecycle,
        sandboxes::set_lifecycle,
        network::set_network,
        templates::templates,
        templates::template,
        repl::create,
        repl::list,
        repl::run,
        repl::run_stream,
        repl::restart,
        repl::delete,
        snapshots::pause,
        snapshots::resume,
        snapshots::hibernate,
        snapshots::wake,
        snapshots::create,
        snapshots::list,
        snapshots::get_one,
        snapshots::delete,
        snapshots::fork,
        snapshots::fork_tree,
        snapshots::promote,
        volumes::create,
        volumes::list,
        volumes::get_one,
        volumes::delete,
        crate::cluster::routes::status,
        crate::cluster::routes::drain,
        crate::cluster::routes::undrain
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
        SystemView,
        IsolationName,
        LayerView,
        BackendView,
        LayerStoreView,
        ExecStreamEvent,
        LogEvent,
        SessionView,
        CellView,
        ExceptionView,
        snapshots::SnapshotView,
        snapshots::SnapshotList,
        snapshots::ForkReq,
        snapshots::ForkView,
        snapshots::ForkTreeView,
        snapshots::PromoteReq,
        snapshots::PromoteView,
        volumes::CreateVolumeReq,
        volumes::VolumeList,
        crate::volumes::VolumeView,
        crate::volumes::VolumeAttach,
        crate::snapshots::OnIdle,
        crate::cluster::routes::ClusterView,
        crate::cluster::routes::EtcdOpsView,
        crate::cluster::routes::OpsView,
        crate::cluster::NodeInfo
    ))
)]
pub(crate) struct ApiDoc;

/// The OpenAPI 3.1 document of this API.
#[utoipa::path(get, path = "/v1/openapi.json", tag = "system", operation_id = "getOpenApi", security(()),
    responses((status = 200, description = "This document", content_type = "application/json", body = Object)))]
pub(crate) async fn openapi() -> Json<utoipa::openapi::OpenApi> {
    Json(document())
}

/// Adds the `bearer` security scheme that every operation requires unless
/// it is public.
#[derive(Debug)]
pub(crate) struct Security;

impl Modify for Security {
    fn modify(&self, doc: &mut OpenApi) {
        let components = doc.components.get_or_insert_with(Default::default);
        let mut http = Http::new(HttpAuthScheme::Bearer);
        http.description = Some(
            "An API key (`runcell key create`, or `<data-dir>/api-key`). \
             Also accepted as the `access_token` query parameter."
                .into(),
        );
        components.add_security_scheme("bearer", SecurityScheme::Http(http));
    }
}

/// Paths anyone may read without a key.
const PUBLIC: [&str; 3] = ["/healthz", "/metrics", "/v1/openapi.json"];

/// The document served at `/v1/openapi.json`.
pub(crate) fn document() -> OpenApi {
    let mut doc = <ApiDoc as utoipa::OpenApi>::openapi();
    // `security(())` makes utoipa write `[{}]` ("no key is one option");
    // public operations need no key at all: `security: []`.
    for (path, item) in doc.paths.paths.iter_mut() {
        if !PUBLIC.contains(&path.as_str()) {
            continue;
        }
        for op in [&mut item.get, &mut item.post].into_iter().flatten() {
            op.security = Some(Vec::new());
        }
    }
    doc
}

/// MCP (Model Context Protocol) over streamable HTTP: a JSON-RPC 2.0
/// message in, a JSON or SSE answer out. Its tools act with the request's
/// key on this daemon's API.
#[utoipa::path(post, path = "/mcp", tag = "system", operation_id = "mcp",
    request_body(content = Object, description = "A JSON-RPC 2.0 request or notification", content_type = "application/json"),
    params(("Mcp-Session-Id" = Option<String>, Header, description = "The session, after `initialize`")),
    responses(
        (status = 200, description = "The JSON-RPC answer", content(
            (Object = "application/json"), (String = "text/event-stream"))),
        (status = 202, description = "A notification or response was accepted"),
        (status = 400, description = "Not a valid MCP message", body = crate::views::ErrorView),
        (status = 401, description = "Missing or unknown API key", body = crate::views::ErrorView),
        (status = 404, description = "Unknown MCP session", body = crate::views::ErrorView),
        (status = 406, description = "The Accept header does not allow JSON and SSE", body = crate::views::ErrorView),
        (status = 415, description = "The body is not application/json", body = crate::views::ErrorView)))]
#[allow(dead_code)] // documents the MCP service mounted at /mcp
pub(crate) fn mcp() {}

/// MCP's server-to-client SSE stream of a session.
#[utoipa::path(get, path = "/mcp", tag = "system", operation_id = "mcpStream",
    params(("Mcp-Session-Id" = String, Header, description = "The session, from `initialize`")),
    responses(
        (status = 200, description = "Server-sent JSON-RPC messages", content_type = "text/event-stream", body = String),
        (status = 400, description = "No session id", body = crate::views::ErrorView),
        (status = 401, description = "Missing or unknown API key", body = crate::views::ErrorView),
        (status = 404, description = "Unknown MCP session", body = crate::views::ErrorView),
        (status = 405, description = "This server does not offer the stream", body = crate::views::ErrorView),
        (status = 406, description = "The Accept header does not allow SSE", body = crate::views::ErrorView)))]
#[allow(dead_code)] // documents the MCP service mounted at /mcp
pub(crate) fn mcp_stream() {}

/// Ends an MCP session.
#[utoipa::path(delete, path = "/mcp", tag = "system", operation_id = "mcpEndSession",
    params(("Mcp-Session-Id" = String, Header, description = "The session, from `initialize`")),
    responses(
        (status = 202, description = "Ended"),
        (status = 204, description = "Ended"),
        (status = 400, description = "No session id", body = crate::views::ErrorView),
        (status = 401, description = "Missing or unknown API key", body = crate::views::ErrorView),
        (status = 404, description = "Unknown MCP session", body = crate::views::ErrorView),
        (status = 405, description = "Sessions cannot be ended by the client", body = crate::views::ErrorView)))]
#[allow(dead_code)] // documents the MCP service mounted at /mcp
pub(crate) fn mcp_end_session() {}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use serde_json::Value;

    #[test]
    fn every_operation_has_a_unique_id_tags_and_its_auth() {
        let doc = serde_json::to_value(super::document()).unwrap();
        assert_eq!(doc["servers"][0]["url"], "/");
        assert_eq!(
            doc["components"]["securitySchemes"]["bearer"]["scheme"],
            "bearer"
        );
        let mut ids: BTreeMap<String, String> = BTreeMap::new();
        let paths = doc["paths"].as_object().unwrap();
        for p in [
            "/healthz",
            "/metrics",
            "/v1/openapi.json",
            "/mcp",
            "/v1/cluster",
            "/v1/cluster/drain",
        ] {
            assert!(paths.contains_key(p), "{p} is not documented");
        }
        for (path, item) in paths {
            for (method, op) in item.as_object().unwrap() {
                let at = format!("{method} {path}");
                let id = op["operationId"].as_str().unwrap().to_string();
                if let Some(other) = ids.insert(id.clone(), at.clone()) {
                    panic!("operationId {id} is used by {other} and {at}");
                }
                assert!(!op["tags"].as_array().unwrap().is_empty(), "{at}");
                let public = op["security"] == Value::Array(vec![]);
                assert_eq!(
                    public,
                    super::PUBLIC.contains(&path.as_str()),
                    "{at}: security {}",
                    op["security"]
                );
                if !public {
                    assert!(op["responses"].get("401").is_some(), "{at} lacks 401");
                }
            }
        }
    }
}
