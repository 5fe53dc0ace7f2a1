/**
 * Pure parts of the tool (no daemon): truncation, result formatting, the
 * description, the schemas, option checks, and that both builds load.
 */
import { test } from "node:test";
import assert from "node:assert/strict";
import { createRequire } from "node:module";
import type { RunResult } from "runcell";
import { createRunCodeTool, defaultThreadId, describeTool, formatRunResult, truncate } from "../src/index.js";

const base: RunResult = {
  stdout: "",
  stderr: "",
  exitCode: 0,
  results: [],
  timedOut: false,
  truncated: false,
  stateLost: false,
  durationMs: 5,
  messages: [],
};

test("truncate keeps text within the limit unchanged", () => {
  assert.deepEqual(truncate("hello", 200), { text: "hello", truncated: false });
  const exact = "x".repeat(200);
  assert.deepEqual(truncate(exact, 200), { text: exact, truncated: false });
});

test("truncate cuts to the limit, keeps head and tail, and states the total", () => {
  const text = "H".repeat(5000) + "T".repeat(5000);
  const { text: cut, truncated } = truncate(text, 1000);
  assert.equal(truncated, true);
  assert.ok(cut.length <= 1000, `${cut.length} > 1000`);
  assert.ok(cut.length > 900, "the budget was wasted");
  assert.ok(cut.startsWith("HHHH"));
  assert.ok(cut.endsWith("TTTT"));
  const m = /\[\.\.\. output truncated: (\d+) of 10000 characters omitted \(total 10000 characters\) \.\.\.\]/.exec(cut);
  assert.ok(m, cut);
  const kept = cut.replace(m[0], "").replace(/\n/g, "").length;
  assert.equal(kept + Number(m[1]), 10000, "the omitted count does not add up");
});

test("formatRunResult summarises results and counts images", () => {
  const out = formatRunResult(
    {
      ...base,
      stdout: "hi\n",
      stderr: "warning: x\n",
      results: [{ "text/plain": "42" }, { "image/png": "iVBORw0KGgo=", "text/plain": "<Figure>" }, { "text/html": "<b>x</b>" }],
    },
    { maxOutputChars: 8000, persistent: false },
  );
  assert.equal(out.stdout, "hi\n");
  assert.equal(out.stderr, "warning: x\n");
  assert.deepEqual(out.results, ["42", "[image/png image: <Figure>; not shown to you]", "[text/html result; not shown to you]"]);
  assert.equal(out.images, 1);
  assert.match(out.message ?? "", /produced 1 image \(not shown to you\)/);
  assert.equal(out.truncated, false);
  assert.equal(out.error, undefined);
});

test("formatRunResult: the sandbox's own truncation is reported", () => {
  const out = formatRunResult({ ...base, stdout: "abc\n[runcell: output truncated]", truncated: true }, { maxOutputChars: 8000, persistent: false });
  assert.equal(out.truncated, true);
});

test("formatRunResult: error fields are bounded too", () => {
  const out = formatRunResult(
    { ...base, exitCode: 1, error: { name: "ValueError", value: "v".repeat(1000), traceback: "t".repeat(1000) } },
    { maxOutputChars: 300, persistent: false },
  );
  assert.equal(out.error?.name, "ValueError");
  assert.ok((out.error?.value.length ?? 0) <= 300);
  assert.ok((out.error?.traceback.length ?? 0) <= 300);
  assert.equal(out.truncated, true);
});

test("formatRunResult: timeout and lost state become plain sentences", () => {
  const perCall = formatRunResult({ ...base, timedOut: true }, { maxOutputChars: 8000, persistent: false, timeoutSeconds: 7 });
  assert.match(perCall.message ?? "", /^Execution timed out after 7s and was interrupted/);
  assert.match(perCall.message ?? "", /self-contained/);
  assert.doesNotMatch(perCall.message ?? "", /from before this call are kept/);

  const kept = formatRunResult({ ...base, timedOut: true }, { maxOutputChars: 8000, persistent: true, timeoutSeconds: 7 });
  assert.match(kept.message ?? "", /Variables and files from before this call are kept/);

  const lost = formatRunResult({ ...base, timedOut: true, stateLost: true }, { maxOutputChars: 8000, persistent: true, timeoutSeconds: 7 });
  assert.doesNotMatch(lost.message ?? "", /Variables and files from before this call are kept/);
  assert.match(lost.message ?? "", /interpreter had to be restarted/);

  const once = formatRunResult(
    { ...base, timedOut: true, messages: ["The cell timed out after 7s and was interrupted; the context's earlier state is kept."] },
    { maxOutputChars: 8000, persistent: true, timeoutSeconds: 7 },
  );
  assert.equal((once.message ?? "").match(/timed out/g)?.length, 1, once.message);

  const daemonSays = formatRunResult({ ...base, messages: ["The cell was killed: out of memory (512 MiB)."] }, { maxOutputChars: 8000, persistent: false });
  assert.equal(daemonSays.message, "The cell was killed: out of memory (512 MiB).");
});

test("describeTool tells the truth about state in each mode", () => {
  const common = { languages: ["python", "bash"] as const, timeoutSeconds: 60, maxOutputChars: 8000 };
  const perCall = describeTool({ ...common, mode: "per-call", ttlSeconds: 300 });
  assert.match(perCall, /Nothing persists between calls/);
  assert.match(perCall, /install packages, import modules, load data and define functions in the same snippet/);
  assert.match(perCall, /default python/);
  assert.doesNotMatch(perCall, /javascript/);
  assert.doesNotMatch(perCall, /300/, "the per-call backstop TTL is no business of the model");

  const perThread = describeTool({ ...common, mode: "per-thread", ttlSeconds: 1800 });
  assert.match(perThread, /State persists between calls in this conversation/);
  assert.match(perThread, /files written to disk and packages you install/);
  assert.match(perThread, /idle for more than 30 minutes/);
  assert.match(describeTool({ ...common, mode: "per-thread", ttlSeconds: 90 }), /90 seconds/);
  assert.match(describeTool({ ...common, mode: "per-thread", ttlSeconds: 7200 }), /2 hours/);
  // By default an idle thread's sandbox hibernates: files stay, variables go, and the model is told which.
  assert.match(perThread, /files written to disk and packages you install are kept/);
  assert.match(perThread, /after that they are gone \(files and packages are not\)/);
  assert.doesNotMatch(perThread, /deleted/);
  const deleting = describeTool({ ...common, mode: "per-thread", ttlSeconds: 1800, onThreadIdle: "delete" });
  assert.match(deleting, /After that it is deleted and the next call starts from a fresh sandbox/);
  assert.doesNotMatch(deleting, /are kept/);
});

test("the input schema limits code to 50,000 characters and defaults to python", () => {
  const tool = createRunCodeTool();
  const schema = tool.inputSchema as unknown as { safeParse(v: unknown): { success: boolean; data?: unknown } };
  assert.equal(schema.safeParse({ code: "x".repeat(50_000) }).success, true);
  assert.equal(schema.safeParse({ code: "x".repeat(50_001) }).success, false);
  assert.deepEqual(schema.safeParse({ code: "1" }).data, { code: "1", language: "python" });
  assert.equal(schema.safeParse({ code: "1", language: "ruby" }).success, false);
  assert.equal(tool.id, "run_code");
});

test("languages restricts the schema; the first one is the default", () => {
  const tool = createRunCodeTool({ languages: ["bash", "python"], id: "shell" });
  const schema = tool.inputSchema as unknown as { safeParse(v: unknown): { success: boolean; data?: unknown } };
  assert.deepEqual(schema.safeParse({ code: "ls" }).data, { code: "ls", language: "bash" });
  assert.equal(schema.safeParse({ code: "1", language: "javascript" }).success, false);
  assert.equal(tool.id, "shell");
  assert.match(tool.description ?? "", /default bash/);
});

test("bad options are refused at creation", () => {
  assert.throws(() => createRunCodeTool({ mode: "per-thread", onThreadIdle: "sleep" as never }), /onThreadIdle must be "hibernate" or "delete"/);
  assert.throws(() => createRunCodeTool({ mode: "forever" as never }), /mode must be/);
  assert.throws(() => createRunCodeTool({ languages: [] }), /must not be empty/);
  assert.throws(() => createRunCodeTool({ languages: ["ruby" as never] }), /unknown language "ruby"/);
  assert.throws(() => createRunCodeTool({ maxOutputChars: 10 }), /at least 200/);
});

test("the thread id comes from the agent, then the request context, then the context", () => {
  const rc = (v: unknown) => ({ get: (k: string) => (k === "mastra__threadId" ? v : undefined) });
  assert.equal(defaultThreadId({ agent: { threadId: "a" }, requestContext: rc("r"), threadId: "c" }), "a");
  assert.equal(defaultThreadId({ agent: {}, requestContext: rc("r"), threadId: "c" }), "r");
  assert.equal(defaultThreadId({ requestContext: rc(undefined), threadId: "c" }), "c");
  assert.equal(defaultThreadId({}), undefined);
  assert.equal(defaultThreadId(undefined), undefined);
});

test("the published builds load as ESM and as CommonJS", async () => {
  const esm = await import("@runcell/mastra");
  assert.equal(typeof esm.createRunCodeTool, "function");
  assert.equal(typeof esm.sweepOrphans, "function");
  const cjs = createRequire(import.meta.url)("@runcell/mastra") as typeof esm;
  assert.equal(typeof cjs.createRunCodeTool, "function");
  assert.equal(typeof cjs.sweepOrphans, "function");
  assert.match(cjs.createRunCodeTool({ mode: "per-thread" }).description ?? "", /State persists/);
});
