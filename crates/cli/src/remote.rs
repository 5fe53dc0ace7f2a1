//! Commands that talk to a running daemon: `sandbox`, `exec`, `code`, `cp`
//! and `logs`. Address and key come from --url/--api-key, RUNCELL_URL and
//! RUNCELL_API_KEY, or the key file `runcell serve` wrote.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Subcommand};
use runcell_client::{
    Client, ClientError, ExecOptions, ForkOptions, OnIdle, PromoteOptions, SandboxInfo, Stream,
    VolumeMount,
};
use runcell_core::{parse_duration, parse_size};
use serde_json::{json, Value};

use crate::conn::Conn;
use crate::context::print_cell;
use crate::report;

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
        /// Template [default: the daemon's, code-interpreter].
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
        network: Option<runcell_egress::NetworkPolicy>,
        /// Isolation: jail, gvisor or microvm [default: the template's,
        /// else the daemon's].
        #[arg(long)]
        isolation: Option<runcell_core::backend::Isolation>,
        /// Start from a snapshot's files (`runcell sandbox snapshot`); the
        /// template defaults to the snapshot's.
        #[arg(long, value_name = "SNAPSHOT_ID")]
        from_snapshot: Option<String>,
        /// Mount a volume, NAME[:ro][:/PATH] (repeatable); the path
        /// defaults to /mnt/NAME.
        #[arg(long = "volume", short = 'v', value_name = "NAME[:ro][:PATH]")]
        volumes: Vec<VolumeMount>,
        /// What happens after the idle TTL: delete (the sandbox and its
        /// files) or hibernate (end its processes, keep its files; the next
        /// call wakes it) [default: the daemon's].
        #[arg(long, value_name = "delete|hibernate")]
        on_idle: Option<OnIdle>,
        #[command(flatten)]
        limits: Box<LimitFlags>,
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
    /// Freeze a sandbox's processes (memory kept); calls on it are refused
    /// until it is resumed.
    Pause {
        /// Sandbox id.
        id: String,
    },
    /// Thaw a paused sandbox.
    Resume {
        /// Sandbox id.
        id: String,
    },
    /// End a sandbox's processes and free its memory, keeping its files;
    /// the next exec, file or code call wakes it (code contexts are lost).
    Hibernate {
        /// Sandbox id.
        id: String,
    },
    /// Start a hibernated sandbox again.
    Wake {
        /// Sandbox id.
        id: String,
    },
    /// Snapshot a sandbox's files; prints the snapshot's id (for
    /// `sandbox create --from-snapshot`).
    Snapshot {
        /// Sandbox id.
        id: String,
    },
    /// Copy a sandbox's files into a new sandbox; prints its id (one a line
    /// with --count).
    Fork {
        /// Sandbox id.
        id: String,
        /// Make this many forks (1 to 16) as one tree, to keep the best with
        /// `runcell sandbox promote`.
        #[arg(long, value_parser = clap::value_parser!(u32).range(1..=16))]
        count: Option<u32>,
        /// Metadata of the fork(s), KEY=VALUE (repeatable).
        #[arg(long = "meta", value_parser = parse_kv)]
        meta: Vec<(String, String)>,
        /// Idle time-to-live of the fork, e.g. 10m (not with --count).
        #[arg(long, value_parser = parse_duration, conflicts_with = "count")]
        ttl: Option<Duration>,
    },
    /// Make a fork the winner of its tree: it becomes independent.
    Promote {
        /// The winning fork's id.
        id: String,
        /// Delete the other forks of its tree.
        #[arg(long)]
        cleanup_siblings: bool,
        /// The tree [default: the fork's].
        #[arg(long)]
        tree: Option<String>,
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

/// The limits flags `runcell run` takes, for a daemon's sandbox; each
/// defaults to the daemon's (or the template's) value.
#[derive(Debug, Args)]
struct LimitFlags {
    /// Memory limit (includes files written to the sandbox), e.g. 256M.
    #[arg(long, value_parser = parse_size)]
    memory: Option<u64>,
    /// CPU limit in cores, e.g. 0.5.
    #[arg(long)]
    cpus: Option<f64>,
    /// Default timeout of each exec and cell, e.g. 30s.
    #[arg(long, value_parser = parse_duration)]
    timeout: Option<Duration>,
    /// Size of the sandbox's writable layer, e.g. 512M.
    #[arg(long, value_parser = parse_size)]
    disk: Option<u64>,
    /// Maximum number of processes and threads.
    #[arg(long)]
    pids: Option<u64>,
    /// Bytes of each of stdout and stderr kept per exec, e.g. 1M.
    #[arg(long, value_parser = parse_size)]
    output_limit: Option<u64>,
}

impl LimitFlags {
    /// The API's `limits` object, or `None` when no flag was given.
    fn to_json(&self) -> Option<Value> {
        let mib = |b: u64| b.div_ceil(1 << 20);
        let mut m = serde_json::Map::new();
        if let Some(b) = self.memory {
            m.insert("memory_mb".into(), mib(b).into());
        }
        if let Some(c) = self.cpus {
            m.insert("cpu".into(), c.into());
        }
        if let Some(t) = self.timeout {
            m.insert("timeout_seconds".into(), t.as_secs_f64().into());
        }
        if let Some(b) = self.disk {
            m.insert("disk_mb".into(), mib(b).into());
        }
        if let Some(p) = self.pids {
            m.insert("pids".into(), p.into());
        }
        if let Some(b) = self.output_limit {
            m.insert("output_bytes".into(), b.into());
        }
        (!m.is_empty()).then_some(Value::Object(m))
    }
}

pub(crate) fn field<'a>(s: &'a SandboxInfo, k: &str) -> &'a str {
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
        "{:<36}  {:<18} {:<9} {:<10} {:<25} {}",
        s.id,
        field(s, "template"),
        field(s, "isolation"),
        field(s, "status"),
        field(s, "created_at"),
        meta.join(",")
    )
}

/// `runcell sandbox get`: one field a line, sizes and times for people.
fn sandbox_view(s: &SandboxInfo) -> String {
    let f = &s.fields;
    let num = |v: &Value, k: &str| v.get(k).and_then(Value::as_f64);
    let mut rows: Vec<(&str, String)> = vec![
        ("ID", s.id.clone()),
        ("Template", field(s, "template").to_string()),
        ("Isolation", field(s, "isolation").to_string()),
        ("Status", field(s, "status").to_string()),
        ("Created", field(s, "created_at").to_string()),
    ];
    let persistent = f.get("persistent").and_then(Value::as_bool) == Some(true);
    if let Some(ttl) = f.get("ttl_seconds").and_then(Value::as_u64) {
        rows.push((
            "Idle TTL",
            if persistent {
                format!("{ttl} s (persistent: exempt)")
            } else {
                format!("{ttl} s")
            },
        ));
    }
    if let Some(l) = f.get("limits") {
        let mut parts = Vec::new();
        if let Some(m) = num(l, "memory_mb") {
            parts.push(format!("memory {m} MiB"));
        }
        if let Some(c) = num(l, "cpu") {
            parts.push(format!("cpu {c}"));
        }
        if let Some(p) = num(l, "pids") {
            parts.push(format!("pids {p}"));
        }
        if let Some(d) = num(l, "disk_mb") {
            parts.push(format!("disk {d} MiB"));
        }
        if let Some(t) = num(l, "timeout_seconds") {
            parts.push(format!("timeout {t} s"));
        }
        if let Some(o) = l.get("output_bytes").and_then(Value::as_u64) {
            parts.push(format!("output {}", runcell_core::format_size(o)));
        }
        rows.push(("Limits", parts.join(", ")));
    }
    if let Some(n) = f.get("network") {
        let mode = n.get("mode").and_then(Value::as_str).unwrap_or("-");
        let allow: Vec<&str> = n
            .get("allow")
            .and_then(Value::as_array)
            .map(|a| a.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        let presets: Vec<&str> = n
            .get("presets")
            .and_then(Value::as_array)
            .map(|a| a.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        let mut text = mode.to_string();
        if !allow.is_empty() || !presets.is_empty() {
            text.push_str(&format!(
                " ({})",
                presets
                    .iter()
                    .chain(allow.iter())
                    .copied()
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
        }
        rows.push(("Network", text));
    }
    if let Some(o) = f.get("on_idle").and_then(Value::as_str) {
        rows.push(("On idle", o.to_string()));
    }
    if let Some(p) = s.forked_from() {
        rows.push(("Fork of", p.to_string()));
    }
    if let Some(p) = s.from_snapshot() {
        rows.push(("Snapshot", p.to_string()));
    }
    if s.state_lost() {
        rows.push((
            "State",
            "lost (woken from hibernation: code contexts restarted)".into(),
        ));
    }
    if let Some(vols) = f.get("volumes").and_then(Value::as_array) {
        if !vols.is_empty() {
            let text: Vec<String> = vols
                .iter()
                .map(|v| {
                    let name = v.get("name").and_then(Value::as_str).unwrap_or("-");
                    let path = v.get("path").and_then(Value::as_str).unwrap_or("-");
                    let ro = v.get("read_only").and_then(Value::as_bool) == Some(true);
                    format!("{name} at {path}{}", if ro { " (read-only)" } else { "" })
                })
                .collect();
            rows.push(("Volumes", text.join(", ")));
        }
    }
    let meta: Vec<String> = f
        .get("metadata")
        .and_then(Value::as_object)
        .map(|m| {
            m.iter()
                .map(|(k, v)| format!("{k}={}", v.as_str().unwrap_or_default()))
                .collect()
        })
        .unwrap_or_default();
    rows.push((
        "Metadata",
        if meta.is_empty() {
            "-".into()
        } else {
            meta.join(", ")
        },
    ));
    rows.iter().map(|(k, v)| format!("{k:<10} {v}\n")).collect()
}

pub(crate) fn sandbox_json(s: &SandboxInfo) -> Value {
    let mut m = s.fields.clone();
    m.insert("id".into(), s.id.clone().into());
    Value::Object(m)
}

pub(crate) async fn outcome(f: impl std::future::Future<Output = Result<u8, ClientError>>) -> u8 {
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
                isolation,
                from_snapshot,
                volumes,
                on_idle,
                limits,
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
                if let Some(l) = limits.to_json() {
                    req["limits"] = l;
                }
                if let Some(i) = isolation {
                    req["isolation"] = i.as_str().into();
                }
                if let Some(s) = from_snapshot {
                    req["from_snapshot"] = s.into();
                }
                if !volumes.is_empty() {
                    req["volumes"] = serde_json::to_value(volumes).expect("mounts serialize");
                }
                if let Some(o) = on_idle {
                    req["on_idle"] = o.as_str().into();
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
                } else if list.is_empty() {
                    println!("No sandboxes.");
                } else {
                    println!(
                        "{:<36}  {:<18} {:<9} {:<10} {:<25} METADATA",
                        "ID", "TEMPLATE", "ISOLATION", "STATUS", "CREATED"
                    );
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
                    print!("{}", sandbox_view(&s));
                }
            }
            SandboxCommand::Kill { ids } => {
                for id in ids {
                    client.delete_sandbox(&id).await?;
                }
            }
            SandboxCommand::Pause { id } => {
                client.pause(&id).await?;
                said(json, &id, "paused", "Paused");
            }
            SandboxCommand::Resume { id } => {
                client.resume(&id).await?;
                said(json, &id, "running", "Resumed");
            }
            SandboxCommand::Hibernate { id } => {
                client.hibernate(&id).await?;
                said(json, &id, "hibernated", "Hibernated");
            }
            SandboxCommand::Wake { id } => {
                client.wake(&id).await?;
                said(json, &id, "running", "Woke");
            }
            SandboxCommand::Snapshot { id } => {
                let snap = client.create_snapshot(&id).await?;
                if json {
                    println!("{}", crate::storage::snapshot_json(&snap));
                } else {
                    println!("{}", snap.id);
                }
            }
            SandboxCommand::Fork {
                id,
                count,
                meta,
                ttl,
            } => {
                let metadata: BTreeMap<String, String> = meta.into_iter().collect();
                let metadata = (!metadata.is_empty()).then_some(metadata);
                let children = match count {
                    Some(n) => {
                        let tree = client.fork_tree(&id, n, metadata.as_ref()).await?;
                        if json {
                            let children: Vec<Value> =
                                tree.children.iter().map(sandbox_json).collect();
                            println!("{}", json!({"tree_id": tree.tree_id, "children": children}));
                            return Ok(0);
                        }
                        eprintln!(
                            "Forked {id} {} times (tree {}).",
                            tree.children.len(),
                            tree.tree_id
                        );
                        tree.children
                    }
                    None => {
                        let opts = ForkOptions {
                            metadata,
                            ttl_seconds: ttl.map(|t| t.as_secs()),
                        };
                        vec![client.fork(&id, &opts).await?]
                    }
                };
                for c in &children {
                    if json {
                        println!("{}", sandbox_json(c));
                    } else {
                        println!("{}", c.id);
                    }
                }
            }
            SandboxCommand::Promote {
                id,
                cleanup_siblings,
                tree,
            } => {
                let p = client
                    .promote(
                        &id,
                        &PromoteOptions {
                            cleanup_siblings,
                            tree_id: tree,
                        },
                    )
                    .await?;
                if json {
                    println!(
                        "{}",
                        json!({"winner": p.winner, "tree_id": p.tree_id, "deleted": p.deleted, "failures": p.failures})
                    );
                } else {
                    println!("Promoted {}; it is independent now.", p.winner);
                    for d in &p.deleted {
                        println!("Deleted sibling {d}.");
                    }
                }
                if !p.failures.is_empty() {
                    for (sib, why) in &p.failures {
                        eprintln!("runcell: could not delete sibling {sib}: {why}");
                    }
                    return Ok(1);
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

/// What a lifecycle command prints: a sentence, or with --json the
/// sandbox's id and new status.
fn said(json: bool, id: &str, status: &str, verb: &str) {
    if json {
        println!("{}", json!({"id": id, "status": status}));
    } else {
        println!("{verb} sandbox {id}.");
    }
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
    /// The program and its arguments, each passed as is (as docker exec
    /// does); a single argument is a shell command line (bash -c).
    #[arg(last = true, required = true)]
    command: Vec<String>,
}

/// The shell line that runs `argv`: one word is a shell line already; more
/// are quoted so each reaches the program as one argument.
pub(crate) fn shell_line(argv: &[String]) -> Result<String, String> {
    match argv {
        [line] => Ok(line.clone()),
        words => shlex::try_join(words.iter().map(String::as_str))
            .map_err(|e| format!("the command cannot be passed to the shell: {e}")),
    }
}

/// `runcell exec ID -- CMD`: output streamed as the command writes it;
/// exits with its status (124 after a timeout).
pub async fn exec(args: ExecArgs) -> u8 {
    let client = match args.conn.client() {
        Ok(c) => c,
        Err(code) => return code,
    };
    let cmd = match shell_line(&args.command) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("runcell: {e}");
            return 2;
        }
    };
    let opts = ExecOptions {
        timeout: args.timeout,
        env: args.env.into_iter().collect(),
        cwd: args.cwd,
        ..ExecOptions::default()
    };
    if args.conn.json {
        return outcome(async move {
            let r = client.exec(&args.id, &cmd, &opts).await?;
            println!(
                "{}",
                json!({"stdout": r.stdout, "stderr": r.stderr, "exit_code": r.exit_code,
                    "timed_out": r.timed_out, "duration_ms": r.duration_ms, "messages": r.messages})
            );
            Ok(u8::try_from(r.exit_code.clamp(0, 255)).unwrap_or(1))
        })
        .await;
    }
    outcome(async move {
        // Whether the last thing printed ended a line: the daemon's notes
        // (a truncation marker) then start on a line of their own.
        let mut at_line_start = true;
        let end = client
            .exec_stream(&args.id, &cmd, &opts, |stream, chunk| {
                if chunk.is_empty() {
                    return;
                }
                let _ = match stream {
                    Stream::Stdout => {
                        let mut o = std::io::stdout().lock();
                        o.write_all(chunk.as_bytes()).and_then(|()| o.flush())
                    }
                    Stream::Stderr => {
                        let mut e = std::io::stderr().lock();
                        let sep = if !at_line_start && chunk.starts_with("[runcell:") {
                            "\n"
                        } else {
                            ""
                        };
                        e.write_all(sep.as_bytes())
                            .and_then(|()| e.write_all(chunk.as_bytes()))
                            .and_then(|()| e.flush())
                    }
                };
                at_line_start = chunk.ends_with('\n');
            })
            .await?;
        if !at_line_start && (end.timed_out || end.error.is_some()) {
            eprintln!();
        }
        if end.timed_out {
            let limit = opts
                .timeout
                .map(|t| format!(" of {} s", runcell_core::format_secs(t)))
                .unwrap_or_default();
            eprintln!("runcell: the command exceeded its timeout{limit} and was stopped (exit status 124).");
        } else if let Some(e) = &end.error {
            eprintln!("runcell: {e}");
        }
        Ok(u8::try_from(end.exit_code.clamp(0, 255)).unwrap_or(1))
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
        let saved = if json {
            println!("{}", crate::context::cell_json(&cell));
            true
        } else {
            print_cell(&cell, args.save_images.as_deref())
        };
        Ok(crate::context::cell_status(&cell, saved))
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

/// Problems of `runcell cp`.
#[derive(Debug, thiserror::Error)]
pub enum CpError {
    /// A local file or directory could not be read or written.
    #[error("{what} {path}: {source}")]
    Local {
        /// What was being done.
        what: &'static str,
        /// The local path.
        path: PathBuf,
        /// Why it failed.
        #[source]
        source: std::io::Error,
    },
    /// The sandbox path does not exist.
    #[error("{0} does not exist in the sandbox")]
    NoRemote(String),
    /// The command that makes empty directories could not be quoted.
    #[error("{0}")]
    Quote(String),
    /// A directory into standard output.
    #[error("{0} is a directory; it cannot be written to standard output")]
    DirToStdout(String),
    /// The daemon refused something.
    #[error(transparent)]
    Api(#[from] ClientError),
}

fn local_err(what: &'static str, path: &std::path::Path) -> impl FnOnce(std::io::Error) -> CpError {
    let path = path.to_path_buf();
    move |source| CpError::Local { what, path, source }
}

/// The last component of a path (`/a/b/` gives `b`).
fn base_name(path: &str) -> &str {
    path.trim_end_matches('/')
        .rsplit('/')
        .next()
        .filter(|b| !b.is_empty() && *b != "." && *b != "..")
        .unwrap_or("")
}

fn join_remote(dir: &str, name: &str) -> String {
    format!("{}/{name}", dir.trim_end_matches('/'))
}

/// `runcell cp`: copies a file or a directory (recursively) into or out of
/// a sandbox. As with docker cp and scp, a destination that ends in `/` or is
/// an existing directory receives the source under its own name.
pub async fn cp(args: CpArgs) -> u8 {
    let client = match args.conn.client() {
        Ok(c) => c,
        Err(code) => return code,
    };
    let result = match (remote(&args.src), remote(&args.dst)) {
        (None, Some((id, path))) => upload(&client, &args.src, id, path).await,
        (Some((id, path)), None) => download(&client, id, path, &args.dst).await,
        _ => {
            eprintln!(
                "runcell: exactly one of SRC and DST must be SANDBOX:/absolute/path, the other a local path (or - for standard output)"
            );
            return 2;
        }
    };
    match result {
        Ok(()) => 0,
        Err(e) => {
            report(&e);
            1
        }
    }
}

async fn upload(client: &Client, src: &str, id: &str, dst: &str) -> Result<(), CpError> {
    let src_path = std::path::Path::new(src);
    let meta = std::fs::metadata(src_path).map_err(local_err("could not read", src_path))?;
    let name = src_path
        .canonicalize()
        .ok()
        .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .unwrap_or_else(|| base_name(src).to_string());
    let into = dst.ends_with('/')
        || client
            .stat(id, dst)
            .await?
            .is_some_and(|e| e.is_dir || e.mode == "d");
    let target = if into {
        join_remote(dst, &name)
    } else {
        dst.to_string()
    };
    if !meta.is_dir() {
        let data = std::fs::read(src_path).map_err(local_err("could not read", src_path))?;
        client.write_file(id, &target, data).await?;
        return Ok(());
    }
    // A directory: every file under it (parents are created by the write);
    // directories with no files are made with mkdir -p.
    let mut empty_dirs = Vec::new();
    let mut stack = vec![(src_path.to_path_buf(), target.clone())];
    while let Some((local, remote)) = stack.pop() {
        let mut any = false;
        let entries = std::fs::read_dir(&local).map_err(local_err("could not list", &local))?;
        for entry in entries {
            let entry = entry.map_err(local_err("could not list", &local))?;
            any = true;
            let path = entry.path();
            let r = join_remote(&remote, &entry.file_name().to_string_lossy());
            let ft = entry
                .file_type()
                .map_err(local_err("could not read", &path))?;
            if ft.is_dir() {
                stack.push((path, r));
            } else if ft.is_file() {
                let data = std::fs::read(&path).map_err(local_err("could not read", &path))?;
                client.write_file(id, &r, data).await?;
            } else {
                eprintln!(
                    "runcell: skipped {} (not a regular file or directory)",
                    path.display()
                );
            }
        }
        if !any {
            empty_dirs.push(remote);
        }
    }
    if !empty_dirs.is_empty() {
        let mut argv = vec!["mkdir".to_string(), "-p".into(), "--".into()];
        argv.extend(empty_dirs);
        let line = shell_line(&argv).map_err(CpError::Quote)?;
        let r = client.exec(id, &line, &ExecOptions::default()).await?;
        if r.exit_code != 0 {
            return Err(CpError::Api(ClientError::Api {
                status: 200,
                message: format!("mkdir in the sandbox failed: {}", r.stderr.trim()),
                body: Value::Null,
            }));
        }
    }
    Ok(())
}

async fn download(client: &Client, id: &str, src: &str, dst: &str) -> Result<(), CpError> {
    let Some(entry) = client.stat(id, src).await? else {
        return Err(CpError::NoRemote(src.to_string()));
    };
    let is_dir = entry.is_dir || entry.mode == "d";
    if dst == "-" {
        if is_dir {
            return Err(CpError::DirToStdout(src.to_string()));
        }
        let data = client.read_file(id, src).await?;
        let mut out = std::io::stdout().lock();
        return out
            .write_all(&data)
            .and_then(|()| out.flush())
            .map_err(local_err("could not write", std::path::Path::new("-")));
    }
    let dst_path = std::path::Path::new(dst);
    let name = match base_name(src) {
        "" => "root",
        n => n,
    };
    let target = if dst.ends_with('/') || dst_path.is_dir() {
        std::fs::create_dir_all(dst_path).map_err(local_err("could not create", dst_path))?;
        dst_path.join(name)
    } else {
        dst_path.to_path_buf()
    };
    if !is_dir {
        // A symbolic link named as the source is followed (read_file does).
        let data = client.read_file(id, src).await?;
        return std::fs::write(&target, data).map_err(local_err("could not write", &target));
    }
    let mut stack = vec![(src.to_string(), target)];
    while let Some((remote, local)) = stack.pop() {
        std::fs::create_dir_all(&local).map_err(local_err("could not create", &local))?;
        for e in client.list_dir(id, &remote).await? {
            let r = join_remote(&remote, &e.name);
            let l = local.join(&e.name);
            if e.is_dir || e.mode == "d" {
                stack.push((r, l));
            } else if e.mode == "l" {
                eprintln!("runcell: skipped {r} (a symbolic link)");
            } else {
                let data = client.read_file(id, &r).await?;
                std::fs::write(&l, data).map_err(local_err("could not write", &l))?;
            }
        }
    }
    Ok(())
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
                    // Each line carries its own newline.
                    if out
                        .write_all(line.as_bytes())
                        .and_then(|()| out.flush())
                        .is_err()
                    {
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
    #[arg(long, default_value = runcell_core::DEFAULT_TEMPLATE)]
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

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct Cmd {
        #[command(flatten)]
        args: SandboxArgs,
    }

    fn parse(argv: &[&str]) -> Result<SandboxCommand, String> {
        Cmd::try_parse_from(std::iter::once("sandbox").chain(argv.iter().copied()))
            .map(|c| c.args.command)
            .map_err(|e| e.to_string())
    }

    #[test]
    fn create_takes_a_snapshot_volumes_and_an_idle_action() {
        let SandboxCommand::Create {
            from_snapshot,
            volumes,
            on_idle,
            ..
        } = parse(&[
            "create",
            "--from-snapshot",
            "s1",
            "--volume",
            "data:ro",
            "-v",
            "cache:/var/cache/x",
            "--on-idle",
            "hibernate",
        ])
        .unwrap()
        else {
            panic!("not a create");
        };
        assert_eq!(from_snapshot.as_deref(), Some("s1"));
        assert_eq!(
            serde_json::to_value(&volumes).unwrap(),
            json!([{"name": "data", "read_only": true}, {"name": "cache", "path": "/var/cache/x"}])
        );
        assert_eq!(on_idle, Some(OnIdle::Hibernate));
        let e = parse(&["create", "--on-idle", "sleep"]).unwrap_err();
        assert!(e.contains("delete or hibernate"), "{e}");
        let e = parse(&["create", "--volume", "data:rw:x"]).unwrap_err();
        assert!(e.contains("NAME[:ro][:/PATH]"), "{e}");
    }

    #[test]
    fn get_shows_the_idle_action_origin_volumes_and_lost_state() {
        let s: SandboxInfo = serde_json::from_value(json!({
            "id": "sb-1", "template": "host", "status": "hibernated", "on_idle": "hibernate",
            "forked_from": "sb-0", "from_snapshot": null, "state_lost": true,
            "volumes": [{"name": "data", "path": "/mnt/data", "read_only": false},
                        {"name": "ref", "path": "/ref", "read_only": true}],
            "metadata": {}
        }))
        .unwrap();
        let view = sandbox_view(&s);
        for row in [
            "Status     hibernated\n",
            "On idle    hibernate\n",
            "Fork of    sb-0\n",
            "State      lost (woken from hibernation: code contexts restarted)\n",
            "Volumes    data at /mnt/data, ref at /ref (read-only)\n",
        ] {
            assert!(view.contains(row), "{row:?} not in\n{view}");
        }
        assert!(!view.contains("Snapshot"), "{view}");
        assert!(
            sandbox_line(&s).contains(" hibernated "),
            "{}",
            sandbox_line(&s)
        );
    }

    #[test]
    fn fork_counts_are_bounded_and_exclude_a_ttl() {
        assert!(matches!(
            parse(&["fork", "id", "--count", "16"]).unwrap(),
            SandboxCommand::Fork {
                count: Some(16),
                ..
            }
        ));
        assert!(parse(&["fork", "id", "--count", "17"]).is_err());
        assert!(parse(&["fork", "id", "--count", "0"]).is_err());
        assert!(parse(&["fork", "id", "--count", "2", "--ttl", "5m"]).is_err());
        for verb in ["pause", "resume", "hibernate", "wake", "snapshot"] {
            assert!(parse(&[verb, "id"]).is_ok(), "{verb}");
            assert!(parse(&[verb]).is_err(), "{verb} without an id");
        }
    }
}
