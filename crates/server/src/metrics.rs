//! Prometheus metrics at `/metrics`, kept and written by the official
//! `prometheus-client` crate in the Prometheus text format (0.0.4).
//!
//! Histograms and per-label counters live here for the daemon's lifetime;
//! values that belong to something else (sandboxes by state, the warm
//! pools, the egress totals) are read at each scrape into a registry made
//! for that scrape.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{
    prometheus_text, DescriptorEncoder, EncodeLabelSet, EncodeMetric,
};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;

/// Upper bounds of the latency histograms, in seconds.
const BUCKETS: [f64; 12] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 60.0,
];

/// A latency histogram (seconds, [`BUCKETS`]). A clone shares the counts.
#[derive(Debug, Clone)]
pub struct Histogram(histogram::Histogram);

/// What `/metrics` shows of one warm pool (`WarmPool::sample`).
#[derive(Debug, Clone)]
pub struct PoolSample {
    /// The pool's template.
    pub template: String,
    /// Sandboxes it keeps ready.
    pub size: u64,
    /// Sandboxes ready now.
    pub ready: u64,
    /// Creates it served.
    pub hits: u64,
    /// Creates of its template it could not serve.
    pub misses: u64,
    /// Time to prepare one pooled sandbox.
    pub refill: Histogram,
}

impl Default for Histogram {
    fn default() -> Self {
        Self(histogram::Histogram::new(BUCKETS))
    }
}

impl Histogram {
    /// Records one observation.
    pub fn observe(&self, d: Duration) {
        self.0.observe(d.as_secs_f64());
    }
}

/// The label of `runcell_sandbox_reaps_total`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ReapLabels {
    reason: String,
}

/// The labels of `runcell_api_errors_total`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ErrorLabels {
    route: String,
    status: u16,
}

/// Every metric the daemon exports.
#[derive(Debug, Default)]
pub struct Metrics {
    /// Sandboxes created.
    pub creations: AtomicU64,
    /// Creation latency.
    pub create_latency: Histogram,
    /// Exec latency.
    pub exec_latency: Histogram,
    /// Sandboxes removed, by reason.
    reaps: Family<ReapLabels, Counter>,
    /// API errors, by route and status.
    errors: Family<ErrorLabels, Counter>,
}

impl Metrics {
    /// Counts a removal. The label is the reason's kind (what precedes a
    /// `:`), so details a tenant chooses (a limit's value) never make new
    /// series.
    pub fn reaped(&self, reason: &str) {
        let kind = reason.split(':').next().unwrap_or(reason);
        self.reaps
            .get_or_create(&ReapLabels {
                reason: kind.to_string(),
            })
            .inc();
    }

    /// Counts an API error.
    pub fn error(&self, route: &str, status: u16) {
        self.errors
            .get_or_create(&ErrorLabels {
                route: route.to_string(),
                status,
            })
            .inc();
    }

    /// The exposition text. `by_state` is the current count of sandboxes per state.
    pub fn render(&self, by_state: &[(&str, usize)], standby: usize) -> String {
        self.render_with_pools(by_state, standby, &[])
    }

    /// The exposition text, with the warm pools.
    pub fn render_with_pools(
        &self,
        by_state: &[(&str, usize)],
        standby: usize,
        pools: &[PoolSample],
    ) -> String {
        let mut registry = Registry::default();
        let states = Family::<Vec<(&'static str, String)>, Gauge>::default();
        for (state, n) in by_state.iter().chain(&[("standby", standby)]) {
            states
                .get_or_create(&label("state", state))
                .set(i64::try_from(*n).unwrap_or(i64::MAX));
        }
        registry.register("runcell_sandboxes", "Sandboxes by state", states);
        // The registry adds the `_total` of counters and the final period
        // of every help text.
        registry.register(
            "runcell_sandbox_creations",
            "Sandboxes created",
            ConstCounter::new(self.creations.load(Ordering::Relaxed)),
        );
        registry.register(
            "runcell_sandbox_create_seconds",
            "Time to create a sandbox",
            self.create_latency.0.clone(),
        );
        registry.register(
            "runcell_exec_seconds",
            "Time an exec took",
            self.exec_latency.0.clone(),
        );
        registry.register(
            "runcell_sandbox_reaps",
            "Sandboxes removed, by reason",
            self.reaps.clone(),
        );
        registry.register(
            "runcell_api_errors",
            "API errors, by route and status",
            self.errors.clone(),
        );
        register_pools(&mut registry, pools);
        encode(&registry)
    }
}

/// Values read at scrape time: one family of counters or gauges, each
/// sample with its labels.
#[derive(Debug)]
struct Snapshot {
    name: &'static str,
    help: &'static str,
    kind: MetricType,
    samples: Vec<(Vec<(&'static str, String)>, u64)>,
}

impl Collector for Snapshot {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let mut family = encoder.encode_descriptor(self.name, self.help, None, self.kind)?;
        for (labels, value) in &self.samples {
            let sample = family.encode_family(labels)?;
            match self.kind {
                MetricType::Counter => ConstCounter::new(*value).encode(sample)?,
                _ => ConstGauge::new(*value).encode(sample)?,
            }
        }
        Ok(())
    }
}

/// Histograms read at scrape time, one per label set.
#[derive(Debug)]
struct Histograms {
    name: &'static str,
    help: &'static str,
    samples: Vec<(Vec<(&'static str, String)>, histogram::Histogram)>,
}

impl Collector for Histograms {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let mut family =
            encoder.encode_descriptor(self.name, self.help, None, MetricType::Histogram)?;
        for (labels, h) in &self.samples {
            h.encode(family.encode_family(labels)?)?;
        }
        Ok(())
    }
}

fn label(key: &'static str, value: &str) -> Vec<(&'static str, String)> {
    vec![(key, value.to_string())]
}

/// The registry's text; writing to a `String` cannot fail, nor can
/// encoding these metrics.
fn encode(registry: &Registry) -> String {
    let mut out = String::new();
    if let Err(e) = prometheus_text::encode(&mut out, registry) {
        tracing::error!("the metrics could not be encoded: {e}");
    }
    out
}

/// A metric family of the warm pools: name, type, help and how to read it.
type PoolFamily = (
    &'static str,
    MetricType,
    &'static str,
    fn(&PoolSample) -> u64,
);

fn register_pools(registry: &mut Registry, pools: &[PoolSample]) {
    let families: [PoolFamily; 4] = [
        (
            "runcell_warm_pool_size",
            MetricType::Gauge,
            "Sandboxes a warm pool keeps ready.",
            |p| p.size,
        ),
        (
            "runcell_warm_pool_ready",
            MetricType::Gauge,
            "Sandboxes ready in a warm pool now.",
            |p| p.ready,
        ),
        (
            "runcell_warm_pool_hits_total",
            MetricType::Counter,
            "Creates served from a warm pool.",
            |p| p.hits,
        ),
        (
            "runcell_warm_pool_misses_total",
            MetricType::Counter,
            "Creates of a pooled template the pool could not serve.",
            |p| p.misses,
        ),
    ];
    for (name, kind, help, value) in families {
        // Counters are named without `_total`: the encoder adds it.
        registry.register_collector(Box::new(Snapshot {
            name: name.strip_suffix("_total").unwrap_or(name),
            help,
            kind,
            samples: pools
                .iter()
                .map(|p| (label("template", &p.template), value(p)))
                .collect(),
        }));
    }
    if !pools.is_empty() {
        registry.register_collector(Box::new(Histograms {
            name: "runcell_warm_pool_refill_seconds",
            help: "Time to prepare one pooled sandbox (create, context, preload).",
            samples: pools
                .iter()
                .map(|p| (label("template", &p.template), p.refill.0.clone()))
                .collect(),
        }));
    }
}

/// What the daemon itself holds, read at scrape time: bounded numbers
/// that return to where they were once deleted sandboxes are torn down
/// (a churn test reads them).
#[derive(Debug, Clone, Copy)]
pub struct DaemonSample {
    /// Tasks alive in the daemon's async runtime.
    pub tasks: usize,
    /// Teardowns of deleted sandboxes queued or running.
    pub teardowns: usize,
    /// Per-sandbox locks (hibernation, wake, memory saves) kept.
    pub sandbox_locks: usize,
}

/// Appends the daemon's own gauges to `out`.
pub fn render_daemon(out: &mut String, d: DaemonSample) {
    let mut registry = Registry::default();
    for (name, help, value) in [
        (
            "runcell_daemon_tasks",
            "Tasks alive in the daemon's async runtime (connections, requests, timers, teardowns).",
            d.tasks,
        ),
        (
            "runcell_sandbox_teardowns",
            "Teardowns of deleted sandboxes queued or running.",
            d.teardowns,
        ),
        (
            "runcell_daemon_sandbox_locks",
            "Per-sandbox locks (hibernation, wake, memory saves) the daemon keeps.",
            d.sandbox_locks,
        ),
    ] {
        registry.register_collector(Box::new(Snapshot {
            name,
            help,
            kind: MetricType::Gauge,
            samples: vec![(Vec::new(), u64::try_from(value).unwrap_or(u64::MAX))],
        }));
    }
    out.push_str(&encode(&registry));
}

/// The egress proxy's totals across sandboxes.
pub fn render_egress(out: &mut String, t: &runcell_egress::EgressTotals) {
    let mut registry = Registry::default();
    registry.register_collector(Box::new(Snapshot {
        name: "runcell_egress_bytes",
        help: "Bytes through the egress proxy, by direction (out: sandbox to network).",
        kind: MetricType::Counter,
        samples: vec![
            (
                label("direction", "out"),
                t.bytes_out.load(Ordering::Relaxed),
            ),
            (label("direction", "in"), t.bytes_in.load(Ordering::Relaxed)),
        ],
    }));
    registry.register_collector(Box::new(Snapshot {
        name: "runcell_egress_connections",
        help: "Egress requests, by outcome.",
        kind: MetricType::Counter,
        samples: [
            ("allowed", &t.allowed),
            ("refused_policy", &t.refused_policy),
            ("refused_private", &t.refused_private),
            ("failed", &t.failed),
        ]
        .into_iter()
        .map(|(outcome, n)| (label("outcome", outcome), n.load(Ordering::Relaxed)))
        .collect(),
    }));
    out.push_str(&encode(&registry));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_counters_and_histograms() {
        let m = Metrics::default();
        m.creations.fetch_add(2, Ordering::Relaxed);
        m.create_latency.observe(Duration::from_millis(7));
        m.reaped("idle ttl expired");
        m.error("/v1/sandboxes/{id}", 404);
        let text = m.render(&[("running", 3)], 2);
        assert!(text.contains("runcell_sandboxes{state=\"running\"} 3"));
        assert!(text.contains("runcell_sandbox_creations_total 2"));
        assert!(text.contains("runcell_sandbox_create_seconds_bucket{le=\"0.01\"} 1"));
        assert!(text.contains("runcell_sandbox_create_seconds_bucket{le=\"0.005\"} 0"));
        assert!(text.contains("runcell_sandbox_reaps_total{reason=\"idle ttl expired\"} 1"));
        assert!(text
            .contains("runcell_api_errors_total{route=\"/v1/sandboxes/{id}\",status=\"404\"} 1"));
    }

    #[test]
    fn exposition_has_the_types_names_and_escapes_prometheus_reads() {
        let m = Metrics::default();
        m.exec_latency.observe(Duration::from_millis(1500));
        m.reaped("said \"bye\"\nand left");
        m.error("/v1/sandboxes/{id}/exec", 504);
        let mut text = m.render(&[("running", 0)], 0);
        let totals = runcell_egress::EgressTotals::default();
        totals.bytes_out.fetch_add(5, Ordering::Relaxed);
        totals.refused_policy.fetch_add(3, Ordering::Relaxed);
        render_egress(&mut text, &totals);
        for line in [
            "# HELP runcell_sandboxes Sandboxes by state.",
            "# TYPE runcell_sandboxes gauge",
            "runcell_sandboxes{state=\"standby\"} 0",
            "# TYPE runcell_sandbox_creations_total counter",
            "runcell_sandbox_creations_total 0",
            "# TYPE runcell_exec_seconds histogram",
            "runcell_exec_seconds_bucket{le=\"1\"} 0",
            "runcell_exec_seconds_bucket{le=\"2.5\"} 1",
            "runcell_exec_seconds_bucket{le=\"60\"} 1",
            "runcell_exec_seconds_bucket{le=\"+Inf\"} 1",
            "runcell_exec_seconds_sum 1.5",
            "runcell_exec_seconds_count 1",
            "# TYPE runcell_sandbox_reaps_total counter",
            "runcell_sandbox_reaps_total{reason=\"said \\\"bye\\\"\\nand left\"} 1",
            "# TYPE runcell_api_errors_total counter",
            "runcell_api_errors_total{route=\"/v1/sandboxes/{id}/exec\",status=\"504\"} 1",
            "# TYPE runcell_warm_pool_hits_total counter",
            "# TYPE runcell_egress_bytes_total counter",
            "runcell_egress_bytes_total{direction=\"out\"} 5",
            "runcell_egress_bytes_total{direction=\"in\"} 0",
            "# TYPE runcell_egress_connections_total counter",
            "runcell_egress_connections_total{outcome=\"refused_policy\"} 3",
            "runcell_egress_connections_total{outcome=\"failed\"} 0",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "{line:?} missing from\n{text}"
            );
        }
        // Text format 0.0.4, not OpenMetrics: no `# EOF`, no `# UNIT`.
        assert!(
            !text.contains("# EOF") && !text.contains("# UNIT"),
            "{text}"
        );
    }
}
