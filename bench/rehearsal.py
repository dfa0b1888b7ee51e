"""Benchmark: where `localswarm up` spends its time, for 3x2 and 8x2 nodes x GPUs.

Run as root after scripts/setup.sh:  .venv/bin/python bench/rehearsal.py [--runs N] [--raw FILE]
--smoke: one run of the smallest rehearsal (1 node x 1 GPU), to see that the bench still runs.

For each size it prints the median and the spread (min-max) over N runs of the seconds from
the start of `up` until the engines were ready, the swarm was formed (every node admitted and
its GPUs proven) and the default smoke stack converged; then the phases of one run (the median
one) as `up` timed them, and what its tasks spent their time on. That last part comes from the
swarm's own records: a thread here reads the first manager's tasks every 25 ms while `up` runs
(the state timestamps are the swarm's, only states shorter than that can be missed), and after
`up` each node's engine events give its image pulls and container create, start and exit.
"""
from __future__ import annotations

import argparse
import calendar
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from localswarm import api  # noqa: E402
from localswarm.nodes import RUN_ROOT  # noqa: E402

SIZES = [(3, 2), (8, 2)]
MILESTONES = {"nodes_ready_s": "nodes ready", "swarm_ready_s": "swarm formed", "stack_converged_s": "converged"}
CHECK_PREFIX = "gpu-swarm-check-"


def localswarm(*args: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "localswarm", *args], cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"localswarm {' '.join(args)} failed:\n{proc.stderr}")
    return proc.stdout


def epoch(timestamp: str) -> float:
    """A Docker timestamp (2026-11-22T23:08:24.123456789Z) as seconds since the epoch."""
    match = re.match(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(\.\d+)?Z$", timestamp)
    return calendar.timegm(time.strptime(match[1], "%Y-%m-%dT%H:%M:%S")) + float(match[2] or 0)


class TaskWatcher(threading.Thread):
    """Every state each task of the first manager went through, with the swarm's timestamp of it."""

    def __init__(self, sock: str, interval: float = 0.025) -> None:
        super().__init__(daemon=True)
        self.sock, self.interval, self.stop = sock, interval, threading.Event()
        self.tasks: dict[str, dict] = {}
        self.services: dict[str, str] = {}

    def run(self) -> None:
        while not self.stop.wait(self.interval):
            try:
                tasks = api.get(self.sock, "/tasks")
                for task in tasks:
                    self._record(task)
            except Exception:  # no engine or no swarm yet
                continue

    def _record(self, task: dict) -> None:
        seen = self.tasks.setdefault(task["ID"], {"created": epoch(task["CreatedAt"]), "states": {}})
        seen["node"] = task.get("NodeID", "")
        if task["ServiceID"] not in self.services:
            self.services[task["ServiceID"]] = api.get(self.sock, f"/services/{task['ServiceID']}")["Spec"]["Name"]
        seen["service"] = self.services[task["ServiceID"]]
        seen["states"].setdefault(task["Status"]["State"], epoch(task["Status"]["Timestamp"]))


def node_events(node: str, since: float, until: float) -> list[dict]:
    body = api.request(str(RUN_ROOT / node / "docker.sock"), "/events", since=f"{since:.3f}", until=f"{until:.3f}",
                       filters={"type": ["container", "image"]})
    return [json.loads(line) for line in body.decode().splitlines() if line.strip()]


def task_phases(task: dict, events: list[dict]) -> dict[str, float]:
    """Seconds each step of one task took, from its swarm states and its node's engine events."""
    def at(action: str) -> float | None:
        return next((e["timeNano"] / 1e9 for e in events if e["Type"] == "container" and e["Action"] == action
                     and e["Actor"]["Attributes"].get("com.docker.swarm.task.id") == task["id"]), None)

    states, created = task["states"], at("create")
    preparing = states.get("preparing")
    pulls = [e["timeNano"] / 1e9 for e in events if e["Type"] == "image" and e["Action"] == "pull"]
    pulled = max((t for t in pulls if preparing and created and preparing <= t <= created), default=None)
    marks = [("scheduling + dispatch", task["created"], preparing), ("image pull", preparing, pulled or preparing),
             ("container create", pulled or preparing, created),
             ("created -> container created", task["created"], created),
             ("container start", created, at("start")), ("job ran", at("start"), at("die"))]
    phases = {name: max(0.0, end - begin) for name, begin, end in marks if begin and end}
    phases["pulled"] = 1.0 if pulled else 0.0
    return phases


def breakdown(watcher: TaskWatcher, node_ids: dict[str, str], events: dict[str, list[dict]], started: float) -> dict:
    """Per group (the GPU check's jobs, the stack's tasks): each phase's median and slowest task,
    and when the group's last task was running (seconds since `up` started)."""
    groups: dict[str, list[dict]] = {"gpu check jobs": [], "stack tasks": []}
    running: dict[str, list[float]] = {"gpu check jobs": [], "stack tasks": []}
    for task_id, task in watcher.tasks.items():
        node = node_ids.get(task.get("node", ""))
        if node is None:
            continue  # never scheduled: the replica that waits for a GPU
        group = "gpu check jobs" if task["service"].startswith(CHECK_PREFIX) else "stack tasks"
        groups[group].append(task_phases({**task, "id": task_id}, events[node]))
        running[group] += [task["states"]["running"] - started] if "running" in task["states"] else []
    out = {}
    for group, tasks in groups.items():
        names = list(dict.fromkeys(name for t in tasks for name in t if name != "pulled"))
        out[group] = {"tasks": len(tasks), "pulls": int(sum(t["pulled"] for t in tasks)),
                      "last_running_s": round(max(running[group], default=0), 2),
                      "phases": {name: (round(statistics.median(v), 3), round(max(v), 3))
                                 for name in names if (v := [t[name] for t in tasks if name in t])}}
    return out


def cpu_ticks() -> tuple[int, int]:
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return sum(fields) - fields[3] - fields[4], sum(fields)  # busy (all but idle and iowait), total


def one_run(nodes: int, gpus: int) -> dict:
    watcher = TaskWatcher(str(RUN_ROOT / "node-1" / "docker.sock"))
    watcher.start()
    busy0, total0 = cpu_ticks()
    view = json.loads(localswarm("up", "--nodes", str(nodes), "--gpus-per-node", str(gpus), "--json"))
    busy1, total1 = cpu_ticks()
    watcher.stop.set()
    watcher.join()
    timings = view["timings"]
    until = timings["started_at"] + timings["stack_converged_s"] + 0.5
    names = [n["name"] for n in view["nodes"]]
    events = {name: node_events(name, timings["started_at"], until) for name in names}
    node_ids = {api.get(str(RUN_ROOT / name / "docker.sock"), "/info")["Swarm"]["NodeID"]: name for name in names}
    localswarm("down")
    return {"timings": timings, "cpu_busy": round((busy1 - busy0) / max(1, total1 - total0), 2),
            "tasks": sum(len(s["tasks"]) for s in view["services"]),
            "breakdown": breakdown(watcher, node_ids, events, timings["started_at"])}


def report(nodes: int, gpus: int, runs: list[dict]) -> str:
    lines = [f"== {nodes} x {gpus} (nodes x GPUs): {len(runs)} runs, {runs[0]['tasks']} tasks ==",
             f"{'seconds since `up` started':<28}{'median':>8}  {'min-max':>11}  per run"]
    for key, label in MILESTONES.items():
        values = [r["timings"][key] for r in runs]
        lines.append(f"  {label:<26}{statistics.median(values):>8.2f}  {min(values):>5.2f}-{max(values):<5.2f}  "
                     + " ".join(f"{v:.2f}" for v in values))
    ordered = sorted(runs, key=lambda r: r["timings"]["stack_converged_s"])
    median_run = ordered[(len(ordered) - 1) // 2]
    t = median_run["timings"]
    lines.append(f"phases of the median run (converged at {t['stack_converged_s']:.2f} s; "
                 f"CPU busy {median_run['cpu_busy']:.0%} of both cores), seconds:")
    lines.append("  " + "  ".join(f"{name} {s:.2f}" for name, s in t["phases"].items()))
    for group, info in median_run["breakdown"].items():
        lines.append(f"  {group} ({info['tasks']} that ran, {info['pulls']} with an image pull; the last running "
                     f"at {info['last_running_s']:.2f} s): median / slowest task, seconds")
        lines += [f"    {name:<28}{med:>6.2f} / {worst:.2f}" for name, (med, worst) in info["phases"].items()]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--sizes", default=",".join(f"{n}x{g}" for n, g in SIZES), help="e.g. 3x2,8x2")
    parser.add_argument("--raw", type=Path, help="also write every run's timings and breakdown here, as JSON")
    parser.add_argument("--smoke", action="store_true", help="one run of 1 node x 1 GPU: that the bench runs")
    args = parser.parse_args()
    if args.smoke:
        args.runs, args.sizes = 1, "1x1"
    if os.geteuid() != 0:
        sys.exit("run as root: the rehearsal creates namespaces and engines")
    localswarm("down")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout
    print(f"machine: {os.cpu_count()} cores, {os.uname().release}; commit {commit.strip()}; {args.runs} runs per size",
          flush=True)
    raw = {}
    for size in args.sizes.split(","):
        nodes, gpus = (int(x) for x in size.split("x"))
        runs = [one_run(nodes, gpus) for _ in range(args.runs)]
        raw[size] = runs
        print(report(nodes, gpus, runs), flush=True)
    if args.raw:
        args.raw.write_text(json.dumps(raw, indent=1) + "\n")


if __name__ == "__main__":
    main()
