"""Benchmark: how fast an elastic pool grows for a waiting GPU task, and how fast it goes back to zero.

Run as root after scripts/setup.sh, under the rehearsal's lock:
    flock /tmp/gpu-swarm-rehearsal.lock .venv/bin/python bench/autoscale.py [--runs 5] [--idle-seconds 5]
--smoke: one run, to see that the bench still runs.

One real `pulumi up` (`localswarm pulumi --stack dev up`, Pulumi's CLI) of the dev stack whose pool is elastic (t4, g4dn.xlarge, autoscale {min 0, max 1}),
without stacks: the pool has no node. The bench then shortens the pool's idle time on the manager to
--idle-seconds (it rewrites idleSeconds in the scaler's settings, /etc/gpu-swarm/autoscale/pools.json, which
the scaler reads at each round; the program's smallest is idleMinutes: 1). Each run:
- creates a one-replica service reserving one GPU (the GPU check's image, which every GPU node builds);
- pending -> decision: from the task's creation until the scaler's journal says it set the desired capacity;
- decision -> admitted: until its journal says the new node was admitted (booted from the template's user
  data through cloud-init, joined from its SSM parameter, labelled and GPU-checked);
- admitted -> running: from the admit's end until the task's state is running (the admit gives the node
  its tasks before its GPU check, so this is near zero);
- gone -> removed: from the service's removal until the node is out of the swarm and its instance terminated
  (idle for --idle-seconds, then paused, drained, terminated with a decrement, removed: about four of the
  scaler's 5 s rounds on top of the idle time).
Prints the median and the spread (min-max) of each. What the rehearsal cannot give: EC2's launch time
and the driver's install; see docs/operations/elastic-pools.md.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from localswarm import api, elastic_cloud, machines, pulumi_host  # noqa: E402
from swarm.node_contract import AUTOSCALE_POOLS_PATH, CHECK_IMAGE  # noqa: E402

POOL = {"name": "t4", "instanceType": "g4dn.xlarge", "autoscale": {"min": 0, "max": 1, "idleMinutes": 1}}
GROUP = "gpu-swarm-dev-t4"
SERVICE = "bench-autoscale"
FIGURES = ("pending_to_decision_s", "decision_to_admitted_s", "admitted_to_running_s", "gone_to_removed_s")


def manager() -> machines.Machine:
    return next(m for m in machines.machines() if m.index < min(elastic_cloud.GROUP_INDEXES))


def on_manager(script: str) -> str:
    done = machines.run(manager(), script, timeout=120)
    if done.returncode != 0:
        sys.exit(f"on the manager: {script!r} failed: {done.stderr or done.stdout}")
    return done.stdout


def journal_after(since: float, words: str) -> float | None:
    """The time of the scaler's first journal line after `since` that holds `words`."""
    out = on_manager(f"journalctl -u gpu-swarm-scaler -o short-unix --no-pager --since @{int(since) - 1}")
    for line in out.splitlines():
        stamp, _, text = line.partition(" ")
        try:
            at = float(stamp)
        except ValueError:
            continue
        if at >= since and words in text:
            return at
    return None


def wait(what: str, found, timeout: float = 600, poll_s: float = 0.5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = found()
        if value:
            return value
        time.sleep(poll_s)
    sys.exit(f"timed out waiting for {what}")


def sock() -> str:
    return pulumi_host.docker_socket(manager())


def task_running() -> float | None:
    for task in api.get(sock(), "/tasks", filters={"service": [SERVICE]}):
        if task["Status"]["State"] == "running":
            return time.time()
    return None


def workers() -> list[dict]:
    return [n for n in api.get(sock(), "/nodes") if n["Spec"]["Role"] == "worker"]


def one_run(idle_s: float) -> dict:
    created = time.time()
    on_manager(f"docker service create --detach --name {SERVICE} --generic-resource NVIDIA-GPU=1 "
               f"--no-resolve-image {CHECK_IMAGE} sleep 3600 >/dev/null")
    decided = wait("the scale-out", lambda: journal_after(created, "desired capacity 1"))
    admitted = wait("the admit", lambda: journal_after(decided, ": admitted: "))
    running = wait("the task running", task_running, poll_s=0.1)
    gone = time.time()
    on_manager(f"docker service rm {SERVICE} >/dev/null")
    removed = wait("the node removed", lambda: time.time() if not workers() and
                   elastic_cloud.STORE.read()["groups"][GROUP]["desired"] == 0 and
                   not elastic_cloud.group_machines() else None, poll_s=0.5)
    return {"pending_to_decision_s": decided - created, "decision_to_admitted_s": admitted - decided,
            "admitted_to_running_s": max(0.0, running - admitted), "gone_to_removed_s": removed - gone,
            "idle_s": idle_s}


def main() -> None:
    parser = argparse.ArgumentParser(description="How fast an elastic pool grows for a waiting GPU task and goes "
                                                 "back to zero, in the program's rehearsal (root, under the lock).")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--idle-seconds", type=float, default=5, help="the pool's idle time for the bench")
    parser.add_argument("--raw", type=Path, help="write every run's figures to this JSON file")
    parser.add_argument("--smoke", action="store_true", help="one run, to see that the bench runs")
    args = parser.parse_args()
    runs = 1 if args.smoke else args.runs
    if os.geteuid() != 0:
        sys.exit("the rehearsal needs root")
    subprocess.run([sys.executable, "-m", "localswarm", "down"], cwd=REPO, capture_output=True, check=True)
    try:
        for args_ in (("config", "set-all", "--json", json.dumps(
                          {"gpu-swarm:gpuPools": {"value": json.dumps([POOL]), "objectValue": [POOL], "secret": False}})),
                      ("config", "rm", "gpu-swarm:stacks"), ("up", "--yes")):
            subprocess.run([sys.executable, "-m", "localswarm", "pulumi", "--stack", "dev", *args_], cwd=REPO,
                           capture_output=True, check=True)
        settings = json.loads(on_manager(f"cat {AUTOSCALE_POOLS_PATH}"))
        settings["pools"][0]["idleSeconds"] = int(args.idle_seconds)
        on_manager(f"cat >{AUTOSCALE_POOLS_PATH} <<'EOF'\n{json.dumps(settings)}\nEOF")
        results = []
        for i in range(runs):
            results.append(one_run(args.idle_seconds))
            print(f"run {i + 1}: " + ", ".join(f"{k} {results[-1][k]:.1f}" for k in FIGURES), flush=True)
    finally:
        subprocess.run([sys.executable, "-m", "localswarm", "down"], cwd=REPO, capture_output=True)
    print(f"\n{runs} runs, idle time {args.idle_seconds:g} s, on {os.cpu_count()} cores ({platform.node()}), "
          f"load average {os.getloadavg()[0]:.2f}")
    for key in FIGURES:
        values = [r[key] for r in results]
        print(f"{key:24} median {statistics.median(values):6.1f} s   ({min(values):.1f}-{max(values):.1f})")
    if args.raw:
        args.raw.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
