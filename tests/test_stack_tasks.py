"""The rules of node/stack_tasks.py: which tasks are settled, which never will be, and what `up` shows of them.

The deploy command's waiter on the manager (node/stack_settle.py) runs these very rules: the
tests load the file by path, through localswarm.task_runs.

tests/data/swarm-tasks-that-end.json holds the task documents a rehearsal manager returned
30 s after these services were created (Docker 26.1.5; fields the rehearsal does not read
removed), on 3 nodes x 2 GPUs:
  smi         7 replicas of `nvidia-smi -L`, one GPU each, default restart policy (any)
  none-ok     restart_policy none, exits 0         none-fail   restart_policy none, exits 3
  onfail-ok   on-failure, exits 0                  onfail-max  on-failure, max_attempts 2, exits 2
  job         mode replicated-job, 3 completions, 2 at a time, exits 0
  crash       default restart policy, exits 1      web         a service that keeps running
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from localswarm import task_runs
from localswarm.placement import render_table, services_view
from localswarm.task_runs import (CRASH_LOOP_FAILURES, converged, failing, outcome, releasing, settled, stuck,
                                  unsettled)

DATA = json.loads((Path(__file__).resolve().parent / "data" / "swarm-tasks-that-end.json").read_text())


def scheduler(task: dict):
    return [], [], "scheduler"


def view(services=DATA["services"], tasks=DATA["tasks"]) -> dict:
    return {"nodes": [], "services": services_view(services, tasks, scheduler, {}, {})}


def service(v: dict, name: str) -> dict:
    return next(s for s in v["services"] if s["name"] == name)


def without(v: dict, *names: str) -> dict:
    return {**v, "services": [s for s in v["services"] if s["name"] not in names]}


@pytest.mark.parametrize("name, expected", [
    # (service, [(state shown, ended for good, last exit code, completed runs > 0)] per task)
    ("none-ok", [("complete", True, 0, True)]),
    ("none-fail", [("failed", True, 3, False)]),
    ("onfail-ok", [("complete", True, 0, True)]),
    ("onfail-max", [("failed", True, 2, False)]),
    ("job", [("complete", True, 0, True)] * 3),
    ("web", [("running", False, None, False)]),
])
def test_each_restart_policy_ends_as_swarm_recorded_it(name, expected):
    tasks = service(view(), name)["tasks"]
    assert [(t["state"], t["ended"], t["exit_code"], t["runs"]["completed"] > 0) for t in tasks] == expected
    assert all(settled(t) for t in tasks)


def test_a_job_stack_under_the_default_policy_is_settled_while_swarm_restarts_it():
    """The issue's stack: 7 one-GPU replicas of `nvidia-smi -L` on 6 GPUs. Each GPU's task completed
    and is being restarted; the seventh waits for a GPU with the scheduler's reason."""
    smi = service(view(), "smi")
    assert smi["replicas"] == 7 and len(smi["tasks"]) == 7
    restarting = [t for t in smi["tasks"] if t["runs"]["completed"]]
    assert len(restarting) >= 6 and all(t["exit_code"] == 0 and not t["ended"] for t in restarting)
    assert all(t["last_run"]["state"] == "complete" for t in restarting)
    waiting = [t for t in smi["tasks"] if t["state"] == "pending"]
    assert all("insufficient resources" in t["reason"] for t in waiting)
    assert all(settled(t) for t in smi["tasks"])


def test_only_the_crash_loop_keeps_the_stacks_from_converging():
    v = view()
    (crash,) = service(v, "crash")["tasks"]
    assert crash["runs"] == {"completed": 0, "failed": crash["runs"]["failed"], "lost": 0} and crash["runs"]["failed"] >= 3
    assert not settled(crash) and crash["exit_code"] == 1
    assert not converged(v)
    (why,) = stuck(v)
    assert why.startswith("crash task 1 failed") and "never completed (failed, exit 1: task: non-zero exit (1))" in why
    assert converged(without(v, "crash")) and stuck(without(v, "crash")) == []


def test_up_reports_each_tasks_last_run_and_exit_code():
    v = view()
    lines = outcome(v)
    assert "none-fail: 1 failed (exit 3)" in lines and "job: 3 completed" in lines and "web: 1 running" in lines
    assert any(line.startswith("smi: ") and "completed, restarting" in line for line in lines)
    table = render_table(v)
    header = next(line for line in table.splitlines() if line.startswith("SERVICE "))
    assert header.split() == ["SERVICE", "TASK", "NODE", "GPUS", "LAST", "RUN", "EXIT", "RUNS", "NOW"]
    row = next(line for line in table.splitlines() if line.startswith("none-fail ")).split()
    assert (row[4], row[6], row[7]) == ("failed", "ago", "3") and row[-4:] == ["completed,", "1", "failed", "ended"]


def test_the_outcome_line_does_not_depend_on_which_slot_got_the_gpu():
    """One running and one waiting read the same whichever slot runs: stackTasks is an output of `up`,
    and a line that changed with it would show a diff on an `up` where nothing changed."""
    smi = service(view(), "smi")
    running = {**smi["tasks"][0], "state": "running", "reason": "", "ended": False, "runs": {"completed": 0}}
    waiting = {**smi["tasks"][0], "state": "pending", "ended": False, "runs": {"completed": 0},
               "reason": "no suitable node (insufficient resources on 1 node)"}
    lines = {outcome({"services": [{**smi, "name": "gpu", "tasks": order}]})[0]
             for order in ([running, waiting], [waiting, running])}
    assert lines == {"gpu: 1 running, 1 waiting for resources"}


def test_an_ended_task_holds_no_gpu_and_shows_the_gpus_its_run_had():
    gpu = "GPU-45d4ba60-e7f0-4e6d-9dde-84c3609cc6cb"
    v = {"nodes": [{"name": "node-1", "role": "worker", "state": "ready", "availability": "active", "gpus": [gpu],
                    "slots": []}],
         "services": [{"name": "once", "mode": "replicated", "replicas": 1, "tasks": [{
             "slot": 1, "node": "node-1", "state": "complete", "gpus": [gpu], "slots": [], "reason": "",
             "ended": True, "exit_code": 0, "runs": {"completed": 1, "failed": 0},
             "last_run": {"state": "complete", "exit_code": 0, "error": "", "node": "node-1", "gpus": [gpu],
                          "age_s": 4}}]}]}
    table = render_table(v)
    assert next(line for line in table.splitlines() if line.startswith(f"node-1  {gpu}")).split()[-1] == "free"
    assert f"once     1     node-1  {gpu}  complete 4s ago  0" in table


# ---------------------------------------------------------------- the rule, on small cases

def doc(slot=1, state="running", desired="running", created="2026-01-01T00:00:00.1Z", err="", exit_code=None,
        node="n1", service="s1", **extra) -> dict:
    status = {"State": state, "Timestamp": created}
    if err:
        status["Err"] = err
    if exit_code is not None:
        status["ContainerStatus"] = {"ContainerID": "c", "ExitCode": exit_code}
    return {"ServiceID": service, "Slot": slot, "NodeID": node, "DesiredState": desired, "CreatedAt": created,
            "Version": {"Index": 1}, "Status": status, **extra}


def svc_doc(mode: dict, service="s1", **extra) -> dict:
    return {"ID": service, "Spec": {"Name": "svc", "Mode": mode}, **extra}


def one(mode: dict, *tasks: dict, **extra) -> dict:
    return view([svc_doc(mode, **extra)], list(tasks))


REPLICATED = {"Replicated": {"Replicas": 1}}


@pytest.mark.parametrize("tasks, is_converged", [
    ([doc()], True),
    ([doc(state="pending", desired="running", err="no suitable node (insufficient resources on 3 nodes)")], True),
    ([doc(state="pending")], False),  # no reason yet: the scheduler has not looked at it
    ([doc(state="starting")], False),
    ([doc(state="complete", desired="shutdown", exit_code=0)], True),  # restart_policy none
    # restarting after completing: the newer task is the slot's, whatever its state
    ([doc(state="complete", desired="shutdown", exit_code=0),
      doc(state="ready", desired="ready", created="2026-01-01T00:00:05.2Z")], True),
    # Docker trims the fraction's zeros: .95 is later than .100000001
    ([doc(state="ready", desired="ready", created="2026-01-01T00:00:00.100000001Z"),
      doc(state="complete", desired="shutdown", exit_code=0, created="2026-01-01T00:00:00.95Z")], True),
    # failing, restarted, never completed: not yet converged (and stuck from the third failure)
    ([doc(state="failed", desired="shutdown", exit_code=1, err="task: non-zero exit (1)"),
      doc(state="starting", created="2026-01-01T00:00:06Z")], False),
    # a task swarm itself replaced (an update, a drain) is history; its successor counts
    ([doc(state="shutdown", desired="shutdown"), doc(state="running", created="2026-01-01T00:00:06Z")], True),
])
def test_settled_tasks(tasks, is_converged):
    assert converged(one(REPLICATED, *tasks)) is is_converged


def test_a_crash_loop_is_stuck_from_the_third_failure():
    fails = [doc(state="failed", desired="shutdown", exit_code=1, created=f"2026-01-01T00:00:0{i}Z")
             for i in range(CRASH_LOOP_FAILURES)]
    restart = doc(state="ready", desired="ready", created="2026-01-01T00:00:09Z")
    assert stuck(one(REPLICATED, *fails[:-1], restart)) == []
    (why,) = stuck(one(REPLICATED, *fails, restart))
    assert "failed 3 times and never completed (failed, exit 1)" in why
    # once one run completed, restarts are what the restart policy asks for
    done = doc(state="complete", desired="shutdown", exit_code=0, created="2026-01-01T00:00:08Z")
    assert stuck(one(REPLICATED, *fails, done, restart)) == []


def test_runs_the_engine_lost_are_no_crash_loop():
    """A node's boot restarts dockerd once its agent has written daemon.json: a task starting then
    fails with "No such container", as often as the engine restarts. That is the node's doing."""
    lost = [doc(state="failed", desired="shutdown", exit_code=0, created=f"2026-01-01T00:00:0{i}Z",
                err=f"No such container: gpu-smoke_gpu.2.task{i}") for i in range(CRASH_LOOP_FAILURES + 1)]
    restart = doc(state="ready", desired="ready", created="2026-01-01T00:00:09Z")
    view = one(REPLICATED, *lost, restart)
    assert stuck(view) == []
    (task,) = view["services"][0]["tasks"]
    assert task["runs"] == {"completed": 0, "failed": 0, "lost": CRASH_LOOP_FAILURES + 1}
    # the task's own failures still count, with lost runs among them
    fails = [doc(state="failed", desired="shutdown", exit_code=1, created=f"2026-01-01T00:00:1{i}Z")
             for i in range(CRASH_LOOP_FAILURES)]
    assert len(stuck(one(REPLICATED, *lost, *fails, doc(state="ready", desired="ready",
                                                          created="2026-01-01T00:00:19Z")))) == 1


def test_missing_replicas_keep_a_stack_from_converging():
    assert not converged(one({"Replicated": {"Replicas": 2}}, doc()))


def test_a_job_is_converged_with_max_concurrent_tasks_running_and_once_all_completed():
    job = {"ReplicatedJob": {"MaxConcurrent": 2, "TotalCompletions": 3}}
    running = [doc(slot=0, desired="complete"), doc(slot=1, desired="complete")]
    assert converged(one(job, *running))
    assert not converged(one(job, running[0]))
    done = [doc(slot=i, state="complete", desired="complete", exit_code=0) for i in range(2)]
    assert not converged(one(job, *done))  # the third is about to be made
    assert converged(one(job, *done, doc(slot=2, desired="complete")))
    # tasks of the job's earlier run (before an update) are not this run's
    old = doc(slot=0, state="failed", desired="shutdown", exit_code=1, JobIteration={"Index": 1})
    new = [doc(slot=i, state="complete", desired="complete", exit_code=0, JobIteration={"Index": 7}) for i in range(3)]
    v = one(job, old, *new, JobStatus={"JobIteration": {"Index": 7}})
    assert converged(v) and [t["runs"]["failed"] for t in v["services"][0]["tasks"]] == [0, 0, 0]


def test_tasks_swarm_stopped_for_good_are_not_shown():
    scaled_away = doc(slot=2, state="shutdown", desired="remove")
    drained = doc(state="shutdown", desired="shutdown", node="n2")
    assert [t["slot"] for t in service(one({"Replicated": {"Replicas": 1}}, doc(), scaled_away), "svc")["tasks"]] == [1]
    glob = one({"Global": {}}, doc(node="n1"), drained)
    assert len(service(glob, "svc")["tasks"]) == 1 and converged(glob)


def test_a_task_counts_as_running_after_half_a_second_so_one_that_exits_at_once_is_seen_ending():
    assert not settled({"state": "running", "reason": "", "state_age_s": 0.2})
    assert settled({"state": "running", "reason": "", "state_age_s": 0.5})
    assert settled({"state": "running", "reason": ""})  # views without the age (older callers) as before


def test_the_rules_are_the_node_softwares_own_file():
    """One copy: the rehearsal's rules are node/stack_tasks.py, the file the nodes install."""
    assert task_runs.RULES_PATH == Path(__file__).resolve().parent.parent / "node" / "stack_tasks.py"
    assert converged.__code__.co_filename == str(task_runs.RULES_PATH)
    assert not (Path(__file__).resolve().parent.parent / "localswarm" / "stack_tasks.py").exists()


# ---------------------------------------------------------------- a swap of stacks, and tasks swarm refuses

NO_GPU = "no suitable node (insufficient resources on 1 node)"
BIND = 'invalid mount config for type "bind": bind source path does not exist: /srv/models'


def test_a_task_waiting_for_a_gpu_another_task_is_still_releasing_is_not_settled():
    """The swap hole: on a second `up` the old stack's task still holds the GPU (swarm is stopping it)
    while the new stack's task waits for it. Only once the old task is gone is the wait the answer."""
    waiting = one(REPLICATED, doc(state="pending", err=NO_GPU))
    old = doc(service="old-stack", state="running", desired="shutdown", node="n1")
    assert releasing([old], ready_nodes={"n1"}) == [old]
    assert not converged(waiting, freeing=True)
    (why,) = unsettled(waiting, freeing=True)
    assert why == f"svc task 1: pending ({NO_GPU}), while other tasks still release theirs"
    assert converged(waiting, freeing=False) and unsettled(waiting) == []
    # a task that is not waiting for resources does not wait for the release either
    assert converged(one(REPLICATED, doc(state="running")), freeing=True)


@pytest.mark.parametrize("task, ready, holds", [
    (doc(state="running", desired="shutdown"), {"n1"}, True),  # an update or a removed stack stopping it
    (doc(state="starting", desired="remove"), {"n1"}, True),  # a removed service's task, not yet stopped
    (doc(state="running", desired="shutdown"), set(), False),  # its node is down: it frees nothing usable
    (doc(state="shutdown", desired="shutdown"), {"n1"}, False),  # stopped: its GPU is free
    (doc(state="complete", desired="shutdown"), {"n1"}, False),
    (doc(state="pending", desired="shutdown"), {"n1"}, False),  # never placed: it holds nothing
    (doc(state="running", desired="running"), {"n1"}, False),  # wanted: it frees nothing
])
def test_releasing_tasks_are_those_swarm_stops_that_still_hold_a_node(task, ready, holds):
    assert (releasing([task], ready_nodes=ready) == [task]) is holds


def test_a_rejected_task_that_swarm_keeps_restarting_fails_with_swarms_reason():
    # A rejected task has a container status whose exit code is 0 (nothing ran): not shown.
    rejected = [doc(state="rejected", desired="shutdown", err=BIND, exit_code=0, created=f"2026-01-01T00:00:0{i}Z")
                for i in range(CRASH_LOOP_FAILURES)]
    again = doc(state="pending", created="2026-01-01T00:00:09Z", err=NO_GPU)
    assert failing(one(REPLICATED, *rejected[:-1], again)) == []  # two rejections: swarm may place it elsewhere
    (why,) = failing(one(REPLICATED, *rejected, again))
    assert why == f"svc task 1 failed 3 times and never completed (rejected: {BIND}); swarm keeps restarting it"


@pytest.mark.parametrize("run, refused", [
    (doc(state="rejected", desired="shutdown", err=BIND), True),
    (doc(state="rejected", desired="shutdown", err="No such image: registry.example/model:1"), True),
    (doc(state="failed", desired="shutdown", exit_code=128,
         err="starting container failed: gpu-swarm: refused: this task reserves no GPU"), True),
    (doc(state="failed", desired="shutdown", exit_code=128,
         err="starting container failed: nvidia-container-cli: requirement error: unsatisfied condition: "
             "cuda>=12.4, please update your driver to a newer version"), True),
    (doc(state="failed", desired="shutdown", exit_code=3, err="task: non-zero exit (3)"), False),  # it ran, as told
])
def test_a_task_refused_once_that_swarm_will_not_restart_fails_at_once(run, refused):
    """restart_policy none: the one task swarm or its runtime refused is the stack's end, so fail now."""
    problems = failing(one(REPLICATED, run))
    assert bool(problems) is refused
    if refused:
        assert problems == [f"svc task 1 was {run['Status']['State']} and swarm will not start it again: "
                            f"{run['Status']['Err']}"]


def test_an_update_swarm_paused_fails_with_its_message():
    message = "update paused due to failure or early termination of task x1"
    v = one(REPLICATED, doc(), UpdateStatus={"State": "paused", "Message": message})
    assert failing(v) == [f"svc: update paused: {message}"]
    assert failing(one(REPLICATED, doc(), UpdateStatus={"State": "completed", "Message": "update completed"})) == []
