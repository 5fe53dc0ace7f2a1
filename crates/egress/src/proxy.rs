//! The per-sandbox HTTP proxy: `CONNECT host:port` for TLS, absolute-URI
//! forwarding for plain HTTP. Every request is checked against the
//! sandbox's policy by name, resolved on the host, and refused if any
//! address it resolves to is not public (unless the operator opened it).

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use serde::Serialize;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpStream, UnixListener, UnixStream};

use crate::{classify, NetworkPolicy, PrivateException};

/// Errors handling one proxied connection (logged, never fatal).
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    /// The sandbox side failed or closed early.
    #[error("The sandbox's side of the connection failed.")]
    Client(#[source] std::io::Error),
    /// The request head was malformed or too large.
    #[error("The request is not a proxy request runcell understands: {0}.")]
    BadRequest(String),
}

/// Longest request head the proxy reads.
const MAX_HEAD: usize = 64 << 10;
/// How long resolving or connecting may take.
const UPSTREAM_TIMEOUT: Duration = Duration::from_secs(10);
/// Connections one sandbox may have open through the proxy at once.
pub const MAX_CONNECTIONS: usize = 256;
/// How long a client may take to send its request head.
const HEAD_TIMEOUT: Duration = Duration::from_secs(30);
/// Buffer size of each direction of a splice.
const COPY_BUF: usize = 64 << 10;
/// How many refused host names are remembered per sandbox.
const REFUSED_KEPT: usize = 64;

/// Totals across every sandbox (for metrics).
#[derive(Debug, Default)]
pub struct EgressTotals {
    /// Bytes from the sandboxes to the network.
    pub bytes_out: AtomicU64,
    /// Bytes from the network to the sandboxes.
    pub bytes_in: AtomicU64,
    /// Connections made.
    pub allowed: AtomicU64,
    /// Requests refused by the policy (host not allowed).
    pub refused_policy: AtomicU64,
    /// Requests refused because the host resolved to a private address.
    pub refused_private: AtomicU64,
    /// Requests that failed upstream (resolution or connection).
    pub failed: AtomicU64,
}

/// Host-wide egress settings.
#[derive(Debug, Clone, Default)]
pub struct EgressConfig {
    /// Private or loopback destinations the operator opened.
    pub allow_private: Vec<PrivateException>,
    /// Totals across sandboxes.
    pub totals: Arc<EgressTotals>,
}

/// One sandbox's policy and counters.
#[derive(Debug)]
pub struct Egress {
    sandbox: String,
    policy: RwLock<NetworkPolicy>,
    config: EgressConfig,
    bytes_in: AtomicU64,
    bytes_out: AtomicU64,
    allowed: AtomicU64,
    refused: AtomicU64,
    refused_hosts: Mutex<VecDeque<String>>,
}

/// A sandbox's policy and what went through its proxy (the `network` object
/// of the API).
#[derive(Debug, Clone, Serialize)]
pub struct EgressReport {
    /// The policy.
    #[serde(flatten)]
    pub policy: NetworkPolicy,
    /// Bytes received from the network.
    pub bytes_in: u64,
    /// Bytes sent to the network.
    pub bytes_out: u64,
    /// Connections made.
    pub connections_allowed: u64,
    /// Requests refused.
    pub connections_refused: u64,
    /// The most recent refused host names, oldest first, each once.
    pub refused_hosts: Vec<String>,
}

enum Refusal {
    Policy,
    Private,
}

impl Egress {
    /// State for sandbox `sandbox` under `policy`.
    pub fn new(sandbox: String, policy: NetworkPolicy, config: EgressConfig) -> Self {
        Self {
            sandbox,
            policy: RwLock::new(policy),
            config,
            bytes_in: AtomicU64::new(0),
            bytes_out: AtomicU64::new(0),
            allowed: AtomicU64::new(0),
            refused: AtomicU64::new(0),
            refused_hosts: Mutex::new(VecDeque::new()),
        }
    }

    /// The current policy.
    pub fn policy(&self) -> NetworkPolicy {
        self.policy
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// Replaces the policy; requests from then on are checked against it.
    pub fn set_policy(&self, policy: NetworkPolicy) {
        *self
            .policy
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = policy;
    }

    /// The policy and counters.
    pub fn report(&self) -> EgressReport {
        EgressReport {
            policy: self.policy(),
            bytes_in: self.bytes_in.load(Ordering::Relaxed),
            bytes_out: self.bytes_out.load(Ordering::Relaxed),
            connections_allowed: self.allowed.load(Ordering::Relaxed),
            connections_refused: self.refused.load(Ordering::Relaxed),
            refused_hosts: self
                .refused_hosts
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .iter()
                .cloned()
                .collect(),
        }
    }

    fn refuse(&self, host: &str, why: Refusal) {
        self.refused.fetch_add(1, Ordering::Relaxed);
        let totals = &self.config.totals;
        match why {
            Refusal::Policy => totals.refused_policy.fetch_add(1, Ordering::Relaxed),
            Refusal::Private => totals.refused_private.fetch_add(1, Ordering::Relaxed),
        };
        let mut hosts = self
            .refused_hosts
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        hosts.retain(|h| h != host);
        hosts.push_back(host.to_string());
        while hosts.len() > REFUSED_KEPT {
            hosts.pop_front();
        }
    }

    fn count_bytes(&self, out: u64, inn: u64) {
        self.bytes_out.fetch_add(out, Ordering::Relaxed);
        self.bytes_in.fetch_add(inn, Ordering::Relaxed);
        self.config
            .totals
            .bytes_out
            .fetch_add(out, Ordering::Relaxed);
        self.config
            .totals
            .bytes_in
            .fetch_add(inn, Ordering::Relaxed);
    }
}

/// Serves the sandbox's egress socket until the task is aborted. At most
/// [`MAX_CONNECTIONS`] connections of one sandbox are open at once; the
/// next ones are answered 503.
pub async fn serve(listener: UnixListener, egress: Arc<Egress>) {
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    loop {
        match listener.accept().await {
            Ok((mut stream, _)) => {
                let egress = egress.clone();
                let Ok(slot) = slots.clone().try_acquire_owned() else {
                    tokio::spawn(async move {
                        tracing::warn!(sandbox = %egress.sandbox, "egress refused: {MAX_CONNECTIONS} connections already open");
                        let body = format!("runcell: this sandbox already has {MAX_CONNECTIONS} connections open\n");
                        let _ = answer(&mut stream, "503 Service Unavailable", &body).await;
                    });
                    continue;
                };
                tokio::spawn(async move {
                    if let Err(e) = handle(stream, &egress).await {
                        tracing::debug!(sandbox = %egress.sandbox, "egress connection: {e}");
                    }
                    drop(slot);
                });
            }
            Err(e) => {
                tracing::warn!(sandbox = %egress.sandbox, "egress accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// A parsed proxy request.
#[derive(Debug, PartialEq, Eq)]
struct Target {
    connect: bool,
    host: String,
    port: u16,
    /// For plain HTTP: the head rewritten for the origin server.
    head: Vec<u8>,
}

/// Splits `host[:port]` / `[v6][:port]`.
fn split_host_port(s: &str, default: u16) -> Option<(String, u16)> {
    if let Some(rest) = s.strip_prefix('[') {
        let (h, after) = rest.split_once(']')?;
        let port = match after.strip_prefix(':') {
            Some(p) => p.parse().ok()?,
            None if after.is_empty() => default,
            None => return None,
        };
        return Some((h.to_string(), port));
    }
    match s.rsplit_once(':') {
        Some((h, p)) if !h.contains(':') => Some((h.to_string(), p.parse().ok()?)),
        Some(_) => None,
        None => Some((s.to_string(), default)),
    }
}

fn parse_head(head: &[u8]) -> Result<Target, ProxyError> {
    let text = std::str::from_utf8(head).map_err(|_| ProxyError::BadRequest("not UTF-8".into()))?;
    let mut lines = text.split("\r\n");
    let first = lines.next().unwrap_or("");
    let mut parts = first.split(' ');
    let (method, target, version) = match (parts.next(), parts.next(), parts.next()) {
        (Some(m), Some(t), Some(v)) if !m.is_empty() => (m, t, v),
        _ => return Err(ProxyError::BadRequest("no request line".into())),
    };
    if method.eq_ignore_ascii_case("CONNECT") {
        let (host, port) = split_host_port(target, 443)
            .filter(|(h, _)| !h.is_empty())
            .ok_or_else(|| ProxyError::BadRequest(format!("CONNECT target {target:?}")))?;
        return Ok(Target {
            connect: true,
            host,
            port,
            head: Vec::new(),
        });
    }
    let rest = target
        .strip_prefix("http://")
        .or_else(|| target.strip_prefix("HTTP://"))
        .ok_or_else(|| {
            ProxyError::BadRequest(format!(
                "{target:?} is not an absolute http:// URL (use CONNECT for https)"
            ))
        })?;
    let (authority, path) = match rest.find(['/', '?']) {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, "/"),
    };
    let authority = authority.rsplit('@').next().unwrap_or(authority);
    let (host, port) = split_host_port(authority, 80)
        .filter(|(h, _)| !h.is_empty())
        .ok_or_else(|| ProxyError::BadRequest(format!("host in {target:?}")))?;
    let path = if path.starts_with('?') {
        format!("/{path}")
    } else {
        path.to_string()
    };
    let mut out = format!("{method} {path} {version}\r\n");
    let mut has_host = false;
    for line in lines {
        if line.is_empty() {
            continue;
        }
        let name = line
            .split(':')
            .next()
            .unwrap_or("")
            .trim()
            .to_ascii_lowercase();
        match name.as_str() {
            "proxy-connection" | "proxy-authorization" | "connection" | "keep-alive" => continue,
            "host" => has_host = true,
            _ => {}
        }
        out.push_str(line);
        out.push_str("\r\n");
    }
    if !has_host {
        out.push_str(&format!("Host: {authority}\r\n"));
    }
    // One request per connection: the next request (a redirect, say) comes
    // through the proxy again and is checked again.
    out.push_str("Connection: close\r\n\r\n");
    Ok(Target {
        connect: false,
        host,
        port,
        head: out.into_bytes(),
    })
}

/// Reads until the end of the head; returns the head and what followed it.
async fn read_head<R: AsyncRead + Unpin>(r: &mut R) -> Result<(Vec<u8>, Vec<u8>), ProxyError> {
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 4096];
    loop {
        let n = r.read(&mut chunk).await.map_err(ProxyError::Client)?;
        if n == 0 {
            return Err(ProxyError::BadRequest(
                "closed before the end of the head".into(),
            ));
        }
        let from = buf.len().saturating_sub(3);
        buf.extend_from_slice(&chunk[..n]);
        if let Some(i) = buf[from..].windows(4).position(|w| w == b"\r\n\r\n") {
            let end = from + i + 4;
            let rest = buf.split_off(end);
            return Ok((buf, rest));
        }
        if buf.len() > MAX_HEAD {
            return Err(ProxyError::BadRequest("request head too large".into()));
        }
    }
}

async fn answer<W: AsyncWrite + Unpin>(
    w: &mut W,
    status: &str,
    body: &str,
) -> Result<(), ProxyError> {
    let msg = format!(
        "HTTP/1.1 {status}\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    w.write_all(msg.as_bytes())
        .await
        .map_err(ProxyError::Client)?;
    let _ = w.shutdown().await;
    Ok(())
}

/// What the proxy decides for `host:port`, given the addresses it resolved to.
/// `Err` carries the name of the refused address's class.
pub fn check_addresses(
    host: &str,
    addrs: &[SocketAddr],
    exceptions: &[PrivateException],
) -> Result<(), SocketAddr> {
    for a in addrs {
        if !classify(a.ip()).is_public() && !exceptions.iter().any(|e| e.allows(host, *a)) {
            return Err(*a);
        }
    }
    Ok(())
}

async fn handle(mut client: UnixStream, egress: &Egress) -> Result<(), ProxyError> {
    let (head, rest) = tokio::time::timeout(HEAD_TIMEOUT, read_head(&mut client))
        .await
        .map_err(|_| ProxyError::BadRequest("no request head within 30 s".into()))??;
    let target = match parse_head(&head) {
        Ok(t) => t,
        Err(e) => {
            answer(&mut client, "400 Bad Request", &format!("runcell: {e}\n")).await?;
            return Err(e);
        }
    };
    let host = target.host.trim_end_matches('.').to_ascii_lowercase();
    let policy = egress.policy();
    if !policy.allows(&host, target.port) {
        egress.refuse(&host, Refusal::Policy);
        let body = if policy.has_egress() {
            format!(
                "runcell: {host:?} (port {}) is not on this sandbox's allowlist\n",
                target.port
            )
        } else {
            "runcell: this sandbox's network policy is \"none\"\n".to_string()
        };
        tracing::info!(sandbox = %egress.sandbox, host = %host, port = target.port, mode = %policy.mode, "egress refused: not allowed by the policy");
        return answer(&mut client, "403 Forbidden", &body).await;
    }
    let lookup = tokio::time::timeout(
        UPSTREAM_TIMEOUT,
        tokio::net::lookup_host((host.as_str(), target.port)),
    )
    .await;
    let addrs: Vec<SocketAddr> = match lookup {
        Ok(Ok(a)) => a.collect(),
        Ok(Err(e)) => {
            egress.config.totals.failed.fetch_add(1, Ordering::Relaxed);
            return answer(
                &mut client,
                "502 Bad Gateway",
                &format!("runcell: could not resolve {host:?}: {e}\n"),
            )
            .await;
        }
        Err(_) => {
            egress.config.totals.failed.fetch_add(1, Ordering::Relaxed);
            return answer(
                &mut client,
                "504 Gateway Timeout",
                &format!("runcell: resolving {host:?} timed out\n"),
            )
            .await;
        }
    };
    if let Err(bad) = check_addresses(&host, &addrs, &egress.config.allow_private) {
        egress.refuse(&host, Refusal::Private);
        tracing::info!(sandbox = %egress.sandbox, host = %host, addr = %bad, class = %classify(bad.ip()), "egress refused: non-public address");
        return answer(
            &mut client,
            "403 Forbidden",
            &format!("runcell: {host:?} resolves to a private/loopback address, which sandboxes may not reach\n"),
        )
        .await;
    }
    let mut upstream = None;
    let mut last_err = None;
    for a in &addrs {
        match tokio::time::timeout(UPSTREAM_TIMEOUT, TcpStream::connect(a)).await {
            Ok(Ok(s)) => {
                upstream = Some(s);
                break;
            }
            Ok(Err(e)) => last_err = Some(e.to_string()),
            Err(_) => last_err = Some("timed out".into()),
        }
    }
    let Some(mut upstream) = upstream else {
        egress.config.totals.failed.fetch_add(1, Ordering::Relaxed);
        let why = last_err.unwrap_or_else(|| "no address".into());
        return answer(
            &mut client,
            "502 Bad Gateway",
            &format!("runcell: could not connect to {host:?}: {why}\n"),
        )
        .await;
    };
    let _ = upstream.set_nodelay(true);
    egress.allowed.fetch_add(1, Ordering::Relaxed);
    egress.config.totals.allowed.fetch_add(1, Ordering::Relaxed);
    tracing::debug!(sandbox = %egress.sandbox, host = %host, port = target.port, "egress allowed");
    let mut out = 0u64;
    if target.connect {
        client
            .write_all(b"HTTP/1.1 200 Connection established\r\n\r\n")
            .await
            .map_err(ProxyError::Client)?;
    } else {
        if upstream.write_all(&target.head).await.is_err() {
            return Ok(());
        }
        out += target.head.len() as u64;
    }
    if !rest.is_empty() {
        if upstream.write_all(&rest).await.is_err() {
            return Ok(());
        }
        out += rest.len() as u64;
    }
    let (o, i) = copy_counted(&mut client, &mut upstream).await;
    egress.count_bytes(out + o, i);
    Ok(())
}

/// Splices both directions until both are closed; returns (sandbox to
/// network, network to sandbox) byte counts, also when one side fails.
async fn copy_counted(client: &mut UnixStream, upstream: &mut TcpStream) -> (u64, u64) {
    let (cr, mut cw) = client.split();
    let (ur, mut uw) = upstream.split();
    // 64 KiB buffers: tokio's default 8 KiB costs a third of the throughput.
    let (mut cr, mut ur) = (
        tokio::io::BufReader::with_capacity(COPY_BUF, cr),
        tokio::io::BufReader::with_capacity(COPY_BUF, ur),
    );
    let up = async {
        let n = tokio::io::copy_buf(&mut cr, &mut uw).await.unwrap_or(0);
        let _ = uw.shutdown().await;
        n
    };
    let down = async {
        let n = tokio::io::copy_buf(&mut ur, &mut cw).await.unwrap_or(0);
        let _ = cw.shutdown().await;
        n
    };
    tokio::join!(up, down)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connect_heads() {
        let t = parse_head(b"CONNECT pypi.org:443 HTTP/1.1\r\nHost: pypi.org:443\r\n\r\n").unwrap();
        assert!(t.connect);
        assert_eq!((t.host.as_str(), t.port), ("pypi.org", 443));
        let t = parse_head(b"CONNECT [2001:db8::1]:8443 HTTP/1.1\r\n\r\n").unwrap();
        assert_eq!((t.host.as_str(), t.port), ("2001:db8::1", 8443));
        assert!(parse_head(b"CONNECT :443 HTTP/1.1\r\n\r\n").is_err());
    }

    #[test]
    fn http_heads_are_rewritten_to_origin_form() {
        let t = parse_head(
            b"GET http://example.com:8080/a?b=1 HTTP/1.1\r\nHost: example.com:8080\r\nProxy-Connection: keep-alive\r\nConnection: keep-alive\r\nAccept: */*\r\n\r\n",
        )
        .unwrap();
        assert!(!t.connect);
        assert_eq!((t.host.as_str(), t.port), ("example.com", 8080));
        let head = String::from_utf8(t.head).unwrap();
        assert_eq!(
            head,
            "GET /a?b=1 HTTP/1.1\r\nHost: example.com:8080\r\nAccept: */*\r\nConnection: close\r\n\r\n"
        );
        let t = parse_head(b"GET http://user:pw@Example.com HTTP/1.0\r\n\r\n").unwrap();
        assert_eq!((t.host.as_str(), t.port), ("Example.com", 80));
        assert!(String::from_utf8(t.head)
            .unwrap()
            .starts_with("GET / HTTP/1.0\r\nHost: Example.com\r\n"));
        assert!(parse_head(b"GET /relative HTTP/1.1\r\n\r\n").is_err());
        assert!(parse_head(b"GET https://x.com/ HTTP/1.1\r\n\r\n").is_err());
    }

    #[test]
    fn resolved_addresses_are_checked() {
        let a = |s: &str| s.parse::<SocketAddr>().unwrap();
        assert!(check_addresses("pypi.org", &[a("151.101.0.223:443")], &[]).is_ok());
        // One bad record among good ones refuses the whole name.
        assert_eq!(
            check_addresses("x", &[a("151.101.0.223:443"), a("127.0.0.1:443")], &[]),
            Err(a("127.0.0.1:443"))
        );
        assert!(check_addresses("m", &[a("169.254.169.254:80")], &[]).is_err());
        assert!(check_addresses("m", &[a("[::ffff:10.0.0.1]:80")], &[]).is_err());
        let ex: PrivateException = "127.0.0.1:8080".parse().unwrap();
        assert!(check_addresses(
            "localhost",
            &[a("127.0.0.1:8080")],
            std::slice::from_ref(&ex)
        )
        .is_ok());
        assert!(check_addresses("localhost", &[a("127.0.0.1:7070")], &[ex]).is_err());
    }

    #[tokio::test]
    async fn connections_beyond_the_cap_get_503_and_policy_refusals_never_resolve() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("egress.sock");
        let listener = UnixListener::bind(&path).unwrap();
        let policy = NetworkPolicy::new(
            crate::NetworkMode::Allowlist,
            vec!["pypi.org".parse().unwrap()],
            vec![],
        )
        .unwrap();
        let egress = Arc::new(Egress::new("t".into(), policy, EgressConfig::default()));
        let task = tokio::spawn(serve(listener, egress.clone()));
        // A host that is not on the list: 403, counted, nothing connected.
        let mut c = UnixStream::connect(&path).await.unwrap();
        c.write_all(b"CONNECT evil.example:443 HTTP/1.1\r\n\r\n")
            .await
            .unwrap();
        let mut reply = String::new();
        c.read_to_string(&mut reply).await.unwrap();
        assert!(reply.starts_with("HTTP/1.1 403"), "{reply}");
        assert!(
            reply.ends_with(
                "runcell: \"evil.example\" (port 443) is not on this sandbox's allowlist\n"
            ),
            "{reply}"
        );
        let r = egress.report();
        assert_eq!((r.connections_allowed, r.connections_refused), (0, 1));
        assert_eq!(r.refused_hosts, vec!["evil.example".to_string()]);
        // Idle connections fill the slots; the next one is turned away.
        let mut idle = Vec::new();
        for _ in 0..MAX_CONNECTIONS {
            idle.push(UnixStream::connect(&path).await.unwrap());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        let mut c = UnixStream::connect(&path).await.unwrap();
        let mut reply = String::new();
        c.read_to_string(&mut reply).await.unwrap();
        assert!(reply.starts_with("HTTP/1.1 503"), "{reply}");
        task.abort();
    }

    #[tokio::test]
    async fn localhost_resolves_and_is_refused() {
        // Resolution only (the host's resolver, no packet leaves loopback).
        let addrs: Vec<SocketAddr> = tokio::net::lookup_host(("localhost", 80))
            .await
            .unwrap()
            .collect();
        assert!(!addrs.is_empty());
        assert!(check_addresses("localhost", &addrs, &[]).is_err());
    }
}
