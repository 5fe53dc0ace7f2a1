// runcell's MCP server through the official MCP client SDK
// (@modelcontextprotocol/sdk): `runcell mcp` over stdio, and the daemon's
// /mcp endpoint over streamable HTTP. Run by scripts/test-clients.sh, which
// starts the daemon and exports PANDASTACK_API / PANDASTACK_API_KEY.
import { test } from "node:test";
import assert from "node:assert/strict";
import path from "node:path";
import { Client } from "@modelcontextprotocol/sdk/client/index.js";
import { StdioClientTransport } from "@modelcontextprotocol/sdk/client/stdio.js";
import { StreamableHTTPClientTransport } from "@modelcontextprotocol/sdk/client/streamableHttp.js";

const API = process.env.PANDASTACK_API;
const KEY = process.env.PANDASTACK_API_KEY;
assert.ok(API && KEY, "PANDASTACK_API and PANDASTACK_API_KEY must be set (scripts/test-clients.sh does)");
const RUNCELL = path.resolve("target/debug/runcell");

const PLOT = "import matplotlib.pyplot as plt\nplt.figure(figsize=(3, 2), dpi=50)\nplt.plot([1, 3, 2])\nprint('plotted')";

function pngSize(b64) {
  const png = Buffer.from(b64, "base64");
  assert.equal(png.subarray(1, 4).toString(), "PNG");
  return [png.readUInt32BE(16), png.readUInt32BE(20)];
}

async function sandboxes() {
  const r = await fetch(`${API}/v1/sandboxes`, { headers: { Authorization: `Bearer ${KEY}` } });
  return r.json();
}

async function stdioClient() {
  const transport = new StdioClientTransport({
    command: RUNCELL,
    args: ["mcp", "--template", "host"],
    env: { ...process.env, RUNCELL_URL: API, RUNCELL_API_KEY: KEY },
    stderr: "inherit",
  });
  const client = new Client({ name: "runcell-test", version: "1.0.0" });
  await client.connect(transport);
  return client;
}

async function httpClient(key = KEY) {
  const transport = new StreamableHTTPClientTransport(new URL(`${API}/mcp`), {
    requestInit: { headers: { Authorization: `Bearer ${key}` } },
  });
  const client = new Client({ name: "runcell-test", version: "1.0.0" });
  await client.connect(transport);
  return client;
}

function text(result) {
  return result.content.filter((c) => c.type === "text").map((c) => c.text).join("\n");
}

test("stdio: tools are listed with descriptions that say whether state persists", async () => {
  const client = await stdioClient();
  try {
    const { tools } = await client.listTools();
    assert.deepEqual(
      tools.map((t) => t.name),
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
        "fork_sandbox",
      ],
    );
    const run = tools.find((t) => t.name === "run_code");
    assert.match(run.description, /nothing persists/);
    assert.match(run.description, /persist between calls/);
    assert.deepEqual(run.inputSchema.required, ["code"]);
  } finally {
    await client.close();
  }
});

test("stdio: run_code in a fresh sandbox returns output, a plot as an image, and leaves nothing", async () => {
  const before = (await sandboxes()).length;
  const client = await stdioClient();
  try {
    const r = await client.callTool({ name: "run_code", arguments: { code: PLOT + "\n6 * 7" } });
    assert.ok(!r.isError, text(r));
    assert.match(text(r), /plotted/);
    assert.match(text(r), /result: 42/);
    const images = r.content.filter((c) => c.type === "image");
    assert.equal(images.length, 1);
    assert.equal(images[0].mimeType, "image/png");
    assert.deepEqual(pngSize(images[0].data), [150, 100]);
    assert.equal(r.structuredContent.exit_code, 0);
    assert.deepEqual(r.structuredContent.results, ["42"]);

    const e = await client.callTool({ name: "run_code", arguments: { code: "1 / 0" } });
    assert.equal(e.isError, true);
    assert.match(text(e), /ZeroDivisionError/);
    const js = await client.callTool({ name: "run_code", arguments: { code: "[1, 2].map((x) => x * 2)", language: "javascript" } });
    assert.match(text(js), /\[ 2, 4 \]/);
    assert.equal((await sandboxes()).length, before, "run_code left a sandbox behind");
  } finally {
    await client.close();
  }
});

test("stdio: a sandbox from create_sandbox keeps state across run_code, exec and files", async () => {
  const client = await stdioClient();
  try {
    const c = await client.callTool({ name: "create_sandbox", arguments: { template: "host", isolation: "jail", metadata: { threadId: "mcp-1" } } });
    const id = c.structuredContent.sandbox_id;
    assert.ok(id);
    assert.equal(c.structuredContent.isolation, "jail");
    await client.callTool({ name: "run_code", arguments: { code: "total = 40", sandbox_id: id } });
    const r = await client.callTool({ name: "run_code", arguments: { code: "total + 2", sandbox_id: id } });
    assert.deepEqual(r.structuredContent.results, ["42"]);
    const w = await client.callTool({ name: "write_file", arguments: { sandbox_id: id, path: "/tmp/note.txt", content: "hello mcp" } });
    assert.ok(!w.isError, text(w));
    const x = await client.callTool({ name: "exec", arguments: { sandbox_id: id, command: "cat /tmp/note.txt; exit 3" } });
    assert.equal(x.structuredContent.stdout, "hello mcp");
    assert.equal(x.structuredContent.exit_code, 3);
    assert.equal(x.isError, true);
    const f = await client.callTool({ name: "read_file", arguments: { sandbox_id: id, path: "/tmp/note.txt" } });
    assert.equal(text(f), "hello mcp");
    const l = await client.callTool({ name: "list_sandboxes", arguments: { metadata: { threadId: "mcp-1" } } });
    assert.deepEqual(l.structuredContent.sandboxes.map((s) => s.sandbox_id), [id]);
    const k = await client.callTool({ name: "kill_sandbox", arguments: { sandbox_id: id } });
    assert.ok(!k.isError);
    const gone = await client.callTool({ name: "exec", arguments: { sandbox_id: id, command: "true" } });
    assert.equal(gone.isError, true);
    // A killed sandbox answers why and when it ended (its tombstone), as a 404.
    assert.match(text(gone), new RegExp(`sandbox ${id} was deleted at .*HTTP 404`));
  } finally {
    await client.close();
  }
});

// Every parameter, nested ones included, says what it is for.
function undescribed(schema, where) {
  const out = [];
  for (const [name, p] of Object.entries(schema.properties ?? {})) {
    if (!p.description) out.push(`${where}.${name}`);
    for (const alt of p.oneOf ?? []) if (alt.type === "object") out.push(...undescribed(alt, `${where}.${name}`));
    if (p.type === "object" && p.properties) out.push(...undescribed(p, `${where}.${name}`));
  }
  return out;
}

test("stdio: every parameter is described, list_files exists, kill_sandbox is destructive", async () => {
  const client = await stdioClient();
  try {
    const { tools } = await client.listTools();
    assert.deepEqual(tools.flatMap((t) => undescribed(t.inputSchema, t.name)), []);
    const kill = tools.find((t) => t.name === "kill_sandbox");
    assert.equal(kill.annotations?.destructiveHint, true);
    assert.equal(tools.find((t) => t.name === "read_file").annotations?.readOnlyHint, true);
    assert.ok(tools.find((t) => t.name === "list_files"));
    const create = tools.find((t) => t.name === "create_sandbox");
    assert.ok(create.inputSchema.properties.network, "create_sandbox takes a network policy");
  } finally {
    await client.close();
  }
});

test("stdio: snapshot_sandbox saves files for create_sandbox's from_snapshot; fork_sandbox copies files, not variables", async () => {
  const client = await stdioClient();
  const made = [];
  let snapshot;
  try {
    const { tools } = await client.listTools();
    assert.match(tools.find((t) => t.name === "snapshot_sandbox").description, /NOT saved/);
    assert.match(tools.find((t) => t.name === "fork_sandbox").description, /not copied/);
    const c = await client.callTool({ name: "create_sandbox", arguments: { template: "host" } });
    const id = c.structuredContent.sandbox_id;
    made.push(id);
    await client.callTool({ name: "write_file", arguments: { sandbox_id: id, path: "/home/user/state.txt", content: "v1" } });
    await client.callTool({ name: "run_code", arguments: { sandbox_id: id, code: "x = 1" } });

    const s = await client.callTool({ name: "snapshot_sandbox", arguments: { sandbox_id: id } });
    assert.ok(!s.isError, text(s));
    snapshot = s.structuredContent.snapshot_id;
    assert.equal(s.structuredContent.sandbox_id, id);
    assert.equal(s.structuredContent.memory, false);
    assert.match(text(s), new RegExp(`from_snapshot: "${snapshot}"`));
    const fromSnap = await client.callTool({ name: "create_sandbox", arguments: { from_snapshot: snapshot } });
    assert.ok(!fromSnap.isError, text(fromSnap));
    made.push(fromSnap.structuredContent.sandbox_id);
    const read = await client.callTool({ name: "read_file", arguments: { sandbox_id: fromSnap.structuredContent.sandbox_id, path: "/home/user/state.txt" } });
    assert.equal(text(read).trim().endsWith("v1"), true, text(read));

    const f = await client.callTool({ name: "fork_sandbox", arguments: { sandbox_id: id } });
    assert.ok(!f.isError, text(f));
    const [fork] = f.structuredContent.forks;
    made.push(fork);
    const r = await client.callTool({ name: "run_code", arguments: { sandbox_id: fork, code: "print('x' in globals(), open('/home/user/state.txt').read())" } });
    assert.match(text(r), /False v1/);
    const tree = await client.callTool({ name: "fork_sandbox", arguments: { sandbox_id: id, count: 2 } });
    assert.ok(!tree.isError, text(tree));
    assert.equal(tree.structuredContent.forks.length, 2);
    assert.ok(tree.structuredContent.tree_id);
    made.push(...tree.structuredContent.forks);
    // The forks are MCP's: list_sandboxes shows them.
    const mine = (await client.callTool({ name: "list_sandboxes", arguments: {} })).structuredContent.sandboxes.map((x) => x.sandbox_id);
    for (const m of made) assert.ok(mine.includes(m), `${m} is not listed`);
    const bad = await client.callTool({ name: "fork_sandbox", arguments: { sandbox_id: "no-such-sandbox" } });
    assert.equal(bad.isError, true);
    assert.match(text(bad), /404/);
  } finally {
    for (const m of made) await client.callTool({ name: "kill_sandbox", arguments: { sandbox_id: m } });
    if (snapshot) await fetch(`${API}/v1/snapshots/${snapshot}`, { method: "DELETE", headers: { Authorization: `Bearer ${KEY}` } });
    await client.close();
  }
});

test("stdio: binary files come back as images or typed base64, directories as listings", async () => {
  const client = await stdioClient();
  try {
    const c = await client.callTool({ name: "create_sandbox", arguments: { template: "host" } });
    const id = c.structuredContent.sandbox_id;
    const png = Buffer.concat([Buffer.from("89504e470d0a1a0a", "hex"), Buffer.from([0, 0, 0, 13, 0xff, 0xfe, 0x80])]);
    const bin = Buffer.from([0, 1, 2, 0xff, 0xfe, 0x80, 0x81]);
    const make = `python3 -c "import sys; open('/tmp/d/out.png','wb').write(bytes.fromhex('${png.toString("hex")}')); open('/tmp/d/blob.bin','wb').write(bytes.fromhex('${bin.toString("hex")}'))"`;
    const x = await client.callTool({ name: "exec", arguments: { sandbox_id: id, command: `mkdir -p /tmp/d/sub && ${make}` } });
    assert.ok(!x.isError, text(x));

    const r = await client.callTool({ name: "read_file", arguments: { sandbox_id: id, path: "/tmp/d/out.png" } });
    assert.ok(!r.isError, text(r));
    const images = r.content.filter((c) => c.type === "image");
    assert.equal(images.length, 1);
    assert.equal(images[0].mimeType, "image/png");
    assert.deepEqual(Buffer.from(images[0].data, "base64"), png);

    const b = await client.callTool({ name: "read_file", arguments: { sandbox_id: id, path: "/tmp/d/blob.bin" } });
    assert.ok(!b.isError, text(b));
    const res = b.content.find((c) => c.type === "resource");
    assert.ok(res, JSON.stringify(b.content));
    assert.equal(res.resource.mimeType, "application/octet-stream");
    assert.deepEqual(Buffer.from(res.resource.blob, "base64"), bin);

    const l = await client.callTool({ name: "list_files", arguments: { sandbox_id: id, path: "/tmp/d" } });
    assert.ok(!l.isError, text(l));
    const entries = Object.fromEntries(l.structuredContent.entries.map((e) => [e.name, e]));
    assert.equal(entries.sub.is_dir, true);
    assert.equal(entries["out.png"].size, png.length);
    assert.match(text(l), /sub\//);
    await client.callTool({ name: "kill_sandbox", arguments: { sandbox_id: id } });
  } finally {
    await client.close();
  }
});

test("stdio: list_sandboxes shows MCP's sandboxes unless asked for all; create_sandbox takes a network policy", async () => {
  const r = await fetch(`${API}/v1/sandboxes`, {
    method: "POST",
    headers: { Authorization: `Bearer ${KEY}`, "Content-Type": "application/json" },
    body: JSON.stringify({ template: "host" }),
  });
  assert.equal(r.status, 201);
  const other = (await r.json()).id;
  const client = await stdioClient();
  try {
    const c = await client.callTool({ name: "create_sandbox", arguments: { template: "host", network: "open" } });
    assert.ok(!c.isError, text(c));
    const id = c.structuredContent.sandbox_id;
    const info = await (await fetch(`${API}/v1/sandboxes/${id}`, { headers: { Authorization: `Bearer ${KEY}` } })).json();
    assert.equal(info.network.mode, "open");
    const bad = await client.callTool({ name: "create_sandbox", arguments: { template: "host", network: { mode: "sometimes" } } });
    assert.equal(bad.isError, true);
    assert.match(text(bad), /network|mode/i);

    const mine = (await client.callTool({ name: "list_sandboxes", arguments: {} })).structuredContent.sandboxes.map((s) => s.sandbox_id);
    assert.ok(mine.includes(id));
    assert.ok(!mine.includes(other), "list_sandboxes listed a sandbox not created through MCP");
    const all = (await client.callTool({ name: "list_sandboxes", arguments: { all: true } })).structuredContent.sandboxes.map((s) => s.sandbox_id);
    assert.ok(all.includes(id) && all.includes(other));
    await client.callTool({ name: "kill_sandbox", arguments: { sandbox_id: id } });
  } finally {
    await client.close();
    await fetch(`${API}/v1/sandboxes/${other}`, { method: "DELETE", headers: { Authorization: `Bearer ${KEY}` } });
  }
});

test("stdio: a timeout says one true thing and exits 124; long output keeps head and tail", async () => {
  const client = await stdioClient();
  try {
    const t = await client.callTool({ name: "run_code", arguments: { code: "while True: pass", timeout_seconds: 1 } });
    assert.equal(t.isError, true);
    assert.equal(t.structuredContent.exit_code, 124);
    assert.match(text(t), /exit code: 124/);
    assert.match(text(t), /timed out/);
    assert.doesNotMatch(text(t), /state is kept/, "a destroyed fresh sandbox keeps no state");

    const c = await client.callTool({ name: "create_sandbox", arguments: { template: "host" } });
    const id = c.structuredContent.sandbox_id;
    const x = await client.callTool({ name: "exec", arguments: { sandbox_id: id, command: "sleep 10", timeout_seconds: 1 } });
    assert.equal(x.structuredContent.exit_code, 124);
    const long = await client.callTool({
      name: "exec",
      arguments: { sandbox_id: id, command: "echo FIRST; head -c 100000 /dev/zero | tr '\\0' x; echo; echo LAST" },
    });
    const out = long.structuredContent.stdout;
    assert.ok(out.startsWith("FIRST"), out.slice(0, 40));
    assert.ok(out.trimEnd().endsWith("LAST"), out.slice(-40));
    assert.match(out, /100\d{3} characters/);
    await client.callTool({ name: "kill_sandbox", arguments: { sandbox_id: id } });
  } finally {
    await client.close();
  }
});

test("http: /mcp lists the tools and run_code returns a plot as an image", async () => {
  const client = await httpClient();
  try {
    const { tools } = await client.listTools();
    assert.equal(tools.length, 10);
    // The daemon's tools default to the code-interpreter template, which is
    // an alias of host unless a template of that name is installed.
    const r = await client.callTool({ name: "run_code", arguments: { code: PLOT } });
    assert.ok(!r.isError, text(r));
    const images = r.content.filter((c) => c.type === "image");
    assert.equal(images.length, 1);
    assert.deepEqual(pngSize(images[0].data), [150, 100]);
    const t = await client.callTool({ name: "run_code", arguments: { code: "while True: pass", timeout_seconds: 1 } });
    assert.equal(t.isError, true);
    assert.match(text(t), /timed out/);
  } finally {
    await client.close();
  }
});

test("http: /mcp refuses a missing or bad key", async () => {
  const r = await fetch(`${API}/mcp`, {
    method: "POST",
    headers: { "Content-Type": "application/json", Accept: "application/json, text/event-stream" },
    body: JSON.stringify({ jsonrpc: "2.0", id: 1, method: "initialize", params: { protocolVersion: "2025-06-18", capabilities: {}, clientInfo: { name: "x", version: "1" } } }),
  });
  assert.equal(r.status, 401);
  await assert.rejects(httpClient("not-a-key"));
});
