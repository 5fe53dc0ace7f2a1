//! runcell's MCP server. Every tool is a call to the daemon's `/v1` API
//! through [`runcell_client`], so the same server runs over stdio
//! (`runcell mcp`, with the caller's key from the environment) and inside the
//! daemon at `/mcp` (streamable HTTP, with the key of each HTTP request).
//!
//! Tools: `run_code` (a fresh sandbox per call unless `sandbox_id` is given),
//! `create_sandbox` (with a network policy), `exec`, `read_file` (text as
//! text, images as image content, other binary data as a typed base64
//! resource), `write_file`, `list_files`, `list_sandboxes` (those made
//! through MCP unless `all`), `kill_sandbox` (annotated destructive),
//! `snapshot_sandbox` (its files, for `create_sandbox`'s `from_snapshot`) and
//! `fork_sandbox` (copies of its files in new sandboxes). Results
//! carry text for the model, structured content, and plots as image content;
//! long output keeps its head and tail around a marker giving the total.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use base64::Engine;
use rmcp::model::{
    CallToolRequestParams, CallToolResult, Content, Implementation, JsonObject, ListToolsResult,
    PaginatedRequestParams, ResourceContents, ServerCapabilities, ServerInfo, Tool,
    ToolAnnotations,
};
use rmcp::service::RequestContext;
use rmcp::{ErrorData as McpError, RoleServer, ServerHandler};
use runcell_client::{Cell, Client, ClientError, ExecOptions, ForkOptions};
use serde::Deserialize;
use serde_json::{json, Value};

/// The `created_by` metadata of sandboxes made through MCP, which
/// `list_sandboxes` lists by default.
const MCP_MARK: &str = "runcell-mcp";

/// Longest text a tool returns per stream before cutting it with a marker.
const MAX_TEXT: usize = 20_000;

/// Where the tools send their API calls.
#[derive(Debug, Clone)]
pub enum Backend {
    /// One client for every call (stdio: the user's own key).
    Fixed(Client),
    /// The daemon itself, with the bearer key of each MCP HTTP request.
    PerRequest {
        /// The daemon's own address, e.g. `http://127.0.0.1:7070`.
        url: String,
    },
}

/// The MCP server.
#[derive(Debug, Clone)]
pub struct RuncellMcp {
    backend: Backend,
    /// Template of sandboxes `run_code` and `create_sandbox` make by default.
    template: Arc<str>,
}

impl RuncellMcp {
    /// A server sending its calls to `backend`; sandboxes default to `template`.
    pub fn new(backend: Backend, template: impl Into<String>) -> Self {
        let template: String = template.into();
        Self {
            backend,
            template: template.into(),
        }
    }

    fn client(&self, ctx: &RequestContext<RoleServer>) -> Result<Client, McpError> {
        match &self.backend {
            Backend::Fixed(c) => Ok(c.clone()),
            Backend::PerRequest { url } => {
                let key = ctx
                    .extensions
                    .get::<http::request::Parts>()
                    .and_then(|p| p.headers.get(http::header::AUTHORIZATION))
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| v.strip_prefix("Bearer "))
                    .ok_or_else(|| {
                        McpError::invalid_request(
                            "An API key (Authorization: Bearer) is required.",
                            None,
                        )
                    })?;
                Ok(Client::new(url.clone(), key.trim())
                    .with_key_source("the MCP request's Authorization header"))
            }
        }
    }
}

fn schema(v: Value) -> Arc<JsonObject> {
    match v {
        Value::Object(m) => Arc::new(m),
        _ => Arc::new(JsonObject::new()),
    }
}

fn tools() -> Vec<Tool> {
    let lang = json!({"type": "string", "enum": ["python", "javascript", "bash"], "default": "python",
        "description": "Language of the code: python (default), javascript (Node.js) or bash."});
    let sandbox_id = |what: &str| json!({"type": "string", "description": format!("Id of the sandbox {what} (from create_sandbox or list_sandboxes).")});
    let metadata = |what: &str| json!({"type": "object", "additionalProperties": {"type": "string"}, "description": what});
    let read_only = ToolAnnotations::new().read_only(true).destructive(false);
    vec![
        Tool::new(
            "run_code",
            "Run Python, JavaScript (Node.js) or bash code in an isolated Linux sandbox with no network, and return stdout, stderr, the exit code, and rich results: the value of the last Python expression, DataFrames as tables, and matplotlib plots as images. Without sandbox_id, every call gets a FRESH sandbox that is destroyed afterwards: nothing persists between calls (variables, files, installed packages), so put imports and setup in the same snippet. With the sandbox_id of a sandbox from create_sandbox, code runs in that sandbox's interpreter for the language and variables, imports and files persist between calls. A timeout gives exit code 124.",
            schema(json!({
                "type": "object",
                "properties": {
                    "code": {"type": "string", "description": "The code to run.", "maxLength": 200000},
                    "language": lang,
                    "sandbox_id": {"type": "string", "description": "Run in this existing sandbox (state persists) instead of a fresh one."},
                    "timeout_seconds": {"type": "number", "exclusiveMinimum": 0, "description": "Stop the code after this many seconds (default: the sandbox's, usually 60)."}
                },
                "required": ["code"]
            })),
        ),
        Tool::new(
            "create_sandbox",
            "Create a sandbox that keeps its state (variables in run_code, files, installed packages) across calls until it is killed or has been idle for ttl_seconds (default 600). Returns its id for run_code, exec, read_file, write_file and list_files.",
            schema(json!({
                "type": "object",
                "properties": {
                    "template": {"type": "string", "description": "Template the sandbox is made from, e.g. code-interpreter (the default) or host."},
                    "ttl_seconds": {"type": "integer", "minimum": 1, "description": "Idle time in seconds after which the sandbox is destroyed (default 600)."},
                    "from_snapshot": {"type": "string", "description": "Start with the files of this snapshot (from snapshot_sandbox) instead of the template's."},
                    "metadata": metadata("Labels (string keys and values) to find the sandbox again with list_sandboxes."),
                    "isolation": {"type": "string", "enum": ["jail", "gvisor", "microvm"], "description": "How the sandbox is isolated: jail (namespaces, seccomp, Landlock; the fastest), gvisor (a user-space kernel) or microvm (its own guest kernel). Default: the template's, else the server's."},
                    "network": {
                        "description": "Network egress: \"none\" (the default: no network), \"open\" (any public address), or an allowlist object. Loopback and private ranges stay closed.",
                        "oneOf": [
                            {"type": "string", "enum": ["none", "open"], "description": "No network, or any public address."},
                            {
                                "type": "object",
                                "description": "An egress policy.",
                                "properties": {
                                    "mode": {"type": "string", "enum": ["none", "allowlist", "open"], "description": "none, allowlist or open."},
                                    "allow": {"type": "array", "items": {"type": "string"}, "description": "Allowed destinations for allowlist: host names, *.wildcards, optionally with :port, e.g. pypi.org or *.example.com:443."},
                                    "presets": {"type": "array", "items": {"type": "string"}, "description": "Named groups of hosts, e.g. package-index (PyPI and npm)."}
                                },
                                "required": ["mode"]
                            }
                        ]
                    }
                }
            })),
        ),
        Tool::new(
            "exec",
            "Run a shell command line (bash -c) in an existing sandbox and return stdout, stderr and the exit code (124 after a timeout). Files and installed packages in the sandbox persist between calls.",
            schema(json!({
                "type": "object",
                "properties": {
                    "sandbox_id": sandbox_id("to run the command in"),
                    "command": {"type": "string", "description": "A shell command line, run by bash -c, e.g. \"ls -la /home/user\"."},
                    "timeout_seconds": {"type": "number", "exclusiveMinimum": 0, "description": "Stop the command after this many seconds (default: the sandbox's, usually 60)."}
                },
                "required": ["sandbox_id", "command"]
            })),
        ),
        Tool::new(
            "read_file",
            "Read a file from a sandbox (absolute path). Text comes back as text, images as image content, other binary files as a base64 resource with its MIME type.",
            schema(json!({
                "type": "object",
                "properties": {
                    "sandbox_id": sandbox_id("to read from"),
                    "path": {"type": "string", "description": "Absolute path of the file, e.g. /home/user/out.png."}
                },
                "required": ["sandbox_id", "path"]
            })),
        )
        .annotate(read_only.clone()),
        Tool::new(
            "write_file",
            "Write a text file into a sandbox (absolute path; parent directories are created; an existing file is replaced).",
            schema(json!({
                "type": "object",
                "properties": {
                    "sandbox_id": sandbox_id("to write into"),
                    "path": {"type": "string", "description": "Absolute path of the file, e.g. /home/user/data.csv."},
                    "content": {"type": "string", "description": "The file's new content (text)."}
                },
                "required": ["sandbox_id", "path", "content"]
            })),
        ),
        Tool::new(
            "list_files",
            "List a directory in a sandbox: each entry's name, whether it is a directory, and its size.",
            schema(json!({
                "type": "object",
                "properties": {
                    "sandbox_id": sandbox_id("to look in"),
                    "path": {"type": "string", "description": "Absolute path of the directory (default /home/user)."}
                },
                "required": ["sandbox_id"]
            })),
        )
        .annotate(read_only.clone()),
        Tool::new(
            "list_sandboxes",
            "List the sandboxes created through this MCP server (all of your sandboxes with all: true), optionally only those whose metadata matches every given key and value.",
            schema(json!({
                "type": "object",
                "properties": {
                    "metadata": metadata("Only sandboxes whose metadata has every one of these keys and values."),
                    "all": {"type": "boolean", "default": false, "description": "Also list sandboxes not created through MCP (by the CLI or an SDK with the same key)."}
                }
            })),
        )
        .annotate(read_only),
        Tool::new(
            "kill_sandbox",
            "Destroy a sandbox and everything in it (files, processes, interpreter state). This cannot be undone.",
            schema(json!({
                "type": "object",
                "properties": {"sandbox_id": sandbox_id("to destroy")},
                "required": ["sandbox_id"]
            })),
        )
        .annotate(
            ToolAnnotations::new()
                .destructive(true)
                .idempotent(true)
                .read_only(false),
        ),
        Tool::new(
            "snapshot_sandbox",
            "Save a sandbox's files (everything written to it, installed packages included) as a snapshot, and return the snapshot's id. Running processes and interpreter state (run_code variables) are NOT saved. The sandbox keeps running unchanged. Pass the id to create_sandbox as from_snapshot to start new sandboxes from these files, e.g. to return to a known-good point later.",
            schema(json!({
                "type": "object",
                "properties": {"sandbox_id": sandbox_id("to snapshot")},
                "required": ["sandbox_id"]
            })),
        )
        .annotate(ToolAnnotations::new().destructive(false).read_only(false)),
        Tool::new(
            "fork_sandbox",
            "Copy a sandbox into one or more NEW sandboxes that start with the same files (installed packages included) but fresh interpreters: run_code variables and running processes are not copied. The original is left unchanged. Use it to try alternatives side by side; each fork is independent and is listed and killed like any sandbox. Returns the new sandbox ids.",
            schema(json!({
                "type": "object",
                "properties": {
                    "sandbox_id": sandbox_id("to copy"),
                    "count": {"type": "integer", "minimum": 1, "maximum": 16, "default": 1, "description": "How many forks to make (1 to 16)."},
                    "metadata": metadata("Metadata of the new sandboxes.")
                },
                "required": ["sandbox_id"]
            })),
        )
        .annotate(ToolAnnotations::new().destructive(false).read_only(false)),
    ]
}

#[derive(Debug, Deserialize)]
struct RunCodeArgs {
    code: String,
    #[serde(default)]
    language: Option<String>,
    #[serde(default)]
    sandbox_id: Option<String>,
    #[serde(default)]
    timeout_seconds: Option<f64>,
}

#[derive(Debug, Deserialize)]
struct CreateArgs {
    #[serde(default)]
    template: Option<String>,
    #[serde(default)]
    ttl_seconds: Option<u64>,
    #[serde(default)]
    metadata: BTreeMap<String, String>,
    #[serde(default)]
    network: Option<Value>,
    #[serde(default)]
    isolation: Option<String>,
    #[serde(default)]
    from_snapshot: Option<String>,
}

#[derive(Debug, Deserialize)]
struct ForkArgs {
    sandbox_id: String,
    #[serde(default)]
    count: Option<u32>,
    #[serde(default)]
    metadata: BTreeMap<String, String>,
}

#[derive(Debug, Deserialize)]
struct ExecArgs {
    sandbox_id: String,
    command: String,
    #[serde(default)]
    timeout_seconds: Option<f64>,
}

#[derive(Debug, Deserialize)]
struct FileArgs {
    sandbox_id: String,
    path: String,
    #[serde(default)]
    content: Option<String>,
}

#[derive(Debug, Deserialize)]
struct ListArgs {
    #[serde(default)]
    metadata: BTreeMap<String, String>,
    #[serde(default)]
    all: bool,
}

#[derive(Debug, Deserialize)]
struct DirArgs {
    sandbox_id: String,
    #[serde(default)]
    path: Option<String>,
}

#[derive(Debug, Deserialize)]
struct KillArgs {
    sandbox_id: String,
}

fn args<T: serde::de::DeserializeOwned>(p: &CallToolRequestParams) -> Result<T, McpError> {
    let v = Value::Object(p.arguments.clone().unwrap_or_default());
    serde_json::from_value(v).map_err(|e| {
        McpError::invalid_params(format!("Invalid arguments for {}: {e}.", p.name), None)
    })
}

fn timeout(secs: Option<f64>) -> Result<Option<Duration>, McpError> {
    match secs {
        None => Ok(None),
        Some(t) if t > 0.0 && t.is_finite() => Ok(Some(Duration::from_secs_f64(t.min(3600.0)))),
        Some(_) => Err(McpError::invalid_params(
            "timeout_seconds must be positive.",
            None,
        )),
    }
}

/// Cuts `text` longer than [`MAX_TEXT`] characters to its head and tail,
/// with a marker in between giving what was left out and the total size
/// (the end of an output, where errors and results are, matters as much as
/// its start).
fn cap(text: &str) -> String {
    let total = text.chars().count();
    if total <= MAX_TEXT {
        return text.to_string();
    }
    let half = MAX_TEXT / 2;
    let head: String = text.chars().take(half).collect();
    let tail: String = text.chars().skip(total - half).collect();
    format!(
        "{head}\n[runcell: output cut: {} characters in the middle left out; the whole output was {total} characters ({} bytes)]\n{tail}",
        total - 2 * half,
        text.len()
    )
}

/// The MIME type of binary data, from its first bytes.
fn sniff(data: &[u8]) -> &'static str {
    const TYPES: &[(&[u8], &str)] = &[
        (b"\x89PNG\r\n\x1a\n", "image/png"),
        (b"\xff\xd8\xff", "image/jpeg"),
        (b"GIF87a", "image/gif"),
        (b"GIF89a", "image/gif"),
        (b"%PDF-", "application/pdf"),
        (b"PK\x03\x04", "application/zip"),
        (b"\x1f\x8b", "application/gzip"),
        (b"\x7fELF", "application/x-executable"),
    ];
    if data.len() >= 12 && &data[..4] == b"RIFF" && &data[8..12] == b"WEBP" {
        return "image/webp";
    }
    TYPES
        .iter()
        .find(|(magic, _)| data.starts_with(magic))
        .map_or("application/octet-stream", |(_, mime)| mime)
}

/// Largest binary file `read_file` returns (as base64).
const MAX_BINARY: usize = 8 << 20;

/// A file's content as the model can use it: text as text, an image as
/// image content, other binary data as a base64 resource with its MIME type.
fn file_result(path: &str, data: &[u8]) -> CallToolResult {
    if let Ok(text) = std::str::from_utf8(data) {
        if !text.contains('\0') {
            return ok(
                cap(text),
                json!({"path": path, "size": data.len(), "mime_type": "text/plain", "encoding": "utf-8"}),
            );
        }
    }
    let mime = sniff(data);
    if data.len() > MAX_BINARY {
        return CallToolResult::error(vec![Content::text(format!(
            "{path} is a binary file ({mime}) of {} bytes, more than the {} MiB read_file returns; inspect it with exec instead.",
            data.len(),
            MAX_BINARY >> 20
        ))]);
    }
    let b64 = base64::engine::general_purpose::STANDARD.encode(data);
    let note = Content::text(format!(
        "{path}: {mime}, {} bytes (binary; attached {}).",
        data.len(),
        if mime.starts_with("image/") {
            "as an image"
        } else {
            "as a base64 resource"
        }
    ));
    let body = if mime.starts_with("image/") {
        Content::image(b64, mime)
    } else {
        Content::resource(
            ResourceContents::blob(b64, format!("file://{path}")).with_mime_type(mime),
        )
    };
    let mut r = CallToolResult::success(vec![note, body]);
    r.structured_content =
        Some(json!({"path": path, "size": data.len(), "mime_type": mime, "encoding": "base64"}));
    r
}

/// Bytes for people: `12.3 MiB`.
fn human_size(bytes: u64) -> String {
    let units = ["bytes", "KiB", "MiB", "GiB", "TiB"];
    let mut unit = 0;
    let mut whole = bytes;
    let mut rem = 0;
    while whole >= 1024 && unit + 1 < units.len() {
        rem = whole % 1024;
        whole /= 1024;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} bytes")
    } else {
        format!("{whole}.{} {}", rem * 10 / 1024, units[unit])
    }
}

/// A failed API call as a tool error the model can read (not a protocol error).
fn tool_error(e: ClientError) -> CallToolResult {
    CallToolResult::error(vec![Content::text(e.to_string())])
}

fn ok(text: String, structured: Value) -> CallToolResult {
    let mut r = CallToolResult::success(vec![Content::text(text)]);
    r.structured_content = Some(structured);
    r
}

fn cell_result(cell: &Cell, sandbox: &str, fresh: bool) -> CallToolResult {
    let mut text = String::new();
    if !cell.stdout.is_empty() {
        text.push_str(&format!("stdout:\n{}\n", cap(&cell.stdout)));
    }
    if !cell.stderr.is_empty() {
        text.push_str(&format!("stderr:\n{}\n", cap(&cell.stderr)));
    }
    let mut images = Vec::new();
    let mut values = Vec::new();
    for r in &cell.results {
        if let Some(png) = r.get("image/png") {
            images.push(Content::image(png.clone(), "image/png"));
        } else if let Some(jpeg) = r.get("image/jpeg") {
            images.push(Content::image(jpeg.clone(), "image/jpeg"));
        } else if let Some(t) = r.get("text/plain") {
            values.push(cap(t));
        }
    }
    for v in &values {
        text.push_str(&format!("result: {v}\n"));
    }
    if !images.is_empty() {
        text.push_str(&format!("{} image(s) attached.\n", images.len()));
    }
    // The daemon's sentences speak of a context that lives on; a fresh
    // sandbox does not, so its timeout gets one sentence of its own.
    let exit_code = if cell.timed_out { 124 } else { cell.exit_code };
    let mut messages: Vec<String> = cell.messages.clone();
    if fresh && cell.timed_out {
        messages.retain(|m| !m.contains("timed out"));
        messages.insert(
            0,
            "The code timed out and was stopped; its fresh sandbox was destroyed, so nothing persists.".into(),
        );
    } else if cell.timed_out && !messages.iter().any(|m| m.contains("timed out")) {
        messages.insert(0, "The code timed out and was stopped.".into());
    }
    for m in &messages {
        text.push_str(&format!("{m}\n"));
    }
    if let (false, Some(e)) = (cell.timed_out, &cell.exception) {
        text.push_str(&format!("error: {}: {}\n", e.name, e.value));
    }
    text.push_str(&format!(
        "exit code: {exit_code}{}",
        if fresh && !cell.timed_out {
            " (this sandbox was destroyed; nothing persists)"
        } else {
            ""
        }
    ));
    let structured = json!({
        "sandbox_id": sandbox,
        "stdout": cap(&cell.stdout),
        "stderr": cap(&cell.stderr),
        "exit_code": exit_code,
        "results": values,
        "images": images.len(),
        "error": cell.error,
        "timed_out": cell.timed_out,
        "state_lost": cell.state_lost,
        "messages": messages,
    });
    let mut content = vec![Content::text(text)];
    content.extend(images);
    let mut r = if exit_code == 0 {
        CallToolResult::success(content)
    } else {
        CallToolResult::error(content)
    };
    r.structured_content = Some(structured);
    r
}

impl RuncellMcp {
    async fn run_code(&self, c: &Client, a: RunCodeArgs) -> Result<CallToolResult, McpError> {
        let language = a.language.unwrap_or_else(|| "python".into());
        if !matches!(language.as_str(), "python" | "javascript" | "bash") {
            return Err(McpError::invalid_params(
                format!("Unknown language \"{language}\"; use python, javascript or bash."),
                None,
            ));
        }
        let t = timeout(a.timeout_seconds)?;
        let (sandbox, fresh) = match a.sandbox_id {
            Some(id) => (id, false),
            None => {
                let req = json!({"template": &*self.template, "ttl_seconds": 300, "metadata": {"created_by": MCP_MARK}});
                match c.create_sandbox(&req).await {
                    Ok(s) => (s.id, true),
                    Err(e) => return Ok(tool_error(e)),
                }
            }
        };
        let run = async {
            let existing = if fresh {
                None
            } else {
                c.list_contexts(&sandbox)
                    .await?
                    .into_iter()
                    .find(|x| x.language == language)
            };
            let ctx = match existing {
                Some(x) => x,
                None => c.create_context(&sandbox, &language).await?,
            };
            c.run_cell(&sandbox, &ctx.id, &a.code, t).await
        }
        .await;
        if fresh {
            let _ = c.delete_sandbox(&sandbox).await;
        }
        Ok(match run {
            Ok(cell) => cell_result(&cell, &sandbox, fresh),
            Err(e) => tool_error(e),
        })
    }

    async fn dispatch(
        &self,
        c: &Client,
        p: &CallToolRequestParams,
    ) -> Result<CallToolResult, McpError> {
        let result = match p.name.as_ref() {
            "run_code" => return self.run_code(c, args(p)?).await,
            "create_sandbox" => {
                let a: CreateArgs = args(p)?;
                let asked_template = a.template.is_some();
                let mut req = json!({
                    "template": a.template.unwrap_or_else(|| self.template.to_string()),
                    "ttl_seconds": a.ttl_seconds.unwrap_or(600),
                    "metadata": a.metadata,
                });
                req["metadata"]["created_by"] = MCP_MARK.into();
                if let Some(n) = a.network {
                    req["network"] = n;
                }
                if let Some(i) = a.isolation {
                    req["isolation"] = i.into();
                }
                if let Some(snap) = a.from_snapshot {
                    req["from_snapshot"] = snap.into();
                    // The snapshot's own template unless one was asked for.
                    if !asked_template {
                        if let Some(o) = req.as_object_mut() {
                            o.remove("template");
                        }
                    }
                }
                c.create_sandbox(&req).await.map(|s| {
                    ok(
                        format!("Created sandbox {}. Its state persists until it is killed or idle for its TTL.", s.id),
                        json!({"sandbox_id": s.id, "template": s.fields.get("template"), "isolation": s.fields.get("isolation")}),
                    )
                })
            }
            "exec" => {
                let a: ExecArgs = args(p)?;
                let opts = ExecOptions {
                    timeout: timeout(a.timeout_seconds)?,
                    ..ExecOptions::default()
                };
                c.exec(&a.sandbox_id, &a.command, &opts).await.map(|r| {
                    let text = format!(
                        "stdout:\n{}\nstderr:\n{}\n{}exit code: {}",
                        cap(&r.stdout),
                        cap(&r.stderr),
                        r.messages.iter().map(|m| format!("{m}\n")).collect::<String>(),
                        r.exit_code
                    );
                    let mut res = ok(
                        text,
                        json!({"stdout": cap(&r.stdout), "stderr": cap(&r.stderr), "exit_code": r.exit_code, "timed_out": r.timed_out}),
                    );
                    res.is_error = Some(r.exit_code != 0);
                    res
                })
            }
            "read_file" => {
                let a: FileArgs = args(p)?;
                c.read_file(&a.sandbox_id, &a.path)
                    .await
                    .map(|b| file_result(&a.path, &b))
            }
            "write_file" => {
                let a: FileArgs = args(p)?;
                let content = a.content.unwrap_or_default();
                let size = content.len();
                c.write_file(&a.sandbox_id, &a.path, content.into_bytes())
                    .await
                    .map(|()| {
                        ok(
                            format!("Wrote {size} bytes to {}.", a.path),
                            json!({"path": a.path, "size": size}),
                        )
                    })
            }
            "list_files" => {
                let a: DirArgs = args(p)?;
                let path = a.path.unwrap_or_else(|| "/home/user".into());
                c.list_dir(&a.sandbox_id, &path).await.map(|entries| {
                    let mut text = if entries.is_empty() {
                        format!("{path} is empty.")
                    } else {
                        format!("{path}:\n")
                    };
                    for e in &entries {
                        if e.is_dir {
                            text.push_str(&format!("{}/\n", e.name));
                        } else if e.mode == "l" {
                            text.push_str(&format!("{} (symbolic link)\n", e.name));
                        } else {
                            text.push_str(&format!("{}  {} bytes\n", e.name, e.size));
                        }
                    }
                    let items: Vec<Value> = entries
                        .iter()
                        .map(|e| json!({"name": e.name, "is_dir": e.is_dir, "size": e.size, "type": e.mode, "mtime": e.mtime}))
                        .collect();
                    ok(cap(&text), json!({"path": path, "entries": items}))
                })
            }
            "list_sandboxes" => {
                let mut a: ListArgs = args(p)?;
                if !a.all {
                    a.metadata.insert("created_by".into(), MCP_MARK.into());
                }
                c.list_sandboxes(&a.metadata).await.map(|list| {
                    let items: Vec<Value> = list
                        .iter()
                        .map(|s| json!({"sandbox_id": s.id, "template": s.fields.get("template"), "status": s.fields.get("status"), "metadata": s.fields.get("metadata")}))
                        .collect();
                    let text = if items.is_empty() {
                        if a.all {
                            "No sandboxes.".to_string()
                        } else {
                            "No sandboxes created through MCP (all: true lists every sandbox of this key).".to_string()
                        }
                    } else {
                        serde_json::to_string_pretty(&items).unwrap_or_default()
                    };
                    ok(text, json!({"sandboxes": items}))
                })
            }
            "kill_sandbox" => {
                let a: KillArgs = args(p)?;
                c.delete_sandbox(&a.sandbox_id).await.map(|()| {
                    ok(
                        format!("Killed sandbox {}.", a.sandbox_id),
                        json!({"sandbox_id": a.sandbox_id, "killed": true}),
                    )
                })
            }
            "snapshot_sandbox" => {
                let a: KillArgs = args(p)?;
                c.create_snapshot(&a.sandbox_id).await.map(|snap| {
                    ok(
                        format!(
                            "Saved the files of sandbox {} as snapshot {} ({}). Processes and interpreter state were not saved. Start a sandbox from it with create_sandbox and from_snapshot: \"{}\".",
                            a.sandbox_id,
                            snap.id,
                            human_size(snap.size_bytes),
                            snap.id
                        ),
                        json!({"snapshot_id": snap.id, "sandbox_id": snap.sandbox_id, "template": snap.template, "size_bytes": snap.size_bytes, "created_at": snap.created_at, "memory": snap.memory}),
                    )
                })
            }
            "fork_sandbox" => {
                let a: ForkArgs = args(p)?;
                let mut metadata = a.metadata;
                metadata.insert("created_by".into(), MCP_MARK.into());
                let count = a.count.unwrap_or(1);
                if !(1..=16).contains(&count) {
                    return Err(McpError::invalid_params(
                        format!("count must be 1 to 16, not {count}."),
                        None,
                    ));
                }
                let forks = if count == 1 {
                    let opts = ForkOptions {
                        metadata: Some(metadata),
                        ttl_seconds: None,
                    };
                    c.fork(&a.sandbox_id, &opts)
                        .await
                        .map(|s| (None, vec![s.id]))
                } else {
                    c.fork_tree(&a.sandbox_id, count, Some(&metadata))
                        .await
                        .map(|t| {
                            (
                                Some(t.tree_id),
                                t.children.into_iter().map(|s| s.id).collect(),
                            )
                        })
                };
                forks.map(|(tree, ids)| {
                    let text = if ids.len() == 1 {
                        format!("Forked sandbox {} into {}: a new sandbox with a copy of its files and a fresh interpreter (run_code variables were not copied).", a.sandbox_id, ids[0])
                    } else {
                        format!("Forked sandbox {} into {} new sandboxes with copies of its files and fresh interpreters (run_code variables were not copied): {}.", a.sandbox_id, ids.len(), ids.join(", "))
                    };
                    ok(text, json!({"sandbox_id": a.sandbox_id, "forks": ids, "tree_id": tree}))
                })
            }
            other => {
                return Err(McpError::invalid_params(
                    format!("Unknown tool \"{other}\"."),
                    None,
                ))
            }
        };
        Ok(result.unwrap_or_else(tool_error))
    }
}

impl ServerHandler for RuncellMcp {
    fn get_info(&self) -> ServerInfo {
        ServerInfo::new(ServerCapabilities::builder().enable_tools().build())
            .with_server_info(Implementation::new("runcell", env!("CARGO_PKG_VERSION")))
            .with_instructions(
                "runcell runs code in isolated Linux sandboxes, with no network unless create_sandbox is given a network policy. run_code without a sandbox_id is stateless: a fresh sandbox per call. For work that builds up state, create_sandbox once and pass its sandbox_id to run_code, exec, read_file, write_file and list_files.",
            )
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, McpError> {
        Ok(ListToolsResult {
            tools: tools(),
            ..ListToolsResult::default()
        })
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, McpError> {
        let client = self.client(&context)?;
        self.dispatch(&client, &request).await
    }
}

/// Serves MCP over stdin/stdout until the client closes it.
pub async fn serve_stdio(server: RuncellMcp) -> Result<(), McpError> {
    use rmcp::ServiceExt;
    let running = server
        .serve(rmcp::transport::stdio())
        .await
        .map_err(|e| McpError::internal_error(format!("MCP start failed: {e}"), None))?;
    running
        .waiting()
        .await
        .map_err(|e| McpError::internal_error(format!("MCP stopped: {e}"), None))?;
    Ok(())
}

/// The streamable-HTTP service for a daemon at `url`: mount it at `/mcp`.
pub fn http_service(
    url: String,
    template: String,
) -> rmcp::transport::streamable_http_server::StreamableHttpService<
    RuncellMcp,
    rmcp::transport::streamable_http_server::session::local::LocalSessionManager,
> {
    use rmcp::transport::streamable_http_server::{
        session::local::LocalSessionManager, StreamableHttpServerConfig, StreamableHttpService,
    };
    let server = RuncellMcp::new(Backend::PerRequest { url }, template);
    StreamableHttpService::new(
        move || Ok(server.clone()),
        LocalSessionManager::default().into(),
        StreamableHttpServerConfig::default(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tools_have_object_schemas_and_state_their_persistence() {
        let t = tools();
        let names: Vec<&str> = t.iter().map(|t| t.name.as_ref()).collect();
        assert_eq!(
            names,
            [
                "run_code",
                "create_sandbox",
                "exec",
                "read_file",
                "write_file",
                "list_files",
                "list_sandboxes",
                "kill_sandbox",
                "snapshot_sandbox",
                "fork_sandbox"
            ]
        );
        for tool in &t {
            assert_eq!(tool.input_schema["type"], "object");
        }
        let run = t[0].description.as_deref().unwrap();
        assert!(run.contains("nothing persists") && run.contains("persist between calls"));
    }

    #[test]
    fn snapshot_and_fork_tools_say_what_they_do_not_copy() {
        let t = tools();
        let find = |n: &str| t.iter().find(|x| x.name == n).unwrap().clone();
        let snap = find("snapshot_sandbox");
        assert!(snap.description.as_deref().unwrap().contains("NOT saved"));
        assert_eq!(snap.input_schema["required"], json!(["sandbox_id"]));
        let fork = find("fork_sandbox");
        assert!(fork.description.as_deref().unwrap().contains("not copied"));
        assert_eq!(fork.input_schema["properties"]["count"]["maximum"], 16);
        let create = find("create_sandbox");
        assert!(create.input_schema["properties"]["from_snapshot"].is_object());
        assert_eq!(human_size(512), "512 bytes");
        assert_eq!(human_size(3 * 1024 * 1024 + 512 * 1024), "3.5 MiB");
    }

    #[test]
    fn long_text_keeps_its_head_and_tail_and_says_how_long_it_was() {
        assert_eq!(cap(&"x".repeat(MAX_TEXT)), "x".repeat(MAX_TEXT));
        let long = format!("HEAD{}TAIL", "x".repeat(3 * MAX_TEXT));
        let c = cap(&long);
        assert!(c.starts_with("HEAD") && c.ends_with("TAIL"), "{}", &c[..50]);
        assert!(c.contains(&format!("the whole output was {} characters", long.len())));
        assert!(c.chars().count() < MAX_TEXT + 200);
    }

    #[test]
    fn binary_files_come_back_as_images_or_typed_base64() {
        let png = file_result("/a.png", b"\x89PNG\r\n\x1a\n\0\0");
        let v = serde_json::to_value(&png).unwrap();
        assert_eq!(v["content"][1]["type"], "image");
        assert_eq!(v["content"][1]["mimeType"], "image/png");
        assert_eq!(v["isError"], false);
        let bin = serde_json::to_value(file_result("/a.bin", b"\0\xff\xfe")).unwrap();
        assert_eq!(bin["content"][1]["type"], "resource");
        assert_eq!(
            bin["content"][1]["resource"]["mimeType"],
            "application/octet-stream"
        );
        assert_eq!(bin["content"][1]["resource"]["blob"], "AP/+");
        let text = serde_json::to_value(file_result("/a.txt", "héllo".as_bytes())).unwrap();
        assert_eq!(text["content"][0]["text"], "héllo");
    }
}
