#!/usr/bin/env bash
# Builds runcell in release mode and runs it (as root) with the given
# arguments, e.g.  sudo ./scripts/run.sh run python -c 'print(6*7)'
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --quiet -p runcell-cli -p runcell-agent
exec target/release/runcell "$@"
