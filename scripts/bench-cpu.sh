#!/usr/bin/env bash
# CPU per run, side by side: bare /usr/bin/python3 -c pass, the same under
# bwrap --unshare-all, and `runcell run python -c pass`, interleaved, N runs
# per block, R rounds. Two parts per block: the command's whole process tree
# (perf stat's task-clock, children inherited: the sandbox's agent and
# program included), and the kernel threads' work meanwhile, system-wide
# (kworkers: namespace teardown; ksoftirqd and rcu: RCU callbacks), from
# perf record -a. Other load on the host shows in the second part only.
# Usage (root, release build): scripts/bench-cpu.sh [N] [R]
set -euo pipefail
cd "$(dirname "$0")/.."
n=${1:-40}
rounds=${2:-4}
runcell=target/release/runcell
py=/usr/bin/python3
bwrap="bwrap --unshare-all --die-with-parent --ro-bind /usr /usr --symlink usr/bin /bin --symlink usr/lib /lib --symlink usr/lib64 /lib64 --proc /proc --dev /dev --tmpfs /tmp $py -c pass"
data=$(mktemp /tmp/runcell-bench-cpu.XXXXXX)
trap 'rm -f "$data"' EXIT
declare -A tree kthreads
for round in $(seq "$rounds"); do
  for mode in bare bwrap runcell; do
    case $mode in
      bare) cmd="$py -c pass" ;;
      bwrap) cmd="$bwrap" ;;
      runcell) cmd="$runcell run python -c pass" ;;
    esac
    loop="for i in \$(seq $n); do $cmd >/dev/null; done"
    ms=$(perf stat -x, -e task-clock -- bash -c "$loop" 2>&1 >/dev/null | awk -F, '/task-clock/ {print $1}')
    perf record -q -a -o "$data" -- bash -c "$loop" >/dev/null 2>&1
    # perf record's default event samples at 4000 Hz: 0.25 ms a sample.
    k=$(perf report -i "$data" --no-children --sort comm --stdio -g none -F sample,comm 2>/dev/null |
      awk '$2 ~ /^(kworker|ksoftirqd|rcu)/ {s += $1} END {print s + 0}')
    t=$(echo "$ms / $n" | bc -l)
    kt=$(echo "$k * 0.25 / $n" | bc -l)
    printf 'round %d %-8s tree %5.1f ms  kernel threads %4.1f ms  per run\n' "$round" "$mode" "$t" "$kt" >&2
    tree[$mode]="${tree[$mode]:-} $t"
    kthreads[$mode]="${kthreads[$mode]:-} $kt"
  done
done
median() { tr ' ' '\n' | grep . | sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
base=$(echo "$(echo "${tree[bare]}" | median) + $(echo "${kthreads[bare]}" | median)" | bc -l)
echo "CPU per run, $n runs per block, $rounds rounds, medians"
echo
echo "| what | process tree ms | kernel threads ms | total ms | over bare ms |"
echo "|---|---:|---:|---:|---:|"
for mode in bare bwrap runcell; do
  t=$(echo "${tree[$mode]}" | median)
  k=$(echo "${kthreads[$mode]}" | median)
  total=$(echo "$t + $k" | bc -l)
  printf '| %s | %.1f | %.1f | %.1f | %.1f |\n' "$mode" "$t" "$k" "$total" "$(echo "$total - $base" | bc -l)"
done
