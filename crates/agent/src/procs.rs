//! Finding and killing process trees through /proc.

use std::collections::HashSet;
use std::fs;
use std::time::Duration;

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

#[derive(Debug, Clone, Copy)]
struct ProcInfo {
    pid: i32,
    ppid: i32,
    pgrp: i32,
    session: i32,
    rss_pages: u64,
}

fn read_proc(pid: i32) -> Option<ProcInfo> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split(' ').collect();
    // After "(comm) ": state ppid pgrp session ... rss is field 24 (index 21 here).
    Some(ProcInfo {
        pid,
        ppid: f.get(1)?.parse().ok()?,
        pgrp: f.get(2)?.parse().ok()?,
        session: f.get(3)?.parse().ok()?,
        rss_pages: f.get(21)?.parse().ok()?,
    })
}

fn all() -> Vec<ProcInfo> {
    fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter_map(read_proc)
        .collect()
}

/// The process tree of an exec started as a session leader `root`: its
/// session, its process group, and every descendant of any of them.
fn tree(root: i32) -> Vec<i32> {
    let procs = all();
    let mut set: HashSet<i32> = procs
        .iter()
        .filter(|p| p.pid == root || p.session == root || p.pgrp == root)
        .map(|p| p.pid)
        .collect();
    loop {
        let before = set.len();
        for p in &procs {
            if set.contains(&p.ppid) {
                set.insert(p.pid);
            }
        }
        if set.len() == before {
            break;
        }
    }
    set.remove(&1);
    set.into_iter().collect()
}

/// Sends SIGKILL once to every descendant of `root` (found by parentage
/// through `/proc`), not to `root` itself.
pub fn kill_below(root: i32) {
    let procs = all();
    let mut set: HashSet<i32> = HashSet::from([root]);
    loop {
        let before = set.len();
        for p in &procs {
            if set.contains(&p.ppid) {
                set.insert(p.pid);
            }
        }
        if set.len() == before {
            break;
        }
    }
    for pid in set {
        if pid != root && pid != 1 {
            let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
        }
    }
}

/// Sends SIGKILL to the whole tree of `root`, repeating until it is gone (a
/// process may fork between the scan and the kill).
pub async fn kill_tree(root: i32) {
    for _ in 0..50 {
        let pids = tree(root);
        if pids.is_empty() {
            return;
        }
        for pid in pids {
            let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// The first child listed for `pid` (its oldest live child).
pub fn first_child(pid: i32) -> Option<i32> {
    let list = fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")).ok()?;
    list.split_whitespace().next()?.parse().ok()
}

/// Whether `pid` has exited and waits to be reaped.
pub fn is_zombie(pid: i32) -> bool {
    fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| Some(s[s.rfind(')')? + 2..].starts_with('Z')))
        .unwrap_or(true)
}

/// Sends `signal` to the process group of `root`.
pub fn signal_group(root: i32, signal: Signal) {
    let _ = kill(Pid::from_raw(-root), signal);
}

/// Process count and summed resident memory in the sandbox.
pub fn usage() -> (u64, u64) {
    let page = page_size();
    let procs = all();
    let rss = procs.iter().map(|p| p.rss_pages * page).sum();
    (procs.len() as u64, rss)
}

/// The agent's own resident memory.
pub fn self_rss() -> u64 {
    read_proc(std::process::id() as i32)
        .map(|p| p.rss_pages * page_size())
        .unwrap_or(0)
}

fn page_size() -> u64 {
    nix::unistd::sysconf(nix::unistd::SysconfVar::PAGE_SIZE)
        .ok()
        .flatten()
        .and_then(|n| u64::try_from(n).ok())
        .unwrap_or(4096)
}

/// Kills every process in the pid namespace except the agent.
pub fn kill_all() {
    let _ = kill(Pid::from_raw(-1), Signal::SIGKILL);
}
