/**
 * A real @mastra/core Agent, driven by a scripted model, calls the run-code
 * tool against a live runcell daemon (RUNCELL_URL, RUNCELL_API_KEY; see
 * scripts/test-mastra.sh).
 */
import { after, describe, test } from "node:test";
import assert from "node:assert/strict";
import { Agent } from "@mastra/core/agent";
import { Sandbox } from "runcell";
import type { RunResult } from "runcell";
import {
  createRunCodeTool,
  sweepOrphans,
  TOOL_METADATA_KEY,
  TOOL_METADATA_VALUE,
  type RunCodeOutput,
  type RunCodeToolOptions,
} from "../src/index.js";
import {
  ScriptedModel,
  createRawSandbox,
  deleteSandbox,
  getSandbox,
  listSandboxes,
  toolResultsInPrompt,
  uniqueId,
  waitFor,
} from "./helpers.js";

/** Stamped on every sandbox these tests make, so they only ever count and clean their own. */
const RUN = uniqueId("mastra-test");
const OURS = { [TOOL_METADATA_KEY]: TOOL_METADATA_VALUE, testRun: RUN };

after(async () => {
  for (const sb of await listSandboxes({ testRun: RUN })) await deleteSandbox(sb.id);
});

function makeAgent(options: RunCodeToolOptions) {
  const script = new ScriptedModel("run_code");
  const seen: { sandboxId: string; threadId?: string; result: RunResult }[] = [];
  const tool = createRunCodeTool({
    ...options,
    metadata: { ...options.metadata, testRun: RUN },
    onResult: (result, info) => {
      seen.push({ ...info, result });
    },
  });
  const agent = new Agent({
    id: "coder",
    name: "coder",
    instructions: "You write and run code.",
    // ai@7's provider types are a newer patch of the spec than the copy
    // @mastra/core compiles against; the objects are the same at run time.
    model: script.model as never,
    tools: { run_code: tool },
  });
  return { agent, script, seen, tool };
}

/** The tool outputs of one agent.generate result, in call order. */
function outputs(result: { toolResults: unknown[] }): RunCodeOutput[] {
  return result.toolResults.map((r) => {
    const payload = (r as { payload?: { result?: unknown; isError?: boolean } }).payload;
    assert.ok(payload, `tool result without payload: ${JSON.stringify(r)}`);
    return payload.result as RunCodeOutput;
  });
}

function only<T>(xs: T[], what: string): T {
  assert.equal(xs.length, 1, `expected exactly one ${what}, got ${xs.length}: ${JSON.stringify(xs)}`);
  return xs[0] as T;
}

describe("per-call mode", () => {
  test("runs the model's code and leaves no sandbox behind", async () => {
    const { agent, script, seen } = makeAgent({});
    script.turn({ code: "import sys\nprint(6*7)\nsys.stderr.write('careful: ' + 'x' * 3 + '\\n')\n'done'" });
    const res = await agent.generate("What is 6*7?");
    const out = only(outputs(res), "tool result");
    assert.equal(out.stdout, "42\n");
    assert.equal(out.stderr, "careful: xxx\n");
    assert.equal(out.exitCode, 0);
    assert.deepEqual(out.results, ["'done'"]);
    assert.equal(out.timedOut, false);
    assert.equal(out.truncated, false);
    assert.equal(res.text, "stdout was: 42\n", "the model got the tool's output back");
    // The sandbox existed, was per-call, and is gone now.
    const { sandboxId } = only(seen, "run");
    assert.match(sandboxId, /\S/);
    assert.deepEqual(await listSandboxes(OURS), [], "per-call mode left a sandbox behind");
    await assert.rejects(Sandbox.get(sandboxId), (e: Error) => e.name === "NotFoundError");
  });

  test("tells the model nothing persists, and nothing does", async () => {
    const { agent, script, seen } = makeAgent({ mode: "per-call" });
    const description = () => script.toolDescriptions[0]?.run_code ?? "";
    script.turn({ code: "x = 41\nopen('/tmp/f', 'w').write('hi')" });
    script.turn({ code: "import os\nprint(os.path.exists('/tmp/f'))\nprint(x + 1)" });
    await agent.generate("set x", { memory: { thread: uniqueId("t"), resource: "u" } });
    const res = await agent.generate("print x+1");
    const out = only(outputs(res), "tool result");
    assert.equal(out.stdout, "False\n", "a file from the previous call survived");
    assert.equal(out.error?.name, "NameError");
    assert.notEqual(out.exitCode, 0);
    assert.equal(seen.length, 2);
    assert.notEqual(seen[0]?.sandboxId, seen[1]?.sandboxId);
    assert.match(description(), /Nothing persists between calls/);
    assert.match(description(), /same snippet/);
    assert.doesNotMatch(description(), /State persists/);
    assert.deepEqual(await listSandboxes(OURS), []);
  });

  test("javascript and bash", async () => {
    const { agent, script } = makeAgent({});
    script.turn([
      { code: "console.log([1, 2, 3].map((n) => n * 2).join(','))", language: "javascript" },
      { code: "echo hello from $0 >&2; echo $((6 * 7))", language: "bash" },
    ]);
    const res = await agent.generate("two languages");
    const outs = outputs(res);
    assert.equal(outs.length, 2);
    const js = outs.find((o) => o.stdout.includes(","));
    const sh = outs.find((o) => o.stdout.startsWith("42"));
    assert.equal(js?.stdout, "2,4,6\n");
    assert.equal(sh?.stdout, "42\n");
    assert.match(sh?.stderr ?? "", /hello from/);
    assert.deepEqual(await listSandboxes(OURS), []);
  });

  test("a failing call still kills its sandbox", async () => {
    const { agent, script, seen } = makeAgent({});
    script.turn({ code: "raise ValueError('boom')" });
    const res = await agent.generate("fail");
    const out = only(outputs(res), "tool result");
    assert.equal(out.error?.name, "ValueError");
    assert.equal(out.error?.value, "boom");
    assert.match(out.error?.traceback ?? "", /boom/);
    assert.equal(seen.length, 1);
    assert.deepEqual(await listSandboxes(OURS), []);
  });

  test("the per-call TTL backstop is set on the server", async () => {
    const tool = createRunCodeTool({ metadata: { testRun: RUN, probe: "ttl" } });
    // Look at the sandbox while the call is running.
    const running = tool.execute!(
      { code: "import time\ntime.sleep(3)\nprint('ok')", language: "python" },
      {} as never,
    ) as Promise<RunCodeOutput>;
    let listed: Awaited<ReturnType<typeof listSandboxes>> = [];
    for (let i = 0; i < 50 && listed.length === 0; i++) {
      listed = await listSandboxes({ testRun: RUN, probe: "ttl" });
      if (listed.length === 0) await new Promise((r) => setTimeout(r, 100));
    }
    const sb = only(listed, "per-call sandbox");
    assert.equal(sb.ttl_seconds, 300);
    assert.equal(sb.metadata.mode, "per-call");
    assert.equal(sb.template, "code-interpreter");
    assert.equal((await running).stdout, "ok\n");
    assert.deepEqual(await listSandboxes({ testRun: RUN, probe: "ttl" }), []);
  });
});

describe("per-thread mode", () => {
  test("one sandbox per thread, reused across turns, not shared between threads", async () => {
    const { agent, script, seen } = makeAgent({ mode: "per-thread" });
    const threadA = uniqueId("thread-a");
    const threadB = uniqueId("thread-b");

    script.turn({ code: "x = 41\nopen('notes.txt', 'w').write('kept')" });
    const t1 = await agent.generate("set x to 41", { memory: { thread: threadA, resource: "user-1" } });
    assert.equal(only(outputs(t1), "tool result").exitCode, 0);

    script.turn({ code: "print(x + 1)\nprint(open('notes.txt').read())" });
    const t2 = await agent.generate("print x+1", { memory: { thread: threadA, resource: "user-1" } });
    const out2 = only(outputs(t2), "tool result");
    assert.equal(out2.stdout, "42\nkept\n", `state did not persist: ${JSON.stringify(out2)}`);
    assert.equal(out2.message, undefined);
    assert.equal(t2.text, "stdout was: 42\nkept\n");

    script.turn({ code: "print(x)" });
    const b = await agent.generate("print x", { memory: { thread: { id: threadB }, resource: "user-2" } });
    const outB = only(outputs(b), "tool result");
    assert.equal(outB.error?.name, "NameError", "thread B saw thread A's variables");

    assert.equal(seen.length, 3);
    assert.equal(seen[0]?.sandboxId, seen[1]?.sandboxId, "turn 2 ran in a different sandbox");
    assert.notEqual(seen[2]?.sandboxId, seen[0]?.sandboxId, "thread B shared thread A's sandbox");
    assert.equal(seen[0]?.threadId, threadA);
    assert.equal(seen[2]?.threadId, threadB);

    const live = await listSandboxes({ ...OURS, mode: "per-thread" });
    assert.equal(live.length, 2, JSON.stringify(live));
    const a = only(live.filter((s) => s.metadata.threadId === threadA), "sandbox of thread A");
    assert.equal(a.id, seen[0]?.sandboxId);
    assert.equal(a.metadata.resourceId, "user-1");
    assert.equal(a.ttl_seconds, 1800);
    only(live.filter((s) => s.metadata.threadId === threadB), "sandbox of thread B");

    const description = script.toolDescriptions[0]?.run_code ?? "";
    assert.match(description, /State persists between calls in this conversation/);
    assert.match(description, /30 minutes/);

    assert.deepEqual((await sweepOrphans({ activeThreadIds: [], metadata: { testRun: RUN } })).sort(), live.map((s) => s.id).sort());
  });

  test("a second tool instance (a new process) finds the thread's sandbox by metadata", async () => {
    const thread = uniqueId("thread-restart");
    const first = makeAgent({ mode: "per-thread", ttlSeconds: 120 });
    first.script.turn({ code: "y = 'survives a restart'" });
    await first.agent.generate("set y", { memory: { thread, resource: "u" } });

    const second = makeAgent({ mode: "per-thread", ttlSeconds: 120 });
    second.script.turn({ code: "print(y)" });
    const res = await second.agent.generate("print y", { memory: { thread, resource: "u" } });
    assert.equal(only(outputs(res), "tool result").stdout, "survives a restart\n");
    assert.equal(first.seen[0]?.sandboxId, second.seen[0]?.sandboxId);
    const live = await listSandboxes({ ...OURS, threadId: thread });
    assert.equal(live.length, 1);
    assert.equal(live[0]?.ttl_seconds, 120);
    await deleteSandbox(live[0]!.id);
  });

  test("a sandbox that is gone is recreated, and the model is told", async () => {
    const { agent, script, seen } = makeAgent({ mode: "per-thread" });
    const thread = uniqueId("thread-gone");
    script.turn({ code: "z = 1" });
    await agent.generate("set z", { memory: { thread, resource: "u" } });
    const firstId = seen[0]!.sandboxId;
    await deleteSandbox(firstId); // as the idle TTL would

    script.turn({ code: "print('z' in globals())" });
    const res = await agent.generate("is z there?", { memory: { thread, resource: "u" } });
    const out = only(outputs(res), "tool result");
    assert.equal(out.stdout, "False\n");
    assert.match(out.message ?? "", /previous sandbox had expired/);
    assert.notEqual(seen[1]?.sandboxId, firstId);
    const live = await listSandboxes({ ...OURS, threadId: thread });
    assert.deepEqual(live.map((s) => s.id), [seen[1]?.sandboxId]);
    await deleteSandbox(seen[1]!.sandboxId);
  });

  test("an idle thread's sandbox hibernates instead of being deleted, and the thread's next call wakes it", async () => {
    const { agent, script, seen } = makeAgent({ mode: "per-thread", ttlSeconds: 2 });
    const thread = uniqueId("thread-hibernate");
    script.turn({ code: "w = 7\nopen('kept.txt', 'w').write('on disk')" });
    await agent.generate("set w", { memory: { thread, resource: "u" } });
    const id = seen[0]!.sandboxId;
    assert.equal((await getSandbox(id))?.on_idle, "hibernate");
    assert.ok(
      await waitFor(id, (sb) => sb?.status === "hibernated", 30),
      `not hibernated 30 s after a 2 s idle TTL: ${JSON.stringify(await getSandbox(id))}`,
    );
    assert.equal(script.toolDescriptions[0]?.run_code?.includes("files and packages are not"), true);

    script.turn({ code: "print(open('kept.txt').read())\nprint('w' in globals())" });
    const res = await agent.generate("is w there?", { memory: { thread, resource: "u" } });
    const out = only(outputs(res), "tool result");
    assert.equal(out.stdout, "on disk\nFalse\n", JSON.stringify(out));
    assert.match(out.message ?? "", /was hibernated; this call woke it/);
    assert.doesNotMatch(out.message ?? "", /had expired|interpreter had to be restarted/);
    assert.equal(seen[1]?.sandboxId, id, "the woken sandbox is the same one");
    assert.equal((await getSandbox(id))?.status, "running");

    // Awake again, the thread goes on as before: no note.
    script.turn({ code: "print(w if 'w' in globals() else 'unset')" });
    const again = only(outputs(await agent.generate("w?", { memory: { thread, resource: "u" } })), "tool result");
    assert.equal(again.message, undefined);
    await deleteSandbox(id);
  });

  test("onThreadIdle: \"delete\" deletes the idle sandbox, and the next call says it started afresh", async () => {
    const { agent, script, seen } = makeAgent({ mode: "per-thread", ttlSeconds: 2, onThreadIdle: "delete" });
    const thread = uniqueId("thread-delete");
    script.turn({ code: "v = 1" });
    await agent.generate("set v", { memory: { thread, resource: "u" } });
    const id = seen[0]!.sandboxId;
    assert.equal((await getSandbox(id))?.on_idle, "delete");
    assert.ok(await waitFor(id, (sb) => sb === undefined, 30), "the idle sandbox was not deleted within 30 s");
    script.turn({ code: "print('v' in globals())" });
    const out = only(outputs(await agent.generate("v?", { memory: { thread, resource: "u" } })), "tool result");
    assert.equal(out.stdout, "False\n");
    assert.match(out.message ?? "", /previous sandbox had expired/);
    assert.match(script.toolDescriptions[0]?.run_code ?? "", /After that it is deleted/);
    await deleteSandbox(seen[1]!.sandboxId);
  });

  test("parallel calls in one thread make one sandbox and run in order", async () => {
    const { agent, script, seen } = makeAgent({ mode: "per-thread" });
    const thread = uniqueId("thread-parallel");
    script.turn([
      { code: "import time\ntime.sleep(0.5)\nprint('one')" },
      { code: "print('two')" },
      { code: "print('three')" },
    ]);
    const res = await agent.generate("three at once", { memory: { thread, resource: "u" } });
    const outs = outputs(res);
    assert.equal(outs.length, 3);
    assert.deepEqual(outs.map((o) => o.stdout).sort(), ["one\n", "three\n", "two\n"]);
    assert.equal(new Set(seen.map((s) => s.sandboxId)).size, 1, "parallel calls created more than one sandbox");
    const live = await listSandboxes({ ...OURS, threadId: thread });
    assert.equal(live.length, 1, JSON.stringify(live));
    await deleteSandbox(live[0]!.id);
  });

  test("the same lock holds for direct calls racing on a new thread", async () => {
    const tool = createRunCodeTool({ mode: "per-thread", metadata: { testRun: RUN } });
    const thread = uniqueId("thread-race");
    const ctx = { agent: { threadId: thread, resourceId: "u" } } as never;
    const outs = (await Promise.all(
      Array.from({ length: 5 }, (_, i) => tool.execute!({ code: `print(${i})`, language: "python" }, ctx)),
    )) as RunCodeOutput[];
    assert.deepEqual(outs.map((o) => o.stdout), ["0\n", "1\n", "2\n", "3\n", "4\n"]);
    const live = await listSandboxes({ ...OURS, threadId: thread });
    assert.equal(live.length, 1, JSON.stringify(live));
    await deleteSandbox(live[0]!.id);
  });

  test("the thread id can come from the request context", async () => {
    const { RequestContext, MASTRA_THREAD_ID_KEY } = await import("@mastra/core/request-context");
    const { agent, script, seen } = makeAgent({ mode: "per-thread" });
    const thread = uniqueId("thread-rc");
    const requestContext = new RequestContext();
    requestContext.set(MASTRA_THREAD_ID_KEY, thread);
    script.turn({ code: "print('hi')" });
    const res = await agent.generate("hi", { requestContext });
    assert.equal(only(outputs(res), "tool result").stdout, "hi\n");
    assert.equal(seen[0]?.threadId, thread);
    await deleteSandbox(seen[0]!.sandboxId);
  });

  test("without a thread id the call fails with a clear error and creates nothing", async () => {
    const tool = createRunCodeTool({ mode: "per-thread", metadata: { testRun: RUN, probe: "nothread" } });
    await assert.rejects(
      Promise.resolve(tool.execute!({ code: "print(1)", language: "python" }, {} as never)),
      /no conversation thread id/,
    );
    assert.deepEqual(await listSandboxes({ testRun: RUN, probe: "nothread" }), []);

    // Through an agent called without memory, the model is told the same.
    const { agent, script } = makeAgent({ mode: "per-thread", metadata: { probe: "nothread" } });
    script.turn({ code: "print(1)" });
    await agent.generate("no thread");
    const lastPrompt = JSON.stringify(script.prompts[script.prompts.length - 1]);
    assert.match(lastPrompt, /no conversation thread id/);
    assert.deepEqual(await listSandboxes({ testRun: RUN, probe: "nothread" }), []);
  });
});

describe("output", () => {
  test("long output is truncated with a marker giving the total size", async (t) => {
    const { agent, script, seen } = makeAgent({ maxOutputChars: 500 });
    script.turn({ code: "print('a' * 20000)\nprint('THE END')" });
    const res = await agent.generate("print a lot");
    const out = only(outputs(res), "tool result");
    t.diagnostic(`what the model got: ${JSON.stringify(out)}`);
    const total = 20000 + 1 + "THE END\n".length;
    assert.equal(seen[0]?.result.stdout.length, total, "the sandbox itself did not cut the output");
    assert.ok(out.stdout.length <= 500, `stdout is ${out.stdout.length} characters`);
    assert.match(out.stdout, /^a+\n\[\.\.\. output truncated: \d+ of 20009 characters omitted \(total 20009 characters\) \.\.\.\]\n/);
    assert.ok(out.stdout.endsWith("THE END\n"), "the tail of the output was not kept");
    assert.equal(out.truncated, true);
    // Under the limit nothing changes.
    script.turn({ code: "print('short')" });
    const res2 = await agent.generate("print a little");
    const out2 = only(outputs(res2), "tool result");
    assert.equal(out2.stdout, "short\n");
    assert.equal(out2.truncated, false);
    assert.match(script.toolDescriptions[0]?.run_code ?? "", /cut to 500 characters/);
  });

  test("the default limit is 8000 characters", async () => {
    const { agent, script } = makeAgent({});
    script.turn({ code: "import sys\nsys.stderr.write('e' * 9000)" });
    const out = only(outputs(await agent.generate("stderr")), "tool result");
    assert.ok(out.stderr.length <= 8000 && out.stderr.length > 7800, `stderr is ${out.stderr.length} characters`);
    assert.match(out.stderr, /output truncated: \d+ of 9000 characters omitted/);
    assert.equal(out.truncated, true);
  });

  test("a timeout returns a plain message, and per-thread state survives it", async (t) => {
    const { agent, script } = makeAgent({ mode: "per-thread", timeoutSeconds: 2 });
    const thread = uniqueId("thread-timeout");
    script.turn({ code: "kept = 'yes'" });
    await agent.generate("set", { memory: { thread, resource: "u" } });

    script.turn({ code: "import time\nprint('starting', flush=True)\nwhile True:\n    time.sleep(0.05)" });
    const started = Date.now();
    const res = await agent.generate("loop", { memory: { thread, resource: "u" } });
    const out = only(outputs(res), "tool result");
    t.diagnostic(`what the model got: ${JSON.stringify(out)}`);
    assert.ok(Date.now() - started < 30_000);
    assert.equal(out.timedOut, true);
    assert.match(out.message ?? "", /^Execution timed out after 2s and was interrupted/);
    assert.match(out.message ?? "", /Variables and files from before this call are kept/);
    assert.match(out.stdout, /starting/);

    script.turn({ code: "print(kept)" });
    const after = await agent.generate("still there?", { memory: { thread, resource: "u" } });
    assert.equal(only(outputs(after), "tool result").stdout, "yes\n");
    for (const s of await listSandboxes({ ...OURS, threadId: thread })) await deleteSandbox(s.id);
  });

  test("a per-call timeout says to split the work, and kills the sandbox", async () => {
    const { agent, script } = makeAgent({ timeoutSeconds: 1 });
    script.turn({ code: "while True: pass" });
    const out = only(outputs(await agent.generate("loop")), "tool result");
    assert.equal(out.timedOut, true);
    assert.match(out.message ?? "", /^Execution timed out after 1s/);
    assert.match(out.message ?? "", /self-contained/);
    assert.deepEqual(await listSandboxes(OURS), []);
  });

  test("images are counted, not sent", async (t) => {
    const { agent, script, seen } = makeAgent({});
    script.turn({
      code: "import matplotlib\nmatplotlib.use('Agg')\nimport matplotlib.pyplot as plt\nplt.plot([1, 2, 3])\nplt.show()\nprint('plotted')",
    });
    const out = only(outputs(await agent.generate("plot")), "tool result");
    t.diagnostic(`what the model got: ${JSON.stringify(out)}`);
    assert.equal(out.stdout, "plotted\n");
    assert.equal(out.images, 1);
    assert.match(out.results.join("\n"), /image\/png image/);
    assert.match(out.message ?? "", /1 image/);
    assert.doesNotMatch(JSON.stringify(out), /iVBOR/, "the PNG itself reached the model");
    assert.ok(seen[0]?.result.results.some((r) => (r["image/png"] ?? "").startsWith("iVBOR")), "onResult did not get the PNG");
  });

  test("the model sees the tool's output in its next prompt", async () => {
    const { agent, script } = makeAgent({});
    script.turn({ code: "print('round trip')" });
    await agent.generate("go");
    const lastPrompt = script.prompts[script.prompts.length - 1];
    const results = toolResultsInPrompt(lastPrompt) as RunCodeOutput[];
    assert.equal(results[results.length - 1]?.stdout, "round trip\n");
  });
});

describe("sweepOrphans", () => {
  test("kills exactly the tool's sandboxes of inactive threads", async () => {
    const tool = createRunCodeTool({ mode: "per-thread", metadata: { testRun: RUN, probe: "sweep" } });
    const [t1, t2, t3] = [uniqueId("sweep-1"), uniqueId("sweep-2"), uniqueId("sweep-3")];
    const ids: Record<string, string> = {};
    for (const t of [t1, t2, t3]) {
      await tool.execute!({ code: "print(1)", language: "python" }, { agent: { threadId: t } } as never);
      const listed = await listSandboxes({ testRun: RUN, threadId: t });
      ids[t] = only(listed, `sandbox of ${t}`).id;
    }
    // Not made by the tool, though it names an inactive thread: must survive.
    const foreign = await createRawSandbox({ threadId: t2, testRun: RUN, probe: "sweep" });
    // Made by the tool for another app (other metadata): out of this sweep's scope.
    const otherApp = createRunCodeTool({ mode: "per-thread", metadata: { testRun: RUN, probe: "sweep-other-app" } });
    await otherApp.execute!({ code: "print(1)", language: "python" }, { agent: { threadId: t3 } } as never);

    const killed = await sweepOrphans({ activeThreadIds: new Set([t1]), metadata: { probe: "sweep", testRun: RUN } });
    assert.deepEqual([...killed].sort(), [ids[t2], ids[t3]].sort());

    const left = (await listSandboxes({ testRun: RUN })).map((s) => s.id);
    assert.ok(left.includes(ids[t1]!), "the active thread's sandbox was killed");
    assert.ok(left.includes(foreign), "a sandbox the tool did not make was killed");
    assert.ok(!left.includes(ids[t2]!) && !left.includes(ids[t3]!), "an orphan survived");
    assert.equal((await listSandboxes({ testRun: RUN, probe: "sweep-other-app" })).length, 1);

    // Nothing left to do the second time.
    assert.deepEqual(await sweepOrphans({ activeThreadIds: [t1], metadata: { probe: "sweep", testRun: RUN } }), []);

    // The active thread goes on in the same sandbox; after its sweep it starts afresh.
    const again = (await tool.execute!({ code: "print(2)", language: "python" }, { agent: { threadId: t1 } } as never)) as RunCodeOutput;
    assert.equal(again.stdout, "2\n");
    assert.deepEqual(await sweepOrphans({ activeThreadIds: [], metadata: { probe: "sweep", testRun: RUN } }), [ids[t1]]);
    await deleteSandbox(foreign);
  });

  test("leaves the hibernated sandbox of a live thread alone, asleep, and kills a dead thread's", async () => {
    const meta = { testRun: RUN, probe: "sweep-hibernated" };
    const tool = createRunCodeTool({ mode: "per-thread", metadata: meta });
    const [live, dead] = [uniqueId("sweep-live"), uniqueId("sweep-dead")];
    const ids: Record<string, string> = {};
    for (const t of [live, dead]) {
      await tool.execute!({ code: "print(1)", language: "python" }, { agent: { threadId: t } } as never);
      ids[t] = only(await listSandboxes({ ...meta, threadId: t }), `sandbox of ${t}`).id;
      await (await Sandbox.get(ids[t]!)).hibernate();
      assert.equal((await getSandbox(ids[t]!))?.status, "hibernated");
    }
    assert.deepEqual(await sweepOrphans({ activeThreadIds: [live], metadata: meta }), [ids[dead]]);
    assert.equal((await getSandbox(ids[live]!))?.status, "hibernated", "the sweep woke (or killed) a live thread's sandbox");
    assert.equal(await getSandbox(ids[dead]!), undefined);
    // The live thread's next call wakes it.
    const out = (await tool.execute!({ code: "print(2)", language: "python" }, { agent: { threadId: live } } as never)) as RunCodeOutput;
    assert.equal(out.stdout, "2\n");
    assert.match(out.message ?? "", /was hibernated/);
    assert.deepEqual(await sweepOrphans({ activeThreadIds: [], metadata: meta }), [ids[live]]);
  });

  test("includePerCall also kills per-call sandboxes of inactive threads", async () => {
    const meta = { testRun: RUN, probe: "sweep-per-call" };
    const tool = createRunCodeTool({ metadata: meta });
    const thread = uniqueId("sweep-pc");
    const running = tool.execute!(
      { code: "import time\ntime.sleep(30)", language: "python" },
      { agent: { threadId: thread } } as never,
    ) as Promise<RunCodeOutput>;
    // Killed under it, the call fails; that is expected here.
    const settled = running.then(
      () => undefined,
      () => undefined,
    );
    let listed: Awaited<ReturnType<typeof listSandboxes>> = [];
    for (let i = 0; i < 100 && listed.length === 0; i++) {
      listed = await listSandboxes(meta);
      if (listed.length === 0) await new Promise((r) => setTimeout(r, 100));
    }
    const sb = only(listed, "per-call sandbox");
    assert.deepEqual(await sweepOrphans({ activeThreadIds: [], metadata: meta }), [], "per-call ones are left alone by default");
    assert.deepEqual(await sweepOrphans({ activeThreadIds: [], metadata: meta, includePerCall: true }), [sb.id]);
    await settled;
    assert.deepEqual(await listSandboxes(meta), []);
  });
});
