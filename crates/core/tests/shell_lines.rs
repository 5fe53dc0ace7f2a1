//! A string command that is one simple command runs its program without
//! bash in front of it (the agent's `shell` module); everything a program
//! or a user can see must be what `bash -c LINE` gives. Each line is run
//! as it is and with a `;` after it, which keeps the shell (bash 5 still
//! execs the last command of a list, so the two must match byte for byte).

mod common;

use common::*;
use runcell_core::ExecResult;

fn lines(out: &[u8]) -> Vec<String> {
    let mut l: Vec<String> = text(out).lines().map(str::to_string).collect();
    l.sort();
    l
}

fn same(line: &str, direct: &ExecResult, shell: &ExecResult) {
    assert_eq!(
        direct.outcome.status(),
        shell.outcome.status(),
        "{line:?}: {direct:?} / {shell:?}"
    );
    assert_eq!(lines(&direct.stdout), lines(&shell.stdout), "{line:?}");
    assert_eq!(text(&direct.stderr), text(&shell.stderr), "{line:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_simple_line_runs_as_bash_runs_it_and_bash_takes_over_where_it_cannot() {
    let rt = runtime(&unique("shell-lines"));
    let sb = sandbox(&rt, limits()).await;
    let setup = sh(
        &sb,
        "printf 'echo from-script $0 $1\\n' > /tmp/noshebang && chmod 755 /tmp/noshebang \
         && printf data > /tmp/data && chmod 644 /tmp/data \
         && printf '#!/nonexistent/interp\\n' > /tmp/badinterp && chmod 755 /tmp/badinterp \
         && mkdir -p /tmp/real && ln -s /tmp/real /tmp/link",
    )
    .await;
    assert_eq!(setup.outcome.status(), 0, "{setup:?}");

    // The environment a program gets: what bash adds, nothing else.
    let env = sh(&sb, "/usr/bin/env").await;
    let got = lines(&env.stdout);
    for want in ["SHLVL=0", "_=/usr/bin/env"] {
        assert!(got.contains(&want.to_string()), "{want} in {got:?}");
    }
    same("/usr/bin/env", &env, &sh(&sb, "/usr/bin/env;").await);

    for line in [
        "env",
        "printenv PWD SHLVL _ HOME",
        "python3 -c pass",
        "ls -a /tmp/real",
        // Not executable by the sandbox user: bash's words, 126.
        "/tmp/data",
        // A script without `#!`: bash runs it itself.
        "/tmp/noshebang one",
        // Its interpreter is missing.
        "/tmp/badinterp",
        // Not on PATH: bash's words, 127.
        "no-such-program-here arg",
        "/no/such/path",
        // A directory.
        "/tmp",
    ] {
        let direct = sh(&sb, line).await;
        same(line, &direct, &sh(&sb, &format!("{line};")).await);
    }
    let r = sh(&sb, "/tmp/noshebang one").await;
    assert_eq!(
        (r.outcome.status(), text(&r.stdout)),
        (0, "from-script /tmp/noshebang one\n".into())
    );
    let r = sh(&sb, "/tmp/data").await;
    assert_eq!(r.outcome.status(), 126, "{r:?}");
    assert!(
        text(&r.stderr).contains("/tmp/data: Permission denied"),
        "{r:?}"
    );
    let r = sh(&sb, "no-such-program-here").await;
    assert_eq!(r.outcome.status(), 127, "{r:?}");
    assert!(
        text(&r.stderr).contains("no-such-program-here: command not found"),
        "{r:?}"
    );

    // The working directory's physical path, as bash's getcwd gives it.
    let opts = runcell_core::RunOptions {
        cwd: Some("/tmp/link".into()),
        ..Default::default()
    };
    let run = |line: &str| sb.exec(runcell_protocol::Command::Shell(line.into()), &opts);
    let (direct, shell) = (
        run("printenv PWD").await.unwrap(),
        run("printenv PWD;").await.unwrap(),
    );
    assert_eq!(text(&direct.stdout), "/tmp/real\n");
    same("printenv PWD", &direct, &shell);
    sb.destroy().await.unwrap();
}
