//! `runcell` is two binaries: `runcell` runs `runcell run` and the commands
//! on a daemon's sandboxes itself and hands every other command line to
//! `runcell-full`, installed beside it. Needs root (the run makes a real
//! sandbox).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn scratch() -> PathBuf {
    let euid = nix::unistd::geteuid().as_raw();
    assert_eq!(
        euid, 0,
        "this test creates a real sandbox and must run as root (CI runs it as root)"
    );
    let d = PathBuf::from(format!("/run/runcell-test/binaries-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn runcell(dir: &Path, args: &[&str]) -> Output {
    let agent = Path::new(env!("CARGO_BIN_EXE_runcell")).with_file_name("runcell-agent");
    Command::new(dir.join("runcell"))
        .args(args)
        .env("RUNCELL_AGENT", agent)
        .env("RUNCELL_STATE_DIR", dir.join("state"))
        .env("RUNCELL_RUN_DAEMON", "never")
        .output()
        .unwrap()
}

#[test]
fn runcell_runs_code_and_remote_commands_itself_and_hands_the_rest_to_runcell_full() {
    let dir = scratch();
    std::fs::copy(env!("CARGO_BIN_EXE_runcell"), dir.join("runcell")).unwrap();

    // Alone, it runs code: the whole of `runcell run` is in it.
    let o = runcell(&dir, &["run", "python", "-c", "print(6 * 7)"]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert_eq!(text(&o.stdout), "42\n");

    // So are the commands on a daemon's sandboxes: this one reaches for the
    // daemon (none answers on that port) rather than for runcell-full.
    let o = Command::new(dir.join("runcell"))
        .args(["sandbox", "ls"])
        .env("RUNCELL_URL", "http://127.0.0.1:9")
        .env("RUNCELL_API_KEY", "k")
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(
        text(&o.stderr).contains("Could not reach the runcell daemon")
            && !text(&o.stderr).contains("runcell-full"),
        "{}",
        text(&o.stderr)
    );

    // Any other command line names what is missing, as runcell's own failure.
    for args in [
        &["--version"][..],
        &["serve", "--help"],
        &["run", "--help"],
        &["doctor"],
    ] {
        let o = runcell(&dir, args);
        assert_eq!(o.status.code(), Some(125), "{args:?}: {}", text(&o.stderr));
        assert!(
            text(&o.stderr).contains("runcell-full") && text(&o.stdout).is_empty(),
            "{args:?}: {}",
            text(&o.stderr)
        );
    }

    // Beside runcell-full, it answers them as ever, under its own name.
    std::fs::copy(env!("CARGO_BIN_EXE_runcell-full"), dir.join("runcell-full")).unwrap();
    let o = runcell(&dir, &["--version"]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert!(
        text(&o.stdout).starts_with("runcell "),
        "{}",
        text(&o.stdout)
    );
    let o = runcell(&dir, &["run", "--help"]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert!(
        text(&o.stdout).contains("Usage: runcell run"),
        "{}",
        text(&o.stdout)
    );
    let o = runcell(&dir, &["run", "no-such-language", "-c", "x"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o.stderr));
    let _ = std::fs::remove_dir_all(&dir);
}
