//! Warm pools: per template, sandboxes created ahead of demand, each with a
//! Python context already started and its template's preload modules
//! imported. A create takes one (it is never handed to a second caller and
//! never goes back), and the pool refills in the background.
//!
//! Pooled sandboxes are not in the registry. If the daemon dies, the next
//! start removes them as orphans; if it never comes back, their agent
//! deadline ([`MAX_AGE`] plus a margin) stops them. Entries are replaced
//! before they get that old.

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use runcell_core::{ContextOptions, Runtime, Sandbox, SandboxLimits, SandboxOptions, Template};
use runcell_protocol::{ContextInfo, Language};

use crate::metrics::{Histogram, PoolSample};

/// Age after which a pooled sandbox is replaced with a fresh one.
pub const MAX_AGE: Duration = Duration::from_secs(600);
/// How long the agent lets a pooled sandbox live if the daemon is gone.
const AGENT_DEADLINE: Duration = Duration::from_secs(900);

/// A sandbox waiting in a pool.
#[derive(Debug)]
pub struct Warm {
    /// The sandbox.
    pub sandbox: Sandbox,
    /// Its started Python context, if the template has Python.
    pub context: Option<ContextInfo>,
    born: Instant,
}

/// The pool of one template.
#[derive(Debug)]
pub struct WarmPool {
    /// The template.
    pub template: Template,
    /// Limits of the pooled sandboxes; a create asking for others is a miss.
    pub limits: SandboxLimits,
    /// Modules the context imports before it is ready.
    pub preload: Vec<String>,
    /// Sandboxes to keep ready.
    pub size: usize,
    ready: Mutex<VecDeque<Warm>>,
    refilling: AtomicBool,
    /// Set on shutdown: nothing more is prepared or kept.
    closed: AtomicBool,
    /// Creates served from the pool.
    pub hits: AtomicU64,
    /// Creates for this template the pool could not serve.
    pub misses: AtomicU64,
    /// Time to prepare one pooled sandbox (create + context + preload).
    pub refill: Histogram,
}

/// Every pool, by template name. A configured pool whose template is not
/// installed yet (e.g. `code-interpreter` while the first start builds it)
/// is added by [`WarmPools::ensure`] once the template appears, without a
/// restart.
#[derive(Debug, Default)]
pub struct WarmPools {
    pools: std::sync::RwLock<BTreeMap<String, Arc<WarmPool>>>,
    /// Configured sizes, by template name.
    sizes: BTreeMap<String, usize>,
    /// The daemon's default limits, before each template's defaults.
    limits: SandboxLimits,
    /// Set on shutdown: no pool is added any more.
    closed: AtomicBool,
}

impl WarmPools {
    /// Pools for `sizes` (template name → size) whose templates are
    /// installed; the others are added by [`WarmPools::ensure`] later.
    pub fn new(runtime: &Runtime, sizes: &BTreeMap<String, usize>, limits: SandboxLimits) -> Self {
        let pools = Self {
            sizes: sizes.clone(),
            limits,
            ..Self::default()
        };
        for name in pools.missing() {
            if let Err(e) = pools.add(runtime, &name) {
                tracing::info!(
                    template = %name,
                    "no warm pool yet: {e}; it starts when the template is installed"
                );
            }
        }
        pools
    }

    /// Configured pools that do not exist yet.
    fn missing(&self) -> Vec<String> {
        let pools = self
            .pools
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        self.sizes
            .iter()
            .filter(|(name, &size)| size > 0 && !pools.contains_key(*name))
            .map(|(name, _)| name.clone())
            .collect()
    }

    /// Adds the pool of `name` if its template is installed now.
    fn add(
        &self,
        runtime: &Runtime,
        name: &str,
    ) -> Result<Option<Arc<WarmPool>>, runcell_core::Error> {
        let size = self.sizes.get(name).copied().unwrap_or(0);
        if size == 0 || self.closed.load(Ordering::Acquire) {
            return Ok(None);
        }
        let template = runtime.template(name)?;
        let preload = template.defaults.preload.clone();
        let limits = template.defaults.apply(self.limits);
        let pool = Arc::new(WarmPool {
            template,
            limits,
            preload,
            size,
            ready: Mutex::new(VecDeque::new()),
            refilling: AtomicBool::new(false),
            closed: AtomicBool::new(false),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
            refill: Histogram::default(),
        });
        let mut pools = self
            .pools
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        Ok(Some(pools.entry(name.to_string()).or_insert(pool).clone()))
    }

    /// Adds the configured pools whose templates have been installed since
    /// start-up and returns them (to be filled by the caller).
    pub fn ensure(&self, runtime: &Runtime) -> Vec<Arc<WarmPool>> {
        let mut added = Vec::new();
        for name in self.missing() {
            if let Ok(Some(pool)) = self.add(runtime, &name) {
                tracing::info!(template = %name, size = pool.size, "warm pool started: the template is installed now");
                added.push(pool);
            }
        }
        added
    }

    /// Every pool.
    pub fn all(&self) -> Vec<Arc<WarmPool>> {
        self.pools
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .values()
            .cloned()
            .collect()
    }

    /// Stops adding pools (shutdown); drain the existing ones with `all()`.
    pub fn close(&self) {
        self.closed.store(true, Ordering::Release);
    }

    /// Takes a ready sandbox of `template` with exactly `limits`, counting a
    /// hit or a miss. Returns the pool too, so the caller can refill it.
    pub fn claim(
        &self,
        template: &str,
        limits: &SandboxLimits,
    ) -> (Option<Warm>, Option<Arc<WarmPool>>) {
        let Some(pool) = self
            .pools
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(template)
            .cloned()
        else {
            return (None, None);
        };
        let warm = if *limits == pool.limits {
            pool.ready
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .pop_front()
        } else {
            None
        };
        let counter = if warm.is_some() {
            &pool.hits
        } else {
            &pool.misses
        };
        counter.fetch_add(1, Ordering::Relaxed);
        (warm, Some(pool))
    }
}

impl WarmPool {
    /// What `/metrics` shows of this pool.
    pub fn sample(&self) -> PoolSample {
        PoolSample {
            template: self.template.name.clone(),
            size: self.size as u64,
            ready: self.ready() as u64,
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            refill: self.refill.clone(),
        }
    }

    /// Sandboxes ready now.
    pub fn ready(&self) -> usize {
        self.ready
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .len()
    }

    async fn prepare(&self, runtime: &Runtime) -> Result<Warm, runcell_core::Error> {
        let started = Instant::now();
        let sandbox = runtime
            .create(SandboxOptions {
                template: self.template.name.clone(),
                limits: self.limits,
                tied_to_process: false,
                max_lifetime: None,
                network: Some(runcell_egress::NetworkPolicy::none()),
                // The template's isolation, else the daemon's default: what
                // a create that does not ask gets, and so what a claim
                // checks for.
                isolation: self.template.defaults.isolation,
                ..SandboxOptions::default()
            })
            .await?;
        let deadline = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            + AGENT_DEADLINE;
        let mut opts = ContextOptions::new(Language::Python);
        opts.preload = self.preload.clone();
        let ready = async {
            sandbox
                .set_deadline(Some(runcell_protocol::units::millis(deadline)))
                .await?;
            sandbox.create_context(opts).await
        }
        .await;
        let context = match ready {
            Ok(c) => Some(c),
            Err(e) => {
                // A template without Python still gets pooled sandboxes.
                tracing::warn!(template = %self.template.name, "pooled sandbox has no warm context: {e}");
                None
            }
        };
        self.refill.observe(started.elapsed());
        Ok(Warm {
            sandbox,
            context,
            born: Instant::now(),
        })
    }

    /// Fills the pool up to its size, replacing entries older than
    /// [`MAX_AGE`]. Only one refill runs at a time per pool.
    pub async fn refill(self: &Arc<Self>, runtime: &Runtime) {
        if self.refilling.swap(true, Ordering::AcqRel) {
            return;
        }
        let stale: Vec<Warm> = {
            let mut ready = self
                .ready
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let (old, fresh): (VecDeque<Warm>, VecDeque<Warm>) =
                ready.drain(..).partition(|w| w.born.elapsed() > MAX_AGE);
            *ready = fresh;
            old.into()
        };
        for w in stale {
            let _ = w.sandbox.destroy().await;
        }
        let mut failures = 0;
        while self.ready() < self.size && failures < 3 && !self.closed.load(Ordering::Acquire) {
            match self.prepare(runtime).await {
                Ok(w) if self.closed.load(Ordering::Acquire) => {
                    // Shut down while this one was being prepared.
                    let _ = w.sandbox.destroy().await;
                }
                Ok(w) => self
                    .ready
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .push_back(w),
                Err(e) => {
                    failures += 1;
                    tracing::warn!(template = %self.template.name, "could not prepare a pooled sandbox: {e}");
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
            }
        }
        self.refilling.store(false, Ordering::Release);
    }

    /// Stops refilling, waits for a refill in progress, and destroys every
    /// pooled sandbox.
    pub async fn drain(&self) {
        self.closed.store(true, Ordering::Release);
        let until = Instant::now() + Duration::from_secs(30);
        while self.refilling.load(Ordering::Acquire) && Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let all: Vec<Warm> = self
            .ready
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .drain(..)
            .collect();
        for w in all {
            let _ = w.sandbox.destroy().await;
        }
    }
}
