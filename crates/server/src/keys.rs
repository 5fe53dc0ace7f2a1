//! API keys: each belongs to a workspace and is stored only as a SHA-256
//! hash (keys are 192-bit random strings, so a plain hash is enough).

use std::fs;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use rusqlite::{params, Connection, OptionalExtension};
use sha2::{Digest, Sha256};

use crate::registry::RegistryError;

/// A key as listed (never the key itself).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyInfo {
    /// The first characters of the key, to tell keys apart.
    pub prefix: String,
    /// The workspace it belongs to.
    pub workspace: String,
    /// A label.
    pub name: String,
    /// Unix seconds.
    pub created_at: i64,
    /// Unix seconds, when revoked.
    pub revoked_at: Option<i64>,
}

fn hash(key: &str) -> String {
    use std::fmt::Write as _;
    let mut hex = String::with_capacity(64);
    for b in Sha256::digest(key.as_bytes()) {
        let _ = write!(hex, "{b:02x}");
    }
    hex
}

fn now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs() as i64
}

/// A new random key (`rc_` + 48 hex digits).
pub fn generate() -> std::io::Result<String> {
    let mut raw = [0u8; 24];
    std::io::Read::read_exact(&mut fs::File::open("/dev/urandom")?, &mut raw)?;
    Ok(std::iter::once("rc_".to_string())
        .chain(raw.iter().map(|b| format!("{b:02x}")))
        .collect())
}

/// Stores a key for `workspace`.
pub fn add(conn: &Connection, key: &str, workspace: &str, name: &str) -> Result<(), RegistryError> {
    conn.execute(
        "INSERT INTO api_keys (hash, prefix, workspace, name, created_at) VALUES (?1, ?2, ?3, ?4, ?5)",
        params![hash(key), &key[..key.len().min(11)], workspace, name, now()],
    )?;
    Ok(())
}

/// The workspace of a valid, unrevoked key.
pub fn workspace_of(conn: &Connection, key: &str) -> Result<Option<String>, RegistryError> {
    // Every request asks: the statement is parsed once and kept.
    Ok(conn
        .prepare_cached("SELECT workspace FROM api_keys WHERE hash = ?1 AND revoked_at IS NULL")?
        .query_row(params![hash(key)], |r| r.get(0))
        .optional()?)
}

/// Every key.
pub fn list(conn: &Connection) -> Result<Vec<KeyInfo>, RegistryError> {
    let mut stmt = conn.prepare(
        "SELECT prefix, workspace, name, created_at, revoked_at FROM api_keys ORDER BY created_at, prefix",
    )?;
    let rows = stmt.query_map([], |r| {
        Ok(KeyInfo {
            prefix: r.get(0)?,
            workspace: r.get(1)?,
            name: r.get(2)?,
            created_at: r.get(3)?,
            revoked_at: r.get(4)?,
        })
    })?;
    Ok(rows.collect::<Result<_, _>>()?)
}

/// Revokes the keys starting with `prefix`; returns how many.
pub fn revoke(conn: &Connection, prefix: &str) -> Result<usize, RegistryError> {
    Ok(conn.execute(
        "UPDATE api_keys SET revoked_at = ?2 WHERE prefix = ?1 AND revoked_at IS NULL",
        params![prefix, now()],
    )?)
}

/// On first start: makes sure some key exists. The operator's key is written
/// to `<data>/api-key` (0600) so the operator can read it; the database only
/// holds its hash. Returns the key file's path if a key was created.
pub fn bootstrap(
    conn: &Connection,
    data_dir: &Path,
) -> Result<Option<std::path::PathBuf>, std::io::Error> {
    let path = data_dir.join("api-key");
    let count: i64 = conn
        .query_row("SELECT COUNT(*) FROM api_keys", [], |r| r.get(0))
        .map_err(std::io::Error::other)?;
    if count > 0 {
        return Ok(None);
    }
    let (key, created) = match fs::read_to_string(&path) {
        Ok(k) if !k.trim().is_empty() => (k.trim().to_string(), false),
        _ => (generate()?, true),
    };
    if created {
        let mut f = fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&path)?;
        writeln!(f, "{key}")?;
    }
    add(conn, &key, "default", "operator").map_err(std::io::Error::other)?;
    Ok(created.then_some(path))
}

/// How many workspaces have a key that is not revoked.
pub fn workspace_count(conn: &Connection) -> rusqlite::Result<u64> {
    let n: i64 = conn
        .prepare_cached("SELECT COUNT(DISTINCT workspace) FROM api_keys WHERE revoked_at IS NULL")?
        .query_row([], |r| r.get(0))?;
    Ok(u64::try_from(n).unwrap_or(0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_hashed_scoped_and_revocable() {
        // The registry makes the key table.
        let dir = std::env::temp_dir().join(format!("runcell-keys-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let registry = crate::registry::Registry::open(&dir.join("registry.db")).unwrap();
        registry.with_conn(check_keys);
        std::fs::remove_dir_all(dir).unwrap();
    }

    fn check_keys(conn: &Connection) {
        let k = generate().unwrap();
        assert!(k.starts_with("rc_") && k.len() == 51);
        add(conn, &k, "team-a", "ci").unwrap();
        let stored: String = conn
            .query_row("SELECT hash FROM api_keys", [], |r| r.get(0))
            .unwrap();
        assert!(
            !stored.contains(&k[3..]),
            "the key itself must not be stored"
        );
        assert_eq!(workspace_of(conn, &k).unwrap().as_deref(), Some("team-a"));
        assert_eq!(workspace_of(conn, "rc_wrong").unwrap(), None);
        assert_eq!(revoke(conn, &k[..11]).unwrap(), 1);
        assert_eq!(workspace_of(conn, &k).unwrap(), None);
        assert_eq!(list(conn).unwrap()[0].workspace, "team-a");
    }
}
