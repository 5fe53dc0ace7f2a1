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

/** A code context (persistent interpreter) in `sb`, closed when the test ends. */
async function createContext(t, sb, language) {
  const ctx = await (language === undefined ? sb.createCodeContext() : sb.createCodeContext(language));
  t.after(() => ctx.close()); // close() swallows errors, e.g. after kill()
  return ctx;
}

/** Width and height from a base64 PNG's IHDR chunk, after checking the signature. */
function pngSize(b64) {
  assert.equal(typeof b64, "string", "no PNG");
  const buf = Buffer.from(b64, "base64");
  assert.deepEqual([...buf.subarray(0, 8)], [0x89, 0x50, 0x4e, 0x47, 0x0d, 0x0a, 0x1a, 0x0a], "not a PNG signature");
  assert.equal(buf.toString("latin1", 12, 16), "IHDR", "the first PNG chunk must be IHDR");
  return { width: buf.readUInt32BE(16), height: buf.readUInt32BE(20) };
}

/** The sessions the daemon lists for a sandbox (neither SDK reads this route). */
async function listSessions(sandboxId) {
  const r = await raw("GET", `/v1/sandboxes/${sandboxId}/repl/sessions`);
  assert.equal(r.status, 200, r.text);
  assert.ok(Array.isArray(r.json), `session list must be an array: ${r.text}`);
  return r.json;
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

// ---------------------------------------------------------------- code contexts, first sandboxes

// First sandbox-creating test of this file on purpose: the daemon prepares
// standby sandboxes (2 by default) before it installs its own SIGINT handler,
// so the first sandboxes handed out are the ones a start-up bug would affect
// (for example an interpreter that inherited an ignored SIGINT and so can
// only be killed, not interrupted, when a cell times out). 3 > the pool.
// node --test may run .build/await-using.test.mjs against the same daemon
// first, and then its sandboxes take the start-up pool; the same test in
// test_pandastack_py.py always gets it.
test("code contexts in the first sandboxes after start-up: a timeout interrupts the cell and keeps state", T, async (t) => {
  const sbs = await Promise.all([0, 1, 2].map(() => createSandbox(t)));
  await Promise.all(
    sbs.map(async (sb, i) => {
      const ctx = await createContext(t, sb);
      await ctx.runCode(`n = ${40 + i}`);
      const err = await ctx.runCode("while True: n += 0", { timeoutSeconds: 1 }).then(
        () => assert.fail(`sandbox ${i}: a cell past its timeout returned normally`),
        (e) => e,
      );
      assert.ok(err instanceof SandboxTimeout, `sandbox ${i}: expected SandboxTimeout, got ${err?.name}: ${err?.message}`);
      const after = await ctx.runCode("n + 2");
      assert.equal(after.error, undefined, `sandbox ${i} (${sb.id}) lost its state on a timeout: ${after.error}`);
      assert.equal(after.text, String(42 + i), `sandbox ${i} (${sb.id})`);
    }),
  );
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

// ---------------------------------------------------------------- code contexts

test("code context: state persists across runCode calls; the last expression is the text result", T, async (t) => {
  const sb = await createSandbox(t);
  const ctx = await createContext(t, sb);
  assert.equal(typeof ctx.id, "string");
  assert.match(ctx.id, /^[0-9a-f]{16}$/);
  assert.equal(ctx.language, "python");
  assert.equal(ctx.sandboxId, sb.id);

  // Statements only: no result, no output, no error.
  const first = await ctx.runCode("x = 6 * 7\nimport math\ndef double(v):\n    return 2 * v");
  assert.deepEqual(first.results, []);
  assert.equal(first.text, undefined);
  assert.equal(first.stdout, "");
  assert.equal(first.stderr, "");
  assert.equal(first.exit_code, 0);
  assert.equal(first.error, undefined);
  assert.equal(typeof first.duration_ms, "number");

  // Variables, imports and functions from the earlier cell are all there.
  const second = await ctx.runCode("print('x is', x)\nimport sys; print('warn', file=sys.stderr)\ndouble(x) + int(math.sqrt(16))");
  assert.equal(second.stdout, "x is 42\n");
  assert.equal(second.stderr, "warn\n");
  assert.equal(second.exit_code, 0);
  assert.equal(second.results.length, 1, JSON.stringify(second.results));
  assert.equal(second.results[0].text, "88");
  assert.equal(second.text, "88");
  assert.deepEqual(second.results[0].data, { "text/plain": "88" });

  // Reassignment is seen by the next cell; a None value is no result.
  await ctx.runCode("x += 1");
  const third = await ctx.runCode("x");
  assert.equal(third.text, "43");
  const none = await ctx.runCode("None");
  assert.deepEqual(none.results, []);

  // A string value comes back as its repr.
  assert.equal((await ctx.runCode("'it' + \"'s\"")).text, `"it's"`);

  // The context runs in the sandbox: files it writes are visible to the API.
  await ctx.runCode("open('/home/user/from-ctx.txt', 'w').write('written by a context ' + str(x))");
  assert.equal(await sb.filesystem.read("/home/user/from-ctx.txt"), "written by a context 43");

  // A second context ("py" is the SDK's alias for python) has its own state.
  const other = await createContext(t, sb, "py");
  assert.equal(other.language, "python");
  assert.notEqual(other.id, ctx.id);
  assert.equal((await other.runCode("'x' in globals()")).text, "False");
  assert.equal((await ctx.runCode("'x' in globals()")).text, "True");
});

test("code context: a pandas DataFrame comes back as HTML; display() adds results", T, async (t) => {
  const sb = await createSandbox(t);
  const ctx = await createContext(t, sb);
  await ctx.runCode("import pandas as pd\ndf = pd.DataFrame({'a': [1, 2], 'b': ['x', 'y']})");
  const ex = await ctx.runCode("df");
  assert.equal(ex.error, undefined, ex.error);
  assert.equal(ex.results.length, 1, JSON.stringify(ex.results).slice(0, 500));
  const [r] = ex.results;
  assert.equal(typeof r.html, "string", `no text/html: ${Object.keys(r.data)}`);
  assert.match(r.html, /<table[^>]*class="dataframe"/);
  assert.match(r.html, /<th>a<\/th>\s*<th>b<\/th>/);
  assert.match(r.html, /<td>1<\/td>\s*<td>x<\/td>/);
  assert.match(r.html, /<td>2<\/td>\s*<td>y<\/td>/);
  assert.equal(r.data["text/html"], r.html);
  assert.equal(r.text, "   a  b\n0  1  x\n1  2  y");
  assert.equal(ex.text, r.text);

  // display() shows a value mid-cell, in order, before the last expression.
  const shown = await ctx.runCode("print('before')\ndisplay(df[df.a > 1])\nprint('after')\nlen(df)");
  assert.equal(shown.stdout, "before\nafter\n");
  assert.equal(shown.results.length, 2, JSON.stringify(shown.results).slice(0, 500));
  assert.match(shown.results[0].html ?? "", /<td>2<\/td>\s*<td>y<\/td>/);
  assert.doesNotMatch(shown.results[0].html ?? "", /<td>x<\/td>/);
  assert.equal(shown.results[1].text, "2");
  assert.equal(shown.results[1].html, undefined);
});

test("code context: matplotlib figures come back as PNGs of the figure's size", T, async (t) => {
  const sb = await createSandbox(t);
  const ctx = await createContext(t, sb);
  const ex = await ctx.runCode(
    "import matplotlib.pyplot as plt\nfig = plt.figure(figsize=(4, 3), dpi=100)\n_ = plt.plot([1, 2, 3], [1, 4, 9])",
  );
  assert.equal(ex.error, undefined, ex.error);
  assert.equal(ex.exit_code, 0);
  const pngs = ex.results.filter((r) => r.png !== undefined);
  assert.equal(pngs.length, 1, `want one PNG result, got ${ex.results.map((r) => Object.keys(r.data))}`);
  assert.equal(ex.png, pngs[0].png);
  assert.equal(pngs[0].chart, pngs[0].png);
  assert.deepEqual(pngSize(ex.png), { width: 400, height: 300 });

  // The figure was closed once sent: the next cell has no PNG.
  const next = await ctx.runCode("len(plt.get_fignums())");
  assert.equal(next.text, "0");
  assert.equal(next.png, undefined);

  // Two figures in one cell (one through plt.show()) come back in order.
  const two = await ctx.runCode(
    "plt.figure(figsize=(2, 1), dpi=50)\nplt.bar(['a', 'b'], [3, 5])\nplt.show()\n" +
      "plt.figure(figsize=(3, 2), dpi=80)\n_ = plt.scatter([1, 2], [2, 1])",
  );
  const sizes = two.results.filter((r) => r.png !== undefined).map((r) => pngSize(r.png));
  assert.deepEqual(sizes, [
    { width: 100, height: 50 },
    { width: 240, height: 160 },
  ]);
});

test("code context: an exception comes back as an error whose traceback names the user's lines", T, async (t) => {
  const sb = await createSandbox(t);
  const ctx = await createContext(t, sb);
  await ctx.runCode("def ratio(a, b):\n    return a / b");
  const ex = await ctx.runCode("before = 'ran'\nratio(1, 0)\nafter = 'ran too'");
  assert.equal(ex.exit_code, 1);
  assert.equal(typeof ex.error, "string", "no error on an exception");
  assert.match(ex.error, /^Traceback \(most recent call last\):/);
  assert.match(ex.error, /line 2, in <module>\n\s+ratio\(1, 0\)/);
  assert.match(ex.error, /line 2, in ratio\n\s+return a \/ b/);
  assert.match(ex.error, /ZeroDivisionError: division by zero\n?$/);
  // The runcell driver's own frames are not shown.
  assert.doesNotMatch(ex.error, /python\.py|runcell/);
  assert.match(ex.stderr, /ZeroDivisionError: division by zero/);
  assert.deepEqual(ex.results, []);

  // Statements before the failing line ran, the ones after did not, and the
  // context keeps working.
  const next = await ctx.runCode("(before, 'after' in globals())");
  assert.equal(next.error, undefined);
  assert.equal(next.text, "('ran', False)");

  // A syntax error is reported the same way; nothing in the cell runs.
  const syntax = await ctx.runCode("y = 1\nif True print(y)");
  assert.equal(syntax.exit_code, 1);
  assert.match(syntax.error ?? "", /SyntaxError/);
  assert.equal((await ctx.runCode("'y' in globals()")).text, "False");
});

test("code context: a cell past its timeout -> SandboxTimeout; the context keeps its state", T, async (t) => {
  const sb = await createSandbox(t);
  const ctx = await createContext(t, sb);
  await ctx.runCode("total = 41\nimport time");
  const started = Date.now();
  const err = await ctx.runCode("while True: pass", { timeoutSeconds: 1 }).then(
    () => assert.fail("a cell past its timeout returned normally"),
    (e) => e,
  );
  const elapsed = Date.now() - started;
  assert.ok(err instanceof SandboxTimeout, `expected SandboxTimeout, got ${err?.name}: ${err?.message}`);
  assert.equal(err.message, "command timed out: while True: pass");
  assert.ok(elapsed < 5000, `timeout took ${elapsed} ms; the daemon should stop at about 1 s`);

  // The next cell works, promptly, and still sees the earlier variables.
  const t0 = Date.now();
  const next = await ctx.runCode("total + 1");
  assert.equal(next.error, undefined, `state lost after a timeout: ${next.error}`);
  assert.equal(next.text, "42");
  assert.ok(Date.now() - t0 < 5000, "the cell after a timeout was slow");

  // A blocking sleep is interrupted too.
  await assert.rejects(ctx.runCode("time.sleep(30)", { timeoutSeconds: 1 }), SandboxTimeout);
  assert.equal((await ctx.runCode("total")).text, "41");

  // Without a timeout of its own, a cell that is quick enough just runs.
  assert.equal((await ctx.runCode("time.sleep(1.5); 'slept'", { timeoutSeconds: 10 })).text, "'slept'");
});

test("code context: close() ends the context; runCode on it -> NotFoundError", T, async (t) => {
  const sb = await createSandbox(t);
  const keep = await createContext(t, sb);
  const ctx = await sb.createCodeContext();
  await ctx.runCode("v = 1");
  const before = (await listSessions(sb.id)).map((s) => s.id).sort();
  assert.deepEqual(before, [keep.id, ctx.id].sort());

  await ctx.close();
  assert.deepEqual((await listSessions(sb.id)).map((s) => s.id), [keep.id]);
  const err = await ctx.runCode("v").then(
    () => assert.fail("runCode on a closed context succeeded"),
    (e) => e,
  );
  assert.ok(err instanceof NotFoundError, `expected NotFoundError, got ${err?.name}: ${err?.message}`);
  assert.equal(err.statusCode, 404);
  // close() again is harmless (the SDK swallows the 404), and the other
  // context of the sandbox is untouched.
  await ctx.close();
  assert.equal((await keep.runCode("1 + 1")).text, "2");
});

test("code context: CodeContext[Symbol.asyncDispose]() (what `await using` calls) closes it", T, async (t) => {
  const sb = await createSandbox(t);
  const ctx = await sb.createCodeContext();
  assert.equal(typeof ctx[Symbol.asyncDispose], "function");
  assert.equal((await ctx.runCode("2 + 2")).text, "4");
  await ctx[Symbol.asyncDispose]();
  assert.deepEqual(await listSessions(sb.id), []);
  await assert.rejects(ctx.runCode("1"), NotFoundError);
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
