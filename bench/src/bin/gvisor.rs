//! The gVisor backend's start-up cost beside bare runsc, interleaved:
//!
//! (a) `runsc --network=none do /usr/bin/python3 -c pass`
//! (b) runcell through `GvisorBackend`: create from `host` + exec
//!     `/usr/bin/python3 -c pass` + destroy (library, tied to the process)
//! (c) the same through the jail backend, for scale
//!
//! Needs root, runsc and the release agent (`cargo build --release -p
//! runcell-agent`); run as `sudo target/release/runcell-bench-gvisor`.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use runcell_core::backend::{probe, GvisorBackend};
use runcell_core::{find_agent, Runtime, RuntimeConfig, Sandbox, SandboxOptions};

const PYTHON: &str = "/usr/bin/python3";

#[derive(Debug, Parser)]
#[command(about = "gVisor backend start-up benchmark")]
struct Args {
    /// Measured iterations per row.
    #[arg(long, default_value_t = 15)]
    iterations: usize,
    /// Unmeasured warm-up iterations per row.
    #[arg(long, default_value_t = 2)]
    warmup: usize,
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

async fn one(rt: &Runtime) -> Duration {
    let t0 = Instant::now();
    let sb: Sandbox = rt
        .create(SandboxOptions::default())
        .await
        .expect("sandbox creation");
    let r = sb
        .exec(
            runcell_protocol::Command::Argv(vec![PYTHON.into(), "-c".into(), "pass".into()]),
            &Default::default(),
        )
        .await
        .expect("exec");
    assert_eq!(r.outcome.exit.exit_code, Some(0), "{r:?}");
    sb.destroy().await.expect("destroy");
    t0.elapsed()
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
    let info = probe(None).unwrap_or_else(|why| panic!("gVisor is not usable here: {why}"));
    let agent = find_agent().expect("build the release agent first");
    let gv_state = PathBuf::from("/run/runcell-bench/gvisor");
    let backend = GvisorBackend::new(
        None,
        agent.clone(),
        gv_state.clone(),
        "runcell-bench-gvisor".into(),
        None,
    );
    let gvisor = Runtime::with_backend(
        RuntimeConfig {
            state_dir: gv_state,
            cgroup_parent: "runcell-bench-gvisor".into(),
            agent: Some(agent.clone()),
            ..RuntimeConfig::default()
        },
        Arc::new(backend),
    );
    let jail = Runtime::new(RuntimeConfig {
        state_dir: PathBuf::from("/run/runcell-bench/jail"),
        cgroup_parent: "runcell-bench-jail".into(),
        agent: Some(agent),
        ..RuntimeConfig::default()
    })
    .expect("jail runtime");
    let mut rows: [(&str, Vec<Duration>); 3] = [
        ("(a) runsc --network=none do python3 -c pass", Vec::new()),
        (
            "(b) runcell gvisor: create + python3 -c pass + destroy",
            Vec::new(),
        ),
        (
            "(c) runcell jail: create + python3 -c pass + destroy",
            Vec::new(),
        ),
    ];
    for i in 0..args.warmup + args.iterations {
        let t0 = Instant::now();
        let status = Command::new(&info.runsc)
            .args(["--network=none", "do", PYTHON, "-c", "pass"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .expect("runsc do");
        let a = t0.elapsed();
        assert!(status.success(), "runsc do failed: {status}");
        let b = one(&gvisor).await;
        let c = one(&jail).await;
        if i >= args.warmup {
            rows[0].1.push(a);
            rows[1].1.push(b);
            rows[2].1.push(c);
        }
    }
    println!(
        "runsc {} on {}; {} iterations (after {} warm-up), interleaved",
        info.version,
        info.platform.as_str(),
        args.iterations,
        args.warmup
    );
    for (label, mut s) in rows {
        s.sort();
        println!(
            "{label:<58} median {:>7.1} ms  min {:>7.1} ms  max {:>7.1} ms",
            ms(s[s.len() / 2]),
            ms(s[0]),
            ms(s[s.len() - 1])
        );
    }
}
