#!/usr/bin/env bash
# TypeScript SDK tests: builds runcell, starts a real `runcell serve` on a
# free loopback port with a fresh data directory under /run, then installs,
# builds and tests the npm package in sdk/typescript (node's test runner)
# against it, including every example of sdk/typescript/README.md, and
# checks that `npm install <path of sdk/typescript>` works from a clean copy
# of its sources (this needs the npm registry for typescript). Afterwards it deletes any sandbox still alive (and fails if the
# tests left one behind), stops the daemon with SIGTERM and removes the data
# directory. The daemon creates real sandboxes, so this must run as root,
# from anywhere (it cds to the repo root):
#   sudo ./scripts/test-sdk.sh
# Exits non-zero if anything it needs is missing or any test fails; it never
# skips.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
SDK=$REPO/sdk/typescript

die() { echo "scripts/test-sdk.sh: $*" >&2; exit 1; }

[ "$(id -u)" -eq 0 ] || die "the daemon creates real sandboxes: run as root (sudo ./scripts/test-sdk.sh)"

# --- tools -------------------------------------------------------------------
if ! command -v curl >/dev/null 2>&1; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends curl ca-certificates >/dev/null
fi
for tool in node npm cargo curl; do
  command -v "$tool" >/dev/null 2>&1 || die "'$tool' is not installed; the SDK tests need it"
done
node -e 'const [maj] = process.versions.node.split(".").map(Number); if (maj < 18) { console.error("node " + process.versions.node + " is too old: the SDK needs >= 18"); process.exit(1); }' ||
  die "node >= 18 is required"

# --- build -------------------------------------------------------------------
echo "== building the workspace (cargo build --workspace)"
cargo build --workspace --quiet
for bin in runcell runcell-agent; do
  [ -x "target/debug/$bin" ] || die "target/debug/$bin is missing after cargo build"
done

echo "== installing the SDK's dev dependencies (npm ci)"
(cd "$SDK" && npm ci --no-audit --no-fund --loglevel=error)
# The repository README's examples (test/root-readme.test.mts) use the
# published @pandastack/sdk, pinned in tests/clients.
echo "== installing @pandastack/sdk for the README's examples (npm ci in tests/clients)"
(cd "$REPO/tests/clients" && npm ci --no-audit --no-fund --loglevel=error)

echo "== building the SDK (ESM + CJS + declarations) and its tests"
rm -rf "$SDK/.build"
(cd "$SDK" && npm run --silent build && npm run --silent build:test)
for f in dist/esm/index.js dist/esm/index.d.ts dist/cjs/index.js dist/cjs/index.d.ts; do
  [ -s "$SDK/$f" ] || die "the build did not produce sdk/typescript/$f"
done
shopt -s nullglob
TESTS=("$SDK"/.build/test/*.test.mjs)
shopt -u nullglob
[ ${#TESTS[@]} -gt 0 ] || die "no compiled tests in sdk/typescript/.build/test"

# --- daemon ------------------------------------------------------------------
failed=()

. scripts/lib/daemon.sh
daemon_cleanup_on_exit

daemon_start sdk || die "the daemon did not start"

# --- tests -------------------------------------------------------------------
# Loopback only, whatever proxy the environment names.
export NO_PROXY="127.0.0.1,localhost${NO_PROXY:+,$NO_PROXY}" no_proxy="127.0.0.1,localhost${no_proxy:+,$no_proxy}"
export RUNCELL_URL="$URL" RUNCELL_API_KEY="$KEY"

echo "== runcell SDK tests (node --test, ${#TESTS[@]} files)"
# A hung daemon would make requests wait forever; bound the whole suite.
(cd "$SDK" && timeout --kill-after=30 900 node --test --test-reporter=spec "${TESTS[@]}") ||
  failed+=("SDK tests")

# `npm install /path/to/sdk/typescript` from a checkout with nothing built
# and no node_modules: the package's `prepare` script must install its dev
# dependencies and build it, and both module systems must load it.
echo "== npm install of the SDK from a clean copy of its sources (prepare builds it)"
INSTALL_TMP=$(mktemp -d /tmp/runcell-sdk-install.XXXXXX)
if (
  set -e
  mkdir "$INSTALL_TMP/sdk" "$INSTALL_TMP/app"
  cd "$SDK"
  git ls-files -z --cached --others --exclude-standard . | xargs -0 cp --parents -t "$INSTALL_TMP/sdk"
  [ ! -e "$INSTALL_TMP/sdk/dist" ] && [ ! -e "$INSTALL_TMP/sdk/node_modules" ]
  cd "$INSTALL_TMP/app"
  npm init -y >/dev/null
  npm install --no-audit --no-fund --loglevel=error "$INSTALL_TMP/sdk"
  cat > esm.mjs <<'JS'
import { Sandbox } from "runcell";
const sb = await Sandbox.create({ template: "host", metadata: { suite: "runcell-sdk-install" } });
try {
  const r = await sb.exec("echo installed");
  if (r.stdout !== "installed\n") throw new Error(`exec said ${JSON.stringify(r.stdout)}`);
} finally {
  await sb.kill();
}
console.log("esm ok");
JS
  cat > cjs.cjs <<'JS'
const { Sandbox } = require("runcell");
if (typeof Sandbox.connect !== "function") throw new Error("no Sandbox.connect in the CommonJS build");
console.log("cjs ok");
JS
  timeout 120 node esm.mjs
  node cjs.cjs
); then
  echo "npm install from the repo path: ok"
else
  failed+=("npm install of sdk/typescript from its path")
fi
rm -rf "$INSTALL_TMP"

daemon_after_suite "the SDK tests"
[ ${#failed[@]} -eq 0 ] || daemon_log
KEY=
daemon_stop || failed+=("daemon ignored SIGTERM")

if [ ${#failed[@]} -gt 0 ]; then
  echo "scripts/test-sdk.sh: FAILED: ${failed[*]}" >&2
  exit 1
fi
echo "scripts/test-sdk.sh: all SDK tests passed"
