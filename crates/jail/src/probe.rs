//! What this host can enforce, found without changing anything: whether
//! user namespaces, seccomp and Landlock are there, which cgroup layout and
//! controllers the jail gets (and whether OOM kills are reported), and
//! whether `/dev/kvm` answers. `runcell doctor` and `GET /v1/system` show
//! it, so an operator sees what really holds on this machine rather than
//! what the documentation hopes.

use std::fs;
use std::path::Path;

use serde::Serialize;

use crate::cgroup::Hierarchy;

/// One capability: whether it is there, and in a sentence what was found.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Check {
    /// Whether the jail can use it.
    pub available: bool,
    /// What was found (a version, a setting, or why not).
    pub detail: String,
}

impl Check {
    fn yes(detail: impl Into<String>) -> Self {
        Self {
            available: true,
            detail: detail.into(),
        }
    }

    fn no(detail: impl Into<String>) -> Self {
        Self {
            available: false,
            detail: detail.into(),
        }
    }
}

/// The host's cgroups as the jail sees them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CgroupReport {
    /// `v1` (also on hybrid hosts), `v2`, or `none`.
    pub version: String,
    /// Controllers the jail can use (memory, pids, cpu, freezer, ...).
    pub controllers: Vec<String>,
    /// Whether OOM kills are counted (v1 `memory.oom_control`, v2
    /// `memory.events`), so a killed program is reported as out of memory.
    pub oom_kill_reporting: bool,
    /// What was found.
    pub detail: String,
}

/// Everything [`probe`] finds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct HostReport {
    /// The running kernel's release.
    pub kernel: String,
    /// Unprivileged-style user namespaces (the jail maps the sandbox's root
    /// to an unprivileged host uid).
    pub user_namespaces: Check,
    /// Seccomp filters (every sandboxed process runs under one).
    pub seccomp: Check,
    /// Landlock, with its ABI version in `landlock_abi`.
    pub landlock: Check,
    /// Landlock's ABI version, if the kernel has it.
    pub landlock_abi: Option<u32>,
    /// cgroups.
    pub cgroups: CgroupReport,
    /// `/dev/kvm`: whether it opens and answers the KVM API. Whether a
    /// guest really boots is for the microVM backend to find out.
    pub kvm: Check,
}

/// Probes the host. Reads `/proc` and `/sys`, makes one Landlock syscall
/// that creates nothing, and opens `/dev/kvm` read-only.
pub fn probe() -> HostReport {
    let landlock_abi = crate::sys::landlock_abi();
    HostReport {
        kernel: nix::sys::utsname::uname()
            .map(|u| u.release().to_string_lossy().into_owned())
            .unwrap_or_else(|e| format!("unknown ({e})")),
        user_namespaces: user_namespaces(),
        seccomp: seccomp(),
        landlock: match &landlock_abi {
            Ok(v) => Check::yes(format!("ABI version {v}")),
            Err(e) => Check::no(format!("not available: {e}")),
        },
        landlock_abi: landlock_abi.ok(),
        cgroups: cgroups(),
        kvm: kvm(),
    }
}

fn read_trim(path: &str) -> Option<String> {
    fs::read_to_string(path).ok().map(|s| s.trim().to_string())
}

fn user_namespaces() -> Check {
    if !Path::new("/proc/self/ns/user").exists() {
        return Check::no("the kernel has no user namespaces (no /proc/self/ns/user)");
    }
    match read_trim("/proc/sys/user/max_user_namespaces").and_then(|s| s.parse::<u64>().ok()) {
        Some(0) => Check::no("disabled: /proc/sys/user/max_user_namespaces is 0"),
        Some(n) => Check::yes(format!("up to {n} (/proc/sys/user/max_user_namespaces)")),
        None => Check::yes("present (/proc/sys/user/max_user_namespaces unreadable)"),
    }
}

fn seccomp() -> Check {
    let status = fs::read_to_string("/proc/self/status").unwrap_or_default();
    if !status.lines().any(|l| l.starts_with("Seccomp:")) {
        return Check::no(
            "the kernel was built without seccomp (no Seccomp: in /proc/self/status)",
        );
    }
    let actions = read_trim("/proc/sys/kernel/seccomp/actions_avail").unwrap_or_default();
    if actions.split_whitespace().any(|a| a == "errno") {
        Check::yes(format!("filters with actions: {actions}"))
    } else {
        Check::yes("filters (actions not listed)")
    }
}

fn cgroups() -> CgroupReport {
    let hierarchy = Hierarchy::detect();
    let version = match &hierarchy {
        Ok(h) => h.name().to_string(),
        Err(_) => "none".to_string(),
    };
    let mut controllers = Vec::new();
    match &hierarchy {
        Ok(Hierarchy::V2 { root }) => {
            let text = fs::read_to_string(root.join("cgroup.controllers")).unwrap_or_default();
            controllers.extend(text.split_whitespace().map(str::to_string));
        }
        Ok(Hierarchy::V1(_)) => {
            // /proc/cgroups: name, hierarchy id, cgroups, enabled. A v1
            // controller has a non-zero hierarchy.
            let text = fs::read_to_string("/proc/cgroups").unwrap_or_default();
            for line in text.lines().filter(|l| !l.starts_with('#')) {
                let f: Vec<&str> = line.split_whitespace().collect();
                if f.len() >= 4 && f[1] != "0" && f[3] == "1" {
                    controllers.push(f[0].to_string());
                }
            }
        }
        Err(_) => {}
    }
    controllers.sort();
    let oom_kill_reporting = match &hierarchy {
        Ok(Hierarchy::V1(_)) => fs::read_to_string("/sys/fs/cgroup/memory/memory.oom_control")
            .map(|t| t.lines().any(|l| l.starts_with("oom_kill ")))
            .unwrap_or(false),
        Ok(Hierarchy::V2 { root }) => fs::read_dir(root)
            .map(|mut d| {
                d.any(|e| {
                    e.map(|e| e.path().join("memory.events").exists())
                        .unwrap_or(false)
                })
            })
            .unwrap_or(false),
        Err(_) => false,
    };
    let detail = match &hierarchy {
        Ok(_) => format!("{version} with {}", controllers.join(", ")),
        Err(e) => format!("no usable cgroup hierarchy: {e}"),
    };
    CgroupReport {
        version,
        controllers,
        oom_kill_reporting,
        detail,
    }
}

fn kvm() -> Check {
    match crate::sys::kvm_api_version() {
        Ok(12) => Check::yes(
            "/dev/kvm answers (KVM API 12); whether it boots a guest shows only when a guest is started",
        ),
        Ok(v) => Check::no(format!(
            "/dev/kvm answers an unexpected KVM API version {v}"
        )),
        Err(e) => Check::no(format!("/dev/kvm: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_probe_finds_what_this_kernel_has() {
        let r = probe();
        assert!(!r.kernel.is_empty());
        // Every machine that runs these tests runs sandboxes: these hold.
        assert!(r.user_namespaces.available, "{r:?}");
        assert!(r.seccomp.available, "{r:?}");
        assert!(r.cgroups.controllers.iter().any(|c| c == "memory"), "{r:?}");
        assert!(r.cgroups.controllers.iter().any(|c| c == "pids"), "{r:?}");
        // Landlock's answer and its ABI agree.
        assert_eq!(r.landlock.available, r.landlock_abi.is_some(), "{r:?}");
        let json = serde_json::to_value(&r).unwrap();
        assert!(json["cgroups"]["version"].is_string());
    }
}
