//! Template builds: `runcell template build NAME -f FILE`.
//!
//! A recipe ([`dockerfile`]) becomes a stack of layers ([`layers`]) and a
//! manifest (`<templates>/<name>/template.json`):
//!
//! * `FROM debian:<suite>` runs debootstrap on the host into the base layer,
//!   then moves its ownership into the sandbox id range;
//! * `RUN` runs in a runcell sandbox made from the layers so far, as root of
//!   the sandbox (an unprivileged host uid) or the recipe's `USER`, in the
//!   host's network namespace, with its writable layer on disk: that
//!   directory becomes the step's layer;
//! * `COPY` and `WORKDIR` write their layer on the host; `ENV`, `USER` and
//!   `LABEL` only change the manifest.
//!
//! Every step has a cache key chained from the previous one; a step whose
//! layer exists is not run again. The manifest is written (atomically) only
//! after every step succeeded, so a failed build leaves no template.

pub mod dockerfile;
pub mod layers;

use std::collections::{BTreeMap, HashSet};
use std::fs;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use runcell_jail::{RootfsSpec, SandboxUser};
use runcell_protocol::{Command, ExecUser};

use crate::limits::{parse_size, SandboxLimits};
use crate::runtime::{Runtime, SandboxOptions};
use crate::sandbox::{Output, RunOptions};
use crate::template::{Manifest, Template, TemplateDefaults, TemplateError};
use dockerfile::{Base, Instruction, ParseError, Step};
use layers::{LayerError, Store};

/// The Debian mirror `FROM debian:<suite>` bootstraps from.
pub const DEBIAN_MIRROR: &str = "http://deb.debian.org/debian";

/// Longest a single `RUN` step may take.
const STEP_TIMEOUT: Duration = Duration::from_secs(3600);

/// Errors of a build, of `template rm` and of `template ls`.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    /// The recipe file could not be read.
    #[error("Could not read the recipe {0}.")]
    ReadRecipe(PathBuf, #[source] std::io::Error),
    /// The recipe is not valid.
    #[error(transparent)]
    Parse(#[from] ParseError),
    /// The template name is not usable.
    #[error("\"{0}\" is not a valid template name: use letters, digits, '-', '_' and '.', not starting with '.' (and not \"host\").")]
    BadName(String),
    /// A directory template of that name exists.
    #[error("Template \"{0}\" is a directory template (it has a rootfs directory); remove it by hand first.")]
    DirectoryTemplate(String),
    /// The base template cannot be built on.
    #[error("Line {line}: template \"{name}\" cannot be a base: only layered templates (built with runcell template build) can.")]
    BaseNotLayered {
        /// Line of the FROM.
        line: usize,
        /// The template named.
        name: String,
    },
    /// A template problem.
    #[error(transparent)]
    Template(#[from] TemplateError),
    /// debootstrap is not installed.
    #[error("debootstrap is not installed; FROM debian:<suite> needs it (apt-get install debootstrap, or scripts/install-deps.sh).")]
    DebootstrapMissing,
    /// debootstrap failed.
    #[error("Line {line}: debootstrap of Debian {suite} failed ({status}).")]
    Debootstrap {
        /// Line of the FROM.
        line: usize,
        /// The suite.
        suite: String,
        /// How it ended.
        status: String,
    },
    /// A RUN step exited unsuccessfully.
    #[error("Step {index}/{total} (line {line}) failed: `{text}` {status}.")]
    StepFailed {
        /// Step number (1-based).
        index: usize,
        /// Number of steps.
        total: usize,
        /// Line in the recipe.
        line: usize,
        /// The instruction.
        text: String,
        /// How it ended, as words.
        status: String,
    },
    /// A step could not be carried out.
    #[error("Line {line}: {message}")]
    Step {
        /// Line in the recipe.
        line: usize,
        /// A sentence.
        message: String,
    },
    /// A step failed on a layer operation.
    #[error("Line {line}: {source}")]
    Layer {
        /// Line in the recipe.
        line: usize,
        /// The cause.
        #[source]
        source: LayerError,
    },
    /// The layer store failed outside a step.
    #[error(transparent)]
    Store(#[from] LayerError),
    /// The build sandbox failed.
    #[error("Line {line}: the build sandbox failed: {source}")]
    Sandbox {
        /// Line in the recipe.
        line: usize,
        /// The cause.
        #[source]
        source: Box<crate::Error>,
    },
    /// Writing the manifest failed.
    #[error("Could not install template \"{0}\".")]
    Install(String, #[source] std::io::Error),
    /// Removing a template failed.
    #[error("Could not remove template \"{0}\".")]
    Remove(String, #[source] std::io::Error),
    /// A task was lost.
    #[error("An internal task failed.")]
    Task(#[source] tokio::task::JoinError),
}

/// What a build reports as it goes.
#[derive(Debug)]
pub enum Progress<'a> {
    /// A step starts.
    Step {
        /// 1-based.
        index: usize,
        /// Number of steps.
        total: usize,
        /// `KEYWORD arguments`.
        text: &'a str,
    },
    /// The current step's layer was found in the cache.
    Cached,
    /// Output of debootstrap or of a RUN command.
    Output(Output, &'a [u8]),
}

/// What to build.
#[derive(Debug, Clone)]
pub struct BuildOptions {
    /// Template name.
    pub name: String,
    /// The recipe's text.
    pub recipe: String,
    /// Directory COPY sources are relative to.
    pub context: PathBuf,
    /// The Debian mirror for `FROM debian:<suite>`.
    pub mirror: String,
}

/// A finished build.
#[derive(Debug)]
pub struct BuildSummary {
    /// The installed template.
    pub template: Template,
    /// Number of steps.
    pub steps: usize,
    /// Steps found in the cache.
    pub cached: usize,
    /// Wall-clock time of the build.
    pub elapsed: Duration,
}

/// The image state between steps.
#[derive(Debug, Default)]
struct State {
    key: String,
    layers: Vec<String>,
    env: BTreeMap<String, String>,
    workdir: Option<String>,
    user: Option<SandboxUser>,
    defaults: TemplateDefaults,
    description: String,
    from: String,
}

impl State {
    /// Layer directories, topmost first.
    fn stack(&self, store: &Store) -> Vec<PathBuf> {
        self.layers.iter().rev().map(|k| store.path(k)).collect()
    }
}

fn templates_dir(runtime: &Runtime) -> Result<PathBuf, BuildError> {
    runtime
        .config()
        .templates_dir
        .clone()
        .ok_or_else(|| BuildError::Step {
            line: 0,
            message: "no templates directory is configured.".into(),
        })
}

fn store(runtime: &Runtime) -> Result<Store, BuildError> {
    let map = runtime.config().id_map;
    Ok(Store::open(
        &templates_dir(runtime)?,
        map.host_base,
        map.count,
    )?)
}

/// Builds and installs a template. Requires root (debootstrap, layer
/// ownership, sandboxes).
pub async fn build(
    runtime: &Runtime,
    opts: &BuildOptions,
    progress: &mut (dyn FnMut(Progress<'_>) + Send),
) -> Result<BuildSummary, BuildError> {
    let started = Instant::now();
    if !Template::valid_name(&opts.name) {
        return Err(BuildError::BadName(opts.name.clone()));
    }
    let steps = dockerfile::parse(&opts.recipe)?;
    let store = store(runtime)?;
    let dir = store.templates_dir().to_path_buf();
    if dir.join(&opts.name).join("rootfs").exists() {
        return Err(BuildError::DirectoryTemplate(opts.name.clone()));
    }
    let _lock = store.lock(false)?;
    let total = steps.len();
    let mut state = State::default();
    let mut cached = 0;
    let mut all_cached = true;
    for (i, step) in steps.iter().enumerate() {
        progress(Progress::Step {
            index: i + 1,
            total,
            text: &step.text,
        });
        let hit = run_step(runtime, &store, opts, &mut state, step, progress)
            .await
            .map_err(|e| match e {
                BuildError::StepFailed { status, .. } => BuildError::StepFailed {
                    index: i + 1,
                    total,
                    line: step.line,
                    text: step.text.clone(),
                    status,
                },
                other => other,
            })?;
        let hit = match hit {
            Hit::Layer(h) => h,
            Hit::Metadata => all_cached,
        };
        all_cached &= hit;
        if hit {
            cached += 1;
            progress(Progress::Cached);
        }
    }
    let template = install(&store, &opts.name, state)?;
    Ok(BuildSummary {
        template,
        steps: total,
        cached,
        elapsed: started.elapsed(),
    })
}

enum Hit {
    /// A step with a layer: whether it came from the cache.
    Layer(bool),
    /// A metadata-only step (cached when everything before it was).
    Metadata,
}

async fn run_step(
    runtime: &Runtime,
    store: &Store,
    opts: &BuildOptions,
    state: &mut State,
    step: &Step,
    progress: &mut (dyn FnMut(Progress<'_>) + Send),
) -> Result<Hit, BuildError> {
    let line = step.line;
    let layer_err = |source| BuildError::Layer { line, source };
    match &step.instruction {
        Instruction::From(Base::Debian { suite }) => {
            state.key = layers::debian_key(suite, &opts.mirror);
            state.from = format!("debian:{suite}");
            let hit = store.exists(&state.key);
            if !hit {
                debootstrap(store, suite, &opts.mirror, &state.key, line, progress).await?;
            }
            state.layers = vec![state.key.clone()];
            Ok(Hit::Layer(hit))
        }
        Instruction::From(Base::Template(name)) => {
            let dir = store.templates_dir();
            let manifest = Manifest::read(dir, name)?;
            let Some(m) = manifest.filter(|m| !m.layers.is_empty() && m.key.is_some()) else {
                if Template::installed(Some(dir)).contains(name) {
                    return Err(BuildError::BaseNotLayered {
                        line,
                        name: name.clone(),
                    });
                }
                return Err(TemplateError::Unknown {
                    name: name.clone(),
                    installed: Template::installed(Some(dir)),
                }
                .into());
            };
            // Checks that every layer is there.
            Template::find(Some(dir), name)?;
            *state = State {
                key: m.key.clone().unwrap_or_default(),
                layers: m.layers,
                env: m.env,
                workdir: m.workdir,
                user: m.user,
                defaults: m.defaults,
                description: m.description,
                from: name.clone(),
            };
            Ok(Hit::Layer(true))
        }
        Instruction::Run(cmd) => {
            let key = layers::step_key(&state.key, &step.text, "");
            let hit = store.exists(&key);
            if !hit {
                run_in_sandbox(runtime, store, state, &cmd.argv(), &key, step, progress).await?;
            }
            state.key = key.clone();
            state.layers.push(key);
            Ok(Hit::Layer(hit))
        }
        Instruction::Copy { sources, dest } => {
            let resolved = layers::resolve_sources(&opts.context, sources).map_err(layer_err)?;
            let hash = layers::content_hash(&resolved).map_err(layer_err)?;
            let dest = absolute(state.workdir.as_deref(), dest);
            let key = layers::step_key(&state.key, &step.text, &format!("{hash} {dest}"));
            let hit = store.exists(&key);
            if !hit {
                let pending = store.begin(false)?;
                let diff = pending.diff();
                fs::create_dir(&diff).map_err(|e| BuildError::Step {
                    line,
                    message: format!("could not create {}: {e}.", diff.display()),
                })?;
                let stack = state.stack(store);
                let base = store.base;
                layers::copy_into_layer(&diff, &stack, &resolved, &dest, base)
                    .map_err(layer_err)?;
                own_layer_root(&diff, base, line)?;
                store.commit(pending, &key, &step.text)?;
            }
            state.key = key.clone();
            state.layers.push(key);
            Ok(Hit::Layer(hit))
        }
        Instruction::Workdir(path) => {
            let dir = absolute(state.workdir.as_deref(), path);
            let key = layers::step_key(&state.key, &step.text, &dir);
            state.workdir = Some(dir.clone());
            let rel = layers::image_rel(&dir);
            let exists = layers::lookup(&state.stack(store), &rel)
                .map_err(layer_err)?
                .is_some();
            let hit = store.exists(&key);
            if hit || !exists {
                if !hit {
                    let pending = store.begin(false)?;
                    let diff = pending.diff();
                    fs::create_dir(&diff).map_err(|e| BuildError::Step {
                        line,
                        message: format!("could not create {}: {e}.", diff.display()),
                    })?;
                    layers::make_dirs_like_image(&diff, &state.stack(store), &rel, store.base)
                        .map_err(layer_err)?;
                    own_layer_root(&diff, store.base, line)?;
                    store.commit(pending, &key, &step.text)?;
                }
                state.key = key.clone();
                state.layers.push(key);
                return Ok(Hit::Layer(hit));
            }
            state.key = key;
            Ok(Hit::Metadata)
        }
        Instruction::Env(pairs) => {
            state.key = layers::step_key(&state.key, &step.text, "");
            for (k, v) in pairs {
                state.env.insert(k.clone(), v.clone());
            }
            Ok(Hit::Metadata)
        }
        Instruction::User { user, group } => {
            state.key = layers::step_key(&state.key, &step.text, "");
            state.user = Some(resolve_user(store, state, user, group.as_deref(), line)?);
            Ok(Hit::Metadata)
        }
        Instruction::Label(pairs) => {
            state.key = layers::step_key(&state.key, &step.text, "");
            for (k, v) in pairs {
                apply_label(&mut state.defaults, &mut state.description, k, v)
                    .map_err(|message| BuildError::Step { line, message })?;
            }
            Ok(Hit::Metadata)
        }
    }
}

/// The root directory of a host-made layer must look like the image's root
/// (root of the sandbox, 0755), since the topmost layer's root wins.
fn own_layer_root(diff: &Path, base: u32, line: usize) -> Result<(), BuildError> {
    use std::os::unix::fs::PermissionsExt;
    std::os::unix::fs::lchown(diff, Some(base), Some(base))
        .and_then(|()| fs::set_permissions(diff, fs::Permissions::from_mode(0o755)))
        .map_err(|e| BuildError::Step {
            line,
            message: format!("could not prepare the layer {}: {e}.", diff.display()),
        })
}

/// An image path: absolute as given, or relative to the working directory.
fn absolute(workdir: Option<&str>, path: &str) -> String {
    if path.starts_with('/') {
        path.to_string()
    } else {
        let base = workdir.unwrap_or("/").trim_end_matches('/');
        format!("{base}/{path}")
    }
}

fn resolve_user(
    store: &Store,
    state: &State,
    user: &str,
    group: Option<&str>,
    line: usize,
) -> Result<SandboxUser, BuildError> {
    let stack = state.stack(store);
    let passwd = layers::read_image_file(&stack, "etc/passwd").unwrap_or_default();
    let numeric = |s: &str| s.parse::<u32>().ok();
    let (name, uid, mut gid, home) = match layers::passwd_entry(&passwd, user) {
        Some(entry) => entry,
        None => match numeric(user) {
            Some(uid) => (user.to_string(), uid, uid, "/".to_string()),
            None => {
                return Err(BuildError::Step {
                    line,
                    message: format!("USER {user}: no such user in the image's /etc/passwd (create it with RUN useradd first)."),
                })
            }
        },
    };
    if let Some(g) = group {
        let groups = layers::read_image_file(&stack, "etc/group").unwrap_or_default();
        gid = match layers::group_gid(&groups, g).or_else(|| numeric(g)) {
            Some(gid) => gid,
            None => {
                return Err(BuildError::Step {
                    line,
                    message: format!("USER {user}:{g}: no such group in the image's /etc/group."),
                })
            }
        };
    }
    if uid >= store.count || gid >= store.count {
        return Err(BuildError::Step {
            line,
            message: format!(
                "USER {user}: uid {uid} / gid {gid} is outside the sandbox's id range (0-{}).",
                store.count - 1
            ),
        });
    }
    Ok(SandboxUser {
        name,
        uid,
        gid,
        home,
    })
}

/// `LABEL` keys with a meaning: `description` (or `runcell.description`)
/// and the `runcell.*` defaults. Other labels are accepted and ignored.
fn apply_label(
    defaults: &mut TemplateDefaults,
    description: &mut String,
    key: &str,
    value: &str,
) -> Result<(), String> {
    match key {
        "description" | "runcell.description" => *description = value.to_string(),
        "runcell.memory" => {
            defaults.memory_bytes = Some(parse_size(value).map_err(|e| format!("LABEL {key}: {e}"))?)
        }
        "runcell.cpu" => {
            let cores: f64 = value
                .parse()
                .ok()
                .filter(|c: &f64| *c > 0.0 && c.is_finite())
                .ok_or_else(|| format!("LABEL {key}: \"{value}\" is not a positive number of cores."))?;
            defaults.cpu_millis = Some(runcell_protocol::units::cpu_millis(cores));
        }
        "runcell.timeout" => {
            defaults.timeout_secs = Some(parse_secs(value).ok_or_else(|| {
                format!("LABEL {key}: \"{value}\" is not a duration in whole seconds (e.g. 30s, 2m).")
            })?)
        }
        "runcell.network" => {
            if value.is_empty()
                || !value
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
            {
                return Err(format!("LABEL {key}: \"{value}\" is not a policy name (e.g. none)."));
            }
            defaults.network = Some(value.to_string());
        }
        "runcell.isolation" => {
            defaults.isolation = Some(
                value
                    .parse()
                    .map_err(|e: crate::backend::UnknownIsolation| format!("LABEL {key}: {e}"))?,
            );
        }
        "runcell.preload" => {
            defaults.preload = value.split_whitespace().map(str::to_string).collect();
        }
        k if k.starts_with("runcell.") => {
            return Err(format!(
                "LABEL {k} is not a runcell setting; use runcell.memory, runcell.cpu, runcell.timeout, runcell.network, runcell.isolation, runcell.preload or runcell.description."
            ))
        }
        _ => {}
    }
    Ok(())
}

/// `30`, `30s`, `2m`, `1h` as whole seconds (at least 1).
fn parse_secs(s: &str) -> Option<u64> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let n: u64 = t[..split].parse().ok()?;
    let secs = match &t[split..] {
        "" | "s" => n,
        "m" => n * 60,
        "h" => n * 3600,
        _ => return None,
    };
    (secs > 0).then_some(secs)
}

async fn debootstrap(
    store: &Store,
    suite: &str,
    mirror: &str,
    key: &str,
    line: usize,
    progress: &mut (dyn FnMut(Progress<'_>) + Send),
) -> Result<(), BuildError> {
    let program =
        runcell_jail::host_tools::find("debootstrap").ok_or(BuildError::DebootstrapMissing)?;
    let pending = store.begin(false)?;
    let diff = pending.diff();
    tracing::info!(suite, target = %diff.display(), "running debootstrap");
    let mut child = tokio::process::Command::new(program)
        .args(["--variant=minbase", suite])
        .arg(&diff)
        .arg(mirror)
        // A shell script that runs chroot, dpkg and mount by name.
        .env("PATH", runcell_jail::host_tools::search_path())
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| BuildError::Step {
            line,
            message: format!("could not start debootstrap: {e}."),
        })?;
    let status = pump_child(&mut child, progress)
        .await
        .map_err(|e| BuildError::Step {
            line,
            message: format!("debootstrap failed: {e}."),
        })?;
    if !status.success() {
        return Err(BuildError::Debootstrap {
            line,
            suite: suite.into(),
            status: status.to_string(),
        });
    }
    let (base, count) = (store.base, store.count);
    let root = diff.clone();
    tokio::task::spawn_blocking(move || layers::prepare_debootstrap(&root, base, count))
        .await
        .map_err(BuildError::Task)?
        .map_err(|source| BuildError::Layer { line, source })?;
    own_layer_root(&diff, base, line)?;
    store.commit(pending, key, &format!("FROM debian:{suite}"))?;
    Ok(())
}

/// Forwards a host child's stdout and stderr as progress until it exits.
async fn pump_child(
    child: &mut tokio::process::Child,
    progress: &mut (dyn FnMut(Progress<'_>) + Send),
) -> std::io::Result<std::process::ExitStatus> {
    use tokio::io::AsyncReadExt;
    let mut out = child.stdout.take();
    let mut err = child.stderr.take();
    let (mut ob, mut eb) = (vec![0u8; 16 << 10], vec![0u8; 16 << 10]);
    while out.is_some() || err.is_some() {
        tokio::select! {
            r = async { out.as_mut().expect("guarded").read(&mut ob).await }, if out.is_some() => match r {
                Ok(0) | Err(_) => out = None,
                Ok(n) => progress(Progress::Output(Output::Stdout, &ob[..n])),
            },
            r = async { err.as_mut().expect("guarded").read(&mut eb).await }, if err.is_some() => match r {
                Ok(0) | Err(_) => err = None,
                Ok(n) => progress(Progress::Output(Output::Stderr, &eb[..n])),
            },
        }
    }
    child.wait().await
}

async fn run_in_sandbox(
    runtime: &Runtime,
    store: &Store,
    state: &State,
    argv: &[String],
    key: &str,
    step: &Step,
    progress: &mut (dyn FnMut(Progress<'_>) + Send),
) -> Result<(), BuildError> {
    let line = step.line;
    let pending = store.begin(true)?;
    let template = Template {
        name: "build".into(),
        description: String::new(),
        rootfs: RootfsSpec::Layers {
            lowers: state.stack(store),
            persist: Some(pending.dir.clone()),
        },
        env: BTreeMap::new(),
        workdir: None,
        user: None,
        defaults: TemplateDefaults::default(),
        size_bytes: 0,
        created_unix: 0,
    };
    let limits = SandboxLimits {
        memory_bytes: 4 << 30,
        pids: 4096,
        cpu_millis: 1000 * std::thread::available_parallelism().map_or(1, |n| n.get() as u64),
        disk_bytes: 64 << 20,
        timeout: STEP_TIMEOUT,
        output_bytes: 256 << 20,
    };
    let opts = SandboxOptions {
        template: "build".into(),
        limits,
        tied_to_process: true,
        max_lifetime: Some(STEP_TIMEOUT + Duration::from_secs(60)),
        network: None,
        // A build step needs the host's network, which only the jail keeps.
        isolation: Some(crate::backend::Isolation::Jail),
        ..SandboxOptions::default()
    };
    let sandbox = runtime
        .create_from(template, opts, true)
        .await
        .map_err(|e| BuildError::Sandbox {
            line,
            source: Box::new(e),
        })?;
    let user = match &state.user {
        Some(u) => ExecUser {
            name: u.name.clone(),
            uid: u.uid,
            gid: u.gid,
            home: u.home.clone(),
        },
        None => ExecUser {
            name: "root".into(),
            uid: 0,
            gid: 0,
            home: "/root".into(),
        },
    };
    let run = RunOptions {
        env: state.env.clone(),
        cwd: Some(state.workdir.clone().unwrap_or_else(|| "/".into())),
        timeout: Some(STEP_TIMEOUT),
        user: Some(user),
        ..RunOptions::default()
    };
    let result = sandbox
        .exec_streaming(Command::Argv(argv.to_vec()), &run, |stream, bytes| {
            progress(Progress::Output(stream, bytes))
        })
        .await;
    let destroyed = sandbox.destroy().await;
    let outcome = result.map_err(|e| BuildError::Sandbox {
        line,
        source: Box::new(e),
    })?;
    destroyed.map_err(|e| BuildError::Sandbox {
        line,
        source: Box::new(e),
    })?;
    if outcome.status() != 0 {
        let mut status = match (outcome.exit.exit_code, outcome.exit.signal) {
            _ if outcome.exit.timed_out => {
                format!("timed out after {} s", crate::format_secs(outcome.timeout))
            }
            (Some(c), _) => format!("exited with status {c}"),
            (None, Some(s)) => format!("was killed by signal {s}"),
            (None, None) => "ended without a status".into(),
        };
        for m in outcome.messages() {
            status.push_str(&format!(" ({m})"));
        }
        // `pending` is dropped here: the half-made layer is removed.
        return Err(BuildError::StepFailed {
            index: 0,
            total: 0,
            line,
            text: step.text.clone(),
            status,
        });
    }
    store.commit(pending, key, &step.text)?;
    Ok(())
}

/// Writes the manifest: `<name>/template.json` is replaced in one rename.
fn install(store: &Store, name: &str, state: State) -> Result<Template, BuildError> {
    if state.user.as_ref().is_some_and(|u| u.uid == 0) {
        return Err(BuildError::Step {
            line: 0,
            message: "the recipe ends as USER root; sandboxed code always runs unprivileged, so switch to another user (or remove USER) at the end.".into(),
        });
    }
    let dir = store.templates_dir().join(name);
    let install_err = |e| BuildError::Install(name.into(), e);
    let size_bytes = state.layers.iter().map(|k| store.size(k)).sum();
    let manifest = Manifest {
        description: state.description,
        layers: state.layers,
        key: Some(state.key),
        from: Some(state.from),
        env: state.env,
        workdir: state.workdir,
        user: state.user,
        defaults: state.defaults,
        size_bytes,
        created_unix: layers::now_unix(),
    };
    fs::create_dir_all(&dir).map_err(install_err)?;
    let tmp = dir.join(format!(".template.json.{}", uuid::Uuid::new_v4()));
    fs::write(
        &tmp,
        serde_json::to_vec_pretty(&manifest).expect("serializes"),
    )
    .map_err(install_err)?;
    fs::rename(&tmp, dir.join("template.json")).map_err(|e| {
        let _ = fs::remove_file(&tmp);
        install_err(e)
    })?;
    Ok(Template::find(Some(store.templates_dir()), name)?)
}

/// What `template rm` freed.
#[derive(Debug, Clone, Copy)]
pub struct Removed {
    /// Layers no template referenced any more.
    pub layers: usize,
    /// Their disk use, bytes.
    pub bytes: u64,
}

/// Removes a layered template and every layer no remaining template uses.
pub fn remove(runtime: &Runtime, name: &str) -> Result<Removed, BuildError> {
    let store = store(runtime)?;
    let dir = store.templates_dir().to_path_buf();
    if !Template::valid_name(name) || !Template::installed(Some(&dir)).iter().any(|n| n == name) {
        return Err(TemplateError::Unknown {
            name: name.into(),
            installed: Template::installed(Some(&dir)),
        }
        .into());
    }
    if dir.join(name).join("rootfs").exists() {
        return Err(BuildError::DirectoryTemplate(name.into()));
    }
    let _lock = store.lock(true)?;
    fs::remove_dir_all(dir.join(name)).map_err(|e| BuildError::Remove(name.into(), e))?;
    let (layers, bytes) = gc(&store)?;
    Ok(Removed { layers, bytes })
}

fn gc(store: &Store) -> Result<(usize, u64), BuildError> {
    let dir = store.templates_dir();
    let mut keep = HashSet::new();
    for n in Template::installed(Some(dir)).iter().skip(1) {
        if let Some(m) = Manifest::read(dir, n)? {
            keep.extend(m.layers);
        }
    }
    Ok(store.gc(&keep)?)
}

/// The installed templates with their manifests (`host` has none).
pub fn list(dir: Option<&Path>) -> Result<Vec<Template>, BuildError> {
    Template::installed(dir)
        .iter()
        .map(|n| Template::find(dir, n).map_err(BuildError::from))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_set_defaults() {
        let mut d = TemplateDefaults::default();
        let mut desc = String::new();
        for (k, v) in [
            ("runcell.memory", "1g"),
            ("runcell.cpu", "1.5"),
            ("runcell.timeout", "2m"),
            ("runcell.network", "none"),
            ("runcell.isolation", "gvisor"),
            ("runcell.preload", "numpy  pandas matplotlib.pyplot"),
            ("description", "Python for analysts"),
            ("maintainer", "someone"),
        ] {
            apply_label(&mut d, &mut desc, k, v).unwrap();
        }
        assert_eq!(d.memory_bytes, Some(1 << 30));
        assert_eq!(d.cpu_millis, Some(1500));
        assert_eq!(d.timeout_secs, Some(120));
        assert_eq!(d.network.as_deref(), Some("none"));
        assert_eq!(d.isolation, Some(crate::backend::Isolation::Gvisor));
        assert!(apply_label(&mut d, &mut desc, "runcell.isolation", "vm").is_err());
        assert_eq!(d.preload, vec!["numpy", "pandas", "matplotlib.pyplot"]);
        assert_eq!(desc, "Python for analysts");
        assert!(apply_label(&mut d, &mut desc, "runcell.memroy", "1g").is_err());
        assert!(apply_label(&mut d, &mut desc, "runcell.timeout", "soon").is_err());
        assert!(apply_label(&mut d, &mut desc, "runcell.cpu", "-1").is_err());
    }

    #[test]
    fn relative_paths_follow_the_workdir() {
        assert_eq!(absolute(None, "app"), "/app");
        assert_eq!(absolute(Some("/srv/"), "x/y"), "/srv/x/y");
        assert_eq!(absolute(Some("/srv"), "/abs"), "/abs");
    }
}
