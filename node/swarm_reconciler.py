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
The engine labels reach the managers with the node's description, on the swarm agent's 20 s tick.
A task's state reaches them at once, so the reconciler also keeps a global service, the sentinel
(SENTINEL_SERVICE, no GPU), with one task on each worker: the watcher stops its node's task with
SENTINEL_EXIT on a fault, and the next round drains that node as unhealthy:sentinel, marking it
gpu-swarm.health.signalled. It gives no such node back on the old labels that still say healthy:
only once they change (or after SIGNAL_HOLD_S, if they never do), and it writes the labels' reason
into gpu-swarm.health once they arrive.
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
from contract import (CHECK_IMAGE, CONDITION_LABEL, CONDITION_REASON_LABEL, CONDITION_SINCE_LABEL,  # noqa: E402
                      DRAIN_CONDITIONS, DRAINED_BY_HEALTH, DRAINED_BY_LABEL, HEALTH_LABEL, HEALTH_LAST_LABEL,
                      HEALTH_MAX_DRAINED_PERCENT_ENV, MAINTENANCE_LABEL, SENTINEL_EXIT, SENTINEL_SERVICE,
                      SENTINEL_SIGNAL, SIGNALLED_LABEL)

# None: no condition reported. An unknown value is not evidence either way: nothing happens.
REACTIVATE_ON = ("healthy", "degraded", None)
_REASON_BAD = re.compile(r"[^A-Za-z0-9._:/-]")
SENTINEL_REASON = "sentinel"  # the condition's reason while only the sentinel has spoken
SIGNAL_HOLD_S = 120  # six of the agent's ticks: labels that never change by then never will
# Busybox sh in CHECK_IMAGE: wait returns as soon as a trapped signal comes; TERM is swarm stopping it.
SENTINEL_COMMAND = (f'trap "exit {SENTINEL_EXIT}" {SENTINEL_SIGNAL}; trap "exit 0" TERM; '
                    'while :; do sleep 3600 & wait $!; done')
_SENTINEL_FAILED = re.compile(rf"non-zero exit \({SENTINEL_EXIT}\)")


@dataclass(frozen=True)
class Action:
    node_id: str
    node: str  # the hostname, for people
    action: str  # "drain", "reactivate", or "explain" (the labels' reason for a drain on the sentinel)
    reason: str
    args: tuple[str, ...]  # for `docker node update`, the node ID last


def sanitize(text: str) -> str:
    return _REASON_BAD.sub("_", str(text).strip())[:120] or "-"


def decide(nodes: list[dict], leader: bool, now: int, max_drained_percent: int = 100,
           signalled: frozenset[str] = frozenset()) -> list[Action]:
    """The updates to make, from `docker node inspect`'s JSON of every node; none unless leader.
    signalled: the IDs of nodes whose sentinel task just exited SENTINEL_EXIT."""
    return plan(nodes, leader, now, max_drained_percent, signalled)[0]


def plan(nodes: list[dict], leader: bool, now: int, max_drained_percent: int,
         signalled: frozenset[str] = frozenset()) -> tuple[list[Action], list[str]]:
    """decide(), and what it held back: faults drain at most max_drained_percent of the nodes
    that report a condition (at least one), counting those still drained for one. Reclaims
    always drain."""
    if not leader:
        return [], []
    back = [_reactivation(n, now) for n in nodes]
    actions = [a for a in back if a] + [a for a in map(lambda n: _caught_up(n, now), nodes) if a]
    watched = sum(1 for n in nodes if _engine(n).get(CONDITION_LABEL) is not None)
    still_out = sum(1 for n, a in zip(nodes, back) if not a and _spec(n).get("Availability") == "drain"
                    and (_spec(n).get("Labels") or {}).get(DRAINED_BY_LABEL) == DRAINED_BY_HEALTH
                    and not (_spec(n).get("Labels") or {}).get(HEALTH_LABEL, "").startswith("reclaim:"))
    budget = max(1, watched * max_drained_percent // 100) - still_out
    held = []
    for node in nodes:
        engine = _engine(node)
        condition, reason = engine.get(CONDITION_LABEL), engine.get(CONDITION_REASON_LABEL, "-")
        early = condition not in DRAIN_CONDITIONS and node["ID"] in signalled
        if early:  # the sentinel spoke; the labels that say why are on their way
            condition, reason = "unhealthy", SENTINEL_REASON
        if condition not in DRAIN_CONDITIONS or _spec(node).get("Availability") != "active":
            continue
        name, node_id = _name(node), node["ID"]
        why = f"{condition}:{sanitize(reason)}"
        if condition != "reclaim":
            if budget <= 0:
                held.append(f"node {name} ({node_id[:12]}) reports {why} but stays active: {max_drained_percent}% "
                            f"of the watched nodes are drained for faults already ({HEALTH_MAX_DRAINED_PERCENT_ENV})")
                continue
            budget -= 1
        args = ("--availability", "drain", "--label-add", f"{DRAINED_BY_LABEL}={DRAINED_BY_HEALTH}",
                "--label-add", f"{HEALTH_LABEL}={why}", "--label-add", f"{HEALTH_LAST_LABEL}=drained:{now}:{why}",
                *(("--label-add", f"{SIGNALLED_LABEL}={now}") if early else ()), node_id)
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
    if _held_for_labels(labels, engine, now):
        return None
    why = f"{condition}:{sanitize(engine.get(CONDITION_REASON_LABEL, '-'))}" if condition else "no_condition"
    # --label-rm of a label that is not there fails the whole update.
    drop = tuple(arg for label in (HEALTH_LABEL, SIGNALLED_LABEL) if label in labels for arg in ("--label-rm", label))
    args = ("--availability", "active", "--label-rm", DRAINED_BY_LABEL, *drop,
            "--label-add", f"{HEALTH_LAST_LABEL}=reactivated:{now}:{why}", node["ID"])
    return Action(node["ID"], _name(node), "reactivate", why, args)


def _held_for_labels(labels: dict, engine: dict, now: int) -> bool:
    """A node drained on its sentinel stays drained while its labels are older than the signal: they
    still say what the node was before the fault."""
    signalled = _int(labels.get(SIGNALLED_LABEL))
    if signalled is None or now - signalled >= SIGNAL_HOLD_S:
        return False
    since = _int(engine.get(CONDITION_SINCE_LABEL))
    return since is None or since < signalled


def _caught_up(node: dict, now: int) -> Action | None:
    """A node drained on its sentinel whose labels now say why: the reason replaces "sentinel"."""
    labels, engine = _spec(node).get("Labels") or {}, _engine(node)
    condition = engine.get(CONDITION_LABEL)
    if SIGNALLED_LABEL not in labels or labels.get(DRAINED_BY_LABEL) != DRAINED_BY_HEALTH or condition not in DRAIN_CONDITIONS:
        return None
    why = f"{condition}:{sanitize(engine.get(CONDITION_REASON_LABEL, '-'))}"
    return Action(node["ID"], _name(node), "explain", why,
                  ("--label-add", f"{HEALTH_LABEL}={why}", "--label-rm", SIGNALLED_LABEL, node["ID"]))


def _int(text) -> int | None:
    return int(text) if isinstance(text, str) and text.isdigit() else None


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

    def __init__(self, docker: str, timeout: float = 30, sentinel_image: str = CHECK_IMAGE):
        self.docker, self.timeout, self.sentinel_image = docker, timeout, sentinel_image

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

    def sentinel_tasks(self) -> list[tuple[str, str, str]] | None:
        """(task ID, node hostname, error) of every sentinel task swarm keeps; None: no sentinel service."""
        try:
            out = self._run("service", "ps", SENTINEL_SERVICE, "--no-trunc", "--format", "{{.ID}}\t{{.Node}}\t{{.Error}}")
        except EngineError as e:
            if "no such service" in str(e).lower():
                return None
            raise
        return [tuple((line.split("\t") + ["", ""])[:3]) for line in out.splitlines() if line.strip()]

    def create_sentinel(self) -> None:
        self._run(*sentinel_service(self.sentinel_image))


def sentinel_service(image: str, constraint: str = "node.role==worker") -> tuple[str, ...]:
    """The docker arguments that create the sentinel service (bench/gpu_e2e.py runs them on its one-node swarm)."""
    # No GPU is reserved, so the runtime guard gives it none; it needs no capability and writes
    # nothing. The image is built on each GPU node and is in no registry, so it is never resolved.
    # Restarted at once, for the next fault.
    return ("service", "create", "--detach", "--name", SENTINEL_SERVICE, "--mode", "global", "--no-resolve-image",
            "--constraint", constraint, "--restart-condition", "any", "--restart-delay", "1s",
            "--stop-grace-period", "2s", "--limit-memory", "32M", "--cap-drop", "ALL", "--read-only",
            image, "sh", "-c", SENTINEL_COMMAND)


class Sentinel:
    """Which nodes' sentinel tasks have newly exited SENTINEL_EXIT. The first look only learns the ones
    there are: a reconciler that just started, or just became leader, acts on no old signal."""

    def __init__(self):
        self.seen: set[str] | None = None

    def signalled(self, engine: Engine, nodes: list[dict], log) -> frozenset[str]:
        tasks = engine.sentinel_tasks()
        if tasks is None:
            engine.create_sentinel()
            log(f"created the {SENTINEL_SERVICE} service: a task on each worker, for its watcher to stop on a fault")
            tasks = []
        failed = {task: host for task, host, error in tasks if _SENTINEL_FAILED.search(error)}
        new = set(failed) - self.seen if self.seen is not None else set()
        self.seen = set(failed)  # swarm's history drops old tasks; an ID it dropped never comes back
        by_host = {_name(n): n["ID"] for n in nodes}
        return frozenset(by_host[failed[task]] for task in new if failed[task] in by_host)

    def forget(self) -> None:
        self.seen = None


def reconcile(engine: Engine, now: int, log, max_drained_percent: int = 50, sentinel: Sentinel | None = None) -> dict:
    """One round; errors are reported, not raised, so the loop goes on."""
    report = {"leader": None, "nodes": 0, "actions": [], "held": [], "errors": []}
    try:
        report["leader"] = engine.is_leader()
        nodes = engine.nodes() if report["leader"] else []
    except EngineError as e:
        report["errors"].append(str(e))
        return report
    report["nodes"] = len(nodes)
    signalled = frozenset()
    if sentinel and not report["leader"]:
        sentinel.forget()
    elif sentinel:
        try:
            signalled = sentinel.signalled(engine, nodes, log)
        except EngineError as e:  # the labels still drain, on the agent's tick
            report["errors"].append(f"sentinel: {e}")
    actions, report["held"] = plan(nodes, report["leader"], now, max_drained_percent, signalled)
    for action in actions:
        try:
            engine.update(action.args)
        except EngineError as e:
            report["errors"].append(f"node {action.node} ({action.node_id[:12]}): {action.action} failed: {e}")
            continue
        done = {"drain": "drained", "reactivate": "reactivated", "explain": "drained earlier on its sentinel"}
        log(f"node {action.node} ({action.node_id[:12]}): {done[action.action]}: {action.reason}")
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
    parser.add_argument("--sentinel-image", default=CHECK_IMAGE, metavar="IMAGE",
                        help=f"the sentinel's image, on every worker, with busybox sh (default {CHECK_IMAGE})")
    parser.add_argument("--once", action="store_true", help="one round, print its report, exit")
    parser.add_argument("--json", action="store_true", help="print reports as JSON lines (log lines go to stderr)")
    return parser.parse_args(argv)


def main(argv=None, clock=time.time, sleep=time.sleep) -> int:
    args = parse_args(argv)
    # --once looks at the sentinel no more than once, which only learns what is there: it leaves it out.
    engine, was_leader, last_errors, sentinel = Engine(args.docker, sentinel_image=args.sentinel_image), None, None, None if args.once else Sentinel()
    wake = threading.Event()
    if not args.once and sleep is time.sleep:
        threading.Thread(target=watch_node_events, args=(args.docker, wake), daemon=True).start()
        sleep = wake.wait  # a round every --interval, or at once when a node changed

    def log(message: str) -> None:
        print(message, file=sys.stderr if args.json else sys.stdout, flush=True)
    while True:
        report = reconcile(engine, int(clock()), log, args.max_drained_percent, sentinel)
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
