#!/usr/bin/env bash
# The GPU agent (files from write_files): a venv with NVML's bindings, its unit enabled
# and run now.
# shellcheck source-path=SCRIPTDIR source=common.sh
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"
if ! "$GPU_SWARM_VENV/bin/python" -c 'import pynvml' 2>/dev/null; then
  if ! python3 -m venv "$GPU_SWARM_VENV"; then
    retry apt_get update
    apt_install python3-venv
    python3 -m venv --clear "$GPU_SWARM_VENV"
  fi
  retry "$GPU_SWARM_VENV/bin/pip" install -q --disable-pip-version-check nvidia-ml-py
fi
systemctl daemon-reload
systemctl enable gpu-swarm-agent.service
systemctl start gpu-swarm-agent.service || {
  journalctl -u gpu-swarm-agent.service -n 30 --no-pager || :
  die "gpu-swarm-agent failed"
}
