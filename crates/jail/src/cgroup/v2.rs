//! cgroup v2: one unified hierarchy.

use std::fs;
use std::path::{Path, PathBuf};

use super::{io_err, read_keyed, read_u64, write, CgroupError, Counters, Kills};
use crate::Limits;

#[derive(Debug, Clone)]
pub(super) struct Group {
    dir: PathBuf,
}

impl Group {
    pub(super) fn open(root: &Path, parent: &str, name: &str) -> Self {
        Self {
            dir: root.join(parent).join(name),
        }
    }

    pub(super) fn create(
        root: &Path,
        parent: &str,
        name: &str,
        limits: &Limits,
    ) -> Result<Self, CgroupError> {
        Self::create_with(root, parent, name, limits, |_| {})
    }

    /// `prepare` runs after the directory exists (tests use it to stand in for
    /// the files cgroupfs creates by itself).
    pub(super) fn create_with(
        root: &Path,
        parent: &str,
        name: &str,
        limits: &Limits,
        prepare: impl FnOnce(&Path),
    ) -> Result<Self, CgroupError> {
        let parent_dir = root.join(parent);
        fs::create_dir_all(&parent_dir).map_err(io_err(&parent_dir))?;
        // Controllers must be enabled for children at every level down to ours.
        for level in [root.to_path_buf(), parent_dir.clone()] {
            let control = level.join("cgroup.subtree_control");
            let current = fs::read_to_string(&control).unwrap_or_default();
            for c in ["memory", "pids", "cpu"] {
                if !current.split_whitespace().any(|x| x == c) {
                    // cpu may be unavailable (e.g. delegated trees); memory and
                    // pids were checked at detection.
                    let _ = fs::write(&control, format!("+{c}"));
                }
            }
        }
        let g = Self::open(root, parent, name);
        fs::create_dir_all(&g.dir).map_err(io_err(&g.dir))?;
        prepare(&g.dir);
        g.set_limits(limits)?;
        Ok(g)
    }

    pub(super) fn set_limits(&self, limits: &Limits) -> Result<(), CgroupError> {
        let g = self;
        write(&g.dir.join("memory.max"), &limits.memory_bytes.to_string())?;
        let swap = g.dir.join("memory.swap.max");
        if swap.exists() {
            write(&swap, "0")?;
        }
        write(&g.dir.join("pids.max"), &limits.pids.to_string())?;
        let cpu = g.dir.join("cpu.max");
        if cpu.exists() {
            let period = 100_000u64;
            let quota = (limits.cpu_millis.saturating_mul(period) / 1000).max(1000);
            write(&cpu, &format!("{quota} {period}"))?;
        }
        Ok(())
    }

    pub(super) fn dir(&self) -> &Path {
        &self.dir
    }

    /// Kills every process in the group at once (kernel 5.14+).
    /// Freezes the cgroup and waits until the kernel says it is frozen.
    pub(super) fn freeze(&self) -> Result<(), CgroupError> {
        write(&self.dir.join("cgroup.freeze"), "1")?;
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while !self.is_frozen() {
            if std::time::Instant::now() >= deadline {
                return Err(CgroupError::NotFrozen(self.dir.clone()));
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        Ok(())
    }

    /// Thaws the cgroup.
    pub(super) fn thaw(&self) -> Result<(), CgroupError> {
        write(&self.dir.join("cgroup.freeze"), "0")
    }

    /// Whether the cgroup is frozen.
    pub(super) fn is_frozen(&self) -> bool {
        super::read_keyed(&self.dir.join("cgroup.events"), "frozen") == 1
    }

    pub(super) fn kill(&self) {
        let _ = fs::write(self.dir.join("cgroup.kill"), "1");
    }

    pub(super) fn kills(&self) -> Kills {
        Kills {
            oom_kills: read_keyed(&self.dir.join("memory.events"), "oom_kill"),
            pids_limit_hits: read_keyed(&self.dir.join("pids.events"), "max"),
        }
    }

    pub(super) fn counters(&self) -> Counters {
        Counters {
            memory_bytes: read_u64(&self.dir.join("memory.current")),
            memory_peak_bytes: read_u64(&self.dir.join("memory.peak")),
            cpu_ns: read_keyed(&self.dir.join("cpu.stat"), "usage_usec") * 1000,
            pids: read_u64(&self.dir.join("pids.current")),
            ..self.kills().counters_base()
        }
    }
}
