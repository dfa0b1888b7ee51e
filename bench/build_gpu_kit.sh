#!/usr/bin/env bash
# Builds .kit/: what a GPU test machine with a driver but no Docker, no toolkit and no internet
# needs to run the real chain (agent -> daemon.json -> dockerd -> swarm -> guard -> nvidia
# runtime -> task). bench/gpu_session.sh installs it there. Nothing on this machine changes:
# Debian's packages come through a private apt state, and the work lands in .kit-build/.
#
#   bash bench/build_gpu_kit.sh            # idempotent: a second run only checks and says so
#   bash bench/build_gpu_kit.sh --smoke    # seconds, nothing fetched: the pins; cuda-probe and mps-peer built and run
#
# The kit (about 50 MB, one xz archive, so it fits the device's 64 MiB carry with the tree):
# - the engine every node runs (node/versions.env DOCKER_VERSION, CONTAINERD_VERSION's minor):
#   Debian forky's docker.io 28.5.2, containerd 2.1.9, runc 1.3.6 and tini (as docker-init);
#   forky's runc needs glibc >= 2.38, which the GPU machines have;
# - nvidia-container-toolkit TOOLKIT_VERSION, built from its Go module with this machine's Go
#   (bench/gpu_kit/go.mod and go.sum pin it; the Go module proxy serves it): nvidia-container-runtime,
#   nvidia-ctk, nvidia-cdi-hook, nvidia-container-runtime-hook;
# - busybox-static, for the stand-in CUDA image (and to unpack the kit where xz is missing);
# - bench/cuda_probe.c built here: it reaches the driver through dlopen("libcuda.so.1") only,
#   so no CUDA header or toolkit is needed, and the runtime mounts libcuda into the task;
# - bench/mps_peer.c built here, static: the MPS bench's tasks speak the MPS control wire with it;
# - wheels for the node software: nvidia-ml-py (versions.env's pin), PyYAML, prometheus_client.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(dirname "$here")
# shellcheck source=../node/versions.env
. "$repo/node/versions.env"
# shellcheck source=../scripts/steps.sh
. "$repo/scripts/steps.sh"
STEP_PREFIX=kit STEP_COUNT=8

KIT=${KIT_DIR:-$repo/.kit}
BUILD=${KIT_BUILD_DIR:-$repo/.kit-build}
SUITE=forky
TOOLKIT_TAG=v$TOOLKIT_VERSION
TOOLKIT_MODULE=github.com/NVIDIA/nvidia-container-toolkit
PYYAML_VERSION=6.0.3  # requirements.txt allows PyYAML 6.x
: "${NVIDIA_ML_PY_VERSION:?node/versions.env must pin it}" "${PROMETHEUS_CLIENT_VERSION:?node/versions.env must pin it}"
# CPython versions the wheels are for: Ubuntu 22.04 has 3.10, 24.04 3.12 (the GPU machines).
# PyYAML falls back to pure Python when its C part does not match, so any of them works.
PYTHONS=(3.10 3.11 3.12)
DEBS=(docker.io docker-cli containerd runc tini-static busybox-static
  libc6 libseccomp2) # the last two only let this machine (glibc 2.36) run forky's runc --version
TOOLKIT_CMDS=(nvidia-container-runtime nvidia-ctk nvidia-cdi-hook nvidia-container-runtime-hook)
# kit name <- path under the unpacked packages
ENGINE_BINS=(dockerd:usr/sbin/dockerd docker:usr/bin/docker containerd:usr/bin/containerd
  containerd-shim-runc-v2:usr/bin/containerd-shim-runc-v2 runc:usr/sbin/runc
  docker-proxy:usr/sbin/docker-proxy docker-init:usr/bin/tini-static busybox:usr/bin/busybox)

if [ "${1:-}" = --smoke ]; then
  # What needs no download: the pins above resolved, and the kit's own program builds as the kit
  # builds it and, on a machine without the driver, says it got no GPU (exit 2), as in a task.
  smoke=$(mktemp -d)
  trap 'rm -rf "$smoke"' EXIT
  cc -O2 -Wall -Werror -o "$smoke/cuda-probe" "$here/cuda_probe.c" -ldl
  cc -O2 -Wall -Werror -static -o "$smoke/mps-peer" "$here/mps_peer.c"
  rc=0
  said=$("$smoke/cuda-probe" 16 2>&1) || rc=$?
  peer=$("$smoke/mps-peer" hold "$smoke/no-socket" 1 0) && exit 1 # no socket there: it must say so, exit 2
  echo "kit smoke: pins nvidia-ml-py $NVIDIA_ML_PY_VERSION, prometheus_client $PROMETHEUS_CLIENT_VERSION," \
    "PyYAML $PYYAML_VERSION, toolkit $TOOLKIT_TAG; cuda-probe built, ran: exit $rc: $said; mps-peer built: $peer"
  if command -v nvidia-smi >/dev/null; then exit "$rc"; fi
  [[ $rc == 2 && $said == *"no libcuda.so.1"* ]]
  exit
fi

mkdir -p "$BUILD"/{apt/lists/partial,apt/cache/archives/partial,debs,stage/bin,stage/wheels} "$KIT"
apt_opts=(-o "Dir::Etc::SourceList=$BUILD/apt/sources.list" -o Dir::Etc::SourceParts=/dev/null
  -o "Dir::State::Lists=$BUILD/apt/lists" -o "Dir::Cache=$BUILD/apt/cache" -o APT::Sandbox::User=root
  -o Dir::Etc::Preferences=/dev/null -o Dir::Etc::PreferencesParts=/dev/null)
# A mirror may hold forky's signed index past its week (localswarm/node_image.py says more).
apt_opts+=(-o Acquire::Check-Valid-Until=false)
printf 'deb http://deb.debian.org/debian %s main\n' "$SUITE" >"$BUILD/apt/sources.list"

step_begin "Debian $SUITE packages: ${DEBS[*]}"
have_all=1
for pkg in "${DEBS[@]}"; do compgen -G "$BUILD/debs/${pkg}_*.deb" >/dev/null || have_all=0; done
if [ "$have_all" = 1 ]; then
  step_skipped "all ${#DEBS[@]} .debs are in $BUILD/debs"
else
  quietly apt-get "${apt_opts[@]}" update
  rm -f "$BUILD"/debs/*.deb
  (cd "$BUILD/debs" && quietly --show '^Get:' apt-get "${apt_opts[@]}" download "${DEBS[@]}")
  say "  downloaded $(mb "$(cat "$BUILD"/debs/*.deb | wc -c)")"
  step_done
fi

step_begin "unpack them"
stamp=$(find "$BUILD/debs" -name '*.deb' -printf '%f\n' | sort | sha256sum | cut -c1-16)
if [ -f "$BUILD/root/.stamp-$stamp" ]; then
  step_skipped "$BUILD/root is from these .debs"
else
  rm -rf "$BUILD/root"
  for deb in "$BUILD"/debs/*.deb; do dpkg-deb -x "$deb" "$BUILD/root"; done
  touch "$BUILD/root/.stamp-$stamp"
  step_done
fi
for entry in "${ENGINE_BINS[@]}"; do
  install -m 0755 "$BUILD/root/${entry#*:}" "$BUILD/stage/bin/${entry%%:*}"
done

step_begin "nvidia-container-toolkit $TOOLKIT_TAG from its Go module"
mod=$here/gpu_kit
grep -q "^require $TOOLKIT_MODULE $TOOLKIT_TAG\$" "$mod/go.mod" || {
  say "bench/gpu_kit/go.mod does not require $TOOLKIT_MODULE $TOOLKIT_TAG (node/versions.env TOOLKIT_VERSION):" \
    "run (cd bench/gpu_kit && go get $TOOLKIT_MODULE@$TOOLKIT_TAG && go mod tidy)" >&2
  exit 1
}
built=1
for cmd in "${TOOLKIT_CMDS[@]}"; do
  [[ $("$BUILD/toolkit-out/$cmd" --version 2>/dev/null) == *"version $TOOLKIT_VERSION"* ]] || built=0
done
if [ "$built" = 1 ] && [ "$BUILD/toolkit-out/nvidia-ctk" -nt "$mod/go.sum" ]; then
  step_skipped "$BUILD/toolkit-out holds $TOOLKIT_TAG"
else
  mkdir -p "$BUILD/toolkit-out"
  # As the toolkit's Makefile builds them: the NVML symbols resolve at run time (-z lazy).
  ldflags="-s -w '-extldflags=-Wl,--export-dynamic -Wl,--unresolved-symbols=ignore-in-object-files -Wl,-z,lazy'"
  ldflags+=" -X $TOOLKIT_MODULE/internal/info.version=$TOOLKIT_VERSION"
  for cmd in "${TOOLKIT_CMDS[@]}"; do
    # -mod=readonly: go.sum holds every module's hash; nothing is resolved anew.
    (cd "$mod" && quietly env CGO_ENABLED=1 GOFLAGS="-mod=readonly -buildvcs=false" go build -trimpath \
      -ldflags "$ldflags" -o "$BUILD/toolkit-out/$cmd" "$TOOLKIT_MODULE/cmd/$cmd")
  done
  step_done
fi
for cmd in "${TOOLKIT_CMDS[@]}"; do install -m 0755 "$BUILD/toolkit-out/$cmd" "$BUILD/stage/bin/$cmd"; done

step_begin "cuda-probe (bench/cuda_probe.c, driver API through dlopen)"
if [ "$BUILD/stage/bin/cuda-probe" -nt "$here/cuda_probe.c" ]; then
  step_skipped "built from this cuda_probe.c"
else
  quietly cc -O2 -Wall -Werror -o "$BUILD/stage/bin/cuda-probe" "$here/cuda_probe.c" -ldl
  step_done
fi

step_begin "mps-peer (bench/mps_peer.c, static)"
if [ "$BUILD/stage/bin/mps-peer" -nt "$here/mps_peer.c" ]; then
  step_skipped "built from this mps_peer.c"
else
  quietly cc -O2 -Wall -Werror -static -o "$BUILD/stage/bin/mps-peer" "$here/mps_peer.c"
  step_done
fi

step_begin "wheels: nvidia-ml-py $NVIDIA_ML_PY_VERSION, PyYAML $PYYAML_VERSION, prometheus_client $PROMETHEUS_CLIENT_VERSION"
pip=("$repo/.venv/bin/python" -m pip)
[ -x "$repo/.venv/bin/python" ] || pip=(python3 -m pip)
wanted=("nvidia_ml_py-$NVIDIA_ML_PY_VERSION-" "prometheus_client-$PROMETHEUS_CLIENT_VERSION-")
for py in "${PYTHONS[@]}"; do wanted+=("pyyaml-$PYYAML_VERSION-cp${py/./}-"); done
missing=0
for prefix in "${wanted[@]}"; do compgen -G "$BUILD/stage/wheels/$prefix*.whl" >/dev/null || missing=1; done
if [ "$missing" = 0 ]; then
  step_skipped "all ${#wanted[@]} wheels are there"
else
  rm -f "$BUILD"/stage/wheels/*.whl
  # The machine's pip settings (extra indexes, constraints) are not the kit's business.
  get=(env PIP_CONFIG_FILE=/dev/null "${pip[@]}" download -q --no-deps --only-binary=:all: -d "$BUILD/stage/wheels")
  quietly "${get[@]}" "nvidia-ml-py==$NVIDIA_ML_PY_VERSION" "prometheus_client==$PROMETHEUS_CLIENT_VERSION"
  for py in "${PYTHONS[@]}"; do
    quietly "${get[@]}" --python-version "$py" --implementation cp --abi "cp${py/./}" \
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 "PyYAML==$PYYAML_VERSION"
  done
  say "  $(find "$BUILD/stage/wheels" -name '*.whl' -printf '%f\n' | sort | tr '\n' ' ')"
  step_done
fi

step_begin "every binary runs here (--version)"
forky_ld() {  # runc needs glibc 2.38: run it with forky's C library, which this machine may lack
  "$BUILD/root/usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2" --library-path \
    "$BUILD/root/usr/lib/x86_64-linux-gnu" "$@"
}
{
  echo "# gpu-swarm GPU kit, built $(date -u +%FT%TZ) by bench/build_gpu_kit.sh"
  echo "# nvidia-container-toolkit $TOOLKIT_TAG, from the Go module proxy (bench/gpu_kit/go.sum)"
  for bin in "$BUILD"/stage/bin/*; do
    name=${bin##*/}
    case $name in
      containerd-shim-runc-v2) out=$("$bin" -v) ;;
      busybox) out=$("$bin" --help 2>&1 | head -n1) ;;
      cuda-probe) out="bench/cuda_probe.c sha256 $(sha256sum <"$here/cuda_probe.c" | cut -c1-16)" ;;
      mps-peer) out="bench/mps_peer.c sha256 $(sha256sum <"$here/mps_peer.c" | cut -c1-16)" ;;
      runc) out=$("$bin" --version 2>/dev/null || forky_ld "$bin" --version) ;;
      # It goes on to print the runc it finds on PATH, which is this machine's, not the kit's.
      nvidia-container-runtime) out=$("$bin" --version | sed '/^runc version/,$d') ;;
      *) out=$("$bin" --version) ;;
    esac
    printf '%-30s %s\n' "$name" "$(printf '%s' "$out" | grep -v '^$' | paste -sd'|' | sed 's/|/ | /g')"
  done
  for whl in "$BUILD"/stage/wheels/*.whl; do printf '%-30s %s\n' wheel "${whl##*/}"; done
} >"$BUILD/stage/VERSIONS"
sed 's/^/  /' "$BUILD/stage/VERSIONS"
step_done

step_begin "pack $KIT/kit.tar.xz"
# The stamp names every input, so an unchanged kit is not compressed again (xz takes minutes).
inputs=$(cd "$BUILD/stage" && find . -type f ! -name VERSIONS ! -name busybox -print0 | sort -z | xargs -0 sha256sum | sha256sum)
inputs=${inputs%% *}
if [ -f "$KIT/kit.tar.xz" ] && [ "$(cat "$KIT/kit.inputs" 2>/dev/null)" = "$inputs" ]; then
  step_skipped "$KIT/kit.tar.xz holds these files"
else
  rm -f "$KIT"/kit.tar.xz "$KIT"/kit.inputs
  # busybox travels beside the archive (below), not in it.
  tar -C "$BUILD/stage" --owner=0 --group=0 --exclude=bin/busybox -cf - bin wheels VERSIONS |
    xz -9 -T0 >"$KIT/kit.tar.xz.tmp"
  mv "$KIT/kit.tar.xz.tmp" "$KIT/kit.tar.xz"
  echo "$inputs" >"$KIT/kit.inputs"
  step_done
fi
# Beside the archive: busybox (its unxz unpacks the kit where xz is missing), what it holds,
# and its checksum, which gpu_session.sh checks before it unpacks anything.
install -m 0755 "$BUILD/stage/bin/busybox" "$KIT/busybox"
cp "$BUILD/stage/VERSIONS" "$KIT/VERSIONS"
(cd "$KIT" && sha256sum kit.tar.xz busybox >SHA256SUMS)
unpacked=$(du -cb "$BUILD"/stage/bin/* "$BUILD"/stage/wheels/* | tail -n1 | cut -f1)
say "$KIT ($(mb "$(cat "$KIT"/* | wc -c)") in all; kit.tar.xz $(mb "$(stat -c %s "$KIT/kit.tar.xz")"), $(mb "$unpacked") unpacked)"
say "carry it to the GPU machine: run(carry=[\".kit\"], command=\"bash bench/gpu_session.sh ...\")"
