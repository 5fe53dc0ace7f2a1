#!/usr/bin/env bash
# Fetches the microVM backend's guest kernel into a cache directory:
# Debian's cloud kernel (linux-image-cloud-amd64) and the few modules the
# guest loads early (virtio PCI, virtio-serial, virtio-blk, overlayfs, and
# fuse + virtiofs for volumes; Debian builds them as modules). The initramfs (the agent, its libraries and these
# modules) is built by runcell itself at first use, and template images per
# template. Idempotent; needs root (apt-get download, dpkg-deb).
#
#   scripts/microvm-assets.sh [DIR]    (default /var/cache/runcell/microvm)
#
# Result: DIR/vmlinuz, DIR/modules/*.ko and DIR/modules/order (load order).
set -euo pipefail

dir=${1:-/var/cache/runcell/microvm}
# In load order: each needs only those above it.
order=(virtio virtio_ring virtio_pci_legacy_dev virtio_pci_modern_dev virtio_pci virtio_console virtio_blk overlay fuse virtiofs)
# A cache made before a module joined the list is completed, not trusted.
complete=1
[ -s "$dir/vmlinuz" ] && [ -s "$dir/modules/order" ] || complete=0
for m in "${order[@]}"; do
  if [ "$complete" = 1 ] && ! { [ -s "$dir/modules/$m.ko" ] && grep -qx "$m.ko" "$dir/modules/order"; }; then
    echo "microvm-assets: $dir lacks the module $m; fetching the kernel's modules again" >&2
    complete=0
  fi
done
[ "$complete" = 1 ] && exit 0
mkdir -p "$dir"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
chmod 755 "$tmp"
cd "$tmp"
# The kernel the cache already has (its modules must match it), else the
# one the metapackage names.
pkg=""
if [ -s "$dir/vmlinuz" ] && [ -s "$dir/kernel-package" ]; then
  pkg=$(cat "$dir/kernel-package")
fi
[ -n "$pkg" ] || pkg=$(apt-cache depends linux-image-cloud-amd64 | awk '/Depends: linux-image-[0-9]/ {print $2; exit}')
if [ -z "$pkg" ]; then
  apt-get update -qq
  pkg=$(apt-cache depends linux-image-cloud-amd64 | awk '/Depends: linux-image-[0-9]/ {print $2; exit}')
fi
[ -n "$pkg" ] || { echo "microvm-assets: no linux-image-cloud-amd64 in the apt sources" >&2; exit 1; }
apt-get download -qq "$pkg" 2>/dev/null || apt-get download "$pkg"
dpkg-deb -x ./"$pkg"_*.deb x
rm -rf "$dir/modules.new"
mkdir -p "$dir/modules.new"
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
# Swapped, not removed first: a build reading the old list meanwhile finds it.
rm -rf "$dir/modules.old"
[ -d "$dir/modules" ] && mv "$dir/modules" "$dir/modules.old"
mv "$dir/modules.new" "$dir/modules"
rm -rf "$dir/modules.old"
cp x/boot/vmlinuz-* "$dir/vmlinuz.new"
mv "$dir/vmlinuz.new" "$dir/vmlinuz"
echo "$pkg" > "$dir/kernel-package"
echo "microvm assets in $dir ($pkg)"
