// Sandbox: create, get, list, exec, files, setTtl, kill, against a live daemon.
import { after, test } from "node:test";
import assert from "node:assert/strict";
import { randomUUID } from "node:crypto";
import { NotFoundError, Sandbox } from "runcell";
import { KEY, URL_, killAll, newSandbox } from "./helpers.mjs";

after(killAll);

test("create passes template, TTL, metadata, limits, envs and persistent, and info reflects them", { timeout: 60_000 }, async () => {
  const tag = randomUUID();
  const sb = await newSandbox({
    template: "host",
    ttlSeconds: 321,
    metadata: { tag, role: "create" },
    limits: { memoryMb: 256, cpu: 0.5, pids: 64, diskMb: 128, timeoutSeconds: 20, outputBytes: 4096 },
    envs: { GREETING: "hello from envs" },
    persistent: true,
    network: { mode: "none" },
  });
  assert.match(sb.id, /^[0-9a-f-]{36}$/);
  assert.equal(sb.info.id, sb.id);
  assert.equal(sb.info.template, "host");
  assert.equal(sb.info.status, "running");
  assert.equal(sb.info.ttlSeconds, 321);
  assert.equal(sb.info.metadata.tag, tag);
  assert.equal(sb.info.metadata.role, "create");
  assert.match(sb.info.createdAt, /^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$/);
  assert.equal(sb.info.raw.persistent, true);
  assert.deepEqual(sb.info.raw.limits, {
    memory_mb: 256,
    cpu: 0.5,
    pids: 64,
    disk_mb: 128,
    timeout_seconds: 20,
    output_bytes: 4096,
  });
  const r = await sb.exec('printf "%s" "$GREETING"');
  assert.equal(r.stdout, "hello from envs");
});

test("create with no options uses the daemon's defaults (env RUNCELL_URL / RUNCELL_API_KEY)", { timeout: 60_000 }, async () => {
  assert.equal(process.env.RUNCELL_URL, URL_);
  const sb = await Sandbox.create();
  try {
    // The one default template; served from host until it is installed.
    assert.equal(sb.info.template, "code-interpreter");
    assert.equal(sb.info.raw.alias_of, "host");
    assert.equal(sb.info.ttlSeconds, 300);
    assert.equal((await sb.exec("echo ok")).stdout, "ok\n");
  } finally {
    await sb.kill();
  }
});

test("explicit apiUrl (with a trailing /v1/) and apiKey override the environment", { timeout: 60_000 }, async () => {
  const saved = { url: process.env.RUNCELL_URL, key: process.env.RUNCELL_API_KEY };
  process.env.RUNCELL_URL = "http://127.0.0.1:1";
  process.env.RUNCELL_API_KEY = "wrong";
  try {
    const list = await Sandbox.list({ apiUrl: `${URL_}/v1/`, apiKey: KEY });
    assert.ok(Array.isArray(list));
  } finally {
    process.env.RUNCELL_URL = saved.url;
    process.env.RUNCELL_API_KEY = saved.key;
  }
});

test("get finds a sandbox by id, with the same info; list filters by metadata", { timeout: 60_000 }, async () => {
  const tag = randomUUID();
  const a = await newSandbox({ metadata: { tag, which: "a" } });
  const b = await newSandbox({ metadata: { tag, which: "b" } });
  await newSandbox({ metadata: { tag: "someone-else" } });

  const got = await Sandbox.get(a.id);
  assert.equal(got.id, a.id);
  assert.deepEqual(got.info.metadata, a.info.metadata);
  assert.equal(got.info.createdAt, a.info.createdAt);

  const both = await Sandbox.list({ metadata: { tag } });
  assert.deepEqual(both.map((s) => s.id).sort(), [a.id, b.id].sort());
  for (const s of both) {
    assert.equal(s.metadata.tag, tag);
    assert.equal(s.status, "running");
    assert.equal(s.template, "host");
    assert.equal(typeof s.raw, "object");
  }
  const onlyB = await Sandbox.list({ metadata: { tag, which: "b" } });
  assert.deepEqual(onlyB.map((s) => s.id), [b.id]);
  assert.deepEqual(await Sandbox.list({ metadata: { tag: randomUUID() } }), []);
  const all = await Sandbox.list();
  assert.ok(all.some((s) => s.id === a.id) && all.some((s) => s.id === b.id));
});

test("exec returns stdout, stderr and the exit code, with envs and cwd", { timeout: 60_000 }, async () => {
  const sb = await newSandbox();
  const r = await sb.exec("echo out; echo err >&2; exit 3");
  assert.equal(r.stdout, "out\n");
  assert.equal(r.stderr, "err\n");
  assert.equal(r.exitCode, 3);
  assert.equal(r.timedOut, false);
  assert.equal(r.truncated, false);
  assert.equal(typeof r.durationMs, "number");
  assert.deepEqual(r.messages, []);

  const e = await sb.exec('mkdir -p /tmp/work && cd /tmp/work && echo "$A-$B" > f', { envs: { A: "1", B: "two" } });
  assert.equal(e.exitCode, 0);
  const c = await sb.exec("cat f; pwd", { cwd: "/tmp/work" });
  assert.equal(c.stdout, "1-two\n/tmp/work\n");
});

test("an exec timeout is returned, not thrown: timedOut with the daemon's message", { timeout: 60_000 }, async () => {
  const sb = await newSandbox();
  const started = Date.now();
  const r = await sb.exec("echo before; sleep 30", { timeoutSeconds: 1 });
  assert.ok(Date.now() - started < 20_000);
  assert.equal(r.timedOut, true);
  assert.equal(r.exitCode, 124);
  assert.equal(r.stdout, "before\n");
  assert.ok(r.messages.length > 0);
  assert.match(r.messages.join(" "), /timeout/i);
  // The sandbox is fine afterwards.
  assert.equal((await sb.exec("echo after")).stdout, "after\n");
});

test("exec output beyond the output limit is truncated, with a marker", { timeout: 60_000 }, async () => {
  const sb = await newSandbox({ limits: { outputBytes: 1000 } });
  const r = await sb.exec("head -c 5000 /dev/zero | tr '\\0' x");
  assert.equal(r.truncated, true);
  assert.ok(r.stdout.startsWith("x".repeat(1000)));
  assert.ok(r.messages.length > 0);
});

test("files: write text and bytes, read them back, list a directory", { timeout: 60_000 }, async () => {
  const sb = await newSandbox();
  await sb.files.write("/tmp/dir/sub/hello.txt", "héllo wörld\n");
  assert.equal(await sb.files.read("/tmp/dir/sub/hello.txt"), "héllo wörld\n");
  assert.equal((await sb.exec("cat /tmp/dir/sub/hello.txt")).stdout, "héllo wörld\n");

  const bytes = new Uint8Array(256);
  for (let i = 0; i < 256; i++) bytes[i] = i;
  await sb.files.write("/tmp/dir/all.bin", bytes);
  const back = await sb.files.readBytes("/tmp/dir/all.bin");
  assert.ok(back instanceof Uint8Array);
  assert.deepEqual(Array.from(back), Array.from(bytes));
  assert.equal((await sb.exec("wc -c < /tmp/dir/all.bin")).stdout.trim(), "256");

  // Overwrite replaces.
  await sb.files.write("/tmp/dir/sub/hello.txt", "short");
  assert.equal(await sb.files.read("/tmp/dir/sub/hello.txt"), "short");

  const entries = await sb.files.list("/tmp/dir");
  entries.sort((x, y) => x.name.localeCompare(y.name));
  assert.deepEqual(entries, [
    { name: "all.bin", isDir: false, size: 256 },
    { name: "sub", isDir: true, size: entries[1]!.size },
  ]);
  assert.deepEqual(await sb.files.list("/tmp/dir/sub"), [{ name: "hello.txt", isDir: false, size: 5 }]);

  await assert.rejects(sb.files.read("/tmp/dir/missing.txt"), NotFoundError);
});

test("setTtl changes the idle TTL (PATCH lifecycle)", { timeout: 60_000 }, async () => {
  const sb = await newSandbox({ ttlSeconds: 100 });
  await sb.setTtl(4321);
  assert.equal(sb.info.ttlSeconds, 4321);
  assert.equal((await Sandbox.get(sb.id)).info.ttlSeconds, 4321);
  const lc = await fetch(`${URL_}/v1/sandboxes/${sb.id}/lifecycle`, { headers: { Authorization: `Bearer ${KEY}` } });
  assert.equal(((await lc.json()) as { ttl_seconds: number }).ttl_seconds, 4321);
});

test("kill deletes the sandbox; killing it again is not an error", { timeout: 60_000 }, async () => {
  const sb = await Sandbox.create({ template: "host" });
  await sb.kill();
  await assert.rejects(Sandbox.get(sb.id), NotFoundError);
  assert.ok(!(await Sandbox.list()).some((s) => s.id === sb.id));
  await sb.kill();
  // Another handle on the same (gone) sandbox can kill too.
  await sb.kill();
});
