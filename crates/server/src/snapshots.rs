//! Snapshots, forks and the state layers they share.
//!
//! A state layer is what one sandbox wrote, copied out while it was frozen
//! (`Sandbox::save_layer`), kept under `<data>/states/<key>`. A sandbox
//! started from saved files lays a chain of them (topmost first) between
//! its template and its own writable layer; its chain is its *lineage*,
//! recorded beside its record. A snapshot names a chain; a fork is a new
//! sandbox on the parent's chain plus one new layer, and every child of a
//! fork tree shares that one layer (copy-on-write through overlayfs: ten
//! forks cost one copy of what the parent wrote, not ten). Layers no
//! snapshot or live sandbox uses are removed ([`Layers::collect`]).
//!
//! With the jail, snapshots and forks save files, not processes and
//! memory: answers say `memory: false`. A gVisor sandbox hibernates with
//! its memory (`runsc checkpoint` into `<data>/memory/<id>`), and its wake
//! restores it. Its snapshots and forks carry its memory too: it is
//! checkpointed (which stops it), its files copied, and it is restored in
//! place from the same image (`Sandbox::save_running`); a snapshot keeps
//! the image (`<data>/snapshot-memory/<snapshot id>`) beside its layer, a
//! fork's image lives until its children started from it. A create from
//! such a snapshot, or a fork, restores the image over a copy-on-write
//! copy of the files; where that fails it starts on the files alone and
//! says `state_lost`. A microVM does the same over QEMU: its memory
//! migrates to a file (the guest stopped, its disk chain linked), and it
//! is continued in place; a fork or a snapshot's sandbox is a new QEMU
//! loading that file over a copy-on-write overlay of the saved disk.

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use axum::http::StatusCode;
use rusqlite::{params, Connection, OptionalExtension};
use serde::{Deserialize, Serialize};

use crate::error::ApiError;
use crate::service::{CreateSpec, Created, Service};
use crate::state::{now_ms, AppState, Entry};

/// Errors of the snapshot tables.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    /// SQLite failed.
    #[error("The snapshot registry failed.")]
    Sql(#[from] rusqlite::Error),
    /// A stored row is not valid JSON.
    #[error("A stored snapshot record is damaged.")]
    Json(#[from] serde_json::Error),
}

/// What an idle sandbox becomes when its idle TTL runs out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum OnIdle {
    /// Deleted (everything it had is gone).
    Delete,
    /// Hibernated: its processes end, its files stay; the next call wakes it.
    Hibernate,
}

/// Where a sandbox's files came from and how it idles, recorded beside
/// its record.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lineage {
    /// Its state layers (keys), topmost first.
    #[serde(default)]
    pub state_layers: Vec<String>,
    /// The sandbox it was forked from.
    #[serde(default)]
    pub forked_from: Option<String>,
    /// The snapshot it started from.
    #[serde(default)]
    pub from_snapshot: Option<String>,
    /// What it becomes when idle; the daemon's rule when absent.
    #[serde(default)]
    pub on_idle: Option<OnIdle>,
    /// It was hibernated and woken since its code contexts were made:
    /// their variables are gone.
    #[serde(default)]
    pub state_lost: bool,
    /// The volumes it has.
    #[serde(default)]
    pub volumes: Vec<crate::volumes::VolumeAttach>,
    /// It is hibernated with its memory (`<data>/memory/<id>`, gVisor): a
    /// wake restores its processes and code contexts.
    #[serde(default)]
    pub memory_image: bool,
}

/// A snapshot's record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snapshot {
    /// Its id.
    pub id: String,
    /// The owning workspace.
    pub workspace: String,
    /// The sandbox it was taken of.
    pub sandbox_id: String,
    /// That sandbox's template.
    pub template: String,
    /// That sandbox's isolation.
    pub isolation: runcell_core::backend::Isolation,
    /// When it was taken, unix ms.
    pub created_ms: i64,
    /// Bytes its own layer takes.
    pub size_bytes: u64,
    /// Its chain of state layers, topmost first.
    pub layers: Vec<String>,
}

/// Makes the tables (idempotent).
pub fn init(conn: &Connection) -> Result<(), SnapshotError> {
    conn.execute_batch(
        "CREATE TABLE IF NOT EXISTS snapshots (
             id TEXT PRIMARY KEY,
             workspace TEXT NOT NULL,
             sandbox_id TEXT NOT NULL,
             template TEXT NOT NULL,
             isolation TEXT NOT NULL,
             created_ms INTEGER NOT NULL,
             size_bytes INTEGER NOT NULL,
             layers TEXT NOT NULL
         );
         CREATE INDEX IF NOT EXISTS snapshots_ws ON snapshots(workspace, created_ms);
         CREATE TABLE IF NOT EXISTS lineage (
             id TEXT PRIMARY KEY,
             data TEXT NOT NULL
         );",
    )?;
    Ok(())
}

/// Records a sandbox's lineage (nothing for a sandbox with none).
pub fn put_lineage(conn: &Connection, id: &str, l: &Lineage) -> Result<(), SnapshotError> {
    if *l == Lineage::default() {
        return Ok(());
    }
    conn.execute(
        "INSERT OR REPLACE INTO lineage (id, data) VALUES (?1, ?2)",
        params![id, serde_json::to_string(l)?],
    )?;
    Ok(())
}

/// Whether a sandbox has a lineage recorded (most have none: no saved
/// files, volumes or idle rule of their own).
pub fn has_lineage(conn: &Connection, id: &str) -> Result<bool, SnapshotError> {
    Ok(conn
        .prepare_cached("SELECT 1 FROM lineage WHERE id = ?1")?
        .exists(params![id])?)
}

/// A sandbox's lineage (empty when it has none).
pub fn lineage(conn: &Connection, id: &str) -> Result<Lineage, SnapshotError> {
    let data: Option<String> = conn
        .prepare_cached("SELECT data FROM lineage WHERE id = ?1")?
        .query_row(params![id], |r| r.get(0))
        .optional()?;
    Ok(match data {
        Some(d) => serde_json::from_str(&d)?,
        None => Lineage::default(),
    })
}

fn put(conn: &Connection, s: &Snapshot) -> Result<(), SnapshotError> {
    conn.execute(
        "INSERT INTO snapshots (id, workspace, sandbox_id, template, isolation, created_ms, size_bytes, layers)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)",
        params![
            s.id,
            s.workspace,
            s.sandbox_id,
            s.template,
            s.isolation.as_str(),
            s.created_ms,
            i64::try_from(s.size_bytes).unwrap_or(i64::MAX),
            serde_json::to_string(&s.layers)?,
        ],
    )?;
    Ok(())
}

type Row = (String, String, String, String, String, i64, i64, String);

fn decode(r: Row) -> Result<Snapshot, SnapshotError> {
    Ok(Snapshot {
        id: r.0,
        workspace: r.1,
        sandbox_id: r.2,
        template: r.3,
        isolation: r
            .4
            .parse()
            .unwrap_or(runcell_core::backend::Isolation::Jail),
        created_ms: r.5,
        size_bytes: u64::try_from(r.6).unwrap_or(0),
        layers: serde_json::from_str(&r.7)?,
    })
}

const COLUMNS: &str =
    "id, workspace, sandbox_id, template, isolation, created_ms, size_bytes, layers";

fn row(r: &rusqlite::Row<'_>) -> rusqlite::Result<Row> {
    Ok((
        r.get(0)?,
        r.get(1)?,
        r.get(2)?,
        r.get(3)?,
        r.get(4)?,
        r.get(5)?,
        r.get(6)?,
        r.get(7)?,
    ))
}

/// One snapshot of `workspace`.
pub fn get(
    conn: &Connection,
    workspace: &str,
    id: &str,
) -> Result<Option<Snapshot>, SnapshotError> {
    let r = conn
        .query_row(
            &format!("SELECT {COLUMNS} FROM snapshots WHERE id = ?1 AND workspace = ?2"),
            params![id, workspace],
            row,
        )
        .optional()?;
    r.map(decode).transpose()
}

/// The snapshots of `workspace`, newest first, of one sandbox if asked.
pub fn list(
    conn: &Connection,
    workspace: &str,
    sandbox: Option<&str>,
) -> Result<Vec<Snapshot>, SnapshotError> {
    let mut stmt = conn.prepare(&format!(
        "SELECT {COLUMNS} FROM snapshots WHERE workspace = ?1 AND (?2 IS NULL OR sandbox_id = ?2)
         ORDER BY created_ms DESC, rowid DESC"
    ))?;
    let rows = stmt.query_map(params![workspace, sandbox], row)?;
    rows.map(|r| decode(r?)).collect()
}

/// Deletes a snapshot of `workspace`; whether there was one.
pub fn delete(conn: &Connection, workspace: &str, id: &str) -> Result<bool, SnapshotError> {
    Ok(conn.execute(
        "DELETE FROM snapshots WHERE id = ?1 AND workspace = ?2",
        params![id, workspace],
    )? > 0)
}

/// Bytes the snapshots of `workspace` take.
pub fn used_bytes(conn: &Connection, workspace: &str) -> Result<u64, SnapshotError> {
    let n: i64 = conn.query_row(
        "SELECT COALESCE(SUM(size_bytes), 0) FROM snapshots WHERE workspace = ?1",
        params![workspace],
        |r| r.get(0),
    )?;
    Ok(u64::try_from(n).unwrap_or(0))
}

/// Layer keys in use: every snapshot's, and every live sandbox's. The
/// lineage of sandboxes that ended is forgotten here.
fn in_use(conn: &Connection) -> Result<HashSet<String>, SnapshotError> {
    conn.execute(
        "DELETE FROM lineage WHERE id NOT IN
             (SELECT id FROM sandboxes WHERE status IN ('running', 'hibernated'))",
        [],
    )?;
    let mut used = HashSet::new();
    let mut stmt = conn.prepare("SELECT layers FROM snapshots")?;
    for layers in stmt.query_map([], |r| r.get::<_, String>(0))? {
        used.extend(serde_json::from_str::<Vec<String>>(&layers?)?);
    }
    let mut stmt = conn.prepare("SELECT data FROM lineage")?;
    for data in stmt.query_map([], |r| r.get::<_, String>(0))? {
        used.extend(serde_json::from_str::<Lineage>(&data?)?.state_layers);
    }
    Ok(used)
}

/// The directories of state layers.
#[derive(Debug, Clone)]
pub struct Layers {
    /// Where new layers go: `<data_dir>/states` (copies), or the btrfs
    /// layer store's `states` (snapshots of stages).
    dir: PathBuf,
    /// `<data_dir>/states`: copies made with the tmpfs store, still read
    /// (and collected) after a restart with the btrfs one.
    copies: PathBuf,
}

impl Layers {
    /// Layers under `<data_dir>/states`, or new ones in `store_states`
    /// (the btrfs layer store's).
    pub fn new(data_dir: &Path, store_states: Option<PathBuf>) -> Self {
        let copies = data_dir.join("states");
        Self {
            dir: store_states.unwrap_or_else(|| copies.clone()),
            copies,
        }
    }

    /// The layers of `state`'s layer store.
    pub fn of(state: &AppState) -> Self {
        // The store's `stages` and `states` are siblings.
        let states = state
            .runtime
            .config()
            .stage_store
            .as_ref()
            .and_then(|s| s.parent())
            .map(|root| root.join("states"));
        Self::new(&state.config.data_dir, states)
    }

    /// The directory of layer `key`: in the store it was saved to.
    pub fn path(&self, key: &str) -> PathBuf {
        let path = self.dir.join(key);
        if self.dir != self.copies && std::fs::symlink_metadata(&path).is_err() {
            let copy = self.copies.join(key);
            if std::fs::symlink_metadata(&copy).is_ok() {
                return copy;
            }
        }
        path
    }

    /// Removes layer `key` (a snapshot is deleted as a subvolume).
    pub fn remove(&self, key: &str) {
        if let Err(e) = runcell_jail::btrfs::remove_tree(&self.path(key)) {
            tracing::warn!(layer = %key, "could not remove a state layer: {e}");
        }
    }

    /// The directories of a chain of keys.
    pub fn paths(&self, keys: &[String]) -> Vec<PathBuf> {
        keys.iter().map(|k| self.path(k)).collect()
    }

    /// Removes every layer no snapshot or sandbox uses (and what an
    /// interrupted copy left), but those in `saving` (being saved, not
    /// recorded yet). Returns how many were removed.
    pub fn collect(&self, conn: &Connection, saving: &HashSet<String>) -> usize {
        let used = match in_use(conn) {
            Ok(u) => u,
            Err(e) => {
                tracing::warn!("could not tell which state layers are in use: {e}");
                return 0;
            }
        };
        let mut removed = 0;
        let dirs = if self.dir == self.copies {
            vec![&self.dir]
        } else {
            vec![&self.dir, &self.copies]
        };
        let entries = dirs
            .into_iter()
            .flat_map(|d| std::fs::read_dir(d).into_iter().flatten().flatten());
        for entry in entries {
            let name = entry.file_name().to_string_lossy().into_owned();
            if used.contains(&name) || saving.contains(&name) {
                continue;
            }
            match runcell_jail::btrfs::remove_tree(&entry.path()) {
                Ok(()) => removed += 1,
                Err(e) => {
                    tracing::warn!(layer = %name, "could not remove an unused state layer: {e}")
                }
            }
        }
        removed
    }
}

/// What a fork asks for.
#[derive(Debug, Default)]
pub(crate) struct ForkSpec {
    pub(crate) metadata: BTreeMap<String, String>,
    pub(crate) ttl_seconds: Option<f64>,
}

/// The outcome of a promote.
#[derive(Debug)]
pub(crate) struct Promoted {
    pub(crate) tree_id: Option<String>,
    pub(crate) deleted: Vec<String>,
    pub(crate) failures: BTreeMap<String, String>,
}

fn registry_err(e: impl std::fmt::Display) -> ApiError {
    ApiError::internal(format!("The snapshot registry failed: {e}"))
}

/// A layer just saved: its key stays out of [`Layers::collect`]'s reach
/// until this is dropped (after its snapshot or sandbox recorded it).
pub(crate) struct Saved<'a> {
    pub(crate) key: String,
    pub(crate) bytes: u64,
    state: &'a AppState,
}

impl Drop for Saved<'_> {
    fn drop(&mut self) {
        self.state
            .saving_layers
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(&self.key);
    }
}

impl<'a> Service<'a> {
    fn layers(self) -> Layers {
        Layers::of(self.0)
    }

    /// Removes the layers nothing uses any more.
    pub(crate) fn collect_layers(self) -> usize {
        collect_unused(self.0)
    }

    /// Saves `e`'s files as a new layer.
    async fn save(self, e: &Arc<Entry>) -> Result<Saved<'a>, ApiError> {
        let key = format!("l-{}", uuid::Uuid::new_v4());
        self.0
            .saving_layers
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(key.clone());
        let mut saved = Saved {
            key,
            bytes: 0,
            state: self.0,
        };
        let layers = self.layers();
        std::fs::create_dir_all(&layers.dir).map_err(|err| {
            ApiError::internal(format!("The state directory could not be made: {err}"))
        })?;
        let dest = layers.path(&saved.key);
        let entry = e.clone();
        let done = tokio::task::spawn_blocking(move || entry.sandbox.save_layer(&dest))
            .await
            .map_err(|err| ApiError::internal(format!("Saving the files failed: {err}")))?;
        match done {
            Ok(bytes) => {
                saved.bytes = bytes;
                Ok(saved)
            }
            Err(runcell_core::Error::Jail(
                err @ runcell_core::backend::BackendError::Unsupported { .. },
            )) => Err(ApiError::bad_request(err.to_string())),
            // It ended (its agent is gone) while or before being saved.
            Err(_) if !e.sandbox.is_alive() => Err(ApiError::new(
                StatusCode::CONFLICT,
                format!(
                    "Sandbox {} stopped running; its files cannot be saved.",
                    e.sandbox.id()
                ),
            )),
            Err(err) => Err(ApiError::internal(format!(
                "The sandbox's files could not be saved: {err}"
            ))),
        }
    }

    /// Saves `e`'s files as a new layer and, for a gVisor sandbox that is
    /// not paused, its processes and memory into `image`; it runs on with
    /// its memory. Whether the memory was saved comes back too (where it
    /// was not, runsc's reason is logged and the files still are).
    async fn save_with_memory(
        self,
        e: &Arc<Entry>,
        image: &Path,
    ) -> Result<(Saved<'a>, bool), ApiError> {
        // A sandbox with volumes saves its files only: its processes could
        // be restored only with the volumes mounted again, and a snapshot's
        // or a fork's children do not get the volumes.
        let isolation = e.sandbox.isolation();
        if !matches!(
            isolation,
            runcell_core::backend::Isolation::Gvisor | runcell_core::backend::Isolation::Microvm
        ) || !self.lineage_of(e.sandbox.id()).volumes.is_empty()
        {
            return Ok((self.save(e).await?, false));
        }
        let id = e.sandbox.id().to_string();
        // Nothing else (a hibernation, a wake) happens to it meanwhile.
        let one = self.0.sandbox_lock(&id);
        let _one = one.lock().await;
        let key = format!("l-{}", uuid::Uuid::new_v4());
        self.0
            .saving_layers
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(key.clone());
        let mut saved = Saved {
            key,
            bytes: 0,
            state: self.0,
        };
        let layers = self.layers();
        for dir in [&layers.dir, &snapshot_memory_dir(&self.0.config.data_dir)] {
            std::fs::create_dir_all(dir).map_err(|err| {
                ApiError::internal(format!("The state directory could not be made: {err}"))
            })?;
        }
        let dest = layers.path(&saved.key);
        let entry = e.clone();
        let img = image.to_path_buf();
        let started = std::time::Instant::now();
        let done = tokio::task::spawn_blocking(move || entry.sandbox.save_running(&img, &dest))
            .await
            .map_err(|err| ApiError::internal(format!("Saving the sandbox failed: {err}")))?;
        let (bytes, memory) = match done {
            Ok(d) => d,
            Err(_) if !e.sandbox.is_alive() => {
                return Err(ApiError::new(
                    StatusCode::CONFLICT,
                    format!("Sandbox {id} stopped running; it could not be saved."),
                ))
            }
            Err(err) => {
                return Err(ApiError::internal(format!(
                    "The sandbox could not be saved: {err}"
                )))
            }
        };
        let with_memory = match memory {
            // A microVM's channel stays open through the save (its VMM
            // runs on): nothing to reconnect.
            Ok(()) if isolation == runcell_core::backend::Isolation::Microvm => true,
            Ok(()) => {
                // Its agent closed every host connection for the checkpoint.
                if let Err(err) = e.sandbox.reconnect().await {
                    let _ = std::fs::remove_dir_all(image);
                    self.layers().remove(&saved.key);
                    return Err(ApiError::internal(format!(
                        "The sandbox was saved but does not answer since: {err}"
                    )));
                }
                true
            }
            Err(err) => {
                tracing::warn!(sandbox = %id, "saving its files without its memory: {err}");
                false
            }
        };
        tracing::info!(
            sandbox = %id,
            bytes,
            memory = with_memory,
            ms = runcell_protocol::units::millis(started.elapsed()),
            "sandbox saved"
        );
        saved.bytes = bytes;
        Ok((saved, with_memory))
    }

    /// Whether snapshot `id` carries memory (a gVisor image beside its files).
    pub(crate) fn snapshot_has_memory(self, id: &str) -> bool {
        snapshot_image(&self.0.config.data_dir, id).is_dir()
    }

    /// The lineage of a live sandbox.
    pub(crate) fn lineage_of(self, id: &str) -> Lineage {
        self.0
            .registry
            .with_conn(|c| lineage(c, id))
            .unwrap_or_default()
    }

    /// Saves `e`'s files as a snapshot of `workspace`.
    pub(crate) async fn snapshot(
        self,
        workspace: &str,
        e: &Arc<Entry>,
    ) -> Result<Snapshot, ApiError> {
        let state = self.0;
        let (id, template, isolation) = {
            let r = e
                .record
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            (r.id.clone(), r.template.clone(), r.isolation)
        };
        let quota = state.config.snapshot_quota_bytes;
        let used = state
            .registry
            .with_conn(|c| used_bytes(c, workspace))
            .map_err(registry_err)?;
        if used >= quota {
            return Err(full(used, quota));
        }
        let snap_id = format!("snap-{}", uuid::Uuid::new_v4());
        let image = snapshot_image(&state.config.data_dir, &snap_id);
        let (saved, memory) = self.save_with_memory(e, &image).await?;
        // Its memory image counts against the quota with its files.
        let size = saved.bytes.saturating_add(if memory {
            runcell_jail::layer::disk_usage(&image)
        } else {
            0
        });
        let mut layers = vec![saved.key.clone()];
        layers.extend(self.lineage_of(&id).state_layers);
        let snap = Snapshot {
            id: snap_id,
            workspace: workspace.to_string(),
            sandbox_id: id,
            template,
            isolation,
            created_ms: now_ms(),
            size_bytes: size,
            layers,
        };
        let recorded = if used.saturating_add(size) > quota {
            Err(full(used.saturating_add(size), quota))
        } else {
            state
                .registry
                .with_conn(|c| put(c, &snap))
                .map_err(registry_err)
        };
        if let Err(err) = recorded {
            self.layers().remove(&snap.layers[0]);
            let _ = std::fs::remove_dir_all(&image);
            return Err(err);
        }
        tracing::info!(snapshot = %snap.id, sandbox = %snap.sandbox_id, bytes = size, "snapshot taken");
        Ok(snap)
    }

    /// Deletes a snapshot; its layers go once nothing uses them.
    pub(crate) fn delete_snapshot(self, workspace: &str, id: &str) -> Result<(), ApiError> {
        let state = self.0;
        let deleted = state
            .registry
            .with_conn(|c| delete(c, workspace, id))
            .map_err(registry_err)?;
        if !deleted {
            return Err(ApiError::new(StatusCode::NOT_FOUND, "snapshot not found"));
        }
        let _ = std::fs::remove_dir_all(snapshot_image(&state.config.data_dir, id));
        self.collect_layers();
        Ok(())
    }

    /// What a create from snapshot `id` starts with: the template (unless
    /// the request names one) and the chain of layers.
    pub(crate) fn resolve_snapshot(
        self,
        workspace: &str,
        spec: &mut CreateSpec,
    ) -> Result<(), ApiError> {
        let Some(id) = spec.from_snapshot.clone() else {
            return Ok(());
        };
        let snap = self
            .0
            .registry
            .with_conn(|c| get(c, workspace, &id))
            .map_err(registry_err)?
            .ok_or_else(|| {
                ApiError::new(
                    StatusCode::NOT_FOUND,
                    format!(
                        "from_snapshot: snapshot {:?} not found",
                        crate::http::kit::clip(id.clone())
                    ),
                )
            })?;
        // Its memory comes along onto its own template and backend, and
        // only with the source's settings: the restored agent keeps the
        // limits, network and environment it was saved with, so a create
        // that asks for its own starts from the files alone (memory: false).
        let image = snapshot_image(&self.0.config.data_dir, &snap.id);
        if spec.template.as_ref().is_none_or(|t| *t == snap.template)
            && spec.isolation.is_none_or(|i| i == snap.isolation)
            && spec.limits.is_none()
            && spec.network.is_none()
            && spec.env.is_empty()
            && spec.volumes.is_empty()
            && image.is_dir()
        {
            spec.memory_image = Some(image);
        }
        // A microVM's saved guest keeps its RAM, vCPUs and cgroup limits:
        // a create that names none gets its source's, so it can take it.
        if spec.memory_image.is_some()
            && snap.isolation == runcell_core::backend::Isolation::Microvm
        {
            if let Ok(Some(source)) = self.0.registry.get(&snap.sandbox_id) {
                let limits = source.limits.over(self.0.config.default_limits);
                spec.limits = Some(crate::limits::LimitsReq::from(&limits));
            }
        }
        spec.template.get_or_insert(snap.template);
        let isolation = *spec.isolation.get_or_insert(snap.isolation);
        // A microVM's saved files are disk images, the others' directory
        // trees: neither starts the other.
        let microvm = runcell_core::backend::Isolation::Microvm;
        if (isolation == microvm) != (snap.isolation == microvm) {
            return Err(ApiError::bad_request(format!(
                "from_snapshot: snapshot {} was taken of a {} sandbox; its files cannot start a {isolation} sandbox.",
                snap.id, snap.isolation
            )));
        }
        spec.state_layers = snap.layers;
        spec.lineage.from_snapshot = Some(id);
        Ok(())
    }

    /// A new sandbox whose files start as `parent`'s now, `count` times
    /// over one shared layer. Children that could not be made after the
    /// first are left out (the answer has fewer); none made is an error.
    pub(crate) async fn fork(
        self,
        workspace: &str,
        parent: &Arc<Entry>,
        spec: ForkSpec,
        count: usize,
        tree: Option<&str>,
    ) -> Result<Vec<Created>, ApiError> {
        // The children's metadata, checked before anything is saved: the
        // parent's with the request's over it (and the tree's keys, which
        // are not counted).
        let mut metadata = parent
            .record
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .metadata
            .clone();
        metadata.extend(spec.metadata);
        metadata.remove("workspace");
        crate::validate::metadata("metadata", &metadata)?;
        // A fork's memory image lives until its children started from it.
        let image = snapshot_image(
            &self.0.config.data_dir,
            &format!("fork-{}", uuid::Uuid::new_v4()),
        );
        let (saved, memory) = self.save_with_memory(parent, &image).await?;
        let key = saved.key.clone();
        let r = parent
            .record
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone();
        let mut chain = vec![key.clone()];
        chain.extend(self.lineage_of(&r.id).state_layers);
        if let Some(tree) = tree {
            metadata.insert("fork_tree_id".into(), tree.to_string());
            metadata.insert("fork_parent".into(), r.id.clone());
        }
        let network = parent.sandbox.network().map(|n| n.policy);
        let mut children = Vec::new();
        let mut last_err = None;
        for _ in 0..count {
            let child = CreateSpec {
                template: Some(r.template.clone()),
                ttl_seconds: spec.ttl_seconds.or(Some(r.ttl_seconds as f64)),
                persistent: Some(r.persistent),
                metadata: metadata.clone(),
                limits: Some(crate::limits::LimitsReq::from(parent.sandbox.limits())),
                env: r.env.clone(),
                network: network.clone(),
                isolation: Some(r.isolation),
                state_layers: chain.clone(),
                lineage: Lineage {
                    forked_from: Some(r.id.clone()),
                    ..Lineage::default()
                },
                memory_image: memory.then(|| image.clone()),
                ..CreateSpec::default()
            };
            match self.create_sandbox(workspace, child).await {
                Ok(c) => children.push(c),
                Err(e) => {
                    last_err = Some(e);
                    break;
                }
            }
        }
        let _ = std::fs::remove_dir_all(&image);
        if children.is_empty() {
            // Nothing uses the new layer.
            self.layers().remove(&key);
            return Err(last_err.unwrap_or_else(|| ApiError::internal("No fork was made.")));
        }
        Ok(children)
    }

    /// Makes `winner` independent of its fork tree and, if asked, deletes
    /// the tree's other sandboxes.
    pub(crate) async fn promote(
        self,
        workspace: &str,
        winner: &Arc<Entry>,
        tree_id: Option<String>,
        cleanup_siblings: bool,
    ) -> Result<Promoted, ApiError> {
        let state = self.0;
        let record = {
            let mut r = winner
                .record
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let tree = tree_id.or_else(|| r.metadata.get("fork_tree_id").cloned());
            r.metadata.remove("fork_tree_id");
            (r.clone(), tree)
        };
        let (record, tree) = record;
        state
            .registry
            .put(&record)
            .map_err(|e| ApiError::internal(format!("The change could not be recorded: {e}")))?;
        let mut deleted = Vec::new();
        let mut failures = BTreeMap::new();
        if let (true, Some(tree)) = (cleanup_siblings, tree.as_deref()) {
            let siblings = self.list(workspace, &[("fork_tree_id".to_string(), tree.to_string())]);
            for s in siblings {
                let id = s.sandbox.id().to_string();
                if id == record.id {
                    continue;
                }
                drop(s);
                match self.kill(&id).await {
                    Ok(()) => deleted.push(id),
                    Err(e) => {
                        failures.insert(id, e.message);
                    }
                }
            }
        }
        Ok(Promoted {
            tree_id: tree,
            deleted,
            failures,
        })
    }

    /// What `r` becomes when idle: its own choice, else hibernation for a
    /// persistent sandbox on a daemon that hibernates idle ones
    /// (`--idle-hibernate`), else deletion.
    pub(crate) fn on_idle(self, r: &crate::registry::Record, lineage: &Lineage) -> OnIdle {
        lineage
            .on_idle
            .unwrap_or(if r.persistent && self.0.config.idle_hibernate {
                OnIdle::Hibernate
            } else {
                OnIdle::Delete
            })
    }

    /// Hibernates a live sandbox: its files are saved as a layer, its
    /// processes end and its memory is freed; its record stays
    /// (`hibernated`) and the next call on it wakes it.
    pub(crate) async fn hibernate(self, e: Arc<Entry>) -> Result<(), ApiError> {
        let state = self.0;
        let id = e.sandbox.id().to_string();
        // No wake of it starts before it is gone.
        let one = state.sandbox_lock(&id);
        let _one = one.lock().await;
        if state.entry(&id).is_none() {
            return Ok(());
        }
        if matches!(
            e.sandbox.isolation(),
            runcell_core::backend::Isolation::Gvisor | runcell_core::backend::Isolation::Microvm
        ) {
            return self.hibernate_with_memory(e, &id).await;
        }
        // Frozen first, so nothing is written between the copy and the end.
        if !e.sandbox.is_paused() {
            let entry = e.clone();
            tokio::task::spawn_blocking(move || entry.sandbox.pause())
                .await
                .map_err(|err| ApiError::internal(format!("Hibernating failed: {err}")))?
                .map_err(|err| match err {
                    runcell_core::Error::Jail(
                        err @ runcell_core::backend::BackendError::Unsupported { .. },
                    ) => ApiError::bad_request(err.to_string()),
                    other => ApiError::from(other),
                })?;
        }
        let saved = match self.save(&e).await {
            Ok(s) => s,
            Err(err) => {
                let _ = e.sandbox.resume();
                return Err(err);
            }
        };
        let bytes = saved.bytes;
        let mut lineage = self.lineage_of(&id);
        lineage.state_layers.insert(0, saved.key.clone());
        let mut record = e
            .record
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone();
        record.status = "hibernated".into();
        record.last_activity_ms = now_ms();
        let recorded = state
            .registry
            .with_conn(|c| put_lineage(c, &id, &lineage))
            .map_err(|err| err.to_string())
            .and_then(|()| state.registry.put(&record).map_err(|err| err.to_string()));
        if let Err(err) = recorded {
            self.layers().remove(&lineage.state_layers[0]);
            let _ = e.sandbox.resume();
            return Err(ApiError::internal(format!(
                "The hibernation could not be recorded: {err}"
            )));
        }
        drop(e);
        state.release(&id).await;
        tracing::info!(sandbox = %id, bytes, "sandbox hibernated");
        Ok(())
    }

    /// Where a sandbox hibernated with its memory keeps it.
    fn memory_image(self, id: &str) -> PathBuf {
        memory_dir(&self.0.config.data_dir).join(id)
    }

    /// Hibernates a gVisor sandbox (the caller holds its lock): its
    /// processes and memory are checkpointed to its memory image and its
    /// files saved as a layer. Where the checkpoint fails (runsc's error is
    /// logged), the files still are, and the wake says `state_lost`.
    async fn hibernate_with_memory(self, e: Arc<Entry>, id: &str) -> Result<(), ApiError> {
        let state = self.0;
        let key = format!("l-{}", uuid::Uuid::new_v4());
        state
            .saving_layers
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(key.clone());
        let saved = Saved {
            key,
            bytes: 0,
            state,
        };
        let layers = self.layers();
        let image = self.memory_image(id);
        for dir in [&layers.dir, &memory_dir(&state.config.data_dir)] {
            std::fs::create_dir_all(dir).map_err(|err| {
                ApiError::internal(format!("The state directory could not be made: {err}"))
            })?;
        }
        let _ = std::fs::remove_dir_all(&image);
        let dest = layers.path(&saved.key);
        let entry = e.clone();
        let img = image.clone();
        let started = std::time::Instant::now();
        let done = tokio::task::spawn_blocking(move || entry.sandbox.checkpoint(&img, &dest))
            .await
            .map_err(|err| ApiError::internal(format!("Hibernating failed: {err}")))?;
        let (bytes, memory) = done.map_err(|err| {
            ApiError::internal(format!("The sandbox's files could not be saved: {err}"))
        })?;
        let with_memory = match memory {
            Ok(()) => true,
            Err(err) => {
                tracing::warn!(sandbox = %id, "hibernating without memory: {err}");
                false
            }
        };
        let mut lineage = self.lineage_of(id);
        lineage.state_layers.insert(0, saved.key.clone());
        lineage.memory_image = with_memory;
        let mut record = e
            .record
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone();
        record.status = "hibernated".into();
        record.last_activity_ms = now_ms();
        let recorded = state
            .registry
            .with_conn(|c| put_lineage(c, id, &lineage))
            .map_err(|err| err.to_string())
            .and_then(|()| state.registry.put(&record).map_err(|err| err.to_string()));
        drop(e);
        // Its processes ended with the checkpoint: it goes either way.
        state.release(id).await;
        if let Err(err) = recorded {
            let _ = std::fs::remove_dir_all(layers.path(&lineage.state_layers[0]));
            let _ = std::fs::remove_dir_all(&image);
            return Err(ApiError::internal(format!(
                "The hibernation could not be recorded: {err}"
            )));
        }
        drop(saved);
        tracing::info!(
            sandbox = %id,
            bytes,
            memory = with_memory,
            ms = runcell_protocol::units::millis(started.elapsed()),
            "sandbox hibernated"
        );
        Ok(())
    }

    /// The record of a hibernated sandbox of `workspace`.
    pub(crate) fn hibernated(self, workspace: &str, id: &str) -> Option<crate::registry::Record> {
        self.0
            .registry
            .get(id)
            .ok()
            .flatten()
            .filter(|r| r.status == "hibernated" && r.workspace == workspace)
    }

    /// Wakes a hibernated sandbox under its id: a new agent on its saved
    /// files. Its code contexts are gone (`state_lost`). Concurrent wakes
    /// of one sandbox make it once.
    pub(crate) async fn wake(self, workspace: &str, id: &str) -> Result<Arc<Entry>, ApiError> {
        let state = self.0;
        let one = state.sandbox_lock(id);
        let _one = one.lock().await;
        if let Some(e) = state.entry(id) {
            // Woken meanwhile, or running: only its own workspace gets it.
            let own = e
                .record
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .workspace
                == workspace;
            return if own {
                Ok(e)
            } else {
                Err(state.gone(workspace, id))
            };
        }
        let mut record = self
            .hibernated(workspace, id)
            .ok_or_else(|| state.gone(workspace, id))?;
        let mut lineage = self.lineage_of(id);
        let template_name = self.resolve_alias(&record.template);
        let template = state
            .runtime
            .template(&template_name)
            .map_err(|e| ApiError::internal(format!("Its template is gone: {e}")))?;
        let limits = record.limits.over(state.config.default_limits);
        let network = state.registry.network(id).ok().flatten();
        let started = std::time::Instant::now();
        let opts = runcell_core::SandboxOptions {
            template: template.name.clone(),
            limits,
            tied_to_process: false,
            max_lifetime: Some(state.config.max_lifetime.saturating_sub(
                std::time::Duration::from_millis(
                    u64::try_from(now_ms() - record.created_at * 1000).unwrap_or(0),
                ),
            )),
            network: Some(network.unwrap_or_default()),
            isolation: Some(record.isolation),
            id: Some(id.to_string()),
            state_layers: self.layers().paths(&lineage.state_layers),
            mounts: self.volume_binds(workspace, &lineage.volumes)?,
            memory_image: None,
            one_shot: false,
            first_run: None,
        };
        let (sandbox, restored) = self.start_woken(id, &lineage, opts).await?;
        record.status = "running".into();
        record.last_activity_ms = now_ms();
        // Restored memory keeps the code contexts (and whether an earlier
        // wake lost them); a fresh start loses them.
        lineage.state_lost = lineage.state_lost || !restored;
        lineage.memory_image = false;
        let recorded = state
            .registry
            .put(&record)
            .map_err(|e| e.to_string())
            .and_then(|()| {
                state
                    .registry
                    .with_conn(|c| put_lineage(c, id, &lineage))
                    .map_err(|e| e.to_string())
            });
        if let Err(e) = recorded {
            let _ = sandbox.destroy().await;
            return Err(ApiError::internal(format!(
                "The wake could not be recorded: {e}"
            )));
        }
        let entry = Entry::new(sandbox, record, template, None);
        state
            .sandboxes
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(id.to_string(), entry.clone());
        tracing::info!(sandbox = %id, ms = runcell_protocol::units::millis(started.elapsed()), "sandbox woken");
        Ok(entry)
    }

    /// Starts a hibernated sandbox again: from its memory image where it
    /// has one (gVisor; `true`), else, or if the restore fails, afresh on
    /// its files. The image is used up either way.
    async fn start_woken(
        self,
        id: &str,
        lineage: &Lineage,
        opts: runcell_core::SandboxOptions,
    ) -> Result<(runcell_core::Sandbox, bool), ApiError> {
        let state = self.0;
        let image = self.memory_image(id);
        let mut restored = None;
        if lineage.memory_image && image.is_dir() {
            let mut with = opts.clone();
            with.memory_image = Some(image.clone());
            match state.runtime.create(with).await {
                Ok(s) => restored = Some(s),
                Err(e) => {
                    tracing::warn!(sandbox = %id, "its memory could not be restored; waking it on its files: {e}");
                }
            }
        }
        let _ = std::fs::remove_dir_all(&image);
        if let Some(s) = restored {
            return Ok((s, true));
        }
        let sandbox = state.runtime.create(opts).await.map_err(|e| {
            ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("auto-wake: the sandbox could not be woken: {e}"),
            )
        })?;
        Ok((sandbox, false))
    }

    /// The hibernated sandboxes of `workspace` with every metadata pair.
    pub(crate) fn list_hibernated(
        self,
        workspace: &str,
        filters: &[(String, String)],
    ) -> Vec<crate::registry::Record> {
        self.0
            .registry
            .with_status("hibernated")
            .unwrap_or_default()
            .into_iter()
            .filter(|r| {
                r.workspace == workspace
                    && filters.iter().all(|(k, v)| r.metadata.get(k) == Some(v))
            })
            .collect()
    }

    /// Ids of hibernated sandboxes past the maximum lifetime `max_ms`.
    pub(crate) fn expired_hibernated(self, now: i64, max_ms: i64) -> Vec<String> {
        self.0
            .registry
            .with_status("hibernated")
            .unwrap_or_default()
            .into_iter()
            .filter(|r| now.saturating_sub(r.created_at.saturating_mul(1000)) > max_ms)
            .map(|r| r.id)
            .collect()
    }

    /// Deletes a hibernated sandbox (it has no processes; its files go).
    pub(crate) fn delete_hibernated(self, id: &str, reason: &str) -> Result<(), ApiError> {
        let state = self.0;
        state
            .registry
            .end(id, crate::registry::Ended::Deleted, reason)
            .map_err(|e| ApiError::internal(format!("The deletion could not be recorded: {e}")))?;
        self.collect_layers();
        let _ = std::fs::remove_dir_all(self.memory_image(id));
        tracing::info!(sandbox = %id, reason, "hibernated sandbox deleted");
        Ok(())
    }

    /// Pauses or resumes a sandbox.
    pub(crate) async fn set_paused(self, e: &Arc<Entry>, pause: bool) -> Result<(), ApiError> {
        let id = e.sandbox.id().to_string();
        if e.sandbox.is_paused() == pause {
            return Err(ApiError::new(
                StatusCode::CONFLICT,
                if pause {
                    format!("Sandbox {id} is paused already.")
                } else {
                    format!("Sandbox {id} is not paused.")
                },
            ));
        }
        if pause {
            self.0.hold_deadline(e).await?;
        }
        let entry = e.clone();
        let done = tokio::task::spawn_blocking(move || {
            if pause {
                entry.sandbox.pause()
            } else {
                entry.sandbox.resume()
            }
        })
        .await
        .map_err(|err| ApiError::internal(format!("Pausing failed: {err}")))?;
        match done {
            Ok(()) => {}
            Err(runcell_core::Error::Jail(
                err @ runcell_core::backend::BackendError::Unsupported { .. },
            )) => return Err(ApiError::bad_request(err.to_string())),
            Err(err) => return Err(ApiError::from(err)),
        }
        // The idle clock starts again from the resume (a paused agent
        // would not answer the deadline touch sends).
        if !pause {
            self.0.touch(e).await;
        }
        tracing::info!(sandbox = %id, paused = pause, "sandbox {}", if pause { "paused" } else { "resumed" });
        Ok(())
    }
}

fn full(used: u64, quota: u64) -> ApiError {
    ApiError::new(
        StatusCode::INSUFFICIENT_STORAGE,
        format!(
            "The workspace's snapshots would take {} of its {} snapshot quota; delete some first.",
            runcell_core::format_size(used),
            runcell_core::format_size(quota)
        ),
    )
}

/// Removes the layers nothing uses any more (but those being saved).
pub fn collect_unused(state: &AppState) -> usize {
    let saving = state
        .saving_layers
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .clone();
    let layers = Layers::of(state);
    state.registry.with_conn(|c| layers.collect(c, &saving))
}

/// Where memory images of hibernated sandboxes live.
fn memory_dir(data_dir: &Path) -> PathBuf {
    data_dir.join("memory")
}

/// Where the memory images of gVisor snapshots (and, while their
/// children start, of forks) live.
fn snapshot_memory_dir(data_dir: &Path) -> PathBuf {
    data_dir.join("snapshot-memory")
}

/// The memory image of snapshot `id` (a directory, where it has one).
fn snapshot_image(data_dir: &Path, id: &str) -> PathBuf {
    snapshot_memory_dir(data_dir).join(id)
}

/// Removes unused layers at start (what a killed daemon left half-made).
pub fn collect_at_start(state: &AppState) {
    // Memory images of snapshots no longer recorded (deleted, or half-made
    // when a daemon was killed) and of forks a killed daemon left.
    let snapshots = state
        .registry
        .with_conn(|c| -> Result<HashSet<String>, SnapshotError> {
            let mut stmt = c.prepare("SELECT id FROM snapshots")?;
            let ids = stmt.query_map([], |r| r.get::<_, String>(0))?;
            Ok(ids.collect::<Result<_, _>>()?)
        });
    // Nothing is removed when the registry cannot say what is used.
    if let (Ok(snapshots), Ok(dir)) = (
        snapshots,
        std::fs::read_dir(snapshot_memory_dir(&state.config.data_dir)),
    ) {
        for e in dir.flatten() {
            if !snapshots.contains(e.file_name().to_string_lossy().as_ref()) {
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
    }
    // Memory images of sandboxes no longer hibernated (a half-made one, or
    // one whose wake or deletion a killed daemon did not finish).
    let hibernated: HashSet<String> = state
        .registry
        .with_status("hibernated")
        .unwrap_or_default()
        .into_iter()
        .map(|r| r.id)
        .collect();
    if let Ok(dir) = std::fs::read_dir(memory_dir(&state.config.data_dir)) {
        for e in dir.flatten() {
            if !hibernated.contains(e.file_name().to_string_lossy().as_ref()) {
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
    }
    let layers = Layers::of(state);
    // Nothing is being saved yet: whatever no record names is a leftover.
    let n = state
        .registry
        .with_conn(|c| layers.collect(c, &HashSet::new()));
    if n > 0 {
        tracing::info!(removed = n, "removed unused state layers");
    }
}
