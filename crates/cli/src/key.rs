//! `runcell key`: manage the daemon's API keys (works with the daemon running).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Subcommand};
use runcell_server::{keys, Registry};

#[derive(Debug, Args)]
pub struct KeyArgs {
    /// The daemon's data directory (before or after the subcommand).
    #[arg(
        long,
        global = true,
        env = "RUNCELL_DATA_DIR",
        default_value = "/var/lib/runcell"
    )]
    data_dir: PathBuf,
    #[command(subcommand)]
    command: KeyCommand,
}

#[derive(Debug, Subcommand)]
enum KeyCommand {
    /// Create a key for a workspace and print it (it is shown only once).
    Create {
        /// The workspace the key belongs to.
        #[arg(long, default_value = "default")]
        workspace: String,
        /// A label for listings.
        #[arg(long, default_value = "")]
        name: String,
    },
    /// List keys (prefixes only).
    Ls,
    /// Revoke the key with this prefix (as shown by `ls`).
    Revoke {
        /// The key's prefix.
        prefix: String,
    },
}

pub fn main(args: KeyArgs) -> ExitCode {
    let db = args.data_dir.join("registry.db");
    if !db.exists() {
        eprintln!(
            "runcell: no registry at {}; start `runcell serve --data-dir {}` once first.",
            db.display(),
            args.data_dir.display()
        );
        return ExitCode::from(1);
    }
    let registry = match Registry::open(&db) {
        Ok(r) => r,
        Err(e) => {
            crate::report(&e);
            return ExitCode::from(1);
        }
    };
    let result = registry.with_conn(|c| -> Result<(), String> {
        match args.command {
            KeyCommand::Create { workspace, name } => {
                if workspace.is_empty()
                    || !workspace
                        .chars()
                        .all(|ch| ch.is_ascii_alphanumeric() || "-_.".contains(ch))
                {
                    return Err(
                        "the workspace name may use letters, digits, '-', '_' and '.'".into(),
                    );
                }
                let key = keys::generate().map_err(|e| e.to_string())?;
                keys::add(c, &key, &workspace, &name).map_err(|e| e.to_string())?;
                println!("{key}");
                Ok(())
            }
            KeyCommand::Ls => {
                let list = keys::list(c).map_err(|e| e.to_string())?;
                if list.is_empty() {
                    println!("No keys; `runcell key create` makes one.");
                    return Ok(());
                }
                let time = |t: i64| crate::template::format_time(u64::try_from(t).unwrap_or(0));
                println!(
                    "{:<12} {:<20} {:<16} {:<20} REVOKED",
                    "PREFIX", "WORKSPACE", "NAME", "CREATED"
                );
                for k in list {
                    println!(
                        "{:<12} {:<20} {:<16} {:<20} {}",
                        k.prefix,
                        k.workspace,
                        k.name,
                        time(k.created_at),
                        k.revoked_at.map(time).unwrap_or_else(|| "-".into())
                    );
                }
                Ok(())
            }
            KeyCommand::Revoke { prefix } => {
                match keys::revoke(c, &prefix).map_err(|e| e.to_string())? {
                    0 => Err(format!("no active key has the prefix {prefix}")),
                    n => {
                        println!("revoked {n} key(s)");
                        Ok(())
                    }
                }
            }
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("runcell: {e}");
            ExitCode::from(1)
        }
    }
}
