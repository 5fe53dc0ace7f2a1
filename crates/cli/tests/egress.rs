//! Network egress policies through a real daemon: `none` fails fast,
//! `allowlist` with the `package-index` preset installs from PyPI and
//! refuses other hosts without connecting, `open` cannot reach the host's
//! loopback (SSRF), the operator's override opens one address, and the
//! policy changes on a live sandbox. Needs root. Packets go only to
//! loopback and the package registries (pypi.org, files.pythonhosted.org).

mod common;

use std::io::{Read, Write};
use std::net::TcpListener;
use std::process::Command;
use std::time::{Duration, Instant};

use common::*;
use reqwest::Method;
use serde_json::{json, Value};

/// A daemon for the egress tests (no warm `code-interpreter` pool); its data
/// directory goes with it unless a sandbox was left in it.
fn start(name: &str, extra: &[&str]) -> Daemon {
    require_root("egress");
    let mut args = vec!["--warm-pool", "code-interpreter=0"];
    args.extend(extra);
    Daemon::start(&data_dir(&format!("egress-{name}")), free_port(), &args).remove_data_on_drop()
}

/// What the egress tests send besides the harness's requests.
trait EgressRequests {
    /// Runs `cmd` with a timeout in seconds; the answer, whatever the status.
    async fn run(&self, id: &str, cmd: &str, timeout: u64) -> Value;
    /// The same, in the background.
    async fn run_background(&self, id: &str, cmd: &str, timeout: u64) -> Value;
    /// PATCH /v1/sandboxes/{id}/network: the status and the answer.
    async fn patch_network(&self, id: &str, body: Value) -> (u16, Value);
}

impl EgressRequests for Daemon {
    async fn run(&self, id: &str, cmd: &str, timeout: u64) -> Value {
        let body = json!({"cmd": cmd, "timeout": timeout});
        self.exec_json(id, body).await.1
    }

    async fn run_background(&self, id: &str, cmd: &str, timeout: u64) -> Value {
        let body = json!({"cmd": cmd, "timeout": timeout, "background": true});
        self.exec_json(id, body).await.1
    }

    async fn patch_network(&self, id: &str, body: Value) -> (u16, Value) {
        let path = format!("/v1/sandboxes/{id}/network");
        self.send_json(Method::PATCH, &path, body).await
    }
}

fn out(r: &Value) -> String {
    format!("stdout: {}\nstderr: {}", r["stdout"], r["stderr"])
}

/// Python that times a DNS lookup, a TCP connect by name and one by address
/// (pypi.org's), printing JSON.
const PROBE: &str = r#"
import json, socket, time
r = {}
def probe(name, f):
    t = time.monotonic()
    try:
        f(); r[name] = "ok"
    except Exception as e:
        r[name] = repr(e)
    r[name + "_s"] = time.monotonic() - t
probe("dns", lambda: socket.getaddrinfo("pypi.org", 443))
probe("tcp", lambda: socket.create_connection(("pypi.org", 443), timeout=5))
probe("tcp_ip", lambda: socket.create_connection(("151.101.0.223", 443), timeout=5))
print(json.dumps(r))
"#;

#[tokio::test(flavor = "multi_thread")]
async fn network_none_dns_and_tcp_fail_fast() {
    let d = start("none", &[]);
    let created = d.create_json(json!({})).await;
    let id = created["id"].as_str().unwrap().to_string();
    assert_eq!(created["network"]["mode"], "none");
    d.req(
        reqwest::Method::PUT,
        &format!("/v1/sandboxes/{id}/fs?path=/tmp/probe.py"),
    )
    .body(PROBE)
    .send()
    .await
    .unwrap();
    let r = d.run(&id, "python3 /tmp/probe.py", 30).await;
    assert_eq!(r["exit_code"], 0, "{}", out(&r));
    let p: Value = serde_json::from_str(r["stdout"].as_str().unwrap().trim()).unwrap();
    for k in ["dns", "tcp", "tcp_ip"] {
        assert_ne!(p[k], "ok", "{k} succeeded without network: {p}");
        let s = p[format!("{k}_s")].as_f64().unwrap();
        assert!(s < 1.0, "{k} took {s} s: {p}");
    }
    assert!(
        p["tcp_ip"].as_str().unwrap().contains("unreachable"),
        "a connect by address should be ENETUNREACH: {p}"
    );
    // curl by name and by address, and no proxy in the environment.
    let t = Instant::now();
    let r = d
        .run(
            &id,
            "curl -sS -m 5 https://pypi.org/simple/six/; echo \"rc=$?\"; curl -sS -m 5 https://151.101.0.223/; echo \"rc=$?\"",
            30,
        )
        .await;
    let elapsed = t.elapsed();
    let stdout = r["stdout"].as_str().unwrap();
    assert!(
        stdout.contains("rc=6"),
        "curl by name should fail to resolve: {}",
        out(&r)
    );
    assert!(
        stdout.contains("rc=7"),
        "curl by address should fail to connect: {}",
        out(&r)
    );
    assert!(
        elapsed < Duration::from_secs(2),
        "two curls took {elapsed:?}"
    );
    let r = d.run(&id, "env | grep -ic proxy || true", 10).await;
    assert_eq!(r["stdout"].as_str().unwrap().trim(), "0", "{}", out(&r));
    let net = &d.sandbox(&id).await["network"];
    assert_eq!(net["connections_allowed"], 0);
    d.delete(&id).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn allowlist_package_index_installs_from_pypi_and_refuses_other_hosts() {
    let d = start("allowlist", &[]);
    let created = d
        .create_json(json!({"network": {"mode": "allowlist", "allow": ["*.pythonhosted.org:443"], "presets": ["package-index"]}}))
        .await;
    let id = created["id"].as_str().unwrap().to_string();
    assert_eq!(created["network"]["mode"], "allowlist");
    assert_eq!(
        created["network"]["allow"],
        json!(["*.pythonhosted.org:443"])
    );
    assert_eq!(created["network"]["presets"], json!(["package-index"]));
    let r = d
        .run(
            &id,
            "python3 -m pip install --disable-pip-version-check --no-cache-dir --target /tmp/pkgs six==1.16.0 \
             && PYTHONPATH=/tmp/pkgs python3 -c 'import six; print(\"six\", six.__version__)'",
            180,
        )
        .await;
    assert_eq!(r["exit_code"], 0, "{}", out(&r));
    assert!(
        r["stdout"].as_str().unwrap().contains("six 1.16.0"),
        "{}",
        out(&r)
    );
    let net = d.sandbox(&id).await["network"].clone();
    let allowed = net["connections_allowed"].as_u64().unwrap();
    assert!(
        allowed >= 2,
        "pip should have reached pypi.org and files.pythonhosted.org: {net}"
    );
    assert!(net["bytes_in"].as_u64().unwrap() > 10_000, "{net}");
    assert_eq!(net["connections_refused"], 0, "{net}");

    // example.com resolves, but it is not on the list: refused with the
    // message, and the proxy never connects.
    let r = d
        .run(
            &id,
            "curl -sS -m 10 http://example.com/; echo; curl -sS -m 10 https://example.com/; echo \"rc=$?\"",
            30,
        )
        .await;
    let stdout = r["stdout"].as_str().unwrap();
    assert!(
        stdout.contains("runcell: \"example.com\" (port 80) is not on this sandbox's allowlist"),
        "{}",
        out(&r)
    );
    assert!(stdout.contains("rc=56"), "{}", out(&r));
    assert!(r["stderr"].as_str().unwrap().contains("403"), "{}", out(&r));
    // Python's urllib through the proxy gets the same refusal.
    let r = d
        .run(
            &id,
            "python3 -c 'import urllib.request as u\ntry:\n  u.urlopen(\"http://example.com/\", timeout=10)\nexcept Exception as e:\n  print(e.code, e.read().decode())'",
            30,
        )
        .await;
    assert!(
        r["stdout"]
            .as_str()
            .unwrap()
            .contains("403 runcell: \"example.com\""),
        "{}",
        out(&r)
    );
    let net = d.sandbox(&id).await["network"].clone();
    assert_eq!(
        net["connections_allowed"].as_u64().unwrap(),
        allowed,
        "a refused host was connected to: {net}"
    );
    assert_eq!(net["connections_refused"], 3, "{net}");
    assert_eq!(net["refused_hosts"], json!(["example.com"]), "{net}");

    // The sandbox user cannot use the egress socket directly.
    let r = d
        .run(
            &id,
            "python3 -c 'import socket; s = socket.socket(socket.AF_UNIX); s.connect(\"/run/runcell/egress/sock\")'",
            10,
        )
        .await;
    assert_ne!(r["exit_code"], 0, "{}", out(&r));
    assert!(
        r["stderr"].as_str().unwrap().contains("PermissionError"),
        "{}",
        out(&r)
    );
    let metrics = d.metrics().await;
    assert!(
        metrics.contains("runcell_egress_connections_total{outcome=\"refused_policy\"} 3"),
        "{metrics}"
    );
    d.delete(&id).await;
}

/// curl through the sandbox's proxy even for loopback names.
const VIA_PROXY: &str = "env -u NO_PROXY -u no_proxy curl -sS -m 10 -x http://127.0.0.1:3128";

/// A plain HTTP server on the host's loopback that counts connections;
/// `/redirect` answers 302 to `redirect`.
fn host_listener(
    redirect: Option<String>,
) -> (u16, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    let seen = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let s = seen.clone();
    std::thread::spawn(move || {
        for c in l.incoming() {
            let Ok(mut c) = c else { continue };
            s.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let mut buf = [0u8; 4096];
            let _ = c.set_read_timeout(Some(Duration::from_secs(2)));
            let n = c.read(&mut buf).unwrap_or(0);
            if let Some(to) = redirect
                .as_ref()
                .filter(|_| buf[..n].starts_with(b"GET /redirect"))
            {
                let _ = c.write_all(
                    format!("HTTP/1.1 302 Found\r\nLocation: {to}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                        .as_bytes(),
                );
                continue;
            }
            let _ = c.write_all(
                b"HTTP/1.1 200 OK\r\nContent-Length: 12\r\nConnection: close\r\n\r\nhello, host\n",
            );
        }
    });
    (port, seen)
}

#[tokio::test(flavor = "multi_thread")]
async fn open_sandbox_cannot_reach_host_loopback_but_operator_override_can() {
    let (secret, secret_seen) = host_listener(None);
    let (mirror, mirror_seen) = host_listener(Some(format!("http://localhost:{secret}/")));
    let allow = format!("127.0.0.1:{mirror}");
    let d = start("open", &["--egress-allow-private", &allow]);
    let created = d.create_json(json!({"network": "open"})).await;
    let id = created["id"].as_str().unwrap().to_string();
    assert_eq!(created["network"]["mode"], "open");
    let targets = [
        format!("http://127.0.0.1:{secret}/"),
        format!("http://localhost:{secret}/"),
        format!("https://localhost:{secret}/"),
        format!("http://[::ffff:127.0.0.1]:{secret}/"),
        format!("http://127.0.0.1:{}/healthz", d.port),
        format!("https://127.0.0.1:{}/", d.port),
        "http://169.254.169.254/latest/meta-data/".to_string(),
    ];
    for t in &targets {
        // NO_PROXY lists loopback (the sandbox's own); force the proxy.
        let r = d
            .run(&id, &format!("{VIA_PROXY} '{t}'; echo \" rc=$?\""), 30)
            .await;
        let stdout = r["stdout"].as_str().unwrap();
        if t.starts_with("http:") {
            assert!(
                stdout.contains(
                    "resolves to a private/loopback address, which sandboxes may not reach"
                ),
                "{t}: {}",
                out(&r)
            );
        } else {
            assert!(stdout.contains("rc=56"), "{t}: {}", out(&r));
        }
    }
    // Without the proxy, the sandbox's own loopback has nothing there.
    let r = d
        .run(
            &id,
            &format!("curl -sS -m 5 --noproxy '*' http://127.0.0.1:{secret}/; echo \" rc=$?\""),
            30,
        )
        .await;
    assert!(
        r["stdout"].as_str().unwrap().contains("rc=7"),
        "{}",
        out(&r)
    );
    assert_eq!(
        secret_seen.load(std::sync::atomic::Ordering::SeqCst),
        0,
        "the host listener saw a connection"
    );
    assert_eq!(
        mirror_seen.load(std::sync::atomic::Ordering::SeqCst),
        0,
        "nothing asked for the mirror yet"
    );
    // The operator opened 127.0.0.1:<mirror>: that one address works.
    let r = d
        .run(&id, &format!("{VIA_PROXY} http://127.0.0.1:{mirror}/"), 30)
        .await;
    assert_eq!(r["stdout"], "hello, host\n", "{}", out(&r));
    assert_eq!(mirror_seen.load(std::sync::atomic::Ordering::SeqCst), 1);
    // A redirect from the opened address to the host's loopback: the
    // client's next request is checked again and refused.
    let r = d
        .run(
            &id,
            &format!("{VIA_PROXY} -L http://127.0.0.1:{mirror}/redirect"),
            30,
        )
        .await;
    assert!(
        r["stdout"]
            .as_str()
            .unwrap()
            .contains("resolves to a private/loopback address"),
        "{}",
        out(&r)
    );
    assert_eq!(mirror_seen.load(std::sync::atomic::Ordering::SeqCst), 2);
    assert_eq!(
        secret_seen.load(std::sync::atomic::Ordering::SeqCst),
        0,
        "the redirect reached the host listener"
    );
    let net = d.sandbox(&id).await["network"].clone();
    assert_eq!(net["connections_allowed"], 2, "{net}");
    assert_eq!(
        net["connections_refused"].as_u64().unwrap(),
        targets.len() as u64 + 1,
        "{net}"
    );
    d.delete(&id).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn network_policy_changes_on_a_live_sandbox() {
    let d = start("patch", &[]);
    let id = d.create(json!({"network": "none"})).await;
    let (status, v) = d
        .patch_network(&id, json!({"mode": "allowlist", "presets": ["nope"]}))
        .await;
    assert_eq!(status, 400, "{v}");
    assert!(
        v["error"]
            .as_str()
            .unwrap()
            .contains("not a network preset"),
        "{v}"
    );
    let (status, v) = d
        .patch_network(&id, json!({"mode": "allowlist", "allow": ["pypi.org"]}))
        .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["mode"], "allowlist");
    assert_eq!(
        d.sandbox(&id).await["network"]["allow"],
        json!(["pypi.org"])
    );
    let r = d
        .run(
            &id,
            "echo $HTTPS_PROXY; curl -sS -m 10 http://example.com/",
            30,
        )
        .await;
    let stdout = r["stdout"].as_str().unwrap();
    assert!(stdout.starts_with("http://127.0.0.1:3128\n"), "{}", out(&r));
    assert!(
        stdout.contains("is not on this sandbox's allowlist"),
        "{}",
        out(&r)
    );
    let (status, _) = d.patch_network(&id, json!("none")).await;
    assert_eq!(status, 200);
    // Sandboxed code that takes the proxy's port makes the switch fail, and
    // the policy stays what it was. (`background`: the holder must outlive
    // the exec that starts it.)
    d.run_background(
        &id,
        "nohup python3 -c 'import socket, time; s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind((\"127.0.0.1\", 3128)); s.listen(); print(\"ready\", flush=True); time.sleep(30)' >/tmp/holder.out 2>&1 & echo $! > /tmp/holder.pid; \
         for i in $(seq 200); do grep -q ready /tmp/holder.out && break; sleep 0.05; done",
        10,
    )
    .await;
    let (status, v) = d.patch_network(&id, json!("open")).await;
    assert_eq!(status, 400, "{v}");
    assert!(v["error"].as_str().unwrap().contains("3128"), "{v}");
    assert_eq!(d.sandbox(&id).await["network"]["mode"], "none");
    d.run(&id, "kill $(cat /tmp/holder.pid)", 10).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let t = Instant::now();
    let r = d.run(&id, "echo \"[$HTTPS_PROXY]\"; curl -sS -m 5 -x http://127.0.0.1:3128 http://pypi.org/; echo \" rc=$?\"", 30).await;
    assert!(t.elapsed() < Duration::from_secs(2));
    let stdout = r["stdout"].as_str().unwrap();
    assert!(stdout.starts_with("[]\n"), "{}", out(&r));
    assert!(
        stdout.contains("rc=7"),
        "the listener should be gone: {}",
        out(&r)
    );
    d.delete(&id).await;
}

#[test]
fn runcell_run_takes_a_network_policy() {
    require_root("egress");
    let run = |args: &[&str]| {
        let o = Command::new(env!("CARGO_BIN_EXE_runcell"))
            .arg("run")
            .args(args)
            .output()
            .unwrap();
        (
            o.status.code(),
            String::from_utf8_lossy(&o.stdout).to_string(),
            String::from_utf8_lossy(&o.stderr).to_string(),
        )
    };
    // pypi.org is not on this list: refused by the proxy, nothing sent.
    let (code, stdout, stderr) = run(&[
        "bash",
        "--network",
        "allowlist:example.com:443",
        "-c",
        "echo $HTTP_PROXY; curl -sS -m 10 http://pypi.org/",
    ]);
    assert_eq!(code, Some(0), "{stderr}");
    assert_eq!(
        stdout,
        "http://127.0.0.1:3128\nruncell: \"pypi.org\" (port 80) is not on this sandbox's allowlist\n"
    );
    let (code, stdout, _) = run(&["bash", "-c", "echo \"[$HTTP_PROXY]\""]);
    assert_eq!((code, stdout.as_str()), (Some(0), "[]\n"));
    let (code, _, stderr) = run(&["bash", "--network", "wide", "-c", "true"]);
    assert_eq!(code, Some(2));
    assert!(stderr.contains("is not a network mode"), "{stderr}");
}
