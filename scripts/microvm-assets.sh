#!/usr/bin/env bash
# Fetches the microVM backend's guest kernel into a cache directory:
# Debian's cloud kernel (linux-image-cloud-amd64) and the few modules the
# guest loads early (virtio PCI, virtio-serial, virtio-blk, overlayfs; Debian
# builds them as modules). The initramfs (the agent, its libraries and these
# modules) is built by runcell itself at first use, and template images per
# template. Idempotent; needs root (apt-get download, dpkg-deb).
#
#   scripts/microvm-assets.sh [DIR]    (default /var/cache/runcell/microvm)
#
# Result: DIR/vmlinuz, DIR/modules/*.ko and DIR/modules/order (load order).
set -euo pipefail

dir=${1:-/var/cache/runcell/microvm}
if [ -s "$dir/vmlinuz" ] && [ -s "$dir/modules/order" ]; then
  exit 0
fi
mkdir -p "$dir"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
chmod 755 "$tmp"
cd "$tmp"
# The metapackage names the current kernel package.
pkg=$(apt-cache depends linux-image-cloud-amd64 | awk '/Depends: linux-image-[0-9]/ {print $2; exit}')
if [ -z "$pkg" ]; then
  apt-get update -qq
  pkg=$(apt-cache depends linux-image-cloud-amd64 | awk '/Depends: linux-image-[0-9]/ {print $2; exit}')
fi
[ -n "$pkg" ] || { echo "microvm-assets: no linux-image-cloud-amd64 in the apt sources" >&2; exit 1; }
apt-get download -qq "$pkg" 2>/dev/null || apt-get download "$pkg"
dpkg-deb -x ./"$pkg"_*.deb x
mkdir -p "$dir/modules.new"
# In load order: each needs only those above it.
order=(virtio virtio_ring virtio_pci_legacy_dev virtio_pci_modern_dev virtio_pci virtio_console virtio_blk overlay)
: > "$dir/modules.new/order"
for m in "${order[@]}"; do
  f=$(find x/lib/modules -name "$m.ko*" | head -n1)
  [ -n "$f" ] || { echo "microvm-assets: $pkg has no module $m" >&2; exit 1; }
  case "$f" in
    *.ko.xz) xz -dc "$f" > "$dir/modules.new/$m.ko" ;;
    *.ko.zst) zstd -qdc "$f" > "$dir/modules.new/$m.ko" ;;
    *) cp "$f" "$dir/modules.new/$m.ko" ;;
  esac
  echo "$m.ko" >> "$dir/modules.new/order"
done
rm -rf "$dir/modules"
mv "$dir/modules.new" "$dir/modules"
cp x/boot/vmlinuz-* "$dir/vmlinuz.new"
mv "$dir/vmlinuz.new" "$dir/vmlinuz"
echo "$pkg" > "$dir/kernel-package"
echo "microvm assets in $dir ($pkg)"
