#!/usr/bin/env bash
# Installs the Docker Engine that node/versions.env pins (DOCKER_VERSION, with containerd of
# CONTAINERD_VERSION's minor) for the local rehearsal and the tests, without touching the system's
# docker packages: the release every node runs.
#
# Debian forky's docker.io 28.5.2 and containerd 2.1.9 run on bookworm (they need glibc 2.34;
# forky's runc needs 2.38, so bookworm's runc stays), so we fetch those signed packages through
# apt and unpack them under PREFIX.
#
# With --check it installs nothing: it names the pinned dockerd and exits 0, or exits 1.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=../node/versions.env
. "$here/../node/versions.env"
# shellcheck source=../scripts/steps.sh
. "$here/../scripts/steps.sh"
STEP_PREFIX=engine STEP_COUNT=3
PREFIX=${GPU_SWARM_ENGINE_PREFIX:-/opt/gpu-swarm/docker}
SUITE=${GPU_SWARM_ENGINE_SUITE:-forky}

version_ok() {  # version_ok BINARY: true when BINARY is the pinned release (28.5.2, or Debian's 28.5.2+dfsg4)
  local v
  v=$("$1" --version 2>/dev/null | sed -n 's/.*version \([0-9][0-9.]*\).*/\1/p' | head -n1)
  [ "$v" = "$DOCKER_VERSION" ]
}

for candidate in "$PREFIX/usr/sbin/dockerd" "$(command -v dockerd || true)"; do
  if [ -n "$candidate" ] && [ -x "$candidate" ] && version_ok "$candidate"; then
    if [ "${1:-}" = --check ]; then
      echo "$candidate is $("$candidate" --version)"
    else
      say "$candidate ($("$candidate" --version)) is the pinned release"
    fi
    exit 0
  fi
done
if [ "${1:-}" = --check ]; then exit 1; fi

say "no dockerd $DOCKER_VERSION found; fetching Debian $SUITE's docker.io into $PREFIX"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cannot_fetch() {
  echo "engine: could not fetch Debian $SUITE's docker.io through apt (see above)." >&2
  echo "engine: install Docker Engine $DOCKER_VERSION yourself (for example docker-ce from" >&2
  echo "engine: Docker's apt repository) so that \`dockerd\` is on PATH, then run this again." >&2
  exit 1
}
mkdir -p "$work/lists/partial" "$work/cache/archives/partial"
echo "deb http://deb.debian.org/debian $SUITE main" >"$work/sources.list"
apt_opts=(-o "Dir::Etc::SourceList=$work/sources.list" -o "Dir::Etc::SourceParts=/dev/null"
  -o "Dir::State::Lists=$work/lists" -o "Dir::Cache=$work/cache" -o "APT::Sandbox::User=root"
  -o "Acquire::Check-Valid-Until=false") # a mirror may hold forky's signed index past its week (node_image.py)
step_begin "package index of Debian $SUITE"
quietly apt-get "${apt_opts[@]}" update || cannot_fetch
step_done
step_begin "download docker.io docker-cli containerd"
(cd "$work" && quietly apt-get "${apt_opts[@]}" download docker.io docker-cli containerd) || cannot_fetch
debs=("$work"/*.deb)
say "  fetched ${#debs[@]} packages, $(mb "$(cat "${debs[@]}" | wc -c)"): ${debs[*]##*/}"
step_done
step_begin "unpack into $PREFIX"
rm -rf "$PREFIX.new"
mkdir -p "$PREFIX.new"
for deb in "${debs[@]}"; do dpkg-deb -x "$deb" "$PREFIX.new"; done
# docker-init is a relative link to tini-static, which comes from bookworm's tini package.
ln -sf /usr/bin/tini-static "$PREFIX.new/usr/bin/docker-init"
rm -rf "$PREFIX"
mv "$PREFIX.new" "$PREFIX"
version_ok "$PREFIX/usr/sbin/dockerd" || {
  echo "engine: Debian $SUITE's dockerd is $("$PREFIX/usr/sbin/dockerd" --version); node/versions.env pins" \
    "$DOCKER_VERSION: move the pin (and run the benches again), or set GPU_SWARM_ENGINE_SUITE to a suite" \
    "that has it" >&2
  exit 1
}
say "  $(du -sh "$PREFIX" | cut -f1) in $PREFIX"
step_done
say "installed $("$PREFIX/usr/sbin/dockerd" --version)"
