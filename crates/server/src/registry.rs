//! The registry: every sandbox the daemon created, in SQLite, so that a
//! restarted daemon knows what exists and what to reap.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Mutex;

use rusqlite::{params, Connection, OptionalExtension};
use serde::{Deserialize, Serialize};

/// Registry errors.
#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    /// SQLite failed.
    #[error("The sandbox registry failed.")]
    Sqlite(#[from] rusqlite::Error),
    /// A stored field is unreadable.
    #[error("A stored sandbox record is unreadable.")]
    Decode(#[from] serde_json::Error),
    /// The database file could not be created or made private.
    #[error("The registry file {0} could not be created or made private.")]
    File(std::path::PathBuf, #[source] std::io::Error),
}

/// One sandbox as recorded.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Record {
    /// Sandbox id.
    pub id: String,
    /// Owning workspace.
    pub workspace: String,
    /// Template name as requested.
    pub template: String,
    /// Caller metadata.
    pub metadata: BTreeMap<String, String>,
    /// Limits (runcell extension), stored as JSON.
    pub limits: crate::limits::StoredLimits,
    /// Extra environment for every run.
    pub env: BTreeMap<String, String>,
    /// Idle TTL in seconds.
    pub ttl_seconds: u64,
    /// Exempt from idle reaping.
    pub persistent: bool,
    /// Unix seconds.
    pub created_at: i64,
    /// Unix milliseconds of the last activity.
    pub last_activity_ms: i64,
    /// running, deleted, failed.
    pub status: String,
    /// Why it ended, when it did.
    pub end_reason: Option<String>,
    /// The isolation backend it runs under.
    pub isolation: runcell_core::backend::Isolation,
}

/// How a sandbox ended: the status its tombstone keeps ([`PRUNE_SQL`] names
/// every one).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ended {
    /// Removed: by the API, its TTL or lifetime, or after its run.
    Deleted,
    /// Found not running when a restarted daemon looked for it.
    Failed,
}

impl Ended {
    /// The status as stored.
    pub fn as_str(self) -> &'static str {
        match self {
            Ended::Deleted => "deleted",
            Ended::Failed => "failed",
        }
    }
}

/// How many tombstones one statement of [`Registry::prune`] removes: the
/// registry's connection is free for requests between two of them (with a
/// million kept, 1000 took 50 ms in one statement).
const PRUNE_BATCH: usize = 256;

/// One batch of [`Registry::prune`]: the oldest tombstones that ended
/// before `?1`, at most `?2` of them, found through the
/// `(status, ended_at_ms)` index, so a prune reads only what it removes
/// however many tombstones are kept (the retention is a week; a busy
/// daemon keeps millions).
pub(crate) const PRUNE_SQL: &str = "DELETE FROM sandboxes WHERE rowid IN
     (SELECT rowid FROM sandboxes WHERE status IN ('deleted', 'failed') AND ended_at_ms < ?1
      LIMIT ?2)";

/// What is kept of a sandbox after it ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tombstone {
    /// Owning workspace (only its keys learn why the sandbox ended).
    pub workspace: String,
    /// Why it ended.
    pub reason: String,
    /// When it ended, unix milliseconds.
    pub ended_at_ms: i64,
    /// Its idle TTL.
    pub ttl_seconds: u64,
}

/// Creates `path` if needed and makes it readable and writable by its owner
/// only.
fn private_file(path: &Path) -> Result<(), RegistryError> {
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o600)
        .open(path)
        .and_then(|_| std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)))
        .map_err(|e| RegistryError::File(path.to_path_buf(), e))
}

/// The SQLite registry.
#[derive(Debug)]
pub struct Registry {
    conn: Mutex<Connection>,
}

impl Registry {
    /// Opens (creating if needed) the registry at `path`. The database and
    /// its journal files are readable by the daemon's user only: records
    /// hold callers' metadata and, while a sandbox lives, its environment.
    pub fn open(path: &Path) -> Result<Self, RegistryError> {
        private_file(path)?;
        let conn = Connection::open(path)?;
        // journal_size_limit=0: once a checkpoint has emptied the WAL, the
        // next commit truncates it, so WAL frames are written past the end
        // of the file. Without it SQLite writes new frames over the old
        // ones, and a frame (a 24-byte header and a 4096-byte page) covers
        // parts of two file blocks: once the host has evicted those blocks
        // from its page cache, every such write first read them from disk
        // (`ext4_block_write_begin`), on the path of every create and end.
        conn.execute_batch(
            "PRAGMA journal_mode=WAL;
             PRAGMA journal_size_limit=0;
             PRAGMA synchronous=NORMAL;
             PRAGMA secure_delete=ON;
             CREATE TABLE IF NOT EXISTS sandboxes (
                 id TEXT PRIMARY KEY,
                 workspace TEXT NOT NULL,
                 template TEXT NOT NULL,
                 metadata TEXT NOT NULL,
                 limits TEXT NOT NULL,
                 env TEXT NOT NULL,
                 ttl_seconds INTEGER NOT NULL,
                 persistent INTEGER NOT NULL,
                 created_at INTEGER NOT NULL,
                 last_activity_ms INTEGER NOT NULL,
                 status TEXT NOT NULL,
                 end_reason TEXT
             );",
        )?;
        // Added after the first release: when a sandbox ended (tombstones
        // are pruned by it). Rows that ended before it existed age from now.
        let has_ended_at = conn
            .prepare("SELECT 1 FROM pragma_table_info('sandboxes') WHERE name = 'ended_at_ms'")?
            .exists([])?;
        if !has_ended_at {
            conn.execute_batch(&format!(
                "ALTER TABLE sandboxes ADD COLUMN ended_at_ms INTEGER;
                 UPDATE sandboxes SET ended_at_ms = {}, env = '{{}}' WHERE status != 'running';",
                crate::clock::now_ms()
            ))?;
        }
        // Added later: the sandbox's network policy (JSON), so a restarted
        // daemon serves its egress with the same policy. Older rows have none
        // (their sandboxes re-attach without egress, as before).
        let has_network = conn
            .prepare("SELECT 1 FROM pragma_table_info('sandboxes') WHERE name = 'network'")?
            .exists([])?;
        if !has_network {
            conn.execute_batch("ALTER TABLE sandboxes ADD COLUMN network TEXT;")?;
        }
        // Added with the isolation backends: which backend holds the
        // sandbox (older rows were all jails).
        let has_isolation = conn
            .prepare("SELECT 1 FROM pragma_table_info('sandboxes') WHERE name = 'isolation'")?
            .exists([])?;
        if !has_isolation {
            conn.execute_batch(
                "ALTER TABLE sandboxes ADD COLUMN isolation TEXT NOT NULL DEFAULT 'jail';",
            )?;
        }
        // Lookups by status (live and hibernated sandboxes at start-up and
        // in the reaper) and the prune's by end time share one index. It
        // replaces the older index on the status alone, with which a prune
        // read every tombstone kept. An end rewrites this index's entry
        // either way: the second column costs no write of its own.
        conn.execute_batch(
            "CREATE INDEX IF NOT EXISTS sandboxes_status_ended ON sandboxes(status, ended_at_ms);
             DROP INDEX IF EXISTS sandboxes_status;",
        )?;
        // The API keys (the keys module) live in the same database.
        conn.execute_batch(
            "CREATE TABLE IF NOT EXISTS api_keys (
                 hash TEXT PRIMARY KEY,
                 prefix TEXT NOT NULL,
                 workspace TEXT NOT NULL,
                 name TEXT NOT NULL,
                 created_at INTEGER NOT NULL,
                 revoked_at INTEGER
             );",
        )?;
        // SQLite gives the journal files the database's mode, but files left
        // by an older version may be more open.
        for suffix in ["-wal", "-shm"] {
            let mut journal = path.as_os_str().to_owned();
            journal.push(suffix);
            let journal = std::path::PathBuf::from(journal);
            if journal.exists() {
                private_file(&journal)?;
            }
        }
        // The hot statements (a create, an exec, a delete, each request's
        // key) are parsed once and kept, not parsed again on every call.
        conn.set_prepared_statement_cache_capacity(64);
        Ok(Self {
            conn: Mutex::new(conn),
        })
    }

    /// Runs `f` with the connection (for the key table).
    pub fn with_conn<T>(&self, f: impl FnOnce(&Connection) -> T) -> T {
        f(&self
            .conn
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner))
    }

    /// Runs `f` in one write transaction (`BEGIN IMMEDIATE`), committed
    /// when it returns `Ok` and rolled back otherwise: a create records its
    /// sandbox, network policy and lineage in one WAL commit, not three.
    pub fn transaction<T, E: From<rusqlite::Error>>(
        &self,
        f: impl FnOnce(&Connection) -> Result<T, E>,
    ) -> Result<T, E> {
        let mut conn = self
            .conn
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let tx = conn.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
        let out = f(&tx)?;
        tx.commit()?;
        Ok(out)
    }

    /// Inserts or replaces a record (keeping the network policy recorded
    /// for its id, if any).
    pub fn put(&self, r: &Record) -> Result<(), RegistryError> {
        let conn = self
            .conn
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        write(&conn, r, None)
    }

    /// Marks a sandbox ended, keeping a tombstone (who owned it, why and
    /// when it ended) until [`Registry::prune`] removes it. Its environment,
    /// which may hold the caller's secrets, is forgotten now (and with
    /// `secure_delete` its old bytes are overwritten, not left in free pages).
    pub fn end(&self, id: &str, status: Ended, reason: &str) -> Result<(), RegistryError> {
        self.conn
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .prepare_cached(
                "UPDATE sandboxes SET status = ?2, end_reason = ?3, ended_at_ms = ?4, env = '{}'
                 WHERE id = ?1",
            )?
            .execute(params![id, status.as_str(), reason, crate::clock::now_ms()])?;
        Ok(())
    }

    /// The tombstone of an ended sandbox, if it is still kept.
    pub fn tombstone(&self, id: &str) -> Result<Option<Tombstone>, RegistryError> {
        let conn = self
            .conn
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let tomb = conn
            .prepare_cached(
                "SELECT workspace, end_reason, ended_at_ms, ttl_seconds FROM sandboxes
                 WHERE id = ?1 AND status != 'running'",
            )?
            .query_row(params![id], |r| {
                Ok(Tombstone {
                    workspace: r.get(0)?,
                    reason: r.get::<_, Option<String>>(1)?.unwrap_or_default(),
                    ended_at_ms: r.get::<_, Option<i64>>(2)?.unwrap_or(0),
                    ttl_seconds: u64::try_from(r.get::<_, i64>(3)?).unwrap_or(0),
                })
            })
            .optional()?;
        Ok(tomb)
    }

    /// Removes the tombstones of sandboxes that ended before `before_ms`;
    /// returns how many. Removed in batches ([`PRUNE_SQL`]), the
    /// connection's lock let go between them.
    pub fn prune(&self, before_ms: i64) -> Result<usize, RegistryError> {
        let mut removed = 0;
        loop {
            let n = self
                .conn
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .prepare_cached(PRUNE_SQL)?
                .execute(params![before_ms, PRUNE_BATCH])?;
            removed += n;
            if n < PRUNE_BATCH {
                return Ok(removed);
            }
        }
    }

    /// Gives back the memory SQLite keeps for this connection (`PRAGMA
    /// shrink_memory`, which is `sqlite3_db_release_memory`): the page
    /// cache, which otherwise fills to its 2 MB as tombstones accumulate
    /// and stays full. The next statements read their pages from the file
    /// again: from the kernel's page cache, or after a minute's quiet on
    /// this VM from disk (four reads of 0.03-0.07 ms on the first create;
    /// README, "What a WAL written past its end bought"). Called when the
    /// daemon goes quiet.
    pub fn release_memory(&self) -> Result<(), RegistryError> {
        self.conn
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .execute_batch("PRAGMA shrink_memory")?;
        Ok(())
    }

    /// Rows kept, running or ended.
    pub fn rows(&self) -> Result<u64, RegistryError> {
        let n: i64 = self
            .conn
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .query_row("SELECT COUNT(*) FROM sandboxes", [], |r| r.get(0))?;
        Ok(u64::try_from(n).unwrap_or(0))
    }

    /// Records a sandbox's network policy.
    pub fn set_network(
        &self,
        id: &str,
        policy: &runcell_egress::NetworkPolicy,
    ) -> Result<(), RegistryError> {
        self.conn
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .execute(
                "UPDATE sandboxes SET network = ?2 WHERE id = ?1",
                params![id, serde_json::to_string(policy)?],
            )?;
        Ok(())
    }

    /// A sandbox's recorded network policy; `None` when none was recorded.
    pub fn network(
        &self,
        id: &str,
    ) -> Result<Option<runcell_egress::NetworkPolicy>, RegistryError> {
        let raw: Option<String> = self
            .conn
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .prepare_cached("SELECT network FROM sandboxes WHERE id = ?1")?
            .query_row(params![id], |r| r.get(0))
            .optional()?
            .flatten();
        Ok(raw.map(|t| serde_json::from_str(&t)).transpose()?)
    }

    /// Records activity.
    pub fn touch(&self, id: &str, at_ms: i64) -> Result<(), RegistryError> {
        self.conn
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .prepare_cached("UPDATE sandboxes SET last_activity_ms = ?2 WHERE id = ?1")?
            .execute(params![id, at_ms])?;
        Ok(())
    }

    /// One record.
    pub fn get(&self, id: &str) -> Result<Option<Record>, RegistryError> {
        let conn = self
            .conn
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let row = conn
            .prepare_cached(
                "SELECT id, workspace, template, metadata, limits, env, ttl_seconds, persistent,
                        created_at, last_activity_ms, status, end_reason, isolation
                 FROM sandboxes WHERE id = ?1",
            )?
            .query_row(params![id], raw_row)
            .optional()?;
        row.map(decode).transpose()
    }

    /// Every record with `status`.
    pub fn with_status(&self, status: &str) -> Result<Vec<Record>, RegistryError> {
        let conn = self
            .conn
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut stmt = conn.prepare_cached(
            "SELECT id, workspace, template, metadata, limits, env, ttl_seconds, persistent,
                    created_at, last_activity_ms, status, end_reason, isolation
             FROM sandboxes WHERE status = ?1 ORDER BY created_at",
        )?;
        let rows = stmt.query_map(params![status], raw_row)?;
        let mut out = Vec::new();
        for row in rows {
            out.push(decode(row?)?);
        }
        Ok(out)
    }
}

/// Records a new sandbox with its network policy (`None`: no egress) on
/// `conn`, inside a [`Registry::transaction`].
pub fn insert(
    conn: &Connection,
    r: &Record,
    network: Option<&runcell_egress::NetworkPolicy>,
) -> Result<(), RegistryError> {
    let network = network.map(serde_json::to_string).transpose()?;
    write(conn, r, Some(network))
}

/// Inserts or replaces `r` on `conn`, with `network` as its network policy
/// (`Some(None)`: no egress) or, with `None`, the one already recorded for
/// its id, if any.
fn write(
    conn: &Connection,
    r: &Record,
    network: Option<Option<String>>,
) -> Result<(), RegistryError> {
    let keep = network.is_none();
    conn.prepare_cached(
        "INSERT OR REPLACE INTO sandboxes
         (id, workspace, template, metadata, limits, env, ttl_seconds, persistent,
          created_at, last_activity_ms, status, end_reason, network, isolation)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12,
                 CASE WHEN ?15 THEN (SELECT network FROM sandboxes WHERE id = ?1) ELSE ?13 END,
                 ?14)",
    )?
    .execute(params![
        r.id,
        r.workspace,
        r.template,
        serde_json::to_string(&r.metadata)?,
        serde_json::to_string(&r.limits)?,
        serde_json::to_string(&r.env)?,
        i64::try_from(r.ttl_seconds).unwrap_or(i64::MAX),
        r.persistent,
        r.created_at,
        r.last_activity_ms,
        r.status,
        r.end_reason,
        network.flatten(),
        r.isolation.as_str(),
        keep,
    ])?;
    Ok(())
}

type RawRow = (
    String,
    String,
    String,
    String,
    String,
    String,
    i64,
    bool,
    i64,
    i64,
    String,
    Option<String>,
    String,
);

fn raw_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<RawRow> {
    Ok((
        r.get(0)?,
        r.get(1)?,
        r.get(2)?,
        r.get(3)?,
        r.get(4)?,
        r.get(5)?,
        r.get(6)?,
        r.get(7)?,
        r.get(8)?,
        r.get(9)?,
        r.get(10)?,
        r.get(11)?,
        r.get(12)?,
    ))
}

fn decode(r: RawRow) -> Result<Record, RegistryError> {
    Ok(Record {
        id: r.0,
        workspace: r.1,
        template: r.2,
        metadata: serde_json::from_str(&r.3)?,
        limits: serde_json::from_str(&r.4)?,
        env: serde_json::from_str(&r.5)?,
        ttl_seconds: u64::try_from(r.6).unwrap_or(0),
        persistent: r.7,
        created_at: r.8,
        last_activity_ms: r.9,
        status: r.10,
        end_reason: r.11,
        // A name this version does not know (a newer daemon's row) is
        // judged a jail's: its removal then finds nothing and the record
        // ends as an orphan.
        isolation: r
            .12
            .parse()
            .unwrap_or(runcell_core::backend::Isolation::Jail),
    })
}

#[cfg(test)]
mod tests;
