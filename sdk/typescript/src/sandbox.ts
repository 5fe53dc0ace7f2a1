/**
 * Sandboxes and code contexts over runcell's `/v1` API.
 */

import { Client, type ConnectionOptions } from "./client.js";
import {
  CapacityError,
  ConnectionError,
  NotFoundError,
  RuncellError,
  ServerError,
} from "./errors.js";

// Node 18.18+ and 20 define Symbol.asyncDispose; older runtimes get the
// well-known registered symbol that TypeScript's `await using` helpers and
// other polyfills agree on.
if (typeof (Symbol as { asyncDispose?: symbol }).asyncDispose !== "symbol") {
  Object.defineProperty(Symbol, "asyncDispose", { value: Symbol.for("Symbol.asyncDispose") });
}

/** The interpreters a code context can run. */
export type Language = "python" | "javascript" | "bash";

/** runcell's per-sandbox limits; unset fields take the template's or the daemon's defaults. */
export interface Limits {
  /** Memory, MiB (files written in the sandbox count too); at least 16. */
  memoryMb?: number;
  /** CPU bandwidth, cores (0 < cpu <= 64). */
  cpu?: number;
  /** Processes and threads; at least 8. */
  pids?: number;
  /** Writable layer, MiB. */
  diskMb?: number;
  /** Default timeout of an exec or cell, seconds. */
  timeoutSeconds?: number;
  /** Bytes of each of stdout and stderr kept per exec or cell. */
  outputBytes?: number;
}

export interface SandboxCreateOptions extends ConnectionOptions {
  /** Template name; default: the daemon's default (`host`). */
  template?: string;
  /** Idle time-to-live in seconds; default: the daemon's (300 s). */
  ttlSeconds?: number;
  /** String labels, filterable with `Sandbox.list({ metadata })`. */
  metadata?: Record<string, string>;
  /**
   * Network egress policy: `"none"` (the default: loopback only), `"open"`,
   * or an allowlist `{ mode: "allowlist", allow: ["pypi.org", "*.example.com:443"], presets: ["package-index"] }`.
   */
  network?: NetworkPolicy;
  /** Resource limits. */
  limits?: Limits;
  /** Environment variables for every exec and code context in the sandbox. */
  envs?: Record<string, string>;
  /** Exempt from the idle TTL (the daemon's maximum lifetime still applies). */
  persistent?: boolean;
  /**
   * Isolation backend: `"jail"` (namespaces, seccomp, Landlock, cgroups; the fastest),
   * `"gvisor"` (runsc's user-space kernel) or `"microvm"` (a guest kernel). Default: the
   * template's, else the daemon's. One the host cannot run is a `BadRequestError` that says why
   * (`GET /v1/system` lists what runs).
   */
  isolation?: Isolation;
  /** Start with the files of this snapshot (`sb.snapshot()`); the template defaults to the snapshot's. */
  fromSnapshot?: string;
  /** Volumes to mount (`volumes.create` makes one); each at `/mnt/<name>` unless `path` says otherwise. */
  volumes?: VolumeMount[];
  /**
   * What happens once the sandbox has been idle for its TTL: `"delete"` (it and its files are gone)
   * or `"hibernate"` (its processes end, its files stay; the next call wakes it). Default: the
   * daemon's (`"hibernate"` for a persistent sandbox when it runs with `--idle-hibernate`, else `"delete"`).
   */
  onIdle?: OnIdle;
}

/** What the daemon does with a sandbox once it has been idle for its TTL. */
export type OnIdle = "delete" | "hibernate";

/** A volume to mount in a new sandbox. */
export interface VolumeMount {
  /** The volume's name. */
  name: string;
  /** Mount read-only (any number of sandboxes may); read-write is one sandbox at a time. */
  readOnly?: boolean;
  /** Where it appears in the sandbox; default `/mnt/<name>`. */
  path?: string;
}

/** A volume as mounted in a sandbox (`info.volumes`). */
export interface MountedVolume {
  name: string;
  path: string;
  readOnly: boolean;
}

/** A snapshot of a sandbox's files (not its processes or memory). */
export interface SnapshotInfo {
  id: string;
  /** The sandbox it was taken of. */
  sandboxId: string;
  workspace: string;
  /** The template of that sandbox (a sandbox created from the snapshot defaults to it). */
  template: string;
  /** RFC 3339. */
  createdAt: string;
  /** Bytes it takes on the daemon's disk. */
  sizeBytes: number;
  /** Whether memory was captured: always `false` with the jail, which snapshots files only. */
  memory: boolean;
}

/** A volume: storage that outlives the sandboxes it is mounted in (and daemon restarts). */
export interface VolumeInfo {
  name: string;
  /** Its size limit, MiB. */
  sizeMb: number;
  /** RFC 3339. */
  createdAt: string;
  usedBytes: number;
  /** Ids of the sandboxes it is mounted in. */
  attachedTo: string[];
}

/** Options of `sb.fork()`. */
export interface ForkOptions {
  /** Metadata of the fork. */
  metadata?: Record<string, string>;
  /** The fork's idle time-to-live, seconds. */
  ttlSeconds?: number;
}

/** What `sb.forkTree()` made. */
export interface ForkTree {
  /** Names the tree; every child's metadata has it as `fork_tree_id`. */
  treeId: string;
  /** The forks, each a `Sandbox` of its own. */
  children: Sandbox[];
}

/** What `sb.promote()` did. */
export interface PromoteResult {
  /** The promoted sandbox: independent from now on. */
  winner: string;
  treeId: string;
  /** Siblings deleted (with `cleanupSiblings`). */
  deleted: string[];
  /** Siblings that could not be deleted, with why. */
  failures: Record<string, string>;
}

/** Isolation backends: see `SandboxCreateOptions.isolation`. */
export type Isolation = "jail" | "gvisor" | "microvm";

/** Egress modes: `none` (loopback only), `allowlist` (only the listed hosts), `open`. */
export type NetworkMode = "none" | "allowlist" | "open";

/** A network policy: a mode, or an allowlist of host rules and presets. */
export type NetworkPolicy =
  | NetworkMode
  | {
      mode?: NetworkMode;
      /** Host rules: `pypi.org`, `*.example.com`, `api.example.com:443`. */
      allow?: string[];
      /** Named rule sets the daemon knows, e.g. `package-index`. */
      presets?: string[];
    };

/** A sandbox's network policy and its egress counters. */
export interface NetworkInfo {
  mode: NetworkMode;
  allow: string[];
  presets: string[];
  bytesIn: number;
  bytesOut: number;
  connectionsAllowed: number;
  connectionsRefused: number;
  /** The most recently refused host names. */
  refusedHosts: string[];
}

/** What the daemon says about a path (`files.stat`). */
export interface FileStat {
  name: string;
  isDir: boolean;
  /** `file`, `dir` or `symlink`. */
  type: "file" | "dir" | "symlink";
  size: number;
  /** Permission bits in octal, e.g. `"644"`. */
  permissions: string;
  /** Last modification, seconds since the epoch (as the daemon reports it). */
  mtime: number;
}

/** Callbacks and cancellation for a long call. */
export interface StreamOptions {
  /** Called with each piece of standard output as it arrives. */
  onStdout?: (chunk: string) => void;
  /** Called with each piece of standard error as it arrives. */
  onStderr?: (chunk: string) => void;
  /** runCode only: called with each rich result (a `display()`, a figure, the last expression's value) as the cell produces it. */
  onResult?: (result: Result) => void;
  /** Cancels the call: it rejects with the signal's reason. See the README for what keeps running. */
  signal?: AbortSignal;
}

/** What the daemon says about a sandbox. */
export interface SandboxInfo {
  id: string;
  template: string;
  metadata: Record<string, string>;
  status: string;
  /** RFC 3339. */
  createdAt: string;
  ttlSeconds?: number;
  /** The isolation backend it runs under (`jail`, `gvisor`, `microvm`). */
  isolation?: Isolation;
  /** What happens after the idle TTL (daemons before issue 14 do not say). */
  onIdle?: OnIdle;
  /** The snapshot it was created from. */
  fromSnapshot?: string;
  /** The sandbox it was forked from. */
  forkedFrom?: string;
  /** Volumes mounted in it. */
  volumes?: MountedVolume[];
  /** It was woken from hibernation: its code contexts (variables, imports) are gone. */
  stateLost?: boolean;
  /** The daemon's JSON object as received (limits, persistent, network, ...). */
  raw: Record<string, unknown>;
}

/** Shortcuts to the common MIME types of a result (absent when the bundle has no such type). */
export interface ResultAccessors {
  /** `text/plain`. */
  readonly text?: string;
  /** `text/html`. */
  readonly html?: string;
  /** `text/markdown`. */
  readonly markdown?: string;
  /** `image/png`, base64. */
  readonly png?: string;
  /** `image/jpeg`, base64. */
  readonly jpeg?: string;
  /** `image/svg+xml`. */
  readonly svg?: string;
  /** `application/json`, as text. */
  readonly json?: string;
  /** `text/latex`. */
  readonly latex?: string;
}

/**
 * A MIME bundle, e.g. `{"text/plain": "42"}` or `{"image/png": "<base64>"}`,
 * with shortcuts: `r.text`, `r.html`, `r.png`, ... (not enumerable, so the
 * object's keys and its JSON are the bundle's MIME types only).
 */
export type Result = { [mime: string]: string } & ResultAccessors;

const ACCESSORS: Record<keyof ResultAccessors, string> = {
  text: "text/plain",
  html: "text/html",
  markdown: "text/markdown",
  png: "image/png",
  jpeg: "image/jpeg",
  svg: "image/svg+xml",
  json: "application/json",
  latex: "text/latex",
};

function withAccessors(bundle: Record<string, string>): Result {
  for (const [name, mime] of Object.entries(ACCESSORS)) {
    Object.defineProperty(bundle, name, { get: () => bundle[mime], enumerable: false, configurable: true });
  }
  return bundle as Result;
}

/** Why a cell failed. */
export interface CellError {
  /** Exception class (`ZeroDivisionError`), or `TimeoutError`, or `InterpreterCrashed`. */
  name: string;
  /** Its message. */
  value: string;
  /** The traceback (may be empty). */
  traceback: string;
}

/** The outcome of a cell. */
export interface RunResult {
  stdout: string;
  stderr: string;
  exitCode: number;
  /** Rich results: the last expression's value, display() calls, matplotlib figures. */
  results: Result[];
  /** Set when the cell raised, timed out, or the interpreter died. */
  error?: CellError;
  /** The cell hit its timeout and was interrupted. */
  timedOut: boolean;
  /** Stdout or stderr was cut at the output limit (a marker line gives the total). */
  truncated: boolean;
  /** The interpreter was restarted (or replaced): earlier variables are gone. */
  stateLost: boolean;
  durationMs: number;
  /** Plain sentences from the daemon about limits hit, timeouts, crashes. */
  messages: string[];
}

/** The outcome of a shell command. */
export interface ExecResult {
  stdout: string;
  stderr: string;
  /** Exit status; 124 on a timeout, 128 + signal when killed. */
  exitCode: number;
  timedOut: boolean;
  truncated: boolean;
  durationMs: number;
  messages: string[];
}

export interface FileEntry {
  name: string;
  isDir: boolean;
  size: number;
}

/** File access inside a sandbox. Paths are absolute. */
export interface SandboxFiles {
  /** A file's contents as UTF-8 text. */
  read(path: string): Promise<string>;
  /** A file's contents as bytes. */
  readBytes(path: string): Promise<Uint8Array>;
  /** Creates or replaces a file (parent directories are created). */
  write(path: string, data: string | Uint8Array): Promise<void>;
  /** A directory's immediate entries. */
  list(path: string): Promise<FileEntry[]>;
  /** Whether the path exists (a file, directory or symlink). */
  exists(path: string): Promise<boolean>;
  /** What the daemon knows about the path; `NotFoundError` if it does not exist. */
  stat(path: string): Promise<FileStat>;
  /** Creates a directory and any missing parents; an existing directory is not an error. */
  mkdir(path: string): Promise<void>;
  /** Removes a file, or a directory with everything in it; a missing path is an error. */
  remove(path: string): Promise<void>;
  /** Renames or moves a file or directory; the destination's parent must exist. */
  rename(from: string, to: string): Promise<void>;
}

// ---- wire shapes -----------------------------------------------------------

interface SandboxWire {
  id: string;
  template?: string;
  metadata?: Record<string, string> | null;
  status?: string;
  created_at?: string;
  ttl_seconds?: number;
  [k: string]: unknown;
}

interface SessionWire {
  id: string;
  language?: string;
  created_at?: string;
  cells?: number;
}

interface CellWire {
  stdout?: string;
  stderr?: string;
  exit?: number;
  exit_code?: number;
  results?: unknown[];
  duration_ms?: number;
  error?: string;
  exception?: { name?: string; value?: string; traceback?: string } | null;
  timed_out?: boolean;
  state_lost?: boolean;
  crashed?: string | null;
  stdout_truncated?: boolean;
  stderr_truncated?: boolean;
  messages?: string[];
}

interface ExecWire {
  stdout?: string;
  stderr?: string;
  exit_code?: number;
  duration_ms?: number;
  timed_out?: boolean;
  stdout_truncated?: boolean;
  stderr_truncated?: boolean;
  messages?: string[];
  error?: string;
}

const enc = (s: string) => encodeURIComponent(s);

function toInfo(w: SandboxWire): SandboxInfo {
  const info: SandboxInfo = {
    id: w.id,
    template: typeof w.template === "string" ? w.template : "",
    metadata: w.metadata ?? {},
    status: typeof w.status === "string" ? w.status : "unknown",
    createdAt: typeof w.created_at === "string" ? w.created_at : "",
    raw: w,
  };
  if (typeof w.ttl_seconds === "number") info.ttlSeconds = w.ttl_seconds;
  if (w.isolation === "jail" || w.isolation === "gvisor" || w.isolation === "microvm") {
    info.isolation = w.isolation;
  }
  if (w.on_idle === "delete" || w.on_idle === "hibernate") info.onIdle = w.on_idle;
  if (typeof w.from_snapshot === "string") info.fromSnapshot = w.from_snapshot;
  if (typeof w.forked_from === "string") info.forkedFrom = w.forked_from;
  if (Array.isArray(w.volumes)) {
    info.volumes = (w.volumes as { name?: unknown; path?: unknown; read_only?: unknown }[]).map((v) => ({
      name: String(v.name ?? ""),
      path: String(v.path ?? ""),
      readOnly: v.read_only === true,
    }));
  }
  if (typeof w.state_lost === "boolean") info.stateLost = w.state_lost;
  return info;
}

interface SnapshotWire {
  id: string;
  sandbox_id?: string;
  workspace?: string;
  template?: string;
  created_at?: string;
  size_bytes?: number;
  memory?: boolean;
}

function toSnapshot(w: SnapshotWire): SnapshotInfo {
  return {
    id: w.id,
    sandboxId: String(w.sandbox_id ?? ""),
    workspace: String(w.workspace ?? ""),
    template: String(w.template ?? ""),
    createdAt: String(w.created_at ?? ""),
    sizeBytes: Number(w.size_bytes ?? 0),
    memory: w.memory === true,
  };
}

interface VolumeWire {
  name: string;
  size_mb?: number;
  created_at?: string;
  used_bytes?: number;
  attached_to?: string[];
}

function toVolume(w: VolumeWire): VolumeInfo {
  return {
    name: w.name,
    sizeMb: Number(w.size_mb ?? 0),
    createdAt: String(w.created_at ?? ""),
    usedBytes: Number(w.used_bytes ?? 0),
    attachedTo: Array.isArray(w.attached_to) ? w.attached_to.map(String) : [],
  };
}

function toResults(items: unknown): Result[] {
  if (!Array.isArray(items)) return [];
  const out: Result[] = [];
  for (const item of items) {
    if (!item || typeof item !== "object") continue;
    const bundle: Record<string, string> = {};
    for (const [mime, v] of Object.entries(item as Record<string, unknown>)) {
      bundle[mime] = typeof v === "string" ? v : JSON.stringify(v);
    }
    out.push(withAccessors(bundle));
  }
  return out;
}

/** A timeout answer (HTTP 500 with `timed_out: true`) carries the result fields. */
function timeoutBody<T extends { timed_out?: boolean; error?: string }>(e: unknown): T | undefined {
  if (!(e instanceof ServerError) || e.status !== 500) return undefined;
  const b = e.body as T | undefined;
  return b && typeof b === "object" && b.timed_out === true ? b : undefined;
}

function toRunResult(w: CellWire): RunResult {
  const messages = Array.isArray(w.messages) ? [...w.messages] : [];
  const timedOut = w.timed_out === true;
  let error: CellError | undefined;
  if (timedOut) {
    if (messages.length === 0 && w.error) messages.push(w.error);
    error = {
      name: "TimeoutError",
      value: messages[0] ?? w.error ?? "The cell timed out.",
      traceback: w.exception?.traceback ?? "",
    };
  } else if (w.exception) {
    error = {
      name: w.exception.name ?? "Error",
      value: w.exception.value ?? "",
      traceback: w.exception.traceback ?? w.error ?? "",
    };
  } else if (w.error) {
    error = { name: "InterpreterCrashed", value: w.crashed ?? w.error, traceback: w.error };
  }
  const r: RunResult = {
    stdout: w.stdout ?? "",
    stderr: w.stderr ?? "",
    exitCode: Number(w.exit ?? w.exit_code ?? 0),
    results: toResults(w.results),
    timedOut,
    truncated: w.stdout_truncated === true || w.stderr_truncated === true,
    stateLost: w.state_lost === true,
    durationMs: Number(w.duration_ms ?? 0),
    messages,
  };
  if (error) r.error = error;
  return r;
}

function toExecResult(w: ExecWire): ExecResult {
  const messages = Array.isArray(w.messages) ? [...w.messages] : [];
  const timedOut = w.timed_out === true;
  if (timedOut && messages.length === 0 && w.error) messages.push(w.error);
  return {
    stdout: w.stdout ?? "",
    stderr: w.stderr ?? "",
    exitCode: Number(w.exit_code ?? 0),
    timedOut,
    truncated: w.stdout_truncated === true || w.stderr_truncated === true,
    durationMs: Number(w.duration_ms ?? 0),
    messages,
  };
}

/** Quotes a string for /bin/sh as one word. */
export function shellQuote(s: string): string {
  return `'${s.replace(/'/g, `'\\''`)}'`;
}

function toNetworkInfo(w: Record<string, unknown> | undefined): NetworkInfo {
  const strs = (v: unknown) => (Array.isArray(v) ? v.map(String) : []);
  const num = (v: unknown) => (typeof v === "number" ? v : 0);
  const b = w ?? {};
  return {
    mode: (typeof b.mode === "string" ? b.mode : "none") as NetworkMode,
    allow: strs(b.allow),
    presets: strs(b.presets),
    bytesIn: num(b.bytes_in),
    bytesOut: num(b.bytes_out),
    connectionsAllowed: num(b.connections_allowed),
    connectionsRefused: num(b.connections_refused),
    refusedHosts: strs(b.refused_hosts),
  };
}

/** Reads a server-sent event stream, calling `on(event, data)` for each event. */
async function readSse(resp: Response, on: (event: string, data: string) => void): Promise<void> {
  if (!resp.body) return;
  const reader = resp.body.getReader();
  const dec = new TextDecoder("utf-8");
  let buf = "";
  let event = "message";
  let data: string[] = [];
  const line = (l: string) => {
    if (l === "") {
      if (data.length) on(event, data.join("\n"));
      event = "message";
      data = [];
    } else if (l.startsWith(":")) {
      // A comment (keep-alive).
    } else {
      const i = l.indexOf(":");
      const field = i < 0 ? l : l.slice(0, i);
      let value = i < 0 ? "" : l.slice(i + 1);
      if (value.startsWith(" ")) value = value.slice(1);
      if (field === "event") event = value;
      else if (field === "data") data.push(value);
    }
  };
  for (;;) {
    const { done, value } = await reader.read();
    buf += dec.decode(value ?? new Uint8Array(), { stream: !done });
    let nl: number;
    while ((nl = buf.search(/\r\n|\r|\n/)) >= 0) {
      const sep = buf.startsWith("\r\n", nl) ? 2 : 1;
      line(buf.slice(0, nl));
      buf = buf.slice(nl + sep);
    }
    if (done) break;
  }
  if (buf) line(buf);
  line("");
}

function parseLanguage(l: string | undefined): Language {
  switch ((l ?? "python").toLowerCase()) {
    case "python":
    case "python3":
    case "py":
      return "python";
    case "javascript":
    case "js":
    case "node":
    case "nodejs":
      return "javascript";
    case "bash":
    case "sh":
    case "shell":
      return "bash";
    default:
      // Let the daemon refuse it with its list of languages.
      return l as Language;
  }
}

function sessionGone(e: unknown): boolean {
  return e instanceof NotFoundError && (e.body as { error?: unknown } | undefined)?.error === "session not found";
}

/** Rejects with the signal's reason as soon as it aborts. */
function abortable<T>(p: Promise<T>, signal: AbortSignal | undefined): Promise<T> {
  if (!signal) return p;
  signal.throwIfAborted();
  return new Promise<T>((resolve, reject) => {
    const onAbort = () => reject(signal.reason);
    signal.addEventListener("abort", onAbort, { once: true });
    p.then(
      (v) => {
        signal.removeEventListener("abort", onAbort);
        resolve(v);
      },
      (e) => {
        signal.removeEventListener("abort", onAbort);
        reject(e);
      },
    );
  });
}

const sleep = (ms: number) => new Promise<void>((resolve) => setTimeout(resolve, ms));

/** Creation is retried once on these: no answer, 5xx (but a 507 quota), 429. */
function transient(e: unknown): e is RuncellError {
  if (e instanceof ConnectionError || e instanceof CapacityError || e instanceof ServerError) return true;
  return e instanceof RuncellError && e.status !== undefined && ((e.status >= 500 && e.status !== 507) || e.status === 429);
}

/** Longest Retry-After honoured before the one retry of a create. */
const MAX_RETRY_AFTER_MS = 3000;
/** Wait before the retry when the daemon gives no Retry-After. */
const DEFAULT_BACKOFF_MS = 250;

function backoffMs(e: RuncellError): number {
  if (e instanceof CapacityError && e.retryAfterSeconds !== undefined) {
    return Math.min(MAX_RETRY_AFTER_MS, Math.max(0, Math.round(e.retryAfterSeconds * 1000)));
  }
  return DEFAULT_BACKOFF_MS;
}

const CREATE = "create a sandbox";

function bothAttempts(first: RuncellError, second: RuncellError, waitedMs: number): RuncellError {
  const strip = (m: string) => m.replace(/^Could not create a sandbox: /, "");
  const message =
    `Could not create a sandbox after two attempts. First attempt: ${strip(first.message)} ` +
    `Second attempt, after waiting ${waitedMs} ms: ${strip(second.message)}`;
  const Ctor = second.constructor as new (
    message: string,
    options: { status?: number; body?: unknown; cause?: unknown; retryAfterSeconds?: number },
  ) => RuncellError;
  const opts: { status?: number; body?: unknown; cause?: unknown; retryAfterSeconds?: number } = { cause: first };
  if (second.status !== undefined) opts.status = second.status;
  if (second.body !== undefined) opts.body = second.body;
  if (second instanceof CapacityError && second.retryAfterSeconds !== undefined) {
    opts.retryAfterSeconds = second.retryAfterSeconds;
  }
  return new Ctor(message, opts);
}

function createBody(opts: SandboxCreateOptions): Record<string, unknown> {
  const body: Record<string, unknown> = {};
  if (opts.template !== undefined) body.template = opts.template;
  if (opts.ttlSeconds !== undefined) body.ttl_seconds = opts.ttlSeconds;
  if (opts.metadata !== undefined) body.metadata = opts.metadata;
  if (opts.network !== undefined) body.network = opts.network;
  if (opts.envs !== undefined) body.env = opts.envs;
  if (opts.persistent !== undefined) body.persistent = opts.persistent;
  if (opts.isolation !== undefined) body.isolation = opts.isolation;
  if (opts.fromSnapshot !== undefined) body.from_snapshot = opts.fromSnapshot;
  if (opts.onIdle !== undefined) body.on_idle = opts.onIdle;
  if (opts.volumes !== undefined) {
    body.volumes = opts.volumes.map((v) => {
      const m: Record<string, unknown> = { name: v.name };
      if (v.readOnly !== undefined) m.read_only = v.readOnly;
      if (v.path !== undefined) m.path = v.path;
      return m;
    });
  }
  if (opts.limits !== undefined) {
    const l = opts.limits;
    const limits: Record<string, number> = {};
    if (l.memoryMb !== undefined) limits.memory_mb = l.memoryMb;
    if (l.cpu !== undefined) limits.cpu = l.cpu;
    if (l.pids !== undefined) limits.pids = l.pids;
    if (l.diskMb !== undefined) limits.disk_mb = l.diskMb;
    if (l.timeoutSeconds !== undefined) limits.timeout_seconds = l.timeoutSeconds;
    if (l.outputBytes !== undefined) limits.output_bytes = l.outputBytes;
    body.limits = limits;
  }
  return body;
}

// ---- Sandbox ---------------------------------------------------------------

/** A runcell sandbox. Create one with `Sandbox.create`, find one with `Sandbox.get`. */
export class Sandbox {
  readonly id: string;
  /** What the daemon said about the sandbox when this object got it (`refresh()` updates it). */
  readonly info: SandboxInfo;
  /** File access (paths are absolute). */
  readonly files: SandboxFiles;

  readonly #client: Client;
  /** True when this object created the sandbox: it has no earlier contexts to find. */
  readonly #fresh: boolean;
  /** The code context `runCode` uses, per language. */
  readonly #contexts = new Map<Language, Promise<CodeContext>>();

  private constructor(client: Client, wire: SandboxWire, fresh: boolean) {
    this.#client = client;
    this.#fresh = fresh;
    this.info = toInfo(wire);
    this.id = this.info.id;
    const base = `/sandboxes/${enc(this.id)}`;
    const c = client;
    const id = this.id;
    this.files = {
      async read(path: string): Promise<string> {
        const resp = await c.request("GET", `${base}/fs`, { query: { path }, what: `read ${path} in sandbox ${id}` });
        return new TextDecoder("utf-8").decode(await resp.arrayBuffer());
      },
      async readBytes(path: string): Promise<Uint8Array> {
        const resp = await c.request("GET", `${base}/fs`, { query: { path }, what: `read ${path} in sandbox ${id}` });
        return new Uint8Array(await resp.arrayBuffer());
      },
      async write(path: string, data: string | Uint8Array): Promise<void> {
        const bytes = typeof data === "string" ? new TextEncoder().encode(data) : data;
        const resp = await c.request("PUT", `${base}/fs`, {
          query: { path },
          bytes,
          what: `write ${path} in sandbox ${id}`,
        });
        await resp.arrayBuffer();
      },
      async list(path: string): Promise<FileEntry[]> {
        const body = await c.json<{ entries?: { name?: string; is_dir?: boolean; size?: number }[] | null }>(
          "GET",
          `${base}/fs/dir`,
          { query: { path }, what: `list ${path} in sandbox ${id}` },
        );
        return (body.entries ?? []).map((e) => ({
          name: String(e.name ?? ""),
          isDir: e.is_dir === true,
          size: Number(e.size ?? 0),
        }));
      },
      async stat(path: string): Promise<FileStat> {
        const w = await c.json<{
          name?: string;
          is_dir?: boolean;
          size?: number;
          mode?: string;
          mtime?: number;
          permissions?: string;
        }>("GET", `${base}/fs/stat`, { query: { path }, what: `stat ${path} in sandbox ${id}` });
        return {
          name: String(w.name ?? ""),
          isDir: w.is_dir === true,
          type: w.mode === "d" ? "dir" : w.mode === "l" ? "symlink" : "file",
          size: Number(w.size ?? 0),
          permissions: String(w.permissions ?? ""),
          mtime: Number(w.mtime ?? 0),
        };
      },
      async exists(path: string): Promise<boolean> {
        try {
          const resp = await c.request("GET", `${base}/fs/stat`, { query: { path }, what: `stat ${path} in sandbox ${id}` });
          await resp.arrayBuffer();
          return true;
        } catch (e) {
          // A 404 about the path is "no"; one about the sandbox is an error.
          const said = String((e as { body?: { error?: unknown } }).body?.error ?? "");
          if (e instanceof NotFoundError && /file does not exist|no such file/i.test(said)) return false;
          throw e;
        }
      },
      // The API has no routes to remove, rename or make directories: these
      // run coreutils in the sandbox (as the sandbox user), every path quoted
      // as one shell word after `--`.
      mkdir: (path: string) => this.#fileOp(`mkdir -p -- ${shellQuote(path)}`, `make directory ${path}`),
      remove: (path: string) =>
        this.#fileOp(
          `if [ -e ${shellQuote(path)} ] || [ -L ${shellQuote(path)} ]; then rm -rf -- ${shellQuote(path)}; ` +
            `else echo "No such file or directory" >&2; exit 2; fi`,
          `remove ${path}`,
        ),
      rename: (from: string, to: string) =>
        this.#fileOp(`mv -T -- ${shellQuote(from)} ${shellQuote(to)}`, `rename ${from} to ${to}`),
    };
  }

  async #fileOp(cmd: string, what: string): Promise<void> {
    const r = await this.exec(cmd);
    if (r.exitCode !== 0) {
      const why = r.stderr.trim().replace(/^(mkdir|rm|mv): /, "") || `exit status ${r.exitCode}`;
      const Err = /No such file or directory/.test(why) ? NotFoundError : RuncellError;
      throw new Err(`Could not ${what} in sandbox ${this.id}: ${why}.`, { body: { error: why } });
    }
  }

  /**
   * Creates a sandbox. A transient failure (no answer, 5xx, 429) is retried
   * once after a short wait (the daemon's Retry-After up to 3 s, else 250 ms);
   * other 4xx answers are not retried.
   */
  static async create(opts: SandboxCreateOptions = {}): Promise<Sandbox> {
    const client = new Client(opts);
    const body = createBody(opts);
    const attempt = async () =>
      new Sandbox(client, await client.json<SandboxWire>("POST", "/sandboxes", { json: body, what: CREATE }), true);
    let first: RuncellError;
    try {
      return await attempt();
    } catch (e) {
      if (!transient(e)) throw e;
      first = e;
    }
    const wait = backoffMs(first);
    await sleep(wait);
    try {
      return await attempt();
    } catch (e) {
      if (!(e instanceof RuncellError)) throw e;
      throw bothAttempts(first, e, wait);
    }
  }

  /** Same as `Sandbox.get`: a handle on an existing sandbox, e.g. one another process created. */
  static connect(id: string, opts: ConnectionOptions = {}): Promise<Sandbox> {
    return Sandbox.get(id, opts);
  }

  /** Connects to an existing sandbox; `NotFoundError` if it is gone (or another workspace's). */
  static async get(id: string, opts: ConnectionOptions = {}): Promise<Sandbox> {
    const client = new Client(opts);
    const wire = await client.json<SandboxWire>("GET", `/sandboxes/${enc(id)}`, { what: `get sandbox ${id}` });
    return new Sandbox(client, wire, false);
  }

  /** The caller's sandboxes, optionally only those whose metadata has every given key=value. */
  static async list(opts: ConnectionOptions & { metadata?: Record<string, string> } = {}): Promise<SandboxInfo[]> {
    const client = new Client(opts);
    const query: Record<string, string> = {};
    for (const [k, v] of Object.entries(opts.metadata ?? {})) query[`metadata.${k}`] = v;
    const data = await client.json<SandboxWire[] | { items?: SandboxWire[] } | null>("GET", "/sandboxes", {
      query,
      what: "list sandboxes",
    });
    const items = Array.isArray(data) ? data : (data?.items ?? []);
    return items.map(toInfo);
  }

  /**
   * Runs code in this sandbox's code context for the language (default
   * python), creating it on first use and reusing it afterwards, so variables
   * and imports persist from one call to the next. After `Sandbox.get`, an
   * existing context of the language is found and reused. A cell timeout is
   * not thrown: it comes back with `timedOut: true`.
   */
  async runCode(
    code: string,
    language?: Language | ({ language?: Language; timeoutSeconds?: number } & StreamOptions),
  ): Promise<RunResult> {
    const o = typeof language === "string" ? { language } : (language ?? {});
    const lang = parseLanguage(o.language);
    const runOpts: { timeoutSeconds?: number } & StreamOptions = { ...o };
    delete (runOpts as { language?: Language }).language;
    const used = this.#defaultContext(lang);
    const ctx = await abortable(used, o.signal);
    try {
      return await ctx.runCode(code, runOpts);
    } catch (e) {
      // The context was closed behind our back: run in a new one and say the
      // earlier state is gone. Nothing ran in the missing context.
      if (!sessionGone(e)) throw e;
      if (this.#contexts.get(lang) === used) this.#contexts.delete(lang);
      const fresh = await this.#defaultContext(lang, true);
      const r = await fresh.runCode(code, runOpts);
      r.stateLost = true;
      r.messages.unshift(
        `The ${lang} code context ${ctx.id} was gone, so this ran in a new context (${fresh.id}); earlier state is lost.`,
      );
      return r;
    }
  }

  #defaultContext(language: Language, forceNew = false): Promise<CodeContext> {
    const cached = this.#contexts.get(language);
    if (cached) return cached;
    const p = (async () => {
      if (!this.#fresh && !forceNew) {
        const found = await this.#findContext(language);
        if (found) return found;
      }
      return this.createCodeContext(language);
    })();
    this.#contexts.set(language, p);
    const drop = () => {
      if (this.#contexts.get(language) === p) this.#contexts.delete(language);
    };
    p.then((ctx) => ctx._onClose(drop), drop);
    return p;
  }

  /** The oldest existing context of the language (the one earlier runCode calls made). */
  async #findContext(language: Language): Promise<CodeContext | undefined> {
    const sessions = await this.#client.json<SessionWire[]>("GET", `/sandboxes/${enc(this.id)}/repl/sessions`, {
      what: `list the code contexts of sandbox ${this.id}`,
    });
    const same = (Array.isArray(sessions) ? sessions : [])
      .filter((s) => parseLanguage(s.language) === language)
      .sort((a, b) => (a.created_at ?? "").localeCompare(b.created_at ?? "") || (b.cells ?? 0) - (a.cells ?? 0));
    const s = same[0];
    return s ? new CodeContext(this.#client, this.id, s.id, language) : undefined;
  }

  /**
   * Runs a shell command (`/bin/sh -c`). A timeout is not thrown: it comes
   * back with `timedOut: true`. With `onStdout` or `onStderr` the output is
   * streamed (`POST /exec/stream`) and each callback gets the text as it
   * arrives; the result still has all of it.
   */
  async exec(
    cmd: string,
    opts: { timeoutSeconds?: number; envs?: Record<string, string>; cwd?: string } & StreamOptions = {},
  ): Promise<ExecResult> {
    const body: Record<string, unknown> = { cmd };
    if (opts.timeoutSeconds !== undefined) body.timeout_seconds = opts.timeoutSeconds;
    if (opts.envs !== undefined) body.env = opts.envs;
    if (opts.cwd !== undefined) body.cwd = opts.cwd;
    const what = `run a command in sandbox ${this.id}`;
    if (opts.onStdout || opts.onStderr) return this.#execStream(body, opts, what);
    try {
      return toExecResult(
        await this.#client.json<ExecWire>("POST", `/sandboxes/${enc(this.id)}/exec`, {
          json: body,
          what,
          signal: opts.signal,
        }),
      );
    } catch (e) {
      const b = timeoutBody<ExecWire>(e);
      if (b) return toExecResult(b);
      throw e;
    }
  }

  async #execStream(body: Record<string, unknown>, opts: StreamOptions, what: string): Promise<ExecResult> {
    const started = Date.now();
    const resp = await this.#client.request("POST", `/sandboxes/${enc(this.id)}/exec/stream`, {
      json: body,
      what,
      signal: opts.signal,
      accept: "text/event-stream",
    });
    const r: ExecResult = {
      stdout: "",
      stderr: "",
      exitCode: -1,
      timedOut: false,
      truncated: false,
      durationMs: 0,
      messages: [],
    };
    let ended = false;
    try {
      await readSse(resp, (event, data) => {
        let d: Record<string, unknown> = {};
        try {
          d = JSON.parse(data) as Record<string, unknown>;
        } catch {
          return; // not one of the daemon's events (a keep-alive)
        }
        if (event === "stdout" || event === "stderr") {
          const chunk = typeof d.chunk === "string" ? d.chunk : "";
          r[event] += chunk;
          if (/\[runcell: (stdout|stderr) truncated/.test(chunk)) r.truncated = true;
          (event === "stdout" ? opts.onStdout : opts.onStderr)?.(chunk);
        } else if (event === "exit") {
          ended = true;
          r.exitCode = Number(d.exit_code ?? 0);
          if (d.oom_killed === true) r.messages.push("The command was killed: the sandbox ran out of memory.");
        } else if (event === "error") {
          ended = true;
          const msg = String(d.error ?? "the command failed");
          if (/timeout/i.test(msg)) {
            r.timedOut = true;
            r.exitCode = 124;
            r.messages.push(msg);
          } else {
            throw new ServerError(`Could not ${what}: ${msg}.`, { body: d });
          }
        }
      });
    } catch (e) {
      if (opts.signal?.aborted) throw opts.signal.reason;
      if (e instanceof RuncellError) throw e;
      throw new ConnectionError(`Could not ${what}: the output stream broke off (${String(e)}).`, { cause: e });
    }
    if (!ended) {
      throw new ConnectionError(`Could not ${what}: the output stream ended before the command's exit status.`);
    }
    r.durationMs = Date.now() - started;
    return r;
  }

  /** A new code context (a long-lived interpreter; default python). */
  async createCodeContext(language: Language = "python"): Promise<CodeContext> {
    const lang = parseLanguage(language);
    const s = await this.#client.json<SessionWire>("POST", `/sandboxes/${enc(this.id)}/repl/sessions`, {
      json: { language: lang },
      what: `create a ${lang} code context in sandbox ${this.id}`,
    });
    return new CodeContext(this.#client, this.id, s.id, parseLanguage(s.language ?? lang));
  }

  /**
   * Sets the sandbox's timeout: it is deleted after this many seconds without
   * activity (the idle TTL; same as `setTtl`).
   */
  async setTimeout(seconds: number): Promise<void> {
    await this.setTtl(seconds);
  }

  /** Re-reads the sandbox from the daemon and updates `info`; `NotFoundError` if it is gone. */
  async refresh(): Promise<SandboxInfo> {
    const wire = await this.#client.json<SandboxWire>("GET", `/sandboxes/${enc(this.id)}`, {
      what: `get sandbox ${this.id}`,
    });
    const fresh = toInfo(wire);
    const info = this.info as { -readonly [K in keyof SandboxInfo]: SandboxInfo[K] };
    delete info.ttlSeconds;
    Object.assign(info, fresh);
    return this.info;
  }

  /** The network policy and egress counters (from a fresh `GET` of the sandbox). */
  async getNetwork(): Promise<NetworkInfo> {
    const info = await this.refresh();
    return toNetworkInfo(info.raw.network as Record<string, unknown> | undefined);
  }

  /** Replaces the network policy (`PATCH /network`); takes effect for new connections. */
  async setNetwork(policy: NetworkPolicy): Promise<NetworkInfo> {
    const w = await this.#client.json<Record<string, unknown>>("PATCH", `/sandboxes/${enc(this.id)}/network`, {
      json: policy,
      what: `set the network policy of sandbox ${this.id}`,
    });
    this.info.raw.network = w;
    return toNetworkInfo(w);
  }

  /** Sets the idle time-to-live, in seconds. */
  async setTtl(seconds: number): Promise<void> {
    const body = await this.#client.json<{ ttl_seconds?: number }>(
      "PATCH",
      `/sandboxes/${enc(this.id)}/lifecycle`,
      { json: { ttl_seconds: seconds }, what: `set the TTL of sandbox ${this.id}` },
    );
    const ttl = typeof body.ttl_seconds === "number" ? body.ttl_seconds : seconds;
    this.info.ttlSeconds = ttl;
    this.info.raw.ttl_seconds = ttl;
  }

  /** A POST to one of the sandbox's lifecycle routes (answered 204). */
  async #lifecycle(route: string, what: string, status: string, json?: unknown): Promise<void> {
    const opts: { what: string; json?: unknown } = { what: `${what} sandbox ${this.id}` };
    if (json !== undefined) opts.json = json;
    const resp = await this.#client.request("POST", `/sandboxes/${enc(this.id)}/${route}`, opts);
    await resp.arrayBuffer();
    this.info.status = status;
    this.info.raw.status = status;
  }

  /**
   * Freezes the sandbox: its processes stop where they are, with their memory. Until `resume()`,
   * exec, file and code calls fail with a `ConflictError` ("Sandbox X is paused; resume it first.").
   * A sandbox that is not running is a `ConflictError` too.
   */
  async pause(): Promise<void> {
    await this.#lifecycle("pause", "pause", "paused");
  }

  /** Thaws a paused sandbox; one that is not paused is a `ConflictError`. */
  async resume(): Promise<void> {
    await this.#lifecycle("resume", "resume", "running");
  }

  /**
   * Ends the sandbox's processes and frees its memory; its files stay on disk. The next exec,
   * file or code call wakes it (or `wake()`), with fresh code contexts: `runCode` then says
   * `stateLost: true`. Hibernating a hibernated sandbox is not an error.
   */
  async hibernate(): Promise<void> {
    await this.#lifecycle("hibernate", "hibernate", "hibernated");
  }

  /** Starts a hibernated sandbox again (a running one is left alone). */
  async wake(): Promise<void> {
    await this.#lifecycle("wake", "wake", "running");
  }

  /** Snapshots the sandbox's files (not its processes); `Sandbox.create({ fromSnapshot: snap.id })` starts from them. */
  async snapshot(): Promise<SnapshotInfo> {
    return toSnapshot(
      await this.#client.json<SnapshotWire>("POST", `/sandboxes/${enc(this.id)}/snapshots`, {
        json: {},
        what: `snapshot sandbox ${this.id}`,
      }),
    );
  }

  /**
   * A new sandbox with a copy of this one's files (not its processes or code contexts);
   * its `info.forkedFrom` is this sandbox's id. This sandbox is left as it is.
   */
  async fork(opts: ForkOptions = {}): Promise<Sandbox> {
    const body: Record<string, unknown> = {};
    if (opts.metadata !== undefined) body.metadata = opts.metadata;
    if (opts.ttlSeconds !== undefined) body.ttl_seconds = opts.ttlSeconds;
    const w = await this.#client.json<SandboxWire>("POST", `/sandboxes/${enc(this.id)}/fork`, {
      json: body,
      what: `fork sandbox ${this.id}`,
    });
    return new Sandbox(this.#client, w, true);
  }

  /**
   * `count` forks (1 to 16) as one tree, to try alternatives side by side; keep the best with
   * `child.promote({ cleanupSiblings: true })`.
   */
  async forkTree(count: number, opts: { metadata?: Record<string, string> } = {}): Promise<ForkTree> {
    const body: Record<string, unknown> = { count };
    if (opts.metadata !== undefined) body.metadata = opts.metadata;
    const w = await this.#client.json<{ tree_id?: string; children?: SandboxWire[] }>(
      "POST",
      `/sandboxes/${enc(this.id)}/fork-tree`,
      { json: body, what: `fork sandbox ${this.id} ${count} times` },
    );
    return {
      treeId: String(w.tree_id ?? ""),
      children: (w.children ?? []).map((c) => new Sandbox(this.#client, c, true)),
    };
  }

  /**
   * Makes this fork the winner of its tree: it loses `fork_tree_id` and is independent from then on.
   * With `cleanupSiblings`, the tree's other children are deleted.
   */
  async promote(opts: { cleanupSiblings?: boolean; treeId?: string } = {}): Promise<PromoteResult> {
    const body: Record<string, unknown> = {};
    if (opts.cleanupSiblings !== undefined) body.cleanup_siblings = opts.cleanupSiblings;
    if (opts.treeId !== undefined) body.tree_id = opts.treeId;
    const w = await this.#client.json<{
      winner?: string;
      tree_id?: string;
      deleted?: string[];
      failures?: Record<string, string>;
    }>("POST", `/sandboxes/${enc(this.id)}/promote`, { json: body, what: `promote sandbox ${this.id}` });
    delete this.info.metadata.fork_tree_id;
    return {
      winner: String(w.winner ?? this.id),
      treeId: String(w.tree_id ?? ""),
      deleted: Array.isArray(w.deleted) ? w.deleted.map(String) : [],
      failures: w.failures ?? {},
    };
  }

  /** Deletes the sandbox; one that is already gone is not an error. */
  async kill(): Promise<void> {
    try {
      const resp = await this.#client.request("DELETE", `/sandboxes/${enc(this.id)}`, {
        what: `delete sandbox ${this.id}`,
      });
      await resp.arrayBuffer();
    } catch (e) {
      if (!(e instanceof NotFoundError)) throw e;
    }
    this.#contexts.clear();
  }

  /** `await using sb = await Sandbox.create()` deletes the sandbox at the end of the scope. */
  async [Symbol.asyncDispose](): Promise<void> {
    await this.kill();
  }
}

// ---- CodeContext -----------------------------------------------------------

/** A long-lived interpreter in a sandbox: state persists from one cell to the next. */
export class CodeContext {
  readonly id: string;
  readonly language: Language;
  readonly sandboxId: string;

  readonly #client: Client;
  #onClose: (() => void)[] = [];

  /** @internal Use `sandbox.createCodeContext()`. */
  constructor(client: Client, sandboxId: string, id: string, language: Language) {
    this.#client = client;
    this.sandboxId = sandboxId;
    this.id = id;
    this.language = language;
  }

  /** @internal */
  _onClose(f: () => void): void {
    this.#onClose.push(f);
  }

  get #path(): string {
    return `/sandboxes/${enc(this.sandboxId)}/repl/sessions/${enc(this.id)}`;
  }

  /** Runs a cell. A timeout is not thrown: it comes back with `timedOut: true` and `error.name` "TimeoutError". */
  async runCode(code: string, opts: { timeoutSeconds?: number } & StreamOptions = {}): Promise<RunResult> {
    const body: Record<string, unknown> = { code };
    if (opts.timeoutSeconds !== undefined) body.timeout_ms = Math.max(1, Math.round(opts.timeoutSeconds * 1000));
    if (opts.onStdout || opts.onStderr || opts.onResult) return this.#runStream(body, opts);
    let r: RunResult;
    try {
      r = toRunResult(
        await this.#client.json<CellWire>("POST", `${this.#path}/run`, {
          json: body,
          what: `run code in ${this.language} context ${this.id} of sandbox ${this.sandboxId}`,
          signal: opts.signal,
        }),
      );
    } catch (e) {
      const b = timeoutBody<CellWire>(e);
      if (!b) throw e;
      r = toRunResult(b);
    }
    return r;
  }

  /** A cell through `run/stream`: output and results reach the callbacks as the cell produces them. */
  async #runStream(body: Record<string, unknown>, opts: StreamOptions): Promise<RunResult> {
    const what = `run code in ${this.language} context ${this.id} of sandbox ${this.sandboxId}`;
    const resp = await this.#client.request("POST", `${this.#path}/run/stream`, {
      json: body,
      what,
      signal: opts.signal,
      accept: "text/event-stream",
    });
    let done: RunResult | undefined;
    try {
      await readSse(resp, (event, data) => {
        let d: Record<string, unknown>;
        try {
          d = JSON.parse(data) as Record<string, unknown>;
        } catch {
          return; // not one of the daemon's events (a keep-alive)
        }
        if (event === "stdout" || event === "stderr") {
          (event === "stdout" ? opts.onStdout : opts.onStderr)?.(typeof d.chunk === "string" ? d.chunk : "");
        } else if (event === "result") {
          const [result] = toResults([d]);
          if (result) opts.onResult?.(result);
        } else if (event === "done") {
          done = toRunResult(d as CellWire);
        } else if (event === "error") {
          throw new ServerError(`Could not ${what}: ${String(d.error ?? "the cell failed")}.`, { body: d });
        }
      });
    } catch (e) {
      if (opts.signal?.aborted) throw opts.signal.reason;
      if (e instanceof RuncellError) throw e;
      throw new ConnectionError(`Could not ${what}: the output stream broke off (${String(e)}).`, { cause: e });
    }
    if (!done) throw new ConnectionError(`Could not ${what}: the output stream ended before the cell's result.`);
    return done;
  }

  /** Restarts the interpreter: every variable and import is gone afterwards. */
  async restart(): Promise<void> {
    const resp = await this.#client.request("POST", `${this.#path}/restart`, {
      what: `restart ${this.language} context ${this.id} of sandbox ${this.sandboxId}`,
    });
    await resp.arrayBuffer();
  }

  /** Stops the interpreter; a context that is already gone is not an error. */
  async close(): Promise<void> {
    try {
      const resp = await this.#client.request("DELETE", this.#path, {
        what: `close ${this.language} context ${this.id} of sandbox ${this.sandboxId}`,
      });
      await resp.arrayBuffer();
    } catch (e) {
      if (!(e instanceof NotFoundError)) throw e;
    }
    const hooks = this.#onClose;
    this.#onClose = [];
    for (const f of hooks) f();
  }

  /** `await using ctx = await sb.createCodeContext()` closes it at the end of the scope. */
  async [Symbol.asyncDispose](): Promise<void> {
    await this.close();
  }
}

// ---- snapshots and volumes ---------------------------------------------------

/** The workspace's snapshots (take one with `sb.snapshot()`). */
export const snapshots = {
  /** Newest first; only those of `sandboxId` when given. */
  async list(opts: ConnectionOptions & { sandboxId?: string } = {}): Promise<SnapshotInfo[]> {
    const client = new Client(opts);
    const w = await client.json<{ snapshots?: SnapshotWire[] }>("GET", "/snapshots", {
      query: { sandbox_id: opts.sandboxId },
      what: "list snapshots",
    });
    return (w.snapshots ?? []).map(toSnapshot);
  },
  /** One snapshot; `NotFoundError` if there is none (or it is another workspace's). */
  async get(id: string, opts: ConnectionOptions = {}): Promise<SnapshotInfo> {
    const client = new Client(opts);
    return toSnapshot(await client.json<SnapshotWire>("GET", `/snapshots/${enc(id)}`, { what: `get snapshot ${id}` }));
  },
  /** Deletes a snapshot (sandboxes created from it keep their files). */
  async delete(id: string, opts: ConnectionOptions = {}): Promise<void> {
    const client = new Client(opts);
    const resp = await client.request("DELETE", `/snapshots/${enc(id)}`, { what: `delete snapshot ${id}` });
    await resp.arrayBuffer();
  },
};

/** The workspace's volumes: storage mounted into sandboxes that outlives them. */
export const volumes = {
  /**
   * Creates a volume of `sizeMb` MiB. The name is 1 to 63 of a-z, 0-9, `_` and `-`, starting with a
   * letter or digit; beyond the workspace's quota it is a `CapacityError` (429).
   */
  async create(name: string, opts: ConnectionOptions & { sizeMb: number }): Promise<VolumeInfo> {
    const client = new Client(opts);
    return toVolume(
      await client.json<VolumeWire>("POST", "/volumes", {
        json: { name, size_mb: opts.sizeMb },
        what: `create volume ${name}`,
      }),
    );
  },
  /** Every volume of the workspace. */
  async list(opts: ConnectionOptions = {}): Promise<VolumeInfo[]> {
    const client = new Client(opts);
    const w = await client.json<{ items?: VolumeWire[] }>("GET", "/volumes", { what: "list volumes" });
    return (w.items ?? []).map(toVolume);
  },
  /** One volume; `NotFoundError` if there is none. */
  async get(name: string, opts: ConnectionOptions = {}): Promise<VolumeInfo> {
    const client = new Client(opts);
    return toVolume(await client.json<VolumeWire>("GET", `/volumes/${enc(name)}`, { what: `get volume ${name}` }));
  },
  /** Deletes a volume and its data; while a sandbox mounts it, a `ConflictError` (409). */
  async delete(name: string, opts: ConnectionOptions = {}): Promise<void> {
    const client = new Client(opts);
    const resp = await client.request("DELETE", `/volumes/${enc(name)}`, { what: `delete volume ${name}` });
    await resp.arrayBuffer();
  },
};
