# Shared by the test scripts that drive a real `runcell serve`: start one on
# a free loopback port with a fresh data directory, check its health, delete
# what tests left behind, and stop it. Source it from the repo root after
# `cargo build --workspace`; call `daemon_stop` from the script's EXIT trap.
#
# After daemon_start: DAEMON_PID, PORT, URL, KEY, DATA_DIR and LOG are set.

DAEMON_PID=
PORT=
URL=
KEY=
DATA_DIR=
LOG=

daemon_log() {
  [ -n "$LOG" ] || return 0
  echo "---- daemon log ($LOG) ----" >&2
  cat "$LOG" >&2 || true
  echo "---- end of daemon log ----" >&2
}

daemon_healthy() { curl -fsS -o /dev/null --max-time 5 "$URL/healthz" 2>/dev/null; }

# daemon_start NAME [extra runcell serve flags...]
daemon_start() {
  local name=$1
  shift
  PORT=$(/usr/bin/python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  URL="http://127.0.0.1:$PORT"
  DATA_DIR=$(mktemp -d "/run/runcell-$name.XXXXXX")
  LOG=$(mktemp "/tmp/runcell-$name-log.XXXXXX")
  echo "== starting runcell serve on 127.0.0.1:$PORT (data dir $DATA_DIR)"
  # Test daemons serve code-interpreter from host rather than each
  # bootstrapping Debian, unless the caller passes --auto-build itself.
  local auto=(--auto-build=false) arg
  for arg in "$@"; do
    case $arg in --auto-build*) auto=() ;; esac
  done
  target/debug/runcell serve --listen "127.0.0.1:$PORT" --data-dir "$DATA_DIR" "${auto[@]}" "$@" >"$LOG" 2>&1 &
  DAEMON_PID=$!
  local ready= status
  for _ in $(seq 1 60); do
    if ! kill -0 "$DAEMON_PID" 2>/dev/null; then
      wait "$DAEMON_PID" && status=0 || status=$?
      DAEMON_PID=
      daemon_log
      echo "runcell serve exited (status $status) before answering /healthz" >&2
      return 1
    fi
    if daemon_healthy; then
      ready=1
      break
    fi
    sleep 0.5
  done
  if [ -z "$ready" ]; then
    daemon_log
    echo "runcell serve did not answer GET /healthz with 200 within 30 s" >&2
    return 1
  fi
  [ -s "$DATA_DIR/api-key" ] || { daemon_log; echo "$DATA_DIR/api-key is missing" >&2; return 1; }
  KEY=$(tr -d '\r\n' <"$DATA_DIR/api-key")
}

# Deletes every sandbox the daemon still has; prints how many there were.
daemon_sweep() {
  local ids id n=0
  ids=$(curl -sS --max-time 30 -H "Authorization: Bearer $KEY" "$URL/v1/sandboxes" |
    /usr/bin/python3 -c 'import json, sys; print("\n".join(s["id"] for s in json.load(sys.stdin)))') ||
    { echo "could not list the daemon's sandboxes" >&2; echo -1; return; }
  for id in $ids; do
    curl -sS --max-time 30 -o /dev/null -H "Authorization: Bearer $KEY" -X DELETE "$URL/v1/sandboxes/$id" >&2 || true
    n=$((n + 1))
  done
  echo "$n"
}

# Stops the daemon (SIGTERM, then SIGKILL after 10 s; returns 1 if it had
# to) and removes its data directory unless something is mounted under it.
daemon_stop() {
  local rc=0
  if [ -n "$DAEMON_PID" ] && kill -0 "$DAEMON_PID" 2>/dev/null; then
    kill -TERM "$DAEMON_PID" 2>/dev/null || true
    for _ in $(seq 1 50); do
      kill -0 "$DAEMON_PID" 2>/dev/null || break
      sleep 0.2
    done
    if kill -0 "$DAEMON_PID" 2>/dev/null; then
      echo "daemon did not stop within 10 s of SIGTERM; killing it" >&2
      kill -KILL "$DAEMON_PID" 2>/dev/null || true
      rc=1
    fi
  fi
  [ -z "$DAEMON_PID" ] || wait "$DAEMON_PID" 2>/dev/null || true
  DAEMON_PID=
  # Volumes are loop mounts the daemon keeps while it runs (and leaves on
  # exit, for the next start): unmount them before the data dir goes.
  if [ -n "$DATA_DIR" ] && [ -d "$DATA_DIR/volumes" ]; then
    for m in "$DATA_DIR"/volumes/*.mnt; do
      [ -d "$m" ] && umount "$m" 2>/dev/null || true
    done
  fi
  # The sandboxes' tmpfs: a daemon that stopped with none left unmounted
  # it; one that was killed did not.
  if [ -n "$DATA_DIR" ] && mountpoint -q "$DATA_DIR/sandboxes" 2>/dev/null \
    && [ -z "$(ls -A "$DATA_DIR/sandboxes")" ]; then
    umount "$DATA_DIR/sandboxes" 2>/dev/null || true
  fi
  # A bind mount of a host directory left behind must never be deleted through.
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
  return "$rc"
}

# After a suite: the daemon must still be running and healthy, and the suite
# must have deleted every sandbox it made (what is left is deleted now).
# Appends what went wrong to the caller's `failed` array.
daemon_after_suite() {
  local what=$1 left
  if ! kill -0 "$DAEMON_PID" 2>/dev/null; then
    echo "FAIL: the daemon exited during $what" >&2
    failed+=("daemon exited during $what")
    DAEMON_PID=
  elif ! daemon_healthy; then
    echo "FAIL: the daemon stopped answering /healthz during $what" >&2
    failed+=("daemon unresponsive after $what")
  else
    left=$(daemon_sweep)
    if [ "$left" != 0 ]; then
      echo "FAIL: $what left $left sandbox(es) running (deleted now)" >&2
      failed+=("$left sandbox(es) left behind by $what")
    fi
  fi
}

# Installs an EXIT trap that deletes the sandboxes a failed run left behind
# and stops the daemon, keeping the script's exit status.
daemon_cleanup_on_exit() {
  trap _daemon_on_exit EXIT
  trap 'exit 130' INT TERM
}
_daemon_on_exit() {
  local rc=$?
  if [ -n "$DAEMON_PID" ] && kill -0 "$DAEMON_PID" 2>/dev/null && [ -n "$KEY" ]; then
    daemon_sweep >/dev/null || true
  fi
  daemon_stop || true
  exit "$rc"
}
