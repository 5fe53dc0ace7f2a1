// The SDK calls an agent developer expects (issue 11): streamed output,
// typed network policies, file operations, result shortcuts, connect,
// setTimeout/refresh and AbortSignal cancellation, against the live daemon.
import { after, test } from "node:test";
import assert from "node:assert/strict";
import { BadRequestError, NotFoundError, Sandbox } from "runcell";
import { killAll, newSandbox } from "./helpers.mjs";

after(killAll);

test("exec with onStdout/onStderr streams each chunk as it is written, before the command ends", { timeout: 60_000 }, async () => {
  const sb = await newSandbox();
  const seen: { stream: string; chunk: string; at: number }[] = [];
  const t0 = Date.now();
  const r = await sb.exec("echo first; sleep 1.5; echo warn >&2; echo last", {
    onStdout: (chunk) => seen.push({ stream: "out", chunk, at: Date.now() - t0 }),
    onStderr: (chunk) => seen.push({ stream: "err", chunk, at: Date.now() - t0 }),
  });
  const total = Date.now() - t0;
  assert.equal(r.exitCode, 0);
  assert.equal(r.stdout, "first\nlast\n");
  assert.equal(r.stderr, "warn\n");
  assert.equal(seen.map((s) => s.chunk).join(""), "first\nwarn\nlast\n");
  const first = seen.find((s) => s.chunk.includes("first"))!;
  // The first line arrived while the command was still sleeping.
  assert.ok(first.at < total - 1000, `first chunk at ${first.at} ms of ${total} ms`);
  assert.ok(seen.some((s) => s.stream === "err" && s.chunk === "warn\n"));

  const failed = await sb.exec("echo x; exit 3", { onStdout: () => {} });
  assert.equal(failed.exitCode, 3);
  const slow = await sb.exec("echo before; sleep 10", { timeoutSeconds: 1, onStdout: () => {} });
  assert.equal(slow.timedOut, true);
  assert.equal(slow.exitCode, 124);
  assert.equal(slow.stdout, "before\n");
  assert.match(slow.messages.join(" "), /timeout/);
});

test("runCode's onStdout/onStderr/onResult stream the cell's output and results while it runs", { timeout: 60_000 }, async () => {
  const sb = await newSandbox();
  let out = "";
  let err = "";
  const seen: { what: string; at: number }[] = [];
  const t0 = Date.now();
  const r = await sb.runCode(
    "import sys, time\nprint('to out', flush=True)\nprint('to err', file=sys.stderr, flush=True)\ndisplay(41)\ntime.sleep(1.5)\n1",
    {
      onStdout: (c) => ((out += c), seen.push({ what: "stdout", at: Date.now() - t0 })),
      onStderr: (c) => ((err += c), seen.push({ what: "stderr", at: Date.now() - t0 })),
      onResult: (res) => seen.push({ what: `result ${res.text}`, at: Date.now() - t0 }),
    },
  );
  const total = Date.now() - t0;
  assert.equal(out, "to out\n");
  assert.equal(err, "to err\n");
  assert.deepEqual(r.results.map((x) => x.text), ["41", "1"]);
  assert.equal(r.stdout, "to out\n");
  // The output and the display() came while the cell slept, not at its end.
  for (const what of ["stdout", "stderr", "result 41"]) {
    const ev = seen.find((s) => s.what === what);
    assert.ok(ev, `no ${what} event: ${JSON.stringify(seen)}`);
    assert.ok(ev.at < total - 1000, `${what} arrived at ${ev.at} ms of ${total} ms: ${JSON.stringify(seen)}`);
  }
  assert.ok(seen.some((s) => s.what === "result 1"), JSON.stringify(seen));
  // A streamed cell that times out resolves like a plain one.
  const slow = await sb.runCode("import time\ntime.sleep(5)", { timeoutSeconds: 1, onStdout: () => {} });
  assert.equal(slow.timedOut, true);
  assert.equal(slow.error?.name, "TimeoutError");
});

test("network: a typed policy on create, getNetwork and setNetwork; a bad one is a 400", { timeout: 60_000 }, async () => {
  const sb = await newSandbox({ network: { mode: "allowlist", allow: ["pypi.org"], presets: [] } });
  const n = await sb.getNetwork();
  assert.equal(n.mode, "allowlist");
  assert.deepEqual(n.allow, ["pypi.org"]);
  assert.equal(typeof n.bytesIn, "number");
  const open = await sb.setNetwork("open");
  assert.equal(open.mode, "open");
  assert.equal((await sb.getNetwork()).mode, "open");
  assert.equal((await sb.setNetwork({ mode: "none" })).mode, "none");
  await assert.rejects(sb.setNetwork("sideways" as never), BadRequestError);
});

test("files: mkdir, exists, stat, list, rename and remove, with paths that need quoting", { timeout: 60_000 }, async () => {
  const sb = await newSandbox();
  const dir = "/tmp/it's a $(touch /tmp/pwned) dir";
  await sb.files.mkdir(`${dir}/sub`);
  await sb.files.mkdir(`${dir}/sub`); // existing: fine
  await sb.files.write(`${dir}/sub/a.txt`, "abc");
  assert.equal(await sb.files.exists(`${dir}/sub/a.txt`), true);
  assert.equal(await sb.files.exists("/tmp/no such file"), false);
  assert.equal(await sb.files.exists("/tmp/pwned"), false, "a path was run by the shell");
  const st = await sb.files.stat(`${dir}/sub/a.txt`);
  assert.deepEqual([st.name, st.isDir, st.type, st.size], ["a.txt", false, "file", 3]);
  assert.equal((await sb.files.stat(dir)).type, "dir");
  await assert.rejects(sb.files.stat("/tmp/no such file"), NotFoundError);

  await sb.files.rename(`${dir}/sub/a.txt`, `${dir}/b -n.txt`);
  assert.deepEqual((await sb.files.list(dir)).map((e) => e.name).sort(), ["b -n.txt", "sub"]);
  assert.equal(await sb.files.read(`${dir}/b -n.txt`), "abc");
  await assert.rejects(sb.files.rename("/tmp/missing-src", "/tmp/x"), NotFoundError);

  await sb.files.remove(`${dir}/b -n.txt`);
  assert.equal(await sb.files.exists(`${dir}/b -n.txt`), false);
  await sb.files.remove(dir); // a directory, recursively
  assert.equal(await sb.files.exists(dir), false);
  await assert.rejects(sb.files.remove(dir), NotFoundError);

  // exists() on a sandbox that is gone is an error, not "false".
  await sb.kill();
  await assert.rejects(sb.files.exists("/tmp"), NotFoundError);
});

test("results have .text, .html, .png shortcuts; the bundle's keys stay the MIME types", { timeout: 120_000 }, async () => {
  const sb = await newSandbox();
  const js = await sb.runCode("display({'image/png': 'iVBORw0KGgo=', 'text/html': '<b>x</b>'}, {raw: true}); 41 + 1", "javascript");
  assert.equal(js.error, undefined, js.stderr);
  const [img, value] = js.results;
  assert.equal(img!.png, "iVBORw0KGgo=");
  assert.equal(img!.html, "<b>x</b>");
  assert.equal(img!.text, undefined);
  assert.equal(value!.text, "42");
  assert.deepEqual(Object.keys(img!).sort(), ["image/png", "text/html"]);
  assert.equal(JSON.stringify(value), '{"text/plain":"42"}');

  const df = await sb.runCode("import pandas as pd\npd.DataFrame({'a': [1]})");
  assert.equal(df.error, undefined, df.stderr);
  assert.match(df.results[0]!.html ?? "", /<table/);
  const fig = await sb.runCode("import matplotlib.pyplot as plt\nplt.plot([1, 2])\nplt.show()");
  assert.equal(fig.error, undefined, fig.stderr);
  assert.ok(Buffer.from(fig.results[0]!.png ?? "", "base64").subarray(1, 4).toString() === "PNG");
});

test("Sandbox.connect, setTimeout and refresh", { timeout: 60_000 }, async () => {
  const sb = await newSandbox({ ttlSeconds: 600 });
  await sb.runCode("kept = 'yes'");
  const other = await Sandbox.connect(sb.id);
  assert.equal(other.id, sb.id);
  assert.equal((await other.runCode("kept")).results[0]?.text, "'yes'");

  await sb.setTimeout(77);
  assert.equal(sb.info.ttlSeconds, 77);
  // Another handle learns of it through refresh().
  assert.equal(other.info.ttlSeconds, 600);
  const info = await other.refresh();
  assert.equal(info.ttlSeconds, 77);
  assert.equal(other.info.ttlSeconds, 77);
  await sb.kill();
  await assert.rejects(other.refresh(), (e: unknown) => e instanceof NotFoundError && /deleted|ended|expired|not found/.test(String(e)));
});

test("an AbortSignal cancels exec, streamed exec and runCode at once", { timeout: 60_000 }, async () => {
  const sb = await newSandbox();
  for (const stream of [false, true]) {
    const ac = new AbortController();
    setTimeout(() => ac.abort(), 300);
    const t0 = Date.now();
    await assert.rejects(
      sb.exec("echo $$ > /tmp/aborted.pid; exec sleep 20", stream ? { signal: ac.signal, onStdout: () => {} } : { signal: ac.signal }),
      (e: unknown) => (e as Error).name === "AbortError",
    );
    assert.ok(Date.now() - t0 < 5000, `abort took ${Date.now() - t0} ms`);
    // The daemon stopped the command too (its HTTP request was closed).
    let state = "";
    for (let i = 0; i < 50; i++) {
      state = (await sb.exec("kill -0 $(cat /tmp/aborted.pid) 2>/dev/null && echo alive || echo gone")).stdout;
      if (state === "gone\n") break;
      await new Promise((r) => setTimeout(r, 200));
    }
    assert.equal(state, "gone\n", `the aborted ${stream ? "streamed " : ""}exec still runs in the sandbox`);
  }
  const t1 = Date.now();
  await assert.rejects(
    sb.runCode("import time\ntime.sleep(2)", { signal: AbortSignal.timeout(300) }),
    (e: unknown) => (e as Error).name === "TimeoutError",
  );
  assert.ok(Date.now() - t1 < 1900, `abort took ${Date.now() - t1} ms`);
  // An already aborted signal sends nothing.
  const done = AbortSignal.abort();
  await assert.rejects(sb.exec("touch /tmp/ran", { signal: done }), (e: unknown) => (e as Error).name === "AbortError");
  assert.equal(await sb.files.exists("/tmp/ran"), false);
  // The sandbox is still usable.
  assert.equal((await sb.exec("echo ok")).stdout, "ok\n");
});

test("isolation: chosen on create and reported; one the host cannot run is a 400 that says why", { timeout: 60_000 }, async () => {
  const sb = await newSandbox({ isolation: "jail" });
  assert.equal(sb.info.isolation, "jail");
  const again = await Sandbox.connect(sb.id);
  assert.equal(again.info.isolation, "jail");
  // The test daemon runs without --allow-emulation, so no microVM here.
  await assert.rejects(newSandbox({ isolation: "microvm" }), (e: unknown) => {
    assert.ok(e instanceof BadRequestError, String(e));
    assert.match((e as Error).message, /microvm/);
    return true;
  });
});
