//! `runcell serve`: every setting is a flag with an environment variable.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::Args;
use runcell_core::{parse_size, SandboxLimits};
use runcell_server::ServeConfig;

use crate::report;
use crate::run::parse_duration;

#[derive(Debug, Args)]
pub struct ServeArgs {
    /// Address and port to listen on.
    #[arg(long, env = "RUNCELL_LISTEN", default_value = "127.0.0.1:7070")]
    listen: SocketAddr,
    /// Data directory: registry, API key, sandbox state.
    #[arg(long, env = "RUNCELL_DATA_DIR", default_value = "/var/lib/runcell")]
    data_dir: PathBuf,
    /// Idle time-to-live of a sandbox whose create request gives none.
    #[arg(long, env = "RUNCELL_DEFAULT_TTL", default_value = "300s", value_parser = parse_duration)]
    default_ttl: Duration,
    /// Lifetime no sandbox may exceed, persistent or not.
    #[arg(long, env = "RUNCELL_MAX_LIFETIME", default_value = "24h", value_parser = parse_duration)]
    max_lifetime: Duration,
    /// Default wall-clock limit of one exec.
    #[arg(long, env = "RUNCELL_EXEC_TIMEOUT", default_value = "60s", value_parser = parse_duration)]
    exec_timeout: Duration,
    /// Largest timeout an exec may ask for.
    #[arg(long, env = "RUNCELL_MAX_EXEC_TIMEOUT", default_value = "1h", value_parser = parse_duration)]
    max_exec_timeout: Duration,
    /// Default memory limit of a sandbox.
    #[arg(long, env = "RUNCELL_MEMORY", default_value = "1G", value_parser = parse_size_arg)]
    memory: u64,
    /// Default CPU limit of a sandbox, in cores.
    #[arg(long, env = "RUNCELL_CPUS", default_value_t = 1.0)]
    cpus: f64,
    /// Default process limit of a sandbox.
    #[arg(long, env = "RUNCELL_PIDS", default_value_t = 512)]
    pids: u64,
    /// Default writable-layer size of a sandbox.
    #[arg(long, env = "RUNCELL_DISK", default_value = "512M", value_parser = parse_size_arg)]
    disk: u64,
    /// Bytes of each of stdout and stderr kept per exec.
    #[arg(long, env = "RUNCELL_OUTPUT_LIMIT", default_value = "1M", value_parser = parse_size_arg)]
    output_limit: u64,
    /// Largest request body (file uploads, code).
    #[arg(long, env = "RUNCELL_MAX_BODY", default_value = "32M", value_parser = parse_size_arg)]
    max_body: u64,
    /// Most sandboxes alive at once; creates beyond it get 503 with Retry-After.
    #[arg(long, env = "RUNCELL_MAX_SANDBOXES", default_value_t = 64)]
    max_sandboxes: usize,
    /// Prepared sandboxes kept ready for fast creation.
    #[arg(long, env = "RUNCELL_STANDBY", default_value_t = 2)]
    standby: usize,
    /// Template alias, NAME=TEMPLATE (repeatable; default code-interpreter=host and ubuntu-24.04=host).
    #[arg(long = "alias", env = "RUNCELL_ALIASES", value_delimiter = ',', value_parser = parse_alias)]
    aliases: Vec<(String, String)>,
}

fn parse_size_arg(s: &str) -> Result<u64, String> {
    parse_size(s).map_err(|e| e.to_string())
}

fn parse_alias(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((a, b)) if !a.is_empty() && !b.is_empty() => Ok((a.into(), b.into())),
        _ => Err(format!("\"{s}\" is not NAME=TEMPLATE")),
    }
}

pub fn main(args: ServeArgs, templates_dir: Option<PathBuf>) -> ExitCode {
    let mut config = ServeConfig {
        listen: args.listen,
        data_dir: args.data_dir,
        templates_dir,
        default_ttl_seconds: args.default_ttl.as_secs(),
        max_lifetime: args.max_lifetime,
        default_limits: SandboxLimits {
            memory_bytes: args.memory,
            pids: args.pids,
            cpu_millis: (args.cpus * 1000.0).round().max(10.0) as u64,
            disk_bytes: args.disk,
            timeout: args.exec_timeout,
            output_bytes: args.output_limit,
        },
        max_exec_timeout: args.max_exec_timeout,
        max_body_bytes: args.max_body as usize,
        standby: args.standby,
        max_sandboxes: args.max_sandboxes,
        ..ServeConfig::default()
    };
    if !args.aliases.is_empty() {
        config.aliases = args.aliases.into_iter().collect();
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("runcell: could not start: {e}");
            return ExitCode::from(125);
        }
    };
    match runtime.block_on(runcell_server::serve(config)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            report(&e);
            ExitCode::from(1)
        }
    }
}
