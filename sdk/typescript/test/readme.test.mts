// The README's examples run against the live daemon, as written: each ts/js
// block (not marked `no-run`) is transpiled, its `import ... from "runcell"`
// pointed at this checkout's build, and run by node; a block that throws
// fails the test with its output.
import { test } from "node:test";
import assert from "node:assert/strict";
import { fileURLToPath } from "node:url";
import { dirname, join } from "node:path";
import { readFileSync } from "node:fs";
import { fencedBlocks, runBlock, runnableBlocks } from "./readme.mjs";
import { KEY, URL_ } from "./helpers.mjs";

const root = join(dirname(fileURLToPath(import.meta.url)), "..", "..");
const readme = join(root, "README.md");
const dist = join(root, "dist", "esm", "index.js");
const text = readFileSync(readme, "utf8");
const blocks = runnableBlocks(text, ["ts", "typescript", "js", "javascript"]);

test("the README has runnable TypeScript examples, and every ts/js block is either run or marked no-run", () => {
  assert.ok(blocks.length >= 4, `only ${blocks.length} runnable blocks in ${readme}`);
  const run = new Set(blocks.map((b) => b.line));
  const skipped = fencedBlocks(text).filter((b) => ["ts", "typescript", "js", "javascript"].includes(b.lang) && !run.has(b.line));
  for (const b of skipped) assert.match(b.info, /no-run/, `line ${b.line}`);
});

for (const block of blocks) {
  const title = block.code.split("\n").find((l) => l.trim() && !l.startsWith("import")) ?? "";
  test(`README.md line ${block.line}: ${title.trim().slice(0, 60)}`, { timeout: 180_000 }, () => {
    const r = runBlock(block, {
      languages: ["ts"],
      imports: { runcell: dist },
      timeoutMs: 170_000,
      env: { RUNCELL_URL: URL_, RUNCELL_API_KEY: KEY },
    });
    assert.ok(r.ok, `the example at README.md line ${block.line} failed (exit ${r.status}):\n${r.stderr}\n--- stdout:\n${r.stdout}`);
  });
}

test("the runner fails a block that throws, and honours no-run", () => {
  const md = "```ts\nthrow new Error('drifted')\n```\n\n```ts no-run\nthrow new Error('never')\n```\n";
  const runnable = runnableBlocks(md, ["ts"]);
  assert.equal(runnable.length, 1);
  const r = runBlock(runnable[0]!, { languages: ["ts"] });
  assert.equal(r.ok, false);
  assert.match(r.stderr, /drifted/);
  const ok = runBlock(runnableBlocks("```js\nawait Promise.resolve(1)\n```\n", ["js"])[0]!, { languages: ["js"] });
  assert.ok(ok.ok, ok.stderr);
});
