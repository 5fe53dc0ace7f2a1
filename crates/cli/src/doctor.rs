//! `runcell doctor`: what this host can enforce and which isolation
//! backends can run here, and why not (see `runcell_core::host`).

use std::process::ExitCode;

use clap::Args;
use runcell_core::host::{system_report, Check};

#[derive(Debug, Args)]
pub struct DoctorArgs {
    /// Print the report as JSON (the same object as `GET /v1/system`).
    #[arg(long)]
    json: bool,
    /// Probe again: forget the answers of the slow probes (a test guest
    /// under KVM, a trial gVisor run) kept for this boot in /run/runcell.
    #[arg(long)]
    fresh: bool,
}

fn mark(available: bool) -> &'static str {
    if available {
        "yes"
    } else {
        "no "
    }
}

fn line(what: &str, c: &Check) {
    println!("  {what:<18} {}  {}", mark(c.available), c.detail);
}

/// Prints the report; exits 1 when no backend can run sandboxes here.
pub fn main(args: DoctorArgs) -> ExitCode {
    if args.fresh {
        for name in ["kvm", "runsc"] {
            let _ = std::fs::remove_file(runcell_core::backend::probe_cache::path(name));
        }
    }
    let r = system_report();
    if args.json {
        match serde_json::to_string_pretty(&r) {
            Ok(s) => println!("{s}"),
            Err(e) => {
                eprintln!("runcell: could not write the report: {e}");
                return ExitCode::from(1);
            }
        }
    } else {
        println!("Host (Linux {})", r.host.kernel);
        line("user namespaces", &r.host.user_namespaces);
        line("seccomp", &r.host.seccomp);
        line("Landlock", &r.host.landlock);
        println!(
            "  {:<18} {}  {}",
            "cgroups",
            mark(r.host.cgroups.version != "none"),
            r.host.cgroups.detail
        );
        println!(
            "  {:<18} {}  {}",
            "OOM kill reporting",
            mark(r.host.cgroups.oom_kill_reporting),
            if r.host.cgroups.oom_kill_reporting {
                "an out-of-memory kill is reported by name"
            } else {
                "an out-of-memory kill shows only as SIGKILL"
            }
        );
        line("KVM device", &r.host.kvm);
        println!("Isolation backends");
        for b in &r.backends {
            println!("  {:<18} {}  {}", b.name, mark(b.available), b.detail);
        }
        // What `runcell serve`'s default (`--layer-store auto`) picks here.
        println!("Layer store (runcell serve --layer-store auto, the default)");
        match runcell_server::store::btrfs_possible() {
            Ok(mkfs) => println!(
                "  {:<18} {}  the kernel has btrfs and {} is installed: snapshots, forks and hibernation are copy-on-write (GET /v1/system says what a running daemon chose, and why)",
                "btrfs",
                mark(true),
                mkfs.display()
            ),
            Err(why) => println!(
                "  {:<18} {}  {why}: sandboxes write to a tmpfs and a save copies it",
                "btrfs",
                mark(false)
            ),
        }
        if !args.fresh {
            println!(
                "(slow probes are kept for this boot in {}; --fresh probes again)",
                runcell_core::backend::probe_cache::CACHE_DIR
            );
        }
    }
    if r.backends.iter().any(|b| b.available) {
        ExitCode::SUCCESS
    } else {
        if !args.json {
            eprintln!("runcell: no isolation backend can run sandboxes on this host");
        }
        ExitCode::from(1)
    }
}
