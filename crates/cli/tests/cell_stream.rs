//! Code cells stream (issue 11: the SDKs' onStdout/onStderr/onResult fire
//! while a cell runs): `POST .../repl/sessions/{sid}/run/stream` sends the
//! cell's output and rich results as server-sent events as they happen,
//! then one `done` event with the same answer `run` gives. Over HTTP
//! against a real daemon. Needs root.

mod common;
use common::*;

use std::time::{Duration, Instant};

use reqwest::Method;
use serde_json::{json, Value};

/// Reads an SSE response to its end: (event, data, when) per event.
async fn events(mut resp: reqwest::Response, t0: Instant) -> Vec<(String, Value, Duration)> {
    let (mut buf, mut out) = (String::new(), Vec::new());
    while let Some(chunk) = resp.chunk().await.unwrap() {
        buf.push_str(&String::from_utf8_lossy(&chunk));
        while let Some(end) = buf.find("\n\n") {
            let block: String = buf.drain(..end + 2).collect();
            let (mut event, mut data) = (String::new(), String::new());
            for line in block.lines() {
                if let Some(v) = line.strip_prefix("event:") {
                    event = v.trim().to_string();
                } else if let Some(v) = line.strip_prefix("data:") {
                    data.push_str(v.trim_start());
                }
            }
            if !event.is_empty() {
                out.push((
                    event,
                    serde_json::from_str(&data).unwrap_or(Value::Null),
                    t0.elapsed(),
                ));
            }
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread")]
async fn a_cell_streams_its_output_and_results_while_it_runs() {
    let d = Daemon::start(
        &data_dir("cell-stream"),
        free_port(),
        &["--warm-pool", "code-interpreter=0"],
    );
    let id = d.create(json!({"template": "host"})).await;
    let r = d
        .req(Method::POST, &format!("/v1/sandboxes/{id}/repl/sessions"))
        .json(&json!({"language": "python"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    let sid = r.json::<Value>().await.unwrap()["id"]
        .as_str()
        .unwrap()
        .to_string();
    let path = format!("/v1/sandboxes/{id}/repl/sessions/{sid}/run/stream");

    let t0 = Instant::now();
    let code = "import sys, time\nprint('first', flush=True)\nprint('oops', file=sys.stderr, flush=True)\ndisplay(41)\ntime.sleep(1.5)\nprint('last')\n6 * 7";
    let resp = d
        .req(Method::POST, &path)
        .json(&json!({"code": code}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert!(resp.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/event-stream"));
    let evs = events(resp, t0).await;
    let total = t0.elapsed();
    let at = |name: &str, pred: &dyn Fn(&Value) -> bool| {
        evs.iter()
            .find(|(e, d, _)| e == name && pred(d))
            .unwrap_or_else(|| panic!("no {name} event: {evs:?}"))
            .2
    };
    // Output and the display() arrive while the cell sleeps, not at its end
    // (print may write its text and its newline as two chunks).
    let early = total.saturating_sub(Duration::from_millis(1000));
    let before = |name: &str| -> String {
        evs.iter()
            .filter(|(e, _, t)| e == name && *t < early)
            .filter_map(|(_, d, _)| d["chunk"].as_str())
            .collect()
    };
    assert_eq!(before("stdout"), "first\n", "{evs:?}");
    assert_eq!(before("stderr"), "oops\n", "{evs:?}");
    assert!(
        at("result", &|d| d["text/plain"] == "41") < early,
        "{evs:?}"
    );
    at("result", &|d| d["text/plain"] == "42");
    // The last event is the whole answer, as `run` gives it.
    let (last, done, _) = evs.last().unwrap();
    assert_eq!(last, "done", "{evs:?}");
    assert_eq!(done["stdout"], "first\nlast\n", "{done}");
    assert_eq!(done["stderr"], "oops\n", "{done}");
    assert_eq!(done["results"].as_array().unwrap().len(), 2, "{done}");
    assert_eq!(done["timed_out"], false);

    // A timeout ends with `done` too, saying so; the context keeps its state.
    let resp = d
        .req(Method::POST, &path)
        .json(&json!({"code": "import time\ntime.sleep(10)", "timeout_ms": 500}))
        .send()
        .await
        .unwrap();
    let evs = events(resp, Instant::now()).await;
    let (last, done, _) = evs.last().unwrap();
    assert_eq!(
        (last.as_str(), &done["timed_out"]),
        ("done", &json!(true)),
        "{evs:?}"
    );

    // Bad input and a missing session answer before any stream starts.
    expect_error(
        d.req(Method::POST, &path).json(&json!({"code": "  "})),
        400,
        "code",
    )
    .await;
    expect_error(
        d.req(
            Method::POST,
            &format!("/v1/sandboxes/{id}/repl/sessions/nope/run/stream"),
        )
        .json(&json!({"code": "1"})),
        404,
        "session not found",
    )
    .await;
    d.delete_all().await;
}
