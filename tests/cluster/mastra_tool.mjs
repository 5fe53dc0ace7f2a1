// runcell's Mastra tool (sdk/mastra, built; Node 22) in per-thread mode
// against a node that does not own the thread's sandbox: RUNCELL_URL is
// node C, the thread THREAD's sandbox was made on node A with the tool's
// metadata. The tool finds it (the list comes from etcd) and runs both
// calls there. Run by tests/cluster/cluster_test.py; prints one JSON line.
import { pathToFileURL } from "node:url";
import path from "node:path";

const { createRunCodeTool } = await import(
  pathToFileURL(path.join(process.env.REPO, "sdk/mastra/dist/esm/index.js")).href
);
const sandboxes = [];
const tool = createRunCodeTool({
  mode: "per-thread",
  apiUrl: process.env.RUNCELL_URL,
  apiKey: process.env.RUNCELL_API_KEY,
  onResult: (_r, info) => {
    sandboxes.push(info.sandboxId);
  },
});
const ctx = { agent: { threadId: process.env.THREAD, resourceId: "cluster-test" } };
const first = await tool.execute({ code: "y = 40", language: "python" }, ctx);
const second = await tool.execute({ code: "y + 2", language: "python" }, ctx);
console.log(JSON.stringify({ sandboxes, first, second: JSON.stringify(second) }));
