#!/usr/bin/env bash
# CPU per run, side by side: bare /usr/bin/python3 -c pass, the same under
# bwrap --unshare-all, `runcell run python -c pass` in its own process
# (--no-daemon), and the same through a local daemon's standby pool
# (--daemon always; the daemon this script starts), interleaved, N runs per
# block, R rounds. Per block:
# - process tree: the command's whole process tree (perf stat's task-clock,
#   children inherited: the sandbox's agent and program included); for the
#   daemon row plus the daemon's own CPU meanwhile (its threads, and the
#   sandboxes it made and reaped: utime+stime+cutime+cstime from
#   /proc/PID/stat), which includes refilling its pool;
# - kernel threads: their work meanwhile, system-wide (kworkers: namespace
#   teardown; ksoftirqd and rcu: RCU callbacks), from perf record -a;
# - system-wide: every CPU's busy time meanwhile (/proc/stat), whatever ran:
#   exact on a quiet host, inflated by any other load.
# Usage (root, release build): scripts/bench-cpu.sh [N] [R]
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib/bench-daemon.sh
n=${1:-40}
rounds=${2:-4}
runcell=target/release/runcell
py=/usr/bin/python3
data=$(mktemp /tmp/runcell-bench-cpu.XXXXXX)
trap 'bench_daemon_stop; rm -f "$data"' EXIT
bench_daemon_start "$runcell" cpu
tck=$(getconf CLK_TCK)
# The daemon's CPU so far, in clock ticks (threads, and reaped children).
dticks() { proc_cpu_ticks "$BENCH_PID" | awk '{print $1 + $2}'; }
# Every CPU's busy ticks so far.
busy() { awk '/^cpu / {print $2 + $3 + $4 + $7 + $8 + $9}' /proc/stat; }
declare -A tree kthreads sys
modes="bare bwrap runcell daemon"
for round in $(seq "$rounds"); do
  for mode in $modes; do
    case $mode in
      bare) cmd="$py -c pass" ;;
      bwrap) cmd="$BENCH_BWRAP" ;;
      runcell) cmd="$runcell run --no-daemon python -c pass" ;;
      daemon) cmd="RUNCELL_URL=http://127.0.0.1:$BENCH_PORT RUNCELL_DATA_DIR=$BENCH_DIR $runcell run --daemon always python -c pass" ;;
    esac
    loop="for i in \$(seq $n); do $cmd >/dev/null; done"
    # Let the daemon's pool refill from the previous block.
    sleep 0.3
    d0=$(dticks)
    b0=$(busy)
    ms=$(perf stat -x, -e task-clock -- bash -c "$loop" 2>&1 >/dev/null | awk -F, '/task-clock/ {print $1}')
    b1=$(busy)
    d1=$(dticks)
    if [ "$mode" = daemon ]; then
      ms=$(echo "$ms + ($d1 - $d0) * 1000 / $tck" | bc -l)
    fi
    perf record -q -a -o "$data" -- bash -c "$loop" >/dev/null 2>&1
    # perf record's default event samples at 4000 Hz: 0.25 ms a sample.
    k=$(perf report -i "$data" --no-children --sort comm --stdio -g none -F sample,comm 2>/dev/null |
      awk '$2 ~ /^(kworker|ksoftirqd|rcu)/ {s += $1} END {print s + 0}')
    t=$(echo "$ms / $n" | bc -l)
    kt=$(echo "$k * 0.25 / $n" | bc -l)
    s=$(echo "($b1 - $b0) * 1000 / $tck / $n" | bc -l)
    printf 'round %d %-8s tree %5.1f ms  kernel threads %4.1f ms  system-wide %5.1f ms  per run\n' \
      "$round" "$mode" "$t" "$kt" "$s" >&2
    tree[$mode]="${tree[$mode]:-} $t"
    kthreads[$mode]="${kthreads[$mode]:-} $kt"
    sys[$mode]="${sys[$mode]:-} $s"
  done
done
median() { tr ' ' '\n' | grep . | sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
base=$(echo "$(echo "${tree[bare]}" | median) + $(echo "${kthreads[bare]}" | median)" | bc -l)
sbase=$(echo "${sys[bare]}" | median)
echo "CPU per run, $n runs per block, $rounds rounds, medians"
echo
echo "| what | process tree (+ daemon) ms | kernel threads ms | total ms | over bare ms | system-wide ms | system-wide over bare ms |"
echo "|---|---:|---:|---:|---:|---:|---:|"
for mode in $modes; do
  t=$(echo "${tree[$mode]}" | median)
  k=$(echo "${kthreads[$mode]}" | median)
  s=$(echo "${sys[$mode]}" | median)
  total=$(echo "$t + $k" | bc -l)
  printf '| %s | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f |\n' "$mode" "$t" "$k" "$total" \
    "$(echo "$total - $base" | bc -l)" "$s" "$(echo "$s - $sbase" | bc -l)"
done
