//! The microVM backend for real: QEMU `microvm` guests (under TCG on a
//! machine whose KVM cannot run guests, which must then allow emulation),
//! with the host template's image. Needs root, QEMU and the kernel from
//! `scripts/microvm-assets.sh` (run by `scripts/install-deps.sh`); fails
//! loudly without them. The first run builds the host template's image
//! (minutes); later runs reuse it.

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{require_root, sh, text};
use runcell_core::backend::microvm::{self, MicrovmBackend, MicrovmConfig};
use runcell_core::{Runtime, RuntimeConfig, SandboxLimits, SandboxOptions, Template};

const STATE: &str = "/run/runcell-test/microvm";

fn config(state: &str) -> MicrovmConfig {
    require_root();
    let agent = runcell_core::find_agent()
        .expect("runcell-agent must be built (cargo build -p runcell-agent) before these tests");
    // Fails here, loudly, when QEMU or the kernel is missing or neither KVM
    // nor emulation can run a guest.
    let info = microvm::probe(true).unwrap_or_else(|why| {
        panic!("microVMs cannot run here: {why} (run scripts/install-deps.sh)")
    });
    eprintln!(
        "microvm: {} accel={} kernel={} kvm_unusable={:?}",
        info.qemu_version,
        info.accel.as_str(),
        info.kernel.display(),
        info.kvm_unusable
    );
    let mut cfg = MicrovmConfig::new(agent, PathBuf::from(state), true);
    cfg.agent_log = Some("info".into());
    cfg
}

fn runtime(state: &str) -> (Runtime, MicrovmBackend) {
    let cfg = config(state);
    let backend = MicrovmBackend::new(cfg);
    // The host template's image is built once (slow) and cached.
    let t0 = Instant::now();
    backend
        .template_image(&Template::host().rootfs)
        .expect("building the host template's image");
    eprintln!("host template image ready in {:?}", t0.elapsed());
    let rt = Runtime::with_backend(
        RuntimeConfig {
            state_dir: PathBuf::from(state),
            ..RuntimeConfig::default()
        },
        Arc::new(backend.clone()),
    );
    (rt, backend)
}

fn limits(memory_mib: u64) -> SandboxLimits {
    SandboxLimits {
        memory_bytes: memory_mib << 20,
        disk_bytes: 64 << 20,
        timeout: Duration::from_secs(60),
        ..SandboxLimits::default()
    }
}

fn qemu_processes_in(dir: &Path) -> Vec<i32> {
    common::host_processes_with(&dir.join("qemu.pid").display().to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guest_runs_commands_sees_its_limits_and_files_and_not_the_hosts() {
    let state = format!("{STATE}-smoke");
    let (rt, _backend) = runtime(&state);
    // A marker only the host has: the guest must not see it.
    let marker = format!("/root/runcell-microvm-marker-{}", std::process::id());
    std::fs::write(&marker, "host secret").unwrap();
    std::fs::write(Path::new(&state).join("host-marker"), "host secret").ok();

    let t0 = Instant::now();
    let sb = rt
        .create(SandboxOptions {
            limits: limits(384),
            tied_to_process: true,
            ..SandboxOptions::default()
        })
        .await
        .expect("creating a microVM sandbox");
    eprintln!("create took {:?}", t0.elapsed());
    let dir = Path::new(&state).join(sb.id());
    assert_eq!(
        qemu_processes_in(&dir).len(),
        1,
        "one QEMU runs the sandbox"
    );

    // Exec: output, error output and exit status come back.
    let r = sh(&sb, "echo out; echo err >&2; exit 3").await;
    assert_eq!(text(&r.stdout), "out\n");
    assert_eq!(text(&r.stderr), "err\n");
    assert_eq!(r.outcome.status(), 3);

    // The guest has its own kernel.
    let r = sh(&sb, "uname -r; cat /proc/1/cmdline | tr '\\0' ' '").await;
    let out = text(&r.stdout);
    assert!(out.contains("cloud-amd64"), "guest kernel: {out}");
    let host_kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap();
    eprintln!("guest: {out} host kernel: {host_kernel}");

    // Python from the host template's image.
    let r = sh(
        &sb,
        "/usr/bin/python3 -c 'import sys; print(sys.version_info[:2])'",
    )
    .await;
    assert_eq!(text(&r.stdout), "(3, 11)\n", "stderr: {}", text(&r.stderr));

    // Memory: the guest's RAM is the limit.
    let r = sh(&sb, "grep MemTotal /proc/meminfo").await;
    let kb: u64 = text(&r.stdout)
        .split_whitespace()
        .nth(1)
        .and_then(|n| n.parse().ok())
        .expect("MemTotal in /proc/meminfo");
    let mib = kb / 1024;
    assert!(
        (300..=384).contains(&mib),
        "MemTotal {mib} MiB, limit 384 MiB"
    );

    // Files: a round trip through the agent, and the writable layer's size.
    sb.write_file("/tmp/hello.txt", b"hello from the host")
        .await
        .expect("write_file");
    let r = sh(&sb, "cat /tmp/hello.txt; echo; df -m / | tail -1").await;
    let out = text(&r.stdout);
    assert!(out.starts_with("hello from the host\n"), "{out}");
    let root_mib: u64 = out
        .lines()
        .nth(1)
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|n| n.parse().ok())
        .expect("df of /");
    assert!(
        (60..=64).contains(&root_mib),
        "root is {root_mib} MiB, limit 64"
    );
    let r = sh(&sb, "echo written in the guest > /tmp/out.txt").await;
    assert_eq!(r.outcome.status(), 0);
    let back = sb
        .read_file("/tmp/out.txt", 1 << 20)
        .await
        .expect("read_file");
    assert_eq!(text(&back), "written in the guest\n");

    // Escape attempts: the host's files are not there, and the template is
    // read-only below the writable layer.
    let r = sh(
        &sb,
        &format!(
            "cat {marker} 2>&1; ls /root 2>&1; cat {state}/host-marker 2>&1; \
             ls /run/runcell-test 2>&1; echo x > /usr/bin/evil 2>&1; echo status=$?"
        ),
    )
    .await;
    let out = text(&r.stdout);
    assert!(
        !out.contains("host secret"),
        "the guest read a host file: {out}"
    );
    assert!(
        !out.contains("status=0"),
        "the guest wrote the template: {out}"
    );
    assert!(!Path::new("/usr/bin/evil").exists());

    // Delete: no QEMU and no directory left.
    sb.destroy().await.expect("destroy");
    assert!(qemu_processes_in(&dir).is_empty(), "QEMU still runs");
    assert!(!dir.exists(), "{} is left", dir.display());
    let _ = std::fs::remove_file(&marker);
}
