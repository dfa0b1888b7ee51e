#!/usr/bin/env bash
# The image of the post-join GPU check (swarm/gpu_check.py): busybox, and the C library that
# the nvidia-smi the NVIDIA runtime mounts in needs. Built here from the node's own files and
# named under .invalid, a domain that never resolves, so no registry can stand in for it.
# It asks for every GPU (NVIDIA_VISIBLE_DEVICES=all), as CUDA images do: the check proves
# that a task which reserved none gets none anyway.
# shellcheck source-path=SCRIPTDIR source=common.sh
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"
image=${GPU_SWARM_CHECK_IMAGE:-gpu-swarm.invalid/check:1}
if docker image inspect "$image" >/dev/null 2>&1; then skip "$image is there"; fi
# Static means no program interpreter (PT_INTERP) among its ELF program headers; ldd's wording
# for that differs between glibc releases.
static() {
  python3 -c 'import struct, sys
d = open(sys.argv[1], "rb").read(65536)
off, = struct.unpack_from("<Q", d, 32)
size, count = struct.unpack_from("<HH", d, 54)
sys.exit(d[:4] != b"\x7fELF" or any(struct.unpack_from("<I", d, off + i * size)[0] == 3 for i in range(count)))' "$1"
}
busybox=""
for candidate in "$(command -v busybox || :)" /usr/local/bin/busybox /bin/busybox /usr/bin/busybox; do
  if [ -f "$candidate" ] && static "$candidate"; then
    busybox=$candidate
    break
  fi
done
if [ -z "$busybox" ]; then
  retry apt_get update
  apt_install busybox-static
  busybox=/bin/busybox
fi
root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT
# A merged-/usr layout, as CUDA images have: bin, lib and lib64 point into /usr.
mkdir -p "$root/usr/bin" "$root/usr/lib" "$root/usr/lib64" "$root/dev" "$root/proc" "$root/sys" "$root/tmp" "$root/etc"
for dir in bin lib lib64; do ln -s "usr/$dir" "$root/$dir"; done
cp "$busybox" "$root/usr/bin/busybox"
for applet in sh ls cat echo grep sleep true env; do ln -s busybox "$root/usr/bin/$applet"; done
# The loader and the libraries nvidia-smi links, at the paths this node has them (under /usr).
for lib in "$(readlink -f /lib64/ld-linux-x86-64.so.2)" /lib64/ld-linux-x86-64.so.2 \
  /lib/x86_64-linux-gnu/libc.so.6 /lib/x86_64-linux-gnu/libm.so.6 /lib/x86_64-linux-gnu/libdl.so.2 \
  /lib/x86_64-linux-gnu/libpthread.so.0 /lib/x86_64-linux-gnu/librt.so.1; do
  if [ -e "$lib" ]; then
    dest="$root/usr${lib#/usr}"
    mkdir -p "$(dirname "$dest")"
    cp -L "$lib" "$dest"
  fi
done
tar -C "$root" -c . | docker import \
  --change 'ENV PATH=/usr/local/nvidia/bin:/usr/bin:/bin' \
  --change 'ENV NVIDIA_VISIBLE_DEVICES=all' \
  --change 'ENV NVIDIA_DRIVER_CAPABILITIES=utility' \
  - "$image" >/dev/null
log "built $image"
