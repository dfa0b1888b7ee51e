#!/usr/bin/env bash
# nvidia-container-toolkit >= TOOLKIT_MIN_VERSION, registered with Docker as the "nvidia"
# runtime. The default runtime is the guard in front of it, which the GPU agent sets
# (swarm services cannot pick a runtime). 1.18.0-1.18.2 ignore swarm-resource: upgrade them.
# shellcheck source-path=SCRIPTDIR source=common.sh
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"
found=$(toolkit_version)
registered() { grep -qsE '"nvidia": *\{' "$DOCKER_DAEMON_JSON"; }
if [ -n "$found" ] && version_ge "$found" "$TOOLKIT_MIN_VERSION"; then
  if registered; then
    hold_nvidia_packages
    skip "toolkit $found, registered with Docker"
  fi
else
  log "installing nvidia-container-toolkit (found ${found:-none}, need >= $TOOLKIT_MIN_VERSION)"
  repo=nvidia.github.io/libnvidia-container
  if ! has_apt_source $repo; then
    key=/etc/apt/keyrings/nvidia-container-toolkit.asc
    fetch_key "https://$repo/gpgkey" $key
    list=$(retry curl -fsSL "https://$repo/stable/deb/nvidia-container-toolkit.list")
    echo "${list//'deb https://'/"deb [signed-by=$key] https://"}" >/etc/apt/sources.list.d/nvidia-container-toolkit.list
  fi
  retry apt_get update
  apt_install --allow-change-held-packages nvidia-container-toolkit nvidia-container-toolkit-base \
    libnvidia-container-tools libnvidia-container1
  found=$(toolkit_version)
  version_ge "${found:-0}" "$TOOLKIT_MIN_VERSION" ||
    log "WARNING !!! nvidia-container-toolkit ${found:-?} < $TOOLKIT_MIN_VERSION: on 1.18.0-1.18.2 tasks see every GPU unless the runtime is in legacy mode (the agent sets it) !!!"
fi
hold_nvidia_packages
nvidia-ctk runtime configure --runtime=docker
registered || die "nvidia-ctk did not register the nvidia runtime in $DOCKER_DAEMON_JSON"
