// `await using` with runcell's Sandbox and CodeContext. Node 20 cannot parse
// the syntax, so tsc (target ES2022, lib ESNext) lowers it to try/finally
// over Symbol.asyncDispose; node runs the compiled .mjs.
import { after, test } from "node:test";
import assert from "node:assert/strict";
import { NotFoundError, Sandbox, type CodeContext } from "runcell";
import { killAll, newSandbox } from "./helpers.mjs";

after(killAll);

test("`await using` kills the sandbox when the scope ends, also on an exception", { timeout: 60_000 }, async () => {
  let id = "";
  {
    await using sb = await Sandbox.create({ template: "host" });
    id = sb.id;
    assert.equal((await sb.exec("echo inside")).stdout, "inside\n");
    await Sandbox.get(id);
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

test("`await using` on a sandbox that was already killed does not throw", { timeout: 60_000 }, async () => {
  {
    await using sb = await Sandbox.create({ template: "host" });
    await sb.kill();
  }
});

test("`await using` closes a code context when the scope ends; the sandbox lives on", { timeout: 60_000 }, async () => {
  const sb = await newSandbox();
  let ref: CodeContext | undefined;
  {
    await using ctx = await sb.createCodeContext();
    ref = ctx;
    assert.equal((await ctx.runCode("x = 20\nx * 2 + 2")).results[0]?.["text/plain"], "42");
  }
  assert.ok(ref);
  await assert.rejects(ref.runCode("x"), NotFoundError);

  let second: CodeContext | undefined;
  await assert.rejects(async () => {
    await using ctx = await sb.createCodeContext("bash");
    second = ctx;
    throw new Error("boom");
  }, /boom/);
  assert.ok(second);
  await assert.rejects(second.runCode("echo"), NotFoundError);
  assert.equal((await sb.exec("echo still here")).stdout, "still here\n");
});
