"""Benchmark: the phases of `localswarm up` for 3x2 and 8x2 nodes x GPUs.

Run as root after scripts/setup.sh:  .venv/bin/python bench/rehearsal.py [--runs N]
Prints, per size, the seconds from the start of `up` until the engines were ready,
the swarm was formed and the default smoke stack converged (median of N runs).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SIZES = [(3, 2), (8, 2)]
PHASES = ("nodes_ready_s", "swarm_ready_s", "stack_converged_s")


def localswarm(*args: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "localswarm", *args], cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"localswarm {' '.join(args)} failed:\n{proc.stderr}")
    return proc.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("run as root: the rehearsal creates namespaces and engines")
    localswarm("down")
    print(f"machine: {os.cpu_count()} cores; median of {args.runs} runs; seconds since `up` started")
    print(f"{'nodes x gpus':>12}  {'nodes ready':>11}  {'swarm formed':>12}  {'converged':>9}  tasks")
    for nodes, gpus in SIZES:
        samples = []
        for _ in range(args.runs):
            view = json.loads(localswarm("up", "--nodes", str(nodes), "--gpus-per-node", str(gpus), "--json"))
            samples.append(view["timings"])
            tasks = sum(len(s["tasks"]) for s in view["services"])
            localswarm("down")
        med = {p: statistics.median(s[p] for s in samples) for p in PHASES}
        print(f"{f'{nodes} x {gpus}':>12}  {med['nodes_ready_s']:>11.2f}  {med['swarm_ready_s']:>12.2f}  "
              f"{med['stack_converged_s']:>9.2f}  {tasks}")


if __name__ == "__main__":
    main()
