//! A shell line (`exec`'s `cmd` string) that is one simple command runs
//! without the shell in front of it.
//!
//! Every string command used to start `/bin/bash -c LINE`, and for a line
//! such as `python3 main.py` bash only looks the program up on `PATH` and
//! `execve`s it in its own place: its start-up (an `execve`, the dynamic
//! loader, glibc's initialisation) was about 1.3 ms of CPU an exec on this
//! project's machine, for nothing a program could tell apart. Here, a line
//! whose words are all literal (no quoting, expansion, redirection,
//! operator or assignment) and whose first word is no bash keyword or
//! builtin runs the program directly, with the environment bash would have
//! given it (`PWD`, `SHLVL=0` and `_` added, as bash 5 does when it execs
//! the last command of `-c`). Anything else, and any environment bash would
//! read or rewrite (`BASH_ENV`, `SHELLOPTS`, `IFS`, `LC_*`, exported
//! functions, ...), keeps the shell.
//!
//! The direct start keeps the shell as its fallback
//! ([`runcell_jail::inside::ExecImage::or_else`]): if the program cannot be
//! run by the sandbox user (no permission, a script without `#!`, a
//! missing interpreter), bash runs the line, and says so or runs the
//! script, exactly as it always did.

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;

/// The words of a command bash would run as it is, or `None` where bash
/// would do more than split the line at blanks.
pub(crate) fn simple_words(line: &str) -> Option<Vec<String>> {
    let words: Vec<String> = line
        .split([' ', '\t'])
        .filter(|w| !w.is_empty())
        .map(str::to_string)
        .collect();
    let first = words.first()?;
    let literal = |w: &String| w.bytes().all(literal_byte);
    if !words.iter().all(literal)
        // `NAME=value` is an assignment; `%1` a job.
        || first.contains(['=', '%'])
        || SHELL_WORDS.contains(&first.as_str())
    {
        return None;
    }
    Some(words)
}

/// Bytes bash takes literally anywhere in a word: no quoting, expansion
/// (`$`, backquote, `~`, globs, braces), comment, operator or redirection.
fn literal_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"_-./,:+@%=".contains(&b)
}

/// bash 5.2's reserved words and builtins (`compgen -k`, `compgen -b`)
/// that a literal word can spell: as a first word bash runs these itself.
#[rustfmt::skip]
const SHELL_WORDS: &[&str] = &[
    // Reserved words.
    "if", "then", "else", "elif", "fi", "case", "esac", "for", "select", "while", "until",
    "do", "done", "in", "function", "time", "coproc",
    // Builtins.
    ".", ":", "alias", "bg", "bind", "break", "builtin", "caller", "cd", "command", "compgen",
    "complete", "compopt", "continue", "declare", "dirs", "disown", "echo", "enable", "eval",
    "exec", "exit", "export", "false", "fc", "fg", "getopts", "hash", "help", "history",
    "jobs", "kill", "let", "local", "logout", "mapfile", "popd", "printf", "pushd", "pwd",
    "read", "readarray", "readonly", "return", "set", "shift", "shopt", "source", "suspend",
    "test", "times", "trap", "true", "type", "typeset", "ulimit", "umask", "unalias", "unset",
    "wait",
];

/// Whether bash reads the variable `name` from its environment to decide
/// how it runs, or rewrites it in what it passes on: with such a variable
/// set, the line keeps the shell.
fn shell_reads(name: &str) -> bool {
    const PREFIXES: &[&str] = &["BASH", "LC_", "COMP_", "EPOCH", "SHELLOPTS", "HIST"];
    const NAMES: &[&str] = &[
        "_",
        "ENV",
        "POSIXLY_CORRECT",
        "IFS",
        "PWD",
        "OLDPWD",
        "SHLVL",
        "OPTERR",
        "OPTIND",
        "OPTARG",
        "PS1",
        "PS2",
        "PS3",
        "PS4",
        "RANDOM",
        "SRANDOM",
        "SECONDS",
        "LINENO",
        "PPID",
        "UID",
        "EUID",
        "GROUPS",
        "FUNCNAME",
        "FUNCNEST",
        "DIRSTACK",
        "EXECIGNORE",
        "GLOBIGNORE",
        "CDPATH",
        "TIMEFORMAT",
    ];
    PREFIXES.iter().any(|p| name.starts_with(p)) || NAMES.contains(&name)
}

/// A shell line's program, run without the shell.
#[derive(Debug, PartialEq)]
pub(crate) struct Direct {
    /// The program's path, as bash found it.
    pub path: String,
    /// Its arguments (the line's words).
    pub argv: Vec<String>,
    /// Its environment: `env` with what bash adds.
    pub env: BTreeMap<String, String>,
}

/// `line` as bash would start it from `cwd` with the environment `env`, or
/// `None` if bash would do more (see the module's documentation) or finds
/// no program (then bash says so, in its words).
pub(crate) fn direct(line: &str, env: &BTreeMap<String, String>, cwd: &str) -> Option<Direct> {
    let argv = simple_words(line)?;
    if env.keys().any(|k| shell_reads(k)) {
        return None;
    }
    let path = find(&argv[0], env.get("PATH")?)?;
    // bash sets PWD, when its environment has none, to getcwd(): the
    // directory's physical path.
    let pwd = std::fs::canonicalize(cwd)
        .ok()?
        .into_os_string()
        .into_string()
        .ok()?;
    let mut env = env.clone();
    env.insert("PWD".into(), pwd);
    // One level up for the shell, one down as it execs the last command.
    env.insert("SHLVL".into(), "0".into());
    env.insert("_".into(), path.clone());
    Some(Direct { path, argv, env })
}

/// `program` found as bash finds it: as given if it has a slash, else the
/// first file with an execute bit in a directory of `path`, joined as bash
/// joins it. `None` if not found, or if `path` has an empty or relative
/// entry (bash searches those from the working directory: left to it).
fn find(program: &str, path: &str) -> Option<String> {
    if program.contains('/') {
        return Some(program.to_string());
    }
    let dirs: Vec<&str> = path.split(':').collect();
    if dirs.iter().any(|d| !d.starts_with('/')) {
        return None;
    }
    dirs.into_iter()
        .map(|dir| match dir.ends_with('/') {
            true => format!("{dir}{program}"),
            false => format!("{dir}/{program}"),
        })
        .find(|p| {
            std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
}

#[cfg(test)]
mod tests;
