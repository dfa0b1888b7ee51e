"""The scaler's decisions (node/scale_plan.py), from swarm- and AWS-shaped inputs, one situation a row.

plan() is pure: it gets `docker node inspect`'s nodes, the Engine API's tasks and each group as
DescribeAutoScalingGroups has it, and returns actions with reasons. The rows are the situations the
issue names: tasks waiting for GPUs a pool could give, tasks no pool can run, idle nodes going down to
min (zero too), a node running a GPU task never touched, no flapping, and a new leader going on from
the labels the last one left.
"""
from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path

import pytest

NODE = Path(__file__).resolve().parents[1] / "node"
spec = importlib.util.spec_from_file_location("scale_plan", NODE / "scale_plan.py")
sp = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = sp
spec.loader.exec_module(sp)

NOW = 1_800_000_000
KIND = "NVIDIA-GPU"
RELEASE = "a" * 64
OLD_RELEASE = "b" * 64
T4 = sp.Pool("t4", "grp-t4", 0, 4, 600, KIND, 1, {"gpu-swarm.pool": "t4", "gpu-swarm.gpu-model": "T4"}, RELEASE,
             gpu_kinds=(KIND, f"{KIND}-SHARED"))
QUAD = sp.Pool("quad", "grp-quad", 0, 2, 600, KIND, 4, {"gpu-swarm.pool": "quad"}, RELEASE,
               gpu_kinds=(KIND, f"{KIND}-SHARED"))
SHARED = sp.Pool("slots", "grp-slots", 0, 2, 600, f"{KIND}-SHARED", 4, {"gpu-swarm.pool": "slots"}, RELEASE,
                 gpu_kinds=(KIND, f"{KIND}-SHARED"))


def node(n: int, pool: str = "t4", *, availability="active", labels=None, admitted=True, state="ready",
         instance=None, idle_since=None, release=RELEASE):
    spec_labels = dict(labels or {})
    if admitted:
        spec_labels.setdefault("gpu-swarm.software", release)
        spec_labels.setdefault("gpu-swarm.pool", pool)
    if idle_since is not None:
        spec_labels["gpu-swarm.idle-since"] = str(idle_since)
    return {"ID": f"node{n:021d}", "Spec": {"Labels": spec_labels, "Role": "worker", "Availability": availability},
            "Description": {"Hostname": f"{pool}-{n}", "Engine": {"Labels": {
                "gpu-swarm.elastic-pool": pool, "gpu-swarm.instance-id": instance or f"i-{n:017d}"}}},
            "Status": {"State": state}}


def task(n: int, *, gpus=1, kind=KIND, node_id="", state="running", desired="running", err="", constraints=(),
         service="svc1", max_replicas=0, since="2027-01-15T08:00:00.000000000Z"):
    reservations = {"GenericResources": [{"DiscreteResourceSpec": {"Kind": kind, "Value": gpus}}]} if gpus else {}
    placement = {"Constraints": list(constraints)}
    if max_replicas:
        placement["MaxReplicas"] = max_replicas
    return {"ID": f"task{n:021d}", "ServiceID": service, "Slot": n, "NodeID": node_id, "DesiredState": desired,
            "Status": {"State": state, "Err": err, "Timestamp": since},
            "Spec": {"Resources": {"Reservations": reservations}, "Placement": placement}}


def pending(n: int, **kw):
    return task(n, state="pending", err="no suitable node (insufficient resources on 1 node)", **kw)


def on(n_task: int, n_node: int, **kw):
    return task(n_task, node_id=f"node{n_node:021d}", **kw)


def group(desired=0, *instances, lifecycle="InService", min_size=0, max_size=4):
    return sp.Group(desired, min_size, max_size, {f"i-{i:017d}": lifecycle for i in instances})


def kinds(result):
    return [(a.kind, a.pool, a.node_id[-2:].lstrip("0") if a.node_id else a.desired) for a in result.actions
            if a.kind != "label"]


def run(nodes=(), tasks=(), groups=None, pools=(T4,), now=NOW, admitting=frozenset()):
    groups = groups if groups is not None else {p.group: group() for p in pools}
    return sp.plan(list(pools), list(nodes), list(tasks), groups, now, admitting)


# --------------------------------------------------------------- scale out

SCALE_OUT = [
    # (id, nodes, tasks, groups, pools, expected actions, a fragment of the reports or None)
    ("two-waiting-tasks-two-nodes", [], [pending(1), pending(2)], {"grp-t4": group(0)}, (T4,),
     [("scale-out", "t4", 2)], None),
    ("booting-nodes-are-counted", [], [pending(1), pending(2)], {"grp-t4": group(2, 1, 2, lifecycle="Pending")},
     (T4,), [], None),
    ("desired-not-yet-launched-is-counted", [], [pending(1)], {"grp-t4": group(1)}, (T4,), [], None),
    ("up-to-max-and-the-rest-reported", [], [pending(i) for i in range(1, 7)], {"grp-t4": group(0)}, (T4,),
     [("scale-out", "t4", 4)], "could run it but are at their max (4 nodes)"),
    ("too-many-gpus-for-any-node", [], [pending(1, gpus=2)], {"grp-t4": group(0)}, (T4,),
     [], "it reserves 2 NVIDIA-GPU, and a node of the pool has 1"),
    ("a-constraint-on-another-pool", [], [pending(1, constraints=["node.labels.gpu-swarm.pool==fixed"])],
     {"grp-t4": group(0)}, (T4,), [], "does not hold for its nodes"),
    ("a-constraint-only-a-booted-node-knows", [], [pending(1, constraints=["engine.labels.gpu.product==Tesla-T4"])],
     {"grp-t4": group(0)}, (T4,), [], "names what only a booted node can say"),
    ("constraints-that-hold", [], [pending(1, constraints=["node.labels.gpu-swarm.gpu-model == t4",
                                                          "node.role==worker", "node.labels.zone!=b"])],
     {"grp-t4": group(0)}, (T4,), [("scale-out", "t4", 1)], None),
    ("cpu-tasks-are-not-ours", [], [pending(1, gpus=0)], {"grp-t4": group(0)}, (T4,), [], None),
    ("a-task-not-yet-refused-waits", [], [task(1, state="pending")], {"grp-t4": group(0)}, (T4,), [], None),
    ("free-units-on-a-ready-node-first", [node(1, idle_since=NOW)], [pending(1)], {"grp-t4": group(1, 1)}, (T4,),
     [], None),
    ("smallest-nodes-first", [], [pending(1)], {"grp-t4": group(0), "grp-quad": group(0)}, (QUAD, T4),
     [("scale-out", "t4", 1)], None),
    ("the-next-pool-when-the-first-is-full", [], [pending(i) for i in range(1, 7)],
     {"grp-t4": group(0), "grp-quad": group(0)}, (T4, QUAD), [("scale-out", "t4", 4), ("scale-out", "quad", 1)], None),
    ("four-one-gpu-tasks-share-a-quad-node", [], [pending(i) for i in range(1, 5)], {"grp-quad": group(0)}, (QUAD,),
     [("scale-out", "quad", 1)], None),
    ("max-replicas-per-node-spreads-them", [], [pending(i, max_replicas=1) for i in range(1, 3)],
     {"grp-quad": group(0)}, (QUAD,), [("scale-out", "quad", 2)], None),
    ("whole-gpus-are-not-slots", [], [pending(1)], {"grp-slots": group(0)}, (SHARED,),
     [], "it reserves NVIDIA-GPU, and the pool's nodes advertise NVIDIA-GPU-SHARED"),
    ("slots-fill-a-shared-node", [], [pending(i, kind=f"{KIND}-SHARED") for i in range(1, 6)], {"grp-slots": group(0)},
     (SHARED,), [("scale-out", "slots", 2)], None),
    ("a-missing-group-is-said", [], [pending(1)], {"grp-t4": None}, (T4,), [], "was not found"),
]


@pytest.mark.parametrize("nodes,tasks,groups,pools,expected,report", [r[1:] for r in SCALE_OUT],
                         ids=[r[0] for r in SCALE_OUT])
def test_scale_out(nodes, tasks, groups, pools, expected, report):
    result = run(nodes, tasks, groups, pools)
    assert kinds(result) == expected
    if report:
        assert any(report in r for r in result.reports), result.reports
    else:
        assert not [r for r in result.reports if "task" in r], result.reports


def test_a_task_that_fits_free_units_but_stays_pending_is_reported_and_not_scaled_for():
    t = pending(1, since="2027-01-15T07:00:00.5Z")  # an hour before NOW (2027-01-15T08:00:00Z)
    assert sp._pending_s(t, NOW) == 3600
    result = run([node(1, idle_since=NOW)], [t], {"grp-t4": group(1, 1)}, now=NOW)
    assert kinds(result) == []
    assert any("something besides GPUs keeps it out" in r for r in result.reports)


# --------------------------------------------------------------- scale in

IDLE = NOW - 601


SCALE_IN = [
    # (id, nodes, tasks, group, pool, expected)
    ("idle-past-idle-minutes-is-paused", [node(1, idle_since=IDLE)], [], group(1, 1), T4, [("pause", "t4", "1")]),
    ("idle-not-long-enough", [node(1, idle_since=NOW - 599)], [], group(1, 1), T4, []),
    ("never-a-node-with-a-gpu-task", [node(1, idle_since=IDLE)], [on(1, 1)], group(1, 1), T4, []),
    ("a-cpu-task-does-not-keep-it", [node(1, idle_since=IDLE)], [on(1, 1, gpus=0)], group(1, 1), T4,
     [("pause", "t4", "1")]),
    ("down-to-min-only", [node(1, idle_since=IDLE), node(2, idle_since=IDLE - 5)], [], group(2, 1, 2, min_size=1),
     sp.Pool(**{**T4.__dict__, "min": 1}), [("pause", "t4", "2")]),
    ("not-while-a-task-waits-for-the-pool", [node(1, idle_since=IDLE)], [pending(1, gpus=1, service="x"),
                                                                          on(2, 1, gpus=0)],
     group(1, 1), T4, []),
    ("a-health-drained-idle-node-goes-too", [node(1, availability="drain", idle_since=IDLE,
                                                  labels={"gpu-swarm.drained-by": "health"})], [], group(1, 1), T4,
     [("pause", "t4", "1")]),
    ("an-operators-drain-is-left-alone", [node(1, availability="drain", idle_since=IDLE)], [], group(1, 1), T4, []),
    ("paused-and-still-idle-is-drained",
     [node(1, availability="pause", labels={"gpu-swarm.autoscale": f"remove:paused:{NOW - 2}",
                                            "gpu-swarm.drained-by": "autoscale"})], [], group(1, 1), T4,
     [("drain", "t4", "1")]),
    ("paused-but-a-gpu-task-landed-is-given-back",
     [node(1, availability="pause", labels={"gpu-swarm.autoscale": f"remove:paused:{NOW - 2}",
                                            "gpu-swarm.drained-by": "autoscale"})], [on(1, 1)], group(1, 1), T4,
     [("give-back", "t4", "1")]),
    ("paused-and-a-task-waits-is-given-back-not-scaled-for",
     [node(1, availability="pause", labels={"gpu-swarm.autoscale": f"remove:paused:{NOW - 2}",
                                            "gpu-swarm.drained-by": "autoscale"})], [pending(1)], group(1, 1), T4,
     [("give-back", "t4", "1")]),
    ("draining-waits-for-its-tasks",
     [node(1, availability="drain", labels={"gpu-swarm.autoscale": f"remove:draining:{NOW - 2}"})],
     [on(1, 1, gpus=0, desired="shutdown")], group(1, 1), T4, []),
    ("drained-empty-is-terminated-with-a-decrement",
     [node(1, availability="drain", labels={"gpu-swarm.autoscale": f"remove:draining:{NOW - 2}"})], [], group(1, 1),
     T4, [("terminate", "t4", "1")]),
    ("at-the-groups-min-it-is-given-back",
     [node(1, availability="drain", labels={"gpu-swarm.autoscale": f"remove:draining:{NOW - 2}"})], [],
     group(1, 1, min_size=1), T4, [("give-back", "t4", "1")]),
    ("terminated-and-gone-and-down-is-forgotten",
     [node(1, availability="drain", state="down", labels={"gpu-swarm.autoscale": f"remove:terminating:{NOW - 9}"})],
     [], group(0), T4, [("forget", "t4", "1")]),
    ("terminated-but-still-listed-waits",
     [node(1, availability="drain", labels={"gpu-swarm.autoscale": f"remove:terminating:{NOW - 9}"})], [],
     group(1, 1), T4, []),
    ("terminated-and-still-in-service-long-after-is-asked-again",
     [node(1, availability="drain", labels={"gpu-swarm.autoscale": f"remove:terminating:{NOW - 301}"})], [],
     group(1, 1), T4, [("terminate", "t4", "1")]),
    ("a-reclaimed-instance-leaves-a-down-node-that-is-forgotten", [node(1, state="down", idle_since=IDLE)], [],
     group(1, 2), T4, [("forget", "t4", "1")]),
]


@pytest.mark.parametrize("nodes,tasks,grp,pool,expected", [r[1:] for r in SCALE_IN], ids=[r[0] for r in SCALE_IN])
def test_scale_in(nodes, tasks, grp, pool, expected):
    assert kinds(run(nodes, tasks, {pool.group: grp}, (pool,))) == expected


def test_a_pause_marks_the_node_as_the_scalers_and_terminate_decrements_only_to_remove():
    pause = run([node(1, idle_since=IDLE)], [], {"grp-t4": group(1, 1)}).actions[0]
    assert pause.args == ("--availability", "pause", "--label-add", "gpu-swarm.drained-by=autoscale",
                          "--label-add", f"gpu-swarm.autoscale=remove:paused:{NOW}", node(1)["ID"])
    gone = run([node(1, availability="drain", labels={"gpu-swarm.autoscale": f"remove:draining:{NOW - 2}"})], [],
               {"grp-t4": group(1, 1)}).actions[0]
    assert (gone.instance, gone.decrement) == ("i-00000000000000001", True)
    assert gone.args == ("--label-add", f"gpu-swarm.autoscale=remove:terminating:{NOW}", node(1)["ID"])


def test_a_node_given_back_loses_the_scalers_labels_and_its_idle_time():
    n = node(1, availability="pause", idle_since=IDLE, labels={"gpu-swarm.autoscale": f"remove:paused:{NOW}",
                                                             "gpu-swarm.drained-by": "autoscale"})
    back = run([n], [on(1, 1)], {"grp-t4": group(1, 1)}).actions
    assert [a for a in back if a.kind == "give-back"][0].args == (
        "--availability", "active", "--label-rm", "gpu-swarm.autoscale", "--label-rm", "gpu-swarm.drained-by",
        "--label-rm", "gpu-swarm.idle-since", n["ID"])


# --------------------------------------------------------------- idle time, admission, replacement

def test_idle_time_starts_when_the_last_gpu_task_goes_and_ends_with_the_next():
    quiet = run([node(1)], [], {"grp-t4": group(1, 1)}).actions
    assert [(a.kind, a.args) for a in quiet] == [("label", ("--label-add", f"gpu-swarm.idle-since={NOW}",
                                                            node(1)["ID"]))]
    busy = run([node(1, idle_since=IDLE)], [on(1, 1)], {"grp-t4": group(1, 1)}).actions
    assert [(a.kind, a.args) for a in busy] == [("label", ("--label-rm", "gpu-swarm.idle-since", node(1)["ID"]))]


def test_a_joined_node_is_admitted_once_its_group_lists_its_instance():
    joined = node(1, availability="drain", admitted=False)
    assert kinds(run([joined], [], {"grp-t4": group(1, 1)})) == [("admit", "t4", "1")]
    assert kinds(run([joined], [], {"grp-t4": group(1, 1)}, admitting=frozenset({joined["ID"]}))) == []
    stranger = run([node(1, availability="drain", admitted=False, instance="i-0ffffffffffffffff")], [],
                   {"grp-t4": group(1, 1)})
    assert kinds(stranger) == [] and "does not list: not admitted" in stranger.reports[0]


def test_two_nodes_claiming_one_instance_are_both_refused():
    twins = [node(1, availability="drain", admitted=False), node(2, availability="drain", admitted=False,
                                                                  instance="i-00000000000000001")]
    result = run(twins, [], {"grp-t4": group(1, 1)})
    assert kinds(result) == [] and all("claim instance" in r for r in result.reports)
    # One of them down (an instance whose engine joined twice): the down copy is forgotten, the other admitted.
    twins[1]["Status"]["State"] = "down"
    assert kinds(run(twins, [], {"grp-t4": group(1, 1)})) == [("forget", "t4", "2"), ("admit", "t4", "1")]


def test_a_joined_node_waiting_for_admission_counts_as_capacity_coming():
    joined = node(1, availability="drain", admitted=False)
    assert kinds(run([joined], [pending(1)], {"grp-t4": group(1, 1)})) == [("admit", "t4", "1")]


def test_an_idle_node_of_another_release_above_min_waits_for_its_idle_time_rather_than_a_replacement():
    """Replacing it would launch a node that idles too: it goes as an idle node."""
    fresh = node(1, idle_since=NOW - 5, release=OLD_RELEASE)
    assert kinds(run([fresh], [], {"grp-t4": group(1, 1)})) == []
    assert kinds(run([node(1, idle_since=IDLE, release=OLD_RELEASE)], [], {"grp-t4": group(1, 1)})) == \
        [("pause", "t4", "1")]


def test_idle_nodes_of_another_release_are_replaced_at_most_max_unavailable_at_a_time():
    pool = sp.Pool(**{**T4.__dict__, "min": 3})
    nodes = [node(i, idle_since=NOW - 5, release=OLD_RELEASE) for i in (1, 2, 3)]
    result = run(nodes, [on(9, 3)], {"grp-t4": group(3, 1, 2, 3)}, (pool,))
    assert kinds(result) == [("pause", "t4", "1")]  # node 3 holds a GPU task, node 2 waits its turn
    assert "gpu-swarm.autoscale=replace:paused:" in result.actions[-1].args[-2]
    drained = node(1, availability="drain", labels={"gpu-swarm.autoscale": f"replace:draining:{NOW}"},
                   release=OLD_RELEASE)
    gone = [a for a in run([drained], [], {"grp-t4": group(3, 1)}, (pool,)).actions if a.kind == "terminate"]
    assert gone and not gone[0].decrement


# --------------------------------------------------------------- what holds in every situation

def _random_situation(rng: random.Random):
    nodes, tasks = [], []
    for i in range(1, rng.randint(1, 6)):
        phase = rng.choice([None, None, "paused", "draining", "terminating"])
        labels = {"gpu-swarm.autoscale": f"{rng.choice(['remove', 'replace'])}:{phase}:{NOW - rng.randint(0, 900)}"} \
            if phase else {}
        availability = {"paused": "pause", "draining": "drain", "terminating": "drain"}.get(phase) or \
            rng.choice(["active", "active", "drain"])
        nodes.append(node(i, availability=availability, labels=labels, admitted=rng.random() > 0.15,
                          state=rng.choice(["ready", "ready", "down"]),
                          idle_since=rng.choice([None, NOW - rng.randint(0, 2000)]),
                          release=rng.choice([RELEASE, OLD_RELEASE])))
        for j in range(rng.randint(0, 2)):
            tasks.append(on(i * 10 + j, i, gpus=rng.choice([0, 1]), desired=rng.choice(["running", "shutdown"])))
    tasks += [pending(100 + k) for k in range(rng.randint(0, 3))]
    live = rng.sample(range(1, 8), rng.randint(0, 6))
    grp = group(rng.randint(len(live), 6), *live, min_size=0)
    return nodes, tasks, grp


def test_no_situation_takes_out_a_node_that_holds_a_gpu_task_or_goes_below_min_or_above_max():
    rng = random.Random(43)
    for _ in range(3000):
        nodes, tasks, grp = _random_situation(rng)
        pool = sp.Pool(**{**T4.__dict__, "min": rng.randint(0, 2), "max": rng.randint(2, 6)})
        grp = sp.Group(max(grp.desired, pool.min), pool.min, pool.max, grp.instances)
        result = run(nodes, tasks, {"grp-t4": grp}, (pool,))
        gpu_nodes = {t["NodeID"] for t in tasks if t["NodeID"] and sp.reserved(t)}
        for a in result.actions:
            if a.kind in ("pause", "drain", "terminate"):
                assert a.node_id not in gpu_nodes, (a, tasks)
            if a.kind == "scale-out":
                assert grp.desired < a.desired <= pool.max
        decided = [a.node_id for a in result.actions if a.kind not in ("label", "scale-out")]
        assert len(decided) == len(set(decided)), result.actions  # one decision per node a round
        removing = sum(1 for a in result.actions if a.kind == "pause" and "remove:" in a.args[-2])
        decrements = sum(1 for a in result.actions if a.kind == "terminate" and a.decrement)
        assert grp.desired - decrements >= pool.min
        assert removing <= max(0, grp.desired - pool.min)


def test_a_round_on_what_the_last_round_did_does_not_undo_it():
    """No flapping: after a scale-out, the next round (the nodes booting) adds nothing and removes nothing; after a
    pause, the next round drains rather than giving back; the labels carry it to another leader."""
    first = run([], [pending(1), pending(2)], {"grp-t4": group(0)})
    assert kinds(first) == [("scale-out", "t4", 2)]
    second = run([], [pending(1), pending(2)], {"grp-t4": group(2, 1, 2, lifecycle="Pending")})
    assert kinds(second) == []
    paused = node(1, availability="pause", idle_since=IDLE,
                  labels={"gpu-swarm.autoscale": f"remove:paused:{NOW}", "gpu-swarm.drained-by": "autoscale"})
    assert kinds(run([paused], [], {"grp-t4": group(1, 1)}, now=NOW + 2)) == [("drain", "t4", "1")]
