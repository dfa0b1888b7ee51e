"""Benchmark: the real `pulumi up` of the program (Pulumi's CLI, the rehearsal's machines), first and again.

Run as root after scripts/setup.sh:  .venv/bin/python bench/program_up.py [--runs N]
--smoke: one run (the shape is already the smallest), to see that the bench still runs.

Each run builds the dev stack (one manager, one GPU node with one GPU, the smoke stack) from a
clean host (`down` runs before it, untimed) with `localswarm pulumi --stack dev up --yes`; then a
second `pulumi up` with nothing changed, and a roll of new node software (`--bump-node-software`),
one after the other in the same run, so a drift of this machine's speed hits all three. It prints
the median and the spread (min-max) over N runs of each, in wall seconds, with the commands each
ran a script of (localswarm/pulumi_cli.py last_run), and the boot steps of the median first run,
as the stack's bootstrapTimings output has them.
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
    first, again, roll, boots, commands, ran_again, ran_roll = [], [], [], [], [], [], []
    for _ in range(args.runs):
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
    print(f"{args.runs} run(s) on {subprocess.getoutput('nproc')} cores")
    print(f"pulumi up --stack dev (first up, Pulumi's CLI)     {spread(first)}   {commands[0]} commands")
    print(f"  again, nothing changed                           {spread(again)}   commands run: {ran_again}")
    print(f"  again, new node software (--bump-node-software)  {spread(roll)}   commands run: {ran_roll}")
    median = boots[sorted(range(len(first)), key=first.__getitem__)[len(first) // 2]]
    print("boot steps of the median first up (bootstrapTimings):")
    for node, steps in median.items():
        print(f"  {node}: " + ", ".join(f"{s} {t['seconds']:.2f} s {t['status']}" for s, t in steps.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
