//! Cluster mode's forwarding hop, measured: creates per second and exec
//! latency through a node that forwards to the owner versus straight to the
//! owner, with 1, 2 and 3 `runcell serve --cluster` nodes on this machine
//! (one etcd member on loopback), and the etcd requests each create costs.
//! All nodes share this machine's cores, so the numbers are the hop's cost,
//! not a cluster's capacity.
//!
//! Run with `sudo ./scripts/bench.sh --cluster` (needs etcd: scripts/install-deps.sh).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use clap::Parser;
use reqwest::Method;
use runcell_testkit::{free_port, Daemon};
use serde_json::{json, Value};

#[derive(Debug, Parser)]
#[command(about = "Cluster forwarding benchmark")]
struct Args {
    /// Creates per row (each deleted after).
    #[arg(long, default_value_t = 20)]
    creates: usize,
    /// Execs per row.
    #[arg(long, default_value_t = 100)]
    execs: usize,
    /// Largest cluster measured (1 to this many nodes).
    #[arg(long, default_value_t = 3)]
    nodes: usize,
}

fn pct(sorted: &[Duration], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    sorted[runcell_testkit::percentile_index(sorted.len(), p)].as_secs_f64() * 1000.0
}

struct Etcd {
    child: Child,
    dir: PathBuf,
    port: u16,
}

impl Etcd {
    fn start(dir: &Path) -> Etcd {
        let port = free_port();
        let peer = free_port();
        let child = Command::new("etcd")
            .args([
                "--name",
                "bench",
                "--data-dir",
                &dir.to_string_lossy(),
                "--listen-client-urls",
                &format!("http://127.0.0.1:{port}"),
                "--advertise-client-urls",
                &format!("http://127.0.0.1:{port}"),
                "--listen-peer-urls",
                &format!("http://127.0.0.1:{peer}"),
                "--initial-advertise-peer-urls",
                &format!("http://127.0.0.1:{peer}"),
                "--initial-cluster",
                &format!("bench=http://127.0.0.1:{peer}"),
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!("could not start etcd ({e}); scripts/install-deps.sh installs etcd-server")
            });
        let until = Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < until, "etcd did not listen within 20 s");
            std::thread::sleep(Duration::from_millis(50));
        }
        Etcd {
            child,
            dir: dir.to_path_buf(),
            port,
        }
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn node(bin: &Path, etcd: &Etcd, name: &str, run: u32) -> Daemon {
    let data = PathBuf::from(format!("/run/runcell-bench-cluster-{run}-{name}"));
    let _ = std::fs::remove_dir_all(&data);
    Daemon::spawn(
        bin,
        &data,
        free_port(),
        [
            "--cluster",
            &format!("etcd://127.0.0.1:{}", etcd.port),
            "--node-name",
            name,
            "--cgroup-parent",
            &format!("runcell-bench-{run}-{name}"),
            "--auto-build=false",
            "--standby",
            "2",
            "--warm-pool",
            "code-interpreter=0",
        ],
    )
    .remove_data_on_drop()
}

async fn cluster_ops(http: &reqwest::Client, d: &Daemon) -> (u64, u64) {
    let (r, _) = cluster_counts(http, d).await;
    r
}

/// (request-path (reads, writes), background reads + writes) of one node.
async fn cluster_counts(http: &reqwest::Client, d: &Daemon) -> ((u64, u64), u64) {
    let v: Value = d
        .request(http, Method::GET, "/v1/cluster")
        .send()
        .await
        .expect("GET /v1/cluster")
        .json()
        .await
        .expect("cluster view");
    let r = &v["etcd_ops"]["requests"];
    let b = &v["etcd_ops"]["background"];
    (
        (
            r["reads"].as_u64().unwrap_or(0),
            r["writes"].as_u64().unwrap_or(0),
        ),
        b["reads"].as_u64().unwrap_or(0) + b["writes"].as_u64().unwrap_or(0),
    )
}

/// `creates` sandboxes made through `via`, placed on `owner`, one after
/// another; returns creates per second (creates only) and the ids.
async fn creates(
    http: &reqwest::Client,
    via: &Daemon,
    owner: &str,
    key: &str,
    n: usize,
) -> (f64, Vec<String>) {
    let mut ids = Vec::new();
    let t = Instant::now();
    for _ in 0..n {
        let r = http
            .post(format!("{}/v1/sandboxes", via.url))
            .bearer_auth(key)
            .json(&json!({"template": "host", "node": owner}))
            .send()
            .await
            .expect("create");
        assert_eq!(r.status(), 201, "create through {} on {owner}", via.url);
        let v: Value = r.json().await.expect("create answer");
        ids.push(v["id"].as_str().unwrap_or_default().to_string());
    }
    (n as f64 / t.elapsed().as_secs_f64(), ids)
}

async fn execs(
    http: &reqwest::Client,
    via: &Daemon,
    key: &str,
    id: &str,
    n: usize,
) -> Vec<Duration> {
    let mut times = Vec::new();
    for _ in 0..n {
        let t = Instant::now();
        let r = http
            .post(format!("{}/v1/sandboxes/{id}/exec", via.url))
            .bearer_auth(key)
            .json(&json!({"cmd": "true"}))
            .send()
            .await
            .expect("exec");
        assert_eq!(r.status(), 200);
        let _: Value = r.json().await.expect("exec answer");
        times.push(t.elapsed());
    }
    times.sort();
    times
}

async fn delete_all(http: &reqwest::Client, via: &Daemon, key: &str, ids: &[String]) {
    for id in ids {
        let _ = http
            .delete(format!("{}/v1/sandboxes/{id}", via.url))
            .bearer_auth(key)
            .send()
            .await;
    }
}

/// Removes the nodes' (empty) cgroup parents, waiting up to 10 s for the
/// last sandbox teardowns.
fn remove_cgroups(run: u32, names: &[String]) {
    let Ok(controllers) = std::fs::read_dir("/sys/fs/cgroup") else {
        return;
    };
    let mut left: Vec<PathBuf> = controllers
        .flatten()
        .flat_map(|c| {
            names
                .iter()
                .map(move |n| c.path().join(format!("runcell-bench-{run}-{n}")))
        })
        .filter(|p| p.exists())
        .collect();
    let until = Instant::now() + Duration::from_secs(10);
    while !left.is_empty() && Instant::now() < until {
        left.retain(|p| std::fs::remove_dir(p).is_err() && p.exists());
        std::thread::sleep(Duration::from_millis(200));
    }
    for p in left {
        eprintln!("left behind: {}", p.display());
    }
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    let bin = std::env::current_exe()
        .expect("own path")
        .parent()
        .expect("target dir")
        .join("runcell");
    assert!(
        bin.exists(),
        "{} is missing: cargo build -p runcell-cli",
        bin.display()
    );
    let run = std::process::id();
    let http = reqwest::Client::new();
    println!(
        "| nodes | path | creates/s | exec p50 ms | exec p95 ms | etcd requests per create (reads + writes, all nodes) |"
    );
    println!("|---|---|---|---|---|---|");
    let mut background_per_node_s = Vec::new();
    for n in 1..=args.nodes.max(1) {
        let dir = std::env::temp_dir().join(format!("runcell-bench-etcd-{run}-{n}"));
        let etcd = Etcd::start(&dir);
        let names: Vec<String> = (0..n).map(|i| format!("n{i}")).collect();
        let nodes: Vec<Daemon> = names.iter().map(|nm| node(&bin, &etcd, nm, run)).collect();
        // Every node sees all the others before measuring.
        let until = Instant::now() + Duration::from_secs(20);
        loop {
            let v: Value = nodes[0]
                .request(&http, Method::GET, "/v1/cluster")
                .send()
                .await
                .expect("GET /v1/cluster")
                .json()
                .await
                .expect("cluster view");
            if v["nodes"].as_array().map_or(0, Vec::len) == n {
                break;
            }
            assert!(
                Instant::now() < until,
                "the nodes did not all register within 20 s"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let started = Instant::now();
        let mut background_before = 0;
        for d in &nodes {
            background_before += cluster_counts(&http, d).await.1;
        }
        let key = nodes[0].key.clone();
        // The owner is node 0; the forwarder, when there is one, the last.
        let owner = &nodes[0];
        let mut paths: Vec<(&str, &Daemon)> = vec![("straight to the owner", owner)];
        if n > 1 {
            paths.push(("through a forwarding node", &nodes[n - 1]));
        }
        for (label, via) in paths {
            let before: Vec<(u64, u64)> = {
                let mut v = Vec::new();
                for d in &nodes {
                    v.push(cluster_ops(&http, d).await);
                }
                v
            };
            let (rate, ids) = creates(&http, via, &names[0], &key, args.creates).await;
            let mut reads = 0;
            let mut writes = 0;
            for (d, b) in nodes.iter().zip(&before) {
                let a = cluster_ops(&http, d).await;
                reads += a.0 - b.0;
                writes += a.1 - b.1;
            }
            let per = |x: u64| x as f64 / args.creates as f64;
            let times = execs(&http, via, &key, &ids[0], args.execs).await;
            println!(
                "| {n} | {label} | {rate:.1} | {:.2} | {:.2} | {:.2} + {:.2} |",
                pct(&times, 0.5),
                pct(&times, 0.95),
                per(reads),
                per(writes)
            );
            delete_all(&http, via, &key, &ids).await;
        }
        let mut background = 0;
        for d in &nodes {
            background += cluster_counts(&http, d).await.1;
        }
        background_per_node_s.push((
            n,
            (background - background_before) as f64 / n as f64 / started.elapsed().as_secs_f64(),
        ));
        drop(nodes);
        drop(etcd);
        remove_cgroups(run, &names);
    }
    println!();
    for (n, rate) in background_per_node_s {
        println!(
            "{n} node(s): the once-a-second round (lease, node record, keys, changed sandboxes, node list) made {rate:.1} etcd requests per node per second."
        );
    }
}
