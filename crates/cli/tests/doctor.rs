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
