"""Benchmark: the real `pulumi up` of the program (Pulumi's CLI, the rehearsal's machines) beside `localswarm up`.

Run as root after scripts/setup.sh:  .venv/bin/python bench/program_up.py [--runs N]
--smoke: one run of each (the shape is already the smallest), to see that the bench still runs.

Both build one manager and one GPU node with one GPU and deploy the smoke stack; the two
alternate (A B A B ...) so a drift of this machine's speed hits both. For each it prints the
median and the spread (min-max) over N runs of the whole `up` (wall seconds, from a clean host:
`down` runs before each, untimed). For `pulumi up` (`localswarm pulumi --stack dev up --yes`) it
also prints a second `pulumi up` with nothing changed, and a roll of new node software
(`--bump-node-software`), with the commands each ran a script of (localswarm/pulumi_cli.py
last_run), and the boot steps of the median first run, as the stack's bootstrapTimings output has them.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from localswarm import pulumi_cli  # noqa: E402


def localswarm(*args: str) -> float:
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "localswarm", *args], cwd=REPO, capture_output=True, text=True)
    seconds = time.monotonic() - started
    if proc.returncode != 0:
        sys.exit(f"localswarm {' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return seconds


def pulumi_up(*rehearsal: str) -> tuple[float, int]:
    """The real `pulumi up --yes` of the dev stack: its wall seconds and how many commands ran a script."""
    seconds = localswarm("pulumi", "--stack", "dev", *rehearsal, "up", "--yes")
    return seconds, len(pulumi_cli.last_run()["commands"])


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):6.1f} s ({min(values):.1f}-{max(values):.1f})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="one run of each: that the bench runs")
    args = parser.parse_args()
    if args.smoke:
        args.runs = 1
    fast, first, again, roll, boots, commands, ran_again, ran_roll = [], [], [], [], [], [], [], []
    for _ in range(args.runs):
        localswarm("down")
        fast.append(localswarm("up", "--nodes", "2", "--gpus-per-node", "1", "--json"))
        localswarm("down")
        seconds, ran = pulumi_up()
        first.append(seconds)
        commands.append(ran)
        shown = subprocess.run([sys.executable, "-m", "localswarm", "pulumi", "--stack", "dev", "stack", "output",
                                "--json"], cwd=REPO, capture_output=True, text=True, check=True)
        boots.append(json.loads(shown.stdout)["bootstrapTimings"])
        seconds, ran = pulumi_up()
        again.append(seconds)
        ran_again.append(ran)
        seconds, ran = pulumi_up("--bump-node-software")
        roll.append(seconds)
        ran_roll.append(ran)
    localswarm("down")
    print(f"{args.runs} runs each, alternating, on {subprocess.getoutput('nproc')} cores")
    print(f"localswarm up --nodes 2 --gpus-per-node 1          {spread(fast)}")
    print(f"pulumi up --stack dev (first up, Pulumi's CLI)     {spread(first)}   "
          f"{statistics.median(first) / statistics.median(fast):.2f}x; {commands[0]} commands")
    # Each first up against the fast up just before it: a drift of this machine's speed hits both.
    pairs = [p / f for p, f in zip(first, fast)]
    print(f"  each run's first up / its fast up: {' '.join(f'{r:.2f}' for r in pairs)}; "
          f"median {statistics.median(pairs):.2f}x")
    print(f"  again, nothing changed                           {spread(again)}   commands run: {ran_again}")
    print(f"  again, new node software (--bump-node-software)  {spread(roll)}   commands run: {ran_roll}")
    median = boots[sorted(range(len(first)), key=first.__getitem__)[len(first) // 2]]
    print("boot steps of the median first up (bootstrapTimings):")
    for node, steps in median.items():
        print(f"  {node}: " + ", ".join(f"{s} {t['seconds']:.2f} s {t['status']}" for s, t in steps.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
