//! Signals caught from a chosen moment on, for a process that must end the
//! graceful way (releasing a mount, destroying a sandbox) whenever one
//! comes: made on the process's first line, it keeps a signal that arrives
//! before anything awaits it, where a handler installed only when first
//! awaited would leave that early signal to its default action.

use std::future::poll_fn;
use std::task::Poll;

use tokio::signal::unix::{signal, Signal, SignalKind};

/// The signals caught since [`Caught::catch`].
#[derive(Debug)]
pub struct Caught {
    signals: Vec<Signal>,
}

impl Caught {
    /// Catches each of `kinds` from now on. Must be called inside a Tokio
    /// runtime.
    pub fn catch(kinds: &[SignalKind]) -> std::io::Result<Self> {
        let signals = kinds
            .iter()
            .map(|&k| signal(k))
            .collect::<std::io::Result<_>>()?;
        Ok(Self { signals })
    }

    /// Catches nothing: [`Caught::recv`] never returns (for when catching
    /// failed, and the signals keep their default action).
    pub fn nothing() -> Self {
        Self {
            signals: Vec::new(),
        }
    }

    /// Returns once one of them has come since [`Caught::catch`] (at once
    /// when one came before this was first awaited).
    pub async fn recv(&mut self) {
        if self.signals.is_empty() {
            return std::future::pending().await;
        }
        poll_fn(|cx| {
            for s in &mut self.signals {
                if s.poll_recv(cx).is_ready() {
                    return Poll::Ready(());
                }
            }
            Poll::Pending
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A signal raised after `catch` and before anything awaits is kept.
    #[tokio::test]
    async fn a_signal_before_the_first_await_is_kept() {
        let mut caught = Caught::catch(&[SignalKind::user_defined1(), SignalKind::user_defined2()])
            .expect("catch SIGUSR1 and SIGUSR2");
        nix::sys::signal::raise(nix::sys::signal::Signal::SIGUSR2).expect("raise SIGUSR2");
        tokio::time::timeout(std::time::Duration::from_secs(5), caught.recv())
            .await
            .expect("the early SIGUSR2 is seen");
    }

    /// With nothing caught, `recv` waits forever.
    #[tokio::test]
    async fn nothing_caught_never_returns() {
        let waited = tokio::time::timeout(
            std::time::Duration::from_millis(50),
            Caught::nothing().recv(),
        )
        .await;
        assert!(waited.is_err());
    }
}
