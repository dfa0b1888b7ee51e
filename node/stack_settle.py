#!/usr/bin/env python3
"""Wait, bounded, until a stack just deployed has settled, and say how it runs, or why it will not.

The stack deploy command (swarm/stacks.py) runs it on the first manager right after
`docker stack deploy`, which returns before any task has started. It polls the local engine
until every service of the stack is settled by the rules of stack_tasks.py (beside this file):
tasks running, ended as their restart policy says, or waiting for GPUs that no task of the
cluster is about to free. It reads only the tasks that run each service's current spec (the
engine's `_up-to-date` filter, which `docker service create` uses for its own progress), so a
task of the stack's previous version is never taken for the new one.

stdout: one JSON line, last, that the program parses: per service its tasks' states, and the
tasks that wait for GPUs with the scheduler's reason. stderr: the same for people.
Exit codes: 0 settled; 1 a task was refused or keeps failing (swarm's reason, the service
named), the stack has no services, or the wait ran out (what did not settle named); 2 bad input.
Stdlib and its siblings only: it runs under the system python3.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)  # the rules and the contract ship beside this file
from contract import DOCKER_SOCKET, STACK_NAMESPACE_LABEL  # noqa: E402
from gpu_tasks import DockerUnavailable, docker_request  # noqa: E402
from stack_tasks import (converged, failing, fault_text, node_faults, outcome, releasing,  # noqa: E402
                         services_view, unsettled, waits_for_resources)

# Settled on two reads in a row: a service's tasks appear a moment after `stack deploy` returns.
CONFIRM_READS = 2


class EngineError(Exception):
    pass


def engine_socket() -> str:
    """The engine the docker CLI would talk to: DOCKER_HOST's unix socket, else dockerd's own."""
    host = os.environ.get("DOCKER_HOST", "")
    if not host:
        return DOCKER_SOCKET
    if not host.startswith("unix://"):
        raise EngineError(f"DOCKER_HOST={host} is no unix socket; run this on a manager")
    return host[len("unix://"):]


def get(sock: str, path: str, filters: dict | None = None) -> list:
    try:
        return json.loads(docker_request(sock, "GET", path, timeout=20, **({"filters": filters} if filters else {})))
    except DockerUnavailable as e:
        raise EngineError(str(e)) from None


def read(sock: str, stack: str) -> tuple[dict, bool]:
    """The stack's services with their up-to-date tasks (a view as stack_tasks.py reads it), and
    whether some task of the cluster is still releasing what it holds."""
    services = get(sock, "/services", {"label": [f"{STACK_NAMESPACE_LABEL}={stack}"]})
    ids = {s["ID"] for s in services}
    current = [t for t in get(sock, "/tasks", {"_up-to-date": ["true"]}) if t.get("ServiceID") in ids]
    nodes = get(sock, "/nodes")
    names = {n["ID"]: n["Description"]["Hostname"] for n in nodes}
    state_of = {n["ID"]: n["Status"]["State"] for n in nodes}
    ready = {node_id for node_id, state in state_of.items() if state == "ready"}
    freeing = bool(releasing(get(sock, "/tasks"), ready))
    no_gpus = lambda task: ([], [], "scheduler")  # noqa: E731 (which GPUs is the rehearsal's view)
    return {"services": services_view(services, current, no_gpus, names, state_of, node_faults(nodes))}, freeing


def report(stack: str, view: dict, *, settled: bool, seconds: float, problems: list[str]) -> dict:
    return {
        "stack": stack,
        "settled": settled,
        "seconds": round(seconds, 1),
        "services": [{"name": s["name"], "mode": s["mode"], "replicas": s["replicas"],
                      "outcome": line.split(": ", 1)[1],
                      "tasks": [{"slot": t["slot"], "node": t["node"], "state": t["state"],
                                 "desired_state": t["desired_state"], "reason": t["reason"],
                                 "exit_code": t["exit_code"],
                                 "hardware": (t.get("last_run") or {}).get("hardware")} for t in s["tasks"]]}
                     for s, line in zip(view["services"], outcome(view))],
        "waiting": [{"service": s["name"], "slot": t["slot"], "reason": t["reason"]}
                    for s in view["services"] for t in s["tasks"] if waits_for_resources(t)],
        # Tasks whose last run failed on a GPU the node's health watcher marked faulty: the hardware did it.
        "hardware_failures": [{"service": s["name"], "slot": t["slot"], "node": t["last_run"]["node"], **fault}
                              for s in view["services"] for t in s["tasks"]
                              if (fault := (t.get("last_run") or {}).get("hardware"))],
        "problems": problems,
    }


def settle(sock: str, stack: str, timeout: float, interval: float, say=lambda line: None) -> tuple[int, dict]:
    """(exit code, report): poll until the stack is settled, fails, or the timeout passes."""
    started = time.monotonic()
    deadline = started + timeout
    view, reads, last_error = {"services": []}, 0, ""
    while True:
        try:
            view, freeing = read(sock, stack)
            last_error = ""
        except EngineError as e:  # an engine that restarts, a leader election: ask again until the deadline
            freeing, last_error = True, str(e)
        took = time.monotonic() - started
        if not last_error and not view["services"]:
            why = (f"stack {stack} has no services after `docker stack deploy`: this swarm is not the one "
                   "the stack was deployed to, or its compose file lists none")
            return 1, report(stack, view, settled=False, seconds=took, problems=[why])
        problems = [f"stack {stack}: {p}" for p in failing(view)] if not last_error else []
        if problems:
            return 1, report(stack, view, settled=False, seconds=took, problems=problems)
        reads = reads + 1 if not last_error and converged(view, freeing) else 0
        if reads >= CONFIRM_READS:
            return 0, report(stack, view, settled=True, seconds=took, problems=[])
        if time.monotonic() >= deadline:
            what = [last_error] if last_error else unsettled(view, freeing)
            why = f"stack {stack} did not settle in {timeout:.0f} s: " + "; ".join(what)
            return 1, report(stack, view, settled=False, seconds=took, problems=[why])
        time.sleep(interval)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stack", required=True, help="the stack's name, as `docker stack deploy` got it")
    parser.add_argument("--timeout", type=float, default=600, metavar="S",
                        help="give up after this many seconds (the stack's waitSeconds)")
    parser.add_argument("--interval", type=float, default=0.25, metavar="S", help="seconds between reads")
    args = parser.parse_args(argv)
    if args.timeout <= 0 or args.interval <= 0:
        parser.error("--timeout and --interval must be more than 0")
    try:
        sock = engine_socket()
    except EngineError as e:
        print(f"gpu-swarm: {e}", file=sys.stderr)
        return 2
    code, result = settle(sock, args.stack, args.timeout, args.interval)
    for svc in result["services"]:
        print(f"  {svc['name']}: {svc['outcome']}", file=sys.stderr)
    for task in result["waiting"]:
        print(f"  {task['service']} task {task['slot']} waits: {task['reason']}", file=sys.stderr)
    for task in result["hardware_failures"]:
        print(f"  {task['service']} task {task['slot']} failed {fault_text(task, task['node'])}", file=sys.stderr)
    if code:
        print("gpu-swarm: " + "\n".join(result["problems"]), file=sys.stderr)
        print("Look with `docker service ps --no-trunc <service>` on a manager; fix the stack or the nodes and "
              "run `pulumi up` again.", file=sys.stderr)
    else:
        print(f"stack {args.stack} settled in {result['seconds']} s", file=sys.stderr)
    print(json.dumps(result, sort_keys=True))
    return code


if __name__ == "__main__":
    sys.exit(main())
