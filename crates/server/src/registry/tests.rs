//! The registry's tests: records, tombstones, the network column and rows
//! of older versions.

use super::*;

/// A running jail sandbox's record, `a` of workspace `local` from template
/// `host`, with no metadata, limits or environment of its own.
fn record() -> Record {
    Record {
        id: "a".into(),
        workspace: "local".into(),
        template: "host".into(),
        metadata: Default::default(),
        limits: Default::default(),
        env: Default::default(),
        ttl_seconds: 300,
        persistent: false,
        created_at: 1,
        last_activity_ms: 2,
        status: "running".into(),
        end_reason: None,
        isolation: runcell_core::backend::Isolation::Jail,
    }
}

/// A fresh directory for one test's database (`name` keeps the tests
/// apart), and the database's path in it.
fn scratch(name: &str) -> (std::path::PathBuf, std::path::PathBuf) {
    let dir = std::env::temp_dir().join(format!("runcell-registry-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("registry.db");
    (dir, path)
}

/// Makes `path` a registry as an older daemon left it: the first release's
/// table, `more` (further columns, the closing parenthesis, statements)
/// after its last column.
fn older_registry(path: &std::path::Path, more: &str) {
    Connection::open(path)
        .unwrap()
        .execute_batch(&format!(
            "CREATE TABLE sandboxes (id TEXT PRIMARY KEY, workspace TEXT NOT NULL,
             template TEXT NOT NULL, metadata TEXT NOT NULL, limits TEXT NOT NULL,
             env TEXT NOT NULL, ttl_seconds INTEGER NOT NULL, persistent INTEGER NOT NULL,
             created_at INTEGER NOT NULL, last_activity_ms INTEGER NOT NULL,
             status TEXT NOT NULL, end_reason TEXT{more}"
        ))
        .unwrap();
}

/// The network policy the tests store: an allowlist of pypi.org.
fn pypi_only() -> runcell_egress::NetworkPolicy {
    serde_json::from_value(serde_json::json!({"mode": "allowlist", "allow": ["pypi.org"]})).unwrap()
}

#[test]
fn records_survive_reopening() {
    let (dir, path) = scratch("records");
    let rec = Record {
        metadata: [("threadId".to_string(), "t1".to_string())].into(),
        limits: crate::limits::StoredLimits {
            memory_mb: Some(512),
            ..Default::default()
        },
        env: [("SECRET".to_string(), "s3cret".to_string())].into(),
        ..record()
    };
    Registry::open(&path).unwrap().put(&rec).unwrap();
    let reg = Registry::open(&path).unwrap();
    assert_eq!(reg.get("a").unwrap().unwrap(), rec);
    reg.touch("a", 99).unwrap();
    reg.end("a", Ended::Deleted, "ttl").unwrap();
    let got = reg.get("a").unwrap().unwrap();
    assert_eq!((got.last_activity_ms, got.status.as_str()), (99, "deleted"));
    assert!(reg.with_status("running").unwrap().is_empty());
    // The tombstone says why; the environment is forgotten.
    let t = reg.tombstone("a").unwrap().unwrap();
    assert_eq!((t.workspace.as_str(), t.reason.as_str()), ("local", "ttl"));
    assert!(got.env.is_empty());
    // Only the owner can read the database and its journal.
    use std::os::unix::fs::PermissionsExt;
    for f in ["registry.db", "registry.db-wal", "registry.db-shm"] {
        let mode = std::fs::metadata(dir.join(f)).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600, "{f}");
    }
    // Pruning removes tombstones that ended before the cut, not live rows.
    reg.put(&Record {
        id: "b".into(),
        ..rec.clone()
    })
    .unwrap();
    assert_eq!(reg.prune(t.ended_at_ms).unwrap(), 0);
    assert_eq!(reg.prune(t.ended_at_ms + 1).unwrap(), 1);
    assert_eq!(reg.rows().unwrap(), 1);
    assert!(reg.tombstone("a").unwrap().is_none());
    std::fs::remove_dir_all(dir).unwrap();
}

/// The network policy survives updates of the record (lifecycle changes
/// rewrite the row) and reopening; a database made before the column
/// existed gains it.
#[test]
fn network_policy_survives_record_updates_and_reopening() {
    let (dir, path) = scratch("net");
    // An older registry: the table without the column.
    older_registry(&path, ");");
    let rec = record();
    let reg = Registry::open(&path).unwrap();
    reg.put(&rec).unwrap();
    assert_eq!(reg.network("a").unwrap(), None);
    let policy = pypi_only();
    reg.set_network("a", &policy).unwrap();
    reg.put(&Record {
        ttl_seconds: 600,
        ..rec.clone()
    })
    .unwrap();
    drop(reg);
    let reg = Registry::open(&path).unwrap();
    assert_eq!(reg.network("a").unwrap(), Some(policy));
    assert_eq!(reg.get("a").unwrap().unwrap().ttl_seconds, 600);
    std::fs::remove_dir_all(dir).unwrap();
}

/// A row as the daemon wrote it before the stored limits were typed
/// loads, and its limits are the ones it was created with.
#[test]
fn a_row_of_the_untyped_format_loads() {
    let (dir, path) = scratch("old");
    drop(Registry::open(&path).unwrap());
    Connection::open(&path)
        .unwrap()
        .execute_batch(
            r#"INSERT INTO sandboxes (id, workspace, template, metadata, limits, env,
                ttl_seconds, persistent, created_at, last_activity_ms, status, end_reason)
             VALUES ('old', 'default', 'host', '{"workspace":"default"}',
                '{"memory_mb":512,"cpu":0.5,"pids":256,"disk_mb":1024,"timeout_seconds":30.0,"output_bytes":1048576}',
                '{"A":"1"}', 300, 0, 1, 2, 'running', NULL);"#,
        )
        .unwrap();
    let reg = Registry::open(&path).unwrap();
    let rec = reg.get("old").unwrap().unwrap();
    let l = rec.limits.over(runcell_core::SandboxLimits::default());
    assert_eq!(l.memory_bytes, 512 << 20);
    assert_eq!(l.cpu_millis, 500);
    assert_eq!(l.pids, 256);
    assert_eq!(l.disk_bytes, 1024 << 20);
    assert_eq!(l.timeout, std::time::Duration::from_secs(30));
    assert_eq!(l.output_bytes, 1 << 20);
    // Written back, the row keeps the same JSON.
    reg.put(&rec).unwrap();
    let stored: String = reg
        .with_conn(|c| {
            c.query_row("SELECT limits FROM sandboxes WHERE id = 'old'", [], |r| {
                r.get(0)
            })
        })
        .unwrap();
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&stored).unwrap(),
        serde_json::json!({"memory_mb":512,"cpu":0.5,"pids":256,"disk_mb":1024,"timeout_seconds":30.0,"output_bytes":1048576})
    );
    std::fs::remove_dir_all(dir).unwrap();
}

/// A create's record, network policy and lineage are committed together:
/// after a successful transaction a reopened registry has all three, and a
/// transaction that fails part-way leaves no row at all (a sandbox whose
/// lineage could not be written is not half-recorded).
#[test]
fn a_create_is_recorded_whole_or_not_at_all() {
    let (dir, path) = scratch("tx");
    let reg = Registry::open(&path).unwrap();
    reg.with_conn(crate::snapshots::init).unwrap();
    let rec = record();
    let policy = pypi_only();
    let lineage = crate::snapshots::Lineage {
        on_idle: Some(crate::snapshots::OnIdle::Hibernate),
        ..Default::default()
    };
    reg.transaction(
        |c| -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
            insert(c, &rec, Some(&policy))?;
            crate::snapshots::put_lineage(c, "a", &lineage)?;
            Ok(())
        },
    )
    .unwrap();
    let failed = reg.transaction(
        |c| -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
            insert(
                c,
                &Record {
                    id: "b".into(),
                    ..rec.clone()
                },
                None,
            )?;
            Err("the lineage could not be written".into())
        },
    );
    assert!(failed.is_err());
    drop(reg);
    let reg = Registry::open(&path).unwrap();
    assert_eq!(reg.get("a").unwrap().unwrap(), rec);
    assert_eq!(reg.network("a").unwrap(), Some(policy));
    assert_eq!(
        reg.with_conn(|c| crate::snapshots::lineage(c, "a"))
            .unwrap(),
        lineage
    );
    assert!(reg
        .with_conn(|c| crate::snapshots::has_lineage(c, "a"))
        .unwrap());
    assert!(reg.get("b").unwrap().is_none());
    assert_eq!(reg.rows().unwrap(), 1);
    std::fs::remove_dir_all(dir).unwrap();
}

/// Writes `n` tombstones of workspace `w` with the given status, ended at
/// `first_ms`, `first_ms + 1`, ... (ids `{prefix}1`, `{prefix}2`, ...).
fn tombstones(reg: &Registry, prefix: &str, status: Ended, n: u32, first_ms: i64) {
    reg.with_conn(|c| {
        c.execute(
            "WITH RECURSIVE k(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM k WHERE i < ?2)
             INSERT INTO sandboxes (id, workspace, template, metadata, limits, env,
                 ttl_seconds, persistent, created_at, last_activity_ms, status, end_reason,
                 ended_at_ms)
             SELECT ?1 || i, 'w', 'host', '{}', '{}', '{}', 300, 0, 1, 2, ?3, 'gone', ?4 + i - 1
             FROM k",
            params![prefix, n, status.as_str(), first_ms],
        )
    })
    .unwrap();
}

/// A prune removes every tombstone that ended before the cut, of either
/// ended status, more than one batch of them, and nothing else: not the
/// newer tombstones, the live or the hibernated sandboxes.
#[test]
fn a_prune_removes_every_old_tombstone_and_nothing_else() {
    let (dir, path) = scratch("prune");
    let reg = Registry::open(&path).unwrap();
    let old = u32::try_from(PRUNE_BATCH).unwrap() * 2 + 500;
    tombstones(&reg, "d", Ended::Deleted, old, 1_000);
    tombstones(&reg, "f", Ended::Failed, 10, 1_000);
    tombstones(&reg, "new", Ended::Deleted, 10, 1_000_000);
    for (id, status) in [("live", "running"), ("asleep", "hibernated")] {
        reg.put(&Record {
            id: id.into(),
            status: status.into(),
            ..record()
        })
        .unwrap();
    }
    assert_eq!(
        reg.prune(1_000_000).unwrap(),
        usize::try_from(old).unwrap() + 10
    );
    assert_eq!(reg.rows().unwrap(), 12);
    assert!(reg.tombstone("new1").unwrap().is_some());
    assert!(reg.get("live").unwrap().is_some());
    assert!(reg.get("asleep").unwrap().is_some());
    assert_eq!(reg.prune(1_000_000).unwrap(), 0);
    std::fs::remove_dir_all(dir).unwrap();
}

/// A prune reads the tombstones it removes, not every tombstone kept: with
/// thousands kept and none old enough it steps through no table (it ran
/// every minute over all of them, holding the registry's connection,
/// which every request needs, for 0.3 s a million). A registry made with
/// the older index on the status alone gets the new one when opened.
#[test]
fn a_prune_reads_only_what_it_removes() {
    let (dir, path) = scratch("prune-index");
    older_registry(
        &path,
        ", ended_at_ms INTEGER); CREATE INDEX sandboxes_status ON sandboxes(status);",
    );
    let reg = Registry::open(&path).unwrap();
    let indexes: Vec<String> = reg.with_conn(|c| {
        c.prepare("SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = 'sandboxes' AND sql IS NOT NULL ORDER BY name")
            .unwrap()
            .query_map([], |r| r.get(0))
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap()
    });
    assert_eq!(indexes, ["sandboxes_status_ended"]);
    tombstones(&reg, "d", Ended::Deleted, 5_000, 10_000);
    tombstones(&reg, "f", Ended::Failed, 100, 10_000);
    tombstones(&reg, "old", Ended::Deleted, 20, 1);
    let (removed, fullscan, steps) = reg.with_conn(|c| {
        let mut stmt = c.prepare(PRUNE_SQL).unwrap();
        let removed = stmt.execute(params![10_000, PRUNE_BATCH]).unwrap();
        (
            removed,
            stmt.get_status(rusqlite::StatementStatus::FullscanStep),
            stmt.get_status(rusqlite::StatementStatus::VmStep),
        )
    });
    assert_eq!(removed, 20);
    assert_eq!(fullscan, 0, "the prune scanned a table");
    assert!(
        steps < 2_000,
        "the prune took {steps} steps to remove 20 tombstones"
    );
    std::fs::remove_dir_all(dir).unwrap();
}

/// Once a checkpoint has emptied the WAL, the next commit starts it again
/// from an empty file: its frames are written past the end of the file, not
/// over old frames (which, with the old blocks gone from the page cache,
/// made each write read from disk first).
#[test]
fn the_wal_starts_again_from_an_empty_file_after_a_checkpoint() {
    let (dir, path) = scratch("wal-reset");
    let wal = dir.join("registry.db-wal");
    let reg = Registry::open(&path).unwrap();
    for i in 0..200 {
        reg.put(&Record {
            id: format!("s{i}"),
            ..record()
        })
        .unwrap();
    }
    let grown = std::fs::metadata(&wal).unwrap().len();
    assert!(grown > 256 * 1024, "the WAL holds only {grown} bytes");
    let (busy, _, _): (i64, i64, i64) = reg.with_conn(|c| {
        c.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |r| {
            Ok((r.get(0)?, r.get(1)?, r.get(2)?))
        })
        .unwrap()
    });
    assert_eq!(busy, 0);
    reg.end("s1", Ended::Deleted, "gone").unwrap();
    let after = std::fs::metadata(&wal).unwrap().len();
    assert!(
        after < 64 * 1024,
        "the WAL was written over in place: {after} bytes after the commit, {grown} before"
    );
    std::fs::remove_dir_all(dir).unwrap();
}
