// Drives a running runcell daemon through the published PandaStack JS SDK
// (@pandastack/sdk, pinned in package.json), unchanged.
//
// Needs PANDASTACK_API (a loopback URL, e.g. http://127.0.0.1:PORT) and
// PANDASTACK_API_KEY in the environment; scripts/test-clients.sh starts the
// daemon and sets both. Run: node --test tests/clients/
//
// Wire contract: shared/pandastack-api.md. SDK facts these tests rely on:
// - Sandbox.create(opts?, config?) sends template "ubuntu-24.04" when none is
//   given; runCode(code, language = "shell"), so Python needs "python";
//   execStream(cmd, {onStdout, onStderr, timeoutSeconds}) resolves to the exit
//   code; filesystem.read returns a UTF-8 string.
// - Error classes are named exports: AuthError (401/403), NotFoundError (404),
//   BadRequestError (other 4xx), ServerError (5xx), SandboxTimeout (a 5xx
//   whose message has "timeout"), NetworkError (transport), CommandError
//   (exec check: true). All extend PandaStackError and carry statusCode.

import { test } from "node:test";
import assert from "node:assert/strict";
import {
  AuthError,
  BadRequestError,
  Client,
  CommandError,
  NotFoundError,
  PandaStackError,
  Sandbox,
  SandboxTimeout,
} from "@pandastack/sdk";

const API = process.env.PANDASTACK_API;
const KEY = process.env.PANDASTACK_API_KEY;
if (!API || !KEY) {
  throw new Error(
    "PANDASTACK_API and PANDASTACK_API_KEY must be set to a running runcell daemon " +
      "(scripts/test-clients.sh does this); refusing to run without them",
  );
}
// Never let a misconfigured environment send these tests to a real service.
const apiHost = new URL(API).hostname;
if (!/^(127\.\d+\.\d+\.\d+|localhost|\[::1\])$/.test(apiHost)) {
  throw new Error(`PANDASTACK_API must point at loopback, got ${API}`);
}
const ORIGIN = API.replace(/\/+$/, "").replace(/\/v1$/, "");

const UUID_RE = /^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$/i;
const T = { timeout: 90_000 };
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

/** Creates a sandbox through the SDK and deletes it when the test ends. */
async function createSandbox(t, opts = { template: "host" }, config) {
  const sb = await Sandbox.create(opts, config);
  t.after(async () => {
    try {
      await sb.kill();
    } catch (err) {
      if (!(err instanceof NotFoundError)) throw err;
    }
  });
  return sb;
}

/** Plain HTTP to the daemon, for runcell extensions and wire-level checks. */
async function raw(method, path, { key = KEY, body, headers = {} } = {}) {
  const h = { ...headers };
  if (key) h.authorization = `Bearer ${key}`;
  if (body !== undefined) h["content-type"] = "application/json";
  const res = await fetch(new URL(path, ORIGIN + "/"), {
    method,
    headers: h,
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  const text = await res.text();
  let json;
  try {
    json = text ? JSON.parse(text) : undefined;
  } catch {
    json = undefined;
  }
  return { status: res.status, contentType: res.headers.get("content-type") ?? "", text, json };
}

function assertJsonError(r, status) {
  assert.equal(r.status, status, `expected HTTP ${status}, got ${r.status}: ${r.text}`);
  assert.match(r.contentType, /application\/json/, `error body must be JSON, got ${r.contentType}`);
  assert.equal(typeof r.json?.error, "string", `error body needs a string "error": ${r.text}`);
  assert.ok(r.json.error.length > 0, "error message must not be empty");
}

// ---------------------------------------------------------------- service

test("GET /healthz answers 200 without auth", T, async () => {
  const r = await raw("GET", "/healthz", { key: null });
  assert.equal(r.status, 200);
});

// ---------------------------------------------------------------- create

test("Sandbox.create with template 'host', ttlSeconds and metadata", T, async (t) => {
  const sb = await createSandbox(t, {
    template: "host",
    ttlSeconds: 600,
    metadata: { suite: "ts-sdk", case: "create" },
  });
  assert.match(sb.id, UUID_RE);
  assert.equal(sb.template, "host");
  assert.equal(sb.status, "running");
  // The server may add keys (PandaStack stamps "workspace"); ours must be there.
  assert.equal(sb.info.metadata?.suite, "ts-sdk");
  assert.equal(sb.info.metadata?.case, "create");
  const life = await sb.lifecycle();
  assert.equal(life.ttl_seconds, 600);
  assert.equal(life.persistent, false);
  const r = await sb.exec("echo ready");
  assert.equal(r.stdout, "ready\n");
});

test("Sandbox.create with no options uses the SDK default template (ubuntu-24.04 alias)", T, async (t) => {
  const sb = await createSandbox(t, undefined);
  assert.match(sb.id, UUID_RE);
  assert.equal(sb.status, "running");
  // The alias resolves to host; whether the daemon echoes the alias or the
  // resolved name is its choice.
  assert.ok(["ubuntu-24.04", "host"].includes(sb.template), `template: ${sb.template}`);
  const r = await sb.exec("python3 -c 'print(1+1)'");
  assert.equal(r.stdout, "2\n");
  assert.equal(r.exitCode, 0);
});

test("Sandbox.create with the code-interpreter alias (the Python SDK's default)", T, async (t) => {
  const sb = await createSandbox(t, { template: "code-interpreter" });
  assert.match(sb.id, UUID_RE);
  assert.ok(["code-interpreter", "host"].includes(sb.template), `template: ${sb.template}`);
});

test("Sandbox.create with persistent: true is reflected by lifecycle()", T, async (t) => {
  const sb = await createSandbox(t, { template: "host", persistent: true });
  const life = await sb.lifecycle();
  assert.equal(life.persistent, true);
});

test("unknown template -> BadRequestError naming the installed templates", T, async () => {
  const err = await Sandbox.create({ template: "no-such-template-xyz" }).then(
    () => assert.fail("create with an unknown template succeeded"),
    (e) => e,
  );
  assert.ok(err instanceof BadRequestError, `expected BadRequestError, got ${err?.name}: ${err?.message}`);
  assert.equal(err.statusCode, 400);
  assert.match(err.message, /\bhost\b/, `message should list installed templates: ${err.message}`);
});

// ---------------------------------------------------------------- exec

test("runCode python prints 42; shell is the default language", T, async (t) => {
  const sb = await createSandbox(t);
  const py = await sb.runCode("x = 6 * 7\nprint(x)", "python");
  assert.equal(py.stdout, "42\n");
  assert.equal(py.stderr, "");
  assert.equal(py.exitCode, 0);
  assert.equal(py.exit_code, 0);
  const sh = await sb.runCode("echo $((6 * 7))");
  assert.equal(sh.stdout, "42\n");
  const js = await sb.exec("node -e 'console.log(6 * 7)'");
  assert.equal(js.stdout, "42\n");
});

test("exec returns stdout, stderr and exitCode; a non-zero exit is not an error", T, async (t) => {
  const sb = await createSandbox(t);
  const r = await sb.exec("echo out; echo err >&2; exit 3");
  assert.equal(r.stdout, "out\n");
  assert.equal(r.stderr, "err\n");
  assert.equal(r.exitCode, 3);
  assert.equal(r.exit_code, 3);

  const ok = await sb.exec("true");
  assert.equal(ok.exitCode, 0);

  // Runs through a shell: pipes, variables and redirections work.
  const piped = await sb.exec("printf 'b\\na\\n' | sort | tr -d '\\n'; X=5; echo \" $X\"");
  assert.equal(piped.stdout, "ab 5\n");

  const uni = await sb.exec("echo 'héllo ✓'");
  assert.equal(uni.stdout, "héllo ✓\n");

  // check: true is enforced by the SDK from exit_code.
  const err = await sb.exec("exit 7", { check: true }).then(
    () => assert.fail("check: true did not throw"),
    (e) => e,
  );
  assert.ok(err instanceof CommandError, `expected CommandError, got ${err?.name}`);
  assert.equal(err.exitCode, 7);

  // commands.run is an alias of exec.
  const viaCommands = await sb.commands.run("echo via-commands");
  assert.equal(viaCommands.stdout, "via-commands\n");
});

test("sandbox basics: /home/user and /tmp writable, python3 and bash present", T, async (t) => {
  const sb = await createSandbox(t);
  const r = await sb.exec(
    "touch /home/user/w && touch /tmp/w && echo ok && command -v python3 bash node >/dev/null && echo tools",
  );
  assert.equal(r.stdout, "ok\ntools\n", r.stderr);
  assert.equal(r.exitCode, 0);
});

test("exec timeout -> SandboxTimeout, and the command is killed", T, async (t) => {
  const sb = await createSandbox(t);
  const started = Date.now();
  const err = await sb.exec("sleep 5; touch /tmp/late", { timeoutSeconds: 1 }).then(
    () => assert.fail("exec past its timeout returned normally"),
    (e) => e,
  );
  const elapsed = Date.now() - started;
  assert.ok(err instanceof SandboxTimeout, `expected SandboxTimeout, got ${err?.name}: ${err?.message}`);
  assert.match(err.message, /^command timed out: /);
  assert.ok(elapsed < 4500, `timeout took ${elapsed} ms; the daemon should stop at about 1 s`);
  // The sandbox is still usable, and the timed-out command did not go on
  // (its whole process group was killed, not just the shell).
  await sleep(Math.max(0, 6000 - (Date.now() - started)));
  const r = await sb.exec("test -e /tmp/late && echo late || echo killed");
  assert.equal(r.stdout, "killed\n");
});

// ---------------------------------------------------------------- exec/stream

test("execStream delivers stdout/stderr chunks as they come and returns the exit code", T, async (t) => {
  const sb = await createSandbox(t);
  const out = [];
  const err = [];
  let firstChunkAt = 0;
  const code = await sb.execStream(
    "for i in 1 2 3; do echo line$i; sleep 0.5; done; echo 'oops ✓' >&2; exit 3",
    {
      onStdout: (c) => {
        if (!firstChunkAt) firstChunkAt = Date.now();
        out.push(c);
      },
      onStderr: (c) => err.push(c),
    },
  );
  const doneAt = Date.now();
  assert.equal(code, 3);
  assert.ok(out.length >= 1, "onStdout was never called");
  assert.equal(out.join(""), "line1\nline2\nline3\n");
  assert.equal(err.join(""), "oops ✓\n");
  // Streamed, not buffered until exit: line1 arrives ~1.5 s before the end.
  assert.ok(doneAt - firstChunkAt >= 700, `first chunk only ${doneAt - firstChunkAt} ms before the end`);
});

test("execStream with exit 0 resolves to 0", T, async (t) => {
  const sb = await createSandbox(t);
  const chunks = [];
  const code = await sb.execStream("python3 -c 'print(6*7)'", { onStdout: (c) => chunks.push(c) });
  assert.equal(code, 0);
  assert.equal(chunks.join(""), "42\n");
});

test("execStream timeout -> SandboxTimeout", T, async (t) => {
  const sb = await createSandbox(t);
  const started = Date.now();
  const err = await sb.execStream("echo before; sleep 20", { timeoutSeconds: 1 }).then(
    (code) => assert.fail(`execStream past its timeout resolved with ${code}`),
    (e) => e,
  );
  assert.ok(err instanceof SandboxTimeout, `expected SandboxTimeout, got ${err?.name}: ${err?.message}`);
  assert.ok(Date.now() - started < 10_000, "the stream should end soon after the 1 s timeout");
});

// ---------------------------------------------------------------- filesystem

test("filesystem write/read/list/stat/exists", T, async (t) => {
  const sb = await createSandbox(t);
  const fs = sb.filesystem;
  const dir = "/home/user/proj";
  const file = `${dir}/sub/hello.txt`;
  const content = "hello from the TS SDK ✓\nline 2\n";
  const size = Buffer.byteLength(content);

  // Parent directories are created.
  const w = await fs.write(file, content);
  assert.equal(w.path, file);
  assert.equal(w.bytes, size);

  assert.equal(await fs.read(file), content);
  // Same filesystem the commands see, both ways.
  assert.equal((await sb.exec(`cat ${file}`)).stdout, content);
  await sb.exec(`echo made-by-exec > ${dir}/from-exec.txt`);
  assert.equal(await fs.read(`${dir}/from-exec.txt`), "made-by-exec\n");

  // Overwrite truncates.
  await fs.write(file, "short");
  assert.equal(await fs.read(file), "short");
  await fs.write(file, content);

  const entries = await fs.list(`${dir}/sub`);
  const hello = entries.find((e) => e.name === "hello.txt");
  assert.ok(hello, `hello.txt not listed: ${JSON.stringify(entries)}`);
  assert.equal(hello.is_dir, false);
  assert.equal(hello.size, size);
  assert.equal(hello.path, file);
  assert.equal(typeof hello.mtime, "number");
  assert.ok(hello.mtime > 1_600_000_000, `mtime should be Unix seconds: ${hello.mtime}`);

  const top = await fs.list(dir);
  const names = top.map((e) => e.name).sort();
  assert.deepEqual(names, ["from-exec.txt", "sub"]);
  assert.equal(top.find((e) => e.name === "sub").is_dir, true);

  const st = await fs.stat(file);
  assert.equal(st.name, "hello.txt");
  assert.equal(st.path, file);
  assert.equal(st.is_dir, false);
  assert.equal(st.size, size);
  const dst = await fs.stat(`${dir}/sub`);
  assert.equal(dst.is_dir, true);

  assert.equal(await fs.exists(file), true);
  assert.equal(await fs.exists(`${dir}/sub`), true);
  assert.equal(await fs.exists(`${dir}/missing.txt`), false);
  assert.equal(await fs.exists("/no/such/dir/at/all"), false);

  // An empty directory lists as [].
  await sb.exec(`mkdir -p ${dir}/empty`);
  assert.deepEqual(await fs.list(`${dir}/empty`), []);

  // /tmp is writable through the API as well.
  await fs.write("/tmp/t.txt", "tmp");
  assert.equal(await fs.read("/tmp/t.txt"), "tmp");
});

test("filesystem binary write round-trips byte for byte", T, async (t) => {
  const sb = await createSandbox(t);
  const bytes = new Uint8Array(256).map((_, i) => i);
  const w = await sb.filesystem.write("/home/user/bin.dat", bytes);
  assert.equal(w.bytes, 256);
  assert.equal((await sb.filesystem.stat("/home/user/bin.dat")).size, 256);
  const r = await sb.exec(
    "python3 -c \"import sys; d=open('/home/user/bin.dat','rb').read(); print(d == bytes(range(256)))\"",
  );
  assert.equal(r.stdout, "True\n");
});

test("filesystem errors: missing file -> NotFoundError, relative path -> BadRequestError", T, async (t) => {
  const sb = await createSandbox(t);
  const missing = await sb.filesystem.read("/home/user/does-not-exist.txt").then(
    () => assert.fail("reading a missing file succeeded"),
    (e) => e,
  );
  assert.ok(missing instanceof NotFoundError, `expected NotFoundError, got ${missing?.name}: ${missing?.message}`);
  const st = await sb.filesystem.stat("/home/user/does-not-exist.txt").then(
    () => assert.fail("stat of a missing file succeeded"),
    (e) => e,
  );
  assert.ok(st instanceof NotFoundError, `expected NotFoundError, got ${st?.name}`);

  const rel = await sb.filesystem.read("relative/path.txt").then(
    () => assert.fail("reading a relative path succeeded"),
    (e) => e,
  );
  assert.ok(rel instanceof BadRequestError, `expected BadRequestError, got ${rel?.name}: ${rel?.message}`);
  assert.equal(rel.statusCode, 400);
  const relW = await sb.filesystem.write("relative.txt", "x").then(
    () => assert.fail("writing a relative path succeeded"),
    (e) => e,
  );
  assert.ok(relW instanceof BadRequestError, `expected BadRequestError, got ${relW?.name}: ${relW?.message}`);
});

// ---------------------------------------------------------------- get / list

test("Sandbox.get and Sandbox.list see the created sandbox", T, async (t) => {
  const sb = await createSandbox(t, { template: "host", metadata: { suite: "ts-sdk", case: "get-list" } });
  const got = await Sandbox.get(sb.id);
  assert.equal(got.id, sb.id);
  assert.equal(got.template, sb.template);
  assert.equal(got.status, "running");
  assert.equal(got.info.metadata?.case, "get-list");
  // A Sandbox from get() is fully usable.
  assert.equal((await got.exec("echo via-get")).stdout, "via-get\n");

  const all = await Sandbox.list();
  assert.ok(Array.isArray(all));
  const mine = all.find((s) => s.id === sb.id);
  assert.ok(mine, `created sandbox ${sb.id} missing from list`);
  assert.ok(mine instanceof Sandbox);
  assert.equal(mine.status, "running");
  assert.equal(mine.info.metadata?.case, "get-list");
});

test("Sandbox.get of an unknown id -> NotFoundError", T, async () => {
  const err = await Sandbox.get("00000000-0000-4000-8000-000000000000").then(
    () => assert.fail("get of an unknown id succeeded"),
    (e) => e,
  );
  assert.ok(err instanceof NotFoundError, `expected NotFoundError, got ${err?.name}: ${err?.message}`);
  assert.equal(err.statusCode, 404);
});

// ---------------------------------------------------------------- lifecycle

test("lifecycle() and setTtl()/setPersistent()", T, async (t) => {
  const sb = await createSandbox(t, { template: "host", ttlSeconds: 600 });
  const before = await sb.lifecycle();
  assert.equal(before.ttl_seconds, 600);
  assert.equal(before.persistent, false);
  assert.equal(typeof before.idle_seconds, "number");
  assert.ok(before.idle_seconds >= 0);

  const updated = await sb.setTtl(900);
  assert.equal(updated.ttl_seconds, 900);
  assert.equal(updated.persistent, false);
  assert.equal((await sb.lifecycle()).ttl_seconds, 900);

  const p = await sb.setPersistent(true);
  assert.equal(p.persistent, true);
  assert.equal(p.ttl_seconds, 900);
  assert.equal((await sb.lifecycle()).persistent, true);
  assert.equal((await sb.setPersistent(false)).persistent, false);

  // A negative TTL is a client error.
  const err = await sb.setTtl(-1).then(
    () => assert.fail("setTtl(-1) succeeded"),
    (e) => e,
  );
  assert.ok(err instanceof BadRequestError, `expected BadRequestError, got ${err?.name}: ${err?.message}`);
});

// ---------------------------------------------------------------- delete

test("kill() then get() -> NotFoundError; gone from list; exec -> NotFoundError", T, async (t) => {
  const sb = await createSandbox(t);
  const id = sb.id;
  await sb.kill();
  const err = await Sandbox.get(id).then(
    () => assert.fail("get after kill succeeded"),
    (e) => e,
  );
  assert.ok(err instanceof NotFoundError, `expected NotFoundError, got ${err?.name}: ${err?.message}`);
  assert.ok(!(await Sandbox.list()).some((s) => s.id === id), "killed sandbox still listed");
  const execErr = await sb.exec("true").then(
    () => assert.fail("exec after kill succeeded"),
    (e) => e,
  );
  assert.ok(execErr instanceof NotFoundError, `expected NotFoundError, got ${execErr?.name}: ${execErr?.message}`);
  const again = await sb.kill().then(
    () => assert.fail("second kill succeeded"),
    (e) => e,
  );
  assert.ok(again instanceof NotFoundError, `expected NotFoundError, got ${again?.name}`);
});

// `await using` itself is tested in await-using.test.mts (compiled by TypeScript).
test("Sandbox[Symbol.asyncDispose]() (what `await using` calls) deletes the sandbox", T, async (t) => {
  assert.equal(typeof Symbol.asyncDispose, "symbol", "this runtime has no Symbol.asyncDispose");
  const sb = await createSandbox(t);
  assert.equal(typeof sb[Symbol.asyncDispose], "function");
  await sb[Symbol.asyncDispose]();
  const err = await Sandbox.get(sb.id).then(
    () => assert.fail("sandbox still exists after asyncDispose"),
    (e) => e,
  );
  assert.ok(err instanceof NotFoundError, `expected NotFoundError, got ${err?.name}`);
});

// ---------------------------------------------------------------- auth

test("wrong API key -> AuthError", T, async (t) => {
  const bad = new Client({ apiKey: "pds_definitely-not-the-key" });
  for (const [what, call] of [
    ["list", () => Sandbox.list(bad)],
    ["create", () => Sandbox.create({ template: "host" }, bad)],
  ]) {
    const err = await call().then(
      () => assert.fail(`${what} with a wrong key succeeded`),
      (e) => e,
    );
    assert.ok(err instanceof AuthError, `${what}: expected AuthError, got ${err?.name}: ${err?.message}`);
    assert.equal(err.statusCode, 401);
    assert.ok(err.message.length > 0);
  }
  // A real sandbox is not reachable with a wrong key either (401, not 404).
  const sb = await createSandbox(t);
  const err = await Sandbox.get(sb.id, bad).then(
    () => assert.fail("get with a wrong key succeeded"),
    (e) => e,
  );
  assert.ok(err instanceof AuthError, `expected AuthError, got ${err?.name}: ${err?.message}`);
});

test("no API key at all -> AuthError (the TS SDK sends no Authorization header)", T, async () => {
  // apiKey "" overrides the env var and leaves the client without a key.
  const none = new Client({ apiKey: "" });
  assert.equal(none.apiKey, undefined);
  const err = await Sandbox.list(none).then(
    () => assert.fail("list without a key succeeded"),
    (e) => e,
  );
  assert.ok(err instanceof AuthError, `expected AuthError, got ${err?.name}: ${err?.message}`);
  assert.equal(err.statusCode, 401);
});

// ---------------------------------------------------------------- wire level

test("wire: error bodies are JSON {error: string} with the right status", T, async () => {
  assertJsonError(await raw("GET", "/v1/sandboxes", { key: null }), 401);
  assertJsonError(await raw("GET", "/v1/sandboxes", { key: "wrong" }), 401);
  assertJsonError(await raw("GET", "/v1/sandboxes/00000000-0000-4000-8000-000000000000"), 404);
  assertJsonError(await raw("POST", "/v1/sandboxes", { body: { template: "no-such-template-xyz" } }), 400);
});

test("wire: list is a bare JSON array; metadata.KEY=VALUE filters (runcell extension)", T, async (t) => {
  const tag = `ts-${process.pid}-${Date.now()}`;
  const a = await createSandbox(t, { template: "host", metadata: { filtertag: tag, role: "a" } });
  const b = await createSandbox(t, { template: "host", metadata: { filtertag: tag, role: "b" } });
  const other = await createSandbox(t, { template: "host", metadata: { filtertag: `${tag}-other` } });

  const all = await raw("GET", "/v1/sandboxes");
  assert.equal(all.status, 200);
  assert.ok(Array.isArray(all.json), `list must be a bare array: ${all.text.slice(0, 200)}`);
  const allIds = all.json.map((s) => s.id);
  for (const sb of [a, b, other]) assert.ok(allIds.includes(sb.id));

  const q = (params) => raw("GET", `/v1/sandboxes?${new URLSearchParams(params)}`);
  const byTag = await q({ "metadata.filtertag": tag });
  assert.equal(byTag.status, 200);
  assert.ok(Array.isArray(byTag.json));
  assert.deepEqual(byTag.json.map((s) => s.id).sort(), [a.id, b.id].sort());

  // Several filters must all match.
  const both = await q({ "metadata.filtertag": tag, "metadata.role": "b" });
  assert.deepEqual(both.json.map((s) => s.id), [b.id]);

  // No match is [], never null.
  const none = await q({ "metadata.filtertag": `${tag}-nobody` });
  assert.equal(none.status, 200);
  assert.deepEqual(none.json, []);
});

test("wire: create answers 201 with the sandbox object", T, async (t) => {
  const r = await raw("POST", "/v1/sandboxes", { body: { template: "host", metadata: { k: "v" } } });
  assert.equal(r.status, 201, r.text);
  const info = r.json;
  t.after(async () => {
    if (info?.id) await raw("DELETE", `/v1/sandboxes/${info.id}`);
  });
  assert.match(info.id, UUID_RE);
  assert.equal(info.status, "running");
  assert.equal(info.metadata?.k, "v");
  // The Python SDK does int(cpu) / int(memory_mb): absent is fine, null is not.
  for (const k of ["cpu", "memory_mb"]) {
    if (k in info) assert.ok(Number.isInteger(info[k]), `${k} must be an integer, got ${info[k]}`);
  }
  const del = await raw("DELETE", `/v1/sandboxes/${info.id}`);
  assert.equal(del.status, 204);
  assert.equal(del.text, "");
});

// Guard against a SDK upgrade silently changing the error hierarchy.
test("SDK error classes extend PandaStackError", () => {
  for (const C of [AuthError, NotFoundError, BadRequestError, SandboxTimeout, CommandError]) {
    assert.ok(C.prototype instanceof PandaStackError, C.name);
  }
});
