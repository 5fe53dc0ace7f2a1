#!/usr/bin/env bash
# Client-compatibility tests: starts a real `runcell serve` on loopback and
# drives it through published client packages, unchanged: the official MCP
# client SDK (@modelcontextprotocol/sdk, against `runcell mcp` and /mcp) and
# the PandaStack clients:
# @pandastack/sdk (npm, tests/clients/package.json) and pandastack (PyPI,
# tests/clients/requirements.txt). The daemon creates real sandboxes, so this
# must run as root, from anywhere (it cds to the repo root):
#   sudo ./scripts/test-clients.sh
# Exits non-zero if any test fails or anything it needs is missing; it never
# skips a suite because a tool is absent.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
CLIENTS=$REPO/tests/clients

die() { echo "scripts/test-clients.sh: $*" >&2; exit 1; }

[ "$(id -u)" -eq 0 ] || die "the daemon creates real sandboxes: run as root (sudo ./scripts/test-clients.sh)"

# --- tools -------------------------------------------------------------------
apt_install() {
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}
command -v curl >/dev/null 2>&1 || apt_install curl ca-certificates
for tool in node npm cargo curl; do
  command -v "$tool" >/dev/null 2>&1 || die "'$tool' is not installed; the client tests need it"
done
[ -x /usr/bin/python3 ] || apt_install python3
# The venv must come from Debian's interpreter (the one sandboxes see too).
if ! /usr/bin/python3 -c 'import venv, ensurepip' >/dev/null 2>&1; then
  apt_install python3-venv
fi

# --- client packages ---------------------------------------------------------
echo "== installing @pandastack/sdk (npm ci)"
(cd "$CLIENTS" && npm ci --no-audit --no-fund --loglevel=error)
node -e 'const v = require(process.argv[1]).version; if (v !== "0.9.0") { console.error("@pandastack/sdk is " + v + ", want 0.9.0"); process.exit(1); }' \
  "$CLIENTS/node_modules/@pandastack/sdk/package.json"

echo "== installing pandastack (venv + pip)"
VENV=$CLIENTS/.venv
if [ -e "$VENV" ] && ! grep -qx 'home = /usr/bin' "$VENV/pyvenv.cfg" 2>/dev/null; then
  echo "$VENV was not made by /usr/bin/python3; recreating it"
  rm -rf "$VENV"
fi
[ -x "$VENV/bin/python" ] || /usr/bin/python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -r "$CLIENTS/requirements.txt"
"$VENV/bin/python" -c 'import pandastack, sys; sys.exit(0 if pandastack.__version__ == "0.10.0" else "pandastack is " + pandastack.__version__ + ", want 0.10.0")'

# `await using` is compiled by TypeScript (Node 20 cannot parse it).
echo "== compiling the await-using test (tsc)"
rm -rf "$CLIENTS/.build"
(cd "$CLIENTS" && npx --no-install tsc -p tsconfig.json)

# --- daemon ------------------------------------------------------------------
echo "== building"
cargo build --workspace --quiet

# Each suite gets a fresh daemon (own port, own data dir), so a crash or hang
# caused by one SDK's traffic cannot turn the other suite into timeouts.
. scripts/lib/daemon.sh
failed=()

on_exit() {
  local rc=$?
  daemon_stop || true
  exit "$rc"
}
trap on_exit EXIT
trap 'exit 130' INT TERM

# Starts the daemon, waits for /healthz, exports PANDASTACK_API(_KEY).
# Extra `runcell serve` flags for the next suites (the gVisor passes below).
SERVE_ARGS=()
start_daemon() {
  daemon_start clients "${SERVE_ARGS[@]}" || die "the daemon did not start"
  local mode
  mode=$(stat -c %a "$DATA_DIR/api-key")
  if [ "$mode" != 600 ]; then
    echo "FAIL: $DATA_DIR/api-key has mode $mode, want 600" >&2
    failed+=("api-key mode $mode")
  fi
  export PANDASTACK_API=$URL PANDASTACK_API_KEY=$KEY
}

# Runs one suite against a fresh daemon; the daemon must survive it.
run_suite() {
  local name=$1
  shift
  start_daemon
  echo "== $name"
  # A hung daemon makes every request wait for the client timeout; bound the
  # whole suite so it cannot eat the CI budget.
  local suite_ok=1
  timeout --kill-after=30 1200 "$@" || { suite_ok=; failed+=("$name"); }
  if ! kill -0 "$DAEMON_PID" 2>/dev/null; then
    echo "FAIL: the daemon exited during $name" >&2
    failed+=("daemon exited during $name")
    suite_ok=
  elif ! daemon_healthy; then
    echo "FAIL: the daemon stopped answering /healthz during $name" >&2
    failed+=("daemon unresponsive after $name")
    suite_ok=
  fi
  [ -n "$suite_ok" ] || daemon_log
  daemon_stop || failed+=("daemon ignored SIGTERM after $name")
}

# Loopback only, whatever proxy the environment names.
export NO_PROXY="127.0.0.1,localhost${NO_PROXY:+,$NO_PROXY}" no_proxy="127.0.0.1,localhost${no_proxy:+,$no_proxy}"

# --- tests -------------------------------------------------------------------
run_suite "@pandastack/sdk@0.9.0" node --test tests/clients/pandastack-sdk.test.mjs tests/clients/.build/await-using.test.mjs tests/clients/pandastack-state.test.mjs
run_suite "pandastack==0.10.0" "$VENV/bin/python" -m pytest -v -p no:cacheprovider "$CLIENTS/test_pandastack_py.py"
run_suite "MCP (@modelcontextprotocol/sdk)" node --test tests/clients/mcp.test.mjs
# The same published clients with gVisor as the daemon's default isolation:
# every sandbox they create runs under runsc (issue 13).
SERVE_ARGS=(--default-isolation gvisor)
run_suite "@pandastack/sdk@0.9.0 on gVisor" node --test tests/clients/pandastack-sdk.test.mjs tests/clients/.build/await-using.test.mjs
run_suite "pandastack==0.10.0 on gVisor" "$VENV/bin/python" -m pytest -v -p no:cacheprovider "$CLIENTS/test_pandastack_py.py"
SERVE_ARGS=()

if [ ${#failed[@]} -gt 0 ]; then
  echo "scripts/test-clients.sh: FAILED: ${failed[*]}" >&2
  exit 1
fi
echo "scripts/test-clients.sh: all client tests passed"
