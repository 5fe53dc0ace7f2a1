//! Named persistent volumes of a workspace: an ext4 file system in an
//! image file under `<data>/volumes`, loop-mounted on the host while the
//! daemon runs, and bound into the sandboxes that ask for it (at
//! `/mnt/<name>` unless a path is given). The image caps the size; data
//! outlives sandboxes and daemon restarts. One sandbox may attach a volume
//! read-write at a time (live or hibernated); read-only attachments are
//! not limited.

use std::path::{Path, PathBuf};
use std::process::Command;

use axum::http::StatusCode;
use rusqlite::{params, Connection, OptionalExtension};
use serde::{Deserialize, Serialize};

use crate::error::ApiError;
use crate::service::Service;
use crate::state::{now_ms, AppState};

/// Errors of the volume table.
#[derive(Debug, thiserror::Error)]
pub enum VolumeError {
    /// SQLite failed.
    #[error("The volume registry failed.")]
    Sql(#[from] rusqlite::Error),
}

/// Largest volume, MiB (PandaStack's ceiling).
pub const MAX_SIZE_MB: u64 = 65_536;

/// A volume's record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Volume {
    /// Its id (names its files).
    pub id: String,
    /// The owning workspace.
    pub workspace: String,
    /// Its name in the workspace.
    pub name: String,
    /// Its size, MiB.
    pub size_mb: u64,
    /// When it was made, unix ms.
    pub created_ms: i64,
}

/// A volume a sandbox asks for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct VolumeAttach {
    /// The volume's name.
    pub name: String,
    /// Mounted read-only.
    #[serde(default, alias = "readOnly")]
    pub read_only: Option<bool>,
    /// Where it appears in the sandbox (absolute); `/mnt/<name>` by default.
    #[serde(default)]
    pub path: Option<String>,
}

/// Makes the table (idempotent).
pub fn init(conn: &Connection) -> Result<(), VolumeError> {
    conn.execute_batch(
        "CREATE TABLE IF NOT EXISTS volumes (
             id TEXT PRIMARY KEY,
             workspace TEXT NOT NULL,
             name TEXT NOT NULL,
             size_mb INTEGER NOT NULL,
             created_ms INTEGER NOT NULL,
             UNIQUE (workspace, name)
         );",
    )?;
    Ok(())
}

type Row = (String, String, String, i64, i64);

fn decode(r: Row) -> Volume {
    Volume {
        id: r.0,
        workspace: r.1,
        name: r.2,
        size_mb: u64::try_from(r.3).unwrap_or(0),
        created_ms: r.4,
    }
}

fn row(r: &rusqlite::Row<'_>) -> rusqlite::Result<Row> {
    Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?))
}

/// One volume of `workspace` by name.
pub fn get(conn: &Connection, workspace: &str, name: &str) -> Result<Option<Volume>, VolumeError> {
    Ok(conn
        .query_row(
            "SELECT id, workspace, name, size_mb, created_ms FROM volumes
             WHERE workspace = ?1 AND name = ?2",
            params![workspace, name],
            row,
        )
        .optional()?
        .map(decode))
}

/// The volumes of `workspace` (all of them with `None`), by name.
pub fn list(conn: &Connection, workspace: Option<&str>) -> Result<Vec<Volume>, VolumeError> {
    let mut stmt = conn.prepare(
        "SELECT id, workspace, name, size_mb, created_ms FROM volumes
         WHERE ?1 IS NULL OR workspace = ?1 ORDER BY name",
    )?;
    let rows = stmt.query_map(params![workspace], row)?;
    rows.map(|r| Ok(decode(r?))).collect()
}

/// Checks a volume name: 1 to 63 of `a-z 0-9 _ -`, starting alphanumeric.
pub fn check_name(name: &str) -> Result<(), ApiError> {
    let ok = (1..=63).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-')
        && name.as_bytes()[0].is_ascii_alphanumeric();
    if ok {
        Ok(())
    } else {
        Err(ApiError::bad_request(format!(
            "name: {:?} is not a volume name (1 to 63 of a-z, 0-9, '_' and '-', starting with a letter or digit).",
            crate::http::kit::clip(name.to_string())
        )))
    }
}

/// Volumes being attached by creates in flight, released when dropped.
pub(crate) struct Attaching<'a> {
    state: &'a AppState,
    keys: Vec<(String, String)>,
}

impl Drop for Attaching<'_> {
    fn drop(&mut self) {
        let mut set = self
            .state
            .attaching
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for k in &self.keys {
            set.remove(k);
        }
    }
}

impl<'a> Service<'a> {
    /// Holds the volumes a create asks for until it is recorded, so two
    /// creates cannot both take one volume (a second is 409).
    pub(crate) fn reserve_volumes(
        self,
        workspace: &str,
        asked: &[VolumeAttach],
    ) -> Result<Attaching<'a>, ApiError> {
        let mut set = self
            .0
            .attaching
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let keys: Vec<(String, String)> = asked
            .iter()
            .map(|a| (workspace.to_string(), a.name.clone()))
            .collect();
        if let Some((_, name)) = keys.iter().find(|k| set.contains(*k)) {
            return Err(ApiError::new(
                StatusCode::CONFLICT,
                format!("Volume {name:?} is being attached to another sandbox right now."),
            ));
        }
        set.extend(keys.iter().cloned());
        Ok(Attaching {
            state: self.0,
            keys,
        })
    }
}

/// Where volumes live on the host.
#[derive(Debug, Clone)]
pub struct Store {
    dir: PathBuf,
}

impl Store {
    /// Volumes under `<data_dir>/volumes`.
    pub fn new(data_dir: &Path) -> Self {
        Self {
            dir: data_dir.join("volumes"),
        }
    }

    fn image(&self, id: &str) -> PathBuf {
        self.dir.join(format!("{id}.img"))
    }

    /// Where volume `id` is mounted on the host.
    pub fn mount_point(&self, id: &str) -> PathBuf {
        self.dir.join(format!("{id}.mnt"))
    }

    /// Makes the image (sparse) with an ext4 file system whose root the
    /// sandbox user (`owner`, a host uid) owns, and mounts it.
    fn make(&self, id: &str, size_mb: u64, owner: u32) -> Result<(), String> {
        std::fs::create_dir_all(&self.dir).map_err(|e| e.to_string())?;
        let image = self.image(id);
        let file = std::fs::File::create(&image).map_err(|e| e.to_string())?;
        file.set_len(size_mb << 20).map_err(|e| e.to_string())?;
        drop(file);
        run(runcell_jail::host_tools::command("mkfs.ext4")
            .args(["-q", "-F", "-m", "0", "-E"])
            .arg(format!("root_owner={owner}:{owner}"))
            .arg(&image))?;
        self.mount(id)
    }

    /// Mounts volume `id` if it is not mounted.
    pub fn mount(&self, id: &str) -> Result<(), String> {
        let mnt = self.mount_point(id);
        if crate::store::is_mounted(&mnt) {
            return Ok(());
        }
        std::fs::create_dir_all(&mnt).map_err(|e| e.to_string())?;
        run(runcell_jail::host_tools::command("mount")
            .args(["-o", "loop,nosuid,nodev"])
            .arg(self.image(id))
            .arg(&mnt))
    }

    /// Unmounts and removes volume `id`'s files.
    fn remove(&self, id: &str) -> Result<(), String> {
        let mnt = self.mount_point(id);
        if crate::store::is_mounted(&mnt) {
            run(runcell_jail::host_tools::command("umount").arg(&mnt))?;
        }
        let _ = std::fs::remove_dir(&mnt);
        match std::fs::remove_file(self.image(id)) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e.to_string()),
            _ => Ok(()),
        }
    }

    /// For a stopping daemon with no live sandbox (none has a volume bound
    /// in its mount namespace): unmounts every volume, and with it goes its
    /// loop device (autoclear). The images stay; the next start mounts
    /// them again ([`mount_all`]). Returns how many were unmounted; one
    /// that fails stays mounted, said in the log.
    pub fn release_all(&self) -> usize {
        let mut released = 0;
        for entry in std::fs::read_dir(&self.dir).into_iter().flatten().flatten() {
            let mnt = entry.path();
            if mnt.extension().is_none_or(|e| e != "mnt") || !crate::store::is_mounted(&mnt) {
                continue;
            }
            match run(runcell_jail::host_tools::command("umount").arg(&mnt)) {
                Ok(()) => released += 1,
                Err(e) => tracing::warn!(mount = %mnt.display(), "a volume stays mounted: {e}"),
            }
        }
        released
    }

    /// Bytes used on volume `id`'s file system.
    fn used_bytes(&self, id: &str) -> u64 {
        nix::sys::statvfs::statvfs(&self.mount_point(id))
            .map(|s| (s.blocks().saturating_sub(s.blocks_free())).saturating_mul(s.fragment_size()))
            .unwrap_or(0)
    }
}

fn run(cmd: &mut Command) -> Result<(), String> {
    let out = cmd.output().map_err(|e| format!("{cmd:?}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{:?} failed: {}",
            cmd.get_program(),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// A volume as the API shows it.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct VolumeView {
    /// Its name.
    pub name: String,
    /// Its size, MiB.
    pub size_mb: u64,
    /// RFC 3339.
    pub created_at: String,
    /// Bytes in use on it.
    pub used_bytes: u64,
    /// Sandboxes (live or hibernated) it is attached to.
    pub attached_to: Vec<String>,
}

fn registry_err(e: impl std::fmt::Display) -> ApiError {
    ApiError::internal(format!("The volume registry failed: {e}"))
}

impl Service<'_> {
    fn store(self) -> Store {
        Store::new(&self.0.config.data_dir)
    }

    /// Sandboxes (live or hibernated) with volume `name` of `workspace`,
    /// and whether each has it read-write.
    fn attachments(self, workspace: &str, name: &str) -> Vec<(String, bool)> {
        let ids: Vec<String> = self
            .0
            .registry
            .with_status("running")
            .unwrap_or_default()
            .into_iter()
            .chain(
                self.0
                    .registry
                    .with_status("hibernated")
                    .unwrap_or_default(),
            )
            .filter(|r| r.workspace == workspace)
            .map(|r| r.id)
            .collect();
        ids.into_iter()
            .filter_map(|id| {
                let l = self.lineage_of(&id);
                let a = l.volumes.iter().find(|v| v.name == name)?;
                Some((id, !a.read_only.unwrap_or(false)))
            })
            .collect()
    }

    /// The view of a volume.
    pub(crate) fn volume_view(self, v: &Volume) -> VolumeView {
        VolumeView {
            name: v.name.clone(),
            size_mb: v.size_mb,
            created_at: runcell_core::rfc3339(v.created_ms / 1000),
            used_bytes: self.store().used_bytes(&v.id),
            attached_to: self
                .attachments(&v.workspace, &v.name)
                .into_iter()
                .map(|(id, _)| id)
                .collect(),
        }
    }

    /// Makes a volume of `workspace`.
    pub(crate) async fn create_volume(
        self,
        workspace: &str,
        name: String,
        size_mb: u64,
    ) -> Result<Volume, ApiError> {
        let state = self.0;
        check_name(&name)?;
        if !(1..=MAX_SIZE_MB).contains(&size_mb) {
            return Err(ApiError::bad_request(format!(
                "size_mb must be from 1 to {MAX_SIZE_MB}, not {size_mb}."
            )));
        }
        let existing = state
            .registry
            .with_conn(|c| list(c, Some(workspace)))
            .map_err(registry_err)?;
        if existing.iter().any(|v| v.name == name) {
            return Err(ApiError::new(
                StatusCode::CONFLICT,
                format!("A volume named {name:?} exists already."),
            ));
        }
        let used: u64 = existing.iter().map(|v| v.size_mb).sum();
        let quota = state.config.volume_quota_mb;
        if used.saturating_add(size_mb) > quota {
            return Err(ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                format!(
                    "The workspace's volumes would take {} MiB of its {quota} MiB volume quota.",
                    used.saturating_add(size_mb)
                ),
            ));
        }
        let v = Volume {
            id: format!("vol-{}", uuid::Uuid::new_v4()),
            workspace: workspace.to_string(),
            name,
            size_mb,
            created_ms: now_ms(),
        };
        let owner = state.runtime.config().id_map.host_base
            + runcell_core::backend::SandboxUser::default().uid;
        let store = self.store();
        let id = v.id.clone();
        tokio::task::spawn_blocking(move || {
            store.make(&id, size_mb, owner).inspect_err(|_| {
                let _ = store.remove(&id);
            })
        })
        .await
        .map_err(|e| ApiError::internal(e.to_string()))?
        .map_err(|e| {
            ApiError::new(
                StatusCode::INSUFFICIENT_STORAGE,
                format!("The volume could not be made: {e}"),
            )
        })?;
        let recorded = state.registry.with_conn(|c| {
            c.execute(
                "INSERT INTO volumes (id, workspace, name, size_mb, created_ms) VALUES (?1, ?2, ?3, ?4, ?5)",
                params![v.id, v.workspace, v.name, i64::try_from(v.size_mb).unwrap_or(i64::MAX), v.created_ms],
            )
        });
        if let Err(e) = recorded {
            let _ = self.store().remove(&v.id);
            // Two creates of one name raced: the unique key refused one.
            return Err(ApiError::new(
                StatusCode::CONFLICT,
                format!("The volume could not be recorded: {e}"),
            ));
        }
        tracing::info!(volume = %v.name, size_mb, "volume created");
        Ok(v)
    }

    /// Deletes a volume of `workspace`; 409 while a sandbox has it.
    pub(crate) async fn delete_volume(self, workspace: &str, name: &str) -> Result<(), ApiError> {
        let state = self.0;
        let v = state
            .registry
            .with_conn(|c| get(c, workspace, name))
            .map_err(registry_err)?
            .ok_or_else(|| not_found(name))?;
        let users = self.attachments(workspace, name);
        if !users.is_empty() {
            return Err(ApiError::new(
                StatusCode::CONFLICT,
                format!(
                    "Volume {name:?} is attached to {}; delete those sandboxes first.",
                    users
                        .into_iter()
                        .map(|(id, _)| id)
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            ));
        }
        state
            .registry
            .with_conn(|c| c.execute("DELETE FROM volumes WHERE id = ?1", params![v.id]))
            .map_err(registry_err)?;
        let store = self.store();
        let id = v.id.clone();
        tokio::task::spawn_blocking(move || store.remove(&id))
            .await
            .map_err(|e| ApiError::internal(e.to_string()))?
            .map_err(|e| {
                ApiError::internal(format!("The volume's files could not be removed: {e}"))
            })?;
        tracing::info!(volume = %name, "volume deleted");
        Ok(())
    }

    /// The bind mounts of volumes a sandbox has (a woken one), unchecked.
    pub(crate) fn volume_binds(
        self,
        workspace: &str,
        has: &[VolumeAttach],
    ) -> Result<Vec<runcell_core::backend::BindMount>, ApiError> {
        has.iter()
            .map(|a| {
                let v = self
                    .0
                    .registry
                    .with_conn(|c| get(c, workspace, &a.name))
                    .map_err(registry_err)?
                    .ok_or_else(|| not_found(&a.name))?;
                Ok(runcell_core::backend::BindMount {
                    source: self.store().mount_point(&v.id),
                    target: a
                        .path
                        .as_deref()
                        .map(PathBuf::from)
                        .unwrap_or_else(|| PathBuf::from(format!("/mnt/{}", a.name))),
                    read_only: a.read_only.unwrap_or(false),
                })
            })
            .collect()
    }

    /// The bind mounts for the volumes a create asks for, checked: each
    /// exists, its path is sane, and no other sandbox has read-write one
    /// this one wants read-write.
    pub(crate) fn volume_mounts(
        self,
        workspace: &str,
        asked: &[VolumeAttach],
    ) -> Result<Vec<runcell_core::backend::BindMount>, ApiError> {
        let mut mounts = Vec::new();
        let mut targets = std::collections::HashSet::new();
        for (i, a) in asked.iter().enumerate() {
            let v = self
                .0
                .registry
                .with_conn(|c| get(c, workspace, &a.name))
                .map_err(registry_err)?
                .ok_or_else(|| {
                    let mut e = not_found(&a.name);
                    e.status = StatusCode::BAD_REQUEST;
                    e.message = format!("volumes[{i}].name: {}", e.message);
                    e
                })?;
            let target = match &a.path {
                Some(p) => check_path(p)
                    .map_err(|m| ApiError::bad_request(format!("volumes[{i}].path: {m}")))?,
                None => PathBuf::from(format!("/mnt/{}", a.name)),
            };
            if !targets.insert(target.clone()) {
                return Err(ApiError::bad_request(format!(
                    "volumes[{i}]: {} is mounted twice.",
                    target.display()
                )));
            }
            let read_only = a.read_only.unwrap_or(false);
            let users = self.attachments(workspace, &a.name);
            // One writer; readers see the same file system beside it.
            if let Some((id, _)) = users.iter().find(|(_, rw)| *rw && !read_only) {
                return Err(ApiError::new(
                    StatusCode::CONFLICT,
                    format!(
                        "Volume {:?} is attached to sandbox {id}; a volume has one writer at a time (read-only attachments are not limited).",
                        a.name
                    ),
                ));
            }
            mounts.push(runcell_core::backend::BindMount {
                source: self.store().mount_point(&v.id),
                target,
                read_only,
            });
        }
        Ok(mounts)
    }
}

/// Volumes as a sandbox view shows them: every field filled in.
pub fn shown(has: &[VolumeAttach]) -> Vec<VolumeAttach> {
    has.iter()
        .map(|a| VolumeAttach {
            name: a.name.clone(),
            read_only: Some(a.read_only.unwrap_or(false)),
            path: Some(a.path.clone().unwrap_or_else(|| format!("/mnt/{}", a.name))),
        })
        .collect()
}

fn not_found(name: &str) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        format!(
            "volume {:?} not found",
            crate::http::kit::clip(name.to_string())
        ),
    )
}

/// An absolute path below `/` with no `.`/`..`, not into /proc, /dev,
/// /sys or /run (the sandbox's own machinery), at most 1024 bytes.
fn check_path(p: &str) -> Result<PathBuf, String> {
    let path = Path::new(p);
    let ok = p.len() <= 1024
        && path.is_absolute()
        && !p.contains('\0')
        && path.components().all(|c| {
            matches!(
                c,
                std::path::Component::RootDir | std::path::Component::Normal(_)
            )
        })
        && path.components().count() >= 2;
    let reserved = ["/proc", "/dev", "/sys", "/run", "/etc"]
        .iter()
        .any(|r| path.starts_with(r));
    if ok && !reserved && path != Path::new("/tmp") {
        Ok(path.to_path_buf())
    } else {
        Err(format!(
            "{:?} is not a mount path (absolute, below /, without '.' or '..', not in /proc, /dev, /sys, /run or /etc).",
            crate::http::kit::clip(p.to_string())
        ))
    }
}

/// Mounts every volume at start, and removes files no volume record names.
pub fn mount_all(state: &AppState) {
    let store = Store::new(&state.config.data_dir);
    let vols = state
        .registry
        .with_conn(|c| list(c, None))
        .unwrap_or_default();
    for v in &vols {
        if let Err(e) = store.mount(&v.id) {
            tracing::error!(volume = %v.name, workspace = %v.workspace, "could not mount a volume: {e}");
        }
    }
    let known: std::collections::HashSet<&str> = vols.iter().map(|v| v.id.as_str()).collect();
    for entry in std::fs::read_dir(&store.dir)
        .into_iter()
        .flatten()
        .flatten()
    {
        let name = entry.file_name().to_string_lossy().into_owned();
        let id = name.trim_end_matches(".img").trim_end_matches(".mnt");
        if !known.contains(id) {
            tracing::info!(volume = %id, "removing what a half-made volume left");
            let _ = store.remove(id);
        }
    }
}
