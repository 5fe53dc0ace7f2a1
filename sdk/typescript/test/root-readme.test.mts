// The repository README's examples run against the live daemon, as written,
// so the front page cannot drift from the product:
// - `console` blocks are shell transcripts (see `runTranscript`): every
//   command runs with this checkout's `runcell` first on PATH and
//   RUNCELL_URL/RUNCELL_API_KEY naming the test daemon, and must exit and
//   print as shown. The `runcell serve` transcript starts a second daemon
//   on a free port and a fresh data directory (the README's 127.0.0.1:7070
//   and /var/lib/runcell are mapped to them).
// - `js`/`ts` blocks run with the published `@pandastack/sdk` (installed in
//   tests/clients by scripts/test-sdk.sh) and this checkout's `runcell` SDK.
// - `json` blocks with `mcpServers` are MCP client configurations: each
//   server is started as configured and must answer `initialize` and list
//   the `run_code` tool.
// Every other block must be `text` (a synopsis, not an example) or say
// `no-run` with its reason.
import { test } from "node:test";
import assert from "node:assert/strict";
import { spawnSync } from "node:child_process";
import { existsSync, mkdirSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";
import { fencedBlocks, runBlock, runTranscript, transcriptSteps, showsInOrder, type Block } from "./readme.mjs";
import { KEY, URL_, freePort } from "./helpers.mjs";

const sdk = join(dirname(fileURLToPath(import.meta.url)), "..", "..");
const repo = join(sdk, "..", "..");
const readme = join(repo, "README.md");
const text = readFileSync(readme, "utf8");
const blocks = fencedBlocks(text);
const bin = join(repo, "target", "debug");
const clients = join(repo, "tests", "clients");

const RUN = new Set(["console", "js", "javascript", "ts", "typescript", "json"]);

test("every README block is run, a synopsis (`text`), or marked no-run with a reason", () => {
  const run = blocks.filter((b) => RUN.has(b.lang) && !/\bno-run\b/.test(b.info));
  assert.ok(run.filter((b) => b.lang === "console").length >= 5, "too few console transcripts");
  assert.ok(run.filter((b) => b.lang !== "console" && b.lang !== "json").length >= 3, "too few js/ts examples");
  for (const b of blocks) {
    if (RUN.has(b.lang) && !/\bno-run\b/.test(b.info)) continue;
    if (b.lang === "text") continue;
    assert.match(b.info, /\bno-run\b\s+\S+/, `README.md line ${b.line}: a \`${b.lang || "(no language)"}\` block that is neither run nor marked \`no-run <reason>\``);
  }
});

function fixtures(): string {
  const dir = mkdtempSync(join(tmpdir(), "readme-fixtures-"));
  writeFileSync(join(dir, "script.sh"), "echo \"hello from $0\"\n");
  writeFileSync(join(dir, "data.csv"), "a,b\n1,2\n3,4\n");
  mkdirSync(join(dir, "project", "src"), { recursive: true });
  writeFileSync(join(dir, "project", "README"), "a project\n");
  writeFileSync(join(dir, "project", "src", "main.py"), "print('main')\n");
  return dir;
}

const env = {
  PATH: `${bin}:${process.env.PATH ?? ""}`,
  RUNCELL_URL: URL_,
  RUNCELL_API_KEY: KEY,
  PANDASTACK_API: URL_,
  PANDASTACK_API_KEY: KEY,
};

for (const block of blocks.filter((b) => b.lang === "console" && !/\bno-run\b/.test(b.info))) {
  const first = transcriptSteps(block)[0]?.command ?? "";
  test(`README.md line ${block.line}: $ ${first.slice(0, 60)}`, { timeout: 300_000 }, async () => {
    assert.ok(existsSync(join(bin, "runcell")), `${bin}/runcell is missing: build the workspace first`);
    const cwd = fixtures();
    const data = mkdtempSync("/run/runcell-readme-serve.");
    const port = await freePort();
    // Only a transcript that starts a daemon gets that daemon's settings.
    const serves = transcriptSteps(block).some((s) => /^runcell serve\b/.test(s.command));
    const daemon = { RUNCELL_LISTEN: `127.0.0.1:${port}`, RUNCELL_DATA_DIR: data, RUNCELL_AUTO_BUILD: "false" };
    try {
      const r = runTranscript(block, {
        cwd,
        env: { ...env, ...(serves ? daemon : {}) },
        substitutions: { "127.0.0.1:7070": `127.0.0.1:${port}`, "/var/lib/runcell": data },
        background: /^runcell serve\b/,
        timeoutMs: 290_000,
      });
      assert.ok(r.ok, `README.md line ${block.line}:\n${r.failures.join("\n")}\n--- what ran:\n${r.outputs.join("\n")}\n${r.stderr}`);
    } finally {
      rmSync(cwd, { recursive: true, force: true });
      rmSync(data, { recursive: true, force: true });
    }
  });
}

for (const block of blocks.filter((b) => ["js", "javascript", "ts", "typescript"].includes(b.lang) && !/\bno-run\b/.test(b.info))) {
  const title = block.code.split("\n").find((l) => l.trim() && !l.startsWith("import")) ?? "";
  test(`README.md line ${block.line}: ${title.trim().slice(0, 60)}`, { timeout: 180_000 }, () => {
    assert.ok(existsSync(join(clients, "node_modules", "@pandastack", "sdk")), "tests/clients has no @pandastack/sdk: run `npm ci` there");
    const r = runBlock(block, {
      languages: ["ts"],
      imports: { runcell: join(sdk, "dist", "esm", "index.js") },
      parent: clients,
      timeoutMs: 170_000,
      env,
    });
    assert.ok(r.ok, `the example at README.md line ${block.line} failed (exit ${r.status}):\n${r.stderr}\n--- stdout:\n${r.stdout}`);
  });
}

interface McpServer {
  command: string;
  args?: string[];
  env?: Record<string, string>;
  url?: string;
}

function mcpConfigs(b: Block): [string, McpServer][] {
  const parsed = JSON.parse(b.code) as { mcpServers?: Record<string, McpServer> };
  assert.ok(parsed.mcpServers, `README.md line ${b.line}: a json block without mcpServers`);
  return Object.entries(parsed.mcpServers);
}

for (const block of blocks.filter((b) => b.lang === "json" && !/\bno-run\b/.test(b.info))) {
  test(`README.md line ${block.line}: the MCP configuration starts a server that lists run_code`, { timeout: 60_000 }, () => {
    for (const [name, server] of mcpConfigs(block)) {
      assert.match(server.command, /\/runcell$/, `${name}: the command is not runcell`);
      const serverEnv: Record<string, string> = {};
      for (const [k, v] of Object.entries(server.env ?? {})) {
        serverEnv[k] = v === "<the key>" ? KEY : v === "http://127.0.0.1:7070" ? URL_ : v;
      }
      const lines = [
        { jsonrpc: "2.0", id: 1, method: "initialize", params: { protocolVersion: "2025-03-26", capabilities: {}, clientInfo: { name: "readme", version: "1" } } },
        { jsonrpc: "2.0", method: "notifications/initialized" },
        { jsonrpc: "2.0", id: 2, method: "tools/list" },
      ];
      // The configured path is where an install puts runcell; this run uses the checkout's build.
      const r = spawnSync(join(bin, "runcell"), server.args ?? [], {
        input: lines.map((l) => JSON.stringify(l)).join("\n") + "\n",
        encoding: "utf8",
        timeout: 30_000,
        env: { PATH: env.PATH, ...serverEnv },
      });
      assert.equal(r.status, 0, `${name}: ${server.command} ${server.args?.join(" ")} exited ${r.status}: ${r.stderr}`);
      const replies = r.stdout.split("\n").filter((l) => l.trim()).map((l) => JSON.parse(l) as { id?: number; result?: { tools?: { name: string }[] } });
      const tools = replies.find((m) => m.id === 2)?.result?.tools?.map((t) => t.name) ?? [];
      assert.ok(tools.includes("run_code"), `${name}: tools/list answered ${JSON.stringify(tools)}`);
    }
  });
}

test("the transcript runner fails a wrong output or status and maps README literals", () => {
  const md = "```console\n$ echo 42\n41\n$ x=5\n$ echo $x; (exit 3)   # exit status 3\n5\n$ echo at 127.0.0.1:7070\nat 127.0.0.1:7070\n```\n";
  const [b] = fencedBlocks(md);
  const cwd = mkdtempSync(join(tmpdir(), "readme-self-"));
  try {
    const r = runTranscript(b!, { cwd, substitutions: { "127.0.0.1:7070": "127.0.0.1:1" } });
    assert.equal(r.ok, false);
    assert.equal(r.failures.length, 2, r.failures.join("\n"));
    assert.match(r.failures[0]!, /did not print "41"/);
    assert.match(r.failures[1]!, /did not print "at 127.0.0.1:1"/);
  } finally {
    rmSync(cwd, { recursive: true, force: true });
  }
  assert.equal(showsInOrder(["a", "x b y", "c"], ["a", "x ... y", "c"]), null);
  assert.equal(showsInOrder(["c", "a"], ["a", "c"]), "c");
});

test("a background command of a transcript is stopped with everything it started", () => {
  const cwd = mkdtempSync(join(tmpdir(), "readme-self-"));
  try {
    // The server's own child records its pid: it must be gone afterwards.
    const md = "```console\n$ srv-like sh -c 'sleep 300 & echo $! > child; echo ready; wait'\nready\n$ echo after\nafter\n```\n";
    const [b] = fencedBlocks(md);
    writeFileSync(join(cwd, "srv-like"), '#!/bin/sh\nexec "$@"\n', { mode: 0o755 });
    const r = runTranscript(b!, { cwd, background: /^srv-like\b/, env: { PATH: `${cwd}:${process.env.PATH ?? ""}` } });
    assert.ok(r.ok, r.failures.join("\n") + r.outputs.join("\n") + r.stderr);
    const child = Number(readFileSync(join(cwd, "child"), "utf8").trim());
    assert.ok(child > 1, "the background command did not start its child");
    let alive = true;
    for (let i = 0; i < 50 && alive; i++) {
      try {
        process.kill(child, 0);
        spawnSync("sleep", ["0.1"]);
      } catch {
        alive = false;
      }
    }
    assert.equal(alive, false, `pid ${child}, started by the background command, outlived the transcript`);
  } finally {
    rmSync(cwd, { recursive: true, force: true });
  }
});
