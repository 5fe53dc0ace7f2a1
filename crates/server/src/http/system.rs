//! The routes that are about the daemon, not a sandbox: health, metrics
//! and the caller's key.

use axum::extract::{Extension, State};
use axum::http::header;
use axum::response::IntoResponse;
use axum::Json;

use super::kit::{St, Workspace};
use crate::views::{BackendView, ErrorView, HealthView, LayerView, MeView, SystemView};

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
    crate::metrics::render_daemon(
        &mut text,
        crate::metrics::DaemonSample {
            tasks: tokio::runtime::Handle::current()
                .metrics()
                .num_alive_tasks(),
            teardowns: state.teardowns.load(std::sync::atomic::Ordering::Acquire),
            sandbox_locks: state.sandbox_locks(),
        },
    );
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

/// What this host enforces (user namespaces, seccomp, Landlock, cgroups,
/// OOM reporting, KVM) and which isolation backends this daemon runs, and
/// why not. Probed when the daemon started.
#[utoipa::path(get, path = "/v1/system", tag = "system", operation_id = "getSystem",
    responses((status = 200, body = SystemView), (status = 401, description = "Missing or unknown API key", body = ErrorView)))]
pub(crate) async fn system(State(state): St) -> Json<SystemView> {
    let r = &state.system;
    let h = &r.host;
    let layer = |name: &str, c: &runcell_core::host::Check| LayerView {
        name: name.into(),
        available: c.available,
        detail: c.detail.clone(),
    };
    let default = state.runtime.default_isolation();
    let runs = state.runtime.isolations();
    let gvisor_memory = if runs.contains(&runcell_core::backend::Isolation::Gvisor) {
        Some(gvisor_checkpoint().await)
    } else {
        None
    };
    let microvm_memory = if runs.contains(&runcell_core::backend::Isolation::Microvm) {
        Some(microvm_memory().await)
    } else {
        None
    };
    Json(SystemView {
        kernel: h.kernel.clone(),
        cgroup_version: h.cgroups.version.clone(),
        cgroup_controllers: h.cgroups.controllers.clone(),
        landlock_abi: h.landlock_abi.unwrap_or(0),
        layers: vec![
            layer("user_namespaces", &h.user_namespaces),
            layer("seccomp", &h.seccomp),
            layer("landlock", &h.landlock),
            LayerView {
                name: "cgroups".into(),
                available: h.cgroups.version != "none",
                detail: h.cgroups.detail.clone(),
            },
            LayerView {
                name: "oom_kill_reporting".into(),
                available: h.cgroups.oom_kill_reporting,
                detail: if h.cgroups.oom_kill_reporting {
                    "an out-of-memory kill is reported by name".into()
                } else {
                    "an out-of-memory kill shows only as SIGKILL".into()
                },
            },
            layer("kvm", &h.kvm),
        ],
        backends: r
            .backends
            .iter()
            .map(|b| {
                let isolation = b.name.parse().ok();
                let jail = isolation == Some(runcell_core::backend::Isolation::Jail);
                let gvisor = isolation == Some(runcell_core::backend::Isolation::Gvisor);
                let microvm = isolation == Some(runcell_core::backend::Isolation::Microvm);
                let freezer = h.cgroups.version.contains("v2")
                    || h.cgroups.controllers.iter().any(|c| c == "freezer");
                BackendView {
                    name: b.name.into(),
                    available: isolation.is_some_and(|i| runs.contains(&i)),
                    default: isolation == Some(default),
                    detail: b.detail.clone(),
                    pause: if microvm { microvm_memory.is_some() } else { freezer },
                    save_files: jail || (gvisor && gvisor_memory.is_some()) || (microvm && microvm_memory.is_some()),
                    save_memory: (gvisor && matches!(gvisor_memory, Some(Ok(()))))
                        || (microvm && matches!(microvm_memory, Some(Ok(())))),
                    state_detail: if jail {
                        format!(
                            "files are saved (the writable layer, copied while frozen); processes and memory are not (no checkpointing){}",
                            if freezer { "" } else { "; no cgroup freezer, so no pause" }
                        )
                    } else if gvisor {
                        let files = "pause works (the host's freezer stops the sentry and gofer); hibernation, snapshots and forks save files (the host-side writable layer)";
                        match &gvisor_memory {
                            Some(Ok(())) => format!("{files}, and memory too (runsc checkpoint and restore verified here): processes and code contexts go on after a wake, and come along into a snapshot's sandboxes and a fork (the sandbox is checkpointed, which stops it, as this runsc's `checkpoint --leave-running` hangs, and restored in place); a restore that fails starts on the files and says state_lost"),
                            Some(Err(why)) => format!("{files}, not memory: {why}"),
                            None => files.to_string(),
                        }
                    } else if microvm {
                        let files = "pause stops the guest's vCPUs (QMP stop/cont; its memory stays); hibernation, snapshots and forks save files (the guest's writable disk, a qcow2 chain: the guest flushes it, its image becomes read-only and is hard-linked, the guest goes on on a new overlay)";
                        match &microvm_memory {
                            Some(Ok(())) => format!("{files}, and memory too (QEMU's migration to a file and -incoming, verified here): processes and code contexts go on after a wake, and come along into a snapshot's sandboxes and a fork (the guest is stopped for the migration and continued in place); a create that asks for other limits, network, environment or volumes, or a restore that fails, starts on the files and says state_lost"),
                            Some(Err(why)) => format!("{files}, not memory (the guest boots again on its disk): {why}"),
                            None => "this daemon does not run microVMs".into(),
                        }
                    } else {
                        "this daemon does not run this backend".into()
                    },
                }
            })
            .collect(),
        default_isolation: default.as_str().into(),
        layer_store: {
            let cow = state.runtime.config().stage_store.is_some();
            crate::views::LayerStoreView {
                kind: state.layer_store.name().into(),
                copy_on_write: cow,
                detail: if cow {
                    "each sandbox writes to a btrfs subvolume capped by a qgroup limit; a save is a read-only snapshot of it (O(1), forks share its extents)".into()
                } else {
                    "each sandbox writes to a tmpfs; a save copies it (time and disk grow with what it wrote)".into()
                },
                reason: state.layer_store.reason().into(),
            }
        },
    })
}

/// Whether `runsc checkpoint` and `runsc restore` work here (probed once,
/// at the first ask: about a second), or runsc's reason why not.
async fn gvisor_checkpoint() -> Result<(), String> {
    static PROBED: tokio::sync::OnceCell<Result<(), String>> = tokio::sync::OnceCell::const_new();
    PROBED
        .get_or_init(|| async {
            tokio::task::spawn_blocking(|| {
                runcell_core::backend::probe_checkpoint(
                    &runcell_core::backend::find_runsc(None),
                    runcell_core::backend::Platform::Ptrace,
                )
            })
            .await
            .unwrap_or_else(|e| Err(format!("The checkpoint probe failed: {e}.")))
        })
        .await
        .clone()
}

/// Whether a microVM's memory can be saved to a file and loaded again here
/// (probed once, at the first ask: about a second), or why not.
async fn microvm_memory() -> Result<(), String> {
    tokio::task::spawn_blocking(runcell_core::backend::microvm::probe_memory_save)
        .await
        .unwrap_or_else(|e| Err(format!("The memory probe failed: {e}.")))
}
