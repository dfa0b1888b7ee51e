"""monitoring: true: the stack it deploys, its settings, its place in the graph, and the metrics port.

The graph is the program's under Pulumi's mocks (tests/test_resource_graph.py's way); the
stack's files are checked with the real docker CLI's compose loader; the whole chain
(exporter -> Prometheus -> a query by service) runs in the rehearsal, in
tests/test_metrics_rehearsal.py.
"""
from __future__ import annotations

import base64
import io
import json
import re
import subprocess
import tarfile

import pytest
import yaml

from localswarm.host import find_engine
from settings import SettingsError, load_settings
from swarm import monitoring
from swarm.node_contract import METRICS_PORT, MONITORING_STACK
from tests.conftest import REPO, run_program, stack_config, use_mocks
from tests.test_resource_graph import Graph, ancestors, inner

PINNED = "prom/prometheus:v3.5.0@sha256:" + "ab" * 32


@pytest.fixture(scope="module")
def with_monitoring():
    return Graph(run_program(stack_config("prod", monitoring=True, monitoringImages={"prometheus": PINNED}),
                             stack="prod"))


@pytest.fixture(scope="module")
def without():
    return Graph(run_program(stack_config("dev"), stack="dev"))


# ---------------------------------------------------------------- the metrics port


@pytest.mark.parametrize("graph", ["with_monitoring", "without"])
def test_the_metrics_port_is_open_to_cluster_members_only(graph, request):
    g = request.getfixturevalue(graph)
    rules = [g.plain(n) for n in g.of_type("aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule")]
    (metrics,) = [r for r in rules if r.get("fromPort") == METRICS_PORT]
    assert (metrics["ipProtocol"], metrics["toPort"]) == ("tcp", METRICS_PORT)
    assert metrics["securityGroupId"] == metrics["referencedSecurityGroupId"] == "gpu-swarm-sg-cluster-id"
    assert "cidrIpv4" not in metrics and "cidrIpv6" not in metrics
    # Open whether or not monitoring is on: turning it on must not touch a security group.
    assert "GPU metrics" in metrics["description"]


def test_prometheus_scrapes_the_port_the_contract_and_the_unit_name():
    assert monitoring.scrape_port_in_config() == METRICS_PORT
    assert f"port {METRICS_PORT}" in (REPO / "node" / "gpu-swarm-metrics.service").read_text()


# ---------------------------------------------------------------- the graph


def test_the_stack_deploys_from_the_first_manager_after_every_node_is_in(with_monitoring):
    g = with_monitoring
    name = "gpu-swarm-monitoring-deploy"
    for admit in g.commands("-admit"):
        assert admit in ancestors(g, name), admit  # through each pool's last wave
    deploy = g.plain(name)
    assert deploy["connection"]["host"] == g.run.exports["managerPublicIps"][0]
    files = unpack(deploy["stdin"])
    assert set(files) == {"monitoring.yml", "monitoring/prometheus.yml", "monitoring/grafana-datasource.yml",
                          "monitoring/grafana-dashboards.yml", "monitoring/gpu-swarm-dashboard.json"}
    compose = yaml.safe_load(files["monitoring.yml"])
    assert compose["services"]["prometheus"]["image"] == PINNED  # monitoringImages
    assert compose["services"]["grafana"]["image"] == monitoring.default_images()["grafana"]
    script = inner(deploy)
    assert monitoring.bundle_sha256(deploy["stdin"])[:16] in script and "triggers" not in deploy
    assert f'docker stack deploy --detach=true --with-registry-auth --prune -c "$dir/monitoring.yml" ' \
           f"{MONITORING_STACK}" in script
    assert g.depends_on("gpu-swarm-health-read", name)


def test_reconcile_keeps_the_stack_while_monitoring_is_on_and_removes_it_after(with_monitoring, without):
    (on,) = with_monitoring.commands("reconcile-run")
    kept = re.search(r"keep_stacks=' ([^']*) '", inner(with_monitoring.plain(on)))[1].split()
    assert sorted(kept) == sorted(["gpu-smoke", "inference", MONITORING_STACK])
    (off,) = without.commands("reconcile-run")
    assert MONITORING_STACK not in inner(without.plain(off))  # its marker makes reconcile remove it
    assert not [n for n in without.requests if "monitoring" in n]


def test_the_stack_output_says_how_to_open_it(with_monitoring, without):
    manager = with_monitoring.run.exports["managerPublicIps"][0]
    access = with_monitoring.run.exports["monitoring"]
    assert access["tunnel"] == f"ssh -N -L 3000:localhost:3000 -L 9090:localhost:9090 ubuntu@{manager}"
    assert access["grafana"] == "http://localhost:3000" and access["prometheus"] == "http://localhost:9090"
    assert without.run.exports["monitoring"]["enabled"] is False
    assert "gpu-swarm:monitoring true" in without.run.exports["monitoring"]["how"]


# ---------------------------------------------------------------- settings

BAD = [
    ("not-a-boolean", {"monitoring": "yes"}, "gpu-swarm:monitoring: expected true or false, found 'yes'"),
    ("tag-only", {"monitoringImages": {"grafana": "grafana/grafana:12.1.1"}},
     "gpu-swarm:monitoringImages.grafana: 'grafana/grafana:12.1.1' is not pinned by digest"),
    ("short-digest", {"monitoringImages": {"prometheus": "prom/prometheus@sha256:abc"}},
     "gpu-swarm:monitoringImages.prometheus: 'prom/prometheus@sha256:abc' is not pinned by digest"),
    ("unknown-service", {"monitoringImages": {"grafanna": PINNED}},
     "gpu-swarm:monitoringImages.grafanna: is not a service of the monitoring stack; did you mean grafana?"),
    ("not-an-object", {"monitoringImages": '["x"]'}, "gpu-swarm:monitoringImages: expected an object"),
    ("stack-name-taken", {"stacks": [{"name": MONITORING_STACK, "file": "stacks/gpu-smoke.yml"}]},
     f"gpu-swarm:stacks: '{MONITORING_STACK}' is the name of the program's monitoring stack"),
]


@pytest.mark.parametrize("overrides,fragment", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_monitoring_settings_name_the_key_and_the_fix(overrides, fragment):
    use_mocks(stack_config("dev", **overrides))
    with pytest.raises(SettingsError) as err:
        load_settings()
    assert fragment in str(err.value)


def test_monitoring_is_off_unless_asked_and_takes_pinned_images():
    use_mocks(stack_config("dev"))
    assert load_settings().monitoring.enabled is False
    use_mocks(stack_config("dev", monitoring=True, monitoringImages={"grafana": PINNED.replace("prom/", "x/")}))
    got = load_settings().monitoring
    assert got.enabled and dict(got.images) == {"grafana": PINNED.replace("prom/", "x/")}


# ---------------------------------------------------------------- the files


def unpack(text: str) -> dict[str, str]:
    with tarfile.open(fileobj=io.BytesIO(base64.decodebytes(text.encode()))) as tar:
        return {m.name: tar.extractfile(m).read().decode() for m in tar.getmembers()}


def test_the_stack_files_images_are_pinned_by_digest():
    for service, image in monitoring.default_images().items():
        assert monitoring.image_problem(image) is None, service


def test_configs_are_named_by_their_content_so_a_change_rolls_the_service():
    one, two = monitoring.render(), monitoring.render(scrape_interval="2s")
    names = lambda files: {k: v["name"] for k, v in yaml.safe_load(files["monitoring.yml"])["configs"].items()}  # noqa
    assert names(one)["grafana-dashboard"] == names(two)["grafana-dashboard"]
    assert names(one)["prometheus"] != names(two)["prometheus"]
    assert "scrape_interval: 2s" in two["monitoring/prometheus.yml"]
    assert all(n.startswith(f"{MONITORING_STACK}-") for n in names(one).values())
    assert monitoring.bundle(one) == monitoring.bundle(monitoring.render())  # the same text every time


def test_the_rehearsal_can_point_prometheus_at_its_engines_socket():
    compose = yaml.safe_load(monitoring.render(docker_socket="/run/x/docker.sock")["monitoring.yml"])
    assert "/run/x/docker.sock:/var/run/docker.sock:ro" in compose["services"]["prometheus"]["volumes"]


def test_render_refuses_an_image_that_is_not_pinned():
    with pytest.raises(ValueError, match="not pinned by digest"):
        monitoring.render({"grafana": "grafana/grafana:latest"})


def test_docker_stack_config_accepts_the_rendered_stack(tmp_path):
    """The real CLI's compose loader (what `docker stack deploy` runs first), on the files as deployed."""
    for rel, text in monitoring.render().items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    engine = find_engine()
    done = subprocess.run([engine.docker, "stack", "config", "-c", str(tmp_path / "monitoring.yml")],
                          capture_output=True, text=True, env=engine.env(), timeout=60)
    assert done.returncode == 0, done.stderr
    config = yaml.safe_load(done.stdout)
    assert set(config["services"]) == {"prometheus", "grafana"}
    assert {c["target"] for c in config["services"]["grafana"]["configs"]} >= {
        "/etc/grafana/dashboards/gpu-swarm.json", "/etc/grafana/provisioning/datasources/gpu-swarm.yml"}


def test_the_deploy_script_is_valid_bash_and_cleans_up():
    text = monitoring.deploy_monitoring("a" * 64)
    assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0
    assert "trap 'rm -rf \"$dir\"' EXIT" in text and "base64 -d | tar -x -C" in text
    with pytest.raises(ValueError):
        monitoring.deploy_monitoring("not a hash")


def test_the_dashboard_has_the_panels_the_issue_asks_and_uses_the_provisioned_source():
    dashboard = json.loads((REPO / "stacks" / "monitoring" / "gpu-swarm-dashboard.json").read_text())
    source = yaml.safe_load((REPO / "stacks" / "monitoring" / "grafana-datasource.yml").read_text())
    uid = source["datasources"][0]["uid"]
    titles = " | ".join(p["title"] for p in dashboard["panels"])
    for wanted in ("by node", "by service", "memory per task", "Errors", "Cost by service", "Idle GPUs",
                   "Cost over the time range"):
        assert wanted in titles
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == uid and panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert re.search(r"gpu_swarm_\w+", target["expr"]), target


def test_a_panel_over_the_dashboards_time_range_is_asked_as_grafana_sends_it():
    """Prometheus knows no $__range: the rehearsal's tests and `localswarm top` ask what Grafana would send."""
    (over,) = [p for p in monitoring.dashboard_panels() if p["title"].startswith("Cost over the time range")]
    assert all("[$__range:1m]" in t["expr"] for t in over["targets"])
    assert monitoring.as_grafana_sends(over["targets"][0]["expr"]) == (
        "sum by (service) (sum_over_time(gpu_swarm_task_cost_dollars_per_hour[10800s:1m])) / 60")  # now-3h


def test_the_tunnel_forwards_both_ports():
    assert monitoring.tunnel_command("ubuntu", "203.0.113.9") == \
        "ssh -N -L 3000:localhost:3000 -L 9090:localhost:9090 ubuntu@203.0.113.9"


def test_the_top_panel_is_the_dashboards_top_left_one_and_top_reads_its_query_from_there(monkeypatch, tmp_path):
    from localswarm import top
    panels = json.loads((REPO / "stacks" / "monitoring" / "gpu-swarm-dashboard.json").read_text())["panels"]
    first = monitoring.top_panel()
    assert all((first["gridPos"]["y"], first["gridPos"]["x"]) <= (p["gridPos"]["y"], p["gridPos"]["x"]) for p in panels)
    # One source: a changed dashboard is what `localswarm top` asks.
    changed = json.loads(monitoring.DASHBOARD.read_text())
    changed["panels"][3]["gridPos"] = {"x": 0, "y": 0, "w": 24, "h": 4}
    changed["panels"][0]["gridPos"]["y"] = 1
    moved = tmp_path / "dashboard.json"
    moved.write_text(json.dumps(changed))
    monkeypatch.setattr(monitoring, "DASHBOARD", moved)
    shown = top.dashboard_top_panel(type("Gone", (), {"sock": str(tmp_path / "no.sock")})(), nodes=[])
    assert shown["title"] == changed["panels"][3]["title"] and shown["expr"] == changed["panels"][3]["targets"][0]["expr"]
    assert "pulumi config set gpu-swarm:monitoring true" in shown["absent"]
    text = top.render({"gpus": [], "errors": [], "dashboard": shown})
    assert f"Dashboard's top panel: {shown['title']}" in text and "gpu-swarm:monitoring true" in text


@pytest.mark.parametrize("fmt, labels, shown", [
    ("{{node}}", {"node": "gpu-1", "gpu": "GPU-a"}, "gpu-1"),
    ("{{ service }} on {{node}}", {"node": "gpu-1", "service": "train"}, "train on gpu-1"),
    ("", {"node": "gpu-1", "gpu": "GPU-a"}, "gpu=GPU-a, node=gpu-1"),
])
def test_top_names_each_series_as_grafanas_legend_format_does(fmt, labels, shown):
    from localswarm import top
    assert top.legend(fmt, labels) == shown


def test_program_up_reports_no_monitoring_addresses_when_monitoring_is_off():
    from localswarm import monitoring_stack
    off = {"monitoring": {"enabled": False, "how": "pulumi config set gpu-swarm:monitoring true && pulumi up"}}
    assert monitoring_stack.program_access(off, nodes=[]) is None
