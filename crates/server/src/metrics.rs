//! Prometheus metrics, in the text exposition format at `/metrics`.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

/// Upper bounds of the latency histograms, in seconds.
const BUCKETS: [f64; 12] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 60.0,
];

/// A latency histogram.
#[derive(Debug, Default)]
pub struct Histogram {
    counts: [AtomicU64; BUCKETS.len()],
    count: AtomicU64,
    sum_us: AtomicU64,
}

impl Histogram {
    /// Records one observation.
    pub fn observe(&self, d: Duration) {
        let s = d.as_secs_f64();
        for (i, b) in BUCKETS.iter().enumerate() {
            if s <= *b {
                self.counts[i].fetch_add(1, Ordering::Relaxed);
            }
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        self.sum_us
            .fetch_add(d.as_micros() as u64, Ordering::Relaxed);
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (i, b) in BUCKETS.iter().enumerate() {
            let _ = writeln!(
                out,
                "{name}_bucket{{le=\"{b}\"}} {}",
                self.counts[i].load(Ordering::Relaxed)
            );
        }
        let count = self.count.load(Ordering::Relaxed);
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {count}");
        let _ = writeln!(
            out,
            "{name}_sum {}",
            self.sum_us.load(Ordering::Relaxed) as f64 / 1e6
        );
        let _ = writeln!(out, "{name}_count {count}");
    }
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
    pub reaps: Mutex<BTreeMap<String, u64>>,
    /// API errors, by (route, status).
    pub errors: Mutex<BTreeMap<(String, u16), u64>>,
}

impl Metrics {
    /// Counts a removal.
    pub fn reaped(&self, reason: &str) {
        *self
            .reaps
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .entry(reason.to_string())
            .or_default() += 1;
    }

    /// Counts an API error.
    pub fn error(&self, route: &str, status: u16) {
        *self
            .errors
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .entry((route.to_string(), status))
            .or_default() += 1;
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
        pools: &[&crate::pool::WarmPool],
    ) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "# HELP runcell_sandboxes Sandboxes by state.\n# TYPE runcell_sandboxes gauge"
        );
        for (state, n) in by_state {
            let _ = writeln!(out, "runcell_sandboxes{{state=\"{state}\"}} {n}");
        }
        let _ = writeln!(out, "runcell_sandboxes{{state=\"standby\"}} {standby}");
        let _ = writeln!(
            out,
            "# HELP runcell_sandbox_creations_total Sandboxes created.\n# TYPE runcell_sandbox_creations_total counter\nruncell_sandbox_creations_total {}",
            self.creations.load(Ordering::Relaxed)
        );
        self.create_latency.render(
            &mut out,
            "runcell_sandbox_create_seconds",
            "Time to create a sandbox.",
        );
        self.exec_latency
            .render(&mut out, "runcell_exec_seconds", "Time an exec took.");
        let _ = writeln!(
            out,
            "# HELP runcell_sandbox_reaps_total Sandboxes removed, by reason.\n# TYPE runcell_sandbox_reaps_total counter"
        );
        for (reason, n) in self
            .reaps
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .iter()
        {
            let _ = writeln!(
                out,
                "runcell_sandbox_reaps_total{{reason=\"{}\"}} {n}",
                escape(reason)
            );
        }
        let _ = writeln!(
            out,
            "# HELP runcell_api_errors_total API errors, by route and status.\n# TYPE runcell_api_errors_total counter"
        );
        for ((route, status), n) in self
            .errors
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .iter()
        {
            let _ = writeln!(
                out,
                "runcell_api_errors_total{{route=\"{}\",status=\"{status}\"}} {n}",
                escape(route)
            );
        }
        render_pools(&mut out, pools);
        out
    }
}

/// A metric family of the warm pools: name, type, help and how to read it.
type PoolFamily = (
    &'static str,
    &'static str,
    &'static str,
    fn(&crate::pool::WarmPool) -> u64,
);

fn render_pools(out: &mut String, pools: &[&crate::pool::WarmPool]) {
    let families: [PoolFamily; 4] = [
        (
            "runcell_warm_pool_size",
            "gauge",
            "Sandboxes a warm pool keeps ready.",
            |p| p.size as u64,
        ),
        (
            "runcell_warm_pool_ready",
            "gauge",
            "Sandboxes ready in a warm pool now.",
            |p| p.ready() as u64,
        ),
        (
            "runcell_warm_pool_hits_total",
            "counter",
            "Creates served from a warm pool.",
            |p| p.hits.load(Ordering::Relaxed),
        ),
        (
            "runcell_warm_pool_misses_total",
            "counter",
            "Creates of a pooled template the pool could not serve.",
            |p| p.misses.load(Ordering::Relaxed),
        ),
    ];
    for (name, kind, help, value) in families {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
        for p in pools {
            let _ = writeln!(
                out,
                "{name}{{template=\"{}\"}} {}",
                escape(&p.template.name),
                value(p)
            );
        }
    }
    for p in pools {
        let mut one = String::new();
        p.refill.render(
            &mut one,
            "runcell_warm_pool_refill_seconds",
            "Time to prepare one pooled sandbox (create, context, preload).",
        );
        // Label every sample of this pool's histogram with its template.
        let label = format!("template=\"{}\"", escape(&p.template.name));
        for line in one.lines() {
            if line.starts_with('#') {
                if !out.contains(line) {
                    let _ = writeln!(out, "{line}");
                }
            } else if let Some((head, rest)) = line.split_once('{') {
                let _ = writeln!(out, "{head}{{{label},{rest}");
            } else if let Some((head, rest)) = line.split_once(' ') {
                let _ = writeln!(out, "{head}{{{label}}} {rest}");
            }
        }
    }
}

fn escape(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// The egress proxy's totals across sandboxes.
pub fn render_egress(out: &mut String, t: &runcell_egress::EgressTotals) {
    let _ = writeln!(
        out,
        "# HELP runcell_egress_bytes_total Bytes through the egress proxy, by direction (out: sandbox to network).\n# TYPE runcell_egress_bytes_total counter\nruncell_egress_bytes_total{{direction=\"out\"}} {}\nruncell_egress_bytes_total{{direction=\"in\"}} {}",
        t.bytes_out.load(Ordering::Relaxed),
        t.bytes_in.load(Ordering::Relaxed)
    );
    let _ = writeln!(
        out,
        "# HELP runcell_egress_connections_total Egress requests, by outcome.\n# TYPE runcell_egress_connections_total counter"
    );
    for (outcome, n) in [
        ("allowed", &t.allowed),
        ("refused_policy", &t.refused_policy),
        ("refused_private", &t.refused_private),
        ("failed", &t.failed),
    ] {
        let _ = writeln!(
            out,
            "runcell_egress_connections_total{{outcome=\"{outcome}\"}} {}",
            n.load(Ordering::Relaxed)
        );
    }
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
}
