//! Density: many idle sandboxes in one daemon. Creates `--sandboxes` (500)
//! `host` sandboxes through the HTTP API and leaves them idle, then reports
//! the memory each one costs (what its cgroup is charged, processes and
//! kernel memory, and its processes' proportional set size), the daemon's
//! RSS at 0, N and again 0 live sandboxes, the host's used memory and slab
//! growth per sandbox, and create latency (create + delete beside 1, beside
//! N, and again beside 1 live sandboxes, the pool refilled before each, as
//! an idle daemon's is). Then `--churn` rounds of N sandboxes created, each
//! running `true`, and all deleted, with the daemon's RSS and anonymous
//! RSS after each: flat if nothing is kept per sandbox.
//!
//! Run with `sudo ./scripts/bench.sh --density [--sandboxes N]`.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use clap::Parser;
use reqwest::Method;
use runcell_testkit::bench::{ms, percentile};
use runcell_testkit::{free_port, Daemon};
use serde_json::{json, Value};

#[derive(Debug, Parser)]
#[command(about = "Memory and create latency with many idle sandboxes")]
struct Args {
    /// Idle sandboxes to create.
    #[arg(long, default_value_t = 500)]
    sandboxes: usize,
    /// Create latency samples at 1 and at N live sandboxes.
    #[arg(long, default_value_t = 30)]
    samples: usize,
    /// Rounds of N sandboxes created, used and deleted after the rest.
    #[arg(long, default_value_t = 5)]
    churn: usize,
}

/// A `key value` field of a /proc file, in KiB (VmRSS, Pss, MemAvailable).
fn kib(path: &Path, key: &str) -> Option<u64> {
    let text = std::fs::read_to_string(path).ok()?;
    text.lines().find_map(|l| {
        let rest = l.strip_prefix(key)?.strip_prefix(':')?;
        rest.split_whitespace().next()?.parse().ok()
    })
}

fn read_u64(path: &Path) -> Option<u64> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// Memory in use host-wide (MemTotal - MemAvailable) and unreclaimable
/// slab, in KiB.
fn host_used() -> (u64, u64) {
    let m = Path::new("/proc/meminfo");
    let used = kib(m, "MemTotal")
        .unwrap_or(0)
        .saturating_sub(kib(m, "MemAvailable").unwrap_or(0));
    (used, kib(m, "SUnreclaim").unwrap_or(0))
}

/// What one sandbox's memory cgroup is charged (bytes), kernel memory
/// (bytes; included in the first on cgroup v1) and its processes' PSS (KiB).
fn sandbox_memory(id: &str) -> Option<(u64, u64, u64)> {
    let v1 = PathBuf::from("/sys/fs/cgroup/memory/runcell").join(id);
    let (usage, kmem, procs) = if v1.is_dir() {
        (
            read_u64(&v1.join("memory.usage_in_bytes"))?,
            read_u64(&v1.join("memory.kmem.usage_in_bytes")).unwrap_or(0),
            v1.join("cgroup.procs"),
        )
    } else {
        let v2 = PathBuf::from("/sys/fs/cgroup/runcell").join(id);
        let stat = v2.join("memory.stat");
        let kernel = std::fs::read_to_string(&stat).ok().and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("kernel ")?.trim().parse().ok())
        });
        (
            read_u64(&v2.join("memory.current"))?,
            kernel.unwrap_or(0),
            v2.join("cgroup.procs"),
        )
    };
    let pss = std::fs::read_to_string(procs)
        .unwrap_or_default()
        .lines()
        .filter_map(|p| {
            kib(
                &PathBuf::from(format!("/proc/{}/smaps_rollup", p.trim())),
                "Pss",
            )
        })
        .sum();
    Some((usage, kmem, pss))
}

async fn create(daemon: &Daemon, http: &reqwest::Client) -> String {
    let r = daemon
        .request(http, Method::POST, "/v1/sandboxes")
        .json(&json!({"template": "host", "ttl_seconds": 3600}))
        .send()
        .await
        .expect("create request");
    assert_eq!(
        r.status(),
        201,
        "create: {}",
        r.text().await.unwrap_or_default()
    );
    r.json::<Value>().await.expect("create body")["id"]
        .as_str()
        .expect("an id")
        .to_string()
}

async fn delete(daemon: &Daemon, http: &reqwest::Client, id: &str) {
    let r = daemon
        .request(http, Method::DELETE, &format!("/v1/sandboxes/{id}"))
        .send()
        .await
        .expect("delete request");
    assert_eq!(r.status(), 204, "delete {id}");
}

/// Waits until the daemon is at rest after a wave of deletes: no teardown
/// in flight (`runcell_sandbox_teardowns` on `/metrics`), its thread count
/// unchanged for 11 s (the runtime's blocking threads end 10 s after their
/// last task), then 1.5 s more, in which its reaper (every 500 ms) sees it
/// quiet and gives free memory back. Reading RSS sooner reads the burst.
async fn settle(daemon: &Daemon, http: &reqwest::Client) {
    let until = Instant::now() + Duration::from_secs(120);
    loop {
        let text = http
            .get(format!("{}/metrics", daemon.url))
            .send()
            .await
            .expect("metrics request")
            .text()
            .await
            .expect("metrics body");
        let busy = text
            .lines()
            .find_map(|l| l.strip_prefix("runcell_sandbox_teardowns "))
            .and_then(|v| v.trim().parse::<f64>().ok())
            .expect("runcell_sandbox_teardowns on /metrics");
        if busy == 0.0 {
            break;
        }
        assert!(
            Instant::now() < until,
            "teardowns still running after 120 s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let stat = PathBuf::from(format!("/proc/{}/stat", daemon.child.id()));
    let threads = || {
        let text = std::fs::read_to_string(&stat).expect("the daemon's stat");
        let (_, rest) = text.rsplit_once(')').expect("a stat line");
        rest.split_whitespace().nth(17).map(str::to_string)
    };
    let (mut last, mut since) = (threads(), Instant::now());
    while since.elapsed() < Duration::from_secs(11) {
        assert!(
            Instant::now() < until,
            "the daemon's threads did not settle"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
        let now = threads();
        if now != last {
            (last, since) = (now, Instant::now());
        }
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
}

/// Create latencies (create alone, then a delete off the clock), the pool
/// refilled before each.
async fn create_latency(daemon: &Daemon, http: &reqwest::Client, n: usize) -> Vec<Duration> {
    let mut out = Vec::new();
    for _ in 0..n {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let t = Instant::now();
        let id = create(daemon, http).await;
        out.push(t.elapsed());
        delete(daemon, http, &id).await;
    }
    out.sort();
    out
}

fn mib(kib: f64) -> f64 {
    kib / 1024.0
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    let dir = std::env::current_exe()
        .ok()
        .and_then(|p| p.parent().map(PathBuf::from))
        .expect("own directory");
    let runcell = dir.join("runcell");
    assert!(runcell.is_file(), "{} is missing", runcell.display());
    let data = PathBuf::from(format!("/run/runcell-bench/density-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&data);
    let max = (args.sandboxes + 50).to_string();
    let mut daemon = Daemon::spawn(
        &runcell,
        &data,
        free_port(),
        [
            "--standby",
            "2",
            "--max-sandboxes",
            max.as_str(),
            "--auto-build=false",
        ],
    );
    let http = reqwest::Client::new();
    let status = PathBuf::from(format!("/proc/{}/status", daemon.child.id()));
    // Warm the daemon (its pool, its allocator) before the first reading.
    let warm = create(&daemon, &http).await;
    delete(&daemon, &http, &warm).await;
    let at_1 = create_latency(&daemon, &http, args.samples).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let rss_0 = kib(&status, "VmRSS").unwrap_or(0);
    let host_0 = host_used();

    let started = Instant::now();
    let mut ids = Vec::with_capacity(args.sandboxes);
    for i in 0..args.sandboxes {
        ids.push(create(&daemon, &http).await);
        if (i + 1) % 100 == 0 {
            eprintln!(
                "{} idle sandboxes ({:.1} s)",
                i + 1,
                started.elapsed().as_secs_f64()
            );
        }
    }
    let fill = started.elapsed();
    // Let page-ins and the pool settle before reading memory.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let rss_n = kib(&status, "VmRSS").unwrap_or(0);
    let host_n = host_used();
    let per: Vec<(u64, u64, u64)> = ids.iter().filter_map(|id| sandbox_memory(id)).collect();
    assert_eq!(per.len(), ids.len(), "every sandbox has a memory cgroup");
    let n = per.len() as f64;
    let usage = per.iter().map(|p| p.0 as f64).sum::<f64>() / n / 1024.0;
    let kmem = per.iter().map(|p| p.1 as f64).sum::<f64>() / n / 1024.0;
    let pss = per.iter().map(|p| p.2 as f64).sum::<f64>() / n;
    let at_n = create_latency(&daemon, &http, args.samples).await;
    // The last one still answers.
    let last = ids.last().expect("at least one sandbox");
    let (code, body) = daemon.exec(last, "/usr/bin/python3 -c 'print(6*7)'").await;
    assert_eq!(code, 200, "exec in the last idle sandbox: {body}");
    assert_eq!(body["stdout"].as_str().map(str::trim), Some("42"), "{body}");

    for id in &ids {
        delete(&daemon, &http, id).await;
    }
    settle(&daemon, &http).await;
    let rss_after = kib(&status, "VmRSS").unwrap_or(0);
    let anon_after = kib(&status, "RssAnon").unwrap_or(0);
    // Again beside 1: drift on a shared host shows as a gap between the two.
    let at_1_again = create_latency(&daemon, &http, args.samples).await;
    let mut rounds = Vec::new();
    for _ in 0..args.churn {
        let mut ids = Vec::with_capacity(args.sandboxes);
        for _ in 0..args.sandboxes {
            let id = create(&daemon, &http).await;
            let (code, body) = daemon.exec(&id, "true").await;
            assert_eq!(code, 200, "exec: {body}");
            ids.push(id);
        }
        for id in &ids {
            delete(&daemon, &http, id).await;
        }
        settle(&daemon, &http).await;
        rounds.push((
            kib(&status, "VmRSS").unwrap_or(0),
            kib(&status, "RssAnon").unwrap_or(0),
        ));
    }
    // SIGTERM: the daemon removes its standby pool (SIGKILL would leave
    // the pool's cgroups behind).
    daemon.stop();
    let _ = std::fs::remove_dir_all(&data);

    println!(
        "{} idle `host` sandboxes in one daemon, created in {:.1} s ({:.1} ms each)\n",
        ids.len(),
        fill.as_secs_f64(),
        ms(fill) / n
    );
    println!("| memory per idle sandbox | KiB |");
    println!("|---|---:|");
    println!("| charged to its memory cgroup (processes + kernel) | {usage:.0} |");
    println!("| of which kernel memory | {kmem:.0} |");
    println!("| its processes' PSS | {pss:.0} |");
    println!(
        "| host memory in use, growth / N (noisy: shared host) | {:.0} |",
        host_n.0.saturating_sub(host_0.0) as f64 / n
    );
    println!(
        "| host unreclaimable slab, growth / N | {:.0} |",
        host_n.1.saturating_sub(host_0.1) as f64 / n
    );
    println!(
        "\n| daemon RSS | MiB |\n|---|---:|\n| 0 live | {:.1} |\n| {} live | {:.1} |\n| 0 live again | {:.1} (anonymous {:.1}) |",
        mib(rss_0 as f64),
        ids.len(),
        mib(rss_n as f64),
        mib(rss_after as f64),
        mib(anon_after as f64)
    );
    for (i, (rss, anon)) in rounds.iter().enumerate() {
        println!(
            "| after churn round {} ({} created, ran `true`, deleted) | {:.1} (anonymous {:.1}) |",
            i + 1,
            ids.len(),
            mib(*rss as f64),
            mib(*anon as f64)
        );
    }
    println!("\n| create (API) | p50 ms | p95 ms |\n|---|---:|---:|");
    for (label, v) in [
        ("beside 1 live".to_string(), &at_1),
        (format!("beside {} live", ids.len()), &at_n),
        ("beside 1 live, after".to_string(), &at_1_again),
    ] {
        println!(
            "| {label} | {:.1} | {:.1} |",
            ms(percentile(v, 0.5)),
            ms(percentile(v, 0.95))
        );
    }
}
