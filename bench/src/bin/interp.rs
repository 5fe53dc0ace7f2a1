//! First-result latency of a code interpreter, in one run: the time until
//! `import pandas as pd; pd.DataFrame({"a": [1, 2]}).sum()` has given its
//! value, four ways.
//!
//! (a) bare `/usr/bin/python3 -c` in the template's root (chroot into a
//!     read-only overlay of its layers): the interpreter alone, no sandbox;
//! (b) a fresh runcell sandbox without any pool: create, run the code with
//!     the template's python3, destroy (through the library);
//! (c) a sandbox from the template's warm pool, through the HTTP API:
//!     create + open a python session + run the cell + delete;
//! (d) a cell in a context that is already warm (through the HTTP API).
//!
//! Needs the template built (default `code-interpreter`, see README). Run
//! with `sudo ./scripts/bench.sh --interp`.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use clap::Parser;
use runcell_core::{RunOptions, Runtime, RuntimeConfig, SandboxOptions, Template};
use runcell_jail::RootfsSpec;
use runcell_protocol::Language;
use runcell_testkit::{free_port, Daemon};
use serde_json::{json, Value};

const CODE: &str = "import pandas as pd; pd.DataFrame({\"a\": [1, 2]}).sum()";
const CODE_PRINT: &str = "import pandas as pd; print(pd.DataFrame({\"a\": [1, 2]}).sum())";

#[derive(Debug, Parser)]
#[command(about = "Code-interpreter first-result benchmark")]
struct Args {
    /// Iterations per row.
    #[arg(long, default_value_t = 30)]
    iterations: usize,
    /// The template.
    #[arg(long, default_value = "code-interpreter")]
    template: String,
    /// Installed templates.
    #[arg(long, default_value = "/var/lib/runcell/templates")]
    templates_dir: PathBuf,
}

fn pct(sorted: &[Duration], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    sorted[runcell_testkit::percentile_index(sorted.len(), p)].as_secs_f64() * 1000.0
}

/// Mounts the template's layers read-only at `at` (an overlay, as a sandbox
/// sees them, minus the writable layer).
fn mount_template(t: &Template, at: &Path) {
    let RootfsSpec::Layers { lowers, .. } = &t.rootfs else {
        panic!("template {} is not a built (layered) template", t.name);
    };
    std::fs::create_dir_all(at).unwrap();
    let lower: Vec<String> = lowers.iter().map(|p| p.display().to_string()).collect();
    let ok = Command::new("mount")
        .args(["-t", "overlay", "overlay", "-o"])
        .arg(format!("ro,lowerdir={}", lower.join(":")))
        .arg(at)
        .status()
        .unwrap()
        .success();
    assert!(ok, "could not mount the template's layers");
}

/// The daemon and one client (with its connection pool) for every request.
struct Api {
    daemon: Daemon,
    http: reqwest::Client,
}

impl Api {
    async fn call(&self, method: reqwest::Method, path: &str, body: Option<Value>) -> (u16, Value) {
        let mut rb = self.daemon.request(&self.http, method, path);
        if let Some(b) = body {
            rb = rb.json(&b);
        }
        let r = rb.send().await.expect("request");
        let status = r.status().as_u16();
        let v = r.json().await.unwrap_or(Value::Null);
        (status, v)
    }

    async fn create_session(&self, template: &str) -> (String, String) {
        let (s, v) = self
            .call(
                reqwest::Method::POST,
                "/v1/sandboxes",
                Some(json!({"template": template})),
            )
            .await;
        assert_eq!(s, 201, "{v}");
        let id = v["id"].as_str().unwrap().to_string();
        let (s, v) = self
            .call(
                reqwest::Method::POST,
                &format!("/v1/sandboxes/{id}/repl/sessions"),
                Some(json!({"language": "python"})),
            )
            .await;
        assert_eq!(s, 201, "{v}");
        (id, v["id"].as_str().unwrap().to_string())
    }

    async fn run(&self, id: &str, sid: &str) {
        let (s, v) = self
            .call(
                reqwest::Method::POST,
                &format!("/v1/sandboxes/{id}/repl/sessions/{sid}/run"),
                Some(json!({"code": CODE})),
            )
            .await;
        assert_eq!(s, 200, "{v}");
        let text = v["results"][0]["text/plain"].as_str().unwrap_or_default();
        assert!(text.starts_with("a    3"), "{v}");
    }

    async fn metric(&self, sample: &str) -> f64 {
        self.daemon.metric(sample).await.unwrap_or(0.0)
    }
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    let template = Template::find(Some(&args.templates_dir), &args.template).unwrap_or_else(|e| {
        panic!("{e} Build it first: sudo ./scripts/run.sh template build code-interpreter -f templates/code-interpreter/Dockerfile")
    });
    let n = args.iterations;

    // (a) bare python3 in the template's root.
    let root = PathBuf::from(format!(
        "/run/runcell-bench/interp-root-{}",
        std::process::id()
    ));
    mount_template(&template, &root);
    let mut bare = Vec::new();
    for _ in 0..n {
        let t = Instant::now();
        let out = Command::new("/usr/sbin/chroot")
            .arg(&root)
            .args(["/usr/bin/python3", "-c", CODE_PRINT])
            .env_clear()
            .env("PATH", "/usr/bin:/bin")
            .stderr(Stdio::inherit())
            .output()
            .expect("chroot python3");
        bare.push(t.elapsed());
        assert!(String::from_utf8_lossy(&out.stdout).starts_with("a    3"));
    }
    let _ = Command::new("umount").arg(&root).status();
    let _ = std::fs::remove_dir(&root);

    // (b) a fresh sandbox, no pool of any kind.
    let rt = Runtime::new(RuntimeConfig {
        state_dir: "/run/runcell-bench/interp-direct".into(),
        templates_dir: Some(args.templates_dir.clone()),
        cgroup_parent: "runcell-bench-interp".into(),
        standby: 0,
        ..RuntimeConfig::default()
    })
    .expect("runtime");
    let mut fresh = Vec::new();
    for _ in 0..n {
        let t = Instant::now();
        let sb = rt
            .create(SandboxOptions {
                template: template.name.clone(),
                tied_to_process: false,
                ..SandboxOptions::default()
            })
            .await
            .expect("create");
        let r = sb
            .run_code(Language::Python, CODE_PRINT, &RunOptions::default())
            .await
            .expect("run");
        assert!(
            String::from_utf8_lossy(&r.stdout).starts_with("a    3"),
            "{r:?}"
        );
        sb.destroy().await.expect("destroy");
        fresh.push(t.elapsed());
    }

    // (c) and (d) through the daemon with a warm pool.
    let dir = std::env::current_exe()
        .ok()
        .and_then(|p| p.parent().map(PathBuf::from))
        .expect("own directory");
    let data = PathBuf::from(format!("/run/runcell-bench/interp-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&data);
    let pool = format!("{}=2", template.name);
    let flags: [&OsStr; 6] = [
        "--standby".as_ref(),
        "2".as_ref(),
        "--warm-pool".as_ref(),
        pool.as_ref(),
        "--templates-dir".as_ref(),
        args.templates_dir.as_ref(),
    ];
    let api = Api {
        daemon: Daemon::spawn(&dir.join("runcell"), &data, free_port(), flags),
        http: reqwest::Client::new(),
    };
    let ready = format!("runcell_warm_pool_ready{{template=\"{}\"}}", template.name);
    let wait_full = || async {
        let until = Instant::now() + Duration::from_secs(120);
        while api.metric(&ready).await < 2.0 {
            assert!(Instant::now() < until, "the warm pool never filled");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    let mut pooled = Vec::new();
    for _ in 0..n {
        // Measure a request that finds the pool as a daemon between bursts does.
        wait_full().await;
        let t = Instant::now();
        let (id, sid) = api.create_session(&template.name).await;
        api.run(&id, &sid).await;
        let (s, _) = api
            .call(
                reqwest::Method::DELETE,
                &format!("/v1/sandboxes/{id}"),
                None,
            )
            .await;
        assert_eq!(s, 204);
        pooled.push(t.elapsed());
    }
    let hits = api
        .metric(&format!(
            "runcell_warm_pool_hits_total{{template=\"{}\"}}",
            template.name
        ))
        .await;
    let misses = api
        .metric(&format!(
            "runcell_warm_pool_misses_total{{template=\"{}\"}}",
            template.name
        ))
        .await;
    let refill_sum = api
        .metric(&format!(
            "runcell_warm_pool_refill_seconds_sum{{template=\"{}\"}}",
            template.name
        ))
        .await;
    let refill_count = api
        .metric(&format!(
            "runcell_warm_pool_refill_seconds_count{{template=\"{}\"}}",
            template.name
        ))
        .await;

    let (id, sid) = api.create_session(&template.name).await;
    api.run(&id, &sid).await;
    let mut warm = Vec::new();
    for _ in 0..n {
        let t = Instant::now();
        api.run(&id, &sid).await;
        warm.push(t.elapsed());
    }
    let _ = api
        .call(
            reqwest::Method::DELETE,
            &format!("/v1/sandboxes/{id}"),
            None,
        )
        .await;
    // Dropping the daemon SIGTERMs it: it destroys its pool on the way out.
    drop(api);
    let _ = std::fs::remove_dir_all(&data);

    for v in [&mut bare, &mut fresh, &mut pooled, &mut warm] {
        v.sort();
    }
    println!(
        "first result of `{CODE}`; template {}; {n} iterations; /usr/bin/python3 of the template\n",
        template.name
    );
    println!("| what | p50 ms | p95 ms |");
    println!("|---|---:|---:|");
    for (label, v) in [
        ("(a) bare python3 in the template's root (chroot)", &bare),
        (
            "(b) fresh sandbox, no pool: create + python3 + destroy",
            &fresh,
        ),
        (
            "(c) warm pool via HTTP: create + session + run + delete",
            &pooled,
        ),
        ("(d) cell in an already warm context via HTTP", &warm),
    ] {
        println!("| {label} | {:.1} | {:.1} |", pct(v, 0.5), pct(v, 0.95));
    }
    println!(
        "\n(a) / (c) at p50: {:.1}x. Pool hits {hits}, misses {misses}; mean refill (create + context + preload, off the request path) {:.0} ms.",
        pct(&bare, 0.5) / pct(&pooled, 0.5),
        if refill_count > 0.0 { refill_sum / refill_count * 1000.0 } else { 0.0 }
    );
}
