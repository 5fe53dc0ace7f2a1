//! The layer store: `<templates>/.layers/<key>/diff` holds one layer's
//! files (an overlay upper directory), `layer.json` what made it. Layers are
//! written once, under a temporary name, and renamed into place when
//! complete; they are never written again (sandboxes only ever see them as
//! read-only overlay lower layers).
//!
//! Also here: host-side file work on layers (the debootstrap ownership
//! shift, `COPY`, `WORKDIR` directories) and lookups in a stack of layers as
//! overlayfs would resolve them.

use std::collections::HashSet;
use std::fs::{self, File};
use std::io;
use std::os::unix::ffi::OsStringExt;
use std::os::unix::fs::{lchown, symlink, FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::template::{layer_path, LAYERS_DIR};

/// Errors of the layer store and of host-side layer work.
#[derive(Debug, thiserror::Error)]
pub enum LayerError {
    /// A file operation failed.
    #[error("Could not {what}.")]
    Io {
        /// What was being done.
        what: String,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// A path of the image goes through a symbolic link.
    #[error(
        "/{0} is a symbolic link in the image; give the real directory (e.g. /usr/bin, not /bin)."
    )]
    ThroughSymlink(String),
    /// A path that must be a directory is something else.
    #[error("/{0} exists in the image and is not a directory.")]
    NotADirectory(String),
    /// A COPY source outside the build context.
    #[error("COPY source \"{0}\" is outside the build context.")]
    OutsideContext(String),
    /// A COPY source that does not exist.
    #[error("COPY source \"{0}\" does not exist in the build context.")]
    SourceMissing(String, #[source] io::Error),
    /// A COPY source that is neither a file, a directory nor a link.
    #[error("COPY source {0} is not a regular file, directory or symbolic link.")]
    SpecialFile(PathBuf),
}

fn io_err(what: impl Into<String>) -> impl FnOnce(io::Error) -> LayerError {
    let what = what.into();
    move |source| LayerError::Io { what, source }
}

/// The cache key of a step: SHA-256 over the parent step's key, the
/// instruction text and anything else its result depends on (the hash of
/// copied files), in hex.
pub fn step_key(parent: &str, text: &str, extra: &str) -> String {
    let mut h = Sha256::new();
    for part in ["runcell-layer-v1", parent, text, extra] {
        h.update((part.len() as u64).to_be_bytes());
        h.update(part.as_bytes());
    }
    hex(&h.finalize())
}

/// The key of a `FROM debian:<suite>` base layer.
pub fn debian_key(suite: &str, mirror: &str) -> String {
    step_key(
        "",
        &format!("FROM debian:{suite}"),
        &format!("debootstrap --variant=minbase {suite} {mirror}"),
    )
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// What `layer.json` records.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LayerInfo {
    /// The instruction that made it.
    pub step: String,
    /// Disk use of `diff`, bytes.
    pub size_bytes: u64,
    /// When it was made, unix seconds.
    pub created_unix: u64,
}

/// Unix seconds now.
pub fn now_unix() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// The layers of one templates directory.
#[derive(Debug, Clone)]
pub struct Store {
    templates: PathBuf,
    /// Host uid/gid of root inside sandboxes.
    pub base: u32,
    /// Ids mapped into sandboxes.
    pub count: u32,
}

/// A layer being made: `<templates>/.layers/.tmp-<uuid>/{diff,work}`,
/// removed when dropped uncommitted.
#[derive(Debug)]
pub struct Pending {
    /// The directory holding `diff` and `work`.
    pub dir: PathBuf,
    armed: bool,
}

impl Pending {
    /// Where the layer's files go.
    pub fn diff(&self) -> PathBuf {
        self.dir.join("diff")
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        // A killed debootstrap leaves its /proc and /sys mounts behind:
        // never delete through a mount.
        match detach_mounts_under(&self.dir) {
            Ok(()) => {
                let _ = fs::remove_dir_all(&self.dir);
            }
            Err(e) => tracing::warn!(
                dir = %self.dir.display(),
                "leaving an unfinished layer in place: {e}"
            ),
        }
    }
}

/// Mount points at or below `dir` in this mount namespace.
fn mounts_under(dir: &Path) -> Vec<PathBuf> {
    let dir = dir.canonicalize().unwrap_or_else(|_| dir.to_path_buf());
    let Ok(info) = fs::read_to_string("/proc/self/mountinfo") else {
        return Vec::new();
    };
    let unescape = |s: &str| {
        let mut out = Vec::new();
        let b = s.as_bytes();
        let mut i = 0;
        while i < b.len() {
            if b[i] == b'\\' && i + 3 < b.len() {
                if let Ok(v) = u8::from_str_radix(&s[i + 1..i + 4], 8) {
                    out.push(v);
                    i += 4;
                    continue;
                }
            }
            out.push(b[i]);
            i += 1;
        }
        PathBuf::from(std::ffi::OsString::from_vec(out))
    };
    info.lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(unescape)
        .filter(|m| m.starts_with(&dir))
        .collect()
}

/// Detaches every mount at or below `dir` (deepest first); fails if any
/// is left.
pub fn detach_mounts_under(dir: &Path) -> Result<(), LayerError> {
    let mut mounts = mounts_under(dir);
    if mounts.is_empty() {
        return Ok(());
    }
    mounts.sort_by_key(|m| std::cmp::Reverse(m.as_os_str().len()));
    for m in &mounts {
        let _ = nix::mount::umount2(m, nix::mount::MntFlags::MNT_DETACH);
    }
    match mounts_under(dir).first() {
        None => Ok(()),
        Some(m) => Err(LayerError::Io {
            what: format!("detach the mount {} left in the layer", m.display()),
            source: io::Error::from(io::ErrorKind::ResourceBusy),
        }),
    }
}

impl Store {
    /// Opens (creating) the store under `templates`.
    pub fn open(templates: &Path, base: u32, count: u32) -> Result<Store, LayerError> {
        let layers = templates.join(LAYERS_DIR);
        fs::create_dir_all(&layers).map_err(io_err(format!("create {}", layers.display())))?;
        // Sandbox agents (an unprivileged host uid) traverse these to their layers.
        for d in [templates, layers.as_path()] {
            fs::set_permissions(d, fs::Permissions::from_mode(0o755))
                .map_err(io_err(format!("set the mode of {}", d.display())))?;
        }
        Ok(Store {
            templates: templates.to_path_buf(),
            base,
            count,
        })
    }

    /// The templates directory.
    pub fn templates_dir(&self) -> &Path {
        &self.templates
    }

    /// The files of layer `key`.
    pub fn path(&self, key: &str) -> PathBuf {
        layer_path(&self.templates, key)
    }

    /// Whether layer `key` is complete.
    pub fn exists(&self, key: &str) -> bool {
        self.path(key).is_dir()
    }

    /// Takes the store's lock: shared for builds, exclusive for removal and
    /// garbage collection (so no build loses a layer it just made).
    pub fn lock(&self, exclusive: bool) -> Result<nix::fcntl::Flock<File>, LayerError> {
        let path = self.templates.join(LAYERS_DIR).join(".lock");
        let file = File::options()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .map_err(io_err(format!("open {}", path.display())))?;
        let arg = if exclusive {
            nix::fcntl::FlockArg::LockExclusive
        } else {
            nix::fcntl::FlockArg::LockShared
        };
        nix::fcntl::Flock::lock(file, arg)
            .map_err(|(_, e)| io_err(format!("lock {}", path.display()))(e.into()))
    }

    /// Starts a layer. With `for_sandbox`, `diff` and `work` are owned by
    /// root of the sandbox, which writes them through its overlay; without,
    /// only `diff` is made, by the caller, on the host.
    pub fn begin(&self, for_sandbox: bool) -> Result<Pending, LayerError> {
        let dir = self
            .templates
            .join(LAYERS_DIR)
            .join(format!(".tmp-{}", uuid::Uuid::new_v4()));
        let pending = Pending { dir, armed: true };
        if for_sandbox {
            for d in [
                pending.dir.clone(),
                pending.diff(),
                pending.dir.join("work"),
            ] {
                fs::create_dir(&d).map_err(io_err(format!("create {}", d.display())))?;
                lchown(&d, Some(self.base), Some(self.base))
                    .map_err(io_err(format!("change the owner of {}", d.display())))?;
            }
            fs::set_permissions(&pending.dir, fs::Permissions::from_mode(0o700))
                .map_err(io_err(format!("set the mode of {}", pending.dir.display())))?;
            fs::set_permissions(pending.diff(), fs::Permissions::from_mode(0o755))
                .map_err(io_err(format!("set the mode of {}", pending.dir.display())))?;
        } else {
            fs::create_dir(&pending.dir)
                .map_err(io_err(format!("create {}", pending.dir.display())))?;
            fs::set_permissions(&pending.dir, fs::Permissions::from_mode(0o700))
                .map_err(io_err(format!("set the mode of {}", pending.dir.display())))?;
        }
        Ok(pending)
    }

    /// Makes a pending layer layer `key`. If another build made the same
    /// layer meanwhile, that one is kept.
    pub fn commit(&self, mut pending: Pending, key: &str, step: &str) -> Result<u64, LayerError> {
        let work = pending.dir.join("work");
        if work.exists() {
            fs::remove_dir_all(&work).map_err(io_err(format!("remove {}", work.display())))?;
        }
        let size = dir_size(&pending.diff());
        let info = LayerInfo {
            step: step.into(),
            size_bytes: size,
            created_unix: now_unix(),
        };
        let info_path = pending.dir.join("layer.json");
        fs::write(
            &info_path,
            serde_json::to_vec_pretty(&info).expect("serializes"),
        )
        .map_err(io_err(format!("write {}", info_path.display())))?;
        fs::set_permissions(&pending.dir, fs::Permissions::from_mode(0o755))
            .map_err(io_err(format!("set the mode of {}", pending.dir.display())))?;
        let target = self.templates.join(LAYERS_DIR).join(key);
        if target.join("diff").is_dir() {
            return Ok(size); // `pending` is removed on drop
        }
        let _ = fs::remove_dir_all(&target);
        fs::rename(&pending.dir, &target).map_err(io_err(format!(
            "move the new layer to {}",
            target.display()
        )))?;
        pending.armed = false;
        Ok(size)
    }

    /// Disk use recorded for layer `key`.
    pub fn size(&self, key: &str) -> u64 {
        fs::read(self.templates.join(LAYERS_DIR).join(key).join("layer.json"))
            .ok()
            .and_then(|raw| serde_json::from_slice::<LayerInfo>(&raw).ok())
            .map(|i| i.size_bytes)
            .unwrap_or(0)
    }

    /// Removes every layer not in `keep`, and unfinished layers. Call with
    /// the exclusive lock held. Returns (layers removed, bytes freed).
    pub fn gc(&self, keep: &HashSet<String>) -> Result<(usize, u64), LayerError> {
        let dir = self.templates.join(LAYERS_DIR);
        let mut removed = (0, 0);
        let entries = fs::read_dir(&dir).map_err(io_err(format!("list {}", dir.display())))?;
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if name == ".lock" || keep.contains(&name) || !entry.path().is_dir() {
                continue;
            }
            let size = if name.starts_with('.') {
                0
            } else {
                self.size(&name)
            };
            fs::remove_dir_all(entry.path())
                .map_err(io_err(format!("remove {}", entry.path().display())))?;
            if !name.starts_with('.') {
                removed.0 += 1;
                removed.1 += size;
            }
        }
        Ok(removed)
    }
}

/// Disk use of a tree (allocated blocks), not following symlinks.
pub fn dir_size(path: &Path) -> u64 {
    let mut total = 0;
    let _ = walk(path, &mut |_, m| {
        total += m.blocks() * 512;
        Ok(())
    });
    total
}

/// Visits `path` and everything below it, parents before children, in name
/// order, never following symlinks.
fn walk(path: &Path, f: &mut dyn FnMut(&Path, &fs::Metadata) -> io::Result<()>) -> io::Result<()> {
    let meta = fs::symlink_metadata(path)?;
    f(path, &meta)?;
    if meta.is_dir() {
        let mut names: Vec<_> = fs::read_dir(path)?
            .map(|e| e.map(|e| e.file_name()))
            .collect::<io::Result<_>>()?;
        names.sort();
        for name in names {
            walk(&path.join(name), f)?;
        }
    }
    Ok(())
}

fn is_whiteout(m: &fs::Metadata) -> bool {
    m.file_type().is_char_device() && m.rdev() == 0
}

/// Normalizes an absolute image path (`.` and `..` resolved lexically, `..`
/// stopping at `/`) into a path relative to the root.
pub fn image_rel(path: &str) -> PathBuf {
    let mut out = PathBuf::new();
    for c in Path::new(path).components() {
        match c {
            Component::Normal(n) => out.push(n),
            Component::ParentDir => {
                out.pop();
            }
            _ => {}
        }
    }
    out
}

/// Finds `rel` in a stack of layers (topmost first) as overlayfs resolves
/// it: the topmost layer that has it wins, a whiteout hides it, a file hides
/// a lower directory. Returns the host path of the winning entry. Opaque
/// directories are not considered (their lower contents may be reported).
pub fn lookup(stack: &[PathBuf], rel: &Path) -> Result<Option<PathBuf>, LayerError> {
    let comps: Vec<&std::ffi::OsStr> = rel
        .components()
        .filter_map(|c| match c {
            Component::Normal(n) => Some(n),
            _ => None,
        })
        .collect();
    'layers: for layer in stack {
        let mut cur = layer.clone();
        for (i, c) in comps.iter().enumerate() {
            cur.push(c);
            let m = match fs::symlink_metadata(&cur) {
                Ok(m) => m,
                Err(_) => continue 'layers,
            };
            if is_whiteout(&m) {
                return Ok(None);
            }
            let last = i + 1 == comps.len();
            if last {
                return Ok(Some(cur));
            }
            if m.file_type().is_symlink() {
                let shown: PathBuf = comps[..=i].iter().collect();
                return Err(LayerError::ThroughSymlink(shown.display().to_string()));
            }
            if !m.is_dir() {
                return Ok(None);
            }
        }
        if comps.is_empty() {
            return Ok(Some(cur));
        }
    }
    Ok(None)
}

/// Reads a text file of the image (e.g. `etc/passwd`).
pub fn read_image_file(stack: &[PathBuf], rel: &str) -> Option<String> {
    let path = lookup(stack, Path::new(rel)).ok()??;
    if !fs::symlink_metadata(&path).ok()?.is_file() {
        return None;
    }
    fs::read_to_string(path).ok()
}

/// Creates directory `rel` and its parents in the layer `diff`, each with
/// the mode and owner it has in the image below (`stack`), or 0755 owned by
/// root of the sandbox when the image lacks it. Without that, the new
/// layer's directory would replace the image's mode (e.g. /tmp's 1777).
pub fn make_dirs_like_image(
    diff: &Path,
    stack: &[PathBuf],
    rel: &Path,
    root_id: u32,
) -> Result<(), LayerError> {
    let mut cur = PathBuf::new();
    for c in rel.components() {
        cur.push(c);
        let target = diff.join(&cur);
        if fs::symlink_metadata(&target).is_ok_and(|m| m.is_dir()) {
            continue;
        }
        let (mode, uid, gid) = match lookup(stack, &cur)? {
            Some(p) => {
                let m =
                    fs::symlink_metadata(&p).map_err(io_err(format!("inspect {}", p.display())))?;
                if m.file_type().is_symlink() {
                    return Err(LayerError::ThroughSymlink(cur.display().to_string()));
                }
                if !m.is_dir() {
                    return Err(LayerError::NotADirectory(cur.display().to_string()));
                }
                (m.mode() & 0o7777, m.uid(), m.gid())
            }
            None => (0o755, root_id, root_id),
        };
        fs::create_dir(&target).map_err(io_err(format!("create {}", target.display())))?;
        lchown(&target, Some(uid), Some(gid))
            .map_err(io_err(format!("change the owner of {}", target.display())))?;
        fs::set_permissions(&target, fs::Permissions::from_mode(mode))
            .map_err(io_err(format!("set the mode of {}", target.display())))?;
    }
    Ok(())
}

/// Resolves COPY sources in the context; each must stay inside it.
pub fn resolve_sources(context: &Path, sources: &[String]) -> Result<Vec<PathBuf>, LayerError> {
    let ctx = context.canonicalize().map_err(io_err(format!(
        "open the build context {}",
        context.display()
    )))?;
    sources
        .iter()
        .map(|s| {
            let joined = ctx.join(s.trim_start_matches('/'));
            let real = joined
                .canonicalize()
                .map_err(|e| LayerError::SourceMissing(s.clone(), e))?;
            if !real.starts_with(&ctx) {
                return Err(LayerError::OutsideContext(s.clone()));
            }
            Ok(real)
        })
        .collect()
}

/// SHA-256 over the COPY sources: names, kinds, modes, contents, link targets.
pub fn content_hash(sources: &[PathBuf]) -> Result<String, LayerError> {
    let mut h = Sha256::new();
    for src in sources {
        walk(src, &mut |p, m| {
            let rel = p.strip_prefix(src).unwrap_or(p);
            h.update(rel.as_os_str().as_encoded_bytes());
            h.update([0]);
            h.update((m.mode() & 0o170777).to_be_bytes());
            if m.is_file() {
                let mut f = File::open(p)?;
                h.update(m.len().to_be_bytes());
                io::copy(&mut f, &mut h)?;
            } else if m.file_type().is_symlink() {
                h.update(fs::read_link(p)?.as_os_str().as_encoded_bytes());
            }
            h.update([0]);
            Ok(())
        })
        .map_err(io_err(format!("read {}", src.display())))?;
        h.update([1]);
    }
    Ok(hex(&h.finalize()))
}

/// COPY into a new layer: `sources` (resolved) to `dest` (an absolute image
/// path; a directory when it ends in `/`, when there are several sources or
/// when a source is a directory, whose contents are copied). Everything
/// copied belongs to root of the sandbox and keeps its mode.
pub fn copy_into_layer(
    diff: &Path,
    stack: &[PathBuf],
    sources: &[PathBuf],
    dest: &str,
    root_id: u32,
) -> Result<(), LayerError> {
    let rel = image_rel(dest);
    let into_dir = dest.ends_with('/') || sources.len() > 1 || sources.iter().any(|s| s.is_dir());
    if into_dir {
        make_dirs_like_image(diff, stack, &rel, root_id)?;
    } else if let Some(parent) = rel.parent() {
        make_dirs_like_image(diff, stack, parent, root_id)?;
    }
    for src in sources {
        let target = match (into_dir, src.is_dir()) {
            (true, true) | (false, _) => diff.join(&rel),
            (true, false) => diff.join(&rel).join(src.file_name().unwrap_or_default()),
        };
        walk(src, &mut |p, m| {
            let sub = p.strip_prefix(src).unwrap_or(Path::new(""));
            let to = if sub.as_os_str().is_empty() {
                target.clone()
            } else {
                target.join(sub)
            };
            let ft = m.file_type();
            if ft.is_dir() {
                if !fs::symlink_metadata(&to).is_ok_and(|t| t.is_dir()) {
                    let _ = fs::remove_file(&to);
                    fs::create_dir(&to)?;
                }
            } else if ft.is_symlink() {
                let _ = fs::remove_file(&to);
                symlink(fs::read_link(p)?, &to)?;
            } else if ft.is_file() {
                let _ = fs::remove_file(&to);
                fs::copy(p, &to)?;
            } else {
                return Err(io::Error::other(format!(
                    "{} is not a regular file, directory or symbolic link",
                    p.display()
                )));
            }
            lchown(&to, Some(root_id), Some(root_id))?;
            if !ft.is_symlink() {
                fs::set_permissions(&to, fs::Permissions::from_mode(m.mode() & 0o7777))?;
            }
            Ok(())
        })
        .map_err(io_err(format!("copy {} into the layer", src.display())))?;
    }
    Ok(())
}

/// Prepares a debootstrapped tree for sandboxes: removes device nodes
/// (`/dev` is provided by the sandbox), replaces the host's resolver
/// configuration debootstrap copied in, adds the standard sandbox user
/// (`user`, uid/gid 1000, home /home/user) and a `policy-rc.d` that keeps
/// package scripts from starting services, then shifts every owner into the
/// sandbox id range (uid + `base`), keeping setuid/setgid bits.
pub fn prepare_debootstrap(root: &Path, base: u32, count: u32) -> Result<(), LayerError> {
    // debootstrap mounts /proc and /sys in the target while it works; the
    // walk below must never reach the host's through a leftover mount.
    detach_mounts_under(root)?;
    let dev = root.join("dev");
    if dev.exists() {
        fs::remove_dir_all(&dev).map_err(io_err("remove the image's /dev"))?;
    }
    fs::create_dir(&dev).map_err(io_err("create the image's /dev"))?;
    let mut specials = Vec::new();
    walk(root, &mut |p, m| {
        let ft = m.file_type();
        if ft.is_char_device() || ft.is_block_device() {
            specials.push(p.to_path_buf());
        }
        Ok(())
    })
    .map_err(io_err(format!("scan {}", root.display())))?;
    for p in specials {
        fs::remove_file(&p).map_err(io_err(format!("remove the device node {}", p.display())))?;
    }
    let etc = root.join("etc");
    for (name, content) in [
        ("resolv.conf", "# runcell: replaced when a sandbox starts\n"),
        ("hosts", "127.0.0.1\tlocalhost\n"),
        ("hostname", "runcell\n"),
    ] {
        let p = etc.join(name);
        let _ = fs::remove_file(&p);
        fs::write(&p, content).map_err(io_err(format!("write {}", p.display())))?;
    }
    let policy = root.join("usr/sbin/policy-rc.d");
    fs::write(
        &policy,
        "#!/bin/sh\n# runcell: no services start while a template is built\nexit 101\n",
    )
    .map_err(io_err(format!("write {}", policy.display())))?;
    fs::set_permissions(&policy, fs::Permissions::from_mode(0o755))
        .map_err(io_err(format!("set the mode of {}", policy.display())))?;
    add_sandbox_user(root)?;

    walk(root, &mut |p, m| {
        let shift = |id: u32| {
            if id < count {
                base + id
            } else {
                base + 65534
            }
        };
        lchown(p, Some(shift(m.uid())), Some(shift(m.gid())))?;
        if !m.file_type().is_symlink() && m.mode() & 0o6000 != 0 {
            fs::set_permissions(p, fs::Permissions::from_mode(m.mode() & 0o7777))?;
        }
        Ok(())
    })
    .map_err(io_err(format!(
        "move the ownership of {} into the sandbox id range",
        root.display()
    )))
}

fn add_sandbox_user(root: &Path) -> Result<(), LayerError> {
    let append = |rel: &str, line: &str, present: &dyn Fn(&str) -> bool| {
        let p = root.join(rel);
        let Ok(text) = fs::read_to_string(&p) else {
            return Ok(());
        };
        if text.lines().any(present) {
            return Ok(());
        }
        let mut out = text;
        if !out.is_empty() && !out.ends_with('\n') {
            out.push('\n');
        }
        out.push_str(line);
        fs::write(&p, out).map_err(io_err(format!("write {}", p.display())))
    };
    let named = |l: &str| l.split(':').next() == Some("user");
    append(
        "etc/passwd",
        "user:x:1000:1000:user:/home/user:/bin/bash\n",
        &|l| named(l) || l.split(':').nth(2) == Some("1000"),
    )?;
    append("etc/group", "user:x:1000:\n", &|l| {
        named(l) || l.split(':').nth(2) == Some("1000")
    })?;
    append("etc/shadow", "user:*:19000:0:99999:7:::\n", &named)?;
    append("etc/gshadow", "user:!::\n", &named)?;
    let home = root.join("home/user");
    fs::create_dir_all(&home).map_err(io_err("create /home/user"))?;
    lchown(&home, Some(1000), Some(1000)).map_err(io_err("give /home/user to the user"))?;
    fs::set_permissions(&home, fs::Permissions::from_mode(0o755))
        .map_err(io_err("set the mode of /home/user"))
}

/// A user of the image: (name, uid, gid, home) from its `/etc/passwd`,
/// found by name or uid.
pub fn passwd_entry(passwd: &str, user: &str) -> Option<(String, u32, u32, String)> {
    passwd.lines().find_map(|l| {
        let f: Vec<&str> = l.split(':').collect();
        if f.len() < 7 || (f[0] != user && f[2] != user) {
            return None;
        }
        Some((
            f[0].to_string(),
            f[2].parse().ok()?,
            f[3].parse().ok()?,
            f[5].to_string(),
        ))
    })
}

/// A group's gid from the image's `/etc/group`, by name or gid.
pub fn group_gid(group: &str, wanted: &str) -> Option<u32> {
    group.lines().find_map(|l| {
        let f: Vec<&str> = l.split(':').collect();
        if f.len() >= 3 && (f[0] == wanted || f[2] == wanted) {
            f[2].parse().ok()
        } else {
            None
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_chain_and_depend_on_every_part() {
        let a = step_key("p", "RUN echo hi", "");
        assert_eq!(a.len(), 64);
        assert_eq!(a, step_key("p", "RUN echo hi", ""));
        assert_ne!(a, step_key("q", "RUN echo hi", ""));
        assert_ne!(a, step_key("p", "RUN echo ho", ""));
        assert_ne!(a, step_key("p", "RUN echo hi", "x"));
        // Parts are length-prefixed: moving text between them changes the key.
        assert_ne!(step_key("ab", "c", ""), step_key("a", "bc", ""));
        assert_ne!(
            debian_key("bookworm", "http://deb.debian.org/debian"),
            debian_key("trixie", "http://deb.debian.org/debian")
        );
    }

    #[test]
    fn content_hash_sees_content_modes_and_names() {
        let tmp = tempfile::tempdir().unwrap();
        let f = tmp.path().join("a.txt");
        fs::write(&f, "one").unwrap();
        let h1 = content_hash(std::slice::from_ref(&f)).unwrap();
        assert_eq!(h1, content_hash(std::slice::from_ref(&f)).unwrap());
        fs::write(&f, "two").unwrap();
        let h2 = content_hash(std::slice::from_ref(&f)).unwrap();
        assert_ne!(h1, h2);
        fs::set_permissions(&f, fs::Permissions::from_mode(0o755)).unwrap();
        assert_ne!(h2, content_hash(std::slice::from_ref(&f)).unwrap());
    }

    #[test]
    fn sources_must_stay_in_the_context() {
        let tmp = tempfile::tempdir().unwrap();
        let ctx = tmp.path().join("ctx");
        fs::create_dir(&ctx).unwrap();
        fs::write(ctx.join("in.txt"), "x").unwrap();
        fs::write(tmp.path().join("secret"), "x").unwrap();
        symlink("../secret", ctx.join("link")).unwrap();
        assert!(resolve_sources(&ctx, &["in.txt".into()]).is_ok());
        for bad in ["../secret", "link"] {
            let err = resolve_sources(&ctx, &[bad.into()]).unwrap_err();
            assert!(matches!(err, LayerError::OutsideContext(_)), "{bad}: {err}");
        }
        assert!(matches!(
            resolve_sources(&ctx, &["nope".into()]).unwrap_err(),
            LayerError::SourceMissing(..)
        ));
    }

    #[test]
    fn lookup_follows_overlay_rules_and_copy_keeps_image_modes() {
        let tmp = tempfile::tempdir().unwrap();
        let (low, high) = (tmp.path().join("low"), tmp.path().join("high"));
        fs::create_dir_all(low.join("tmp")).unwrap();
        fs::set_permissions(low.join("tmp"), fs::Permissions::from_mode(0o1777)).unwrap();
        fs::create_dir_all(low.join("etc")).unwrap();
        fs::write(low.join("etc/passwd"), "root:x:0:0:root:/root:/bin/sh\n").unwrap();
        fs::write(low.join("etc/gone"), "x").unwrap();
        symlink("usr/bin", low.join("bin")).unwrap();
        fs::create_dir_all(high.join("etc")).unwrap();
        fs::write(high.join("etc/passwd"), "root:x:0:0:root:/root:/bin/bash\n").unwrap();
        let stack = vec![high.clone(), low.clone()];
        assert_eq!(
            lookup(&stack, Path::new("etc/passwd")).unwrap(),
            Some(high.join("etc/passwd"))
        );
        assert_eq!(
            read_image_file(&stack, "etc/passwd").unwrap(),
            "root:x:0:0:root:/root:/bin/bash\n"
        );
        assert!(matches!(
            lookup(&stack, Path::new("bin/sh")),
            Err(LayerError::ThroughSymlink(_))
        ));

        let ctx = tmp.path().join("ctx");
        fs::create_dir(&ctx).unwrap();
        fs::write(ctx.join("f"), "data").unwrap();
        let diff = tmp.path().join("diff");
        fs::create_dir(&diff).unwrap();
        let uid = nix_uid();
        copy_into_layer(&diff, &stack, &[ctx.join("f")], "/tmp/sub/", uid).unwrap();
        assert_eq!(fs::read_to_string(diff.join("tmp/sub/f")).unwrap(), "data");
        let mode = fs::metadata(diff.join("tmp")).unwrap().mode() & 0o7777;
        assert_eq!(mode, 0o1777, "the layer's /tmp keeps the image's mode");
        assert!(copy_into_layer(&diff, &stack, &[ctx.join("f")], "/bin/f", uid).is_err());
    }

    fn nix_uid() -> u32 {
        fs::metadata("/proc/self").map(|m| m.uid()).unwrap_or(0)
    }

    #[test]
    fn finds_mounts_below_a_directory() {
        assert!(mounts_under(Path::new("/")).contains(&PathBuf::from("/")));
        let tmp = tempfile::tempdir().unwrap();
        assert!(mounts_under(tmp.path()).is_empty());
        assert!(detach_mounts_under(tmp.path()).is_ok());
    }

    #[test]
    fn users_and_groups_by_name_or_id() {
        let passwd = "root:x:0:0:root:/root:/bin/bash\ntester:x:1001:1002::/home/tester:/bin/sh\n";
        assert_eq!(
            passwd_entry(passwd, "tester"),
            Some(("tester".into(), 1001, 1002, "/home/tester".into()))
        );
        assert_eq!(passwd_entry(passwd, "1001").unwrap().0, "tester");
        assert!(passwd_entry(passwd, "nobody").is_none());
        assert_eq!(group_gid("staff:x:50:\n", "staff"), Some(50));
        assert_eq!(group_gid("staff:x:50:\n", "50"), Some(50));
    }
}
