"""How the program's evaluation cost grows with the cluster: time and memory under Pulumi's mocks.

    .venv/bin/python bench/scale.py [--sizes 10 100 500]

Each size runs in a fresh interpreter, so peak memory of one size does not hide another's.
It measures the Python side only (settings, components, every registration answered by the
mocks); with the real engine, provider calls and SSH commands add to it.
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def measure(gpu_nodes: int, trace: bool) -> dict:
    sys.path.insert(0, str(REPO))
    from tests.conftest import run_program, stack_config  # the test suite's mocks

    config = stack_config(
        "prod",
        managerCount="3",
        gpuPools=[{"name": "gpu", "instanceType": "g6.xlarge", "count": gpu_nodes}],
    )
    if trace:
        tracemalloc.start()
    start = time.perf_counter()
    run = run_program(config, stack="bench")
    seconds = time.perf_counter() - start
    peak = tracemalloc.get_traced_memory()[1] if trace else 0
    assert len(run.exports["inventory"]) == gpu_nodes + 3
    return {
        "gpu_nodes": gpu_nodes,
        "resources": len(run.monitor.requests),
        "seconds": seconds,
        "traced_peak_mib": peak / 2**20,
        "maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def child(gpu_nodes: int, trace: bool) -> dict:
    cmd = [sys.executable, __file__, "--child", str(gpu_nodes)] + (["--trace"] if trace else [])
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10, 100, 500])
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--trace", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(measure(args.child, args.trace)))
        return

    rows = []
    for size in args.sizes:
        timed = child(size, trace=False)  # tracemalloc slows Python down: time without it
        traced = child(size, trace=True)
        rows.append((size, timed, traced))

    print("| GPU nodes (+3 managers) | resources | evaluation s | maxrss MiB | traced peak MiB "
          "| ms per added node | KiB per added node |")
    print("|---|---|---|---|---|---|---|")
    base_size, base_timed, base_traced = rows[0]
    for size, timed, traced in rows:
        added = size - base_size
        per_ms = f"{(timed['seconds'] - base_timed['seconds']) * 1000 / added:.1f}" if added else "-"
        per_kib = f"{(traced['traced_peak_mib'] - base_traced['traced_peak_mib']) * 1024 / added:.0f}" if added else "-"
        print(f"| {size} | {timed['resources']} | {timed['seconds']:.2f} | {timed['maxrss_mib']:.0f} "
              f"| {traced['traced_peak_mib']:.1f} | {per_ms} | {per_kib} |")
    print(f"(per added node: the growth over the {base_size}-node run, which holds the fixed cost)")

if __name__ == "__main__":
    main()
