// `await using` with the published @pandastack/sdk, compiled by TypeScript
// (Node 20 cannot parse the syntax itself; tsc lowers it to try/finally over
// Symbol.asyncDispose, which Node 20 has). scripts/test-clients.sh compiles
// this file with tsconfig.json into .build/ and runs it with node --test.
import { test } from "node:test";
import assert from "node:assert/strict";
import { Sandbox, NotFoundError } from "@pandastack/sdk";

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
