# Shared by the CPU benchmarks that start a `runcell serve` of their own
# (scripts/bench-cpu.sh, scripts/bench-daemon-cpu.sh). Source it from the
# repo root.

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
