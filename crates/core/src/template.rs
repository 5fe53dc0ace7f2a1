//! Templates: what a sandbox's read-only root is made of.
//!
//! The built-in `host` template exposes the host's system directories (`/usr`
//! and the merged-usr links) read-only, so runcell works on a fresh machine
//! with nothing to build. Directory templates (`<templates>/<name>/rootfs`,
//! with a `template.json` manifest) are full root trees; the template builder
//! of a later milestone produces them.

use std::fs;
use std::path::{Path, PathBuf};

use runcell_jail::RootfsSpec;
use serde::{Deserialize, Serialize};

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
}

/// The manifest of a directory template (`template.json`).
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Manifest {
    #[serde(default)]
    description: String,
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
        }
    }

    /// Finds a template by name: `host`, or a directory under `dir`.
    pub fn find(dir: Option<&Path>, name: &str) -> Result<Self, TemplateError> {
        if name == "host" {
            return Ok(Self::host());
        }
        let valid = !name.is_empty()
            && name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
            && !name.starts_with('.');
        if let (true, Some(dir)) = (valid, dir) {
            let root = dir.join(name);
            if root.join("rootfs").is_dir() {
                let manifest = match fs::read(root.join("template.json")) {
                    Ok(raw) => serde_json::from_slice(&raw)
                        .map_err(|e| TemplateError::BadManifest(name.into(), e))?,
                    Err(_) => Manifest {
                        description: String::new(),
                    },
                };
                return Ok(Self {
                    name: name.into(),
                    description: manifest.description,
                    rootfs: RootfsSpec::Directory {
                        path: root.join("rootfs"),
                    },
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
            .filter(|e| e.path().join("rootfs").is_dir())
            .filter_map(|e| e.file_name().into_string().ok())
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
}
