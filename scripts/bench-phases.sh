#!/usr/bin/env bash
# Where a run's time goes, side by side: bare /usr/bin/python3 -c pass, the
# same under bwrap --unshare-all, and `runcell run python -c pass` through a
# local daemon's standby pool (--daemon always; the daemon this script
# starts), interleaved, N rounds, IDLE seconds between runs. The times are
# the kernel's own (perf's sched_process_exec and sched_process_exit
# tracepoints, recorded system-wide), per run:
# - before: from the launcher's exec (bwrap, runcell) to the program's;
# - program: from the program's exec to its exit;
# - after: from the program's exit to the launcher's, split in two at the
#   exit of the program's parent (bwrap's init in the sandbox; runcell's
#   exec supervisor): "to its parent's end" is the program's own teardown
#   and its parent's wait and exit, "the rest" is how the end reaches the
#   launcher (bwrap: its own wait; runcell: the agent, the daemon, the CLI)
#   and the launcher's exit.
# Bare python has only its program phase, the baseline for the others'.
# Usage (root, release build): scripts/bench-phases.sh [N] [IDLE]
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib/bench-daemon.sh
n=${1:-40}
idle=${2:-0.1}
runcell=$PWD/target/release/runcell
py=/usr/bin/python3
data=$(mktemp /tmp/runcell-bench-phases.XXXXXX)
trap 'bench_daemon_stop; rm -f "$data"' EXIT
bench_daemon_start "$runcell" phases
export RUNCELL_URL=http://127.0.0.1:$BENCH_PORT RUNCELL_DATA_DIR=$BENCH_DIR
loop="for i in \$(seq $n); do
  $py -c pass; sleep $idle
  $BENCH_BWRAP; sleep $idle
  $runcell run --daemon always python -c pass; sleep $idle
done"
perf record -q -a -o "$data" -e sched:sched_process_fork,sched:sched_process_exec,sched:sched_process_exit \
  -- bash -c "$loop" >/dev/null 2>&1
perf script -i "$data" -F pid,time,event,trace 2>/dev/null | "$py" -c '
import statistics, sys

runcell, py, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
# Per launcher pid: [kind, its exec, the program exec, the program exit,
# the exit of the parent of the program].
launchers = {}
program = {}  # program pid -> (launcher pid or None for a bare run, its exec)
parent_of = {}  # pid -> the pid that forked it
parents = {}  # the parent pid of a running program -> its launcher pid
phases = {"bare": [], "bwrap": [], "runcell": []}
pending = None  # the launcher whose program has not started yet
for line in sys.stdin:
    f = line.split()
    pid, t = f[0], float(f[1].rstrip(":"))
    if "sched_process_fork:" in line:
        child = line.split("child_pid=")[1].split()[0]
        parent_of[child] = line.split("pid=")[1].split()[0]
    elif "sched_process_exec:" in line:
        name = line.split("filename=")[1].split()[0]
        if name == runcell or name.endswith("/bwrap"):
            launchers[pid] = ["runcell" if name == runcell else "bwrap", t, None, None, None]
            pending = pid
        elif name == py:
            program[pid] = (pending, t)
            if pending is not None:
                launchers[pending][2] = t
                if pid in parent_of:
                    parents[parent_of[pid]] = pending
            pending = None
    elif "sched_process_exit:" in line:
        if pid in program:
            owner, start = program.pop(pid)
            if owner is None:
                phases["bare"].append((0.0, t - start, 0.0, 0.0))
            elif owner in launchers:
                launchers[owner][3] = t
        elif pid in parents:
            owner = parents.pop(pid)
            if owner in launchers and launchers[owner][3] is not None:
                launchers[owner][4] = t
        elif pid in launchers:
            kind, t0, t1, t2, t3 = launchers.pop(pid)
            if t1 is not None and t2 is not None:
                t3 = t if t3 is None else t3
                phases[kind].append((t1 - t0, t2 - t1, t3 - t2, t - t3))

def med(rows, i):
    return statistics.median(r[i] for r in rows) * 1000

def after(rows):
    return statistics.median(r[2] + r[3] for r in rows) * 1000

print(f"Phases of a run, medians of {n} runs each (ms)")
print()
print("| what | before | program | after | of it, to the end of its parent | the rest | total | total over bwrap |")
print("|---|---:|---:|---:|---:|---:|---:|---:|")
totals = {k: med(v, 0) + med(v, 1) + after(v) for k, v in phases.items() if v}
for kind, label in (("bare", "bare python3"), ("bwrap", "bwrap --unshare-all"),
                    ("runcell", "runcell run, through a daemon")):
    rows = phases[kind]
    if len(rows) < n:
        sys.exit(f"only {len(rows)} of {n} {kind} runs were seen whole")
    over = totals[kind] - totals["bwrap"]
    print(f"| {label} | {med(rows, 0):.2f} | {med(rows, 1):.2f} | {after(rows):.2f} "
          f"| {med(rows, 2):.2f} | {med(rows, 3):.2f} | {totals[kind]:.2f} | {over:+.2f} |")
' "$runcell" "$py" "$n"
