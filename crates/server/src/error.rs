//! API errors: a status and a sentence, sent as `{"error": "..."}`.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use runcell_protocol::ErrorKind;

/// An error answered to an API caller.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// What the caller reads.
    pub message: String,
    /// Extra JSON fields merged into the body (e.g. partial output on a timeout).
    pub extra: Option<serde_json::Map<String, serde_json::Value>>,
    /// Seconds for a Retry-After header.
    pub retry_after: Option<u64>,
}

impl ApiError {
    /// An error with a status and message.
    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            extra: None,
            retry_after: None,
        }
    }

    /// 400.
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message)
    }

    /// 404 for a sandbox.
    pub fn no_sandbox() -> Self {
        Self::new(StatusCode::NOT_FOUND, "sandbox not found")
    }

    /// 500.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, message)
    }

    /// This error as the answer to a request whose fields sit in the
    /// object `scope` of the body (`POST /v1/run`'s `sandbox` and `exec`),
    /// `fields` their names: a 400's or 413's message that starts with one
    /// of them then names the field from the body's top
    /// (`exec.timeout_seconds must be ...`); another says which part it is
    /// about (`sandbox: unknown template ...`).
    pub(crate) fn within(mut self, scope: &str, fields: &[&str]) -> Self {
        if matches!(
            self.status,
            StatusCode::BAD_REQUEST | StatusCode::PAYLOAD_TOO_LARGE
        ) {
            let m = &self.message;
            let names_field = fields.iter().any(|f| {
                m.strip_prefix(f)
                    .is_some_and(|rest| rest.starts_with(['.', ' ', ':', '[']))
            });
            self.message = if names_field {
                format!("{scope}.{m}")
            } else {
                format!("{scope}: {m}")
            };
        }
        self
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut body = self.extra.unwrap_or_default();
        body.insert("error".into(), self.message.into());
        let mut resp = (self.status, Json(serde_json::Value::Object(body))).into_response();
        if let Some(secs) = self.retry_after {
            resp.headers_mut()
                .insert(axum::http::header::RETRY_AFTER, secs.into());
        }
        resp
    }
}

impl From<runcell_core::Error> for ApiError {
    fn from(e: runcell_core::Error) -> Self {
        use runcell_core::{ClientError, Error};
        match &e {
            Error::Template(t) => ApiError::bad_request(t.to_string()),
            Error::Agent(ClientError::Agent { kind, message }) => {
                let status = match kind {
                    ErrorKind::NotFound => StatusCode::NOT_FOUND,
                    ErrorKind::InvalidInput => StatusCode::BAD_REQUEST,
                    ErrorKind::PermissionDenied => StatusCode::FORBIDDEN,
                    ErrorKind::TooLarge => StatusCode::PAYLOAD_TOO_LARGE,
                    ErrorKind::NoSpace => StatusCode::INSUFFICIENT_STORAGE,
                    ErrorKind::SpawnFailed => StatusCode::BAD_REQUEST,
                    ErrorKind::Other => StatusCode::INTERNAL_SERVER_ERROR,
                };
                ApiError::new(status, message.clone())
            }
            // Whatever a request carried that did not fit one protocol frame
            // (the checks in validate.rs should catch it first).
            Error::Agent(ClientError::Codec(runcell_protocol::CodecError::TooLarge { .. })) => {
                ApiError::new(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    format!("The request is too large for the sandbox agent: {e}"),
                )
            }
            Error::Agent(ClientError::Closed) => {
                ApiError::new(StatusCode::CONFLICT, "The sandbox is no longer running.")
            }
            Error::Ended(_) => ApiError::new(StatusCode::CONFLICT, e.to_string()),
            _ => {
                let mut msg = e.to_string();
                let mut src = std::error::Error::source(&e);
                while let Some(s) = src {
                    // "The agent connection failed: Broken pipe (os error 32)".
                    msg.truncate(msg.trim_end_matches('.').len());
                    msg.push_str(&format!(": {s}"));
                    src = s.source();
                }
                ApiError::internal(msg)
            }
        }
    }
}
