//! The daemon's operations on sandboxes, under the HTTP layer: create,
//! kill, lifetime and network changes. The HTTP handlers parse a request,
//! call one of these and map the answer to a view. The decisions (what a
//! request may ask for, defaults, capacity, lifetimes) are in [`plan`],
//! testable without a runtime; this module carries them out.

pub(crate) mod plan;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::http::StatusCode;
use runcell_core::{SandboxLimits, SandboxOptions, Template};
use runcell_egress::NetworkPolicy;

use crate::error::ApiError;
use crate::registry::Record;
use crate::state::{now_ms, AppState, Entry};

pub(crate) use plan::{CreateSpec, LifecycleChange};

/// A sandbox just created.
#[derive(Debug)]
pub(crate) struct Created {
    /// It, live (in the daemon's map).
    pub(crate) entry: Arc<Entry>,
    /// How long the create took.
    pub(crate) boot: Duration,
    /// The requested template is an alias (not installed, or still being
    /// built): the sandbox was made from this template instead.
    pub(crate) alias_of: Option<String>,
    /// The requested template is still being built (`--auto-build`).
    pub(crate) building_instead: bool,
    /// Its processes and memory were restored from `memory_image`.
    pub(crate) memory: bool,
    /// The run of [`CreateSpec::first_run`], started with the sandbox (none
    /// for a sandbox from a warm pool or restored from memory: the caller
    /// starts the program then).
    pub(crate) first: Option<runcell_core::StartedRun>,
}

/// The operations, over the daemon's state.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Service<'a>(pub(crate) &'a Arc<AppState>);

/// What a fresh sandbox starts from besides its template.
struct Origin<'x> {
    /// Saved files (state layer keys, topmost first).
    state_layers: &'x [String],
    /// A gVisor memory image to restore over them.
    memory_image: Option<&'x std::path::Path>,
    /// The deadline (unix ms) the agent is started with.
    deadline_unix_ms: u64,
    /// The one program it is made for ([`CreateSpec::first_run`]).
    first_run: Option<runcell_core::FirstRun>,
}

/// Counts a create in flight against the capacity until dropped.
struct Slot<'a>(&'a AtomicUsize);

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl<'a> Service<'a> {
    /// Creates a sandbox for `workspace`: checks the request, takes a
    /// capacity slot and the workspace's quota, claims a warm sandbox or
    /// starts one, records it and makes it live.
    pub(crate) async fn create_sandbox(
        self,
        workspace: &str,
        mut spec: CreateSpec,
    ) -> Result<Created, ApiError> {
        let state = self.0;
        self.resolve_snapshot(workspace, &mut spec)?;
        let mut lineage = std::mem::take(&mut spec.lineage);
        lineage.state_layers = std::mem::take(&mut spec.state_layers);
        if spec.volumes.len() > 16 {
            return Err(ApiError::bad_request("volumes: at most 16 per sandbox."));
        }
        let _attaching = self.reserve_volumes(workspace, &spec.volumes)?;
        let mounts = self.volume_mounts(workspace, &spec.volumes)?;
        lineage.volumes = std::mem::take(&mut spec.volumes);
        let memory_image = spec.memory_image.take();
        let first_run = spec.first_run.take();
        let asked = plan::admit(&state.config, workspace, spec)?;
        let resolved = self.resolve_alias(&asked.template);
        let served_from_alias = resolved != asked.template;
        let building_instead = served_from_alias && state.auto_builds.in_progress(&asked.template);
        if building_instead {
            tracing::info!(
                template = %asked.template,
                "{} is still being built; this sandbox is served from {resolved}",
                asked.template
            );
        }
        let template = state
            .runtime
            .template(&resolved)
            .map_err(|_| self.unknown_template(&asked.template))?;
        let (limits, network) = plan::settings(
            &state.config,
            &template.defaults,
            asked.limits,
            asked.network,
        )?;
        // The request's isolation, else the template's, else the daemon's;
        // one the host cannot run is the caller's error, said before
        // anything is reserved.
        let isolation = asked
            .isolation
            .or(template.defaults.isolation)
            .unwrap_or_else(|| state.runtime.default_isolation());
        state
            .runtime
            .backend_for(isolation)
            .map_err(|e| ApiError::bad_request(format!("isolation: {e}")))?;
        // Capacity: live sandboxes plus creates in flight.
        let in_flight = state.creating.fetch_add(1, Ordering::AcqRel);
        let _slot = Slot(&state.creating);
        plan::capacity(self.live(), in_flight, state.config.max_sandboxes)?;
        // The workspace's own share, held until the sandbox is live.
        let _quota = self.reserve(workspace, &limits)?;
        let started = Instant::now();
        // Warm sandboxes have the template's isolation (else the default).
        let pooled = template
            .defaults
            .isolation
            .unwrap_or_else(|| state.runtime.default_isolation());
        // Warm sandboxes started without saved files.
        let (warm, pool) = if isolation == pooled
            && lineage.state_layers.is_empty()
            && mounts.is_empty()
            && memory_image.is_none()
        {
            state.pools.claim(&template.name, &limits)
        } else {
            (None, None)
        };
        if let Some(pool) = pool {
            // Top the pool up behind this request.
            let st = state.clone();
            tokio::spawn(async move { pool.refill(&st.runtime).await });
        }
        let mut memory = false;
        // The agent's deadline as this sandbox's record will give it (idle
        // TTL from now): a sandbox started here is started with it, and
        // the touch below then has nothing to send. A warm one was started
        // with the pool's deadline; a restored one has its source's.
        let first_deadline =
            state.first_agent_deadline(now_ms(), asked.ttl_seconds, asked.persistent);
        let mut started_with = None;
        let (sandbox, warm_context) = match warm {
            Some(w) => {
                // Pooled sandboxes are made with no network.
                if network.has_egress() {
                    if let Err(e) = w.sandbox.set_network(network.clone()).await {
                        let _ = w.sandbox.destroy().await;
                        return Err(ApiError::from(e));
                    }
                }
                (w.sandbox, w.context)
            }
            None => {
                let restored = match &memory_image {
                    Some(image)
                        if matches!(
                            isolation,
                            runcell_core::backend::Isolation::Gvisor
                                | runcell_core::backend::Isolation::Microvm
                        ) =>
                    {
                        let started = self
                            .start(
                                &template,
                                limits,
                                network.clone(),
                                isolation,
                                Origin {
                                    state_layers: &lineage.state_layers,
                                    memory_image: Some(image),
                                    deadline_unix_ms: first_deadline,
                                    first_run: None,
                                },
                                mounts.clone(),
                            )
                            .await;
                        // Its files still start it; what it lost is said.
                        lineage.state_lost = started.is_err();
                        if let Err(e) = &started {
                            tracing::warn!("a {isolation} sandbox's memory could not be restored; starting it on its files: {}", e.message);
                        }
                        started.ok()
                    }
                    _ => None,
                };
                memory = restored.is_some();
                // The restored agent has its source's egress setting: it
                // gets this sandbox's.
                if let Some(s) = &restored {
                    if let Some(n) = s.network() {
                        if let Err(e) = s.set_network(n.policy).await {
                            tracing::warn!(sandbox = %s.id(), "its egress setting could not be applied: {e}");
                        }
                    }
                }
                let sandbox = match restored {
                    Some(s) => s,
                    None => {
                        let s = self
                            .start(
                                &template,
                                limits,
                                network,
                                isolation,
                                Origin {
                                    state_layers: &lineage.state_layers,
                                    memory_image: None,
                                    deadline_unix_ms: first_deadline,
                                    first_run,
                                },
                                mounts,
                            )
                            .await?;
                        // A restored agent keeps its source's deadline; a
                        // started one has the deadline its record gives.
                        started_with = Some(first_deadline);
                        s
                    }
                };
                (sandbox, None)
            }
        };
        // Taken now: should this create be given up on from here, the
        // run goes with it (its connection closes and the agent kills it).
        let first = sandbox.take_first_run();
        let now = now_ms();
        let record = Record {
            id: sandbox.id().to_string(),
            workspace: workspace.to_string(),
            template: asked.template,
            metadata: asked.metadata,
            limits: (&limits).into(),
            env: asked.env,
            ttl_seconds: asked.ttl_seconds,
            persistent: asked.persistent,
            created_at: now / 1000,
            last_activity_ms: now,
            status: "running".into(),
            end_reason: None,
            isolation,
        };
        // One transaction: the record, its network policy (so a restarted
        // daemon serves its egress the same way) and its lineage are
        // committed together, before its id is answered.
        let recorded = state
            .registry
            .transaction(
                |c| -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
                    let policy = sandbox.network().map(|n| n.policy);
                    crate::registry::insert(c, &record, policy.as_ref())?;
                    crate::snapshots::put_lineage(c, &record.id, &lineage)?;
                    Ok(())
                },
            )
            .map_err(|e| e.to_string());
        if let Err(e) = recorded {
            let _ = sandbox.destroy().await;
            return Err(ApiError::internal(format!(
                "The sandbox could not be recorded: {e}"
            )));
        }
        let entry = Entry::new(sandbox, record, template, warm_context);
        // The record just written holds this activity: the touch only sends
        // the agent its deadline, unless it was started with it.
        *entry
            .persisted
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = (now, started_with.unwrap_or(0));
        state.touch(&entry).await;
        let boot = started.elapsed();
        state.metrics.creations.fetch_add(1, Ordering::Relaxed);
        state.metrics.create_latency.observe(started.elapsed());
        state
            .sandboxes
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(entry.sandbox.id().to_string(), entry.clone());
        Ok(Created {
            alias_of: served_from_alias.then(|| entry.template.name.clone()),
            entry,
            boot,
            building_instead,
            memory,
            first,
        })
    }

    /// Kills a sandbox and records that the API deleted it.
    pub(crate) async fn kill(self, id: &str) -> Result<(), ApiError> {
        if self.0.remove(id, "deleted by the API").await {
            Ok(())
        } else {
            Err(ApiError::no_sandbox())
        }
    }

    /// Changes a sandbox's idle TTL or persistence; the agent's deadline
    /// follows. Answers the record as changed.
    pub(crate) async fn set_lifecycle(
        self,
        e: &Entry,
        change: LifecycleChange,
    ) -> Result<Record, ApiError> {
        let state = self.0;
        let ttl = plan::lifecycle_ttl(&state.config, &change)?;
        let (record, deadline) = {
            let mut r = e
                .record
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            plan::apply_lifecycle(&mut r, ttl, change.persistent);
            (r.clone(), state.agent_deadline(&r))
        };
        state.registry.put(&record).map_err(|err| {
            ApiError::internal(format!("The change could not be recorded: {err}"))
        })?;
        e.sandbox.set_deadline(Some(deadline)).await?;
        Ok(record)
    }

    /// Replaces a running sandbox's network policy and records it.
    pub(crate) async fn set_network(
        self,
        e: &Entry,
        policy: NetworkPolicy,
    ) -> Result<(), ApiError> {
        let id = e.sandbox.id();
        e.sandbox
            .set_network(policy)
            .await
            .map_err(|err| match err {
                runcell_core::Error::NoEgress => ApiError::bad_request(err.to_string()),
                other => ApiError::from(other),
            })?;
        if let Some(n) = e.sandbox.network() {
            self.0.registry.set_network(id, &n.policy).map_err(|err| {
                ApiError::internal(format!("The policy could not be recorded: {err}"))
            })?;
        }
        tracing::info!(sandbox = %id, mode = %e.sandbox.network().map(|n| n.policy.mode.to_string()).unwrap_or_default(), "network policy changed");
        Ok(())
    }

    /// The live sandboxes of `workspace` whose metadata has every
    /// `filters` pair, oldest first.
    pub(crate) fn list(self, workspace: &str, filters: &[(String, String)]) -> Vec<Arc<Entry>> {
        let entries: Vec<Arc<Entry>> = self
            .0
            .sandboxes
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .values()
            .cloned()
            .collect();
        let mut out: Vec<(i64, Arc<Entry>)> = entries
            .into_iter()
            .filter_map(|e| {
                let r = e
                    .record
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                let keep = r.workspace == workspace
                    && filters.iter().all(|(k, v)| r.metadata.get(k) == Some(v));
                let created = r.created_at;
                drop(r);
                keep.then_some((created, e))
            })
            .collect();
        out.sort_by_key(|(t, _)| *t);
        out.into_iter().map(|(_, e)| e).collect()
    }

    /// The template an alias names, unless a template of that name is
    /// installed (an installed `code-interpreter` wins over the built-in
    /// alias).
    pub(crate) fn resolve_alias(self, name: &str) -> String {
        match self.0.config.aliases.get(name) {
            Some(target) if self.0.runtime.template(name).is_err() => target.clone(),
            _ => name.to_string(),
        }
    }

    /// The workspace's share of the daemon for one more sandbox with
    /// `limits` (see [`crate::quota`]).
    fn reserve(
        self,
        workspace: &str,
        limits: &SandboxLimits,
    ) -> Result<crate::quota::Reservation<'a>, ApiError> {
        let state = self.0;
        let quota = state.config.workspace_quota;
        let workspaces = if quota.sandboxes.is_none() {
            state
                .registry
                .with_conn(crate::keys::workspace_count)
                .unwrap_or(2)
        } else {
            0
        };
        let max = quota.max_sandboxes(state.config.max_sandboxes, workspaces);
        let live = || {
            state
                .sandboxes
                .read()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .values()
                .filter(|e| {
                    e.record
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .workspace
                        == workspace
                })
                .map(|e| *e.sandbox.limits())
                .collect()
        };
        crate::quota::reserve(&state.reservations, quota, max, workspace, limits, live)
    }

    fn live(self) -> usize {
        self.0
            .sandboxes
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .len()
    }

    fn unknown_template(self, requested: &str) -> ApiError {
        let config = &self.0.config;
        let mut installed = Template::installed(config.templates_dir.as_deref());
        installed.extend(config.aliases.keys().cloned());
        // An installed template can share its name with an alias: name it once.
        let mut seen = std::collections::HashSet::new();
        installed.retain(|n| seen.insert(n.clone()));
        ApiError::bad_request(format!(
            "unknown template \"{}\"; installed templates: {}",
            crate::http::kit::clip(requested.to_string()),
            installed.join(", ")
        ))
    }

    /// A fresh sandbox (the warm pool had none for this request).
    async fn start(
        self,
        template: &Template,
        limits: SandboxLimits,
        network: NetworkPolicy,
        isolation: runcell_core::backend::Isolation,
        origin: Origin<'_>,
        mounts: Vec<runcell_core::backend::BindMount>,
    ) -> Result<runcell_core::Sandbox, ApiError> {
        let state_layers = crate::snapshots::Layers::of(self.0).paths(origin.state_layers);
        self.0
            .runtime
            .create(SandboxOptions {
                template: template.name.clone(),
                limits,
                tied_to_process: false,
                // The agent stops the sandbox by itself at this deadline,
                // which the daemon moves on with the sandbox's activity.
                max_lifetime: Some(Duration::from_millis(
                    origin
                        .deadline_unix_ms
                        .saturating_sub(u64::try_from(now_ms()).unwrap_or(0)),
                )),
                network: Some(network),
                isolation: Some(isolation),
                state_layers,
                mounts,
                memory_image: origin.memory_image.map(std::path::Path::to_path_buf),
                one_shot: origin.first_run.is_some(),
                first_run: origin.first_run,
                ..SandboxOptions::default()
            })
            .await
            .map_err(|e| match e {
                runcell_core::Error::Jail(
                    err @ runcell_core::backend::BackendError::Unsupported { .. },
                ) => ApiError::bad_request(err.to_string()),
                // Nothing is left of a failed start (the jail cleans up), so a
                // retry cannot duplicate anything.
                runcell_core::Error::Jail(_) => plan::retry_later(
                    StatusCode::SERVICE_UNAVAILABLE,
                    format!(
                        "The sandbox could not be started: {}",
                        ApiError::from(e).message
                    ),
                    1,
                ),
                other => ApiError::from(other),
            })
    }
}
