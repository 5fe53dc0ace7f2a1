//! The jail backend: a Linux sandbox built from namespaces, an overlay root,
//! seccomp and cgroups. Every raw syscall and `unsafe` block of runcell lives
//! in this crate, behind a narrow API:
//!
//! * [`Jail::spawn`] (host side) creates cgroups, clones the agent into new
//!   user, pid, mount, net, ipc and uts namespaces, writes its id maps and waits
//!   until the sandbox is ready; [`Standby::prepare`] ([`PrepareConfig`]) and
//!   [`Standby::start`] ([`StartConfig`]) are its two halves. `runcell-core`
//!   uses it as its `JailBackend`.
//! * [`inside::bootstrap`] (sandbox side, run by the agent as PID 1) builds the
//!   root filesystem, pivots into it and brings up loopback.
//! * [`seccomp`] builds the syscall filter every sandboxed process runs under,
//!   and [`inside::drop_privileges`] turns a forked child into the unprivileged
//!   sandbox user.
//! * [`gvisor`] does both sides for gVisor sandboxes: the host composes
//!   their root filesystem, and the agent (`gvisor-init`) gets its spec and
//!   binds its socket through host unix sockets.
//! * [`idmap_mount`] (host side) mounts a volume for a gVisor sandbox
//!   through the jail's id map inverted, so both kinds of sandbox keep the
//!   same owners on it.
//! * [`SandboxCommand`] (sandbox side) starts a [`std::process::Command`] as
//!   the sandbox user, so the agent needs no `unsafe` `pre_exec` of its own.
//!
//! See docs/SECURITY.md for what each layer stops.

pub mod btrfs;
pub mod cgroup;
pub mod clock;
mod command;
pub mod confine;
pub mod forkserver;
pub mod gvisor;
pub mod host_tools;
pub mod idmap_mount;
pub mod inside;
pub mod layer;
pub mod probe;
pub mod seccomp;
pub mod socket;
mod spawn;
mod spec;
mod sys;
pub mod zygote;

pub use sys::{finit_module, thread_count, trim_heap};

/// How long a host-side wait on a sandbox's processes sleeps between looks
/// (runsc starting a container, an agent connecting, a killed cgroup's
/// release): every create or destroy pays up to one tick per wait, so it
/// is short, and each look is one cheap system call.
pub const WAIT_TICK: std::time::Duration = std::time::Duration::from_micros(250);

pub use command::{SandboxCommand, MAX_EXTRA_FDS};
pub use spawn::{
    check_id, list_sandboxes, log_tail, read_setup_answer, EgressSocket, Jail, PrepareConfig,
    SetupAnswer, SpawnError, Standby, StartConfig,
};
pub use spec::{
    BindMount, IdMap, InitSpec, Limits, RootfsSpec, SandboxUser, EGRESS_SOCKET, STAGE_FD,
};
