//! The egress path's cost, in one run: a 10 MiB download and a small
//! request from a local HTTP server (on the host's loopback, opened to the
//! sandbox with the operator's exception, `127.0.0.1:PORT`), by curl inside
//! a sandbox through its proxy (agent listener, egress socket, the host's
//! proxy) beside the same curl on the host directly. Interleaved.
//!
//! Run with `sudo ./scripts/bench.sh --egress`.

use std::io::{Read, Write};
use std::net::TcpListener;
use std::process::Command;
use std::time::Duration;

use clap::Parser;
use runcell_core::{RunOptions, Runtime, RuntimeConfig, SandboxOptions};
use runcell_egress::{EgressConfig, NetworkPolicy};
use runcell_protocol::Command as Cmd;

#[derive(Debug, Parser)]
#[command(
    about = "Egress proxy benchmark: 10 MiB and small downloads, through the proxy and direct"
)]
struct Args {
    /// Downloads per row.
    #[arg(long, default_value_t = 30)]
    iterations: usize,
}

const BIG: usize = 10 << 20;

/// Serves `/big` (10 MiB) and `/small` (2 bytes), one request per connection.
fn serve() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = l.local_addr().expect("addr").port();
    let body = std::sync::Arc::new(vec![b'x'; BIG]);
    std::thread::spawn(move || {
        for c in l.incoming() {
            let Ok(mut c) = c else { continue };
            let _ = c.set_nodelay(true);
            let body = body.clone();
            std::thread::spawn(move || {
                let mut head = Vec::new();
                let mut b = [0u8; 1024];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    match c.read(&mut b) {
                        Ok(0) | Err(_) => return,
                        Ok(n) => head.extend_from_slice(&b[..n]),
                    }
                }
                let big = head.starts_with(b"GET /big");
                let payload: &[u8] = if big { &body[..] } else { b"ok" };
                let _ = c.write_all(
                    format!(
                        "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                        payload.len()
                    )
                    .as_bytes(),
                );
                let _ = c.write_all(payload);
            });
        }
    });
    port
}

/// curl's own timings: time to first byte, total, bytes/s.
const FORMAT: &str = "%{time_starttransfer} %{time_total} %{speed_download}\n";

fn parse(line: &str) -> (f64, f64, f64) {
    let v: Vec<f64> = line
        .split_whitespace()
        .map(|x| x.parse().expect("curl timing"))
        .collect();
    (v[0] * 1000.0, v[1] * 1000.0, v[2])
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).expect("no NaN"));
    v[runcell_testkit::percentile_index(v.len(), p)]
}

#[derive(Default)]
struct Row {
    ttfb: Vec<f64>,
    total: Vec<f64>,
    speed: Vec<f64>,
}

impl Row {
    fn push(&mut self, (a, b, c): (f64, f64, f64)) {
        self.ttfb.push(a);
        self.total.push(b);
        self.speed.push(c);
    }
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    let port = serve();
    let exception = format!("127.0.0.1:{port}").parse().expect("exception");
    let rt = Runtime::new(RuntimeConfig {
        state_dir: "/run/runcell-bench/egress".into(),
        cgroup_parent: "runcell-bench-egress".into(),
        standby: 0,
        ..RuntimeConfig::default()
    })
    .expect("runtime")
    .with_egress(EgressConfig {
        allow_private: vec![exception],
        ..Default::default()
    });
    let sb = rt
        .create(SandboxOptions {
            tied_to_process: true,
            network: Some(NetworkPolicy::open()),
            ..SandboxOptions::default()
        })
        .await
        .expect("create");
    let url = |path: &str| format!("http://127.0.0.1:{port}/{path}");
    let (mut direct_big, mut proxy_big, mut direct_small, mut proxy_small) = (
        Row::default(),
        Row::default(),
        Row::default(),
        Row::default(),
    );
    let opts = RunOptions {
        timeout: Some(Duration::from_secs(60)),
        ..RunOptions::default()
    };
    for i in 0..args.iterations + 2 {
        for (path, direct, proxied) in [
            ("big", &mut direct_big, &mut proxy_big),
            ("small", &mut direct_small, &mut proxy_small),
        ] {
            let out = Command::new("curl")
                .args(["-sS", "-o", "/dev/null", "--noproxy", "*", "-w", FORMAT])
                .arg(url(path))
                .output()
                .expect("curl on the host");
            let host = String::from_utf8_lossy(&out.stdout).to_string();
            let cmd = format!(
                "env -u NO_PROXY -u no_proxy curl -sS -o /dev/null -x http://127.0.0.1:3128 -w '{FORMAT}' {}",
                url(path)
            );
            let r = sb
                .exec(Cmd::Shell(cmd), &opts)
                .await
                .expect("curl in the sandbox");
            let inside = String::from_utf8_lossy(&r.stdout).to_string();
            assert!(
                r.outcome.status() == 0,
                "curl in the sandbox failed: {}",
                String::from_utf8_lossy(&r.stderr)
            );
            // The first two rounds warm up.
            if i >= 2 {
                direct.push(parse(host.trim()));
                proxied.push(parse(inside.trim()));
            }
        }
    }
    let report = sb.network().expect("egress report");
    sb.destroy().await.expect("destroy");

    println!(
        "{} iterations, curl inside the sandbox (through the proxy) vs on the host (direct)\n",
        args.iterations
    );
    println!("| what | p50 ms | p95 ms | p50 MiB/s |");
    println!("|---|---:|---:|---:|");
    let mib = |v: &mut Vec<f64>| pct(v, 0.5) / (1 << 20) as f64;
    for (name, row) in [
        ("10 MiB, direct", &mut direct_big),
        ("10 MiB, through the egress proxy", &mut proxy_big),
    ] {
        println!(
            "| {name} (total) | {:.1} | {:.1} | {:.0} |",
            pct(&mut row.total, 0.5),
            pct(&mut row.total, 0.95),
            mib(&mut row.speed)
        );
    }
    for (name, row) in [
        ("small request, direct", &mut direct_small),
        ("small request, through the egress proxy", &mut proxy_small),
    ] {
        println!(
            "| {name} (time to first byte) | {:.2} | {:.2} | - |",
            pct(&mut row.ttfb, 0.5),
            pct(&mut row.ttfb, 0.95)
        );
    }
    println!(
        "\nadded latency (small request, p50): {:.2} ms; throughput ratio (10 MiB, p50): {:.2}x",
        pct(&mut proxy_small.ttfb, 0.5) - pct(&mut direct_small.ttfb, 0.5),
        pct(&mut proxy_big.speed, 0.5) / pct(&mut direct_big.speed, 0.5)
    );
    println!(
        "proxy counters: {} connections, {} bytes in, {} bytes out",
        report.connections_allowed, report.bytes_in, report.bytes_out
    );
}
