//! The first run: the bundled `code-interpreter` recipe (Debian with numpy,
//! pandas and matplotlib) is built in the background when it is not
//! installed. Until it is ready, the `code-interpreter` alias serves `host`
//! and says so; once it is installed, new sandboxes get it (an installed
//! template wins over an alias), without a restart. Layers are cached in the
//! templates directory, so a later start finds it installed and builds
//! nothing.

use std::io::Write as _;
use std::sync::{Arc, Mutex};

use runcell_core::build::{self, BuildOptions, Progress};
use runcell_core::Runtime;
use serde::Serialize;

/// The template the daemon builds.
pub const NAME: &str = "code-interpreter";

/// The recipe, embedded so the daemon does not depend on the checkout.
pub const RECIPE: &str = include_str!("../../../templates/code-interpreter/Dockerfile");

/// Where a background build is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum BuildState {
    /// Waiting to start.
    Queued,
    /// Running a step.
    Building,
    /// Installed: new sandboxes get it.
    Ready,
    /// Failed: the alias keeps serving its target.
    Failed,
}

/// A background build's progress, as `GET /v1/templates/{name}` shows it.
#[derive(Debug, Clone, Serialize)]
pub struct BuildStatus {
    /// Where it is.
    pub state: BuildState,
    /// The current (or last) step: `N/TOTAL KEYWORD arguments`.
    pub step: Option<String>,
    /// Why it failed.
    pub error: Option<String>,
    /// When it started (RFC 3339).
    pub started_at: String,
    /// Seconds it took, once it ended.
    pub seconds: Option<f64>,
}

/// The daemon's background builds, by template name.
#[derive(Debug, Default)]
pub struct AutoBuilds {
    builds: Mutex<std::collections::BTreeMap<String, BuildStatus>>,
}

impl AutoBuilds {
    /// The status of `name`'s build, if one ran since the daemon started.
    pub fn status(&self, name: &str) -> Option<BuildStatus> {
        self.builds
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(name)
            .cloned()
    }

    /// Whether `name` is being built (queued or building).
    pub fn in_progress(&self, name: &str) -> bool {
        self.status(name)
            .is_some_and(|s| matches!(s.state, BuildState::Queued | BuildState::Building))
    }

    fn update(&self, name: &str, f: impl FnOnce(&mut BuildStatus)) {
        if let Some(s) = self
            .builds
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get_mut(name)
        {
            f(s);
        }
    }
}

/// Starts the build of the bundled recipe in the background unless the
/// template is installed already.
/// `target` is the template the alias serves meanwhile, `data_dir` the
/// daemon's (the build's context).
pub fn start(
    runtime: &Runtime,
    builds: &Arc<AutoBuilds>,
    data_dir: &std::path::Path,
    target: String,
    on_ready: impl FnOnce() + Send + 'static,
) {
    if runtime.template(NAME).is_ok() {
        tracing::info!(
            template = NAME,
            "the {NAME} template is installed; nothing to build"
        );
        return;
    }
    builds
        .builds
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .insert(
            NAME.into(),
            BuildStatus {
                state: BuildState::Queued,
                step: None,
                error: None,
                started_at: runcell_core::rfc3339(crate::clock::now_ms().div_euclid(1000)),
                seconds: None,
            },
        );
    tracing::info!(
        template = NAME,
        "building the {NAME} template in the background (Debian with numpy, pandas, \
         matplotlib; a few minutes on first start); until it is ready, {NAME} is served \
         from {target}"
    );
    let (runtime, builds, context) = (runtime.clone(), builds.clone(), data_dir.to_path_buf());
    tokio::spawn(async move {
        let started = std::time::Instant::now();
        let opts = BuildOptions {
            name: NAME.into(),
            recipe: RECIPE.into(),
            // The recipe copies nothing.
            context,
            mirror: build::DEBIAN_MIRROR.into(),
        };
        let builds = &*builds;
        // The output of debootstrap and apt-get goes to the log line by line.
        let mut line = Vec::new();
        let mut on_progress = |p: Progress<'_>| match p {
            Progress::Step { index, total, text } => {
                let step = format!("{index}/{total} {text}");
                tracing::info!(template = NAME, "build step {step}");
                builds.update(NAME, |s| {
                    s.state = BuildState::Building;
                    s.step = Some(step);
                });
            }
            Progress::Cached => tracing::info!(template = NAME, "build step cached"),
            Progress::Output(_, bytes) => {
                for &b in bytes {
                    if b == b'\n' {
                        let text = String::from_utf8_lossy(&line);
                        tracing::debug!(template = NAME, "build: {}", text.trim_end());
                        line.clear();
                    } else if line.len() < 4096 {
                        let _ = line.write_all(&[b]);
                    }
                }
            }
        };
        let result = build::build(&runtime, &opts, &mut on_progress).await;
        let seconds = started.elapsed().as_secs_f64();
        match result {
            Ok(summary) => {
                tracing::info!(
                    template = NAME,
                    steps = summary.steps,
                    cached = summary.cached,
                    "the {NAME} template is ready after {seconds:.1} s; new sandboxes get it"
                );
                builds.update(NAME, |s| {
                    s.state = BuildState::Ready;
                    s.seconds = Some(seconds);
                });
                on_ready();
            }
            Err(e) => {
                let mut message = e.to_string();
                let mut source = std::error::Error::source(&e);
                while let Some(cause) = source {
                    let text = cause.to_string();
                    if !message.contains(&text) {
                        message.push_str(": ");
                        message.push_str(&text);
                    }
                    source = cause.source();
                }
                tracing::error!(
                    template = NAME,
                    "the {NAME} template could not be built after {seconds:.1} s: {message}; \
                     {NAME} stays served from {target}"
                );
                builds.update(NAME, |s| {
                    s.state = BuildState::Failed;
                    s.error = Some(message);
                    s.seconds = Some(seconds);
                });
            }
        }
    });
}
