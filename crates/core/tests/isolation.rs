//! Escape attempts. Each test really tries, asserts that the attempt failed
//! inside the sandbox, and checks that the host is unchanged.

mod common;

use std::io::Read;
use std::net::TcpListener;
use std::time::{Duration, Instant};

use common::*;
use runcell_core::backend::Isolation;
use runcell_core::{RunOptions, SandboxLimits};
use runcell_protocol::Language;

#[tokio::test(flavor = "multi_thread")]
async fn cannot_read_host_files_outside_the_template() {
    let rt = runtime("isolation");
    let name = unique("runcell-secret");
    let secret = unique("s3cr3t");
    let paths = [
        format!("/root/{name}"),
        format!("/tmp/{name}"),
        format!("/var/tmp/{name}"),
    ];
    for p in &paths {
        std::fs::write(p, &secret).unwrap();
    }
    let sb = sandbox(&rt, limits()).await;
    // The search reads host files bound into the template (/etc's), cold on
    // a fresh machine whose disk may still be writing the build: it gets
    // far more than the default 20 s, and a failure shows how the run ended.
    let search = RunOptions {
        timeout: Some(Duration::from_secs(180)),
        ..RunOptions::default()
    };
    let r = sb
        .exec(
            runcell_protocol::Command::Shell(format!(
                "cat {p0} {p1} {p2}; ls -a /root /tmp /var/tmp; \
                 find / -xdev -name '{name}*' 2>/dev/null; grep -rs {secret} /etc /run /home /tmp; \
                 echo done",
                p0 = paths[0],
                p1 = paths[1],
                p2 = paths[2]
            )),
            &search,
        )
        .await
        .expect("exec");
    let out = text(&r.stdout) + &text(&r.stderr);
    assert!(out.contains("done"), "{out}\n{:?}", r.outcome);
    assert!(out.contains("No such file or directory"), "{out}");
    assert!(!out.contains(&secret), "a host file leaked: {out}");
    assert!(
        !text(&r.stdout).contains(&name),
        "a host file is visible: {out}"
    );
    // Nothing outside the template's own directories is visible at the root
    // (under gVisor also /sys, which runsc always mounts: gVisor's own
    // synthetic sysfs, checked below, not the host's).
    let r = sh(&sb, "ls /").await;
    let top: Vec<String> = text(&r.stdout).lines().map(String::from).collect();
    let mut allowed = vec![
        "bin", "dev", "etc", "home", "lib", "lib32", "lib64", "libx32", "proc", "root", "run",
        "sbin", "tmp", "usr", "var",
    ];
    if isolation() == Isolation::Gvisor {
        allowed.push("sys");
        let r = sh(&sb, "grep ' /sys ' /proc/mounts").await;
        let out = text(&r.stdout);
        assert!(out.starts_with("none /sys sysfs"), "{out}");
        // None of the host's network devices (the sandbox has none but lo).
        let r = sh(&sb, "ls /sys/class/net").await;
        let devices = text(&r.stdout);
        assert!(
            devices.split_whitespace().all(|d| d == "lo"),
            "host devices: {devices}"
        );
    } else {
        assert!(!top.contains(&"sys".to_string()));
    }
    for entry in &top {
        assert!(
            allowed.contains(&entry.as_str()),
            "unexpected top-level entry {entry}: {top:?}"
        );
    }
    assert!(!top.contains(&"work".to_string()));
    sb.destroy().await.unwrap();
    for p in &paths {
        assert_eq!(std::fs::read_to_string(p).unwrap(), secret);
        std::fs::remove_file(p).unwrap();
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn writes_never_reach_the_template_or_the_host() {
    let rt = runtime("isolation");
    let planted = unique("runcell-planted");
    let python_before = std::fs::read("/usr/bin/python3").unwrap();
    let sb = sandbox(&rt, limits()).await;
    // As the sandbox user: the template's files are not writable.
    let r = sh(
        &sb,
        &format!("echo x > /usr/bin/{planted}; echo x >> /usr/bin/python3; rm -f /usr/bin/env; echo rc=$?"),
    )
    .await;
    let err = text(&r.stderr);
    assert!(err.contains("Permission denied"), "{err}");
    // As root of the sandbox (the agent's file identity is the user, so use the
    // user's own writable layer for the positive case): writes land in the
    // private layer only.
    let r = sh(
        &sb,
        &format!("echo hello > /tmp/{planted} && cat /tmp/{planted}"),
    )
    .await;
    assert_eq!(text(&r.stdout), "hello\n");
    sb.destroy().await.unwrap();
    assert!(!std::path::Path::new(&format!("/usr/bin/{planted}")).exists());
    assert!(!std::path::Path::new(&format!("/tmp/{planted}")).exists());
    assert_eq!(std::fs::read("/usr/bin/python3").unwrap(), python_before);
    assert!(std::path::Path::new("/usr/bin/env").exists());
    // A new sandbox starts clean.
    let sb = sandbox(&rt, limits()).await;
    let r = sh(&sb, &format!("ls /tmp/{planted} 2>&1; ls /tmp | wc -l")).await;
    assert!(
        text(&r.stdout).contains("No such file"),
        "{}",
        text(&r.stdout)
    );
    sb.destroy().await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn cannot_see_host_processes_or_the_agents_environment() {
    let rt = runtime("isolation");
    let sb = sandbox(&rt, limits()).await;
    let r = sh(
        &sb,
        "ls /proc | grep -E '^[0-9]+$' | tr '\\n' ' '; echo; cat /proc/1/environ; echo rc=$?; \
         cat /proc/1/cmdline | tr '\\0' ' '; echo; cat /proc/1/maps >/dev/null; echo maps=$?",
    )
    .await;
    let out = text(&r.stdout);
    let pids: Vec<i32> = out
        .lines()
        .next()
        .unwrap()
        .split_whitespace()
        .map(|p| p.parse().unwrap())
        .collect();
    // The agent (1), the shell and its few children: no host process.
    assert!(pids.len() < 8 && pids.contains(&1), "{pids:?}");
    assert!(!pids.contains(&(std::process::id() as i32)) || pids.len() < 8);
    if isolation() == Isolation::Gvisor {
        // This gVisor does not hide a non-dumpable process's /proc files
        // from other users, so the agent masks its own: its environment,
        // command line and memory map read empty.
        let mut lines = out.lines().skip(1);
        assert_eq!(lines.next(), Some("rc=0"), "{out}");
        assert_eq!(lines.next(), Some(""), "{out}");
        let r = sh(
            &sb,
            "cat /proc/1/environ /proc/1/task/1/environ /proc/1/cmdline /proc/1/maps \
             /proc/1/smaps /proc/1/auxv | wc -c; \
             for t in /proc/1/task/*; do cat $t/environ; done; echo; \
             echo x > /proc/1/environ; echo write=$?",
        )
        .await;
        let out = text(&r.stdout);
        let mut lines = out.lines();
        assert_eq!(lines.next(), Some("0"), "{out}");
        // The agent's other threads show the process's environment: it
        // starts with an empty one (runsc adds HOME).
        let threads = lines.next().unwrap_or_default();
        assert!(
            !threads.contains("RUNCELL")
                && !threads.contains("PATH")
                && !threads.contains("RUST_LOG"),
            "{out}"
        );
        assert!(out.contains("write=1"), "{out}");
    } else {
        assert!(
            text(&r.stderr).contains("Permission denied"),
            "{}",
            text(&r.stderr)
        );
        assert!(out.contains("maps=1"), "{out}");
    }
    // The user's environment is the sandbox's, not the host's.
    let r = sh(&sb, "env").await;
    let env = text(&r.stdout);
    assert!(
        env.contains("HOME=/home/user") && env.contains("USER=user"),
        "{env}"
    );
    for (k, _) in std::env::vars() {
        if ![
            "PATH",
            "HOME",
            "USER",
            "LOGNAME",
            "SHELL",
            "LANG",
            "TMPDIR",
            "HOSTNAME",
            "PWD",
            "SHLVL",
            "_",
            "OLDPWD",
            "PYTHONUNBUFFERED",
            "TERM",
        ]
        .contains(&k.as_str())
        {
            assert!(
                !env.contains(&format!("{k}=")),
                "host variable {k} leaked into the sandbox"
            );
        }
    }
    // Root inside maps to an unprivileged host id.
    let status = std::fs::read_to_string(format!("/proc/{}/status", sb.agent_pid())).unwrap();
    let uid_line = status.lines().find(|l| l.starts_with("Uid:")).unwrap();
    let host_uid: u32 = uid_line.split_whitespace().nth(1).unwrap().parse().unwrap();
    assert_ne!(host_uid, 0, "{uid_line}");
    let r = sh(&sb, "id -u; cat /proc/self/uid_map").await;
    let out = text(&r.stdout);
    assert!(out.starts_with("1000\n"), "{out}");
    // Under gVisor the ids inside are its own kernel's (its uid_map is an
    // identity map of nothing on the host); the host sees only the Sentry,
    // running as the unprivileged uid checked above.
    if isolation() != Isolation::Gvisor {
        assert!(
            !out.contains(" 0 ") || out.contains(&host_uid.to_string()),
            "{out}"
        );
    }
    sb.destroy().await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn cannot_reach_a_port_on_the_hosts_loopback() {
    let rt = runtime("isolation");
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let port = listener.local_addr().unwrap().port();
    let sb = sandbox(&rt, limits()).await;
    let started = Instant::now();
    let r = py(
        &sb,
        &format!(
            "import socket\n\
             for host in ['127.0.0.1', 'localhost']:\n\
             \x20   s = socket.socket(); s.settimeout(3)\n\
             \x20   try:\n\
             \x20       s.connect((host, {port})); print('CONNECTED', host)\n\
             \x20   except OSError as e:\n\
             \x20       print('refused', host, e.errno)\n\
             try:\n\
             \x20   socket.getaddrinfo('pypi.org', 443); print('RESOLVED')\n\
             except OSError as e:\n\
             \x20   print('no dns', e)\n"
        ),
    )
    .await;
    let out = text(&r.stdout);
    assert!(
        !out.contains("CONNECTED") && !out.contains("RESOLVED"),
        "{out}"
    );
    assert_eq!(out.matches("refused").count(), 2, "{out}");
    assert!(out.contains("no dns"), "{out}");
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "network failures must be fast"
    );
    assert!(
        listener.accept().is_err(),
        "the host listener saw a connection"
    );
    let r = sh(
        &sb,
        "cat /proc/net/dev | tail -n +3 | cut -d: -f1 | tr -d ' '",
    )
    .await;
    assert_eq!(text(&r.stdout).trim(), "lo", "only loopback exists");
    sb.destroy().await.unwrap();
}

/// Every syscall the filter denies, tried for real from Python.
#[tokio::test(flavor = "multi_thread")]
async fn seccomp_denies_dangerous_syscalls() {
    let rt = runtime("isolation");
    let sb = sandbox(&rt, limits()).await;
    let code = r#"
import ctypes, os, errno
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
def call(nr, *args):
    ctypes.set_errno(0)
    rc = libc.syscall(ctypes.c_long(nr), *[ctypes.c_long(a) for a in args])
    return rc, ctypes.get_errno()
checks = {
  'mount': (165, 0, 0, 0, 0, 0), 'umount2': (166, 0, 0), 'pivot_root': (155, 0, 0),
  'ptrace_attach': (101, 16, 1, 0, 0), 'bpf': (321, 0, 0, 0), 'perf_event_open': (298, 0, 0, -1, -1, 0),
  'keyctl': (250, 0, 0), 'add_key': (248, 0, 0, 0, 0, 0), 'request_key': (249, 0, 0, 0, 0),
  'kexec_load': (246, 0, 0, 0, 0), 'init_module': (175, 0, 0, 0), 'finit_module': (313, 0, 0, 0),
  'delete_module': (176, 0, 0), 'userfaultfd': (323, 0), 'io_uring_setup': (425, 1, 0),
  'open_by_handle_at': (304, 0, 0, 0), 'setns': (308, 0, 0),
  'unshare_user': (272, 0x10000000), 'unshare_net': (272, 0x40000000), 'unshare_mnt': (272, 0x20000),
  'clone_newuser': (56, 0x10000000 | 17, 0, 0, 0, 0), 'ioctl_tiocsti': (16, 0, 0x5412, 0),
  'ioctl_tioclinux': (16, 0, 0x541C, 0), 'fsopen': (430, 0, 0), 'move_mount': (429, 0, 0, 0, 0, 0),
}
for name, (nr, *args) in checks.items():
    rc, err = call(nr, *args)
    print(name, rc, errno.errorcode.get(err, err))
for name, nr in [('clone3', 435), ('x32_getpid', 0x40000000 | 39)]:
    rc, err = call(nr, 0, 0)
    print(name, rc, errno.errorcode.get(err, err))
rc, err = call(39)
print('getpid_allowed', rc > 0)
"#;
    let r = py(&sb, code).await;
    let out = text(&r.stdout);
    assert!(r.stderr.is_empty(), "{}", text(&r.stderr));
    for line in out.lines().filter(|l| !l.starts_with("getpid")) {
        let f: Vec<&str> = line.split_whitespace().collect();
        let expect = if matches!(f[0], "clone3" | "x32_getpid") {
            "ENOSYS"
        } else {
            "EPERM"
        };
        assert_eq!((f[1], f[2]), ("-1", expect), "{line}\n{out}");
    }
    assert_eq!(out.lines().count(), 28, "{out}");
    assert!(out.contains("getpid_allowed True"), "{out}");
    // The tools fail too.
    let r = sh(&sb, "mount -t tmpfs none /tmp; unshare -Ur true; echo end").await;
    let err = text(&r.stderr);
    assert!(err.contains("mount") && err.contains("unshare"), "{err}");
    sb.destroy().await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn cannot_ptrace_or_load_modules() {
    let rt = runtime("isolation");
    let sb = sandbox(&rt, limits()).await;
    let r = py(
        &sb,
        r#"
import ctypes, subprocess, os
libc = ctypes.CDLL(None, use_errno=True)
child = subprocess.Popen(['sleep', '30'])
PTRACE_ATTACH, PTRACE_SEIZE = 16, 0x4206
print('attach', libc.ptrace(PTRACE_ATTACH, child.pid, 0, 0), os.strerror(ctypes.get_errno()))
print('seize', libc.ptrace(PTRACE_SEIZE, 1, 0, 0), os.strerror(ctypes.get_errno()))
child.kill()
fd = os.open('/usr/bin/true', os.O_RDONLY)
print('finit_module', libc.syscall(313, fd, b'', 0), os.strerror(ctypes.get_errno()))
print('init_module', libc.syscall(175, b'\x7fELF', 4, b''), os.strerror(ctypes.get_errno()))
"#,
    )
    .await;
    let out = text(&r.stdout);
    for op in ["attach", "seize", "finit_module", "init_module"] {
        assert!(
            out.contains(&format!("{op} -1 Operation not permitted")),
            "{op}: {out}\n{}",
            text(&r.stderr)
        );
    }
    sb.destroy().await.unwrap();
}

/// Processes inside the sandbox whose command line has `marker`.
async fn sandbox_processes_with(sb: &runcell_core::Sandbox, marker: &str) -> usize {
    let r = sh(sb, &format!("ps -eo args= | grep -c '^{marker}' || true")).await;
    text(&r.stdout).trim().parse().unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread")]
async fn double_forked_daemons_die_with_the_sandbox() {
    let rt = runtime("isolation");
    let marker = unique("runcell-escape");
    let sb = sandbox(&rt, limits()).await;
    let script = format!(
        "(setsid bash -c 'exec -a {marker}-a sleep 300' &) ; \
         nohup bash -c 'exec -a {marker}-b sleep 301' >/dev/null 2>&1 & \
         python3 -c \"import os,time\nif os.fork()==0:\n  os.setsid()\n  if os.fork()==0:\n    os.execvp('bash',['bash','-c','exec -a {marker}-c sleep 302'])\n\" ; \
         sleep 0.3; echo started"
    );
    // By default they die when the command returns (under gVisor, which
    // has no child subreaper, because the exec's own cgroup is emptied)...
    let r = sh(&sb, &script).await;
    assert!(text(&r.stdout).contains("started"));
    if isolation() == Isolation::Gvisor {
        let inside = sandbox_processes_with(&sb, &marker).await;
        assert_eq!(inside, 0, "processes outlived their exec");
    } else {
        let alive = host_processes_with(&marker);
        assert!(alive.is_empty(), "processes outlived their exec: {alive:?}");
    }
    // ...and with `background` they outlive it: they are running on the host
    // right now...
    let background = RunOptions {
        background: true,
        ..RunOptions::default()
    };
    let r = sb
        .exec(runcell_protocol::Command::Shell(script), &background)
        .await
        .unwrap();
    assert!(text(&r.stdout).contains("started"));
    if isolation() == Isolation::Gvisor {
        // Inside gVisor's own kernel: the host sees only the Sentry.
        let inside = sandbox_processes_with(&sb, &marker).await;
        assert!(inside >= 3, "expected the daemons to be running: {inside}");
    } else {
        let alive = host_processes_with(&marker);
        assert!(
            alive.len() >= 3,
            "expected the daemons to be running: {alive:?}"
        );
    }
    // ...and die with the sandbox.
    sb.destroy().await.unwrap();
    let left = host_processes_with(&marker);
    assert!(
        left.is_empty(),
        "processes outlived their sandbox: {left:?}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn fork_bomb_hits_the_pids_limit_and_the_host_stays_responsive() {
    let rt = runtime("isolation");
    let lim = SandboxLimits {
        pids: 64,
        timeout: Duration::from_secs(4),
        ..limits()
    };
    let sb = sandbox(&rt, lim).await;
    let probe = std::thread::spawn(|| {
        let mut worst = Duration::ZERO;
        let until = Instant::now() + Duration::from_secs(4);
        while Instant::now() < until {
            let t = Instant::now();
            std::process::Command::new("/bin/true").status().unwrap();
            worst = worst.max(t.elapsed());
            std::thread::sleep(Duration::from_millis(100));
        }
        worst
    });
    let r = sh(&sb, "bomb() { bomb | bomb & }; bomb; sleep 10").await;
    let worst = probe.join().unwrap();
    assert!(worst < Duration::from_secs(1), "host stalled for {worst:?}");
    // Reported by name whatever the isolation: the host's cgroup counts the
    // jail's hits, the agent those of gVisor's own pids cgroup.
    assert!(r.outcome.pids_limit, "{:?}", r.outcome);
    let msgs = r.outcome.messages().join("\n");
    assert!(msgs.contains("process limit (64)"), "{msgs}");
    if isolation() == Isolation::Gvisor {
        // The host sees the sentry's threads, not the sandbox's processes:
        // the bomb is contained inside gVisor (forks fail with EAGAIN, the
        // run times out, the sandbox lives).
        assert!(r.outcome.exit.timed_out, "{:?}", r.outcome);
        assert!(
            text(&r.stderr).contains("Resource temporarily unavailable"),
            "{}",
            text(&r.stderr)
        );
        let r = sh(&sb, "echo alive").await;
        assert_eq!(text(&r.stdout), "alive\n");
        assert!(!r.outcome.pids_limit, "{:?}", r.outcome);
    } else {
        assert!(sb.counters().pids <= 64);
    }
    sb.destroy().await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn memory_bomb_is_reported_as_oom() {
    let rt = runtime("isolation");
    let lim = SandboxLimits {
        memory_bytes: 128 << 20,
        ..limits()
    };
    let sb = sandbox(&rt, lim).await;
    let r = py(
        &sb,
        "a = []\nwhile True:\n    a.append(bytearray(8 << 20))\n",
    )
    .await;
    assert!(r.outcome.oom_killed, "{:?}", r.outcome);
    assert_eq!(r.outcome.exit.signal, Some(9));
    assert_eq!(r.outcome.status(), 137);
    let msgs = r.outcome.messages().join("\n");
    assert!(msgs.contains("ran out of memory (limit 128 MiB)"), "{msgs}");
    if isolation() == Isolation::Gvisor {
        // The Sentry is one host process: the kernel's OOM killer ends the
        // whole sandbox, and the outcome says so by name.
        assert!(r.outcome.sandbox_ended, "{:?}", r.outcome);
        assert!(msgs.contains("ends the whole sandbox"), "{msgs}");
        sb.destroy().await.unwrap();
        return;
    }
    // The agent survived its sandbox's OOM: the sandbox is still usable.
    let r = py(&sb, "print('still here')").await;
    assert_eq!(text(&r.stdout), "still here\n");
    sb.destroy().await.unwrap();
}

fn host_free_bytes() -> u64 {
    let s = nix_statvfs("/");
    s.0 * s.1
}

fn nix_statvfs(p: &str) -> (u64, u64) {
    let st = nix::sys::statvfs::statvfs(p).unwrap();
    (st.blocks_available(), st.fragment_size())
}

#[tokio::test(flavor = "multi_thread")]
async fn filling_the_disk_fails_inside_and_leaves_the_host_disk_alone() {
    let rt = runtime("isolation");
    let lim = SandboxLimits {
        disk_bytes: 32 << 20,
        memory_bytes: 256 << 20,
        ..limits()
    };
    let sb = sandbox(&rt, lim).await;
    let before = host_free_bytes();
    let r = sh(
        &sb,
        "dd if=/dev/zero of=/tmp/fill bs=1M count=200; echo rc=$?; df -k / | tail -1",
    )
    .await;
    let after = host_free_bytes();
    let err = text(&r.stderr);
    assert!(err.contains("No space left on device"), "{err}");
    assert!(text(&r.stdout).contains("rc=1"), "{}", text(&r.stdout));
    assert!(!r.outcome.oom_killed);
    assert!(
        before.saturating_sub(after) < 24 << 20,
        "host disk shrank by {} bytes",
        before - after
    );
    // Deleting frees the space again.
    let r = sh(
        &sb,
        "rm /tmp/fill && dd if=/dev/zero of=/tmp/small bs=1M count=8 2>&1 && echo ok",
    )
    .await;
    assert!(text(&r.stdout).contains("ok"), "{}", text(&r.stdout));
    sb.destroy().await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn a_gibibyte_of_output_is_truncated_counted_and_costs_no_memory() {
    let rt = runtime("isolation");
    let sb = sandbox(&rt, limits()).await;
    // Under gVisor's ptrace platform a GiB takes longer than the run's
    // timeout on a loaded machine: a quarter of it makes the same point.
    let (total, human) = if isolation() == Isolation::Gvisor {
        (1u64 << 28, "256 MiB")
    } else {
        (1u64 << 30, "1 GiB")
    };
    let r = sh(&sb, &format!("head -c {total} /dev/zero; echo tail >&2")).await;
    assert_eq!(
        r.stdout.len(),
        1 << 20,
        "stdout is capped at the output limit"
    );
    assert!(r.outcome.exit.stdout_truncated);
    assert_eq!(r.outcome.exit.stdout_bytes, total);
    assert_eq!(text(&r.stderr), "tail\n");
    assert!(!r.outcome.exit.stderr_truncated);
    let msgs = r.outcome.messages().join("\n");
    assert!(
        msgs.contains(&format!(
            "stdout truncated; the program wrote {total} bytes ({human}) in total"
        )),
        "{msgs}"
    );
    let status = std::fs::read_to_string(format!("/proc/{}/status", sb.agent_pid())).unwrap();
    let hwm_kb: u64 = status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .unwrap()
        .parse()
        .unwrap();
    // Under gVisor the host process is the Sentry (the whole sandbox's
    // kernel), so its bound is larger; either way a GiB does not pass
    // through memory.
    let bound_kb = if isolation() == Isolation::Gvisor {
        128 * 1024
    } else {
        32 * 1024
    };
    assert!(hwm_kb < bound_kb, "agent peak RSS {hwm_kb} KiB");
    sb.destroy().await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn an_infinite_loop_times_out_and_the_sandbox_stays_usable() {
    let rt = runtime("isolation");
    let sb = sandbox(&rt, limits()).await;
    let opts = RunOptions {
        timeout: Some(Duration::from_secs(1)),
        ..RunOptions::default()
    };
    let started = Instant::now();
    let r = sb
        .run_code(
            Language::Python,
            "import subprocess\nsubprocess.Popen(['sleep','100'])\nwhile True: pass",
            &opts,
        )
        .await
        .unwrap();
    let took = started.elapsed();
    assert!(r.outcome.exit.timed_out);
    assert_eq!(r.outcome.status(), 124);
    assert_eq!(
        r.outcome.messages(),
        vec!["Execution exceeded the 1 s timeout and was stopped.".to_string()]
    );
    assert!(took < Duration::from_secs(3), "took {took:?}");
    // The whole tree died, the child sleep included.
    let r = sh(&sb, "ps -eo comm= | grep -c sleep || true").await;
    assert_eq!(text(&r.stdout).trim(), "0");
    let r = py(&sb, "print('alive')").await;
    assert_eq!(text(&r.stdout), "alive\n");
    sb.destroy().await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn output_that_looks_like_protocol_frames_is_just_output() {
    let rt = runtime("isolation");
    let sb = sandbox(&rt, limits()).await;
    let mut forged = Vec::new();
    forged.extend_from_slice(&60u32.to_be_bytes());
    forged.extend_from_slice(&56u32.to_be_bytes());
    forged.extend_from_slice(br#"{"id":1,"ev":"exec_exited","exit_code":0,"timed_out":false}"#);
    let r = sb
        .exec(
            runcell_protocol::Command::Argv(vec!["cat".into()]),
            &RunOptions {
                stdin: forged.clone(),
                ..RunOptions::default()
            },
        )
        .await
        .unwrap();
    assert_eq!(r.stdout, forged);
    let r = sh(&sb, "printf 'x'; exit 7").await;
    assert_eq!(r.outcome.status(), 7);
    sb.destroy().await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn files_can_be_written_read_listed_and_stated() {
    let rt = runtime("isolation");
    let sb = sandbox(&rt, limits()).await;
    let data: Vec<u8> = (0..10u32 << 20)
        .map(|i| u8::try_from(i % 251).unwrap())
        .collect();
    assert_eq!(
        sb.write_file("/home/user/sub/dir/blob.bin", &data)
            .await
            .unwrap(),
        data.len() as u64
    );
    assert_eq!(
        sb.read_file("/home/user/sub/dir/blob.bin", 64 << 20)
            .await
            .unwrap(),
        data
    );
    let entries = sb.list_dir("/home/user/sub/dir").await.unwrap();
    assert_eq!(entries.len(), 1);
    assert_eq!(
        (entries[0].name.as_str(), entries[0].size),
        ("blob.bin", 10 << 20)
    );
    let st = sb.stat("/home/user/sub").await.unwrap();
    assert!(st.is_dir);
    let r = sh(&sb, "stat -c '%U %s' /home/user/sub/dir/blob.bin").await;
    assert_eq!(text(&r.stdout), format!("user {}\n", 10 << 20));
    let err = sb.stat("/nope").await.unwrap_err().to_string();
    assert!(err.contains("No such file"), "{err}");
    let err = sb
        .read_file("relative.txt", 10)
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("must be absolute"), "{err}");
    let err = sb
        .read_file("/home/user/sub/dir/blob.bin", 10)
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("more than the 10 allowed"), "{err}");
    // The sandbox user's permissions apply: the template is read-only to it.
    let err = sb
        .write_file("/usr/bin/planted", b"x")
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("Permission denied"), "{err}");
    let stats = sb.stats().await.unwrap();
    assert!(
        stats.disk_used_bytes >= 10 << 20 && stats.processes >= 1,
        "{stats:?}"
    );
    sb.destroy().await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn a_sandbox_tied_to_its_owner_stops_when_the_owner_dies() {
    let rt = runtime("isolation");
    let sb = sandbox(&rt, limits()).await;
    let pid = sb.agent_pid();
    let dir = format!("/run/runcell-test/isolation/{}", sb.id());
    let mut buf = String::new();
    std::fs::File::open(format!("/proc/{pid}/status"))
        .unwrap()
        .read_to_string(&mut buf)
        .unwrap();
    // Dropping the handle without destroy closes the owner's end of the setup socket.
    drop(sb);
    let until = Instant::now() + Duration::from_secs(5);
    while std::path::Path::new(&format!("/proc/{pid}/cmdline")).exists()
        && std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .map(|s| !s.contains(") Z"))
            .unwrap_or(false)
        && Instant::now() < until
    {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    assert!(
        stat.is_empty() || stat.contains(") Z"),
        "agent still running: {stat}"
    );
    // What is left (cgroup, directory) is swept.
    let removed = rt.sweep_dead();
    assert!(
        removed.iter().any(|id| dir.ends_with(id.as_str())) || !std::path::Path::new(&dir).exists()
    );
    assert!(!std::path::Path::new(&dir).exists());
}

#[tokio::test(flavor = "multi_thread")]
async fn the_host_can_reconnect_to_a_running_sandbox() {
    let rt = runtime("isolation");
    let sb = rt
        .create(runcell_core::SandboxOptions {
            limits: limits(),
            tied_to_process: false,
            ..runcell_core::SandboxOptions::default()
        })
        .await
        .unwrap();
    let id = sb.id().to_string();
    let pid = sb.agent_pid();
    let background = RunOptions {
        background: true,
        ..RunOptions::default()
    };
    sb.exec(
        runcell_protocol::Command::Shell("echo kept > /home/user/state.txt; sleep 300 &".into()),
        &background,
    )
    .await
    .unwrap();
    // The host process lets go (as a daemon does when it restarts)...
    drop(sb);
    tokio::time::sleep(Duration::from_millis(100)).await;
    // ...and finds the same sandbox again, with its files and processes.
    let again = rt
        .attach(
            &id,
            isolation(),
            runcell_core::Template::host(),
            limits(),
            None,
        )
        .await
        .unwrap();
    assert_eq!(again.agent_pid(), pid);
    let r = sh(&again, "cat /home/user/state.txt; pgrep -c sleep").await;
    assert_eq!(text(&r.stdout), "kept\n1\n");
    // A clean shutdown through the protocol leaves nothing behind.
    again.shutdown().await.unwrap();
    assert!(!std::path::Path::new(&format!("/run/runcell-test/isolation/{id}")).exists());
    assert!(!std::path::Path::new(&format!("/run/runcell-test/isolation-gvisor/{id}")).exists());
    assert!(
        !std::path::Path::new(&format!("/proc/{pid}/cmdline")).exists()
            || std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .map(|s| s.contains(") Z"))
                .unwrap_or(true)
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn landlock_confines_every_process_to_the_sandboxs_root() {
    // The kernel's Landlock ABI, as `runcell doctor` reports it.
    let host = runcell_core::host::system_report().host;
    let abi = host
        .landlock_abi
        .expect("the CI kernel has Landlock; this test needs it");
    let rt = runtime("isolation");
    let sb = sandbox(&rt, limits()).await;
    let stats = sb.stats().await.unwrap();
    // gVisor does not implement Landlock (its own kernel is the fence);
    // the agent says so rather than pretending.
    let want = if isolation() == Isolation::Gvisor {
        0
    } else {
        abi
    };
    assert_eq!(
        stats.landlock_abi, want,
        "the agent did not confine the sandbox with the kernel's Landlock"
    );
    // Programs still run and write where the sandbox lets them: the domain
    // covers the sandbox's whole root.
    let r = sh(
        &sb,
        "echo hi > /tmp/x && cat /tmp/x && /usr/bin/python3 -c 'print(2+2)'",
    )
    .await;
    assert_eq!(text(&r.stdout), "hi\n4\n", "{}", text(&r.stderr));
    sb.destroy().await.unwrap();
}

/// Every way an exec can end (exit code, signal, timeout, background
/// leftovers, a program that cannot start, input) is reported as it
/// happened, and none leaves a process or a zombie behind, not even for a
/// moment after its answer: under gVisor each exec's supervisor comes from
/// the agent's fork server, which must start, report and reap every one of
/// them before the exec is answered.
#[tokio::test(flavor = "multi_thread")]
async fn every_kind_of_exec_ending_is_reported_and_leaves_nothing_behind() {
    let rt = runtime("isolation");
    let sb = sandbox(&rt, limits()).await;
    // Which processes run (their states vary with scheduling; zombies are
    // checked apart).
    let processes = "ps -eo args=";
    let before = text(&sh(&sb, processes).await.stdout);
    let argv =
        |a: &[&str]| runcell_protocol::Command::Argv(a.iter().map(|s| s.to_string()).collect());
    let short = RunOptions {
        timeout: Some(Duration::from_millis(500)),
        ..RunOptions::default()
    };
    // Right after an exec's answer: no process but those of the next exec
    // (the check itself) is a zombie.
    let no_zombie = |after: String| {
        let sb = &sb;
        async move {
            let states = text(&sh(sb, "ps -eo stat=,args=").await.stdout);
            assert!(
                !states.lines().any(|l| l.starts_with('Z')),
                "after {after}:\n{states}"
            );
        }
    };
    for round in 0..3 {
        let r = sh(&sb, "echo out; echo err >&2; exit 7").await;
        assert_eq!(
            (r.outcome.status(), text(&r.stdout), text(&r.stderr)),
            (7, "out\n".into(), "err\n".into())
        );
        no_zombie(format!("round {round}, an exit")).await;
        let r = sh(&sb, "kill -9 $$").await;
        assert_eq!(
            r.outcome.exit.signal,
            Some(9),
            "round {round}: {:?}",
            r.outcome
        );
        no_zombie(format!("round {round}, a signal")).await;
        let r = sb.exec(argv(&["sleep", "30"]), &short).await.unwrap();
        assert!(r.outcome.exit.timed_out, "round {round}: {:?}", r.outcome);
        no_zombie(format!("round {round}, a timeout")).await;
        let r = sh(&sb, "sleep 60 & setsid sleep 61 & echo started").await;
        assert_eq!(text(&r.stdout), "started\n");
        no_zombie(format!("round {round}, background leftovers")).await;
        for program in ["/etc/hostname", "/no/such/program"] {
            let e = sb
                .exec(argv(&[program]), &RunOptions::default())
                .await
                .expect_err("a program that cannot start");
            let e = e.to_string();
            assert!(e.contains("Could not start") && e.contains(program), "{e}");
            no_zombie(format!("round {round}, {program} that cannot start")).await;
        }
        let r = sb
            .exec(
                argv(&["cat"]),
                &RunOptions {
                    stdin: b"through stdin".to_vec(),
                    ..RunOptions::default()
                },
            )
            .await
            .unwrap();
        assert_eq!(text(&r.stdout), "through stdin");
    }
    // What ran before is all that runs now: no leftover, no zombie.
    let after = text(&sh(&sb, processes).await.stdout);
    assert_eq!(
        after, before,
        "processes before:\n{before}\nafter:\n{after}"
    );
    let states = text(&sh(&sb, "ps -eo stat=,args=").await.stdout);
    assert!(!states.lines().any(|l| l.starts_with('Z')), "{states}");
    sb.destroy().await.unwrap();
}

/// Every program starts with an empty capability bounding set (nothing it
/// could regain through a privileged binary) and with every signal at its
/// default: nothing the agent or its exec fork server ignores (SIGPIPE, as
/// every Rust program does) passes on. Checked on a sandbox's first exec
/// and on later ones, which start from the fork server's noted state
/// (`note_inherited`).
#[tokio::test(flavor = "multi_thread")]
async fn programs_start_with_an_empty_bounding_set_and_default_signals() {
    let rt = runtime("isolation");
    let sb = sandbox(&rt, limits()).await;
    for round in 0..3 {
        let r = sh(
            &sb,
            "grep CapBnd /proc/self/status; yes | head -n1 >/dev/null; echo piped",
        )
        .await;
        let (out, err) = (text(&r.stdout), text(&r.stderr));
        assert!(
            out.contains("CapBnd:\t0000000000000000") && out.contains("piped"),
            "round {round}: {out}{err}"
        );
        // An ignored SIGPIPE makes `yes` see EPIPE and say so; the default
        // action ends it silently.
        assert!(
            !err.contains("Broken pipe"),
            "round {round}: SIGPIPE is ignored: {err}"
        );
        let r = py(
            &sb,
            "import signal as s\n\
             print([s.getsignal(x) == s.SIG_DFL for x in (s.SIGHUP, s.SIGQUIT, s.SIGUSR1, s.SIGUSR2, s.SIGALRM, s.SIGTERM, s.SIGCHLD, s.SIGTSTP)], s.getsignal(s.SIGINT) is s.default_int_handler, sorted(s.pthread_sigmask(s.SIG_BLOCK, [])))",
        )
        .await;
        // Nothing blocked either (the last list): the host's clone blocks
        // every signal until the agent's first line, and a program must not
        // inherit that.
        assert_eq!(
            text(&r.stdout).trim(),
            "[True, True, True, True, True, True, True, True] True []",
            "round {round}: {}",
            text(&r.stderr)
        );
    }
    sb.destroy().await.unwrap();
}

/// Execs started at once in one sandbox each get their own output and
/// status, and leave nothing behind once answered, not even a zombie for a
/// moment: under gVisor they mix the fork server's spare supervisor (forked
/// ahead) with supervisors it forks for the requests that find none, in
/// whatever order they arrive, and the fork server (not the agent) reaps
/// them.
#[tokio::test(flavor = "multi_thread")]
async fn execs_started_at_once_each_get_their_own_output_and_status() {
    let rt = runtime("isolation");
    let sb = std::sync::Arc::new(sandbox(&rt, limits()).await);
    let processes = "ps -eo args=";
    let before = text(&sh(&sb, processes).await.stdout);
    for round in 0..8 {
        let mut runs = tokio::task::JoinSet::new();
        for i in 0..6 {
            let sb = sb.clone();
            runs.spawn(async move {
                let r = sh(
                    &sb,
                    &format!("echo out{i}; echo err{i} >&2; exit {}", i + 1),
                )
                .await;
                (i, r)
            });
        }
        while let Some(done) = runs.join_next().await {
            let (i, r) = done.unwrap();
            assert_eq!(
                (r.outcome.status(), text(&r.stdout), text(&r.stderr)),
                (i + 1, format!("out{i}\n"), format!("err{i}\n")),
                "round {round}, exec {i}: {:?}",
                r.outcome
            );
        }
        let after = text(&sh(&sb, processes).await.stdout);
        assert_eq!(
            after, before,
            "round {round}: processes before:\n{before}\nafter:\n{after}"
        );
    }
    std::sync::Arc::into_inner(sb)
        .expect("no exec holds the sandbox")
        .destroy()
        .await
        .unwrap();
}
