//! Templates: what a sandbox's read-only root is made of.
//!
//! The built-in `host` template exposes the host's system directories (`/usr`
//! and the merged-usr links) read-only, so runcell works on a fresh machine
//! with nothing to build. Installed templates live in the templates directory
//! (`/var/lib/runcell/templates` by default), one subdirectory per template:
//!
//! * a **layered** template (`runcell template build`) is a `template.json`
//!   manifest naming its layers, bottom first; each layer is a directory
//!   `<templates>/.layers/<key>/diff` shared by every template built on it;
//! * a **directory** template is a full root tree in `<name>/rootfs`, with
//!   an optional `template.json`.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

use runcell_jail::{RootfsSpec, SandboxUser};
use serde::{Deserialize, Serialize};

use crate::limits::SandboxLimits;

/// The directory under the templates directory that holds every layer.
pub const LAYERS_DIR: &str = ".layers";

/// The template a sandbox gets when its creator names none: the API, the
/// CLI, the MCP tools and the SDKs all default to it. Until a template of
/// this name is installed, the daemon serves it from `host` (an alias) and
/// says so.
pub const DEFAULT_TEMPLATE: &str = "code-interpreter";

/// Template errors.
#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    /// No such template.
    #[error("Unknown template \"{name}\"; installed templates: {}.", installed.join(", "))]
    Unknown {
        /// The name asked for.
        name: String,
        /// What is installed.
        installed: Vec<String>,
    },
    /// The manifest is unreadable.
    #[error("The manifest of template \"{0}\" is invalid.")]
    BadManifest(String, #[source] serde_json::Error),
    /// A layer the manifest names is gone.
    #[error("Template \"{name}\" is damaged: its layer {layer} is missing; rebuild it.")]
    MissingLayer {
        /// The template.
        name: String,
        /// The missing layer's key.
        layer: String,
    },
}

/// What a template suggests for sandboxes made from it (the recipe's
/// `LABEL runcell.*=...`). Each is absent unless the recipe set it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TemplateDefaults {
    /// Memory limit, bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_bytes: Option<u64>,
    /// CPU in thousandths of a core.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_millis: Option<u64>,
    /// Default timeout of one run, seconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_secs: Option<u64>,
    /// Default network egress policy of the template's sandboxes in the
    /// daemon (`none`, `open`, `allowlist:RULE;RULE` or a JSON policy; see
    /// [`runcell_egress::NetworkPolicy::parse_setting`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<String>,
    /// The isolation its sandboxes get unless a request asks for another
    /// (`LABEL runcell.isolation=gvisor`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub isolation: Option<crate::backend::Isolation>,
    /// Python modules a warm context imports ahead of time.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub preload: Vec<String>,
}

impl TemplateDefaults {
    /// `limits` with the template's memory, CPU and timeout where it sets them.
    pub fn apply(&self, mut limits: SandboxLimits) -> SandboxLimits {
        if let Some(m) = self.memory_bytes {
            limits.memory_bytes = m;
        }
        if let Some(c) = self.cpu_millis {
            limits.cpu_millis = c;
        }
        if let Some(t) = self.timeout_secs {
            limits.timeout = std::time::Duration::from_secs(t);
        }
        limits
    }
}

/// The manifest of an installed template (`<templates>/<name>/template.json`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    /// One line for listings.
    #[serde(default)]
    pub description: String,
    /// Layer keys, bottom first (layered templates only).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub layers: Vec<String>,
    /// The cache key of the recipe's last step; a recipe that starts `FROM`
    /// this template continues the chain from it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
    /// What the recipe started from (`debian:bookworm`, or a template).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from: Option<String>,
    /// Environment of every process (`ENV`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
    /// Default working directory (`WORKDIR`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workdir: Option<String>,
    /// The user code runs as (`USER`); the standard sandbox user when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<SandboxUser>,
    /// Suggested limits and preloads.
    #[serde(default)]
    pub defaults: TemplateDefaults,
    /// Disk use of its layers, bytes.
    #[serde(default)]
    pub size_bytes: u64,
    /// When it was built, unix seconds.
    #[serde(default)]
    pub created_unix: u64,
}

impl Manifest {
    /// Reads `<dir>/<name>/template.json`; `None` when there is none.
    pub fn read(dir: &Path, name: &str) -> Result<Option<Manifest>, TemplateError> {
        match fs::read(dir.join(name).join("template.json")) {
            Ok(raw) => serde_json::from_slice(&raw)
                .map(Some)
                .map_err(|e| TemplateError::BadManifest(name.into(), e)),
            Err(_) => Ok(None),
        }
    }
}

/// The directory of one layer's files: `<templates>/.layers/<key>/diff`.
pub fn layer_path(templates_dir: &Path, key: &str) -> PathBuf {
    templates_dir.join(LAYERS_DIR).join(key).join("diff")
}

/// A template.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Template {
    /// Name.
    pub name: String,
    /// One line for listings.
    pub description: String,
    /// How the root is assembled.
    pub rootfs: RootfsSpec,
    /// Environment every process starts with (`ENV`).
    pub env: BTreeMap<String, String>,
    /// Default working directory (`WORKDIR`); the user's home when absent.
    pub workdir: Option<String>,
    /// The user code runs as (`USER`); the standard sandbox user when absent.
    pub user: Option<SandboxUser>,
    /// Suggested limits, network policy and preloads.
    pub defaults: TemplateDefaults,
    /// Disk use, bytes (0 when unknown).
    pub size_bytes: u64,
    /// When it was built, unix seconds (0 when unknown).
    pub created_unix: u64,
}

fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 128
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        && !name.starts_with('.')
}

impl Template {
    /// The built-in `host` template. Its interpreters are the host's:
    /// `python3` is `/usr/bin/python3`, `node` is `/usr/bin/node`.
    pub fn host() -> Self {
        Self {
            name: "host".into(),
            description: "The host's /usr, read-only, under a private writable layer".into(),
            rootfs: RootfsSpec::Host {
                paths: [
                    "/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32",
                ]
                .iter()
                .map(PathBuf::from)
                .collect(),
                etc: [
                    "alternatives",
                    "ssl",
                    "ca-certificates",
                    "ca-certificates.conf",
                    "ld.so.cache",
                    "ld.so.conf",
                    "ld.so.conf.d",
                    "localtime",
                    "timezone",
                    "os-release",
                    "mime.types",
                    "matplotlibrc",
                    "python3",
                    "python3.11",
                    "bash.bashrc",
                    "profile",
                    "inputrc",
                ]
                .iter()
                .map(|s| s.to_string())
                .collect(),
            },
            env: BTreeMap::new(),
            workdir: None,
            user: None,
            defaults: TemplateDefaults::default(),
            size_bytes: 0,
            created_unix: 0,
        }
    }

    /// Whether `name` can name an installed template (letters, digits, `-`,
    /// `_`, `.`, not starting with `.`; `host` is built in).
    pub fn valid_name(name: &str) -> bool {
        valid_name(name) && name != "host"
    }

    /// Finds a template by name: `host`, or an installed one under `dir`.
    pub fn find(dir: Option<&Path>, name: &str) -> Result<Self, TemplateError> {
        if name == "host" {
            return Ok(Self::host());
        }
        if let (true, Some(dir)) = (valid_name(name), dir) {
            let root = dir.join(name);
            let manifest = Manifest::read(dir, name)?;
            let rootfs = if root.join("rootfs").is_dir() {
                Some(RootfsSpec::Directory {
                    path: root.join("rootfs"),
                })
            } else {
                match &manifest {
                    Some(m) if !m.layers.is_empty() => {
                        let mut lowers = Vec::with_capacity(m.layers.len());
                        for key in m.layers.iter().rev() {
                            let path = layer_path(dir, key);
                            if !path.is_dir() {
                                return Err(TemplateError::MissingLayer {
                                    name: name.into(),
                                    layer: key.clone(),
                                });
                            }
                            lowers.push(path);
                        }
                        Some(RootfsSpec::Layers {
                            lowers,
                            persist: None,
                        })
                    }
                    _ => None,
                }
            };
            if let Some(rootfs) = rootfs {
                let m = manifest.unwrap_or_default();
                return Ok(Self {
                    name: name.into(),
                    description: m.description,
                    rootfs,
                    env: m.env,
                    workdir: m.workdir,
                    user: m.user,
                    defaults: m.defaults,
                    size_bytes: m.size_bytes,
                    created_unix: m.created_unix,
                });
            }
        }
        Err(TemplateError::Unknown {
            name: name.into(),
            installed: Self::installed(dir),
        })
    }

    /// Names of every installed template, `host` first.
    pub fn installed(dir: Option<&Path>) -> Vec<String> {
        let mut names: Vec<String> = dir
            .and_then(|d| fs::read_dir(d).ok())
            .into_iter()
            .flatten()
            .flatten()
            .filter(|e| {
                let p = e.path();
                p.join("rootfs").is_dir() || p.join("template.json").is_file()
            })
            .filter_map(|e| e.file_name().into_string().ok())
            .filter(|n| valid_name(n) && n != "host")
            .collect();
        names.sort();
        names.insert(0, "host".into());
        names
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_host_and_directory_templates_and_names_the_installed_ones() {
        let tmp = tempfile::tempdir().unwrap();
        fs::create_dir_all(tmp.path().join("mini/rootfs")).unwrap();
        fs::write(
            tmp.path().join("mini/template.json"),
            r#"{"description":"tiny"}"#,
        )
        .unwrap();
        assert_eq!(Template::find(None, "host").unwrap().name, "host");
        let t = Template::find(Some(tmp.path()), "mini").unwrap();
        assert_eq!(t.description, "tiny");
        let err = Template::find(Some(tmp.path()), "nope")
            .unwrap_err()
            .to_string();
        assert_eq!(
            err,
            "Unknown template \"nope\"; installed templates: host, mini."
        );
        assert!(Template::find(Some(tmp.path()), "../mini").is_err());
    }

    #[test]
    fn layered_templates_stack_their_layers_topmost_first() {
        let tmp = tempfile::tempdir().unwrap();
        for key in ["aa", "bb"] {
            fs::create_dir_all(layer_path(tmp.path(), key)).unwrap();
        }
        fs::create_dir_all(tmp.path().join("py")).unwrap();
        let manifest = Manifest {
            description: "python".into(),
            layers: vec!["aa".into(), "bb".into()],
            env: [("A".to_string(), "1".to_string())].into(),
            workdir: Some("/app".into()),
            defaults: TemplateDefaults {
                memory_bytes: Some(1 << 30),
                preload: vec!["numpy".into()],
                ..Default::default()
            },
            ..Default::default()
        };
        fs::write(
            tmp.path().join("py/template.json"),
            serde_json::to_vec(&manifest).unwrap(),
        )
        .unwrap();
        let t = Template::find(Some(tmp.path()), "py").unwrap();
        assert_eq!(
            t.rootfs,
            RootfsSpec::Layers {
                lowers: vec![layer_path(tmp.path(), "bb"), layer_path(tmp.path(), "aa")],
                persist: None,
            }
        );
        assert_eq!(t.workdir.as_deref(), Some("/app"));
        assert_eq!(t.env["A"], "1");
        assert_eq!(t.defaults.preload, vec!["numpy".to_string()]);
        assert_eq!(Template::installed(Some(tmp.path())), vec!["host", "py"]);

        fs::remove_dir_all(tmp.path().join(LAYERS_DIR).join("aa")).unwrap();
        let err = Template::find(Some(tmp.path()), "py").unwrap_err();
        assert!(matches!(err, TemplateError::MissingLayer { .. }), "{err}");
    }

    #[test]
    fn defaults_override_only_what_they_set() {
        let d = TemplateDefaults {
            memory_bytes: Some(2 << 30),
            timeout_secs: Some(30),
            ..Default::default()
        };
        let l = d.apply(SandboxLimits::default());
        assert_eq!(l.memory_bytes, 2 << 30);
        assert_eq!(l.timeout, std::time::Duration::from_secs(30));
        assert_eq!(l.cpu_millis, SandboxLimits::default().cpu_millis);
    }
}
