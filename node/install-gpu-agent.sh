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
# The pip wheel python3-venv ships for ensurepip (Debian's and Ubuntu's python3-pip-whl).
wheels=${GPU_SWARM_PIP_WHEELS:-/usr/share/python-wheels}
pip_wheel() { compgen -G "$wheels/pip-*.whl" | sort -V | tail -n 1; }
if [ "$have" != "$want" ]; then
  # pip runs from that wheel, as ensurepip itself runs it: the venv needs no pip of its own, and
  # making one (ensurepip installs and byte-compiles pip) took 1.3 of the step's 2.3 CPU seconds.
  wheel=$(pip_wheel || :)
  if [ -z "$wheel" ]; then
    retry apt_get update
    apt_install python3-venv
    wheel=$(pip_wheel) || die "python3-venv is installed, but there is no pip wheel in $wheels"
  fi
  python3 -m venv --without-pip "$GPU_SWARM_VENV"
  # shellcheck disable=SC2086 # two requirements, one word each
  retry env PYTHONPATH="$wheel" "$GPU_SWARM_VENV/bin/python" -m pip install -q --disable-pip-version-check $want
fi
install -m 0644 "$here/gpu-swarm-agent.service" "$GPU_SWARM_UNIT_DIR/gpu-swarm-agent.service"
systemctl enable --no-reload gpu-swarm-agent.service
systemctl daemon-reload
systemctl start gpu-swarm-agent.service || {
  journalctl -u gpu-swarm-agent.service -n 30 --no-pager || :
  die "gpu-swarm-agent failed"
}
# A changed GPU configuration (MPS turned on, a new GPU) makes the agent's unit queue a docker
# restart and return (--no-block: see the unit). The steps after this one talk to docker
# (build-check-image first), so the restart must be over before they run, or they meet a docker
# that is going down. With no change, or at first boot before docker runs, no job is queued.
end=$((SECONDS + 180))
while [ -n "$(systemctl list-jobs --no-legend docker.service 2>/dev/null)" ]; do
  [ "$SECONDS" -lt "$end" ] || die "docker's restart for the new GPU configuration is still queued after 180 s (systemctl list-jobs)"
  sleep 0.2
done
# The runtime guard's server (guard_server.py): restarted, so new node software runs at once.
install_service gpu-swarm-guard.service
