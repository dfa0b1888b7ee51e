"""The metrics exporter (node/gpu_metrics.py, gpu_tasks.py): each GPU's readings, named by the task that holds it.

NVML is played by localswarm/standins/pynvml.py, dockerd's API by tests/docker_api_stub.py,
and /proc by a folder of cgroup files: the same answers a node gives, without a GPU.
"""
from __future__ import annotations

import importlib.util
import hashlib
import json
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tests.docker_api_stub import DockerApiStub, task_container

REPO = Path(__file__).resolve().parent.parent
NODE = REPO / "node"
sys.path.insert(0, str(NODE))


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


fake_pynvml = _load("pynvml", REPO / "localswarm" / "standins" / "pynvml.py")
metrics = _load("gpu_metrics_under_test", NODE / "gpu_metrics.py")
import gpu_tasks  # noqa: E402

G = [f"GPU-{i}{i}{i}{i}{i}{i}{i}{i}-{i}{i}{i}{i}-{i}{i}{i}{i}-{i}{i}{i}{i}-{i}{i}{i}{i}{i}{i}{i}{i}{i}{i}{i}{i}"
     for i in range(1, 9)]
CID = {name: (name * 64)[:64] for name in ("a", "b", "c", "d")}


class Node:
    """A node's NVML description, daemon.json, dockerd and /proc, and a collector reading them."""

    def __init__(self, tmp: Path, monkeypatch):
        self.tmp, self.monkeypatch = tmp, monkeypatch
        monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml)
        self.gpus = [{"uuid": G[0], "name": "NVIDIA H100 80GB HBM3", "memory_mib": 81559},
                     {"uuid": G[1], "name": "NVIDIA H100 80GB HBM3", "memory_mib": 81559}]
        self.daemon_json, self.proc = tmp / "daemon.json", tmp / "proc"
        self.proc.mkdir()
        self.advertise(G[:2])
        self.docker = DockerApiStub(tmp / "docker.sock")
        self.collector = None

    def advertise(self, uuids, labels=()):
        self.daemon_json.write_text(json.dumps({"node-generic-resources": [f"NVIDIA-GPU={u}" for u in uuids],
                                                "labels": list(labels)}))

    def process(self, pid: int, container: str | None, cgroup_v2=False) -> int:
        (self.proc / str(pid)).mkdir()
        path = (f"/system.slice/docker-{container}.scope" if cgroup_v2 else f"/docker/{container}") if container \
            else "/user.slice/user-0.slice/session-1.scope"
        (self.proc / str(pid) / "cgroup").write_text(f"0::{path}\n" if cgroup_v2 else
                                                     f"12:memory:{path}\n1:name=systemd:{path}\n")
        return pid

    def scrape(self) -> dict[str, list]:
        """{metric name: [(labels, value)]} of one scrape."""
        self.monkeypatch.setenv("FAKE_PYNVML", json.dumps({"gpus": self.gpus, **getattr(self, "extra", {})}))
        if self.collector is None:
            self.collector = metrics.GpuCollector("node-1", "NVIDIA-GPU", "NVIDIA-GPU-SHARED", str(self.daemon_json),
                                                  self.docker.sock, log=lambda m: None, proc=str(self.proc),
                                                  cost_env=str(self.tmp / "cost.env"))
        registry = CollectorRegistry(auto_describe=False)
        registry.register(self.collector)
        out = {}
        for family in text_string_to_metric_families(generate_latest(registry).decode()):
            for sample in family.samples:
                out.setdefault(sample.name, []).append((sample.labels, sample.value))
        return out


@pytest.fixture
def node(tmp_path, monkeypatch):
    n = Node(tmp_path, monkeypatch)
    with n.docker:
        yield n
    if n.collector:
        n.collector.stopping.set()


def one(samples, **labels):
    found = [v for l, v in samples if all(l.get(k) == v2 for k, v2 in labels.items())]
    assert len(found) == 1, (labels, samples)
    return found[0]


# ---------------------------------------------------------------- the readings and their labels


def test_every_gpu_series_names_the_gpu_its_index_model_and_node(node):
    node.gpus[0].update(utilization={"gpu": 87, "memory": 40}, power_w=312.5, temperature_c=64, sm_clock_mhz=1755,
                        throttle_reasons=0x4, ecc={"corrected": 3, "uncorrected": 0})
    got = node.scrape()
    gpu_series = [name for name in got if name.startswith("gpu_swarm_") and not name.startswith("gpu_swarm_exporter")]
    assert len(gpu_series) >= 12
    for name in gpu_series:
        for labels, _ in got[name]:
            assert {"gpu", "index", "model", "node"} <= set(labels), name
            assert labels["node"] == "node-1" and labels["model"] == "NVIDIA H100 80GB HBM3"
    first = {"gpu": G[0], "index": "0"}
    assert one(got["gpu_swarm_gpu_up"], **first) == 1
    assert one(got["gpu_swarm_gpu_utilization_percent"], **first) == 87
    assert one(got["gpu_swarm_memory_utilization_percent"], **first) == 40
    assert one(got["gpu_swarm_power_watts"], **first) == 312.5
    assert one(got["gpu_swarm_temperature_celsius"], **first) == 64
    assert one(got["gpu_swarm_sm_clock_hertz"], **first) == 1755e6
    assert one(got["gpu_swarm_memory_total_bytes"], **first) == 81559 * 2**20
    assert one(got["gpu_swarm_throttled"], **first, reason="sw_power_cap") == 1
    assert one(got["gpu_swarm_throttled"], **first, reason="hw_slowdown") == 0
    assert one(got["gpu_swarm_ecc_errors_total"], **first, type="corrected") == 3
    assert one(got["gpu_swarm_gpu_up"], gpu=G[1], index="1") == 1
    assert one(got["gpu_swarm_exporter_nvml_up"]) == 1 and one(got["gpu_swarm_exporter_docker_up"]) == 1


def test_a_gpu_whose_nvml_fails_reports_the_error_and_the_others_go_on(node):
    node.gpus[1]["lost"] = True  # NVML answers GpuIsLost for everything but its name and UUID
    node.gpus[0]["utilization"] = {"gpu": 55, "memory": 5}
    got = node.scrape()
    assert one(got["gpu_swarm_gpu_up"], gpu=G[1]) == 0
    assert one(got["gpu_swarm_nvml_errors_total"], gpu=G[1], error="memory") == 1
    assert not [l for l, _ in got["gpu_swarm_gpu_utilization_percent"] if l["gpu"] == G[1]]
    assert one(got["gpu_swarm_gpu_up"], gpu=G[0]) == 1 and \
        one(got["gpu_swarm_gpu_utilization_percent"], gpu=G[0]) == 55
    assert one(node.scrape()["gpu_swarm_nvml_errors_total"], gpu=G[1], error="memory") == 2  # a counter


def test_one_failing_call_costs_only_that_reading(node):
    node.gpus[0]["failing"] = ["nvmlDeviceGetPowerUsage"]
    got = node.scrape()
    assert one(got["gpu_swarm_gpu_up"], gpu=G[0]) == 0
    assert one(got["gpu_swarm_nvml_errors_total"], gpu=G[0]) == 1  # error="power_mw" only
    assert not [l for l, _ in got["gpu_swarm_power_watts"] if l["gpu"] == G[0]]
    assert one(got["gpu_swarm_temperature_celsius"], gpu=G[0]) == 35


def test_an_advertised_gpu_that_nvml_no_longer_lists_is_down(node):
    node.scrape()  # seen once: its index and model are remembered
    node.gpus[1]["fault"] = {"missing": True}  # fallen off the bus
    got = node.scrape()
    assert one(got["gpu_swarm_gpu_up"], gpu=G[1], index="1", model="NVIDIA H100 80GB HBM3") == 0
    assert one(got["gpu_swarm_nvml_errors_total"], gpu=G[1], error="not_found") == 1


def test_without_nvml_the_advertised_gpus_are_down_and_the_exporter_serves(node):
    node.extra = {"init_error": "DriverNotLoaded"}
    got = node.scrape()
    assert one(got["gpu_swarm_exporter_nvml_up"]) == 0
    assert sorted(l["gpu"] for l, v in got["gpu_swarm_gpu_up"] if v == 0) == G[:2]
    assert one(got["gpu_swarm_nvml_errors_total"], gpu=G[0], error="nvml_unavailable") == 1


def test_the_watchers_condition_is_on_the_gpu_it_names(node):
    node.advertise(G[:2], ["gpu-swarm.condition=unhealthy", f"gpu-swarm.condition.gpu={G[1]}",
                           f"gpu-swarm.condition.reason=xid_79_on_{G[1]}"])
    got = node.scrape()["gpu_swarm_condition"]
    assert one(got, gpu=G[1], condition="unhealthy", reason=f"xid_79_on_{G[1]}") == 2
    assert one(got, gpu=G[0], condition="healthy") == 0
    node.advertise(G[:2], ["gpu-swarm.condition=reclaim", "gpu-swarm.condition.gpu=-"])  # the node's, not a GPU's
    assert [v for _, v in node.scrape()["gpu_swarm_condition"]] == [3, 3]


def test_xids_are_counted_as_they_come(node):
    node.extra = {"events": [{"uuid": G[0], "type": "xid", "xid": 79}, {"uuid": G[0], "type": "xid", "xid": 79},
                             {"uuid": G[1], "type": "xid", "xid": 48}]}
    node.scrape()  # starts NVML and its listener, which takes the queued events
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and len(node.collector.xids) < 2:
        time.sleep(0.05)
    got = node.scrape()["gpu_swarm_xid_events_total"]
    assert one(got, gpu=G[0], xid="79") == 2 and one(got, gpu=G[1], xid="48") == 1


# ---------------------------------------------------------------- who holds each GPU, and its memory


def test_a_held_gpu_carries_its_task_and_the_tasks_memory(node):
    node.docker.add(task_container(CID["a"], "train_worker", 1, [f"DOCKER_RESOURCE_NVIDIA-GPU={G[0]}"]))
    node.docker.add(task_container(CID["b"], "web_api", 1, []))  # a task without a GPU
    node.gpus[0]["processes"] = [{"pid": node.process(101, CID["a"]), "used_mib": 2048},
                                 {"pid": node.process(102, CID["a"], cgroup_v2=True), "used_mib": 1024},
                                 {"pid": node.process(103, None), "used_mib": 512}]  # a process of the host
    got = node.scrape()
    held = one(got["gpu_swarm_gpu_up"], gpu=G[0])
    labels = [l for l, _ in got["gpu_swarm_gpu_up"] if l["gpu"] == G[0]][0]
    assert held == 1 and labels["service"] == "train_worker" and labels["container"] == CID["a"][:12]
    assert labels["task"] == f"train_worker.1.{CID['a'][:25]}" and labels["slot"] == ""
    assert one(got["gpu_swarm_task_memory_used_bytes"], gpu=G[0], service="train_worker") == 3072 * 2**20
    assert one(got["gpu_swarm_untracked_memory_used_bytes"], gpu=G[0]) == 512 * 2**20
    assert one(got["gpu_swarm_memory_used_bytes"], gpu=G[0]) == 3584 * 2**20
    free = [l for l, _ in got["gpu_swarm_gpu_up"] if l["gpu"] == G[1]][0]
    assert free["service"] == free["task"] == free["container"] == ""
    assert not [l for l, _ in got["gpu_swarm_task_memory_used_bytes"] if l["gpu"] == G[1]]


def test_a_shared_gpu_has_one_series_per_slot_holder_and_each_its_own_memory(node):
    node.advertise([])
    node.daemon_json.write_text(json.dumps({"node-generic-resources": [f"NVIDIA-GPU-SHARED={G[0]}-s{k}"
                                                                       for k in range(4)]}))
    node.gpus = node.gpus[:1]
    for name, k in (("c", 0), ("d", 2)):
        node.docker.add(task_container(CID[name], "infer_embed", k + 1,
                                       [f"DOCKER_RESOURCE_NVIDIA-GPU-SHARED={G[0]}-s{k}"]))
    node.gpus[0]["processes"] = [{"pid": node.process(201, CID["c"]), "used_mib": 1000},
                                 {"pid": node.process(202, CID["d"]), "used_mib": 3000}]
    got = node.scrape()
    ups = [l for l, _ in got["gpu_swarm_gpu_up"]]
    assert sorted(l["slot"] for l in ups) == [f"{G[0]}-s0", f"{G[0]}-s2"]
    assert one(got["gpu_swarm_task_memory_used_bytes"], slot=f"{G[0]}-s0") == 1000 * 2**20
    assert one(got["gpu_swarm_task_memory_used_bytes"], slot=f"{G[0]}-s2") == 3000 * 2**20


def sharers(node, mode: str) -> dict[str, int]:
    """Four tasks share GPU 0, each with its own processes of its own size; {container: pid}."""
    node.advertise([])
    node.daemon_json.write_text(json.dumps({"node-generic-resources": [f"NVIDIA-GPU-SHARED={G[0]}-s{k}"
                                                                       for k in range(4)]}))
    node.gpus = node.gpus[:1]
    pids = {}
    for k, name in enumerate("abcd"):
        node.docker.add(task_container(CID[name], f"infer_{name}", 1,
                                       [f"DOCKER_RESOURCE_NVIDIA-GPU-SHARED={G[0]}-s{k}"]))
        pids[name] = node.process(300 + k, CID[name])
    sizes = {"a": 10240, "b": 4096, "c": 2048, "d": 1024}
    if mode == "mps":
        # NVML names the MPS server (a host process) among the compute processes, with the GPU's
        # memory, and the clients among the MPS processes; the server's samples are its clients'.
        server = node.process(299, None)
        node.gpus[0]["processes"] = [{"pid": server, "used_mib": sum(sizes.values()) + 512}]
        node.gpus[0]["mps_processes"] = [{"pid": pids[n], "used_mib": mib} for n, mib in sizes.items()]
        node.gpus[0]["process_utilization"] = [{"pid": server, "sm": 90}, {"pid": pids["a"], "sm": 60},
                                               {"pid": pids["c"], "sm": 30}]
    else:
        node.gpus[0]["processes"] = [{"pid": pids[n], "used_mib": mib} for n, mib in sizes.items()]
        node.gpus[0]["process_utilization"] = [{"pid": pids["a"], "sm": 5, "stamp": 1}, {"pid": pids["a"], "sm": 60,
                                                                                          "stamp": 2},
                                               {"pid": pids["c"], "sm": 30, "stamp": 2}]
    return sizes


@pytest.mark.parametrize("mode", ["time-slicing", "mps"])
def test_each_sharer_has_its_own_memory_and_utilization_never_a_neighbours(node, mode):
    sizes = sharers(node, mode)
    got = node.scrape()
    for k, name in enumerate("abcd"):
        labels = {"gpu": G[0], "service": f"infer_{name}", "container": CID[name][:12], "slot": f"{G[0]}-s{k}"}
        assert one(got["gpu_swarm_task_memory_used_bytes"], **labels) == sizes[name] * 2**20
        # its processes' latest sample only; a task whose processes ran no kernel is at 0
        assert one(got["gpu_swarm_task_utilization_percent"], **labels) == {"a": 60, "c": 30}.get(name, 0)
    # The MPS server is no task's: its memory (the clients' as the driver counts it) and samples are untracked.
    untracked_mib = sum(sizes.values()) + 512 if mode == "mps" else 0
    assert one(got["gpu_swarm_untracked_memory_used_bytes"], gpu=G[0]) == untracked_mib * 2**20
    assert one(got["gpu_swarm_untracked_utilization_percent"], gpu=G[0]) == (90 if mode == "mps" else 0)


def test_without_per_process_samples_no_task_gets_a_utilization(node):
    """No series rather than the GPU's figure under a sharer's name."""
    sharers(node, "time-slicing")
    node.gpus[0]["failing"] = ["nvmlDeviceGetProcessUtilization"]
    got = node.scrape()
    assert not got.get("gpu_swarm_task_utilization_percent")
    assert one(got["gpu_swarm_nvml_errors_total"], gpu=G[0], error="process_utilization", slot=f"{G[0]}-s0") == 1
    node.gpus[0].pop("failing")
    node.gpus[0]["process_utilization"] = []  # no process ran a kernel: NVML says NotFound, every task is at 0
    assert {v for _, v in node.scrape()["gpu_swarm_task_utilization_percent"]} == {0}

    def success_as_error(handle, last_seen):  # pynvml's own answer when its first call finds no sample
        error = fake_pynvml.NVMLError("Success")
        error.value = 0
        raise error
    node.monkeypatch.setattr(fake_pynvml, "nvmlDeviceGetProcessUtilization", success_as_error)
    got = node.scrape()
    assert {v for _, v in got["gpu_swarm_task_utilization_percent"]} == {0}
    assert one(got["gpu_swarm_nvml_errors_total"], gpu=G[0], error="process_utilization", slot=f"{G[0]}-s0") == 1


def test_a_holder_with_no_process_on_its_gpu_uses_none_of_its_memory(node):
    node.docker.add(task_container(CID["a"], "train_worker", 1, [f"DOCKER_RESOURCE_NVIDIA-GPU={G[0]}"]))
    assert one(node.scrape()["gpu_swarm_task_memory_used_bytes"], service="train_worker") == 0


def test_containers_are_inspected_once_and_forgotten_when_gone(node):
    node.docker.add(task_container(CID["a"], "train_worker", 1, [f"DOCKER_RESOURCE_NVIDIA-GPU={G[0]}"]))
    node.scrape()
    node.scrape()
    assert node.docker.calls.count(f"/containers/{CID['a']}/json") == 1
    del node.docker.containers[CID["a"]]
    labels = [l for l, _ in node.scrape()["gpu_swarm_gpu_up"] if l["gpu"] == G[0]][0]
    assert labels["service"] == ""


def test_without_dockerd_the_gpus_are_still_reported(node, tmp_path):
    node.collector = metrics.GpuCollector("node-1", "NVIDIA-GPU", "NVIDIA-GPU-SHARED", str(node.daemon_json),
                                          str(tmp_path / "no-such.sock"), log=lambda m: None)
    got = node.scrape()
    assert one(got["gpu_swarm_exporter_docker_up"]) == 0
    assert [v for _, v in got["gpu_swarm_gpu_up"]] == [1, 1]


@pytest.mark.parametrize("cgroup, found", [
    ("12:memory:/docker/" + CID["a"] + "\n", CID["a"]),
    ("0::/system.slice/docker-" + CID["a"] + ".scope\n", CID["a"]),
    ("0::/kubepods/pod1/" + CID["b"] + "/docker/" + CID["a"] + "\n", CID["a"]),  # nested: the innermost
    ("0::/user.slice/user-1000.slice/session-3.scope\n", None),
    ("0::/docker/" + CID["a"][:63] + "\n", None),  # not a whole ID
])
def test_a_process_is_in_the_container_its_cgroup_names(tmp_path, cgroup, found):
    (tmp_path / "7").mkdir()
    (tmp_path / "7" / "cgroup").write_text(cgroup)
    assert gpu_tasks.container_of(7, str(tmp_path)) == found
    assert gpu_tasks.container_of(8, str(tmp_path)) is None  # gone since NVML listed it


# ---------------------------------------------------------------- the program


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_it_serves_over_http_and_stops_on_sigterm(tmp_path):
    port = free_port()
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO / "localswarm" / "standins"),
           "FAKE_PYNVML": json.dumps({"gpus": [{"uuid": G[0], "name": "NVIDIA L4", "memory_mib": 22491}]})}
    proc = subprocess.Popen([sys.executable, str(NODE / "gpu_metrics.py"), "--port", str(port), "--address",
                             "127.0.0.1", "--node-name", "n1", "--daemon-json", str(tmp_path / "none.json"),
                             "--docker-socket", str(tmp_path / "none.sock")], env=env, stderr=subprocess.PIPE,
                            text=True)
    try:
        deadline, body = time.monotonic() + 20, ""
        while time.monotonic() < deadline and not body:
            try:
                body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
            except OSError:
                time.sleep(0.1)
        assert f'gpu="{G[0]}"' in body and 'model="NVIDIA L4"' in body and "process_resident_memory_bytes" in body
    finally:
        proc.terminate()
        assert proc.wait(10) == 0, proc.stderr.read()


@pytest.mark.parametrize("args, message", [(["--kind", "no spaces"], "--kind"), (["--port", "0"], "--port 0")])
def test_bad_arguments_exit_2_and_say_which(args, message):
    done = subprocess.run([sys.executable, str(NODE / "gpu_metrics.py"), *args], capture_output=True, text=True)
    assert done.returncode == 2 and message in done.stderr


def test_the_port_in_use_exits_1_with_the_reason(tmp_path):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        done = subprocess.run([sys.executable, str(NODE / "gpu_metrics.py"), "--address", "127.0.0.1", "--port",
                               str(held.getsockname()[1]), "--daemon-json", str(tmp_path / "x")],
                              capture_output=True, text=True, timeout=30,
                              env={"PATH": "/usr/bin:/bin", "FAKE_PYNVML": '{"gpus": []}',
                                   "PYTHONPATH": str(REPO / "localswarm" / "standins")})
    assert done.returncode == 1 and "cannot listen" in done.stderr


def test_the_unit_runs_the_exporter_in_the_agents_venv_with_the_nodes_settings():
    from swarm import node_contract as c
    unit = (NODE / c.METRICS_UNIT).read_text()
    assert f"ExecStart={c.AGENT_VENV}/bin/python {c.METRICS_PATH}\n" in unit
    assert f"EnvironmentFile=-{c.NODE_ENV_PATH}\n" in unit and f"Documentation=file://{c.METRICS_PATH}\n" in unit
    assert f"port {c.METRICS_PORT} " in unit  # its comment says where Prometheus finds it
    assert f"install_service {c.METRICS_UNIT}" in (NODE / "install-gpu-metrics.sh").read_text()
    from to_node import software as node_software
    assert node_software.bootstrap_steps(gpu=True, instance_type="g5.xlarge")[-1] == "install-gpu-metrics"
    assert "install-gpu-metrics" not in node_software.bootstrap_steps(gpu=False, instance_type="m7i.large")


def test_the_budget_bench_runs_the_exporter_and_reports_each_figure(tmp_path):
    out = tmp_path / "budget.json"
    done = subprocess.run([sys.executable, "bench/metrics_budget.py", "--gpus", "2", "--scrapes", "3", "--minutes",
                           "0.02", "--interval", "0.3", "--out", str(out)], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode in (0, 1), done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["series_per_scrape"] > 30 and result["scrape_ms"]["median"] > 0 and result["rss_mib"] > 5
    assert result["cpu"]["scrapes"] >= 2


def test_the_real_gpu_proof_reads_the_exporters_own_output(node):
    """bench/gpu_metrics.py runs only on a GPU machine (the lead's device session); what it can be
    checked for here: it starts, and it reads the exporter's real exposition as the exporter writes it."""
    done = subprocess.run([sys.executable, "bench/gpu_metrics.py", "--help"], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0 and "--out" in done.stdout
    proof = _load("gpu_metrics_proof", REPO / "bench" / "gpu_metrics.py")
    node.docker.add(task_container(CID["a"], "gpu-metrics-probe", 1, [f"DOCKER_RESOURCE_NVIDIA-GPU={G[0]}"]))
    node.gpus[0]["processes"] = [{"pid": node.process(301, CID["a"]), "used_mib": 2048}]
    registry = CollectorRegistry(auto_describe=False)
    node.scrape()
    registry.register(node.collector)
    text = generate_latest(registry).decode()
    labels, value = proof.value(text, "gpu_swarm_memory_used_bytes", gpu=G[0])
    assert labels["service"] == "gpu-metrics-probe" and value == 2048 * 2**20
    assert proof.value(text, "gpu_swarm_task_memory_used_bytes", gpu=G[0], service="gpu-metrics-probe")[1] == \
        2048 * 2**20


def test_the_node_images_wheelhouse_gets_prometheus_client_at_the_pin_from_pypi(tmp_path, monkeypatch):
    """`localswarm pulumi up`'s machines install the node software offline: install-agent-venv.sh finds
    prometheus_client under the pinned wheel's name in the image's wheelhouse; it is PyPI's wheel, with the
    pin's sha256, and a cached file without it is refused."""
    from localswarm import node_image, standins
    from localswarm.host import RehearsalError
    from to_node import software as node_software
    monkeypatch.setattr(node_image, "WHEELS", tmp_path / "wheels")
    assert node_image.pypi_wheels(download=False) is None  # not there: the image counts as not built
    wheels = node_image.pypi_wheels(download=True, progress=lambda _: None)
    _, name, sha256 = node_software.pinned_wheel("PROMETHEUS_CLIENT")
    (path, (data, mode)), = wheels.items()
    assert path == f"{standins.WHEELHOUSE}/{name}" and mode == 0o644
    assert hashlib.sha256(data).hexdigest() == sha256
    assert node_image.pypi_wheels(download=False) == wheels  # kept: no second download
    (tmp_path / "wheels" / Path(path).name).write_bytes(data + b"\0")
    with pytest.raises(RehearsalError, match="PROMETHEUS_CLIENT_WHEEL's sha256"):
        node_image.pypi_wheels(download=False)


# ---------------------------------------------------------------- what each GPU and task costs


def priced(node, per_hour: float | None, gpus: int = 2, market: str = "spot") -> None:
    """cost.env as the program writes it (to_node/software.py price_env, env_text)."""
    from to_node.software import env_text, price_env
    (node.tmp / "cost.env").write_text(env_text(price_env(per_hour, market=market, date="2026-11-30T08:15:00Z",
                                                          instance_type="p5.4xlarge", gpus=gpus)))


def test_the_nodes_price_is_shared_by_its_gpus_and_a_free_gpus_share_is_idle(node):
    priced(node, 10.5)
    node.docker.add(task_container(CID["a"], "train_worker", 1, [f"DOCKER_RESOURCE_NVIDIA-GPU={G[0]}"]))
    got = node.scrape()
    assert one(got["gpu_swarm_node_cost_dollars_per_hour"], node="node-1", instance_type="p5.4xlarge",
               market="spot") == 10.5
    assert one(got["gpu_swarm_node_price_set_timestamp_seconds"]) == 1796026500  # 2026-11-30T08:15:00Z
    assert one(got["gpu_swarm_gpu_cost_dollars_per_hour"], gpu=G[0]) == one(
        got["gpu_swarm_gpu_cost_dollars_per_hour"], gpu=G[1]) == 5.25
    assert one(got["gpu_swarm_task_cost_dollars_per_hour"], gpu=G[0], service="train_worker",
               container=CID["a"][:12], slot="") == 5.25
    assert [l["gpu"] for l, _ in got["gpu_swarm_task_cost_dollars_per_hour"]] == [G[0]]  # a free GPU has no task
    assert one(got["gpu_swarm_idle_cost_dollars_per_hour"], gpu=G[0]) == 0
    assert one(got["gpu_swarm_idle_cost_dollars_per_hour"], gpu=G[1]) == 5.25


def test_a_slot_pays_its_gpus_price_over_the_slots_and_holders_and_idle_add_up_to_the_node(node):
    priced(node, 12.0)
    node.advertise([])
    node.daemon_json.write_text(json.dumps({"node-generic-resources": [
        *(f"NVIDIA-GPU-SHARED={G[0]}-s{k}" for k in range(4)), *(f"NVIDIA-GPU-SHARED={G[1]}-s{k}" for k in range(4))]}))
    for name, service, slot in (("a", "infer_embed", f"{G[0]}-s0"), ("b", "infer_rank", f"{G[0]}-s1"),
                                ("c", "infer_embed", f"{G[0]}-s3"), ("d", "infer_rank", f"{G[1]}-s2")):
        node.docker.add(task_container(CID[name], service, 1, [f"DOCKER_RESOURCE_NVIDIA-GPU-SHARED={slot}"]))
    got = node.scrape()
    tasks = got["gpu_swarm_task_cost_dollars_per_hour"]
    assert sorted((l["gpu"], l["slot"], v) for l, v in tasks) == [
        (G[0], f"{G[0]}-s0", 1.5), (G[0], f"{G[0]}-s1", 1.5), (G[0], f"{G[0]}-s3", 1.5), (G[1], f"{G[1]}-s2", 1.5)]
    assert one(got["gpu_swarm_idle_cost_dollars_per_hour"], gpu=G[0]) == 1.5
    assert one(got["gpu_swarm_idle_cost_dollars_per_hour"], gpu=G[1]) == 4.5
    by_service = {}
    for labels, value in tasks:
        by_service[labels["service"]] = by_service.get(labels["service"], 0) + value
    assert by_service == {"infer_embed": 3.0, "infer_rank": 3.0}
    idle = sum(v for _, v in got["gpu_swarm_idle_cost_dollars_per_hour"])
    assert sum(by_service.values()) + idle == one(got["gpu_swarm_node_cost_dollars_per_hour"]) == 12.0


def test_a_new_price_is_read_at_the_next_scrape_and_no_price_means_no_cost_series(node):
    got = node.scrape()  # no cost.env: a node the program has not priced (yet)
    assert "gpu_swarm_node_cost_dollars_per_hour" not in got and "gpu_swarm_idle_cost_dollars_per_hour" not in got
    assert one(got["gpu_swarm_gpu_up"], gpu=G[0]) == 1  # the readings go on
    priced(node, 7.0)
    assert one(node.scrape()["gpu_swarm_node_cost_dollars_per_hour"]) == 7.0
    priced(node, 7.25)  # spot's price moved: the program wrote the file again, nothing restarted
    assert one(node.scrape()["gpu_swarm_idle_cost_dollars_per_hour"], gpu=G[1]) == 3.625
    priced(node, None, market="capacity-block")  # a price the program does not know
    got = node.scrape()
    assert "gpu_swarm_node_cost_dollars_per_hour" not in got and "gpu_swarm_task_cost_dollars_per_hour" not in got


def test_a_gpu_that_left_the_bus_still_costs_its_share(node):
    priced(node, 8.0)
    node.gpus = node.gpus[:1]  # NVML lists one of the two GPUs the node advertises
    got = node.scrape()
    assert one(got["gpu_swarm_gpu_up"], gpu=G[1]) == 0
    assert one(got["gpu_swarm_idle_cost_dollars_per_hour"], gpu=G[1]) == 4.0
    assert sum(v for _, v in got["gpu_swarm_gpu_cost_dollars_per_hour"]) == 8.0


@pytest.mark.parametrize("bench", ["metrics_sample.py", "metrics_budget.py", "gpu_metrics.py"])
def test_the_metrics_benches_start(bench):
    done = subprocess.run([sys.executable, f"bench/{bench}", "--help"], cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0 and "usage:" in done.stdout, done.stderr


def test_top_reads_the_exporters_text_and_shows_each_gpu_and_its_task(node):
    """node/gpu_top.py (stdlib only, for managers): the exporter's own output, parsed and shown."""
    top = _load("gpu_top_under_test", NODE / "gpu_top.py")
    node.docker.add(task_container(CID["a"], 'we"ird', 2, [f"DOCKER_RESOURCE_NVIDIA-GPU={G[1]}"]))
    node.gpus[1].update(utilization={"gpu": 77, "memory": 3}, processes=[{"pid": node.process(401, CID["a"]),
                                                                          "used_mib": 300}],
                        process_utilization=[{"pid": 401, "sm": 64}])
    node.scrape()
    registry = CollectorRegistry(auto_describe=False)
    registry.register(node.collector)
    rows = top.rows_of("node-1", top.parse(generate_latest(registry).decode()))
    assert [(r["index"], r["service"], r["utilization_percent"], r["memory_used_mib"], r["task_memory_mib"])
            for r in rows] == [("0", "", 0, 0, None), ("1", 'we"ird', 77, 300, 300)]
    assert rows[1]["memory_total_mib"] == 81559 and rows[1]["task"].startswith('we"ird.2.')
    text = top.render({"gpus": rows, "errors": [{"node": "node-9", "error": "10.0.0.9:9835: refused"}]})
    assert "77%" in text and "300 / 81559" in text and "node-9: no metrics (10.0.0.9:9835: refused)" in text
    assert rows[1]["task_utilization_percent"] == 64 and text.splitlines()[2].endswith("300       64%")


def test_top_shows_each_services_cost_and_the_idle_gpus(node):
    top = _load("gpu_top_under_test", NODE / "gpu_top.py")
    priced(node, 9.0)
    node.docker.add(task_container(CID["a"], "train_worker", 1, [f"DOCKER_RESOURCE_NVIDIA-GPU={G[1]}"]))
    node.scrape()
    registry = CollectorRegistry(auto_describe=False)
    registry.register(node.collector)
    metrics_text = top.parse(generate_latest(registry).decode())
    rows = top.rows_of("node-1", metrics_text)
    assert [(r["index"], r["task_cost_per_hour"]) for r in rows] == [("0", None), ("1", 4.5)]
    cost = top.total_cost([top.cost_of("node-1", metrics_text)], ["node-2"])
    assert cost == {"services": {"train_worker": 4.5}, "idle": 4.5, "nodes": 9.0, "priced_nodes": ["node-1"],
                    "unpriced_nodes": ["node-2"]}
    text = top.render({"gpus": rows, "errors": [], "cost": cost})
    assert re.search(r"^train_worker +4\.5000$", text, re.M) and re.search(r"^idle GPUs +4\.5000$", text, re.M)
    assert re.search(r"^GPU nodes in all +9\.0000$", text, re.M) and "not priced, and not counted: node-2" in text


def test_the_exporter_caps_glibcs_arenas_and_gives_back_a_scrapes_garbage_before_the_next():
    """RSS on a many-core GPU node (README "Metrics"): two malloc arenas, and malloc_trim before each scrape."""
    trim = metrics.lean_malloc()
    assert trim is not None and trim(0) in (0, 1)  # glibc (Debian, the DLAMI's Ubuntu)
    calls = []
    collector = metrics.GpuCollector("node-1", "NVIDIA-GPU", "NVIDIA-GPU-SHARED", "/nonexistent/daemon.json",
                                         "/nonexistent/docker.sock", log=lambda message: None)
    collector.trim = calls.append
    list(collector.collect())
    list(collector.collect())
    assert calls == [0, 0]
    assert "collector.trim = trim" in (NODE / "gpu_metrics.py").read_text()  # main() gives it the real one
