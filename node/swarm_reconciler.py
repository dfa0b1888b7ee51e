#!/usr/bin/env python3
"""Drain the swarm nodes whose GPU health watcher reports a fault, and admit them back.

Runs on every manager (gpu-swarm-reconciler.service); only the leader acts, so the
managers never race each other. Each --interval it reads every node's engine label
gpu-swarm.condition (written by node/gpu_health.py on the node) and:
- drains an active node whose condition is unhealthy or reclaim, marking it
  gpu-swarm.drained-by=health and gpu-swarm.health=<condition>:<reason>;
- makes a node it drained active again once the condition is healthy, degraded or no
  longer reported (the watcher never removes its labels itself: a missing one was
  removed on purpose, or the node's daemon.json was rebuilt, and nothing else would ever
  give the node back);
- leaves every other drained or paused node alone: an operator's, or one that
  gpu-swarm.drained-by=rollout or =gpu-check names, belongs to someone else.
Swarm cannot withdraw one GPU from a running node, so the node is the unit.
Stdlib only: it runs under the system python3 and talks to the docker CLI.

Exit codes: 0 done; 1 (--once only) the engine could not be asked, or an update failed;
2 bad input.
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

CONDITION = "gpu-swarm.condition"  # engine labels, from the node's watcher
DRAINED_BY = "gpu-swarm.drained-by"  # node labels, shared with rollout and gpu-check
HEALTH = "gpu-swarm.health"
LAST = "gpu-swarm.health.last"
OURS = "health"
DRAIN_ON = ("unhealthy", "reclaim")
# None: no condition reported. An unknown value is not evidence either way: nothing happens.
REACTIVATE_ON = ("healthy", "degraded", None)
_REASON_BAD = re.compile(r"[^A-Za-z0-9._:/-]")


@dataclass(frozen=True)
class Action:
    node_id: str
    node: str  # the hostname, for people
    action: str  # "drain" or "reactivate"
    reason: str
    args: tuple[str, ...]  # for `docker node update`, the node ID last


def sanitize(text: str) -> str:
    return _REASON_BAD.sub("_", str(text).strip())[:120] or "-"


def decide(nodes: list[dict], leader: bool, now: int) -> list[Action]:
    """The updates to make, from `docker node inspect`'s JSON of every node; none unless leader."""
    if not leader:
        return []
    actions = []
    for node in nodes:
        spec, description = node.get("Spec") or {}, node.get("Description") or {}
        labels = spec.get("Labels") or {}
        engine = (description.get("Engine") or {}).get("Labels") or {}
        availability, condition = spec.get("Availability"), engine.get(CONDITION)
        name, node_id = description.get("Hostname") or node["ID"], node["ID"]
        if condition in DRAIN_ON and availability == "active":
            why = f"{condition}:{sanitize(engine.get(CONDITION + '.reason', '-'))}"
            args = ("--availability", "drain", "--label-add", f"{DRAINED_BY}={OURS}", "--label-add", f"{HEALTH}={why}",
                    "--label-add", f"{LAST}=drained:{now}:{why}", node_id)
            actions.append(Action(node_id, name, "drain", why, args))
        elif labels.get(DRAINED_BY) == OURS and availability == "drain" and condition in REACTIVATE_ON:
            # Only from drain: a node someone paused (or set active) since is theirs now.
            why = f"{condition}:{sanitize(engine.get(CONDITION + '.reason', '-'))}" if condition else "no_condition"
            # --label-rm of a label that is not there fails the whole update.
            drop = ("--label-rm", HEALTH) if HEALTH in labels else ()
            args = ("--availability", "active", "--label-rm", DRAINED_BY, *drop,
                    "--label-add", f"{LAST}=reactivated:{now}:{why}", node_id)
            actions.append(Action(node_id, name, "reactivate", why, args))
    return actions


class EngineError(Exception):
    pass


class Engine:
    """The docker CLI, thin: DOCKER_HOST and friends come from the environment as usual."""

    def __init__(self, docker: str, timeout: float = 30):
        self.docker, self.timeout = docker, timeout

    def _run(self, *args: str) -> str:
        try:
            done = subprocess.run([self.docker, *args], capture_output=True, text=True, timeout=self.timeout)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise EngineError(f"{self.docker} {' '.join(args[:2])}: {e}")
        if done.returncode != 0:
            raise EngineError(f"{self.docker} {' '.join(args[:2])} exited {done.returncode}: "
                              f"{(done.stderr or done.stdout).strip()}")
        return done.stdout

    def is_leader(self) -> bool:
        return self._run("node", "inspect", "self", "--format", "{{.ManagerStatus.Leader}}").strip() == "true"

    def nodes(self) -> list[dict]:
        ids = self._run("node", "ls", "-q").split()
        if not ids:
            return []
        try:
            nodes = json.loads(self._run("node", "inspect", *ids))
        except ValueError as e:
            raise EngineError(f"docker node inspect printed no JSON: {e}")
        if not isinstance(nodes, list) or not all(isinstance(n, dict) and "ID" in n for n in nodes):
            raise EngineError("docker node inspect printed something other than a list of nodes")
        return nodes

    def update(self, args: tuple[str, ...]) -> None:
        self._run("node", "update", *args)


def reconcile(engine: Engine, now: int, log) -> dict:
    """One round; errors are reported, not raised, so the loop goes on."""
    report = {"leader": None, "nodes": 0, "actions": [], "errors": []}
    try:
        report["leader"] = engine.is_leader()
        nodes = engine.nodes() if report["leader"] else []
    except EngineError as e:
        report["errors"].append(str(e))
        return report
    report["nodes"] = len(nodes)
    for action in decide(nodes, report["leader"], now):
        try:
            engine.update(action.args)
        except EngineError as e:
            report["errors"].append(f"node {action.node} ({action.node_id[:12]}): {action.action} failed: {e}")
            continue
        log(f"node {action.node} ({action.node_id[:12]}): {'drained' if action.action == 'drain' else 'reactivated'}: "
            f"{action.reason}")
        report["actions"].append({**asdict(action), "args": list(action.args)})
    return report


def _interval(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value < 86400:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds > 0")
    return value


def parse_args(argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="On the swarm leader, drain nodes whose gpu-swarm.condition engine label is unhealthy or "
                    "reclaim, and make the ones it drained active again once healthy. Exit 0 ok, 1 (--once) "
                    "engine errors, 2 bad input.")
    parser.add_argument("--interval", type=_interval, default=2.0, help="seconds between rounds (default 2)")
    parser.add_argument("--docker", default="docker", metavar="PATH", help="the docker CLI (default docker)")
    parser.add_argument("--once", action="store_true", help="one round, print its report, exit")
    parser.add_argument("--json", action="store_true", help="print reports as JSON lines (log lines go to stderr)")
    return parser.parse_args(argv)


def main(argv=None, clock=time.time, sleep=time.sleep) -> int:
    args = parse_args(argv)
    engine, was_leader, last_errors = Engine(args.docker), None, None

    def log(message: str) -> None:
        print(message, file=sys.stderr if args.json else sys.stdout, flush=True)
    while True:
        report = reconcile(engine, int(clock()), log)
        if report["leader"] is not None and report["leader"] != was_leader:
            log("this manager is the swarm leader: reconciling node health" if report["leader"] else
                "this manager is not the leader: doing nothing")
            was_leader = report["leader"]
        news = report["errors"] != last_errors  # the same failure every 2 s is said once
        for error in report["errors"] if news else []:
            log(f"error: {error}; trying again in {args.interval:g}s")
        last_errors = report["errors"]
        if args.once or (args.json and (report["actions"] or (news and report["errors"]))):
            print(json.dumps(report) if args.json else
                  f"leader={report['leader']} nodes={report['nodes']} actions={len(report['actions'])} "
                  f"errors={len(report['errors'])}", flush=True)
        if args.once:
            return 1 if report["errors"] else 0
        sleep(args.interval)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(0)
