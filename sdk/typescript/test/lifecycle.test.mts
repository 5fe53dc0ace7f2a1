// Sandboxes that outlive their processes (issue 14), against the live
// daemon: pause/resume, hibernate/wake (explicit and by the next call),
// snapshots and sandboxes created from them, forks and fork trees with
// promote, and volumes that outlive the sandboxes they are mounted in.
import { after, test } from "node:test";
import assert from "node:assert/strict";
import { CapacityError, ConflictError, NotFoundError, Sandbox, snapshots, volumes } from "runcell";
import { killAll, newSandbox, track } from "./helpers.mjs";

const madeSnapshots: string[] = [];
const madeVolumes: string[] = [];

after(async () => {
  await killAll();
  for (const id of madeSnapshots.splice(0)) await snapshots.delete(id).catch(() => {});
  for (const name of madeVolumes.splice(0)) await volumes.delete(name).catch(() => {});
});

test("a paused sandbox refuses calls with a ConflictError until it is resumed, and keeps its processes", { timeout: 60_000 }, async () => {
  const sb = await newSandbox();
  // The interpreter is a process: its variables survive a pause.
  await sb.runCode("kept = 'alive'");
  await sb.pause();
  assert.equal(sb.info.status, "paused");
  assert.equal((await sb.refresh()).status, "paused");
  await assert.rejects(sb.exec("echo hi"), (e: unknown) => {
    assert.ok(e instanceof ConflictError, String(e));
    assert.equal(e.status, 409);
    assert.match(e.message, /paused; resume it first/);
    return true;
  });
  await assert.rejects(sb.pause(), ConflictError);
  await sb.resume();
  assert.equal((await sb.refresh()).status, "running");
  await assert.rejects(sb.resume(), ConflictError);
  const r = await sb.exec("echo hi");
  assert.equal(r.stdout, "hi\n");
  const kept = await sb.runCode("kept");
  assert.equal(kept.results[0]?.text, "'alive'");
  assert.equal(kept.stateLost, false);
});

test("a hibernated sandbox keeps its files, wakes on the next call, and says its code state is gone", { timeout: 120_000 }, async () => {
  const sb = await newSandbox({ persistent: true });
  await sb.files.write("/home/user/notes.txt", "kept\n");
  assert.equal((await sb.runCode("x = 41\nx + 1")).results[0]?.text, "42");
  await sb.hibernate();
  assert.equal((await sb.refresh()).status, "hibernated");
  await sb.hibernate(); // already hibernated: not an error
  // Any exec wakes it, transparently.
  assert.equal((await sb.exec("cat /home/user/notes.txt")).stdout, "kept\n");
  const info = await sb.refresh();
  assert.equal(info.status, "running");
  assert.equal(info.stateLost, true);
  // The interpreter of before is gone: runCode says so and starts afresh.
  const r = await sb.runCode("'x' in globals()");
  assert.equal(r.stateLost, true, JSON.stringify(r));
  assert.equal(r.results[0]?.text, "False");

  // An explicit wake, and a file read as the waking call.
  await sb.hibernate();
  await sb.wake();
  await sb.wake(); // running: not an error
  assert.equal((await sb.refresh()).status, "running");
  await sb.hibernate();
  assert.equal(await sb.files.read("/home/user/notes.txt"), "kept\n");
});

test("a snapshot's files start new sandboxes; snapshots are listed per sandbox and deleted", { timeout: 120_000 }, async () => {
  const sb = await newSandbox();
  await sb.files.write("/home/user/state.txt", "v1\n");
  const snap = await sb.snapshot();
  madeSnapshots.push(snap.id);
  assert.equal(snap.sandboxId, sb.id);
  assert.equal(snap.memory, false);
  assert.ok(snap.sizeBytes > 0, JSON.stringify(snap));
  assert.ok(!Number.isNaN(Date.parse(snap.createdAt)), snap.createdAt);
  await sb.files.write("/home/user/state.txt", "v2\n");

  const copy = await newSandbox({ fromSnapshot: snap.id });
  assert.equal(copy.info.fromSnapshot, snap.id);
  assert.equal(copy.info.template, snap.template);
  assert.equal(await copy.files.read("/home/user/state.txt"), "v1\n");
  assert.equal(await sb.files.read("/home/user/state.txt"), "v2\n");

  const second = await sb.snapshot();
  madeSnapshots.push(second.id);
  const mine = await snapshots.list({ sandboxId: sb.id });
  assert.deepEqual(
    mine.map((s) => s.id),
    [second.id, snap.id],
    "newest first, only this sandbox's",
  );
  assert.equal((await snapshots.get(snap.id)).id, snap.id);
  assert.ok((await snapshots.list()).some((s) => s.id === second.id));
  await snapshots.delete(second.id);
  await assert.rejects(snapshots.get(second.id), NotFoundError);
  await assert.rejects(newSandbox({ fromSnapshot: second.id }), NotFoundError);
});

test("a fork copies the files, not the interpreter, and leaves the parent alone", { timeout: 120_000 }, async () => {
  const parent = await newSandbox();
  await parent.files.write("/home/user/plan.txt", "A\n");
  const child = track(await parent.fork({ metadata: { branch: "b" }, ttlSeconds: 120 }));
  assert.notEqual(child.id, parent.id);
  assert.equal(child.info.forkedFrom, parent.id);
  assert.equal(child.info.metadata.branch, "b");
  assert.equal(child.info.ttlSeconds, 120);
  assert.equal(await child.files.read("/home/user/plan.txt"), "A\n");
  await child.files.write("/home/user/plan.txt", "B\n");
  assert.equal(await parent.files.read("/home/user/plan.txt"), "A\n");
  await child.kill();
});

test("a fork tree's winner is promoted: it goes independent and its siblings are deleted", { timeout: 180_000 }, async () => {
  const parent = await newSandbox();
  await parent.files.write("/home/user/seed.txt", "seed\n");
  const tree = await parent.forkTree(3, { metadata: { experiment: "e1" } });
  tree.children.forEach(track);
  assert.equal(tree.children.length, 3);
  for (const c of tree.children) {
    assert.equal(c.info.metadata.fork_tree_id, tree.treeId);
    assert.equal(c.info.metadata.fork_parent, parent.id);
    assert.equal(c.info.metadata.experiment, "e1");
    assert.equal(await c.files.read("/home/user/seed.txt"), "seed\n");
  }
  await assert.rejects(parent.forkTree(17), /count|16/);
  const [winner, ...losers] = tree.children as [Sandbox, ...Sandbox[]];
  const p = await winner.promote({ cleanupSiblings: true });
  assert.equal(p.winner, winner.id);
  assert.equal(p.treeId, tree.treeId);
  assert.deepEqual([...p.deleted].sort(), losers.map((l) => l.id).sort());
  assert.deepEqual(p.failures, {});
  const after = await winner.refresh();
  assert.equal(after.metadata.fork_tree_id, undefined);
  for (const l of losers) await assert.rejects(Sandbox.get(l.id), NotFoundError);
  assert.equal((await parent.exec("cat /home/user/seed.txt")).stdout, "seed\n");
});

test("a volume outlives its sandbox, takes one writer at a time, and cannot be deleted while mounted", { timeout: 180_000 }, async () => {
  const name = `sdk-vol-${process.pid}`;
  const v = await volumes.create(name, { sizeMb: 16 });
  madeVolumes.push(name);
  assert.deepEqual([v.name, v.sizeMb, v.attachedTo], [name, 16, []]);
  assert.ok((await volumes.list()).some((x) => x.name === name));
  // Beyond the workspace's volume quota: a CapacityError (429) that says so.
  await assert.rejects(volumes.create(`${name}-big`, { sizeMb: 65536 }), (e: unknown) => {
    assert.ok(e instanceof CapacityError, String(e));
    assert.match((e as Error).message, /quota/);
    return true;
  });

  const writer = await newSandbox({ volumes: [{ name }] });
  assert.deepEqual(writer.info.volumes, [{ name, path: `/mnt/${name}`, readOnly: false }]);
  await writer.files.write(`/mnt/${name}/out.txt`, "survives\n");
  assert.deepEqual((await volumes.get(name)).attachedTo, [writer.id]);
  await assert.rejects(newSandbox({ volumes: [{ name }] }), ConflictError, "a second read-write mount");
  await assert.rejects(volumes.delete(name), ConflictError);

  const reader = await newSandbox({ volumes: [{ name, readOnly: true, path: "/data" }] });
  assert.equal((await reader.exec("cat /data/out.txt")).stdout, "survives\n");
  const denied = await reader.exec("echo x > /data/new.txt");
  assert.notEqual(denied.exitCode, 0, "a read-only mount refuses writes");
  await writer.kill();
  await reader.kill();

  const later = await newSandbox({ volumes: [{ name, path: "/work" }] });
  assert.equal(await later.files.read("/work/out.txt"), "survives\n");
  await later.kill();
  assert.ok((await volumes.get(name)).usedBytes > 0);
  await volumes.delete(name);
  madeVolumes.splice(madeVolumes.indexOf(name), 1);
  await assert.rejects(volumes.get(name), NotFoundError);
});
