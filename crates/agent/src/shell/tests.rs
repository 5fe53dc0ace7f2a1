//! Checked against the host's own bash: a line run directly must be what
//! `bash -c LINE` runs, byte for byte.

use super::*;
use std::os::unix::process::CommandExt;
use std::process::{Command, Output};

fn env(extra: &[(&str, &str)]) -> BTreeMap<String, String> {
    let mut env: BTreeMap<String, String> = [
        (
            "PATH",
            "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        ),
        ("HOME", "/root"),
        ("USER", "root"),
        ("SHELL", "/bin/bash"),
        ("LANG", "C.UTF-8"),
        ("TMPDIR", "/tmp"),
        ("HOSTNAME", "sandbox"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    env.extend(extra.iter().map(|(k, v)| (k.to_string(), v.to_string())));
    env
}

fn through_bash(line: &str, env: &BTreeMap<String, String>, cwd: &str) -> Output {
    Command::new("/bin/bash")
        .args(["-c", line])
        .env_clear()
        .envs(env)
        .current_dir(cwd)
        .output()
        .unwrap()
}

fn directly(d: &Direct, cwd: &str) -> Output {
    Command::new(&d.path)
        .arg0(&d.argv[0])
        .args(&d.argv[1..])
        .env_clear()
        .envs(&d.env)
        .current_dir(cwd)
        .output()
        .unwrap()
}

/// The output's lines in order (bash lays out the environment in an order
/// of its own).
fn sorted(out: &[u8]) -> Vec<String> {
    let mut lines: Vec<String> = String::from_utf8_lossy(out)
        .split(['\n', '\0'])
        .map(str::to_string)
        .collect();
    lines.sort();
    lines
}

#[test]
fn a_simple_line_runs_as_bash_would_run_it() {
    let dir = std::env::temp_dir().join(format!("runcell-shell-{}", std::process::id()));
    let real = dir.join("real");
    std::fs::create_dir_all(&real).unwrap();
    let link = dir.join("link");
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(&real, &link).unwrap();
    let lines = [
        "/usr/bin/env",
        "env",
        "  env\t-0  ",
        "printenv PWD SHLVL _ HOME",
        "/usr/bin/printf %s, a b=c d,e:f+g@h -i",
        "env -u HOME",
        "ls -a .",
        "cat /nonexistent/file",
        "sh -c exit",
    ];
    let envs = [
        env(&[]),
        env(&[
            ("A-B", "odd name"),
            ("X", "a b"),
            ("EMPTY", ""),
            ("TERM", "xterm"),
        ]),
        env(&[("PATH", "/usr/bin/:/bin")]),
    ];
    let mut compared = 0;
    for cwd in [real.to_str().unwrap(), link.to_str().unwrap(), "/"] {
        for env in &envs {
            for line in lines {
                let d = direct(line, env, cwd).unwrap_or_else(|| panic!("{line:?} is simple"));
                let (want, got) = (through_bash(line, env, cwd), directly(&d, cwd));
                assert_eq!(want.status, got.status, "{line:?} in {cwd}");
                assert_eq!(
                    sorted(&want.stdout),
                    sorted(&got.stdout),
                    "{line:?} in {cwd}"
                );
                assert_eq!(want.stderr, got.stderr, "{line:?} in {cwd}");
                compared += 1;
            }
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
    assert_eq!(compared, 81);
}

#[test]
fn lines_bash_would_do_more_with_keep_the_shell() {
    for line in [
        "",
        "   ",
        "echo hi",
        "true",
        "cd /tmp",
        "exit 3",
        ". /etc/profile",
        "time ls",
        "if",
        "A=1 env",
        "%1",
        "ls *.py",
        "ls ?",
        "ls [ab]",
        "ls ~",
        "echo {a,b}",
        "env $HOME",
        "env `id`",
        "env 'quoted'",
        "env \"quoted\"",
        "env a\\ b",
        "env; env",
        "env && env",
        "env | cat",
        "env > /tmp/x",
        "env < /tmp/x",
        "env &",
        "(env)",
        "env # comment",
        "env\nenv",
        "! env",
        "env é",
    ] {
        assert_eq!(simple_words(line), None, "{line:?}");
    }
    assert_eq!(
        simple_words("python3 -m pytest -q tests/a.py --x=1"),
        Some(
            ["python3", "-m", "pytest", "-q", "tests/a.py", "--x=1"]
                .map(String::from)
                .to_vec()
        )
    );
}

#[test]
fn an_environment_bash_reads_keeps_the_shell() {
    for (k, v) in [
        ("BASH_ENV", "/tmp/rc"),
        ("BASH_FUNC_env%%", "() { echo hijacked; }"),
        ("SHELLOPTS", "xtrace"),
        ("IFS", "/"),
        ("LC_ALL", "xx_YY"),
        ("PWD", "/elsewhere"),
        ("SHLVL", "4"),
        ("OPTIND", "9"),
        ("ENV", "/tmp/rc"),
        ("POSIXLY_CORRECT", "1"),
        ("EXECIGNORE", "*"),
    ] {
        assert_eq!(direct("env", &env(&[(k, v)]), "/"), None, "{k}");
    }
    // A PATH bash searches from the working directory, and none at all.
    for path in ["bin:/usr/bin", "/usr/bin::/bin", ""] {
        assert_eq!(
            direct("env", &env(&[("PATH", path)]), "/"),
            None,
            "{path:?}"
        );
    }
    let mut none = env(&[]);
    none.remove("PATH");
    assert_eq!(direct("env", &none, "/"), None);
    // Not found: bash says so.
    assert_eq!(direct("no-such-program-here", &env(&[]), "/"), None);
}

/// Every keyword and builtin of the host's bash that a literal word spells
/// is known here, and every variable bash rewrites when it starts (checked
/// by starting it with each set to a value it would not keep) keeps the
/// shell.
#[test]
fn what_bash_treats_as_its_own_is_known_here() {
    let listed = Command::new("/bin/bash")
        .args(["-c", "compgen -k; compgen -b; compgen -v"])
        .env_clear()
        .output()
        .unwrap();
    let names = String::from_utf8(listed.stdout).unwrap();
    let mut words = 0;
    for word in names.lines().filter(|w| w.bytes().all(literal_byte)) {
        let kind = Command::new("/bin/bash")
            .args(["-c", &format!("type -t {word}")])
            .output()
            .unwrap();
        let kind = String::from_utf8_lossy(&kind.stdout);
        if matches!(kind.trim(), "keyword" | "builtin") {
            assert!(SHELL_WORDS.contains(&word), "bash's {word} ({kind})");
            words += 1;
        }
    }
    assert!(words > 50, "{words} keywords and builtins");
    let mut rewritten = 0;
    for name in names
        .lines()
        .filter(|n| n.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_'))
    {
        let base = env(&[]);
        let mut set = base.clone();
        set.insert(name.to_string(), "zz9".into());
        let out = through_bash("/usr/bin/env", &set, "/");
        let mut want = set.clone();
        want.insert("PWD".into(), "/".into());
        want.insert("SHLVL".into(), "0".into());
        want.insert("_".into(), "/usr/bin/env".into());
        let mut want: Vec<String> = want.iter().map(|(k, v)| format!("{k}={v}")).collect();
        want.sort();
        let mut got = sorted(&out.stdout);
        got.retain(|l| !l.is_empty());
        if got != want || !out.stderr.is_empty() {
            assert!(shell_reads(name), "bash rewrites {name}: {got:?}");
            rewritten += 1;
        }
    }
    assert!(rewritten > 5, "{rewritten} variables bash rewrites");
}
