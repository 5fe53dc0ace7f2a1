// Rich results through runCode: a pandas DataFrame as HTML and a matplotlib
// figure as PNG (the host template's /usr/bin/python3 has both).
import { after, test } from "node:test";
import assert from "node:assert/strict";
import { killAll, newSandbox } from "./helpers.mjs";

after(killAll);

test("a DataFrame comes back as text/html and text/plain", { timeout: 120_000 }, async () => {
  const sb = await newSandbox();
  const setup = await sb.runCode("import pandas as pd\ndf = pd.DataFrame({'name': ['ada', 'bob'], 'score': [91, 78]})");
  assert.equal(setup.error, undefined, setup.stderr);
  const r = await sb.runCode("df");
  assert.equal(r.error, undefined, r.stderr);
  assert.equal(r.results.length, 1);
  const html = r.results[0]!["text/html"];
  assert.ok(html, `no text/html in ${JSON.stringify(Object.keys(r.results[0]!))}`);
  assert.match(html, /<table/);
  assert.match(html, /ada/);
  assert.match(html, /<td>91<\/td>/);
  assert.match(r.results[0]!["text/plain"] ?? "", /bob\s+78/);
});

test("a matplotlib figure comes back as a base64 image/png", { timeout: 120_000 }, async () => {
  const sb = await newSandbox();
  const r = await sb.runCode(
    "import matplotlib\nmatplotlib.use('Agg')\nimport matplotlib.pyplot as plt\nplt.plot([1, 2, 3], [1, 4, 9])\nplt.title('squares')\nplt.show()",
  );
  assert.equal(r.error, undefined, r.stderr);
  const pngs = r.results.filter((x) => "image/png" in x).map((x) => x["image/png"]!);
  assert.equal(pngs.length, 1, JSON.stringify(r.results.map((x) => Object.keys(x))));
  const bytes = Buffer.from(pngs[0]!, "base64");
  assert.ok(bytes.length > 1000, `PNG of ${bytes.length} bytes`);
  assert.deepEqual([...bytes.subarray(0, 8)], [0x89, 0x50, 0x4e, 0x47, 0x0d, 0x0a, 0x1a, 0x0a]);
  // Shown figures are closed: the next cell has none.
  assert.deepEqual((await sb.runCode("1 + 1")).results, [{ "text/plain": "2" }]);
});
