"""GPU metrics in the rehearsal, end to end: exporter -> Prometheus -> a task's GPU memory and cost by service name.

Real engines, real tasks, the real exporter on every node (with the fake NVML), the program's
own monitoring stack and deploy script, and a real Prometheus (Debian's) discovering the
exporters through dockerswarm_sd_configs. A task "allocates" GPU memory (localswarm/metrics.py
puts one of its container's processes among its GPU's compute processes); the exporter must
map that process to the task through its cgroup, and Prometheus must return the memory by the
task's service name. node-3 shares its two GPUs as two slots each, held by three services: its
price (written by the program's own script) splits into theirs and the idle slot's.
"""
from __future__ import annotations

import functools
import json
import re
import subprocess
import sys

import pytest

from localswarm import metrics, monitoring_stack
from localswarm.nodes import Node
from localswarm.state import nodes_of, require_state
from tests.rehearsal_tools import KIND, cli, cli_json, rehearsal_up, tasks_of, until
from localswarm.host import REPO
from swarm import monitoring

pytestmark = pytest.mark.integration
SERVICE = "smoke_gpu"
ALLOCATED_MIB = 1536
SHARERS = ("share_embed", "share_rank", "share_chat")  # one slot each, of node-3's four: two share a GPU
SHARED = "services:\n" + "".join(f"""\
  {name.removeprefix("share_")}:
    image: nvidia/cuda:12.6.3-base-ubuntu24.04
    command: ["sh", "-c", "exec sleep infinity"]
    deploy:
      resources:
        reservations:
          generic_resources:
            - discrete_resource_spec: {{kind: NVIDIA-GPU-SHARED, value: 1}}
""" for name in SHARERS)


@pytest.fixture(scope="module")
def rehearsal(engine, tmp_path_factory):
    stack = (REPO / "stacks" / "gpu-smoke.yml").read_text()
    folder = tmp_path_factory.mktemp("metrics")
    compose, shared = folder / "smoke.yml", folder / "share.yml"
    compose.write_text(re.sub(r"replicas: \d+", "replicas: 3", stack, count=1))
    shared.write_text(SHARED)
    yield from rehearsal_up("--nodes", "3", "--gpus-per-node", "2", "--slots-per-gpu", "2", "--shared-nodes", "1",
                            "--stack", f"smoke={compose}", "--stack", f"share={shared}", "--monitoring")


wait = functools.partial(until, interval=1)  # the exporters and Prometheus move in seconds


def top_json() -> dict | None:
    proc = cli("top", "--json", check=False)
    return json.loads(proc.stdout) if proc.returncode == 0 and proc.stdout.strip() else None


def a_worker_task(view: dict) -> tuple[Node, str]:
    """(node, container ID) of a running smoke task on a worker: Prometheus scrapes the GPU pools'
    nodes, as the program labels them (gpu-swarm.gpu-count), and the rehearsal's manager has none."""
    nodes = {n.name: n for n in nodes_of(require_state())}
    from localswarm import api
    for task in tasks_of(view, SERVICE):
        node = nodes.get(task["node"])
        if task["state"] == "running" and node and node.role == "worker":
            tasks = api.get(nodes["node-1"].sock, "/tasks", filters={"service": [SERVICE],
                                                                    "desired-state": ["running"]})
            for t in tasks:
                if t["Slot"] == task["slot"] and t["Status"].get("ContainerStatus", {}).get("ContainerID"):
                    return node, t["Status"]["ContainerStatus"]["ContainerID"]
    raise AssertionError(f"no running {SERVICE} task on a worker")


def test_every_node_runs_the_exporter_and_top_names_each_gpus_task(rehearsal):
    nodes = nodes_of(require_state())
    assert all(metrics.exporting(n) for n in nodes)
    top = wait(lambda: (v := top_json()) and len({(g["node"], g["gpu"]) for g in v["gpus"]}) == 6 and v, 30,
               "top to list 6 GPUs")
    assert not top["errors"]
    held = [g for g in top["gpus"] if g["service"] == SERVICE]
    assert len(held) == 3 and all(g["task"].startswith(f"{SERVICE}.") for g in held)
    for g in top["gpus"]:
        assert {"node", "gpu", "service", "task", "memory_used_mib"} <= set(g)
        assert g["memory_total_mib"] == 81559 and g["gpu"].startswith("GPU-")
    table = cli("top").stdout
    assert "Simulated NVIDIA H100" in table and SERVICE in table


def test_prometheus_returns_a_tasks_gpu_memory_by_its_service_name(rehearsal):
    prometheus = rehearsal["monitoring"]["prometheus"]
    node, container = a_worker_task(rehearsal)
    before = wait(lambda: monitoring_stack.query(
        prometheus, f'sum(gpu_swarm_task_memory_used_bytes{{service="{SERVICE}", node="{node.name}"}})'),
        60, "Prometheus to scrape the worker's exporter")
    load = metrics.simulate_load(node, container, KIND, ALLOCATED_MIB)
    expr = f'sum by (service) (gpu_swarm_task_memory_used_bytes{{service="{SERVICE}"}})'

    def grown():
        result = monitoring_stack.query(prometheus, expr)
        value = float(result[0]["value"][1]) if result else 0
        return result if value - float(before[0]["value"][1]) >= ALLOCATED_MIB * 2**20 else None
    result = wait(grown, 60, f"{SERVICE}'s GPU memory to rise by {ALLOCATED_MIB} MiB")
    assert result[0]["metric"] == {"service": SERVICE}
    # The GPU's own series carries the task too, and its memory rose as much.
    by_gpu = monitoring_stack.query(prometheus, f'gpu_swarm_memory_used_bytes{{gpu="{load["gpu"]}"}}')
    assert by_gpu and by_gpu[0]["metric"]["service"] == SERVICE
    assert by_gpu[0]["metric"]["container"] == container[:12]
    assert float(by_gpu[0]["value"][1]) == ALLOCATED_MIB * 2**20
    assert any(g["task_memory_mib"] == ALLOCATED_MIB and g["service"] == SERVICE for g in top_json()["gpus"])


def test_top_shows_the_dashboards_top_panel_as_prometheus_answers_it(rehearsal):
    panel = monitoring.top_panel()
    assert panel["gridPos"]["y"] == 0 and panel["gridPos"]["x"] == 0

    def agreeing():
        # Prometheus's answer for each node against the exporters' own figures, which top reads
        # directly: the panel's avg over the node's GPUs, within a scrape's lag.
        view = top_json()
        if not view or "rows" not in view["dashboard"]:
            return None
        by_node: dict[str, dict[str, float]] = {}
        for g in view["gpus"]:  # a shared GPU has a row per holder: the panel takes their max (max by node, gpu)
            gpus = by_node.setdefault(g["node"], {})
            gpus[g["gpu"]] = max(gpus.get(g["gpu"], 0.0), g["utilization_percent"])
        rows = {r["legend"]: r["value"] for r in view["dashboard"]["rows"]}
        # Every node with GPUs, the manager's included: the rehearsal's manager has GPUs and its exporter is scraped.
        expected = {node: sum(u.values()) / len(u) for node, u in by_node.items()}
        seen[:] = [rows, expected]
        return view if rows == expected and any(expected.values()) else None
    seen: list = []
    try:
        view = wait(agreeing, 60, "the top panel's values to match the exporters' GPU utilization per node")
    except AssertionError as e:
        raise AssertionError(f"{e}; last seen: panel {seen[:1]}, exporters {seen[1:]}") from None
    assert view["dashboard"]["title"] == panel["title"] and view["dashboard"]["expr"] == panel["targets"][0]["expr"]
    table = cli("top").stdout
    assert f"Dashboard's top panel: {panel['title']}" in table and panel["targets"][0]["expr"] in table
    busiest = max(view["dashboard"]["rows"], key=lambda r: r["value"])
    assert re.search(rf"{busiest['legend']}\s+{busiest['value']:.1f}%", table), table


def test_the_monitoring_stack_runs_its_pinned_digests_and_is_the_programs(rehearsal):
    images = rehearsal["monitoring"]["images"]
    assert all("@sha256:" in image for image in images.values())
    services = cli_json("status")["services"]
    names = {s["name"] for s in services}
    assert {"gpu-swarm-monitoring_prometheus", "gpu-swarm-monitoring_grafana"} <= names


def test_services_sharing_a_gpu_cost_its_price_and_the_idle_slots_are_the_rest_of_the_node(rehearsal):
    prometheus = rehearsal["monitoring"]["prometheus"]
    node_price = metrics.STANDIN_GPU_HOUR * 2  # node-3's two GPUs

    def priced():
        tasks = monitoring_stack.query(prometheus, 'gpu_swarm_task_cost_dollars_per_hour{node="node-3"}')
        return tasks if {t["metric"]["service"] for t in tasks} == set(SHARERS) else None
    tasks = wait(priced, 60, "Prometheus to have node-3's three sharers' cost")
    by_gpu: dict[str, dict[str, float]] = {}
    for t in tasks:
        by_gpu.setdefault(t["metric"]["gpu"], {})[t["metric"]["service"]] = float(t["value"][1])
    (shared_gpu,) = [gpu for gpu, services in by_gpu.items() if len(services) == 2]
    gpu_price = float(monitoring_stack.query(prometheus, f'gpu_swarm_gpu_cost_dollars_per_hour{{gpu="{shared_gpu}"}}'
                                             )[0]["value"][1])
    assert gpu_price == node_price / 2 and sum(by_gpu[shared_gpu].values()) == gpu_price
    idle = monitoring_stack.query(prometheus, 'sum(gpu_swarm_idle_cost_dollars_per_hour{node="node-3"})')
    held = sum(float(t["value"][1]) for t in tasks)
    assert float(idle[0]["value"][1]) == node_price - held == node_price / 4  # one free slot of four
    (node,) = monitoring_stack.query(prometheus, 'gpu_swarm_node_cost_dollars_per_hour{node="node-3"}')
    assert float(node["value"][1]) == node_price and node["metric"]["market"] == "on-demand"
    # The terminal says the same: `localswarm top` and the report of `up`.
    cost = top_json()["cost"]
    assert {s: cost["services"][s] for s in SHARERS} == {s: node_price / 4 for s in SHARERS}
    assert cost["nodes"] == node_price * 3 and cost["idle"] == cost["nodes"] - sum(cost["services"].values())
    assert re.search(rf"^idle GPUs +{cost['idle']:.4f}$", cli("top").stdout, re.M)
    assert rehearsal["cost"]["services"]["share_embed"] == node_price / 4


def panels_without_data(prometheus) -> list[str]:
    """Titles of the dashboard's panels none of whose queries returns a series: what Grafana shows
    as "No data". A query Prometheus refuses raises (monitoring_stack.query)."""
    return [panel["title"] for panel in monitoring.dashboard_panels()
            if not any(monitoring_stack.query(prometheus, monitoring.as_grafana_sends(target["expr"]))
                       for target in panel["targets"])]


def test_every_dashboard_panel_has_data_with_gpu_tasks_running_and_errors_once_a_gpu_fails(rehearsal):
    """Last in the module: it fails a GPU, which drains its node. The errors panel is empty on
    healthy GPUs by design ("Empty is good"), so every panel having data needs a real fault:
    `node gpu-fault` -> the health watcher's condition in daemon.json -> the exporter -> Prometheus."""
    prometheus = rehearsal["monitoring"]["prometheus"]
    errors = next(p["title"] for p in monitoring.dashboard_panels() if p["title"].startswith("Errors"))
    assert any(t["state"] == "running" for t in tasks_of(cli_json("status"), SERVICE))
    last: list = []

    def empty_panels_are(expected: list[str]) -> bool:
        last[:] = panels_without_data(prometheus)
        return last == expected
    try:
        wait(lambda: empty_panels_are([errors]), 60, "every panel but the errors panel to have data")
    except AssertionError as e:
        raise AssertionError(f"{e}; panels without data: {last}") from None
    cli("node", "gpu-fault", "node-3")
    try:
        try:
            wait(lambda: empty_panels_are([]), 60, "the errors panel to show node-3's fault")
        except AssertionError as e:
            raise AssertionError(f"{e}; panels without data: {last}") from None
        failing = monitoring_stack.query(prometheus, "max by (node, gpu, condition, reason) (gpu_swarm_condition) > 0")
        assert {r["metric"]["node"] for r in failing} == {"node-3"}, failing
    finally:
        cli("node", "gpu-heal", "node-3")


def test_the_dashboard_sample_bench_samples_this_rehearsal_and_leaves_it_up(rehearsal):
    """bench/metrics_sample.py's smoke in CI (tests/test_benches.py's SMOKES), on this module's rehearsal,
    which has what it samples (the smoke stack, monitoring): every panel's query, then `localswarm top`."""
    done = subprocess.run([sys.executable, "bench/metrics_sample.py", "--smoke", "--running",
                           json.dumps(rehearsal["monitoring"]["prometheus"])], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "## localswarm top" in done.stdout and "MiB" in done.stdout
    assert len(nodes_of(require_state())) == 3  # left up for the module's teardown
