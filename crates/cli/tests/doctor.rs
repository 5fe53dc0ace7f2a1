//! `runcell doctor` reports what this host enforces and which isolation
//! backends can run, as text and as JSON. Needs root (the jail backend is
//! available only to root).

use serde_json::Value;

fn doctor(args: &[&str]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_runcell"))
        .arg("doctor")
        .args(args)
        .output()
        .unwrap()
}

#[test]
fn doctor_reports_the_hosts_layers_and_every_backend() {
    let out = doctor(&["--json"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r: Value = serde_json::from_slice(&out.stdout).unwrap();
    for layer in ["user_namespaces", "seccomp", "landlock", "kvm"] {
        assert!(r["host"][layer]["available"].is_boolean(), "{layer}: {r}");
        assert!(
            r["host"][layer]["detail"]
                .as_str()
                .is_some_and(|d| !d.is_empty()),
            "{layer}: {r}"
        );
    }
    // What the kernel says, not what the docs hope.
    let version = std::fs::read_to_string("/proc/sys/user/max_user_namespaces").unwrap();
    assert!(
        r["host"]["user_namespaces"]["detail"]
            .as_str()
            .unwrap()
            .contains(version.trim()),
        "{r}"
    );
    assert!(
        ["v1", "v2"].contains(&r["host"]["cgroups"]["version"].as_str().unwrap()),
        "{r}"
    );
    let backends: Vec<&str> = r["backends"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["name"].as_str().unwrap())
        .collect();
    assert_eq!(backends, ["jail", "gvisor", "microvm"]);
    assert_eq!(
        r["backends"][0]["available"], true,
        "the jail runs here: {r}"
    );

    let text = doctor(&[]);
    assert!(text.status.success());
    let text = String::from_utf8(text.stdout).unwrap();
    for word in [
        "user namespaces",
        "seccomp",
        "Landlock",
        "cgroups",
        "OOM kill reporting",
        "jail",
        "gvisor",
        "microvm",
    ] {
        assert!(text.contains(word), "{word}: {text}");
    }
}

/// The slow probes (a test guest under KVM, a trial gVisor run) are kept
/// for the boot: a later doctor (and every daemon start) gives the same
/// answer without running them again, and `--fresh` runs them again.
#[test]
fn slow_probes_are_kept_for_the_boot_and_fresh_runs_them_again() {
    let backends = |out: std::process::Output| -> Value {
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice::<Value>(&out.stdout).unwrap()["backends"].clone()
    };
    let fresh = backends(doctor(&["--json", "--fresh"]));
    let kvm = std::path::Path::new("/run/runcell/probe-kvm.json");
    let kvm_probed = std::fs::metadata("/dev/kvm").is_ok();
    if kvm_probed {
        let kept: Value = serde_json::from_slice(&std::fs::read(kvm).unwrap()).unwrap();
        let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap();
        assert_eq!(kept["key"]["boot_id"], boot.trim(), "{kept}");
    }
    let kept = backends(doctor(&["--json"]));
    assert_eq!(fresh, kept, "a kept answer is the answer");
}
