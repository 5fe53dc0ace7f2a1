//! The `runcell` command line as a user runs it: the real binary against a
//! real daemon (needs root, like the other daemon tests).

mod common;

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::*;
use reqwest::Method;
use serde_json::{json, Value};

/// `runcell ARGS` with the daemon's address and key in the environment.
fn runcell(d: &Daemon, args: &[&str]) -> Output {
    cmd(d, args).output().unwrap()
}

fn cmd(d: &Daemon, args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_runcell"));
    c.args(args)
        .env("RUNCELL_URL", &d.url)
        .env("RUNCELL_API_KEY", &d.key)
        .env_remove("RUNCELL_DATA_DIR")
        .stdin(Stdio::null());
    c
}

fn out(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn err(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn ok(o: &Output) -> String {
    assert!(
        o.status.success(),
        "status {:?}\nstdout: {}\nstderr: {}",
        o.status,
        out(o),
        err(o)
    );
    out(o)
}

fn scratch(name: &str) -> PathBuf {
    let d = PathBuf::from(format!(
        "/run/runcell-test/cli-{name}-{}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

async fn sh(d: &Daemon, id: &str, cmd: &str) -> String {
    let (status, body) = d.exec(id, cmd).await;
    assert_eq!(status, 200, "{body}");
    body["stdout"].as_str().unwrap().to_string()
}

/// Stops the daemon and removes its data directory.
fn finish(d: Daemon) {
    let data = d.data.clone();
    drop(d);
    let _ = std::fs::remove_dir_all(data);
}

async fn kill(d: &Daemon, id: &str) {
    d.delete(id).await;
}

#[tokio::test]
async fn cp_copies_into_directories_both_ways_and_copies_directories_recursively() {
    let d = Daemon::start(&data_dir("cli-cp"), free_port(), &[]);
    let id = d.create(json!({"template": "host"})).await;
    sh(
        &d,
        &id,
        "mkdir -p /home/user/tree/sub && printf 'PNG\\x00\\x01' > /home/user/out.png \
         && echo a > /home/user/tree/a.txt && echo b > /home/user/tree/sub/b.txt",
    )
    .await;
    let local = scratch("cp");
    let l = local.to_str().unwrap();

    // Out of the sandbox into an existing directory, with and without '/'.
    ok(&runcell(
        &d,
        &["cp", &format!("{id}:/home/user/out.png"), l],
    ));
    assert_eq!(
        std::fs::read(local.join("out.png")).unwrap(),
        b"PNG\x00\x01"
    );
    std::fs::create_dir(local.join("into")).unwrap();
    ok(&runcell(
        &d,
        &[
            "cp",
            &format!("{id}:/home/user/out.png"),
            &format!("{l}/into/"),
        ],
    ));
    assert!(local.join("into/out.png").is_file());
    // "." is the current directory.
    let o = cmd(&d, &["cp", &format!("{id}:/home/user/out.png"), "."])
        .current_dir(local.join("into"))
        .output()
        .unwrap();
    ok(&o);

    // Into the sandbox: a trailing '/' or an existing directory.
    std::fs::write(local.join("data.csv"), "x,y\n1,2\n").unwrap();
    let csv = format!("{l}/data.csv");
    ok(&runcell(&d, &["cp", &csv, &format!("{id}:/home/user/")]));
    ok(&runcell(
        &d,
        &["cp", &csv, &format!("{id}:/home/user/tree")],
    ));
    ok(&runcell(&d, &["cp", &csv, &format!("{id}:/tmp/new/")]));
    assert_eq!(
        sh(
            &d,
            &id,
            "cat /home/user/data.csv /home/user/tree/data.csv /tmp/new/data.csv"
        )
        .await,
        "x,y\n1,2\n".repeat(3)
    );

    // A directory out of the sandbox: copied recursively, named as the source.
    ok(&runcell(&d, &["cp", &format!("{id}:/home/user/tree"), l]));
    assert_eq!(
        std::fs::read_to_string(local.join("tree/sub/b.txt")).unwrap(),
        "b\n"
    );
    assert_eq!(
        std::fs::read_to_string(local.join("tree/a.txt")).unwrap(),
        "a\n"
    );
    // And a local directory into the sandbox.
    ok(&runcell(
        &d,
        &["cp", &format!("{l}/tree"), &format!("{id}:/tmp/copy")],
    ));
    assert_eq!(
        sh(&d, &id, "cat /tmp/copy/a.txt /tmp/copy/sub/b.txt").await,
        "a\nb\n"
    );

    // A missing source says so and fails.
    let o = runcell(&d, &["cp", &format!("{id}:/home/user/nope.txt"), l]);
    assert!(!o.status.success());
    assert!(err(&o).contains("nope.txt"), "{}", err(&o));
    kill(&d, &id).await;
    finish(d);
    let _ = std::fs::remove_dir_all(&local);
}

#[tokio::test]
async fn exec_passes_arguments_streams_output_and_exits_with_the_status() {
    let d = Daemon::start(&data_dir("cli-exec"), free_port(), &[]);
    let id = d
        .create(json!({"template": "host", "limits": {"output_bytes": 100}}))
        .await;

    // Arguments after -- reach the program as separate argv entries.
    let o = runcell(
        &d,
        &[
            "exec",
            &id,
            "--",
            "python3",
            "-c",
            "import sys; print(sys.version_info[0], sys.argv[1:])",
            "a b",
            "c'd",
            "$HOME",
        ],
    );
    assert_eq!(ok(&o), "3 ['a b', \"c'd\", '$HOME']\n");
    // One argument stays a shell line.
    let o = runcell(&d, &["exec", &id, "--", "echo hi && exit 3"]);
    assert_eq!(out(&o), "hi\n");
    assert_eq!(o.status.code(), Some(3));

    // Output streams: the first line arrives before the command ends.
    let started = Instant::now();
    let mut child = cmd(&d, &["exec", &id, "--", "echo first; sleep 4; echo second"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    assert_eq!(lines.next().unwrap().unwrap(), "first");
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "the first line came after {:?}: exec buffers its output",
        started.elapsed()
    );
    assert_eq!(lines.next().unwrap().unwrap(), "second");
    assert!(child.wait().unwrap().success());

    // A timeout exits 124 and says so.
    let o = runcell(&d, &["exec", "--timeout", "1s", &id, "--", "sleep 10"]);
    assert_eq!(o.status.code(), Some(124), "{}", err(&o));
    assert!(err(&o).contains("timeout") || err(&o).contains("timed out"));

    // Output past the limit: one clean marker, printed once.
    let o = runcell(
        &d,
        &["exec", &id, "--", "head -c 501 /dev/zero | tr '\\0' x"],
    );
    ok(&o);
    let all = format!("{}{}", out(&o), err(&o));
    assert_eq!(all.matches("truncated").count(), 1, "{all}");
    assert!(!all.contains("runcell: [runcell:"), "{all}");
    assert!(!all.contains("501 bytes (501 B)"), "{all}");
    assert!(all.contains("501"), "{all}");
    kill(&d, &id).await;
    finish(d);
}

#[tokio::test]
async fn logs_follow_prints_each_line_once() {
    let d = Daemon::start(&data_dir("cli-logs"), free_port(), &[]);
    let id = d.create(json!({"template": "host"})).await;
    sh(&d, &id, "printf 'one\\ntwo\\n'").await;
    assert_eq!(out(&runcell(&d, &["logs", &id])), "one\ntwo\n");
    let child = cmd(&d, &["logs", "-f", &id])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    tokio::time::sleep(Duration::from_millis(800)).await;
    sh(&d, &id, "echo three").await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    kill(&d, &id).await;
    let o = tokio::task::spawn_blocking(move || child.wait_with_output().unwrap())
        .await
        .unwrap();
    assert_eq!(out(&o), "one\ntwo\nthree\n");
    finish(d);
}

#[tokio::test]
async fn save_images_creates_the_directory_or_fails_with_the_reason() {
    let d = Daemon::start(&data_dir("cli-images"), free_port(), &[]);
    let id = d.create(json!({"template": "host"})).await;
    let local = scratch("images");
    // An image result without matplotlib (the host template may lack it).
    let plot = "class P:\n    def _repr_png_(self):\n        return b'\\x89PNG\\r\\n'\nP()";
    let dir = local.join("new/plots");
    let o = runcell(
        &d,
        &[
            "code",
            &id,
            "--save-images",
            dir.to_str().unwrap(),
            "-c",
            plot,
        ],
    );
    ok(&o);
    let png = std::fs::read(dir.join("result-1.png")).unwrap();
    assert_eq!(&png[1..4], b"PNG");

    // Under a regular file no directory can be made: the OS error, non-zero.
    std::fs::write(local.join("file"), "").unwrap();
    let bad = local.join("file/plots");
    let o = runcell(
        &d,
        &[
            "code",
            &id,
            "--save-images",
            bad.to_str().unwrap(),
            "-c",
            plot,
        ],
    );
    assert!(!o.status.success(), "{}", err(&o));
    assert!(err(&o).contains("Not a directory"), "{}", err(&o));
    kill(&d, &id).await;
    finish(d);
    let _ = std::fs::remove_dir_all(&local);
}

#[tokio::test]
async fn sandbox_commands_take_limits_print_headers_and_human_views() {
    let d = Daemon::start(&data_dir("cli-sandbox"), free_port(), &[]);
    let o = runcell(&d, &["sandbox", "ls"]);
    assert!(ok(&o).contains("No sandboxes"), "{}", out(&o));
    let o = runcell(
        &d,
        &[
            "sandbox",
            "create",
            "--template",
            "host",
            "--memory",
            "256M",
            "--cpus",
            "0.5",
            "--timeout",
            "7s",
            "--disk",
            "100M",
            "--pids",
            "64",
        ],
    );
    let id = ok(&o).trim().to_string();
    let s: Value = d.get(&format!("/v1/sandboxes/{id}")).await;
    let l = &s["limits"];
    assert_eq!(
        (
            &l["memory_mb"],
            &l["cpu"],
            &l["timeout_seconds"],
            &l["disk_mb"],
            &l["pids"]
        ),
        (
            &json!(256),
            &json!(0.5),
            &json!(7.0),
            &json!(100),
            &json!(64)
        ),
        "{s}"
    );
    let o = runcell(&d, &["sandbox", "ls"]);
    let text = ok(&o);
    let mut lines = text.lines();
    assert!(lines.next().unwrap().starts_with("ID"), "{text}");
    assert!(lines.next().unwrap().starts_with(&id), "{text}");
    let o = runcell(&d, &["sandbox", "get", &id]);
    let text = ok(&o);
    assert!(!text.trim_start().starts_with('{'), "{text}");
    assert!(text.contains(&id) && text.contains("256"), "{text}");
    // Contexts likewise: an empty list says so, a full one has a header.
    let o = runcell(&d, &["context", "ls", &id]);
    assert!(ok(&o).starts_with("No contexts"), "{}", out(&o));
    let ctx = ok(&runcell(&d, &["context", "create", &id]))
        .trim()
        .to_string();
    let o = runcell(&d, &["context", "ls", &id]);
    let text = ok(&o);
    let mut lines = text.lines();
    assert!(lines.next().unwrap().starts_with("ID"), "{text}");
    assert!(lines.next().unwrap().starts_with(&ctx), "{text}");
    let j: Value =
        serde_json::from_str(&ok(&runcell(&d, &["sandbox", "get", &id, "--json"]))).unwrap();
    assert_eq!(j["id"], id.as_str());
    kill(&d, &id).await;
    finish(d);
}

#[tokio::test]
async fn a_refused_key_names_its_source_not_its_value() {
    let d = Daemon::start(&data_dir("cli-401"), free_port(), &[]);
    let o = cmd(&d, &["sandbox", "ls"])
        .env("RUNCELL_API_KEY", "rk-not-a-real-key")
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    let e = err(&o);
    assert!(e.contains("RUNCELL_API_KEY"), "{e}");
    assert!(e.contains("runcell key"), "{e}");
    assert!(!e.contains("rk-not-a-real-key"), "{e}");
    let o = cmd(&d, &["sandbox", "ls", "--api-key", "rk-bad"])
        .output()
        .unwrap();
    assert!(err(&o).contains("--api-key"), "{}", err(&o));
    finish(d);
}

#[tokio::test]
async fn key_ls_takes_the_data_dir_after_the_subcommand_and_prints_dates() {
    let d = Daemon::start(&data_dir("cli-key"), free_port(), &[]);
    let o = Command::new(env!("CARGO_BIN_EXE_runcell"))
        .args(["key", "ls", "--data-dir"])
        .arg(&d.data)
        .output()
        .unwrap();
    let text = ok(&o);
    let row = text.lines().nth(1).expect("a key row");
    // Today in UTC, by jiff rather than the code under test.
    let today = jiff::Timestamp::now().strftime("%Y-%m-%d").to_string();
    assert!(row.contains(&today), "{text}");
    let o = Command::new(env!("CARGO_BIN_EXE_runcell"))
        .args(["key", "create", "--name", "ci", "--data-dir"])
        .arg(&d.data)
        .output()
        .unwrap();
    ok(&o);
    finish(d);
}

#[tokio::test]
async fn template_ls_lists_the_daemons_templates_when_one_is_serving() {
    let d = Daemon::start(&data_dir("cli-tpl"), free_port(), &[]);
    let empty = scratch("tpl-empty");
    let o = cmd(&d, &["template", "ls"])
        .env_remove("RUNCELL_TEMPLATES_DIR")
        .output()
        .unwrap();
    let text = ok(&o);
    let all = format!("{text}{}", err(&o));
    assert!(all.contains(&d.url), "{all}");
    let want: Vec<String> = d
        .req(Method::GET, "/v1/templates")
        .send()
        .await
        .unwrap()
        .json::<Vec<Value>>()
        .await
        .unwrap()
        .iter()
        .map(|t| t["name"].as_str().unwrap().to_string())
        .collect();
    assert!(want.len() >= 2, "{want:?}");
    for name in &want {
        assert!(
            text.lines().any(|l| l.starts_with(name.as_str())),
            "{name} missing: {text}"
        );
    }
    // No daemon reachable: the local directory, and it says so.
    let o = Command::new(env!("CARGO_BIN_EXE_runcell"))
        .args(["template", "ls"])
        .env_remove("RUNCELL_TEMPLATES_DIR")
        .env("RUNCELL_URL", format!("http://127.0.0.1:{}", free_port()))
        .env("RUNCELL_API_KEY", "x")
        .output()
        .unwrap();
    let all = format!("{}{}", ok(&o), err(&o));
    assert!(all.contains("no daemon answers"), "{all}");
    assert!(all.contains("Templates in /"), "{all}");
    // An explicit local directory is listed even while a daemon serves.
    let o = cmd(
        &d,
        &["template", "ls", "--templates-dir", empty.to_str().unwrap()],
    )
    .output()
    .unwrap();
    let all = format!("{}{}", ok(&o), err(&o));
    assert!(
        all.contains(empty.to_str().unwrap()) && !all.contains(&d.url),
        "{all}"
    );
    finish(d);
    let _ = std::fs::remove_dir_all(&empty);
}
