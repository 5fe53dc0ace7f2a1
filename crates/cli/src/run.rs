//! `runcell run`: one sandbox, one program, then nothing left.

use std::io::{IsTerminal, Read, Write};
use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use runcell_core::{
    parse_duration, parse_size, Output, RunOptions, Runtime, RuntimeConfig, SandboxLimits,
    SandboxOptions,
};
use runcell_protocol::Language;

use crate::report;

/// Largest program accepted (from a file, stdin or -c).
const MAX_CODE: u64 = 16 << 20;

#[derive(Debug, Args)]
pub struct RunArgs {
    /// Language: python, javascript (node) or bash.
    language: String,
    /// Source file to run, or - to read the program from standard input.
    file: Option<PathBuf>,
    /// Program text (instead of a file).
    #[arg(short = 'c', long = "code", conflicts_with = "file")]
    code: Option<String>,
    /// Wall-clock limit, e.g. 5, 5s, 500ms, 2m.
    #[arg(long, default_value = "60s", value_parser = parse_duration)]
    timeout: Duration,
    /// Memory limit (includes files written to the sandbox), e.g. 256M.
    #[arg(long, default_value = "1G", value_parser = parse_size)]
    memory: u64,
    /// Maximum number of processes and threads.
    #[arg(long, default_value_t = 512)]
    pids: u64,
    /// CPU limit in cores, e.g. 0.5.
    #[arg(long, default_value_t = 1.0)]
    cpus: f64,
    /// Size of the sandbox's writable layer, e.g. 512M.
    #[arg(long, default_value = "512M", value_parser = parse_size)]
    disk: u64,
    /// Bytes of each of stdout and stderr printed; the rest is counted.
    #[arg(long, default_value = "1M", value_parser = parse_size)]
    output_limit: u64,
    /// Template the sandbox is made from.
    #[arg(long, default_value = "host")]
    template: String,
    /// Environment variable for the program, KEY=VALUE (repeatable).
    #[arg(short = 'e', long = "env", value_parser = parse_env)]
    env: Vec<(String, String)>,
    /// Network egress: none, open, allowlist:RULE;RULE... (host names,
    /// *.wildcards, :ports, or presets such as package-index), or a JSON
    /// policy. Loopback and private ranges stay closed. [default: none]
    #[arg(long, value_parser = parse_network)]
    network: Option<runcell_egress::NetworkPolicy>,
    /// Isolation: jail (namespaces, seccomp, Landlock, cgroups; the
    /// fastest), gvisor (runsc's user-space kernel) or microvm (a guest
    /// kernel in QEMU). `runcell doctor` says which run here.
    #[arg(long, default_value = "jail")]
    isolation: runcell_core::backend::Isolation,
    /// Let a microVM run under TCG emulation where KVM cannot run a guest
    /// (slow).
    #[arg(long)]
    allow_emulation: bool,
    /// Whether to run through a local daemon's standby pool: auto (when
    /// `runcell serve` runs at $RUNCELL_URL, else http://127.0.0.1:7070,
    /// and its key is at hand: $RUNCELL_API_KEY, else the key file of
    /// $RUNCELL_DATA_DIR, else /var/lib/runcell), always (fail without
    /// one) or never. Output, exit status and limits are the same either
    /// way.
    #[arg(long, env = "RUNCELL_RUN_DAEMON", default_value = "auto", value_enum)]
    daemon: DaemonUse,
    /// Never use a daemon: the same as --daemon never.
    #[arg(long)]
    no_daemon: bool,
    /// Arguments passed to the program (after --).
    #[arg(last = true)]
    args: Vec<String>,
}

/// Whether `runcell run` goes through a daemon.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum DaemonUse {
    /// Through a local daemon when one answers, else in this process.
    Auto,
    /// Through a daemon; fail when none answers.
    Always,
    /// In this process.
    Never,
}

/// A `--network` value.
pub(crate) fn parse_network(s: &str) -> Result<runcell_egress::NetworkPolicy, String> {
    runcell_egress::NetworkPolicy::parse_setting(s).map_err(|e| e.to_string())
}

fn parse_env(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.into(), v.into())),
        _ => Err(format!("\"{s}\" is not KEY=VALUE")),
    }
}

fn read_code(args: &RunArgs) -> Result<String, String> {
    let mut buf = Vec::new();
    match (&args.code, &args.file) {
        (Some(code), _) => return Ok(code.clone()),
        (None, Some(p)) if p.as_os_str() == "-" => {
            std::io::stdin()
                .take(MAX_CODE + 1)
                .read_to_end(&mut buf)
                .map_err(|e| format!("could not read the program from standard input: {e}"))?;
        }
        (None, Some(p)) => {
            std::fs::File::open(p)
                .and_then(|f| f.take(MAX_CODE + 1).read_to_end(&mut buf))
                .map_err(|e| format!("could not read {}: {e}", p.display()))?;
        }
        (None, None) if !std::io::stdin().is_terminal() => {
            std::io::stdin()
                .take(MAX_CODE + 1)
                .read_to_end(&mut buf)
                .map_err(|e| format!("could not read the program from standard input: {e}"))?;
        }
        (None, None) => {
            return Err(
                "give the program with -c CODE, as a file, or as - to read standard input".into(),
            )
        }
    }
    if buf.len() as u64 > MAX_CODE {
        return Err(format!("the program is larger than {} MiB", MAX_CODE >> 20));
    }
    String::from_utf8(buf).map_err(|_| "the program is not valid UTF-8".into())
}

/// Runs `runcell run`; returns the process exit status.
pub async fn run(config: RuntimeConfig, args: RunArgs) -> u8 {
    let mut interrupts = catch_interrupts();
    let language: Language = match args.language.parse() {
        Ok(l) => l,
        Err(e) => {
            eprintln!("runcell: {e}");
            return 2;
        }
    };
    let code = match read_code(&args) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("runcell: {e}");
            return 2;
        }
    };
    let daemon = if args.no_daemon {
        DaemonUse::Never
    } else {
        args.daemon
    };
    if daemon != DaemonUse::Never {
        match through_daemon(&args, language, &code, &mut interrupts).await {
            Ok(status) => return status,
            Err(why) if daemon == DaemonUse::Always => {
                eprintln!("runcell: {why}");
                return 125;
            }
            Err(why) => tracing::debug!("running without a daemon: {why}"),
        }
    }
    let runtime = match Runtime::new(config) {
        Ok(r) => r,
        Err(e) => {
            report(&e);
            return 125;
        }
    };
    // Only the backend asked for is probed: the jail's path spawns
    // nothing extra.
    let runtime = runcell_core::host::equip_one(
        runtime,
        args.isolation,
        &runcell_core::host::HostOptions {
            allow_emulation: args.allow_emulation,
        },
    );
    // Leftovers of runs whose runcell process was killed.
    for id in runtime.sweep_dead() {
        tracing::info!(sandbox = %id, "removed a sandbox left behind by an earlier run");
    }
    let limits = SandboxLimits {
        memory_bytes: args.memory,
        pids: args.pids,
        cpu_millis: runcell_protocol::units::cpu_millis(args.cpus),
        disk_bytes: args.disk,
        timeout: args.timeout,
        output_bytes: args.output_limit,
    };
    let opts = SandboxOptions {
        template: args.template.clone(),
        limits,
        tied_to_process: true,
        // A backstop well past the run timeout, should this process vanish
        // without its sandbox noticing.
        max_lifetime: Some(args.timeout + Duration::from_secs(60)),
        network: args
            .network
            .clone()
            .filter(runcell_egress::NetworkPolicy::has_egress),
        isolation: Some(args.isolation),
        // The program follows at once, on a connection that checks the
        // agent's hello itself.
        one_shot: true,
        ..SandboxOptions::default()
    };
    let sandbox = match runtime.create(opts).await {
        Ok(s) => s,
        Err(e) => {
            report(&e);
            return 125;
        }
    };
    let run_opts = RunOptions {
        env: args.env.iter().cloned().collect(),
        args: args.args.clone(),
        ..Default::default()
    };
    let status = wait_for_run(
        async {
            sandbox
                .run_code_streaming(language, &code, &run_opts, |stream, bytes| {
                    echo(stream == Output::Stderr, bytes);
                })
                .await
                .map(|outcome| Ended::Exited {
                    status: outcome.status(),
                    messages: outcome.messages(),
                })
        },
        &mut interrupts,
    )
    .await;
    if let Err(e) = sandbox.destroy().await {
        report(&e);
        return 125;
    }
    status
}

/// How long a sandbox made for `runcell run` outlives a `runcell` that was
/// killed outright: its idle TTL in the daemon (a running program keeps it
/// busy; a killed `runcell` closes the stream, which kills the program).
const DAEMON_RUN_TTL_SECONDS: u64 = 5;

/// Why a run did not go through a daemon (nothing was created there).
#[derive(Debug, thiserror::Error)]
pub enum NoDaemon {
    /// No key for a daemon is at hand.
    #[error("no daemon key: {0}")]
    NoKey(#[source] runcell_client::ClientError),
    /// A limit the daemon's API cannot carry exactly.
    #[error("the {0} limit is not a whole number of MiB, which the daemon's API takes")]
    NotWholeMib(&'static str),
    /// `--allow-emulation` is this process's setting, not the daemon's.
    #[error("--allow-emulation applies to a sandbox made by this process")]
    Emulation,
    /// The daemon did not answer or refused the sandbox.
    #[error("the daemon did not make the sandbox: {0}")]
    Create(#[source] runcell_client::ClientError),
    /// The daemon has no `POST /v1/run` (it is older than this client).
    #[error("the daemon is older than this runcell (it has no POST /v1/run); upgrade it")]
    TooOld,
}

fn whole_mib(field: &'static str, bytes: u64) -> Result<u64, NoDaemon> {
    if bytes.is_multiple_of(1 << 20) {
        Ok(bytes >> 20)
    } else {
        Err(NoDaemon::NotWholeMib(field))
    }
}

/// Runs the program in a sandbox from a local daemon (its standby pool):
/// the daemon makes the sandbox with this run's limits, streams the
/// program's output bytes as written, and deletes it. `Err` when no sandbox
/// was made there (the caller may then run it itself); once one was made,
/// every outcome is this run's exit status, reported as a run in this
/// process reports it.
async fn through_daemon(
    args: &RunArgs,
    language: Language,
    code: &str,
    interrupts: &mut Interrupts,
) -> Result<u8, NoDaemon> {
    if args.allow_emulation {
        return Err(NoDaemon::Emulation);
    }
    let client = runcell_client::Client::from_env(None, None).map_err(NoDaemon::NoKey)?;
    let mut limits = serde_json::json!({
        "memory_mb": whole_mib("memory", args.memory)?,
        "disk_mb": whole_mib("disk", args.disk)?,
        "pids": args.pids,
        "cpu": args.cpus,
        "timeout_seconds": args.timeout.as_secs_f64(),
        "output_bytes": args.output_limit,
    });
    let mut request = serde_json::json!({
        "template": args.template,
        "isolation": args.isolation.as_str(),
        "ttl_seconds": DAEMON_RUN_TTL_SECONDS,
        "metadata": {"created_by": "runcell run"},
    });
    request["limits"] = limits.take();
    if let Some(n) = args
        .network
        .as_ref()
        .filter(|n| runcell_egress::NetworkPolicy::has_egress(n))
    {
        request["network"] = serde_json::to_value(n).expect("a network policy serializes");
    }
    let opts = runcell_client::ExecOptions {
        env: args.env.iter().cloned().collect(),
        ..Default::default()
    };
    // One request: the daemon makes the sandbox, runs the program and
    // deletes the sandbox once it has run (`POST /v1/run`).
    let mut made: Option<String> = None;
    let mut refused = None;
    let mut streamed = false;
    let status = wait_for_run(
        async {
            let end = client
                .run_code_once(
                    &request,
                    language.name(),
                    code,
                    &args.args,
                    &opts,
                    |id| made = Some(id.to_string()),
                    |stream, bytes| echo(stream == runcell_client::Stream::Stderr, bytes),
                )
                .await;
            match end {
                // Nothing was made: the caller may run it itself.
                Err(e) if made.is_none() && e.did_nothing() => {
                    refused = Some(e);
                    Ok(Ended::Refused)
                }
                Err(e) => Err(e),
                Ok(end) => {
                    streamed = true;
                    Ok(match end.error {
                        Some(error) => Ended::Failed(error),
                        None => Ended::Exited {
                            status: end.exit_code,
                            messages: end.messages,
                        },
                    })
                }
            }
        },
        interrupts,
    )
    .await;
    if let Some(e) = refused {
        return Err(match e.status() {
            Some(404) if e.to_string().contains("no such route") => NoDaemon::TooOld,
            _ => NoDaemon::Create(e),
        });
    }
    // Interrupted, or the stream failed: the daemon deletes the sandbox too
    // once it sees the stream closed; this makes sure, at once (one the
    // daemon has deleted meanwhile is no longer there to find).
    if !streamed {
        if let Some(id) = made {
            match client.delete_sandbox(&id).await {
                Err(e) if e.status() != Some(404) => {
                    report(&e);
                    return Ok(125);
                }
                _ => {}
            }
        }
    }
    Ok(status)
}

/// How a run that was not interrupted ended: the program's exit status
/// and the notes on the limits it hit, or why it could not run.
enum Ended {
    Exited {
        status: i32,
        messages: Vec<String>,
    },
    Failed(String),
    /// The daemon refused the run before anything was made (the caller
    /// says why).
    Refused,
}

/// Waits for `run` unless the user interrupts it first, and gives the
/// status `runcell run` exits with, having said why: 130 after an
/// interrupt (the caller destroys the sandbox), 125 when runcell or the
/// sandbox failed, else the program's own (0 to 255) after the notes on
/// the limits it hit.
async fn wait_for_run<E: std::error::Error>(
    run: impl std::future::Future<Output = Result<Ended, E>>,
    interrupts: &mut Interrupts,
) -> u8 {
    // An interrupt that came while the sandbox was made wins over the run.
    let outcome = tokio::select! {
        biased;
        _ = interrupts.recv() => None,
        r = run => Some(r),
    };
    match outcome {
        None => {
            eprintln!("runcell: interrupted; the sandbox was destroyed.");
            130
        }
        Some(Err(e)) => {
            report(&e);
            125
        }
        Some(Ok(Ended::Failed(error))) => {
            eprintln!("runcell: {error}");
            125
        }
        Some(Ok(Ended::Refused)) => 125,
        Some(Ok(Ended::Exited { status, messages })) => {
            for m in &messages {
                eprintln!("runcell: {m}");
            }
            u8::try_from(status.clamp(0, 255)).unwrap_or(1)
        }
    }
}

/// SIGINT, SIGTERM and SIGHUP, caught from the moment this is made: one
/// that comes before it is awaited (while the sandbox is being created) is
/// kept, so the run that follows stops at once and its sandbox is
/// destroyed, rather than the signal's default action ending this process
/// with the sandbox left for a later sweep. Should they not be catchable,
/// they keep their default action.
pub type Interrupts = runcell_core::signals::Caught;

/// Catches SIGINT, SIGTERM and SIGHUP from now on (see [`Interrupts`]).
pub fn catch_interrupts() -> Interrupts {
    use tokio::signal::unix::SignalKind;
    runcell_core::signals::Caught::catch(&[
        SignalKind::interrupt(),
        SignalKind::terminate(),
        SignalKind::hangup(),
    ])
    .unwrap_or_else(|_| runcell_core::signals::Caught::nothing())
}

/// Passes a program's output through as it comes, to our stderr or stdout.
fn echo(to_stderr: bool, bytes: &[u8]) {
    let _ = if to_stderr {
        let mut e = std::io::stderr().lock();
        e.write_all(bytes).and_then(|_| e.flush())
    } else {
        let mut o = std::io::stdout().lock();
        o.write_all(bytes).and_then(|_| o.flush())
    };
}
