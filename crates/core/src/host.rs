//! What this host offers each isolation backend, for `runcell doctor` and
//! `GET /v1/system`: the jail's layers as the kernel really provides them
//! ([`runcell_jail::probe`]), and for gVisor and the microVM whether their
//! tools are installed. A backend is available only when runcell can run
//! sandboxes with it here; otherwise the report says why not.

use serde::Serialize;

use crate::backend::Isolation;
use crate::Runtime;

pub use runcell_jail::probe::{CgroupReport, Check, HostReport};

/// One isolation backend on this host.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct BackendReport {
    /// `jail`, `gvisor` or `microvm` (the value of `isolation`).
    pub name: &'static str,
    /// Whether sandboxes can be created with it here.
    pub available: bool,
    /// What was found, or why it is not available.
    pub detail: String,
}

/// The host and its backends.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SystemReport {
    /// The kernel's security features and cgroups.
    pub host: HostReport,
    /// Every backend, available or not.
    pub backends: Vec<BackendReport>,
}

/// What the operator allows on this host, beyond what it can do.
#[derive(Debug, Clone, Default)]
pub struct HostOptions {
    /// Run microVMs under TCG emulation where KVM cannot run a guest.
    pub allow_emulation: bool,
}

/// Probes the host (a few reads of /proc and /sys, `runsc --version`).
pub fn system_report() -> SystemReport {
    system_report_with(&HostOptions::default())
}

/// [`system_report`] under the operator's `options`.
pub fn system_report_with(options: &HostOptions) -> SystemReport {
    let host = runcell_jail::probe::probe();
    let backends = vec![jail(&host), gvisor(), microvm(options)];
    SystemReport { host, backends }
}

/// Gives `runtime` a backend for every kind of isolation beyond its jail
/// that this host can run under `options`, and records for the others why
/// not (the error a create that asks for one gets). Answers the report it
/// was decided from.
pub fn equip(runtime: Runtime, options: &HostOptions) -> (Runtime, SystemReport) {
    let report = system_report_with(options);
    let mut runtime = runtime;
    for b in &report.backends {
        let Ok(isolation) = b.name.parse::<Isolation>() else {
            continue;
        };
        if isolation == Isolation::Jail {
            continue;
        }
        runtime = match backend_for(&runtime, isolation, b, options) {
            Some(backend) => runtime.add_backend(backend),
            None => runtime.mark_unavailable(isolation, b.detail.clone()),
        };
    }
    (runtime, report)
}

/// [`equip`] for one kind of isolation only (a one-shot `runcell run`):
/// the other backends are not probed, so asking for gVisor never boots a
/// test guest under KVM.
pub fn equip_one(runtime: Runtime, isolation: Isolation, options: &HostOptions) -> Runtime {
    let report = match isolation {
        Isolation::Jail => return runtime,
        Isolation::Gvisor => gvisor(),
        Isolation::Microvm => microvm(options),
    };
    match backend_for(&runtime, isolation, &report, options) {
        Some(backend) => runtime.add_backend(backend),
        None => runtime.mark_unavailable(isolation, report.detail),
    }
}

/// The backend of an available `isolation` on this host. Each keeps its
/// own state directory beside the jail's (`<state>-gvisor`, ...) and its
/// own cgroup parent: a backend sweeps its whole directory.
fn backend_for(
    runtime: &Runtime,
    isolation: Isolation,
    report: &BackendReport,
    options: &HostOptions,
) -> Option<std::sync::Arc<dyn crate::backend::Backend>> {
    if !report.available {
        return None;
    }
    let config = runtime.config();
    let agent = match &config.agent {
        Some(a) => a.clone(),
        None => crate::find_agent().ok()?,
    };
    let beside = |suffix: &str| {
        let mut name = config
            .state_dir
            .file_name()
            .map(|n| n.to_os_string())
            .unwrap_or_else(|| "sandboxes".into());
        name.push(format!("-{suffix}"));
        config.state_dir.with_file_name(name)
    };
    match isolation {
        Isolation::Jail => None,
        Isolation::Gvisor => Some(std::sync::Arc::new(
            crate::backend::GvisorBackend::new(
                None,
                agent,
                beside("gvisor"),
                format!("{}-gvisor", config.cgroup_parent),
                config.agent_log.clone(),
            )
            .with_id_map(config.id_map),
        )),
        Isolation::Microvm => {
            let mut vm = crate::backend::MicrovmConfig::new(
                agent,
                beside("microvm"),
                options.allow_emulation,
            );
            vm.agent_log = config.agent_log.clone();
            vm.id_map = config.id_map;
            Some(std::sync::Arc::new(crate::backend::MicrovmBackend::new(vm)))
        }
    }
}

fn jail(host: &HostReport) -> BackendReport {
    let mut missing = Vec::new();
    if !nix::unistd::geteuid().is_root() {
        missing.push("root (to write uid maps and cgroups)".to_string());
    }
    for (what, check) in [
        ("user namespaces", &host.user_namespaces),
        ("seccomp", &host.seccomp),
    ] {
        if !check.available {
            missing.push(format!("{what}: {}", check.detail));
        }
    }
    for c in ["memory", "pids"] {
        if !host.cgroups.controllers.iter().any(|x| x == c) {
            missing.push(format!("the {c} cgroup controller"));
        }
    }
    if missing.is_empty() {
        BackendReport {
            name: "jail",
            available: true,
            detail: format!(
                "namespaces, seccomp and cgroup {} ({}); Landlock {}",
                host.cgroups.version,
                host.cgroups.controllers.join(", "),
                match host.landlock_abi {
                    Some(abi) => format!(
                        "ABI {abi}, applied to every sandbox: file access only beneath its own root{}",
                        if abi >= 6 {
                            ", signals and abstract unix sockets scoped to it"
                        } else {
                            ""
                        }
                    ),
                    None => "absent: the jail runs without it".into(),
                }
            ),
        }
    } else {
        BackendReport {
            name: "jail",
            available: false,
            detail: format!("missing: {}", missing.join("; ")),
        }
    }
}

fn gvisor() -> BackendReport {
    match crate::backend::probe(None) {
        Ok(info) => BackendReport {
            name: "gvisor",
            available: true,
            detail: format!(
                "{} ({}) on the {} platform (this runsc offers ptrace and kvm, no systrap; kvm needs a /dev/kvm that runs guests): \
                 a user-space kernel serves the sandbox's system calls, the host kernel sees only the Sentry's few",
                info.runsc.display(),
                info.version,
                info.platform.as_str()
            ),
        },
        Err(why) => BackendReport {
            name: "gvisor",
            available: false,
            detail: why,
        },
    }
}

fn microvm(options: &HostOptions) -> BackendReport {
    match crate::backend::microvm::probe(options.allow_emulation) {
        Ok(info) => BackendReport {
            name: "microvm",
            available: true,
            detail: match &info.kvm_unusable {
                None => format!(
                    "{} under KVM with {}: a guest kernel of its own per sandbox",
                    info.qemu_version,
                    info.kernel.display()
                ),
                Some(why) => format!(
                    "{} under TCG emulation (allowed; tens of times slower than KVM) with {}: a guest kernel of its own per sandbox; KVM is not used: {why}",
                    info.qemu_version,
                    info.kernel.display()
                ),
            },
        },
        Err(why) => BackendReport {
            name: "microvm",
            available: false,
            detail: why,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_report_names_every_backend_and_says_what_each_does_here() {
        let r = system_report();
        let names: Vec<&str> = r.backends.iter().map(|b| b.name).collect();
        assert_eq!(names, ["jail", "gvisor", "microvm"]);
        for b in &r.backends {
            assert!(!b.detail.is_empty());
        }
        let json = serde_json::to_value(&r).unwrap();
        assert!(json["host"]["cgroups"]["controllers"].is_array(), "{json}");
    }
}
