// runCode and code contexts against a live daemon.
import { after, test } from "node:test";
import assert from "node:assert/strict";
import { CodeContext, NotFoundError, Sandbox, type RunResult } from "runcell";
import { KEY, URL_, killAll, newSandbox } from "./helpers.mjs";

after(killAll);

const text = (r: RunResult) => r.results.find((x) => "text/plain" in x)?.["text/plain"];

async function sessions(id: string): Promise<{ id: string; language: string; cells: number }[]> {
  const r = await fetch(`${URL_}/v1/sandboxes/${id}/repl/sessions`, { headers: { Authorization: `Bearer ${KEY}` } });
  assert.equal(r.status, 200);
  return (await r.json()) as { id: string; language: string; cells: number }[];
}

test("runCode defaults to python and keeps state across calls in one context", { timeout: 60_000 }, async () => {
  const sb = await newSandbox();
  const a = await sb.runCode("import math\nx = 6");
  assert.equal(a.exitCode, 0);
  assert.deepEqual(a.results, []);
  assert.equal(a.error, undefined);
  const b = await sb.runCode("print('side'); x * 7");
  assert.equal(b.stdout, "side\n");
  assert.equal(text(b), "42");
  assert.deepEqual(b.results, [{ "text/plain": "42" }]);
  assert.equal(b.timedOut, false);
  assert.equal(b.truncated, false);
  assert.equal(b.stateLost, false);
  assert.equal(typeof b.durationMs, "number");
  assert.deepEqual(b.messages, []);
  assert.equal(text(await sb.runCode("math.floor(x / 4)", "python")), "1");
  // One context, reused.
  const s = await sessions(sb.id);
  assert.equal(s.length, 1);
  assert.equal(s[0]!.language, "python");
  assert.equal(s[0]!.cells, 3);
});

test("runCode runs javascript and bash in their own persistent contexts", { timeout: 60_000 }, async () => {
  const sb = await newSandbox();
  await sb.runCode("let n = 20", "javascript");
  const js = await sb.runCode("console.log('js'); n * 2 + 2", { language: "javascript" });
  assert.equal(js.stdout, "js\n");
  assert.equal(text(js), "42");

  await sb.runCode("cd /tmp && export V=kept", "bash");
  const sh = await sb.runCode('echo "$PWD $V"', "bash");
  assert.equal(sh.stdout, "/tmp kept\n");

  await sb.runCode("y = 'py'");
  assert.equal(text(await sb.runCode("y")), "'py'");
  const langs = (await sessions(sb.id)).map((s) => s.language).sort();
  assert.deepEqual(langs, ["bash", "javascript", "python"]);
});

test("an exception comes back as error with name, value and traceback (not thrown)", { timeout: 60_000 }, async () => {
  const sb = await newSandbox();
  const r = await sb.runCode("def f():\n    return 1 / 0\nf()");
  assert.equal(r.exitCode, 1);
  assert.ok(r.error);
  assert.equal(r.error.name, "ZeroDivisionError");
  assert.equal(r.error.value, "division by zero");
  assert.match(r.error.traceback, /return 1 \/ 0/);
  assert.match(r.stderr, /ZeroDivisionError/);
  assert.equal(r.timedOut, false);
});

test("a cell timeout is returned with timedOut, a TimeoutError and the daemon's message; state is kept", { timeout: 60_000 }, async () => {
  const sb = await newSandbox();
  await sb.runCode("kept = 41");
  const started = Date.now();
  const r = await sb.runCode("import time\nwhile True:\n    time.sleep(0.05)", { timeoutSeconds: 1 });
  assert.ok(Date.now() - started < 20_000);
  assert.equal(r.timedOut, true);
  assert.ok(r.error);
  assert.equal(r.error.name, "TimeoutError");
  assert.match(r.error.value, /timed out after 1s/);
  assert.ok(r.messages.some((m) => /timed out after 1s/.test(m)));
  assert.equal(r.stateLost, false);
  assert.equal(text(await sb.runCode("kept + 1")), "42");
});

test("an interpreter crash is reported with stateLost and the context restarts", { timeout: 60_000 }, async () => {
  const sb = await newSandbox();
  await sb.runCode("gone = 1");
  const r = await sb.runCode("import os\nos._exit(7)");
  assert.equal(r.stateLost, true);
  assert.equal(r.exitCode, 7);
  assert.ok(r.error);
  assert.ok(r.messages.length > 0);
  const after = await sb.runCode("'gone' in globals()");
  assert.equal(text(after), "False");
});

test("cell output beyond the output limit is truncated", { timeout: 60_000 }, async () => {
  const sb = await newSandbox({ limits: { outputBytes: 1000 } });
  const r = await sb.runCode("print('y' * 5000)");
  assert.equal(r.truncated, true);
  assert.ok(r.stdout.startsWith("y".repeat(1000)));
  assert.ok(r.messages.length > 0);
});

test("after Sandbox.get, runCode finds the existing context of the language and keeps its state", { timeout: 60_000 }, async () => {
  const sb = await newSandbox();
  await sb.runCode("counter = 1");
  await sb.runCode("cd /tmp", "bash");
  const again = await Sandbox.get(sb.id);
  assert.equal(text(await again.runCode("counter += 1\ncounter")), "2");
  assert.equal((await again.runCode("pwd", "bash")).stdout, "/tmp\n");
  // Still one context per language: nothing new was created.
  assert.equal((await sessions(sb.id)).length, 2);
  // A third handle, running javascript for the first time, creates one.
  const third = await Sandbox.get(sb.id);
  assert.equal(text(await third.runCode("1 + 1", "javascript")), "2");
  assert.equal((await sessions(sb.id)).length, 3);
  // Concurrent first calls on a new handle share one lookup and one context.
  const fourth = await Sandbox.get(sb.id);
  const rs = await Promise.all([fourth.runCode("counter"), fourth.runCode("counter")]);
  assert.deepEqual(rs.map(text), ["2", "2"]);
  assert.equal((await sessions(sb.id)).length, 3);
});

test("when runCode's context was closed elsewhere, it runs in a new one and says state was lost", { timeout: 60_000 }, async () => {
  const sb = await newSandbox();
  await sb.runCode("z = 1");
  const [s] = await sessions(sb.id);
  assert.ok(s);
  const del = await fetch(`${URL_}/v1/sandboxes/${sb.id}/repl/sessions/${s.id}`, {
    method: "DELETE",
    headers: { Authorization: `Bearer ${KEY}` },
  });
  assert.equal(del.status, 204);
  const r = await sb.runCode("'z' in globals()");
  assert.equal(text(r), "False");
  assert.equal(r.stateLost, true);
  assert.match(r.messages[0] ?? "", /was gone/);
  assert.equal(text(await sb.runCode("'z' in globals()")), "False");
  assert.equal((await sessions(sb.id)).length, 1);
});

test("createCodeContext, CodeContext.runCode, restart and close", { timeout: 60_000 }, async () => {
  const sb = await newSandbox();
  const ctx = await sb.createCodeContext();
  assert.ok(ctx instanceof CodeContext);
  assert.equal(ctx.language, "python");
  assert.match(ctx.id, /^[0-9a-f]+$/);
  await ctx.runCode("a = 5");
  assert.equal(text(await ctx.runCode("a * 2")), "10");
  // Separate from runCode's own context.
  assert.equal(text(await sb.runCode("'a' in globals()")), "False");

  const t = await ctx.runCode("import time\ntime.sleep(30)", { timeoutSeconds: 0.5 });
  assert.equal(t.timedOut, true);
  assert.equal(t.error?.name, "TimeoutError");
  assert.equal(text(await ctx.runCode("a")), "5");

  await ctx.restart();
  const r = await ctx.runCode("'a' in globals()");
  assert.equal(text(r), "False");

  const js = await sb.createCodeContext("javascript");
  assert.equal(js.language, "javascript");
  assert.equal(text(await js.runCode("[1, 2, 3].length")), "3");
  const sh = await sb.createCodeContext("bash");
  assert.equal((await sh.runCode("echo $((6 * 7))")).stdout, "42\n");

  await ctx.close();
  await assert.rejects(ctx.runCode("1"), NotFoundError);
  await assert.rejects(ctx.restart(), NotFoundError);
  await ctx.close(); // already closed: not an error
  await js.close();
  await sh.close();
  assert.deepEqual((await sessions(sb.id)).map((s) => s.language), ["python"]);
});
