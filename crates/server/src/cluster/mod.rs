//! Cluster mode (`runcell serve --cluster etcd://HOST:PORT,...`): several
//! daemons share one API. etcd holds what they share; each node keeps its
//! own registry for its own sandboxes as in single-node mode.
//!
//! etcd layout (all under `/runcell/`):
//! - `nodes/<name>`: [`NodeInfo`], attached to the node's lease (a node
//!   whose lease expires is gone, its key with it).
//! - `keys/<sha256 of the key>`: [`KeyRecord`], the API keys of every node's
//!   registry (published by their node), so a key works on every node.
//! - `sandbox/<id>`: [`Owner`], which node owns a sandbox and its workspace
//!   (to route a request for it).
//! - `ws/<hex workspace>/<id>`: [`SandboxRecord`], the sandbox's view as its
//!   owner last published it (to list a workspace with one range read).
//!
//! The node publishes its sandboxes after each create and delete it serves
//! and every second (what the reaper removed, status changes), and its keys
//! every second. [`forward`] is the HTTP side: routing, placement, listing;
//! [`routes`] the `/v1/cluster` routes (the node list, draining).
//!
//! What is the node's own and must outlive it, its drain flag, is kept in
//! its local registry (table `cluster_node`), not in etcd: a node restarted
//! while etcd is down still knows it drains, and etcd holds only what the
//! nodes share.

pub mod forward;
pub mod labels;
pub mod routes;

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use etcd_client::{Client, ConnectOptions, GetOptions, PutOptions, Txn, TxnOp};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::state::AppState;

/// How long a node's lease lives without a keep-alive: a node that dies is
/// reported lost at most this long after.
pub const LEASE_TTL_SECONDS: i64 = 5;
/// How often the node renews its lease, republishes itself, its keys and
/// its sandboxes, and re-reads the other nodes.
const ROUND: Duration = Duration::from_secs(1);
/// The node list is trusted for placement only if read this recently.
const NODES_FRESH: Duration = Duration::from_secs(4);
const PREFIX: &str = "/runcell/";
/// The node's own settings that outlive a restart, in its registry: one
/// row `draining` = `true`/`false` (absent: not draining).
const DRAIN_TABLE: &str =
    "CREATE TABLE IF NOT EXISTS cluster_node (key TEXT PRIMARY KEY, value TEXT NOT NULL);";

/// Settings of cluster mode.
#[derive(Debug, Clone)]
pub struct ClusterConfig {
    /// etcd endpoints, `host:port`.
    pub endpoints: Vec<String>,
    /// This node's name (unique in the cluster).
    pub node_name: String,
    /// The URL other nodes forward requests to (`http://host:port`).
    pub advertise: String,
    /// A node away (no lease) longer than this comes back to find its
    /// sandboxes reported lost: it removes them rather than re-attach.
    pub lost_after: Duration,
    /// This node's labels (`--node-label key=value`), for placement by a
    /// create's `node_selector` (checked by [`labels::parse_node_labels`]).
    pub labels: BTreeMap<String, String>,
}

/// Errors of cluster mode.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    /// `--cluster` is malformed.
    #[error("--cluster must be etcd://HOST:PORT[,HOST:PORT...], not {0:?}.")]
    Url(String),
    /// etcd refused or failed a request.
    #[error("etcd failed: {0}")]
    Etcd(#[source] etcd_client::Error),
    /// The node's registry could not read or record its drain flag.
    #[error("The node's registry failed to keep its drain flag: {0}")]
    Registry(#[source] rusqlite::Error),
    /// A record in etcd is not what this version writes.
    #[error("The etcd record {key} is unreadable.")]
    Record {
        /// Its key.
        key: String,
        /// Why.
        #[source]
        source: serde_json::Error,
    },
}

impl From<etcd_client::Error> for ClusterError {
    fn from(e: etcd_client::Error) -> Self {
        ClusterError::Etcd(e)
    }
}

/// Parses `etcd://h1:2379,h2:2379` into endpoints.
pub fn parse_url(url: &str) -> Result<Vec<String>, ClusterError> {
    let rest = url
        .strip_prefix("etcd://")
        .ok_or_else(|| ClusterError::Url(url.into()))?;
    let endpoints: Vec<String> = rest
        .split(',')
        .map(|e| e.trim().trim_end_matches('/').to_string())
        .filter(|e| !e.is_empty())
        .collect();
    if endpoints.is_empty() || endpoints.iter().any(|e| !e.contains(':')) {
        return Err(ClusterError::Url(url.into()));
    }
    Ok(endpoints)
}

/// A node as registered under its lease.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
pub struct NodeInfo {
    /// Its name.
    pub name: String,
    /// Where other nodes forward to.
    pub url: String,
    /// Most sandboxes it runs at once.
    pub capacity: usize,
    /// Slots free now (capacity minus live sandboxes and creates in flight).
    pub free: usize,
    /// Templates and aliases it can create from.
    pub templates: Vec<String>,
    /// Isolation backends it can run.
    pub backends: Vec<String>,
    /// Draining: it takes no creates.
    pub draining: bool,
    /// Its labels, matched by a create's `node_selector` (absent in the
    /// records of a version without labels: none).
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
}

/// An API key as published (its hash, never the key).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct KeyRecord {
    /// The key's workspace.
    pub workspace: String,
    /// Its first characters.
    pub prefix: String,
    /// Its label.
    pub name: String,
    /// Unix seconds.
    pub created_at: i64,
    /// Unix seconds, when revoked.
    pub revoked_at: Option<i64>,
    /// The node whose registry holds it.
    pub node: String,
}

/// Who owns a sandbox.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Owner {
    /// The owner node.
    pub node: String,
    /// The sandbox's workspace.
    pub workspace: String,
}

/// A sandbox as its owner published it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct SandboxRecord {
    /// The owner node.
    pub node: String,
    /// The sandbox's API view (`GET /v1/sandboxes/{id}`), metadata,
    /// template and status included.
    pub view: serde_json::Value,
}

/// Counts of etcd requests, by kind (for the benchmark: operations per create).
#[derive(Debug, Default)]
pub struct EtcdOps {
    /// Reads (range requests).
    pub reads: std::sync::atomic::AtomicU64,
    /// Writes (puts, deletes, transactions).
    pub writes: std::sync::atomic::AtomicU64,
}

impl EtcdOps {
    fn read(&self) {
        self.reads
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
    fn write(&self) {
        self.writes
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
}

/// This node's membership of the cluster.
pub struct Cluster {
    /// Settings.
    pub config: ClusterConfig,
    client: Client,
    /// The other nodes (and this one) as last read, and when.
    nodes: Mutex<(HashMap<String, NodeInfo>, Option<Instant>)>,
    /// What this node last published: sandbox id → (workspace, serialized
    /// record).
    published: tokio::sync::Mutex<HashMap<String, (String, String)>>,
    /// Keys last published: hash → record.
    keys: Mutex<HashMap<String, KeyRecord>>,
    /// Every node's keys as last read (hash → record), so keys keep
    /// working while etcd is unreachable.
    all_keys: Mutex<HashMap<String, KeyRecord>>,
    /// Stop taking creates.
    draining: std::sync::atomic::AtomicBool,
    /// etcd requests made while serving API requests (routing, keys,
    /// publishing a create or delete, listing).
    pub ops: EtcdOps,
    /// etcd requests made by the once-a-second round (lease, node record,
    /// keys, sandbox records, node list).
    pub background: EtcdOps,
    /// The HTTP client that forwards to other nodes.
    pub(crate) http: forward::HttpClient,
}

impl std::fmt::Debug for Cluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cluster")
            .field("config", &self.config)
            .field("draining", &self.is_draining())
            .finish_non_exhaustive()
    }
}

fn hex(s: &str) -> String {
    s.bytes().map(|b| format!("{b:02x}")).collect()
}

fn key_hash(key: &str) -> String {
    Sha256::digest(key.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn sandbox_key(id: &str) -> String {
    format!("{PREFIX}sandbox/{id}")
}

fn record_key(workspace: &str, id: &str) -> String {
    format!("{PREFIX}ws/{}/{id}", hex(workspace))
}

/// gRPC's UNAVAILABLE status code.
const GRPC_UNAVAILABLE: i32 = 14;
/// Tries of one request-path etcd request while members are unreachable.
const TRIES: u32 = 3;

/// Whether an etcd request failed because the member it went to could not
/// be reached (a stopped member of a cluster that still has a quorum).
fn unreachable(e: &etcd_client::Error) -> bool {
    match e {
        etcd_client::Error::TransportError(_) => true,
        etcd_client::Error::GRpcStatus(s) => i32::from(s.code()) == GRPC_UNAVAILABLE,
        _ => false,
    }
}

/// Runs an etcd request, again (up to [`TRIES`] in all) when the member it
/// went to was unreachable: the client balances over every endpoint, and
/// the next try goes to a member that answers. Without this, stopping one
/// member of three failed the requests that happened to go to it.
async fn retrying<T, F, Fut>(client: &Client, mut request: F) -> Result<T, etcd_client::Error>
where
    F: FnMut(Client) -> Fut,
    Fut: std::future::Future<Output = Result<T, etcd_client::Error>>,
{
    let mut tries = 1;
    loop {
        match request(client.clone()).await {
            Err(e) if tries < TRIES && unreachable(&e) => {
                tries += 1;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            r => return r,
        }
    }
}

impl Cluster {
    /// Connects to etcd (lazily: a node starts while etcd is down, and
    /// serves its own sandboxes until it is back).
    pub async fn connect(config: ClusterConfig) -> Result<Arc<Self>, ClusterError> {
        let options = ConnectOptions::new()
            .with_connect_timeout(Duration::from_secs(2))
            .with_timeout(Duration::from_secs(3))
            .with_keep_alive(Duration::from_secs(2), Duration::from_secs(2));
        let client = Client::connect(&config.endpoints, Some(options)).await?;
        Ok(Arc::new(Cluster {
            config,
            client,
            nodes: Mutex::new((HashMap::new(), None)),
            published: Default::default(),
            keys: Default::default(),
            all_keys: Default::default(),
            draining: Default::default(),
            ops: EtcdOps::default(),
            background: EtcdOps::default(),
            http: forward::http_client(),
        }))
    }

    /// A range read, retried on an unreachable member (see [`retrying`]).
    async fn get(
        &self,
        key: String,
        options: Option<GetOptions>,
    ) -> Result<etcd_client::GetResponse, etcd_client::Error> {
        retrying(&self.client, |mut c| {
            let (key, options) = (key.clone(), options.clone());
            async move { c.get(key, options).await }
        })
        .await
    }

    /// A transaction of `ops`, retried on an unreachable member.
    async fn txn(&self, ops: Vec<TxnOp>) -> Result<(), etcd_client::Error> {
        retrying(&self.client, |mut c| {
            let txn = Txn::new().and_then(ops.clone());
            async move { c.txn(txn).await }
        })
        .await
        .map(drop)
    }

    /// This node's name.
    pub fn name(&self) -> &str {
        &self.config.node_name
    }

    /// Stops (or resumes) taking creates; sandboxes keep running. The flag
    /// is recorded in the node's registry first (see [`DRAIN_TABLE`]), so
    /// it survives a restart, a SIGKILL included; an error leaves it as it
    /// was.
    pub fn set_draining(&self, state: &AppState, on: bool) -> Result<(), ClusterError> {
        state
            .registry
            .with_conn(|c| {
                c.execute_batch(DRAIN_TABLE)?;
                c.execute(
                    "INSERT OR REPLACE INTO cluster_node (key, value) VALUES ('draining', ?1)",
                    [if on { "true" } else { "false" }],
                )
            })
            .map_err(ClusterError::Registry)?;
        self.draining.store(on, std::sync::atomic::Ordering::SeqCst);
        Ok(())
    }

    /// Reads the drain flag a previous run of this node recorded.
    fn load_draining(&self, state: &AppState) -> Result<bool, ClusterError> {
        let on = state
            .registry
            .with_conn(|c| {
                c.execute_batch(DRAIN_TABLE)?;
                c.query_row(
                    "SELECT value FROM cluster_node WHERE key = 'draining'",
                    [],
                    |r| r.get::<_, String>(0),
                )
                .map(|v| v == "true")
                .or_else(|e| match e {
                    rusqlite::Error::QueryReturnedNoRows => Ok(false),
                    e => Err(e),
                })
            })
            .map_err(ClusterError::Registry)?;
        self.draining.store(on, std::sync::atomic::Ordering::SeqCst);
        Ok(on)
    }

    /// Counts a create placed on `name` against its free slots until its
    /// next published record says otherwise.
    fn took_slot(&self, name: &str) {
        let mut g = self
            .nodes
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(n) = g.0.get_mut(name) {
            n.free = n.free.saturating_sub(1);
        }
    }

    /// Whether this node drains (takes no creates).
    pub fn is_draining(&self) -> bool {
        self.draining.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// The live nodes if the list is fresh (read within [`NODES_FRESH`]).
    pub fn live_nodes(&self) -> Option<HashMap<String, NodeInfo>> {
        let g = self
            .nodes
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        match g.1 {
            Some(at) if at.elapsed() < NODES_FRESH => Some(g.0.clone()),
            _ => None,
        }
    }

    /// A node by name, if it holds a lease now (read fresh from etcd when
    /// the cached list does not have it).
    pub async fn node(&self, name: &str) -> Result<Option<NodeInfo>, ClusterError> {
        if let Some(n) = self.live_nodes().and_then(|m| m.get(name).cloned()) {
            return Ok(Some(n));
        }
        let key = format!("{PREFIX}nodes/{name}");
        self.ops.read();
        let resp = retrying(&self.client, |mut c| {
            let key = key.clone();
            async move { c.get(key, None).await }
        })
        .await?;
        resp.kvs()
            .first()
            .map(|kv| {
                serde_json::from_slice(kv.value()).map_err(|source| ClusterError::Record {
                    key: key.clone(),
                    source,
                })
            })
            .transpose()
    }

    async fn read_nodes(&self) -> Result<(), ClusterError> {
        self.background.read();
        let resp = self
            .get(
                format!("{PREFIX}nodes/"),
                Some(GetOptions::new().with_prefix()),
            )
            .await?;
        let mut map = HashMap::new();
        for kv in resp.kvs() {
            match serde_json::from_slice::<NodeInfo>(kv.value()) {
                Ok(n) => {
                    map.insert(n.name.clone(), n);
                }
                Err(e) => tracing::warn!("an unreadable node record in etcd: {e}"),
            }
        }
        *self
            .nodes
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = (map, Some(Instant::now()));
        Ok(())
    }

    /// Who owns sandbox `id`.
    pub async fn owner(&self, id: &str) -> Result<Option<Owner>, ClusterError> {
        let key = sandbox_key(id);
        self.ops.read();
        let resp = retrying(&self.client, |mut c| {
            let key = key.clone();
            async move { c.get(key, None).await }
        })
        .await?;
        resp.kvs()
            .first()
            .map(|kv| {
                serde_json::from_slice(kv.value()).map_err(|source| ClusterError::Record {
                    key: key.clone(),
                    source,
                })
            })
            .transpose()
    }

    /// Every published sandbox of `workspace` (one range read).
    pub async fn workspace_sandboxes(
        &self,
        workspace: &str,
    ) -> Result<Vec<SandboxRecord>, ClusterError> {
        let prefix = format!("{PREFIX}ws/{}/", hex(workspace));
        self.ops.read();
        let resp = retrying(&self.client, |mut c| {
            let prefix = prefix.clone();
            async move { c.get(prefix, Some(GetOptions::new().with_prefix())).await }
        })
        .await?;
        Ok(resp
            .kvs()
            .iter()
            .filter_map(|kv| serde_json::from_slice(kv.value()).ok())
            .collect())
    }

    /// The workspace of an API key published by any node (`None`: unknown
    /// or revoked).
    /// Answered from the copy read every second; a key not in it yet (made
    /// on another node within the last second) is read from etcd.
    pub async fn workspace_of(&self, key: &str) -> Result<Option<String>, ClusterError> {
        let hash = key_hash(key);
        let cached = self
            .all_keys
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(&hash)
            .cloned();
        let record = match cached {
            Some(r) => Some(r),
            None => {
                let key = format!("{PREFIX}keys/{hash}");
                self.ops.read();
                let resp = retrying(&self.client, |mut c| {
                    let key = key.clone();
                    async move { c.get(key, None).await }
                })
                .await?;
                resp.kvs()
                    .first()
                    .and_then(|kv| serde_json::from_slice::<KeyRecord>(kv.value()).ok())
            }
        };
        Ok(record
            .filter(|r| r.revoked_at.is_none())
            .map(|r| r.workspace))
    }

    /// Reads every node's keys into the local copy.
    async fn read_keys(&self) -> Result<(), ClusterError> {
        self.background.read();
        let resp = self
            .get(
                format!("{PREFIX}keys/"),
                Some(GetOptions::new().with_prefix()),
            )
            .await?;
        let map = resp
            .kvs()
            .iter()
            .filter_map(|kv| {
                let hash = kv.key_str().ok()?.rsplit('/').next()?.to_string();
                Some((hash, serde_json::from_slice::<KeyRecord>(kv.value()).ok()?))
            })
            .collect();
        *self
            .all_keys
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = map;
        Ok(())
    }

    /// Publishes one sandbox of this node (after a create), in one
    /// transaction; `view` is its API view.
    pub async fn publish(
        &self,
        workspace: &str,
        view: serde_json::Value,
    ) -> Result<(), ClusterError> {
        let Some(id) = view.get("id").and_then(|v| v.as_str()).map(str::to_string) else {
            return Ok(());
        };
        let record = serde_json::to_string(&SandboxRecord {
            node: self.name().into(),
            view,
        })
        .unwrap_or_default();
        let owner = serde_json::to_string(&Owner {
            node: self.name().into(),
            workspace: workspace.into(),
        })
        .unwrap_or_default();
        let mut published = self.published.lock().await;
        self.ops.write();
        retrying(&self.client, |mut c| {
            let txn = Txn::new().and_then(vec![
                TxnOp::put(sandbox_key(&id), owner.clone(), None),
                TxnOp::put(record_key(workspace, &id), record.clone(), None),
            ]);
            async move { c.txn(txn).await }
        })
        .await?;
        published.insert(id, (workspace.into(), record));
        Ok(())
    }

    /// Removes one sandbox of this node from etcd (after a delete).
    pub async fn unpublish(&self, workspace: &str, id: &str) -> Result<(), ClusterError> {
        let mut published = self.published.lock().await;
        self.ops.write();
        retrying(&self.client, |mut c| {
            let txn = Txn::new().and_then(vec![
                TxnOp::delete(sandbox_key(id), None),
                TxnOp::delete(record_key(workspace, id), None),
            ]);
            async move { c.txn(txn).await }
        })
        .await?;
        published.remove(id);
        Ok(())
    }

    /// This node's record now.
    fn info(&self, state: &AppState) -> NodeInfo {
        let live = state
            .sandboxes
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .len();
        let creating = state.creating.load(std::sync::atomic::Ordering::Acquire);
        let mut templates: Vec<String> =
            runcell_core::Template::installed(state.config.templates_dir.as_deref());
        templates.push("host".into());
        templates.extend(state.config.aliases.keys().cloned());
        templates.sort();
        templates.dedup();
        NodeInfo {
            name: self.name().into(),
            url: self.config.advertise.clone(),
            capacity: state.config.max_sandboxes,
            free: state.config.max_sandboxes.saturating_sub(live + creating),
            templates,
            backends: state
                .system
                .backends
                .iter()
                .filter(|b| b.available)
                .map(|b| b.name.to_string())
                .collect(),
            draining: self.is_draining(),
            labels: self.config.labels.clone(),
        }
    }

    /// Registers this node under a new lease; returns the lease.
    async fn register(&self, state: &AppState) -> Result<i64, ClusterError> {
        self.background.write();
        let lease = retrying(&self.client, |mut c| async move {
            c.lease_grant(LEASE_TTL_SECONDS, None).await
        })
        .await?
        .id();
        self.put_info(state, lease).await?;
        Ok(lease)
    }

    /// Puts the node record under the lease, and when it was last seen
    /// (outside the lease, for [`Cluster::came_back_late`]).
    async fn put_info(&self, state: &AppState, lease: i64) -> Result<(), ClusterError> {
        let info = serde_json::to_string(&self.info(state)).unwrap_or_default();
        self.background.write();
        self.txn(vec![
            TxnOp::put(
                format!("{PREFIX}nodes/{}", self.name()),
                info,
                Some(PutOptions::new().with_lease(lease)),
            ),
            TxnOp::put(
                format!("{PREFIX}seen/{}", self.name()),
                crate::state::now_ms().to_string(),
                None,
            ),
        ])
        .await?;
        Ok(())
    }

    /// Whether this node was away (not seen) longer than `lost_after`:
    /// its sandboxes were reported lost meanwhile.
    async fn came_back_late(&self) -> Result<Option<i64>, ClusterError> {
        self.background.read();
        let resp = self
            .get(format!("{PREFIX}seen/{}", self.name()), None)
            .await?;
        let seen = resp
            .kvs()
            .first()
            .and_then(|kv| kv.value_str().ok()?.parse::<i64>().ok());
        let away = seen.map(|s| crate::state::now_ms() - s);
        let limit = i64::try_from(self.config.lost_after.as_millis()).unwrap_or(i64::MAX);
        Ok(away.filter(|a| *a > limit))
    }

    /// Removes this node's sandboxes after it came back late (they were
    /// reported lost to their users, who may have made new ones).
    async fn reap_lost(&self, state: &AppState, away_ms: i64) {
        let ids: Vec<String> = state
            .sandboxes
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .keys()
            .cloned()
            .collect();
        let reason = format!(
            "lost: node {} was away {} s, longer than its lost-after of {} s",
            self.name(),
            away_ms / 1000,
            self.config.lost_after.as_secs()
        );
        for id in ids {
            tracing::warn!(sandbox = %id, "{reason}");
            state.remove(&id, &reason).await;
        }
    }

    /// Publishes this node's keys that changed since the last round.
    async fn sync_keys(&self, state: &AppState) -> Result<(), ClusterError> {
        let rows = state.registry.with_conn(|c| {
            let mut stmt = c.prepare(
                "SELECT hash, prefix, workspace, name, created_at, revoked_at FROM api_keys",
            )?;
            let rows = stmt.query_map([], |r| {
                Ok((
                    r.get::<_, String>(0)?,
                    KeyRecord {
                        prefix: r.get(1)?,
                        workspace: r.get(2)?,
                        name: r.get(3)?,
                        created_at: r.get(4)?,
                        revoked_at: r.get(5)?,
                        node: self.name().into(),
                    },
                ))
            })?;
            rows.collect::<Result<Vec<_>, rusqlite::Error>>()
        });
        let rows = match rows {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!("could not read the keys to publish: {e}");
                return Ok(());
            }
        };
        let changed: Vec<(String, KeyRecord)> = {
            let known = self
                .keys
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            rows.into_iter()
                .filter(|(h, r)| known.get(h) != Some(r))
                .collect()
        };
        for (h, r) in changed {
            self.background.write();
            self.txn(vec![TxnOp::put(
                format!("{PREFIX}keys/{h}"),
                serde_json::to_string(&r).unwrap_or_default(),
                None,
            )])
            .await?;
            self.keys
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .insert(h, r);
        }
        Ok(())
    }

    /// Publishes every sandbox of this node whose view changed, and
    /// removes the records of the ones that are gone (the reaper's, and
    /// on the first round after a restart, those that did not survive).
    async fn sync_sandboxes(&self, state: &Arc<AppState>, first: bool) -> Result<(), ClusterError> {
        let now: HashMap<String, (String, String)> = forward::own_views(state)
            .into_iter()
            .map(|(ws, view)| {
                let id = view
                    .get("id")
                    .and_then(|v| v.as_str())
                    .unwrap_or_default()
                    .to_string();
                let record = serde_json::to_string(&SandboxRecord {
                    node: self.name().into(),
                    view,
                })
                .unwrap_or_default();
                (id, (ws, record))
            })
            .collect();
        let mut published = self.published.lock().await;
        if first {
            // What etcd says this node owns, from before a restart.
            self.background.read();
            let resp = self
                .get(
                    format!("{PREFIX}sandbox/"),
                    Some(GetOptions::new().with_prefix()),
                )
                .await?;
            for kv in resp.kvs() {
                let (Ok(key), Ok(owner)) =
                    (kv.key_str(), serde_json::from_slice::<Owner>(kv.value()))
                else {
                    continue;
                };
                if owner.node == self.name() {
                    let id = key
                        .trim_start_matches(&format!("{PREFIX}sandbox/"))
                        .to_string();
                    if !now.contains_key(&id) {
                        self.background.write();
                        self.txn(vec![
                            TxnOp::delete(sandbox_key(&id), None),
                            TxnOp::delete(record_key(&owner.workspace, &id), None),
                        ])
                        .await?;
                        tracing::info!(sandbox = %id, "removed from the cluster: it did not survive this node's restart");
                    }
                }
            }
        }
        let gone: Vec<String> = published
            .keys()
            .filter(|id| !now.contains_key(*id))
            .cloned()
            .collect();
        for id in gone {
            let Some((ws, _)) = published.remove(&id) else {
                continue;
            };
            self.background.write();
            self.txn(vec![
                TxnOp::delete(sandbox_key(&id), None),
                TxnOp::delete(record_key(&ws, &id), None),
            ])
            .await?;
        }
        for (id, (ws, record)) in now {
            if published.get(&id).map(|p| &p.1) == Some(&record) {
                continue;
            }
            let owner = serde_json::to_string(&Owner {
                node: self.name().into(),
                workspace: ws.clone(),
            })
            .unwrap_or_default();
            self.background.write();
            self.txn(vec![
                TxnOp::put(sandbox_key(&id), owner, None),
                TxnOp::put(record_key(&ws, &id), record.clone(), None),
            ])
            .await?;
            published.insert(id, (ws, record));
        }
        Ok(())
    }

    /// Registers the node and keeps it registered: renews the lease,
    /// republishes the node (free slots), its keys and sandboxes, and
    /// re-reads the node list, every second, for as long as the daemon runs.
    /// etcd being down only delays this; running sandboxes are unaffected.
    pub fn start(self: &Arc<Self>, state: Arc<AppState>) {
        // Before the first registration, so the node never shows itself
        // taking creates while a drain it was told before is in force.
        match self.load_draining(&state) {
            Ok(true) => tracing::info!(
                node = %self.name(),
                "draining (recorded before this start): this node takes no creates until DELETE /v1/cluster/drain"
            ),
            Ok(false) => {}
            Err(e) => tracing::warn!("{e}; starting as not draining"),
        }
        let me = self.clone();
        tokio::spawn(async move {
            let mut lease: Option<(
                i64,
                etcd_client::LeaseKeeper,
                etcd_client::LeaseKeepAliveStream,
            )> = None;
            let mut first_sync = true;
            let mut warned = false;
            let mut tick = tokio::time::interval(ROUND);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let round = async {
                    match lease.as_mut() {
                        None => {
                            if first_sync {
                                if let Some(away) = me.came_back_late().await? {
                                    me.reap_lost(&state, away).await;
                                }
                            }
                            let id = me.register(&state).await?;
                            let (keeper, stream) = retrying(&me.client, |mut c| async move {
                                c.lease_keep_alive(id).await
                            })
                            .await?;
                            tracing::info!(node = %me.name(), lease = id, "registered in the cluster");
                            lease = Some((id, keeper, stream));
                        }
                        Some((id, keeper, stream)) => {
                            me.background.write();
                            keeper.keep_alive().await?;
                            let alive = match tokio::time::timeout(
                                Duration::from_secs(2),
                                stream.message(),
                            )
                            .await
                            {
                                Ok(Ok(Some(r))) => r.ttl() > 0,
                                _ => false,
                            };
                            if !alive {
                                tracing::warn!(node = %me.name(), "the cluster lease expired; registering again");
                                lease = None;
                                return Ok(());
                            }
                            me.put_info(&state, *id).await?;
                        }
                    }
                    me.read_nodes().await?;
                    me.sync_keys(&state).await?;
                    me.read_keys().await?;
                    me.sync_sandboxes(&state, first_sync).await?;
                    first_sync = false;
                    Ok::<(), ClusterError>(())
                };
                match round.await {
                    Ok(()) => {
                        if warned {
                            tracing::info!("etcd is reachable again");
                            warned = false;
                        }
                    }
                    Err(e) => {
                        if !warned {
                            tracing::warn!(
                                "cluster round failed (running sandboxes are unaffected): {e}"
                            );
                            warned = true;
                        }
                        // The keep-alive stream may be dead: start over.
                        lease = None;
                    }
                }
            }
        });
    }

    /// Leaves the cluster on shutdown: the lease is revoked, so the node
    /// is gone at once (its sandboxes keep running, and are re-attached
    /// and republished by the next start).
    pub async fn leave(&self) {
        let mut c = self.client.clone();
        let key = format!("{PREFIX}nodes/{}", self.name());
        if let Err(e) = c.delete(key, None).await {
            tracing::warn!("could not leave the cluster: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_cluster_flag_names_etcd_endpoints() {
        assert_eq!(
            super::parse_url("etcd://10.0.0.1:2379, 10.0.0.2:2379/").unwrap(),
            vec!["10.0.0.1:2379", "10.0.0.2:2379"]
        );
        for bad in ["10.0.0.1:2379", "etcd://", "etcd://host", "http://h:2379"] {
            let e = super::parse_url(bad).unwrap_err().to_string();
            assert!(e.contains("etcd://HOST:PORT"), "{bad}: {e}");
        }
    }
}
