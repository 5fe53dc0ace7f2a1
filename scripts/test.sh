#!/usr/bin/env bash
# Runs every test. The integration tests create real sandboxes, so this must
# run as root; it installs what the tests need first.
#   sudo ./scripts/test.sh
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" -ne 0 ]; then
  echo "scripts/test.sh: the tests create real sandboxes and must run as root (sudo ./scripts/test.sh)" >&2
  exit 1
fi
./scripts/install-deps.sh
# The agent binary must exist before the tests that start sandboxes.
cargo build --workspace --all-targets --quiet
cargo test --workspace -- --test-threads=2
# The hostile-code suites and code contexts again with gVisor as the
# isolation (the microVM's smoke tests are in crates/core/tests/microvm.rs).
RUNCELL_TEST_ISOLATION=gvisor cargo test -p runcell-core --test isolation --test contexts --test shell_lines -- --test-threads=2
RUNCELL_TEST_ISOLATION=gvisor cargo test -p runcell-cli --test hostile_output --test hostile_fs --test exec_lifetime -- --test-threads=2
./scripts/test-api.sh # OpenAPI validation and schemathesis fuzzing, real daemon
# The published PandaStack clients (npm and PyPI) and the official MCP client
# against a real daemon.
./scripts/test-clients.sh
# runcell's own TypeScript SDK (sdk/typescript) against a real daemon.
./scripts/test-sdk.sh
# The Mastra tool (sdk/mastra) in a real @mastra/core Agent, on Node 22.
./scripts/test-mastra.sh
# The Helm chart (deploy/kubernetes), rendered and validated offline
# against the Kubernetes JSON schemas.
./scripts/test-deploy.sh
# Cluster mode: three etcd members and three nodes on loopback, faults
# included, and the @pandastack/sdk suite through one node.
./scripts/test-cluster.sh
