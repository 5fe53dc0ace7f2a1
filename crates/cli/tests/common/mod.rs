//! The daemon harness shared by the integration tests: start a real
//! `runcell serve` on a free loopback port with its own data directory, talk
//! to it over HTTP, and clean up (delete its sandboxes if a test failed,
//! SIGTERM it) when dropped. Needs root.
#![allow(dead_code)]

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

pub struct Daemon {
    pub child: Child,
    pub url: String,
    pub key: String,
    pub data: std::path::PathBuf,
    pub port: u16,
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

impl Daemon {
    pub fn start(data: &std::path::Path, port: u16, extra: &[&str]) -> Daemon {
        // SAFETY: geteuid has no preconditions and cannot fail.
        let euid = unsafe { libc::geteuid() };
        assert_eq!(euid, 0, "the daemon tests must run as root");
        let child = Command::new(env!("CARGO_BIN_EXE_runcell"))
            .args([
                "serve",
                "--listen",
                &format!("127.0.0.1:{port}"),
                "--data-dir",
            ])
            .arg(data)
            .args(if extra.contains(&"--standby") {
                &[][..]
            } else {
                &["--standby", "1"][..]
            })
            // Test daemons serve `code-interpreter` from `host` rather than
            // each bootstrapping Debian, unless the test asks for the build.
            .args(if extra.iter().any(|a| a.starts_with("--auto-build")) {
                &[][..]
            } else {
                &["--auto-build=false"][..]
            })
            .args(extra)
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        let url = format!("http://127.0.0.1:{port}");
        let until = Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < until, "the daemon did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
        let key = std::fs::read_to_string(data.join("api-key"))
            .unwrap()
            .trim()
            .to_string();
        Daemon {
            child,
            url,
            key,
            data: data.to_path_buf(),
            port,
        }
    }

    pub fn req(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        reqwest::Client::new()
            .request(method, format!("{}{path}", self.url))
            .bearer_auth(&self.key)
    }

    pub async fn create(&self, body: Value) -> String {
        let r = self
            .req(reqwest::Method::POST, "/v1/sandboxes")
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 201);
        r.json::<Value>().await.unwrap()["id"]
            .as_str()
            .unwrap()
            .to_string()
    }

    pub async fn exec(&self, id: &str, cmd: &str) -> (u16, Value) {
        let r = self
            .req(reqwest::Method::POST, &format!("/v1/sandboxes/{id}/exec"))
            .json(&json!({"cmd": cmd}))
            .send()
            .await
            .unwrap();
        (r.status().as_u16(), r.json().await.unwrap())
    }

    /// Deletes every sandbox (they outlive the daemon by design).
    pub async fn delete_all(&self) {
        let list: Vec<Value> = self
            .req(reqwest::Method::GET, "/v1/sandboxes")
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        for sb in list {
            let id = sb["id"].as_str().unwrap();
            let r = self
                .req(reqwest::Method::DELETE, &format!("/v1/sandboxes/{id}"))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 204);
        }
    }

    pub fn kill9(&mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        // A test that failed did not get to delete its sandboxes, which
        // outlive the daemon by design: delete them now (on a thread with its
        // own runtime, since this may run inside the test's).
        if std::thread::panicking() && self.child.try_wait().ok().flatten().is_none() {
            let (url, key) = (self.url.clone(), self.key.clone());
            let _ = std::thread::spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .ok()?;
                rt.block_on(async {
                    let c = reqwest::Client::new();
                    let list: Vec<Value> = c
                        .get(format!("{url}/v1/sandboxes"))
                        .bearer_auth(&key)
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
                            .bearer_auth(&key)
                            .send()
                            .await;
                    }
                    Some(())
                })
            })
            .join();
        }
        // SIGTERM first, so the daemon destroys its warm pools; sandboxes it
        // handed out outlive it by design (tests delete those themselves).
        // SAFETY: kill has no memory preconditions; the pid is our child's.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let until = Instant::now() + Duration::from_secs(10);
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
pub async fn wait_gone(path: &std::path::Path) {
    let until = Instant::now() + Duration::from_secs(5);
    while path.exists() {
        assert!(Instant::now() < until, "{} was not removed", path.display());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

pub fn data_dir(name: &str) -> std::path::PathBuf {
    let d = std::path::PathBuf::from(format!(
        "/run/runcell-test/daemon-{name}-{}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// Creates an API key for `workspace` in the daemon's data directory (the
/// `runcell key` command) and returns it.
pub fn new_key(data: &std::path::Path, workspace: &str) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_runcell"))
        .arg("key")
        .arg("--data-dir")
        .arg(data)
        .args(["create", "--workspace", workspace, "--name", "test"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}
