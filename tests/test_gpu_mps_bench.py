"""bench/gpu_mps.py, run whole on this machine against a stand-in GPU, so that the one real-GPU run finds no bug of its own.

The real engine, swarm, agent, guard, ledger and node/gpu-swarm-mps run; the GPU is played by
the rehearsal's stand-ins (NVML through localswarm/standins/pynvml.py, nvidia-container-runtime
through its stand-in) plus, written here, an nvidia-smi whose compute mode lives in the hardware
file, an nvidia-cuda-mps-control that daemonizes under its own name, and a cuda-probe that
enforces CUDA_MPS_PINNED_DEVICE_MEM_LIMIT as MPS does. It starts a dockerd on this host and
writes /etc/gpu-swarm/runtime.env (put back after), so it runs under the shared lock:
    flock /tmp/lsw.lock .venv/bin/python -m pytest -m integration tests/test_gpu_mps_bench.py
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.integration
GPU = "GPU-5e551011-0000-4000-8000-000000000001"
SMI = """#!/bin/bash
hw=$GPU_SWARM_REHEARSAL_HARDWARE
mode() { python3 -c 'import json, sys; g = json.load(open(sys.argv[1]))["gpus"][0]
print({0: "Default", 3: "Exclusive_Process"}[g.get("compute_mode", 0)])' "$hw"; }
set_mode() { python3 -c 'import json, sys; d = json.load(open(sys.argv[1])); d["gpus"][0]["compute_mode"] = int(sys.argv[2])
open(sys.argv[1], "w").write(json.dumps(d))' "$hw" "$1"; }
case "$*" in
  -L) echo "GPU 0: Stand-in H100 (UUID: @GPU@)" ;;
  *--query-gpu=uuid*) echo @GPU@ ;;
  *--query-gpu=compute_mode,memory.used*) echo "$(mode), 512 MiB" ;;
  *--query-gpu=compute_mode*) mode ;;
  *--query-gpu=memory.used*) echo 4608 ;;
  *--query-compute-apps*) echo "123, nvidia-cuda-mps-server, 512 MiB" ;;
  *"-c EXCLUSIVE_PROCESS"*) set_mode 3 ;;
  *"-c DEFAULT"*) set_mode 0 ;;
  *) echo "stand-in nvidia-smi: $*" >&2; exit 1 ;;
esac
"""
MPS_CONTROL = """#!/bin/bash
if [ "${1:-}" = -d ]; then
  "$0" --run </dev/null >/dev/null 2>&1 &
  echo $! >"$CUDA_MPS_PIPE_DIRECTORY/nvidia-cuda-mps-control.pid"
  : >"$CUDA_MPS_PIPE_DIRECTORY/control"
  echo "daemon for $CUDA_VISIBLE_DEVICES" >"$CUDA_MPS_LOG_DIRECTORY/control.log"
  exit 0
fi
if [ "${1:-}" = --run ]; then while :; do sleep 0.2; done; fi
read -r command
if [ "$command" = quit ]; then kill "$(cat "$CUDA_MPS_PIPE_DIRECTORY/nvidia-cuda-mps-control.pid")"; fi
"""
CUDA_PROBE = """#!/bin/sh
mib=${1:-1024}
case "$NVIDIA_VISIBLE_DEVICES" in GPU-*) ;; *) echo "cuda-probe: no libcuda.so.1: this container got no GPU" >&2; exit 2 ;; esac
limit=${CUDA_MPS_PINNED_DEVICE_MEM_LIMIT#0=}
limit=${limit%M}
if [ -n "$limit" ] && [ "$mib" -gt "$limit" ]; then
  echo "cuda-probe: cuMemAlloc_v2(&ptr, mib << 20) failed with CUDA error 2" >&2
  exit 3
fi
echo "GPU 0: allocated $mib MiB (UUID: $NVIDIA_VISIBLE_DEVICES)"
exec sleep 100000
"""


def test_the_mps_bench_passes_every_check_on_a_stand_in_gpu(engine, tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("nvidia-smi", SMI.replace("@GPU@", GPU)), ("nvidia-cuda-mps-control", MPS_CONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    (bin_dir / "nvidia-container-runtime").symlink_to(REPO / "localswarm" / "standins" / "nvidia-container-runtime")
    (tmp_path / "cuda-probe").write_text(CUDA_PROBE)
    (tmp_path / "cuda-probe").chmod(0o755)
    hardware = tmp_path / "hardware.json"
    hardware.write_text(json.dumps({"driver": "580.159.04", "cuda": 13000,
                                    "gpus": [{"uuid": GPU, "name": "Stand-in H100", "memory_mib": 81559}]}))
    toolkit = tmp_path / "config.toml"
    toolkit.write_text('swarm-resource = "DOCKER_RESOURCE_NVIDIA-GPU"\n')
    env = {**os.environ, "PATH": os.pathsep.join([str(bin_dir), str(Path(engine.dockerd).parent),
                                                  str(Path(engine.docker).parent), os.environ["PATH"]]),
           "PYTHONPATH": str(REPO / "localswarm" / "standins"), "GPU_SWARM_REHEARSAL_HARDWARE": str(hardware),
           "GPU_SWARM_REHEARSAL_TOOLKIT_CONFIG": str(toolkit), "CUDA_PROBE": str(tmp_path / "cuda-probe")}
    runtime_env = Path("/etc/gpu-swarm/runtime.env")
    before = runtime_env.read_bytes() if runtime_env.exists() else None
    ours = [] if Path("/run/gpu-swarm").exists() else ["/run/gpu-swarm"]  # the ledger's folder, when it made it
    try:
        done = subprocess.run([sys.executable, "bench/gpu_mps.py", "--out", str(tmp_path / "out"), "--start-runs", "2"],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        assert (tmp_path / "out" / "results.json").exists(), done.stdout[-4000:] + done.stderr[-2000:]
        results = json.loads((tmp_path / "out" / "results.json").read_text())
        # The start-time figures are for a real GPU machine: here they time a stand-in runtime
        # on a busy 2-core machine, so only that they were measured counts.
        timed = [r for r in results if r["check"].startswith("guard's cost per container start")]
        assert len(timed) == 2 and len(results) >= 19, done.stdout[-4000:]
        assert all(r["ok"] for r in results if r not in timed), done.stdout[-4000:]
        assert (runtime_env.read_bytes() if runtime_env.exists() else None) == before  # put back
        assert json.loads(hardware.read_text())["gpus"][0]["compute_mode"] == 0  # Default again
    finally:
        for leftover in ("/var/lib/gpu-swarm-mps", "/run/gpu-swarm-mps-bench", "/run/gpu-swarm/mps", *ours):
            shutil.rmtree(leftover, ignore_errors=True)
