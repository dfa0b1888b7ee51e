#!/usr/bin/env python3
"""What the runtime guard (node/gpu-swarm-runtime + gpu_guard.py) costs per OCI runtime call.

    python3 bench/guard_cost.py [--runs 200]

A container start makes the shim call its runtime several times (create, start, state,
delete). Timing `docker run` on a GPU machine measures those plus the engine, the toolkit
and the driver, which vary by more than the guard costs. This times the calls alone: the
guard in front of a delegate that does nothing (/bin/true), against that delegate called
directly, on a copy of a real swarm task's config.json, interleaved, median of --runs:
- `create` of a task holding one GPU (the guard's Python rewrites config.json);
- `create` of a task that reserved nothing (rewritten to NVIDIA_VISIBLE_DEVICES=void);
- `start` (and every other call): the sh front alone, which execs the delegate.
Needs nothing but python3 and sh; no GPU, no Docker.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GUARD = REPO / "node" / "gpu-swarm-runtime"
GPU = "GPU-e282fbe7-2973-2b00-45d8-019e7e863f55"
# The parts of a swarm task's config.json the guard reads, as dockerd 26 writes them.
SPEC = {"ociVersion": "1.0.2-dev", "process": {"args": ["sh", "-c", "nvidia-smi -L; exec sleep infinity"], "env": [
    "PATH=/usr/local/nvidia/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "NVIDIA_VISIBLE_DEVICES=all", "NVIDIA_DRIVER_CAPABILITIES=compute,utility", "HOSTNAME=4f2a9c1e0b7d"]},
    "root": {"path": "rootfs"}, "hooks": {}, "annotations": {}, "linux": {"namespaces": [{"type": "pid"}]}}


def timed(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="guard-cost-"))
    try:
        settings = work / "runtime.env"
        settings.write_text(f"DELEGATE=/bin/true\nGUARD={REPO / 'node' / 'gpu_guard.py'}\nGUARD_PYTHON={sys.executable}\n"
                            f"KIND=NVIDIA-GPU\nSHARED_KIND=\nSLOTS_PER_GPU=0\nGPUS={GPU}\nALLOW_DOCKER_RUN_GPUS=true\n")
        bundles = {}
        for name, extra in (("one GPU", [f"DOCKER_RESOURCE_NVIDIA-GPU={GPU}"]), ("no GPU", [])):
            bundle = work / name.replace(" ", "-")
            bundle.mkdir()
            spec = json.loads(json.dumps(SPEC))
            spec["process"]["env"] += extra
            (bundle / "config.json.orig").write_text(json.dumps(spec))
            bundles[name] = bundle

        def call(via_guard: bool, verb: str, bundle: Path) -> list[str]:
            front = [str(GUARD), "--gpu-swarm-config", str(settings)] if via_guard else ["/bin/true"]
            return [*front, "--root", "/run/runc", "--log", str(work / "log.json"), verb, "--bundle", str(bundle),
                    "task1"]

        cases = {f"create, {name}": ("create", b) for name, b in bundles.items()}
        cases["start (any call but create)"] = ("start", bundles["one GPU"])
        samples = {case: {"guard": [], "delegate alone": []} for case in cases}
        for i in range(args.runs + 5):
            for case, (verb, bundle) in cases.items():
                for who in ("guard", "delegate alone"):
                    shutil.copy(bundle / "config.json.orig", bundle / "config.json")  # each create sees a fresh spec
                    seconds = timed(call(who == "guard", verb, bundle))
                    if i >= 5:  # warm-up rounds are not counted
                        samples[case][who].append(seconds)
        shutil.copy(bundles["no GPU"] / "config.json.orig", bundles["no GPU"] / "config.json")
        timed(call(True, "create", bundles["no GPU"]))
        rewritten = json.loads((bundles["no GPU"] / "config.json").read_text())["process"]["env"]
        assert "NVIDIA_VISIBLE_DEVICES=void" in rewritten, "the guard did not run"
        print(f"median of {args.runs} interleaved calls, milliseconds; python {sys.version.split()[0]}")
        print(f"{'call':32} {'guard':>8} {'alone':>8} {'guard adds':>11}")
        for case, s in samples.items():
            g, d = statistics.median(s["guard"]) * 1000, statistics.median(s["delegate alone"]) * 1000
            print(f"{case:32} {g:8.1f} {d:8.1f} {g - d:+11.1f}")
        return 0
    finally:
        shutil.rmtree(work)


if __name__ == "__main__":
    sys.exit(main())
