//! Sandboxes that outlive their processes, measured through `runcell
//! serve` on loopback in one run: pause + resume, hibernate, wake to a
//! usable exec, snapshot and fork of a sandbox holding a small and a
//! ~200 MB writable layer (as installed packages: thousands of files), and
//! the disk ten forks of the big one take beside ten full copies, with
//! each layer store (`runcell serve --layer-store tmpfs`: saves copy the
//! sandbox's tmpfs with `cp -a`; `btrfs`: saves are subvolume snapshots).
//! The baseline in the same run is `cp -a` of the same tree on the host:
//! what a full copy costs. Then gVisor's hibernation, snapshot and fork
//! with memory (an idle Python context and one holding 100 MB; the
//! snapshot's sandbox and the fork read a variable set before), beside
//! `runsc checkpoint` and `runsc restore` run directly on a plain
//! container holding the same.
//!
//! Run with `sudo ./scripts/bench.sh --persistence [--iterations N]`.

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use clap::Parser;
use reqwest::Method;
use runcell_testkit::{free_port, Daemon};
use serde_json::{json, Value};

#[derive(Debug, Parser)]
#[command(about = "Pause, hibernate, snapshot and fork benchmark")]
struct Args {
    /// Iterations per row.
    #[arg(long, default_value_t = 20)]
    iterations: usize,
    /// Megabytes of "installed packages" in the big sandbox.
    #[arg(long, default_value_t = 200)]
    layer_mb: u64,
    /// Layer stores to measure, in order.
    #[arg(long, value_delimiter = ',', default_value = "tmpfs,btrfs")]
    stores: Vec<String>,
    /// Only the gVisor rows (hibernation with memory and its baseline).
    #[arg(long)]
    gvisor_only: bool,
    /// Iterations of the microVM rows (TCG guests here: slow); 0 skips them.
    #[arg(long, default_value_t = 3)]
    microvm_iterations: usize,
    /// Only the microVM rows.
    #[arg(long)]
    microvm_only: bool,
}

fn pct(sorted: &[Duration], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[runcell_testkit::percentile_index(sorted.len(), p)].as_secs_f64() * 1000.0
}

fn row(name: &str, mut v: Vec<Duration>) {
    v.sort();
    println!(
        "| {name} | {:.1} | {:.1} | {} |",
        pct(&v, 0.5),
        pct(&v, 0.95),
        v.len()
    );
}

struct Api {
    daemon: Daemon,
    http: reqwest::Client,
}

impl Api {
    async fn call(&self, method: Method, path: &str, body: Value) -> (u16, Value) {
        let r = self
            .daemon
            .request(&self.http, method, path)
            .json(&body)
            .send()
            .await
            .expect("request");
        let status = r.status().as_u16();
        let text = r.text().await.unwrap_or_default();
        (status, serde_json::from_str(&text).unwrap_or(Value::Null))
    }

    async fn ok(&self, method: Method, path: &str, body: Value, want: u16) -> Value {
        let (s, v) = self.call(method, path, body).await;
        assert_eq!(s, want, "{path}: {v}");
        v
    }

    async fn create(&self) -> String {
        self.create_with(json!({"template": "host", "ttl_seconds": 3600,
                                "limits": {"memory_mb": 2048, "disk_mb": 1024}}))
            .await
    }

    /// Creates a sandbox from the request `body`: its id.
    async fn create_with(&self, body: Value) -> String {
        let v = self.ok(Method::POST, "/v1/sandboxes", body, 201).await;
        v["id"].as_str().expect("id").to_string()
    }

    /// Opens a Python REPL session in sandbox `sb`: its id, and the path
    /// its cells run at.
    async fn python_session(&self, sb: &str) -> (String, String) {
        let s = self
            .ok(
                Method::POST,
                &format!("/v1/sandboxes/{sb}/repl/sessions"),
                json!({"language": "python"}),
                201,
            )
            .await;
        let id = s["id"].as_str().expect("session id").to_string();
        let cell = format!("/v1/sandboxes/{sb}/repl/sessions/{id}/run");
        (id, cell)
    }

    async fn exec(&self, id: &str, cmd: &str) {
        let v = self
            .ok(
                Method::POST,
                &format!("/v1/sandboxes/{id}/exec"),
                json!({"cmd": cmd, "timeout_seconds": 600}),
                200,
            )
            .await;
        assert_eq!(v["exit_code"], 0, "{cmd}: {v}");
    }

    async fn timed(&self, method: Method, path: &str, want: u16) -> (Duration, Value) {
        let t = Instant::now();
        let v = self.ok(method, path, json!({}), want).await;
        (t.elapsed(), v)
    }

    async fn delete(&self, id: &str) {
        let _ = self
            .call(Method::DELETE, &format!("/v1/sandboxes/{id}"), json!({}))
            .await;
    }
}

/// Hibernates sandbox `sb` and wakes it with a cell (at `cell`) that
/// prints the `x = 42` set before, `m` times: the hibernations' and the
/// wakes' times.
async fn hibernate_and_wake(
    api: &Api,
    sb: &str,
    cell: &str,
    m: usize,
) -> (Vec<Duration>, Vec<Duration>) {
    let (mut hib, mut wake) = (Vec::new(), Vec::new());
    for _ in 0..m {
        let (d, _) = api
            .timed(Method::POST, &format!("/v1/sandboxes/{sb}/hibernate"), 204)
            .await;
        hib.push(d);
        let t = Instant::now();
        let v = api
            .ok(Method::POST, cell, json!({"code": "print(x)"}), 200)
            .await;
        wake.push(t.elapsed());
        assert_eq!(v["stdout"], "42\n", "the variable was lost: {v}");
    }
    (hib, wake)
}

/// Python that writes `mb` MB as 50 KB files in 100 directories under
/// `root` (like site-packages).
fn fill_code(root: &str, mb: u64) -> String {
    let files = mb * 1024 / 50;
    format!(
        "import os\nfor i in range({files}):\n    d = os.path.join(os.path.expanduser(\"{root}\"), \"pkg%d\" % (i % 100))\n    os.makedirs(d, exist_ok=True)\n    open(os.path.join(d, \"m%d.py\" % i), \"wb\").write(os.urandom(51200))"
    )
}

/// The same, as a shell command for the sandbox.
fn fill(mb: u64) -> String {
    format!(
        "/usr/bin/python3 -c '{}'",
        fill_code("~/.local/lib/python3.11/site-packages", mb)
    )
}

/// `m` snapshots (each deleted) and `m` forks (each deleted) of `sb`.
async fn save_rows(api: &Api, sb: &str, m: usize) -> (Vec<Duration>, Vec<Duration>) {
    let (mut snap, mut fork) = (Vec::new(), Vec::new());
    for _ in 0..m {
        let (d, v) = api
            .timed(Method::POST, &format!("/v1/sandboxes/{sb}/snapshots"), 201)
            .await;
        snap.push(d);
        let id = v["id"].as_str().unwrap_or_default().to_string();
        api.call(Method::DELETE, &format!("/v1/snapshots/{id}"), json!({}))
            .await;
        let (d, v) = api
            .timed(Method::POST, &format!("/v1/sandboxes/{sb}/fork"), 201)
            .await;
        fork.push(d);
        api.delete(v["id"].as_str().unwrap_or_default()).await;
    }
    (snap, fork)
}

/// Bytes allocated on the file system of `path` (after a sync: btrfs
/// allocates at commit), for a store whose saves share extents, which
/// `du` would count once per snapshot.
fn fs_used(path: &std::path::Path) -> u64 {
    let _ = Command::new("sync").arg("-f").arg(path).status();
    let out = Command::new("df")
        .args(["-B1", "--output=used", "--"])
        .arg(path)
        .output()
        .expect("df");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .nth(1)
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or(0)
}

fn du(path: &std::path::Path) -> u64 {
    let out = Command::new("du")
        .args(["-sb", "--"])
        .arg(path)
        .output()
        .expect("du");
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

/// Allocated bytes under `paths`, a file with several hard links counted
/// once.
fn du_allocated(paths: &[&std::path::Path]) -> u64 {
    let out = Command::new("du")
        .args(["-s", "-c", "-B1", "--"])
        .args(paths)
        .output()
        .expect("du");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .last()
        .and_then(|l| l.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    let n = args.iterations.max(1);
    let dir = std::env::current_exe()
        .ok()
        .and_then(|p| p.parent().map(PathBuf::from))
        .expect("own directory");
    if args.microvm_only {
        microvm_rows(&dir, args.microvm_iterations.max(1), args.layer_mb.min(50)).await;
        return;
    }
    if !args.gvisor_only {
        jail_rows(&dir, &args, n).await;
    }
    // gVisor's hibernation with memory, on a daemon with the default store.
    let data = PathBuf::from(format!(
        "/run/runcell-bench/persistence-gvisor-{}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&data);
    let daemon = Daemon::spawn(
        &dir.join("runcell"),
        &data,
        free_port(),
        [
            "--standby",
            "2",
            "--max-sandboxes",
            "64",
            "--auto-build=false",
        ],
    );
    let api = Api {
        daemon,
        http: reqwest::Client::new(),
    };
    gvisor_rows(&api, &data, n.min(5)).await;
    drop(api);
    let _ = std::fs::remove_dir_all(&data);
    if args.microvm_iterations > 0 && !args.gvisor_only {
        microvm_rows(&dir, args.microvm_iterations, args.layer_mb.min(50)).await;
    }
}

/// MicroVM rows, on a daemon that allows emulation (this host's KVM cannot
/// run a guest, so these are TCG guests): pause+resume, hibernate with
/// memory (QEMU migration to a file) and wake to a cell reading a variable
/// set before, snapshot and fork of a guest that wrote `layer_mb` MB of
/// files (the fork's time includes booting the child), and the disk the
/// saved layers take. The baseline is QEMU's own `migrate` to a file of a
/// guest of the same size, held before its first instruction (`-S`).
async fn microvm_rows(dir: &std::path::Path, m: usize, layer_mb: u64) {
    let data = PathBuf::from(format!(
        "/run/runcell-bench/persistence-microvm-{}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&data);
    let daemon = Daemon::spawn(
        &dir.join("runcell"),
        &data,
        free_port(),
        ["--allow-emulation", "--standby", "0", "--auto-build=false"],
    );
    let api = Api {
        daemon,
        http: reqwest::Client::new(),
    };
    println!("\n# microVM (QEMU microvm under TCG emulation; {m} iterations)\n");
    println!("| operation | p50 ms | p95 ms | n |\n|---|---:|---:|---:|");
    let sb = api
        .create_with(
            json!({"template": "host", "isolation": "microvm", "ttl_seconds": 3600,
                   "limits": {"memory_mb": 512, "disk_mb": 1024}}),
        )
        .await;
    let (_, cell) = api.python_session(&sb).await;
    api.ok(Method::POST, &cell, json!({"code": "x = 42"}), 200)
        .await;
    let mut pause = Vec::new();
    for _ in 0..m {
        let t = Instant::now();
        api.ok(
            Method::POST,
            &format!("/v1/sandboxes/{sb}/pause"),
            json!({}),
            204,
        )
        .await;
        api.ok(
            Method::POST,
            &format!("/v1/sandboxes/{sb}/resume"),
            json!({}),
            204,
        )
        .await;
        pause.push(t.elapsed());
    }
    row("microVM pause + resume", pause);
    let (hib, wake) = hibernate_and_wake(&api, &sb, &cell, m).await;
    row("microVM hibernate with memory (512 MB guest limit)", hib);
    row("microVM wake to a cell reading a variable", wake);
    // Files, then snapshots and forks of them.
    api.exec(&sb, &fill(layer_mb)).await;
    let (mut snap, mut fork) = (Vec::new(), Vec::new());
    let mut children = Vec::new();
    for _ in 0..m {
        let (d, v) = api
            .timed(Method::POST, &format!("/v1/sandboxes/{sb}/snapshots"), 201)
            .await;
        snap.push(d);
        assert_eq!(v["memory"], true, "the snapshot has no memory: {v}");
        let (d, v) = api
            .timed(Method::POST, &format!("/v1/sandboxes/{sb}/fork"), 201)
            .await;
        fork.push(d);
        assert_eq!(v["memory"], true, "the fork has no memory: {v}");
        let child = v["id"].as_str().expect("child id").to_string();
        // The child is the parent's guest, code context included.
        let v = api
            .ok(
                Method::POST,
                &cell.replace(&sb, &child),
                json!({"code": "print(x)"}),
                200,
            )
            .await;
        assert_eq!(v["stdout"], "42\n", "the fork lost the variable: {v}");
        children.push(child);
    }
    row(
        &format!("microVM snapshot with memory ({layer_mb} MB written)"),
        snap,
    );
    row(
        &format!(
            "microVM fork with memory ({layer_mb} MB written; save + the child's QEMU loading it)"
        ),
        fork,
    );
    // Allocated bytes, each hard-linked image counted once (one `du` over
    // both directories), the guests' disks first.
    let vms = du_allocated(&[&data.join("sandboxes-microvm")]);
    let all = du_allocated(&[&data.join("sandboxes-microvm"), &data.join("states")]);
    let images = du_allocated(&[&data.join("snapshot-memory")]);
    println!(
        "\nmicroVM disk: the {} guests' disks take {:.1} MB; the {} saved layers add {:.1} MB \
         (hard-linked image chains; allocated bytes, each image counted once); the {m} \
         snapshots' memory images take {:.1} MB (a fork's is removed once its child loaded it)",
        1 + m,
        vms as f64 / 1e6,
        2 * m,
        all.saturating_sub(vms) as f64 / 1e6,
        images as f64 / 1e6
    );
    for c in &children {
        api.delete(c).await;
    }
    api.delete(&sb).await;
    // Baseline: QEMU's own migration to a file of an idle guest held at -S.
    let mut base = Vec::new();
    for _ in 0..m {
        base.push(qemu_migrate_baseline(&data));
    }
    println!("\n| baseline | p50 ms | p95 ms | n |\n|---|---:|---:|---:|");
    row(
        "baseline: QEMU `migrate` to a file, 640 MB guest held at -S",
        base,
    );
    drop(api);
    let _ = std::fs::remove_dir_all(&data);
}

/// One QEMU `migrate` to a file of a microvm guest of 640 MB (the size the
/// benchmark's sandbox gets) that never ran: what saving any memory costs
/// before a guest touches it.
fn qemu_migrate_baseline(data: &std::path::Path) -> Duration {
    use std::io::{BufRead, BufReader, Write};
    let dir = data.join("bench-qemu");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("baseline dir");
    let qmp = dir.join("qmp.sock");
    let mut child = Command::new("qemu-system-x86_64")
        .args([
            "-M",
            "microvm",
            "-accel",
            "tcg",
            "-m",
            "640M",
            "-S",
            "-nodefaults",
        ])
        .args(["-display", "none", "-qmp"])
        .arg(format!("unix:{},server=on,wait=off", qmp.display()))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("qemu-system-x86_64");
    let until = Instant::now() + Duration::from_secs(10);
    let stream = loop {
        if let Ok(s) = std::os::unix::net::UnixStream::connect(&qmp) {
            break s;
        }
        assert!(Instant::now() < until, "QEMU did not listen");
        std::thread::sleep(Duration::from_millis(10));
    };
    let mut w = stream.try_clone().expect("qmp");
    let mut r = BufReader::new(stream);
    let mut line = String::new();
    r.read_line(&mut line).expect("greeting");
    let mut send = |cmd: &str, line: &mut String| {
        w.write_all(cmd.as_bytes()).expect("qmp write");
        loop {
            line.clear();
            r.read_line(line).expect("qmp read");
            if line.contains("\"return\"") || line.contains("\"error\"") {
                return;
            }
        }
    };
    send("{\"execute\":\"qmp_capabilities\"}\n", &mut line);
    let t = Instant::now();
    let file = dir.join("memory");
    send(
        &format!(
            "{{\"execute\":\"migrate\",\"arguments\":{{\"uri\":\"exec:cat > {}\"}}}}\n",
            file.display()
        ),
        &mut line,
    );
    loop {
        send("{\"execute\":\"query-migrate\"}\n", &mut line);
        if line.contains("completed") || line.contains("failed") {
            break;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let took = t.elapsed();
    let _ = child.kill();
    let _ = child.wait();
    let _ = std::fs::remove_dir_all(&dir);
    took
}

/// The jail's rows with each layer store, and the host copy baseline.
async fn jail_rows(dir: &std::path::Path, args: &Args, n: usize) {
    println!("# runcell persistence benchmark ({n} iterations, jail, host template)");
    for store in &args.stores {
        let data = PathBuf::from(format!(
            "/run/runcell-bench/persistence-{store}-{}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&data);
        suite(dir, &data, store, n, args.layer_mb).await;
        // The daemon unmounts the btrfs store when it stops with no live
        // sandbox (and the harness after a kill): unmount it here should
        // it still be, never remove the data through it.
        let store_mnt = data.join("store");
        if std::fs::read_dir(&store_mnt).is_ok_and(|mut d| d.next().is_some()) {
            let _ = Command::new("umount").arg(&store_mnt).status();
        }
        let _ = std::fs::remove_dir_all(&data);
    }

    // Baseline: a full host copy of the same tree.
    let data = PathBuf::from(format!(
        "/run/runcell-bench/persistence-copy-{}",
        std::process::id()
    ));
    let copy_src = data.join("bench-copy-src");
    let copy_dst = data.join("bench-copy-dst");
    let _ = std::fs::remove_dir_all(&data);
    let status = Command::new("/usr/bin/python3")
        .arg("-c")
        .arg(fill_code(&copy_src.display().to_string(), args.layer_mb))
        .status()
        .expect("python3");
    assert!(status.success());
    let mut cp = Vec::new();
    for _ in 0..n.min(5) {
        let _ = std::fs::remove_dir_all(&copy_dst);
        let t = Instant::now();
        assert!(Command::new("cp")
            .args(["-a", "--"])
            .arg(&copy_src)
            .arg(&copy_dst)
            .status()
            .expect("cp")
            .success());
        cp.push(t.elapsed());
    }
    println!("\n## baseline\n\n| operation | p50 ms | p95 ms | n |\n|---|---:|---:|---:|");
    row(
        &format!("host `cp -a` of the {} MB tree", args.layer_mb),
        cp,
    );
    let _ = std::fs::remove_dir_all(&data);
}

/// Every row with the daemon's `--layer-store store`.
async fn suite(
    dir: &std::path::Path,
    data: &std::path::Path,
    store: &str,
    n: usize,
    layer_mb: u64,
) {
    let daemon = Daemon::spawn(
        &dir.join("runcell"),
        data,
        free_port(),
        [
            "--standby",
            "2",
            "--max-sandboxes",
            "64",
            "--auto-build=false",
            "--layer-store",
            store,
        ],
    );
    let api = Api {
        daemon,
        http: reqwest::Client::new(),
    };
    let system: Value = api.daemon.get("/v1/system").await;
    let kind = system["layer_store"]["kind"].as_str().unwrap_or_default();
    if store != "auto" {
        assert_eq!(kind, store, "{system}");
    }
    println!("\n## --layer-store {store} ({kind})\n");
    println!("| operation | p50 ms | p95 ms | n |\n|---|---:|---:|---:|");

    // What the store costs a create: create to a first exec, then delete
    // (the standby pool prepares the next one meanwhile).
    let mut life = Vec::new();
    for _ in 0..n {
        let t = Instant::now();
        let id = api.create().await;
        api.exec(&id, "true").await;
        api.delete(&id).await;
        life.push(t.elapsed());
    }
    row("create + first exec + delete", life);

    // Pause + resume of an idle sandbox.
    let sb = api.create().await;
    let mut pr = Vec::new();
    for _ in 0..n {
        let t = Instant::now();
        api.timed(Method::POST, &format!("/v1/sandboxes/{sb}/pause"), 204)
            .await;
        api.timed(Method::POST, &format!("/v1/sandboxes/{sb}/resume"), 204)
            .await;
        pr.push(t.elapsed());
    }
    row("pause + resume", pr);

    // Snapshot and fork, small layer.
    api.exec(&sb, "echo hi > ~/small").await;
    let (snap, fork) = save_rows(&api, &sb, n).await;
    row("snapshot (small layer)", snap);
    row("fork (small layer)", fork);
    // Hibernate, then wake to a usable exec (the exec wakes it).
    let mut hib = Vec::new();
    let mut wake = Vec::new();
    for _ in 0..n {
        let (d, _) = api
            .timed(Method::POST, &format!("/v1/sandboxes/{sb}/hibernate"), 204)
            .await;
        hib.push(d);
        let t = Instant::now();
        api.exec(&sb, "true").await;
        wake.push(t.elapsed());
    }
    row("hibernate (small layer)", hib);
    row("wake to first exec (small layer)", wake);

    api.delete(&sb).await;

    // The big layer: ~layer_mb MB of package-like files, written since
    // the sandbox started (all of it in its writable layer).
    let big = api.create().await;
    api.exec(&big, &fill(layer_mb)).await;
    let mb = layer_mb;

    // Disk: ten forks of it (one fork-tree) share one saved copy (btrfs:
    // one snapshot, sharing every extent with the sandbox's own layer).
    let btrfs = store == "btrfs";
    let states = if btrfs {
        data.join("store")
    } else {
        data.join("states")
    };
    let used = |p: &std::path::Path| if btrfs { fs_used(p) } else { du(p) };
    let before = used(&states);
    let t = Instant::now();
    let v = api
        .ok(
            Method::POST,
            &format!("/v1/sandboxes/{big}/fork-tree"),
            json!({"count": 10}),
            201,
        )
        .await;
    let tree_ms = t.elapsed();
    let kids: Vec<String> = v["children"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|c| c["id"].as_str().map(String::from))
                .collect()
        })
        .unwrap_or_default();
    let one = used(&states).saturating_sub(before);
    for k in &kids {
        api.delete(k).await;
    }

    let m = n.min(5);
    let (snap, fork) = save_rows(&api, &big, m).await;
    row(&format!("snapshot ({mb} MB written since start)"), snap);
    row(&format!("fork ({mb} MB written since start)"), fork);

    // After one hibernation the saved files are a layer under the woken
    // sandbox: later saves copy only what was written since.
    let (mut hib, mut wake) = (Vec::new(), Vec::new());
    for _ in 0..m {
        let (d, _) = api
            .timed(Method::POST, &format!("/v1/sandboxes/{big}/hibernate"), 204)
            .await;
        hib.push(d);
        let t = Instant::now();
        api.exec(&big, "true").await;
        wake.push(t.elapsed());
    }
    row(
        &format!(
            "hibernate ({mb} MB; {})",
            if btrfs {
                "a snapshot"
            } else {
                "the first copies it"
            }
        ),
        hib,
    );
    row(&format!("wake to first exec ({mb} MB layer)"), wake);
    let (snap, fork) = save_rows(&api, &big, m).await;
    row(
        &format!("snapshot ({mb} MB saved before, nothing since)"),
        snap,
    );
    row(&format!("fork ({mb} MB saved before, nothing since)"), fork);
    println!(
        "\n{} forks of the {mb} MB sandbox (one fork-tree right after the write, {:.0} ms): {:.1} MB more on disk; ten full copies would be {:.1} MB.",
        kids.len(),
        tree_ms.as_secs_f64() * 1000.0,
        one as f64 / 1e6,
        mb as f64 * 1.048576 * 10.0,
    );
    api.delete(&big).await;
}

/// gVisor hibernation with memory: hibernate (quiesce, `runsc checkpoint`
/// and the files) and wake to a cell that reads a variable set before
/// (`runsc restore`); snapshot and fork with memory (checkpoint, copy,
/// restore in place), a create from the snapshot and the fork each to a
/// cell reading the variable; for an idle Python context and one holding
/// 100 MB. The baseline is `runsc checkpoint` and `runsc restore` run
/// directly on a plain container whose Python holds the same.
async fn gvisor_rows(api: &Api, data: &std::path::Path, m: usize) {
    println!("\n# gVisor: hibernation, snapshots and forks with memory ({m} iterations)\n");
    println!("| operation | p50 ms | p95 ms | n |\n|---|---:|---:|---:|");
    for mb in [0u64, 100] {
        let sb = api
            .create_with(json!({"isolation": "gvisor", "ttl_seconds": 3600,
                                "limits": {"memory_mb": 1024}}))
            .await;
        let (session, cell) = api.python_session(&sb).await;
        let code = format!("import os\nx = 42\nbig = os.urandom({mb} << 20)");
        api.ok(Method::POST, &cell, json!({"code": code}), 200)
            .await;
        let (hib, wake) = hibernate_and_wake(api, &sb, &cell, m).await;
        row(
            &format!("gVisor hibernate with memory (Python holding {mb} MB)"),
            hib,
        );
        row(
            &format!("gVisor wake to a cell reading a variable ({mb} MB)"),
            wake,
        );
        let (snap, from, fork) = gvisor_save_rows(api, &sb, &session, m).await;
        row(
            &format!("gVisor snapshot with memory ({mb} MB; the sandbox runs on)"),
            snap,
        );
        row(
            &format!("gVisor create from it to a cell reading the variable ({mb} MB)"),
            from,
        );
        row(
            &format!("gVisor fork with memory to a cell reading the variable ({mb} MB)"),
            fork,
        );
        api.delete(&sb).await;
    }
    for mb in [0u64, 100] {
        let (ckpt, restore) = runsc_baseline(data, mb, m);
        row(
            &format!("baseline: `runsc checkpoint` of a plain container (Python holding {mb} MB)"),
            ckpt,
        );
        row(
            &format!("baseline: `runsc restore` of it ({mb} MB)"),
            restore,
        );
    }
}

/// `m` snapshots of gVisor sandbox `sb` (each with memory, deleted after a
/// sandbox made from it read `x` in code context `session`) and `m` forks
/// (each reads `x`, then is deleted): the snapshot, the create from it to
/// the cell, and the fork to the cell.
async fn gvisor_save_rows(
    api: &Api,
    sb: &str,
    session: &str,
    m: usize,
) -> (Vec<Duration>, Vec<Duration>, Vec<Duration>) {
    let (mut snap, mut from, mut fork) = (Vec::new(), Vec::new(), Vec::new());
    let read_x = |id: &str| format!("/v1/sandboxes/{id}/repl/sessions/{session}/run");
    for _ in 0..m {
        let (d, v) = api
            .timed(Method::POST, &format!("/v1/sandboxes/{sb}/snapshots"), 201)
            .await;
        snap.push(d);
        assert_eq!(v["memory"], true, "a snapshot without memory: {v}");
        let snap_id = v["id"].as_str().unwrap_or_default().to_string();
        let t = Instant::now();
        let v = api
            .ok(
                Method::POST,
                "/v1/sandboxes",
                json!({"from_snapshot": snap_id, "ttl_seconds": 3600}),
                201,
            )
            .await;
        let id = v["id"].as_str().unwrap_or_default().to_string();
        let v = api
            .ok(Method::POST, &read_x(&id), json!({"code": "print(x)"}), 200)
            .await;
        from.push(t.elapsed());
        assert_eq!(v["stdout"], "42\n", "the snapshot lost the variable: {v}");
        api.delete(&id).await;
        api.call(
            Method::DELETE,
            &format!("/v1/snapshots/{snap_id}"),
            json!({}),
        )
        .await;
        let t = Instant::now();
        let v = api
            .ok(
                Method::POST,
                &format!("/v1/sandboxes/{sb}/fork"),
                json!({}),
                201,
            )
            .await;
        assert_eq!(v["memory"], true, "a fork without memory: {v}");
        let id = v["id"].as_str().unwrap_or_default().to_string();
        let v = api
            .ok(Method::POST, &read_x(&id), json!({"code": "print(x)"}), 200)
            .await;
        fork.push(t.elapsed());
        assert_eq!(v["stdout"], "42\n", "the fork lost the variable: {v}");
        api.delete(&id).await;
    }
    (snap, from, fork)
}

/// `runsc checkpoint` and `runsc restore` run directly, `m` times each,
/// on a container (the host's root, read-only) whose Python holds `mb` MB.
fn runsc_baseline(data: &std::path::Path, mb: u64, m: usize) -> (Vec<Duration>, Vec<Duration>) {
    let dir = data.join(format!("bench-runsc-{mb}"));
    let bundle = dir.join("bundle");
    let image = dir.join("image");
    std::fs::create_dir_all(&bundle).expect("bundle dir");
    let code = format!("import os, time\nx = 42\nbig = os.urandom({mb} << 20)\nopen('/dev/shm/ready', 'w').close()\ntime.sleep(3600)");
    let config = json!({
        "ociVersion": "1.0.2",
        "process": {"user": {"uid": 0, "gid": 0}, "args": ["/usr/bin/python3", "-c", code],
                    "env": ["PATH=/usr/bin:/bin"], "cwd": "/"},
        "root": {"path": "/", "readonly": true},
        "mounts": [{"destination": "/proc", "type": "proc", "source": "proc"},
                   {"destination": "/dev/shm", "type": "tmpfs", "source": "shm"}],
        "linux": {"namespaces": [{"type": "pid"}, {"type": "ipc"}, {"type": "uts"},
                                 {"type": "mount"}, {"type": "network"}]},
    });
    std::fs::write(bundle.join("config.json"), config.to_string()).expect("config");
    let runsc = |args: &[&str]| -> bool {
        Command::new("runsc")
            .arg("--root")
            .arg(dir.join("state"))
            .args(["--network=none"])
            .args(args)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()
            .expect("runsc")
            .success()
    };
    let b = bundle.display().to_string();
    let i = image.display().to_string();
    assert!(
        runsc(&["run", "--detach", "--bundle", &b, "c"]),
        "runsc run"
    );
    // Until the Python holds its memory (a file in its own /dev/shm).
    let until = Instant::now() + Duration::from_secs(60);
    while !Command::new("runsc")
        .arg("--root")
        .arg(dir.join("state"))
        .args(["exec", "c", "/bin/test", "-e", "/dev/shm/ready"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
    {
        assert!(
            Instant::now() < until,
            "the baseline container never got ready"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let (mut ckpt, mut restore) = (Vec::new(), Vec::new());
    for _ in 0..m {
        let _ = std::fs::remove_dir_all(&image);
        let t = Instant::now();
        assert!(
            runsc(&["checkpoint", "--image-path", &i, "c"]),
            "runsc checkpoint"
        );
        ckpt.push(t.elapsed());
        assert!(runsc(&["delete", "c"]), "runsc delete");
        let t = Instant::now();
        assert!(
            runsc(&[
                "restore",
                "--detach",
                "--bundle",
                &b,
                "--image-path",
                &i,
                "c"
            ]),
            "runsc restore"
        );
        restore.push(t.elapsed());
    }
    let _ = runsc(&["kill", "c", "KILL"]);
    std::thread::sleep(Duration::from_millis(200));
    let _ = runsc(&["delete", "--force", "c"]);
    let _ = std::fs::remove_dir_all(&dir);
    (ckpt, restore)
}
