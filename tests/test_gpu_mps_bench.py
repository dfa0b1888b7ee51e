"""bench/gpu_mps.py, run whole on this machine against a stand-in GPU, so that the one real-GPU run finds no bug of its own.

The real engine, swarm, agent, guard, ledger, node/gpu-swarm-mps and exporter run; the GPU is
played by bench/gpu_standins.py: NVML and nvidia-container-runtime from the rehearsal's stand-ins,
an nvidia-smi whose compute modes live in the hardware file, an nvidia-cuda-mps-control that keeps
the ceiling it is told, and a cuda-probe that allocates within the lower of that ceiling and its
own CUDA_MPS_PINNED_DEVICE_MEM_LIMIT, as MPS does (FACTS), and gets no context when it leaves MPS
on an Exclusive_Process GPU. It starts a dockerd on this host and writes /etc/gpu-swarm/runtime.env
(put back after), so it runs under the shared lock:
    flock /tmp/gpu-swarm-rehearsal.lock .venv/bin/python -m pytest -m integration tests/test_gpu_mps_bench.py
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.integration
WAYS_OUT = ("asks for more than its share", "raises its limit to 200G", "re-sets its limit to what it wants",
            "unsets its limit", "starts a child with another environment", "leaves MPS (unsets its pipe)")


def test_the_mps_bench_holds_every_slot_to_its_share_whatever_the_task_does(engine, tmp_path):
    runtime_env = Path("/etc/gpu-swarm/runtime.env")
    before = runtime_env.read_bytes() if runtime_env.exists() else None
    ours = [] if Path("/run/gpu-swarm").exists() else ["/run/gpu-swarm"]  # the ledger's folder, when it made it
    try:
        done = subprocess.run([sys.executable, "bench/gpu_mps.py", "--smoke", "--gpus", "1", "--out",
                               str(tmp_path / "out")], cwd=REPO, capture_output=True, text=True, timeout=600)
        assert (tmp_path / "out" / "results.json").exists(), done.stdout[-4000:] + done.stderr[-2000:]
        results = {r["check"]: r for r in json.loads((tmp_path / "out" / "results.json").read_text())}
        assert done.returncode == 0, done.stdout[-4000:]
        # The daemon's ceiling is the share the guard gives; every way out of it is tried and held.
        assert any(c.startswith("every GPU's MPS daemon has the slot's share as its ceiling") for c in results)
        for way in WAYS_OUT:
            tried = [r for c, r in results.items() if c.startswith(f"a slot task that {way}")]
            assert len(tried) == 1 and tried[0]["ok"], (way, tried)
        assert results["the others keep running and keep their memory through all of it"]["ok"]
        # Two processes in one task: a ceiling each, as README says, and the exporter shows the total.
        assert any(c.startswith("a slot task's two CUDA processes get") and r["ok"] for c, r in results.items())
        assert any(c.startswith("the exporter names every sharer's memory") and r["ok"] for c, r in results.items())
        assert (tmp_path / "out" / "hostile-unset.log").read_text().startswith("Failed")
        assert (runtime_env.read_bytes() if runtime_env.exists() else None) == before  # put back
    finally:
        for leftover in ("/var/lib/gpu-swarm-mps", "/run/gpu-swarm-mps-bench", "/run/gpu-swarm/mps", *ours):
            shutil.rmtree(leftover, ignore_errors=True)
