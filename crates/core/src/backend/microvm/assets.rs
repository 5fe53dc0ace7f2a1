//! What a guest boots from: the kernel (fetched by
//! `scripts/microvm-assets.sh`), an initramfs built here at first use (the
//! agent as `/init`, its shared libraries, the modules), and one read-only
//! ext4 image per template, cached by template content.

use std::fs;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::SystemTime;

use sha2::{Digest, Sha256};

use super::{MicrovmError, RootfsSpec};

/// Builds (once) and finds a guest's boot files.
#[derive(Debug, Clone)]
pub struct Assets {
    /// `vmlinuz`, `modules/` (from the assets script).
    pub kernel_dir: PathBuf,
    /// Initramfs and template images.
    pub cache_dir: PathBuf,
}

fn io_err(what: impl Into<String>) -> impl FnOnce(io::Error) -> MicrovmError {
    let what = what.into();
    move |e| MicrovmError::Asset(what, e)
}

fn mtime_ns(p: &Path) -> u128 {
    fs::symlink_metadata(p)
        .and_then(|m| m.modified())
        .ok()
        .and_then(|t| t.duration_since(SystemTime::UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_nanos())
}

fn short_hash(parts: &[String]) -> String {
    let mut h = Sha256::new();
    for p in parts {
        h.update(p.as_bytes());
        h.update([0]);
    }
    h.finalize()
        .iter()
        .take(8)
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Writes `path` by way of a temporary file, so a reader never sees half.
fn publish(tmp: &Path, path: &Path) -> Result<(), MicrovmError> {
    fs::rename(tmp, path).map_err(io_err(format!("publishing {}", path.display())))
}

impl Assets {
    /// The kernel image.
    pub fn kernel(&self) -> PathBuf {
        self.kernel_dir.join("vmlinuz")
    }

    /// Checks that the kernel and its modules are there.
    pub fn check(&self) -> Result<(), MicrovmError> {
        for p in [self.kernel(), self.kernel_dir.join("modules/order")] {
            if !p.is_file() {
                return Err(MicrovmError::NoKernel(p));
            }
        }
        Ok(())
    }

    /// The initramfs for `agent`, built if this agent build has none yet.
    pub fn initramfs(&self, agent: &Path) -> Result<PathBuf, MicrovmError> {
        self.check()?;
        let meta = fs::metadata(agent).map_err(io_err(format!("reading {}", agent.display())))?;
        let key = short_hash(&[
            agent.display().to_string(),
            meta.len().to_string(),
            mtime_ns(agent).to_string(),
            mtime_ns(&self.kernel_dir.join("modules/order")).to_string(),
        ]);
        fs::create_dir_all(&self.cache_dir)
            .map_err(io_err(format!("creating {}", self.cache_dir.display())))?;
        let path = self.cache_dir.join(format!("initramfs-{key}.cpio"));
        if path.is_file() {
            return Ok(path);
        }
        let t0 = std::time::Instant::now();
        let mut cpio = Cpio::default();
        for d in [
            "dev",
            "proc",
            "sys",
            "run",
            "lib",
            "lib64",
            "usr",
            "tmp",
            "lib/modules",
        ] {
            cpio.dir(d);
        }
        cpio.char_dev("dev/console", 0o600, 5, 1);
        cpio.file("init", 0o755, &read(agent)?);
        for lib in shared_libraries(agent)? {
            let rel = lib.strip_prefix("/").unwrap_or(&lib);
            let mut acc = PathBuf::new();
            if let Some(parent) = rel.parent() {
                for c in parent.components() {
                    acc.push(c);
                    cpio.dir(&acc.display().to_string());
                }
            }
            cpio.file(&rel.display().to_string(), 0o755, &read(&lib)?);
        }
        let modules = self.kernel_dir.join("modules");
        let order = fs::read_to_string(modules.join("order"))
            .map_err(io_err(format!("reading {}", modules.display())))?;
        for name in order.lines().map(str::trim).filter(|l| !l.is_empty()) {
            cpio.file(
                &format!("lib/modules/{name}"),
                0o644,
                &read(&modules.join(name))?,
            );
        }
        cpio.file("lib/modules/order", 0o644, order.as_bytes());
        // Unique per builder: threads of one process may build it at once.
        static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let tmp = path.with_extension(format!(
            "tmp{}-{}",
            std::process::id(),
            SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        ));
        fs::write(&tmp, cpio.finish()).map_err(io_err(format!("writing {}", tmp.display())))?;
        publish(&tmp, &path)?;
        // Earlier agents' initramfs files are never booted again (QEMU
        // reads its initrd at launch): one per agent build would pile up.
        if let (Some(dir), Some(name)) = (path.parent(), path.file_name()) {
            for e in fs::read_dir(dir).into_iter().flatten().flatten() {
                let n = e.file_name();
                let n = n.to_string_lossy();
                if n.starts_with("initramfs-")
                    && n.ends_with(".cpio")
                    && *n != *name.to_string_lossy()
                {
                    let _ = fs::remove_file(e.path());
                }
            }
        }
        tracing::info!(
            path = %path.display(),
            ms = runcell_protocol::units::millis(t0.elapsed()),
            "microvm initramfs built"
        );
        Ok(path)
    }

    /// The read-only image of a template's root, built if this template
    /// (name and content) has none yet. What a guest mounts as its lower
    /// layer; the writable layer is its own disk ([`Assets::blank_disk`]).
    pub fn template_image(&self, rootfs: &RootfsSpec) -> Result<PathBuf, MicrovmError> {
        let (key_parts, script) = image_plan(rootfs)?;
        let key = short_hash(&key_parts);
        let dir = self.cache_dir.join("images");
        fs::create_dir_all(&dir).map_err(io_err(format!("creating {}", dir.display())))?;
        let path = dir.join(format!("{key}.ext4"));
        if path.is_file() {
            return Ok(path);
        }
        // One builder at a time per image: others wait on the lock.
        let lock_path = dir.join(format!("{key}.lock"));
        let lock = fs::File::create(&lock_path)
            .map_err(io_err(format!("creating {}", lock_path.display())))?;
        let _guard = nix::fcntl::Flock::lock(lock, nix::fcntl::FlockArg::LockExclusive)
            .map_err(|(_, e)| MicrovmError::Asset("locking the image".into(), e.into()))?;
        if path.is_file() {
            return Ok(path);
        }
        let t0 = std::time::Instant::now();
        let tmp = dir.join(format!("{key}.ext4.tmp"));
        let tree = dir.join(format!("{key}.tree"));
        let _ = fs::remove_file(&tmp);
        let _ = fs::remove_dir_all(&tree);
        fs::create_dir_all(&tree).map_err(io_err(format!("creating {}", tree.display())))?;
        // In a private mount namespace: the bind mounts that assemble the
        // tree vanish with it, whatever happens.
        let full = format!(
            "set -eu\nT={}\nIMG={}\n{script}\n\
             bytes=$(du -sb \"$T\" 2>/dev/null | cut -f1 || true)\n\
             files=$(du -s --inodes \"$T\" 2>/dev/null | cut -f1 || true)\n\
             bytes=${{bytes:-0}}; files=${{files:-0}}\n\
             size=$(( (bytes + bytes / 4 + files * 4096 + (64 << 20)) / 1048576 ))\n\
             inodes=$(( files + files / 4 + 4096 ))\n\
             mkfs.ext4 -q -F -O ^has_journal -N \"$inodes\" -m 0 -L runcell -d \"$T\" \"$IMG\" \"${{size}}M\"\n",
            shell_quote(&tree),
            shell_quote(&tmp),
        );
        let out = runcell_jail::host_tools::command("unshare")
            .args([
                "--mount",
                "--propagation",
                "private",
                "--",
                "sh",
                "-c",
                &full,
            ])
            .output()
            .map_err(|e| MicrovmError::Spawn(PathBuf::from("unshare"), e))?;
        let _ = fs::remove_dir_all(&tree);
        if !out.status.success() {
            let _ = fs::remove_file(&tmp);
            return Err(MicrovmError::ImageBuild(
                String::from_utf8_lossy(&out.stderr).trim().to_string(),
            ));
        }
        publish(&tmp, &path)?;
        tracing::info!(
            path = %path.display(),
            ms = runcell_protocol::units::millis(t0.elapsed()),
            "microvm template image built"
        );
        Ok(path)
    }
}

impl Assets {
    /// An empty ext4 file system of `bytes` (rounded up to MiB, at least
    /// 16 MiB), the base every sandbox's writable disk starts from: built
    /// once per size, with its inode tables written out (the guest then
    /// has nothing to initialise, so a fresh disk's overlay stays small),
    /// and never written again (disks are qcow2 overlays on it).
    pub fn blank_disk(&self, bytes: u64) -> Result<PathBuf, MicrovmError> {
        let mib = bytes.div_ceil(1 << 20).max(16);
        let dir = self.cache_dir.join("disks");
        fs::create_dir_all(&dir).map_err(io_err(format!("creating {}", dir.display())))?;
        let path = dir.join(format!("blank-{mib}M.ext4"));
        if path.is_file() {
            return Ok(path);
        }
        let lock_path = dir.join(format!("blank-{mib}M.lock"));
        let lock = fs::File::create(&lock_path)
            .map_err(io_err(format!("creating {}", lock_path.display())))?;
        let _guard = nix::fcntl::Flock::lock(lock, nix::fcntl::FlockArg::LockExclusive)
            .map_err(|(_, e)| MicrovmError::Asset("locking the blank disk".into(), e.into()))?;
        if path.is_file() {
            return Ok(path);
        }
        let tmp = dir.join(format!("blank-{mib}M.ext4.tmp"));
        let _ = fs::remove_file(&tmp);
        // The file system is made larger than the limit by its own
        // metadata (a journal of 1/64 of it, 1 to 64 MiB; inode tables of
        // 1/64 at one inode per 16 KiB), so what `df` shows the sandbox,
        // and what it can write, is the limit, as with the jail's tmpfs.
        let journal = (mib / 64).clamp(1, 64);
        let size = mib + journal + mib / 64 + 1;
        let out = runcell_jail::host_tools::command("mkfs.ext4")
            .args(["-q", "-F", "-m", "0", "-i", "16384", "-L", "runcell-rw"])
            .arg("-J")
            .arg(format!("size={journal}"))
            .args(["-E", "lazy_itable_init=0,lazy_journal_init=0"])
            .arg(&tmp)
            .arg(format!("{size}M"))
            .output()
            .map_err(|e| MicrovmError::Spawn(PathBuf::from("mkfs.ext4"), e))?;
        if !out.status.success() {
            let _ = fs::remove_file(&tmp);
            return Err(MicrovmError::ImageBuild(
                String::from_utf8_lossy(&out.stderr).trim().to_string(),
            ));
        }
        publish(&tmp, &path)?;
        Ok(path)
    }
}

/// Makes `path` a new, empty qcow2 overlay of `backing` (`raw` or
/// `qcow2`) of `size` bytes, without opening the backing file (a running
/// guest may hold it).
pub fn create_overlay(
    qemu_img: &Path,
    path: &Path,
    backing: &Path,
    backing_format: &str,
    size: u64,
) -> Result<(), MicrovmError> {
    let out = Command::new(qemu_img)
        .args([
            "create",
            "-q",
            "-f",
            "qcow2",
            "-u",
            "-F",
            backing_format,
            "-b",
        ])
        .arg(backing)
        .arg(path)
        .arg(size.to_string())
        .output()
        .map_err(|e| MicrovmError::Spawn(qemu_img.to_path_buf(), e))?;
    if !out.status.success() {
        let _ = fs::remove_file(path);
        return Err(MicrovmError::Vmm(format!(
            "{} could not make {}: {}",
            qemu_img.display(),
            path.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(())
}

/// The virtual size of a qcow2 image, from its header (bytes 24..32, big
/// endian), or of a raw image (its length).
pub fn image_size(path: &Path) -> Result<u64, MicrovmError> {
    use std::io::Read;
    let mut f = fs::File::open(path).map_err(io_err(format!("opening {}", path.display())))?;
    let mut head = [0u8; 32];
    f.read_exact(&mut head)
        .map_err(io_err(format!("reading {}", path.display())))?;
    if &head[..4] == b"QFI\xfb" {
        let mut size = [0u8; 8];
        size.copy_from_slice(&head[24..32]);
        return Ok(u64::from_be_bytes(size));
    }
    f.metadata()
        .map(|m| m.len())
        .map_err(io_err(format!("reading {}", path.display())))
}

fn read(p: &Path) -> Result<Vec<u8>, MicrovmError> {
    fs::read(p).map_err(io_err(format!("reading {}", p.display())))
}

fn shell_quote(p: &Path) -> String {
    format!("'{}'", p.display().to_string().replace('\'', r"'\''"))
}

/// What identifies a template's image, and the shell commands that
/// assemble its tree at `$T`.
fn image_plan(rootfs: &RootfsSpec) -> Result<(Vec<String>, String), MicrovmError> {
    let spec = serde_json::to_string(rootfs).unwrap_or_default();
    let mut key = vec![spec];
    let mut script = String::new();
    match rootfs {
        RootfsSpec::Host { paths, etc } => {
            // The host's packages change what its /usr holds.
            key.push(mtime_ns(Path::new("/var/lib/dpkg/status")).to_string());
            for p in paths {
                key.push(mtime_ns(p).to_string());
                let Ok(meta) = fs::symlink_metadata(p) else {
                    continue;
                };
                let q = shell_quote(p);
                let rel = p.strip_prefix("/").unwrap_or(p);
                let dst = format!("\"$T\"/{}", shell_quote(rel));
                if meta.file_type().is_symlink() {
                    script.push_str(&format!("ln -s \"$(readlink {q})\" {dst}\n"));
                } else if meta.is_dir() {
                    script.push_str(&format!("mkdir -p {dst}\nmount --bind -o ro {q} {dst}\n"));
                }
            }
            script.push_str("mkdir -p \"$T/etc\"\n");
            for name in etc {
                if name.contains("..") || name.contains('/') {
                    continue;
                }
                let src = Path::new("/etc").join(name);
                if fs::symlink_metadata(&src).is_ok() {
                    script.push_str(&format!("cp -a {} \"$T/etc/\"\n", shell_quote(&src)));
                }
            }
        }
        RootfsSpec::Directory { path } => {
            key.push(mtime_ns(path).to_string());
            script.push_str(&format!(
                "mount --bind -o ro {} \"$T\"\n",
                shell_quote(path)
            ));
        }
        RootfsSpec::Layers { lowers, persist } => {
            if persist.is_some() {
                return Err(MicrovmError::Unsupported(
                    "template builds (a persistent writable layer)",
                ));
            }
            for l in lowers {
                key.push(mtime_ns(l).to_string());
            }
            let lowerdir: Vec<String> = lowers.iter().map(|l| l.display().to_string()).collect();
            script.push_str(&format!(
                "mount -t overlay overlay -o ro,lowerdir={} \"$T\"\n",
                shell_quote(Path::new(&lowerdir.join(":")))
            ));
        }
    }
    Ok((key, script))
}

/// The shared libraries `binary` loads, by absolute path, as `ldd` lists them.
fn shared_libraries(binary: &Path) -> Result<Vec<PathBuf>, MicrovmError> {
    let out = runcell_jail::host_tools::command("ldd")
        .arg(binary)
        .output()
        .map_err(|e| MicrovmError::Spawn(PathBuf::from("ldd"), e))?;
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        // A static binary needs nothing.
        return Ok(Vec::new());
    }
    let mut libs = Vec::new();
    for line in text.lines() {
        let path = match line.split_once("=>") {
            Some((_, rest)) => rest.split_whitespace().next(),
            None => line.split_whitespace().next(),
        };
        if let Some(p) = path.filter(|p| p.starts_with('/')) {
            libs.push(PathBuf::from(p));
        }
    }
    Ok(libs)
}

/// A `newc` cpio archive, as the kernel unpacks an initramfs.
#[derive(Debug, Default)]
struct Cpio {
    out: Vec<u8>,
    ino: u32,
    dirs: std::collections::BTreeSet<String>,
}

impl Cpio {
    fn entry(&mut self, name: &str, mode: u32, rdev: (u32, u32), data: &[u8]) {
        self.ino += 1;
        let namesize = name.len() + 1;
        let fields = [
            self.ino,
            mode,
            0,
            0,
            1,
            0,
            u32::try_from(data.len()).unwrap_or(u32::MAX),
            0,
            0,
            rdev.0,
            rdev.1,
            u32::try_from(namesize).unwrap_or(u32::MAX),
            0,
        ];
        let _ = write!(self.out, "070701");
        for f in fields {
            let _ = write!(self.out, "{f:08x}");
        }
        self.out.extend_from_slice(name.as_bytes());
        self.out.push(0);
        self.pad();
        self.out.extend_from_slice(data);
        self.pad();
    }

    fn pad(&mut self) {
        while !self.out.len().is_multiple_of(4) {
            self.out.push(0);
        }
    }

    fn dir(&mut self, name: &str) {
        if self.dirs.insert(name.to_string()) {
            self.entry(name, 0o040_755, (0, 0), &[]);
        }
    }

    fn file(&mut self, name: &str, perm: u32, data: &[u8]) {
        self.entry(name, 0o100_000 | perm, (0, 0), data);
    }

    fn char_dev(&mut self, name: &str, perm: u32, major: u32, minor: u32) {
        self.entry(name, 0o020_000 | perm, (major, minor), &[]);
    }

    fn finish(mut self) -> Vec<u8> {
        self.entry("TRAILER!!!", 0, (0, 0), &[]);
        self.out
    }
}
