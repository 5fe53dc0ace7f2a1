#!/usr/bin/env bash
# Builds runcell in release mode and runs it (as root) with the given
# arguments, e.g.  sudo ./scripts/run.sh run python -c 'print(6*7)'
#
# For `serve` (and `template build`) it first installs what building
# templates needs: `serve` builds the bundled code-interpreter template
# (Debian with numpy, pandas, matplotlib) in the background on first start,
# which bootstraps Debian with debootstrap and checks the archive's
# signatures with Debian's keyring and gpgv.
set -euo pipefail
cd "$(dirname "$0")/.."

template_tools() {
  local need=()
  command -v debootstrap >/dev/null 2>&1 || [ -x /usr/sbin/debootstrap ] || need+=(debootstrap)
  [ -f /usr/share/keyrings/debian-archive-keyring.gpg ] || need+=(debian-archive-keyring)
  command -v gpgv >/dev/null 2>&1 || need+=(gpgv)
  [ ${#need[@]} -gt 0 ] || return 0
  if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "run.sh: installing what template builds need: ${need[*]}" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
  else
    echo "run.sh: template builds need ${need[*]}; install them (as root, with your" \
      "package manager) or code-interpreter stays served from the host template" >&2
  fi
}

auto_build=true
for arg in "$@"; do
  case $arg in
    --auto-build=false | --auto-build=0) auto_build=false ;;
  esac
done
case "${RUNCELL_AUTO_BUILD:-}" in false | 0) auto_build=false ;; esac
case "${1:-} ${2:-}" in
  "serve "* ) [ "$auto_build" = false ] || template_tools ;;
  "template build") template_tools ;;
esac

cargo build --release --quiet -p runcell-cli -p runcell-agent
exec target/release/runcell "$@"
