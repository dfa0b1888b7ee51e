"""A failed task names its hardware (node/stack_tasks.py, one copy of the rule): a run that failed on a GPU its
node's health watcher marked faulty at that time is reported with the XID and the GPU, by the deploy's waiter
(`up`), by `localswarm status` and in the program's stackTasks output.

The task documents are the rehearsal's own (tests/data/swarm-tasks-that-end.json, Docker 26.1.5), given the
GPU assignment swarm records on each task (GenericResources, as the Engine API names swarmkit's
AssignedGenericResources; a run in the rehearsal showed the name)."""
from __future__ import annotations

import copy
import importlib.util
import json
from datetime import datetime, timezone
from pathlib import Path

import pytest

from components.gpu_stack import stack_tasks
from localswarm import task_runs
from localswarm.placement import render_table, services_view
from swarm.labels import (CONDITION_GPU_LABEL, CONDITION_LABEL, CONDITION_REASON_LABEL, CONDITION_SINCE_LABEL,
                          HEALTH_LAST_LABEL)

_spec = importlib.util.spec_from_file_location("stack_settle", Path(__file__).resolve().parent.parent / "node"
                                               / "stack_settle.py")
stack_settle = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(stack_settle)
DATA = json.loads((Path(__file__).resolve().parent / "data" / "swarm-tasks-that-end.json").read_text())
GPU = "GPU-7e3c1a52-0a4b-4c8e-9d1f-2b6a8c0e4f10"
OTHER = "GPU-19d2b7c4-5e6f-4a1b-8c3d-9e0f1a2b3c4d"


def _epoch(ts: str) -> int:
    return int(datetime.strptime(ts[:19], "%Y-%m-%dT%H:%M:%S").replace(tzinfo=timezone.utc).timestamp())


def tasks_on(gpu: str) -> list[dict]:
    """Every task holds `gpu` (a slot of it for the smi service, as a shared GPU's task would)."""
    tasks = copy.deepcopy(DATA["tasks"])
    smi = next(s["ID"] for s in DATA["services"] if s["Spec"]["Name"] == "smi")
    for t in tasks:
        value = f"{gpu}-s2" if t["ServiceID"] == smi else gpu
        t["GenericResources"] = [{"NamedResourceSpec": {"Kind": "NVIDIA-GPU", "Value": value}}]
    return tasks


def failed_run(service: str, tasks: list[dict]) -> dict:
    sid = next(s["ID"] for s in DATA["services"] if s["Spec"]["Name"] == service)
    return max((t for t in tasks if t["ServiceID"] == sid and t["Status"]["State"] == "failed"),
               key=lambda t: t["Status"]["Timestamp"])


def node_doc(node_id: str, condition: str, reason: str, gpu: str, since: int, spec_labels=None) -> dict:
    return {"ID": node_id, "Spec": {"Labels": spec_labels or {}},
            "Description": {"Engine": {"Labels": {CONDITION_LABEL: condition, CONDITION_REASON_LABEL: reason,
                                                  CONDITION_GPU_LABEL: gpu, CONDITION_SINCE_LABEL: str(since)}}}}


def view_with(faults: dict, tasks: list[dict]) -> dict:
    return {"nodes": [], "services": services_view(DATA["services"], tasks, lambda t: ([], [], "scheduler"),
                                                   {}, {}, faults)}


def svc(view: dict, name: str) -> dict:
    return next(s for s in view["services"] if s["name"] == name)


def test_a_run_that_failed_on_a_gpu_marked_faulty_names_the_xid_and_the_gpu():
    tasks = tasks_on(GPU)
    run = failed_run("none-fail", tasks)
    since = _epoch(run["Status"]["Timestamp"]) - 3  # the XID came first; the task died of it
    faults = task_runs.node_faults([node_doc(run["NodeID"], "unhealthy", f"xid_79_on_{GPU}", GPU, since)])
    assert faults == {run["NodeID"]: {"gpu": GPU, "xid": 79, "reason": f"xid_79_on_{GPU}", "since": since}}
    view = view_with(faults, tasks)
    (task,) = svc(view, "none-fail")["tasks"]
    assert task["last_run"]["hardware"]["xid"] == 79 and task["last_run"]["hardware"]["gpu"] == GPU
    line = next(line for line in task_runs.outcome(view) if line.startswith("none-fail:"))
    assert line == f"none-fail: 1 failed (exit 3) (failed on GPU {GPU}, which its node's health watcher marked " \
                   "faulty (XID 79))"
    table = render_table(view)
    assert f"HARDWARE\nnone-fail task 1 failed on GPU {GPU}, which its node's health watcher marked faulty " \
           "(XID 79)" in table
    # A completed run on the same GPU is not the hardware's doing, nor a service that keeps running.
    assert all(t["last_run"] is None or t["last_run"]["hardware"] is None
               for name in ("none-ok", "onfail-ok", "job", "web") for t in svc(view, name)["tasks"])


@pytest.mark.parametrize("gpu, since_after_failure, expected", [
    (GPU, -3600, True),  # faulty an hour before the run failed, and still: the hardware
    (GPU, 25, True),  # noted 25 s after the run died: within the slack, the same fault
    (GPU, 120, False),  # the GPU went bad two minutes after the run had failed: not why it failed
    (OTHER, -3, False),  # another GPU of the node is faulty: not this run's
])
def test_only_the_runs_gpu_and_only_at_that_time(gpu, since_after_failure, expected):
    tasks = tasks_on(GPU)
    run = failed_run("none-fail", tasks)
    since = _epoch(run["Status"]["Timestamp"]) + since_after_failure
    faults = task_runs.node_faults([node_doc(run["NodeID"], "unhealthy", f"xid_48_on_{gpu}", gpu, since)])
    (task,) = svc(view_with(faults, tasks), "none-fail")["tasks"]
    assert (task["last_run"]["hardware"] is not None) is expected


def test_which_conditions_count_as_a_faulty_gpu():
    reason = f"xid_79_on_{GPU}"
    assert task_runs.node_faults([node_doc("n", "degraded", f"pages_pending_retirement_on_{GPU}", GPU, 1)]) == {}
    assert task_runs.node_faults([node_doc("n", "reclaim", "spot_terminate_at_x", "-", 1)]) == {}
    assert task_runs.node_faults([node_doc("n", "healthy", "ok", "-", 1)]) == {}
    ecc = task_runs.node_faults([node_doc("n", "unhealthy", f"ecc_double_on_{GPU}", GPU, 5)])["n"]
    assert ecc["xid"] is None and "ecc_double" in task_runs.fault_text(ecc)
    # The watcher's labels not yet seen by the manager: the reconciler's last drain says the same.
    drained = {"ID": "n", "Spec": {"Labels": {HEALTH_LAST_LABEL: f"drained:1700000000:unhealthy:{reason}"}},
               "Description": {"Engine": {"Labels": {}}}}
    assert task_runs.node_faults([drained])["n"] == {"gpu": GPU, "xid": 79, "reason": reason, "since": 1700000000}


def test_a_crash_loop_on_a_faulty_gpu_fails_up_naming_it():
    tasks = tasks_on(GPU)
    run = failed_run("crash", tasks)
    faults = task_runs.node_faults([node_doc(run["NodeID"], "unhealthy", f"xid_79_on_{GPU}", GPU,
                                             _epoch(run["Status"]["Timestamp"]) - 60)])
    view = view_with(faults, tasks)
    (why,) = task_runs.stuck(view)
    assert why.startswith("crash task 1 failed") and f"GPU {GPU}" in why and "(XID 79)" in why


def test_the_waiters_report_and_the_stack_output_name_the_hardware():
    tasks = tasks_on(GPU)
    run = failed_run("none-fail", tasks)
    faults = task_runs.node_faults([node_doc(run["NodeID"], "unhealthy", f"xid_79_on_{GPU}", GPU,
                                             _epoch(run["Status"]["Timestamp"]))])
    view = view_with(faults, tasks)
    report = stack_settle.report("s", view, settled=True, seconds=1.0, problems=[])
    (failure,) = report["hardware_failures"]
    assert failure == {"service": "none-fail", "slot": 1, "node": "", "gpu": GPU, "xid": 79,
                       "reason": f"xid_79_on_{GPU}", "since": faults[run["NodeID"]]["since"]}
    out = stack_tasks(json.dumps(report))
    assert out["hardwareFailures"] == [{"service": "none-fail", "task": 1, "node": "", "gpu": GPU, "xid": 79}]
    assert "(XID 79)" in out["services"]["none-fail"]
