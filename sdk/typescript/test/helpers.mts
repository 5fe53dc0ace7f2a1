// Shared test helpers. The tests run against a live daemon named by
// RUNCELL_URL and RUNCELL_API_KEY (scripts/test-sdk.sh sets both); without
// them the suite fails rather than skips.
import http from "node:http";
import net from "node:net";
import { NotFoundError, Sandbox, type SandboxCreateOptions } from "runcell";

export const URL_ = process.env.RUNCELL_URL ?? "";
export const KEY = process.env.RUNCELL_API_KEY ?? "";
if (!URL_ || !KEY) {
  throw new Error("RUNCELL_URL and RUNCELL_API_KEY must name a running daemon (scripts/test-sdk.sh sets them)");
}

/** The real fetch, captured before any test wraps globalThis.fetch. */
const realFetch = globalThis.fetch;

/** Every sandbox a test file creates is killed when the file ends, even if a test fails. */
const created: Sandbox[] = [];
export async function newSandbox(opts: SandboxCreateOptions = {}): Promise<Sandbox> {
  const sb = await Sandbox.create({ template: "host", ttlSeconds: 600, metadata: { suite: "runcell-sdk" }, ...opts });
  created.push(sb);
  return sb;
}
/** Sandboxes created through a fake daemon, killed through the real one. */
const createdIds: string[] = [];
export function track(sb: Sandbox): Sandbox {
  createdIds.push(sb.id);
  return sb;
}
export async function killAll(): Promise<void> {
  await Promise.all(created.splice(0).map((sb) => sb.kill()));
  await Promise.all(
    createdIds.splice(0).map(async (id) => {
      try {
        await (await Sandbox.get(id, { apiUrl: URL_ })).kill();
      } catch (e) {
        if (!(e instanceof NotFoundError)) throw e;
      }
    }),
  );
}

/** A loopback port nothing listens on (yet). */
export function freePort(): Promise<number> {
  return new Promise((resolve, reject) => {
    const s = net.createServer();
    s.once("error", reject);
    s.listen(0, "127.0.0.1", () => {
      const { port } = s.address() as net.AddressInfo;
      s.close(() => resolve(port));
    });
  });
}

export interface Seen {
  method: string;
  path: string;
}

/**
 * An HTTP server on loopback that answers each request with `respond(n, req)`
 * (n counts from 1) or, when that returns undefined, forwards it to the daemon.
 */
export async function fakeDaemon(
  respond: (n: number, seen: Seen) => { status: number; headers?: Record<string, string>; body: unknown } | undefined,
  port = 0,
): Promise<{ url: string; seen: Seen[]; close: () => Promise<void> }> {
  const seen: Seen[] = [];
  const server = http.createServer(async (req, res) => {
    const chunks: Buffer[] = [];
    for await (const c of req) chunks.push(c as Buffer);
    const s = { method: req.method ?? "", path: req.url ?? "" };
    seen.push(s);
    const canned = respond(seen.length, s);
    if (canned) {
      res.writeHead(canned.status, { "content-type": "application/json", ...canned.headers });
      res.end(JSON.stringify(canned.body));
      return;
    }
    const headers: Record<string, string> = {};
    for (const h of ["authorization", "content-type", "accept"]) {
      const v = req.headers[h];
      if (typeof v === "string") headers[h] = v;
    }
    const body = Buffer.concat(chunks);
    const init: RequestInit = { method: req.method ?? "GET", headers };
    if (body.length > 0) init.body = body;
    const up = await realFetch(`${URL_}${req.url}`, init);
    const out = Buffer.from(await up.arrayBuffer());
    res.writeHead(up.status, { "content-type": up.headers.get("content-type") ?? "application/json" });
    res.end(out);
  });
  await new Promise<void>((resolve, reject) => {
    server.once("error", reject);
    server.listen(port, "127.0.0.1", () => resolve());
  });
  const { port: actual } = server.address() as net.AddressInfo;
  return {
    url: `http://127.0.0.1:${actual}`,
    seen,
    close: () =>
      new Promise<void>((resolve) => {
        server.close(() => resolve());
        server.closeAllConnections();
      }),
  };
}
