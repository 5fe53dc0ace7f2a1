//! What a new user meets on the first run of `runcell serve`: the start-up
//! banner, a data directory sandboxes cannot reach, a sandbox's egress
//! policy across a daemon restart, and the `code-interpreter` template built
//! on first start. Needs root.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use common::*;
use nix::sys::signal::Signal;
use reqwest::Method;
use serde_json::{json, Value};

/// The flags of a `runcell serve` these tests start by hand: no standbys,
/// no template build, and a tmpfs layer store (the daemon is killed or
/// fails, which with the `auto` store would leave a btrfs mount and a loop
/// device behind).
const BY_HAND: [&str; 5] = [
    "--standby",
    "0",
    "--auto-build=false",
    "--layer-store",
    "tmpfs",
];

/// Fails unless `out` ([`through_proxy`]) shows the host's answer came
/// through the egress proxy.
fn assert_let_through(out: &str) {
    assert!(
        out.contains("hello, host") && out.contains("status=200"),
        "{out}"
    );
}

/// Starts `runcell serve` with its stdout captured and returns the lines it
/// printed until `want` appeared (or 20 s passed), killing it after.
fn banner(want: &str) -> String {
    let data = data_dir("banner");
    let port = free_port();
    let mut child = serve_command(Path::new(RUNCELL), port)
        .arg("--data-dir")
        .arg(&data)
        .args(BY_HAND)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let mut text = String::new();
    let until = Instant::now() + Duration::from_secs(20);
    while Instant::now() < until && !text.contains(want) {
        if let Ok(line) = rx.recv_timeout(Duration::from_millis(200)) {
            text.push_str(&line);
            text.push('\n');
        }
    }
    signal(&mut child, Signal::SIGTERM);
    let _ = child.wait();
    let _ = std::fs::remove_dir_all(&data);
    text
}

#[test]
fn banner_prints_the_runcell_variables_as_well_as_pandastack_ones() {
    let text = banner("RUNCELL_API_KEY");
    assert!(text.contains("PANDASTACK_API="), "{text}");
    let line = text
        .lines()
        .find(|l| l.contains("RUNCELL_URL="))
        .unwrap_or_else(|| panic!("no RUNCELL_URL export in the banner:\n{text}"));
    assert!(
        line.contains("export RUNCELL_URL=http://127.0.0.1:"),
        "{line}"
    );
    assert!(line.contains("RUNCELL_API_KEY=$(cat "), "{line}");
    assert!(line.contains("/api-key)"), "{line}");
}

/// A data directory under a 0700 directory (a home such as /root): sandboxes
/// (an unprivileged host uid) cannot traverse it, so `serve` must refuse to
/// start and say which directory and how to fix it, not answer every create
/// with 503.
/// Runs `serve` with `args` (under a fresh 0700 directory) and returns its
/// failure output; panics if it is still running after 10 s.
fn serve_fails(args: &[&std::ffi::OsStr]) -> String {
    let port = free_port();
    let started = Instant::now();
    let mut child = serve_command(Path::new(RUNCELL), port)
        .args(args)
        .args(BY_HAND)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if started.elapsed() > Duration::from_secs(10) {
            let _ = child.kill();
            let _ = child.wait();
            panic!("serve started with a directory sandboxes cannot traverse: {args:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut err = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    assert!(!status.success(), "{err}");
    err
}

/// A data (or templates) directory under a 0700 directory (a home such as
/// /root): sandboxes (an unprivileged host uid) cannot traverse it, so
/// `serve` must refuse to start and say which directory and how to fix it,
/// not answer every create with 503.
#[test]
fn serve_refuses_a_data_directory_sandboxes_cannot_traverse() {
    use std::os::unix::fs::PermissionsExt;
    let home = data_dir("private-home");
    std::fs::create_dir_all(&home).unwrap();
    std::fs::set_permissions(&home, std::fs::Permissions::from_mode(0o700)).unwrap();
    let data = home.join("runcell-data");
    let err = serve_fails(&["--data-dir".as_ref(), data.as_os_str()]);
    let shown = home.display().to_string();
    assert!(err.contains(&data.display().to_string()), "{err}");
    assert!(err.contains(&format!("chmod o+x {shown}")), "{err}");
    assert!(err.contains("--data-dir /var/lib/runcell"), "{err}");

    // The same for the templates directory, with a usable data directory.
    let usable = data_dir("usable-data");
    let templates = home.join("templates");
    let err = serve_fails(&[
        "--data-dir".as_ref(),
        usable.as_os_str(),
        "--templates-dir".as_ref(),
        templates.as_os_str(),
    ]);
    assert!(err.contains(&templates.display().to_string()), "{err}");
    assert!(err.contains("templates directory"), "{err}");
    assert!(err.contains(&format!("chmod o+x {shown}")), "{err}");
    let _ = std::fs::remove_dir_all(&home);
    let _ = std::fs::remove_dir_all(&usable);
}

/// A plain HTTP server on the host's loopback that answers `hello, host`.
fn host_listener() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for c in l.incoming() {
            let Ok(mut c) = c else { continue };
            let mut buf = [0u8; 4096];
            let _ = c.set_read_timeout(Some(Duration::from_secs(2)));
            let _ = c.read(&mut buf);
            let _ = c.write_all(
                b"HTTP/1.1 200 OK\r\nContent-Length: 12\r\nConnection: close\r\n\r\nhello, host\n",
            );
        }
    });
    port
}

/// What a request from inside the sandbox through its egress proxy gets:
/// the HTTP status and body, or curl's failure.
async fn through_proxy(d: &Daemon, id: &str, port: u16) -> String {
    // NO_PROXY lists loopback (the sandbox's own); force the proxy.
    let (status, r) = d
        .exec(
            id,
            &format!(
                "env -u NO_PROXY -u no_proxy curl -sS -m 10 -x http://127.0.0.1:3128 \
                 -w ' status=%{{http_code}}' http://127.0.0.1:{port}/; echo \" rc=$?\""
            ),
        )
        .await;
    assert_eq!(status, 200, "{r}");
    format!(
        "{}{}",
        r["stdout"].as_str().unwrap(),
        r["stderr"].as_str().unwrap()
    )
}

/// The policy survives a daemon that is killed and started again: the
/// sandbox's view shows it, the allowed host is reached through the proxy
/// and a host outside the allowlist is still refused (not `none`, not open).
#[tokio::test(flavor = "multi_thread")]
async fn reattached_sandbox_keeps_its_egress_policy() {
    let allowed = host_listener();
    let other = host_listener();
    // The operator opens both loopback ports; only the policy tells them apart.
    let flags = [
        format!("--egress-allow-private=127.0.0.1:{allowed}"),
        format!("--egress-allow-private=127.0.0.1:{other}"),
    ];
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let data = data_dir("egress-restart");
    let mut d = Daemon::start(&data, free_port(), &flags);
    let id = d
        .create(
            json!({"network": {"mode": "allowlist", "allow": [format!("127.0.0.1:{allowed}")]}}),
        )
        .await;
    let before_ok = through_proxy(&d, &id, allowed).await;
    assert_let_through(&before_ok);
    let before_refused = through_proxy(&d, &id, other).await;
    assert!(before_refused.contains("status=403"), "{before_refused}");

    // A policy set later (PATCH) is kept as well.
    let patched = d.create(json!({"network": "none"})).await;
    let status = d
        .status(
            Method::PATCH,
            &format!("/v1/sandboxes/{patched}/network"),
            Some(json!({"mode": "allowlist", "allow": [format!("127.0.0.1:{allowed}")]})),
        )
        .await;
    assert_eq!(status, 200);

    d.kill9();
    let d = Daemon::start(&data, free_port(), &flags);
    let after = through_proxy(&d, &patched, allowed).await;
    assert_let_through(&after);
    let view = d.sandbox(&id).await;
    assert_eq!(view["network"]["mode"], "allowlist", "{view}");
    assert_eq!(
        view["network"]["allow"],
        json!([format!("127.0.0.1:{allowed}")]),
        "{view}"
    );
    let after_ok = through_proxy(&d, &id, allowed).await;
    assert_let_through(&after_ok);
    let after_refused = through_proxy(&d, &id, other).await;
    assert!(after_refused.contains("status=403"), "{after_refused}");
    d.delete_all().await;
}

/// Where the end-to-end build test keeps its templates between runs on the
/// same machine (the Debian base layer is bootstrapped once).
const TEMPLATE_CACHE: &str = "/var/cache/runcell-test/templates";

/// What the new user's first `code-interpreter` sandbox must offer: the data
/// stack from the template's own Debian (its dpkg database lists it; the
/// `host` template has no /var/lib/dpkg at all).
const DATA_STACK: &str = "python3 -c 'import numpy, pandas, matplotlib; \
     print(\"stack\", numpy.__version__, pandas.__version__, matplotlib.__version__)' \
     && grep -c '^Package: python3-pandas$' /var/lib/dpkg/status \
     && grep VERSION_CODENAME /etc/os-release";

/// `serve` with --auto-build (the default) on a machine without the
/// template: code-interpreter is served from host, says so, builds in the
/// background (progress in the template view), then new sandboxes get the
/// built template without a restart; a second start reuses it. The Debian
/// base layer is cached in TEMPLATE_CACHE across runs, the apt-get step is
/// built for real each run.
#[tokio::test(flavor = "multi_thread")]
async fn first_start_builds_code_interpreter_and_a_second_start_reuses_it() {
    let cache = std::path::Path::new(TEMPLATE_CACHE);
    std::fs::create_dir_all(cache).unwrap();
    // Uninstall the template left by an earlier run and drop every layer but
    // the bootstrapped base, so this daemon has to build (run apt-get).
    let manifest = cache.join("code-interpreter/template.json");
    if let Ok(raw) = std::fs::read(&manifest) {
        let m: Value = serde_json::from_slice(&raw).unwrap();
        for key in m["layers"].as_array().unwrap().iter().skip(1) {
            let layer = cache.join(".layers").join(key.as_str().unwrap());
            std::fs::remove_dir_all(&layer).unwrap();
        }
    }
    let _ = std::fs::remove_dir_all(cache.join("code-interpreter"));
    let started = Instant::now();
    let flags = ["--auto-build=true", "--templates-dir", TEMPLATE_CACHE];
    let d = Daemon::start(&data_dir("autobuild"), free_port(), &flags);

    // While it builds: served from host, and said so.
    let view = d.get_ok("/v1/templates/code-interpreter").await;
    assert_eq!(view["alias_of"], "host", "{view}");
    assert_eq!(view["building"], true, "{view}");
    let state = view["build"]["state"].as_str().unwrap_or_default();
    assert!(state == "queued" || state == "building", "{view}");
    let early = d.create_json(json!({"template": "code-interpreter"})).await;
    assert_eq!(early["alias_of"], "host", "{early}");
    assert_eq!(early["building"], true, "{early}");
    let early_id = early["id"].as_str().unwrap();
    let (_, r) = d
        .exec(early_id, "test -e /var/lib/dpkg/status; echo dpkg=$?")
        .await;
    assert!(r["stdout"].as_str().unwrap().contains("dpkg=1"), "{r}");
    d.delete(early_id).await;

    // Progress until ready (bounded: a first run bootstraps Debian too).
    let mut steps = std::collections::BTreeSet::new();
    let until = Instant::now() + Duration::from_secs(1200);
    let view = loop {
        let view = d.get_ok("/v1/templates/code-interpreter").await;
        if let Some(step) = view["build"]["step"].as_str() {
            steps.insert(step.to_string());
        }
        match view["build"]["state"].as_str() {
            Some("ready") => break view,
            Some("failed") => panic!("the build failed: {view}"),
            _ => {}
        }
        assert!(
            Instant::now() < until,
            "the build did not finish in 20 min: {view}"
        );
        tokio::time::sleep(Duration::from_secs(2)).await;
    };
    let build_secs = started.elapsed().as_secs_f64();
    eprintln!("code-interpreter built in {build_secs:.0} s; steps seen: {steps:?}");
    assert!(steps.iter().any(|s| s.contains("RUN apt-get")), "{steps:?}");
    assert!(view["alias_of"].is_null(), "{view}");
    assert_eq!(view["building"], false, "{view}");

    // New sandboxes get the built template, without a restart.
    let built = d.create_json(json!({"template": "code-interpreter"})).await;
    assert!(built["alias_of"].is_null(), "{built}");
    let id = built["id"].as_str().unwrap();
    let (_, r) = d.exec(id, DATA_STACK).await;
    assert_eq!(r["exit_code"], 0, "{r}");
    let out = r["stdout"].as_str().unwrap();
    assert!(out.contains("stack ") && out.contains("bookworm"), "{r}");
    d.delete(id).await;

    // Its warm pool (the default `code-interpreter=2`) starts too, without a
    // restart, and serves the next create.
    let until = Instant::now() + Duration::from_secs(120);
    loop {
        let text = d.metrics().await;
        if text.contains("runcell_warm_pool_ready{template=\"code-interpreter\"} 2") {
            break;
        }
        assert!(
            Instant::now() < until,
            "the code-interpreter warm pool did not fill within 2 min of the build:\n{}",
            text.lines()
                .filter(|l| l.contains("warm_pool"))
                .collect::<Vec<_>>()
                .join("\n")
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    // (The create above may have been a hit already, if the pool filled
    // before it: count from here.)
    let hits = "runcell_warm_pool_hits_total{template=\"code-interpreter\"}";
    let before = d.metric(hits).await.unwrap_or(0.0);
    let pooled = d.create_json(json!({"template": "code-interpreter"})).await;
    let after = d.metric(hits).await.unwrap_or(0.0);
    assert_eq!(after, before + 1.0, "{}", d.metrics().await);
    d.delete(pooled["id"].as_str().unwrap()).await;
    drop(d);

    // A second start finds it installed: no build, served at once.
    let t0 = Instant::now();
    let d = Daemon::start(&data_dir("autobuild-again"), free_port(), &flags);
    let view = d.get_ok("/v1/templates/code-interpreter").await;
    assert!(view["alias_of"].is_null(), "{view}");
    assert!(
        view.get("build").is_none(),
        "a second start built again: {view}"
    );
    let again = d.create_json(json!({"template": "code-interpreter"})).await;
    let id = again["id"].as_str().unwrap();
    let (_, r) = d.exec(id, DATA_STACK).await;
    assert_eq!(r["exit_code"], 0, "{r}");
    assert!(t0.elapsed() < Duration::from_secs(60), "{:?}", t0.elapsed());
    d.delete(id).await;
}
