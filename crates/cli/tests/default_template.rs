//! One default template across every client (issue 11): a sandbox whose
//! creator names no template gets `code-interpreter`, through the API (so
//! the TypeScript SDK, which sends no template by default), the CLI and the
//! MCP tools alike; until that template is installed it is served from
//! `host` and the answer says so. Over HTTP against a real daemon. Needs
//! root.

mod common;
use common::*;

use reqwest::Method;
use serde_json::{json, Value};

#[tokio::test(flavor = "multi_thread")]
async fn a_create_without_a_template_gets_code_interpreter_everywhere() {
    let data = data_dir("default-template");
    let d = Daemon::start(&data, free_port(), &["--warm-pool", "code-interpreter=0"]);

    // The API (and so the TypeScript SDK, which sends no template unless told).
    let r = d
        .req(Method::POST, "/v1/sandboxes")
        .json(&json!({}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    let created: Value = r.json().await.unwrap();
    assert_eq!(created["template"], "code-interpreter", "{created}");
    assert_eq!(created["alias_of"], "host", "not installed yet: {created}");
    let id = created["id"].as_str().unwrap().to_string();
    assert_eq!(d.sandbox(&id).await["template"], "code-interpreter");
    let (code, body) = d.exec(&id, "python3 -c 'print(6*7)'").await;
    assert_eq!(
        (code, body["stdout"].as_str()),
        (200, Some("42\n")),
        "{body}"
    );

    // The CLI's `sandbox create` names no template either.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_runcell"))
        .args(["sandbox", "create"])
        .env("RUNCELL_URL", &d.url)
        .env("RUNCELL_API_KEY", &d.key)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let cli_id = String::from_utf8(out.stdout).unwrap().trim().to_string();
    assert_eq!(d.sandbox(&cli_id).await["template"], "code-interpreter");

    // `runcell mcp --help` documents the same default.
    let help = std::process::Command::new(env!("CARGO_BIN_EXE_runcell"))
        .args(["mcp", "--help"])
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&help.stdout);
    assert!(help.contains("[default: code-interpreter]"), "{help}");
    d.delete_all().await;
}
