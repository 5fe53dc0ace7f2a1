//! `/v1/sandboxes/{id}/network`: a sandbox's egress policy and traffic.

use axum::Json;
use runcell_egress::NetworkPolicy;

use super::kit::{AppResult, JsonBody, Sandboxed, St};
use crate::service::Service;
use crate::views::{ErrorView, NetworkPolicyReq, NetworkView};

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

/// Replaces the network policy of a running sandbox.
#[utoipa::path(patch, path = "/v1/sandboxes/{id}/network", tag = "sandboxes", operation_id = "setNetwork", params(("id" = String, Path, description = "The sandbox id")), request_body(content = NetworkPolicyReq, description = "The new policy, as in create"),
    responses((status = 200, body = NetworkView), (status = 400, description = "Invalid input: the error names the field", body = ErrorView), (status = 401, description = "Missing or unknown API key", body = ErrorView), (status = 404, description = "No such sandbox in the key's workspace", body = ErrorView), (status = 409, description = "The sandbox stopped running during the request", body = ErrorView), (status = 413, description = "The request body is larger than the daemon allows", body = ErrorView)))]
pub(crate) async fn set_network(
    axum::extract::State(state): St,
    Sandboxed(e, JsonBody(policy)): Sandboxed<JsonBody<NetworkPolicy>>,
) -> AppResult<Json<NetworkView>> {
    Service(&state).set_network(&e, policy).await?;
    Ok(Json(network_view(&e.sandbox)))
}
