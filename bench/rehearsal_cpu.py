"""Benchmark: where the CPU goes while the rehearsal's `pulumi up` runs (which processes, how many CPU-seconds).

Run as root after scripts/setup.sh, with no rehearsal up:
    .venv/bin/python bench/rehearsal_cpu.py [--nodes 8]
    .venv/bin/python bench/rehearsal_cpu.py --smoke     # 1 GPU node: that the bench runs

It sets the dev stack's GPU pool to --nodes g4dn.xlarge (1 GPU each), as a user sets it, and samples
/proc every 0.1 s while one `localswarm pulumi --stack dev up --yes` runs (Pulumi's CLI, its plugins,
the machines booting their user data and running the commands), then prints each command name's CPU
seconds: its own (processes alive at a sample; a process that lived less than 0.1 s is missed here)
and its waited children's (where those short-lived ones end up: a bash script's `docker` calls are
its "waited children"). Then it runs `down`. On a 2-core machine `up` has 2 CPU-seconds per second;
compare the totals with its wall time.
"""
from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TICKS = os.sysconf("SC_CLK_TCK")


def sample(into: dict) -> None:
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        comm = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        # utime, stime; then cutime, cstime: the children it waited for
        into[pid] = (comm, int(fields[11]) + int(fields[12]), int(fields[13]) + int(fields[14]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=8, help="GPU nodes of the pool (default %(default)s)")
    parser.add_argument("--smoke", action="store_true", help="1 GPU node: that the bench runs")
    args = parser.parse_args()
    if args.smoke:
        args.nodes = 1
    localswarm = [sys.executable, "-m", "localswarm"]
    subprocess.run([*localswarm, "down"], cwd=REPO, capture_output=True, check=True)
    subprocess.run([*localswarm, "pulumi", "--stack", "dev", "config", "set", "--path", "gpu-swarm:gpuPools[0].count",
                    str(args.nodes)], cwd=REPO, capture_output=True, check=True)
    before: dict = {}
    sample(before)
    seen: dict = {}
    started = time.monotonic()
    with tempfile.TemporaryFile("w+") as out:  # a pipe nobody reads while it runs would stall it
        up = subprocess.Popen([*localswarm, "pulumi", "--stack", "dev", "up", "--yes"], cwd=REPO,
                              stdout=out, stderr=subprocess.STDOUT, text=True)
        while up.poll() is None:
            sample(seen)
            time.sleep(0.1)
        wall = time.monotonic() - started
        sample(seen)
        out.seek(0)
        err = out.read()
    subprocess.run([*localswarm, "down"], cwd=REPO, capture_output=True)
    if up.returncode != 0:
        sys.exit(f"up failed:\n{err[-5000:]}")
    own, waited = collections.Counter(), collections.Counter()
    for pid, (comm, cpu, children) in seen.items():
        old = before.get(pid)
        if old and old[0] == comm:
            cpu, children = cpu - old[1], children - old[2]
        own[comm] += cpu
        waited[comm] += children
    print(f"`pulumi up` of a manager and {args.nodes} GPU node(s) took {wall:.2f} s wall on {os.cpu_count()} cores "
          f"({wall * os.cpu_count():.1f} CPU-seconds available)")
    print("own CPU-seconds by command:   " + ", ".join(f"{c} {v / TICKS:.2f}" for c, v in own.most_common(10)))
    print("waited children's CPU-seconds, by parent:   "
          + ", ".join(f"{c} {v / TICKS:.2f}" for c, v in waited.most_common(8)))
    print("(a parent's waited children are summed whole: `systemd-nspawn`'s are a machine's, `pulumi`'s its plugins')")
    return 0


if __name__ == "__main__":
    sys.exit(main())
