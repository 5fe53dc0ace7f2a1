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
  /** Passed through as `network`; the daemon may ignore it until egress policies land. */
  network?: unknown;
  /** Resource limits. */
  limits?: Limits;
  /** Environment variables for every exec and code context in the sandbox. */
  envs?: Record<string, string>;
  /** Exempt from the idle TTL (the daemon's maximum lifetime still applies). */
  persistent?: boolean;
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
  /** The daemon's JSON object as received (limits, persistent, network, ...). */
  raw: Record<string, unknown>;
}

/** A MIME bundle, e.g. `{"text/plain": "42"}` or `{"image/png": "<base64>"}`. */
export interface Result {
  [mime: string]: string;
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
  return info;
}

function toResults(items: unknown): Result[] {
  if (!Array.isArray(items)) return [];
  const out: Result[] = [];
  for (const item of items) {
    if (!item || typeof item !== "object") continue;
    const bundle: Result = {};
    for (const [mime, v] of Object.entries(item as Record<string, unknown>)) {
      bundle[mime] = typeof v === "string" ? v : JSON.stringify(v);
    }
    out.push(bundle);
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

const sleep = (ms: number) => new Promise<void>((resolve) => setTimeout(resolve, ms));

/** Creation is retried once on these: no answer, 5xx, 429. */
function transient(e: unknown): e is RuncellError {
  if (e instanceof ConnectionError || e instanceof CapacityError || e instanceof ServerError) return true;
  return e instanceof RuncellError && e.status !== undefined && (e.status >= 500 || e.status === 429);
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
    };
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
    language?: Language | { language?: Language; timeoutSeconds?: number },
  ): Promise<RunResult> {
    const o = typeof language === "string" ? { language } : (language ?? {});
    const lang = parseLanguage(o.language);
    const runOpts = o.timeoutSeconds === undefined ? {} : { timeoutSeconds: o.timeoutSeconds };
    const used = this.#defaultContext(lang);
    const ctx = await used;
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

  /** Runs a shell command (`/bin/sh -c`). A timeout is not thrown: it comes back with `timedOut: true`. */
  async exec(
    cmd: string,
    opts: { timeoutSeconds?: number; envs?: Record<string, string>; cwd?: string } = {},
  ): Promise<ExecResult> {
    const body: Record<string, unknown> = { cmd };
    if (opts.timeoutSeconds !== undefined) body.timeout_seconds = opts.timeoutSeconds;
    if (opts.envs !== undefined) body.env = opts.envs;
    if (opts.cwd !== undefined) body.cwd = opts.cwd;
    try {
      return toExecResult(
        await this.#client.json<ExecWire>("POST", `/sandboxes/${enc(this.id)}/exec`, {
          json: body,
          what: `run a command in sandbox ${this.id}`,
        }),
      );
    } catch (e) {
      const b = timeoutBody<ExecWire>(e);
      if (b) return toExecResult(b);
      throw e;
    }
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
  async runCode(code: string, opts: { timeoutSeconds?: number } = {}): Promise<RunResult> {
    const body: Record<string, unknown> = { code };
    if (opts.timeoutSeconds !== undefined) body.timeout_ms = Math.max(1, Math.round(opts.timeoutSeconds * 1000));
    try {
      return toRunResult(
        await this.#client.json<CellWire>("POST", `${this.#path}/run`, {
          json: body,
          what: `run code in ${this.language} context ${this.id} of sandbox ${this.sandboxId}`,
        }),
      );
    } catch (e) {
      const b = timeoutBody<CellWire>(e);
      if (b) return toRunResult(b);
      throw e;
    }
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
