#!/usr/bin/env bash
# TypeScript SDK tests: builds runcell, starts a real `runcell serve` on a
# free loopback port with a fresh data directory under /run, then installs,
# builds and tests the npm package in sdk/typescript (node's test runner)
# against it. Afterwards it deletes any sandbox still alive (and fails if the
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
DAEMON_PID=
DATA_DIR=
LOG=
PORT=
KEY=
failed=()

show_log() {
  [ -n "$LOG" ] || return 0
  echo "---- daemon log ($LOG) ----" >&2
  cat "$LOG" >&2 || true
  echo "---- end of daemon log ----" >&2
}

api() { curl -sS --max-time 30 -H "Authorization: Bearer $KEY" "$@"; }

# Deletes every sandbox the daemon still has; prints how many there were.
sweep() {
  local ids id n=0
  ids=$(api "http://127.0.0.1:$PORT/v1/sandboxes" |
    node -e 'let s = ""; process.stdin.on("data", (d) => (s += d)).on("end", () => { for (const x of JSON.parse(s)) console.log(x.id); });') ||
    { echo "could not list the daemon's sandboxes" >&2; echo -1; return; }
  for id in $ids; do
    api -o /dev/null -X DELETE "http://127.0.0.1:$PORT/v1/sandboxes/$id" >&2 || true
    n=$((n + 1))
  done
  echo "$n"
}

stop_daemon() {
  if [ -n "$DAEMON_PID" ] && kill -0 "$DAEMON_PID" 2>/dev/null; then
    kill -TERM "$DAEMON_PID" 2>/dev/null || true
    for _ in $(seq 1 50); do
      kill -0 "$DAEMON_PID" 2>/dev/null || break
      sleep 0.2
    done
    if kill -0 "$DAEMON_PID" 2>/dev/null; then
      echo "daemon did not stop within 10 s of SIGTERM; killing it" >&2
      kill -KILL "$DAEMON_PID" 2>/dev/null || true
      failed+=("daemon ignored SIGTERM")
    fi
  fi
  [ -z "$DAEMON_PID" ] || wait "$DAEMON_PID" 2>/dev/null || true
  DAEMON_PID=
  # Remove the data dir only if nothing is still mounted under it: a bind
  # mount of a host directory left behind must never be deleted through.
  if [ -n "$DATA_DIR" ] && [ -d "$DATA_DIR" ]; then
    if awk -v d="$DATA_DIR/" '{ if (index($5 "/", d) == 1) found = 1 } END { exit !found }' /proc/self/mountinfo; then
      echo "leaving $DATA_DIR in place: mounts remain under it" >&2
    else
      rm -rf "$DATA_DIR"
    fi
  fi
  DATA_DIR=
  [ -z "$LOG" ] || rm -f "$LOG"
  LOG=
}
on_exit() {
  local rc=$?
  if [ -n "$DAEMON_PID" ] && kill -0 "$DAEMON_PID" 2>/dev/null && [ -n "$KEY" ]; then
    sweep >/dev/null || true
  fi
  stop_daemon
  exit "$rc"
}
trap on_exit EXIT
trap 'exit 130' INT TERM

healthy() { curl -fsS -o /dev/null --max-time 5 "http://127.0.0.1:$PORT/healthz" 2>/dev/null; }

PORT=$(node -e 'const s = require("net").createServer().listen(0, "127.0.0.1", () => { console.log(s.address().port); s.close(); });')
DATA_DIR=$(mktemp -d /run/runcell-sdk.XXXXXX)
LOG=$(mktemp /tmp/runcell-sdk-log.XXXXXX)
echo "== starting runcell serve on 127.0.0.1:$PORT (data dir $DATA_DIR)"
target/debug/runcell serve --listen "127.0.0.1:$PORT" --data-dir "$DATA_DIR" >"$LOG" 2>&1 &
DAEMON_PID=$!

ready=
for _ in $(seq 1 60); do
  if ! kill -0 "$DAEMON_PID" 2>/dev/null; then
    wait "$DAEMON_PID" && status=0 || status=$?
    DAEMON_PID=
    show_log
    die "runcell serve exited (status $status) before answering /healthz"
  fi
  if healthy; then
    ready=1
    break
  fi
  sleep 0.5
done
if [ -z "$ready" ]; then
  show_log
  die "runcell serve did not answer GET /healthz with 200 within 30 s"
fi
[ -s "$DATA_DIR/api-key" ] || { show_log; die "$DATA_DIR/api-key is missing or empty after start-up"; }
KEY=$(tr -d '\r\n' <"$DATA_DIR/api-key")

# --- tests -------------------------------------------------------------------
# Loopback only, whatever proxy the environment names.
export NO_PROXY="127.0.0.1,localhost${NO_PROXY:+,$NO_PROXY}" no_proxy="127.0.0.1,localhost${no_proxy:+,$no_proxy}"
export RUNCELL_URL="http://127.0.0.1:$PORT" RUNCELL_API_KEY="$KEY"

echo "== runcell SDK tests (node --test, ${#TESTS[@]} files)"
# A hung daemon would make requests wait forever; bound the whole suite.
(cd "$SDK" && timeout --kill-after=30 900 node --test --test-reporter=spec "${TESTS[@]}") ||
  failed+=("SDK tests")

if ! kill -0 "$DAEMON_PID" 2>/dev/null; then
  echo "FAIL: the daemon exited during the SDK tests" >&2
  failed+=("daemon exited during the tests")
  DAEMON_PID=
elif ! healthy; then
  echo "FAIL: the daemon stopped answering /healthz during the SDK tests" >&2
  failed+=("daemon unresponsive after the tests")
else
  left=$(sweep)
  if [ "$left" != 0 ]; then
    echo "FAIL: the tests left $left sandbox(es) running (deleted now)" >&2
    failed+=("$left sandbox(es) left behind")
  fi
fi
[ ${#failed[@]} -eq 0 ] || show_log
KEY=
stop_daemon

if [ ${#failed[@]} -gt 0 ]; then
  echo "scripts/test-sdk.sh: FAILED: ${failed[*]}" >&2
  exit 1
fi
echo "scripts/test-sdk.sh: all SDK tests passed"
