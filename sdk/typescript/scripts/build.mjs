// Builds dist/esm (ES modules) and dist/cjs (CommonJS), each with .d.ts
// declarations, from src/ with the TypeScript compiler. dist/cjs gets a
// package.json with "type": "commonjs" so Node loads its .js files as CJS
// (the package itself is "type": "module").
import { execFileSync } from "node:child_process";
import { rmSync, writeFileSync } from "node:fs";
import { createRequire } from "node:module";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

const root = join(dirname(fileURLToPath(import.meta.url)), "..");
const tsc = createRequire(import.meta.url).resolve("typescript/bin/tsc");

rmSync(join(root, "dist"), { recursive: true, force: true });
for (const project of ["tsconfig.json", "tsconfig.cjs.json"]) {
  try {
    execFileSync(process.execPath, [tsc, "-p", join(root, project)], { stdio: "inherit", cwd: root });
  } catch {
    console.error(`build: tsc -p ${project} failed`);
    process.exit(1);
  }
}
writeFileSync(join(root, "dist/cjs/package.json"), JSON.stringify({ type: "commonjs" }, null, 2) + "\n");
writeFileSync(join(root, "dist/esm/package.json"), JSON.stringify({ type: "module" }, null, 2) + "\n");
console.log("built dist/esm and dist/cjs");
