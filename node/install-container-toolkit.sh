#!/usr/bin/env bash
# nvidia-container-toolkit TOOLKIT_VERSION, exactly (node/versions.env: what the GPU benches ran),
# registered with Docker as the "nvidia" runtime. The default runtime is the guard in front of it, which
# the GPU agent sets (swarm services cannot pick a runtime). An image's toolkit of another version is
# replaced by the pinned one; 1.18.0-1.18.2 ignored swarm-resource (toolkit#1599).
# shellcheck source-path=SCRIPTDIR source=common.sh
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"
found=$(toolkit_version)
registered() { grep -qsE '"nvidia": *\{' "$DOCKER_DAEMON_JSON"; }
if [ "$found" = "$TOOLKIT_VERSION" ]; then
  if registered; then
    hold_nvidia_packages
    skip "toolkit $found, registered with Docker"
  fi
else
  log "installing nvidia-container-toolkit $TOOLKIT_VERSION (found ${found:-none})"
  repo=nvidia.github.io/libnvidia-container
  if ! has_apt_source $repo; then
    key=$GPU_SWARM_APT_DIR/keyrings/nvidia-container-toolkit.asc
    fetch_key "https://$repo/gpgkey" "$key"
    list=$(retry curl -fsSL "https://$repo/stable/deb/nvidia-container-toolkit.list")
    echo "${list//'deb https://'/"deb [signed-by=$key] https://"}" >"$GPU_SWARM_APT_DIR/sources.list.d/nvidia-container-toolkit.list"
  fi
  retry apt_get update
  pkgs=()
  for pkg in nvidia-container-toolkit nvidia-container-toolkit-base libnvidia-container-tools libnvidia-container1; do
    version=$(pinned_package "$pkg" "$TOOLKIT_VERSION")
    [ -n "$version" ] || die "NVIDIA's repository has no $pkg $TOOLKIT_VERSION; pin a version it has in node/versions.env"
    pkgs+=("$pkg=$version")
  done
  apt_install --allow-downgrades --allow-change-held-packages "${pkgs[@]}"
  found=$(toolkit_version)
  [ "$found" = "$TOOLKIT_VERSION" ] ||
    die "after the install, nvidia-ctk says ${found:-nothing}; node/versions.env pins $TOOLKIT_VERSION"
fi
hold_nvidia_packages
nvidia-ctk runtime configure --runtime=docker
registered || die "nvidia-ctk did not register the nvidia runtime in $DOCKER_DAEMON_JSON"
