//! Code contexts (REPL sessions) through `runcell serve`: over HTTP and with
//! `runcell context`. Needs root.

mod common;

use std::process::{Command, Stdio};

use common::*;
use serde_json::{json, Value};

#[tokio::test(flavor = "multi_thread")]
async fn code_contexts_over_http_keep_state_return_rich_results_and_survive_timeouts() {
    use base64::Engine;
    let data = data_dir("repl");
    let d = Daemon::start(&data, free_port(), &[]);
    let id = d.create(json!({})).await;
    let sessions = format!("/v1/sandboxes/{id}/repl/sessions");
    let s = d.create_session(&id, json!({"language": "python"})).await;
    let sid = s["id"].as_str().unwrap().to_string();
    assert_eq!(sid.len(), 16);
    assert_eq!(
        (s["session_id"].as_str(), s["language"].as_str()),
        (Some(sid.as_str()), Some("python"))
    );
    let run = |code: &str, timeout_ms: Option<u64>| {
        let mut body = json!({ "code": code });
        if let Some(t) = timeout_ms {
            body["timeout_ms"] = json!(t);
        }
        d.req(reqwest::Method::POST, &format!("{sessions}/{sid}/run"))
            .json(&body)
    };
    let ok = |rb: reqwest::RequestBuilder| async move {
        let r = rb.send().await.unwrap();
        let status = r.status().as_u16();
        let v: Value = r.json().await.unwrap();
        assert_eq!(status, 200, "{v}");
        v
    };

    ok(run("import pandas as pd\nrows = [1, 2]", None)).await;
    let v = ok(run("print(len(rows))\npd.DataFrame({'a': rows})", None)).await;
    assert_eq!(v["stdout"], "2\n");
    assert_eq!(
        (v["exit"].as_i64(), v["exit_code"].as_i64()),
        (Some(0), Some(0))
    );
    assert!(
        v["results"][0]["text/html"]
            .as_str()
            .unwrap()
            .contains("<table"),
        "{v}"
    );
    assert!(v.get("error").is_none());

    let v = ok(run(
        "import matplotlib.pyplot as plt\nfig = plt.figure(figsize=(2, 1), dpi=50)\nplt.plot([0, 1])",
        None,
    ))
    .await;
    let png = v["results"]
        .as_array()
        .unwrap()
        .iter()
        .find_map(|b| b["image/png"].as_str())
        .expect("a PNG result");
    let png = base64::engine::general_purpose::STANDARD
        .decode(png)
        .unwrap();
    assert_eq!(&png[16..24], &[0, 0, 0, 100, 0, 0, 0, 50]);

    let v = ok(run("x = 1\n1 / 0", None)).await;
    assert_eq!(v["exit"], 1);
    assert_eq!(v["exception"]["name"], "ZeroDivisionError");
    let tb = v["error"].as_str().unwrap();
    assert!(
        tb.contains("line 2") && tb.contains("1 / 0") && tb.contains("ZeroDivisionError"),
        "{tb}"
    );
    assert!(v["stderr"].as_str().unwrap().contains("ZeroDivisionError"));

    // A timeout: 500 whose error contains "timeout" (the SDKs raise
    // SandboxTimeout), with a plain message; the context keeps working.
    let r = run("while True: pass", Some(500)).send().await.unwrap();
    assert_eq!(r.status(), 500);
    let v: Value = r.json().await.unwrap();
    let err = v["error"].as_str().unwrap();
    assert!(
        err.starts_with("cell timeout after 0.5s") && err.contains("interrupted"),
        "{err}"
    );
    assert_eq!(v["timed_out"], true);
    assert_eq!(v["state_lost"], false);
    assert_eq!(
        ok(run("x + len(rows)", None)).await["results"][0]["text/plain"],
        "3"
    );

    // A crash is reported in `error` and the next cell runs in a fresh interpreter.
    let v = ok(run("import os; os._exit(5)", None)).await;
    assert_eq!(v["exit"], 5);
    assert_eq!(v["state_lost"], true);
    let err = v["error"].as_str().unwrap();
    assert!(
        err.contains("exited with code 5") && err.contains("lost"),
        "{err}"
    );
    assert_eq!(
        ok(run("'x' in globals()", None)).await["results"][0]["text/plain"],
        "False"
    );

    // JavaScript and bash sessions too; list shows all three.
    for (lang, code, want) in [
        ("javascript", "let a = 6; a * 7", "42"),
        ("bash", "echo $((6 * 7))", ""),
    ] {
        let r = d
            .req(reqwest::Method::POST, &sessions)
            .json(&json!({ "language": lang }))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 201);
        let other: Value = r.json().await.unwrap();
        let (_, v) = d
            .post(
                &format!("{sessions}/{}/run", other["id"].as_str().unwrap()),
                json!({ "code": code }),
            )
            .await;
        if want.is_empty() {
            assert_eq!(v["stdout"], "42\n", "{v}");
        } else {
            assert_eq!(v["results"][0]["text/plain"], want, "{v}");
        }
    }
    let list: Vec<Value> = d.get(&sessions).await;
    assert_eq!(list.len(), 3);
    assert!(list
        .iter()
        .any(|s| s["id"] == sid.as_str() && s["restarts"] == 1));

    // Bad input: unknown language, empty code, bad JSON, missing session and sandbox.
    expect_error(
        d.req(reqwest::Method::POST, &sessions)
            .json(&json!({"language": "cobol"})),
        400,
        "cobol",
    )
    .await;
    expect_error(run("  ", None), 400, "code required").await;
    expect_error(
        d.req(reqwest::Method::POST, &format!("{sessions}/{sid}/run"))
            .body("{"),
        400,
        "not valid JSON",
    )
    .await;
    expect_error(
        d.req(
            reqwest::Method::POST,
            &format!("{sessions}/0000000000000000/run"),
        )
        .json(&json!({"code": "1"})),
        404,
        "session not found",
    )
    .await;
    expect_error(
        d.req(reqwest::Method::POST, "/v1/sandboxes/nope/repl/sessions")
            .json(&json!({})),
        404,
        "sandbox not found",
    )
    .await;
    let r = d
        .req(reqwest::Method::DELETE, &format!("{sessions}/{sid}"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 204);
    expect_error(
        d.req(reqwest::Method::DELETE, &format!("{sessions}/{sid}")),
        404,
        "session not found",
    )
    .await;
    d.delete_all().await;
}

/// Runs `runcell context ...` against `d`, with the code on stdin when given.
fn context_cli(d: &Daemon, args: &[&str], stdin: Option<&str>) -> (i32, String, String) {
    use std::io::Write;
    let mut child = Command::new(env!("CARGO_BIN_EXE_runcell"))
        .arg("context")
        .args(args)
        .env("RUNCELL_URL", &d.url)
        .env("RUNCELL_API_KEY", &d.key)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut input = child.stdin.take().unwrap();
    if let Some(s) = stdin {
        input.write_all(s.as_bytes()).unwrap();
    }
    drop(input);
    let out = child.wait_with_output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test(flavor = "multi_thread")]
async fn the_cli_creates_runs_lists_and_removes_contexts() {
    let data = data_dir("ctxcli");
    let d = Daemon::start(&data, free_port(), &[]);
    let sb = d.create(json!({})).await;
    let (code, out, err) = context_cli(&d, &["create", &sb], None);
    assert_eq!(code, 0, "{err}");
    let ctx = out.trim().to_string();
    assert_eq!(ctx.len(), 16, "{out}");

    let (code, out, _) = context_cli(
        &d,
        &["run", &sb, &ctx, "-c", "x = 6\nprint('hi')\nx * 7"],
        None,
    );
    assert_eq!((code, out.as_str()), (0, "hi\n42\n"));
    // Code from stdin; state persisted; images are described or saved.
    let (code, out, _) = context_cli(&d, &["run", &sb, &ctx], Some("x + 1"));
    assert_eq!((code, out.as_str()), (0, "7\n"));
    let dir = data.join("images");
    std::fs::create_dir_all(&dir).unwrap();
    let plot = "import matplotlib.pyplot as plt\nplt.figure(figsize=(1, 1), dpi=20)\nplt.plot([1, 2]); None";
    let (code, out, err) = context_cli(
        &d,
        &[
            "run",
            &sb,
            &ctx,
            "-c",
            plot,
            "--save-images",
            dir.to_str().unwrap(),
        ],
        None,
    );
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("[image/png saved to"), "{out}");
    assert_eq!(
        &std::fs::read(dir.join("result-1.png")).unwrap()[1..4],
        b"PNG"
    );
    // An exception: traceback on stderr, status 1. A timeout: 124 and the message.
    let (code, _, err) = context_cli(&d, &["run", &sb, &ctx, "-c", "1 / 0"], None);
    assert_eq!(code, 1);
    assert!(err.contains("ZeroDivisionError"), "{err}");
    let (code, _, err) = context_cli(
        &d,
        &[
            "run",
            &sb,
            &ctx,
            "-c",
            "while True: pass",
            "--timeout",
            "1s",
        ],
        None,
    );
    assert_eq!(code, 124);
    assert!(err.contains("timed out after 1s"), "{err}");
    // --json gives the daemon's fields.
    let (_, out, _) = context_cli(&d, &["--json", "run", &sb, &ctx, "-c", "x"], None);
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["results"][0]["text/plain"], "6");

    let (_, out, _) = context_cli(&d, &["ls", &sb], None);
    assert!(out.contains(&ctx) && out.contains("python"), "{out}");
    let (code, _, _) = context_cli(&d, &["restart", &sb, &ctx], None);
    assert_eq!(code, 0);
    let (code, _, _) = context_cli(&d, &["rm", &sb, &ctx], None);
    assert_eq!(code, 0);
    let (code, _, err) = context_cli(&d, &["rm", &sb, &ctx], None);
    assert_eq!(code, 1);
    assert!(err.contains("session not found (HTTP 404)"), "{err}");
    // A daemon that is not there is named plainly.
    let mut child = Command::new(env!("CARGO_BIN_EXE_runcell"))
        .args([
            "context",
            "ls",
            &sb,
            "--url",
            "http://127.0.0.1:9",
            "--api-key",
            "k",
        ])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut err = String::new();
    std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut err).unwrap();
    assert!(!child.wait().unwrap().success());
    assert!(
        err.contains("Could not reach the runcell daemon at http://127.0.0.1:9"),
        "{err}"
    );
    d.delete_all().await;
}
