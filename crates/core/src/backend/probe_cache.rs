//! Answers of slow host probes (booting a test guest under KVM, a trial
//! `runsc do true`) kept for the rest of the boot in `/run/runcell`, so a
//! daemon start or a one-shot `runcell run` does not pay for them again.
//!
//! An answer is used only while the machine's boot id and every input
//! file's size and modification time are those it was made with; `/run`
//! is emptied at boot. Only root keeps answers. Deleting the file makes
//! the next start probe again.

use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

/// Where answers are kept.
pub const CACHE_DIR: &str = "/run/runcell";

/// One kept answer and what it was made with.
#[derive(Debug, Serialize, Deserialize)]
struct Kept<T> {
    key: Key,
    result: Result<T, String>,
}

/// What a kept answer must match to be used.
#[derive(Debug, PartialEq, Eq, Serialize, Deserialize)]
struct Key {
    /// `/proc/sys/kernel/random/boot_id`.
    boot_id: String,
    /// Each input file: its path, size and modification time.
    inputs: Vec<(PathBuf, u64, i64)>,
}

fn key(inputs: &[&Path]) -> Option<Key> {
    let boot_id = fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
    let inputs = inputs
        .iter()
        .map(|p| {
            let m = fs::metadata(p).ok()?;
            Some((p.to_path_buf(), m.len(), m.mtime()))
        })
        .collect::<Option<Vec<_>>>()?;
    Some(Key {
        boot_id: boot_id.trim().to_string(),
        inputs,
    })
}

/// The path answers of probe `name` are kept at.
pub fn path(name: &str) -> PathBuf {
    Path::new(CACHE_DIR).join(format!("probe-{name}.json"))
}

/// The kept answer of probe `name` for these `inputs`, or `probe()`'s,
/// which is kept when `keep` says it is not a passing accident (a probe
/// that timed out under load should run again next time).
pub fn per_boot<T: Serialize + DeserializeOwned>(
    name: &str,
    inputs: &[&Path],
    keep: impl FnOnce(&Result<T, String>) -> bool,
    probe: impl FnOnce() -> Result<T, String>,
) -> Result<T, String> {
    let path = path(name);
    let key = key(inputs);
    if let Some(k) = &key {
        let kept = fs::read(&path)
            .ok()
            .and_then(|b| serde_json::from_slice::<Kept<T>>(&b).ok());
        if let Some(kept) = kept.filter(|kept| &kept.key == k) {
            return kept.result;
        }
    }
    let result = probe();
    if let Some(key) = key.filter(|_| nix::unistd::geteuid().is_root() && keep(&result)) {
        let kept = Kept { key, result };
        let tmp = path.with_extension(format!("{}.tmp", std::process::id()));
        let written = fs::create_dir_all(CACHE_DIR)
            .and_then(|()| fs::write(&tmp, serde_json::to_vec(&kept).unwrap_or_default()))
            .and_then(|()| fs::rename(&tmp, &path));
        if let Err(e) = written {
            let _ = fs::remove_file(&tmp);
            tracing::debug!(probe = name, error = %e, "could not keep a probe's answer");
        }
        return kept.result;
    }
    result
}
