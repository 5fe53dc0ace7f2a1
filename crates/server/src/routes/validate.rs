//! Request checks at the edge: every number, name and size a request
//! carries is checked here (through `runcell_core::limits`) into a 4xx that
//! names the field and its range before anything is made or sent to a
//! sandbox; and a handler that panics answers 500 instead of taking the
//! daemon down.

use std::any::Any;
use std::collections::BTreeMap;

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use runcell_core::limits::{self, LimitBounds, RequestError};

use crate::error::ApiError;
use crate::state::AppState;

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

/// The ranges a request's limits must fall in on this daemon.
pub(crate) fn bounds(state: &AppState) -> LimitBounds {
    LimitBounds {
        max_output_bytes: state.config.max_output_bytes,
        ..LimitBounds::for_host(
            state.config.max_exec_timeout,
            state.config.max_lifetime,
            &state.config.default_limits,
        )
    }
}

/// An idle TTL in seconds, up to the maximum lifetime.
pub(crate) fn ttl(state: &AppState, secs: f64) -> Result<u64, ApiError> {
    Ok(bounds(state).ttl("ttl_seconds", secs)?)
}

/// Environment variables of a create or a session: each one a process can
/// have, and all of them within one protocol frame once encoded (a stored
/// environment that did not fit would fail every later exec).
pub(crate) fn env(field: &'static str, env: &BTreeMap<String, String>) -> Result<(), ApiError> {
    limits::check_env(field, env)?;
    limits::check_encoded(field, "", env, None)?;
    Ok(())
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

/// A cell's source code.
pub(crate) fn code(code: &str) -> Result<(), ApiError> {
    Ok(limits::check_len(
        "code",
        code,
        limits::MAX_CODE_BYTES,
        ", the agent protocol's limit for one message; write larger data to a file",
    )?)
}

/// Answers a panic in a handler with a 500 `{"error": ...}` and logs it; the
/// daemon and every other request carry on.
pub(crate) type CatchPanics =
    tower_http::catch_panic::CatchPanicLayer<fn(Box<dyn Any + Send + 'static>) -> Response>;

/// The layer that catches a panicking handler (see [`CatchPanics`]).
pub(crate) fn catch_panics() -> CatchPanics {
    tower_http::catch_panic::CatchPanicLayer::custom(panic_response as fn(_) -> _)
}

fn panic_response(panic: Box<dyn Any + Send + 'static>) -> Response {
    let what = panic
        .downcast_ref::<String>()
        .map(String::as_str)
        .or_else(|| panic.downcast_ref::<&str>().copied())
        .unwrap_or("a panic without a message");
    tracing::error!(panic = what, "a request handler panicked; answered 500");
    ApiError::internal(
        "The daemon failed while handling this request (an internal error, logged); \
         the request may be retried, and other requests are not affected.",
    )
    .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::routing::get;
    use axum::Router;

    /// A router whose handler panics keeps serving: the panicking request
    /// gets a 500 with a JSON error, the next ones are answered normally.
    #[tokio::test(flavor = "multi_thread")]
    async fn a_panicking_handler_answers_500_and_the_server_keeps_serving() {
        let app = Router::new()
            .route(
                "/boom",
                get(|| async {
                    let n: u32 = "not a number".parse().unwrap_or(0);
                    if n == 0 {
                        panic!("a handler bug");
                    }
                    "never"
                }),
            )
            .route("/ok", get(|| async { "ok" }))
            .layer(catch_panics());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await });
        let client = reqwest::Client::new();
        for _ in 0..3 {
            let r = client
                .get(format!("http://{addr}/boom"))
                .send()
                .await
                .expect("a panicking handler must still be answered");
            assert_eq!(r.status(), 500);
            let body: serde_json::Value = r.json().await.unwrap();
            assert!(
                body["error"].as_str().unwrap().contains("internal error"),
                "{body}"
            );
            let r = client
                .get(format!("http://{addr}/ok"))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200);
            assert_eq!(r.text().await.unwrap(), "ok");
        }
    }
}
