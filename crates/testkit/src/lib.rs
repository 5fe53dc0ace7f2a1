//! The daemon harness shared by runcell's integration tests
//! (`crates/cli/tests`) and the HTTP benchmarks (`bench`): start a real
//! `runcell serve` on a free loopback port with its own data directory, talk
//! to it over HTTP, and stop it when dropped (deleting the sandboxes a failed
//! test left, since sandboxes outlive the daemon by design). Starting a
//! daemon needs root.
//!
//! It panics on anything unexpected: it is meant for tests and benchmarks,
//! where a panic with the daemon's answer in it is the report.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use reqwest::Method;
use serde::de::DeserializeOwned;
use serde_json::{json, Value};

/// How long a daemon may take to listen after it was started: more than
/// the 20 s its KVM probe may wait for a test guest that never boots (a
/// loaded host), which it does before it listens.
const START_TIMEOUT: Duration = Duration::from_secs(45);
/// How long a daemon may take to exit after SIGTERM before it is killed.
const STOP_TIMEOUT: Duration = Duration::from_secs(10);

/// A loopback port that was free a moment ago, below the kernel's
/// ephemeral range (32768 and up): a test's own servers that bind port 0
/// meanwhile never get it, and the tests of one process never share one.
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    for _ in 0..1000 {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let offset = (std::process::id()
            .wrapping_mul(977)
            .wrapping_add(n.wrapping_mul(7919)))
            % 12_000;
        let port = u16::try_from(20_000 + offset).expect("below 32000");
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free loopback port between 20000 and 32000");
}

/// `bin serve --listen 127.0.0.1:port`; the caller adds the rest (at least
/// `--data-dir`), where its output goes, and spawns it.
pub fn serve_command(bin: &Path, port: u16) -> Command {
    let mut c = Command::new(bin);
    c.args(["serve", "--listen", &format!("127.0.0.1:{port}")]);
    c
}

/// A running `runcell serve`.
#[derive(Debug)]
pub struct Daemon {
    pub child: Child,
    /// `http://127.0.0.1:PORT`.
    pub url: String,
    /// The API key the daemon wrote to `<data>/api-key` on its first start.
    pub key: String,
    pub data: PathBuf,
    pub port: u16,
    remove_data_on_drop: bool,
}

impl Daemon {
    /// Starts `bin serve` on 127.0.0.1:`port` with its data in `data` and
    /// `args` after those, its stdout discarded; returns once it listens (at
    /// most 20 s) with the key it wrote.
    pub fn spawn<I, S>(bin: &Path, data: &Path, port: u16, args: I) -> Daemon
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        let child = serve_command(bin, port)
            .arg("--data-dir")
            .arg(data)
            .args(args)
            .stdout(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("could not start {}: {e}", bin.display()));
        // Owned before the wait, so a daemon that never listens is stopped.
        let mut d = Daemon {
            child,
            url: format!("http://127.0.0.1:{port}"),
            key: String::new(),
            data: data.to_path_buf(),
            port,
            remove_data_on_drop: false,
        };
        let until = Instant::now() + START_TIMEOUT;
        // The daemon writes its key before it listens: a port that answers
        // while the key is missing is someone else's.
        while !data.join("api-key").exists()
            || std::net::TcpStream::connect(("127.0.0.1", port)).is_err()
        {
            if let Ok(Some(status)) = d.child.try_wait() {
                panic!("the daemon exited ({status}) before it listened on port {port}");
            }
            assert!(Instant::now() < until, "the daemon did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
        d.key = std::fs::read_to_string(data.join("api-key"))
            .expect("the daemon's api-key file")
            .trim()
            .to_string();
        d
    }

    /// Also removes the data directory when dropped, unless sandboxes are
    /// left in it (a leftover keeps its state there).
    pub fn remove_data_on_drop(mut self) -> Daemon {
        self.remove_data_on_drop = true;
        self
    }

    /// A request to `path` (from `/v1`…) with the daemon's key, on `http`.
    pub fn request(
        &self,
        http: &reqwest::Client,
        method: Method,
        path: &str,
    ) -> reqwest::RequestBuilder {
        http.request(method, format!("{}{path}", self.url))
            .bearer_auth(&self.key)
    }

    /// A request to `path` with the daemon's key, on a client of its own.
    pub fn req(&self, method: Method, path: &str) -> reqwest::RequestBuilder {
        self.req_as(&self.key, method, path)
    }

    /// A request to `path` with another `key` (another workspace's, a
    /// revoked or a wrong one), on a client of its own.
    pub fn req_as(&self, key: &str, method: Method, path: &str) -> reqwest::RequestBuilder {
        reqwest::Client::new()
            .request(method, format!("{}{path}", self.url))
            .bearer_auth(key)
    }

    /// GETs `path` and decodes its JSON, whatever the status.
    pub async fn get<T: DeserializeOwned>(&self, path: &str) -> T {
        self.get_as(&self.key, path).await
    }

    /// GETs `path` with another `key` and decodes its JSON, whatever the
    /// status.
    pub async fn get_as<T: DeserializeOwned>(&self, key: &str, path: &str) -> T {
        self.fetch(key, path).await.json().await.unwrap()
    }

    /// GETs `path` and returns its body as text, whatever the status.
    pub async fn text(&self, path: &str) -> String {
        self.fetch(&self.key, path).await.text().await.unwrap()
    }

    async fn fetch(&self, key: &str, path: &str) -> reqwest::Response {
        self.req_as(key, Method::GET, path).send().await.unwrap()
    }

    /// GETs `path`, which must answer 200, and returns its JSON.
    pub async fn get_ok(&self, path: &str) -> Value {
        let r = self.req(Method::GET, path).send().await.unwrap();
        assert_eq!(r.status(), 200, "GET {path}");
        r.json().await.unwrap()
    }

    /// GET /v1/sandboxes/{id}: the sandbox's view, whatever the status.
    pub async fn sandbox(&self, id: &str) -> Value {
        self.get(&format!("/v1/sandboxes/{id}")).await
    }

    /// Sends `method path` with `body` as JSON and returns the status only.
    pub async fn status(&self, method: Method, path: &str, body: Option<Value>) -> u16 {
        let mut rb = self.req(method, path);
        if let Some(b) = body {
            rb = rb.json(&b);
        }
        rb.send().await.unwrap().status().as_u16()
    }

    /// Creates a sandbox, which must answer 201, and returns its view.
    pub async fn create_json(&self, body: Value) -> Value {
        let (status, v) = self.post("/v1/sandboxes", body).await;
        assert_eq!(status, 201, "{v}");
        v
    }

    /// Creates a sandbox, which must answer 201, and returns its id.
    pub async fn create(&self, body: Value) -> String {
        self.create_json(body).await["id"]
            .as_str()
            .unwrap()
            .to_string()
    }

    /// Opens a code context (REPL session) in sandbox `id` with `body`
    /// (e.g. `{"language": "python"}`), which must answer 201; returns its view.
    pub async fn create_session(&self, id: &str, body: Value) -> Value {
        let path = format!("/v1/sandboxes/{id}/repl/sessions");
        let (status, v) = self.post(&path, body).await;
        assert_eq!(status, 201, "{v}");
        v
    }

    /// Runs `cmd` (a shell line) and returns the status and the answer.
    pub async fn exec(&self, id: &str, cmd: &str) -> (u16, Value) {
        self.exec_json(id, json!({ "cmd": cmd })).await
    }

    /// POST /v1/sandboxes/{id}/exec with `body`: the status and the answer.
    pub async fn exec_json(&self, id: &str, body: Value) -> (u16, Value) {
        self.post(&format!("/v1/sandboxes/{id}/exec"), body).await
    }

    /// POST /v1/sandboxes/{id}/exec/stream with `body`, which must answer
    /// 200: the whole event stream as text, read to its end.
    pub async fn exec_stream_text(&self, id: &str, body: Value) -> String {
        let r = self
            .req(Method::POST, &format!("/v1/sandboxes/{id}/exec/stream"))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "exec/stream {body}");
        r.text().await.unwrap()
    }

    /// POSTs `body` as JSON to `path`: the status and the answer's JSON.
    pub async fn post(&self, path: &str, body: Value) -> (u16, Value) {
        self.send_json(Method::POST, path, body).await
    }

    /// Sends `body` as JSON: the status and the answer's JSON.
    pub async fn send_json(&self, method: Method, path: &str, body: Value) -> (u16, Value) {
        let r = self.req(method, path).json(&body).send().await.unwrap();
        (r.status().as_u16(), r.json().await.unwrap())
    }

    /// Deletes a sandbox, which must answer 204.
    pub async fn delete(&self, id: &str) {
        let r = self
            .req(Method::DELETE, &format!("/v1/sandboxes/{id}"))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 204);
    }

    /// Deletes every sandbox (they outlive the daemon by design).
    pub async fn delete_all(&self) {
        let list: Vec<Value> = self.get("/v1/sandboxes").await;
        for sb in list {
            self.delete(sb["id"].as_str().unwrap()).await;
        }
    }

    /// The text of /metrics (no key needed).
    pub async fn metrics(&self) -> String {
        reqwest::get(format!("{}/metrics", self.url))
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    }

    /// The value of a metric sample line, e.g.
    /// `runcell_warm_pool_ready{template="host"}`, if there is one.
    pub async fn metric(&self, sample: &str) -> Option<f64> {
        metric_value(&self.metrics().await, sample)
    }

    /// Sends SIGTERM (the daemon finishes running requests, destroys its
    /// warm pools and exits); does not wait.
    pub fn sigterm(&mut self) {
        signal(&mut self.child, Signal::SIGTERM);
    }

    /// SIGKILLs the daemon and reaps it.
    pub fn kill9(&mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }

    /// SIGTERM, then SIGKILL if it has not exited within 10 s; reaps it.
    pub fn stop(&mut self) {
        if let Ok(Some(_)) = self.child.try_wait() {
            return;
        }
        self.sigterm();
        let until = Instant::now() + STOP_TIMEOUT;
        while Instant::now() < until {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        // A test that failed did not get to delete its sandboxes, which
        // outlive the daemon by design: delete them now (on a thread with its
        // own runtime, since this may run inside the test's).
        if std::thread::panicking() && self.child.try_wait().ok().flatten().is_none() {
            let (url, key) = (self.url.clone(), self.key.clone());
            let _ = std::thread::spawn(move || delete_everything(&url, &key)).join();
        }
        // SIGTERM first, so the daemon destroys its warm pools; sandboxes it
        // handed out outlive it by design (tests delete those themselves).
        self.stop();
        let no_sandboxes =
            std::fs::read_dir(self.data.join("sandboxes")).map_or(true, |mut d| d.next().is_none());
        // The sandboxes' tmpfs, the btrfs layer store and the volumes: a
        // daemon that stopped gracefully with no live sandbox unmounted
        // them; one that was killed (or left sandboxes) did not. With no
        // sandbox left, unmount them here, so that no test leaves a mount
        // or a loop device (autoclear) behind.
        let volumes = std::fs::read_dir(self.data.join("volumes"))
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|x| x == "mnt"));
        let mut mounted = false;
        for mount in ["sandboxes", "store"]
            .map(|m| self.data.join(m))
            .into_iter()
            .chain(volumes)
        {
            if is_mount_point(&mount) {
                mounted |= !(no_sandboxes
                    && Command::new("umount")
                        .arg(&mount)
                        .status()
                        .is_ok_and(|s| s.success()));
            }
        }
        // Never deleted through a mount.
        if self.remove_data_on_drop && no_sandboxes && !mounted {
            let _ = std::fs::remove_dir_all(&self.data);
        }
    }
}

/// Whether `path` is a mount point in this process's mount namespace.
pub fn is_mount_point(path: &Path) -> bool {
    let want = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
    let want = want.to_string_lossy();
    std::fs::read_to_string("/proc/self/mountinfo").is_ok_and(|m| {
        m.lines()
            .any(|l| l.split(' ').nth(4) == Some(want.as_ref()))
    })
}

/// Best effort: deletes every sandbox the key sees.
fn delete_everything(url: &str, key: &str) -> Option<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .ok()?;
    rt.block_on(async {
        let c = reqwest::Client::new();
        let list: Vec<Value> = c
            .get(format!("{url}/v1/sandboxes"))
            .bearer_auth(key)
            .send()
            .await
            .ok()?
            .json()
            .await
            .ok()?;
        for sb in list {
            let id = sb["id"].as_str().unwrap_or_default();
            let _ = c
                .delete(format!("{url}/v1/sandboxes/{id}"))
                .bearer_auth(key)
                .send()
                .await;
        }
        Some(())
    })
}

/// Sends `sig` to `child` unless it has exited (a reaped child's pid may
/// be reused).
pub fn signal(child: &mut Child, sig: Signal) {
    if let Ok(Some(_)) = child.try_wait() {
        return;
    }
    let pid = Pid::from_raw(i32::try_from(child.id()).expect("a pid fits in i32"));
    // ESRCH (it exited) is fine: the caller waits for it anyway.
    let _ = kill(pid, sig);
}

/// The value of the sample line `sample` in a Prometheus text exposition.
pub fn metric_value(text: &str, sample: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(sample)?.trim().parse().ok())
}

/// Sends a request that must fail with `want` and an error naming `words`.
pub async fn expect_error(rb: reqwest::RequestBuilder, want: u16, words: &str) {
    let r = rb.send().await.unwrap();
    let status = r.status().as_u16();
    let body: Value = r.json().await.unwrap();
    assert_eq!(status, want, "{body}");
    assert!(body["error"].as_str().unwrap().contains(words), "{body}");
}

/// Waits (up to 5 s) until `path` is gone: DELETE answers once every process
/// is killed, and the directory goes when the teardown finishes.
pub async fn wait_gone(path: &Path) {
    let until = Instant::now() + Duration::from_secs(5);
    while path.exists() {
        assert!(Instant::now() < until, "{} was not removed", path.display());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The index of the `p` quantile (0.0 to 1.0, nearest rank) in a sorted
/// sample of `len` values (`len` > 0).
#[allow(
    clippy::cast_possible_truncation,
    clippy::cast_sign_loss,
    clippy::cast_precision_loss,
    reason = "the rounded product lies in 0..len, which a usize holds"
)]
pub fn percentile_index(len: usize, p: f64) -> usize {
    let last = len.saturating_sub(1);
    ((last as f64 * p.clamp(0.0, 1.0)).round() as usize).min(last)
}

/// What the benchmarks share: timing whole commands and the baselines'
/// command lines.
pub mod bench {
    use std::process::{Command, Stdio};
    use std::time::{Duration, Instant};

    /// Debian's interpreter, which every row of a start-up benchmark runs.
    pub const PYTHON: &str = "/usr/bin/python3";

    /// `argv` as owned strings.
    pub fn strings(argv: &[&str]) -> Vec<String> {
        argv.iter().map(|s| s.to_string()).collect()
    }

    /// Runs `argv` (which must succeed) with no input or output; its wall time.
    pub fn time_command(argv: &[String]) -> Duration {
        let started = Instant::now();
        let status = Command::new(&argv[0])
            .args(&argv[1..])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .unwrap_or_else(|e| panic!("could not run {}: {e}", argv[0]));
        let took = started.elapsed();
        assert!(status.success(), "{argv:?} failed: {status}");
        took
    }

    /// The `p` percentile of sorted samples (zero for none).
    pub fn percentile(sorted: &[Duration], p: f64) -> Duration {
        if sorted.is_empty() {
            return Duration::ZERO;
        }
        sorted[super::percentile_index(sorted.len(), p)]
    }

    /// Milliseconds, for tables.
    pub fn ms(d: Duration) -> f64 {
        d.as_secs_f64() * 1000.0
    }

    /// `bwrap --unshare-all` around `python3 ARGS`: the host's /usr read-only,
    /// fresh /proc, /dev and /tmp (the bubblewrap baseline).
    pub fn bwrap_python(args: &[&str]) -> Vec<String> {
        let mut v = strings(&[
            "bwrap",
            "--unshare-all",
            "--die-with-parent",
            "--ro-bind",
            "/usr",
            "/usr",
            "--symlink",
            "usr/bin",
            "/bin",
            "--symlink",
            "usr/lib",
            "/lib",
            "--symlink",
            "usr/lib64",
            "/lib64",
            "--proc",
            "/proc",
            "--dev",
            "/dev",
            "--tmpfs",
            "/tmp",
            PYTHON,
        ]);
        v.extend(strings(args));
        v
    }
}
