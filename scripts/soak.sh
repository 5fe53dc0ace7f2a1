#!/usr/bin/env bash
# A longer soak than CI's: N sandboxes (default 10,000) through the API, each
# with an exec, a file write and read, an exec/stream and a code-context
# cell, four at a time, against one real daemon; the daemon's RSS, open
# descriptors, mounts, cgroups and registry are compared before and after
# (crates/cli/tests/soak.rs prints them). Needs root.
#   sudo ./scripts/soak.sh [N]
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" -ne 0 ]; then
  echo "scripts/soak.sh: the soak creates real sandboxes and must run as root" >&2
  exit 1
fi
export RUNCELL_SOAK_SANDBOXES=${1:-${RUNCELL_SOAK_SANDBOXES:-10000}}
echo "== soak: $RUNCELL_SOAK_SANDBOXES sandboxes"
cargo test -p runcell-cli --test soak -- --nocapture --test-threads=1
