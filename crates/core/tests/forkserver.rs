//! A long-lived runtime forks each jail sandbox's agent from one started
//! agent (`runcell_jail::forkserver`) instead of an exec per sandbox. The
//! forked agent must be what an exec'd one is (this process's child,
//! holding nothing of the fork server's), a fork server that dies must not
//! stop sandboxes from starting, and one serves a bounded number of
//! sandboxes before a fresh exec (a new address-space layout) replaces it.
//!
//! One test in its own binary: every fork server of this process is this
//! test's.

mod common;

use std::path::PathBuf;

use common::*;
use runcell_core::{Runtime, RuntimeConfig};

fn cmdline(pid: i32) -> Vec<String> {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .unwrap_or_default()
        .split(|b| *b == 0)
        .filter(|a| !a.is_empty())
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect()
}

fn status_field(pid: i32, field: &str) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix(field).map(|v| v.trim().to_string()))
        .unwrap_or_default()
}

/// The fork servers this process runs: its children running as host root
/// with the fork server's command line (forked agents run as the
/// sandbox's mapped root, a host uid far from 0).
fn fork_servers() -> Vec<i32> {
    let me = std::process::id().to_string();
    host_processes_with("fork-server")
        .into_iter()
        .filter(|&pid| {
            status_field(pid, "PPid:") == me
                && status_field(pid, "Uid:").split_whitespace().next() == Some("0")
                && cmdline(pid).get(1).map(String::as_str) == Some("fork-server")
                // A killed one stays a zombie until it is collected.
                && !status_field(pid, "State:").starts_with('Z')
        })
        .collect()
}

/// The fork servers, once only one is left (a dropped one is stopped off
/// the create's path, so it may take a moment to go), or after 3 s.
fn one_fork_server() -> Vec<i32> {
    let mut servers = fork_servers();
    for _ in 0..150 {
        if servers.len() == 1 {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
        servers = fork_servers();
    }
    servers
}

/// The socket inodes among a process's descriptors.
fn sockets(pid: i32) -> Vec<String> {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| std::fs::read_link(e.path()).ok())
        .map(|l| l.to_string_lossy().into_owned())
        .filter(|l| l.starts_with("socket:"))
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn agents_are_forked_from_a_fork_server_that_is_replaced_when_it_dies_or_has_served_its_share(
) {
    require_root();
    let rt = Runtime::new(RuntimeConfig {
        state_dir: PathBuf::from("/run/runcell-test/forkserver"),
        cgroup_parent: "runcell-test-forkserver".into(),
        ..RuntimeConfig::default()
    })
    .expect("runcell-agent must be built before the tests run");
    rt.sweep_dead();

    // The first sandbox starts the fork server and is forked from it.
    let a = sandbox(&rt, limits()).await;
    let servers = fork_servers();
    assert_eq!(servers.len(), 1, "one fork server, got {servers:?}");
    let server = servers[0];
    let agent = a.agent_pid();
    assert_eq!(
        cmdline(agent).get(1).map(String::as_str),
        Some("fork-server")
    );
    // Like an exec'd agent: this process's child (it waits for it), not
    // the fork server's, and nothing of the fork server's is held.
    assert_eq!(status_field(agent, "PPid:"), std::process::id().to_string());
    let server_sockets = sockets(server);
    assert!(!server_sockets.is_empty());
    for s in sockets(agent) {
        assert!(
            !server_sockets.contains(&s),
            "the agent holds the fork server's {s}"
        );
    }
    // It runs programs as the sandbox user, in its own namespaces.
    let r = sh(&a, "id -u; cat /proc/1/comm; echo $$").await;
    assert_eq!(r.outcome.exit.exit_code, Some(0), "{}", text(&r.stderr));
    let out = text(&r.stdout);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.first(), Some(&"1000"), "{out}");
    assert_eq!(lines.get(1), Some(&"runcell-agent"), "{out}");
    assert_ne!(lines.get(2), Some(&agent.to_string().as_str()), "{out}");

    // Its network namespace is its own: neither the host's nor the fork
    // server's (which is private too), with a TCP connection table of its
    // own (the kernel shows a shared table's size as negative), so its
    // teardown never walks the host's; and loopback TCP works in it.
    let netns = |pid: i32| std::fs::read_link(format!("/proc/{pid}/ns/net")).unwrap();
    let host = std::fs::read_link("/proc/self/ns/net").unwrap();
    assert_ne!(
        netns(server),
        host,
        "the fork server is on the host's network"
    );
    assert_ne!(netns(agent), host);
    assert_ne!(netns(agent), netns(server));
    let r = sh(
        &a,
        "cat /proc/sys/net/ipv4/tcp_ehash_entries; /usr/bin/python3 -c '\
import socket; s = socket.create_server((\"127.0.0.1\", 0)); \
c = socket.create_connection(s.getsockname()); a, _ = s.accept(); \
c.sendall(b\"ok\"); print(a.recv(2).decode())'",
    )
    .await;
    assert_eq!(
        text(&r.stdout),
        format!("{}\nok\n", runcell_jail::forkserver::SANDBOX_TCP_BUCKETS),
        "{}",
        text(&r.stderr)
    );

    // A fork server killed outright: sandboxes still start (the one that
    // finds it gone execs its agent), and the next fork server is new.
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(server),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    let b = sandbox(&rt, limits()).await;
    let r = sh(&b, "echo b").await;
    assert_eq!(text(&r.stdout), "b\n", "{}", text(&r.stderr));
    let c = sandbox(&rt, limits()).await;
    assert_eq!(
        cmdline(c.agent_pid()).get(1).map(String::as_str),
        Some("fork-server")
    );
    let servers = fork_servers();
    assert_eq!(servers.len(), 1, "{servers:?}");
    let second = servers[0];
    assert_ne!(second, server);
    let r = sh(&c, "echo c").await;
    assert_eq!(text(&r.stdout), "c\n", "{}", text(&r.stderr));
    // The first sandbox outlived its fork server.
    let r = sh(&a, "echo a").await;
    assert_eq!(text(&r.stdout), "a\n", "{}", text(&r.stderr));

    // A wedged fork server (stopped) holds no create up for long: the one
    // that finds it so gives up after 10 s and execs its agent,
    // the wedged one is killed, and the next create has a new one.
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(second),
        nix::sys::signal::Signal::SIGSTOP,
    )
    .unwrap();
    let t0 = std::time::Instant::now();
    let d = sandbox(&rt, limits()).await;
    assert!(
        t0.elapsed() < std::time::Duration::from_secs(14),
        "{:?}",
        t0.elapsed()
    );
    assert_eq!(
        cmdline(d.agent_pid()).get(1).map(String::as_str),
        Some("init")
    );
    let r = sh(&d, "echo d").await;
    assert_eq!(text(&r.stdout), "d\n", "{}", text(&r.stderr));
    d.destroy().await.unwrap();
    let e = sandbox(&rt, limits()).await;
    assert_eq!(
        cmdline(e.agent_pid()).get(1).map(String::as_str),
        Some("fork-server")
    );
    e.destroy().await.unwrap();
    let servers = one_fork_server();
    assert_eq!(
        servers.len(),
        1,
        "the wedged fork server is still there: {servers:?}"
    );
    assert_ne!(servers[0], second);
    let second = servers[0];

    // A fork server serves a bounded number of sandboxes; then a fresh one
    // (a new exec, so a new layout) takes over.
    for _ in 0..runcell_jail::forkserver::FORKS_PER_SERVER {
        let s = sandbox(&rt, limits()).await;
        s.destroy().await.unwrap();
    }
    // The retired one is stopped off the create's path: give it a moment.
    let servers = one_fork_server();
    assert_eq!(servers.len(), 1, "{servers:?}");
    assert_ne!(servers[0], second, "the fork server was never replaced");

    for s in [a, b, c] {
        s.destroy().await.unwrap();
    }
    // Dropping the runtime ends its fork server.
    drop(rt);
    assert!(fork_servers().is_empty(), "{:?}", fork_servers());
}
