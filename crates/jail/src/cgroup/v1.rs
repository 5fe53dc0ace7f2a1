//! cgroup v1: one hierarchy per controller (memory, pids, cpu, cpuacct).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use super::{io_err, read_keyed, read_u64, write, CgroupError, Counters, Kills};
use crate::Limits;

/// Where each v1 controller runcell uses is mounted.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Mounts {
    memory: Option<PathBuf>,
    pids: Option<PathBuf>,
    cpu: Option<PathBuf>,
    cpuacct: Option<PathBuf>,
    freezer: Option<PathBuf>,
}

impl Mounts {
    pub(super) fn add(&mut self, mount_point: &Path, super_opts: &str) {
        for opt in super_opts.split(',') {
            let slot = match opt {
                "memory" => &mut self.memory,
                "pids" => &mut self.pids,
                "cpu" => &mut self.cpu,
                "cpuacct" => &mut self.cpuacct,
                "freezer" => &mut self.freezer,
                _ => continue,
            };
            if slot.is_none() {
                *slot = Some(mount_point.to_path_buf());
            }
        }
    }

    pub(super) fn has_required(&self) -> bool {
        self.memory.is_some() && self.pids.is_some()
    }

    /// The distinct directories `<mount>/<rel>` across controllers.
    pub(super) fn dirs(&self, rel: &str) -> Vec<PathBuf> {
        let mut out: Vec<PathBuf> = Vec::new();
        for m in [&self.memory, &self.pids, &self.cpu, &self.cpuacct]
            .into_iter()
            .flatten()
        {
            let d = m.join(rel);
            if !out.contains(&d) {
                out.push(d);
            }
        }
        out
    }
}

#[derive(Debug, Clone)]
pub(super) struct Group {
    memory: PathBuf,
    pids: PathBuf,
    cpu: Option<PathBuf>,
    cpuacct: Option<PathBuf>,
    /// Made only when the sandbox is first paused: joining one more v1
    /// hierarchy at every create would cost another migration.
    freezer: Option<PathBuf>,
    /// Whether `freezer` may exist (it was there when opened, or a freeze
    /// made it; shared by clones): until then the sandbox is not frozen,
    /// and [`Group::is_frozen`], asked on every request, opens nothing.
    freezer_made: Arc<AtomicBool>,
}

impl Group {
    pub(super) fn open(m: &Mounts, parent: &str, name: &str) -> Self {
        let rel = format!("{parent}/{name}");
        Self {
            memory: m
                .memory
                .as_ref()
                .expect("checked by has_required")
                .join(&rel),
            pids: m.pids.as_ref().expect("checked by has_required").join(&rel),
            cpu: m.cpu.as_ref().map(|c| c.join(&rel)),
            cpuacct: m.cpuacct.as_ref().map(|c| c.join(&rel)),
            freezer: m.freezer.as_ref().map(|c| c.join(&rel)),
            freezer_made: Arc::new(AtomicBool::new(true)),
        }
    }

    pub(super) fn create(
        m: &Mounts,
        parent: &str,
        name: &str,
        limits: &Limits,
    ) -> Result<Self, CgroupError> {
        let g = Self::open(m, parent, name);
        // New (its name is new): no freeze has made its freezer cgroup.
        g.freezer_made.store(false, Ordering::Release);
        for dir in g.dirs() {
            std::fs::create_dir_all(&dir).map_err(io_err(&dir))?;
        }
        g.set_limits(limits)?;
        Ok(g)
    }

    pub(super) fn set_limits(&self, limits: &Limits) -> Result<(), CgroupError> {
        let g = self;
        let mem = limits.memory_bytes.to_string();
        let limit = g.memory.join("memory.limit_in_bytes");
        let memsw = g.memory.join("memory.memsw.limit_in_bytes");
        if memsw.exists() {
            // Without swap accounting this file is absent; with it, swap must
            // not stretch the limit. The kernel keeps memory <= memory+swap at
            // every step, so raising writes memsw first and lowering writes
            // it last (a standby prepared with a smaller limit is raised).
            let current = std::fs::read_to_string(&limit)
                .ok()
                .and_then(|s| s.trim().parse::<u64>().ok())
                .unwrap_or(u64::MAX);
            if limits.memory_bytes > current {
                write(&memsw, &mem)?;
                write(&limit, &mem)?;
            } else {
                write(&limit, &mem)?;
                write(&memsw, &mem)?;
            }
        } else {
            write(&limit, &mem)?;
        }
        write(&g.pids.join("pids.max"), &limits.pids.to_string())?;
        if let Some(cpu) = &g.cpu {
            let period = 100_000u64;
            let quota = (limits.cpu_millis.saturating_mul(period) / 1000).max(1000);
            write(&cpu.join("cpu.cfs_period_us"), &period.to_string())?;
            write(&cpu.join("cpu.cfs_quota_us"), &quota.to_string())?;
        }
        Ok(())
    }

    pub(super) fn dirs(&self) -> Vec<PathBuf> {
        let mut out = vec![self.memory.clone(), self.pids.clone()];
        for d in [&self.cpu, &self.cpuacct].into_iter().flatten() {
            if !out.contains(d) {
                out.push(d.clone());
            }
        }
        out
    }

    /// The freezer cgroup, where the host has the controller.
    pub(super) fn freezer(&self) -> Option<&Path> {
        self.freezer.as_deref()
    }

    /// Moves every process of the sandbox into its freezer cgroup and
    /// freezes it, until no process is left outside (one may fork while
    /// the others are moved; a frozen one cannot).
    pub(super) fn freeze(&self, procs: impl Fn() -> Vec<i32>) -> Result<(), CgroupError> {
        let dir = self.freezer.as_ref().ok_or(CgroupError::NoFreezer)?;
        self.freezer_made.store(true, Ordering::Release);
        std::fs::create_dir_all(dir).map_err(io_err(dir))?;
        let state = dir.join("freezer.state");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        loop {
            let inside = read_procs(dir);
            let outside: Vec<i32> = procs()
                .into_iter()
                .filter(|p| !inside.contains(p))
                .collect();
            if outside.is_empty() && read_state(&state) == "FROZEN" {
                return Ok(());
            }
            for pid in outside {
                // A process that exited meanwhile cannot be moved: fine.
                let _ = std::fs::write(dir.join("cgroup.procs"), pid.to_string());
            }
            write(&state, "FROZEN")?;
            if std::time::Instant::now() >= deadline {
                return Err(CgroupError::NotFrozen(dir.clone()));
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }

    /// Thaws the freezer cgroup (its processes stay in it, harmlessly).
    pub(super) fn thaw(&self) -> Result<(), CgroupError> {
        match &self.freezer {
            Some(dir) if dir.exists() => write(&dir.join("freezer.state"), "THAWED"),
            _ => Ok(()),
        }
    }

    /// Whether the sandbox is frozen.
    pub(super) fn is_frozen(&self) -> bool {
        self.freezer_made.load(Ordering::Acquire)
            && self
                .freezer
                .as_ref()
                .is_some_and(|d| read_state(&d.join("freezer.state")) != "THAWED")
    }

    pub(super) fn kills(&self) -> Kills {
        Kills {
            oom_kills: read_keyed(&self.memory.join("memory.oom_control"), "oom_kill"),
            pids_limit_hits: read_keyed(&self.pids.join("pids.events"), "max"),
        }
    }

    pub(super) fn counters(&self) -> Counters {
        Counters {
            memory_bytes: read_u64(&self.memory.join("memory.usage_in_bytes")),
            memory_peak_bytes: read_u64(&self.memory.join("memory.max_usage_in_bytes")),
            cpu_ns: self
                .cpuacct
                .as_ref()
                .map(|d| read_u64(&d.join("cpuacct.usage")))
                .unwrap_or(0),
            pids: read_u64(&self.pids.join("pids.current")),
            ..self.kills().counters_base()
        }
    }
}

fn read_state(path: &Path) -> String {
    std::fs::read_to_string(path)
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "THAWED".into())
}

fn read_procs(dir: &Path) -> Vec<i32> {
    std::fs::read_to_string(dir.join("cgroup.procs"))
        .map(|s| s.lines().filter_map(|l| l.trim().parse().ok()).collect())
        .unwrap_or_default()
}
