//! `runcell run` through a local daemon's standby pool: the cases of
//! `run_cases/` (the same as `run.rs` runs in the `runcell` process) with
//! every run taken by a daemon (`--daemon always`), plus how `runcell run`
//! finds a daemon and what it does without one. Needs root.

mod common;
mod run_cases;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use serde_json::Value;

/// A daemon of the test's own; `runcell run` reaches it as a local user
/// does: its address and the key file `runcell serve` wrote.
#[derive(Debug)]
pub struct Runner {
    daemon: Daemon,
}

fn runner() -> Runner {
    static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let daemon =
        Daemon::start(&data_dir(&format!("run-{n}")), free_port(), &[]).remove_data_on_drop();
    Runner { daemon }
}

impl Runner {
    fn cmd(&self) -> Command {
        let mut c = Command::new(RUNCELL);
        c.env("RUNCELL_URL", &self.daemon.url)
            .env("RUNCELL_DATA_DIR", &self.daemon.data)
            .env_remove("RUNCELL_API_KEY")
            .env("RUNCELL_RUN_DAEMON", "always")
            // Nothing may be made here: the daemon makes the sandboxes.
            .env("RUNCELL_STATE_DIR", "/nonexistent/runcell-run-daemon");
        c
    }

    fn sandboxes(&self) -> Vec<Value> {
        let (code, out, err) = runcell_cli(&self.daemon, &["sandbox", "ls", "--json"]);
        assert_eq!(code, 0, "{err}");
        serde_json::from_str(&out).unwrap()
    }

    /// Waits until the daemon holds no sandbox (that of a killed run is
    /// removed after its idle TTL); false if one is still there after
    /// `within`.
    fn nothing_left(&self, within: Duration) -> bool {
        let until = Instant::now() + within;
        loop {
            if self.sandboxes().is_empty() {
                return true;
            }
            if Instant::now() > until {
                return false;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

impl Drop for Runner {
    fn drop(&mut self) {
        // Every run deletes its sandbox before it exits.
        if !std::thread::panicking() {
            assert!(
                self.nothing_left(Duration::from_secs(2)),
                "a run left its sandbox in the daemon: {:?}",
                self.sandboxes()
            );
        }
    }
}

#[test]
fn the_run_takes_a_sandbox_of_the_daemon() {
    let r = runner();
    let mut child = r
        .cmd()
        .args(["run", "bash", "-c", "echo started; sleep 30"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(child.stdout.as_mut().unwrap()),
        &mut line,
    )
    .unwrap();
    assert_eq!(line, "started\n");
    let list = r.sandboxes();
    assert_eq!(list.len(), 1, "{list:?}");
    assert_eq!(list[0]["metadata"]["created_by"], "runcell run", "{list:?}");
    // An interrupted run stops its program and deletes its sandbox.
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(i32::try_from(child.id()).unwrap()),
        nix::sys::signal::Signal::SIGINT,
    )
    .unwrap();
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(130));
}

#[test]
fn auto_finds_the_daemon_and_never_bypasses_it() {
    let r = runner();
    for (mode, in_daemon) in [("auto", true), ("never", false)] {
        let mut child = r
            .cmd()
            .env("RUNCELL_RUN_DAEMON", mode)
            .env("RUNCELL_STATE_DIR", "/run/runcell-test/cli-daemon")
            .args(["run", "bash", "-c", &format!("sleep 1; echo {mode}")])
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        // Watched for as long as the run lasts.
        let mut seen = false;
        while !seen && child.try_wait().unwrap().is_none() {
            seen = !r.sandboxes().is_empty();
            std::thread::sleep(Duration::from_millis(20));
        }
        let out = child.wait_with_output().unwrap();
        assert_eq!(String::from_utf8_lossy(&out.stdout), format!("{mode}\n"));
        assert_eq!(seen, in_daemon, "--daemon {mode}");
    }
}

#[test]
fn without_a_daemon_auto_runs_here_and_always_fails_plainly() {
    require_root("run");
    // A port nothing listens on, with a key at hand.
    let url = format!("http://127.0.0.1:{}", free_port());
    let run = |mode: &str| {
        Command::new(RUNCELL)
            .env("RUNCELL_URL", &url)
            .env("RUNCELL_API_KEY", "rc_nothing")
            .env("RUNCELL_STATE_DIR", "/run/runcell-test/cli-daemon")
            .env("RUNCELL_RUN_DAEMON", mode)
            .args(["run", "python", "-c", "print(6*7)"])
            .output()
            .unwrap()
    };
    let out = run("auto");
    assert_eq!(String::from_utf8_lossy(&out.stdout), "42\n");
    assert_eq!(out.status.code(), Some(0));
    let out = run("always");
    assert_eq!(out.status.code(), Some(125));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.starts_with(
            "runcell: the daemon did not make the sandbox: Could not reach the runcell daemon at"
        ),
        "{err}"
    );
}

#[tokio::test]
async fn the_exec_extensions_refuse_what_they_cannot_run_naming_the_field() {
    let r = runner();
    let d = &r.daemon;
    let sb: Value = d
        .req(reqwest::Method::POST, "/v1/sandboxes")
        .json(&serde_json::json!({"template": "host", "ttl_seconds": 30}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let id = sb["id"].as_str().unwrap();
    for (body, field) in [
        (serde_json::json!({"cmd": "echo", "args": ["a"]}), "args"),
        (
            serde_json::json!({"cmd": "1", "language": "cobol"}),
            "language",
        ),
    ] {
        for path in ["exec", "exec/stream"] {
            let resp = d
                .req(reqwest::Method::POST, &format!("/v1/sandboxes/{id}/{path}"))
                .json(&body)
                .send()
                .await
                .unwrap();
            assert_eq!(resp.status(), 400, "{path} {body}");
            let err: Value = resp.json().await.unwrap();
            assert!(
                err["error"].as_str().unwrap().starts_with(field),
                "{path} {body}: {err}"
            );
        }
    }
    // The plain exec runs code with its arguments too.
    let out: Value = d
        .req(reqwest::Method::POST, &format!("/v1/sandboxes/{id}/exec"))
        .json(&serde_json::json!({
            "cmd": "import sys; print(sys.argv[1:])",
            "language": "python",
            "args": ["a", "b c"],
        }))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(out["stdout"], "['a', 'b c']\n", "{out}");
    let resp = d
        .req(reqwest::Method::DELETE, &format!("/v1/sandboxes/{id}"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 204);
}

/// `delete_after` deletes the sandbox once its exec has run, after the
/// answer, on both exec routes, whatever the program's end; a request
/// refused before it runs leaves the sandbox; `runcell run` uses it and
/// leaves nothing behind.
#[tokio::test(flavor = "multi_thread")]
async fn delete_after_deletes_the_sandbox_once_its_exec_has_run() {
    use serde_json::json;
    let r = runner();
    let d = &r.daemon;
    let host = json!({"template": "host", "ttl_seconds": 300});
    let status_of = |id: &str| {
        let path = format!("/v1/sandboxes/{id}");
        async move { d.status(reqwest::Method::GET, &path, None).await }
    };
    // Waits until a GET of the sandbox answers 404; fails with `why` after
    // `secs` seconds.
    let gone_within = |id: &str, secs: u64, why: &str| {
        let (id, why) = (id.to_string(), why.to_string());
        async move {
            let deadline = Instant::now() + Duration::from_secs(secs);
            while status_of(&id).await != 404 {
                assert!(Instant::now() < deadline, "{why}");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    // Refused before it runs (args without language): the sandbox stays.
    let id = d.create(host.clone()).await;
    let refused = json!({"cmd": "echo", "args": ["a"], "delete_after": true});
    assert_eq!(d.exec_json(&id, refused).await.0, 400);
    assert_eq!(status_of(&id).await, 200);
    // The plain exec answers in full, and once the answer is in, the
    // sandbox is gone, with why: the very next request finds it so (a CI
    // run once found it still there, the deletion then ran only after the
    // answer; a few rounds give that race its chances).
    let mut id = id;
    for round in 0..8 {
        if round > 0 {
            id = d.create(host.clone()).await;
        }
        let once = json!({"cmd": "echo kept; exit 3", "delete_after": true});
        let (status, out) = d.exec_json(&id, once).await;
        assert_eq!(status, 200, "{out}");
        assert_eq!(
            (out["stdout"].as_str(), out["exit_code"].as_i64()),
            (Some("kept\n"), Some(3)),
            "{out}"
        );
        let r = d
            .req(reqwest::Method::GET, &format!("/v1/sandboxes/{id}"))
            .send()
            .await
            .unwrap();
        let status = r.status().as_u16();
        let gone: Value = r.json().await.unwrap();
        assert_eq!(status, 404, "round {round}: {gone}");
        assert!(
            gone["error"]
                .as_str()
                .is_some_and(|e| e.contains("delete_after")),
            "round {round}: {gone}"
        );
    }
    // The stream sends its closing event, and once it is read the sandbox
    // is gone too, also after a timeout.
    for (body, closing) in [
        (
            json!({"cmd": "print('streamed')", "language": "python", "exact_output": true, "delete_after": true}),
            "event: exit",
        ),
        (
            json!({"cmd": "sleep 30", "timeout_seconds": 0.5, "delete_after": true}),
            "event: ",
        ),
    ] {
        let id = d.create(host.clone()).await;
        let text = d.exec_stream_text(&id, body.clone()).await;
        assert!(text.contains(closing), "{body}: {text}");
        assert_eq!(
            status_of(&id).await,
            404,
            "{body}: the sandbox is still there"
        );
    }
    // A client that goes away mid-exec: the exec is killed and the
    // sandbox goes too.
    let id = d.create(host.clone()).await;
    let gave_up = d
        .req(reqwest::Method::POST, &format!("/v1/sandboxes/{id}/exec"))
        .json(&json!({"cmd": "sleep 30", "delete_after": true}))
        .timeout(Duration::from_millis(500))
        .send()
        .await;
    assert!(gave_up.is_err(), "{gave_up:?}");
    gone_within(&id, 3, "the sandbox of a client gone is still there").await;
    // Without it the sandbox stays.
    let id = d.create(host).await;
    assert_eq!(d.exec(&id, "true").await.0, 200);
    assert_eq!(status_of(&id).await, 200);
    // runcell run: nothing is left once it returns (its sandbox's TTL is
    // 5 s; this looks well before).
    let before = r.sandboxes().len();
    let out = r
        .cmd()
        .args(["run", "python", "-c", "print(6*7)"])
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), "42\n");
    let deadline = Instant::now() + Duration::from_secs(2);
    while r.sandboxes().len() != before {
        assert!(Instant::now() < deadline, "{:?}", r.sandboxes());
        std::thread::sleep(Duration::from_millis(20));
    }
    d.delete(&id).await;
}

/// The events of an SSE answer, in order: (name, data as JSON).
fn sse_events(text: &str) -> Vec<(String, Value)> {
    text.split("\n\n")
        .filter_map(|event| {
            let name = event.lines().find_map(|l| l.strip_prefix("event: "))?;
            let data = event.lines().find_map(|l| l.strip_prefix("data: "))?;
            Some((name.to_string(), serde_json::from_str(data).unwrap()))
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn post_run_makes_runs_and_deletes_a_sandbox_in_one_request() {
    use base64::Engine as _;
    use serde_json::json;
    let r = runner();
    let d = &r.daemon;
    let run = |body: Value| async move {
        let resp = d
            .req(reqwest::Method::POST, "/v1/run")
            .json(&body)
            .send()
            .await
            .unwrap();
        (resp.status().as_u16(), resp.text().await.unwrap())
    };
    let listed = || async { d.get::<Value>("/v1/sandboxes").await };
    let gone_within = |id: String, secs: u64| async move {
        let deadline = Instant::now() + Duration::from_secs(secs);
        let path = format!("/v1/sandboxes/{id}");
        loop {
            if d.status(reqwest::Method::GET, &path, None).await == 404 {
                return d.sandbox(&id).await;
            }
            assert!(Instant::now() < deadline, "{id} is still there");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    // The sandbox comes first, then the program's output as written and
    // its end; the sandbox's and the exec's environments both apply.
    let (status, text) = run(json!({
        "sandbox": {"template": "host", "env": {"A": "1"}},
        "exec": {
            "cmd": "import os, sys; print(os.environ['A'] + os.environ['B']); sys.stderr.write('e'); sys.exit(4)",
            "language": "python", "exact_output": true, "env": {"B": "2"},
        },
    }))
    .await;
    assert_eq!(status, 200, "{text}");
    let events = sse_events(&text);
    assert_eq!(events[0].0, "sandbox", "{text}");
    assert_eq!(events[0].1["template"], "host", "{text}");
    let id = events[0].1["id"].as_str().unwrap().to_string();
    let decoded = |stream: &str| -> Vec<u8> {
        events
            .iter()
            .filter(|(n, _)| n == stream)
            .flat_map(|(_, v)| {
                base64::engine::general_purpose::STANDARD
                    .decode(v["data"].as_str().unwrap())
                    .unwrap()
            })
            .collect()
    };
    assert_eq!(decoded("stdout"), b"12\n", "{text}");
    assert_eq!(decoded("stderr"), b"e", "{text}");
    let last = events.last().unwrap();
    assert_eq!((last.0.as_str(), &last.1["exit_code"]), ("exit", &json!(4)));
    let why = gone_within(id, 2).await;
    assert!(
        why["error"].as_str().unwrap().contains("POST /v1/run"),
        "{why}"
    );
    // Refused before anything is made, the error naming the field from
    // the body's top.
    for (body, names) in [
        (
            json!({"exec": {"cmd": "true", "timeout_seconds": -1}}),
            "exec.timeout_seconds",
        ),
        (
            json!({"exec": {"cmd": "true", "timeout_seconds": 1e308}}),
            "exec.timeout_seconds",
        ),
        (json!({"exec": {"cmd": "1", "args": ["a"]}}), "exec.args"),
        (
            json!({"exec": {"cmd": "1", "language": "cobol"}}),
            "exec.language",
        ),
        (json!({"exec": {"cmd": " "}}), "exec.cmd"),
        (
            json!({"sandbox": {"limits": {"memory_mb": 1e20}}, "exec": {"cmd": "true"}}),
            "sandbox.limits.memory_mb",
        ),
        (
            json!({"sandbox": {"ttl_seconds": -5}, "exec": {"cmd": "true"}}),
            "ttl_seconds",
        ),
        (
            json!({"sandbox": {"template": "no-such-template"}, "exec": {"cmd": "true"}}),
            "no-such-template",
        ),
        (json!({"sandbox": {}}), "exec"),
        (json!({"exec": {"cmd": "true"}, "then": "x"}), "then"),
        // NUL bytes, and a command longer than one argument may be.
        (json!({"exec": {"cmd": "echo a\u{0}b"}}), "exec.cmd"),
        (
            json!({"exec": {"cmd": "true", "env": {"A": "x\u{0}"}}}),
            "exec.env",
        ),
        (
            json!({"sandbox": {"env": {"A\u{0}": "1"}}, "exec": {"cmd": "true"}}),
            "env",
        ),
        (json!({"exec": {"cmd": "x".repeat(200 << 10)}}), "exec.cmd"),
    ] {
        let (status, text) = run(body.clone()).await;
        assert!((400..500).contains(&status), "{body}: {status} {text}");
        let err: Value = serde_json::from_str(&text).unwrap();
        assert!(
            err["error"].as_str().unwrap().contains(names),
            "{body}: {text}"
        );
    }
    assert_eq!(listed().await, json!([]), "a refused run made a sandbox");
    // A timeout ends the stream, then the sandbox goes.
    let (status, text) = run(json!({
        "sandbox": {"template": "host"},
        "exec": {"cmd": "sleep 30", "timeout_seconds": 0.5, "exact_output": true},
    }))
    .await;
    assert_eq!(status, 200, "{text}");
    let events = sse_events(&text);
    assert_eq!(events.last().unwrap().1["timed_out"], true, "{text}");
    gone_within(events[0].1["id"].as_str().unwrap().into(), 2).await;
    // A program that outlives the sandbox's idle TTL is work in progress:
    // the TTL does not reap it.
    let (status, text) = run(json!({
        "sandbox": {"template": "host", "ttl_seconds": 1},
        "exec": {"cmd": "sleep 2.5; echo done"},
    }))
    .await;
    assert_eq!(status, 200, "{text}");
    assert!(text.contains("{\"chunk\":\"done\\n\"}"), "{text}");
    // A client that goes away mid-run: the program is killed and the
    // sandbox goes.
    let mut resp = d
        .req(reqwest::Method::POST, "/v1/run")
        .json(&json!({"sandbox": {"template": "host"}, "exec": {"cmd": "sleep 30"}}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let first = String::from_utf8(resp.chunk().await.unwrap().unwrap().to_vec()).unwrap();
    let id = sse_events(&first)[0].1["id"].as_str().unwrap().to_string();
    drop(resp);
    gone_within(id, 3).await;
    assert_eq!(listed().await, json!([]));
}
