//! Measures sandbox start-up cost against baselines, all in one run:
//!
//! (a) bare `/usr/bin/python3 -c pass`
//! (b) the same under `bwrap --unshare-all`
//! (c) the same under gVisor (`runsc --network=none do`), when installed
//! (d) `runcell run --no-daemon python -c pass` (the CLI: create, run,
//!     destroy, all in its own process)
//! (e) runcell sandbox create + destroy with no process (library)
//! (f) runcell create + run python + destroy (library, no CLI start-up)
//! (g) as (e), taking a prepared sandbox from the standby pool
//! (h) as (f), taking a prepared sandbox from the standby pool
//! (i) `runcell run --daemon always python -c pass`: the CLI through a local
//!     `runcell serve` (standby pool of 2), as `runcell run` does by default
//!     when a daemon runs
//!
//! Every command runs the same interpreter, Debian's `/usr/bin/python3`
//! (the `host` template exposes the host's /usr, so runcell runs it too).
//! Runs are interleaved round-robin so drift affects every row alike, and
//! every sample follows the same idle pause (`--pause-ms`, 150 ms), so none
//! is measured from a warmer or colder machine than another.
//!
//! Run with `sudo ./scripts/bench.sh` (builds in release mode first).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use clap::Parser;
use runcell_core::{RunOptions, Runtime, RuntimeConfig, SandboxOptions};
use runcell_protocol::Language;
use runcell_testkit::bench::{bwrap_python, ms, percentile, strings, time_command, PYTHON};
use runcell_testkit::{free_port, Daemon};

#[derive(Debug, Parser)]
#[command(about = "Sandbox start-up benchmark (runs baselines side by side)")]
struct Args {
    /// Measured iterations per row.
    #[arg(long, default_value_t = 100)]
    iterations: usize,
    /// Unmeasured warm-up iterations per row.
    #[arg(long, default_value_t = 5)]
    warmup: usize,
    /// Iterations for the gVisor row (it is slow).
    #[arg(long, default_value_t = 20)]
    gvisor_iterations: usize,
    /// Idle time before every sample of every row, in milliseconds. Row (i)
    /// needs one (the daemon refills its standby pool 100 ms after a
    /// claim), and a pause costs the next command a cold start on this
    /// VM (about 1-3 ms more for bare python3), so every row gets the same
    /// pause: each is measured from the same idle state. 0 runs rows back to
    /// back and row (i) then after the pause only, as before 4 December 2026.
    #[arg(long, default_value_t = 150, value_parser = clap::value_parser!(u64).range(0..=5000))]
    pause_ms: u64,
}

#[derive(Debug)]
struct Row {
    label: &'static str,
    samples: Vec<Duration>,
}

fn on_path(tool: &str) -> bool {
    std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).any(|d| d.join(tool).is_file()))
        .unwrap_or(false)
}

async fn create_destroy(rt: &Runtime, opts: &SandboxOptions) -> Duration {
    let t = Instant::now();
    let sb = rt.create(opts.clone()).await.expect("create");
    sb.destroy().await.expect("destroy");
    t.elapsed()
}

async fn create_run_destroy(rt: &Runtime, opts: &SandboxOptions) -> Duration {
    let t = Instant::now();
    let sb = rt.create(opts.clone()).await.expect("create");
    let r = sb
        .run_code(Language::Python, "pass", &RunOptions::default())
        .await
        .expect("run");
    assert_eq!(r.outcome.status(), 0);
    sb.destroy().await.expect("destroy");
    t.elapsed()
}

/// Waits `d` without using a CPU (nothing when `d` is zero).
async fn idle(d: Duration) {
    if !d.is_zero() {
        tokio::time::sleep(d).await;
    }
}

/// As `time_command`, with `env` added to the command's environment.
fn time_with_env(argv: &[String], env: &[(&str, String)]) -> Duration {
    let started = Instant::now();
    let status = std::process::Command::new(&argv[0])
        .args(&argv[1..])
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .unwrap_or_else(|e| panic!("could not run {}: {e}", argv[0]));
    let took = started.elapsed();
    assert!(status.success(), "{argv:?} failed: {status}");
    took
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("RUNCELL_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let exe_dir = std::env::current_exe()
        .ok()
        .and_then(|p| p.parent().map(PathBuf::from))
        .expect("own directory");
    let runcell = exe_dir.join("runcell");
    assert!(
        runcell.is_file(),
        "build the workspace first: {} is missing",
        runcell.display()
    );

    let bare = strings(&[PYTHON, "-c", "pass"]);
    let bwrap = bwrap_python(&["-c", "pass"]);
    let runsc = strings(&["runsc", "--network=none", "do", PYTHON, "-c", "pass"]);
    let runcell_cli = vec![
        runcell.display().to_string(),
        "run".into(),
        "--no-daemon".into(),
        "python".into(),
        "-c".into(),
        "pass".into(),
    ];
    // A daemon as a user runs it (no first-run template build competing
    // for the CPU); `runcell run` finds it through RUNCELL_URL and its key
    // file through RUNCELL_DATA_DIR.
    let data = PathBuf::from(format!("/run/runcell-bench/startup-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&data);
    let mut daemon = Daemon::spawn(
        &runcell,
        &data,
        free_port(),
        [
            "--standby",
            "2",
            "--auto-build=false",
            "--cgroup-parent",
            "runcell-bench-daemon",
        ],
    );
    let runcell_daemon = strings(&[
        &runcell.display().to_string(),
        "run",
        "--daemon",
        "always",
        "python",
        "-c",
        "pass",
    ]);
    let daemon_env = [
        ("RUNCELL_URL", daemon.url.clone()),
        ("RUNCELL_DATA_DIR", data.display().to_string()),
    ];
    let has_bwrap = on_path("bwrap");
    let has_runsc = on_path("runsc");

    let rt = Runtime::new(RuntimeConfig {
        state_dir: "/run/runcell-bench/sandboxes".into(),
        cgroup_parent: "runcell-bench".into(),
        ..RuntimeConfig::default()
    })
    .expect("runtime");
    let opts = SandboxOptions::default();
    let pooled = Runtime::new(RuntimeConfig {
        state_dir: "/run/runcell-bench/pooled".into(),
        cgroup_parent: "runcell-bench-pooled".into(),
        standby: 2,
        ..RuntimeConfig::default()
    })
    .expect("runtime");
    pooled.warm_up().await;

    let mut rows: Vec<Row> = [
        "(a) bare python3 -c pass",
        "(b) bwrap --unshare-all python3",
        "(c) runsc (gVisor) do python3",
        "(d) runcell run python -c pass",
        "(e) runcell create+destroy",
        "(f) runcell create+run+destroy",
        "(g) runcell create+destroy, standby pool",
        "(h) runcell create+run+destroy, standby pool",
        "(i) runcell run python -c pass, through a daemon",
    ]
    .into_iter()
    .map(|label| Row {
        label,
        samples: Vec::new(),
    })
    .collect();

    let total = args.warmup + args.iterations;
    // The same idle time before every sample (see `--pause-ms`); at least
    // 150 ms before row (i), whose daemon refills its pool 100 ms after a
    // claim, as between a person's runs.
    let pause = Duration::from_millis(args.pause_ms);
    let before_daemon = pause.max(Duration::from_millis(150));
    for i in 0..total {
        let keep = i >= args.warmup;
        let mut record = |row: usize, d: Duration| {
            if keep {
                rows[row].samples.push(d);
            }
        };
        idle(pause).await;
        record(0, time_command(&bare));
        if has_bwrap {
            idle(pause).await;
            record(1, time_command(&bwrap));
        }
        if has_runsc && i < args.warmup + args.gvisor_iterations {
            idle(pause).await;
            record(2, time_command(&runsc));
        }
        idle(pause).await;
        record(3, time_command(&runcell_cli));

        idle(pause).await;
        record(4, create_destroy(&rt, &opts).await);
        idle(pause).await;
        record(5, create_run_destroy(&rt, &opts).await);
        // The pool refills in the background; make sure a standby is there
        // (not measured), as it is in a daemon between requests.
        pooled.warm_up().await;
        idle(pause).await;
        record(6, create_destroy(&pooled, &opts).await);
        pooled.warm_up().await;
        idle(pause).await;
        record(7, create_run_destroy(&pooled, &opts).await);
        idle(before_daemon).await;
        record(8, time_with_env(&runcell_daemon, &daemon_env));
    }
    daemon.stop();
    let _ = std::fs::remove_dir_all(&data);

    let base = {
        let mut s = rows[0].samples.clone();
        s.sort();
        percentile(&s, 0.5)
    };
    println!(
        "python: {PYTHON}; iterations: {} (gVisor {}); idle before every sample: {} ms; machine: {} cores",
        args.iterations,
        args.gvisor_iterations,
        args.pause_ms,
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(0)
    );
    println!();
    println!("| what | p50 ms | p95 ms | p50 / (a) | overhead over (a), ms |");
    println!("|---|---:|---:|---:|---:|");
    for row in &mut rows {
        if row.samples.is_empty() {
            println!("| {} | n/a | n/a | n/a | n/a |", row.label);
            continue;
        }
        row.samples.sort();
        let p50 = percentile(&row.samples, 0.5);
        let p95 = percentile(&row.samples, 0.95);
        let ratio = p50.as_secs_f64() / base.as_secs_f64();
        let over = if row.label.contains("create+destroy") {
            "n/a (no process)".to_string()
        } else {
            format!("{:.1}", ms(p50) - ms(base))
        };
        println!(
            "| {} | {:.1} | {:.1} | {:.2}x | {} |",
            row.label,
            ms(p50),
            ms(p95),
            ratio,
            over
        );
    }
}
