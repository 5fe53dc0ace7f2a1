//! Limit hits counted inside the sandbox, for backends whose kernel the
//! host cannot read.
//!
//! The jail's processes run on the host's kernel, and the host reads the
//! sandbox's cgroup counters (`pids.events`, `memory.oom_control`) itself.
//! Under gVisor and in a microVM the processes live in another kernel, so
//! the agent counts and reports the hits in each run's
//! [`ExitInfo`](runcell_protocol::ExitInfo):
//!
//! * **microVM:** the guest's own cgroup v2 (`/sys/fs/cgroup/sandbox`, which
//!   `vm-init` makes and joins), whose `pids.events` (`max`) and
//!   `memory.events` (`oom_kill`) are the kernel's exact counters, as in the
//!   jail ([`watch_events`]).
//! * **gVisor:** gVisor's cgroupfs enforces `pids.max` but keeps no
//!   `pids.events`; its `pids.current` is the very count the limit is
//!   checked against (so unlike counting `/proc`, it reads the limit when
//!   forks fail). While a run is active a thread reads it every
//!   [`SAMPLE_QUIET`] while the sandbox holds few processes, every
//!   [`SAMPLE_EVERY`] when it holds more, every [`SAMPLE_NEAR`] within a
//!   quarter of the limit, and counts each time it reaches the limit
//!   ([`watch_sampled`]), each run
//!   starting from "not at the limit" (a limit the previous run left full
//!   is counted again when this run meets it). It is a sample, and this
//!   gVisor's count is not exact during a fork storm (it was read at 65
//!   under a `pids.max` of 64, and a Python bomb has had 65 to 88 children
//!   alive at once under it): the count can sit at the limit for well under
//!   a millisecond after the refused fork, and such a hit goes unreported
//!   (about 2 in 100 bombs that exit at once after the refusal, in
//!   `crates/core/tests/gvisor.rs`'s set-up). A program that keeps the limit
//!   full is seen.
//!   gVisor's OOM is the host's to count (it ends the whole sandbox).

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::Duration;

/// How often the gVisor sampler reads `pids.current` while a run is active
/// and the sandbox holds few processes ([`QUIET_PROCESSES`]): most runs.
/// Each look is two system calls, which under gVisor's ptrace platform
/// cost 15-40 µs of the Sentry's time each, beside the program it watches.
pub const SAMPLE_QUIET: Duration = Duration::from_millis(10);
/// ...while it holds more (processes are being started).
pub const SAMPLE_EVERY: Duration = Duration::from_millis(2);
/// ...and while the count is within a quarter of the limit.
pub const SAMPLE_NEAR: Duration = Duration::from_micros(500);
/// At most this many processes (and under a quarter of the limit) is a
/// quiet sandbox: the agent, its fork server, a supervisor and a program
/// with a few children.
pub const QUIET_PROCESSES: u64 = 16;

/// Hits counted so far (they only grow).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Hits {
    /// Forks refused by the process limit (microVM: `pids.events max`;
    /// gVisor: times `pids.current` was seen at the limit).
    pub pids: u64,
    /// Processes killed by the memory limit (microVM: `memory.events oom_kill`).
    pub oom_kills: u64,
}

impl Hits {
    /// The limits `self` (read after a run) shows were hit since `before`:
    /// (process limit, memory limit).
    pub fn since(self, before: Hits) -> (bool, bool) {
        (self.pids > before.pids, self.oom_kills > before.oom_kills)
    }
}

#[derive(Debug)]
enum Source {
    /// A cgroup v2's `pids.events` and `memory.events`, opened before the
    /// agent changed its root (read again at offset 0 each time).
    Events { pids: File, memory: File },
    /// The gVisor sampler.
    Sampled(Arc<Sampler>),
}

#[derive(Debug)]
struct Sampler {
    hits: AtomicU64,
    /// Runs in progress; the thread sleeps while there are none.
    active: Mutex<Runs>,
    wake: Condvar,
}

#[derive(Debug, Default)]
struct Runs {
    /// Runs in progress.
    now: usize,
    /// Runs started so far: a new one makes the sampler forget that the
    /// count was at the limit, so this run's hit is counted.
    started: u64,
}

static SOURCE: OnceLock<Source> = OnceLock::new();

/// Counts hits from the cgroup v2 directory `group` (its `pids.events` and
/// `memory.events`, opened now: the agent's root changes later).
pub fn watch_events(group: &Path) -> std::io::Result<()> {
    let pids = File::open(group.join("pids.events"))?;
    let memory = File::open(group.join("memory.events"))?;
    let _ = SOURCE.set(Source::Events { pids, memory });
    Ok(())
}

/// Counts hits by sampling `current` (an open `pids.current`) against `max`
/// while runs are active, on a thread of its own.
pub fn watch_sampled(current: File, max: u64) -> std::io::Result<()> {
    let sampler = Arc::new(Sampler {
        hits: AtomicU64::new(0),
        active: Mutex::new(Runs::default()),
        wake: Condvar::new(),
    });
    let s = sampler.clone();
    std::thread::Builder::new()
        .name("pids-sampler".into())
        .spawn(move || sample(&s, &current, max))?;
    let _ = SOURCE.set(Source::Sampled(sampler));
    Ok(())
}

fn sample(s: &Sampler, current: &File, max: u64) {
    let mut at_limit = false;
    let mut seen_runs = 0;
    let mut buf = [0u8; 32];
    loop {
        {
            let mut runs = s.active.lock().unwrap_or_else(|e| e.into_inner());
            while runs.now == 0 {
                at_limit = false;
                runs = s.wake.wait(runs).unwrap_or_else(|e| e.into_inner());
            }
            if runs.started != seen_runs {
                seen_runs = runs.started;
                at_limit = false;
            }
        }
        // gVisor regenerates the file's contents on a read at offset 0.
        let now = current.read_at(&mut buf, 0).ok().and_then(|n| {
            std::str::from_utf8(buf.get(..n)?)
                .ok()?
                .trim()
                .parse::<u64>()
                .ok()
        });
        let at = now.is_some_and(|n| n >= max);
        if at && !at_limit {
            s.hits.fetch_add(1, Ordering::Relaxed);
        }
        at_limit = at;
        std::thread::sleep(sample_after(now, max));
    }
}

/// How long the sampler waits after reading `now` processes under a limit
/// of `max`.
fn sample_after(now: Option<u64>, max: u64) -> Duration {
    let Some(n) = now else {
        return SAMPLE_EVERY;
    };
    if n.saturating_mul(4) >= max.saturating_mul(3) {
        SAMPLE_NEAR
    } else if n <= QUIET_PROCESSES && n.saturating_mul(4) < max {
        SAMPLE_QUIET
    } else {
        SAMPLE_EVERY
    }
}

/// The hits counted so far (zero where the host counts them).
pub fn hits() -> Hits {
    match SOURCE.get() {
        None => Hits::default(),
        Some(Source::Sampled(s)) => Hits {
            pids: s.hits.load(Ordering::Relaxed),
            oom_kills: 0,
        },
        Some(Source::Events { pids, memory }) => Hits {
            pids: event(pids, "max"),
            oom_kills: event(memory, "oom_kill"),
        },
    }
}

/// The value of `key` in an open cgroup v2 `key value` file, read from
/// its start (0 if absent or unreadable).
fn event(file: &File, key: &str) -> u64 {
    let mut buf = [0u8; 512];
    let Ok(n) = file.read_at(&mut buf, 0) else {
        return 0;
    };
    String::from_utf8_lossy(buf.get(..n).unwrap_or_default())
        .lines()
        .find_map(|l| {
            let (k, v) = l.split_once(' ')?;
            (k == key).then(|| v.trim().parse().ok())?
        })
        .unwrap_or(0)
}

/// Keeps the gVisor sampler running while it lives (one per run).
#[derive(Debug)]
pub struct Active(Option<Arc<Sampler>>);

/// Marks a run active until the returned guard is dropped.
pub fn active() -> Active {
    match SOURCE.get() {
        Some(Source::Sampled(s)) => {
            let mut runs = s.active.lock().unwrap_or_else(|e| e.into_inner());
            runs.now += 1;
            runs.started += 1;
            drop(runs);
            s.wake.notify_all();
            Active(Some(s.clone()))
        }
        _ => Active(None),
    }
}

impl Drop for Active {
    fn drop(&mut self) {
        if let Some(s) = &self.0 {
            let mut runs = s.active.lock().unwrap_or_else(|e| e.into_inner());
            runs.now = runs.now.saturating_sub(1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn event_files_are_read_by_key() {
        let tmp = std::env::temp_dir().join(format!("runcell-limits-{}", std::process::id()));
        std::fs::create_dir_all(&tmp).unwrap();
        std::fs::write(tmp.join("pids.events"), "max 7\n").unwrap();
        std::fs::write(
            tmp.join("memory.events"),
            "low 0\nhigh 0\nmax 12\noom 2\noom_kill 1\noom_group_kill 0\n",
        )
        .unwrap();
        let open = |name: &str| File::open(tmp.join(name)).unwrap();
        assert_eq!(event(&open("pids.events"), "max"), 7);
        let memory = open("memory.events");
        assert_eq!(event(&memory, "oom_kill"), 1);
        // Read again from the start, as the agent does.
        assert_eq!(event(&memory, "oom_kill"), 1);
        assert_eq!(event(&memory, "oom"), 2);
        assert_eq!(event(&memory, "low"), 0);
        assert_eq!(event(&open("pids.events"), "nothing"), 0);
        std::fs::remove_dir_all(&tmp).unwrap();
        let before = Hits {
            pids: 1,
            oom_kills: 0,
        };
        let after = Hits {
            pids: 2,
            oom_kills: 0,
        };
        assert_eq!(after.since(before), (true, false));
    }

    #[test]
    fn the_sampler_looks_more_often_the_more_processes_run() {
        // A quiet run under the default limit, and under a small one.
        assert_eq!(sample_after(Some(5), 512), SAMPLE_QUIET);
        assert_eq!(sample_after(Some(5), 64), SAMPLE_QUIET);
        // Processes being started: more than a few, or a quarter of a
        // small limit.
        assert_eq!(sample_after(Some(17), 512), SAMPLE_EVERY);
        assert_eq!(sample_after(Some(16), 64), SAMPLE_EVERY);
        assert_eq!(sample_after(Some(3), 8), SAMPLE_EVERY);
        // Within a quarter of the limit, and at it.
        assert_eq!(sample_after(Some(48), 64), SAMPLE_NEAR);
        assert_eq!(sample_after(Some(64), 64), SAMPLE_NEAR);
        // An unreadable count is not taken for a quiet one.
        assert_eq!(sample_after(None, 512), SAMPLE_EVERY);
    }
}
