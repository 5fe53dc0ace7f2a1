//! Every error of the API, axum's own rejections included, is
//! `{"error": "..."}` with `application/json` (issue 10, defect 12), and a
//! query parameter that is not UTF-8 is refused, not decoded into another
//! path. Over HTTP against a real daemon. Needs root.

mod common;
use common::*;

use reqwest::Method;
use serde_json::{json, Value};

/// Sends `rb`, expects `status`, a JSON content type and an `error`
/// sentence containing `words`; returns the response's headers.
async fn json_error(
    rb: reqwest::RequestBuilder,
    status: u16,
    words: &str,
) -> reqwest::header::HeaderMap {
    let r = rb.send().await.unwrap();
    let got = r.status().as_u16();
    let headers = r.headers().clone();
    let ctype = headers
        .get("content-type")
        .map(|v| v.to_str().unwrap().to_string())
        .unwrap_or_default();
    let text = r.text().await.unwrap();
    assert_eq!(got, status, "{text}");
    assert!(
        ctype.starts_with("application/json"),
        "status {got}: content-type {ctype:?}, body {text:?}"
    );
    let body: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text:?}"));
    let msg = body["error"]
        .as_str()
        .unwrap_or_else(|| panic!("no error: {text}"));
    assert!(msg.contains(words), "{msg:?} should contain {words:?}");
    headers
}

#[tokio::test(flavor = "multi_thread")]
async fn every_error_is_json_with_an_error_sentence() {
    let d = Daemon::start(
        &data_dir("api-errors"),
        free_port(),
        &["--max-body", "1MiB"],
    );
    let id = d.create(json!({})).await;
    let sb = format!("/v1/sandboxes/{id}");
    // A file whose name is the replacement character must not be what a
    // path of invalid UTF-8 reads.
    let (code, _) = d
        .exec(&id, "printf secret > /tmp/$(printf '\\357\\277\\275')")
        .await;
    assert_eq!(code, 200);

    // Invalid UTF-8 in a query parameter: a 400 naming it, on every route.
    for route in ["fs", "fs/stat", "fs/dir"] {
        json_error(
            d.req(Method::GET, &format!("{sb}/{route}?path=/tmp/%FF")),
            400,
            "\"path\"",
        )
        .await;
    }
    json_error(
        d.req(Method::PUT, &format!("{sb}/fs?path=/tmp/%C3%28"))
            .body("x"),
        400,
        "\"path\"",
    )
    .await;
    json_error(
        d.req(Method::GET, &format!("{sb}/logs?stream=%FF")),
        400,
        "\"stream\"",
    )
    .await;
    json_error(
        d.req(Method::GET, "/v1/sandboxes?metadata.a=%FF"),
        400,
        "\"metadata.a\"",
    )
    .await;
    // Malformed query (a repeated field): axum's rejection, as JSON.
    json_error(
        d.req(Method::GET, &format!("{sb}/fs?path=/a&path=/b")),
        400,
        "path",
    )
    .await;
    // Invalid UTF-8 in a path segment.
    json_error(d.req(Method::GET, "/v1/sandboxes/%FF"), 400, "URL path").await;
    json_error(
        d.req(Method::GET, &format!("{sb}/repl/sessions/%FF%FE/run")),
        405,
        "GET",
    )
    .await;
    json_error(
        d.req(Method::POST, &format!("{sb}/repl/sessions/%FF/run"))
            .json(&json!({"code": "1"})),
        400,
        "URL path",
    )
    .await;

    // A body that may be absent is absent only when it has no bytes: JSON
    // whitespace alone, a form feed (ASCII whitespace, not JSON's) or any
    // other byte is a body, and not JSON (a JSON text holds a value).
    for route in ["repl/sessions", "fork", "promote"] {
        for body in ["\x0c", "\x0b", " \x0c\n", " ", " \t\r\n"] {
            json_error(
                d.req(Method::POST, &format!("{sb}/{route}"))
                    .header("content-type", "application/json")
                    .body(body),
                400,
                "not valid JSON",
            )
            .await;
        }
    }
    let r = d
        .req(Method::POST, &format!("{sb}/repl/sessions"))
        .header("content-type", "application/json")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201, "no body at all is an absent body");

    // Wrong methods: 405, the Allow header kept, a sentence naming the method.
    let h = json_error(d.req(Method::DELETE, "/v1/me"), 405, "DELETE").await;
    assert_eq!(h.get("allow").unwrap(), "GET,HEAD");
    json_error(d.req(Method::PUT, "/healthz"), 405, "PUT").await;
    json_error(d.req(Method::POST, "/v1/openapi.json"), 405, "POST").await;
    json_error(d.req(Method::PATCH, &format!("{sb}/exec")), 405, "PATCH").await;

    // Unknown routes, inside and outside /v1.
    json_error(d.req(Method::GET, "/nope"), 404, "no such route").await;
    json_error(d.req(Method::GET, "/v1/nope"), 404, "no such route").await;

    // Bodies: not JSON, the wrong JSON, over the size limit.
    json_error(
        d.req(Method::POST, &format!("{sb}/exec")).body("{"),
        400,
        "JSON",
    )
    .await;
    json_error(
        d.req(Method::POST, &format!("{sb}/exec"))
            .json(&json!({"cmd": 1})),
        400,
        "cmd",
    )
    .await;
    // serde would read a struct from an array of its fields.
    json_error(
        d.req(Method::PATCH, &format!("{sb}/lifecycle"))
            .json(&json!([null, true])),
        400,
        "not an array",
    )
    .await;
    json_error(
        d.req(Method::POST, "/v1/sandboxes").json(&json!(["host"])),
        400,
        "not an array",
    )
    .await;
    json_error(
        d.req(Method::PUT, &format!("{sb}/fs?path=/tmp/big"))
            .body(vec![b'x'; 2 << 20]),
        413,
        "larger",
    )
    .await;
    // MCP's own rejections (rmcp answers them as text): JSON too.
    json_error(
        d.req(Method::POST, "/mcp")
            .header("accept", "application/json, text/event-stream")
            .json(&json!({"not": "json-rpc"})),
        415,
        "POST /mcp",
    )
    .await;
    json_error(
        d.req(Method::POST, "/mcp").json(&json!({"jsonrpc": "2.0"})),
        406,
        "accept",
    )
    .await;

    // The file named by the replacement character was never read instead.
    let r = d
        .req(Method::GET, &format!("{sb}/fs?path=/tmp/%EF%BF%BD"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.text().await.unwrap(), "secret");

    d.delete_all().await;
}
