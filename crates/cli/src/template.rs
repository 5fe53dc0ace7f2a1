//! `runcell template build|ls|rm`.

use std::io::Write;
use std::path::PathBuf;

use clap::{Args, Subcommand};
use runcell_core::build::{self, BuildOptions, Progress};
use runcell_core::{format_size, Output, Runtime, RuntimeConfig};

use crate::report;

#[derive(Debug, Args)]
pub struct TemplateArgs {
    #[command(subcommand)]
    command: TemplateCommand,
}

#[derive(Debug, Subcommand)]
enum TemplateCommand {
    /// Build a template from a Dockerfile subset (FROM debian:<suite> or a
    /// template, RUN, ENV, WORKDIR, COPY, USER, LABEL). RUN steps run in a
    /// sandbox, as root of the sandbox, with the host's network.
    Build {
        /// Template name.
        name: String,
        /// The recipe.
        #[arg(short = 'f', long = "file")]
        file: PathBuf,
        /// Directory COPY sources are relative to [default: the recipe's directory].
        #[arg(long)]
        context: Option<PathBuf>,
        /// Debian mirror for FROM debian:<suite>.
        #[arg(long, default_value = build::DEBIAN_MIRROR)]
        mirror: String,
    },
    /// List the templates: the daemon's (GET /v1/templates) when one is
    /// reachable with a key, else those in the local templates directory
    /// (always that directory with --local or --templates-dir).
    Ls {
        /// The daemon [default: $RUNCELL_URL, else http://127.0.0.1:7070].
        #[arg(long)]
        url: Option<String>,
        /// API key [default: $RUNCELL_API_KEY, else the key file runcell serve wrote].
        #[arg(long)]
        api_key: Option<String>,
        /// List the local templates directory even when a daemon is serving.
        #[arg(long)]
        local: bool,
    },
    /// Remove a template and the layers no other template uses.
    Rm {
        /// Template name.
        name: String,
    },
}

/// Runs `runcell template ...`; returns the exit status. `explicit_dir`:
/// --templates-dir (or RUNCELL_TEMPLATES_DIR) was given, so `ls` lists that
/// directory rather than asking a daemon.
pub async fn main(config: RuntimeConfig, args: TemplateArgs, explicit_dir: bool) -> u8 {
    match args.command {
        TemplateCommand::Ls {
            url,
            api_key,
            local,
        } => {
            if !local && !explicit_dir {
                if let Some(code) = ls_daemon(url, api_key).await {
                    return code;
                }
            }
            ls(&config)
        }
        TemplateCommand::Rm { name } => {
            let runtime = match Runtime::new(config) {
                Ok(r) => r,
                Err(e) => {
                    report(&e);
                    return 125;
                }
            };
            match build::remove(&runtime, &name) {
                Ok(r) => {
                    println!(
                        "Removed template {name}; {} unused layer(s) freed ({}).",
                        r.layers,
                        format_size(r.bytes)
                    );
                    0
                }
                Err(e) => {
                    report(&e);
                    1
                }
            }
        }
        TemplateCommand::Build {
            name,
            file,
            context,
            mirror,
        } => {
            // From here on an interrupt stops the build the clean way.
            let mut interrupts = crate::run::catch_interrupts();
            let recipe = match std::fs::read_to_string(&file) {
                Ok(r) => r,
                Err(e) => {
                    report(&build::BuildError::ReadRecipe(file, e));
                    return 2;
                }
            };
            let context = context.unwrap_or_else(|| {
                file.parent()
                    .filter(|p| !p.as_os_str().is_empty())
                    .map(PathBuf::from)
                    .unwrap_or_else(|| PathBuf::from("."))
            });
            let runtime = match Runtime::new(config) {
                Ok(r) => r,
                Err(e) => {
                    report(&e);
                    return 125;
                }
            };
            for id in runtime.sweep_dead() {
                tracing::info!(sandbox = %id, "removed a sandbox left behind by an earlier run");
            }
            let opts = BuildOptions {
                name: name.clone(),
                recipe,
                context,
                mirror,
            };
            let mut on_progress = |p: Progress<'_>| {
                let mut out = std::io::stdout().lock();
                let _ = match p {
                    Progress::Step { index, total, text } => {
                        writeln!(out, "Step {index}/{total} : {text}")
                    }
                    Progress::Cached => writeln!(out, " ---> CACHED"),
                    Progress::Output(Output::Stdout, bytes) => out.write_all(bytes),
                    Progress::Output(Output::Stderr, bytes) => {
                        let _ = out.flush();
                        let mut err = std::io::stderr().lock();
                        err.write_all(bytes).and_then(|()| err.flush())
                    }
                };
                let _ = out.flush();
            };
            let started = std::time::Instant::now();
            let result = tokio::select! {
                r = build::build(&runtime, &opts, &mut on_progress) => Some(r),
                _ = interrupts.recv() => None,
            };
            match result {
                Some(Ok(summary)) => {
                    println!(
                        "Built template {name}: {} step(s), {} cached, {} on disk, in {:.1} s.",
                        summary.steps,
                        summary.cached,
                        format_size(summary.template.size_bytes),
                        summary.elapsed.as_secs_f64()
                    );
                    0
                }
                Some(Err(e)) => {
                    report(&e);
                    eprintln!(
                        "runcell: the build failed after {:.1} s; template {name} was not changed.",
                        started.elapsed().as_secs_f64()
                    );
                    1
                }
                None => {
                    eprintln!("runcell: interrupted; template {name} was not changed.");
                    130
                }
            }
        }
    }
}

/// Lists the daemon's templates; `None` (after saying why) when no daemon
/// answers with this key, so the local directory is listed instead.
async fn ls_daemon(url: Option<String>, key: Option<String>) -> Option<u8> {
    let client = match runcell_client::Client::from_env(url, key) {
        Ok(c) => c,
        Err(e) => {
            tracing::debug!(error = %e, "no daemon key; listing the local directory");
            return None;
        }
    };
    let list = match client.list_templates().await {
        Ok(l) => l,
        Err(runcell_client::ClientError::Connect { url, .. }) => {
            eprintln!(
                "runcell: no daemon answers at {url}; listing the local templates directory."
            );
            return None;
        }
        Err(e) => {
            report(&e);
            return Some(1);
        }
    };
    eprintln!("Templates of the daemon at {}:", client.url());
    let rows: Vec<[String; 4]> = list
        .iter()
        .map(|t| {
            let s = |k: &str| t.get(k).and_then(serde_json::Value::as_str).unwrap_or("");
            let name = s("name").to_string();
            let size = match t.get("size_bytes").and_then(serde_json::Value::as_u64) {
                Some(b) if b > 0 => format_size(b),
                _ => "-".into(),
            };
            let created = match t.get("created_at").and_then(serde_json::Value::as_u64) {
                Some(c) => format_time(c),
                None if name == "host" => "built in".into(),
                None => "-".into(),
            };
            let description = match t.get("alias_of").and_then(serde_json::Value::as_str) {
                Some(a) => format!("alias of {a}: {}", s("description")),
                None => s("description").to_string(),
            };
            [name, size, created, description]
        })
        .collect();
    print_table(&rows);
    Some(0)
}

fn ls(config: &RuntimeConfig) -> u8 {
    let templates = match build::list(config.templates_dir.as_deref()) {
        Ok(t) => t,
        Err(e) => {
            report(&e);
            return 1;
        }
    };
    eprintln!(
        "Templates in {}:",
        config
            .templates_dir
            .as_deref()
            .unwrap_or(std::path::Path::new(crate::DEFAULT_TEMPLATES_DIR))
            .display()
    );
    let rows: Vec<[String; 4]> = templates
        .iter()
        .map(|t| {
            let (size, created) = if t.name == "host" {
                ("-".to_string(), "built in".to_string())
            } else {
                (format_size(t.size_bytes), format_time(t.created_unix))
            };
            [t.name.clone(), size, created, t.description.clone()]
        })
        .collect();
    print_table(&rows);
    0
}

fn print_table(rows: &[[String; 4]]) {
    let header = [
        "NAME".to_string(),
        "SIZE".into(),
        "CREATED".into(),
        "DESCRIPTION".into(),
    ];
    let widths: Vec<usize> = (0..3)
        .map(|i| {
            rows.iter()
                .map(|r| r[i].len())
                .chain([header[i].len()])
                .max()
                .unwrap_or(0)
        })
        .collect();
    for r in std::iter::once(&header).chain(rows.iter()) {
        println!(
            "{:w0$}  {:w1$}  {:w2$}  {}",
            r[0],
            r[1],
            r[2],
            r[3],
            w0 = widths[0],
            w1 = widths[1],
            w2 = widths[2]
        );
    }
}

/// `2025-01-31 12:00 UTC` from unix seconds ("-" for 0).
pub(crate) fn format_time(unix: u64) -> String {
    if unix == 0 {
        return "-".into();
    }
    runcell_core::timestamp(i64::try_from(unix).unwrap_or(i64::MAX))
        .strftime("%Y-%m-%d %H:%M UTC")
        .to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_times() {
        assert_eq!(format_time(0), "-");
        assert_eq!(
            format_time(86_400 * 365 + 3600 + 120),
            "1971-01-01 01:02 UTC"
        );
        assert_eq!(format_time(1_700_000_000), "2023-11-14 22:13 UTC");
    }
}
