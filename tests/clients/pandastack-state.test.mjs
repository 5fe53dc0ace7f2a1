// Sandboxes that outlive their processes (issue 14), driven through the
// published PandaStack JS SDK (@pandastack/sdk 0.9.0), unchanged: pause and
// resume, snapshots and creating from one, fork, forkTree, promote and
// explore() over copy-on-write forks. Needs PANDASTACK_API(_KEY) of a
// running daemon with the namespace jail (scripts/test-clients.sh).

import { test } from "node:test";
import assert from "node:assert/strict";
import { BadRequestError, Client, NotFoundError, Sandbox } from "@pandastack/sdk";

const API = process.env.PANDASTACK_API;
const KEY = process.env.PANDASTACK_API_KEY;
if (!API || !KEY) {
  throw new Error("PANDASTACK_API and PANDASTACK_API_KEY must be set (scripts/test-clients.sh)");
}
if (!/^(127\.\d+\.\d+\.\d+|localhost|\[::1\])$/.test(new URL(API).hostname)) {
  throw new Error(`PANDASTACK_API must point at loopback, got ${API}`);
}
const T = { timeout: 120_000 };
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
const client = new Client();

async function track(t, sb) {
  t.after(async () => {
    try {
      await sb.kill();
    } catch (err) {
      if (!(err instanceof NotFoundError)) throw err;
    }
  });
  return sb;
}

const out = async (sb, cmd) => {
  const r = await sb.exec(cmd);
  assert.equal(r.exitCode, 0, `${cmd}: ${r.stderr}`);
  return r.stdout;
};

test("pause freezes the sandbox, work answers 409 meanwhile, resume carries on", T, async (t) => {
  const sb = await track(t, await Sandbox.create({ template: "host" }));
  // runcell's `background` keeps what the command leaves running.
  const started = await fetch(`${API.replace(/\/+$/, "").replace(/\/v1$/, "")}/v1/sandboxes/${sb.id}/exec`, {
    method: "POST",
    headers: { authorization: `Bearer ${KEY}`, "content-type": "application/json" },
    body: JSON.stringify({
      cmd: "(i=0; while :; do i=$((i+1)); echo $i > /tmp/tick; sleep 0.02; done) >/dev/null 2>&1 &",
      background: true,
    }),
  });
  assert.equal(started.status, 200, await started.text());
  await sleep(300);
  await sb.pause();
  assert.equal((await client.sandboxes.get(sb.id)).info.status, "paused");
  await assert.rejects(sb.exec("echo hi"), (e) => e instanceof BadRequestError && e.statusCode === 409 && /paused/.test(e.message));
  await assert.rejects(sb.filesystem.read("/tmp/tick"), (e) => e.statusCode === 409);
  // Pausing twice is a plain conflict, not a hang.
  await assert.rejects(sb.pause(), (e) => e.statusCode === 409);
  await sb.resume();
  const a = Number(await out(sb, "cat /tmp/tick"));
  await sleep(300);
  const b = Number(await out(sb, "cat /tmp/tick"));
  assert.ok(b > a, `the loop did not run on after resume (${a} then ${b})`);
  assert.equal((await client.sandboxes.get(sb.id)).info.status, "running");
  await assert.rejects(sb.resume(), (e) => e.statusCode === 409);
});

test("a snapshot is listed, starts new sandboxes with its files, and is deleted", T, async (t) => {
  const sb = await track(t, await Sandbox.create({ template: "host" }));
  await out(sb, "mkdir -p ~/proj && echo v1 > ~/proj/state.txt");
  const snap = await sb.snapshot();
  assert.match(snap.id, /^snap-/);
  assert.equal(snap.sandbox_id, sb.id);
  assert.equal(snap.memory, false, "the jail saves files, not memory, and says so");
  assert.ok(snap.size_bytes > 0);
  // The source runs on, and what it writes later is not in the snapshot.
  await out(sb, "echo v2 > ~/proj/state.txt");

  const listed = await client.snapshots.list({ sandbox_id: sb.id });
  assert.deepEqual(listed.map((s) => s.id), [snap.id]);
  assert.equal((await client.snapshots.get(snap.id)).template, "host");

  const restored = await track(t, await Sandbox.create({ from_snapshot: snap.id }));
  assert.equal(await out(restored, "cat ~/proj/state.txt"), "v1\n");
  assert.equal(restored.info.from_snapshot ?? snap.id, snap.id);

  await client.snapshots.delete(snap.id);
  await assert.rejects(client.snapshots.get(snap.id), NotFoundError);
  // The sandbox started from it keeps its files.
  assert.equal(await out(restored, "cat ~/proj/state.txt"), "v1\n");
  await assert.rejects(Sandbox.create({ from_snapshot: snap.id }), NotFoundError);
});

test("fork copies the files at that instant; parent and child then differ", T, async (t) => {
  const parent = await track(t, await Sandbox.create({ template: "host", metadata: { job: "fork-test" } }));
  await out(parent, "echo base > ~/f");
  const child = await track(t, await parent.fork({ metadata: { branch: "a" } }));
  assert.notEqual(child.id, parent.id);
  assert.equal(await out(child, "cat ~/f"), "base\n");
  await out(child, "echo child > ~/f");
  await out(parent, "echo parent > ~/g");
  assert.equal(await out(parent, "cat ~/f"), "base\n");
  assert.equal(await out(child, "test -e ~/g && echo leaked; cat ~/f"), "child\n");
  const info = (await client.sandboxes.get(child.id)).info;
  assert.equal(info.metadata.branch, "a");
  assert.equal(info.metadata.job, "fork-test");
});

test("explore() runs three candidates in forks, promotes the winner and reaps the losers", T, async (t) => {
  const parent = await track(t, await Sandbox.create({ template: "host" }));
  await out(parent, "printf 'x=2\\n' > ~/config");
  const result = await parent.explore(
    [
      { label: "fails", cmd: "exit 3" },
      { label: "slow-pass", cmd: ". ~/config; sleep 0.5; echo PASS $x > ~/out; cat ~/out" },
      { label: "fast-pass", cmd: ". ~/config; echo PASS $((x*2))" },
    ],
    { scoreFn: (_sb, o) => (o.ok && o.stdoutTail.includes("PASS") ? 1 : 0) },
  );
  assert.ok(result.winner, `no winner: ${JSON.stringify(result.errors)}`);
  await track(t, result.winner);
  assert.equal(result.winnerOutcome.label, "fast-pass");
  assert.equal(result.outcomes.length, 3);
  assert.deepEqual(result.errors, []);
  assert.ok(result.treeId.startsWith("tree-"), result.treeId);
  // Losers are gone; the winner is independent and usable.
  assert.equal(result.reaped.length, 2);
  for (const id of result.reaped) {
    await assert.rejects(client.sandboxes.get(id), NotFoundError);
  }
  const winner = (await client.sandboxes.get(result.winner.id)).info;
  assert.equal(winner.metadata.fork_tree_id, undefined);
  assert.equal(await out(result.winner, "cat ~/config"), "x=2\n");
  // Nothing of the tree is left but the winner and the parent.
  const mine = (await client.sandboxes.list()).filter((s) => s.info.metadata?.explore === "1");
  assert.deepEqual(mine.map((s) => s.id), [result.winner.id]);
});

test("forkTree makes N children sharing one copy; promote with cleanup reaps the rest", T, async (t) => {
  const parent = await track(t, await Sandbox.create({ template: "host" }));
  await out(parent, "head -c 2000000 /dev/urandom > ~/blob");
  const kids = await parent.forkTree({ count: 3 });
  for (const k of kids) await track(t, k);
  assert.equal(kids.length, 3);
  const tree = kids[0].info.metadata.fork_tree_id;
  assert.ok(tree);
  const sums = await Promise.all(kids.map((k) => out(k, "md5sum < ~/blob")));
  assert.equal(new Set(sums).size, 1);
  assert.equal(sums[0], await out(parent, "md5sum < ~/blob"));
  const p = await kids[1].promote({ cleanupSiblings: true });
  assert.equal(p.winner, kids[1].id);
  assert.equal(p.tree_id, tree);
  assert.deepEqual([...p.deleted].sort(), [kids[0].id, kids[2].id].sort());
  await assert.rejects(client.sandboxes.get(kids[0].id), NotFoundError);
  assert.equal(await out(kids[1], "md5sum < ~/blob"), sums[0]);
});

test("bad fork and snapshot requests are clear 4xx answers", T, async (t) => {
  const sb = await track(t, await Sandbox.create({ template: "host" }));
  for (const count of [0, 17, 2.5, -1, "3", 1e300]) {
    await assert.rejects(sb.forkTree({ count }), (e) => e.statusCode === 400 && /count/.test(e.message), `count ${count}`);
  }
  await assert.rejects(client.snapshots.get("snap-nope"), NotFoundError);
  await assert.rejects(client.snapshots.delete("snap-nope"), NotFoundError);
  await assert.rejects(Sandbox.create({ from_snapshot: "x".repeat(100000) }), (e) => e.statusCode === 404 && e.message.length < 2000);
});

test("hibernate frees the sandbox and keeps its files; the next exec wakes it", T, async (t) => {
  const sb = await track(t, await Sandbox.create({ template: "host", persistent: true }));
  await out(sb, "mkdir -p ~/.local/lib && echo installed > ~/.local/lib/pkg.txt");
  await sb.hibernate();
  let info = (await client.sandboxes.get(sb.id)).info;
  assert.equal(info.status, "hibernated");
  assert.ok((await client.sandboxes.list()).some((s) => s.id === sb.id && s.info.status === "hibernated"));
  // Hibernating twice is fine; GET did not wake it.
  await sb.hibernate();
  assert.equal((await client.sandboxes.get(sb.id)).info.status, "hibernated");
  // Any exec wakes it, transparently, with its files.
  assert.equal(await out(sb, "cat ~/.local/lib/pkg.txt"), "installed\n");
  info = (await client.sandboxes.get(sb.id)).info;
  assert.equal(info.status, "running");
  assert.equal(info.state_lost, true, "a woken sandbox says its processes and contexts are gone");
  // And again: the second hibernation keeps what was written after the first wake.
  await out(sb, "echo more >> ~/.local/lib/pkg.txt && rm -f ~/gone");
  await sb.hibernate();
  await sb.wake();
  assert.equal((await client.sandboxes.get(sb.id)).info.status, "running");
  assert.equal(await out(sb, "cat ~/.local/lib/pkg.txt"), "installed\nmore\n");
  // A hibernated sandbox can be deleted, and is gone.
  await sb.hibernate();
  await sb.kill();
  await assert.rejects(client.sandboxes.get(sb.id), NotFoundError);
  await assert.rejects(sb.exec("true"), NotFoundError);
});

test("on_idle: hibernate makes an idle sandbox hibernate instead of being deleted", T, async (t) => {
  const res = await fetch(`${API.replace(/\/+$/, "").replace(/\/v1$/, "")}/v1/sandboxes`, {
    method: "POST",
    headers: { authorization: `Bearer ${KEY}`, "content-type": "application/json" },
    body: JSON.stringify({ template: "host", ttl_seconds: 1, on_idle: "hibernate" }),
  });
  assert.equal(res.status, 201);
  const created = await res.json();
  assert.equal(created.on_idle, "hibernate");
  const sb = await track(t, await client.sandboxes.get(created.id));
  await out(sb, "echo kept > ~/k");
  let status;
  for (let i = 0; i < 40; i++) {
    await sleep(250);
    status = (await client.sandboxes.get(sb.id)).info.status;
    if (status === "hibernated") break;
  }
  assert.equal(status, "hibernated");
  assert.equal(await out(sb, "cat ~/k"), "kept\n");
  // A bad on_idle is a 400 that names the field.
  const bad = await fetch(`${API.replace(/\/+$/, "").replace(/\/v1$/, "")}/v1/sandboxes`, {
    method: "POST",
    headers: { authorization: `Bearer ${KEY}`, "content-type": "application/json" },
    body: JSON.stringify({ template: "host", on_idle: "sleep" }),
  });
  assert.equal(bad.status, 400);
  assert.match((await bad.json()).error, /on_idle/);
});
