#!/usr/bin/env bash
# Cluster mode on one machine: three etcd members and three `runcell serve
# --cluster` nodes on loopback (tests/cluster/cluster_test.py): a sandbox
# used through another node than its owner, keys shared, lists through any
# node, SIGKILL of a node, one and then all etcd members stopped, and the
# published @pandastack/sdk suite through each node and pandastack through
# one. Creates real sandboxes,
# so it runs as root:
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
cargo build -p runcell-cli -p runcell-agent --quiet
# Bounded as a whole: the scenario's own waits are bounded too.
timeout --kill-after=30 1500 /usr/bin/python3 tests/cluster/cluster_test.py
