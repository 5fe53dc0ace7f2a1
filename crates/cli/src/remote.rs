//! Commands that talk to a running daemon: `sandbox`, `exec`, `code`, `cp`
//! and `logs`. Address and key come from --url/--api-key, RUNCELL_URL and
//! RUNCELL_API_KEY, or the key file `runcell serve` wrote.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Subcommand};
use runcell_client::{Client, ClientError, ExecOptions, SandboxInfo};
use serde_json::{json, Value};

use crate::context::print_cell;
use crate::report;
use crate::run::parse_duration;

/// How to reach the daemon, shared by every remote command.
#[derive(Debug, Args)]
pub struct Conn {
    /// The daemon [default: $RUNCELL_URL, else http://127.0.0.1:7070].
    #[arg(long, global = true)]
    pub url: Option<String>,
    /// API key [default: $RUNCELL_API_KEY, else the key file runcell serve wrote].
    #[arg(long, global = true)]
    pub api_key: Option<String>,
    /// Print JSON instead of text.
    #[arg(long, global = true)]
    pub json: bool,
}

impl Conn {
    /// A client, or the exit status after reporting why there is none.
    pub fn client(&self) -> Result<Client, u8> {
        Client::from_env(self.url.clone(), self.api_key.clone()).map_err(|e| {
            report(&e);
            2
        })
    }
}

fn parse_kv(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.into(), v.into())),
        _ => Err(format!("\"{s}\" is not KEY=VALUE")),
    }
}

#[derive(Debug, Args)]
pub struct SandboxArgs {
    #[command(flatten)]
    conn: Conn,
    #[command(subcommand)]
    command: SandboxCommand,
}

#[derive(Debug, Subcommand)]
enum SandboxCommand {
    /// Create a sandbox; prints its id.
    Create {
        /// Template [default: host].
        #[arg(long, short)]
        template: Option<String>,
        /// Idle time-to-live, e.g. 10m [default: the daemon's].
        #[arg(long, value_parser = parse_duration)]
        ttl: Option<Duration>,
        /// Metadata, KEY=VALUE (repeatable).
        #[arg(long = "meta", value_parser = parse_kv)]
        meta: Vec<(String, String)>,
        /// Environment variable for every command, KEY=VALUE (repeatable).
        #[arg(long = "env", short = 'e', value_parser = parse_kv)]
        env: Vec<(String, String)>,
        /// Exempt from the idle TTL (the maximum lifetime still applies).
        #[arg(long)]
        persistent: bool,
        /// Network egress: none, open, allowlist:RULE;RULE... or JSON.
        #[arg(long, value_parser = crate::run::parse_network)]
        network: Option<runcell_core::egress::NetworkPolicy>,
    },
    /// List sandboxes, optionally only those whose metadata matches.
    Ls {
        /// KEY=VALUE that must match (repeatable, ANDed).
        #[arg(long = "meta", value_parser = parse_kv)]
        meta: Vec<(String, String)>,
    },
    /// Show one sandbox.
    Get {
        /// Sandbox id.
        id: String,
    },
    /// Kill a sandbox and everything in it.
    Kill {
        /// Sandbox ids.
        #[arg(required = true)]
        ids: Vec<String>,
    },
    /// Set a sandbox's idle time-to-live.
    Ttl {
        /// Sandbox id.
        id: String,
        /// The new TTL, e.g. 30m.
        #[arg(value_parser = parse_duration)]
        ttl: Duration,
    },
}

fn field<'a>(s: &'a SandboxInfo, k: &str) -> &'a str {
    s.fields.get(k).and_then(Value::as_str).unwrap_or("-")
}

fn sandbox_line(s: &SandboxInfo) -> String {
    let meta: Vec<String> = s
        .fields
        .get("metadata")
        .and_then(Value::as_object)
        .map(|m| {
            m.iter()
                .filter(|(k, _)| k.as_str() != "workspace")
                .map(|(k, v)| format!("{k}={}", v.as_str().unwrap_or_default()))
                .collect()
        })
        .unwrap_or_default();
    format!(
        "{}  {:<18} {:<9} {}  {}",
        s.id,
        field(s, "template"),
        field(s, "status"),
        field(s, "created_at"),
        meta.join(",")
    )
}

fn sandbox_json(s: &SandboxInfo) -> Value {
    let mut m = s.fields.clone();
    m.insert("id".into(), s.id.clone().into());
    Value::Object(m)
}

async fn outcome(f: impl std::future::Future<Output = Result<u8, ClientError>>) -> u8 {
    match f.await {
        Ok(c) => c,
        Err(e) => {
            report(&e);
            1
        }
    }
}

pub async fn sandbox(args: SandboxArgs) -> u8 {
    let client = match args.conn.client() {
        Ok(c) => c,
        Err(code) => return code,
    };
    let json = args.conn.json;
    outcome(async move {
        match args.command {
            SandboxCommand::Create {
                template,
                ttl,
                meta,
                env,
                persistent,
                network,
            } => {
                let mut req = json!({
                    "metadata": meta.into_iter().collect::<BTreeMap<_, _>>(),
                    "env": env.into_iter().collect::<BTreeMap<_, _>>(),
                    "persistent": persistent,
                });
                if let Some(t) = template {
                    req["template"] = t.into();
                }
                if let Some(t) = ttl {
                    req["ttl_seconds"] = t.as_secs().into();
                }
                if let Some(n) = network {
                    req["network"] = serde_json::to_value(n).expect("a policy serializes");
                }
                let s = client.create_sandbox(&req).await?;
                if json {
                    println!("{}", sandbox_json(&s));
                } else {
                    println!("{}", s.id);
                }
            }
            SandboxCommand::Ls { meta } => {
                let list = client.list_sandboxes(&meta.into_iter().collect()).await?;
                if json {
                    let v: Vec<Value> = list.iter().map(sandbox_json).collect();
                    println!("{}", Value::Array(v));
                } else {
                    for s in &list {
                        println!("{}", sandbox_line(s));
                    }
                }
            }
            SandboxCommand::Get { id } => {
                let s = client.get_sandbox(&id).await?;
                if json {
                    println!("{}", sandbox_json(&s));
                } else {
                    println!(
                        "{}",
                        serde_json::to_string_pretty(&sandbox_json(&s)).unwrap_or_default()
                    );
                }
            }
            SandboxCommand::Kill { ids } => {
                for id in ids {
                    client.delete_sandbox(&id).await?;
                }
            }
            SandboxCommand::Ttl { id, ttl } => {
                let l = client.set_lifecycle(&id, Some(ttl.as_secs()), None).await?;
                if json {
                    println!("{l}");
                }
            }
        }
        Ok(0)
    })
    .await
}

#[derive(Debug, Args)]
pub struct ExecArgs {
    #[command(flatten)]
    conn: Conn,
    /// Timeout, e.g. 30s [default: the sandbox's].
    #[arg(long, value_parser = parse_duration)]
    timeout: Option<Duration>,
    /// Working directory.
    #[arg(long)]
    cwd: Option<String>,
    /// Environment variable, KEY=VALUE (repeatable).
    #[arg(long = "env", short = 'e', value_parser = parse_kv)]
    env: Vec<(String, String)>,
    /// Sandbox id.
    id: String,
    /// The command (joined with spaces and run by bash -c).
    #[arg(last = true, required = true)]
    command: Vec<String>,
}

/// `runcell exec ID -- CMD`: output as the command wrote it; exits with its status.
pub async fn exec(args: ExecArgs) -> u8 {
    let client = match args.conn.client() {
        Ok(c) => c,
        Err(code) => return code,
    };
    let opts = ExecOptions {
        timeout: args.timeout,
        env: args.env.into_iter().collect(),
        cwd: args.cwd,
        background: false,
    };
    let json = args.conn.json;
    outcome(async move {
        let r = client
            .exec(&args.id, &args.command.join(" "), &opts)
            .await?;
        if json {
            println!(
                "{}",
                json!({"stdout": r.stdout, "stderr": r.stderr, "exit_code": r.exit_code,
                    "timed_out": r.timed_out, "duration_ms": r.duration_ms, "messages": r.messages})
            );
        } else {
            print!("{}", r.stdout);
            let _ = std::io::stdout().flush();
            eprint!("{}", r.stderr);
            for m in &r.messages {
                eprintln!("runcell: {m}");
            }
        }
        Ok(r.exit_code.clamp(0, 255) as u8)
    })
    .await
}

#[derive(Debug, Args)]
pub struct CodeArgs {
    #[command(flatten)]
    conn: Conn,
    /// python, javascript or bash.
    #[arg(long = "lang", short, default_value = "python")]
    language: String,
    /// The code [default: standard input].
    #[arg(short = 'c', long = "code")]
    code: Option<String>,
    /// Timeout, e.g. 30s [default: the sandbox's].
    #[arg(long, value_parser = parse_duration)]
    timeout: Option<Duration>,
    /// Write image results into this directory.
    #[arg(long)]
    save_images: Option<PathBuf>,
    /// Sandbox id.
    id: String,
}

/// `runcell code ID`: runs code in the sandbox's context of that language
/// (created on first use, then reused, so state persists between calls).
pub async fn code(args: CodeArgs) -> u8 {
    let client = match args.conn.client() {
        Ok(c) => c,
        Err(code) => return code,
    };
    let code = match args.code {
        Some(c) => c,
        None => {
            let mut c = String::new();
            if let Err(e) = std::io::stdin().read_to_string(&mut c) {
                eprintln!("runcell: could not read the code from standard input: {e}");
                return 2;
            }
            c
        }
    };
    let json = args.conn.json;
    outcome(async move {
        let contexts = client.list_contexts(&args.id).await?;
        let want = match args.language.parse::<runcell_protocol::Language>() {
            Ok(l) => l.name().to_string(),
            Err(e) => {
                eprintln!("runcell: {e}");
                return Ok(2);
            }
        };
        let ctx = match contexts.into_iter().find(|c| c.language == want) {
            Some(c) => c,
            None => client.create_context(&args.id, &want).await?,
        };
        let cell = client
            .run_cell(&args.id, &ctx.id, &code, args.timeout)
            .await?;
        if json {
            println!("{}", crate::context::cell_json(&cell));
        } else {
            print_cell(&cell, args.save_images.as_deref());
        }
        Ok(if cell.timed_out {
            124
        } else {
            cell.exit_code.clamp(0, 255) as u8
        })
    })
    .await
}

#[derive(Debug, Args)]
pub struct CpArgs {
    #[command(flatten)]
    conn: Conn,
    /// Source: a local path, or SANDBOX:PATH.
    src: String,
    /// Destination: a local path, or SANDBOX:PATH.
    dst: String,
}

/// A `SANDBOX:/path` operand, or a local path.
fn remote(operand: &str) -> Option<(&str, &str)> {
    match operand.split_once(':') {
        Some((id, path)) if !id.is_empty() && !id.contains('/') && path.starts_with('/') => {
            Some((id, path))
        }
        _ => None,
    }
}

/// `runcell cp`: copies one file into or out of a sandbox.
pub async fn cp(args: CpArgs) -> u8 {
    let client = match args.conn.client() {
        Ok(c) => c,
        Err(code) => return code,
    };
    outcome(async move {
        match (remote(&args.src), remote(&args.dst)) {
            (None, Some((id, path))) => {
                let data = match std::fs::read(&args.src) {
                    Ok(d) => d,
                    Err(e) => {
                        eprintln!("runcell: could not read {}: {e}", args.src);
                        return Ok(1);
                    }
                };
                client.write_file(id, path, data).await?;
            }
            (Some((id, path)), None) => {
                let data = client.read_file(id, path).await?;
                let written = if args.dst == "-" {
                    std::io::stdout().write_all(&data)
                } else {
                    std::fs::write(&args.dst, &data)
                };
                if let Err(e) = written {
                    eprintln!("runcell: could not write {}: {e}", args.dst);
                    return Ok(1);
                }
            }
            _ => {
                eprintln!(
                    "runcell: exactly one of SRC and DST must be SANDBOX:/absolute/path, the other a local path (or - for standard output)"
                );
                return Ok(2);
            }
        }
        Ok(0)
    })
    .await
}

#[derive(Debug, Args)]
pub struct LogsArgs {
    #[command(flatten)]
    conn: Conn,
    /// Keep printing new output until the sandbox goes away.
    #[arg(long, short)]
    follow: bool,
    /// Sandbox id.
    id: String,
}

/// `runcell logs [-f] ID`: the output of the sandbox's execs.
pub async fn logs(args: LogsArgs) -> u8 {
    let client = match args.conn.client() {
        Ok(c) => c,
        Err(code) => return code,
    };
    outcome(async move {
        if args.follow {
            client
                .follow_logs(&args.id, |line| {
                    let mut out = std::io::stdout().lock();
                    if writeln!(out, "{line}").and_then(|()| out.flush()).is_err() {
                        // The reader went away (`runcell logs -f ID | head`).
                        std::process::exit(0);
                    }
                })
                .await?;
        } else {
            let text = client.logs(&args.id).await?;
            let _ = std::io::stdout().write_all(text.as_bytes());
        }
        Ok(0)
    })
    .await
}

#[derive(Debug, Args)]
pub struct McpArgs {
    #[command(flatten)]
    conn: Conn,
    /// Template of the sandboxes the tools create.
    #[arg(long, default_value = "code-interpreter")]
    template: String,
}

/// `runcell mcp`: an MCP server on stdin/stdout whose tools use the daemon.
pub async fn mcp(args: McpArgs) -> u8 {
    let client = match args.conn.client() {
        Ok(c) => c,
        Err(code) => return code,
    };
    let server = runcell_mcp::RuncellMcp::new(runcell_mcp::Backend::Fixed(client), args.template);
    match runcell_mcp::serve_stdio(server).await {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("runcell: {}", e.message);
            1
        }
    }
}
