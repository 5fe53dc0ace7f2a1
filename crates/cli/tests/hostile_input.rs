//! `runcell serve` under hostile request input (issue 10): every number, name
//! and size a request carries is checked at the edge into a 4xx that names
//! the field and its range, and nothing a request carries takes the daemon
//! down. Needs root.

mod common;

use std::time::Duration;

use common::*;
use reqwest::Method;
use serde_json::{json, Value};

/// The daemon still answers, and still runs code.
async fn still_serving(d: &Daemon) {
    let r = reqwest::get(format!("{}/healthz", d.url))
        .await
        .expect("the daemon must still be listening");
    assert_eq!(r.status(), 200);
}

async fn sandboxes(d: &Daemon) -> Vec<Value> {
    d.get("/v1/sandboxes").await
}

/// Asserts that a create with `body` is refused with `status` and an error
/// naming every one of `words`, that nothing was made, and that the daemon
/// is still up.
async fn refused_create(d: &Daemon, body: Value, status: u16, words: &[&str]) {
    let r = d
        .req(Method::POST, "/v1/sandboxes")
        .json(&body)
        .send()
        .await
        .unwrap_or_else(|e| panic!("{body}: the daemon did not answer: {e}"));
    let got = r.status().as_u16();
    let answer: Value = r.json().await.unwrap_or(Value::Null);
    if got == 201 {
        // Do not leave it behind.
        let id = answer["id"].as_str().unwrap_or_default();
        let _ = d
            .req(Method::DELETE, &format!("/v1/sandboxes/{id}"))
            .send()
            .await;
    }
    assert_eq!(got, status, "{body} was answered {got} {answer}");
    let msg = answer["error"].as_str().unwrap_or_default();
    for w in words {
        assert!(
            msg.contains(w),
            "{body}: the error {msg:?} does not name {w:?}"
        );
    }
    still_serving(d).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn out_of_range_create_numbers_are_a_400_naming_field_and_range() {
    let data = data_dir("hostile-create");
    let d = Daemon::start(
        &data,
        free_port(),
        &["--max-exec-timeout", "120s", "--max-lifetime", "2h"],
    );
    let cases: Vec<(Value, &[&str])> = vec![
        // Defect 1: this aborted the daemon.
        (
            json!({"limits": {"timeout_seconds": 1e20}}),
            &["limits.timeout_seconds", "120"],
        ),
        // 12: this bypassed --max-exec-timeout.
        (
            json!({"limits": {"timeout_seconds": 1e19}}),
            &["limits.timeout_seconds", "120"],
        ),
        (
            json!({"limits": {"timeout_seconds": 121}}),
            &["limits.timeout_seconds", "120"],
        ),
        (
            json!({"limits": {"timeout_seconds": 0}}),
            &["limits.timeout_seconds"],
        ),
        (
            json!({"limits": {"timeout_seconds": -5}}),
            &["limits.timeout_seconds"],
        ),
        // Defect 9.
        (
            json!({"limits": {"pids": 1_099_511_627_776u64}}),
            &["limits.pids", "32768"],
        ),
        (json!({"limits": {"pids": 2}}), &["limits.pids", "8"]),
        (json!({"limits": {"pids": 8.5}}), &["limits.pids"]),
        (
            json!({"limits": {"memory_mb": u64::MAX}}),
            &["limits.memory_mb", "16"],
        ),
        (
            json!({"limits": {"memory_mb": 1e20}}),
            &["limits.memory_mb"],
        ),
        (
            json!({"limits": {"memory_mb": 17_592_186_044_416u64}}),
            &["limits.memory_mb"],
        ),
        (
            json!({"limits": {"disk_mb": 17_592_186_044_416u64}}),
            &["limits.disk_mb"],
        ),
        (json!({"limits": {"disk_mb": 0}}), &["limits.disk_mb"]),
        (json!({"limits": {"cpu": 0.0001}}), &["limits.cpu", "0.01"]),
        (json!({"limits": {"cpu": 1e300}}), &["limits.cpu"]),
        (json!({"limits": {"cpu": -1}}), &["limits.cpu"]),
        (
            json!({"limits": {"output_bytes": 4_000_000_000u64}}),
            &["limits.output_bytes"],
        ),
        (
            json!({"limits": {"output_bytes": -1}}),
            &["limits.output_bytes"],
        ),
        // Defect 5: this was accepted and the sandbox reaped within 0.5 s.
        (
            json!({"ttl_seconds": 9_223_372_036_854_776u64}),
            &["ttl_seconds", "7200"],
        ),
        (json!({"ttl_seconds": 7201}), &["ttl_seconds", "7200"]),
        (json!({"ttl_seconds": -1}), &["ttl_seconds"]),
        (json!({"ttl_seconds": 1e30}), &["ttl_seconds"]),
        // A wrong type is said in JSON's words, not Rust's (`expected f64`).
        (
            json!({"ttl_seconds": "5"}),
            &["ttl_seconds", "expected a number"],
        ),
        (
            json!({"limits": {"pids": true}}),
            &["limits.pids", "expected a number"],
        ),
    ];
    for (body, words) in cases {
        refused_create(&d, body, 400, words).await;
    }
    assert!(
        sandboxes(&d).await.is_empty(),
        "a refused create made a sandbox"
    );
    // The edges of the ranges are accepted.
    let ok = d
        .create(json!({"ttl_seconds": 7200, "limits": {"timeout_seconds": 120, "cpu": 0.01, "pids": 8, "memory_mb": 64, "disk_mb": 1}}))
        .await;
    let got: Value = d.get(&format!("/v1/sandboxes/{ok}")).await;
    assert_eq!(got["limits"]["timeout_seconds"], json!(120.0), "{got}");
    assert_eq!(got["limits"]["cpu"], json!(0.01), "{got}");
    assert_eq!(got["limits"]["pids"], json!(8), "{got}");
    let (s, out) = d.exec(&ok, "echo alive").await;
    assert_eq!((s, out["stdout"].as_str()), (200, Some("alive\n")), "{out}");
    d.delete_all().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn out_of_range_exec_and_cell_timeouts_are_a_400_and_the_daemon_lives() {
    let data = data_dir("hostile-exec");
    let d = Daemon::start(&data, free_port(), &["--max-exec-timeout", "120s"]);
    let id = d.create(json!({})).await;
    for path in ["exec", "exec/stream"] {
        for t in [json!(1e20), json!(1e19), json!(121), json!(0), json!(-1)] {
            let body = json!({"cmd": "echo hi", "timeout_seconds": t});
            expect_error(
                d.req(Method::POST, &format!("/v1/sandboxes/{id}/{path}"))
                    .json(&body),
                400,
                "timeout_seconds",
            )
            .await;
            still_serving(&d).await;
        }
    }
    // A cell's timeout in milliseconds, the same promise.
    let session = d.create_session(&id, json!({"language": "bash"})).await;
    let sid = session["id"].as_str().unwrap().to_string();
    for ms in [
        json!(9_000_000_000_000_000_000u64),
        json!(120_001),
        json!(1e300),
    ] {
        expect_error(
            d.req(
                Method::POST,
                &format!("/v1/sandboxes/{id}/repl/sessions/{sid}/run"),
            )
            .json(&json!({"code": "echo hi", "timeout_ms": ms})),
            400,
            "timeout_ms",
        )
        .await;
    }
    // Valid values at the edge still run.
    let r = d
        .req(Method::POST, &format!("/v1/sandboxes/{id}/exec"))
        .json(&json!({"cmd": "echo ok", "timeout_seconds": 120}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.json::<Value>().await.unwrap()["stdout"], "ok\n");
    d.delete_all().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn lifecycle_ttl_out_of_range_is_a_400_and_the_sandbox_is_not_reaped() {
    let data = data_dir("hostile-ttl");
    let d = Daemon::start(&data, free_port(), &["--max-lifetime", "2h"]);
    let id = d.create(json!({"ttl_seconds": 600})).await;
    let patch = |body: Value| {
        d.req(Method::PATCH, &format!("/v1/sandboxes/{id}/lifecycle"))
            .json(&body)
    };
    for t in [
        json!(9_223_372_036_854_776u64),
        json!(9_223_372_036_854_775_807i64),
        json!(7201),
        json!(-1),
        json!(1e30),
    ] {
        expect_error(patch(json!({"ttl_seconds": t})), 400, "ttl_seconds").await;
    }
    // The wrapped deadline reaped it within half a second: wait longer.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let r = d
        .req(Method::GET, &format!("/v1/sandboxes/{id}/lifecycle"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "the sandbox was reaped");
    assert_eq!(r.json::<Value>().await.unwrap()["ttl_seconds"], 600);
    let (s, _) = d.exec(&id, "true").await;
    assert_eq!(s, 200);
    // The largest allowed value is taken.
    let r = patch(json!({"ttl_seconds": 7200})).send().await.unwrap();
    assert_eq!(r.status(), 200);
    d.delete_all().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn invalid_environment_is_refused_at_create_and_exec_naming_the_variable() {
    let data = data_dir("hostile-env");
    let d = Daemon::start(&data, free_port(), &[]);
    for (env, words) in [
        (json!({"SECRET": "a\u{0}b"}), &["env", "SECRET"][..]),
        (json!({"BAD\u{0}KEY": "x"}), &["env", "BAD"][..]),
        (json!({"A=B": "x"}), &["env", "A=B"][..]),
        (json!({"": "x"}), &["env", "empty"][..]),
    ] {
        refused_create(&d, json!({"env": env}), 400, words).await;
    }
    assert!(sandboxes(&d).await.is_empty());
    let id = d.create(json!({"env": {"GOOD": "1"}})).await;
    for path in ["exec", "exec/stream"] {
        expect_error(
            d.req(Method::POST, &format!("/v1/sandboxes/{id}/{path}"))
                .json(&json!({"cmd": "true", "env": {"X": "1\u{0}"}})),
            400,
            "X",
        )
        .await;
    }
    expect_error(
        d.req(Method::POST, &format!("/v1/sandboxes/{id}/repl/sessions"))
            .json(&json!({"language": "bash", "envs": {"K=V": "1"}})),
        400,
        "K=V",
    )
    .await;
    // The sandbox is untouched and usable.
    let (s, out) = d.exec(&id, "echo $GOOD").await;
    assert_eq!((s, out["stdout"].as_str()), (200, Some("1\n")), "{out}");
    d.delete_all().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn oversized_request_fields_are_a_413_naming_the_limit() {
    let data = data_dir("hostile-size");
    let d = Daemon::start(&data, free_port(), &[]);
    let id = d.create(json!({})).await;
    let exec = |body: Value| {
        d.req(Method::POST, &format!("/v1/sandboxes/{id}/exec"))
            .json(&body)
    };
    // A 10 MB command answered 500 with a protocol-frame message.
    let big = "x".repeat(10 << 20);
    expect_error(exec(json!({"cmd": big})), 413, "cmd").await;
    expect_error(exec(json!({"cmd": big})), 413, "128 KiB").await;
    // Control characters grow sixfold when encoded for the agent: fields
    // each under their own limit can still not fit one protocol frame.
    let ctl = "\u{1}".repeat(100 << 10);
    expect_error(
        exec(json!({"cmd": format!("true {ctl}"), "env": {"C": ctl}})),
        413,
        "encoded",
    )
    .await;
    // Other header fields: environment and working directory.
    expect_error(
        exec(json!({"cmd": "true", "env": {"BIG": "y".repeat(2 << 20)}})),
        413,
        "env",
    )
    .await;
    let many: serde_json::Map<String, Value> = (0..40)
        .map(|i| (format!("V{i}"), Value::from("z".repeat(100 << 10))))
        .collect();
    expect_error(exec(json!({"cmd": "true", "env": many})), 413, "env").await;
    expect_error(
        exec(json!({"cmd": "true", "cwd": format!("/{}", "d".repeat(8192))})),
        400,
        "cwd",
    )
    .await;
    // An environment that would not fit any later exec is refused at create.
    expect_error(
        d.req(Method::POST, "/v1/sandboxes").json(
            &json!({"env": {"A": "\u{1}".repeat(100 << 10), "B": "\u{1}".repeat(100 << 10)}}),
        ),
        413,
        "env take",
    )
    .await;
    // Paths longer than PATH_MAX answered 500 ("File name too long").
    let long = format!("/{}", "p".repeat(10_000));
    for route in ["fs", "fs/stat", "fs/dir"] {
        expect_error(
            d.req(
                Method::GET,
                &format!("/v1/sandboxes/{id}/{route}?path={long}"),
            ),
            400,
            "path must be a path between 1 and 4095 bytes",
        )
        .await;
    }
    expect_error(
        d.req(Method::PUT, &format!("/v1/sandboxes/{id}/fs?path={long}"))
            .body("x"),
        400,
        "path",
    )
    .await;
    expect_error(
        d.req(Method::POST, "/v1/sandboxes")
            .json(&json!({"env": {"BIG": "y".repeat(2 << 20)}})),
        413,
        "env",
    )
    .await;
    // A cell's code goes in a frame body (8 MiB at most).
    let session = d.create_session(&id, json!({"language": "bash"})).await;
    let sid = session["id"].as_str().unwrap().to_string();
    expect_error(
        d.req(
            Method::POST,
            &format!("/v1/sandboxes/{id}/repl/sessions/{sid}/run"),
        )
        .json(&json!({"code": format!("# {}", "c".repeat(9 << 20))})),
        413,
        "code",
    )
    .await;
    still_serving(&d).await;
    let (s, out) = d.exec(&id, "echo fine").await;
    assert_eq!((s, out["stdout"].as_str()), (200, Some("fine\n")), "{out}");
    d.delete_all().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn unknown_template_error_lists_each_template_once() {
    let data = data_dir("hostile-template");
    // An installed template named like the built-in alias.
    let t = data.join("templates/code-interpreter");
    std::fs::create_dir_all(&t).unwrap();
    std::fs::write(t.join("template.json"), "{}").unwrap();
    let d = Daemon::start(&data, free_port(), &[]);
    let r = d
        .req(Method::POST, "/v1/sandboxes")
        .json(&json!({"template": "no-such-template"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let msg = r.json::<Value>().await.unwrap()["error"]
        .as_str()
        .unwrap()
        .to_string();
    let list = msg.split("installed templates: ").nth(1).unwrap();
    let names: Vec<&str> = list.split(", ").collect();
    let mut unique = names.clone();
    unique.sort();
    unique.dedup();
    assert_eq!(names.len(), unique.len(), "{msg}");
    assert!(names.contains(&"code-interpreter"), "{msg}");
}

/// The fields of issue 14 (snapshots, forks, hibernation, volumes): every
/// wrong value is a 4xx naming the field, nothing is made, nothing echoes
/// a huge value back, and the daemon lives.
#[tokio::test(flavor = "multi_thread")]
async fn snapshot_fork_and_volume_fields_are_checked() {
    let data = data_dir("hostile-state");
    let d = Daemon::start(&data, free_port(), &[]);
    let huge = "v".repeat(1 << 20);
    for (body, status, words) in [
        (json!({"on_idle": "sleep"}), 400, &["on_idle"][..]),
        (json!({"on_idle": 1}), 400, &["on_idle"]),
        (json!({"on_idle": huge.clone()}), 400, &["on_idle"]),
        (
            json!({"from_snapshot": huge.clone()}),
            404,
            &["from_snapshot"],
        ),
        (json!({"from_snapshot": 7}), 400, &["from_snapshot"]),
        (json!({"volumes": "cache"}), 400, &["volumes"]),
        (
            json!({"volumes": [{"name": "nope"}]}),
            400,
            &["volumes[0].name"],
        ),
        (
            json!({"volumes": [{"name": huge.clone()}]}),
            400,
            &["volumes[0].name"],
        ),
        (
            json!({"volumes": [{"name": "nope", "extra": 1}]}),
            400,
            &["volumes"],
        ),
        (
            json!({"volumes": [{"name": "nope", "read_only": "yes"}]}),
            400,
            &["read_only"],
        ),
        (
            json!({"volumes": vec![json!({"name": "v"}); 17]}),
            400,
            &["volumes"],
        ),
    ] {
        let r = d
            .req(Method::POST, "/v1/sandboxes")
            .json(&body)
            .send()
            .await
            .unwrap();
        let got = r.status().as_u16();
        let text = r.text().await.unwrap();
        assert_eq!(
            got,
            status,
            "{} -> {got} {}",
            &body.to_string()[..body.to_string().len().min(120)],
            &text[..text.len().min(300)]
        );
        assert!(
            text.len() < 2048,
            "a huge value was echoed: {} bytes",
            text.len()
        );
        for w in words {
            assert!(text.contains(w), "{text} does not name {w}");
        }
    }
    assert!(
        sandboxes(&d).await.is_empty(),
        "a refused create made a sandbox"
    );

    let id = d.create(json!({})).await;
    for (path, body, words) in [
        ("fork-tree", json!({}), &["count"][..]),
        ("fork-tree", json!({"count": 0}), &["count"]),
        ("fork-tree", json!({"count": 17}), &["count"]),
        ("fork-tree", json!({"count": 1e300}), &["count"]),
        ("fork-tree", json!({"count": -1}), &["count"]),
        ("fork-tree", json!({"count": "2"}), &["count"]),
        ("fork", json!({"count": 2}), &["count"]),
        ("fork", json!({"metadata": {"a": 1}}), &["metadata"]),
        ("fork", json!({"ttl_seconds": -1}), &["ttl_seconds"]),
        ("fork", json!({"ttl_seconds": 1e30}), &["ttl_seconds"]),
        (
            "promote",
            json!({"cleanup_siblings": "yes"}),
            &["cleanup_siblings"],
        ),
        ("promote", json!({"tree_id": 5}), &["tree_id"]),
    ] {
        let r = d
            .req(Method::POST, &format!("/v1/sandboxes/{id}/{path}"))
            .json(&body)
            .send()
            .await
            .unwrap();
        let got = r.status().as_u16();
        let text = r.text().await.unwrap();
        assert_eq!(got, 400, "{path} {body} -> {got} {text}");
        for w in words {
            assert!(text.contains(w), "{path} {body}: {text} does not name {w}");
        }
    }
    assert_eq!(
        sandboxes(&d).await.len(),
        1,
        "a refused fork made a sandbox"
    );
    // A tree id is a metadata value: a megabyte of one is refused, not
    // echoed back.
    let r = d
        .req(Method::POST, &format!("/v1/sandboxes/{id}/promote"))
        .json(&json!({"tree_id": huge.clone()}))
        .send()
        .await
        .unwrap();
    let got = r.status().as_u16();
    let text = r.text().await.unwrap();
    assert_eq!(got, 413, "{}", &text[..text.len().min(300)]);
    assert!(
        text.len() < 2048 && text.contains("tree_id"),
        "{}",
        &text[..text.len().min(300)]
    );
    for (body, status, word) in [
        (json!({"name": "ok", "size_mb": 0}), 400, "size_mb"),
        (json!({"name": "ok", "size_mb": 65537}), 400, "size_mb"),
        (json!({"name": "ok", "size_mb": 1e300}), 400, "size_mb"),
        (json!({"name": "ok", "size_mb": -5}), 400, "size_mb"),
        (json!({"name": "../x", "size_mb": 1}), 400, "name"),
        (json!({"name": huge.clone(), "size_mb": 1}), 400, "name"),
        (json!({"name": "ok"}), 400, "size_mb"),
        (json!({"name": "ok", "size_mb": 20000}), 429, "quota"),
    ] {
        let r = d
            .req(Method::POST, "/v1/volumes")
            .json(&body)
            .send()
            .await
            .unwrap();
        let got = r.status().as_u16();
        let text = r.text().await.unwrap();
        assert_eq!(
            got,
            status,
            "{} -> {got} {}",
            &body.to_string()[..body.to_string().len().min(120)],
            &text[..text.len().min(300)]
        );
        assert!(text.contains(word), "{text} does not name {word}");
        assert!(text.len() < 2048, "a huge value was echoed");
    }
    let vols: Value = d.get("/v1/volumes").await;
    assert_eq!(vols["items"], json!([]), "a refused volume was made");
    still_serving(&d).await;
    d.delete_all().await;
}

/// A language name is a field like any other: a wrong one is a 400 that
/// names `language`, and a megabyte of it is not sent back, on every route
/// that takes one.
#[tokio::test(flavor = "multi_thread")]
async fn language_names_are_checked_and_never_echoed_whole() {
    let d = Daemon::start(&data_dir("hostile-language"), free_port(), &[]);
    let id = d.create(json!({})).await;
    let huge = "l".repeat(1 << 20);
    for (path, body) in [
        ("exec", json!({"cmd": "1", "language": huge.clone()})),
        ("exec/stream", json!({"cmd": "1", "language": huge.clone()})),
        ("repl/sessions", json!({"language": huge.clone()})),
        ("exec", json!({"cmd": "1", "language": "cobol\u{0}"})),
    ] {
        let r = d
            .req(Method::POST, &format!("/v1/sandboxes/{id}/{path}"))
            .json(&body)
            .send()
            .await
            .unwrap();
        let status = r.status().as_u16();
        let text = r.text().await.unwrap();
        assert_eq!(status, 400, "{path}: {}", &text[..text.len().min(300)]);
        assert!(
            text.len() < 2048,
            "{path}: a huge value was echoed: {} bytes",
            text.len()
        );
        assert!(text.contains("anguage"), "{path}: {text}");
    }
    let (s, out) = d.exec(&id, "echo alive").await;
    assert_eq!((s, out["stdout"].as_str()), (200, Some("alive\n")));
    d.delete_all().await;
}

/// Metadata is bounded like every other field: it is kept with the sandbox
/// in the daemon's memory, returned by every list and kept in the
/// sandbox's tombstone for a week after it ends, and 20 MB of it was
/// accepted. Too many keys, too long a key or value, or too much in all is
/// refused on every route that takes metadata (create, `POST /v1/run`, a
/// fork) naming the field, without echoing a huge key; at the limits a
/// sandbox is made and forked (a fork tree's own keys are not counted). A
/// template name is not echoed whole either.
#[tokio::test(flavor = "multi_thread")]
async fn metadata_is_bounded_and_never_echoed_whole() {
    let d = Daemon::start(&data_dir("hostile-metadata"), free_port(), &[]);
    let keys = |n: usize, len: usize| -> Value {
        (0..n)
            .map(|i| (format!("k{i}"), Value::from("m".repeat(len))))
            .collect::<serde_json::Map<_, _>>()
            .into()
    };
    let huge_key = "K".repeat(1 << 20);
    let refusals = [
        (keys(65, 1), 400, &["metadata", "64", "65"][..]),
        (json!({"k": "v".repeat(4097)}), 413, &["metadata.k", "4097"]),
        (
            json!({ huge_key.clone(): "v" }),
            413,
            &["metadata key", "KKK"],
        ),
        (keys(6, 3000), 413, &["metadata", "16 KiB", "together"]),
        (
            json!({"fork_parent": "p".repeat(1 << 20)}),
            413,
            &["metadata.fork_parent"],
        ),
    ];
    let parent = d.create(json!({"metadata": keys(64, 200)})).await;
    for (metadata, status, words) in refusals {
        let shown = &metadata.to_string()[..metadata.to_string().len().min(80)];
        for (path, body) in [
            ("/v1/sandboxes".to_string(), json!({ "metadata": metadata })),
            (
                "/v1/run".to_string(),
                json!({"sandbox": {"metadata": metadata}, "exec": {"cmd": "true"}}),
            ),
            (
                format!("/v1/sandboxes/{parent}/fork"),
                json!({ "metadata": metadata }),
            ),
        ] {
            let r = d.req(Method::POST, &path).json(&body).send().await.unwrap();
            let got = r.status().as_u16();
            let text = r.text().await.unwrap();
            assert_eq!(
                got,
                status,
                "{path} {shown} -> {}",
                &text[..text.len().min(300)]
            );
            assert!(
                text.len() < 2048,
                "{path} {shown}: {} bytes echoed",
                text.len()
            );
            for w in words {
                assert!(text.contains(w), "{path} {shown}: {text} does not name {w}");
            }
        }
    }
    assert_eq!(
        sandboxes(&d).await.len(),
        1,
        "a refused request made a sandbox"
    );
    // At the limits: 64 keys (the parent above), 16 KiB in all; a fork tree
    // adds its two keys to the parent's 64.
    let full = d
        .create(json!({"metadata": {"a": "x".repeat(4096), "b": "y".repeat(4096), "c": "z".repeat(4096), "d": "w".repeat(4096 - 4)}}))
        .await;
    let (s, tree) = d
        .post(
            &format!("/v1/sandboxes/{parent}/fork-tree"),
            json!({"count": 1}),
        )
        .await;
    assert_eq!(s, 201, "{tree}");
    let child = tree["children"][0]["id"].as_str().unwrap().to_string();
    let got: Value = d.get(&format!("/v1/sandboxes/{child}")).await;
    assert_eq!(got["metadata"]["fork_parent"], parent.as_str(), "{got}");
    assert_eq!(got["metadata"]["k63"], "m".repeat(200));
    let (s, out) = d.exec(&full, "echo fine").await;
    assert_eq!((s, out["stdout"].as_str()), (200, Some("fine\n")), "{out}");
    // An unknown template's name is cut short in the error.
    let r = d
        .req(Method::POST, "/v1/sandboxes")
        .json(&json!({"template": "t".repeat(1 << 20)}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let text = r.text().await.unwrap();
    assert!(
        text.len() < 4096,
        "the template name was echoed: {} bytes",
        text.len()
    );
    assert!(
        text.contains("unknown template") && text.contains("bytes in all"),
        "{text}"
    );
    still_serving(&d).await;
    d.delete_all().await;
}
