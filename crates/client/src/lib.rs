//! An async client for the runcell daemon's `/v1` API (the PandaStack v1
//! sandbox API plus runcell's additions). The CLI uses it for everything that
//! talks to a daemon.
//!
//! ```no_run
//! # async fn demo() -> Result<(), runcell_client::ClientError> {
//! let client = runcell_client::Client::from_env(None, None)?;
//! let sandbox = client.create_sandbox(&serde_json::json!({"template": "host"})).await?;
//! let ctx = client.create_context(&sandbox.id, "python").await?;
//! let cell = client.run_cell(&sandbox.id, &ctx.id, "6 * 7", None).await?;
//! assert_eq!(cell.results[0]["text/plain"], "42");
//! client.delete_sandbox(&sandbox.id).await?;
//! # Ok(()) }
//! ```

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use reqwest::{Method, StatusCode};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Where `runcell serve` listens by default.
pub const DEFAULT_URL: &str = "http://127.0.0.1:7070";
/// Where `runcell serve` writes its first API key by default.
pub const DEFAULT_KEY_FILE: &str = "/var/lib/runcell/api-key";

/// Errors talking to the daemon.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// No key was given and none could be read.
    #[error("No API key: pass --api-key, set RUNCELL_API_KEY, or make {0} readable (runcell serve writes it).")]
    NoKey(PathBuf),
    /// The daemon could not be reached.
    #[error("Could not reach the runcell daemon at {url}; is `runcell serve` running?")]
    Connect {
        /// The daemon's address.
        url: String,
        /// Why.
        #[source]
        source: reqwest::Error,
    },
    /// The daemon refused the request.
    #[error("{message} (HTTP {status})")]
    Api {
        /// HTTP status.
        status: u16,
        /// The daemon's `error` message.
        message: String,
        /// The whole response body.
        body: Value,
    },
    /// The daemon refused the key (HTTP 401).
    #[error("The daemon at {url} refused the API key from {key_source} (HTTP 401: {message}). Use a key of this daemon: `runcell key ls --data-dir DIR` lists its keys, `runcell key create --data-dir DIR` makes one; pass it with --api-key or RUNCELL_API_KEY, or unset both to use the key file `runcell serve` wrote (DATA_DIR/api-key).")]
    Unauthorized {
        /// The daemon's address.
        url: String,
        /// Where the key came from (never the key itself).
        key_source: String,
        /// The daemon's `error` message.
        message: String,
    },
    /// The answer was not what this client understands.
    #[error("The daemon's answer could not be read.")]
    Decode(#[source] reqwest::Error),
}

impl ClientError {
    /// The HTTP status, when the daemon answered with an error.
    pub fn status(&self) -> Option<u16> {
        match self {
            ClientError::Api { status, .. } => Some(*status),
            ClientError::Unauthorized { .. } => Some(401),
            _ => None,
        }
    }

    /// Whether the request certainly did nothing: the daemon could not be
    /// connected to, or answered it with an error status. (A connection
    /// that broke once the request was sent may have done anything.)
    pub fn did_nothing(&self) -> bool {
        match self {
            ClientError::Connect { source, .. } => source.is_connect(),
            ClientError::Api { .. } | ClientError::Unauthorized { .. } => true,
            _ => false,
        }
    }
}

/// A sandbox as the daemon describes it.
#[derive(Debug, Clone, Deserialize)]
pub struct SandboxInfo {
    /// Sandbox id.
    pub id: String,
    /// Every other field (template, status, metadata, limits, ...).
    #[serde(flatten)]
    pub fields: serde_json::Map<String, Value>,
}

impl SandboxInfo {
    /// `running`, `paused` or `hibernated` (`-` when the daemon did not say).
    pub fn status(&self) -> &str {
        self.fields
            .get("status")
            .and_then(Value::as_str)
            .unwrap_or("-")
    }

    /// The sandbox this one was forked from, if it is a fork.
    pub fn forked_from(&self) -> Option<&str> {
        self.fields.get("forked_from").and_then(Value::as_str)
    }

    /// The snapshot this sandbox was created from, if any.
    pub fn from_snapshot(&self) -> Option<&str> {
        self.fields.get("from_snapshot").and_then(Value::as_str)
    }

    /// The sandbox was woken from hibernation: its code contexts are gone.
    pub fn state_lost(&self) -> bool {
        self.fields.get("state_lost").and_then(Value::as_bool) == Some(true)
    }

    /// The sandbox's metadata value for `key`.
    pub fn metadata(&self, key: &str) -> Option<&str> {
        self.fields
            .get("metadata")
            .and_then(|m| m.get(key))
            .and_then(Value::as_str)
    }
}

/// What the daemon does with a sandbox once it has been idle for its TTL.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnIdle {
    /// Destroy it and its files.
    Delete,
    /// End its processes and keep its files; the next call wakes it.
    Hibernate,
}

impl OnIdle {
    /// The API's name for it.
    pub fn as_str(self) -> &'static str {
        match self {
            OnIdle::Delete => "delete",
            OnIdle::Hibernate => "hibernate",
        }
    }
}

impl std::str::FromStr for OnIdle {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "delete" => Ok(OnIdle::Delete),
            "hibernate" => Ok(OnIdle::Hibernate),
            other => Err(format!(
                "\"{other}\" is not an idle action; use delete or hibernate"
            )),
        }
    }
}

/// A volume to mount into a new sandbox.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeMount {
    /// The volume's name (from [`Client::create_volume`]).
    pub name: String,
    /// Mount it read-only (any number of sandboxes may); a read-write
    /// mount is one sandbox at a time.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub read_only: bool,
    /// Where it appears in the sandbox [default: `/mnt/<name>`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
}

impl std::str::FromStr for VolumeMount {
    type Err = String;
    /// `NAME`, `NAME:ro`, `NAME:/path`, `NAME:ro:/path` or `NAME:/path:ro`.
    fn from_str(s: &str) -> Result<Self, String> {
        let mut parts = s.split(':');
        let name = parts.next().unwrap_or_default();
        if name.is_empty() {
            return Err(format!("\"{s}\" does not start with a volume name"));
        }
        let mut mount = VolumeMount {
            name: name.to_string(),
            read_only: false,
            path: None,
        };
        for part in parts {
            match part {
                "ro" if !mount.read_only => mount.read_only = true,
                "rw" => {}
                p if p.starts_with('/') && mount.path.is_none() => mount.path = Some(p.into()),
                other => {
                    return Err(format!(
                    "\"{other}\" in \"{s}\" is neither ro nor an absolute path (NAME[:ro][:/PATH])"
                ))
                }
            }
        }
        Ok(mount)
    }
}

/// Options of a new sandbox, for [`Client::create`]; every field left out
/// takes the daemon's (or the template's) default.
#[derive(Debug, Clone, Default, Serialize)]
pub struct CreateOptions {
    /// Template name.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub template: Option<String>,
    /// Idle time-to-live in seconds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ttl_seconds: Option<u64>,
    /// Metadata (string keys and values; the list filter matches on them).
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub metadata: BTreeMap<String, String>,
    /// Environment variables of every command.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
    /// Exempt from the idle TTL.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub persistent: bool,
    /// Start from this snapshot's files (the template defaults to the
    /// snapshot's).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub from_snapshot: Option<String>,
    /// Volumes to mount.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub volumes: Vec<VolumeMount>,
    /// What happens once the sandbox has been idle for its TTL.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub on_idle: Option<OnIdle>,
    /// Any other field of the create request (`limits`, `network`,
    /// `isolation`, ...), passed as is.
    #[serde(flatten)]
    pub extra: serde_json::Map<String, Value>,
}

impl CreateOptions {
    /// The API's create request.
    pub fn to_json(&self) -> Value {
        serde_json::to_value(self).expect("create options serialize")
    }
}

/// A snapshot of a sandbox's files.
#[derive(Debug, Clone, Deserialize)]
pub struct Snapshot {
    /// Snapshot id.
    pub id: String,
    /// The sandbox it was taken of.
    pub sandbox_id: String,
    /// The workspace it belongs to.
    #[serde(default)]
    pub workspace: String,
    /// The template of that sandbox.
    #[serde(default)]
    pub template: String,
    /// RFC 3339.
    pub created_at: String,
    /// Bytes it takes on the daemon's disk.
    #[serde(default)]
    pub size_bytes: u64,
    /// Whether memory (running processes) was captured; always `false` with
    /// the jail, which snapshots files only.
    #[serde(default)]
    pub memory: bool,
}

#[derive(Debug, Deserialize)]
struct SnapshotList {
    snapshots: Vec<Snapshot>,
}

/// Options of a fork, for [`Client::fork`].
#[derive(Debug, Clone, Default, Serialize)]
pub struct ForkOptions {
    /// Metadata of the fork.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub metadata: Option<BTreeMap<String, String>>,
    /// The fork's idle time-to-live in seconds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ttl_seconds: Option<u64>,
}

/// The children of [`Client::fork_tree`].
#[derive(Debug, Clone, Deserialize)]
pub struct ForkTree {
    /// Names the tree; each child's metadata has it as `fork_tree_id`.
    pub tree_id: String,
    /// The forks.
    pub children: Vec<SandboxInfo>,
}

/// Options of [`Client::promote`].
#[derive(Debug, Clone, Default, Serialize)]
pub struct PromoteOptions {
    /// Delete the winner's siblings in its fork tree.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub cleanup_siblings: bool,
    /// The tree [default: the winner's `fork_tree_id`].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tree_id: Option<String>,
}

/// What [`Client::promote`] did.
#[derive(Debug, Clone, Deserialize)]
pub struct Promotion {
    /// The promoted sandbox, independent from now on.
    pub winner: String,
    /// The tree it was promoted out of.
    #[serde(default)]
    pub tree_id: Option<String>,
    /// Siblings deleted.
    #[serde(default)]
    pub deleted: Vec<String>,
    /// Siblings that could not be deleted, with why.
    #[serde(default)]
    pub failures: BTreeMap<String, String>,
}

/// A volume: storage that outlives the sandboxes it is mounted in.
#[derive(Debug, Clone, Deserialize)]
pub struct Volume {
    /// Its name.
    pub name: String,
    /// Its size limit in MiB.
    pub size_mb: u64,
    /// RFC 3339.
    #[serde(default)]
    pub created_at: String,
    /// Bytes used.
    #[serde(default)]
    pub used_bytes: u64,
    /// Sandboxes it is mounted in.
    #[serde(default)]
    pub attached_to: Vec<String>,
}

#[derive(Debug, Deserialize)]
struct VolumeList {
    items: Vec<Volume>,
}

/// A code context (REPL session).
#[derive(Debug, Clone, Deserialize)]
pub struct Session {
    /// Session id.
    pub id: String,
    /// Its sandbox.
    pub sandbox_id: String,
    /// `python`, `javascript` or `bash`.
    pub language: String,
    /// RFC 3339.
    pub created_at: String,
    /// Cells run so far.
    #[serde(default)]
    pub cells: u64,
    /// Times the interpreter was restarted.
    #[serde(default)]
    pub restarts: u64,
}

/// An exception raised by a cell.
#[derive(Debug, Clone, Deserialize)]
pub struct Exception {
    /// Class name.
    pub name: String,
    /// Message.
    pub value: String,
    /// Traceback text.
    pub traceback: String,
}

/// The result of a cell, including one that timed out.
#[derive(Debug, Clone, Deserialize)]
pub struct Cell {
    /// Standard output (capped, with a marker when cut).
    pub stdout: String,
    /// Standard error.
    pub stderr: String,
    /// Exit status (the daemon sends it as both `exit_code` and `exit`).
    pub exit_code: i32,
    /// MIME bundles.
    #[serde(default)]
    pub results: Vec<BTreeMap<String, String>>,
    /// Wall-clock duration.
    #[serde(default)]
    pub duration_ms: u64,
    /// Traceback text or what happened to the interpreter.
    #[serde(default)]
    pub error: Option<String>,
    /// The exception, structured.
    #[serde(default)]
    pub exception: Option<Exception>,
    /// The cell hit its timeout.
    #[serde(default)]
    pub timed_out: bool,
    /// The interpreter was restarted: earlier state is gone.
    #[serde(default)]
    pub state_lost: bool,
    /// Plain sentences about what went wrong.
    #[serde(default)]
    pub messages: Vec<String>,
}

/// The result of an exec, including one that timed out.
#[derive(Debug, Clone, Deserialize)]
pub struct ExecOutput {
    /// Standard output (capped, with a marker when cut).
    pub stdout: String,
    /// Standard error.
    pub stderr: String,
    /// Exit status (124 after a timeout).
    pub exit_code: i32,
    /// Wall-clock duration.
    #[serde(default)]
    pub duration_ms: u64,
    /// The exec hit its timeout.
    #[serde(default)]
    pub timed_out: bool,
    /// Plain sentences about every limit hit.
    #[serde(default)]
    pub messages: Vec<String>,
}

/// A directory entry.
#[derive(Debug, Clone, Deserialize)]
pub struct FileEntry {
    /// Base name.
    pub name: String,
    /// Is a directory.
    pub is_dir: bool,
    /// Size in bytes.
    pub size: u64,
    /// Permission string, e.g. `-rw-r--r--`.
    #[serde(default)]
    pub permissions: String,
    /// Modification time, unix seconds.
    #[serde(default)]
    pub mtime: i64,
    /// `f` (file), `d` (directory) or `l` (symbolic link).
    #[serde(default)]
    pub mode: String,
}

#[derive(Debug, Deserialize)]
struct DirListing {
    entries: Vec<FileEntry>,
}

/// Options for an exec.
#[derive(Debug, Clone, Default)]
pub struct ExecOptions {
    /// Timeout; the sandbox's default when absent.
    pub timeout: Option<Duration>,
    /// Extra environment variables.
    pub env: BTreeMap<String, String>,
    /// Working directory.
    pub cwd: Option<String>,
    /// Keep the processes the command leaves behind (`cmd &`, daemons)
    /// running after it returns; by default they are killed with it.
    pub background: bool,
    /// Delete the sandbox once the exec has run, however it ended (runcell
    /// extension): a one-shot run then needs no `DELETE`.
    pub delete_after: bool,
}

impl ExecOptions {
    /// `body`, an exec request, with these options' environment, timeout
    /// and working directory (`background` is the caller's to add: only a
    /// buffered exec takes it).
    fn onto(&self, mut body: Value) -> Value {
        body["env"] = serde_json::json!(self.env);
        if let Some(t) = self.timeout {
            body["timeout_seconds"] = t.as_secs_f64().into();
        }
        if let Some(c) = &self.cwd {
            body["cwd"] = c.clone().into();
        }
        if self.delete_after {
            body["delete_after"] = true.into();
        }
        body
    }
}

/// The stream a streamed exec's `stdout` or `stderr` event is from.
fn stream_of(event: &str) -> Stream {
    if event == "stdout" {
        Stream::Stdout
    } else {
        Stream::Stderr
    }
}

/// The exit code in a streamed exec's `exit` event (1 if it names none
/// that fits).
fn exit_code_of(v: &Value) -> i32 {
    v.get("exit_code")
        .and_then(Value::as_i64)
        .and_then(|c| i32::try_from(c).ok())
        .unwrap_or(1)
}

/// How an exec streamed with [`Client::exec_stream`] ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecEnd {
    /// Exit status (124 after a timeout).
    pub exit_code: i32,
    /// The exec hit its timeout.
    pub timed_out: bool,
    /// What the daemon said went wrong (a timeout, a lost sandbox), if anything.
    pub error: Option<String>,
}

/// How a program run with [`Client::run_code_stream`] ended.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CodeEnd {
    /// Exit status (124 after a timeout, 128 + N after signal N).
    pub exit_code: i32,
    /// The program hit its timeout.
    pub timed_out: bool,
    /// The sandbox ran out of memory during the run.
    pub oom_killed: bool,
    /// The sandbox reached its process limit during the run.
    pub pids_limit: bool,
    /// Plain sentences about every limit hit.
    pub messages: Vec<String>,
    /// What the daemon said went wrong (a lost sandbox), if the run did
    /// not finish.
    pub error: Option<String>,
}

/// One chunk of a streamed exec's output.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    /// Standard output.
    Stdout,
    /// Standard error.
    Stderr,
}

/// A client for one daemon and key.
#[derive(Debug, Clone)]
pub struct Client {
    http: reqwest::Client,
    url: String,
    key: String,
    /// Where the key came from, for error messages (never the key).
    key_source: String,
}

fn seg(s: &str) -> String {
    // Ids are UUIDs and hex; anything else is escaped for the path.
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

impl Client {
    /// A client for the daemon at `url` with `key`.
    pub fn new(url: impl Into<String>, key: impl Into<String>) -> Self {
        Self {
            http: reqwest::Client::new(),
            url: url.into().trim_end_matches('/').to_string(),
            key: key.into(),
            key_source: "the caller".into(),
        }
    }

    /// Says where the key came from (e.g. `RUNCELL_API_KEY`), for the
    /// message of a refused key. Never pass the key itself.
    pub fn with_key_source(mut self, source: impl Into<String>) -> Self {
        self.key_source = source.into();
        self
    }

    /// Where the key came from.
    pub fn key_source(&self) -> &str {
        &self.key_source
    }

    /// The daemon address and key from the arguments, else `RUNCELL_URL` and
    /// `RUNCELL_API_KEY`, else the defaults (`http://127.0.0.1:7070` and the
    /// key file `runcell serve` writes, `$RUNCELL_DATA_DIR/api-key`).
    pub fn from_env(url: Option<String>, key: Option<String>) -> Result<Self, ClientError> {
        let url = url
            .or_else(|| std::env::var("RUNCELL_URL").ok())
            .unwrap_or_else(|| DEFAULT_URL.into());
        let (key, source) = match (key, std::env::var("RUNCELL_API_KEY").ok()) {
            (Some(k), _) => (k, "--api-key".to_string()),
            (None, Some(k)) => (k, "RUNCELL_API_KEY".to_string()),
            (None, None) => {
                let file = std::env::var_os("RUNCELL_DATA_DIR")
                    .map(|d| PathBuf::from(d).join("api-key"))
                    .unwrap_or_else(|| PathBuf::from(DEFAULT_KEY_FILE));
                let key = std::fs::read_to_string(&file)
                    .map(|k| k.trim().to_string())
                    .map_err(|_| ClientError::NoKey(file.clone()))?;
                (key, format!("the key file {}", file.display()))
            }
        };
        Ok(Self::new(url, key).with_key_source(source))
    }

    /// The daemon's address.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Sends a request; returns the status and the raw body.
    async fn send_raw(
        &self,
        method: Method,
        path: &str,
        body: Option<reqwest::Body>,
        json: Option<&Value>,
    ) -> Result<(StatusCode, Vec<u8>), ClientError> {
        let mut rb = self
            .http
            .request(method, format!("{}{path}", self.url))
            .bearer_auth(&self.key);
        if let Some(b) = json {
            rb = rb.json(b);
        }
        if let Some(b) = body {
            rb = rb.body(b);
        }
        let resp = rb.send().await.map_err(|source| ClientError::Connect {
            url: self.url.clone(),
            source,
        })?;
        let status = resp.status();
        let bytes = resp.bytes().await.map_err(ClientError::Decode)?;
        Ok((status, bytes.to_vec()))
    }

    async fn send(
        &self,
        method: Method,
        path: &str,
        body: Option<&Value>,
    ) -> Result<(StatusCode, Value), ClientError> {
        let (status, bytes) = self.send_raw(method, path, None, body).await?;
        let value = if bytes.is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(&bytes)
                .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned()))
        };
        Ok((status, value))
    }

    async fn call<T: DeserializeOwned>(
        &self,
        method: Method,
        path: &str,
        body: Option<&Value>,
    ) -> Result<T, ClientError> {
        let (status, value) = self.send(method, path, body).await?;
        if !status.is_success() {
            return Err(self.api_error(status, value));
        }
        decode(value)
    }

    /// Creates a sandbox from a create request (`template`, `ttl_seconds`,
    /// `metadata`, `limits`, `env`, ...).
    pub async fn create_sandbox(&self, request: &Value) -> Result<SandboxInfo, ClientError> {
        self.call(Method::POST, "/v1/sandboxes", Some(request))
            .await
    }

    /// Creates a sandbox from typed options (see [`CreateOptions`]).
    pub async fn create(&self, options: &CreateOptions) -> Result<SandboxInfo, ClientError> {
        self.create_sandbox(&options.to_json()).await
    }

    /// A POST whose success has no body (204).
    async fn post_empty(&self, path: &str, body: Option<&Value>) -> Result<(), ClientError> {
        let (status, value) = self.send(Method::POST, path, body).await?;
        if status.is_success() {
            Ok(())
        } else {
            Err(self.api_error(status, value))
        }
    }

    /// Freezes a running sandbox: its processes stop where they are and keep
    /// their memory. Calls on it answer 409 until [`Client::resume`].
    pub async fn pause(&self, id: &str) -> Result<(), ClientError> {
        self.post_empty(&format!("/v1/sandboxes/{}/pause", seg(id)), None)
            .await
    }

    /// Thaws a paused sandbox.
    pub async fn resume(&self, id: &str) -> Result<(), ClientError> {
        self.post_empty(&format!("/v1/sandboxes/{}/resume", seg(id)), None)
            .await
    }

    /// Ends a sandbox's processes and frees its memory, keeping its files;
    /// the next exec, file or cell call (or [`Client::wake`]) starts it
    /// again. Hibernating a hibernated sandbox is not an error.
    pub async fn hibernate(&self, id: &str) -> Result<(), ClientError> {
        self.post_empty(&format!("/v1/sandboxes/{}/hibernate", seg(id)), None)
            .await
    }

    /// Starts a hibernated sandbox again (a running one is left alone). Its
    /// code contexts are gone: the sandbox shows `state_lost`.
    pub async fn wake(&self, id: &str) -> Result<(), ClientError> {
        self.post_empty(&format!("/v1/sandboxes/{}/wake", seg(id)), None)
            .await
    }

    /// Snapshots a sandbox's files (not its memory).
    pub async fn create_snapshot(&self, sandbox: &str) -> Result<Snapshot, ClientError> {
        self.call(
            Method::POST,
            &format!("/v1/sandboxes/{}/snapshots", seg(sandbox)),
            Some(&serde_json::json!({})),
        )
        .await
    }

    /// The workspace's snapshots, newest first; only those of `sandbox`
    /// when given.
    pub async fn list_snapshots(
        &self,
        sandbox: Option<&str>,
    ) -> Result<Vec<Snapshot>, ClientError> {
        let path = match sandbox {
            Some(id) => format!("/v1/snapshots?sandbox_id={}", seg(id)),
            None => "/v1/snapshots".to_string(),
        };
        let list: SnapshotList = self.call(Method::GET, &path, None).await?;
        Ok(list.snapshots)
    }

    /// One snapshot.
    pub async fn get_snapshot(&self, id: &str) -> Result<Snapshot, ClientError> {
        self.call(Method::GET, &format!("/v1/snapshots/{}", seg(id)), None)
            .await
    }

    /// Deletes a snapshot.
    pub async fn delete_snapshot(&self, id: &str) -> Result<(), ClientError> {
        let (status, value) = self
            .send(Method::DELETE, &format!("/v1/snapshots/{}", seg(id)), None)
            .await?;
        if status.is_success() {
            Ok(())
        } else {
            Err(self.api_error(status, value))
        }
    }

    /// A new sandbox with a copy of `id`'s files (not its processes); its
    /// `forked_from` names the parent.
    pub async fn fork(&self, id: &str, options: &ForkOptions) -> Result<SandboxInfo, ClientError> {
        let body = serde_json::to_value(options).expect("fork options serialize");
        self.call(
            Method::POST,
            &format!("/v1/sandboxes/{}/fork", seg(id)),
            Some(&body),
        )
        .await
    }

    /// `count` (1 to 16) forks of `id` as one tree, to try alternatives and
    /// keep the best with [`Client::promote`].
    pub async fn fork_tree(
        &self,
        id: &str,
        count: u32,
        metadata: Option<&BTreeMap<String, String>>,
    ) -> Result<ForkTree, ClientError> {
        let mut body = serde_json::json!({ "count": count });
        if let Some(m) = metadata {
            body["metadata"] = serde_json::to_value(m).expect("metadata serializes");
        }
        self.call(
            Method::POST,
            &format!("/v1/sandboxes/{}/fork-tree", seg(id)),
            Some(&body),
        )
        .await
    }

    /// Makes a fork the winner of its tree: it becomes independent and, with
    /// `cleanup_siblings`, the other children are deleted.
    pub async fn promote(
        &self,
        id: &str,
        options: &PromoteOptions,
    ) -> Result<Promotion, ClientError> {
        let body = serde_json::to_value(options).expect("promote options serialize");
        self.call(
            Method::POST,
            &format!("/v1/sandboxes/{}/promote", seg(id)),
            Some(&body),
        )
        .await
    }

    /// Creates a volume of `size_mb` MiB.
    pub async fn create_volume(&self, name: &str, size_mb: u64) -> Result<Volume, ClientError> {
        let body = serde_json::json!({ "name": name, "size_mb": size_mb });
        self.call(Method::POST, "/v1/volumes", Some(&body)).await
    }

    /// The workspace's volumes.
    pub async fn list_volumes(&self) -> Result<Vec<Volume>, ClientError> {
        let list: VolumeList = self.call(Method::GET, "/v1/volumes", None).await?;
        Ok(list.items)
    }

    /// One volume.
    pub async fn get_volume(&self, name: &str) -> Result<Volume, ClientError> {
        self.call(Method::GET, &format!("/v1/volumes/{}", seg(name)), None)
            .await
    }

    /// Deletes a volume and its data (409 while a sandbox has it mounted).
    pub async fn delete_volume(&self, name: &str) -> Result<(), ClientError> {
        let (status, value) = self
            .send(Method::DELETE, &format!("/v1/volumes/{}", seg(name)), None)
            .await?;
        if status.is_success() {
            Ok(())
        } else {
            Err(self.api_error(status, value))
        }
    }

    /// Sandboxes of the key's workspace whose metadata has every `key=value`
    /// of `metadata`.
    pub async fn list_sandboxes(
        &self,
        metadata: &BTreeMap<String, String>,
    ) -> Result<Vec<SandboxInfo>, ClientError> {
        let query: Vec<String> = metadata
            .iter()
            .map(|(k, v)| format!("metadata.{}={}", seg(k), seg(v)))
            .collect();
        let path = if query.is_empty() {
            "/v1/sandboxes".to_string()
        } else {
            format!("/v1/sandboxes?{}", query.join("&"))
        };
        self.call(Method::GET, &path, None).await
    }

    /// One sandbox.
    pub async fn get_sandbox(&self, id: &str) -> Result<SandboxInfo, ClientError> {
        self.call(Method::GET, &format!("/v1/sandboxes/{}", seg(id)), None)
            .await
    }

    /// Sets a sandbox's idle TTL and/or persistence; returns the lifecycle.
    pub async fn set_lifecycle(
        &self,
        id: &str,
        ttl_seconds: Option<u64>,
        persistent: Option<bool>,
    ) -> Result<Value, ClientError> {
        let mut body = serde_json::Map::new();
        if let Some(t) = ttl_seconds {
            body.insert("ttl_seconds".into(), t.into());
        }
        if let Some(p) = persistent {
            body.insert("persistent".into(), p.into());
        }
        self.call(
            Method::PATCH,
            &format!("/v1/sandboxes/{}/lifecycle", seg(id)),
            Some(&Value::Object(body)),
        )
        .await
    }

    /// Runs a shell command line. A timeout is an `Ok` with `timed_out` set.
    pub async fn exec(
        &self,
        id: &str,
        cmd: &str,
        opts: &ExecOptions,
    ) -> Result<ExecOutput, ClientError> {
        let mut body = opts.onto(serde_json::json!({ "cmd": cmd }));
        if opts.background {
            body["background"] = true.into();
        }
        let path = format!("/v1/sandboxes/{}/exec", seg(id));
        let (status, value) = self.send(Method::POST, &path, Some(&body)).await?;
        if status.is_success() || value.get("timed_out") == Some(&Value::Bool(true)) {
            return decode(value);
        }
        Err(self.api_error(status, value))
    }

    /// Runs a shell command line, calling `on_output` with each chunk of
    /// its output as it is written (`POST .../exec/stream`). A timeout is an
    /// `Ok` with `timed_out` set and exit code 124.
    pub async fn exec_stream(
        &self,
        id: &str,
        cmd: &str,
        opts: &ExecOptions,
        mut on_output: impl FnMut(Stream, &str),
    ) -> Result<ExecEnd, ClientError> {
        let body = opts.onto(serde_json::json!({ "cmd": cmd }));
        let mut resp = self.exec_stream_open(id, &body).await?;
        let mut end: Option<ExecEnd> = None;
        read_sse(&mut resp, |event, data| {
            let v: Value = serde_json::from_str(data).unwrap_or(Value::Null);
            match event {
                "stdout" | "stderr" => {
                    if let Some(chunk) = v.get("chunk").and_then(Value::as_str) {
                        on_output(stream_of(event), chunk);
                    }
                }
                "exit" => {
                    end = Some(ExecEnd {
                        exit_code: exit_code_of(&v),
                        timed_out: false,
                        error: None,
                    });
                }
                "error" => {
                    let msg = v
                        .get("error")
                        .and_then(Value::as_str)
                        .unwrap_or("the exec failed")
                        .to_string();
                    let timed_out = msg.contains("timeout");
                    end = Some(ExecEnd {
                        exit_code: if timed_out { 124 } else { 1 },
                        timed_out,
                        error: Some(msg),
                    });
                }
                _ => {}
            }
        })
        .await?;
        Ok(end.unwrap_or(ExecEnd {
            exit_code: 1,
            timed_out: false,
            error: Some("the daemon ended the stream before the command finished".into()),
        }))
    }

    /// Runs source code in `language` (`python`, `javascript`, `bash`) with
    /// `args`, as `runcell run` does, calling `on_output` with each chunk
    /// of its output, bytes exactly as written (`POST .../exec/stream` with
    /// `language` and `exact_output`). A timeout is an `Ok` with
    /// `timed_out` set; the notes on limits hit are in
    /// [`CodeEnd::messages`], never in the output.
    pub async fn run_code_stream(
        &self,
        id: &str,
        language: &str,
        code: &str,
        args: &[String],
        opts: &ExecOptions,
        on_output: impl FnMut(Stream, &[u8]),
    ) -> Result<CodeEnd, ClientError> {
        let body = code_exec(language, code, args, opts);
        let mut resp = self.exec_stream_open(id, &body).await?;
        code_events(&mut resp, |_| {}, on_output).await
    }

    /// Makes a sandbox (`sandbox`: a create request, as
    /// [`Client::create_sandbox`] takes it), runs source code in it as
    /// [`Client::run_code_stream`] does, and has the daemon delete it once
    /// the program has run, however it ended: one request (`POST /v1/run`,
    /// runcell extension) where a create, an exec and a delete take three.
    /// `on_sandbox` gets the sandbox's id as soon as it is made. A request
    /// refused before the program runs (a 4xx) makes nothing.
    #[allow(clippy::too_many_arguments)]
    pub async fn run_code_once(
        &self,
        sandbox: &Value,
        language: &str,
        code: &str,
        args: &[String],
        opts: &ExecOptions,
        on_sandbox: impl FnMut(&str),
        on_output: impl FnMut(Stream, &[u8]),
    ) -> Result<CodeEnd, ClientError> {
        let exec = code_exec(language, code, args, opts);
        let body = serde_json::json!({"sandbox": sandbox, "exec": exec});
        let mut resp = self.stream_open("/v1/run", &body).await?;
        code_events(&mut resp, on_sandbox, on_output).await
    }

    /// Describes a path in a sandbox; `None` when it does not exist.
    pub async fn stat(&self, id: &str, path: &str) -> Result<Option<FileEntry>, ClientError> {
        let p = format!("/v1/sandboxes/{}/fs/stat?path={}", seg(id), seg(path));
        let (status, value) = self.send(Method::GET, &p, None).await?;
        if status == StatusCode::NOT_FOUND
            && value.get("error").and_then(Value::as_str) == Some("file does not exist")
        {
            return Ok(None);
        }
        if !status.is_success() {
            return Err(self.api_error(status, value));
        }
        decode(value).map(Some)
    }

    /// The daemon's templates (installed ones and aliases), as it describes them.
    pub async fn list_templates(&self) -> Result<Vec<Value>, ClientError> {
        self.call(Method::GET, "/v1/templates", None).await
    }

    /// Reads a file from a sandbox.
    pub async fn read_file(&self, id: &str, path: &str) -> Result<Vec<u8>, ClientError> {
        let p = format!("/v1/sandboxes/{}/fs?path={}", seg(id), seg(path));
        self.raw_ok(self.send_raw(Method::GET, &p, None, None).await?)
    }

    /// Writes a file into a sandbox (parents are created).
    pub async fn write_file(&self, id: &str, path: &str, data: Vec<u8>) -> Result<(), ClientError> {
        let p = format!("/v1/sandboxes/{}/fs?path={}", seg(id), seg(path));
        self.raw_ok(
            self.send_raw(Method::PUT, &p, Some(data.into()), None)
                .await?,
        )
        .map(drop)
    }

    /// Lists a directory in a sandbox.
    pub async fn list_dir(&self, id: &str, path: &str) -> Result<Vec<FileEntry>, ClientError> {
        let listing: DirListing = self
            .call(
                Method::GET,
                &format!("/v1/sandboxes/{}/fs/dir?path={}", seg(id), seg(path)),
                None,
            )
            .await?;
        Ok(listing.entries)
    }

    /// The output of a sandbox's execs so far.
    pub async fn logs(&self, id: &str) -> Result<String, ClientError> {
        let p = format!("/v1/sandboxes/{}/logs", seg(id));
        let bytes = self.raw_ok(self.send_raw(Method::GET, &p, None, None).await?)?;
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    /// Follows a sandbox's log, calling `on_line` for each line (the ones
    /// so far, then new ones) until the sandbox goes away.
    pub async fn follow_logs(
        &self,
        id: &str,
        mut on_line: impl FnMut(&str),
    ) -> Result<(), ClientError> {
        let url = format!("{}/v1/sandboxes/{}/logs?follow=1", self.url, seg(id));
        let mut resp = self
            .http
            .get(url)
            .bearer_auth(&self.key)
            .header("accept", "text/event-stream")
            .send()
            .await
            .map_err(|source| ClientError::Connect {
                url: self.url.clone(),
                source,
            })?;
        let status = resp.status();
        if !status.is_success() {
            let body = resp.json().await.unwrap_or(Value::Null);
            return Err(self.api_error(status, body));
        }
        read_sse(&mut resp, |event, data| {
            if event != "line" {
                return;
            }
            if let Ok(v) = serde_json::from_str::<Value>(data) {
                if let Some(text) = v.get("line").and_then(Value::as_str) {
                    on_line(text);
                }
            }
        })
        .await?;
        Ok(())
    }

    /// Deletes a sandbox and everything in it.
    pub async fn delete_sandbox(&self, id: &str) -> Result<(), ClientError> {
        let (status, value) = self
            .send(Method::DELETE, &format!("/v1/sandboxes/{}", seg(id)), None)
            .await?;
        if status.is_success() {
            Ok(())
        } else {
            Err(self.api_error(status, value))
        }
    }

    /// Starts a code context (`python`, `javascript` or `bash`).
    pub async fn create_context(
        &self,
        sandbox: &str,
        language: &str,
    ) -> Result<Session, ClientError> {
        let body = serde_json::json!({ "language": language });
        self.call(
            Method::POST,
            &format!("/v1/sandboxes/{}/repl/sessions", seg(sandbox)),
            Some(&body),
        )
        .await
    }

    /// The sandbox's contexts.
    pub async fn list_contexts(&self, sandbox: &str) -> Result<Vec<Session>, ClientError> {
        self.call(
            Method::GET,
            &format!("/v1/sandboxes/{}/repl/sessions", seg(sandbox)),
            None,
        )
        .await
    }

    /// Runs a cell. A cell that times out is an `Ok` with `timed_out` set
    /// (the daemon answers 500 for the PandaStack clients' sake).
    pub async fn run_cell(
        &self,
        sandbox: &str,
        context: &str,
        code: &str,
        timeout: Option<Duration>,
    ) -> Result<Cell, ClientError> {
        let mut body = serde_json::json!({ "code": code });
        if let Some(t) = timeout {
            body["timeout_ms"] = u64::try_from(t.as_millis()).unwrap_or(u64::MAX).into();
        }
        let path = format!(
            "/v1/sandboxes/{}/repl/sessions/{}/run",
            seg(sandbox),
            seg(context)
        );
        let (status, value) = self.send(Method::POST, &path, Some(&body)).await?;
        if status.is_success() || value.get("timed_out") == Some(&Value::Bool(true)) {
            return decode(value);
        }
        Err(self.api_error(status, value))
    }

    /// Replaces a context's interpreter with a fresh one.
    pub async fn restart_context(
        &self,
        sandbox: &str,
        context: &str,
    ) -> Result<Session, ClientError> {
        self.call(
            Method::POST,
            &format!(
                "/v1/sandboxes/{}/repl/sessions/{}/restart",
                seg(sandbox),
                seg(context)
            ),
            None,
        )
        .await
    }

    /// Stops a context.
    pub async fn delete_context(&self, sandbox: &str, context: &str) -> Result<(), ClientError> {
        let path = format!(
            "/v1/sandboxes/{}/repl/sessions/{}",
            seg(sandbox),
            seg(context)
        );
        let (status, value) = self.send(Method::DELETE, &path, None).await?;
        if status.is_success() {
            Ok(())
        } else {
            Err(self.api_error(status, value))
        }
    }
}

impl Client {
    /// The body of a successful raw answer, or the daemon's error.
    fn raw_ok(&self, (status, bytes): (StatusCode, Vec<u8>)) -> Result<Vec<u8>, ClientError> {
        if status.is_success() {
            Ok(bytes)
        } else {
            Err(self.api_error(
                status,
                serde_json::from_slice(&bytes).unwrap_or(Value::Null),
            ))
        }
    }

    /// Starts `POST /v1/sandboxes/{id}/exec/stream` with `body`: the
    /// response whose SSE events the caller reads, or the API's error.
    async fn exec_stream_open(
        &self,
        id: &str,
        body: &Value,
    ) -> Result<reqwest::Response, ClientError> {
        self.stream_open(&format!("/v1/sandboxes/{}/exec/stream", seg(id)), body)
            .await
    }

    /// Opens the SSE stream a `POST` of `body` to `path` answers.
    async fn stream_open(
        &self,
        path: &str,
        body: &Value,
    ) -> Result<reqwest::Response, ClientError> {
        let url = format!("{}{path}", self.url);
        let resp = self
            .http
            .post(url)
            .bearer_auth(&self.key)
            .header("accept", "text/event-stream")
            .json(body)
            .send()
            .await
            .map_err(|source| ClientError::Connect {
                url: self.url.clone(),
                source,
            })?;
        let status = resp.status();
        if !status.is_success() {
            let body = resp.json().await.unwrap_or(Value::Null);
            return Err(self.api_error(status, body));
        }
        Ok(resp)
    }

    /// The daemon's error; a refused key says where the key came from.
    fn api_error(&self, status: StatusCode, body: Value) -> ClientError {
        match api_error(status, body) {
            ClientError::Api {
                status: 401,
                message,
                ..
            } => ClientError::Unauthorized {
                url: self.url.clone(),
                key_source: self.key_source.clone(),
                message,
            },
            e => e,
        }
    }
}

/// The exec body that runs source code in `language` with `args`, its
/// output exact: what `exec/stream` and `POST /v1/run`'s `exec` take.
fn code_exec(language: &str, code: &str, args: &[String], opts: &ExecOptions) -> Value {
    opts.onto(serde_json::json!({
        "cmd": code,
        "language": language,
        "args": args,
        "exact_output": true,
    }))
}

/// Reads a code run's SSE stream to its end: `on_sandbox` gets the id of a
/// `sandbox` event (`POST /v1/run`), `on_output` each chunk of output.
async fn code_events(
    resp: &mut reqwest::Response,
    mut on_sandbox: impl FnMut(&str),
    mut on_output: impl FnMut(Stream, &[u8]),
) -> Result<CodeEnd, ClientError> {
    use base64::Engine as _;
    let mut end: Option<CodeEnd> = None;
    read_sse(resp, |event, data| {
        let v: Value = serde_json::from_str(data).unwrap_or(Value::Null);
        let flag = |k: &str| v.get(k).and_then(Value::as_bool).unwrap_or(false);
        match event {
            "sandbox" => {
                if let Some(id) = v.get("id").and_then(Value::as_str) {
                    on_sandbox(id);
                }
            }
            "stdout" | "stderr" => {
                let bytes = v
                    .get("data")
                    .and_then(Value::as_str)
                    .and_then(|d| base64::engine::general_purpose::STANDARD.decode(d).ok());
                if let Some(bytes) = bytes {
                    on_output(stream_of(event), &bytes);
                }
            }
            "exit" => {
                end = Some(CodeEnd {
                    exit_code: exit_code_of(&v),
                    timed_out: flag("timed_out"),
                    oom_killed: flag("oom_killed"),
                    pids_limit: flag("pids_limit"),
                    messages: v
                        .get("messages")
                        .and_then(Value::as_array)
                        .map(|m| {
                            m.iter()
                                .filter_map(Value::as_str)
                                .map(str::to_string)
                                .collect()
                        })
                        .unwrap_or_default(),
                    error: None,
                });
            }
            "error" => {
                end = Some(CodeEnd {
                    exit_code: 1,
                    error: Some(
                        v.get("error")
                            .and_then(Value::as_str)
                            .unwrap_or("the exec failed")
                            .to_string(),
                    ),
                    ..CodeEnd::default()
                });
            }
            _ => {}
        }
    })
    .await?;
    Ok(end.unwrap_or(CodeEnd {
        exit_code: 1,
        error: Some("the daemon ended the stream before the program finished".into()),
        ..CodeEnd::default()
    }))
}

/// Reads a `text/event-stream` body, calling `on_event(name, data)` for each
/// event (`message` when it has no name).
async fn read_sse(
    resp: &mut reqwest::Response,
    mut on_event: impl FnMut(&str, &str),
) -> Result<(), ClientError> {
    let mut buf = Vec::new();
    let mut dispatch = |event: &[u8]| {
        let text = String::from_utf8_lossy(event);
        let (mut name, mut data) = ("message".to_string(), Vec::new());
        for line in text.lines() {
            if let Some(v) = line.strip_prefix("event:") {
                name = v.trim().to_string();
            } else if let Some(v) = line.strip_prefix("data:") {
                data.push(v.strip_prefix(' ').unwrap_or(v).to_string());
            }
        }
        if !data.is_empty() {
            on_event(&name, &data.join("\n"));
        }
    };
    while let Some(chunk) = resp.chunk().await.map_err(ClientError::Decode)? {
        buf.extend_from_slice(&chunk);
        // Events end with a blank line.
        while let Some(end) = buf.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = buf.drain(..end + 2).collect();
            dispatch(&event);
        }
    }
    if !buf.is_empty() {
        dispatch(&buf);
    }
    Ok(())
}

fn api_error(status: StatusCode, body: Value) -> ClientError {
    let message = body
        .get("error")
        .and_then(Value::as_str)
        .map(str::to_string)
        .unwrap_or_else(|| status.canonical_reason().unwrap_or("error").to_string());
    ClientError::Api {
        status: status.as_u16(),
        message,
        body,
    }
}

fn decode<T: DeserializeOwned>(value: Value) -> Result<T, ClientError> {
    serde_json::from_value(value.clone()).map_err(|e| ClientError::Api {
        status: 200,
        message: format!("unexpected answer from the daemon: {e}"),
        body: value,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_path_segments_reads_cells_and_words_errors() {
        assert_eq!(seg("a b/c"), "a%20b%2Fc");
        assert_eq!(seg("0123abcd-ef"), "0123abcd-ef");
        let c: Cell = serde_json::from_value(serde_json::json!({
            "stdout": "", "stderr": "", "exit": 3, "exit_code": 3, "results": [{"text/plain": "1"}]
        }))
        .unwrap();
        assert_eq!((c.exit_code, c.results[0]["text/plain"].as_str()), (3, "1"));
        let e = api_error(
            StatusCode::NOT_FOUND,
            serde_json::json!({"error": "session not found"}),
        );
        assert_eq!(e.to_string(), "session not found (HTTP 404)");
        assert_eq!(e.status(), Some(404));
    }

    #[test]
    fn create_options_map_to_the_api_and_volume_flags_parse() {
        let o = CreateOptions {
            from_snapshot: Some("snap-1".into()),
            volumes: vec!["data:ro:/data".parse().unwrap(), "cache".parse().unwrap()],
            on_idle: Some("hibernate".parse().unwrap()),
            ..CreateOptions::default()
        };
        assert_eq!(
            o.to_json(),
            serde_json::json!({
                "from_snapshot": "snap-1",
                "volumes": [{"name": "data", "read_only": true, "path": "/data"}, {"name": "cache"}],
                "on_idle": "hibernate"
            })
        );
        assert_eq!(CreateOptions::default().to_json(), serde_json::json!({}));
        let m: VolumeMount = "v:/x:ro".parse().unwrap();
        assert_eq!((m.read_only, m.path.as_deref()), (true, Some("/x")));
        assert!("v:x"
            .parse::<VolumeMount>()
            .unwrap_err()
            .contains("NAME[:ro][:/PATH]"));
        assert!(":ro".parse::<VolumeMount>().is_err());
        assert!("sleep"
            .parse::<OnIdle>()
            .unwrap_err()
            .contains("delete or hibernate"));
        let p = serde_json::to_value(PromoteOptions::default()).unwrap();
        assert_eq!(p, serde_json::json!({}));
    }
}
