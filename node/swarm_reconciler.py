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
  gpu-swarm.drained-by=rollout or =gpu-check names, belongs to someone else; and it gives
  back no node while its software is being changed (gpu-swarm.maintenance is set);
- drains no more than --max-drained-percent of the nodes for faults at once: when every
  watcher reports a fault at the same time, the watchers are more likely wrong than the
  GPUs, and draining them all would stop every task. It says so, every round, in its log.
  Spot reclaims are not limited: those nodes go away whatever happens.
Swarm cannot withdraw one GPU from a running node, so the node is the unit.
Stdlib and its sibling contract.py only: it runs under the system python3 and talks to the docker CLI.

Exit codes: 0 done; 1 (--once only) the engine could not be asked, or an update failed;
2 bad input.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)  # the contract ships beside this file (tests load it by path)
from contract import (CONDITION_LABEL, CONDITION_REASON_LABEL, DRAINED_BY_HEALTH, DRAINED_BY_LABEL,  # noqa: E402
                      HEALTH_LABEL, HEALTH_LAST_LABEL, HEALTH_MAX_DRAINED_PERCENT_ENV, MAINTENANCE_LABEL)

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


def decide(nodes: list[dict], leader: bool, now: int, max_drained_percent: int = 100) -> list[Action]:
    """The updates to make, from `docker node inspect`'s JSON of every node; none unless leader."""
    return plan(nodes, leader, now, max_drained_percent)[0]


def plan(nodes: list[dict], leader: bool, now: int, max_drained_percent: int) -> tuple[list[Action], list[str]]:
    """decide(), and what it held back: faults drain at most max_drained_percent of the nodes
    that report a condition (at least one), counting those still drained for one. Reclaims
    always drain."""
    if not leader:
        return [], []
    back = [_reactivation(n, now) for n in nodes]
    actions = [a for a in back if a]
    watched = sum(1 for n in nodes if _engine(n).get(CONDITION_LABEL) is not None)
    still_out = sum(1 for n, a in zip(nodes, back) if not a and _spec(n).get("Availability") == "drain"
                    and (_spec(n).get("Labels") or {}).get(DRAINED_BY_LABEL) == DRAINED_BY_HEALTH
                    and not (_spec(n).get("Labels") or {}).get(HEALTH_LABEL, "").startswith("reclaim:"))
    budget = max(1, watched * max_drained_percent // 100) - still_out
    held = []
    for node in nodes:
        engine = _engine(node)
        condition = engine.get(CONDITION_LABEL)
        if condition not in DRAIN_ON or _spec(node).get("Availability") != "active":
            continue
        name, node_id = _name(node), node["ID"]
        why = f"{condition}:{sanitize(engine.get(CONDITION_REASON_LABEL, '-'))}"
        if condition != "reclaim":
            if budget <= 0:
                held.append(f"node {name} ({node_id[:12]}) reports {why} but stays active: {max_drained_percent}% "
                            f"of the watched nodes are drained for faults already ({HEALTH_MAX_DRAINED_PERCENT_ENV})")
                continue
            budget -= 1
        args = ("--availability", "drain", "--label-add", f"{DRAINED_BY_LABEL}={DRAINED_BY_HEALTH}",
                "--label-add", f"{HEALTH_LABEL}={why}", "--label-add", f"{HEALTH_LAST_LABEL}=drained:{now}:{why}",
                node_id)
        actions.append(Action(node_id, name, "drain", why, args))
    order = {n["ID"]: i for i, n in enumerate(nodes)}
    return sorted(actions, key=lambda a: order[a.node_id]), held


def _reactivation(node: dict, now: int) -> Action | None:
    labels, engine = _spec(node).get("Labels") or {}, _engine(node)
    condition = engine.get(CONDITION_LABEL)
    # Only from drain: a node someone paused (or set active) since is theirs now. Not while
    # its software is being changed: the rollout gives it back when it is done.
    if labels.get(DRAINED_BY_LABEL) != DRAINED_BY_HEALTH or _spec(node).get("Availability") != "drain" \
            or condition not in REACTIVATE_ON or MAINTENANCE_LABEL in labels:
        return None
    why = f"{condition}:{sanitize(engine.get(CONDITION_REASON_LABEL, '-'))}" if condition else "no_condition"
    # --label-rm of a label that is not there fails the whole update.
    drop = ("--label-rm", HEALTH_LABEL) if HEALTH_LABEL in labels else ()
    args = ("--availability", "active", "--label-rm", DRAINED_BY_LABEL, *drop,
            "--label-add", f"{HEALTH_LAST_LABEL}=reactivated:{now}:{why}", node["ID"])
    return Action(node["ID"], _name(node), "reactivate", why, args)


def _name(node: dict) -> str:
    return (node.get("Description") or {}).get("Hostname") or node["ID"]


def _spec(node: dict) -> dict:
    return node.get("Spec") or {}


def _engine(node: dict) -> dict:
    return ((node.get("Description") or {}).get("Engine") or {}).get("Labels") or {}


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


def reconcile(engine: Engine, now: int, log, max_drained_percent: int = 50) -> dict:
    """One round; errors are reported, not raised, so the loop goes on."""
    report = {"leader": None, "nodes": 0, "actions": [], "held": [], "errors": []}
    try:
        report["leader"] = engine.is_leader()
        nodes = engine.nodes() if report["leader"] else []
    except EngineError as e:
        report["errors"].append(str(e))
        return report
    report["nodes"] = len(nodes)
    actions, report["held"] = plan(nodes, report["leader"], now, max_drained_percent)
    for action in actions:
        try:
            engine.update(action.args)
        except EngineError as e:
            report["errors"].append(f"node {action.node} ({action.node_id[:12]}): {action.action} failed: {e}")
            continue
        log(f"node {action.node} ({action.node_id[:12]}): {'drained' if action.action == 'drain' else 'reactivated'}: "
            f"{action.reason}")
        report["actions"].append({**asdict(action), "args": list(action.args)})
    return report


def watch_node_events(docker: str, wake: threading.Event) -> None:
    """Wake the loop when the managers record a change to a node: a watcher's label arrives with the node's
    description, on the swarm agent's 20 s tick, and the drain then waits for no round of --interval. When
    the engine gives no events (restarting, too old), the rounds still run every --interval."""
    while True:
        try:
            with subprocess.Popen([docker, "events", "--filter", "type=node", "--format", "{{.Action}}"],
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) as events:
                for _ in events.stdout:
                    wake.set()
        except OSError:
            return  # no docker CLI: the rounds say so
        time.sleep(5)  # the engine went away: ask again


def _interval(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value < 86400:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds > 0")
    return value


def _percent(text: str) -> int:
    if not text.strip().isdigit() or not 1 <= int(text) <= 100:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole percentage from 1 to 100")
    return int(text)


def parse_args(argv, env=os.environ) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=f"On the swarm leader, drain nodes whose {CONDITION_LABEL} engine label is unhealthy or "
                    "reclaim, and make the ones it drained active again once healthy. Exit 0 ok, 1 (--once) "
                    "engine errors, 2 bad input.")
    parser.add_argument("--interval", type=_interval, default=2.0, help="seconds between rounds (default 2)")
    parser.add_argument("--max-drained-percent", type=_percent,
                        default=env.get(HEALTH_MAX_DRAINED_PERCENT_ENV) or "50",
                        help="most of the watched nodes drained for faults at once "
                             f"(${HEALTH_MAX_DRAINED_PERCENT_ENV}, 50)")
    parser.add_argument("--docker", default="docker", metavar="PATH", help="the docker CLI (default docker)")
    parser.add_argument("--once", action="store_true", help="one round, print its report, exit")
    parser.add_argument("--json", action="store_true", help="print reports as JSON lines (log lines go to stderr)")
    return parser.parse_args(argv)


def main(argv=None, clock=time.time, sleep=time.sleep) -> int:
    args = parse_args(argv)
    engine, was_leader, last_errors = Engine(args.docker), None, None
    wake = threading.Event()
    if not args.once and sleep is time.sleep:
        threading.Thread(target=watch_node_events, args=(args.docker, wake), daemon=True).start()
        sleep = wake.wait  # a round every --interval, or at once when a node changed

    def log(message: str) -> None:
        print(message, file=sys.stderr if args.json else sys.stdout, flush=True)
    while True:
        report = reconcile(engine, int(clock()), log, args.max_drained_percent)
        if report["leader"] is not None and report["leader"] != was_leader:
            log("this manager is the swarm leader: reconciling node health" if report["leader"] else
                "this manager is not the leader: doing nothing")
            was_leader = report["leader"]
        news = report["errors"] + report["held"] != last_errors  # the same news every 2 s is said once
        for error in report["errors"] if news else []:
            log(f"error: {error}; trying again in {args.interval:g}s")
        for held in report["held"] if news else []:
            log(f"held back: {held}")
        last_errors = report["errors"] + report["held"]
        if args.once or (args.json and (report["actions"] or (news and report["errors"]))):
            print(json.dumps(report) if args.json else
                  f"leader={report['leader']} nodes={report['nodes']} actions={len(report['actions'])} "
                  f"errors={len(report['errors'])}", flush=True)
        if args.once:
            return 1 if report["errors"] else 0
        sleep(args.interval)
        wake.clear()


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(0)
