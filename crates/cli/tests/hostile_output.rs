//! Hostile output: floods of short lines and of binary bytes, a stream
//! reader that stops reading, and floods that must not slow other tenants.
//! The daemon's memory is read from /proc/<pid>/status (VmHWM, VmRSS), its
//! CPU time from /proc/<pid>/stat. Needs root.

mod common;

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use common::*;
use reqwest::Method;
use serde_json::{json, Value};

/// A field of /proc/<pid>/status in KiB (VmHWM, VmRSS).
fn status_kib(pid: u32, field: &str) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    s.lines()
        .find_map(|l| l.strip_prefix(&format!("{field}:")))
        .unwrap_or_else(|| panic!("no {field} in /proc/{pid}/status"))
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .unwrap()
}

/// User + system CPU time of a process.
fn cpu_time(pid: u32) -> Duration {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let rest = &s[s.rfind(')').unwrap() + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // Fields 14 and 15 of stat (utime, stime), counted after the command.
    let ticks: u64 = f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap();
    let hz = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)
        .unwrap()
        .expect("the clock tick rate");
    let hz = u64::try_from(hz).expect("a positive clock tick rate");
    Duration::from_millis(ticks * 1000 / hz)
}

async fn exec_json(d: &Daemon, id: &str, cmd: &str) -> Value {
    let (status, v) = d
        .exec_json(id, json!({"cmd": cmd, "timeout_seconds": 120}))
        .await;
    assert_eq!(
        status,
        200,
        "{cmd}: {}",
        &v.to_string()[..v.to_string().len().min(500)]
    );
    v
}

const MB: u64 = 1 << 20;

#[tokio::test(flavor = "multi_thread")]
async fn short_line_floods_are_exact_linear_and_bounded() {
    let d = Daemon::start(&data_dir("hostile-lines"), free_port(), &[]);
    let pid = d.child.id();
    let id = d
        .create(json!({"limits": {"output_bytes": 20_000_000}}))
        .await;
    exec_json(&d, &id, "true").await;
    let base = status_kib(pid, "VmRSS");
    for n in [65_536usize, 262_144, 10_000_000] {
        let cpu = cpu_time(pid);
        let started = Instant::now();
        let v = exec_json(&d, &id, &format!("yes | head -c {n}")).await;
        let (took, cpu) = (started.elapsed(), cpu_time(pid) - cpu);
        let out = v["stdout"].as_str().unwrap();
        assert_eq!(
            out.len(),
            n,
            "{n} bytes of `yes` came back as {}",
            out.len()
        );
        assert!(out
            .bytes()
            .enumerate()
            .all(|(i, b)| b == if i % 2 == 0 { b'y' } else { b'\n' }));
        assert_eq!(v["stdout_bytes"], n as u64);
        assert_eq!(v["stdout_truncated"], false);
        let grew = status_kib(pid, "VmHWM").saturating_sub(base) / 1024;
        eprintln!("{n} bytes: {took:?} wall, {cpu:?} daemon CPU, daemon peak +{grew} MB");
        // A 10 MB answer is a 10 MB JSON string (plus what serializing it
        // takes), never hundreds of MB of line bookkeeping.
        assert!(
            grew < 100,
            "{n} bytes of short lines grew the daemon by {grew} MB"
        );
        // Linear work: a debug build handles 10 MB well within 10 s of CPU.
        assert!(
            cpu < Duration::from_secs(10),
            "{n} bytes took {cpu:?} of daemon CPU"
        );
    }
    // The log keeps a bounded tail of it, as lines.
    let log = d.text(&format!("/v1/sandboxes/{id}/logs")).await;
    assert!(log.len() <= 256 << 10 && log.len() > 1000, "{}", log.len());
    assert!(log.lines().rev().skip(1).take(1000).all(|l| l == "y"));
    d.delete_all().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn binary_floods_come_back_exactly_or_say_what_was_cut() {
    let d = Daemon::start(&data_dir("hostile-binary"), free_port(), &[]);
    let pid = d.child.id();
    let cap = 4_000_000usize;
    let id = d.create(json!({"limits": {"output_bytes": cap}})).await;
    exec_json(&d, &id, "head -c 12000000 /dev/urandom > /tmp/b").await;
    let file = d
        .req(Method::GET, &format!("/v1/sandboxes/{id}/fs?path=/tmp/b"))
        .send()
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap();
    assert_eq!(file.len(), 12_000_000);
    let base = status_kib(pid, "VmRSS");
    for n in [100_000usize, 3_000_000, 12_000_000] {
        let v = exec_json(
            &d,
            &id,
            &format!("head -c {n} /tmp/b; head -c {n} /tmp/b >&2"),
        )
        .await;
        for s in ["stdout", "stderr"] {
            assert_eq!(v[format!("{s}_bytes")], n as u64, "{s} of {n}");
            let text = v[s].as_str().unwrap();
            let kept = n.min(cap);
            let want = String::from_utf8_lossy(&file[..kept]);
            if n > cap {
                assert_eq!(v[format!("{s}_truncated")], true);
                assert!(
                    text.starts_with(&*want),
                    "{s} of {n} is not its first {cap} bytes"
                );
                assert!(text[want.len()..].contains(&format!("wrote {n} bytes")));
            } else {
                assert_eq!(v[format!("{s}_truncated")], false);
                assert!(text == want, "{s} of {n} differs from what was written");
            }
        }
        let grew = status_kib(pid, "VmHWM").saturating_sub(base) / 1024;
        eprintln!("{n} binary bytes on each stream: daemon peak +{grew} MB");
        assert!(grew < 100, "{n} binary bytes grew the daemon by {grew} MB");
    }
    d.delete_all().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn output_limit_is_capped_by_the_operator() {
    let d = Daemon::start(
        &data_dir("hostile-cap"),
        free_port(),
        &["--max-output-bytes", "8M"],
    );
    for big in [json!(4_000_000_000u64), json!(8 * MB + 1)] {
        expect_error(
            d.req(Method::POST, "/v1/sandboxes")
                .json(&json!({"limits": {"output_bytes": big}})),
            400,
            "limits.output_bytes",
        )
        .await;
    }
    let id = d.create(json!({"limits": {"output_bytes": 8 * MB}})).await;
    let v = exec_json(&d, &id, "yes | head -c 9000000").await;
    assert_eq!(v["stdout_bytes"], 9_000_000);
    assert_eq!(v["stdout_truncated"], true);
    assert!(v["stdout"]
        .as_str()
        .unwrap()
        .starts_with(&"y\n".repeat(1000)));
    d.delete_all().await;
    drop(d);
    // The default maximum refuses 4 GB too.
    let d = Daemon::start(&data_dir("hostile-cap2"), free_port(), &[]);
    expect_error(
        d.req(Method::POST, "/v1/sandboxes")
            .json(&json!({"limits": {"output_bytes": 4_000_000_000u64}})),
        400,
        "limits.output_bytes",
    )
    .await;
}

/// Opens an SSE exec stream on a raw socket, so the test decides when (and
/// whether) to read.
fn open_stream(d: &Daemon, id: &str, cmd: &str) -> std::net::TcpStream {
    let body = json!({"cmd": cmd, "timeout_seconds": 300});
    open_sse(d, &format!("/v1/sandboxes/{id}/exec/stream"), &body).0
}

/// POSTs `body` to an SSE route on a raw socket and reads the answer's
/// head: the socket, and what the first read gave (head and maybe events).
fn open_sse(d: &Daemon, path: &str, body: &Value) -> (std::net::TcpStream, String) {
    let body = body.to_string();
    let mut s = std::net::TcpStream::connect(("127.0.0.1", d.port)).unwrap();
    write!(
        s,
        "POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {}\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        d.key,
        body.len()
    )
    .unwrap();
    let mut head = [0u8; 4096];
    let n = s.read(&mut head).unwrap();
    let first = String::from_utf8_lossy(&head[..n]).into_owned();
    assert!(first.starts_with("HTTP/1.1 200"), "{first}");
    (s, first)
}

/// Reads a stalled SSE stream to its end: the bytes read and the last 8 KiB.
fn read_to_end_of_stream(s: &mut std::net::TcpStream) -> (usize, String) {
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let mut tail = Vec::new();
    let mut buf = vec![0u8; 1 << 16];
    let mut total = 0usize;
    loop {
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                total += n;
                tail.extend_from_slice(&buf[..n]);
                if tail.len() > 8192 {
                    tail.drain(..tail.len() - 8192);
                }
                if String::from_utf8_lossy(&tail).contains("\r\n0\r\n\r\n") {
                    break;
                }
            }
            Err(e) => panic!("the stream did not end ({total} bytes read): {e}"),
        }
    }
    (total, String::from_utf8_lossy(&tail).into_owned())
}

/// Stops reading a stream for 20 s (longer than the daemon's stall limit)
/// while its program keeps writing: the daemon's RSS stays within 100 MB of
/// `base` (KiB) and `echo hi` in sandbox `other` answers within 3 s
/// throughout. `what` names the stream in the messages.
async fn stall_and_check(d: &Daemon, other: &str, base: u64, what: &str) {
    let pid = d.child.id();
    let until = Instant::now() + Duration::from_secs(20);
    let mut peak = 0;
    let mut slowest = Duration::ZERO;
    while Instant::now() < until {
        peak = peak.max(status_kib(pid, "VmRSS").saturating_sub(base) / 1024);
        let t = Instant::now();
        let v = exec_json(d, other, "echo hi").await;
        slowest = slowest.max(t.elapsed());
        assert_eq!(v["stdout"], "hi\n");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    eprintln!("{what}: daemon RSS +{peak} MB, another exec at most {slowest:?}");
    assert!(peak < 100, "{what} grew the daemon by {peak} MB");
    assert!(
        slowest < Duration::from_secs(3),
        "another exec took {slowest:?} beside {what}"
    );
}

/// Reading a stalled stream again gives what was buffered (under 300 MiB),
/// then the stall's error, never an exit.
fn assert_stall_ended(s: &mut std::net::TcpStream) {
    let (total, tail) = read_to_end_of_stream(s);
    assert!(tail.contains("event: error"), "{tail}");
    assert!(tail.contains("stopped reading"), "{tail}");
    assert!(!tail.contains("event: exit"), "{tail}");
    assert!(
        total < 300 << 20,
        "{total} bytes were buffered for the reader"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_stream_reader_that_stops_does_not_bloat_the_daemon() {
    let d = Daemon::start(
        &data_dir("hostile-stall"),
        free_port(),
        &["--max-output-bytes", "1G"],
    );
    let pid = d.child.id();
    let id = d
        .create(json!({"limits": {"output_bytes": 512 * MB}}))
        .await;
    exec_json(&d, &id, "true").await;
    let base = status_kib(pid, "VmRSS");
    let mut s = open_stream(&d, &id, "yes | head -c 536870912");
    // The same sandbox keeps answering other requests meanwhile.
    stall_and_check(&d, &id, base, "a stalled stream").await;
    assert_stall_ended(&mut s);
    // The exec was killed.
    let v = exec_json(&d, &id, "pgrep -x yes | wc -l").await;
    assert_eq!(v["stdout"], "0\n");
    d.delete_all().await;
}

/// The same stall on a one-shot run (`POST /v1/run`), whose sandbox exists
/// only for its stream: the daemon stays bounded, other tenants are served,
/// the stream ends with the error, and the sandbox is gone with its program.
#[tokio::test(flavor = "multi_thread")]
async fn a_one_shot_run_reader_that_stops_does_not_bloat_the_daemon_or_keep_its_sandbox() {
    let d = Daemon::start(
        &data_dir("hostile-run-stall"),
        free_port(),
        &["--max-output-bytes", "1G"],
    );
    let pid = d.child.id();
    let other = d.create(json!({})).await;
    exec_json(&d, &other, "true").await;
    let base = status_kib(pid, "VmRSS");
    let body = json!({
        "sandbox": {"limits": {"output_bytes": 512 * MB}},
        "exec": {"cmd": "yes | head -c 536870912", "timeout_seconds": 300},
    });
    let (mut s, first) = open_sse(&d, "/v1/run", &body);
    // The first event names the sandbox the run made.
    let mut seen = first;
    let whole = |seen: &str| {
        seen.split("event: sandbox\ndata: ")
            .nth(1)
            .is_some_and(|rest| rest.contains('\n'))
    };
    while !whole(&seen) {
        let mut buf = [0u8; 4096];
        let n = s.read(&mut buf).unwrap();
        assert!(n > 0, "the stream ended before its sandbox event: {seen}");
        seen.push_str(&String::from_utf8_lossy(&buf[..n]));
    }
    let data = seen
        .split("event: sandbox\ndata: ")
        .nth(1)
        .and_then(|rest| rest.split('\n').next())
        .unwrap_or_else(|| panic!("no sandbox event in {seen}"));
    let made: Value = serde_json::from_str(data).unwrap();
    let id = made["id"].as_str().expect("the sandbox's id").to_string();
    stall_and_check(&d, &other, base, "a stalled one-shot run").await;
    assert_stall_ended(&mut s);
    // The run's sandbox is gone, and says why; only the other one is live.
    let why = ended_answer(&d, &id, Duration::from_secs(10)).await;
    assert!(
        why["error"].as_str().unwrap_or("").contains("POST /v1/run"),
        "{why}"
    );
    let listed: Value = d.get("/v1/sandboxes").await;
    let ids: Vec<&str> = listed
        .as_array()
        .expect("a list")
        .iter()
        .filter_map(|s| s["id"].as_str())
        .collect();
    assert_eq!(ids, [other.as_str()], "{listed}");
    // No process is left in the run's cgroups.
    let left: Vec<String> = std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().parse::<u32>().is_ok())
        .filter(|e| std::fs::read_to_string(e.path().join("cgroup")).is_ok_and(|c| c.contains(&id)))
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    assert!(
        left.is_empty(),
        "processes of the run's sandbox are left: {left:?}"
    );
    d.delete_all().await;
}

async fn healthz(d: &Daemon) -> Duration {
    let t = Instant::now();
    let r = d.req(Method::GET, "/healthz").send().await.unwrap();
    assert_eq!(r.status(), 200);
    t.elapsed()
}

async fn small_exec(d: &Daemon, id: &str) -> Duration {
    let t = Instant::now();
    let v = exec_json(d, id, "echo ok").await;
    assert_eq!(v["stdout"], "ok\n");
    t.elapsed()
}

/// Checks an exec answer of `yes | head -c n` without parsing its JSON
/// (cheaper in a debug build): all of it, and no truncation.
fn check_flood_answer(body: &[u8], n: usize) {
    let key = br#""stdout":""#;
    let start = body
        .windows(key.len())
        .position(|w| w == key)
        .expect("an exec answer has stdout")
        + key.len();
    // `y\n` is three bytes in JSON.
    let end = start + n / 2 * 3;
    assert!(body[start..end].chunks_exact(3).all(|c| c == b"y\\n"));
    assert_eq!(body[end], b'"', "stdout is longer than {n} bytes");
    // The other fields, before or after stdout.
    let rest = [&body[..start], &body[end..]].concat();
    let rest = String::from_utf8(rest).unwrap();
    assert!(rest.contains(&format!("\"stdout_bytes\":{n},")), "{rest}");
    assert!(rest.contains("\"stdout_truncated\":false"), "{rest}");
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// How far the slow tail of `v` lies above its median (p90 - p50): the
/// machine's own scheduling noise, which the floods did not cause.
fn spread(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() * 9 / 10].saturating_sub(v[v.len() / 2])
}

#[tokio::test(flavor = "multi_thread")]
async fn concurrent_floods_do_not_slow_other_tenants() {
    let d = std::sync::Arc::new(Daemon::start(
        &data_dir("hostile-tenants"),
        free_port(),
        &["--standby", "0"],
    ));
    let quiet = d.create(json!({})).await;
    small_exec(&d, &quiet).await;
    let mut idle_h = Vec::new();
    let mut idle_e = Vec::new();
    for _ in 0..21 {
        idle_h.push(healthz(&d).await);
        idle_e.push(small_exec(&d, &quiet).await);
    }
    // Three sandboxes flood short lines (256 KiB of `yes` per exec, in a
    // loop: the size that took the daemon to 1.9 GB and healthz to 1.27 s
    // when its work per line was quadratic). They get a quarter of a core
    // each, so the machine's two cores are not themselves the bottleneck:
    // what is measured is the daemon's own work per byte of their output.
    // Each flood's client runs on a thread of its own, so that receiving and
    // checking answers does not delay the measuring requests.
    let mut floods = Vec::new();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    for _ in 0..3 {
        let id = d
            .create(json!({"limits": {"output_bytes": 20_000_000, "cpu": 0.25}}))
            .await;
        let (url, key, stop) = (d.url.clone(), d.key.clone(), stop.clone());
        floods.push(std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let c = reqwest::Client::new();
                let mut n = 0;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let body = c
                        .post(format!("{url}/v1/sandboxes/{id}/exec"))
                        .bearer_auth(&key)
                        .json(&json!({"cmd": "yes | head -c 262144", "timeout_seconds": 120}))
                        .send()
                        .await
                        .unwrap()
                        .bytes()
                        .await
                        .unwrap();
                    check_flood_answer(&body, 262_144);
                    n += 1;
                }
                n
            })
        }));
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let mut busy_h = Vec::new();
    let mut busy_e = Vec::new();
    for _ in 0..21 {
        busy_h.push(healthz(&d).await);
        busy_e.push(small_exec(&d, &quiet).await);
    }
    // Under that load, a big output still comes back whole.
    let big = d
        .create(json!({"limits": {"output_bytes": 20_000_000, "cpu": 0.25}}))
        .await;
    let body = d
        .req(Method::POST, &format!("/v1/sandboxes/{big}/exec"))
        .json(&json!({"cmd": "yes | head -c 10000000", "timeout_seconds": 120}))
        .send()
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap();
    check_flood_answer(&body, 10_000_000);
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut runs = 0;
    for f in floods {
        runs += f.join().unwrap();
    }
    // Idle again: the baseline is measured before and after the floods, so
    // that the machine's own load drifting meanwhile counts for neither side.
    for _ in 0..21 {
        idle_h.push(healthz(&d).await);
        idle_e.push(small_exec(&d, &quiet).await);
    }
    let (sh, se) = (spread(idle_h.clone()), spread(idle_e.clone()));
    let (ih, ie, bh, be) = (
        median(idle_h),
        median(idle_e),
        median(busy_h),
        median(busy_e),
    );
    eprintln!(
        "healthz {ih:?} idle (p90 +{sh:?}), {bh:?} under {runs} floods; exec {ie:?} idle (p90 +{se:?}), {be:?} busy"
    );
    assert!(runs >= 30, "the floods did not run ({runs} execs)");
    // Within 2x of idle, with 10 ms of slack for the scheduling noise of a
    // shared 2-core machine on requests that take a few milliseconds, plus
    // twice the idle runs' own p90-p50 spread where other work on the
    // machine makes that noise larger (a starved daemon is off by hundreds
    // of milliseconds: 1.27 s when its work per line was quadratic).
    assert!(
        bh <= ih * 2 + Duration::from_millis(10) + sh * 2,
        "healthz {ih:?} (p90 +{sh:?}) -> {bh:?}"
    );
    assert!(
        be <= ie * 2 + Duration::from_millis(10) + se * 2,
        "exec {ie:?} (p90 +{se:?}) -> {be:?}"
    );
    d.delete_all().await;
}
