//! `runcell context`: code contexts in a sandbox of a running daemon.

use std::io::{Read, Write};
use std::path::PathBuf;
use std::time::Duration;

use base64::Engine;
use clap::{Args, Subcommand};
use runcell_client::{Cell, Client, ClientError, Session};
use runcell_core::parse_duration;

use crate::report;

#[derive(Debug, Args)]
pub struct ContextArgs {
    #[command(flatten)]
    conn: crate::conn::Conn,
    #[command(subcommand)]
    command: ContextCommand,
}

#[derive(Debug, Subcommand)]
enum ContextCommand {
    /// Start a context (a long-lived interpreter) in a sandbox; prints its id.
    Create {
        /// Sandbox id.
        sandbox: String,
        /// python, javascript or bash.
        #[arg(long, short, default_value = "python")]
        language: String,
    },
    /// List a sandbox's contexts.
    Ls {
        /// Sandbox id.
        sandbox: String,
    },
    /// Run a cell: the code from -c, a file, or standard input. Exits with
    /// the cell's status (124 after a timeout).
    Run {
        /// Sandbox id.
        sandbox: String,
        /// Context id.
        context: String,
        /// The code.
        #[arg(short = 'c', long = "code", conflicts_with = "file")]
        code: Option<String>,
        /// A file holding the code.
        #[arg(long, short)]
        file: Option<PathBuf>,
        /// Timeout, e.g. 30s [default: the sandbox's].
        #[arg(long, value_parser = parse_duration)]
        timeout: Option<Duration>,
        /// Write image results (PNG, JPEG, SVG) into this directory.
        #[arg(long)]
        save_images: Option<PathBuf>,
    },
    /// Kill a context's interpreter and start a fresh one (state is lost).
    Restart {
        /// Sandbox id.
        sandbox: String,
        /// Context id.
        context: String,
    },
    /// Stop a context.
    Rm {
        /// Sandbox id.
        sandbox: String,
        /// Context id.
        context: String,
    },
}

fn print_json<T: serde::Serialize + ?Sized>(v: &T) {
    println!("{}", serde_json::to_string_pretty(v).unwrap_or_default());
}

fn session_line(s: &Session) -> String {
    format!(
        "{:<36}  {:<10}  {:<10}  {:<12}  {}",
        s.id, s.language, s.cells, s.restarts, s.created_at
    )
}

pub async fn main(args: ContextArgs) -> u8 {
    let client = match args.conn.client() {
        Ok(c) => c,
        Err(code) => return code,
    };
    match run(&client, args).await {
        Ok(code) => code,
        Err(e) => {
            report(&e);
            1
        }
    }
}

async fn run(client: &Client, args: ContextArgs) -> Result<u8, ClientError> {
    let json = args.conn.json;
    match args.command {
        ContextCommand::Create { sandbox, language } => {
            let s = client.create_context(&sandbox, &language).await?;
            if json {
                print_json(
                    &serde_json::json!({"id": s.id, "language": s.language, "sandbox_id": s.sandbox_id}),
                );
            } else {
                println!("{}", s.id);
            }
        }
        ContextCommand::Ls { sandbox } => {
            let list = client.list_contexts(&sandbox).await?;
            if json {
                let v: Vec<_> = list
                    .iter()
                    .map(|s| serde_json::json!({"id": s.id, "language": s.language, "cells": s.cells, "restarts": s.restarts, "created_at": s.created_at}))
                    .collect();
                print_json(&v);
            } else if list.is_empty() {
                println!("No contexts in sandbox {sandbox}.");
            } else {
                println!(
                    "{:<36}  {:<10}  {:<10}  {:<12}  CREATED",
                    "ID", "LANGUAGE", "CELLS", "RESTARTS"
                );
                for s in &list {
                    println!("{}", session_line(s));
                }
            }
        }
        ContextCommand::Run {
            sandbox,
            context,
            code,
            file,
            timeout,
            save_images,
        } => {
            let code = match (code, file) {
                (Some(c), _) => c,
                (None, Some(f)) => match std::fs::read_to_string(&f) {
                    Ok(c) => c,
                    Err(e) => {
                        eprintln!("runcell: could not read {}: {e}", f.display());
                        return Ok(2);
                    }
                },
                (None, None) => {
                    let mut c = String::new();
                    if let Err(e) = std::io::stdin().read_to_string(&mut c) {
                        eprintln!("runcell: could not read the code from standard input: {e}");
                        return Ok(2);
                    }
                    c
                }
            };
            let cell = client.run_cell(&sandbox, &context, &code, timeout).await?;
            let saved = if json {
                print_json(&cell_json(&cell));
                true
            } else {
                print_cell(&cell, save_images.as_deref())
            };
            return Ok(cell_status(&cell, saved));
        }
        ContextCommand::Restart { sandbox, context } => {
            let s = client.restart_context(&sandbox, &context).await?;
            if json {
                print_json(&serde_json::json!({"id": s.id, "restarts": s.restarts}));
            } else {
                println!("{}", session_line(&s));
            }
        }
        ContextCommand::Rm { sandbox, context } => {
            client.delete_context(&sandbox, &context).await?;
        }
    }
    Ok(0)
}

pub(crate) fn cell_json(c: &Cell) -> serde_json::Value {
    serde_json::json!({
        "stdout": c.stdout, "stderr": c.stderr, "exit_code": c.exit_code,
        "results": c.results, "duration_ms": c.duration_ms, "error": c.error,
        "exception": c.exception.as_ref().map(|e| serde_json::json!({"name": e.name, "value": e.value, "traceback": e.traceback})),
        "timed_out": c.timed_out, "state_lost": c.state_lost, "messages": c.messages,
    })
}

/// Prints the plain-sentence messages of an exec or cell on stderr, each
/// once: a truncation marker already printed with the output is not
/// repeated, and a marker (which names runcell itself) gets no prefix.
pub(crate) fn print_messages(messages: &[String], printed: &[&str]) {
    for m in messages {
        if printed.iter().any(|p| p.contains(m.as_str())) {
            continue;
        }
        if m.starts_with("[runcell:") {
            eprintln!("{m}");
        } else {
            eprintln!("runcell: {m}");
        }
    }
}

/// Output as a terminal user expects: streams as they were, values as text,
/// images saved (or described), problems on stderr. Returns false when an
/// image could not be saved (the reason is printed).
pub(crate) fn print_cell(c: &Cell, save_images: Option<&std::path::Path>) -> bool {
    let mut out = std::io::stdout().lock();
    let _ = out.write_all(c.stdout.as_bytes());
    let mut saved = 0;
    let mut all_saved = true;
    for r in &c.results {
        let image = ["image/png", "image/jpeg", "image/svg+xml"]
            .iter()
            .find_map(|m| r.get(*m).map(|d| (*m, d)));
        match (image, save_images) {
            (Some((mime, data)), Some(dir)) => {
                saved += 1;
                let ext = match mime {
                    "image/png" => "png",
                    "image/jpeg" => "jpg",
                    _ => "svg",
                };
                let path = dir.join(format!("result-{saved}.{ext}"));
                let bytes = if mime == "image/svg+xml" {
                    Ok(data.as_bytes().to_vec())
                } else {
                    base64::engine::general_purpose::STANDARD
                        .decode(data)
                        .map_err(|e| format!("the daemon sent invalid base64: {e}"))
                };
                let written = bytes.and_then(|b| {
                    std::fs::create_dir_all(dir)
                        .map_err(|e| format!("could not create {}: {e}", dir.display()))?;
                    std::fs::write(&path, b).map_err(|e| e.to_string())
                });
                match written {
                    Ok(()) => {
                        let _ = writeln!(out, "[{mime} saved to {}]", path.display());
                    }
                    Err(e) => {
                        all_saved = false;
                        let _ = out.flush();
                        eprintln!("runcell: could not save {mime} to {}: {e}", path.display());
                    }
                }
            }
            (Some((mime, data)), None) => {
                let _ = writeln!(
                    out,
                    "[{mime}, {} bytes; --save-images DIR writes it]",
                    data.len()
                );
            }
            (None, _) => {
                if let Some(t) = r.get("text/plain") {
                    let _ = writeln!(out, "{t}");
                }
            }
        }
    }
    let _ = out.flush();
    eprint!("{}", c.stderr);
    print_messages(&c.messages, &[&c.stdout, &c.stderr]);
    all_saved
}

/// The exit status of `context run` and `code`: the cell's (124 after a
/// timeout), else 1 when an image could not be saved.
pub(crate) fn cell_status(c: &Cell, saved: bool) -> u8 {
    if c.timed_out {
        124
    } else if c.exit_code != 0 {
        u8::try_from(c.exit_code.clamp(1, 255)).unwrap_or(1)
    } else if !saved {
        1
    } else {
        0
    }
}
