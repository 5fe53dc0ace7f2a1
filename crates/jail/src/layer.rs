//! State layers: what a sandbox wrote, copied out of its writable layer so
//! another sandbox (a fork, a snapshot's, a woken one) starts with it.
//!
//! A state layer is a directory: `root/` holds what was written to the
//! root (an overlay upper layer: whiteouts and opaque directories
//! included), and, for the `host` template, `upper/<key>/` what was
//! written over each host path ([`crate::inside::host_path_key`]). The
//! agent lays them between the template and its fresh writable layer
//! ([`crate::InitSpec::state_layers`]).

use std::fs;
use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use crate::inside::STATE_ROOT;
use crate::STAGE_FD;

/// Errors copying a sandbox's writable layer.
#[derive(Debug, thiserror::Error)]
pub enum LayerError {
    /// The destination exists already.
    #[error("The layer directory {0} exists already.")]
    Exists(PathBuf),
    /// The sandbox's writable layer cannot be reached (its agent is gone).
    #[error("The sandbox's writable layer cannot be reached: is it running?")]
    Unreachable(#[source] io::Error),
    /// A file operation failed.
    #[error("Could not write the layer at {path}.")]
    Io {
        /// The path involved.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// `cp` failed.
    #[error("Copying {what} failed: {stderr}")]
    Copy {
        /// What was copied.
        what: String,
        /// What cp said.
        stderr: String,
    },
}

/// Copies the writable layer of the sandbox whose agent is `pid` into
/// `dest` (which must not exist). The sandbox must be frozen. Returns the
/// bytes the copy takes on disk.
pub fn export(pid: i32, dest: &Path) -> Result<u64, LayerError> {
    let stage = PathBuf::from(format!("/proc/{pid}/fd/{STAGE_FD}"));
    fs::metadata(&stage).map_err(LayerError::Unreachable)?;
    if fs::symlink_metadata(dest).is_ok() {
        return Err(LayerError::Exists(dest.to_path_buf()));
    }
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| LayerError::Io { path, source }
    };
    fs::create_dir_all(dest).map_err(io(dest))?;
    let upper = stage.join("upper");
    let overlaid = upper.join(STATE_ROOT);
    if overlaid.is_dir() {
        copy(&overlaid, &dest.join(STATE_ROOT), false)?;
    } else {
        // The `host` template's root is the stage's own directory, with
        // host paths, /proc, /dev and the egress socket mounted on it:
        // those are other file systems, and not the sandbox's.
        copy(&stage.join(STATE_ROOT), &dest.join(STATE_ROOT), true)?;
    }
    for entry in fs::read_dir(&upper).map_err(LayerError::Unreachable)? {
        let entry = entry.map_err(LayerError::Unreachable)?;
        let name = entry.file_name();
        if name == STATE_ROOT {
            continue;
        }
        let to = dest.join("upper").join(&name);
        fs::create_dir_all(dest.join("upper")).map_err(io(dest))?;
        copy(&entry.path(), &to, false)?;
    }
    Ok(disk_usage(dest))
}

/// `cp -a` (no symlink followed, owners, modes, xattrs, device nodes and
/// hard links kept) of the directory `src` as `dst`.
fn copy(src: &Path, dst: &Path, one_file_system: bool) -> Result<(), LayerError> {
    let mut cmd = crate::host_tools::command("cp");
    cmd.arg("-a");
    if one_file_system {
        cmd.arg("--one-file-system");
    }
    let out = cmd
        .arg("--")
        .arg(src)
        .arg(dst)
        .output()
        .map_err(|e| LayerError::Copy {
            what: src.display().to_string(),
            stderr: e.to_string(),
        })?;
    if out.status.success() {
        Ok(())
    } else {
        Err(LayerError::Copy {
            what: src.display().to_string(),
            stderr: String::from_utf8_lossy(&out.stderr)
                .chars()
                .take(4096)
                .collect(),
        })
    }
}

/// Bytes a directory tree takes on disk (allocated blocks; hard links once).
pub fn disk_usage(dir: &Path) -> u64 {
    let mut seen = std::collections::HashSet::new();
    let mut total = 0u64;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(meta) = fs::symlink_metadata(&d) else {
            continue;
        };
        if meta.nlink() > 1 && !meta.is_dir() && !seen.insert((meta.dev(), meta.ino())) {
            continue;
        }
        total = total.saturating_add(meta.blocks().saturating_mul(512));
        if meta.is_dir() {
            if let Ok(rd) = fs::read_dir(&d) {
                stack.extend(rd.flatten().map(|e| e.path()));
            }
        }
    }
    total
}
