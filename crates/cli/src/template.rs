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
    /// List the installed templates.
    Ls,
    /// Remove a template and the layers no other template uses.
    Rm {
        /// Template name.
        name: String,
    },
}

/// Runs `runcell template ...`; returns the exit status.
pub async fn main(config: RuntimeConfig, args: TemplateArgs) -> u8 {
    match args.command {
        TemplateCommand::Ls => ls(&config),
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
                _ = crate::run::interrupted() => None,
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

fn ls(config: &RuntimeConfig) -> u8 {
    let templates = match build::list(config.templates_dir.as_deref()) {
        Ok(t) => t,
        Err(e) => {
            report(&e);
            return 1;
        }
    };
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
    0
}

/// `2025-01-31 12:00 UTC` from unix seconds ("-" for 0).
fn format_time(unix: u64) -> String {
    if unix == 0 {
        return "-".into();
    }
    let (y, m, d, secs) = runcell_core::civil(unix as i64);
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02} UTC",
        secs / 3600,
        secs % 3600 / 60
    )
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
