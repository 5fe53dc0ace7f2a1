//! The `runcell run` tests, shared by `run.rs` (every run in the `runcell`
//! process) and `run_daemon.rs` (every run through a daemon's standby pool):
//! output, exit status, limits and failures must be the same either way.
//! Each includer provides `runner()`, whose `cmd()` is a `runcell` command
//! set up for its way.

use std::io::{BufRead, BufReader, Write};
use std::process::{Output, Stdio};
use std::time::{Duration, Instant};

fn run(r: &super::Runner, args: &[&str]) -> Output {
    r.cmd().args(args).output().expect("runcell runs")
}

/// `runcell run python ARGS` with a fresh runner: its output.
fn python(args: &[&str]) -> Output {
    run(&super::runner(), &[&["run", "python"][..], args].concat())
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Host processes whose argv[0] is `marker` (set with `exec -a`). Only
/// argv[0] counts: the `runcell run` process itself carries the marker in
/// its later arguments.
fn host_processes_with(marker: &str) -> usize {
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter(|e| {
            std::fs::read(e.path().join("cmdline"))
                .map(|c| c.split(|&b| b == 0).next() == Some(marker.as_bytes()))
                .unwrap_or(false)
        })
        .count()
}

#[test]
fn python_prints_42() {
    let out = python(&["-c", "print(6*7)"]);
    assert_eq!(text(&out.stdout), "42\n", "{}", text(&out.stderr));
    assert_eq!(out.status.code(), Some(0));
}

#[test]
fn javascript_from_standard_input() {
    let r = super::runner();
    let mut child = r
        .cmd()
        .args(["run", "javascript", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(b"console.log(1+1)\n")
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert_eq!(text(&out.stdout), "2\n");
    assert!(out.status.success());
}

#[test]
fn bash_script_file_with_limits_and_its_exit_status() {
    let r = super::runner();
    let dir = std::env::temp_dir().join(format!("runcell-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let script = dir.join("script.sh");
    std::fs::write(&script, "echo \"args: $*\"\necho oops >&2\nexit 3\n").unwrap();
    let out = run(
        &r,
        &[
            "run",
            "bash",
            script.to_str().unwrap(),
            "--timeout",
            "5",
            "--memory",
            "256M",
            "--",
            "a",
            "b",
        ],
    );
    assert_eq!(text(&out.stdout), "args: a b\n");
    assert_eq!(text(&out.stderr), "oops\n");
    assert_eq!(out.status.code(), Some(3));
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn unknown_language_is_a_clear_error() {
    let r = super::runner();
    let out = run(&r, &["run", "cobol", "-c", "DISPLAY 'HI'"]);
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(
        text(&out.stderr),
        "runcell: Unknown language \"cobol\"; known languages are python, javascript and bash.\n"
    );
}

#[test]
fn stderr_comes_back_verbatim() {
    let r = super::runner();
    let out = run(
        &r,
        &["run", "python", "-c", "import definitely_not_installed"],
    );
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert!(
        err.starts_with("Traceback (most recent call last):\n"),
        "{err}"
    );
    assert!(
        err.ends_with("ModuleNotFoundError: No module named 'definitely_not_installed'\n"),
        "{err}"
    );
}

#[test]
fn infinite_loop_times_out_with_a_message_and_nothing_is_left() {
    let r = super::runner();
    let started = Instant::now();
    let out = run(
        &r,
        &["run", "python", "-c", "while True: pass", "--timeout", "1"],
    );
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(out.status.code(), Some(124));
    assert_eq!(
        text(&out.stderr),
        "runcell: Execution exceeded the 1 s timeout and was stopped.\n"
    );
}

#[test]
fn a_gibibyte_of_output_is_cut_with_a_marker_and_the_total() {
    let r = super::runner();
    let out = run(&r, &["run", "bash", "-c", "head -c 1073741824 /dev/zero"]);
    assert_eq!(out.stdout.len(), 1 << 20);
    assert!(
        text(&out.stderr)
            .contains("stdout truncated; the program wrote 1073741824 bytes (1 GiB) in total"),
        "{}",
        text(&out.stderr)
    );
    assert_eq!(out.status.code(), Some(0));
}

#[test]
fn memory_limit_reports_oom() {
    let out = python(&["-c", "x = bytearray(512 << 20)", "--memory", "128M"]);
    assert_eq!(out.status.code(), Some(137), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("ran out of memory (limit 128 MiB)"),
        "{}",
        text(&out.stderr)
    );
}

/// The sandbox's files and programs do not take the caller's umask (a
/// service started with `UMask=0077`, say): the code file stays readable
/// to the user who runs it, and its programs start from 022.
#[test]
fn a_strict_umask_of_the_caller_changes_nothing_in_the_sandbox() {
    let r = super::runner();
    let inner = r.cmd();
    // `umask 077`, then this runner's `runcell` with its environment.
    let mut strict = std::process::Command::new("sh");
    strict
        .args(["-c", "umask 077 && exec \"$0\" \"$@\""])
        .arg(inner.get_program());
    for (k, v) in inner.get_envs() {
        match v {
            Some(v) => strict.env(k, v),
            None => strict.env_remove(k),
        };
    }
    let out = strict
        .args([
            "run",
            "bash",
            "-c",
            "umask; stat -c %a /tmp \"$HOME\"; cd; echo hi > f; stat -c %a f; cat f",
        ])
        .output()
        .unwrap();
    assert_eq!(
        text(&out.stdout),
        "0022\n1777\n755\n644\nhi\n",
        "{}",
        text(&out.stderr)
    );
    assert_eq!(out.status.code(), Some(0));
}

#[test]
fn the_callers_environment_never_reaches_the_sandbox() {
    let r = super::runner();
    let secret = format!("hunter2-{}", std::process::id());
    let out = r
        .cmd()
        .env("RUNCELL_TEST_SECRET", &secret)
        .env("AWS_SECRET_ACCESS_KEY", &secret)
        .args([
            "run",
            "bash",
            "-c",
            "env; cat /proc/*/environ 2>/dev/null | tr '\\0' '\\n'; ls /proc",
        ])
        .output()
        .unwrap();
    let all = text(&out.stdout) + &text(&out.stderr);
    assert!(!all.contains(&secret), "{all}");
    assert!(!all.contains("RUNCELL_TEST_SECRET"));
}

#[test]
fn output_streams_as_it_comes() {
    let r = super::runner();
    let mut child = r
        .cmd()
        .args([
            "run",
            "python",
            "-c",
            "import time\nprint('first', flush=True)\ntime.sleep(2)\nprint('second')",
        ])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let started = Instant::now();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    assert_eq!(lines.next().unwrap().unwrap(), "first");
    let first_at = started.elapsed();
    assert_eq!(lines.next().unwrap().unwrap(), "second");
    assert!(
        first_at < Duration::from_millis(1500),
        "first line after {first_at:?}"
    );
    assert!(child.wait().unwrap().success());
}

#[test]
fn daemons_do_not_outlive_runcell_run() {
    let r = super::runner();
    let marker = format!("runcell-cli-escape-{}", std::process::id());
    let out = run(
        &r,
        &[
            "run",
            "bash",
            "-c",
            &format!("(setsid bash -c 'exec -a {marker} sleep 300' &); sleep 0.2; echo forked"),
        ],
    );
    assert_eq!(text(&out.stdout), "forked\n");
    assert_eq!(host_processes_with(&marker), 0);
}

#[test]
fn killing_runcell_stops_its_sandbox_and_the_next_run_sweeps_it() {
    let r = super::runner();
    let marker = format!("runcell-cli-orphan-{}", std::process::id());
    let mut child = r
        .cmd()
        .args(["run", "bash", "-c", &format!("exec -a {marker} sleep 300")])
        .spawn()
        .unwrap();
    let until = Instant::now() + Duration::from_secs(10);
    while host_processes_with(&marker) == 0 && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(host_processes_with(&marker), 1);
    // SIGKILL: runcell gets no chance to clean up.
    child.kill().unwrap();
    child.wait().unwrap();
    let until = Instant::now() + Duration::from_secs(5);
    while host_processes_with(&marker) > 0 && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(
        host_processes_with(&marker),
        0,
        "the sandbox outlived its owner"
    );
    assert!(
        r.nothing_left(Duration::from_secs(15)),
        "the killed run's sandbox was never removed"
    );
}

#[test]
fn output_bytes_come_back_exactly_as_written() {
    let r = super::runner();
    // Every byte value on stdout, and bytes that are not UTF-8 on stderr.
    let out = run(
        &r,
        &[
            "run",
            "python",
            "-c",
            "import sys\nsys.stdout.buffer.write(bytes(range(256)))\nsys.stderr.buffer.write(b'\\xff\\xfe\\xc3(')",
        ],
    );
    assert_eq!(
        out.stdout,
        (0..=255u8).collect::<Vec<u8>>(),
        "{}",
        text(&out.stderr)
    );
    assert_eq!(out.stderr, b"\xff\xfe\xc3(");
    assert_eq!(out.status.code(), Some(0));
}

#[test]
fn a_process_limit_is_reported() {
    let out = python(&[
        "--pids",
        "16",
        "-c",
        "import os, time\n\
             try:\n\
             \x20   for _ in range(64):\n\
             \x20       if os.fork() == 0:\n\
             \x20           time.sleep(2); os._exit(0)\n\
             except OSError as e: print('fork failed', e.errno)\n",
    ]);
    assert_eq!(
        text(&out.stdout),
        "fork failed 11\n",
        "{}",
        text(&out.stderr)
    );
    assert_eq!(
        text(&out.stderr),
        "runcell: The sandbox reached its process limit (16); new processes could not be started.\n"
    );
    assert_eq!(out.status.code(), Some(0));
}
