"""Tests for the swarm-side health reconciler (node/swarm_reconciler.py), without an engine.

decide() is pure and gets `docker node inspect`-shaped dicts; the command line runs
against a fake `docker` (a bash script on PATH that answers from files and records
every call), never against a real engine.
"""
import importlib.util
import json
import os
import select
import signal
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RECONCILER = ROOT / "node" / "swarm_reconciler.py"
UNIT = ROOT / "node" / "gpu-swarm-reconciler.service"

spec = importlib.util.spec_from_file_location("swarm_reconciler", RECONCILER)
reconciler = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = reconciler  # dataclasses look their module up there
spec.loader.exec_module(reconciler)

NOW = 1_800_000_000
GPU = "GPU-00000001-1111-2222-3333-000000000001"


def node(n, availability="active", condition=None, reason=None, labels=None, state="ready"):
    engine = {"gpu.count": "8", "zone": "a"}
    if condition is not None:
        engine["gpu-swarm.condition"] = condition
        engine["gpu-swarm.condition.reason"] = reason or "ok"
        engine["gpu-swarm.condition.gpu"] = GPU
    return {"ID": f"node{n:021d}", "Version": {"Index": 10 + n},
            "Spec": {"Labels": dict(labels or {}), "Role": "worker", "Availability": availability},
            "Description": {"Hostname": f"gpu-{n}", "Engine": {"EngineVersion": "28.0.1", "Labels": engine}},
            "Status": {"State": state, "Addr": f"10.0.0.{n}"}}


def ids(actions):
    return [(a.node, a.action) for a in actions]


# --- decide() -------------------------------------------------------------------------------

def test_drains_an_unhealthy_active_node():
    actions = reconciler.decide([node(1, condition="unhealthy", reason=f"xid_79_on_{GPU}")], True, NOW)
    why = f"unhealthy:xid_79_on_{GPU}"
    assert actions == [reconciler.Action(
        node(1)["ID"], "gpu-1", "drain", why,
        ("--availability", "drain", "--label-add", "gpu-swarm.drained-by=health",
         "--label-add", f"gpu-swarm.health={why}", "--label-add", f"gpu-swarm.health.last=drained:{NOW}:{why}",
         node(1)["ID"]))]


def test_drains_on_reclaim():
    actions = reconciler.decide([node(2, condition="reclaim", reason="spot_terminate_at_2026-11-22T23:59:00Z")],
                                True, NOW)
    assert ids(actions) == [("gpu-2", "drain")]
    assert "gpu-swarm.health=reclaim:spot_terminate_at_2026-11-22T23:59:00Z" in actions[0].args


@pytest.mark.parametrize("condition", ["healthy", "degraded", None, "something-new"])
def test_no_drain_without_a_fault(condition):
    assert reconciler.decide([node(1, condition=condition, reason="ecc_single_on_x")], True, NOW) == []


def test_reactivates_a_node_it_drained_once_healthy():
    drained = node(3, availability="drain", condition="healthy",
                   labels={"gpu-swarm.drained-by": "health", "gpu-swarm.health": "unhealthy:xid_79",
                           "gpu-swarm.pool": "h100"})
    actions = reconciler.decide([drained], True, NOW)
    assert actions == [reconciler.Action(
        drained["ID"], "gpu-3", "reactivate", "healthy:ok",
        ("--availability", "active", "--label-rm", "gpu-swarm.drained-by", "--label-rm", "gpu-swarm.health",
         "--label-add", f"gpu-swarm.health.last=reactivated:{NOW}:healthy:ok", drained["ID"]))]


@pytest.mark.parametrize("condition,why", [("degraded", "degraded:ecc_single_on_x"), (None, "no_condition")])
def test_reactivates_when_degraded_or_no_longer_reported(condition, why):
    drained = node(4, availability="drain", condition=condition, reason="ecc_single_on_x",
                   labels={"gpu-swarm.drained-by": "health"})  # no gpu-swarm.health: not removed
    actions = reconciler.decide([drained], True, NOW)
    assert ids(actions) == [("gpu-4", "reactivate")] and actions[0].reason == why
    assert actions[0].args == ("--availability", "active", "--label-rm", "gpu-swarm.drained-by", "--label-add",
                               f"gpu-swarm.health.last=reactivated:{NOW}:{why}", drained["ID"])


@pytest.mark.parametrize("condition", ["unhealthy", "reclaim", "something-new"])
def test_keeps_its_drain_while_the_fault_lasts(condition):
    drained = node(5, availability="drain", condition=condition, labels={"gpu-swarm.drained-by": "health"})
    assert reconciler.decide([drained], True, NOW) == []


@pytest.mark.parametrize("availability,labels", [
    ("drain", {}),  # an operator's drain
    ("pause", {}),
    ("drain", {"gpu-swarm.drained-by": "rollout", "gpu-swarm.maintenance": "1:abc"}),
    ("drain", {"gpu-swarm.drained-by": "gpu-check"}),
    ("pause", {"gpu-swarm.drained-by": "health"}),  # paused since: someone else's now
])
@pytest.mark.parametrize("condition", ["unhealthy", "reclaim", "healthy", None])
def test_leaves_other_drains_alone(availability, labels, condition):
    assert reconciler.decide([node(6, availability, condition, labels=labels)], True, NOW) == []


def test_non_leader_does_nothing():
    nodes = [node(1, condition="unhealthy"), node(3, "drain", "healthy", labels={"gpu-swarm.drained-by": "health"})]
    assert reconciler.decide(nodes, False, NOW) == []
    assert ids(reconciler.decide(nodes, True, NOW)) == [("gpu-1", "drain"), ("gpu-3", "reactivate")]


def test_a_drained_node_set_active_by_hand_is_drained_again_while_faulty():
    node_ = node(7, "active", "unhealthy", "xid_48", labels={"gpu-swarm.drained-by": "health"})
    assert ids(reconciler.decide([node_], True, NOW)) == [("gpu-7", "drain")]


def test_reason_from_the_engine_label_is_sanitized():
    actions = reconciler.decide([node(8, condition="unhealthy", reason="bad reason; rm -rf /" + "x" * 200)], True, NOW)
    label = next(a for a in actions[0].args if a.startswith("gpu-swarm.health="))
    assert label == "gpu-swarm.health=unhealthy:" + ("bad_reason__rm_-rf_/" + "x" * 200)[:120]


def test_nodes_without_labels_or_hostname_are_handled():
    bare = {"ID": "abc123", "Spec": {"Availability": "active"}, "Description": {"Engine": {}}}
    assert reconciler.decide([bare], True, NOW) == []
    bare["Description"]["Engine"]["Labels"] = {"gpu-swarm.condition": "unhealthy"}
    assert ids(reconciler.decide([bare], True, NOW)) == [("abc123", "drain")]


def test_gives_back_no_node_while_its_software_changes():
    drained = node(9, "drain", "healthy", labels={"gpu-swarm.drained-by": "health",
                                                  "gpu-swarm.maintenance": "1800000000:abc"})
    assert reconciler.decide([drained], True, NOW) == []
    del drained["Spec"]["Labels"]["gpu-swarm.maintenance"]  # the rollout is done: now it does
    assert ids(reconciler.decide([drained], True, NOW)) == [("gpu-9", "reactivate")]


def test_faults_drain_at_most_the_limit_and_say_so():
    nodes = [node(n, condition="unhealthy", reason="xid_79") for n in range(1, 5)]
    actions, held = reconciler.plan(nodes, True, NOW, 50)
    assert ids(actions) == [("gpu-1", "drain"), ("gpu-2", "drain")]
    assert len(held) == 2 and "gpu-3" in held[0] and "50% of the watched nodes" in held[0]
    # Next round: two are out for faults, so nothing more goes, and a healthy one comes back.
    nodes[0] = node(1, "drain", "healthy", labels={"gpu-swarm.drained-by": "health", "gpu-swarm.health": "unhealthy:x"})
    nodes[1] = node(2, "drain", "unhealthy", labels={"gpu-swarm.drained-by": "health", "gpu-swarm.health": "unhealthy:x"})
    actions, held = reconciler.plan(nodes, True, NOW, 50)
    assert ids(actions) == [("gpu-1", "reactivate"), ("gpu-3", "drain")] and len(held) == 1


def test_the_limit_leaves_at_least_one_drain_and_never_holds_back_a_reclaim():
    nodes = [node(1, condition="unhealthy"), node(2, condition="healthy"), node(3, condition="healthy")]
    assert ids(reconciler.plan(nodes, True, NOW, 1)[0]) == [("gpu-1", "drain")]  # 1% of 3 rounds to 0: still 1
    reclaims = [node(n, condition="reclaim", reason="spot") for n in range(1, 4)]
    assert len(reconciler.plan(reclaims, True, NOW, 1)[0]) == 3
    # Reclaimed nodes that are out do not use up the budget for faults.
    out = node(4, "drain", "reclaim", labels={"gpu-swarm.drained-by": "health", "gpu-swarm.health": "reclaim:spot"})
    assert ids(reconciler.plan([out, node(5, condition="unhealthy")], True, NOW, 50)[0]) == [("gpu-5", "drain")]


def test_max_drained_percent_from_the_environment_and_checked():
    assert reconciler.parse_args([], env={"HEALTH_MAX_DRAINED_PERCENT": "25"}).max_drained_percent == 25
    assert reconciler.parse_args([], env={}).max_drained_percent == 50
    for bad in ("0", "101", "half"):
        with pytest.raises(SystemExit):
            reconciler.parse_args(["--max-drained-percent", bad], env={})


# --- the command line against a fake docker ----------------------------------------------------

FAKE_DOCKER = r"""#!/usr/bin/env bash
# A fake docker CLI: answers from the files in $FAKE_DOCKER_DIR and records every call,
# one per line, its arguments separated by tabs.
set -euo pipefail
dir=${FAKE_DOCKER_DIR:?}
line=$(printf '%s\t' "$@")
printf '%s\t\n' "${line%$'\t'}" >>"$dir/calls"  # one write: the event stream runs beside the rounds
if [ -e "$dir/down" ]; then
  echo "Cannot connect to the Docker daemon at unix:///var/run/docker.sock. Is the docker daemon running?" >&2
  exit 1
fi
case "$*" in
  "node inspect self --format {{.ManagerStatus.Leader}}") cat "$dir/leader" ;;
  "node ls -q") cat "$dir/ids" ;;
  "node inspect "*) cat "$dir/nodes.json" ;;
  "events --filter type=node --format {{.Action}}")
    # A node event once $dir/event appears (a label reaching the managers), then a stream that stays open.
    while [ ! -e "$dir/event" ]; do sleep 0.05; done
    echo update
    exec sleep 60 ;;
  "node update "*)
    if [ -e "$dir/update-fails" ]; then echo "Error response from daemon: update out of sequence" >&2; exit 1; fi
    echo "${*: -1}" ;;
  "service ps gpu-swarm-sentinel --no-trunc --format "*)
    # Its tasks as "ID<tab>hostname<tab>error" lines, once the service is there; the CLI's words when not.
    if [ ! -e "$dir/sentinel" ]; then echo "no such service: gpu-swarm-sentinel" >&2; exit 1; fi
    cat "$dir/sentinel" ;;
  "service create "*) : >"$dir/sentinel" ;;
  *) echo "fake docker: unexpected arguments: $*" >&2; exit 64 ;;
esac
"""


class FakeDocker:
    def __init__(self, tmp_path):
        self.dir = tmp_path / "docker"
        self.dir.mkdir()
        self.bin = tmp_path / "bin"
        self.bin.mkdir()
        self.path = self.bin / "docker"
        self.path.write_text(FAKE_DOCKER)
        self.path.chmod(0o755)
        self.set(True, [])

    def set(self, leader, nodes):
        (self.dir / "leader").write_text("true\n" if leader else "false\n")
        (self.dir / "ids").write_text("".join(n["ID"] + "\n" for n in nodes))
        (self.dir / "nodes.json").write_text(json.dumps(nodes, indent=4))

    def calls(self):
        path = self.dir / "calls"
        lines = path.read_text().splitlines() if path.exists() else []
        return [line.split("\t")[:-1] for line in lines]

    def env(self):
        return {"PATH": f"{self.bin}{os.pathsep}{os.environ.get('PATH', os.defpath)}",
                "FAKE_DOCKER_DIR": str(self.dir)}

    def run(self, *args, timeout=60):
        return subprocess.run([sys.executable, str(RECONCILER), *args], capture_output=True, text=True,
                              env=self.env(), timeout=timeout)


@pytest.fixture
def docker(tmp_path):
    return FakeDocker(tmp_path)


def test_fake_docker_passes_shellcheck(tmp_path):
    if not shutil.which("shellcheck"):
        pytest.skip("shellcheck is not installed")
    script = tmp_path / "docker"
    script.write_text(FAKE_DOCKER)
    done = subprocess.run(["shellcheck", str(script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout


def test_once_drains_and_reactivates_with_the_exact_arguments(docker):
    unhealthy = node(1, condition="unhealthy", reason=f"xid_79_on_{GPU}")
    healed = node(2, "drain", "healthy", labels={"gpu-swarm.drained-by": "health", "gpu-swarm.health": "reclaim:x"})
    operators = node(3, "drain", "unhealthy")
    docker.set(True, [unhealthy, healed, operators])
    before = int(time.time())
    done = docker.run("--once", "--json")
    after = int(time.time())
    assert done.returncode == 0, done.stderr
    calls = docker.calls()
    assert calls[:3] == [["node", "inspect", "self", "--format", "{{.ManagerStatus.Leader}}"], ["node", "ls", "-q"],
                         ["node", "inspect", unhealthy["ID"], healed["ID"], operators["ID"]]]
    updates = calls[3:]
    assert len(updates) == 2
    stamp = updates[0][-2].split(":")[1]
    assert before <= int(stamp) <= after
    why = f"unhealthy:xid_79_on_{GPU}"
    assert updates[0] == ["node", "update", "--availability", "drain", "--label-add", "gpu-swarm.drained-by=health",
                          "--label-add", f"gpu-swarm.health={why}",
                          "--label-add", f"gpu-swarm.health.last=drained:{stamp}:{why}", unhealthy["ID"]]
    assert updates[1] == ["node", "update", "--availability", "active", "--label-rm", "gpu-swarm.drained-by",
                          "--label-rm", "gpu-swarm.health",
                          "--label-add", f"gpu-swarm.health.last=reactivated:{stamp}:healthy:ok", healed["ID"]]
    report = json.loads(done.stdout)
    assert report["leader"] is True and report["nodes"] == 3 and report["errors"] == []
    assert [(a["node"], a["action"]) for a in report["actions"]] == [("gpu-1", "drain"), ("gpu-2", "reactivate")]
    assert f"node gpu-1 ({unhealthy['ID'][:12]}): drained: {why}" in done.stderr
    assert f"node gpu-2 ({healed['ID'][:12]}): reactivated: healthy:ok" in done.stderr


def test_once_reports_and_logs_what_the_limit_held_back(docker):
    docker.set(True, [node(n, condition="unhealthy", reason="xid_79") for n in range(1, 4)])
    done = docker.run("--once", "--json", "--max-drained-percent", "34")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert [a["node"] for a in report["actions"]] == ["gpu-1"] and len(report["held"]) == 2
    assert [c[-1] for c in docker.calls() if c[:2] == ["node", "update"]] == [node(1)["ID"]]
    assert "held back: node gpu-2" in done.stderr and "held back: node gpu-3" in done.stderr


def test_once_as_a_non_leader_only_asks_who_leads(docker):
    docker.set(False, [node(1, condition="unhealthy")])
    done = docker.run("--once")
    assert done.returncode == 0, done.stderr
    assert docker.calls() == [["node", "inspect", "self", "--format", "{{.ManagerStatus.Leader}}"]]
    assert "not the leader" in done.stdout and "leader=False" in done.stdout


def test_a_failed_update_is_reported_and_the_others_still_run(docker):
    docker.set(True, [node(1, condition="unhealthy"), node(2, condition="reclaim")])
    (docker.dir / "update-fails").touch()
    done = docker.run("--once", "--json")
    assert done.returncode == 1
    report = json.loads(done.stdout)
    assert report["actions"] == [] and len(report["errors"]) == 2
    assert "update out of sequence" in report["errors"][0]
    assert [c[:2] for c in docker.calls()].count(["node", "update"]) == 2


def test_engine_errors_never_end_the_loop(docker):
    (docker.dir / "down").touch()
    process = subprocess.Popen([sys.executable, str(RECONCILER), "--interval", "0.1"], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, env=docker.env())
    try:
        deadline = time.time() + 20
        while len(docker.calls()) < 3 and time.time() < deadline:
            time.sleep(0.05)
        assert len(docker.calls()) >= 3 and process.poll() is None  # retried, still running
        (docker.dir / "down").unlink()
        docker.set(True, [node(1, condition="unhealthy")])
        out = ""
        while not ("drained: " in out and "swarm leader" in out) and time.time() < deadline:
            if select.select([process.stdout], [], [], 0.1)[0]:
                out += process.stdout.readline()
        assert any(c[:2] == ["node", "update"] for c in docker.calls())
    finally:
        process.terminate()
        out += process.communicate(timeout=10)[0]
    assert out.count("Cannot connect to the Docker daemon") == 1  # said once, not every round
    assert "this manager is the swarm leader" in out and "drained: unhealthy:ok" in out


def test_a_node_event_starts_a_round_at_once(docker):
    """The label arrives with the node's description: the drain waits for no round of --interval."""
    docker.set(True, [node(1)])
    process = subprocess.Popen([sys.executable, str(RECONCILER), "--interval", "30"], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, env=docker.env(), start_new_session=True)
    try:
        deadline = time.time() + 20
        def first_round_done() -> bool:  # the events stream is asked for, and the first round has read the nodes
            calls = docker.calls()
            read = any(c[:2] == ["node", "inspect"] and "self" not in c for c in calls)
            return read and any(c[:1] == ["events"] for c in calls)
        while not first_round_done() and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)  # the round's end: it found nothing to do
        docker.set(True, [node(1, condition="unhealthy")])
        (docker.dir / "event").touch()
        woke = time.time()
        while not any(c[:2] == ["node", "update"] for c in docker.calls()) and time.time() < deadline:
            time.sleep(0.05)
        assert any(c[:2] == ["node", "update"] for c in docker.calls()), "no drain before the next round"
        assert time.time() - woke < 10  # long before the round 30 s on
        assert sum(c[:2] == ["node", "ls"] for c in docker.calls()) == 2  # the first round, and the one woken
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.communicate(timeout=10)


def test_once_with_the_engine_down_exits_1(docker):
    (docker.dir / "down").touch()
    done = docker.run("--once")
    assert done.returncode == 1 and "Cannot connect to the Docker daemon" in done.stdout
    done = docker.run("--once", "--docker", str(docker.bin / "no-such-docker"))
    assert done.returncode == 1 and "no-such-docker" in done.stdout


def test_unparseable_inspect_output_is_an_error_not_a_crash(docker):
    docker.set(True, [node(1)])
    (docker.dir / "nodes.json").write_text("Error: something\n")
    done = docker.run("--once", "--json")
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "no JSON" in json.loads(done.stdout)["errors"][0]


@pytest.mark.parametrize("interval", ["0", "-1", "soon"])
def test_bad_interval_exit_2(docker, interval):
    done = docker.run("--once", "--interval", interval)
    assert done.returncode == 2 and "--interval" in done.stderr
    assert docker.calls() == []


# --- the systemd unit -------------------------------------------------------------------------

def test_unit_runs_the_reconciler_with_the_system_python():
    settings = {}
    for line in UNIT.read_text().splitlines():
        if "=" in line and not line.startswith("#"):
            key, value = line.split("=", 1)
            settings.setdefault(key, []).append(value)
    assert settings["Type"] == ["simple"] and settings["Restart"] == ["always"]
    assert "docker.service" in settings["After"][0].split()
    assert settings["ExecStart"] == ["/usr/bin/python3 /opt/gpu-swarm/software/swarm_reconciler.py"]
    assert "multi-user.target" in settings["WantedBy"][0]


def test_unit_passes_systemd_analyze_verify():
    tool = shutil.which("systemd-analyze")
    if not tool:
        pytest.skip("systemd-analyze is not installed")
    if not os.access("/usr/bin/python3", os.X_OK):
        pytest.skip("no /usr/bin/python3 here for ExecStart")
    done = subprocess.run([tool, "verify", str(UNIT)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and UNIT.name not in done.stderr, done.stderr


def test_module_is_stdlib_and_its_sibling_contract_only():
    """It runs under the system python3, with node/ beside it: the contract, and nothing installed."""
    code = ("import sys, importlib.util; before = set(sys.modules); "
            f"s = importlib.util.spec_from_file_location('r', {str(RECONCILER)!r}); "
            "m = importlib.util.module_from_spec(s); sys.modules['r'] = m; s.loader.exec_module(m); "
            "print(sorted(n for n in set(sys.modules) - before if n.split('.')[0] not in sys.stdlib_module_names "
            "and n != 'r'))")
    done = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "['contract']"


def test_it_reads_and_writes_the_labels_the_program_and_the_watcher_use():
    from swarm import labels
    spec_ = importlib.util.spec_from_file_location("health_rules_for_labels", ROOT / "node" / "health_rules.py")
    rules = importlib.util.module_from_spec(spec_)
    spec_.loader.exec_module(rules)  # node/ is on sys.path: the reconciler put it there
    written = rules.condition_labels("unhealthy", "xid_79", GPU, NOW)
    assert set(written) == {labels.CONDITION_LABEL, labels.CONDITION_REASON_LABEL, labels.CONDITION_GPU_LABEL,
                            labels.CONDITION_SINCE_LABEL}
    engine_node = node(1)
    engine_node["Description"]["Engine"]["Labels"].update(written)
    drain = reconciler.decide([engine_node], leader=True, now=NOW)[0]
    assert drain.action == "drain" and drain.args[:4] == (
        "--availability", "drain", "--label-add", f"{labels.DRAINED_BY_LABEL}={labels.DRAINED_BY_HEALTH}")
    assert f"{labels.HEALTH_LABEL}=unhealthy:xid_79" in drain.args
    assert any(a.startswith(f"{labels.HEALTH_LAST_LABEL}=drained:") for a in drain.args)
    held = node(2, availability="drain", condition="healthy",
                labels={labels.DRAINED_BY_LABEL: labels.DRAINED_BY_HEALTH, labels.MAINTENANCE_LABEL: "1:abc"})
    assert reconciler.decide([held], leader=True, now=NOW) == []



# --- the sentinel: a fault heard at once, not on the agent's 20 s tick -------------------------------

def signalled(n, at=NOW - 5, **kw):
    return node(n, "drain", labels={"gpu-swarm.drained-by": "health", "gpu-swarm.health": "unhealthy:sentinel",
                                    "gpu-swarm.health.signalled": str(at)}, **kw)


def since(n, value, **kw):
    found = node(n, **kw)
    found["Description"]["Engine"]["Labels"]["gpu-swarm.condition.since"] = str(value)
    return found


def test_a_signalled_node_drains_before_its_labels_say_why():
    nodes = [since(1, NOW - 3600, condition="healthy"), since(2, NOW - 3600, condition="healthy")]
    (action,) = reconciler.decide(nodes, True, NOW, signalled=frozenset({nodes[0]["ID"]}))
    assert action.node == "gpu-1" and action.action == "drain" and action.reason == "unhealthy:sentinel"
    assert action.args == ("--availability", "drain", "--label-add", "gpu-swarm.drained-by=health",
                           "--label-add", "gpu-swarm.health=unhealthy:sentinel",
                           "--label-add", f"gpu-swarm.health.last=drained:{NOW}:unhealthy:sentinel",
                           "--label-add", f"gpu-swarm.health.signalled={NOW}", nodes[0]["ID"])


def test_a_signalled_node_whose_labels_already_say_why_drains_on_them():
    nodes = [node(1, condition="reclaim", reason="spot_terminate")]
    (action,) = reconciler.decide(nodes, True, NOW, signalled=frozenset({nodes[0]["ID"]}))
    assert action.reason == "reclaim:spot_terminate" and not any("signalled" in a for a in action.args)


def test_the_old_labels_give_no_signalled_node_back():
    """Its labels are the ones from before the fault (healthy since long ago): they are no news."""
    held = dict(signalled(1)); held["Description"] = since(1, NOW - 3600, condition="healthy")["Description"]
    no_label = signalled(2)  # no condition yet: the watcher's first word is on its way
    assert reconciler.decide([held, no_label], True, NOW) == []


def test_labels_that_catch_up_replace_the_sentinels_reason():
    caught = signalled(1); caught["Description"] = node(1, condition="unhealthy", reason=f"xid_79_on_{GPU}")["Description"]
    (action,) = reconciler.decide([caught], True, NOW)
    assert action.action == "explain" and action.reason == f"unhealthy:xid_79_on_{GPU}"
    assert action.args == ("--label-add", f"gpu-swarm.health=unhealthy:xid_79_on_{GPU}",
                           "--label-rm", "gpu-swarm.health.signalled", caught["ID"])


@pytest.mark.parametrize("labels_since, at, why", [
    (NOW - 2, NOW - 5, "healthy:ok"),  # the GPU healed after the signal: labels newer than it
    (NOW - 3600, NOW - reconciler.SIGNAL_HOLD_S, "healthy:ok"),  # labels that never changed: the signal was no fault
])
def test_a_signalled_node_comes_back_on_news_or_after_the_hold(labels_since, at, why):
    back = signalled(1, at=at); back["Description"] = since(1, labels_since, condition="healthy")["Description"]
    (action,) = reconciler.decide([back], True, NOW)
    assert action.action == "reactivate" and action.reason == why
    assert action.args[:7] == ("--availability", "active", "--label-rm", "gpu-swarm.drained-by",
                               "--label-rm", "gpu-swarm.health", "--label-rm") and "gpu-swarm.health.signalled" in action.args


def test_signals_count_against_the_drain_limit():
    nodes = [since(n, NOW - 3600, condition="healthy") for n in (1, 2, 3, 4)]
    actions, held = reconciler.plan(nodes, True, NOW, 50, frozenset(n["ID"] for n in nodes))
    assert ids(actions) == [("gpu-1", "drain"), ("gpu-2", "drain")] and len(held) == 2


class SentinelEngine:
    def __init__(self, tasks):
        self.tasks, self.created = tasks, 0

    def sentinel_tasks(self):
        return self.tasks

    def create_sentinel(self):
        self.created += 1
        self.tasks = []


def test_the_sentinel_acts_on_new_exits_only():
    nodes = [node(1), node(2)]
    engine = SentinelEngine(None)
    watch = reconciler.Sentinel()
    assert watch.signalled(engine, nodes, print) == frozenset() and engine.created == 1  # made when missing
    engine.tasks = [("t-old", "gpu-1", "task: non-zero exit (75)"), ("t-run", "gpu-2", "")]
    watch.forget()  # a new leader: what is there is history
    assert watch.signalled(engine, nodes, print) == frozenset()
    engine.tasks += [("t-new", "gpu-2", "task: non-zero exit (75)"), ("t-oom", "gpu-1", "task: non-zero exit (137)"),
                     ("t-gone", "gpu-9", "task: non-zero exit (75)")]  # a node swarm no longer lists
    assert watch.signalled(engine, nodes, print) == frozenset({nodes[1]["ID"]})
    assert watch.signalled(engine, nodes, print) == frozenset()  # once
    assert engine.created == 1


def test_the_loop_makes_the_sentinel_and_drains_on_its_exit_within_a_round(docker):
    docker.set(True, [since(1, NOW - 3600, condition="healthy")])
    process = subprocess.Popen([sys.executable, str(RECONCILER), "--interval", "0.2"], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, env=docker.env(), start_new_session=True)
    try:
        deadline = time.time() + 20
        while not any(c[:2] == ["service", "create"] for c in docker.calls()) and time.time() < deadline:
            time.sleep(0.05)
        (create,) = [c for c in docker.calls() if c[:2] == ["service", "create"]]
        assert create[2:] == ["--detach", "--name", "gpu-swarm-sentinel", "--mode", "global", "--no-resolve-image",
                              "--constraint", "node.role==worker", "--restart-condition", "any", "--restart-delay",
                              "1s", "--stop-grace-period", "2s", "--limit-memory", "32M", "--cap-drop", "ALL",
                              "--read-only", "gpu-swarm.invalid/check:1",
                              "sh", "-c", reconciler.SENTINEL_COMMAND]
        while sum(c[:2] == ["service", "ps"] for c in docker.calls()) < 2 and time.time() < deadline:
            time.sleep(0.05)  # a round has seen it, with no task exited yet
        assert not any(c[:2] == ["node", "update"] for c in docker.calls())
        (docker.dir / "sentinel").write_text("task1\tgpu-1\ttask: non-zero exit (75)\n")
        while not any(c[:2] == ["node", "update"] for c in docker.calls()) and time.time() < deadline:
            time.sleep(0.05)
        (update,) = [c for c in docker.calls() if c[:2] == ["node", "update"]]
        assert "gpu-swarm.health=unhealthy:sentinel" in update and update[-1] == node(1)["ID"]
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.communicate(timeout=10)


def test_the_sentinel_command_exits_with_its_code_on_the_signal_and_0_when_swarm_stops_it():
    """The very command line, in busybox sh as CHECK_IMAGE has it (bash where busybox is missing)."""
    shell = [shutil.which("busybox"), "sh"] if shutil.which("busybox") else ["bash"]
    for sig, code in ((signal.SIGUSR1, reconciler.SENTINEL_EXIT), (signal.SIGTERM, 0)):
        process = subprocess.Popen([*shell, "-c", reconciler.SENTINEL_COMMAND])
        time.sleep(0.3)
        started = time.time()
        process.send_signal(sig)
        assert process.wait(timeout=5) == code and time.time() - started < 1
