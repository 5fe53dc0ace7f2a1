/**
 * The HTTP layer: where the daemon is, which key to send, and how a failed
 * answer becomes a typed error. Uses the global `fetch` (Node >= 18), nothing else.
 */

import {
  AuthError,
  BadRequestError,
  CapacityError,
  ConflictError,
  ConnectionError,
  NotFoundError,
  QuotaError,
  RuncellError,
  ServerError,
} from "./errors.js";

/** Where the daemon is and how to authenticate. */
export interface ConnectionOptions {
  /** Base URL of the daemon. Default: env `RUNCELL_URL`, else `http://127.0.0.1:7070`. */
  apiUrl?: string;
  /** API key. Default: env `RUNCELL_API_KEY`, else the contents of `/var/lib/runcell/api-key` if readable. */
  apiKey?: string;
}

/** The key file `runcell serve` writes with its default data directory. */
export const DEFAULT_KEY_FILE = "/var/lib/runcell/api-key";
/** The daemon's default listen address. */
export const DEFAULT_URL = "http://127.0.0.1:7070";

function env(name: string): string | undefined {
  const p = (globalThis as { process?: { env?: Record<string, string | undefined> } }).process;
  const v = p?.env?.[name];
  return v === undefined || v === "" ? undefined : v;
}

async function readKeyFile(path: string): Promise<string | undefined> {
  try {
    const fs = await import("node:fs/promises");
    const text = (await fs.readFile(path, "utf8")).trim();
    return text === "" ? undefined : text;
  } catch {
    // Not readable, absent, or not running on Node: no key.
    return undefined;
  }
}

export type Query = Record<string, string | undefined>;

export interface RequestOptions {
  query?: Query;
  /** A JSON body (sent with Content-Type: application/json). */
  json?: unknown;
  /** A raw body (sent with Content-Type: application/octet-stream). */
  bytes?: Uint8Array;
  /** What this request does, for error messages ("create a sandbox"). */
  what: string;
  /** Cancels the request: the call rejects with the signal's reason (an `AbortError` by default). */
  signal?: AbortSignal | undefined;
  /** Accept header (default application/json). */
  accept?: string;
}

/** One daemon connection: base URL and a lazily resolved key. */
export class Client {
  readonly apiUrl: string;
  private readonly explicitKey: string | undefined;
  private keyPromise: Promise<string | undefined> | undefined;

  constructor(opts: ConnectionOptions = {}) {
    let url = opts.apiUrl ?? env("RUNCELL_URL") ?? DEFAULT_URL;
    url = url.replace(/\/+$/, "");
    if (url.endsWith("/v1")) url = url.slice(0, -3);
    this.apiUrl = url;
    this.explicitKey = opts.apiKey ?? env("RUNCELL_API_KEY");
  }

  private apiKey(): Promise<string | undefined> {
    if (this.explicitKey !== undefined) return Promise.resolve(this.explicitKey);
    this.keyPromise ??= readKeyFile(DEFAULT_KEY_FILE);
    return this.keyPromise;
  }

  url(path: string, query?: Query): string {
    let u = `${this.apiUrl}/v1${path}`;
    if (query) {
      const q = new URLSearchParams();
      for (const [k, v] of Object.entries(query)) if (v !== undefined) q.append(k, v);
      const s = q.toString();
      if (s) u += `?${s}`;
    }
    return u;
  }

  /** Sends a request; resolves with the Response on 2xx, throws a typed error otherwise. */
  async request(method: string, path: string, opts: RequestOptions): Promise<Response> {
    const headers: Record<string, string> = { Accept: opts.accept ?? "application/json" };
    const key = await this.apiKey();
    if (key) headers["Authorization"] = `Bearer ${key}`;
    let body: string | Uint8Array | undefined;
    if (opts.json !== undefined) {
      headers["Content-Type"] = "application/json";
      body = JSON.stringify(opts.json);
    } else if (opts.bytes !== undefined) {
      headers["Content-Type"] = "application/octet-stream";
      body = opts.bytes;
    }
    const url = this.url(path, opts.query);
    let resp: Response;
    try {
      opts.signal?.throwIfAborted();
      const init: RequestInit = { method, headers };
      if (body !== undefined) init.body = body as NonNullable<RequestInit["body"]>;
      if (opts.signal) init.signal = opts.signal;
      resp = await globalThis.fetch(url, init);
    } catch (e) {
      // A cancelled call rejects with the signal's reason, not a ConnectionError.
      if (opts.signal?.aborted) throw opts.signal.reason;
      throw new ConnectionError(
        `Could not ${opts.what}: no answer from the runcell daemon at ${this.apiUrl} (${describeFetchFailure(e)}).`,
        { cause: e },
      );
    }
    if (resp.ok) return resp;
    throw await errorFromResponse(resp, opts.what, this.apiUrl);
  }

  /** A request whose 2xx answer is JSON. */
  async json<T>(method: string, path: string, opts: RequestOptions): Promise<T> {
    const resp = await this.request(method, path, opts);
    let text: string;
    try {
      text = await resp.text();
    } catch (e) {
      if (opts.signal?.aborted) throw opts.signal.reason;
      throw e;
    }
    try {
      return JSON.parse(text) as T;
    } catch (e) {
      throw new ServerError(
        `Could not ${opts.what}: the runcell daemon answered HTTP ${resp.status} with a body that is not JSON: ${snippet(text)}.`,
        { status: resp.status, body: text, cause: e },
      );
    }
  }
}

function snippet(text: string): string {
  const t = text.trim();
  return t.length > 200 ? `${t.slice(0, 200)}…` : t || "(empty)";
}

/** The most specific reason a fetch failed (Node puts it in `cause`). */
export function describeFetchFailure(e: unknown): string {
  const parts: string[] = [];
  let cur: unknown = e;
  for (let depth = 0; cur && depth < 4; depth++) {
    const c = cur as { message?: unknown; code?: unknown; cause?: unknown };
    const msg = typeof c.message === "string" ? c.message : String(cur);
    if (msg && !parts.includes(msg)) parts.push(msg);
    cur = c.cause;
  }
  return parts.join(": ") || "unknown error";
}

/** Parses Retry-After (seconds or an HTTP date) into seconds. */
function retryAfter(resp: Response): number | undefined {
  const h = resp.headers.get("retry-after");
  if (h === null) return undefined;
  const n = Number(h.trim());
  if (Number.isFinite(n) && n >= 0) return n;
  const t = Date.parse(h);
  if (!Number.isNaN(t)) return Math.max(0, (t - Date.now()) / 1000);
  return undefined;
}

/** Builds the typed error for a non-2xx answer. */
export async function errorFromResponse(resp: Response, what: string, apiUrl: string): Promise<RuncellError> {
  const status = resp.status;
  let text = "";
  try {
    text = await resp.text();
  } catch {
    // The body could not be read; the status still says enough.
  }
  let body: unknown = text;
  let daemonError = "";
  try {
    body = JSON.parse(text);
    const b = body as { error?: unknown; detail?: unknown; message?: unknown };
    if (typeof b.error === "string") daemonError = b.error;
    else if (typeof b.message === "string") daemonError = b.message;
    if (typeof b.detail === "string" && b.detail) daemonError += daemonError ? ` (${b.detail})` : b.detail;
  } catch {
    daemonError = text.trim().slice(0, 500);
  }
  const said = daemonError ? `: ${daemonError}` : "";
  const opts = { status, body };
  if (status === 401 || status === 403) {
    return new AuthError(
      `Could not ${what}: the runcell daemon at ${apiUrl} refused the API key (HTTP ${status}${said}). ` +
        `Pass apiKey, set RUNCELL_API_KEY, or make ${DEFAULT_KEY_FILE} readable.`,
      opts,
    );
  }
  if (status === 404) return new NotFoundError(`Could not ${what}: not found (HTTP 404${said}).`, opts);
  if (status === 400 || status === 413) {
    return new BadRequestError(`Could not ${what}: the request was refused (HTTP ${status}${said}).`, opts);
  }
  if (status === 503 || status === 429) {
    const after = retryAfter(resp);
    const hint = after === undefined ? "" : ` Retry after ${after} s.`;
    return new CapacityError(
      `Could not ${what}: the runcell daemon has no capacity (HTTP ${status}${said}).${hint}`,
      after === undefined ? opts : { ...opts, retryAfterSeconds: after },
    );
  }
  if (status === 409) return new ConflictError(`Could not ${what}: conflict (HTTP 409${said}).`, opts);
  if (status === 507) {
    return new QuotaError(`Could not ${what}: the workspace's disk quota is used up (HTTP 507${said}).`, opts);
  }
  if (status >= 500) return new ServerError(`Could not ${what}: the runcell daemon failed (HTTP ${status}${said}).`, opts);
  return new RuncellError(`Could not ${what}: HTTP ${status}${said}.`, opts);
}
