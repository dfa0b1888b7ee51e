"""How a stack's tasks are doing, slot by slot: running, waiting, ended, restarting, or failing for good.

Swarm keeps a few past tasks per slot (a replica's number; a node, for a global service).
Reading them, and not only the tasks it still wants running, is how a task that ended is
told from one that never ran: batch jobs and smoke tests end, and swarm restarts them under
the default restart policy. Pure functions over the Engine API's documents, stdlib only: the
deploy command's waiter on the manager (stack_settle.py, beside this file) runs them, and
the rehearsal and the tests load this very file by path, so "settled" has one definition.
"""
from __future__ import annotations

import os
import re
import sys
import time
from datetime import datetime, timezone

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.append(_HERE)  # the contract ships beside this file; appended, so it shadows nothing of a caller's
from contract import CONDITION_LABEL, CONDITION_REASON_LABEL, CONDITION_SINCE_LABEL, HEALTH_LAST_LABEL  # noqa: E402


# A task's process ended by itself, or never started (rejected): swarm may start another in its slot.
ENDED = ("complete", "failed", "rejected")
# Swarm stopped the task itself (an update, a drain, a scale-down): not something the task did.
STOPPED = ("shutdown", "remove", "orphaned")
# A slot whose tasks failed this many times in a row, none completing, while swarm keeps
# restarting them, is a crash loop: more waiting only repeats it. Swarm's default restart
# delay is 5 s, so this is seen about 15 s after the first failure.
CRASH_LOOP_FAILURES = 3
# A run that failed because its engine lost the container (dockerd restarted while it started: a
# node's boot restarts it once the agent has written daemon.json) is the node's doing, not the
# task's: it is counted as lost, never toward a crash loop.
LOST_CONTAINER = "No such container"
# A task counts as running once it has run this long: one that exits at once, as a smoke test
# does (`nvidia-smi -L` takes 40 ms on a GPU node), is then seen ending instead of being
# reported as running. `docker service create` waits 5 s for the same reason; each 0.1 s here
# is 0.1 s more for every `up`, so half a second.
RUNNING_STABLE_S = 0.5
# A task in one of these states holds its node's resources, GPUs among them: swarmkit's
# scheduler frees them only once the task's state is past running.
HOLDING = ("assigned", "accepted", "preparing", "ready", "starting", "running")
# The scheduler's reason for a task that waits for a free GPU (or any reserved resource).
NO_RESOURCES = "insufficient resources"
# A run that never started because its runtime refused it (the guard, an unsatisfied `cuda>=`
# requirement): dockerd's words. Swarm's own refusals (a missing bind source, an image it cannot
# pull) end the task as "rejected".
START_FAILED = "starting container failed"
# An update swarm gave up on, as the service's update_config.failure_action said.
UPDATE_GAVE_UP = ("paused", "rollback_paused", "rollback_completed")
# A run that failed at most this long before its GPU was marked faulty, or any time after, failed on
# faulty hardware: the task dies with the XID, and the watcher notes the fault a moment later (it
# checks every second or so; NVML's events come at once). A run that failed earlier than that had a
# GPU that was fine, as far as anyone knows.
FAULT_SLACK_S = 30
# The watcher's reason for an unhealthy GPU: what happened, then the GPU (xid_79_on_GPU-..., ecc_double_on_...).
_FAULT_REASON = re.compile(r"(?P<what>.+?)_on_(?P<gpu>(?:GPU|MIG)-\S+)")
_SLOT = re.compile(r"(?P<gpu>(?:GPU|MIG)-.+)-s[0-9]+")


def node_faults(nodes_docs: list[dict]) -> dict[str, dict]:
    """Per node ID, the GPU its health watcher marks unhealthy and since when: from the watcher's engine
    labels, else from the reconciler's last drain (node label), which tells the same once the manager
    has seen it. {"gpu", "xid" (None for other faults), "reason", "since"}."""
    out = {}
    for node in nodes_docs:
        engine = ((node.get("Description") or {}).get("Engine") or {}).get("Labels") or {}
        last = ((node.get("Spec") or {}).get("Labels") or {}).get(HEALTH_LAST_LABEL, "")
        fault = None
        if engine.get(CONDITION_LABEL) == "unhealthy" and engine.get(CONDITION_SINCE_LABEL, "").isdigit():
            fault = _fault(engine.get(CONDITION_REASON_LABEL, ""), int(engine[CONDITION_SINCE_LABEL]))
        match = re.fullmatch(r"drained:(\d+):unhealthy:(.+)", last)
        if fault is None and match:
            fault = _fault(match[2], int(match[1]))
        if fault:
            out[node["ID"]] = fault
    return out


def _fault(reason: str, since: int) -> dict | None:
    match = _FAULT_REASON.fullmatch(reason)
    if not match:
        return None
    xid = re.fullmatch(r"xid_(\d+)", match["what"])
    return {"gpu": match["gpu"], "xid": int(xid[1]) if xid else None, "reason": reason, "since": since}


def hardware_fault(run: dict, faults: dict[str, dict]) -> dict | None:
    """The fault of the GPU a failed run held, if its node's watcher marked that GPU faulty when the run
    failed (see FAULT_SLACK_S); None for a run that completed, was stopped by swarm, or lost by the engine."""
    if run["Status"]["State"] in ("complete", *STOPPED) or _lost(run):
        return None
    fault = faults.get(run.get("NodeID", ""))
    ended = _epoch(run["Status"].get("Timestamp", ""))
    if fault is None or ended is None or ended < fault["since"] - FAULT_SLACK_S:
        return None
    # What the scheduler gave the run: swarmkit's AssignedGenericResources, named GenericResources by the Engine API.
    values = [r.get("NamedResourceSpec", {}).get("Value", "") for r in run.get("GenericResources") or []]
    held = {slot["gpu"] if (slot := _SLOT.fullmatch(v)) else v for v in values}  # a slot counts as its GPU
    return fault if fault["gpu"] in held else None


def fault_text(fault: dict, node: str = "") -> str:
    """How a run's hardware fault reads for people: the GPU (of node), and the XID when there is one."""
    what = f"XID {fault['xid']}" if fault["xid"] is not None else fault["reason"].rsplit("_on_", 1)[0]
    where = f" of {node}" if node else ""
    return f"on GPU {fault['gpu']}{where}, which its node's health watcher marked faulty ({what})"


def services_view(services_docs: list[dict], tasks_docs: list[dict], gpus_of, names_by_id: dict,
                  state_of: dict, faults: dict | None = None) -> list[dict]:
    """Every service with one entry per slot (a replica's number; a node, for a global service):
    its newest task, and what the slot's tasks that ended did. gpus_of, names_by_id, state_of: see
    task_view; faults: node_faults() of the nodes, which names the hardware of a run that failed on it."""
    by_service: dict[str, list[dict]] = {}
    for task in tasks_docs:
        by_service.setdefault(task.get("ServiceID", ""), []).append(task)
    services = []
    for svc in services_docs:
        mode = svc["Spec"].get("Mode", {})
        tasks = [task_view(group, gpus_of, names_by_id, state_of, faults or {})
                 for group in slots(svc, by_service.get(svc["ID"], []))]
        replicated = mode.get("Replicated")
        job = mode.get("ReplicatedJob")
        update = svc.get("UpdateStatus") or {}
        services.append({
            "name": svc["Spec"]["Name"],
            "mode": ("replicated" if replicated is not None else "replicated-job" if job is not None
                     else "global-job" if "GlobalJob" in mode else "global"),
            "replicas": (replicated.get("Replicas", 1) if replicated is not None
                         else job.get("TotalCompletions", 1) if job is not None else None),
            **({"max_concurrent": job.get("MaxConcurrent", 1)} if job is not None else {}),
            "update": {"state": update.get("State", ""), "message": update.get("Message", "")},
            "tasks": sorted(tasks, key=lambda t: (t["slot"], t["node"])),
        })
    return sorted(services, key=lambda s: s["name"])


def slots(svc: dict, tasks: list[dict]) -> list[list[dict]]:
    """The service's tasks grouped by slot, oldest first; slots no task is wanted in are left out."""
    mode = svc["Spec"].get("Mode", {})
    per_node = "Global" in mode or "GlobalJob" in mode
    iteration = ((svc.get("JobStatus") or {}).get("JobIteration") or {}).get("Index", 0)
    groups: dict = {}
    for task in tasks:
        if task.get("DesiredState") == "remove":
            continue  # scaled away, or the service is being removed
        if "JobIteration" in task and (task["JobIteration"] or {}).get("Index", 0) != iteration:
            continue  # a run of the job before its last update
        groups.setdefault(task.get("NodeID", "") if per_node else task.get("Slot", 0), []).append(task)
    found = []
    for group in groups.values():
        group.sort(key=_created)
        newest = group[-1]
        if newest["Status"]["State"] in STOPPED and newest.get("DesiredState") in STOPPED:
            continue  # swarm stopped it and started none in its place (a global task on a drained node)
        found.append(group)
    return found


def _created(task: dict) -> tuple:
    match = re.match(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(\.\d+)?", task.get("CreatedAt") or "")
    # Docker trims trailing zeros of the fraction, so the text alone does not sort.
    return (match[1], float(match[2] or 0)) if match else ("", 0.0), task.get("Version", {}).get("Index", 0)


def task_view(group: list[dict], gpus_of, names_by_id: dict, state_of: dict, faults: dict | None = None) -> dict:
    """What a slot shows: its newest task, with the state, exit code and GPUs of its last run that ended.

    gpus_of(task) -> (GPUs, slots of shared GPUs, where they were read); names_by_id and
    state_of map node IDs to names and to ready/down.
    """
    task = group[-1]
    status = task["Status"]
    node_id = task.get("NodeID", "")
    state = status["State"]
    gpus, slots, source = gpus_of(task)
    if node_id and state_of.get(node_id) == "down" and state == "running":
        state = "unknown"  # its node is down: the manager has not rescheduled it yet
    reason = status.get("Err", "")
    runs = [t for t in group if t["Status"]["State"] in ENDED]
    last = runs[-1] if runs else None
    last_gpus = gpus if last is task else gpus_of(last)[0] if last else []
    return {
        "slot": task.get("Slot", 0),
        "node": names_by_id.get(node_id, ""),
        "state": state,
        "desired_state": task.get("DesiredState", ""),
        "gpus": gpus,
        "slots": slots,
        "gpus_from": source,
        "reason": reason,
        "error": reason,  # the old name of "reason"
        "reason_age_s": round(_age(status.get("Timestamp", "")) or 0, 1) if reason else None,
        "state_age_s": round(_age(status.get("Timestamp", "")) or 0, 1),  # since the task entered its state
        # The task ended and swarm will start none in its place (restart_policy none, on-failure
        # after a success or its last attempt, a job's completion): it holds no GPU any more.
        "ended": state in ENDED and task.get("DesiredState") in ("shutdown", "complete"),
        "exit_code": _exit_code(last) if last else None,
        "last_run": None if last is None else {
            "state": last["Status"]["State"], "exit_code": _exit_code(last), "error": last["Status"].get("Err", ""),
            "node": names_by_id.get(last.get("NodeID", ""), ""), "gpus": last_gpus,
            "age_s": round(_age(last["Status"].get("Timestamp", "")) or 0, 1),
            "hardware": hardware_fault(last, faults or {})},
        # Of the runs swarm still remembers (its task history keeps the last few per slot).
        "runs": {"completed": sum(t["Status"]["State"] == "complete" for t in runs),
                 "failed": sum(t["Status"]["State"] != "complete" and not _lost(t) for t in runs),
                 "lost": sum(_lost(t) for t in runs)},
    }


def _lost(task: dict) -> bool:
    return task["Status"]["State"] != "complete" and LOST_CONTAINER in task["Status"].get("Err", "")


def _exit_code(task: dict) -> int | None:
    return (task["Status"].get("ContainerStatus") or {}).get("ExitCode")


def _age(timestamp: str) -> float | None:
    """Seconds since a Docker timestamp such as 2026-11-22T23:08:24.123456789Z."""
    when = _epoch(timestamp)
    return None if when is None else max(0.0, time.time() - when)


def _epoch(timestamp: str) -> float | None:
    """A Docker timestamp such as 2026-11-22T23:08:24.123456789Z as Unix time."""
    match = re.match(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(\.\d+)?Z$", timestamp or "")
    if not match:
        return None
    when = datetime.strptime(match[1], "%Y-%m-%dT%H:%M:%S").replace(tzinfo=timezone.utc)
    return when.timestamp() + float(match[2] or 0)


def settled(task: dict, freeing: bool = False) -> bool:
    """A task whose state is what its stack will show until something changes: running (for
    RUNNING_STABLE_S at least); pending for a reason the scheduler gave (no free GPU); ended
    for good; or restarting after it completed, as swarm restarts a task that exits 0 under
    the default restart policy.

    freeing: some task of the cluster is still releasing what it holds (releasing()). A task
    waiting for resources then is not settled: it may get them in a moment, and only then
    show whether it runs (a swap of stacks frees the old stack's GPUs while the new one waits).
    """
    running = task["state"] == "running" and task.get("state_age_s", RUNNING_STABLE_S) >= RUNNING_STABLE_S
    waiting = task["state"] == "pending" and bool(task["reason"]) and not (freeing and waits_for_resources(task))
    return running or waiting or task.get("ended", False) or task.get("runs", {}).get("completed", 0) > 0


def waits_for_resources(task: dict) -> bool:
    """Pending because no node has the resources it reserves free: for us, a GPU."""
    return task["state"] == "pending" and NO_RESOURCES in task.get("reason", "")


def converged(view: dict, freeing: bool = False) -> bool:
    """Every wanted task is settled: running, pending for a reason, ended, or restarting after completing."""
    for svc in view["services"]:
        tasks = svc["tasks"]
        if svc["replicas"] is not None and len(tasks) < _wanted(svc):
            return False
        if not all(settled(t, freeing) for t in tasks):
            return False
    return True


def releasing(tasks_docs: list[dict], ready_nodes: set[str]) -> list[dict]:
    """The tasks swarm is stopping (an update, a removed stack or service, a scale-down) that still
    hold their node's resources. Those on a node that is not ready free nothing anyone can use."""
    return [t for t in tasks_docs if t.get("DesiredState") in ("shutdown", "remove")
            and t["Status"]["State"] in HOLDING and t.get("NodeID") in ready_nodes]


def unsettled(view: dict, freeing: bool = False) -> list[str]:
    """What keeps converged() false, one line per service or task, for a timeout's message."""
    out = []
    for svc in view["services"]:
        if svc["replicas"] is not None and len(svc["tasks"]) < _wanted(svc):
            out.append(f"{svc['name']}: {len(svc['tasks'])} of {_wanted(svc)} tasks made")
        for t in svc["tasks"]:
            if not settled(t, freeing):
                why = f" ({t['reason']})" if t["reason"] else ""
                still = ", while other tasks still release theirs" if freeing and waits_for_resources(t) else ""
                out.append(f"{svc['name']} task {t['slot']}: {t['state']}{why}{still}")
    return out


def failing(view: dict) -> list[str]:
    """Why the stacks will not settle by waiting: a crash loop (stuck()), a task swarm or its
    runtime refused that swarm will not start again, an update swarm gave up on."""
    out = stuck(view)
    for svc in view["services"]:
        for t in svc["tasks"]:
            run = t.get("last_run") or {}
            if t.get("ended") and run and run["state"] != "complete" and _never_started(run):
                out.append(f"{svc['name']} task {t['slot']} was {run['state']} and swarm will not start it "
                           f"again: {run['error']}"
                           + (f" ({fault_text(run['hardware'])})" if run.get("hardware") else ""))
        update = svc.get("update") or {}
        if update.get("state") in UPDATE_GAVE_UP:
            out.append(f"{svc['name']}: update {update['state'].replace('_', ' ')}: {update.get('message', '')}")
    return out


def _never_started(run: dict) -> bool:
    return run["state"] == "rejected" or START_FAILED in run.get("error", "")


def _wanted(svc: dict) -> int:
    """The tasks a service has once swarm has made them all. A job runs max_concurrent at a time, and
    makes the next one as one completes, so it has fewer than its completions until near its end."""
    if svc.get("mode") != "replicated-job":
        return svc["replicas"]
    done = sum(t.get("ended", False) and t["state"] == "complete" for t in svc["tasks"])
    return min(svc["replicas"], svc.get("max_concurrent", 1) + done)


def stuck(view: dict) -> list[str]:
    """The tasks that cannot converge: failing over and over, never completing, while swarm restarts them.
    Its next try waiting for a GPU changes nothing: the tries before it had one."""
    out = []
    for svc in view["services"]:
        for t in svc["tasks"]:
            runs = t.get("runs", {})
            restarting = not t.get("ended") and not (t["state"] == "running" and settled(t))
            if restarting and runs.get("completed", 0) == 0 and runs.get("failed", 0) >= CRASH_LOOP_FAILURES:
                out.append(f"{svc['name']} task {t['slot']} failed {runs['failed']} times and never completed "
                           f"({_last(t)}); swarm keeps restarting it")
    return out


def _last(task: dict) -> str:
    run = task.get("last_run") or {}
    text = run.get("state", task["state"])
    if run.get("exit_code") is not None and text != "rejected":  # a rejected task ran nothing: its 0 means nothing
        text += f", exit {run['exit_code']}"
    if run.get("error"):
        text += f": {run['error']}"
    if run.get("hardware"):
        text += f", {fault_text(run['hardware'])}"
    return text


def outcome(view: dict) -> list[str]:
    """One line per service: how many tasks run, wait, completed, failed (with exit codes), restart."""
    lines = []
    for svc in view["services"]:
        counts: dict[str, int] = {}
        for t in svc["tasks"]:
            if t.get("ended"):
                code = (t.get("last_run") or {}).get("exit_code")
                what = "completed" if t["state"] == "complete" else f"failed (exit {code})" if code else t["state"]

            elif t["state"] == "running":
                what = "running"
            elif t["state"] == "pending" and t["reason"]:
                what = "waiting for resources" if "insufficient resources" in t["reason"] else "pending"
            elif t.get("runs", {}).get("completed"):
                what = "completed, restarting"
            else:
                what = t["state"]
            fault = (t.get("last_run") or {}).get("hardware")
            if fault:  # the run that ended last failed on faulty hardware: said whatever the slot does now
                what += f" ({'its last run ' if not t.get('ended') else ''}failed {fault_text(fault)})"
            counts[what] = counts.get(what, 0) + 1
        # In a fixed order, not the tasks': which slot got the GPU must not change the line (an
        # output of `up` that changed with it would show a diff where nothing changed).
        parts = sorted(counts.items(), key=lambda item: (_OUTCOME_ORDER.get(item[0].split(" (")[0], len(_OUTCOME_ORDER)),
                                                         item[0]))
        lines.append(f"{svc['name']}: " + (", ".join(f"{n} {what}" for what, n in parts) or "no tasks"))
    return lines


_OUTCOME_ORDER = {what: i for i, what in enumerate(
    ("running", "completed", "completed, restarting", "waiting for resources", "pending"))}

