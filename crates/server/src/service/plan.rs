//! The decisions of the service, without a runtime: what a create may ask
//! for and what it gets (TTL, limits, network), whether there is room, and
//! how a lifecycle change applies. Each is a function of the daemon's
//! settings and the request, so the unit tests below drive them directly.

use std::collections::BTreeMap;

use axum::http::StatusCode;
use runcell_core::{SandboxLimits, TemplateDefaults};
use runcell_egress::NetworkPolicy;

use crate::error::ApiError;
use crate::limits::LimitsReq;
use crate::registry::Record;
use crate::state::ServeConfig;
use crate::validate;

/// What a create asks for.
#[derive(Debug, Default)]
pub(crate) struct CreateSpec {
    /// Template or alias; `host` when absent.
    pub(crate) template: Option<String>,
    /// Idle TTL, seconds; the daemon's default when absent.
    pub(crate) ttl_seconds: Option<f64>,
    /// Exempt from the idle TTL.
    pub(crate) persistent: Option<bool>,
    /// Caller metadata (`workspace`, `kind` and `app.id` are the server's).
    pub(crate) metadata: BTreeMap<String, String>,
    /// A snapshot id to start from (resolved by the service).
    pub(crate) from_snapshot: Option<String>,
    /// Limits over the template's defaults.
    pub(crate) limits: Option<LimitsReq>,
    /// Environment of every run.
    pub(crate) env: BTreeMap<String, String>,
    /// Network policy; the template's, else none, when absent.
    pub(crate) network: Option<NetworkPolicy>,
    /// Isolation backend; the template's, else the daemon's default.
    pub(crate) isolation: Option<runcell_core::backend::Isolation>,
    /// Saved files it starts with (state layer keys, topmost first): a
    /// snapshot's or a fork parent's. Never from a request.
    pub(crate) state_layers: Vec<String>,
    /// Where those files came from, recorded with it.
    pub(crate) lineage: crate::snapshots::Lineage,
    /// Volumes to mount.
    pub(crate) volumes: Vec<crate::volumes::VolumeAttach>,
    /// A gVisor memory image to restore (a snapshot's or a fork parent's),
    /// which is kept; its files are `state_layers`. Never from a request.
    pub(crate) memory_image: Option<std::path::PathBuf>,
    /// The one program it is made for (`POST /v1/run`): a fresh sandbox
    /// starts it as soon as it is up, before it is recorded, and its create
    /// does not wait for the agent's hello
    /// ([`runcell_core::SandboxOptions::first_run`], `one_shot`); the run is
    /// [`super::Created::first`]. Never from a request.
    pub(crate) first_run: Option<runcell_core::FirstRun>,
}

/// A create that passed the checks that need no template.
#[derive(Debug)]
pub(crate) struct Admitted {
    /// The template as requested.
    pub(crate) template: String,
    pub(crate) ttl_seconds: u64,
    pub(crate) persistent: bool,
    /// The caller's metadata with the workspace stamped.
    pub(crate) metadata: BTreeMap<String, String>,
    pub(crate) env: BTreeMap<String, String>,
    pub(crate) limits: LimitsReq,
    pub(crate) network: Option<NetworkPolicy>,
    pub(crate) isolation: Option<runcell_core::backend::Isolation>,
}

/// Metadata keys only the server sets.
const RESERVED_METADATA: [&str; 3] = ["workspace", "kind", "app.id"];

/// Checks a create for `workspace` as far as it can be without its
/// template: stamps the workspace, refuses snapshots, validates the
/// metadata, the TTL (or takes the default) and the environment.
pub(crate) fn admit(
    config: &ServeConfig,
    workspace: &str,
    mut spec: CreateSpec,
) -> Result<Admitted, ApiError> {
    for reserved in RESERVED_METADATA {
        spec.metadata.remove(reserved);
    }
    validate::metadata("metadata", &spec.metadata)?;
    spec.metadata
        .insert("workspace".into(), workspace.to_string());
    let ttl_seconds = match spec.ttl_seconds {
        Some(t) => validate::ttl(config, t)?,
        None => config.default_ttl_seconds,
    };
    validate::env("env", &spec.env)?;
    Ok(Admitted {
        template: spec
            .template
            .unwrap_or_else(|| runcell_core::DEFAULT_TEMPLATE.into()),
        ttl_seconds,
        persistent: spec.persistent.unwrap_or(false),
        metadata: spec.metadata,
        env: spec.env,
        limits: spec.limits.unwrap_or_default(),
        network: spec.network,
        isolation: spec.isolation,
    })
}

/// The limits and network policy of a new sandbox: the daemon's defaults,
/// then the template's, then what the request asks for (within the
/// daemon's bounds); the request's network policy, else the template's,
/// else none.
pub(crate) fn settings(
    config: &ServeConfig,
    defaults: &TemplateDefaults,
    asked: LimitsReq,
    network: Option<NetworkPolicy>,
) -> Result<(SandboxLimits, NetworkPolicy), ApiError> {
    let mut limits =
        validate::bounds(config).apply(defaults.apply(config.default_limits), &asked.into())?;
    // A template's default above the operator's maximum is lowered to it
    // (a request above it was refused by the bounds).
    limits.output_bytes = limits.output_bytes.min(config.max_output_bytes);
    let network = match network {
        Some(p) => p,
        None => match &defaults.network {
            Some(s) => NetworkPolicy::parse_setting(s).map_err(|e| {
                ApiError::bad_request(format!(
                    "The template's default network policy is invalid: {e}"
                ))
            })?,
            None => NetworkPolicy::none(),
        },
    };
    Ok((limits, network))
}

/// Room for one more sandbox: `live` ones plus `in_flight` creates (not
/// counting this one) must stay under `max`.
pub(crate) fn capacity(live: usize, in_flight: usize, max: usize) -> Result<(), ApiError> {
    if live + in_flight >= max {
        return Err(retry_later(
            StatusCode::SERVICE_UNAVAILABLE,
            format!(
                "no capacity: {live} sandboxes are running and the limit is {max}; retry later"
            ),
            5,
        ));
    }
    Ok(())
}

/// A refusal the PandaStack Python client retries: 503/429 with
/// Retry-After and a JSON error.
pub(crate) fn retry_later(status: StatusCode, message: String, after_secs: u64) -> ApiError {
    let mut e = ApiError::new(status, message);
    e.retry_after = Some(after_secs);
    e
}

/// A change of a sandbox's lifetime.
#[derive(Debug, Default)]
pub(crate) struct LifecycleChange {
    /// New idle TTL, seconds.
    pub(crate) ttl_seconds: Option<f64>,
    /// Exempt from the idle TTL, or not.
    pub(crate) persistent: Option<bool>,
}

/// The TTL of a lifecycle change, validated (before anything changes).
pub(crate) fn lifecycle_ttl(
    config: &ServeConfig,
    change: &LifecycleChange,
) -> Result<Option<u64>, ApiError> {
    change
        .ttl_seconds
        .map(|t| validate::ttl(config, t))
        .transpose()
}

/// Applies a validated lifecycle change to a record.
pub(crate) fn apply_lifecycle(r: &mut Record, ttl: Option<u64>, persistent: Option<bool>) {
    if let Some(t) = ttl {
        r.ttl_seconds = t;
    }
    if let Some(p) = persistent {
        r.persistent = p;
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn config() -> ServeConfig {
        ServeConfig {
            max_lifetime: Duration::from_secs(3600),
            default_ttl_seconds: 300,
            ..ServeConfig::default()
        }
    }

    #[test]
    fn admit_stamps_the_workspace_over_the_callers_reserved_keys() {
        let spec = CreateSpec {
            metadata: [
                ("workspace", "other"),
                ("kind", "x"),
                ("app.id", "y"),
                ("thread", "t1"),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
            ..CreateSpec::default()
        };
        let a = admit(&config(), "team-a", spec).unwrap();
        let keys: Vec<(&str, &str)> = a
            .metadata
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        assert_eq!(keys, [("thread", "t1"), ("workspace", "team-a")]);
    }

    #[test]
    fn admit_defaults_the_template_ttl_and_persistence() {
        let a = admit(&config(), "w", CreateSpec::default()).unwrap();
        assert_eq!(a.template, runcell_core::DEFAULT_TEMPLATE);
        assert_eq!(a.ttl_seconds, 300);
        assert!(!a.persistent);
    }

    #[test]
    fn admit_refuses_a_ttl_beyond_the_maximum_lifetime_naming_the_field() {
        let spec = CreateSpec {
            ttl_seconds: Some(3601.0),
            ..CreateSpec::default()
        };
        let e = admit(&config(), "w", spec).unwrap_err();
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert!(e.message.contains("ttl_seconds"), "{}", e.message);
        let ok = CreateSpec {
            ttl_seconds: Some(3600.0),
            ..CreateSpec::default()
        };
        assert_eq!(admit(&config(), "w", ok).unwrap().ttl_seconds, 3600);
    }

    #[test]
    fn admit_refuses_bad_environments() {
        let env = CreateSpec {
            env: [("A=B".to_string(), "x".to_string())].into(),
            ..CreateSpec::default()
        };
        let e = admit(&config(), "w", env).unwrap_err();
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert!(e.message.contains("env"), "{}", e.message);
    }

    #[test]
    fn settings_layer_the_request_over_the_template_over_the_daemon() {
        let cfg = config();
        let defaults = TemplateDefaults {
            memory_bytes: Some(256 << 20),
            cpu_millis: Some(2000),
            ..TemplateDefaults::default()
        };
        let asked = LimitsReq {
            memory_mb: Some(128.0),
            ..LimitsReq::default()
        };
        let (l, net) = settings(&cfg, &defaults, asked, None).unwrap();
        assert_eq!(l.memory_bytes, 128 << 20, "the request wins");
        assert_eq!(l.cpu_millis, 2000, "then the template");
        assert_eq!(l.pids, cfg.default_limits.pids, "then the daemon");
        assert_eq!(net, NetworkPolicy::none());
    }

    #[test]
    fn settings_cap_a_templates_output_default_and_refuse_a_request_over_it() {
        let cfg = ServeConfig {
            max_output_bytes: 1000,
            ..config()
        };
        // The daemon default (above 1000) is lowered to the maximum.
        let (l, _) = settings(
            &cfg,
            &TemplateDefaults::default(),
            LimitsReq::default(),
            None,
        )
        .unwrap();
        assert_eq!(l.output_bytes, 1000);
        let asked = LimitsReq {
            output_bytes: Some(1001.0),
            ..LimitsReq::default()
        };
        let e = settings(&cfg, &TemplateDefaults::default(), asked, None).unwrap_err();
        assert!(e.message.contains("limits.output_bytes"), "{}", e.message);
    }

    #[test]
    fn settings_take_the_templates_network_unless_the_request_gives_one() {
        let cfg = config();
        let open = TemplateDefaults {
            network: Some("open".into()),
            ..TemplateDefaults::default()
        };
        let (_, net) = settings(&cfg, &open, LimitsReq::default(), None).unwrap();
        assert_eq!(net, NetworkPolicy::parse_setting("open").unwrap());
        let (_, net) = settings(
            &cfg,
            &open,
            LimitsReq::default(),
            Some(NetworkPolicy::none()),
        )
        .unwrap();
        assert_eq!(net, NetworkPolicy::none());
        let bad = TemplateDefaults {
            network: Some("sideways".into()),
            ..TemplateDefaults::default()
        };
        let e = settings(&cfg, &bad, LimitsReq::default(), None).unwrap_err();
        assert!(
            e.message
                .starts_with("The template's default network policy is invalid"),
            "{}",
            e.message
        );
    }

    #[test]
    fn capacity_counts_creates_in_flight_and_asks_to_retry() {
        assert!(capacity(2, 1, 4).is_ok());
        let e = capacity(2, 2, 4).unwrap_err();
        assert_eq!(e.status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(e.retry_after, Some(5));
        assert_eq!(
            e.message,
            "no capacity: 2 sandboxes are running and the limit is 4; retry later"
        );
    }

    #[test]
    fn a_lifecycle_change_validates_then_applies_only_what_it_names() {
        let cfg = config();
        let too_long = LifecycleChange {
            ttl_seconds: Some(1e9),
            persistent: None,
        };
        assert!(lifecycle_ttl(&cfg, &too_long).is_err());
        let mut r = Record {
            id: "a".into(),
            workspace: "w".into(),
            template: "host".into(),
            metadata: Default::default(),
            limits: Default::default(),
            env: Default::default(),
            ttl_seconds: 300,
            persistent: false,
            created_at: 0,
            last_activity_ms: 0,
            status: "running".into(),
            end_reason: None,
            isolation: runcell_core::backend::Isolation::Jail,
        };
        let change = LifecycleChange {
            ttl_seconds: Some(60.0),
            persistent: None,
        };
        let ttl = lifecycle_ttl(&cfg, &change).unwrap();
        apply_lifecycle(&mut r, ttl, change.persistent);
        assert_eq!((r.ttl_seconds, r.persistent), (60, false));
        apply_lifecycle(&mut r, None, Some(true));
        assert_eq!((r.ttl_seconds, r.persistent), (60, true));
    }
}
