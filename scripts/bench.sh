#!/usr/bin/env bash
# Sandbox start-up benchmark: runcell beside bare python3, bwrap and gVisor in
# one run. Needs root. Usage: sudo ./scripts/bench.sh [--iterations N]
# The HTTP API benchmark: sudo ./scripts/bench.sh --api [--iterations N]
# Code-interpreter first result (needs the code-interpreter template):
#   sudo ./scripts/bench.sh --interp [--iterations N]
# Isolation backends (jail, gVisor, microVM) beside python3, bwrap, runsc:
#   sudo ./scripts/bench.sh --isolation [--allow-emulation] [--iterations N]
# Pause, hibernate, snapshot and fork (small and ~200 MB layers):
#   sudo ./scripts/bench.sh --persistence [--iterations N]
# The egress proxy (10 MiB and small downloads, proxied vs direct):
#   sudo ./scripts/bench.sh --egress [--iterations N]
# Cluster mode's forwarding hop (1, 2, 3 nodes on one etcd member):
#   sudo ./scripts/bench.sh --cluster [--creates N] [--execs N]
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-deps.sh
cargo build --release --workspace --quiet
if [ "${1:-}" = "--interp" ]; then
  shift
  exec target/release/runcell-bench-interp "$@"
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
