"""GPU metrics on the machines of Pulumi's CLI, end to end: exporter -> Prometheus -> a task's GPU memory and cost.

The dev stack, set as a user sets it: a CPU manager, a pool `t4` of one g4dn.12xlarge (4 GPUs) running
three one-GPU tasks, a pool `shared` of one g4dn.xlarge whose GPU is shared as 4 slots, held by three
services, and `monitoring: true`. Every GPU node runs the exporter its user data installed, against
the NVML stand-in; Prometheus (Debian's, under the stack's pinned digest) discovers them through
dockerswarm_sd_configs. A task "allocates" GPU memory (machine_health.gpu_load puts one of its
container's processes among its GPU's compute processes): the exporter must map that process to the
task through its cgroup, and Prometheus must return the memory by the task's service name. The shared
node's price (the price list's, written by the program's own command) splits into its sharers' and
the idle slot's. Its own lane.
"""
from __future__ import annotations

import functools
import json
import re
import subprocess
import sys

import pytest

from localswarm import fake_aws, fake_prices, machine_health, monitoring_stack, pulumi_cli
from localswarm.host import REPO
from swarm import monitoring
from tests.rehearsal_tools import (CLI_MANAGER, KIND, cli, cli_engines, config_set_all, diagnostics, pulumi,
                                   require_engine, tasks_of, until)

pytestmark = pytest.mark.integration
SERVICE = "smoke_gpu"
ALLOCATED_MIB = 1536
WHOLE, SHARED = "gpu-swarm-dev-t4-0", "gpu-swarm-dev-shared-0"
SHARERS = ("share_embed", "share_rank", "share_chat")  # one slot each of the shared GPU's four
POOLS = [{"name": "t4", "instanceType": "g4dn.12xlarge", "count": 1},
         {"name": "shared", "instanceType": "g4dn.xlarge", "count": 1, "sharing": {"slotsPerGpu": 4}}]
STACKS = [{"name": "smoke", "file": "tests/data/metrics/smoke.yml"},
          {"name": "share", "file": "tests/data/metrics/share.yml"}]
SHARED_PRICE = float(fake_prices.ON_DEMAND["g4dn.xlarge"])  # USD per hour, as the preview read it


@pytest.fixture(scope="module")
def rehearsal():
    require_engine()
    cli("down")
    config_set_all({"gpuPools": POOLS, "stacks": STACKS, "monitoring": "true"})
    done = pulumi("up", "--yes")
    assert done.returncode == 0, diagnostics(done)
    nodes = pulumi_cli.nodes()
    manager = next(n for n in nodes if n.role == "manager")
    where = until(lambda: monitoring_stack.prometheus_task(manager), 120, "Prometheus to run")
    yield {"prometheus": where, "nodes": nodes, "engines": cli_engines()}
    cli("down")


wait = functools.partial(until, interval=1)  # the exporters and Prometheus move in seconds


def query(rehearsal, expr: str) -> list[dict]:
    return monitoring_stack.query(rehearsal["prometheus"], expr, nodes=rehearsal["nodes"])


def top_json() -> dict | None:
    proc = cli("top", "--json", check=False)
    return json.loads(proc.stdout) if proc.returncode == 0 and proc.stdout.strip() else None


def a_running_task(rehearsal, service: str) -> tuple[str, str]:
    """(hostname, container ID) of a running task of `service`."""
    engines = rehearsal["engines"]
    ids = engines.docker(CLI_MANAGER, "service", "ps", "-q", "--no-trunc", "--filter", "desired-state=running",
                         service).stdout.split()
    for task in json.loads(engines.docker(CLI_MANAGER, "inspect", "--type", "task", *ids).stdout):
        container = task["Status"].get("ContainerStatus", {}).get("ContainerID")
        if task["Status"]["State"] == "running" and container:
            node = json.loads(engines.docker(CLI_MANAGER, "node", "inspect", task["NodeID"]).stdout)[0]
            return node["Description"]["Hostname"], container
    raise AssertionError(f"no running {service} task")


def test_every_gpu_node_runs_the_exporter_and_top_names_each_gpus_task(rehearsal):
    top = wait(lambda: (v := top_json()) and len({(g["node"], g["gpu"]) for g in v["gpus"]}) == 5 and v, 90,
               "top to list the 5 GPUs")
    assert not top["errors"], top["errors"]
    assert {g["node"] for g in top["gpus"]} == {WHOLE, SHARED}
    held = [g for g in top["gpus"] if g["service"] == SERVICE]
    assert len(held) == 3 and all(g["task"].startswith(f"{SERVICE}.") and g["node"] == WHOLE for g in held)
    (t4_memory,) = {memory for _, memory in fake_aws.gpus_of("g4dn.xlarge")}
    for g in top["gpus"]:
        assert {"node", "gpu", "service", "task", "memory_used_mib"} <= set(g)
        assert g["memory_total_mib"] == t4_memory and g["gpu"].startswith("GPU-")
    table = cli("top").stdout
    assert "NVIDIA T4" in table and SERVICE in table


def test_prometheus_returns_a_tasks_gpu_memory_by_its_service_name(rehearsal):
    node, container = a_running_task(rehearsal, SERVICE)
    before = wait(lambda: query(rehearsal, f'sum(gpu_swarm_task_memory_used_bytes{{service="{SERVICE}", '
                                           f'node="{node}"}})'), 90, "Prometheus to scrape the node's exporter")
    load = machine_health.gpu_load(node, container, KIND, ALLOCATED_MIB)
    expr = f'sum by (service) (gpu_swarm_task_memory_used_bytes{{service="{SERVICE}"}})'

    def grown():
        result = query(rehearsal, expr)
        value = float(result[0]["value"][1]) if result else 0
        return result if value - float(before[0]["value"][1]) >= ALLOCATED_MIB * 2**20 else None
    result = wait(grown, 60, f"{SERVICE}'s GPU memory to rise by {ALLOCATED_MIB} MiB")
    assert result[0]["metric"] == {"service": SERVICE}
    # The GPU's own series carries the task too, and its memory rose as much.
    by_gpu = query(rehearsal, f'gpu_swarm_memory_used_bytes{{gpu="{load["gpu"]}"}}')
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
        expected = {node: sum(u.values()) / len(u) for node, u in by_node.items()}
        seen[:] = [rows, expected]
        return view if rows == expected and any(expected.values()) else None
    seen: list = []
    try:
        view = wait(agreeing, 90, "the top panel's values to match the exporters' GPU utilization per node")
    except AssertionError as e:
        raise AssertionError(f"{e}; last seen: panel {seen[:1]}, exporters {seen[1:]}") from None
    assert view["dashboard"]["title"] == panel["title"] and view["dashboard"]["expr"] == panel["targets"][0]["expr"]
    table = cli("top").stdout
    assert f"Dashboard's top panel: {panel['title']}" in table and panel["targets"][0]["expr"] in table
    busiest = max(view["dashboard"]["rows"], key=lambda r: r["value"])
    assert re.search(rf"{busiest['legend']}\s+{busiest['value']:.1f}%", table), table


def test_the_monitoring_stack_runs_pinned_digests_of_the_programs_services(rehearsal):
    engines = rehearsal["engines"]
    images = dict(line.split(" ", 1) for line in engines.docker(
        CLI_MANAGER, "service", "ls", "--format", "{{.Name}} {{.Image}}").stdout.splitlines())
    assert {"gpu-swarm-monitoring_prometheus", "gpu-swarm-monitoring_grafana"} <= set(images)
    assert all("@sha256:" in images[s] for s in ("gpu-swarm-monitoring_prometheus", "gpu-swarm-monitoring_grafana"))


def test_services_sharing_a_gpu_cost_its_price_and_the_idle_slot_is_the_rest_of_the_node(rehearsal):
    def priced():
        tasks = query(rehearsal, f'gpu_swarm_task_cost_dollars_per_hour{{node="{SHARED}"}}')
        return tasks if {t["metric"]["service"] for t in tasks} == set(SHARERS) else None
    tasks = wait(priced, 90, "Prometheus to have the shared node's three sharers' cost")
    (gpu,) = {t["metric"]["gpu"] for t in tasks}  # the node's one GPU, three of its four slots held
    (gpu_price,) = query(rehearsal, f'gpu_swarm_gpu_cost_dollars_per_hour{{gpu="{gpu}"}}')
    assert float(gpu_price["value"][1]) == SHARED_PRICE
    assert all(float(t["value"][1]) == SHARED_PRICE / 4 for t in tasks)
    (idle,) = query(rehearsal, f'sum(gpu_swarm_idle_cost_dollars_per_hour{{node="{SHARED}"}})')
    assert float(idle["value"][1]) == SHARED_PRICE - sum(float(t["value"][1]) for t in tasks) == SHARED_PRICE / 4
    (node,) = query(rehearsal, f'gpu_swarm_node_cost_dollars_per_hour{{node="{SHARED}"}}')
    assert float(node["value"][1]) == SHARED_PRICE and node["metric"]["instance_type"] == "g4dn.xlarge"
    # The terminal says the same: `localswarm top`.
    cost = top_json()["cost"]
    assert {s: cost["services"][s] for s in SHARERS} == {s: SHARED_PRICE / 4 for s in SHARERS}
    assert cost["nodes"] == SHARED_PRICE + float(fake_prices.ON_DEMAND["g4dn.12xlarge"])
    assert cost["idle"] == pytest.approx(cost["nodes"] - sum(cost["services"].values()))
    assert re.search(rf"^idle GPUs +{cost['idle']:.4f}$", cli("top").stdout, re.M)


def test_the_dashboard_sample_bench_samples_this_rehearsal_and_leaves_it_up(rehearsal):
    """bench/metrics_sample.py's smoke in CI (tests/test_benches.py's SMOKES), on this module's rehearsal,
    which has what it samples (the smoke stack, monitoring): every panel's query, then `localswarm top`."""
    done = subprocess.run([sys.executable, "bench/metrics_sample.py", "--smoke", "--running"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "## localswarm top" in done.stdout and "MiB" in done.stdout
    assert pulumi_cli.holds_machines()  # left up for the module's teardown


def panels_without_data(rehearsal) -> list[str]:
    """Titles of the dashboard's panels none of whose queries returns a series: what Grafana shows
    as "No data". A query Prometheus refuses raises (monitoring_stack.query)."""
    return [panel["title"] for panel in monitoring.dashboard_panels()
            if not any(query(rehearsal, monitoring.as_grafana_sends(target["expr"])) for target in panel["targets"])]


def test_every_dashboard_panel_has_data_with_gpu_tasks_running_and_errors_once_a_gpu_fails(rehearsal):
    """Last in the module: it fails a GPU, which drains its node. The errors panel is empty on
    healthy GPUs by design ("Empty is good"), so every panel having data needs a real fault:
    `node gpu-fault` -> the health watcher's condition in daemon.json -> the exporter -> Prometheus."""
    errors = next(p["title"] for p in monitoring.dashboard_panels() if p["title"].startswith("Errors"))
    assert any(t["state"] == "running" for t in tasks_of(pulumi_cli.status("dev"), SERVICE))
    last: list = []

    def empty_panels_are(expected: list[str]) -> bool:
        last[:] = panels_without_data(rehearsal)
        return last == expected
    try:
        wait(lambda: empty_panels_are([errors]), 90, "every panel but the errors panel to have data")
    except AssertionError as e:
        raise AssertionError(f"{e}; panels without data: {last}") from None
    cli("node", "gpu-fault", SHARED)
    try:
        try:
            wait(lambda: empty_panels_are([]), 90, f"the errors panel to show {SHARED}'s fault")
        except AssertionError as e:
            raise AssertionError(f"{e}; panels without data: {last}") from None
        failing = query(rehearsal, "max by (node, gpu, condition, reason) (gpu_swarm_condition) > 0")
        assert {r["metric"]["node"] for r in failing} == {SHARED}, failing
    finally:
        cli("node", "gpu-heal", SHARED)
