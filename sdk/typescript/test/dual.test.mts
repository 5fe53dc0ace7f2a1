// The package loads as both ESM (import) and CJS (require), through its
// exports map, with declarations for each, and the CJS build works end to end.
import { test } from "node:test";
import assert from "node:assert/strict";
import { existsSync, readFileSync } from "node:fs";
import { createRequire } from "node:module";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";
import * as esm from "runcell";

const require = createRequire(import.meta.url);
const pkgDir = join(dirname(fileURLToPath(import.meta.url)), "..", "..");
const names = [
  "AuthError",
  "BadRequestError",
  "CapacityError",
  "CodeContext",
  "ConflictError",
  "ConnectionError",
  "DEFAULT_KEY_FILE",
  "DEFAULT_URL",
  "NotFoundError",
  "QuotaError",
  "RuncellError",
  "Sandbox",
  "ServerError",
  "snapshots",
  "volumes",
];

test("import resolves to dist/esm and require to dist/cjs", () => {
  assert.equal(fileURLToPath(import.meta.resolve("runcell")), join(pkgDir, "dist/esm/index.js"));
  assert.equal(require.resolve("runcell"), join(pkgDir, "dist/cjs/index.js"));
  for (const d of ["dist/esm/index.d.ts", "dist/cjs/index.d.ts", "dist/esm/sandbox.d.ts", "dist/cjs/sandbox.d.ts"]) {
    assert.ok(existsSync(join(pkgDir, d)), `${d} is missing`);
  }
  // The CJS files really are CommonJS, the ESM files really are modules.
  assert.match(readFileSync(join(pkgDir, "dist/cjs/index.js"), "utf8"), /exports\./);
  assert.match(readFileSync(join(pkgDir, "dist/esm/index.js"), "utf8"), /^export /m);
  const pkg = JSON.parse(readFileSync(join(pkgDir, "package.json"), "utf8")) as { dependencies?: object };
  assert.equal(pkg.dependencies, undefined, "runcell has no runtime dependencies");
});

test("both builds export the same names", () => {
  const cjs = require("runcell") as Record<string, unknown>;
  assert.deepEqual(Object.keys(esm).sort(), names);
  assert.deepEqual(Object.keys(cjs).filter((k) => k !== "__esModule").sort(), names);
  for (const n of names) assert.equal(typeof cjs[n], typeof (esm as Record<string, unknown>)[n], n);
  const e = new (cjs.NotFoundError as typeof esm.NotFoundError)("x", { status: 404 });
  assert.ok(e instanceof (cjs.RuncellError as typeof esm.RuncellError));
  assert.equal(e.name, "NotFoundError");
});

test("the CJS build talks to the daemon: create, runCode, kill", { timeout: 60_000 }, async () => {
  const { Sandbox, NotFoundError } = require("runcell") as typeof esm;
  const sb = await Sandbox.create({ template: "host", metadata: { suite: "runcell-sdk" } });
  try {
    const r = await sb.runCode("6 * 7");
    assert.equal(r.results[0]?.["text/plain"], "42");
  } finally {
    await sb.kill();
  }
  await assert.rejects(Sandbox.get(sb.id), NotFoundError);
});

test("a plain CommonJS program can require the package", async () => {
  const { execFileSync } = await import("node:child_process");
  const out = execFileSync(
    process.execPath,
    ["-e", 'const r = require("runcell"); console.log(typeof r.Sandbox.create, r.DEFAULT_URL)'],
    { cwd: pkgDir, encoding: "utf8" },
  );
  assert.equal(out, "function http://127.0.0.1:7070\n");
});
