#!/usr/bin/env bash
# The GPU agent's venv: NVML's bindings and the metrics exporter's Prometheus client, both pinned
# in versions.env by version, wheel and sha256. A step of its own so that the boot can start it
# first, in the background (install-agent-venv& in the steps: see bootstrap.sh), since it needs
# nothing the steps before the agent make. install-gpu-agent.sh runs it again in the foreground:
# it waits for the background run, then finds the pins in place, or does the work itself.
#
# No pip: both pins are pure-Python wheels (py3-none-any, Root-Is-Purelib, no .data folder), and
# such a wheel is installed by unpacking it into site-packages (PEP 427). pip's own start-up, not
# the two wheels, was the cost: pip took 1.3-2.0 s a run in a rehearsal GPU node, where this whole
# step, compile included, takes 0.7 s of CPU on the project's 2-core VM, and 0.3 s on a GPU
# machine (bench/results/agent-venv-2xH200). It also spares the image python3-venv, which a venv
# without pip does not need.
# shellcheck source-path=SCRIPTDIR source=common.sh
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"
mkdir -p "$GPU_SWARM_STATE"
exec 8>"$GPU_SWARM_STATE/agent-venv.lock"
flock 8  # one run at a time: the foreground one waits for the background one
want="nvidia-ml-py==$NVIDIA_ML_PY_VERSION prometheus-client==$PROMETHEUS_CLIENT_VERSION"
installed() {
  "$GPU_SWARM_VENV/bin/python" -c 'from importlib.metadata import version as v
print("nvidia-ml-py==" + v("nvidia-ml-py"), "prometheus-client==" + v("prometheus-client"))' 2>/dev/null || :
}
[ "$(installed)" != "$want" ] || skip "the venv has $want"
tmp=$(mktemp -d "${GPU_SWARM_WHEEL_TMP:-/run}/gpu-swarm-wheels.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
wheels=()
for pin in "$NVIDIA_ML_PY_WHEEL" "$PROMETHEUS_CLIENT_WHEEL"; do
  url=${pin%%#sha256=*} sha=${pin##*#sha256=}
  name=${url##*/}
  if [ -f "$GPU_SWARM_WHEELHOUSE/$name" ]; then
    # An image that carries the wheel (a baked AMI, the rehearsal's image) vouches for it as it
    # does for its Python: no download, and no sha256 to match.
    log "$name from the image's wheelhouse ($GPU_SWARM_WHEELHOUSE)"
    wheels+=("$GPU_SWARM_WHEELHOUSE/$name")
    continue
  fi
  retry curl -fsSL -o "$tmp/$name" "$url"
  echo "$sha  $tmp/$name" | sha256sum -c --quiet - || die "$url does not have the sha256 pinned in versions.env ($sha)"
  wheels+=("$tmp/$name")
done
# Made anew (--clear): a pin bump leaves no file of the old version behind. The units that run
# from it are restarted by the steps after this one.
python3 -m venv --without-pip --clear "$GPU_SWARM_VENV"
"$GPU_SWARM_VENV/bin/python" - "${wheels[@]}" <<'PY' || die "could not install the agent's wheels into $GPU_SWARM_VENV"
import sys, sysconfig, zipfile
site = sysconfig.get_path("purelib")
for path in sys.argv[1:]:
    with zipfile.ZipFile(path) as wheel:
        names = wheel.namelist()
        info = [n for n in names if n.count("/") == 1 and n.endswith(".dist-info/WHEEL")]
        pure = len(info) == 1 and b"Root-Is-Purelib: true" in wheel.read(info[0])
        if not pure or any(n.split("/")[0].endswith(".data") for n in names):
            sys.exit(f"{path}: not a pure-Python wheel, so unpacking it is no install (PEP 427); "
                     "pin a py3-none-any wheel in versions.env")
        wheel.extractall(site)
# Compiled here, as pip compiles what it installs: else the agent, the watcher and the exporter
# each compile pynvml (270 kB) at their first start, in the boot's foreground.
import compileall
sys.exit(0 if compileall.compile_dir(site, quiet=1) else f"could not compile {site}")
PY
[ "$(installed)" = "$want" ] || die "the venv has '$(installed)' after installing ${wheels[*]}, not $want"
log "the venv has $want"
