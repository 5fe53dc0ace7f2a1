//! The clients of `runcell serve` against a live daemon: the Rust client and
//! the CLI's remote commands (sandbox, exec, code, cp, logs). Needs root.

mod common;

use std::process::{Command, Stdio};
use std::time::Duration;

use common::*;
use serde_json::{json, Value};

#[tokio::test(flavor = "multi_thread")]
async fn the_rust_client_covers_the_api_against_a_live_daemon() {
    use runcell_client::{Client, ExecOptions};
    use std::collections::BTreeMap;
    let data = data_dir("client");
    let d = Daemon::start(&data, free_port(), &[]);
    let c = Client::new(&d.url, &d.key);
    let meta: BTreeMap<String, String> = [("threadId".to_string(), "t-9".to_string())].into();
    let sb = c
        .create_sandbox(&json!({"metadata": meta, "ttl_seconds": 120}))
        .await
        .unwrap();
    let other = c.create_sandbox(&json!({})).await.unwrap();
    let listed = c.list_sandboxes(&meta).await.unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].id, sb.id);
    assert_eq!(c.list_sandboxes(&BTreeMap::new()).await.unwrap().len(), 2);
    assert_eq!(
        c.get_sandbox(&sb.id).await.unwrap().fields["metadata"]["threadId"],
        "t-9"
    );

    let r = c
        .exec(
            &sb.id,
            "echo out; echo err >&2; exit 3",
            &ExecOptions::default(),
        )
        .await
        .unwrap();
    assert_eq!(
        (r.stdout.as_str(), r.stderr.as_str(), r.exit_code),
        ("out\n", "err\n", 3)
    );
    let opts = ExecOptions {
        timeout: Some(Duration::from_millis(500)),
        ..ExecOptions::default()
    };
    let r = c.exec(&sb.id, "sleep 10", &opts).await.unwrap();
    assert!(r.timed_out && r.exit_code == 124, "{r:?}");

    c.write_file(&sb.id, "/tmp/d/x.bin", vec![0, 1, 2, 255])
        .await
        .unwrap();
    assert_eq!(
        c.read_file(&sb.id, "/tmp/d/x.bin").await.unwrap(),
        vec![0, 1, 2, 255]
    );
    let entries = c.list_dir(&sb.id, "/tmp/d").await.unwrap();
    assert_eq!((entries[0].name.as_str(), entries[0].size), ("x.bin", 4));
    assert!(c.logs(&sb.id).await.unwrap().contains("out\n"));
    let l = c.set_lifecycle(&sb.id, Some(900), None).await.unwrap();
    assert_eq!(l["ttl_seconds"], 900);

    // Errors are typed and worded.
    let e = c.get_sandbox("nope").await.unwrap_err();
    assert_eq!(e.status(), Some(404));
    let e = c.read_file(&sb.id, "/nope").await.unwrap_err();
    assert_eq!(e.status(), Some(404));
    let e = c
        .create_sandbox(&json!({"template": "nope"}))
        .await
        .unwrap_err();
    assert!(
        e.status() == Some(400) && e.to_string().contains("installed templates"),
        "{e}"
    );
    let e = Client::new(&d.url, "bad-key")
        .list_sandboxes(&BTreeMap::new())
        .await
        .unwrap_err();
    assert_eq!(e.status(), Some(401));

    c.delete_sandbox(&sb.id).await.unwrap();
    c.delete_sandbox(&other.id).await.unwrap();
    assert_eq!(
        c.delete_sandbox(&sb.id).await.unwrap_err().status(),
        Some(404)
    );
    d.delete_all().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn the_cli_manages_sandboxes_exec_code_cp_and_logs() {
    let data = data_dir("cli");
    let d = Daemon::start(&data, free_port(), &[]);
    let cli = |args: &[&str]| runcell_cli(&d, args);
    let (code, out, err) = cli(&[
        "sandbox",
        "create",
        "--meta",
        "threadId=abc",
        "--ttl",
        "10m",
    ]);
    assert_eq!(code, 0, "{err}");
    let id = out.trim().to_string();
    let (_, other, _) = cli(&["sandbox", "create"]);
    let other = other.trim().to_string();
    // Without a URL flag or key in the environment, the key file the daemon
    // wrote is used (RUNCELL_DATA_DIR points at it).
    let out = Command::new(env!("CARGO_BIN_EXE_runcell"))
        .args(["sandbox", "ls", "--url", &d.url])
        .env_remove("RUNCELL_API_KEY")
        .env("RUNCELL_DATA_DIR", &d.data)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains(&id));

    let (_, out, _) = cli(&["sandbox", "ls", "--meta", "threadId=abc"]);
    assert!(out.contains(&id) && !out.contains(&other), "{out}");
    let (_, out, _) = cli(&["sandbox", "ls", "--json"]);
    assert_eq!(
        serde_json::from_str::<Value>(&out)
            .unwrap()
            .as_array()
            .unwrap()
            .len(),
        2
    );
    let (_, out, _) = cli(&["sandbox", "get", &id, "--json"]);
    assert_eq!(
        serde_json::from_str::<Value>(&out).unwrap()["ttl_seconds"],
        600
    );
    assert_eq!(cli(&["sandbox", "ttl", &id, "30m"]).0, 0);
    let (_, out, _) = cli(&["sandbox", "get", &id, "--json"]);
    assert_eq!(
        serde_json::from_str::<Value>(&out).unwrap()["ttl_seconds"],
        1800
    );

    // One argument after -- is a shell line; more are the program's argv.
    let (code, out, err) = cli(&["exec", &id, "--", "echo hello; echo oops >&2; exit 4"]);
    assert_eq!((code, out.as_str(), err.as_str()), (4, "hello\n", "oops\n"));
    let (code, _, err) = cli(&["exec", "--timeout", "1s", &id, "--", "sleep", "5"]);
    assert_eq!(code, 124);
    assert!(err.contains("timeout"), "{err}");

    // code: one context per language, kept between calls.
    assert_eq!(cli(&["code", &id, "-c", "n = 20"]).0, 0);
    let (code, out, _) = cli(&["code", &id, "-c", "n * 2 + 2"]);
    assert_eq!((code, out.as_str()), (0, "42\n"));
    let (_, out, _) = cli(&["code", &id, "--lang", "javascript", "-c", "typeof n"]);
    assert_eq!(out, "'undefined'\n");

    let local = data.join("local.txt");
    std::fs::write(&local, "from the host\n").unwrap();
    let dst = format!("{id}:/home/user/in.txt");
    assert_eq!(cli(&["cp", local.to_str().unwrap(), &dst]).0, 0);
    let (_, out, _) = cli(&["exec", &id, "--", "cat", "/home/user/in.txt"]);
    assert_eq!(out, "from the host\n");
    let back = data.join("back.txt");
    assert_eq!(cli(&["cp", &dst, back.to_str().unwrap()]).0, 0);
    assert_eq!(std::fs::read_to_string(&back).unwrap(), "from the host\n");
    let (code, _, err) = cli(&["cp", "a", "b"]);
    assert_eq!(code, 2);
    assert!(err.contains("SANDBOX:/absolute/path"), "{err}");

    let (_, out, _) = cli(&["logs", &id]);
    assert!(
        out.contains("hello") && out.contains("from the host"),
        "{out}"
    );
    // logs -f prints what is there and then new lines as they come.
    let mut follow = Command::new(env!("CARGO_BIN_EXE_runcell"))
        .args(["logs", "-f", &id])
        .env("RUNCELL_URL", &d.url)
        .env("RUNCELL_API_KEY", &d.key)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let reader = std::thread::spawn({
        let stdout = follow.stdout.take().unwrap();
        move || {
            use std::io::BufRead;
            std::io::BufReader::new(stdout)
                .lines()
                .map_while(Result::ok)
                .find(|l| l == "late line")
                .is_some()
        }
    });
    std::thread::sleep(Duration::from_millis(300));
    cli(&["exec", &id, "--", "echo", "late", "line"]);
    assert_eq!(cli(&["sandbox", "kill", &id, &other]).0, 0);
    assert!(reader.join().unwrap(), "logs -f did not print the new line");
    let _ = follow.kill();
    let _ = follow.wait();
    let (code, _, err) = cli(&["sandbox", "get", &id]);
    assert_eq!(code, 1);
    // The tombstone says when it ended, still as a 404.
    assert!(
        err.contains(&format!("sandbox {id} was deleted at")) && err.contains("(HTTP 404)"),
        "{err}"
    );
    d.delete_all().await;
}
