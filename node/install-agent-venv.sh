#!/usr/bin/env bash
# The GPU agent's venv: NVML's bindings and the metrics exporter's Prometheus client, both pinned
# in versions.env. A step of its own so that the boot can start it first, in the background
# (install-agent-venv& in the steps: see bootstrap.sh), since pip needs nothing the steps before
# the agent make. install-gpu-agent.sh runs it again in the foreground: it waits for the
# background run, then finds the pins in place, or does the work itself.
# shellcheck source-path=SCRIPTDIR source=common.sh
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"
mkdir -p "$GPU_SWARM_STATE"
exec 8>"$GPU_SWARM_STATE/agent-venv.lock"
flock 8  # one run at a time: the foreground one waits for the background one
want="nvidia-ml-py==$NVIDIA_ML_PY_VERSION prometheus-client==$PROMETHEUS_CLIENT_VERSION"
have=$("$GPU_SWARM_VENV/bin/python" -c 'from importlib.metadata import version as v
print("nvidia-ml-py==" + v("nvidia-ml-py"), "prometheus-client==" + v("prometheus-client"))' 2>/dev/null || :)
[ "$have" != "$want" ] || skip "the venv has $want"
# The pip wheel python3-venv ships for ensurepip (Debian's and Ubuntu's python3-pip-whl).
wheels=${GPU_SWARM_PIP_WHEELS:-/usr/share/python-wheels}
pip_wheel() { compgen -G "$wheels/pip-*.whl" | sort -V | tail -n 1; }
# pip runs from that wheel, unpacked: the venv needs no pip of its own, and making one (ensurepip
# installs and byte-compiles pip) took 1.3 of the step's 2.3 CPU seconds. Unpacked, because run from
# the zip (as ensurepip runs it) Python's zipimport compiles each of the ~370 modules pip imports
# twice, once to name its file and once to load it: 2.6 of pip's 3.8 s in a profile (Python 3.11;
# 3.12's and 3.13's zipimport do the same). Unpacked in /run, a tmpfs on every systemd host: its
# 434 files took 0.65 s to unpack and remove on a slow disk, 0.19 s on tmpfs.
wheel=$(pip_wheel || :)
if [ -z "$wheel" ]; then
  # In the background, the steps beside this one use apt: dpkg's lock is waited for, but
  # `apt-get update`'s lock on the package lists is not. So python3-venv is installed only in the
  # foreground (install-gpu-agent.sh's run), and the head start is lost on an image without it.
  [ -z "${GPU_SWARM_STEP_BACKGROUND:-}" ] || skip "no pip wheel in $wheels: install-gpu-agent installs python3-venv"
  retry apt_get update
  apt_install python3-venv
  wheel=$(pip_wheel) || die "python3-venv is installed, but there is no pip wheel in $wheels"
fi
pip_dir=$(mktemp -d "${GPU_SWARM_PIP_UNPACK:-/run}/gpu-swarm-pip.XXXXXX")
trap 'rm -rf "$pip_dir"' EXIT
python3 -m zipfile -e "$wheel" "$pip_dir"
python3 -m venv --without-pip "$GPU_SWARM_VENV"
# shellcheck disable=SC2086 # two requirements, one word each
retry env PYTHONPATH="$pip_dir" "$GPU_SWARM_VENV/bin/python" -m pip install -q --disable-pip-version-check $want
