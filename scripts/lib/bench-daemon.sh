# Shared by the benchmarks that start a `runcell serve` of their own
# (scripts/bench-cpu.sh, scripts/bench-daemon-cpu.sh,
# scripts/bench-phases.sh). Source it from the repo root.

# The row beside bare Python: Debian's python3 under bwrap with every
# namespace of its own and only /usr, /proc, /dev and a /tmp shown.
BENCH_BWRAP="bwrap --unshare-all --die-with-parent --ro-bind /usr /usr --symlink usr/bin /bin --symlink usr/lib /lib --symlink usr/lib64 /lib64 --proc /proc --dev /dev --tmpfs /tmp /usr/bin/python3 -c pass"

# bench_daemon_start RUNCELL NAME [N]: starts `RUNCELL serve` (a standby
# pool of 2, no template builds, cgroup parent runcell-bench-NAME) in a data
# directory of its own, /run/runcell-bench/NAME-daemon-PID, with its log
# beside it, on a port of its own (N, default 0, moves it); sets BENCH_DIR,
# BENCH_PORT and BENCH_PID and waits until it serves. Set the EXIT trap that
# calls bench_daemon_stop first, so a daemon that fails to serve is stopped.
bench_daemon_start() {
  local runcell=$1 name=$2
  BENCH_DIR=/run/runcell-bench/$name-daemon-$$
  BENCH_PORT=$((20000 + ($$ + ${3:-0}) % 20000))
  rm -rf "$BENCH_DIR"
  mkdir -p "$BENCH_DIR"
  "$runcell" serve --listen "127.0.0.1:$BENCH_PORT" --data-dir "$BENCH_DIR" --standby 2 \
    --auto-build=false --cgroup-parent "runcell-bench-$name" >/dev/null 2>"$BENCH_DIR.log" &
  BENCH_PID=$!
  bench_daemon_wait "$BENCH_DIR" "$BENCH_PORT"
}

# bench_daemon_stop: stops the daemon bench_daemon_start started (if any)
# and removes its directory and log.
bench_daemon_stop() {
  [ -n "${BENCH_PID:-}" ] || return 0
  kill -TERM "$BENCH_PID" 2>/dev/null || true
  wait "$BENCH_PID" 2>/dev/null || true
  rm -rf "$BENCH_DIR" "$BENCH_DIR.log"
  BENCH_PID=
}

# bench_daemon_wait DIR PORT: waits (up to 10 s) until the daemon started
# with --data-dir DIR, its stderr in DIR.log, has written its API key and
# accepts connections on 127.0.0.1:PORT; exits 1 with its log if not.
bench_daemon_wait() {
  local dir=$1 port=$2
  for _ in $(seq 500); do
    [ -s "$dir/api-key" ] && (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && break
    sleep 0.02
  done
  [ -s "$dir/api-key" ] || { echo "the daemon did not start: $(cat "$dir.log")" >&2; exit 1; }
}

# proc_cpu_ticks PID: the CPU process PID has used so far, in clock ticks,
# as "OWN REAPED": utime+stime of its threads, and cutime+cstime of the
# children it reaped (from /proc/PID/stat, counted after the command
# name's closing parenthesis, so a name with spaces cannot shift them).
proc_cpu_ticks() {
  sed 's/.*) //' "/proc/$1/stat" | awk '{print $12 + $13, $14 + $15}'
}
