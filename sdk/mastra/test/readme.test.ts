/**
 * This package's README examples run as written against the live daemon:
 * each ts block becomes a module inside this package (so `@runcell/mastra`
 * and `@mastra/core` resolve as they do for a user) and is imported. The
 * README leaves two things to the reader, which the prelude provides: the
 * agent's `model` (here the scripted model of the other tests, which calls
 * `run_code` once and answers with its output) and `listLiveThreadIds()`
 * (here: no live threads, so the sweep removes what the first example left).
 */
import { test } from "node:test";
import assert from "node:assert/strict";
import { mkdirSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath, pathToFileURL } from "node:url";
import { listSandboxes } from "./helpers.js";

const here = dirname(fileURLToPath(import.meta.url)); // .build/test
const pkg = join(here, "..", "..");
const readme = readFileSync(join(pkg, "README.md"), "utf8");

interface Block {
  line: number;
  info: string;
  code: string;
}

function tsBlocks(md: string): Block[] {
  const out: Block[] = [];
  const lines = md.split("\n");
  for (let i = 0; i < lines.length; i++) {
    const open = /^```(ts|typescript|js|javascript)\b(.*)$/.exec(lines[i]!);
    if (!open) continue;
    const start = i;
    const body: string[] = [];
    for (i++; i < lines.length && !lines[i]!.startsWith("```"); i++) body.push(lines[i]!);
    out.push({ line: start + 1, info: `${open[1]}${open[2]}`, code: body.join("\n") });
  }
  return out;
}

const blocks = tsBlocks(readme);
const runnable = blocks.filter((b) => !/\bno-run\b/.test(b.info));

const prelude = (helpers: string) => `
import { ScriptedModel as __ScriptedModel } from ${JSON.stringify(helpers)};
const __script = new __ScriptedModel("run_code");
__script.turn({ code: "xs = [1, 2, 3]\\nys = [2, 4, 6]\\nprint(sum(y / x for x, y in zip(xs, ys)) / 3)" });
const model = __script.model;
async function listLiveThreadIds() { return []; }
export { __script };
`;

test("the README has runnable examples and every ts block runs", () => {
  assert.ok(runnable.length >= 2, `only ${runnable.length} runnable blocks`);
  for (const b of blocks) if (!runnable.includes(b)) assert.match(b.info, /no-run\s+\S/, `README.md line ${b.line}`);
});

for (const block of runnable) {
  test(`README.md line ${block.line}`, { timeout: 120_000 }, async () => {
    const dir = join(pkg, ".build", "readme");
    mkdirSync(dir, { recursive: true });
    const file = join(dir, `block-${block.line}-${process.pid}.mjs`);
    writeFileSync(file, prelude(pathToFileURL(join(here, "helpers.js")).href) + block.code + "\n");
    try {
      const mod = (await import(pathToFileURL(file).href)) as { __script: { steps: unknown[] } };
      if (/\.generate\(/.test(block.code)) {
        // The agent called run_code and answered with its output.
        assert.equal(mod.__script.steps.length, 0, "the example did not run the scripted agent turn to the end");
      }
    } finally {
      rmSync(file, { force: true });
    }
  });
}

test("the README's examples leave no per-thread sandbox behind (the sweep example removed it)", async () => {
  const left = await listSandboxes({ tool: "runcell-mastra", mode: "per-thread", threadId: "t-42" });
  assert.deepEqual(left.map((s) => s.id), []);
});
