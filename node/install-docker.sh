#!/usr/bin/env bash
# Docker Engine DOCKER_VERSION with containerd CONTAINERD_VERSION, exactly, from download.docker.com: what
# the rehearsal and the GPU benches ran (node/versions.env). An image's own engine of another release (the
# Deep Learning AMI ships Docker 29 with containerd 2.4) is replaced by the pinned one, so that every node of
# every pool, replaced over months, runs one engine. The packages are held: unattended-upgrades never moves
# them, and a roll of new node software with new pins is what does.
# shellcheck source-path=SCRIPTDIR source=common.sh
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"
found=$(docker_version) containerd_found=$(containerd_version)
if [ "$found" = "$DOCKER_VERSION" ] && same_minor "$containerd_found" "$CONTAINERD_VERSION"; then
  # Installed is not enough: the later steps need it running, also on a node whose engine a
  # failed earlier install left stopped (systemd's start limit) or that an operator stopped.
  if ! systemctl is-active -q docker; then
    log "Docker $found is installed but not running: starting it"
    systemctl reset-failed docker 2>/dev/null || :
    systemctl enable --now docker
  fi
  skip "Docker $found with containerd $containerd_found"
fi
log "installing Docker $DOCKER_VERSION with containerd $CONTAINERD_VERSION" \
  "(found Docker ${found:-none}, containerd ${containerd_found:-none})"
distro=$(os_release ID)
retry apt_get update
if ! has_apt_source download.docker.com; then
  apt_install ca-certificates curl
  fetch_key "https://download.docker.com/linux/$distro/gpg" "$GPU_SWARM_APT_DIR/keyrings/docker.asc"
  echo "deb [arch=$(dpkg --print-architecture) signed-by=$GPU_SWARM_APT_DIR/keyrings/docker.asc]" \
    "https://download.docker.com/linux/$distro $(os_release VERSION_CODENAME) stable" >"$GPU_SWARM_APT_DIR/sources.list.d/docker.list"
  retry apt_get update
fi
engine=$(pinned_package docker-ce "$DOCKER_VERSION")
cli=$(pinned_package docker-ce-cli "$DOCKER_VERSION")
runtime=$(pinned_package containerd.io "$CONTAINERD_VERSION")
if [ -z "$engine" ] || [ -z "$cli" ] || [ -z "$runtime" ]; then
  die "Docker's repository for $distro $(os_release VERSION_CODENAME) has no docker-ce $DOCKER_VERSION" \
    "(${engine:-missing}), docker-ce-cli (${cli:-missing}) or containerd.io $CONTAINERD_VERSION (${runtime:-missing});" \
    "use an image of a release that Docker publishes them for, or pin versions it has in node/versions.env"
fi
pkgs=("docker-ce=$engine" "docker-ce-cli=$cli" "containerd.io=$runtime")
# Docker's own packages of the image's release go with it, at the pinned release, or apt refuses the mix.
if dpkg -s docker-ce-rootless-extras >/dev/null 2>&1; then
  pkgs+=("docker-ce-rootless-extras=$(pinned_package docker-ce-rootless-extras "$DOCKER_VERSION")")
fi
old=() # the distro's engine conflicts with Docker's packages
for pkg in docker.io docker-compose docker-compose-v2 podman-docker containerd runc; do
  if dpkg -s "$pkg" >/dev/null 2>&1; then old+=("$pkg"); fi
done
if ((${#old[@]})); then apt_get remove "${old[@]}"; fi
apt_install --allow-downgrades --allow-change-held-packages "${pkgs[@]}"
apt-mark hold docker-ce docker-ce-cli containerd.io >/dev/null
found=$(docker_version) containerd_found=$(containerd_version)
if [ "$found" != "$DOCKER_VERSION" ] || ! same_minor "$containerd_found" "$CONTAINERD_VERSION"; then
  die "after the install, Docker is ${found:-missing} and containerd ${containerd_found:-missing};" \
    "node/versions.env pins Docker $DOCKER_VERSION and containerd $CONTAINERD_VERSION"
fi
systemctl enable --now docker
# A running engine of the release it replaced keeps running until restarted.
systemctl restart docker
