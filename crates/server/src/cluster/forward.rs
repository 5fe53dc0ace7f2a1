//! The HTTP side of cluster mode, one middleware inside the key check of
//! `/v1`: a request for another node's sandbox is forwarded to it (bodies
//! streamed both ways, so exec streams and SSE logs pass through with
//! back-pressure), a create is placed on the least loaded node, a list is
//! answered from etcd, and what this node creates or deletes is published.
//! A request that came from another node (`x-runcell-forwarded-by`) is
//! always served here, so nothing is forwarded twice.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{OriginalUri, Query, Request, State};
use axum::http::{header, HeaderName, Method, StatusCode, Uri};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::{Map, Value};

use super::{labels, Cluster, NodeInfo};
use crate::error::ApiError;
use crate::http::kit::{St, Workspace};
use crate::state::AppState;

/// Marks a request forwarded by another node (its name).
pub const FORWARDED_BY: &str = "x-runcell-forwarded-by";
/// Names the node that answered (on every sandbox answer in cluster mode).
pub const NODE_HEADER: &str = "x-runcell-node";

/// The client that forwards requests to other nodes.
pub(crate) type HttpClient = Client<HttpConnector, Body>;

/// A pooled HTTP/1 client; connecting to a node gives up after 2 s (a dead
/// node on the same network refuses at once).
pub(crate) fn http_client() -> HttpClient {
    let mut conn = HttpConnector::new();
    conn.set_connect_timeout(Some(Duration::from_secs(2)));
    conn.set_nodelay(true);
    Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(30))
        .build(conn)
}

/// Hop-by-hop headers (RFC 9110 7.6.1): not passed on.
const HOP: [&str; 8] = [
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

fn strip_hop(h: &mut axum::http::HeaderMap) {
    for name in HOP {
        h.remove(name);
    }
}

/// The views of every sandbox of this node (live and hibernated), with
/// their workspaces, as `GET /v1/sandboxes/{id}` shows them.
pub(crate) fn own_views(state: &Arc<AppState>) -> Vec<(String, Value)> {
    let entries: Vec<_> = state
        .sandboxes
        .read()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .values()
        .cloned()
        .collect();
    let mut out = Vec::new();
    for e in entries {
        let ws = e
            .record
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .workspace
            .clone();
        let view = crate::http::sandboxes::sandbox_view(state, &e);
        out.push((ws, serde_json::to_value(view).unwrap_or(Value::Null)));
    }
    for r in state.registry.with_status("hibernated").unwrap_or_default() {
        let view = crate::http::sandboxes::record_view(state, &r);
        out.push((
            r.workspace.clone(),
            serde_json::to_value(view).unwrap_or(Value::Null),
        ));
    }
    out
}

/// A 503 for a request whose node is gone; `id` is the sandbox it was
/// for, if any (a create placed there, or a drain of that node, has none).
fn lost(id: Option<&str>, node: &str, why: &str) -> Response {
    let message = match id {
        Some(id) => format!(
            "Sandbox {id} is on node {node}, which is lost ({why}); it answers again if the node comes back."
        ),
        None => format!("Node {node} is lost ({why}); retry later."),
    };
    let mut err = ApiError::new(StatusCode::SERVICE_UNAVAILABLE, message);
    err.retry_after = Some(5);
    err.extra = Some(
        [
            ("node".to_string(), Value::from(node)),
            ("node_lost".to_string(), Value::from(true)),
        ]
        .into_iter()
        .collect(),
    );
    err.into_response()
}

/// A 503 for a create on a node that drains.
fn draining(node: &str) -> Response {
    let mut err = ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        PlaceError::Draining(node.into()).to_string(),
    );
    err.retry_after = Some(2);
    err.extra = Some(
        [
            ("node".to_string(), Value::from(node)),
            ("draining".to_string(), Value::from(true)),
        ]
        .into_iter()
        .collect(),
    );
    err.into_response()
}

pub(super) fn store_down(what: &str, e: &super::ClusterError) -> Response {
    let mut err = ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        format!("The cluster store (etcd) is unreachable, so {what}: {e}."),
    );
    err.retry_after = Some(2);
    err.into_response()
}

/// The workspace of a key that this node's registry does not hold, from
/// the keys every node publishes (`Ok(None)`: unknown, or no cluster); an
/// unreachable etcd is a 503, not a 401 (the key may well be valid).
pub(crate) async fn key_workspace(state: &AppState, key: &str) -> Result<Option<String>, Response> {
    let Some(cluster) = &state.cluster else {
        return Ok(None);
    };
    cluster
        .workspace_of(key)
        .await
        .map_err(|e| store_down("a key of another node cannot be checked", &e))
}

/// The middleware (see the module's doc). Without `--cluster` it passes
/// every request through untouched.
pub(crate) async fn layer(State(state): St, req: Request, next: Next) -> Response {
    let Some(cluster) = state.cluster.clone() else {
        return next.run(req).await;
    };
    let uri = req
        .extensions()
        .get::<OriginalUri>()
        .map(|u| u.0.clone())
        .unwrap_or_else(|| req.uri().clone());
    let path = uri
        .path()
        .strip_prefix("/v1")
        .unwrap_or(uri.path())
        .to_string();
    let parts: Vec<&str> = path.trim_matches('/').split('/').collect();
    let forwarded = req.headers().contains_key(FORWARDED_BY);
    let Some(ws) = req.extensions().get::<Workspace>().cloned() else {
        return next.run(req).await;
    };
    let method = req.method().clone();
    match (method.clone(), parts.as_slice()) {
        (Method::POST, ["sandboxes"]) if forwarded => {
            create_here(&state, &cluster, &ws, req, next).await
        }
        (Method::POST, ["sandboxes"]) => place(&state, &cluster, &ws, uri, "", req, next).await,
        // A one-shot run is placed as its sandbox's create; its sandbox is
        // deleted when its answer's stream ends, so it is not published.
        (Method::POST, ["run"]) if forwarded => run_here(&cluster, req, next).await,
        (Method::POST, ["run"]) => place(&state, &cluster, &ws, uri, "/sandbox", req, next).await,
        (Method::GET, ["sandboxes"]) => list(&cluster, &ws, &uri, req, next).await,
        (_, ["sandboxes", id, rest @ ..]) => {
            let id = id.to_string();
            let delete = method == Method::DELETE && rest.is_empty();
            if forwarded || state.entry(&id).is_some() {
                return here(&cluster, &ws, &id, delete, req, next).await;
            }
            let owner = match cluster.owner(&id).await {
                Ok(o) => o,
                // A sandbox of this node (hibernated) is still served.
                Err(e) if state.registry.get(&id).ok().flatten().is_none() => {
                    return store_down("the owner of this sandbox cannot be looked up", &e)
                }
                Err(_) => None,
            };
            match owner {
                Some(o) if o.workspace == ws.0 && o.node != cluster.name() => {
                    match cluster.node(&o.node).await {
                        Ok(Some(n)) => forward(&cluster, &n, Some(&id), uri, req).await,
                        Ok(None) => lost(Some(&id), &o.node, "its lease expired"),
                        Err(e) => store_down("the owner of this sandbox cannot be looked up", &e),
                    }
                }
                // Missing, another workspace's (answered as missing), or ours.
                _ => here(&cluster, &ws, &id, delete, req, next).await,
            }
        }
        _ => next.run(req).await,
    }
}

/// Serves a sandbox request here; a delete that succeeds is unpublished.
async fn here(
    cluster: &Arc<Cluster>,
    ws: &Workspace,
    id: &str,
    delete: bool,
    req: Request,
    next: Next,
) -> Response {
    let mut resp = next.run(req).await;
    if delete && resp.status().is_success() {
        if let Err(e) = cluster.unpublish(&ws.0, id).await {
            tracing::warn!(sandbox = %id, "deleted, but not yet from etcd (the next round retries): {e}");
        }
    }
    if let Ok(v) = cluster.name().parse() {
        resp.headers_mut().insert(NODE_HEADER, v);
    }
    resp
}

/// Creates here and publishes the new sandbox before answering, so that a
/// list through any node shows it at once.
async fn create_here(
    state: &Arc<AppState>,
    cluster: &Arc<Cluster>,
    ws: &Workspace,
    req: Request,
    next: Next,
) -> Response {
    if cluster.is_draining() {
        // Another node placed it from a node list older than the drain.
        return draining(cluster.name());
    }
    let resp = next.run(req).await;
    if resp.status() != StatusCode::CREATED {
        return resp;
    }
    let (mut parts, body) = resp.into_parts();
    let bytes = match axum::body::to_bytes(body, state.config.max_body_bytes.max(1 << 20)).await {
        Ok(b) => b,
        Err(e) => {
            return ApiError::internal(format!("The create's answer was unreadable: {e}"))
                .into_response()
        }
    };
    if let Ok(view) = serde_json::from_slice::<Value>(&bytes) {
        if let Err(e) = cluster.publish(&ws.0, view).await {
            tracing::warn!("created, but not yet published to etcd (the next round retries): {e}");
        }
    }
    if let Ok(v) = cluster.name().parse() {
        parts.headers.insert(NODE_HEADER, v);
    }
    Response::from_parts(parts, Body::from(bytes))
}

/// Runs a one-shot run (`POST /v1/run`) here, unless this node drains;
/// the answer names this node.
async fn run_here(cluster: &Arc<Cluster>, req: Request, next: Next) -> Response {
    if cluster.is_draining() {
        // Another node placed it from a node list older than the drain.
        return draining(cluster.name());
    }
    let mut resp = next.run(req).await;
    if let Ok(v) = cluster.name().parse() {
        resp.headers_mut().insert(NODE_HEADER, v);
    }
    resp
}

/// Places a create: the node named by the body's `node` (or the
/// `x-runcell-node` header), else the live, non-draining node with the most
/// free slots that carries the labels of the body's `node_selector` and has
/// the template and the isolation asked for (this node on a tie); see
/// [`choose`]. The sandbox's fields are the body's at the JSON pointer
/// `spec_at` (`""`: the whole body).
async fn place(
    state: &Arc<AppState>,
    cluster: &Arc<Cluster>,
    ws: &Workspace,
    uri: Uri,
    spec_at: &str,
    req: Request,
    next: Next,
) -> Response {
    let (parts, body) = req.into_parts();
    let bytes = match axum::body::to_bytes(body, state.config.max_body_bytes).await {
        Ok(b) => b,
        Err(_) => {
            return ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "The request body is larger than the daemon allows.",
            )
            .into_response()
        }
    };
    let body: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    let spec = body.pointer(spec_at).unwrap_or(&Value::Null);
    let (wanted, selector) = match placement_fields(spec) {
        Ok(f) => f,
        Err(msg) => {
            let err = ApiError::bad_request(msg);
            return match spec_at.strip_prefix('/') {
                Some(scope) => err.within(scope, crate::http::run::SANDBOX_FIELDS),
                None => err,
            }
            .into_response();
        }
    };
    let wanted = wanted.or_else(|| {
        parts
            .headers
            .get(NODE_HEADER)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    });
    let template = spec
        .get("template")
        .and_then(Value::as_str)
        .unwrap_or(runcell_core::DEFAULT_TEMPLATE)
        .to_string();
    let isolation = spec
        .get("isolation")
        .and_then(Value::as_str)
        .map(str::to_string);
    let Some(mut nodes) = cluster.live_nodes() else {
        let mut err = ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "The cluster store (etcd) is unreachable, so no node can be chosen for a new sandbox; retry later.",
        );
        err.retry_after = Some(2);
        return err.into_response();
    };
    // This node's own flag is fresher than its record in the list.
    if let Some(me) = nodes.get_mut(cluster.name()) {
        me.draining = cluster.is_draining();
    }
    let chosen = match choose(
        &nodes,
        cluster.name(),
        &Wanted {
            node: wanted.as_deref(),
            selector: selector.as_ref(),
            template: &template,
            isolation: isolation.as_deref(),
        },
    ) {
        Ok(n) => n,
        Err(e) => {
            let mut err = ApiError::new(StatusCode::SERVICE_UNAVAILABLE, e.to_string());
            err.retry_after = Some(2);
            if let Some(sel) = &selector {
                err.extra = Some(
                    [(
                        "node_selector".to_string(),
                        serde_json::to_value(sel).unwrap_or(Value::Null),
                    )]
                    .into_iter()
                    .collect(),
                );
            }
            return err.into_response();
        }
    };
    cluster.took_slot(&chosen.name);
    let req = Request::from_parts(parts, Body::from(bytes));
    if chosen.name == cluster.name() && spec_at.is_empty() {
        create_here(state, cluster, ws, req, next).await
    } else if chosen.name == cluster.name() {
        run_here(cluster, req, next).await
    } else {
        forward(cluster, &chosen, None, uri, req).await
    }
}

/// A create's `node` and `node_selector`.
type PlacementFields = (Option<String>, Option<BTreeMap<String, String>>);

/// A create's `node` and `node_selector` (both optional, both runcell
/// extensions of cluster mode); `Err` is a 400's message naming the field.
fn placement_fields(spec: &Value) -> Result<PlacementFields, String> {
    let node = match spec.get("node") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(_) => return Err("node must be a node name (a string).".into()),
    };
    let selector =
        match spec.get("node_selector") {
            None | Some(Value::Null) => None,
            Some(Value::Object(m)) => {
                let mut sel = BTreeMap::new();
                for (k, v) in m {
                    let Value::String(v) = v else {
                        return Err(format!(
                            "node_selector.{k} must be a string (a label value)."
                        ));
                    };
                    sel.insert(k.clone(), v.clone());
                }
                labels::check_selector(&sel).map_err(|e| format!("node_selector: {e}"))?;
                Some(sel)
            }
            Some(_) => return Err(
                "node_selector must be an object of label keys to values, e.g. {\"zone\": \"a\"}."
                    .into(),
            ),
        };
    Ok((node, selector))
}

/// What a create asks of its node.
struct Wanted<'a> {
    /// A node by name.
    node: Option<&'a str>,
    /// Labels the node must carry.
    selector: Option<&'a BTreeMap<String, String>>,
    template: &'a str,
    isolation: Option<&'a str>,
}

/// Why a create could not be placed (a 503 with Retry-After: nodes come
/// and go, and drain and undrain).
#[derive(Debug, thiserror::Error, PartialEq)]
enum PlaceError {
    /// The node asked for has no live lease.
    #[error("Node {0} is not in the cluster (no live lease).")]
    NoSuchNode(String),
    /// The node asked for drains.
    #[error("Node {0} is draining: it takes no creates until it is undrained (DELETE /v1/cluster/drain?node={0}).")]
    Draining(String),
    /// The node asked for does not match the selector.
    #[error("Node {node} does not carry the labels node_selector asks for ({selector}); its labels are {labels:?}.")]
    NodeMismatch {
        node: String,
        selector: String,
        labels: String,
    },
    /// No live node matches the selector.
    #[error("No live node of the cluster carries the labels node_selector asks for ({selector}); the live nodes' labels: {nodes}.")]
    NoMatch { selector: String, nodes: String },
    /// Every candidate is full or draining.
    #[error("No node of the cluster{which} has a free slot (or all are draining); retry later.")]
    Full { which: String },
}

/// The node a create goes to (see [`place`]): the one named, which must
/// match the selector if there is one; else, among the live nodes that
/// match the selector, not draining and with a free slot, those that have
/// the template and the isolation (any of them when none has: the node
/// answers the usual 400/404), the one with the most free slots (this node
/// on a tie).
fn choose(
    nodes: &HashMap<String, NodeInfo>,
    me: &str,
    want: &Wanted<'_>,
) -> Result<NodeInfo, PlaceError> {
    let fits_selector = |n: &NodeInfo| want.selector.is_none_or(|s| labels::matches(&n.labels, s));
    if let Some(w) = want.node {
        let n = nodes
            .get(w)
            .ok_or_else(|| PlaceError::NoSuchNode(w.into()))?;
        if !fits_selector(n) {
            return Err(PlaceError::NodeMismatch {
                node: w.into(),
                selector: want.selector.map(labels::show).unwrap_or_default(),
                labels: labels::show(&n.labels),
            });
        }
        if n.draining {
            return Err(PlaceError::Draining(w.into()));
        }
        return Ok(n.clone());
    }
    let matching: Vec<&NodeInfo> = nodes.values().filter(|n| fits_selector(n)).collect();
    if let Some(sel) = want.selector {
        if matching.is_empty() {
            let mut all: Vec<String> = nodes
                .values()
                .map(|n| format!("{} {{{}}}", n.name, labels::show(&n.labels)))
                .collect();
            all.sort();
            return Err(PlaceError::NoMatch {
                selector: labels::show(sel),
                nodes: if all.is_empty() {
                    "none".into()
                } else {
                    all.join(", ")
                },
            });
        }
    }
    let open: Vec<&NodeInfo> = matching
        .into_iter()
        .filter(|n| !n.draining && n.free > 0)
        .collect();
    if open.is_empty() {
        return Err(PlaceError::Full {
            which: want
                .selector
                .map(|s| format!(" matching node_selector ({})", labels::show(s)))
                .unwrap_or_default(),
        });
    }
    let fits: Vec<&NodeInfo> = open
        .iter()
        .copied()
        .filter(|n| n.templates.iter().any(|t| t == want.template))
        .filter(|n| {
            want.isolation
                .is_none_or(|i| n.backends.iter().any(|b| b == i))
        })
        .collect();
    // No node has it: any open node answers (with the usual 400/404).
    let pool = if fits.is_empty() { open } else { fits };
    pool.into_iter()
        .max_by(|a, b| {
            a.free
                .cmp(&b.free)
                .then_with(|| (a.name == me).cmp(&(b.name == me)))
                .then_with(|| b.name.cmp(&a.name))
        })
        .cloned()
        .ok_or(PlaceError::Full {
            which: String::new(),
        })
}

/// Forwards a request to `node`, streaming both bodies.
pub(super) async fn forward(
    cluster: &Arc<Cluster>,
    node: &NodeInfo,
    id: Option<&str>,
    uri: Uri,
    req: Request,
) -> Response {
    let (mut parts, body) = req.into_parts();
    let pq = uri.path_and_query().map(|p| p.as_str()).unwrap_or("/");
    let target = format!("{}{pq}", node.url.trim_end_matches('/'));
    let Ok(target) = target.parse::<Uri>() else {
        return ApiError::internal(format!(
            "Node {} advertises a bad URL {}.",
            node.name, node.url
        ))
        .into_response();
    };
    parts.uri = target;
    parts.version = axum::http::Version::HTTP_11;
    strip_hop(&mut parts.headers);
    parts.headers.remove(header::HOST);
    if let Ok(v) = cluster.name().parse() {
        parts
            .headers
            .insert(HeaderName::from_static(FORWARDED_BY), v);
    }
    // Drop what axum put in for this node's routing.
    parts.extensions = Default::default();
    match cluster.http.request(Request::from_parts(parts, body)).await {
        Ok(resp) => {
            let (mut p, b) = resp.into_parts();
            strip_hop(&mut p.headers);
            Response::from_parts(p, Body::new(b))
        }
        Err(e) => {
            tracing::warn!(node = %node.name, "forwarding failed: {e}");
            lost(id, &node.name, &format!("unreachable at {}", node.url))
        }
    }
}

/// A list: this node's own sandboxes (fresh) and the other nodes' as
/// published in etcd, of the caller's workspace only, with the metadata
/// filters applied; each view says its `node`, and a sandbox whose node is
/// gone shows status `lost`.
async fn list(
    cluster: &Arc<Cluster>,
    ws: &Workspace,
    uri: &Uri,
    req: Request,
    next: Next,
) -> Response {
    let resp = next.run(req).await;
    if resp.status() != StatusCode::OK {
        return resp;
    }
    let (mut parts, body) = resp.into_parts();
    let Ok(bytes) = axum::body::to_bytes(body, 256 << 20).await else {
        return ApiError::internal("The local list was unreadable.").into_response();
    };
    let mut views: Vec<Value> = serde_json::from_slice(&bytes).unwrap_or_default();
    for v in &mut views {
        if let Some(o) = v.as_object_mut() {
            o.insert("node".into(), Value::from(cluster.name()));
        }
    }
    let filters: Vec<(String, String)> = Query::<Vec<(String, String)>>::try_from_uri(uri)
        .map(|q| q.0)
        .unwrap_or_default()
        .into_iter()
        .filter_map(|(k, v)| k.strip_prefix("metadata.").map(|k| (k.to_string(), v)))
        .collect();
    match cluster.workspace_sandboxes(&ws.0).await {
        Ok(records) => {
            let live = cluster.live_nodes();
            for r in records {
                if r.node == cluster.name() {
                    continue; // this node's own are listed fresh
                }
                let Value::Object(mut view) = r.view else {
                    continue;
                };
                let meta: Map<String, Value> = view
                    .get("metadata")
                    .and_then(Value::as_object)
                    .cloned()
                    .unwrap_or_default();
                if !filters
                    .iter()
                    .all(|(k, v)| meta.get(k).and_then(Value::as_str) == Some(v.as_str()))
                {
                    continue;
                }
                let alive = live.as_ref().is_none_or(|m| m.contains_key(&r.node));
                if !alive {
                    view.insert("status".into(), Value::from("lost"));
                }
                view.remove("alias_of");
                view.remove("building");
                view.remove("boot_ms");
                view.insert("node".into(), Value::from(r.node));
                views.push(Value::Object(view));
            }
        }
        Err(e) => {
            tracing::warn!("listing only this node's sandboxes: {e}");
            parts.headers.insert(
                "x-runcell-partial",
                axum::http::HeaderValue::from_static("etcd unreachable"),
            );
        }
    }
    views.sort_by(|a, b| {
        let t = |v: &Value| {
            v.get("created_at")
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_string()
        };
        t(a).cmp(&t(b))
    });
    let body = serde_json::to_vec(&views).unwrap_or_default();
    parts.headers.remove(header::CONTENT_LENGTH);
    Response::from_parts(parts, Body::from(body))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(name: &str, free: usize, templates: &[&str], draining: bool) -> NodeInfo {
        NodeInfo {
            name: name.into(),
            url: format!("http://{name}"),
            capacity: 8,
            free,
            templates: templates.iter().map(|t| t.to_string()).collect(),
            backends: vec!["jail".into()],
            draining,
            labels: BTreeMap::new(),
        }
    }

    fn labelled(mut n: NodeInfo, pairs: &[(&str, &str)]) -> NodeInfo {
        n.labels = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        n
    }

    fn by_name(list: Vec<NodeInfo>) -> HashMap<String, NodeInfo> {
        list.into_iter().map(|n| (n.name.clone(), n)).collect()
    }

    fn want<'a>(
        node: Option<&'a str>,
        selector: Option<&'a BTreeMap<String, String>>,
        template: &'a str,
        isolation: Option<&'a str>,
    ) -> Wanted<'a> {
        Wanted {
            node,
            selector,
            template,
            isolation,
        }
    }

    fn sel(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn creates_go_to_the_least_loaded_node_that_has_the_template() {
        let nodes = by_name(vec![
            node("a", 3, &["host"], false),
            node("b", 7, &["host"], true),
            node("c", 5, &["host"], false),
            node("d", 6, &["other"], false),
        ]);
        let pick = |w: Wanted<'_>| choose(&nodes, "a", &w).map(|n| n.name);
        assert_eq!(pick(want(None, None, "host", None)).unwrap(), "c");
        assert_eq!(pick(want(None, None, "other", None)).unwrap(), "d");
        assert_eq!(pick(want(Some("a"), None, "host", None)).unwrap(), "a");
        assert!(pick(want(None, None, "host", Some("microvm"))).is_ok());
        assert_eq!(
            pick(want(Some("zz"), None, "host", None)),
            Err(PlaceError::NoSuchNode("zz".into()))
        );
        // A draining node takes no create, not even one that names it.
        assert_eq!(
            pick(want(Some("b"), None, "host", None)),
            Err(PlaceError::Draining("b".into()))
        );
    }

    #[test]
    fn a_tie_stays_on_this_node() {
        let nodes = by_name(vec![
            node("a", 4, &["host"], false),
            node("b", 4, &["host"], false),
        ]);
        let w = want(None, None, "host", None);
        assert_eq!(choose(&nodes, "b", &w).unwrap().name, "b");
        assert_eq!(choose(&nodes, "a", &w).unwrap().name, "a");
    }

    #[test]
    fn a_selector_limits_placement_to_the_nodes_that_carry_its_labels() {
        let nodes = by_name(vec![
            labelled(node("a", 9, &["host"], false), &[("zone", "a")]),
            labelled(
                node("b", 2, &["host"], false),
                &[("zone", "b"), ("disk", "ssd")],
            ),
            labelled(node("c", 5, &["host"], false), &[("zone", "b")]),
            labelled(
                node("d", 8, &["host"], true),
                &[("zone", "b"), ("disk", "ssd")],
            ),
        ]);
        let zone_b = sel(&[("zone", "b")]);
        let ssd_b = sel(&[("zone", "b"), ("disk", "ssd")]);
        let pick = |w: Wanted<'_>| choose(&nodes, "a", &w);
        // The least loaded of the matching nodes, not of all nodes.
        assert_eq!(
            pick(want(None, Some(&zone_b), "host", None)).unwrap().name,
            "c"
        );
        // Every pair must match; a draining match is skipped.
        assert_eq!(
            pick(want(None, Some(&ssd_b), "host", None)).unwrap().name,
            "b"
        );
        // An empty selector is no constraint.
        assert_eq!(
            pick(want(None, Some(&sel(&[])), "host", None))
                .unwrap()
                .name,
            "a"
        );
        // A named node must match the selector too.
        assert_eq!(
            pick(want(Some("c"), Some(&zone_b), "host", None))
                .unwrap()
                .name,
            "c"
        );
        let e = pick(want(Some("a"), Some(&zone_b), "host", None)).unwrap_err();
        assert!(matches!(e, PlaceError::NodeMismatch { .. }), "{e}");
        assert!(
            e.to_string().contains("zone=b") && e.to_string().contains("zone=a"),
            "{e}"
        );
        // No match names the selector and the labels the nodes have.
        let e = pick(want(None, Some(&sel(&[("zone", "c")])), "host", None))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("(zone=c)") && e.contains("b {disk=ssd,zone=b}"),
            "{e}"
        );
        // Matches that are all full or draining: full, naming the selector.
        let full = by_name(vec![
            labelled(node("a", 0, &["host"], false), &[("zone", "a")]),
            labelled(node("b", 5, &["host"], true), &[("zone", "a")]),
            labelled(node("c", 5, &["host"], false), &[("zone", "c")]),
        ]);
        let e = choose(
            &full,
            "a",
            &want(None, Some(&sel(&[("zone", "a")])), "host", None),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("free slot") && e.contains("zone=a"), "{e}");
    }

    #[test]
    fn placement_fields_are_checked_naming_the_field() {
        let ok =
            placement_fields(&serde_json::json!({"node": "a", "node_selector": {"zone": "a"}}))
                .unwrap();
        assert_eq!(ok, (Some("a".into()), Some(sel(&[("zone", "a")]))));
        assert_eq!(placement_fields(&Value::Null).unwrap(), (None, None));
        for (body, field) in [
            (serde_json::json!({"node": 3}), "node "),
            (
                serde_json::json!({"node_selector": "zone=a"}),
                "node_selector must",
            ),
            (
                serde_json::json!({"node_selector": {"zone": 1}}),
                "node_selector.zone",
            ),
            (
                serde_json::json!({"node_selector": {"-zone": "a"}}),
                "node_selector: ",
            ),
            (
                serde_json::json!({"node_selector": {"zone": "a b"}}),
                "node_selector: ",
            ),
        ] {
            let e = placement_fields(&body).unwrap_err();
            assert!(e.starts_with(field), "{body}: {e}");
        }
    }
}
