//! `runcell template build|ls|rm` end to end: the real binary, a real
//! debootstrap of Debian bookworm (needs root, the network to the Debian
//! archive and debootstrap installed; none of them is optional), real
//! sandboxes. Debootstrap takes a minute or more, so one test runs the whole
//! sequence on one templates directory and every later build reuses the base
//! layer from the cache.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use reqwest::Method;
use runcell_testkit::{free_port, Daemon};

const STATE: &str = "/run/runcell-test/template";
const TEMPLATES: &str = "/var/lib/runcell-test-template";
const CONTEXT: &str = "/var/lib/runcell-test-template-context";
/// Beside the context, for a COPY that tries to escape it.
const SECRET: &str = "/var/lib/runcell-test-template-secret";

fn runcell(templates: &Path) -> Command {
    let euid = nix::unistd::geteuid().as_raw();
    assert_eq!(
        euid, 0,
        "template builds run debootstrap and create real sandboxes: run as root (CI does)"
    );
    let mut c = Command::new(env!("CARGO_BIN_EXE_runcell"));
    c.env("RUNCELL_STATE_DIR", STATE)
        .env("RUNCELL_TEMPLATES_DIR", templates);
    c
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn show(out: &Output) -> String {
    format!(
        "status {:?}\n--- stdout ---\n{}\n--- stderr ---\n{}",
        out.status.code(),
        text(&out.stdout),
        text(&out.stderr)
    )
}

fn build(templates: &Path, name: &str, recipe: &Path, context: &Path) -> (Output, Duration) {
    let t0 = Instant::now();
    let out = runcell(templates)
        .args(["template", "build", name, "-f"])
        .arg(recipe)
        .arg("--context")
        .arg(context)
        .output()
        .expect("runcell runs");
    (out, t0.elapsed())
}

/// Layer directories and unfinished (`.tmp-*`) ones.
fn layer_dirs(templates: &Path) -> (Vec<String>, Vec<String>) {
    let mut done = Vec::new();
    let mut tmp = Vec::new();
    for e in std::fs::read_dir(templates.join(".layers"))
        .unwrap()
        .flatten()
    {
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with(".tmp-") {
            tmp.push(name);
        } else if e.path().is_dir() {
            done.push(name);
        }
    }
    (done, tmp)
}

const RECIPE: &str = r#"# Every instruction runcell supports.
FROM debian:bookworm
RUN echo "run as $(id -un)" \
 && useradd --create-home --uid 1001 --shell /bin/bash analyst
ENV GREETING=hello MODE="two words"
ENV PLAIN a value with spaces
WORKDIR /srv/app
COPY data.txt ./
COPY sub /opt/sub/
RUN ["/bin/sh", "-c", "echo exec-form > /srv/app/exec.txt && ls /srv/app"]
LABEL description="runcell test template" runcell.memory=512M runcell.timeout=30s runcell.preload="json os"
USER analyst
RUN id -un > /tmp/built-by && echo "$GREETING from $HOME"
"#;

#[test]
fn build_run_cache_fail_and_remove() {
    let templates = PathBuf::from(TEMPLATES);
    let _ = std::fs::remove_dir_all(&templates);
    let ctx = PathBuf::from(CONTEXT);
    let _ = std::fs::remove_dir_all(&ctx);
    std::fs::create_dir_all(ctx.join("sub")).unwrap();
    std::fs::write(ctx.join("data.txt"), "from the context\n").unwrap();
    std::fs::write(ctx.join("sub/nested.txt"), "nested\n").unwrap();
    std::fs::write(SECRET, "secret\n").unwrap();
    let recipe = ctx.join("Dockerfile");
    std::fs::write(&recipe, RECIPE).unwrap();
    let steps = 11;

    // 1. The first build: debootstrap, then every step for real.
    let (out, first) = build(&templates, "testimg", &recipe, &ctx);
    assert!(out.status.success(), "first build failed:\n{}", show(&out));
    let stdout = text(&out.stdout);
    for want in [
        format!("Step 1/{steps} : FROM debian:bookworm"),
        format!("Step 2/{steps} : RUN echo"),
        "run as root".to_string(),
        format!("Step {steps}/{steps} : RUN id -un"),
        "hello from /home/analyst".to_string(),
        "exec.txt".to_string(),
        "Built template testimg".to_string(),
    ] {
        assert!(stdout.contains(&want), "missing {want:?}:\n{}", show(&out));
    }
    assert!(!stdout.contains("CACHED"), "{}", show(&out));
    eprintln!(
        "first build (debootstrap included): {:.1} s",
        first.as_secs_f64()
    );

    // A sandbox from the template sees its files, environment, working
    // directory and user; the template itself stays read-only.
    let out = runcell(&templates)
        .args(["run", "bash", "--template", "testimg", "-c"])
        .arg(
            "pwd; id -un; echo \"$GREETING|$MODE|$PLAIN\"; cat data.txt exec.txt /opt/sub/nested.txt /tmp/built-by; \
             stat -c %a /tmp; (echo x > /srv/app/data.txt) 2>/dev/null || echo read-only",
        )
        .output()
        .unwrap();
    assert_eq!(
        text(&out.stdout),
        "/srv/app\nanalyst\nhello|two words|a value with spaces\nfrom the context\nexec-form\nnested\nanalyst\n1777\nread-only\n",
        "{}",
        show(&out)
    );
    let out = runcell(&templates)
        .args(["template", "ls"])
        .output()
        .unwrap();
    let ls = text(&out.stdout);
    assert!(
        ls.lines()
            .any(|l| l.starts_with("testimg ") && l.contains("runcell test template")),
        "{}",
        show(&out)
    );
    let manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(templates.join("testimg/template.json")).unwrap())
            .unwrap();
    assert_eq!(manifest["defaults"]["memory_bytes"], 512 << 20);
    assert_eq!(manifest["defaults"]["timeout_secs"], 30);
    assert_eq!(
        manifest["defaults"]["preload"],
        serde_json::json!(["json", "os"])
    );
    assert_eq!(manifest["workdir"], "/srv/app");
    assert_eq!(manifest["user"]["name"], "analyst");
    assert_eq!(manifest["env"]["MODE"], "two words");

    daemon_serves(&templates);

    // 2. A rebuild with nothing changed takes every step from the cache.
    let (out, again) = build(&templates, "testimg", &recipe, &ctx);
    assert!(out.status.success(), "rebuild failed:\n{}", show(&out));
    let stdout = text(&out.stdout);
    assert_eq!(stdout.matches("CACHED").count(), steps, "{}", show(&out));
    assert!(
        !stdout.contains("hello from"),
        "a RUN step ran again:\n{}",
        show(&out)
    );
    assert!(
        again < Duration::from_secs(5),
        "the cached rebuild took {again:?}"
    );
    eprintln!("cached rebuild: {:.2} s", again.as_secs_f64());
    // Changing a copied file invalidates that step and the ones after it only.
    std::fs::write(ctx.join("data.txt"), "changed\n").unwrap();
    let (out, _) = build(&templates, "testimg", &recipe, &ctx);
    assert!(out.status.success(), "{}", show(&out));
    // FROM, RUN, ENV, ENV and WORKDIR are cached; the COPY and what follows are not.
    assert_eq!(
        text(&out.stdout).matches("CACHED").count(),
        5,
        "{}",
        show(&out)
    );
    let out = runcell(&templates)
        .args(["run", "bash", "--template", "testimg", "-c", "cat data.txt"])
        .output()
        .unwrap();
    assert_eq!(text(&out.stdout), "changed\n", "{}", show(&out));

    // 3. A failing RUN step reports its output and status and installs nothing.
    let bad = ctx.join("Dockerfile.bad");
    std::fs::write(
        &bad,
        "FROM debian:bookworm\nRUN touch /half-done\nRUN echo boom >&2; exit 3\n",
    )
    .unwrap();
    let (out, _) = build(&templates, "broken", &bad, &ctx);
    assert_eq!(out.status.code(), Some(1), "{}", show(&out));
    let stderr = text(&out.stderr);
    assert!(stderr.contains("boom"), "{}", show(&out));
    assert!(
        stderr.contains("Step 3/3 (line 3) failed") && stderr.contains("exited with status 3"),
        "{}",
        show(&out)
    );
    assert!(
        text(&out.stdout).contains(" ---> CACHED"),
        "the base came from the cache"
    );
    assert!(!templates.join("broken").exists());
    let out = runcell(&templates)
        .args(["template", "ls"])
        .output()
        .unwrap();
    assert!(!text(&out.stdout).contains("broken"), "{}", show(&out));
    assert!(
        layer_dirs(&templates).1.is_empty(),
        "an unfinished layer was left"
    );

    // Errors that stop a build before it runs anything.
    for (recipe, want) in [
        (
            "FROM debian:bookworm\nEXPOSE 80\n",
            "Line 2: EXPOSE is not supported; the supported instructions are FROM, RUN, ENV, WORKDIR, COPY, USER, LABEL.",
        ),
        (
            "FROM debian:bookworm\nCOPY ../runcell-test-template-secret /x\n",
            "is outside the build context",
        ),
        ("FROM no-such-template\nRUN true\n", "Unknown template \"no-such-template\""),
    ] {
        std::fs::write(&bad, recipe).unwrap();
        let (out, _) = build(&templates, "broken", &bad, &ctx);
        assert_ne!(out.status.code(), Some(0), "{}", show(&out));
        assert!(text(&out.stderr).contains(want), "want {want:?}:\n{}", show(&out));
        assert!(!templates.join("broken").exists());
    }

    // 4. Removing the template collects every layer nothing else uses.
    let (before, _) = layer_dirs(&templates);
    assert!(before.len() >= 6, "{before:?}");
    let out = runcell(&templates)
        .args(["template", "rm", "testimg"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", show(&out));
    assert!(text(&out.stdout).contains("Removed template testimg"));
    assert_eq!(layer_dirs(&templates), (vec![], vec![]));
    let out = runcell(&templates)
        .args(["run", "bash", "--template", "testimg", "-c", "true"])
        .output()
        .unwrap();
    assert!(
        text(&out.stderr).contains("Unknown template \"testimg\"; installed templates: host."),
        "{}",
        show(&out)
    );

    let _ = std::fs::remove_dir_all(&templates);
    let _ = std::fs::remove_dir_all(&ctx);
    let _ = std::fs::remove_file(SECRET);
}

/// `runcell serve` lists the layered template with its defaults and creates
/// sandboxes from it.
fn daemon_serves(templates: &Path) {
    let data = PathBuf::from("/var/lib/runcell-test-template-daemon");
    let _ = std::fs::remove_dir_all(&data);
    // The same environment as `runcell(templates)`, as flags.
    let flags: [&OsStr; 7] = [
        "--state-dir".as_ref(),
        STATE.as_ref(),
        "--templates-dir".as_ref(),
        templates.as_ref(),
        "--auto-build=false".as_ref(),
        "--standby".as_ref(),
        "0".as_ref(),
    ];
    let d = Daemon::spawn(
        Path::new(env!("CARGO_BIN_EXE_runcell")),
        &data,
        free_port(),
        flags,
    );
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let list: serde_json::Value = d.get("/v1/templates").await;
        let t = list
            .as_array()
            .unwrap()
            .iter()
            .find(|t| t["name"] == "testimg")
            .unwrap_or_else(|| panic!("testimg is not listed: {list}"));
        assert_eq!(t["description"], "runcell test template", "{t}");
        assert_eq!(t["memory_mb"], 512, "{t}");
        assert_eq!(t["defaults"]["preload"], serde_json::json!(["json", "os"]));
        assert!(t["size_bytes"].as_u64().unwrap() > 50 << 20, "{t}");

        let (_, r) = d
            .post("/v1/sandboxes", serde_json::json!({"template": "testimg"}))
            .await;
        let id = r["id"]
            .as_str()
            .unwrap_or_else(|| panic!("{r}"))
            .to_string();
        let (_, r) = d.exec(&id, "pwd; id -un; echo $GREETING").await;
        assert_eq!(r["stdout"], "/srv/app\nanalyst\nhello\n", "{r}");
        let s = d
            .status(Method::DELETE, &format!("/v1/sandboxes/{id}"), None)
            .await;
        assert!((200..300).contains(&s), "{s}");
    });
    drop(d);
    let _ = std::fs::remove_dir_all(&data);
}
