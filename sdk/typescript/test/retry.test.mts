// Sandbox.create retries once on a transient failure, and only then.
// Deterministic: the "daemon" that refuses once is either a port that starts
// listening right after the first connection attempt was refused, or a
// fake daemon that answers the first request itself and forwards the rest.
import { after, test } from "node:test";
import assert from "node:assert/strict";
import {
  BadRequestError,
  CapacityError,
  ConnectionError,
  NotFoundError,
  Sandbox,
  ServerError,
} from "runcell";
import { fakeDaemon, freePort, killAll, newSandbox, track } from "./helpers.mjs";

after(killAll);

test("connection refused once: the retry reaches the daemon once it listens", { timeout: 60_000 }, async () => {
  const port = await freePort();
  const apiUrl = `http://127.0.0.1:${port}`;
  const realFetch = globalThis.fetch;
  const attempts: string[] = [];
  let proxy: Awaited<ReturnType<typeof fakeDaemon>> | undefined;
  // Wrap fetch only to learn when the first attempt has failed, and start
  // listening on the port right then: the SDK's retry finds a daemon.
  globalThis.fetch = async (input, init) => {
    try {
      const r = await realFetch(input, init);
      attempts.push(`HTTP ${r.status}`);
      return r;
    } catch (e) {
      attempts.push(`refused: ${String((e as { cause?: { code?: string } }).cause?.code)}`);
      proxy ??= await fakeDaemon(() => undefined, port);
      throw e;
    }
  };
  try {
    const started = Date.now();
    const sb = await Sandbox.create({ apiUrl, template: "host", metadata: { suite: "runcell-sdk" } });
    track(sb);
    const waited = Date.now() - started;
    assert.deepEqual(attempts, ["refused: ECONNREFUSED", "HTTP 201"]);
    assert.ok(waited >= 200, `retried after ${waited} ms, want about 250`);
    assert.equal((await sb.exec("echo retried")).stdout, "retried\n");
    assert.deepEqual(proxy?.seen.map((s) => `${s.method} ${s.path}`), [
      "POST /v1/sandboxes",
      "POST /v1/sandboxes/" + sb.id + "/exec",
    ]);
  } finally {
    globalThis.fetch = realFetch;
    await proxy?.close();
  }
});

test("503 with Retry-After once: create waits that long, retries, and succeeds", { timeout: 60_000 }, async () => {
  const fake = await fakeDaemon((n) =>
    n === 1
      ? { status: 503, headers: { "retry-after": "1" }, body: { error: "no capacity: 64 sandboxes are running" } }
      : undefined,
  );
  try {
    const started = Date.now();
    const sb = await Sandbox.create({ apiUrl: fake.url, template: "host", metadata: { suite: "runcell-sdk" } });
    track(sb);
    const waited = Date.now() - started;
    assert.ok(waited >= 950, `retried after ${waited} ms, want the 1 s Retry-After`);
    assert.deepEqual(fake.seen.map((s) => s.method), ["POST", "POST"]);
    assert.equal(sb.info.template, "host");
  } finally {
    await fake.close();
  }
});

test("429 once is retried; a long Retry-After is capped at a few seconds", { timeout: 60_000 }, async () => {
  const fake = await fakeDaemon((n) =>
    n === 1 ? { status: 429, headers: { "retry-after": "600" }, body: { error: "rate limit" } } : undefined,
  );
  try {
    const started = Date.now();
    const sb = await Sandbox.create({ apiUrl: fake.url, template: "host", metadata: { suite: "runcell-sdk" } });
    track(sb);
    const waited = Date.now() - started;
    assert.ok(waited >= 2900 && waited < 10_000, `retried after ${waited} ms, want the 3 s cap`);
    assert.equal(fake.seen.length, 2);
  } finally {
    await fake.close();
  }
});

test("a 500 once is retried after about 250 ms", { timeout: 60_000 }, async () => {
  const fake = await fakeDaemon((n) => (n === 1 ? { status: 500, body: { error: "the jail failed" } } : undefined));
  try {
    const started = Date.now();
    const sb = await Sandbox.create({ apiUrl: fake.url, template: "host", metadata: { suite: "runcell-sdk" } });
    track(sb);
    const waited = Date.now() - started;
    assert.ok(waited >= 200, `retried after ${waited} ms`);
    assert.equal(fake.seen.length, 2);
  } finally {
    await fake.close();
  }
});

test("two failures: the error says what happened on both attempts", { timeout: 60_000 }, async () => {
  const fake = await fakeDaemon((n) =>
    n === 1
      ? { status: 502, body: { error: "first thing broke" } }
      : { status: 503, headers: { "retry-after": "4" }, body: { error: "second thing: no capacity" } },
  );
  try {
    await assert.rejects(Sandbox.create({ apiUrl: fake.url }), (e: unknown) => {
      assert.ok(e instanceof CapacityError, `got ${String(e)}`);
      assert.equal(e.status, 503);
      assert.equal(e.retryAfterSeconds, 4);
      assert.match(e.message, /after two attempts/);
      assert.match(e.message, /First attempt: .*HTTP 502: first thing broke/);
      assert.match(e.message, /Second attempt, after waiting 250 ms: .*HTTP 503: second thing: no capacity/);
      assert.ok(e.cause instanceof ServerError);
      return true;
    });
    assert.equal(fake.seen.length, 2, "exactly one retry");
  } finally {
    await fake.close();
  }

  const port = await freePort();
  await assert.rejects(Sandbox.create({ apiUrl: `http://127.0.0.1:${port}` }), (e: unknown) => {
    assert.ok(e instanceof ConnectionError);
    assert.match(e.message, /First attempt: no answer from the runcell daemon .*ECONNREFUSED/);
    assert.match(e.message, /Second attempt, after waiting 250 ms: no answer .*ECONNREFUSED/);
    return true;
  });
});

test("a 4xx other than 429 is not retried", { timeout: 30_000 }, async () => {
  for (const [status, Err] of [
    [400, BadRequestError],
    [404, NotFoundError],
    [413, BadRequestError],
  ] as const) {
    const fake = await fakeDaemon(() => ({ status, body: { error: `refused with ${status}` } }));
    try {
      await assert.rejects(Sandbox.create({ apiUrl: fake.url }), Err);
      assert.equal(fake.seen.length, 1, `HTTP ${status} must not be retried`);
    } finally {
      await fake.close();
    }
  }
  const conflict = await fakeDaemon(() => ({ status: 409, body: { error: "conflict" } }));
  try {
    await assert.rejects(Sandbox.create({ apiUrl: conflict.url }), /HTTP 409: conflict/);
    assert.equal(conflict.seen.length, 1);
  } finally {
    await conflict.close();
  }
});

test("other calls are not retried (only create is)", { timeout: 30_000 }, async () => {
  const sb = await newSandbox();
  const fake = await fakeDaemon(() => ({ status: 503, body: { error: "busy" } }));
  try {
    await assert.rejects(Sandbox.get(sb.id, { apiUrl: fake.url }), CapacityError);
    await assert.rejects(Sandbox.list({ apiUrl: fake.url }), CapacityError);
    assert.equal(fake.seen.length, 2);
  } finally {
    await fake.close();
  }
});
