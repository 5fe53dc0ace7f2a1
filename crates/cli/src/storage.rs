//! `runcell snapshot` and `runcell volume`: what a daemon keeps of sandboxes
//! beyond their processes (snapshots of their files, and volumes that
//! outlive them).

use clap::{Args, Subcommand};
use runcell_client::{Snapshot, Volume};
use serde_json::{json, Value};

use crate::conn::Conn;
use crate::remote::outcome;

#[derive(Debug, Args)]
pub struct SnapshotArgs {
    #[command(flatten)]
    conn: Conn,
    #[command(subcommand)]
    command: SnapshotCommand,
}

#[derive(Debug, Subcommand)]
enum SnapshotCommand {
    /// List snapshots, newest first (take one with `runcell sandbox snapshot ID`).
    Ls {
        /// Only the snapshots of this sandbox.
        #[arg(long, value_name = "SANDBOX_ID")]
        sandbox: Option<String>,
    },
    /// Show one snapshot.
    Get {
        /// Snapshot id.
        id: String,
    },
    /// Delete snapshots.
    Rm {
        /// Snapshot ids.
        #[arg(required = true)]
        ids: Vec<String>,
    },
}

#[derive(Debug, Args)]
pub struct VolumeArgs {
    #[command(flatten)]
    conn: Conn,
    #[command(subcommand)]
    command: VolumeCommand,
}

#[derive(Debug, Subcommand)]
enum VolumeCommand {
    /// Create a volume (mount it with `runcell sandbox create --volume NAME`).
    Create {
        /// 1 to 63 of a-z, 0-9, _ and -, starting with a letter or digit.
        name: String,
        /// Its size limit in MiB (1 to 65536).
        #[arg(long, value_parser = clap::value_parser!(u64).range(1..=65536))]
        size_mb: u64,
    },
    /// List volumes.
    Ls,
    /// Show one volume.
    Get {
        /// Volume name.
        name: String,
    },
    /// Delete volumes and their data (refused while a sandbox mounts one).
    Rm {
        /// Volume names.
        #[arg(required = true)]
        names: Vec<String>,
    },
}

/// A snapshot as `--json` prints it.
pub(crate) fn snapshot_json(s: &Snapshot) -> Value {
    json!({
        "id": s.id, "sandbox_id": s.sandbox_id, "workspace": s.workspace,
        "template": s.template, "created_at": s.created_at,
        "size_bytes": s.size_bytes, "memory": s.memory,
    })
}

fn volume_json(v: &Volume) -> Value {
    json!({
        "name": v.name, "size_mb": v.size_mb, "created_at": v.created_at,
        "used_bytes": v.used_bytes, "attached_to": v.attached_to,
    })
}

fn snapshot_header() -> String {
    format!(
        "{:<36}  {:<36}  {:<18} {:>9}  CREATED",
        "ID", "SANDBOX", "TEMPLATE", "SIZE"
    )
}

fn snapshot_line(s: &Snapshot) -> String {
    format!(
        "{:<36}  {:<36}  {:<18} {:>9}  {}",
        s.id,
        s.sandbox_id,
        s.template,
        runcell_core::format_size(s.size_bytes),
        s.created_at
    )
}

fn volume_header() -> String {
    format!(
        "{:<24} {:>9} {:>9}  {:<25} ATTACHED TO",
        "NAME", "SIZE", "USED", "CREATED"
    )
}

fn volume_line(v: &Volume) -> String {
    format!(
        "{:<24} {:>9} {:>9}  {:<25} {}",
        v.name,
        format!("{} MiB", v.size_mb),
        runcell_core::format_size(v.used_bytes),
        v.created_at,
        if v.attached_to.is_empty() {
            "-".to_string()
        } else {
            v.attached_to.join(",")
        }
    )
}

/// `runcell snapshot ...`.
pub async fn snapshot(args: SnapshotArgs) -> u8 {
    let client = match args.conn.client() {
        Ok(c) => c,
        Err(code) => return code,
    };
    let json = args.conn.json;
    outcome(async move {
        match args.command {
            SnapshotCommand::Ls { sandbox } => {
                let list = client.list_snapshots(sandbox.as_deref()).await?;
                if json {
                    let v: Vec<Value> = list.iter().map(snapshot_json).collect();
                    println!("{}", Value::Array(v));
                } else if list.is_empty() {
                    println!("No snapshots.");
                } else {
                    println!("{}", snapshot_header());
                    for s in &list {
                        println!("{}", snapshot_line(s));
                    }
                }
            }
            SnapshotCommand::Get { id } => {
                let s = client.get_snapshot(&id).await?;
                if json {
                    println!("{}", snapshot_json(&s));
                } else {
                    println!("{}\n{}", snapshot_header(), snapshot_line(&s));
                }
            }
            SnapshotCommand::Rm { ids } => {
                for id in ids {
                    client.delete_snapshot(&id).await?;
                }
            }
        }
        Ok(0)
    })
    .await
}

/// `runcell volume ...`.
pub async fn volume(args: VolumeArgs) -> u8 {
    let client = match args.conn.client() {
        Ok(c) => c,
        Err(code) => return code,
    };
    let json = args.conn.json;
    outcome(async move {
        match args.command {
            VolumeCommand::Create { name, size_mb } => {
                let v = client.create_volume(&name, size_mb).await?;
                if json {
                    println!("{}", volume_json(&v));
                } else {
                    println!("{}", v.name);
                }
            }
            VolumeCommand::Ls => {
                let list = client.list_volumes().await?;
                if json {
                    let v: Vec<Value> = list.iter().map(volume_json).collect();
                    println!("{}", Value::Array(v));
                } else if list.is_empty() {
                    println!("No volumes.");
                } else {
                    println!("{}", volume_header());
                    for v in &list {
                        println!("{}", volume_line(v));
                    }
                }
            }
            VolumeCommand::Get { name } => {
                let v = client.get_volume(&name).await?;
                if json {
                    println!("{}", volume_json(&v));
                } else {
                    println!("{}\n{}", volume_header(), volume_line(&v));
                }
            }
            VolumeCommand::Rm { names } => {
                for name in names {
                    client.delete_volume(&name).await?;
                }
            }
        }
        Ok(0)
    })
    .await
}
