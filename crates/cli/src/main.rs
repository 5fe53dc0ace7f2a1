//! `runcell`: run untrusted code in a sandbox.

mod conn;
mod context;
mod doctor;
mod key;
mod remote;
mod run;
mod serve;
mod storage;
mod template;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// Run untrusted, model-written code in a Linux sandbox.
#[derive(Debug, Parser)]
#[command(name = "runcell", version, about, long_about = None)]
struct Cli {
    /// Directory for the state of running sandboxes.
    #[arg(
        long,
        global = true,
        env = "RUNCELL_STATE_DIR",
        default_value = "/run/runcell/sandboxes"
    )]
    state_dir: PathBuf,
    /// Directory of installed templates [default: /var/lib/runcell/templates;
    /// for serve, DATA_DIR/templates].
    #[arg(long, global = true, env = "RUNCELL_TEMPLATES_DIR")]
    templates_dir: Option<PathBuf>,
    /// The sandbox agent binary (default: runcell-agent next to this binary).
    #[arg(long, global = true, env = "RUNCELL_AGENT")]
    agent: Option<PathBuf>,
    #[command(subcommand)]
    command: Commands,
}

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
    /// An MCP server on stdin/stdout (for Claude Desktop, Cursor, ...) whose
    /// tools run code through the daemon.
    Mcp(remote::McpArgs),
    /// What this host can enforce, and which isolation backends run here.
    Doctor(doctor::DoctorArgs),
}

/// Where templates live unless --templates-dir says otherwise: the daemon's
/// default data directory's `templates`.
pub const DEFAULT_TEMPLATES_DIR: &str = "/var/lib/runcell/templates";

fn main() -> ExitCode {
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
    let cli = Cli::parse();
    let command = match cli.command {
        Commands::Serve(args) => return serve::main(*args, cli.templates_dir),
        Commands::Key(args) => return key::main(args),
        Commands::Doctor(args) => return doctor::main(args),
        other => other,
    };
    let command = match command {
        Commands::Context(_)
        | Commands::Sandbox(_)
        | Commands::Snapshot(_)
        | Commands::Volume(_)
        | Commands::Exec(_)
        | Commands::Code(_)
        | Commands::Cp(_)
        | Commands::Logs(_)
        | Commands::Mcp(_) => {
            let rt = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => {
                    eprintln!("runcell: could not start: {e}");
                    return ExitCode::from(125);
                }
            };
            return ExitCode::from(rt.block_on(async {
                match command {
                    Commands::Context(a) => context::main(a).await,
                    Commands::Sandbox(a) => remote::sandbox(a).await,
                    Commands::Snapshot(a) => storage::snapshot(a).await,
                    Commands::Volume(a) => storage::volume(a).await,
                    Commands::Exec(a) => remote::exec(a).await,
                    Commands::Code(a) => remote::code(a).await,
                    Commands::Cp(a) => remote::cp(a).await,
                    Commands::Logs(a) => remote::logs(a).await,
                    Commands::Mcp(a) => remote::mcp(a).await,
                    _ => unreachable!("only remote commands reach here"),
                }
            }));
        }
        other => other,
    };
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("runcell: could not start: {e}");
            return ExitCode::from(125);
        }
    };
    let explicit_templates_dir = cli.templates_dir.is_some();
    let config = runcell_core::RuntimeConfig {
        state_dir: cli.state_dir,
        templates_dir: Some(
            cli.templates_dir
                .unwrap_or_else(|| PathBuf::from(DEFAULT_TEMPLATES_DIR)),
        ),
        agent: cli.agent,
        // One sandbox (a run, a template build's steps): a fork server
        // would cost the exec it saves.
        fork_server: false,
        ..Default::default()
    };
    let code = runtime.block_on(async {
        match command {
            Commands::Run(args) => run::run(config, args).await,
            Commands::Template(args) => template::main(config, args, explicit_templates_dir).await,
            _ => unreachable!("handled above"),
        }
    });
    ExitCode::from(code)
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
