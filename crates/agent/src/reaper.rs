//! Zombie reaping for PID 1: every child, ours or orphaned, is waited for;
//! exit statuses of processes the agent started are handed to whoever waits.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;
use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::oneshot;

/// How a process ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exit {
    /// Exited with a code.
    Code(i32),
    /// Killed by a signal.
    Signal(i32),
}

#[derive(Debug, Default)]
struct State {
    waiting: HashMap<i32, oneshot::Sender<Exit>>,
}

/// Hands out exit statuses.
#[derive(Debug, Clone, Default)]
pub struct Reaper {
    state: Arc<Mutex<State>>,
}

impl Reaper {
    /// Starts reaping. Must be called before any child is started.
    pub fn start() -> std::io::Result<Self> {
        let reaper = Reaper::default();
        let mut sigchld = signal(SignalKind::child())?;
        let r = reaper.clone();
        tokio::spawn(async move {
            loop {
                r.reap_all();
                if sigchld.recv().await.is_none() {
                    return;
                }
            }
        });
        Ok(reaper)
    }

    /// Registers interest in `pid`'s exit. Call right after starting it, with
    /// no `.await` in between (the runtime is single-threaded, so the reaper
    /// cannot run in that gap).
    pub fn watch(&self, pid: i32) -> oneshot::Receiver<Exit> {
        let (tx, rx) = oneshot::channel();
        self.state
            .lock()
            .expect("reaper lock")
            .waiting
            .insert(pid, tx);
        rx
    }

    /// Whether `pid` is watched and has not been reaped yet, so its number
    /// still names it (reaping happens on the runtime thread, so this holds
    /// until the caller's next `.await`).
    pub fn is_waiting(&self, pid: i32) -> bool {
        self.state
            .lock()
            .expect("reaper lock")
            .waiting
            .contains_key(&pid)
    }

    fn reap_all(&self) {
        loop {
            match waitpid(Pid::from_raw(-1), Some(WaitPidFlag::WNOHANG)) {
                Ok(WaitStatus::Exited(pid, code)) => self.deliver(pid, Exit::Code(code)),
                Ok(WaitStatus::Signaled(pid, sig, _)) => {
                    self.deliver(pid, Exit::Signal(sig as i32))
                }
                Ok(WaitStatus::StillAlive) | Err(_) => return,
                Ok(_) => {}
            }
        }
    }

    fn deliver(&self, pid: Pid, exit: Exit) {
        self.deliver_exit(pid.as_raw(), exit);
    }

    fn deliver_exit(&self, pid: i32, exit: Exit) {
        if let Some(tx) = self.let_go(pid) {
            let _ = tx.send(exit);
        }
    }

    /// Stops waiting for `pid`, a process that is not the agent's child (an
    /// exec supervisor the fork server started, which reports its own
    /// exit): from here on [`Reaper::is_waiting`] says no, as its number may
    /// soon name another process. The exit goes to whoever watches it
    /// through what this returns.
    pub fn let_go(&self, pid: i32) -> Option<oneshot::Sender<Exit>> {
        self.state.lock().expect("reaper lock").waiting.remove(&pid)
    }
}
