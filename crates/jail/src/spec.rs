//! What the host tells the agent about the sandbox it must build.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// How the sandbox's root filesystem is assembled. Both kinds put a private,
/// size-capped writable layer (tmpfs) over read-only lower layers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum RootfsSpec {
    /// The built-in `host` template: selected host directories (normally `/usr`)
    /// are overlaid read-only at the same place, host symlinks such as
    /// `/bin -> usr/bin` are recreated, and a handful of named `/etc` entries
    /// (certificates, `alternatives`, `ld.so.cache`) are bound read-only.
    Host {
        /// Absolute host paths: directories are overlaid, symlinks copied.
        paths: Vec<PathBuf>,
        /// Names under the host's `/etc` to expose read-only.
        etc: Vec<String>,
    },
    /// A template root directory (a complete tree), overlaid as the root.
    Directory {
        /// The template's root tree on the host.
        path: PathBuf,
    },
    /// A layered template (built by `runcell template build`): its layer
    /// directories are overlaid as the root, topmost first. The image's own
    /// `/etc/passwd` and `/etc/group` are kept; `hosts`, `hostname` and
    /// `resolv.conf` are bind-mounted over the image's, so nothing is written
    /// into the root when the sandbox starts.
    Layers {
        /// Layer directories on the host, topmost first.
        lowers: Vec<PathBuf>,
        /// Where the writable layer goes. Absent: the private tmpfs, as for
        /// every other kind. Present (template builds only): this host
        /// directory, which must hold `diff` and `work` subdirectories owned
        /// by root of the sandbox; what the sandbox writes lands in `diff`
        /// and outlives it, to become the next layer.
        #[serde(default)]
        persist: Option<PathBuf>,
    },
}

/// The unprivileged user that sandboxed code runs as.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SandboxUser {
    /// User name inside.
    pub name: String,
    /// Uid inside the sandbox (never 0).
    pub uid: u32,
    /// Gid inside the sandbox (never 0).
    pub gid: u32,
    /// Home directory inside.
    pub home: String,
}

impl Default for SandboxUser {
    fn default() -> Self {
        Self {
            name: "user".into(),
            uid: 1000,
            gid: 1000,
            home: "/home/user".into(),
        }
    }
}

/// How ids inside the sandbox map to host ids: inside `0..count` is host
/// `host_base..host_base+count`. `host_base` is never 0, so root inside is an
/// unprivileged host id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct IdMap {
    /// First host id of the range.
    pub host_base: u32,
    /// Number of ids mapped.
    pub count: u32,
}

impl Default for IdMap {
    fn default() -> Self {
        Self {
            host_base: 1_000_000_000,
            count: 65_536,
        }
    }
}

/// Resource limits enforced by cgroups and the writable layer's size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Limits {
    /// Memory (including the writable layer, which lives in memory), bytes.
    pub memory_bytes: u64,
    /// Maximum number of processes and threads.
    pub pids: u64,
    /// CPU bandwidth in thousandths of a core (1000 = one core).
    pub cpu_millis: u64,
    /// Size of the writable layer, bytes.
    pub disk_bytes: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            memory_bytes: 1 << 30,
            pids: 512,
            cpu_millis: 1000,
            disk_bytes: 512 << 20,
        }
    }
}

/// The message the host sends the agent right after it starts.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InitSpec {
    /// Sandbox id.
    pub sandbox_id: String,
    /// Host name inside.
    pub hostname: String,
    /// Host directory where the writable layer is mounted (in the sandbox's
    /// own mount namespace only; the host sees an empty directory). Where
    /// it is a btrfs subvolume (the host's btrfs layer store made it), it
    /// is the writable layer itself, on disk, and nothing is mounted on it.
    pub staging_dir: PathBuf,
    /// The root filesystem.
    pub rootfs: RootfsSpec,
    /// Writable layer size, bytes.
    pub disk_bytes: u64,
    /// The sandbox user.
    pub user: SandboxUser,
    /// Stop the sandbox when the host end of the setup socket closes
    /// (one-shot sandboxes owned by a CLI process).
    pub exit_on_host_close: bool,
    /// Hard deadline (unix ms) after which the agent stops the sandbox itself.
    pub deadline_unix_ms: Option<u64>,
    /// The sandbox shares the host's network namespace (template builds
    /// only; never reachable from the API). It then sees the host's
    /// `/etc/resolv.conf` and `/etc/hosts`, read-only.
    #[serde(default)]
    pub host_network: bool,
    /// Environment every process in the sandbox starts with (the template's
    /// `ENV`), under what a request adds.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Default working directory of processes (the template's `WORKDIR`);
    /// the user's home when absent.
    #[serde(default)]
    pub workdir: Option<String>,
    /// Host path of the sandbox's egress socket (`<state>/<id>/egress/sock`,
    /// served by the host's egress proxy), bind-mounted at
    /// [`EGRESS_SOCKET`] where only root of the sandbox (the agent) can
    /// connect to it. Absent: the sandbox has no egress at all.
    #[serde(default)]
    pub egress_socket: Option<PathBuf>,
    /// The agent starts with its proxy listener (`127.0.0.1:3128`) up and
    /// gives processes the proxy environment (the policy is not `none`).
    #[serde(default)]
    pub egress_enabled: bool,
    /// Layers of sandbox state (a snapshot's or a hibernated sandbox's
    /// files: host directories, topmost first) laid read-only between the
    /// template and the writable layer, so the sandbox starts with the files
    /// they hold.
    #[serde(default)]
    pub state_layers: Vec<PathBuf>,
    /// Host directories bound into the sandbox (volumes).
    #[serde(default)]
    pub mounts: Vec<BindMount>,
    /// Sent by a standby's host before any claim, with what the last
    /// claim asked for: the agent lays out the root filesystem now and
    /// waits for the claim's own spec. When that spec builds the same root
    /// ([`InitSpec::builds_same_root`]) the claim only enters it; else the
    /// agent takes what it laid down apart and builds the claim's.
    #[serde(default)]
    pub ahead: bool,
}

impl InitSpec {
    /// Whether `other` asks for the root filesystem this spec lays out:
    /// the same in everything but what only matters once the root is laid
    /// out (the deadline, the tie to the host, the processes' environment
    /// and working directory, whether the egress proxy listens), the
    /// writable layer's size (resized in place) and [`InitSpec::ahead`].
    pub fn builds_same_root(&self, other: &InitSpec) -> bool {
        let mut other = other.clone();
        other.deadline_unix_ms = self.deadline_unix_ms;
        other.exit_on_host_close = self.exit_on_host_close;
        other.env.clone_from(&self.env);
        other.workdir.clone_from(&self.workdir);
        other.egress_enabled = self.egress_enabled;
        other.disk_bytes = self.disk_bytes;
        other.ahead = self.ahead;
        *self == other
    }
}

/// A host directory bound into the sandbox.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BindMount {
    /// The host directory.
    pub source: PathBuf,
    /// Where it appears inside the sandbox: an absolute path with no `..`.
    pub target: PathBuf,
    /// Mounted read-only.
    pub read_only: bool,
}

/// The agent keeps its writable layer's directory open on this descriptor
/// (`O_PATH`, close-on-exec), so the host can reach the layer through
/// `/proc/<agent>/fd/5` (to snapshot it) after the sandbox has pivoted away
/// from every path that leads there.
pub const STAGE_FD: i32 = 5;

/// Where the egress socket appears inside the sandbox. Its directory, not
/// the socket file, is bind-mounted from the host, so a socket the host
/// binds again at the same path (a restarted daemon) is the one the agent
/// reaches.
pub const EGRESS_SOCKET: &str = "/run/runcell/egress/sock";

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> InitSpec {
        InitSpec {
            sandbox_id: "a".into(),
            hostname: "runcell-a".into(),
            staging_dir: "/state/a/rootfs".into(),
            rootfs: RootfsSpec::Directory {
                path: "/templates/t/rootfs".into(),
            },
            disk_bytes: 64 << 20,
            user: SandboxUser::default(),
            exit_on_host_close: false,
            deadline_unix_ms: None,
            host_network: false,
            env: BTreeMap::new(),
            workdir: None,
            egress_socket: None,
            egress_enabled: false,
            state_layers: Vec::new(),
            mounts: Vec::new(),
            ahead: true,
        }
    }

    #[test]
    fn a_root_laid_out_ahead_serves_a_claim_that_differs_only_in_what_comes_after_it() {
        let ahead = spec();
        let claim = InitSpec {
            ahead: false,
            deadline_unix_ms: Some(1),
            exit_on_host_close: true,
            env: BTreeMap::from([("A".into(), "1".into())]),
            workdir: Some("/work".into()),
            egress_enabled: true,
            disk_bytes: 1 << 30,
            ..spec()
        };
        assert!(ahead.builds_same_root(&claim));
        let others = [
            InitSpec {
                rootfs: RootfsSpec::Directory {
                    path: "/templates/u/rootfs".into(),
                },
                ..claim.clone()
            },
            InitSpec {
                hostname: "runcell-b".into(),
                ..claim.clone()
            },
            InitSpec {
                mounts: vec![BindMount {
                    source: "/volumes/v".into(),
                    target: "/data".into(),
                    read_only: false,
                }],
                ..claim.clone()
            },
            InitSpec {
                egress_socket: Some("/state/a/egress/sock".into()),
                ..claim.clone()
            },
            InitSpec {
                user: SandboxUser {
                    uid: 1001,
                    ..SandboxUser::default()
                },
                ..claim.clone()
            },
            InitSpec {
                state_layers: vec!["/snapshots/s".into()],
                ..claim.clone()
            },
        ];
        for other in others {
            assert!(!ahead.builds_same_root(&other), "{other:?}");
        }
    }
}
