//! `runcell serve` over real HTTP: bad input gets clear errors, and the
//! logs, OpenAPI document and metrics show what happened. Needs root.

mod common;

use std::time::Duration;

use common::*;
use serde_json::{json, Value};

#[tokio::test(flavor = "multi_thread")]
async fn bad_input_gets_clear_errors() {
    let data = data_dir("bad");
    let d = Daemon::start(&data, free_port(), &["--max-body", "1M"]);
    let post = |path: &str, body: &'static str| {
        d.req(reqwest::Method::POST, path)
            .header("content-type", "application/json")
            .body(body)
    };
    expect_error(post("/v1/sandboxes", "{not json"), 400, "not valid JSON").await;
    expect_error(
        post("/v1/sandboxes", r#"{"template":"cobol-99"}"#),
        400,
        "installed templates: host",
    )
    .await;
    expect_error(
        post("/v1/sandboxes", r#"{"ttl_seconds":-5}"#),
        400,
        "ttl_seconds must be a whole number between 0 and",
    )
    .await;
    expect_error(
        post("/v1/sandboxes/nope/exec", r#"{"cmd":"true"}"#),
        404,
        "sandbox not found",
    )
    .await;
    let id = d.create(json!({})).await;
    let fs = |method, path: &str| d.req(method, &format!("/v1/sandboxes/{id}/fs?path={path}"));
    expect_error(
        fs(reqwest::Method::PUT, "/tmp/big").body(vec![0u8; 2 << 20]),
        413,
        "larger than",
    )
    .await;
    expect_error(fs(reqwest::Method::GET, "etc/passwd"), 400, "absolute").await;
    expect_error(fs(reqwest::Method::GET, "/no/such"), 404, "No such file").await;
    expect_error(
        reqwest::Client::new()
            .get(format!("{}/v1/sandboxes", d.url))
            .bearer_auth("wrong"),
        401,
        "unauthorized",
    )
    .await;
    // The sandbox lost nothing through all that.
    let (s, body) = d.exec(&id, "echo fine").await;
    assert_eq!((s, body["stdout"].as_str().unwrap()), (200, "fine\n"));
    let list: Vec<Value> = d.get("/v1/sandboxes").await;
    assert_eq!(list.len(), 1);
    // The sandbox's log has the output of its execs, as text and as SSE.
    let log = d
        .text(&format!("/v1/sandboxes/{id}/logs?stream=stdout"))
        .await;
    assert_eq!(log, "fine\n");
    let follow = d
        .req(
            reqwest::Method::GET,
            &format!("/v1/sandboxes/{id}/logs?follow=true"),
        )
        .send()
        .await
        .unwrap();
    assert!(follow.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/event-stream"));
    let (s, _) = d.exec(&id, "echo live").await;
    assert_eq!(s, 200);
    let mut body = follow.bytes_stream();
    let mut seen = String::new();
    use futures_util::StreamExt;
    while !seen.contains("live") {
        let chunk = tokio::time::timeout(Duration::from_secs(5), body.next())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        seen.push_str(&String::from_utf8_lossy(&chunk));
    }
    assert!(
        seen.contains("event: line\ndata: {\"line\":\"fine\\n\"}"),
        "{seen}"
    );
    assert!(seen.contains("{\"line\":\"live\\n\"}"), "{seen}");
    // The OpenAPI document is generated from the handlers (no key needed).
    let doc: Value = reqwest::get(format!("{}/v1/openapi.json", d.url))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert!(doc["openapi"].as_str().unwrap().starts_with("3."), "{doc}");
    for path in [
        "/v1/sandboxes",
        "/v1/sandboxes/{id}/exec",
        "/v1/sandboxes/{id}/fs",
        "/v1/sandboxes/{id}/lifecycle",
        "/v1/templates",
    ] {
        assert!(
            doc["paths"].get(path).is_some(),
            "{path} missing from the OpenAPI document"
        );
    }
    let exec_schema = &doc["components"]["schemas"]["ExecView"]["properties"];
    assert!(
        exec_schema.get("oom_killed").is_some() && exec_schema.get("exit_code").is_some(),
        "{exec_schema}"
    );
    // The errors and the creation show up in the metrics (no key needed).
    let text = d.metrics().await;
    assert!(text.contains("runcell_sandbox_creations_total 1"), "{text}");
    assert!(
        text.contains("runcell_sandboxes{state=\"running\"} 1"),
        "{text}"
    );
    assert!(
        text.contains("runcell_api_errors_total{route=\"/v1/sandboxes\",status=\"400\"} 3"),
        "{text}"
    );
    assert!(
        text.contains("route=\"/v1/sandboxes/{id}/fs\",status=\"413\"} 1"),
        "{text}"
    );
    let _ = (d.port, &d.data);
    d.delete_all().await;
    drop(d);
    let _ = std::fs::remove_dir_all(&data);
}
