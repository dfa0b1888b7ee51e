#!/usr/bin/env bash
# Docker Engine >= DOCKER_MIN_VERSION from download.docker.com (older engines reject
# generic-resource tasks on overlay networks, moby#44378).
# shellcheck source-path=SCRIPTDIR source=common.sh
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"
found=$(docker_version)
if [ -n "$found" ] && version_ge "$found" "$DOCKER_MIN_VERSION"; then
  # Installed is not enough: the later steps need it running, also on a node whose engine a
  # failed earlier install left stopped (systemd's start limit) or that an operator stopped.
  if ! systemctl is-active -q docker; then
    log "Docker $found is installed but not running: starting it"
    systemctl reset-failed docker 2>/dev/null || :
    systemctl enable --now docker
  fi
  skip "Docker $found"
fi
log "installing Docker (found ${found:-none}, need >= $DOCKER_MIN_VERSION)"
distro=$(os_release ID)
retry apt_get update
if ! has_apt_source download.docker.com; then
  apt_install ca-certificates curl
  fetch_key "https://download.docker.com/linux/$distro/gpg" /etc/apt/keyrings/docker.asc
  echo "deb [arch=$(dpkg --print-architecture) signed-by=/etc/apt/keyrings/docker.asc]" \
    "https://download.docker.com/linux/$distro $(os_release VERSION_CODENAME) stable" >/etc/apt/sources.list.d/docker.list
  retry apt_get update
fi
old=() # the distro's engine conflicts with Docker's packages
for pkg in docker.io docker-compose docker-compose-v2 podman-docker containerd runc; do
  if dpkg -s "$pkg" >/dev/null 2>&1; then old+=("$pkg"); fi
done
if ((${#old[@]})); then apt_get remove "${old[@]}"; fi
apt_install docker-ce docker-ce-cli containerd.io
found=$(docker_version)
version_ge "$found" "$DOCKER_MIN_VERSION" || die "Docker $found < DOCKER_MIN_VERSION=$DOCKER_MIN_VERSION"
systemctl enable --now docker
