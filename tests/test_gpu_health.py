"""Tests for the GPU health watcher (node/gpu_health.py), without a GPU, a dockerd or AWS.

The decisions are pure functions, called directly. The command line runs in-process
(main) or as a subprocess, always with every path (daemon.json, state file, dockerd
pidfile) under tmp_path: a default path would touch this machine's docker. NVML is
localswarm/standins/pynvml.py, IMDS a small http.server on 127.0.0.1 (or, where a test does
not name one, a port nobody listens on: every node asks IMDS for scheduled maintenance).
"""
import http.server
import importlib.util
import json
import os
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WATCHER = ROOT / "node" / "gpu_health.py"
UNIT = ROOT / "node" / "gpu-swarm-health.service"
FAKE_NVML_DIR = ROOT / "localswarm" / "standins"


def _load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


health = _load("gpu_health", WATCHER)
import health_rules as rules  # noqa: E402  (node/ is on sys.path: the watcher put it there)
fake_nvml = _load("pynvml_standin", FAKE_NVML_DIR / "pynvml.py")


def uuid(n):
    return f"GPU-{n:08x}-1111-2222-3333-{n:012x}"


NO_IMDS = "http://127.0.0.1:9"  # the discard port, which nothing here listens on (nor takes as an ephemeral port)


def inventory_gpu(n):
    return {"index": n, "uuid": uuid(n), "name": "NVIDIA H200", "memory_mib": 143771, "mig": False}


class Node:
    """A node under tmp_path: daemon.json, state file, dockerd pidfile, inventory and faults."""

    def __init__(self, tmp_path, gpus=2):
        self.root = tmp_path
        self.daemon_json = tmp_path / "daemon.json"
        self.state = tmp_path / "health-state.json"
        self.pidfile = tmp_path / "docker.pid"  # absent unless a test starts a fake dockerd
        self.faults = tmp_path / "faults.json"
        self.inventory = tmp_path / "inventory.json"
        self.inventory.write_text(json.dumps([inventory_gpu(n) for n in range(gpus)]))
        self.write_daemon({"data-root": "/data", "labels": ["zone=a", "gpu.count=2"],
                           "node-generic-resources": [f"NVIDIA-GPU={uuid(n)}" for n in range(gpus)]})

    def write_daemon(self, config):
        self.daemon_json.write_text(config if isinstance(config, str) else json.dumps(config, indent=4))

    def daemon(self):
        return json.loads(self.daemon_json.read_text())

    def labels(self):
        return dict(label.split("=", 1) for label in self.daemon()["labels"] if label.startswith("gpu-swarm."))

    def set_faults(self, faults):
        self.faults.write_text(json.dumps(faults))

    def paths(self):
        return ["--daemon-json", str(self.daemon_json), "--state-file", str(self.state),
                "--dockerd-pidfile", str(self.pidfile), "--imds", NO_IMDS,  # a later --imds wins
                "--docker-socket", str(self.root / "docker.sock")]  # absent unless a test serves one; later wins

    def sim_args(self):
        return ["--inventory", str(self.inventory), "--faults", str(self.faults)]

    def sim(self):
        return [*self.paths(), *self.sim_args()]

    def main(self, capsys, *args):
        """main() in-process with --once --json; returns (exit code, report or None, stderr)."""
        rc = health.main([*self.paths(), "--once", "--json", *args])
        out, err = capsys.readouterr()
        return rc, (json.loads(out) if rc == 0 else None), err

    def cli(self, *args, env=None, timeout=60):
        environment = {"PATH": os.environ.get("PATH", os.defpath), **(env or {})}
        return subprocess.run([sys.executable, str(WATCHER), *self.paths(), *args], capture_output=True,
                              text=True, env=environment, timeout=timeout)

    def once(self, *args, env=None):
        done = self.cli("--inventory", str(self.inventory), "--faults", str(self.faults), "--once", "--json",
                        *args, env=env)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout), done.stderr


@pytest.fixture
def node(tmp_path):
    return Node(tmp_path)


# --- the pure decisions -------------------------------------------------------------

XID_TABLE = [  # xid, --ignore-xids, --critical-xids, condition
    (13, set(), set(), "healthy"), (31, set(), set(), "healthy"), (43, set(), set(), "healthy"),
    (45, set(), set(), "healthy"), (68, set(), set(), "healthy"), (109, set(), set(), "healthy"),
    (48, set(), set(), "unhealthy"), (63, set(), set(), "unhealthy"), (79, set(), set(), "unhealthy"),
    (94, set(), set(), "unhealthy"), (94, {94, 95}, set(), "healthy"), (95, {94, 95}, set(), "healthy"),
    (13, set(), {13}, "unhealthy"), (43, {43}, {43}, "unhealthy"), (79, {1}, {13}, "unhealthy"),
]


@pytest.mark.parametrize("xid,ignore,critical,expected", XID_TABLE)
def test_xid_classification(xid, ignore, critical, expected):
    assert rules.classify_xid(xid, rules.ignored_xids(ignore, critical)) == expected


def test_ignored_xids_default_and_event_kinds():
    assert rules.ignored_xids() == {13, 31, 43, 45, 68, 109}
    assert rules.ignored_xids({1, 2}, {13, 2}) == {1, 31, 43, 45, 68, 109}
    ignored = rules.ignored_xids()
    assert rules.classify_event("ecc_double", None, ignored) == "unhealthy"
    assert rules.classify_event("ecc_single", None, ignored) == "degraded"
    assert rules.classify_event("xid", 13, ignored) == "healthy"


@pytest.mark.parametrize("gpus,spot,expected", [
    ({}, rules.OK, ("healthy", "ok", "-")),
    ({"A": ("healthy", "ok"), "B": ("degraded", "sbe_B")}, rules.OK, ("degraded", "sbe_B", "B")),
    ({"A": ("degraded", "d"), "B": ("unhealthy", "u")}, rules.OK, ("unhealthy", "u", "B")),
    ({"A": ("unhealthy", "first"), "B": ("unhealthy", "second")}, rules.OK, ("unhealthy", "first", "A")),
    ({"A": ("unhealthy", "u")}, ("reclaim", "spot_terminate"), ("reclaim", "spot_terminate", "-")),
    ({"A": ("healthy", "ok")}, ("reclaim", "r"), ("reclaim", "r", "-")),
])
def test_node_condition_is_the_worst(gpus, spot, expected):
    assert rules.node_condition(gpus, spot) == expected


def test_recovery_after_an_event_needs_checks_passing_for_the_whole_window():
    log = []
    tracker = rules.Tracker(300, log.append)
    a = uuid(0)
    tracker.check(a, "healthy", "ok", 0)
    tracker.event(a, "unhealthy", f"xid_79_on_{a}", 100)
    assert tracker.states([a], 399) == {a: ("unhealthy", f"xid_79_on_{a}")}  # 299 s after the event
    tracker.check(a, "healthy", "ok", 399)
    assert tracker.states([a], 400) == {a: ("healthy", "ok")}  # 300 s after it
    assert log == [f"{a}: xid_79_on_{a} cleared: checks passed for 300s since the event"]

    tracker.event(a, "unhealthy", "xid_79", 1000)
    tracker.check(a, "unhealthy", "not_found", 1100)  # a failed check breaks the run ...
    tracker.check(a, "healthy", "ok", 1200)  # ... which starts again here
    assert tracker.states([a], 1400)[a][0] == "unhealthy"  # 400 s after the event, 200 s of passing
    assert tracker.states([a], 1500)[a] == ("healthy", "ok")


def test_a_later_event_restarts_the_window_and_a_milder_one_does_not_hide_a_worse_one():
    tracker = rules.Tracker(60, lambda _: None)
    a = uuid(0)
    tracker.check(a, "healthy", "ok", 0)
    assert tracker.event(a, "unhealthy", "dbe", 10) is True
    assert tracker.event(a, "degraded", "sbe", 50) is False  # the state stays unhealthy: no news
    assert tracker.states([a], 100) == {a: ("unhealthy", "dbe")}  # 60 s after the first, 50 after the last
    assert tracker.states([a], 110) == {a: ("healthy", "ok")}


def test_check_results_clear_as_soon_as_the_check_passes():
    tracker = rules.Tracker(300, lambda _: None)
    a, b = uuid(0), uuid(1)
    tracker.check(a, "unhealthy", "not_found", 0)
    tracker.check(b, "degraded", "pages_pending_retirement", 0)
    assert tracker.states([a, b], 0) == {a: ("unhealthy", "not_found"), b: ("degraded", "pages_pending_retirement")}
    tracker.check(a, "healthy", "ok", 10)
    tracker.check(b, "healthy", "ok", 10)
    assert tracker.states([a, b], 10) == {a: ("healthy", "ok"), b: ("healthy", "ok")}


def test_event_cleared_timing():
    assert rules.event_cleared(100, 50, 400, 300) is True
    assert rules.event_cleared(100, 50, 399.9, 300) is False
    assert rules.event_cleared(100, 200, 450, 300) is False  # checks pass only since 200
    assert rules.event_cleared(100, None, 10_000, 300) is False  # checks are failing
    assert rules.event_cleared(100, 100, 100, 0) is True


def test_watched_uuids_of_the_kind_and_shared_kind():
    config = {"node-generic-resources": [
        f"NVIDIA-GPU={uuid(0)}", "FPGA=fpga0", f"SHARED={uuid(1)}-s0", f"SHARED={uuid(1)}-s1",
        f"SHARED={uuid(0)}-s12", f"NVIDIA-GPU={uuid(0)}", "NVIDIA-GPU=MIG-" + uuid(5)[4:]]}
    assert rules.watched_uuids(config, "NVIDIA-GPU") == [uuid(0), "MIG-" + uuid(5)[4:]]
    assert rules.watched_uuids(config, "NVIDIA-GPU", "SHARED") == [uuid(0), uuid(1), "MIG-" + uuid(5)[4:]]
    assert rules.watched_uuids(config, "OTHER") == [] and rules.watched_uuids({}, "NVIDIA-GPU") == []


def test_reason_is_sanitized():
    def reason(text):
        return rules.condition_labels("unhealthy", text, "GPU-1", 0)["gpu-swarm.condition.reason"]
    assert reason("xid 79 on GPU-1 (fell off the bus)") == "xid_79_on_GPU-1__fell_off_the_bus_"
    assert reason("ok:a/b.c-d_e") == "ok:a/b.c-d_e"
    assert len(reason("x" * 500)) == 120
    assert reason(" ") == "-"
    assert rules.condition_labels("healthy", "a b", "", 12.7) == {
        "gpu-swarm.condition": "healthy", "gpu-swarm.condition.reason": "a_b", "gpu-swarm.condition.gpu": "-",
        "gpu-swarm.condition.since": "12"}


def test_label_merge_keeps_every_other_key_and_label():
    config = {"data-root": "/data", "labels": ["zone=a", "gpu-swarm.condition=unhealthy", "gpu.count=2",
                                               "gpu-swarm.condition.reason=old", "gpu-swarm.pool=h100"],
              "node-generic-resources": ["NVIDIA-GPU=x"], "runtimes": {"nvidia": {"path": "p"}}}
    labels = rules.condition_labels("healthy", "ok", "-", 5)
    merged = rules.merge_labels(config, labels)
    # Ours are set where they were (the agent's gpu.* labels never move), new ones come last.
    assert merged == {**config, "labels": ["zone=a", "gpu-swarm.condition=healthy", "gpu.count=2",
                                           "gpu-swarm.condition.reason=ok", "gpu-swarm.pool=h100",
                                           "gpu-swarm.condition.gpu=-", "gpu-swarm.condition.since=5"]}
    assert list(merged) == list(config) and config["labels"][1] == "gpu-swarm.condition=unhealthy"  # not mutated
    assert rules.merge_labels({}, labels)["labels"][0] == "gpu-swarm.condition=healthy"


# --- daemon.json, SIGHUP and the state file ------------------------------------------------

def test_first_run_writes_labels_keeping_the_rest_and_a_second_run_writes_nothing(node, capsys):
    node.daemon_json.chmod(0o640)
    rc, report, _ = node.main(capsys, "--inventory", str(node.inventory))
    assert rc == 0 and report["changed"] is True and report["condition"] == "healthy"
    daemon = node.daemon()
    assert daemon["data-root"] == "/data" and daemon["node-generic-resources"] == [f"NVIDIA-GPU={uuid(0)}",
                                                                                    f"NVIDIA-GPU={uuid(1)}"]
    assert daemon["labels"][:2] == ["zone=a", "gpu.count=2"]
    assert node.labels() == {"gpu-swarm.condition": "healthy", "gpu-swarm.condition.reason": "ok",
                             "gpu-swarm.condition.gpu": "-", "gpu-swarm.condition.since": str(report["since"])}
    assert abs(report["since"] - time.time()) < 30
    assert stat.S_IMODE(node.daemon_json.stat().st_mode) == 0o640
    before = (node.daemon_json.read_bytes(), node.daemon_json.stat().st_mtime_ns, node.daemon_json.stat().st_ino)
    rc, again, _ = node.main(capsys, "--inventory", str(node.inventory))
    assert rc == 0 and again["changed"] is False and again["dockerd"] == "not told"
    assert (node.daemon_json.read_bytes(), node.daemon_json.stat().st_mtime_ns,
            node.daemon_json.stat().st_ino) == before
    assert sorted(p.name for p in node.root.iterdir()) == ["daemon.json", "health-state.json", "inventory.json"]


@pytest.mark.parametrize("content", ['{"labels": ["a=b"],,}', '["x"]', '{"labels": "zone=a"}', b'{"x": "\xff"}'])
def test_corrupt_daemon_json_is_left_untouched_exit_2(node, capsys, content):
    (node.daemon_json.write_bytes if isinstance(content, bytes) else node.daemon_json.write_text)(content)
    before = node.daemon_json.read_bytes()
    rc, _, err = node.main(capsys, "--inventory", str(node.inventory))
    assert rc == 2 and str(node.daemon_json) in err
    assert node.daemon_json.read_bytes() == before
    assert sorted(p.name for p in node.root.iterdir()) == ["daemon.json", "inventory.json"]


HUP_RECORDER = """
import signal, sys, time
def hup(*_):
    with open(sys.argv[1], "a") as f:
        f.write("HUP\\n")
signal.signal(signal.SIGHUP, hup)
open(sys.argv[2], "w").write("ready")
while True:
    time.sleep(0.05)
"""


@pytest.fixture
def dockerd(node):
    """A stand-in dockerd that records each SIGHUP; its pid is in node.pidfile."""
    record, ready = node.root / "hups.txt", node.root / "ready"
    child = subprocess.Popen([sys.executable, "-c", HUP_RECORDER, str(record), str(ready)])
    try:
        deadline = time.time() + 20
        while not ready.exists() and time.time() < deadline:
            time.sleep(0.02)
        node.pidfile.write_text(f"{child.pid}\n")
        yield lambda: record.read_text().count("HUP") if record.exists() else 0
    finally:
        child.kill()
        child.wait()


def wait_for(predicate, timeout=10.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def test_sighup_is_sent_on_change_and_only_then(node, capsys, dockerd):
    rc, report, _ = node.main(capsys, *node.sim_args())
    assert rc == 0 and report["dockerd"].startswith("sent SIGHUP")
    assert wait_for(lambda: dockerd() == 1)
    node.main(capsys, *node.sim_args())
    node.set_faults({uuid(1): {"pending_retirement": True}})
    rc, report, _ = node.main(capsys, *node.sim_args())
    assert report["condition"] == "degraded" and report["changed"] is True
    assert wait_for(lambda: dockerd() == 2)
    node.main(capsys, *node.sim_args())
    time.sleep(0.3)
    assert dockerd() == 2  # nothing changed, nothing sent


@pytest.mark.parametrize("content", ["0", "-1", "1", "not a pid", ""])
def test_a_pidfile_without_a_usable_pid_signals_nothing(node, content):
    node.pidfile.write_text(content)
    # Its own session: a kill(0, SIGHUP) would end this process, not pytest.
    done = subprocess.run([sys.executable, str(WATCHER), *node.sim(), "--once"], capture_output=True, text=True,
                          timeout=60, start_new_session=True)
    assert done.returncode == 0, done.stderr
    assert "dockerd was not told" in done.stdout
    assert node.labels()["gpu-swarm.condition"] == "healthy"


def test_no_pidfile_means_dockerd_reads_the_labels_at_start(node, capsys):
    rc, report, _ = node.main(capsys, *node.sim_args())
    assert rc == 0 and "dockerd is not running" in report["dockerd"]


# --- simulation mode, end to end ------------------------------------------------------------

def test_simulated_xid_makes_unhealthy_and_recovers_after_the_wait(node):
    report, _ = node.once()
    assert report["condition"] == "healthy"
    node.set_faults({uuid(1): {"xid": 79}})
    report, log = node.once("--recovery-seconds", "2")
    assert report["condition"] == "unhealthy" and report["gpu"] == uuid(1)
    assert report["reason"] == f"xid_79_on_{uuid(1)}" and f"{uuid(1)}: xid 79: unhealthy" in log
    assert node.labels()["gpu-swarm.condition.reason"] == f"xid_79_on_{uuid(1)}"
    assert node.labels()["gpu-swarm.condition.gpu"] == uuid(1)
    node.set_faults({})
    report, _ = node.once("--recovery-seconds", "2")
    assert report["condition"] == "unhealthy"  # remembered (state file) until the window has passed
    since = report["since"]
    time.sleep(2.1)
    report, log = node.once("--recovery-seconds", "2")
    assert report["condition"] == "healthy" and report["reason"] == "ok" and report["changed"] is True
    assert f"xid_79_on_{uuid(1)} cleared" in log
    assert report["since"] >= since


@pytest.mark.parametrize("fault,condition,reason", [
    ({"ecc": "double"}, "unhealthy", "ecc_double_on_"),
    ({"ecc": "single"}, "degraded", "ecc_single_on_"),
    ({"missing": True}, "unhealthy", "not_found_on_"),
    ({"pending_retirement": True}, "degraded", "pages_pending_retirement_on_"),
    ({"xid": 13}, "healthy", "ok"),
])
def test_simulated_faults(node, fault, condition, reason):
    node.set_faults({uuid(0): fault})
    report, _ = node.once()
    assert report["condition"] == condition
    assert report["reason"] == (reason + uuid(0) if reason != "ok" else "ok")


def test_check_faults_clear_at_once_and_event_faults_wait(node):
    node.set_faults({uuid(0): {"missing": True}, uuid(1): {"ecc": "double"}})
    report, _ = node.once("--recovery-seconds", "300")
    assert report["gpus"] == {uuid(0): {"condition": "unhealthy", "reason": f"not_found_on_{uuid(0)}"},
                              uuid(1): {"condition": "unhealthy", "reason": f"ecc_double_on_{uuid(1)}"}}
    assert report["gpu"] == uuid(0)  # equally bad: the first GPU names the reason
    node.set_faults({})
    report, _ = node.once("--recovery-seconds", "300")
    assert report["gpus"][uuid(0)]["condition"] == "healthy"
    assert report["condition"] == "unhealthy" and report["gpu"] == uuid(1)


def test_critical_and_ignored_xids_from_flags_and_environment(node):
    node.set_faults({uuid(0): {"xid": 13}})
    assert node.once("--critical-xids", "13")[0]["condition"] == "unhealthy"
    node.state.unlink()
    node.set_faults({uuid(0): {"xid": 94}})
    assert node.once(env={"HEALTH_IGNORE_XIDS": "94,95"})[0]["condition"] == "healthy"
    assert node.once()[0]["condition"] == "unhealthy"


def test_advertised_gpu_missing_from_the_inventory_is_unhealthy(node):
    node.write_daemon({"node-generic-resources": [f"NVIDIA-GPU={uuid(0)}", f"NVIDIA-GPU={uuid(7)}"]})
    report, _ = node.once()
    assert report["condition"] == "unhealthy" and report["reason"] == f"not_found_on_{uuid(7)}"


def test_kind_and_shared_kind_choose_the_gpus(node):
    node.write_daemon({"node-generic-resources": [f"H200={uuid(0)}", f"SHARED={uuid(1)}-s0", f"SHARED={uuid(1)}-s1"]})
    node.set_faults({uuid(1): {"xid": 79}})
    report, _ = node.once(env={"GPU_SWARM_KIND": "H200"})
    assert list(report["gpus"]) == [uuid(0)] and report["condition"] == "healthy"
    report, _ = node.once("--kind", "H200", "--shared-kind", "SHARED")
    assert list(report["gpus"]) == [uuid(0), uuid(1)] and report["condition"] == "unhealthy"


@pytest.mark.parametrize("content", ['{"x": ', '[]', json.dumps({uuid(0): {"xid": "79"}}),
                                     json.dumps({uuid(0): {"ecc": "triple"}}), json.dumps({uuid(0): {"fire": True}}),
                                     json.dumps({uuid(0): {}}), json.dumps({uuid(0): {"missing": 1}})])
def test_bad_faults_file_exit_2_and_nothing_written(node, content):
    node.faults.write_text(content)
    before = node.daemon_json.read_bytes()
    done = node.cli(*node.sim_args(), "--once")
    assert done.returncode == 2 and str(node.faults) in done.stderr and "Traceback" not in done.stderr
    assert node.daemon_json.read_bytes() == before


def test_empty_or_missing_faults_file_means_no_faults(node):
    node.faults.write_text("")
    assert node.once()[0]["condition"] == "healthy"
    node.faults.unlink()
    assert node.once()[0]["condition"] == "healthy"


@pytest.mark.parametrize("args,env,message", [
    (["--ignore-xids", "13,x"], {}, "comma-separated list of XIDs"),
    (["--interval", "0"], {}, "--interval"),
    ([], {"HEALTH_RECOVERY_SECONDS": "soon"}, "--recovery-seconds"),
    ([], {"GPU_SWARM_SPOT": "maybe"}, "GPU_SWARM_SPOT"),
    (["--kind", "NVIDIA GPU"], {}, "--kind"),
])
def test_bad_settings_exit_2(node, args, env, message):
    before = node.daemon_json.read_bytes()
    done = node.cli(*node.sim_args(), "--once", *args, env=env)
    assert done.returncode == 2 and message in done.stderr
    assert node.daemon_json.read_bytes() == before


def test_environment_defaults():
    args = health.parse_args([], env={"GPU_SWARM_KIND": "H100", "GPU_SWARM_SHARED_KIND": "H100-shared",
                                      "HEALTH_INTERVAL_SECONDS": "3", "HEALTH_RECOVERY_SECONDS": "60",
                                      "HEALTH_IGNORE_XIDS": "94, 95", "HEALTH_CRITICAL_XIDS": "13",
                                      "GPU_SWARM_SPOT": "true"})
    assert (args.kind, args.shared_kind, args.interval, args.recovery_seconds) == ("H100", "H100-shared", 3, 60)
    assert (args.ignore_xids, args.critical_xids, args.spot) == ({94, 95}, {13}, True)
    defaults = health.parse_args([], env={})
    assert (defaults.kind, defaults.shared_kind, defaults.interval, defaults.recovery_seconds, defaults.spot) == (
        "NVIDIA-GPU", None, 10, 300, None)  # None: as IMDS's instance-life-cycle says
    assert health.parse_args([], env={"GPU_SWARM_SPOT": "false"}).spot is False
    assert defaults.maintenance is True and args.maintenance is True  # on-demand and spot nodes alike
    assert health.parse_args(["--no-spot", "--interval", "1"], env={"GPU_SWARM_SPOT": "true"}).spot is False


def test_the_loop_reacts_to_faults_and_recovers(node):
    """The long-running mode, not --once: a fault appears, then goes, and the labels follow."""
    process = subprocess.Popen([sys.executable, str(WATCHER), *node.sim(), "--interval", "0.1",
                                "--recovery-seconds", "0.5"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True)
    lines = []  # read as it comes: the watcher writes the labels before it logs them
    reader = threading.Thread(target=lambda: [lines.append(line) for line in process.stdout], daemon=True)
    reader.start()
    try:
        assert wait_for(lambda: node.daemon_json.exists() and node.labels().get("gpu-swarm.condition") == "healthy")
        node.set_faults({uuid(0): {"xid": 48}})
        assert wait_for(lambda: node.labels()["gpu-swarm.condition"] == "unhealthy")
        assert node.labels()["gpu-swarm.condition.reason"] == f"xid_48_on_{uuid(0)}"
        good = node.daemon()
        node.write_daemon("{corrupt")  # logged once, not fatal
        time.sleep(0.3)
        node.write_daemon({**good, "debug": True})
        node.set_faults({})
        assert wait_for(lambda: node.labels()["gpu-swarm.condition"] == "healthy")
        assert node.daemon()["debug"] is True and process.poll() is None
        assert wait_for(lambda: any("condition healthy (was unhealthy)" in line for line in lines))
    finally:
        process.terminate()
        process.wait(timeout=10)
        reader.join(timeout=10)
    out = "".join(lines)
    assert f"condition unhealthy (was healthy): xid_48_on_{uuid(0)}" in out
    assert out.count("error: ") == 1 and "trying again" in out
    assert "condition healthy (was unhealthy): ok" in out


def test_changed_gpus_end_the_loop_for_systemd_to_restart_it(node):
    process = subprocess.Popen([sys.executable, str(WATCHER), *node.sim(), "--interval", "0.1"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert wait_for(lambda: node.daemon_json.exists() and "gpu-swarm.condition" in node.labels())
        node.write_daemon({**node.daemon(), "node-generic-resources": [f"NVIDIA-GPU={uuid(0)}"]})
        assert process.wait(timeout=10) == 0
    finally:
        process.kill()
    assert "advertised GPUs changed" in process.stdout.read()


# --- spot notices from a fake IMDS ---------------------------------------------------------------

class FakeImds(http.server.BaseHTTPRequestHandler):
    token = "fake-token-123"
    answers: dict = {}  # path -> JSON body; anything else is 404
    requests: list = []

    def do_PUT(self):
        self.requests.append(("PUT", self.path, {k.lower(): v for k, v in self.headers.items()}))
        ok = self.path == "/latest/api/token" and self.headers.get("X-aws-ec2-metadata-token-ttl-seconds") == "21600"
        self._answer(200 if ok else 400, self.token if ok else "")

    def do_GET(self):
        self.requests.append(("GET", self.path, {k.lower(): v for k, v in self.headers.items()}))
        if self.headers.get("X-aws-ec2-metadata-token") != self.token:
            return self._answer(401, "")
        body = self.answers.get(self.path)
        self._answer(404 if body is None else 200, "" if body is None else body if isinstance(body, str)
                     else json.dumps(body))  # a JSON notice, or a plain value (instance-life-cycle)

    def _answer(self, status, body):
        data = body.encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def imds():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeImds)
    FakeImds.answers, FakeImds.requests = {}, []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", FakeImds
    server.shutdown()
    server.server_close()


ACTION = "/latest/meta-data/spot/instance-action"
REBALANCE = "/latest/meta-data/events/recommendations/rebalance"
MAINTENANCE = "/latest/meta-data/events/maintenance/scheduled"


def _ec2_time(seconds_from_now: float) -> str:
    """A time as IMDS's scheduled events write it: 21 Jan 2019 09:00:43 GMT."""
    return time.strftime("%d %b %Y %H:%M:%S GMT", time.gmtime(time.time() + seconds_from_now))


def _event(code: str, starts_in: float, state: str = "active") -> dict:
    return {"Code": code, "Description": "scheduled reboot", "EventId": "instance-event-0d59937288b749b32",
            "NotBefore": _ec2_time(starts_in), "NotAfter": _ec2_time(starts_in + 3600), "State": state}


@pytest.mark.parametrize("market", [[], ["--spot"]], ids=["on-demand", "spot"])
def test_scheduled_maintenance_drains_when_it_is_near_and_is_shown_before(node, imds, market):
    """AWS schedules a reboot, stop or retirement days ahead, for on-demand and spot instances alike:
    shown as degraded until MAINTENANCE_LEAD_S before it begins, then the node is drained as for a spot
    reclaim; completed or canceled ones say nothing."""
    url, fake = imds
    fake.answers[MAINTENANCE] = [_event("system-reboot", 3 * 86400)]
    report, _ = node.once(*market, "--imds", url)
    assert report["condition"] == "degraded" and report["reason"].startswith("maintenance_system-reboot_at_20")
    fake.answers[MAINTENANCE] = [_event("system-reboot", 3 * 86400), _event("instance-stop", 120)]
    report, _ = node.once(*market, "--imds", url)
    assert report["condition"] == "reclaim" and report["reason"].startswith("maintenance_now_instance-stop_at_20")
    assert node.labels()["gpu-swarm.condition"] == "reclaim"
    fake.answers[MAINTENANCE] = [_event("instance-stop", 120, "canceled"), _event("system-reboot", -60, "completed")]
    report, _ = node.once(*market, "--imds", url)
    assert report["condition"] == "healthy"
    fake.answers[MAINTENANCE] = []  # what IMDS answers when nothing is scheduled
    assert node.once(*market, "--imds", url)[0]["condition"] == "healthy"


def test_an_on_demand_node_asks_imds_for_scheduled_maintenance_only(node, imds):
    """No spot notice can come to an on-demand node: its IMDS is asked for scheduled events alone."""
    url, fake = imds
    fake.answers[ACTION] = {"action": "terminate", "time": "2026-11-22T23:59:00Z"}  # unasked, so unseen
    report, log = node.once("--imds", url, env={"GPU_SWARM_SPOT": "false"})
    assert report["condition"] == "healthy" and report["imds"] == {"condition": "healthy", "reason": "ok"}
    assert [(m, p) for m, p, _ in fake.requests] == [("PUT", "/latest/api/token"), ("GET", MAINTENANCE)]
    assert "scheduled maintenance;" in log and "spot notices" not in log


LIFECYCLE = "/latest/meta-data/instance-life-cycle"


@pytest.mark.parametrize("lifecycle, spot_asked", [("spot", True), ("on-demand", False), ("capacity-block", False),
                                                   (None, False)])
def test_a_node_watches_spot_notices_when_imds_says_it_is_spot(node, imds, lifecycle, spot_asked):
    """The program writes no market into node.env: a running node keeps the market it was launched on when its
    pool's marketType changes, and the instance knows which (IMDS's instance-life-cycle; 404: not spot)."""
    url, fake = imds
    if lifecycle:
        fake.answers[LIFECYCLE] = lifecycle
    fake.answers[ACTION] = {"action": "terminate", "time": "2026-11-22T23:59:00Z"}
    report, log = node.once("--imds", url, env={})
    assert report["condition"] == ("reclaim" if spot_asked else "healthy"), report
    asked = [p for m, p, _ in fake.requests if m == "GET"]
    assert asked == [LIFECYCLE, *([ACTION, REBALANCE] if spot_asked else []), MAINTENANCE]
    assert f"IMDS says this instance is {lifecycle or 'not spot'}" in log


def test_until_imds_says_the_lifecycle_a_node_asks_for_spot_notices_too(imds):
    """A spot node must not miss its two minutes because IMDS failed once: unknown, the notices are asked."""
    url, fake = imds
    said = []
    watcher = health.Imds(url, said.append, spot=None)
    real = watcher._ask
    failing = {"n": 1}

    def ask(method, path, headers):
        if path == LIFECYCLE and failing["n"]:
            failing["n"] -= 1
            return 500, ""
        return real(method, path, headers)
    watcher._ask = ask
    fake.answers[ACTION] = {"action": "stop", "time": "2026-11-22T23:59:00Z"}
    assert watcher.poll(0)[0] == "reclaim" and watcher.spot is None and "did not answer" in said[-1]
    fake.answers[LIFECYCLE] = "spot"
    assert watcher.poll(1)[0] == "reclaim" and watcher.spot is True
    assert [p for m, p, _ in fake.requests if m == "GET"].count(LIFECYCLE) == 1  # the failed ask was not the fake's


def test_no_maintenance_and_no_spot_ask_imds_nothing(node, imds):
    url, fake = imds
    fake.answers[MAINTENANCE] = [_event("instance-stop", 120)]
    report, _ = node.once("--no-maintenance", "--no-spot", "--imds", url)
    assert report["condition"] == "healthy" and report["imds"] is None and fake.requests == []
    report, _ = node.once("--no-maintenance", "--spot", "--imds", url)  # spot notices still asked, events not
    assert report["condition"] == "healthy"
    assert [p for _, p, _ in fake.requests] == ["/latest/api/token", ACTION, REBALANCE]


def test_imds_is_asked_every_imds_interval_not_every_gpu_check(node, imds):
    """A notice gives two minutes: waiting for the next GPU check (10 s on a node) would spend up to 10 s of them."""
    url, fake = imds
    process = subprocess.Popen([sys.executable, str(WATCHER), *node.sim(), "--interval", "30", "--imds-interval",
                                "0.2", "--spot", "--imds", url], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True)
    try:
        assert wait_for(lambda: node.daemon_json.exists() and node.labels().get("gpu-swarm.condition") == "healthy")
        fake.answers[ACTION] = {"action": "terminate", "time": "2026-11-22T23:59:00Z"}
        noticed = time.monotonic()
        assert wait_for(lambda: node.labels()["gpu-swarm.condition"] == "reclaim")
        assert time.monotonic() - noticed < 5  # well before the next GPU check, 30 s on
    finally:
        process.terminate()
        process.communicate(timeout=10)


def test_a_maintenance_event_whose_start_cannot_be_read_is_shown_not_acted_on(imds):
    url, fake = imds
    fake.answers[MAINTENANCE] = [{"Code": "system-maintenance", "NotBefore": "soon", "State": "active"}]
    assert health.Imds(url, print, spot=False).poll(0) == ("degraded", "maintenance_system-maintenance_at_unknown")


def test_spot_instance_action_means_reclaim(node, imds):
    url, fake = imds
    fake.answers[ACTION] = {"action": "terminate", "time": "2026-11-22T23:59:00Z"}
    dead_proxy = "http://127.0.0.1:9"  # IMDS is never asked through a proxy
    report, _ = node.once("--spot", "--imds", url, env={"http_proxy": dead_proxy, "HTTP_PROXY": dead_proxy})
    assert report["condition"] == "reclaim" and report["gpu"] == "-"
    assert report["reason"] == "spot_terminate_at_2026-11-22T23:59:00Z"
    assert node.labels()["gpu-swarm.condition.reason"] == "spot_terminate_at_2026-11-22T23:59:00Z"
    assert [(m, p) for m, p, _ in fake.requests] == [("PUT", "/latest/api/token"), ("GET", ACTION), ("GET", REBALANCE),
                                                     ("GET", MAINTENANCE)]
    assert fake.requests[0][2]["x-aws-ec2-metadata-token-ttl-seconds"] == "21600"
    assert [h.get("x-aws-ec2-metadata-token") for _, _, h in fake.requests] == [None] + [fake.token] * 3


def test_spot_reclaim_outranks_a_gpu_fault_and_a_rebalance(node, imds):
    url, fake = imds
    fake.answers[REBALANCE] = {"noticeTime": "2026-11-22T23:50:00Z"}
    fake.answers[ACTION] = {"action": "stop", "time": "2026-11-22T23:59:00Z"}
    node.set_faults({uuid(0): {"xid": 79}})
    report, _ = node.once("--imds", url, env={"GPU_SWARM_SPOT": "true"})
    assert report["condition"] == "reclaim" and report["reason"] == "spot_stop_at_2026-11-22T23:59:00Z"
    assert report["gpus"][uuid(0)]["condition"] == "unhealthy"


def test_a_rebalance_recommendation_is_shown_as_degraded_and_drains_nothing(node, imds):
    """It says the risk went up, often hours ahead of any interruption: the node keeps its tasks."""
    url, fake = imds
    fake.answers[REBALANCE] = {"noticeTime": "2026-11-22T23:50:00Z"}
    report, _ = node.once("--imds", url, env={"GPU_SWARM_SPOT": "true"})
    assert report["condition"] == "degraded" and report["reason"] == "rebalance_recommended_at_2026-11-22T23:50:00Z"
    node.set_faults({uuid(0): {"xid": 79}})  # a GPU fault is worse, and drains
    report, _ = node.once("--imds", url, env={"GPU_SWARM_SPOT": "true"})
    assert report["condition"] == "unhealthy"


def test_spot_nothing_announced_is_healthy(node, imds):
    url, fake = imds
    report, _ = node.once("--spot", "--imds", url)
    assert report["condition"] == "healthy" and report["imds"] == {"condition": "healthy", "reason": "ok"}
    assert len(fake.requests) == 4  # the token, the two spot notices, the scheduled events


def test_spot_imds_down_is_logged_not_a_condition(node):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    report, log = node.once("--spot", "--imds", f"http://127.0.0.1:{port}")
    assert report["condition"] == "healthy"
    assert f"IMDS http://127.0.0.1:{port} did not answer" in log


def test_spot_token_refused_is_logged(imds):
    url, fake = imds
    log = []
    spot = health.Imds(url, log.append)
    spot.state = ("reclaim", "spot_terminate_at_x")
    spot.token, spot.token_until = "expired", 1e12  # every GET gets 401
    assert spot.poll(0) == ("reclaim", "spot_terminate_at_x")  # kept: IMDS did not say otherwise
    assert len(log) == 1 and "HTTP 401" in log[0] and spot.token is None


# --- NVML mode, with the events-capable fake ---------------------------------------------------

class NvmlNode:
    def __init__(self, node, monkeypatch):
        self.node, self.monkeypatch = node, monkeypatch
        monkeypatch.setitem(sys.modules, "pynvml", fake_nvml)

    def run(self, capsys, description, *args):
        self.monkeypatch.setenv("FAKE_PYNVML", json.dumps(description))
        return self.node.main(capsys, *args)


@pytest.fixture
def nvml(node, monkeypatch):
    return NvmlNode(node, monkeypatch)


def nvml_gpu(n, **more):
    return {"uuid": uuid(n), "name": "NVIDIA H200", "memory_mib": 143771, **more}


def test_nvml_critical_xid_event_marks_its_gpu_unhealthy(nvml, capsys):
    events = [{"uuid": uuid(1), "type": "xid", "xid": 79}]
    rc, report, err = nvml.run(capsys, {"gpus": [nvml_gpu(0), nvml_gpu(1)], "events": events})
    assert rc == 0, err
    assert report["condition"] == "unhealthy" and report["reason"] == f"xid_79_on_{uuid(1)}"
    assert report["gpus"][uuid(0)] == {"condition": "healthy", "reason": "ok"}
    assert nvml.node.labels()["gpu-swarm.condition.gpu"] == uuid(1)


def test_nvml_ignored_xid_event_is_logged_only(nvml, capsys):
    events = [{"uuid": uuid(0), "type": "xid", "xid": 43}, {"uuid": uuid(1), "type": "xid", "xid": 13}]
    rc, report, err = nvml.run(capsys, {"gpus": [nvml_gpu(0), nvml_gpu(1)], "events": events})
    assert rc == 0 and report["condition"] == "healthy"
    assert f"{uuid(0)}: xid 43 ignored" in err and f"{uuid(1)}: xid 13 ignored" in err


def test_nvml_ecc_events(nvml, capsys):
    gpus = [nvml_gpu(0), nvml_gpu(1)]
    rc, report, _ = nvml.run(capsys, {"gpus": gpus, "events": [{"uuid": uuid(0), "type": "ecc_single"}]})
    assert report["condition"] == "degraded" and report["reason"] == f"ecc_single_on_{uuid(0)}"
    rc, report, _ = nvml.run(capsys, {"gpus": gpus, "events": [{"uuid": uuid(0), "type": "ecc_double"}]})
    assert report["condition"] == "unhealthy" and report["reason"] == f"ecc_double_on_{uuid(0)}"


def test_nvml_registers_only_supported_event_types(nvml, capsys):
    gpus = [nvml_gpu(0), nvml_gpu(1, events_supported=0x8 | 0x4), nvml_gpu(2, events_supported=0x4)]
    events = [{"uuid": uuid(1), "type": "ecc_double"}]  # GPU 1 cannot report it: never delivered
    nvml.node.write_daemon({"node-generic-resources": [f"NVIDIA-GPU={uuid(n)}" for n in range(3)]})
    rc, report, err = nvml.run(capsys, {"gpus": gpus, "events": events})
    assert rc == 0, err
    assert fake_nvml.registrations == [(uuid(0), 0x8 | 0x2 | 0x1), (uuid(1), 0x8)]
    assert f"{uuid(2)}: watching events: none supported" in err
    assert report["condition"] == "healthy"


def test_nvml_periodic_check(nvml, capsys):
    gpus = [nvml_gpu(0, pending_retirement="unsupported", remapped_pending="unsupported"),
            nvml_gpu(1, remapped_pending=True)]
    rc, report, _ = nvml.run(capsys, {"gpus": gpus})
    assert report["gpus"] == {uuid(0): {"condition": "healthy", "reason": "ok"},
                              uuid(1): {"condition": "degraded", "reason": f"rows_pending_remap_on_{uuid(1)}"}}
    gpus = [nvml_gpu(0, pending_retirement=True), nvml_gpu(1, lost=True)]
    rc, report, _ = nvml.run(capsys, {"gpus": gpus})
    assert report["gpus"][uuid(0)]["reason"] == f"pages_pending_retirement_on_{uuid(0)}"
    assert report["condition"] == "unhealthy" and report["reason"].startswith("no_answer:")
    rc, report, _ = nvml.run(capsys, {"gpus": [nvml_gpu(0)]})  # GPU 1 is gone
    assert report["condition"] == "unhealthy" and report["reason"] == f"not_found_on_{uuid(1)}"


def test_nvml_mig_events_count_against_the_advertised_mig_devices(nvml, capsys):
    mig = [{"uuid": "MIG-" + uuid(10)[4:], "name": "MIG 3g", "memory_mib": 40192}, None,
           {"uuid": "MIG-" + uuid(11)[4:], "name": "MIG 3g", "memory_mib": 40192}]
    nvml.node.write_daemon({"node-generic-resources": ["NVIDIA-GPU=MIG-" + uuid(10)[4:],
                                                       "NVIDIA-GPU=MIG-" + uuid(11)[4:]]})
    rc, report, err = nvml.run(capsys, {"gpus": [nvml_gpu(0, mig_slots=mig)],
                                        "events": [{"uuid": uuid(0), "type": "xid", "xid": 79}]})
    assert rc == 0, err
    assert fake_nvml.registrations == [(uuid(0), 0xB)]  # once, on the parent
    assert {g["condition"] for g in report["gpus"].values()} == {"unhealthy"}
    assert report["reason"] == f"xid_79_on_MIG-{uuid(10)[4:]}"


@pytest.mark.parametrize("description", [{"init_error": "DriverNotLoaded", "gpus": []},
                                         {"init_error": "LibraryNotFound", "gpus": []}])
def test_nvml_failing_at_start_exit_3(nvml, capsys, description):
    before = nvml.node.daemon_json.read_bytes()
    rc, _, err = nvml.run(capsys, description)
    assert rc == 3 and "NVML initialisation failed" in err
    assert nvml.node.daemon_json.read_bytes() == before


def test_no_pynvml_exit_3_but_simulation_works(node, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    rc, _, err = node.main(capsys)
    assert rc == 3 and "pynvml is not importable" in err
    rc, report, _ = node.main(capsys, "--inventory", str(node.inventory))
    assert rc == 0 and report["condition"] == "healthy"


def test_module_imports_without_pynvml():
    code = ("import sys, importlib.util; sys.modules['pynvml'] = None; "
            f"s = importlib.util.spec_from_file_location('h', {str(WATCHER)!r}); "
            "m = importlib.util.module_from_spec(s); s.loader.exec_module(m); "
            "import health_rules as r; print(r.classify_xid(79, m.ignored_xids()))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "unhealthy"


# --- the systemd unit ---------------------------------------------------------------------------

def unit_settings(path):
    settings = {}
    for line in path.read_text().splitlines():
        if "=" in line and not line.startswith("#"):
            key, value = line.split("=", 1)
            settings.setdefault(key, []).append(value)
    return settings


def test_unit_runs_the_watcher_after_docker_and_the_agent():
    settings = unit_settings(UNIT)
    assert settings["Type"] == ["simple"] and settings["Restart"] == ["always"] and settings["RestartSec"] == ["5"]
    assert {"docker.service", "gpu-swarm-agent.service"} <= set(settings["After"][0].split())
    assert settings["EnvironmentFile"] == ["-/etc/gpu-swarm/node.env", "-/etc/gpu-swarm/health.env"]
    assert settings["ExecStart"] == ["/opt/gpu-swarm/venv/bin/python /opt/gpu-swarm/software/gpu_health.py"]
    assert "multi-user.target" in settings["WantedBy"][0]


def test_unit_passes_systemd_analyze_verify(tmp_path):
    tool = subprocess.run(["which", "systemd-analyze"], capture_output=True, text=True).stdout.strip()
    if not tool:
        pytest.skip("systemd-analyze is not installed")
    # verify wants ExecStart's program to exist: point it at this Python for the check.
    unit = tmp_path / UNIT.name
    unit.write_text(UNIT.read_text().replace("/opt/gpu-swarm/venv/bin/python", sys.executable))
    done = subprocess.run([tool, "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and UNIT.name not in done.stderr, done.stderr


def test_the_watcher_waits_for_the_agents_lock_on_daemon_json(node):
    """The agent and the watcher both rewrite daemon.json; with the agent's lock held, the
    watcher neither reads nor writes it, so it cannot write back a copy that lacks the agent's
    change. Once the lock is free it goes on."""
    daemon_json = _load("daemon_json", WATCHER.parent / "daemon_json.py")
    with daemon_json.locked(str(node.daemon_json)):
        process = subprocess.Popen([sys.executable, str(WATCHER), *node.sim(), "--once", "--json"],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(1.0)
        assert process.poll() is None  # still waiting
        assert node.labels() == {}
    out, err = process.communicate(timeout=30)
    assert process.returncode == 0, err
    assert json.loads(out)["condition"] == "healthy" and node.labels()["gpu-swarm.condition"] == "healthy"
    assert not [p.name for p in node.root.iterdir() if p.name.endswith(".lock")]  # it lives in /run/lock



# --- the sentinel: the fault told to the managers at once ---------------------------------------

class EngineApi(http.server.BaseHTTPRequestHandler):
    """dockerd's answers to the two calls signal_sentinel makes: the containers, and a kill."""

    def do_GET(self):
        self.server.requests.append(("GET", self.path))
        self.answer(200, json.dumps([{"Id": "c0ffee" + "0" * 58}]).encode())

    def do_POST(self):
        self.server.requests.append(("POST", self.path))
        self.answer(204, b"")

    def answer(self, status, body):
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def address_string(self):
        return "unix"

    def log_message(self, *args):
        pass


@pytest.fixture
def engine():
    import socketserver
    import tempfile
    import urllib.parse
    folder = tempfile.mkdtemp(prefix="engine-")  # a unix socket's path has room for about 100 bytes
    server = socketserver.ThreadingUnixStreamServer(f"{folder}/docker.sock", EngineApi)
    server.requests = []
    server.parse = lambda path: (urllib.parse.urlparse(path).path, urllib.parse.parse_qs(urllib.parse.urlparse(path).query))
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


def test_a_fault_signals_the_nodes_sentinel_once(node, engine):
    sock = ["--docker-socket", engine.server_address]
    report, _ = node.once(*sock)
    assert report["condition"] == "healthy" and engine.requests == [] and "sentinel" not in report
    node.set_faults({uuid(1): {"xid": 79}})
    report, log = node.once(*sock)
    assert report["condition"] == "unhealthy" and report["sentinel"] == "signalled the sentinel (c0ffee000000)"
    (get, query), (kill, kill_query) = [engine.parse(path) for _, path in engine.requests]
    assert [method for method, _ in engine.requests] == ["GET", "POST"]
    assert get == "/containers/json" and json.loads(query["filters"][0]) == {
        "label": ["com.docker.swarm.service.name=gpu-swarm-sentinel"], "status": ["running"]}
    assert kill == f"/containers/c0ffee{'0' * 58}/kill" and kill_query == {"signal": ["USR1"]}
    assert "signalled the sentinel" in log
    report, _ = node.once(*sock)  # still unhealthy: its new task is for the next fault
    assert report["condition"] == "unhealthy" and len(engine.requests) == 2


def test_no_engine_means_the_labels_alone_tell_the_fault(node):
    node.set_faults({uuid(0): {"xid": 79}})
    report, log = node.once()
    assert report["condition"] == "unhealthy" and "the labels still reach the managers" in report["sentinel"]


# --- MPS: the watchdog's choices (its whole run: tests/test_gpu_sharing.py, on the stand-in daemon) -----

import health_mps  # noqa: E402


def test_a_stuck_server_is_named_in_its_reason_for_every_report_that_reads_reasons():
    """The reason carries the task, so `up`'s wait (stack_tasks), `localswarm status` and the metrics name it."""
    sys.path.insert(0, str(Path(WATCHER).parent.parent))
    from node import stack_tasks
    gpu = uuid(3)
    assert health_mps.stuck_reason(gpu, "infer_infer") == f"mps_server_stuck_after_infer_infer_on_{gpu}"
    assert health_mps.stuck_reason(gpu, None) == f"mps_server_stuck_on_{gpu}"
    long = health_mps.stuck_reason(gpu, "s" * 200)
    assert len(long) == 120 and long.endswith(f"_on_{gpu}")  # what condition_labels keeps, the GPU whole
    assert rules.condition_labels("unhealthy", long, gpu, 1)["gpu-swarm.condition.reason"] == long
    fault = stack_tasks._fault(health_mps.stuck_reason(gpu, "infer_infer"), 1)
    assert fault["gpu"] == gpu and "(mps_server_stuck_after_infer_infer)" in stack_tasks.fault_text(fault)
    from localswarm.placement import render_table
    table = render_table({"nodes": [{"name": "n", "role": "worker", "state": "ready", "availability": "drain",
                                     "condition": "unhealthy", "condition_reason": fault["reason"], "gpus": []}],
                          "services": []})
    assert "mps_server_stuck_after_infer_infer" in table


def test_the_task_named_is_the_first_that_got_a_descriptor_after_the_last_answered_ask(tmp_path):
    from tests.docker_api_stub import DockerApiStub
    gpu, container = uuid(0), "c" * 64
    (tmp_path / gpu).mkdir()
    lines = [{"at": 100.0, "pid": 11, "container": None}, {"at": 205.0, "pid": 12, "container": container},
             {"at": 206.0, "pid": 13, "container": "d" * 64}]
    (tmp_path / gpu / "last-clients").write_text("".join(json.dumps(e) + "\n" for e in lines))
    logged = []
    with DockerApiStub(tmp_path / "docker.sock") as docker:
        docker.add({"Id": container, "Config": {"Labels": {"com.docker.swarm.service.name": "web_web"}, "Env": []}})
        watchdog = health_mps.MpsWatchdog(str(tmp_path), logged.append, str(tmp_path / "docker.sock"))
        watchdog.last_ok[gpu] = 200.0
        assert watchdog.culprit(gpu) == "web_web"  # its swarm service
        assert "2 tasks got a server descriptor since the last answered ask" in logged[0]
        watchdog.last_ok[gpu] = 300.0  # none since: the last one before
        assert watchdog.culprit(gpu) == "d" * 12  # a container dockerd does not know: its short id
        watchdog.last_ok[gpu] = 0.0
        assert watchdog.culprit(gpu) == "pid_11"  # no container: a host process
        del watchdog.last_ok[gpu]  # a watcher that started on a stalled server: every descriptor may be innocent
        assert watchdog.culprit(gpu) is None
        assert "no ask answered since this watcher started, so no task is named" in logged[-1]
        assert "d" * 12 in logged[-1]  # the last ones still go to the log, for the operator
    assert health_mps.MpsWatchdog(str(tmp_path / "none"), logged.append).culprit(gpu) is None


def test_the_watchdog_never_kills_its_own_namespace(tmp_path):
    """A namespace file that names this process's namespace (or init's) kills nothing."""
    (tmp_path / "namespace").write_text(os.readlink("/proc/self/ns/mnt") + "\n")
    assert health_mps.kill_namespace(str(tmp_path)) == []


def test_mps_probe_settings_are_checked():
    for flag in ("--mps-probe-interval", "--mps-probe-timeout"):
        with pytest.raises(SystemExit):
            health.parse_args([flag, "0"])
    args = health.parse_args([])
    assert (args.mps_probe_interval, args.mps_probe_timeout, args.mps_hold) == (2, 3, 60)
    assert args.mps_restart == "systemctl reload gpu-swarm-mps.service"


def test_the_watchdog_asks_a_daemon_after_each_descriptor_it_handed_out_and_once_a_minute_besides(tmp_path):
    """Each ask is four lines of the daemon's control.log in /run: every 2 s for weeks would fill the node's memory.
    Only a client that got a server descriptor can stall the server, so that is when to ask."""
    import tempfile
    from tests import mps_standin
    root = Path(tempfile.mkdtemp(prefix="wd", dir="/tmp"))
    daemon = mps_standin.Daemon(root, uuid(0))
    try:
        (root / uuid(0) / "daemon.pid").write_text(f"{daemon.pid}\n")
        daemon.control("start_server -uid 0")
        calls = tmp_path / "calls"
        utility = tmp_path / "utility"
        utility.write_text(f"#!/bin/sh\necho x >>{calls}\nexec {daemon.script} \"$@\"\n")
        utility.chmod(0o755)
        logged = []
        watchdog = health_mps.MpsWatchdog(str(root), logged.append, utility=str(utility))
        tracker = rules.Tracker(300)
        asked = lambda: len(calls.read_text().splitlines()) if calls.exists() else 0  # noqa: E731
        watchdog.check([uuid(0)], tracker, 1000)
        assert asked() == 2 and not watchdog.stuck  # its server, and the server's ceiling
        assert logged == [f"{uuid(0)}: {health_mps.FIRST_ANSWER}"]  # once, what the benches wait on
        watchdog.check([uuid(0)], tracker, 1002)
        assert asked() == 2  # nothing handed out since: not asked
        (root / uuid(0) / "last-clients").write_text('{"at": 1, "pid": 1}\n')  # the relay handed one out
        watchdog.check([uuid(0)], tracker, 1004)
        assert asked() == 4
        watchdog.check([uuid(0)], tracker, 1006)
        assert asked() == 4
        watchdog.check([uuid(0)], tracker, 1004 + health_mps.BACKSTOP_S)
        assert asked() == 6 and len(logged) == 1
    finally:
        daemon.kill()
        import shutil
        shutil.rmtree(root, ignore_errors=True)
