//! What each isolation backend costs, beside its baselines, in one run:
//!
//! Start-up (create + `python3 -c pass` + destroy), interleaved round-robin:
//! (a) bare `/usr/bin/python3 -c pass`
//! (b) the same under `bwrap --unshare-all`
//! (c) the same under gVisor (`runsc --network=none do`): the baseline of
//!     the gvisor backend, whose target is 1.2x of it
//! (d) runcell, one row per backend this host runs (`--backends`): a fresh
//!     sandbox (no standby pool), the program run by its agent, destroyed.
//!
//! Throughput: `--programs` short real programs (hash a JSON document in
//! Python), two at a time, each in a fresh sandbox per backend, beside the
//! same programs run bare and under `runsc do`.
//!
//! The microVM row runs only with `--allow-emulation` where KVM cannot run
//! a guest (TCG is tens of times slower than KVM; its figures say what
//! emulation costs here, not what a KVM host would see).
//!
//! Run with `sudo ./scripts/bench.sh --isolation` (release build first).

use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use runcell_core::backend::Isolation;
use runcell_core::host::{equip, HostOptions};
use runcell_core::{Runtime, RuntimeConfig, SandboxOptions};
use runcell_protocol::Command as AgentCommand;
use runcell_testkit::bench::{bwrap_python, ms, percentile, strings, time_command, PYTHON};

const PROGRAM: &str = "import hashlib, json; print(hashlib.sha256(json.dumps(list(range(20000))).encode()).hexdigest())";

#[derive(Debug, Parser)]
#[command(about = "Isolation backends side by side with bare python3, bwrap and runsc")]
struct Args {
    /// Measured start-up iterations per row.
    #[arg(long, default_value_t = 20)]
    iterations: usize,
    /// Unmeasured warm-up iterations per row.
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    /// Start-up iterations of the microVM row (slow under emulation).
    #[arg(long, default_value_t = 3)]
    microvm_iterations: usize,
    /// Programs per row in the throughput run (0: skip it).
    #[arg(long, default_value_t = 40)]
    programs: usize,
    /// Backends to measure.
    #[arg(long, value_delimiter = ',', default_value = "jail,gvisor,microvm")]
    backends: Vec<Isolation>,
    /// Let the microVM run under TCG emulation.
    #[arg(long)]
    allow_emulation: bool,
}

/// Where one fresh sandbox's time went.
#[derive(Debug, Clone, Copy, Default)]
struct Phases {
    create: Duration,
    exec: Duration,
    /// The same program again in the same sandbox (its files warm): not
    /// part of the start-up total.
    again: Duration,
    destroy: Duration,
}

/// A fresh sandbox of `isolation` runs `code` with python3 and goes.
async fn sandbox_run(rt: &Runtime, isolation: Isolation, code: &str) -> Duration {
    sandbox_phases(rt, isolation, code, false).await.0
}

/// [`sandbox_run`], with the time of each phase; with `again`, the program
/// also runs a second time before the sandbox goes (timed apart).
async fn sandbox_phases(
    rt: &Runtime,
    isolation: Isolation,
    code: &str,
    again: bool,
) -> (Duration, Phases) {
    let t = Instant::now();
    let sb = rt
        .create(SandboxOptions {
            template: "host".into(),
            isolation: Some(isolation),
            ..SandboxOptions::default()
        })
        .await
        .unwrap_or_else(|e| panic!("create ({isolation}): {e}"));
    let created = t.elapsed();
    let run = || async {
        let r = sb
            .exec(
                AgentCommand::Argv(strings(&[PYTHON, "-c", code])),
                &runcell_core::RunOptions::default(),
            )
            .await
            .unwrap_or_else(|e| panic!("exec ({isolation}): {e}"));
        assert_eq!(
            r.outcome.status(),
            0,
            "{isolation}: {}",
            String::from_utf8_lossy(&r.stderr)
        );
    };
    run().await;
    let executed = t.elapsed();
    if again {
        run().await;
    }
    let again = t.elapsed() - executed;
    let t = Instant::now();
    sb.destroy().await.expect("destroy");
    let destroy = t.elapsed();
    (
        executed + destroy,
        Phases {
            create: created,
            exec: executed - created,
            again,
            destroy,
        },
    )
}

/// Programs per second: `n` runs of `one`, two at a time.
async fn throughput<F, Fut>(n: usize, one: F) -> f64
where
    F: Fn() -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = Duration> + Send,
{
    let one = Arc::new(one);
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let t = Instant::now();
    let workers: Vec<_> = (0..2)
        .map(|_| {
            let one = one.clone();
            let next = next.clone();
            tokio::spawn(async move {
                while next.fetch_add(1, std::sync::atomic::Ordering::Relaxed) < n {
                    one().await;
                }
            })
        })
        .collect();
    for w in workers {
        w.await.expect("worker");
    }
    let secs = t.elapsed().as_secs_f64();
    if secs > 0.0 {
        n as f64 / secs
    } else {
        0.0
    }
}

async fn command_async(argv: Vec<String>) -> Duration {
    tokio::task::spawn_blocking(move || time_command(&argv))
        .await
        .expect("command")
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

    let runtime = Runtime::new(RuntimeConfig {
        state_dir: "/run/runcell-bench/isolation".into(),
        cgroup_parent: "runcell-bench-isolation".into(),
        ..RuntimeConfig::default()
    })
    .expect("runtime (build the workspace first)");
    let (rt, report) = equip(
        runtime,
        &HostOptions {
            allow_emulation: args.allow_emulation,
        },
    );
    let mut backends = Vec::new();
    for want in &args.backends {
        match rt.backend_for(*want) {
            Ok(_) => backends.push(*want),
            Err(e) => println!("skipped {want}: {e}"),
        }
    }
    for b in &report.backends {
        println!("backend {}: {}", b.name, b.detail);
    }

    let bare = strings(&[PYTHON, "-c", "pass"]);
    let bwrap = bwrap_python(&["-c", "pass"]);
    let runsc = strings(&["runsc", "--network=none", "do", PYTHON, "-c", "pass"]);

    let mut labels: Vec<String> = vec![
        "(a) bare python3 -c pass".into(),
        "(b) bwrap --unshare-all python3 -c pass".into(),
        "(c) runsc --network=none do python3 -c pass".into(),
    ];
    for b in &backends {
        labels.push(format!(
            "(d) runcell {b}: create + python3 -c pass + destroy"
        ));
    }
    let mut samples: Vec<Vec<Duration>> = vec![Vec::new(); labels.len()];
    let mut phases: Vec<Vec<Phases>> = vec![Vec::new(); backends.len()];
    for i in 0..args.warmup + args.iterations {
        let keep = i >= args.warmup;
        let mut record = |row: usize, d: Duration| {
            if keep {
                samples[row].push(d);
            }
        };
        record(0, time_command(&bare));
        record(1, time_command(&bwrap));
        record(2, time_command(&runsc));
        for (j, b) in backends.iter().enumerate() {
            if *b == Isolation::Microvm && i >= args.warmup + args.microvm_iterations {
                continue;
            }
            let (total, p) = sandbox_phases(&rt, *b, "pass", true).await;
            record(3 + j, total);
            if keep {
                phases[j].push(p);
            }
        }
    }

    let base = {
        let mut s = samples[0].clone();
        s.sort();
        percentile(&s, 0.5)
    };
    let runsc_p50 = {
        let mut s = samples[2].clone();
        s.sort();
        percentile(&s, 0.5)
    };
    println!(
        "\npython: {PYTHON}; iterations: {} (microvm {}); machine: {} cores\n",
        args.iterations,
        args.microvm_iterations,
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(0)
    );
    // Each round ran every row once, in turn: a row's time over `runsc
    // do`'s of the same round compares the two under the same load, which
    // on a shared host drifts from minute to minute.
    let runsc_rounds = samples[2].clone();
    println!("| what | n | p50 ms | p95 ms | p50 / (a) | p50 / (c) | per round / (c), median |");
    println!("|---|---:|---:|---:|---:|---:|---:|");
    for (label, s) in labels.iter().zip(samples.iter_mut()) {
        let mut paired: Vec<f64> = s
            .iter()
            .zip(&runsc_rounds)
            .map(|(d, r)| d.as_secs_f64() / r.as_secs_f64())
            .collect();
        paired.sort_by(f64::total_cmp);
        s.sort();
        let p50 = percentile(s, 0.5);
        println!(
            "| {label} | {} | {:.1} | {:.1} | {:.2}x | {:.2}x | {:.2}x |",
            s.len(),
            ms(p50),
            ms(percentile(s, 0.95)),
            p50.as_secs_f64() / base.as_secs_f64(),
            p50.as_secs_f64() / runsc_p50.as_secs_f64(),
            paired.get(paired.len() / 2).copied().unwrap_or(f64::NAN),
        );
    }

    println!("\nWhere a fresh sandbox's time goes (p50 of each phase, ms)\n");
    println!("| backend | create | exec python3 -c pass | destroy | the exec again, warm (not in the total) |");
    println!("|---|---:|---:|---:|---:|");
    for (b, p) in backends.iter().zip(&phases) {
        let p50 = |f: fn(&Phases) -> Duration| {
            let mut v: Vec<Duration> = p.iter().map(f).collect();
            v.sort();
            ms(percentile(&v, 0.5))
        };
        println!(
            "| {b} | {:.1} | {:.1} | {:.1} | {:.1} |",
            p50(|p| p.create),
            p50(|p| p.exec),
            p50(|p| p.destroy),
            p50(|p| p.again)
        );
    }

    if args.programs == 0 {
        return;
    }
    println!(
        "\nThroughput: {} short programs (python3: sha256 of a 100 KiB JSON document), two at a time\n",
        args.programs
    );
    println!("| what | programs/s |");
    println!("|---|---:|");
    let n = args.programs;
    let prog = strings(&[PYTHON, "-c", PROGRAM]);
    let p = prog.clone();
    let rate = throughput(n, move || command_async(p.clone())).await;
    println!("| bare python3 | {rate:.1} |");
    let mut r = strings(&["runsc", "--network=none", "do"]);
    r.extend(prog.clone());
    let rate = throughput(n, move || command_async(r.clone())).await;
    println!("| runsc do python3 | {rate:.1} |");
    for b in backends {
        let n = if b == Isolation::Microvm { n.min(4) } else { n };
        let rt = rt.clone();
        let rate = throughput(n, move || {
            let rt = rt.clone();
            async move { sandbox_run(&rt, b, PROGRAM).await }
        })
        .await;
        println!("| runcell {b}: a fresh sandbox per program (n = {n}) | {rate:.1} |");
    }
}
