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
busybox=$(command -v busybox || :)
if [ -z "$busybox" ] || ! ldd "$busybox" 2>&1 | grep -q 'not a dynamic executable'; then
  retry apt_get update
  apt_install busybox-static
  busybox=/bin/busybox
fi
root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT
mkdir -p "$root/bin" "$root/usr/bin" "$root/dev" "$root/proc" "$root/sys" "$root/tmp" "$root/etc"
cp "$busybox" "$root/bin/busybox"
for applet in sh ls cat echo grep; do ln -s busybox "$root/bin/$applet"; done
# The loader and the libraries nvidia-smi links, at the paths this node has them.
for lib in "$(readlink -f /lib64/ld-linux-x86-64.so.2)" /lib64/ld-linux-x86-64.so.2 \
  /lib/x86_64-linux-gnu/libc.so.6 /lib/x86_64-linux-gnu/libm.so.6 /lib/x86_64-linux-gnu/libdl.so.2 \
  /lib/x86_64-linux-gnu/libpthread.so.0 /lib/x86_64-linux-gnu/librt.so.1; do
  if [ -e "$lib" ]; then
    mkdir -p "$root$(dirname "$lib")"
    cp -L "$lib" "$root$lib"
  fi
done
tar -C "$root" -c . | docker import \
  --change 'ENV PATH=/usr/local/nvidia/bin:/usr/bin:/bin' \
  --change 'ENV NVIDIA_VISIBLE_DEVICES=all' \
  --change 'ENV NVIDIA_DRIVER_CAPABILITIES=utility' \
  - "$image" >/dev/null
log "built $image"
