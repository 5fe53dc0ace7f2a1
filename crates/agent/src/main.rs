//! `runcell-agent`: PID 1 of every runcell sandbox.
//!
//! Started by the host as `runcell-agent init` inside fresh namespaces, it
//! builds the sandbox's filesystem ([`runcell_jail::inside::bootstrap`]),
//! installs the seccomp filter on itself (so every process it starts inherits
//! it), and then serves the framed protocol ([`runcell_protocol`]) on the
//! listening socket the host bound for it. It reaps every orphan, as an init
//! must.
//!
//! Under gVisor runsc starts it as `runcell-agent gvisor-init`, the init of
//! a container whose root the host already built; it then gets its spec and
//! binds its socket through host unix sockets
//! ([`runcell_jail::gvisor::bootstrap`]) and serves the same way.
//!
//! In a microVM guest it starts as `runcell-agent vm-init` instead (see
//! [`vm`]).

mod checkpoint;
mod context;
mod egress;
mod exec;
mod files;
mod limits;
mod procs;
mod reaper;
mod server;
mod shared;
mod shell;
mod vm;

use std::process::ExitCode;

/// At most this many file operations run at once; more wait their turn.
const FILE_THREADS: usize = 8;

fn main() -> ExitCode {
    let mut started = std::time::Instant::now();
    let mut in_vm = false;
    let mut fork_server = false;
    let gvisor = match std::env::args().nth(1).as_deref() {
        Some("init") => false,
        // The jail's agent fork server (runcell_jail::forkserver): each
        // sandbox's agent is forked from it and goes on as `init` below.
        Some(runcell_jail::forkserver::FORK_SERVER_ARG) => {
            fork_server = true;
            false
        }
        // Started by runsc as the init of a gVisor container.
        Some("gvisor-init") => true,
        // PID 1 of a microVM guest (the kernel passes what follows `--` on
        // its command line).
        Some("vm-init") => {
            in_vm = true;
            false
        }
        Some("--version") => {
            println!("runcell-agent {}", env!("CARGO_PKG_VERSION"));
            return ExitCode::SUCCESS;
        }
        _ => {
            eprintln!(
                "runcell-agent runs inside a sandbox and is started by runcell; it is not meant to be run by hand."
            );
            return ExitCode::from(2);
        }
    };
    // Everything in a sandbox starts from the usual umask, whatever the
    // daemon's is: the files the agent writes for the sandbox's user (code
    // cells, uploads) and the directories of its root, and every program it
    // starts. A daemon under `UMask=0077` (a hardened service) made the code
    // file of a run unreadable to the user who runs it ("Permission
    // denied", exit 126). Set here, before any thread, and inherited by
    // every agent a fork server forks.
    nix::sys::stat::umask(nix::sys::stat::Mode::from_bits_truncate(0o022));
    // Under gVisor the filter is an argument (the agent's environment is
    // empty there); elsewhere RUST_LOG.
    let filter = match gvisor
        .then(|| arg_value(runcell_jail::gvisor::LOG_ARG))
        .flatten()
    {
        Some(f) => tracing_subscriber::EnvFilter::try_new(f).ok(),
        None => tracing_subscriber::EnvFilter::try_from_default_env().ok(),
    };
    tracing_subscriber::fmt()
        .with_env_filter(filter.unwrap_or_else(|| tracing_subscriber::EnvFilter::new("warn")))
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .init();

    tracing::debug!(
        us = runcell_protocol::units::micros(started.elapsed()),
        "agent started"
    );
    if in_vm {
        return vm::main(started);
    }
    // The seccomp filter (installed at the end of setup), built before a
    // fork server serves, so each sandbox it forks inherits it built.
    let seccomp = runcell_jail::seccomp::filter();
    if fork_server {
        match runcell_jail::forkserver::serve() {
            // A forked sandbox agent: the init path below, as if exec'd.
            Ok(true) => started = std::time::Instant::now(),
            // The host closed the fork server's socket.
            Ok(false) => return ExitCode::SUCCESS,
            Err(e) => {
                tracing::error!("the agent fork server failed: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    // Under gVisor the process limit is gVisor's own pids cgroup, which the
    // agent joins before it starts anything; its count is sampled below.
    // This gVisor also shows /proc/1's environment and memory map to every
    // process, non-dumpable or not: masked before anything of the sandbox
    // runs. Then CAP_SYS_ADMIN, needed only for those mounts, goes.
    let pids_current = if gvisor {
        let set_up = runcell_jail::gvisor::hide_agent_proc()
            .and_then(|()| gvisor_pids_limit())
            .and_then(|c| runcell_jail::gvisor::drop_sys_admin().map(|()| c));
        match set_up {
            Ok(c) => c,
            Err(e) => {
                tracing::error!("sandbox setup failed: {e}");
                return ExitCode::FAILURE;
            }
        }
    } else {
        None
    };
    let boot = if gvisor {
        runcell_jail::gvisor::bootstrap()
    } else {
        runcell_jail::inside::bootstrap()
    };
    let boot = match boot {
        Ok(b) => b,
        Err(e) => {
            tracing::error!("sandbox setup failed: {e}");
            return ExitCode::FAILURE;
        }
    };

    // Landlock under the mount namespace: from here on the agent and all it
    // starts reach only files beneath the sandbox's root, whatever path
    // leads out of it. After the last mount (a confined process cannot
    // mount) and before seccomp, which does not allow the Landlock calls.
    let confinement = match runcell_jail::confine::confine_beneath(std::path::Path::new("/")) {
        Ok(c) => c,
        Err(e) => {
            tracing::error!("{e}");
            return ExitCode::FAILURE;
        }
    };
    tracing::debug!("Landlock {}", confinement.describe());
    // Installed on the agent itself so every process it starts inherits it;
    // the agent needs none of the denied calls after setup.
    let seccomp = match seccomp {
        Ok(f) => f,
        Err(e) => {
            tracing::error!("{e}");
            return ExitCode::FAILURE;
        }
    };
    if let Err(e) = runcell_jail::seccomp::install(&seccomp) {
        tracing::error!("{e}");
        return ExitCode::FAILURE;
    }
    // Sandboxed processes must not read the agent's memory or /proc/1 files.
    if let Err(e) = nix::sys::prctl::set_dumpable(false) {
        tracing::error!("could not make the agent non-dumpable: {e}");
        return ExitCode::FAILURE;
    }
    // Under gVisor, where copying a large process is slow, exec supervisors
    // are forked by a small copy of the agent made now, while it is
    // single-threaded (before the sampler thread and the runtime).
    if gvisor {
        match runcell_jail::zygote::Zygote::start() {
            Ok(z) => {
                tracing::debug!(pid = z.pid(), "exec fork server started");
                exec::use_zygote(z);
            }
            Err(e) => tracing::warn!("{e}: exec supervisors are forked from the agent"),
        }
    }
    if let Some((current, max)) = pids_current {
        if let Err(e) = limits::watch_sampled(current, max) {
            tracing::error!("could not start the process-limit sampler: {e}");
            return ExitCode::FAILURE;
        }
    }
    tracing::debug!(
        us = runcell_protocol::units::micros(started.elapsed()),
        "agent set up"
    );
    // One thread runs the protocol and the processes (the reaper relies on
    // it); file operations go to a small blocking pool, so a slow one never
    // holds up the rest.
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .max_blocking_threads(FILE_THREADS)
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            tracing::error!("could not start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(server::run(boot, confinement, gvisor)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e}");
            ExitCode::FAILURE
        }
    }
}

/// The value of the agent's argument starting with `prefix` (gVisor passes
/// its settings as arguments; its environment is empty).
fn arg_value(prefix: &str) -> Option<String> {
    std::env::args()
        .skip(2)
        .find_map(|a| a.strip_prefix(prefix).map(str::to_string))
}

/// Puts the agent in gVisor's pids cgroup limited to the process limit the
/// host passed ([`runcell_jail::gvisor::PIDS_ARG`]; none without it), and
/// gives that cgroup's open `pids.current` and the limit.
fn gvisor_pids_limit() -> Result<Option<(std::fs::File, u64)>, runcell_jail::inside::SetupError> {
    let Some(max) = arg_value(runcell_jail::gvisor::PIDS_ARG).and_then(|v| v.parse::<u64>().ok())
    else {
        return Ok(None);
    };
    let (current, groups) = runcell_jail::gvisor::limit_pids(max)?;
    exec::use_exec_groups(groups);
    Ok(Some((current, max)))
}
