//! Cheap cgroup migrations: the `favordynmods` mount option.
//!
//! Moving a process into a cgroup (writing `cgroup.procs`) write-locks the
//! kernel's global `cgroup_threadgroup_rwsem`. That lock is a per-CPU rwsem
//! tuned for readers (every fork and exit): a writer first waits for an RCU
//! grace period, 7-28 ms measured on a 2-core host, which was most of a cold
//! sandbox create. A cgroup hierarchy mounted with `favordynmods` (Linux
//! 6.0+; cgroup v1 and v2 alike) keeps the lock in its reader-slow mode for
//! as long as that hierarchy exists, so a migration costs about 0.1 ms, at
//! the price of a few atomic operations more in every fork and exit; on
//! Linux 6.18+ it switches the kernel to a per-thread-group lock for good.
//!
//! runcell does not remount the host's hierarchies (a remount replaces their
//! options): it mounts one named, controller-less v1 hierarchy of its own
//! with the option and leaves it mounted. No process is ever put in it, so
//! it changes no limit and no accounting. On kernels without the option, or
//! where v1 hierarchies cannot be mounted, the mount fails, migrations keep
//! their grace period, and creation still works.

use std::path::Path;

/// The name of runcell's controller-less hierarchy.
const NAME: &str = "runcell-dynmods";

/// Where it is mounted.
pub const MOUNT_POINT: &str = "/run/runcell/cgroup-dynmods";

/// Whether some cgroup hierarchy in `mountinfo` was mounted with
/// `favordynmods` (then migrations are already cheap).
pub fn favoured(mountinfo: &str) -> bool {
    mountinfo.lines().any(|line| {
        let Some((_, right)) = line.split_once(" - ") else {
            return false;
        };
        let mut fields = right.split(' ');
        let fstype = fields.next().unwrap_or("");
        let super_opts = fields.nth(1).unwrap_or("");
        matches!(fstype, "cgroup" | "cgroup2") && super_opts.split(',').any(|o| o == "favordynmods")
    })
}

/// Makes cgroup migrations cheap for every later sandbox (see the module
/// documentation). Returns whether they are; failures are logged, never
/// fatal.
pub fn enable() -> bool {
    let info = match std::fs::read_to_string("/proc/self/mountinfo") {
        Ok(i) => i,
        Err(e) => {
            tracing::debug!("cannot read the mount table: {e}");
            return false;
        }
    };
    if favoured(&info) {
        return true;
    }
    let dir = Path::new(MOUNT_POINT);
    if let Err(e) = std::fs::create_dir_all(dir) {
        tracing::debug!("cannot make {}: {e}", dir.display());
        return false;
    }
    let options = format!("none,name={NAME},favordynmods");
    match nix::mount::mount(
        Some("cgroup"),
        dir,
        Some("cgroup"),
        nix::mount::MsFlags::MS_NOSUID
            | nix::mount::MsFlags::MS_NODEV
            | nix::mount::MsFlags::MS_NOEXEC,
        Some(options.as_str()),
    ) {
        Ok(()) => {
            tracing::info!(
                "mounted the cgroup hierarchy {NAME} with favordynmods at {MOUNT_POINT}: \
                 moving a sandbox into its cgroup no longer waits for an RCU grace period"
            );
            true
        }
        Err(e) => {
            tracing::info!(
                "could not mount a cgroup hierarchy with favordynmods ({e}); \
                 each cold sandbox create waits for an RCU grace period"
            );
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn favoured_reads_super_options() {
        let plain = "32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu\n";
        assert!(!favoured(plain));
        let named = "42 27 0:40 / /run/runcell/cgroup-dynmods rw,relatime - cgroup cgroup rw,favordynmods,name=runcell-dynmods\n";
        assert!(favoured(&format!("{plain}{named}")));
        let v2 = "30 23 0:27 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw,nsdelegate,favordynmods\n";
        assert!(favoured(v2));
        // The option on another file system does not count.
        let tmpfs = "31 23 0:28 / /tmp rw - tmpfs tmpfs rw,favordynmods\n";
        assert!(!favoured(tmpfs));
    }

    #[test]
    fn enabling_leaves_a_favordynmods_hierarchy_mounted() {
        assert!(
            nix::unistd::geteuid().is_root(),
            "this test mounts a cgroup hierarchy: run it as root"
        );
        assert!(
            enable(),
            "no cgroup hierarchy could be mounted with favordynmods (Linux 6.0+ needed)"
        );
        let info = std::fs::read_to_string("/proc/self/mountinfo").expect("the mount table");
        assert!(favoured(&info), "no favordynmods mount in:\n{info}");
        // A second call finds it and mounts nothing more (counted among
        // favordynmods mounts only: other processes mount things too).
        let ours = |info: &str| info.lines().filter(|l| favoured(l)).count();
        let before = ours(&info);
        assert!(enable());
        let after = std::fs::read_to_string("/proc/self/mountinfo").expect("the mount table");
        assert_eq!(ours(&after), before, "a second call stacked another mount");
    }
}
