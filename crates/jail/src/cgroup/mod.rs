//! Cgroups for sandbox limits, on cgroup v1 (including hybrid hosts, where
//! the v1 controllers are mounted beside an empty v2 tree) and pure cgroup v2.
//!
//! A sandbox's cgroup is `<parent>/<sandbox id>` in every hierarchy that has a
//! controller runcell uses. The sandbox never sees a cgroup filesystem: the
//! agent unshares a cgroup namespace and mounts none, so `release_agent` and
//! limit files are out of reach.

pub mod dynmods;
mod v1;
mod v2;

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::Limits;

/// Errors managing cgroups.
#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    /// /proc/self/mountinfo could not be read.
    #[error("Could not read the mount table to find cgroup hierarchies.")]
    MountInfo(#[source] io::Error),
    /// No usable hierarchy.
    #[error("No usable cgroup hierarchy was found: runcell needs the memory and pids controllers, mounted as cgroup v1 or v2.")]
    NotFound,
    /// A cgroup file or directory operation failed.
    #[error("Cgroup operation on {path} failed.")]
    Io {
        /// The path involved.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// The host has no freezer controller (cgroup v1 without `freezer`).
    #[error("This host has no cgroup freezer, so sandboxes cannot be paused.")]
    NoFreezer,
    /// Freezing did not finish in time.
    #[error("The cgroup {0} did not finish freezing in time.")]
    NotFrozen(PathBuf),
    /// The cgroup still had processes after the grace period.
    #[error("The cgroup {0} still has processes and could not be removed.")]
    Busy(PathBuf),
}

pub(crate) fn io_err(path: &Path) -> impl FnOnce(io::Error) -> CgroupError + '_ {
    move |source| CgroupError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Which cgroup layout the host has.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Hierarchy {
    /// Per-controller v1 hierarchies (also used on hybrid hosts).
    V1(v1::Mounts),
    /// A unified v2 hierarchy with the controllers available.
    V2 {
        /// Where cgroup2 is mounted.
        root: PathBuf,
    },
}

impl Hierarchy {
    /// Finds the host's hierarchy from `/proc/self/mountinfo`.
    pub fn detect() -> Result<Self, CgroupError> {
        let info = fs::read_to_string("/proc/self/mountinfo").map_err(CgroupError::MountInfo)?;
        Self::from_mountinfo(&info, |p| fs::read_to_string(p).ok())
    }

    /// Finds the hierarchy in a mountinfo text. `read` reads a file (used to
    /// check which controllers a v2 mount offers); tests pass a fake.
    pub fn from_mountinfo(
        info: &str,
        read: impl Fn(&Path) -> Option<String>,
    ) -> Result<Self, CgroupError> {
        let mut v1 = v1::Mounts::default();
        let mut v2_root = None;
        for line in info.lines() {
            // Fields: id parent maj:min root mountpoint opts [optional...] - fstype source superopts
            let Some((left, right)) = line.split_once(" - ") else {
                continue;
            };
            let mut right = right.split(' ');
            let fstype = right.next().unwrap_or("");
            let _source = right.next();
            let super_opts = right.next().unwrap_or("");
            let mount_point = left.split(' ').nth(4).unwrap_or("");
            let mount_point = PathBuf::from(unescape_mountinfo(mount_point));
            match fstype {
                "cgroup" => v1.add(&mount_point, super_opts),
                "cgroup2" if v2_root.is_none() => v2_root = Some(mount_point),
                _ => {}
            }
        }
        if v1.has_required() {
            return Ok(Hierarchy::V1(v1));
        }
        if let Some(root) = v2_root {
            let controllers = read(&root.join("cgroup.controllers")).unwrap_or_default();
            let has = |c: &str| controllers.split_whitespace().any(|x| x == c);
            if has("memory") && has("pids") {
                return Ok(Hierarchy::V2 { root });
            }
        }
        Err(CgroupError::NotFound)
    }

    /// Short name for logs and docs.
    pub fn name(&self) -> &'static str {
        match self {
            Hierarchy::V1(_) => "v1",
            Hierarchy::V2 { .. } => "v2",
        }
    }
}

fn unescape_mountinfo(s: &str) -> String {
    // mountinfo escapes space, tab, newline and backslash as \ooo octal.
    let mut out = String::with_capacity(s.len());
    let b = s.as_bytes();
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && i + 4 <= b.len() {
            if let Ok(v) = u8::from_str_radix(&s[i + 1..i + 4], 8) {
                out.push(v as char);
                i += 4;
                continue;
            }
        }
        out.push(b[i] as char);
        i += 1;
    }
    out
}

/// The two kill counters of a sandbox's cgroup: what a run compares
/// before and after it to name the limit that ended it (two reads, where
/// [`Counters`] takes six).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Kills {
    /// Processes killed by the OOM killer in this cgroup.
    pub oom_kills: u64,
    /// Times a fork failed because the pids limit was reached.
    pub pids_limit_hits: u64,
}

impl Kills {
    /// The kill counters as [`Counters`] whose others are zero: the base of
    /// a struct update that reads the others (v1's and v2's `counters`).
    fn counters_base(self) -> Counters {
        Counters {
            oom_kills: self.oom_kills,
            pids_limit_hits: self.pids_limit_hits,
            ..Counters::default()
        }
    }
}

impl From<Counters> for Kills {
    fn from(c: Counters) -> Self {
        Self {
            oom_kills: c.oom_kills,
            pids_limit_hits: c.pids_limit_hits,
        }
    }
}

/// Counters read from a sandbox's cgroup.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counters {
    /// Processes killed by the OOM killer in this cgroup.
    pub oom_kills: u64,
    /// Times a fork failed because the pids limit was reached.
    pub pids_limit_hits: u64,
    /// Current memory use, bytes.
    pub memory_bytes: u64,
    /// Peak memory use, bytes (0 where the kernel does not report it).
    pub memory_peak_bytes: u64,
    /// CPU time used, nanoseconds (0 where not accounted).
    pub cpu_ns: u64,
    /// Current number of processes.
    pub pids: u64,
}

/// One sandbox's cgroup, in every hierarchy it needs.
#[derive(Debug, Clone)]
pub struct Cgroup {
    inner: Inner,
}

#[derive(Debug, Clone)]
enum Inner {
    V1(v1::Group),
    V2(v2::Group),
}

impl Cgroup {
    /// Creates `<parent>/<name>` with the given limits.
    pub fn create(
        hierarchy: &Hierarchy,
        parent: &str,
        name: &str,
        limits: &Limits,
    ) -> Result<Self, CgroupError> {
        let existed = Self::open(hierarchy, parent, name).exists();
        let made = match hierarchy {
            Hierarchy::V1(m) => v1::Group::create(m, parent, name, limits).map(Inner::V1),
            Hierarchy::V2 { root } => v2::Group::create(root, parent, name, limits).map(Inner::V2),
        };
        match made {
            Ok(inner) => Ok(Self { inner }),
            Err(e) => {
                // A limit the kernel refused (or any other failure) must not
                // leave the directories made so far: no process is in them
                // yet, so they can be removed at once, in every hierarchy.
                if !existed {
                    for dir in Self::open(hierarchy, parent, name).dirs() {
                        if let Err(err) = fs::remove_dir(&dir) {
                            if err.kind() != io::ErrorKind::NotFound {
                                tracing::warn!(dir = %dir.display(), "could not remove a cgroup after a failed create: {err}");
                            }
                        }
                    }
                }
                Err(e)
            }
        }
    }

    /// Refers to an existing `<parent>/<name>` (after a restart, or to sweep it).
    pub fn open(hierarchy: &Hierarchy, parent: &str, name: &str) -> Self {
        let inner = match hierarchy {
            Hierarchy::V1(m) => Inner::V1(v1::Group::open(m, parent, name)),
            Hierarchy::V2 { root } => Inner::V2(v2::Group::open(root, parent, name)),
        };
        Self { inner }
    }

    /// Names of the sandbox cgroups that exist under `parent`.
    pub fn list(hierarchy: &Hierarchy, parent: &str) -> Vec<String> {
        let dirs = match hierarchy {
            Hierarchy::V1(m) => m.dirs(parent),
            Hierarchy::V2 { root } => vec![root.join(parent)],
        };
        let mut names: Vec<String> = dirs
            .iter()
            .filter_map(|d| fs::read_dir(d).ok())
            .flatten()
            .flatten()
            .filter(|e| e.file_type().map(|t| t.is_dir()).unwrap_or(false))
            .filter_map(|e| e.file_name().into_string().ok())
            .collect();
        names.sort();
        names.dedup();
        names
    }

    /// Rewrites the limits (e.g. when a standby sandbox is claimed).
    pub fn set_limits(&self, limits: &Limits) -> Result<(), CgroupError> {
        match &self.inner {
            Inner::V1(g) => g.set_limits(limits),
            Inner::V2(g) => g.set_limits(limits),
        }
    }

    /// Moves a process into the cgroup.
    pub fn add_process(&self, pid: i32) -> Result<(), CgroupError> {
        let dirs = self.dirs();
        for dir in dirs {
            let path = dir.join("cgroup.procs");
            fs::write(&path, pid.to_string()).map_err(io_err(&path))?;
        }
        Ok(())
    }

    /// Reads the counters.
    pub fn counters(&self) -> Counters {
        match &self.inner {
            Inner::V1(g) => g.counters(),
            Inner::V2(g) => g.counters(),
        }
    }

    /// Reads the kill counters only.
    pub fn kills(&self) -> Kills {
        match &self.inner {
            Inner::V1(g) => g.kills(),
            Inner::V2(g) => g.kills(),
        }
    }

    /// Pids of the processes in the cgroup.
    pub fn procs(&self) -> Vec<i32> {
        let mut pids: Vec<i32> = self
            .dirs()
            .iter()
            .filter_map(|d| fs::read_to_string(d.join("cgroup.procs")).ok())
            .flat_map(|s| {
                s.lines()
                    .filter_map(|l| l.trim().parse().ok())
                    .collect::<Vec<i32>>()
            })
            .collect();
        pids.sort_unstable();
        pids.dedup();
        pids
    }

    /// Freezes every process in the cgroup (they keep their memory).
    pub fn freeze(&self) -> Result<(), CgroupError> {
        match &self.inner {
            Inner::V1(g) => g.freeze(|| self.procs()),
            Inner::V2(g) => g.freeze(),
        }
    }

    /// Thaws a frozen cgroup.
    pub fn thaw(&self) -> Result<(), CgroupError> {
        match &self.inner {
            Inner::V1(g) => g.thaw(),
            Inner::V2(g) => g.thaw(),
        }
    }

    /// Whether the cgroup is frozen (or freezing).
    pub fn is_frozen(&self) -> bool {
        match &self.inner {
            Inner::V1(g) => g.is_frozen(),
            Inner::V2(g) => g.is_frozen(),
        }
    }

    /// Kills every process in the cgroup and removes it, waiting up to `grace`
    /// for the processes to go away.
    pub fn destroy(&self, grace: Duration) -> Result<(), CgroupError> {
        let deadline = Instant::now() + grace;
        // A frozen process does not die until it is thawed (cgroup v1).
        if let Err(e) = self.thaw() {
            tracing::warn!("could not thaw a cgroup before removing it: {e}");
        }
        let mut dirs = self.dirs();
        if let Inner::V1(g) = &self.inner {
            dirs.extend(g.freezer().map(Path::to_path_buf));
        }
        loop {
            if let Inner::V2(g) = &self.inner {
                g.kill();
            }
            for pid in self.procs() {
                // Only reached when the pid namespace's init did not take its
                // processes with it (e.g. a setup failure before the agent ran).
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
            let mut busy = None;
            for dir in &dirs {
                match fs::remove_dir(dir) {
                    Ok(()) => {}
                    Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                    Err(e) if e.raw_os_error() == Some(libc::EBUSY) => busy = Some(dir.clone()),
                    Err(e) => return Err(io_err(dir)(e)),
                }
            }
            match busy {
                None => return Ok(()),
                Some(dir) if Instant::now() >= deadline => return Err(CgroupError::Busy(dir)),
                // A destroy waits here once its processes are killed.
                Some(_) => std::thread::sleep(crate::WAIT_TICK),
            }
        }
    }

    /// Whether any of the cgroup's directories still exist.
    pub fn exists(&self) -> bool {
        self.dirs().iter().any(|d| d.exists())
    }

    pub(crate) fn dirs(&self) -> Vec<PathBuf> {
        match &self.inner {
            Inner::V1(g) => g.dirs(),
            Inner::V2(g) => vec![g.dir().to_path_buf()],
        }
    }
}

pub(crate) fn write(path: &Path, value: &str) -> Result<(), CgroupError> {
    fs::write(path, value).map_err(io_err(path))
}

pub(crate) fn read_u64(path: &Path) -> u64 {
    fs::read_to_string(path)
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0)
}

/// Reads `key value` lines (memory.events, pids.events, memory.oom_control, cpu.stat).
pub(crate) fn read_keyed(path: &Path, key: &str) -> u64 {
    fs::read_to_string(path)
        .ok()
        .and_then(|s| {
            s.lines().find_map(|l| {
                let (k, v) = l.split_once(' ')?;
                (k == key).then(|| v.trim().parse().ok()).flatten()
            })
        })
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    const HYBRID: &str = "\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
33 31 0:30 / /sys/fs/cgroup/cpuacct rw,relatime - cgroup cgroup rw,cpuacct
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
39 31 0:36 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
";

    const PURE_V2: &str = "\
30 23 0:27 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:9 - cgroup2 cgroup2 rw,nsdelegate
";

    #[test]
    fn hybrid_host_uses_v1_controllers() {
        let h = Hierarchy::from_mountinfo(HYBRID, |_| None).unwrap();
        let Hierarchy::V1(m) = h else {
            panic!("expected v1, got {h:?}")
        };
        assert_eq!(
            m.dirs("runcell"),
            vec![
                PathBuf::from("/sys/fs/cgroup/memory/runcell"),
                PathBuf::from("/sys/fs/cgroup/pids/runcell"),
                PathBuf::from("/sys/fs/cgroup/cpu/runcell"),
                PathBuf::from("/sys/fs/cgroup/cpuacct/runcell"),
            ]
        );
    }

    #[test]
    fn pure_v2_host_needs_controllers() {
        let h = Hierarchy::from_mountinfo(PURE_V2, |_| Some("cpuset cpu io memory pids\n".into()));
        assert_eq!(
            h.unwrap(),
            Hierarchy::V2 {
                root: "/sys/fs/cgroup".into()
            }
        );
        let h = Hierarchy::from_mountinfo(PURE_V2, |_| Some("cpu io\n".into()));
        assert!(matches!(h, Err(CgroupError::NotFound)));
    }

    #[test]
    fn co_mounted_controllers_share_one_directory() {
        let info = "32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct\n\
                    35 31 0:32 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n\
                    39 31 0:36 / /sys/fs/cgroup/pids rw - cgroup cgroup rw,pids\n";
        let Hierarchy::V1(m) = Hierarchy::from_mountinfo(info, |_| None).unwrap() else {
            panic!()
        };
        assert_eq!(m.dirs("p").len(), 3);
    }

    #[test]
    fn v2_group_writes_limits_and_reads_counters() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        fs::write(root.join("cgroup.subtree_control"), "").unwrap();
        let limits = Limits {
            memory_bytes: 64 << 20,
            pids: 32,
            cpu_millis: 500,
            disk_bytes: 1 << 20,
        };
        // A fake cgroupfs: directories are plain, so pre-create the group's files.
        let g = v2::Group::create_with(root, "runcell", "sb1", &limits, |dir| {
            for f in ["memory.max", "memory.swap.max", "pids.max", "cpu.max"] {
                fs::write(dir.join(f), "").unwrap();
            }
        })
        .unwrap();
        let dir = root.join("runcell/sb1");
        assert_eq!(
            fs::read_to_string(dir.join("memory.max")).unwrap(),
            "67108864"
        );
        assert_eq!(fs::read_to_string(dir.join("pids.max")).unwrap(), "32");
        assert_eq!(
            fs::read_to_string(dir.join("cpu.max")).unwrap(),
            "50000 100000"
        );
        fs::write(
            dir.join("memory.events"),
            "low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n",
        )
        .unwrap();
        fs::write(dir.join("pids.events"), "max 7\n").unwrap();
        fs::write(dir.join("memory.current"), "4096\n").unwrap();
        let c = g.counters();
        assert_eq!(
            (c.oom_kills, c.pids_limit_hits, c.memory_bytes),
            (1, 7, 4096)
        );
    }

    #[test]
    fn unescapes_mount_points() {
        assert_eq!(unescape_mountinfo("/a\\040b"), "/a b");
        assert_eq!(unescape_mountinfo("/plain"), "/plain");
    }
}
