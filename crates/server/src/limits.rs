//! Every conversion of a sandbox's limits to and from its outside forms:
//! the request (`limits` of a create), the view (`limits` of a sandbox) and
//! the registry's stored form. The CPU rounding the PandaStack fields use
//! is here too, once.

use std::time::Duration;

use runcell_core::limits::LimitsRequest;
use runcell_core::SandboxLimits;
use serde::{Deserialize, Deserializer, Serialize};

use crate::views::LimitsView;

/// runcell's per-sandbox limits in API form.
#[derive(Debug, Default, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct LimitsReq {
    // Numbers are read as sent and checked against their ranges by
    // `runcell_core::limits`, so that a refusal names the field and its
    // range.
    #[schema(value_type = Option<u64>)]
    pub(crate) memory_mb: Option<f64>,
    pub(crate) cpu: Option<f64>,
    #[schema(value_type = Option<u64>)]
    pub(crate) pids: Option<f64>,
    #[schema(value_type = Option<u64>)]
    pub(crate) disk_mb: Option<f64>,
    pub(crate) timeout_seconds: Option<f64>,
    #[schema(value_type = Option<u64>)]
    pub(crate) output_bytes: Option<f64>,
}

impl From<&SandboxLimits> for LimitsReq {
    /// The same limits again (a fork gets its parent's).
    fn from(l: &SandboxLimits) -> Self {
        LimitsReq {
            memory_mb: Some((l.memory_bytes >> 20) as f64),
            cpu: Some(l.cpu_millis as f64 / 1000.0),
            pids: Some(l.pids as f64),
            disk_mb: Some((l.disk_bytes >> 20) as f64),
            timeout_seconds: Some(l.timeout.as_secs_f64()),
            output_bytes: Some(l.output_bytes as f64),
        }
    }
}

impl From<LimitsReq> for LimitsRequest {
    fn from(r: LimitsReq) -> Self {
        LimitsRequest {
            memory_mb: r.memory_mb,
            cpu: r.cpu,
            pids: r.pids,
            disk_mb: r.disk_mb,
            timeout_seconds: r.timeout_seconds,
            output_bytes: r.output_bytes,
        }
    }
}

/// CPU in whole cores, rounded up and at least one (PandaStack's `cpu`).
pub(crate) fn whole_cores(l: &SandboxLimits) -> u64 {
    l.cpu_millis.div_ceil(1000).max(1)
}

/// The `limits` of a sandbox view.
pub(crate) fn view(l: &SandboxLimits) -> LimitsView {
    LimitsView {
        memory_mb: l.memory_bytes >> 20,
        cpu: l.cpu_millis as f64 / 1000.0,
        pids: l.pids,
        disk_mb: l.disk_bytes >> 20,
        timeout_seconds: l.timeout.as_secs_f64(),
        output_bytes: l.output_bytes,
    }
}

/// A sandbox's limits as the registry stores them (the JSON of the
/// `limits` column). A field that is absent keeps the daemon's default when
/// the sandbox is re-attached; numbers are read whatever their JSON form
/// (rows written by older versions).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct StoredLimits {
    /// MiB.
    #[serde(skip_serializing_if = "Option::is_none", deserialize_with = "whole")]
    pub memory_mb: Option<u64>,
    /// Cores.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cpu: Option<f64>,
    /// Processes.
    #[serde(skip_serializing_if = "Option::is_none", deserialize_with = "whole")]
    pub pids: Option<u64>,
    /// MiB.
    #[serde(skip_serializing_if = "Option::is_none", deserialize_with = "whole")]
    pub disk_mb: Option<u64>,
    /// Default exec timeout, seconds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub timeout_seconds: Option<f64>,
    /// Bytes per stream and exec.
    #[serde(skip_serializing_if = "Option::is_none", deserialize_with = "whole")]
    pub output_bytes: Option<u64>,
}

/// A number as a whole count: any JSON number, cut towards zero (as older
/// versions read them).
fn whole<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    Ok(Option::<f64>::deserialize(d)?.map(runcell_protocol::units::saturating_u64))
}

impl From<&SandboxLimits> for StoredLimits {
    fn from(l: &SandboxLimits) -> Self {
        let v = view(l);
        StoredLimits {
            memory_mb: Some(v.memory_mb),
            cpu: Some(v.cpu),
            pids: Some(v.pids),
            disk_mb: Some(v.disk_mb),
            timeout_seconds: Some(v.timeout_seconds),
            output_bytes: Some(v.output_bytes),
        }
    }
}

impl StoredLimits {
    /// The limits stored, each absent one taken from `defaults`.
    pub fn over(&self, mut l: SandboxLimits) -> SandboxLimits {
        if let Some(m) = self.memory_mb {
            l.memory_bytes = m << 20;
        }
        if let Some(c) = self.cpu {
            l.cpu_millis = runcell_protocol::units::saturating_u64(c * 1000.0);
        }
        if let Some(p) = self.pids {
            l.pids = p;
        }
        if let Some(d) = self.disk_mb {
            l.disk_bytes = d << 20;
        }
        if let Some(t) = self.timeout_seconds {
            l.timeout = Duration::from_secs_f64(t.max(0.001));
        }
        if let Some(o) = self.output_bytes {
            l.output_bytes = o;
        }
        l
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> SandboxLimits {
        SandboxLimits {
            memory_bytes: 768 << 20,
            cpu_millis: 1500,
            pids: 200,
            disk_bytes: 2048 << 20,
            timeout: Duration::from_millis(2500),
            output_bytes: 1 << 20,
        }
    }

    /// What is stored comes back as the same limits after a restart.
    #[test]
    fn stored_limits_round_trip() {
        let l = limits();
        let json = serde_json::to_string(&StoredLimits::from(&l)).unwrap();
        let back: StoredLimits = serde_json::from_str(&json).unwrap();
        assert_eq!(back.over(SandboxLimits::default()), l);
    }

    /// The stored form is the sandbox view's `limits` object, as older
    /// versions wrote it.
    #[test]
    fn stored_form_is_the_views_json() {
        let l = limits();
        assert_eq!(
            serde_json::to_value(StoredLimits::from(&l)).unwrap(),
            serde_json::to_value(view(&l)).unwrap()
        );
    }

    /// Rows of older versions: numbers as floats, missing fields (the
    /// defaults apply), unknown fields (ignored).
    #[test]
    fn older_stored_forms_still_load() {
        let d = SandboxLimits::default();
        let s: StoredLimits =
            serde_json::from_str(r#"{"memory_mb": 512.0, "cpu": 2, "old_field": true}"#).unwrap();
        let l = s.over(d);
        assert_eq!(l.memory_bytes, 512 << 20);
        assert_eq!(l.cpu_millis, 2000);
        assert_eq!(
            (l.pids, l.disk_bytes, l.timeout),
            (d.pids, d.disk_bytes, d.timeout)
        );
        let empty: StoredLimits = serde_json::from_str("{}").unwrap();
        assert_eq!(empty.over(d), d);
    }

    #[test]
    fn whole_cores_rounds_up_to_at_least_one() {
        let at = |m| {
            whole_cores(&SandboxLimits {
                cpu_millis: m,
                ..SandboxLimits::default()
            })
        };
        assert_eq!((at(0), at(500), at(1000), at(1001)), (1, 1, 1, 2));
    }
}
