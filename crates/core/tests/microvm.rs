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
use runcell_core::backend::Backend;
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
    cfg.agent_log = Some("debug".into());
    cfg
}

fn runtime(state: &str) -> (Runtime, MicrovmBackend) {
    let cfg = config(state);
    let backend = MicrovmBackend::new(cfg);
    // What a failed earlier run left in this test's own directory.
    let swept = backend.sweep(Duration::ZERO);
    if !swept.is_empty() {
        eprintln!("swept {} leftover sandboxes", swept.len());
    }
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
        pids: 64,
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

    // The guest's clock runs at the host's pace (a wrong TSC rate would
    // make `sleep 1` and every timeout last much more or less).
    let t = Instant::now();
    let r = sh(&sb, "sleep 1").await;
    assert_eq!(r.outcome.status(), 0);
    let took = t.elapsed();
    assert!(
        took > Duration::from_millis(900) && took < Duration::from_secs(3),
        "the guest's `sleep 1` took {took:?} on the host"
    );

    // Python from the host template's image.
    let r = sh(
        &sb,
        "/usr/bin/python3 -c 'import sys; print(sys.version_info[:2])'",
    )
    .await;
    assert_eq!(text(&r.stdout), "(3, 11)\n", "stderr: {}", text(&r.stderr));

    // Memory: the guest's RAM is the limit plus room for its kernel and
    // agent (the sandbox's processes are held to the limit by the guest's
    // cgroup, below).
    let r = sh(&sb, "grep MemTotal /proc/meminfo").await;
    let kb: u64 = text(&r.stdout)
        .split_whitespace()
        .nth(1)
        .and_then(|n| n.parse().ok())
        .expect("MemTotal in /proc/meminfo");
    let mib = kb / 1024;
    assert!(
        (384..=512).contains(&mib),
        "MemTotal {mib} MiB, limit 384 MiB + 128 MiB for the guest"
    );

    // Processes: the limit holds in the guest.
    let r = sh(
        &sb,
        "/usr/bin/python3 -c '
import os, time
n = 0
for _ in range(100):
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        time.sleep(5)
        os._exit(0)
    n += 1
print(n)
'",
    )
    .await;
    let out = text(&r.stdout);
    let forked: u64 = out
        .trim()
        .parse()
        .unwrap_or_else(|_| panic!("fork count: {out} {}", text(&r.stderr)));
    assert!(
        (10..64).contains(&forked),
        "{forked} processes forked with a limit of 64"
    );
    // ...and is reported by name, from the guest kernel's own counter.
    assert!(r.outcome.pids_limit, "{:?}", r.outcome);
    let msgs = r.outcome.messages().join("\n");
    assert!(msgs.contains("reached its process limit (64)"), "{msgs}");
    let r = sh(&sb, "echo calm").await;
    assert_eq!(text(&r.stdout), "calm\n");
    assert!(!r.outcome.pids_limit, "{:?}", r.outcome);

    // A memory bomb is killed by the guest cgroup's OOM killer, reported
    // by name, and the sandbox lives on.
    let r = sh(
        &sb,
        "/usr/bin/python3 -c '
a = []
while True:
    a.append(bytearray(16 << 20))
'",
    )
    .await;
    assert!(r.outcome.oom_killed, "{:?} {}", r.outcome, text(&r.stderr));
    assert_eq!(r.outcome.exit.signal, Some(9), "{:?}", r.outcome);
    assert!(!r.outcome.sandbox_ended);
    let msgs = r.outcome.messages().join("\n");
    assert!(
        msgs.contains("ran out of memory (limit 384 MiB) and a process was killed"),
        "{msgs}"
    );
    let r = sh(&sb, "echo alive").await;
    assert_eq!(text(&r.stdout), "alive\n");
    assert!(!r.outcome.oom_killed, "{:?}", r.outcome);
    // So is a code context's cell that blows the limit.
    let ctx = sb
        .create_context(runcell_core::ContextOptions::new(
            runcell_protocol::Language::Python,
        ))
        .await
        .expect("a Python context")
        .id;
    let cell = sb
        .run_cell(
            &ctx,
            "a = []\nwhile True:\n    a.append(bytearray(16 << 20))\n",
            None,
        )
        .await
        .expect("the cell's report");
    assert!(cell.report.oom_killed, "{:?}", cell.report);
    let cell = sb.run_cell(&ctx, "print(6 * 7)", None).await.expect("cell");
    assert_eq!(text(&cell.stdout), "42\n", "{:?}", cell.report);
    assert!(!cell.report.oom_killed, "{:?}", cell.report);

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

    // Large transfers both ways cross the port's flow-control window many
    // times over.
    let big: Vec<u8> = (0..3_000_000u32)
        .map(|i| u8::try_from(i % 251).unwrap())
        .collect();
    sb.write_file("/tmp/big.bin", &big)
        .await
        .expect("write_file big");
    let r = sh(
        &sb,
        "sha256sum /tmp/big.bin | cut -c1-64; head -c 2000000 /dev/zero | tr '\\0' x | wc -c",
    )
    .await;
    let expected = {
        use sha2::Digest;
        let d = sha2::Sha256::digest(&big);
        d.iter().map(|b| format!("{b:02x}")).collect::<String>()
    };
    assert_eq!(text(&r.stdout), format!("{expected}\n2000000\n"));
    let back = sb
        .read_file("/tmp/big.bin", 8 << 20)
        .await
        .expect("read_file big");
    assert!(back == big, "the 3 MB file came back different");
    let r = sh(&sb, "head -c 1000000 /tmp/big.bin").await;
    assert!(
        r.stdout == big[..1_000_000],
        "1 MB of output came back different"
    );

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
    let _ = std::fs::remove_file(Path::new(&state).join("host-marker"));
}

/// The median of boot-to-agent-ready (`create`, the image and initramfs
/// cached) over a few guests, under this machine's acceleration.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn boot_to_agent_ready_is_measured_and_bounded() {
    let state = format!("{STATE}-boot");
    let (rt, _backend) = runtime(&state);
    let mut times = Vec::new();
    for _ in 0..3 {
        let t0 = Instant::now();
        let sb = rt
            .create(SandboxOptions {
                limits: limits(256),
                ..SandboxOptions::default()
            })
            .await
            .expect("creating a microVM sandbox");
        let ready = t0.elapsed();
        let r = sh(&sb, "echo ready").await;
        assert_eq!(text(&r.stdout), "ready\n");
        times.push(ready);
        sb.destroy().await.expect("destroy");
    }
    times.sort();
    let median = times[times.len() / 2];
    eprintln!("microvm boot-to-agent-ready: {times:?}, median {median:?}");
    assert!(
        median < Duration::from_secs(30),
        "booting takes {median:?} (median)"
    );
}

/// A sandbox outlives the process's end of its channel: another process
/// (here, a second backend after this one's forwarder was stopped, as the
/// daemon's death stops it) attaches by id and finds the same guest;
/// remove kills QEMU and removes the directory; sweep removes leftovers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guest_is_attached_again_after_its_forwarder_goes_then_removed() {
    let state = format!("{STATE}-attach");
    let (rt, backend) = runtime(&state);
    let sb = rt
        .create(SandboxOptions {
            limits: limits(256),
            tied_to_process: false,
            ..SandboxOptions::default()
        })
        .await
        .expect("creating a microVM sandbox");
    let id = sb.id().to_string();
    let dir = Path::new(&state).join(&id);
    let r = sh(&sb, "echo kept > /tmp/state").await;
    assert_eq!(r.outcome.status(), 0);
    let pids = qemu_processes_in(&dir);
    assert_eq!(pids.len(), 1);
    // QEMU runs in its own session, not as this process's child: it does
    // not die with the daemon.
    let stat = std::fs::read_to_string(format!("/proc/{}/stat", pids[0])).unwrap();
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .unwrap()
        .1
        .split_whitespace()
        .collect();
    let (ppid, sid): (i32, i32) = (fields[1].parse().unwrap(), fields[3].parse().unwrap());
    let me = i32::try_from(std::process::id()).unwrap();
    assert_ne!(ppid, me, "QEMU is a child of the host process");
    assert_ne!(sid, nix::unistd::getsid(None).unwrap().as_raw());
    drop(sb);

    backend.detach(&id).unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        qemu_processes_in(&dir),
        pids,
        "the guest stopped with its forwarder"
    );

    let (rt2, backend2) = runtime(&state);
    assert!(backend2.list().contains(&id));
    assert!(!backend2.is_dead(&id, Duration::ZERO));
    let sb = rt2
        .attach(
            &id,
            runcell_core::backend::Isolation::Microvm,
            Template::host(),
            limits(256),
            None,
        )
        .await
        .expect("attaching to the running guest");
    let r = sh(&sb, "cat /tmp/state").await;
    assert_eq!(text(&r.stdout), "kept\n", "stderr: {}", text(&r.stderr));
    drop(sb);

    backend2.remove(&id).expect("remove");
    assert!(qemu_processes_in(&dir).is_empty(), "QEMU still runs");
    assert!(!dir.exists());
    assert!(backend2.attach(&id).is_err());

    // Sweep: a half-made directory past its grace goes; a young one stays.
    std::fs::create_dir_all(Path::new(&state).join("orphan")).unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(
        backend2.sweep(Duration::from_millis(10)),
        vec!["orphan".to_string()]
    );
    std::fs::create_dir_all(Path::new(&state).join("young")).unwrap();
    assert!(backend2.sweep(Duration::from_secs(60)).is_empty());
    backend2.remove("young").unwrap();
}

/// A sandbox tied to its process stops when the process's end of the
/// channel closes: the agent exits and QEMU with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tied_guest_stops_when_the_host_end_closes() {
    let state = format!("{STATE}-tied");
    let (rt, backend) = runtime(&state);
    let sb = rt
        .create(SandboxOptions {
            limits: limits(256),
            tied_to_process: true,
            ..SandboxOptions::default()
        })
        .await
        .expect("creating a microVM sandbox");
    let id = sb.id().to_string();
    let dir = Path::new(&state).join(&id);
    assert_eq!(qemu_processes_in(&dir).len(), 1);
    backend.detach(&id).unwrap();
    let t0 = Instant::now();
    while !qemu_processes_in(&dir).is_empty() {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "QEMU still runs 20 s after the host end closed"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(backend.is_dead(&id, Duration::from_secs(60)));
    drop(sb);
    backend.remove(&id).unwrap();
    assert!(!dir.exists());
}

/// Egress travels guest -> port -> host proxy: an allowed host is reached
/// through the proxy, another is refused by it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn egress_goes_through_the_hosts_proxy() {
    let state = format!("{STATE}-egress");
    let (rt, _backend) = runtime(&state);
    let policy = runcell_egress::NetworkPolicy::parse_setting("allowlist:pypi.org").unwrap();
    let sb = rt
        .create(SandboxOptions {
            limits: limits(256),
            network: Some(policy),
            ..SandboxOptions::default()
        })
        .await
        .expect("creating a microVM sandbox");
    let r = sh(
        &sb,
        "curl -s -o /dev/null -w '%{http_code} %{time_connect} %{time_appconnect} %{time_total}\\n' \
         --max-time 40 https://pypi.org/simple/pip/; \
         curl -s -o /dev/null -w '%{http_code}\\n' --max-time 15 https://example.com/; true",
    )
    .await;
    let out = text(&r.stdout);
    let codes: Vec<&str> = out
        .lines()
        .map(|l| l.split_whitespace().next().unwrap_or(""))
        .collect();
    eprintln!("egress: {out}");
    assert_eq!(
        codes.first(),
        Some(&"200"),
        "pypi.org through the proxy: {out} {}",
        text(&r.stderr)
    );
    assert_ne!(codes.get(1), Some(&"200"), "example.com was reached: {out}");
    sb.destroy().await.expect("destroy");
}
