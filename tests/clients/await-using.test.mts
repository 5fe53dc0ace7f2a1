// `await using` with the published @pandastack/sdk, compiled by TypeScript
// (Node 20 cannot parse the syntax itself; tsc lowers it to try/finally over
// Symbol.asyncDispose, which Node 20 has). scripts/test-clients.sh compiles
// this file with tsconfig.json into .build/ and runs it with node --test.
import { test } from "node:test";
import assert from "node:assert/strict";
import { Sandbox, NotFoundError, type CodeContext, type Execution } from "@pandastack/sdk";

test("`await using` deletes the sandbox when its scope ends, also on an exception", { timeout: 60_000 }, async () => {
  let id = "";
  {
    await using sb = await Sandbox.create({ template: "host" });
    id = sb.id;
    const r = await sb.exec("echo inside");
    assert.equal(r.stdout, "inside\n");
  }
  await assert.rejects(Sandbox.get(id), NotFoundError);

  let second = "";
  await assert.rejects(async () => {
    await using sb = await Sandbox.create({ template: "host" });
    second = sb.id;
    throw new Error("boom");
  }, /boom/);
  assert.notEqual(second, "");
  await assert.rejects(Sandbox.get(second), NotFoundError);
});

test("`await using` closes a code context when its scope ends, also on an exception", { timeout: 60_000 }, async () => {
  await using sb = await Sandbox.create({ template: "host" });
  let ctxRef = undefined as CodeContext | undefined;
  {
    await using ctx = await sb.createCodeContext();
    ctxRef = ctx;
    const ex: Execution = await ctx.runCode("x = 20\nx * 2 + 2");
    assert.equal(ex.text, "42");
  }
  assert.ok(ctxRef);
  await assert.rejects(ctxRef.runCode("x"), NotFoundError);

  let second = undefined as CodeContext | undefined;
  await assert.rejects(async () => {
    await using ctx = await sb.createCodeContext();
    second = ctx;
    await ctx.runCode("y = 1");
    throw new Error("boom");
  }, /boom/);
  assert.ok(second);
  await assert.rejects(second.runCode("y"), NotFoundError);

  // The sandbox itself outlives its contexts: a new one works.
  await using third = await sb.createCodeContext();
  assert.equal((await third.runCode("'x' in globals()")).text, "False");
});
