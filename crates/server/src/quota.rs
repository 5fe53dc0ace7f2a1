//! Per-workspace quotas: how many sandboxes, and how much memory and disk
//! (the sum of their limits), one workspace may hold at once, so that one
//! tenant cannot take every slot of the daemon.

use std::collections::HashMap;
use std::sync::Mutex;

use axum::http::StatusCode;
use runcell_core::SandboxLimits;

use crate::error::ApiError;

/// What one workspace may hold at once. `None` means no quota beyond the
/// daemon's own limits, except for the sandbox count (see
/// [`WorkspaceQuota::max_sandboxes`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WorkspaceQuota {
    /// Live sandboxes (`--workspace-max-sandboxes`).
    pub sandboxes: Option<usize>,
    /// Sum of the memory limits of its live sandboxes
    /// (`--workspace-max-memory`).
    pub memory_bytes: Option<u64>,
    /// Sum of the disk limits of its live sandboxes (`--workspace-max-disk`).
    pub disk_bytes: Option<u64>,
}

impl WorkspaceQuota {
    /// The sandboxes one workspace may hold when the daemon holds at most
    /// `global` and serves `workspaces` workspaces: the quota if set; else,
    /// when there are other workspaces, all but a reserve of one in sixteen
    /// (at least one) kept for them; else (a single tenant) every slot.
    pub fn max_sandboxes(&self, global: usize, workspaces: u64) -> usize {
        self.sandboxes.unwrap_or_else(|| {
            if workspaces > 1 {
                global.saturating_sub((global / 16).max(1)).max(1)
            } else {
                global
            }
        })
    }
}

/// What a workspace holds or is creating.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Usage {
    sandboxes: usize,
    memory_bytes: u64,
    disk_bytes: u64,
}

impl Usage {
    fn of(limits: &SandboxLimits) -> Self {
        Self {
            sandboxes: 1,
            memory_bytes: limits.memory_bytes,
            disk_bytes: limits.disk_bytes,
        }
    }

    fn add(&mut self, other: Usage) {
        self.sandboxes = self.sandboxes.saturating_add(other.sandboxes);
        self.memory_bytes = self.memory_bytes.saturating_add(other.memory_bytes);
        self.disk_bytes = self.disk_bytes.saturating_add(other.disk_bytes);
    }

    fn sub(&mut self, other: Usage) {
        self.sandboxes = self.sandboxes.saturating_sub(other.sandboxes);
        self.memory_bytes = self.memory_bytes.saturating_sub(other.memory_bytes);
        self.disk_bytes = self.disk_bytes.saturating_sub(other.disk_bytes);
    }
}

/// Creates in progress, by workspace.
#[derive(Debug, Default)]
pub struct Reservations(Mutex<HashMap<String, Usage>>);

/// A create in progress, counted against its workspace until dropped (drop
/// it once the sandbox is in the live map, or when the create fails).
#[derive(Debug)]
pub struct Reservation<'a> {
    owner: &'a Reservations,
    workspace: String,
    usage: Usage,
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        let mut map = self
            .owner
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(u) = map.get_mut(&self.workspace) {
            u.sub(self.usage);
            if *u == Usage::default() {
                map.remove(&self.workspace);
            }
        }
    }
}

/// Reserves room for one more sandbox with `limits` in `workspace`, or
/// answers 429 (with Retry-After) naming the quota it would exceed.
/// `max_sandboxes` is what the workspace may hold
/// ([`WorkspaceQuota::max_sandboxes`]); `live` lists the limits of the
/// workspace's live sandboxes, and is read while the reservations are
/// locked (a create that goes live meanwhile is counted once, not missed).
pub fn reserve<'a>(
    reservations: &'a Reservations,
    quota: WorkspaceQuota,
    max_sandboxes: usize,
    workspace: &str,
    limits: &SandboxLimits,
    live: impl FnOnce() -> Vec<SandboxLimits>,
) -> Result<Reservation<'a>, ApiError> {
    let want = Usage::of(limits);
    let mut reserved = reservations
        .0
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let mut used = reserved.get(workspace).copied().unwrap_or_default();
    for l in live() {
        used.add(Usage::of(&l));
    }
    let max = max_sandboxes;
    let refusal = if used.sandboxes.saturating_add(1) > max {
        Some(format!(
            "workspace quota reached: {} sandboxes are running or starting in this workspace and its limit is {max}",
            used.sandboxes
        ))
    } else {
        over(
            "memory",
            want.memory_bytes,
            used.memory_bytes,
            quota.memory_bytes,
        )
        .or_else(|| over("disk", want.disk_bytes, used.disk_bytes, quota.disk_bytes))
    };
    if let Some(message) = refusal {
        let mut err = ApiError::new(
            StatusCode::TOO_MANY_REQUESTS,
            format!("{message}; delete a sandbox or retry later"),
        );
        err.retry_after = Some(5);
        return Err(err);
    }
    reserved.entry(workspace.to_string()).or_default().add(want);
    Ok(Reservation {
        owner: reservations,
        workspace: workspace.to_string(),
        usage: want,
    })
}

/// Why `want` more on top of `used` exceeds `quota`, if it does.
fn over(what: &str, want: u64, used: u64, quota: Option<u64>) -> Option<String> {
    let quota = quota.filter(|q| used.saturating_add(want) > *q)?;
    Some(format!(
        "workspace quota reached: this sandbox's {} {what} limit on top of the {} its workspace holds exceeds the workspace's {}",
        runcell_core::format_size(want),
        runcell_core::format_size(used),
        runcell_core::format_size(quota)
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_sandbox_quota_keeps_a_reserve_for_other_workspaces() {
        let q = WorkspaceQuota::default();
        assert_eq!(q.max_sandboxes(64, 2), 60);
        assert_eq!(q.max_sandboxes(80, 5), 75);
        assert_eq!(q.max_sandboxes(8, 2), 7);
        assert_eq!(q.max_sandboxes(1, 2), 1);
        // A single tenant may use every slot.
        assert_eq!(q.max_sandboxes(8, 1), 8);
        let q = WorkspaceQuota {
            sandboxes: Some(3),
            ..Default::default()
        };
        assert_eq!(q.max_sandboxes(64, 1), 3);
    }

    #[test]
    fn reservations_are_returned_when_dropped() {
        let r = Reservations::default();
        let limits = SandboxLimits::default();
        {
            let _a = Reservation {
                owner: &r,
                workspace: "w".into(),
                usage: {
                    let u = Usage::of(&limits);
                    r.0.lock().unwrap().entry("w".into()).or_default().add(u);
                    u
                },
            };
            assert_eq!(r.0.lock().unwrap()["w"].sandboxes, 1);
        }
        assert!(r.0.lock().unwrap().is_empty());
    }

    #[test]
    fn reserve_counts_live_sandboxes_and_refuses_over_a_quota_with_retry_after() {
        let r = Reservations::default();
        let mib = |n: u64| SandboxLimits {
            memory_bytes: n << 20,
            ..SandboxLimits::default()
        };
        let quota = WorkspaceQuota {
            memory_bytes: Some(1024 << 20),
            ..Default::default()
        };
        // 512 MiB live and 256 MiB starting: another 256 MiB fits.
        let starting = reserve(&r, quota, 8, "w", &mib(256), Vec::new).unwrap();
        let live = || vec![mib(512)];
        let fits = reserve(&r, quota, 8, "w", &mib(256), live).unwrap();
        // The next one does not; another workspace is not affected.
        let e = reserve(&r, quota, 8, "w", &mib(1), live).unwrap_err();
        assert_eq!(e.status, StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(e.retry_after, Some(5));
        assert!(
            e.message.starts_with(
                "workspace quota reached: this sandbox's 1 MiB memory limit on top of the 1 GiB"
            ),
            "{}",
            e.message
        );
        assert!(reserve(&r, quota, 8, "other", &mib(1), Vec::new).is_ok());
        // The sandbox count: live and starting ones count.
        let e = reserve(&r, WorkspaceQuota::default(), 3, "w", &mib(1), live).unwrap_err();
        assert!(
            e.message.contains(
                "3 sandboxes are running or starting in this workspace and its limit is 3"
            ),
            "{}",
            e.message
        );
        drop((starting, fits));
        assert!(reserve(&r, quota, 8, "w", &mib(256), live).is_ok());
    }
}
