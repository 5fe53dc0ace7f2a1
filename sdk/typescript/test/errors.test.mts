// Typed errors against a live daemon (and a fake one for statuses the daemon
// does not produce on demand).
import { after, test } from "node:test";
import assert from "node:assert/strict";
import { randomUUID } from "node:crypto";
import {
  AuthError,
  BadRequestError,
  CapacityError,
  ConnectionError,
  NotFoundError,
  RuncellError,
  Sandbox,
  ServerError,
} from "runcell";
import { KEY, fakeDaemon, freePort, killAll, newSandbox } from "./helpers.mjs";

after(killAll);

test("a bad API key is an AuthError (401) that quotes the daemon, and create does not retry it", { timeout: 30_000 }, async () => {
  await assert.rejects(Sandbox.list({ apiKey: "not-a-key" }), (e: unknown) => {
    assert.ok(e instanceof AuthError);
    assert.ok(e instanceof RuncellError);
    assert.equal(e.name, "AuthError");
    assert.equal(e.status, 401);
    assert.match(e.message, /unauthorized/);
    assert.match(e.message, /invalid api token/);
    assert.deepEqual(e.body, { error: "unauthorized", detail: "invalid api token" });
    return true;
  });
  const fake = await fakeDaemon(() => undefined);
  try {
    await assert.rejects(Sandbox.create({ apiUrl: fake.url, apiKey: "not-a-key" }), AuthError);
    assert.equal(fake.seen.length, 1);
  } finally {
    await fake.close();
  }
  await assert.rejects(Sandbox.get(randomUUID(), { apiKey: "" }), AuthError);
});

test("a 403 is an AuthError too", { timeout: 30_000 }, async () => {
  const fake = await fakeDaemon(() => ({ status: 403, body: { error: "template not accessible" } }));
  try {
    await assert.rejects(Sandbox.list({ apiUrl: fake.url }), (e: unknown) => {
      assert.ok(e instanceof AuthError);
      assert.equal(e.status, 403);
      assert.match(e.message, /template not accessible/);
      return true;
    });
  } finally {
    await fake.close();
  }
});

test("a missing sandbox is a NotFoundError from get and from every method of a stale handle", { timeout: 60_000 }, async () => {
  const id = randomUUID();
  await assert.rejects(Sandbox.get(id), (e: unknown) => {
    assert.ok(e instanceof NotFoundError);
    assert.equal(e.status, 404);
    assert.match(e.message, new RegExp(id));
    assert.match(e.message, /sandbox not found/);
    return true;
  });
  const sb = await newSandbox();
  const ctx = await sb.createCodeContext();
  await sb.kill();
  await assert.rejects(sb.exec("true"), NotFoundError);
  await assert.rejects(sb.runCode("1"), NotFoundError);
  await assert.rejects(ctx.runCode("1"), NotFoundError);
  await assert.rejects(sb.files.read("/etc/hostname"), NotFoundError);
  await assert.rejects(sb.files.write("/tmp/x", "x"), NotFoundError);
  await assert.rejects(sb.files.list("/"), NotFoundError);
  await assert.rejects(sb.createCodeContext(), NotFoundError);
  await assert.rejects(sb.setTtl(10), NotFoundError);
  await sb.kill(); // gone already: fine
  await ctx.close(); // gone already: fine
});

test("an unknown template is a BadRequestError naming the installed templates, not retried", { timeout: 30_000 }, async () => {
  const fake = await fakeDaemon(() => undefined);
  try {
    await assert.rejects(Sandbox.create({ apiUrl: fake.url, template: "no-such-template" }), (e: unknown) => {
      assert.ok(e instanceof BadRequestError);
      assert.equal(e.status, 400);
      assert.match(e.message, /unknown template "no-such-template"/);
      assert.match(e.message, /installed templates: .*host/);
      return true;
    });
    assert.equal(fake.seen.length, 1, "a 400 must not be retried");
  } finally {
    await fake.close();
  }
});

test("invalid limits and an invalid TTL are BadRequestErrors", { timeout: 30_000 }, async () => {
  await assert.rejects(Sandbox.create({ limits: { memoryMb: 1 } }), /limits\.memory_mb must be a whole number between 16 and /);
  await assert.rejects(Sandbox.create({ limits: { memoryMb: 1 } }), BadRequestError);
  await assert.rejects(Sandbox.create({ ttlSeconds: -1 }), BadRequestError);
  const sb = await newSandbox();
  await assert.rejects(sb.setTtl(-5), BadRequestError);
  await assert.rejects(sb.exec("true", { timeoutSeconds: -1 }), BadRequestError);
  await assert.rejects(sb.files.read("relative/path"), /path must be absolute/);
  await assert.rejects(sb.createCodeContext("cobol" as never), BadRequestError);
});

test("no daemon at the URL is a ConnectionError that names the URL", { timeout: 30_000 }, async () => {
  const port = await freePort();
  await assert.rejects(Sandbox.list({ apiUrl: `http://127.0.0.1:${port}` }), (e: unknown) => {
    assert.ok(e instanceof ConnectionError);
    assert.equal(e.status, undefined);
    assert.match(e.message, new RegExp(`127\\.0\\.0\\.1:${port}`));
    assert.match(e.message, /ECONNREFUSED/);
    return true;
  });
  await assert.rejects(Sandbox.get(randomUUID(), { apiUrl: `http://127.0.0.1:${port}` }), ConnectionError);
});

test("503 and 429 are CapacityErrors with retryAfterSeconds; other 5xx are ServerErrors", { timeout: 30_000 }, async () => {
  const answers = [
    { status: 503, headers: { "retry-after": "7" }, body: { error: "no capacity: 64 sandboxes are running" } },
    { status: 429, headers: { "retry-after": "2" }, body: { error: "rate limit" } },
    { status: 502, body: { error: "bad gateway" } },
    { status: 500, body: { error: "boom" } },
  ];
  const fake = await fakeDaemon((n) => answers[n - 1]);
  try {
    await assert.rejects(Sandbox.list({ apiUrl: fake.url }), (e: unknown) => {
      assert.ok(e instanceof CapacityError);
      assert.equal(e.status, 503);
      assert.equal(e.retryAfterSeconds, 7);
      assert.match(e.message, /no capacity: 64 sandboxes are running/);
      return true;
    });
    await assert.rejects(Sandbox.list({ apiUrl: fake.url }), (e: unknown) => {
      assert.ok(e instanceof CapacityError);
      assert.equal(e.status, 429);
      assert.equal(e.retryAfterSeconds, 2);
      return true;
    });
    await assert.rejects(Sandbox.list({ apiUrl: fake.url }), (e: unknown) => {
      assert.ok(e instanceof ServerError);
      assert.equal(e.status, 502);
      assert.match(e.message, /bad gateway/);
      return true;
    });
    await assert.rejects(Sandbox.list({ apiUrl: fake.url }), ServerError);
  } finally {
    await fake.close();
  }
});

test("the key is sent as a Bearer token (a key for the right daemon works through a proxy)", { timeout: 30_000 }, async () => {
  const fake = await fakeDaemon(() => undefined);
  try {
    const list = await Sandbox.list({ apiUrl: fake.url, apiKey: KEY });
    assert.ok(Array.isArray(list));
    assert.deepEqual(fake.seen, [{ method: "GET", path: "/v1/sandboxes" }]);
  } finally {
    await fake.close();
  }
});
