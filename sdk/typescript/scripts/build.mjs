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
const require = createRequire(import.meta.url);

// `npm install /path/to/runcell/sdk/typescript` links this directory and runs
// `prepare` (this script) without installing its dev dependencies: install
// them here first (scripts ignored, so this does not recurse).
function resolveTsc() {
  try {
    return require.resolve("typescript/bin/tsc");
  } catch {
    return undefined;
  }
}
let tsc = resolveTsc();
if (!tsc) {
  console.log("build: installing the SDK's dev dependencies (typescript) first");
  const env = { ...process.env };
  // Settings of an outer `npm install` (production, omit=dev, global, a
  // prefix) must not leak into this one.
  for (const k of Object.keys(env)) {
    if (/^npm_config_(omit|include|production|only|global|prefix|location|save.*|dry_run|workspaces?)$/i.test(k)) delete env[k];
  }
  const npmCli = process.env.npm_execpath;
  const [cmd, args] = npmCli && npmCli.endsWith(".js") ? [process.execPath, [npmCli]] : ["npm", []];
  try {
    execFileSync(cmd, [...args, "install", "--no-save", "--ignore-scripts", "--include=dev", "--no-audit", "--no-fund"], {
      stdio: "inherit",
      cwd: root,
      env,
    });
  } catch {
    console.error("build: npm install of the dev dependencies failed");
    process.exit(1);
  }
  tsc = resolveTsc();
  if (!tsc) {
    console.error("build: typescript is still missing after npm install");
    process.exit(1);
  }
}

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
