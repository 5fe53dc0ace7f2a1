//! The JSON objects the API answers with. Routes build these (never ad-hoc
//! JSON for them), and the OpenAPI document is generated from the same types.

use std::collections::BTreeMap;

use serde::Serialize;
use utoipa::ToSchema;

/// runcell's per-sandbox limits.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct LimitsView {
    /// Memory, MiB (files written in the sandbox count too).
    pub memory_mb: u64,
    /// CPU, cores.
    pub cpu: f64,
    /// Processes and threads.
    pub pids: u64,
    /// Writable layer, MiB.
    pub disk_mb: u64,
    /// Default exec timeout, seconds.
    pub timeout_seconds: f64,
    /// Bytes of each of stdout and stderr kept per exec.
    pub output_bytes: u64,
}

/// The sandbox's network policy and what went through its egress proxy.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct NetworkView {
    /// `none` (loopback only), `allowlist` or `open`.
    pub mode: String,
    /// Host rules of an allowlist (`pypi.org`, `*.example.com:443`).
    pub allow: Vec<String>,
    /// Presets of an allowlist (`package-index`).
    pub presets: Vec<String>,
    /// Bytes received from the network.
    pub bytes_in: u64,
    /// Bytes sent to the network.
    pub bytes_out: u64,
    /// Connections the proxy made.
    pub connections_allowed: u64,
    /// Requests the proxy refused.
    pub connections_refused: u64,
    /// The most recently refused host names.
    pub refused_hosts: Vec<String>,
}

/// A sandbox (PandaStack fields plus runcell's `limits` and `network`).
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct SandboxView {
    /// UUID.
    pub id: String,
    /// Template name as requested.
    pub template: String,
    /// CPU cores, rounded up.
    pub cpu: u64,
    /// Memory, MiB.
    pub memory_mb: u64,
    /// `running`, `paused` (frozen by `pause` until `resume`), or
    /// `hibernated` (its processes ended, its files kept; the next exec,
    /// file or code call wakes it).
    pub status: String,
    /// Caller metadata (`workspace` is stamped by the server).
    pub metadata: BTreeMap<String, String>,
    /// RFC 3339.
    pub created_at: String,
    /// Exempt from the idle TTL.
    pub persistent: bool,
    /// Idle time-to-live, seconds.
    pub ttl_seconds: u64,
    /// runcell's limits.
    pub limits: LimitsView,
    /// runcell's network policy.
    pub network: NetworkView,
    /// The isolation backend it runs under: `jail`, `gvisor` or `microvm`.
    #[schema(value_type = IsolationName)]
    pub isolation: String,
    /// Milliseconds the create took (create responses only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub boot_ms: Option<u64>,
    /// The snapshot it started from.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub from_snapshot: Option<String>,
    /// The sandbox it was forked from.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub forked_from: Option<String>,
    /// What it becomes when its idle TTL runs out: `delete` or `hibernate`.
    #[schema(value_type = String)]
    pub on_idle: crate::snapshots::OnIdle,
    /// `true` once it was hibernated and woken, or started from a gVisor
    /// snapshot or fork whose memory could not be restored: its files are
    /// as they were, but processes and code contexts (their variables)
    /// are gone.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub state_lost: bool,
    /// Its volumes: name, where mounted, read-only or not.
    pub volumes: Vec<crate::volumes::VolumeAttach>,
}

/// The result of an exec. On a timeout the same fields come with a 500 and
/// an `error` that contains "timeout".
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ExecView {
    /// Standard output (capped; a marker line gives the total when cut).
    pub stdout: String,
    /// Standard error (capped likewise).
    pub stderr: String,
    /// Exit status (128 + signal when killed; 124 on timeout).
    pub exit_code: i32,
    /// Wall-clock duration.
    pub duration_ms: u64,
    /// The exec hit its timeout.
    pub timed_out: bool,
    /// A process was killed for exceeding the memory limit.
    pub oom_killed: bool,
    /// The process limit was reached.
    pub pids_limit: bool,
    /// Stdout was cut.
    pub stdout_truncated: bool,
    /// Stderr was cut.
    pub stderr_truncated: bool,
    /// Total bytes written to stdout.
    pub stdout_bytes: u64,
    /// Total bytes written to stderr.
    pub stderr_bytes: u64,
    /// Plain sentences about every limit hit.
    pub messages: Vec<String>,
}

/// TTL state.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct LifecycleView {
    /// Idle time-to-live, seconds.
    pub ttl_seconds: u64,
    /// Exempt from the idle TTL.
    pub persistent: bool,
    /// Seconds since the last activity.
    pub idle_seconds: i64,
}

/// A file or directory.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct FileView {
    /// Base name.
    pub name: String,
    /// Is a directory.
    pub is_dir: bool,
    /// Bytes.
    pub size: u64,
    /// `f`, `d` or `l` (as PandaStack's `find %y`).
    pub mode: String,
    /// Unix seconds.
    pub mtime: i64,
    /// Permission bits, octal.
    pub permissions: String,
}

/// A directory listing.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct DirView {
    /// The directory.
    pub path: String,
    /// Its entries.
    pub entries: Vec<FileView>,
}

/// The result of a file write.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct WrittenView {
    /// The path as given.
    pub path: String,
    /// Bytes written.
    pub bytes: u64,
}

/// A template.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct TemplateView {
    /// Name.
    pub name: String,
    /// Always empty (templates are directories and layers, not images).
    pub rootfs_path: String,
    /// Disk use of its layers, bytes (0 for `host` and directory templates).
    pub size_bytes: u64,
    /// Default CPU, cores.
    pub cpu: u64,
    /// Default memory, MiB.
    pub memory_mb: u64,
    /// Built in or operator-installed.
    pub is_global: bool,
    /// One line.
    pub description: String,
    /// The installed template this alias resolves to.
    pub alias_of: Option<String>,
    /// What the template's recipe declares (`LABEL runcell.*`); absent
    /// fields are not set by the template.
    pub defaults: TemplateDefaultsView,
    /// When it was built, unix seconds (absent for `host`).
    pub created_at: Option<u64>,
}

/// A template's declared defaults.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct TemplateDefaultsView {
    /// Memory limit, bytes.
    pub memory_bytes: Option<u64>,
    /// CPU, thousandths of a core.
    pub cpu_millis: Option<u64>,
    /// Default exec timeout, seconds.
    pub timeout_secs: Option<u64>,
    /// Default network egress policy of the template's sandboxes
    /// (`none`, `open`, `allowlist:RULE;RULE` or a JSON policy).
    pub network: Option<String>,
    /// Python modules a warm context preloads.
    pub preload: Vec<String>,
}

/// Who the key belongs to.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct MeView {
    /// The workspace.
    pub user_id: String,
    /// Always empty.
    pub email: String,
    /// Always null.
    pub current_org: Option<String>,
    /// Always empty.
    pub orgs: Vec<String>,
    /// `token`.
    pub auth_method: String,
}

/// The network mode of a sandbox.
#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum NetworkModeName {
    /// Loopback only.
    None,
    /// Only the hosts of `allow` and `presets`, through the egress proxy.
    Allowlist,
    /// Any public host, through the egress proxy.
    Open,
}

/// A network policy as callers send it: a mode (`"none"`, `"open"`), or an
/// object. Private and loopback addresses are never reachable.
#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(untagged)]
pub enum NetworkPolicyReq {
    /// A mode alone.
    Mode(NetworkModeName),
    /// A mode with an allowlist.
    Policy(NetworkPolicyObject),
}

/// A network policy object. `allow` and `presets` need mode `allowlist`
/// (the default when either is given).
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct NetworkPolicyObject {
    /// The mode; `allowlist` when `allow` or `presets` is given, else `none`.
    pub mode: Option<NetworkModeName>,
    /// Host rules: `pypi.org`, `*.example.com`, `example.com:443`.
    #[serde(default)]
    pub allow: Vec<String>,
    /// Named rule sets, e.g. `package-index`.
    #[serde(default)]
    pub presets: Vec<String>,
}

/// The kinds of event of `exec/stream`.
#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum ExecStreamEventName {
    /// `{"chunk": "..."}`: output (`{"data": base64}` with `exact_output`).
    Stdout,
    /// `{"chunk": "..."}`: output, and runcell's notes on limits hit
    /// (`{"data": base64}`, output only, with `exact_output`).
    Stderr,
    /// `{"exit_code", "oom_killed", "pids_limit"}`: the last event (with
    /// `exact_output` also `timed_out` and `messages`, the notes on limits).
    Exit,
    /// `{"error": "..."}`: the last event (a timeout contains "timeout").
    Error,
}

/// One server-sent event of `exec/stream`.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ExecStreamEvent {
    /// What the event is.
    pub event: ExecStreamEventName,
    /// A JSON object (see the event names).
    #[schema(content_media_type = "application/json")]
    pub data: String,
}

/// The kinds of event of a followed log.
#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum LogEventName {
    /// `{"line": "..."}`.
    Line,
}

/// One server-sent event of `logs?follow=1`.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct LogEvent {
    /// Always `line`.
    pub event: LogEventName,
    /// `{"line": "..."}`, JSON.
    #[schema(content_media_type = "application/json")]
    pub data: String,
}

/// Liveness.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct HealthView {
    /// `ok`.
    pub status: String,
}

/// Every error.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ErrorView {
    /// A sentence.
    pub error: String,
}

/// A code context (a PandaStack REPL session).
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct SessionView {
    /// Session id (16 hex digits).
    pub id: String,
    /// The same id, under the name PandaStack's docs use.
    pub session_id: String,
    /// The sandbox.
    pub sandbox_id: String,
    /// `python`, `javascript` or `bash`.
    pub language: String,
    /// RFC 3339.
    pub created_at: String,
    /// Cells run so far.
    pub cells: u64,
    /// Times the interpreter was restarted (state is lost each time).
    pub restarts: u64,
    /// Preload modules that failed to import.
    pub preload_errors: Vec<String>,
}

/// An exception raised by a cell.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ExceptionView {
    /// Class name, e.g. `ZeroDivisionError`.
    pub name: String,
    /// Its message.
    pub value: String,
    /// The traceback, showing the cell's lines.
    pub traceback: String,
}

/// The result of a cell. On a timeout the same fields come with a 500 and an
/// `error` that contains "timeout".
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct CellView {
    /// Standard output (capped; a marker line gives the total when cut).
    pub stdout: String,
    /// Standard error (capped likewise).
    pub stderr: String,
    /// 0; 1 after an uncaught exception; the SystemExit code; 128 + signal
    /// when the interpreter died.
    pub exit: i32,
    /// The same as `exit`.
    pub exit_code: i32,
    /// MIME bundles: the last expression's value, display() calls, figures.
    #[schema(value_type = Vec<Object>)]
    pub results: Vec<std::collections::BTreeMap<String, String>>,
    /// Wall-clock duration.
    pub duration_ms: u64,
    /// The traceback of an uncaught exception, or what happened to the
    /// interpreter; absent when the cell succeeded.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// The uncaught exception, structured.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub exception: Option<ExceptionView>,
    /// The cell hit its timeout.
    pub timed_out: bool,
    /// The interpreter was restarted during this cell: earlier state is gone.
    pub state_lost: bool,
    /// How the interpreter died, when it did.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub crashed: Option<String>,
    /// A process was killed for exceeding the memory limit.
    pub oom_killed: bool,
    /// Stdout was cut.
    pub stdout_truncated: bool,
    /// Stderr was cut.
    pub stderr_truncated: bool,
    /// Total bytes written to stdout.
    pub stdout_bytes: u64,
    /// Total bytes written to stderr.
    pub stderr_bytes: u64,
    /// Plain sentences about what went wrong.
    pub messages: Vec<String>,
}

/// One security layer of the host, as the kernel really provides it.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct LayerView {
    /// `user_namespaces`, `seccomp`, `landlock`, `cgroups`,
    /// `oom_kill_reporting` or `kvm`.
    pub name: String,
    /// Whether runcell can rely on it here.
    pub available: bool,
    /// What was found, or why not.
    pub detail: String,
}

/// One isolation backend on this host.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct BackendView {
    /// The value of `isolation`: `jail`, `gvisor` or `microvm`.
    pub name: String,
    /// Whether sandboxes can be created with it on this daemon.
    pub available: bool,
    /// Sandboxes get it when neither the request nor the template names one.
    pub default: bool,
    /// What it enforces here, or why it is not available.
    pub detail: String,
    /// Its sandboxes can be paused (frozen in place).
    pub pause: bool,
    /// Its sandboxes' files can be saved: snapshots, forks, hibernation.
    pub save_files: bool,
    /// Running processes and memory are saved too, where it was verified
    /// here (gVisor: hibernation, snapshots and forks checkpoint them, and
    /// a wake, a create from the snapshot or the fork restores them;
    /// `state_detail` says how).
    pub save_memory: bool,
    /// What is saved, or why not.
    pub state_detail: String,
}

/// What this host enforces and which isolation backends it runs.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct SystemView {
    /// Kernel release.
    pub kernel: String,
    /// The cgroup layout: `v1`, `v2`, `hybrid` or `none`.
    pub cgroup_version: String,
    /// Writable cgroup controllers.
    pub cgroup_controllers: Vec<String>,
    /// The landlock ABI version (0: none).
    pub landlock_abi: u32,
    /// The kernel's security layers.
    pub layers: Vec<LayerView>,
    /// Every isolation backend, available or not.
    pub backends: Vec<BackendView>,
    /// The isolation of a sandbox that does not ask.
    pub default_isolation: String,
    /// Where jail sandboxes' writable layers live, and what a save costs.
    pub layer_store: LayerStoreView,
}

/// The daemon's layer store (`runcell serve --layer-store`).
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct LayerStoreView {
    /// `btrfs` (a subvolume per sandbox on a loop-mounted image) or
    /// `tmpfs` (a tmpfs per sandbox).
    pub kind: String,
    /// Saves (snapshots, forks, hibernation) are copy-on-write: O(1)
    /// whatever the sandbox wrote, and forks share one copy on disk.
    pub copy_on_write: bool,
    /// What a save does.
    pub detail: String,
    /// Why this store runs: `--layer-store` asked for it, or with `auto`
    /// (the default) what made btrfs possible or not here.
    pub reason: String,
}

/// An isolation backend (runcell extension; see `GET /v1/system`).
#[derive(Debug, Clone, Copy, Serialize, ToSchema)]
#[serde(rename_all = "lowercase")]
#[schema(as = Isolation)]
pub enum IsolationName {
    /// Namespaces, seccomp, Landlock and cgroups on the host's kernel.
    Jail,
    /// gVisor's user-space kernel (runsc).
    Gvisor,
    /// A microVM with its own guest kernel.
    Microvm,
}
