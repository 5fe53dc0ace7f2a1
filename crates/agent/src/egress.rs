//! The sandbox end of egress: a TCP listener on `127.0.0.1:3128` (inside the
//! sandbox's own network namespace) that forwards every connection to the
//! host's egress proxy through the egress socket. Processes find it through
//! the standard proxy variables.

use std::collections::BTreeMap;
use std::sync::Mutex;

use runcell_jail::EGRESS_SOCKET;
use tokio::net::{TcpListener, UnixStream};
use tokio::task::JoinHandle;

/// Where the proxy listens inside the sandbox.
pub const PROXY_ADDR: &str = "127.0.0.1:3128";

/// Errors turning the listener on.
#[derive(Debug, thiserror::Error)]
pub enum EgressError {
    /// The sandbox was created without an egress socket.
    #[error("This sandbox was created without egress; its network policy cannot be changed.")]
    NoSocket,
    /// Binding the listener failed.
    #[error("Could not listen on {PROXY_ADDR} for the egress proxy.")]
    Listen(#[source] std::io::Error),
}

/// The listener's state.
#[derive(Debug, Default)]
pub struct Egress {
    available: bool,
    task: Mutex<Option<JoinHandle<()>>>,
}

impl Egress {
    /// State for a sandbox with (`available`) or without an egress socket.
    pub fn new(available: bool) -> Self {
        Self {
            available,
            task: Mutex::new(None),
        }
    }

    /// Whether processes get the proxy environment.
    pub fn enabled(&self) -> bool {
        self.task.lock().expect("egress lock").is_some()
    }

    /// Starts or stops the listener. Connections already forwarded stay
    /// open; the host's proxy checks every new request against the policy.
    pub async fn set(&self, enabled: bool) -> Result<(), EgressError> {
        if !self.available {
            return if enabled {
                Err(EgressError::NoSocket)
            } else {
                Ok(())
            };
        }
        if !enabled {
            if let Some(t) = self.task.lock().expect("egress lock").take() {
                t.abort();
            }
            return Ok(());
        }
        if self.enabled() {
            return Ok(());
        }
        let listener = TcpListener::bind(PROXY_ADDR)
            .await
            .map_err(EgressError::Listen)?;
        let task = tokio::spawn(forward(listener));
        let mut slot = self.task.lock().expect("egress lock");
        if let Some(old) = slot.replace(task) {
            old.abort();
        }
        Ok(())
    }

    /// Adds the proxy variables to `env` when egress is on.
    pub fn apply_env(&self, env: &mut BTreeMap<String, String>) {
        if !self.enabled() {
            return;
        }
        let url = format!("http://{PROXY_ADDR}");
        for k in ["HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"] {
            env.insert(k.into(), url.clone());
        }
        for k in ["NO_PROXY", "no_proxy"] {
            env.insert(k.into(), "localhost,127.0.0.1,::1".into());
        }
        // npm reads its own settings before the environment's lower-case names.
        env.insert("npm_config_proxy".into(), url.clone());
        env.insert("npm_config_https_proxy".into(), url);
    }
}

async fn forward(listener: TcpListener) {
    loop {
        let (mut tcp, _) = match listener.accept().await {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!("egress listener accept failed: {e}");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                continue;
            }
        };
        tokio::spawn(async move {
            let _ = tcp.set_nodelay(true);
            // A host socket: a checkpoint closes it (the client sees its
            // connection reset).
            let _open = crate::checkpoint::open();
            if crate::checkpoint::is_quiescing() {
                return;
            }
            match UnixStream::connect(EGRESS_SOCKET).await {
                Ok(mut unix) => {
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional_with_sizes(
                            &mut tcp,
                            &mut unix,
                            64 << 10,
                            64 << 10,
                        ) => {}
                        () = crate::checkpoint::quiesced() => {}
                    }
                }
                Err(e) => tracing::warn!("could not reach the egress socket: {e}"),
            }
        });
    }
}
