//! The HTTP API's own cost, in one run: create + exec `python3 -c pass` +
//! delete through `runcell serve` on loopback (sequential, then 16 and 64
//! concurrent clients), beside the same work through the library with the
//! same standby pool (the direct path) and `runcell run python -c pass`;
//! then where one sandbox's time goes through the API, phase by phase, as
//! `runcell run` uses it (create, the program `pass` through
//! `exec/stream`, a second run in the same sandbox, a shell line that is
//! one simple command and the same line kept in bash, delete), beside bare
//! `/usr/bin/python3 -c pass` in the same loop, and the same create, run
//! and delete as one request (`POST /v1/run`, what `runcell run` sends).
//!
//! Run with `sudo ./scripts/bench.sh --api`.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use reqwest::Method;
use runcell_core::{RunOptions, Runtime, RuntimeConfig, SandboxOptions};
use runcell_protocol::Command as Cmd;
use runcell_testkit::{free_port, Daemon};
use serde_json::{json, Value};

/// The idle time before every measured row: the daemon refills its pools
/// 100 ms after a claim, as between a person's runs, and every other row
/// gets the same pause so that none starts from a warmer machine.
const PAUSE: Duration = Duration::from_millis(150);

#[derive(Debug, Parser)]
#[command(about = "HTTP API benchmark (runs the direct path beside it)")]
struct Args {
    /// Sequential iterations per row.
    #[arg(long, default_value_t = 60)]
    iterations: usize,
    /// Operations per client in the concurrent rows.
    #[arg(long, default_value_t = 3)]
    per_client: usize,
}

fn pct(sorted: &[Duration], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    sorted[runcell_testkit::percentile_index(sorted.len(), p)].as_secs_f64() * 1000.0
}

/// The daemon and one client (with its connection pool) for every request.
struct Api {
    daemon: Daemon,
    http: reqwest::Client,
}

impl Api {
    fn req(&self, method: Method, path: &str) -> reqwest::RequestBuilder {
        self.daemon.request(&self.http, method, path)
    }

    /// Creates a sandbox from `host`; its id.
    async fn create(&self) -> Result<String, String> {
        let r = self
            .req(Method::POST, "/v1/sandboxes")
            .json(&json!({"template": "host"}))
            .send()
            .await
            .map_err(|e| e.to_string())?;
        if r.status() != 201 {
            return Err(format!("create: {}", r.status()));
        }
        Ok(r.json::<Value>().await.map_err(|e| e.to_string())?["id"]
            .as_str()
            .unwrap_or_default()
            .to_string())
    }

    async fn delete(&self, id: &str) -> Result<(), String> {
        let r = self
            .req(Method::DELETE, &format!("/v1/sandboxes/{id}"))
            .send()
            .await
            .map_err(|e| e.to_string())?;
        if r.status() != 204 {
            return Err(format!("delete: {}", r.status()));
        }
        Ok(())
    }

    async fn cycle(&self) -> Result<Duration, String> {
        let t = Instant::now();
        let id = self.create().await?;
        self.exec_line(&id, "/usr/bin/python3 -c pass").await?;
        self.delete(&id).await?;
        Ok(t.elapsed())
    }

    /// Runs `pass` as a Python program through `exec/stream`, as
    /// `runcell run` does (no shell); the time to the stream's end.
    async fn run_pass(&self, id: &str) -> Result<Duration, String> {
        let t = Instant::now();
        let r = self
            .req(Method::POST, &format!("/v1/sandboxes/{id}/exec/stream"))
            .json(&json!({"cmd": "pass", "language": "python", "exact_output": true}))
            .send()
            .await
            .map_err(|e| e.to_string())?;
        let body = r.text().await.map_err(|e| e.to_string())?;
        if !body.contains("\"exit_code\":0") {
            return Err(format!("run: {body}"));
        }
        Ok(t.elapsed())
    }

    /// `pass` as a Python program in a sandbox made for it and deleted
    /// after it, in one request (`POST /v1/run`, as `runcell run` sends
    /// it); the time to the stream's end.
    async fn run_once(&self) -> Result<Duration, String> {
        let t = Instant::now();
        let r = self
            .req(Method::POST, "/v1/run")
            .json(&json!({
                "sandbox": {"template": "host"},
                "exec": {"cmd": "pass", "language": "python", "exact_output": true},
            }))
            .send()
            .await
            .map_err(|e| e.to_string())?;
        let body = r.text().await.map_err(|e| e.to_string())?;
        if !body.starts_with("event: sandbox") || !body.contains("\"exit_code\":0") {
            return Err(format!("run: {body}"));
        }
        Ok(t.elapsed())
    }

    /// The shell line `line` through `exec`; the time to its answer.
    async fn exec_line(&self, id: &str, line: &str) -> Result<Duration, String> {
        let t = Instant::now();
        let r = self
            .req(Method::POST, &format!("/v1/sandboxes/{id}/exec"))
            .json(&json!({ "cmd": line }))
            .send()
            .await
            .map_err(|e| e.to_string())?;
        let body: Value = r.json().await.map_err(|e| e.to_string())?;
        if body["exit_code"] != 0 {
            return Err(format!("exec {line:?}: {body}"));
        }
        Ok(t.elapsed())
    }

    /// One sandbox phase by phase: create, first run, second run, a simple
    /// shell line (its program started without bash), the same line made
    /// a list (`;` after it: bash starts and then execs the program),
    /// delete.
    async fn phases(&self) -> Result<[Duration; 6], String> {
        let t = Instant::now();
        let id = self.create().await?;
        let create = t.elapsed();
        let first = self.run_pass(&id).await?;
        let second = self.run_pass(&id).await?;
        let simple = self.exec_line(&id, "/usr/bin/true").await?;
        let shell = self.exec_line(&id, "/usr/bin/true;").await?;
        let t = Instant::now();
        self.delete(&id).await?;
        Ok([create, first, second, simple, shell, t.elapsed()])
    }
}

async fn concurrent(
    api: &Arc<Api>,
    clients: usize,
    per_client: usize,
) -> (Vec<Duration>, usize, Duration) {
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..clients {
        let api = api.clone();
        tasks.push(tokio::spawn(async move {
            let mut out = Vec::new();
            let mut errors = 0;
            for _ in 0..per_client {
                match api.cycle().await {
                    Ok(d) => out.push(d),
                    Err(e) => {
                        eprintln!("error: {e}");
                        errors += 1
                    }
                }
            }
            (out, errors)
        }));
    }
    let (mut all, mut errors) = (Vec::new(), 0);
    for t in tasks {
        let (d, e) = t.await.expect("client task");
        all.extend(d);
        errors += e;
    }
    all.sort();
    (all, errors, started.elapsed())
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    let dir = std::env::current_exe()
        .ok()
        .and_then(|p| p.parent().map(PathBuf::from))
        .expect("own directory");
    let runcell = dir.join("runcell");
    let data = PathBuf::from(format!("/run/runcell-bench/api-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&data);
    let daemon = Daemon::spawn(
        &runcell,
        &data,
        free_port(),
        // No first-run template build competing for the CPU while it measures.
        [
            "--standby",
            "2",
            "--max-sandboxes",
            "128",
            "--auto-build=false",
        ],
    );
    let api = Arc::new(Api {
        daemon,
        http: reqwest::Client::new(),
    });
    let direct = Runtime::new(RuntimeConfig {
        state_dir: "/run/runcell-bench/direct".into(),
        cgroup_parent: "runcell-bench-direct".into(),
        standby: 2,
        ..RuntimeConfig::default()
    })
    .expect("runtime");
    direct.warm_up().await;
    for _ in 0..3 {
        api.cycle().await.expect("warm-up");
    }

    let (mut seq_api, mut seq_direct, mut cli) = (Vec::new(), Vec::new(), Vec::new());
    let mut phases: [Vec<Duration>; 6] = Default::default();
    let mut bare = Vec::new();
    let (mut three, mut once) = (Vec::new(), Vec::new());
    let mut errors = 0;
    for _ in 0..args.iterations {
        // Between requests, as a daemon is, the pools have refilled.
        tokio::time::sleep(PAUSE).await;
        match api.cycle().await {
            Ok(d) => seq_api.push(d),
            Err(e) => {
                eprintln!("error: {e}");
                errors += 1
            }
        }
        direct.warm_up().await;
        // Every row after the same idle pause: a pause costs the next
        // command a cold start here (1-3 ms for bare python3), so a row
        // measured without one would look faster than it is.
        tokio::time::sleep(PAUSE).await;
        let t = Instant::now();
        let sb = direct
            .create(SandboxOptions {
                tied_to_process: false,
                ..SandboxOptions::default()
            })
            .await
            .expect("create");
        // The same work as the API's exec: the command through a shell.
        let r = sb
            .exec(
                Cmd::Shell("/usr/bin/python3 -c pass".into()),
                &RunOptions::default(),
            )
            .await
            .expect("run");
        assert_eq!(r.outcome.status(), 0);
        sb.destroy().await.expect("destroy");
        seq_direct.push(t.elapsed());
        tokio::time::sleep(PAUSE).await;
        let t = Instant::now();
        let ok = Command::new(&runcell)
            .args(["run", "python", "-c", "pass"])
            .stdout(Stdio::null())
            .status()
            .expect("runcell run")
            .success();
        assert!(ok);
        cli.push(t.elapsed());
        tokio::time::sleep(PAUSE).await;
        match api.phases().await {
            Ok(p) => {
                three.push(p[0] + p[1] + p[5]);
                for (v, d) in phases.iter_mut().zip(p) {
                    v.push(d);
                }
            }
            Err(e) => {
                eprintln!("error: {e}");
                errors += 1
            }
        }
        tokio::time::sleep(PAUSE).await;
        match api.run_once().await {
            Ok(d) => once.push(d),
            Err(e) => {
                eprintln!("error: {e}");
                errors += 1
            }
        }
        tokio::time::sleep(PAUSE).await;
        let t = Instant::now();
        let ok = Command::new("/usr/bin/python3")
            .args(["-c", "pass"])
            .status()
            .expect("python3")
            .success();
        assert!(ok);
        bare.push(t.elapsed());
    }
    for v in [
        &mut seq_api,
        &mut seq_direct,
        &mut cli,
        &mut bare,
        &mut three,
        &mut once,
    ]
    .into_iter()
    .chain(phases.iter_mut())
    {
        v.sort();
    }
    let (c16, e16, w16) = concurrent(&api, 16, args.per_client).await;
    let (c64, e64, w64) = concurrent(&api, 64, args.per_client).await;
    // Every client task has finished: this is the last reference. Dropping
    // it stops the daemon gracefully (it destroys its standbys) and unmounts
    // its layer store and the sandboxes' tmpfs; a SIGKILL here left both
    // mounted, and a loop device attached, after every run.
    drop(api);

    println!(
        "create + exec `python3 -c pass` + delete; iterations {}; {} ops per concurrent client\n",
        args.iterations, args.per_client
    );
    println!("| what | p50 ms | p95 ms | errors | ops/s |");
    println!("|---|---:|---:|---:|---:|");
    let row = |label: &str, v: &[Duration], e: usize, wall: Option<Duration>| {
        let ops = wall
            .map(|w| format!("{:.1}", v.len() as f64 / w.as_secs_f64()))
            .unwrap_or_else(|| "-".into());
        println!(
            "| {label} | {:.1} | {:.1} | {e} | {ops} |",
            pct(v, 0.5),
            pct(v, 0.95)
        );
    };
    row("direct: library, standby pool", &seq_direct, 0, None);
    row("HTTP API, sequential", &seq_api, errors, None);
    row("HTTP API, 16 concurrent clients", &c16, e16, Some(w16));
    row("HTTP API, 64 concurrent clients", &c64, e64, Some(w64));
    row("`runcell run python -c pass` (no daemon)", &cli, 0, None);
    println!(
        "\nAPI cost over the direct path (p50): {:.1} ms",
        pct(&seq_api, 0.5) - pct(&seq_direct, 0.5)
    );
    println!("\nOne sandbox through the API, phase by phase (the program `pass` through `exec/stream`, as `runcell run` sends it; then two shell lines through `exec`):\n");
    println!("| phase | p50 ms | p95 ms |");
    println!("|---|---:|---:|");
    let labels = [
        "create (standby pool)",
        "first run in the sandbox",
        "second run in the same sandbox",
        "`exec` of the line `/usr/bin/true` (started without bash)",
        "`exec` of the line `/usr/bin/true;` (bash starts, then execs it)",
        "delete",
    ];
    for (label, v) in labels.iter().zip(&phases) {
        println!("| {label} | {:.2} | {:.2} |", pct(v, 0.5), pct(v, 0.95));
    }
    println!(
        "| bare `/usr/bin/python3 -c pass`, same loop | {:.2} | {:.2} |",
        pct(&bare, 0.5),
        pct(&bare, 0.95)
    );
    println!(
        "| create + first run + delete, three requests (sum of the rows above) | {:.2} | {:.2} |",
        pct(&three, 0.5),
        pct(&three, 0.95)
    );
    println!(
        "| the same in one request (`POST /v1/run`, as `runcell run` sends it) | {:.2} | {:.2} |",
        pct(&once, 0.5),
        pct(&once, 0.95)
    );
    let _ = std::fs::remove_dir_all(&data);
}
