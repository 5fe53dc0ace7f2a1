#!/usr/bin/env bash
# Installs what runcell's tests and benchmark need on a Debian (bookworm)
# machine. Idempotent; needs root. Nothing here is needed to *run* runcell
# beyond a Linux kernel with user namespaces and cgroups.
set -euo pipefail

need=()
have() { command -v "$1" >/dev/null 2>&1; }
# The `host` template exposes the host's /usr: the tests run Debian's
# /usr/bin/python3 and /usr/bin/node inside sandboxes.
[ -x /usr/bin/python3 ] || need+=(python3)
[ -x /usr/bin/node ] || need+=(nodejs)
# Code-context tests check DataFrame HTML and matplotlib figures in the host
# template, so its Python needs pandas and matplotlib.
/usr/bin/python3 -c 'import pandas' >/dev/null 2>&1 || need+=(python3-pandas)
/usr/bin/python3 -c 'import matplotlib' >/dev/null 2>&1 || need+=(python3-matplotlib)
# Egress tests: curl and pip run inside sandboxes (the host template's /usr).
have curl || need+=(curl)
/usr/bin/python3 -m pip --version >/dev/null 2>&1 || need+=(python3-pip)
# scripts/test-api.sh installs openapi-spec-validator and schemathesis
# from PyPI into a venv made by Debian's Python.
/usr/bin/python3 -c 'import ensurepip, venv' >/dev/null 2>&1 || need+=(python3-venv)
have ps || need+=(procps)
have unshare || need+=(util-linux)
# Template builds (`FROM debian:<suite>`) bootstrap Debian with debootstrap,
# checking the archive's signatures with Debian's keyring.
have debootstrap || [ -x /usr/sbin/debootstrap ] || need+=(debootstrap)
[ -f /usr/share/keyrings/debian-archive-keyring.gpg ] || need+=(debian-archive-keyring)
have gpgv || need+=(gpgv)
have bwrap || need+=(bubblewrap)   # benchmark baseline
have runsc || need+=(runsc)        # the gVisor backend (crates/core/tests/gvisor.rs) and a benchmark baseline
have perf || need+=(linux-perf)    # bench.sh --cpu: CPU per run, process trees and kernel threads
have bc || need+=(bc)              # bench.sh --cpu's arithmetic
# The btrfs layer store (`runcell serve --layer-store btrfs`): mkfs.btrfs
# formats its image once (crates/cli/tests/layer_store.rs, the persistence
# benchmark); everything else is ioctls.
[ -x /usr/sbin/mkfs.btrfs ] || [ -x /sbin/mkfs.btrfs ] || need+=(btrfs-progs)
# Cluster mode: the server's etcd client (the etcd-client crate) compiles
# etcd's protobuf definitions with protoc, which needs the well-known types;
# scripts/test-cluster.sh runs a three-member etcd.
have protoc || need+=(protobuf-compiler)
[ -f /usr/include/google/protobuf/descriptor.proto ] || need+=(libprotobuf-dev)
have etcd || need+=(etcd-server)

if [ ${#need[@]} -gt 0 ]; then
  echo "installing: ${need[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

# The microVM backend: QEMU (its `microvm` machine), qemu-img for the
# guests' writable disks (qcow2 overlays), mkfs.ext4 for template images and
# blank disks, virtiofsd for volumes, and the guest kernel in the cache
# (scripts/microvm-assets.sh).
mneed=()
[ -x /usr/bin/qemu-system-x86_64 ] || mneed+=(qemu-system-x86)
[ -x /usr/bin/qemu-img ] || mneed+=(qemu-utils)
[ -x /usr/sbin/mkfs.ext4 ] || mneed+=(e2fsprogs)
# virtiofsd serves volumes to microVMs (QEMU 7.2's C one).
[ -x /usr/lib/qemu/virtiofsd ] || mneed+=(qemu-system-common)
if [ ${#mneed[@]} -gt 0 ]; then
  echo "installing: ${mneed[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${mneed[@]}" >/dev/null
fi
# Debian's qemu-system-x86 breaks a newer qemu-utils (a backport), so apt
# removes that one when it installs QEMU: a machine that came with
# qemu-img 10 was left with none. Install Debian's, which matches.
if [ ! -x /usr/bin/qemu-img ]; then
  echo "installing: qemu-utils"
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -qq --no-install-recommends qemu-utils >/dev/null
fi
[ -x /usr/bin/qemu-img ] || { echo "qemu-img is still missing after installing qemu-utils" >&2; exit 1; }
"$(dirname "$0")/microvm-assets.sh"
