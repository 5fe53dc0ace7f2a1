//! Request checks at the edge: every number, name and size a request
//! carries is checked here (through `runcell_core::limits`) into a 4xx that
//! names the field and its range before anything is made or sent to a
//! sandbox. Used by the HTTP layer and the service alike.

use std::collections::BTreeMap;

use axum::http::StatusCode;
use runcell_core::limits::{self, LimitBounds, RequestError};

use crate::error::ApiError;
use crate::state::ServeConfig;

impl From<RequestError> for ApiError {
    fn from(e: RequestError) -> Self {
        let status = if e.is_too_large() {
            StatusCode::PAYLOAD_TOO_LARGE
        } else {
            StatusCode::BAD_REQUEST
        };
        ApiError::new(status, e.to_string())
    }
}

/// The ranges a request's limits must fall in on this daemon. The host's
/// part (its cores, as its cgroup's CPU quota allows, and its memory) is
/// read once per daemon settings, not on every create and exec: finding
/// the cores reads `/proc/self/cgroup`, the mount table and the quota
/// files. A host's cores or memory changed while the daemon runs are seen
/// after a restart.
pub(crate) fn bounds(config: &ServeConfig) -> LimitBounds {
    type Key = (
        std::time::Duration,
        std::time::Duration,
        runcell_core::SandboxLimits,
        u64,
    );
    static LAST: std::sync::Mutex<Option<(Key, LimitBounds)>> = std::sync::Mutex::new(None);
    let key = (
        config.max_exec_timeout,
        config.max_lifetime,
        config.default_limits,
        config.max_output_bytes,
    );
    let mut last = LAST
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    match &*last {
        Some((k, b)) if *k == key => *b,
        _ => {
            let b = LimitBounds {
                max_output_bytes: config.max_output_bytes,
                ..LimitBounds::for_host(
                    config.max_exec_timeout,
                    config.max_lifetime,
                    &config.default_limits,
                )
            };
            *last = Some((key, b));
            b
        }
    }
}

/// An idle TTL in seconds, up to the maximum lifetime.
pub(crate) fn ttl(config: &ServeConfig, secs: f64) -> Result<u64, ApiError> {
    Ok(bounds(config).ttl("ttl_seconds", secs)?)
}

/// Environment variables of a create or a session: each one a process can
/// have, and all of them within one protocol frame once encoded (a stored
/// environment that did not fit would fail every later exec).
pub(crate) fn env(field: &'static str, env: &BTreeMap<String, String>) -> Result<(), ApiError> {
    limits::check_env(field, env)?;
    limits::check_encoded(field, "", env, None)?;
    Ok(())
}

/// Metadata keys a fork adds to its parent's (the tree it belongs to):
/// not counted in the caller's number of keys or total, though each is
/// held to the limits of one key and value.
pub(crate) const FORK_METADATA: [&str; 2] = ["fork_tree_id", "fork_parent"];

/// A sandbox's metadata (keys a fork adds aside).
pub(crate) fn metadata(
    field: &'static str,
    metadata: &BTreeMap<String, String>,
) -> Result<(), ApiError> {
    Ok(limits::check_metadata(field, metadata, &FORK_METADATA)?)
}

/// A run's command, its environment (the sandbox's and the request's) and
/// working directory: each within its limit, and all of them within one
/// protocol frame.
pub(crate) fn run(
    cmd: &str,
    request_env: &BTreeMap<String, String>,
    merged_env: &BTreeMap<String, String>,
    cwd: Option<&str>,
) -> Result<(), ApiError> {
    limits::check_command("cmd", cmd)?;
    limits::check_env("env", request_env)?;
    limits::check_env("env", merged_env)?;
    if let Some(c) = cwd {
        limits::check_path("cwd", c)?;
    }
    limits::check_encoded("cmd, env and cwd", cmd, merged_env, cwd)?;
    Ok(())
}

/// A program run with `language` (exec): its code, its arguments (each an
/// argument of the interpreter's command line), environment and directory.
pub(crate) fn code_run(
    code_text: &str,
    args: &[String],
    request_env: &BTreeMap<String, String>,
    merged_env: &BTreeMap<String, String>,
    cwd: Option<&str>,
) -> Result<(), ApiError> {
    code(code_text)?;
    for a in args {
        limits::check_command("args", a)?;
    }
    limits::check_env("env", request_env)?;
    limits::check_env("env", merged_env)?;
    if let Some(c) = cwd {
        limits::check_path("cwd", c)?;
    }
    limits::check_encoded("args, env and cwd", &args.join("\0"), merged_env, cwd)?;
    Ok(())
}

/// A cell's source code.
pub(crate) fn code(code: &str) -> Result<(), ApiError> {
    Ok(limits::check_len(
        "code",
        code,
        limits::MAX_CODE_BYTES,
        ", the agent protocol's limit for one message; write larger data to a file",
    )?)
}
