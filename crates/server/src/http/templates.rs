//! `/v1/templates`: what sandboxes are made from.

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::Json;
use serde::Serialize;

use super::kit::{AppResult, St};
use crate::autobuild::BuildStatus;
use crate::error::ApiError;
use crate::service::Service;
use crate::state::AppState;
use crate::views::{ErrorView, TemplateDefaultsView, TemplateView};

/// A template, with a background build's progress (`--auto-build`) when
/// one was started for its name: `build` {state, step, error, ...}, and
/// `building: true` while an alias serves it in the meantime.
#[derive(Debug, Serialize)]
pub(crate) struct TemplateListing {
    #[serde(flatten)]
    template: TemplateView,
    #[serde(skip_serializing_if = "Option::is_none")]
    build: Option<BuildStatus>,
    #[serde(skip_serializing_if = "Option::is_none")]
    building: Option<bool>,
}

fn template_view(state: &AppState, name: &str, alias_of: Option<&str>) -> AppResult<TemplateView> {
    let t = state
        .runtime
        .template(alias_of.unwrap_or(name))
        .map_err(ApiError::from)?;
    let l = t.defaults.apply(state.config.default_limits);
    let d = t.defaults;
    Ok(TemplateView {
        name: name.into(),
        rootfs_path: String::new(),
        size_bytes: t.size_bytes,
        cpu: crate::limits::whole_cores(&l),
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
}

/// A template's view with its build's progress, if any.
fn with_build(state: &AppState, name: &str, template: TemplateView) -> TemplateListing {
    let build = state.auto_builds.status(name);
    let building = build.is_some().then(|| state.auto_builds.in_progress(name));
    TemplateListing {
        template,
        build,
        building,
    }
}

#[utoipa::path(get, path = "/v1/templates", tag = "templates", operation_id = "listTemplates",
    responses((status = 200, body = Vec<TemplateView>), (status = 401, description = "Missing or unknown API key", body = ErrorView)))]
pub(crate) async fn templates(State(state): St) -> AppResult<Json<Vec<TemplateListing>>> {
    let mut out = Vec::new();
    for name in runcell_core::Template::installed(state.config.templates_dir.as_deref()) {
        let view = template_view(&state, &name, None)?;
        out.push(TemplateListing {
            template: view,
            build: None,
            building: None,
        });
    }
    for (alias, target) in &state.config.aliases {
        if Service(&state).resolve_alias(alias) == *alias {
            continue; // an installed template of that name is listed already
        }
        if let Ok(v) = template_view(&state, alias, Some(target)) {
            out.push(with_build(&state, alias, v));
        }
    }
    Ok(Json(out))
}

#[utoipa::path(get, path = "/v1/templates/{name}", tag = "templates", operation_id = "getTemplate", params(("name" = String, Path, description = "Template name or alias")),
    responses((status = 200, body = TemplateView), (status = 400, description = "Invalid input: the error names the field", body = ErrorView), (status = 401, description = "Missing or unknown API key", body = ErrorView), (status = 404, description = "No such template", body = ErrorView)))]
pub(crate) async fn template(
    State(state): St,
    Path(name): Path<String>,
) -> AppResult<Json<TemplateListing>> {
    let resolved = Service(&state).resolve_alias(&name);
    let alias = (resolved != name).then_some(resolved);
    let view = template_view(&state, &name, alias.as_deref())
        .map_err(|_| ApiError::new(StatusCode::NOT_FOUND, "template not found"))?;
    Ok(Json(with_build(&state, &name, view)))
}
