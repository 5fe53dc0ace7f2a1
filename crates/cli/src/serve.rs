//! `runcell serve`: every setting is a flag, an environment variable, or a
//! key in the TOML file given with `--config`. Flags and environment win
//! over the file; the file wins over the built-in defaults.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::Args;
use runcell_core::{parse_duration, parse_size, SandboxLimits};
use runcell_server::ServeConfig;
use serde::Deserialize;

use crate::report;

#[derive(Debug, Args)]
pub struct ServeArgs {
    /// TOML file with any of the settings below (keys as the flags, with `_`
    /// for `-`, e.g. `default_ttl = "10m"`, `[aliases] base = "host"`).
    #[arg(long, env = "RUNCELL_CONFIG")]
    config: Option<PathBuf>,
    /// Address and port to listen on. [default: 127.0.0.1:7070]
    #[arg(long, env = "RUNCELL_LISTEN")]
    listen: Option<SocketAddr>,
    /// Data directory: registry, API key, sandbox state. [default: /var/lib/runcell]
    #[arg(long, env = "RUNCELL_DATA_DIR")]
    data_dir: Option<PathBuf>,
    /// Idle time-to-live of a sandbox whose create request gives none. [default: 300s]
    #[arg(long, env = "RUNCELL_DEFAULT_TTL", value_parser = parse_duration)]
    default_ttl: Option<Duration>,
    /// Lifetime no sandbox may exceed, persistent or not. [default: 24h]
    #[arg(long, env = "RUNCELL_MAX_LIFETIME", value_parser = parse_duration)]
    max_lifetime: Option<Duration>,
    /// Default wall-clock limit of one exec. [default: 60s]
    #[arg(long, env = "RUNCELL_EXEC_TIMEOUT", value_parser = parse_duration)]
    exec_timeout: Option<Duration>,
    /// Largest timeout an exec may ask for. [default: 1h]
    #[arg(long, env = "RUNCELL_MAX_EXEC_TIMEOUT", value_parser = parse_duration)]
    max_exec_timeout: Option<Duration>,
    /// Default memory limit of a sandbox. [default: 1G]
    #[arg(long, env = "RUNCELL_MEMORY", value_parser = parse_size)]
    memory: Option<u64>,
    /// Default CPU limit of a sandbox, in cores. [default: 1.0]
    #[arg(long, env = "RUNCELL_CPUS")]
    cpus: Option<f64>,
    /// Default process limit of a sandbox. [default: 512]
    #[arg(long, env = "RUNCELL_PIDS")]
    pids: Option<u64>,
    /// Default writable-layer size of a sandbox. [default: 512M]
    #[arg(long, env = "RUNCELL_DISK", value_parser = parse_size)]
    disk: Option<u64>,
    /// Bytes of each of stdout and stderr kept per exec. [default: 1M]
    #[arg(long, env = "RUNCELL_OUTPUT_LIMIT", value_parser = parse_size)]
    output_limit: Option<u64>,
    /// Largest output limit (`limits.output_bytes`) a create request may ask
    /// for; larger ones are refused with 400. [default: 64M]
    #[arg(long, env = "RUNCELL_MAX_OUTPUT_BYTES", value_parser = parse_size)]
    max_output_bytes: Option<u64>,
    /// Largest request body (file uploads, code). [default: 32M]
    #[arg(long, env = "RUNCELL_MAX_BODY", value_parser = parse_size)]
    max_body: Option<u64>,
    /// Most sandboxes alive at once; creates beyond it get 503 with Retry-After. [default: 64]
    #[arg(long, env = "RUNCELL_MAX_SANDBOXES")]
    max_sandboxes: Option<usize>,
    /// Prepared sandboxes kept ready for fast creation. [default: 2]
    #[arg(long, env = "RUNCELL_STANDBY")]
    standby: Option<usize>,
    /// How long running requests may finish after SIGTERM/SIGINT. [default: 30s]
    #[arg(long, env = "RUNCELL_SHUTDOWN_GRACE", value_parser = parse_duration)]
    shutdown_grace: Option<Duration>,
    /// Warm pool, TEMPLATE=N (repeatable): N sandboxes of TEMPLATE kept
    /// ready, each with a Python context that has imported the template's
    /// preload modules. Templates that are not installed are skipped.
    /// [default: code-interpreter=2]
    #[arg(long = "warm-pool", env = "RUNCELL_WARM_POOLS", value_delimiter = ',', value_parser = parse_pool)]
    warm_pools: Vec<(String, usize)>,
    /// Template alias, NAME=TEMPLATE (repeatable), added to the defaults
    /// code-interpreter=host and ubuntu-24.04=host (naming one overrides it).
    #[arg(long = "alias", env = "RUNCELL_ALIASES", value_delimiter = ',', value_parser = parse_alias)]
    aliases: Vec<(String, String)>,
    /// Private or loopback destination sandboxes may reach through the
    /// egress proxy despite the always-closed ranges (repeatable): a CIDR
    /// (10.1.2.0/24), an address, ADDR:PORT (127.0.0.1:8080) or HOST:PORT
    /// (mirror.internal:443). Only the operator can open these; the API
    /// cannot.
    #[arg(long = "egress-allow-private", env = "RUNCELL_EGRESS_ALLOW_PRIVATE", value_delimiter = ',', value_parser = parse_private)]
    egress_allow_private: Vec<runcell_egress::PrivateException>,
    /// Most sandboxes one workspace may hold at once; creates beyond it get
    /// 429 with Retry-After. [default: when keys of more than one workspace
    /// exist, max-sandboxes less one in sixteen; else max-sandboxes]
    #[arg(long, env = "RUNCELL_WORKSPACE_MAX_SANDBOXES")]
    workspace_max_sandboxes: Option<usize>,
    /// Most memory (the sum of memory limits) one workspace's sandboxes may
    /// hold at once. [default: no quota]
    #[arg(long, env = "RUNCELL_WORKSPACE_MAX_MEMORY", value_parser = parse_size)]
    workspace_max_memory: Option<u64>,
    /// Most disk (the sum of disk limits) one workspace's sandboxes may hold
    /// at once. [default: no quota]
    #[arg(long, env = "RUNCELL_WORKSPACE_MAX_DISK", value_parser = parse_size)]
    workspace_max_disk: Option<u64>,
    /// Disk the snapshots of one workspace may take; a snapshot beyond it
    /// gets 507. [default: 10GiB]
    #[arg(long, env = "RUNCELL_SNAPSHOT_QUOTA", value_parser = parse_size)]
    snapshot_quota: Option<u64>,
    /// Disk the volumes of one workspace may take (the sum of their sizes);
    /// a volume beyond it gets 429. [default: 10GiB]
    #[arg(long, env = "RUNCELL_VOLUME_QUOTA", value_parser = parse_size)]
    volume_quota: Option<u64>,
    /// Hibernate persistent sandboxes whose idle TTL ran out instead of
    /// leaving them running (their files stay on disk, memory is freed;
    /// the next call wakes them). A sandbox's own `on_idle` wins.
    #[arg(long, env = "RUNCELL_IDLE_HIBERNATE", num_args = 0..=1, default_missing_value = "true")]
    idle_hibernate: Option<bool>,
    /// How long why and when a sandbox ended is kept (a 404 for it says
    /// so); never less than the maximum lifetime. [default: 7d]
    #[arg(long, env = "RUNCELL_TOMBSTONE_RETENTION", value_parser = parse_duration)]
    tombstone_retention: Option<Duration>,
    /// Build the bundled code-interpreter template (Debian with numpy,
    /// pandas, matplotlib) in the background on first start; until it is
    /// ready `code-interpreter` is served from `host`. A later start reuses
    /// the built template. [default: true]
    #[arg(long, env = "RUNCELL_AUTO_BUILD", num_args = 0..=1, default_missing_value = "true")]
    auto_build: Option<bool>,
    /// The isolation of a sandbox whose request and template name none:
    /// jail, gvisor or microvm (`runcell doctor` says which run here).
    /// [default: jail]
    #[arg(long, env = "RUNCELL_DEFAULT_ISOLATION")]
    default_isolation: Option<runcell_core::backend::Isolation>,
    /// Run microVMs under TCG emulation where KVM cannot run a guest (tens
    /// of times slower: for tests). [default: false]
    #[arg(long, env = "RUNCELL_ALLOW_EMULATION", num_args = 0..=1, default_missing_value = "true")]
    allow_emulation: Option<bool>,
    /// Where jail sandboxes write: `tmpfs` (a tmpfs each; a snapshot, fork
    /// or hibernation copies it), `btrfs` (a subvolume each on a sparse
    /// btrfs image in the data directory, `store.img`, loop-mounted at
    /// `store/`; needs mkfs.btrfs; saves are copy-on-write snapshots, O(1)
    /// whatever was written) or `auto` (btrfs where the kernel has it and
    /// mkfs.btrfs is installed, else tmpfs; `GET /v1/system` and `runcell
    /// doctor` say which and why). A graceful stop with no live sandbox
    /// unmounts the store; the next start mounts it again. [default: auto]
    #[arg(long, env = "RUNCELL_LAYER_STORE")]
    layer_store: Option<runcell_server::store::LayerStoreKind>,
    /// Cgroup parent of this daemon's sandboxes (two daemons on one host
    /// each take their own). [default: runcell]
    #[arg(long, env = "RUNCELL_CGROUP_PARENT")]
    cgroup_parent: Option<String>,
    /// Cluster mode: share keys, workspaces and sandbox records with the
    /// other nodes through etcd, e.g. etcd://10.0.0.1:2379,10.0.0.2:2379.
    /// Without it the daemon is a single node.
    #[arg(long, env = "RUNCELL_CLUSTER")]
    cluster: Option<String>,
    /// This node's name in the cluster. [default: the host name and port]
    #[arg(long, env = "RUNCELL_NODE_NAME", requires = "cluster")]
    node_name: Option<String>,
    /// The URL the other nodes reach this one at. [default: http:// and
    /// --listen, 127.0.0.1 for an unspecified address]
    #[arg(long, env = "RUNCELL_ADVERTISE", requires = "cluster")]
    advertise: Option<String>,
    /// In a cluster, a node that was away longer than this comes back to
    /// find its sandboxes reported lost and removes them instead of
    /// re-attaching them. [default: 60s]
    #[arg(long, env = "RUNCELL_LOST_AFTER", value_parser = parse_duration, requires = "cluster")]
    lost_after: Option<Duration>,
    /// A label of this node, key=value (repeatable; the environment
    /// variable takes a comma-separated list), for creates that ask for a
    /// `node_selector`. Keys and values follow Kubernetes' label syntax:
    /// `[dns.prefix/]name`, names and values at most 63 characters of
    /// letters, digits, '-', '_' and '.', alphanumeric at both ends.
    #[arg(
        long = "node-label",
        env = "RUNCELL_NODE_LABELS",
        value_delimiter = ',',
        requires = "cluster"
    )]
    node_labels: Vec<String>,
}

/// The TOML file. Durations and sizes are strings as on the command line.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    listen: Option<SocketAddr>,
    data_dir: Option<PathBuf>,
    default_ttl: Option<String>,
    max_lifetime: Option<String>,
    exec_timeout: Option<String>,
    max_exec_timeout: Option<String>,
    memory: Option<String>,
    cpus: Option<f64>,
    pids: Option<u64>,
    disk: Option<String>,
    output_limit: Option<String>,
    max_output_bytes: Option<String>,
    max_body: Option<String>,
    max_sandboxes: Option<usize>,
    standby: Option<usize>,
    shutdown_grace: Option<String>,
    aliases: Option<BTreeMap<String, String>>,
    warm_pools: Option<BTreeMap<String, usize>>,
    egress_allow_private: Option<Vec<String>>,
    workspace_max_sandboxes: Option<usize>,
    workspace_max_memory: Option<String>,
    workspace_max_disk: Option<String>,
    snapshot_quota: Option<String>,
    volume_quota: Option<String>,
    idle_hibernate: Option<bool>,
    tombstone_retention: Option<String>,
    auto_build: Option<bool>,
    default_isolation: Option<runcell_core::backend::Isolation>,
    allow_emulation: Option<bool>,
    layer_store: Option<runcell_server::store::LayerStoreKind>,
}

fn parse_private(s: &str) -> Result<runcell_egress::PrivateException, String> {
    s.parse()
        .map_err(|e: runcell_egress::ExceptionError| e.to_string())
}

fn parse_pool(s: &str) -> Result<(String, usize), String> {
    match s.split_once('=').map(|(a, b)| (a, b.parse::<usize>())) {
        Some((a, Ok(n))) if !a.is_empty() => Ok((a.into(), n)),
        _ => Err(format!("\"{s}\" is not TEMPLATE=COUNT")),
    }
}

fn parse_alias(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((a, b)) if !a.is_empty() && !b.is_empty() => Ok((a.into(), b.into())),
        _ => Err(format!("\"{s}\" is not NAME=TEMPLATE")),
    }
}

/// Merges flags (and environment), the file and the defaults.
fn settings(
    args: ServeArgs,
    templates_dir: Option<PathBuf>,
) -> Result<(ServeConfig, Duration), String> {
    let file: FileConfig = match &args.config {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .map_err(|e| format!("could not read the config file {}: {e}", path.display()))?;
            toml::from_str(&text)
                .map_err(|e| format!("the config file {} is invalid: {e}", path.display()))?
        }
        None => FileConfig::default(),
    };
    let dur = |flag: Option<Duration>,
               file: &Option<String>,
               key: &str,
               default: Duration|
     -> Result<Duration, String> {
        match (flag, file) {
            (Some(d), _) => Ok(d),
            (None, Some(s)) => parse_duration(s).map_err(|e| format!("config {key}: {e}")),
            (None, None) => Ok(default),
        }
    };
    let size = |flag: Option<u64>,
                file: &Option<String>,
                key: &str,
                default: u64|
     -> Result<u64, String> {
        match (flag, file) {
            (Some(v), _) => Ok(v),
            (None, Some(s)) => parse_size(s).map_err(|e| format!("config {key}: {e}")),
            (None, None) => Ok(default),
        }
    };
    let opt_size = |flag: Option<u64>, file: &Option<String>, key: &str| {
        file.as_ref()
            .map(|_| size(None, file, key, 0))
            .transpose()
            .map(|from_file| flag.or(from_file))
    };
    let d = ServeConfig::default();
    let l = d.default_limits;
    let cpus = args
        .cpus
        .or(file.cpus)
        .unwrap_or(l.cpu_millis as f64 / 1000.0);
    if !(cpus > 0.0 && cpus.is_finite()) {
        return Err("cpus must be a positive number".into());
    }
    // Absolute, as every path handed to a sandbox's setup must be
    // (whichever of the flag, the environment or the file gave it, against
    // the working directory).
    let data_dir = args.data_dir.or(file.data_dir).unwrap_or(d.data_dir);
    let data_dir = std::path::absolute(&data_dir).map_err(|e| {
        format!(
            "data_dir {} cannot be made an absolute path: {e}",
            data_dir.display()
        )
    })?;
    let max_output_bytes = size(
        args.max_output_bytes,
        &file.max_output_bytes,
        "max_output_bytes",
        d.max_output_bytes,
    )?;
    let output_limit = size(
        args.output_limit,
        &file.output_limit,
        "output_limit",
        l.output_bytes,
    )?;
    if max_output_bytes == 0 || output_limit > max_output_bytes {
        return Err(format!(
            "max_output_bytes ({max_output_bytes}) must be positive and at least output_limit ({output_limit})"
        ));
    }
    let config = ServeConfig {
        listen: args.listen.or(file.listen).unwrap_or(d.listen),
        // Templates live in the data directory unless --templates-dir says
        // otherwise (the default matches `runcell template build`'s).
        templates_dir: Some(templates_dir.unwrap_or_else(|| data_dir.join("templates"))),
        data_dir,
        // Aliases add to the defaults (code-interpreter and ubuntu-24.04 are
        // served from host until installed), the file's first, then the
        // flags'; naming a default alias overrides it.
        aliases: {
            let mut aliases = d.aliases;
            aliases.extend(file.aliases.unwrap_or_default());
            aliases.extend(args.aliases);
            aliases
        },
        default_ttl_seconds: dur(
            args.default_ttl,
            &file.default_ttl,
            "default_ttl",
            Duration::from_secs(d.default_ttl_seconds),
        )?
        .as_secs(),
        max_lifetime: dur(
            args.max_lifetime,
            &file.max_lifetime,
            "max_lifetime",
            d.max_lifetime,
        )?,
        default_limits: SandboxLimits {
            memory_bytes: size(args.memory, &file.memory, "memory", l.memory_bytes)?,
            pids: args.pids.or(file.pids).unwrap_or(l.pids),
            cpu_millis: runcell_protocol::units::cpu_millis(cpus),
            disk_bytes: size(args.disk, &file.disk, "disk", l.disk_bytes)?,
            timeout: dur(
                args.exec_timeout,
                &file.exec_timeout,
                "exec_timeout",
                l.timeout,
            )?,
            output_bytes: output_limit,
        },
        max_exec_timeout: dur(
            args.max_exec_timeout,
            &file.max_exec_timeout,
            "max_exec_timeout",
            d.max_exec_timeout,
        )?,
        max_body_bytes: usize::try_from(size(
            args.max_body,
            &file.max_body,
            "max_body",
            d.max_body_bytes as u64,
        )?)
        .unwrap_or(usize::MAX),
        max_output_bytes,
        standby: args.standby.or(file.standby).unwrap_or(d.standby),
        max_sandboxes: args
            .max_sandboxes
            .or(file.max_sandboxes)
            .unwrap_or(d.max_sandboxes),
        cgroup_parent: args.cgroup_parent.unwrap_or(d.cgroup_parent),
        mcp_template: d.mcp_template,
        warm_pools: if !args.warm_pools.is_empty() {
            args.warm_pools.into_iter().collect()
        } else {
            file.warm_pools.unwrap_or(d.warm_pools)
        },
        egress_allow_private: if !args.egress_allow_private.is_empty() {
            args.egress_allow_private
        } else {
            file.egress_allow_private
                .unwrap_or_default()
                .iter()
                .map(|s| parse_private(s))
                .collect::<Result<_, _>>()?
        },
        workspace_quota: runcell_server::WorkspaceQuota {
            sandboxes: args
                .workspace_max_sandboxes
                .or(file.workspace_max_sandboxes),
            memory_bytes: opt_size(
                args.workspace_max_memory,
                &file.workspace_max_memory,
                "workspace_max_memory",
            )?,
            disk_bytes: opt_size(
                args.workspace_max_disk,
                &file.workspace_max_disk,
                "workspace_max_disk",
            )?,
        },
        snapshot_quota_bytes: opt_size(
            args.snapshot_quota,
            &file.snapshot_quota,
            "snapshot_quota",
        )?
        .unwrap_or(d.snapshot_quota_bytes),
        volume_quota_mb: opt_size(args.volume_quota, &file.volume_quota, "volume_quota")?
            .map_or(d.volume_quota_mb, |b| b >> 20),
        idle_hibernate: args
            .idle_hibernate
            .or(file.idle_hibernate)
            .unwrap_or(d.idle_hibernate),
        tombstone_retention: dur(
            args.tombstone_retention,
            &file.tombstone_retention,
            "tombstone_retention",
            d.tombstone_retention,
        )?,
        auto_build: args.auto_build.or(file.auto_build).unwrap_or(d.auto_build),
        default_isolation: args
            .default_isolation
            .or(file.default_isolation)
            .unwrap_or(d.default_isolation),
        allow_emulation: args
            .allow_emulation
            .or(file.allow_emulation)
            .unwrap_or(d.allow_emulation),
        layer_store: args
            .layer_store
            .or(file.layer_store)
            .unwrap_or(d.layer_store),
        cluster: None,
    };
    let config = ServeConfig {
        cluster: match args.cluster {
            None => None,
            Some(url) => Some(cluster_config(
                &url,
                args.node_name,
                args.advertise,
                args.lost_after.unwrap_or(Duration::from_secs(60)),
                &args.node_labels,
                config.listen,
            )?),
        },
        ..config
    };
    let grace = dur(
        args.shutdown_grace,
        &file.shutdown_grace,
        "shutdown_grace",
        Duration::from_secs(30),
    )?;
    Ok((config, grace))
}

/// Cluster settings from `--cluster`, `--node-name`, `--advertise` and
/// `--node-label`.
fn cluster_config(
    url: &str,
    node_name: Option<String>,
    advertise: Option<String>,
    lost_after: Duration,
    node_labels: &[String],
    listen: SocketAddr,
) -> Result<runcell_server::cluster::ClusterConfig, String> {
    let endpoints = runcell_server::cluster::parse_url(url).map_err(|e| e.to_string())?;
    let labels = runcell_server::cluster::labels::parse_node_labels(node_labels)
        .map_err(|e| format!("--node-label: {e}"))?;
    let host = if listen.ip().is_unspecified() {
        std::net::IpAddr::from([127, 0, 0, 1])
    } else {
        listen.ip()
    };
    let node_name = node_name.unwrap_or_else(|| {
        let h = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
        format!("{}-{}", h.trim(), listen.port())
    });
    Ok(runcell_server::cluster::ClusterConfig {
        endpoints,
        node_name,
        advertise: advertise
            .unwrap_or_else(|| format!("http://{}", SocketAddr::new(host, listen.port()))),
        lost_after,
        labels,
    })
}

pub fn main(args: ServeArgs, templates_dir: Option<PathBuf>) -> ExitCode {
    let (config, grace) = match settings(args, templates_dir) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("runcell: {e}");
            return ExitCode::from(2);
        }
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("runcell: could not start: {e}");
            return ExitCode::from(125);
        }
    };
    match runtime.block_on(runcell_server::serve(config, grace)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            report(&e);
            ExitCode::from(1)
        }
    }
}
