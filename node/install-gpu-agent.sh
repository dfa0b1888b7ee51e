#!/usr/bin/env bash
# The GPU agent: a venv with NVML's bindings and the metrics exporter's Prometheus client
# (both pinned in versions.env), its unit installed from the node software, enabled and run now;
# and the runtime guard's server (gpu-swarm-guard.service).
# shellcheck source-path=SCRIPTDIR source=common.sh
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"
here=$(dirname "${BASH_SOURCE[0]}")
want="nvidia-ml-py==$NVIDIA_ML_PY_VERSION prometheus-client==$PROMETHEUS_CLIENT_VERSION"
have=$("$GPU_SWARM_VENV/bin/python" -c 'from importlib.metadata import version as v
print("nvidia-ml-py==" + v("nvidia-ml-py"), "prometheus-client==" + v("prometheus-client"))' 2>/dev/null || :)
if [ "$have" != "$want" ]; then
  if ! python3 -m venv "$GPU_SWARM_VENV"; then
    retry apt_get update
    apt_install python3-venv
    python3 -m venv --clear "$GPU_SWARM_VENV"
  fi
  # shellcheck disable=SC2086 # two requirements, one word each
  retry "$GPU_SWARM_VENV/bin/pip" install -q --disable-pip-version-check $want
fi
install -m 0644 "$here/gpu-swarm-agent.service" "$GPU_SWARM_UNIT_DIR/gpu-swarm-agent.service"
systemctl daemon-reload
systemctl enable gpu-swarm-agent.service
systemctl start gpu-swarm-agent.service || {
  journalctl -u gpu-swarm-agent.service -n 30 --no-pager || :
  die "gpu-swarm-agent failed"
}
# The runtime guard's server (guard_server.py): restarted, so new node software runs at once.
install_service gpu-swarm-guard.service
