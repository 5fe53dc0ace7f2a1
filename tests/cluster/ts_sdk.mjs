// runcell's TypeScript SDK (sdk/typescript, built) against a node that does
// not own the sandbox: RUNCELL_URL is node C, SID a sandbox on node A. Run
// by tests/cluster/cluster_test.py; prints one JSON line of what it saw.
import { pathToFileURL } from "node:url";
import path from "node:path";

const { Sandbox } = await import(pathToFileURL(path.join(process.env.REPO, "sdk/typescript/dist/esm/index.js")).href);
const opts = { apiUrl: process.env.RUNCELL_URL, apiKey: process.env.RUNCELL_API_KEY };
const sb = await Sandbox.connect(process.env.SID, opts);
const exec = await sb.exec("echo ts-ok");
const streamed = [];
await sb.exec("echo one; sleep 0.5; echo two", { onStdout: (s) => streamed.push(s) });
await sb.files.write("/tmp/ts.txt", "from ts");
const file = await sb.files.read("/tmp/ts.txt");
const code = await sb.runCode("x = 41\nx + 1");
const listed = (await Sandbox.list(opts)).some((i) => i.id === sb.id);
console.log(
  JSON.stringify({
    exec: exec.stdout,
    streamed,
    file,
    code: code.results.map((r) => r.text).join(""),
    listed,
    error: code.error ?? null,
  }),
);
