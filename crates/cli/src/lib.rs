//! `runcell`: run untrusted code in a sandbox.
//!
//! Two binaries run this command line. `runcell-full` has every command.
//! `runcell`, the one people type, has the commands run once per task:
//! `runcell run` (both of its paths: through a daemon, and in its own
//! process) and the commands on a daemon's sandboxes; it executes
//! `runcell-full`, installed beside it, in its own place for the rest
//! (`serve`, `key`, `mcp`, `template`, `doctor`): a run is mostly start-up,
//! and a binary without the daemon's HTTP server, registry, MCP server and
//! template builder starts faster ([`front_main`]).

mod conn;
mod context;
mod doctor;
mod key;
mod remote;
mod run;
mod serve;
mod storage;
mod template;

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};

/// Run untrusted, model-written code in a Linux sandbox.
#[derive(Debug, Parser)]
#[command(name = "runcell", version, about, long_about = None)]
struct Cli {
    #[command(flatten)]
    globals: Globals,
    #[command(subcommand)]
    command: Commands,
}

/// The options every command takes.
#[derive(Debug, Args)]
struct Globals {
    /// Directory for the state of running sandboxes.
    #[arg(
        long,
        global = true,
        env = "RUNCELL_STATE_DIR",
        default_value = "/run/runcell/sandboxes",
        value_parser = absolute_path
    )]
    state_dir: PathBuf,
    /// Directory of installed templates [default: /var/lib/runcell/templates;
    /// for serve, DATA_DIR/templates].
    #[arg(long, global = true, env = "RUNCELL_TEMPLATES_DIR", value_parser = absolute_path)]
    templates_dir: Option<PathBuf>,
    /// The sandbox agent binary (default: runcell-agent next to this binary).
    #[arg(long, global = true, env = "RUNCELL_AGENT", value_parser = absolute_path)]
    agent: Option<PathBuf>,
}

/// A path argument made absolute against the working directory: the
/// daemon and the sandboxes' setup hand paths to processes that run
/// elsewhere (a relative `--data-dir` made every sandbox's setup fail to
/// find its own directory).
pub(crate) fn absolute_path(s: &str) -> Result<PathBuf, String> {
    std::path::absolute(s).map_err(|e| format!("{s:?} cannot be made an absolute path: {e}"))
}

/// The commands `runcell` itself runs, parsed as the full command line
/// parses them.
#[derive(Debug, Parser)]
#[command(name = "runcell")]
struct FrontCli {
    #[command(flatten)]
    globals: Globals,
    #[command(subcommand)]
    command: Front,
}

#[derive(Debug, Subcommand)]
enum Front {
    Run(run::RunArgs),
    #[command(flatten)]
    Remote(Remote),
}

/// `runcell run`'s command line alone: parsing it builds no other
/// command's arguments (clap builds every subcommand it is given, and a
/// run is mostly start-up).
#[derive(Debug, Parser)]
#[command(name = "runcell")]
struct RunCli {
    #[command(flatten)]
    globals: Globals,
    #[command(subcommand)]
    command: RunOnly,
}

#[derive(Debug, Subcommand)]
enum RunOnly {
    Run(run::RunArgs),
}

/// The first words of the command lines `runcell` runs itself.
const FRONT_COMMANDS: [&str; 9] = [
    "run", "context", "sandbox", "exec", "code", "snapshot", "volume", "cp", "logs",
];

#[derive(Debug, Subcommand)]
enum Commands {
    /// Run code in a fresh sandbox that is destroyed when it finishes.
    Run(run::RunArgs),
    /// Run the daemon: the /v1 HTTP API (PandaStack-compatible), with TTLs
    /// that survive restarts.
    Serve(Box<serve::ServeArgs>),
    /// Manage the daemon's API keys and their workspaces.
    Key(key::KeyArgs),
    /// Build, list and remove templates.
    Template(template::TemplateArgs),
    #[command(flatten)]
    Remote(Remote),
    /// An MCP server on stdin/stdout (for Claude Desktop, Cursor, ...) whose
    /// tools run code through the daemon.
    Mcp(remote::McpArgs),
    /// What this host can enforce, and which isolation backends run here.
    Doctor(doctor::DoctorArgs),
}

/// The commands that work on a daemon's sandboxes through its API.
#[derive(Debug, Subcommand)]
enum Remote {
    /// Code contexts (long-lived interpreters) in a daemon's sandbox.
    Context(context::ContextArgs),
    /// Create, list, show, kill, pause, hibernate, snapshot and fork sandboxes
    /// of a daemon, and set their TTL.
    Sandbox(remote::SandboxArgs),
    /// Run a command in a daemon's sandbox: runcell exec ID -- CMD.
    Exec(remote::ExecArgs),
    /// Run code in a daemon's sandbox, in a context kept per language.
    Code(remote::CodeArgs),
    /// List, show and delete snapshots of sandboxes' files.
    Snapshot(storage::SnapshotArgs),
    /// Create, list, show and delete volumes (storage that outlives sandboxes).
    Volume(storage::VolumeArgs),
    /// Copy a file into or out of a daemon's sandbox (SANDBOX:/path).
    Cp(remote::CpArgs),
    /// Print (or follow with -f) the output of a sandbox's commands.
    Logs(remote::LogsArgs),
}

/// Where templates live unless --templates-dir says otherwise: the daemon's
/// default data directory's `templates`.
pub const DEFAULT_TEMPLATES_DIR: &str = "/var/lib/runcell/templates";

/// The binary with every command, installed beside `runcell`.
pub const FULL_BINARY: &str = "runcell-full";

/// `runcell`: `runcell run` and the commands on a daemon's sandboxes run
/// here; any other command line (another command, an option before the
/// command, `--help`, an error to report) goes to [`FULL_BINARY`], executed
/// in this process's place with the same arguments, so it is parsed,
/// answered and reported exactly as ever.
pub fn front_main() -> ExitCode {
    let first = std::env::args_os().nth(1);
    if !FRONT_COMMANDS
        .iter()
        .any(|c| first.as_deref() == Some(OsStr::new(c)))
    {
        return exec_full();
    }
    let parsed = if first.as_deref() == Some(OsStr::new("run")) {
        RunCli::try_parse().map(|cli| {
            let RunOnly::Run(args) = cli.command;
            (cli.globals, Front::Run(args))
        })
    } else {
        FrontCli::try_parse().map(|cli| (cli.globals, cli.command))
    };
    let Ok((globals, command)) = parsed else {
        return exec_full();
    };
    init_front_tracing();
    match command {
        Front::Run(args) => run_command(args, globals),
        Front::Remote(command) => remote_command(command),
    }
}

/// Executes [`FULL_BINARY`] (beside this binary) in this process's place,
/// with the same arguments; returns only if it could not.
fn exec_full() -> ExitCode {
    use std::os::unix::process::CommandExt as _;
    let exe = std::env::current_exe().unwrap_or_else(|_| PathBuf::from("runcell"));
    let full = exe.parent().unwrap_or(Path::new("/")).join(FULL_BINARY);
    let mut args = std::env::args_os();
    let arg0 = args.next().unwrap_or_else(|| "runcell".into());
    let err = std::process::Command::new(&full)
        .arg0(arg0)
        .args(args)
        .exec();
    eprintln!(
        "runcell: this command runs in {FULL_BINARY}, installed beside runcell, \
         and {} could not start: {err}",
        full.display()
    );
    ExitCode::from(125)
}

/// The front's log filter: `RUNCELL_LOG` read as per-target levels
/// (`warn,runcell_core=debug`), which is what a run's logs need, without
/// the span and field matching (and the regex engine) of the full binary's
/// filter.
fn init_front_tracing() {
    let filter = std::env::var("RUNCELL_LOG")
        .ok()
        .and_then(|s| s.parse::<tracing_subscriber::filter::Targets>().ok())
        .unwrap_or_else(|| {
            tracing_subscriber::filter::Targets::new()
                .with_default(tracing_subscriber::filter::LevelFilter::WARN)
        });
    use tracing_subscriber::layer::SubscriberExt as _;
    use tracing_subscriber::util::SubscriberInitExt as _;
    tracing_subscriber::registry()
        .with(tracing_subscriber::fmt::layer().with_writer(std::io::stderr))
        .with(filter)
        .init();
}

fn init_tracing() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("RUNCELL_LOG")
                // The first start's template build reports its progress.
                .unwrap_or_else(|_| {
                    tracing_subscriber::EnvFilter::new("warn,runcell_server::autobuild=info")
                }),
        )
        .with_writer(std::io::stderr)
        .init();
}

fn current_thread() -> Result<tokio::runtime::Runtime, ExitCode> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| {
            eprintln!("runcell: could not start: {e}");
            ExitCode::from(125)
        })
}

/// `runcell-full`: every command.
pub fn main() -> ExitCode {
    init_tracing();
    let cli = Cli::parse();
    match cli.command {
        Commands::Run(args) => run_command(args, cli.globals),
        Commands::Serve(args) => serve::main(*args, cli.globals.templates_dir),
        Commands::Key(args) => key::main(args),
        Commands::Doctor(args) => doctor::main(args),
        Commands::Remote(command) => remote_command(command),
        Commands::Mcp(args) => match current_thread() {
            Ok(rt) => ExitCode::from(rt.block_on(remote::mcp(args))),
            Err(code) => code,
        },
        Commands::Template(args) => {
            let explicit = cli.globals.templates_dir.is_some();
            with_runtime(cli.globals, |config| template::main(config, args, explicit))
        }
    }
}

/// A command on a daemon's sandboxes, in either binary.
fn remote_command(command: Remote) -> ExitCode {
    let rt = match current_thread() {
        Ok(rt) => rt,
        Err(code) => return code,
    };
    ExitCode::from(rt.block_on(async {
        match command {
            Remote::Context(a) => context::main(a).await,
            Remote::Sandbox(a) => remote::sandbox(a).await,
            Remote::Snapshot(a) => storage::snapshot(a).await,
            Remote::Volume(a) => storage::volume(a).await,
            Remote::Exec(a) => remote::exec(a).await,
            Remote::Code(a) => remote::code(a).await,
            Remote::Cp(a) => remote::cp(a).await,
            Remote::Logs(a) => remote::logs(a).await,
        }
    }))
}

/// `runcell run`, in either binary.
fn run_command(args: run::RunArgs, globals: Globals) -> ExitCode {
    with_runtime(globals, |config| run::run(config, args))
}

/// Runs `f` on a current-thread runtime with the sandbox runtime's settings
/// from `globals`.
fn with_runtime<F: std::future::Future<Output = u8>>(
    globals: Globals,
    f: impl FnOnce(runcell_core::RuntimeConfig) -> F,
) -> ExitCode {
    let runtime = match current_thread() {
        Ok(r) => r,
        Err(code) => return code,
    };
    let config = runcell_core::RuntimeConfig {
        state_dir: globals.state_dir,
        templates_dir: Some(
            globals
                .templates_dir
                .unwrap_or_else(|| PathBuf::from(DEFAULT_TEMPLATES_DIR)),
        ),
        agent: globals.agent,
        // One sandbox (a run, a template build's steps): a fork server
        // would cost the exec it saves.
        fork_server: false,
        ..Default::default()
    };
    ExitCode::from(runtime.block_on(f(config)))
}

/// Prints an error with its chain of causes.
pub fn report(err: &dyn std::error::Error) {
    let mut msg = format!("runcell: {err}");
    let mut source = err.source();
    while let Some(s) = source {
        let text = s.to_string();
        if !msg.contains(&text) {
            msg.push_str(&format!("\n  caused by: {text}"));
        }
        source = s.source();
    }
    eprintln!("{msg}");
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    /// A command `runcell` parses but does not list would still be handed
    /// to `runcell-full` (right, but slow); one it lists but cannot parse
    /// would be too. The list is the parser's.
    #[test]
    fn the_commands_runcell_runs_itself_are_the_ones_it_parses() {
        let mut parsed: Vec<String> = FrontCli::command()
            .get_subcommands()
            .map(|c| c.get_name().to_string())
            .collect();
        parsed.sort();
        let mut listed: Vec<String> = FRONT_COMMANDS.iter().map(|c| c.to_string()).collect();
        listed.sort();
        assert_eq!(parsed, listed);
    }

    /// `runcell run` is parsed by a parser of its own; it must take and
    /// refuse exactly what the full command line does.
    #[test]
    fn a_run_is_parsed_as_the_full_command_line_parses_it() {
        // (the command line, whether it parses)
        let lines: [(&[&str], bool); 6] = [
            (&["runcell", "run", "python", "-c", "print(1)"], true),
            (
                &[
                    "runcell",
                    "run",
                    "--memory",
                    "256M",
                    "--timeout",
                    "5s",
                    "--env",
                    "A=1",
                    "--state-dir",
                    "/tmp/s",
                    "bash",
                    "-c",
                    "echo hi",
                ],
                true,
            ),
            (
                &[
                    "runcell",
                    "run",
                    "--no-daemon",
                    "--network",
                    "open",
                    "--isolation",
                    "gvisor",
                    "node",
                    "-c",
                    "1",
                    "--",
                    "x",
                ],
                true,
            ),
            (
                &["runcell", "run", "--memory", "lots", "python", "-c", "1"],
                false,
            ),
            (
                &["runcell", "run", "--no-such-option", "python", "-c", "1"],
                false,
            ),
            (&["runcell", "run", "python", "-c", "1", "file.py"], false),
        ];
        for (line, parses) in lines {
            let front = RunCli::try_parse_from(line).map(|c| {
                let RunOnly::Run(args) = c.command;
                format!("{args:?} {:?}", c.globals)
            });
            let full = Cli::try_parse_from(line).map(|c| match c.command {
                Commands::Run(args) => format!("{args:?} {:?}", c.globals),
                other => panic!("{line:?} parsed as {other:?}"),
            });
            assert_eq!(front.is_ok(), parses, "{line:?}: {front:?}");
            match (front, full) {
                (Ok(a), Ok(b)) => assert_eq!(a, b, "{line:?}"),
                (Err(a), Err(b)) => assert_eq!(a.kind(), b.kind(), "{line:?}"),
                (a, b) => panic!("{line:?}: runcell {a:?}, runcell-full {b:?}"),
            }
        }
    }
}
