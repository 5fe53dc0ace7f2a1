//! One error shape for every response: `{"error": "..."}` with
//! `application/json`. The handlers answer with `ApiError`, but axum answers
//! some requests itself before a handler runs: a path, query or body
//! extractor's rejection (text/plain), an unknown route, a method the route
//! does not have (405 with an empty body), a body over a limit (413), a
//! wrong content type (415). This middleware, outermost in the router,
//! rewrites every such error into the API's shape, keeping its status and
//! headers (`Allow`, `Retry-After`, ...) and naming what was wrong.

use axum::extract::Request;
use axum::http::{header, HeaderMap, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::error::ApiError;

/// The most of a rejection's own text that is kept (axum's are one line).
const MAX_TEXT: usize = 16 * 1024;

/// Rewrites an error response that is not JSON into `{"error": "..."}`.
pub(crate) async fn json_errors(req: Request, next: Next) -> Response {
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    let query = req.uri().query().map(str::to_string);
    // axum's query extractor decodes lossily: `path=%FF` would reach a
    // handler as U+FFFD and name another file. Refuse it, naming the
    // parameter.
    if let Some(name) = bad_query_param(query.as_deref()) {
        return ApiError::bad_request(format!(
            "The query parameter \"{name}\" is not valid UTF-8 once percent-decoded."
        ))
        .into_response();
    }
    let resp = next.run(req).await;
    let status = resp.status();
    if !(status.is_client_error() || status.is_server_error()) || is_json(resp.headers()) {
        return resp;
    }
    let (parts, body) = resp.into_parts();
    let text = match axum::body::to_bytes(body, MAX_TEXT).await {
        Ok(b) => String::from_utf8_lossy(&b).trim().to_string(),
        Err(_) => String::new(),
    };
    let message = describe(status, &method, &path, &parts.headers, &text);
    let mut out = ApiError::new(status, message).into_response();
    for (name, value) in &parts.headers {
        if name != header::CONTENT_TYPE && name != header::CONTENT_LENGTH {
            out.headers_mut().insert(name.clone(), value.clone());
        }
    }
    out
}

fn is_json(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|m| m.trim().eq_ignore_ascii_case("application/json"))
}

/// A sentence for a rejection: what was wrong, named as the caller sent it.
fn describe(
    status: StatusCode,
    method: &Method,
    path: &str,
    headers: &HeaderMap,
    text: &str,
) -> String {
    match status {
        StatusCode::METHOD_NOT_ALLOWED => {
            let allowed = headers
                .get(header::ALLOW)
                .and_then(|v| v.to_str().ok())
                .filter(|v| !v.is_empty());
            match allowed {
                Some(a) => format!("The method {method} is not allowed on {path}; it allows {a}."),
                None => format!("The method {method} is not allowed on {path}."),
            }
        }
        StatusCode::NOT_FOUND if text.is_empty() => {
            format!("There is no such route in this API: {method} {path}.")
        }
        StatusCode::UNSUPPORTED_MEDIA_TYPE => format!(
            "{method} {path} does not accept this request body or its Content-Type{}",
            detail(text)
        ),
        StatusCode::PAYLOAD_TOO_LARGE => format!("The request body is too large{}", detail(text)),
        _ if text.starts_with("Failed to deserialize query string") => {
            format!(
                "The query string is not valid for this route{}",
                detail(text)
            )
        }
        _ if text.starts_with("Invalid URL") || text.contains("path param") => {
            format!(
                "The URL path {path} is not valid for this route{}",
                detail(text)
            )
        }
        _ if text.is_empty() => format!(
            "{} {}.",
            status.as_u16(),
            status.canonical_reason().unwrap_or("error")
        ),
        _ => sentence(text),
    }
}

/// `: text.` for a non-empty text, else `.`.
fn detail(text: &str) -> String {
    if text.is_empty() {
        ".".into()
    } else {
        format!(": {}", sentence(text))
    }
}

fn sentence(text: &str) -> String {
    let t = text.trim_end();
    if t.ends_with(['.', '!', '?']) {
        t.to_string()
    } else {
        format!("{t}.")
    }
}

/// The first query parameter whose name or value is not UTF-8 once
/// percent-decoded.
fn bad_query_param(query: Option<&str>) -> Option<String> {
    for pair in query?.split('&') {
        let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
        let decode = |s: &str| {
            percent_encoding::percent_decode_str(&s.replace('+', " "))
                .decode_utf8()
                .map(|c| c.into_owned())
        };
        match decode(name) {
            Err(_) => return Some(String::from_utf8_lossy(name.as_bytes()).into_owned()),
            Ok(n) if decode(value).is_err() => return Some(n),
            Ok(_) => {}
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_the_query_parameter_that_is_not_utf8() {
        assert_eq!(
            bad_query_param(Some("a=1&path=%FF")).as_deref(),
            Some("path")
        );
        assert_eq!(bad_query_param(Some("path=%C3%A9")), None);
    }
}
