"""`localswarm top`: node/gpu_top.py, the operator's view of every GPU and the task on it, and what each service
and the idle GPUs cost, on the rehearsal; and, where the monitoring stack runs, the dashboard's top panel as
Prometheus answers it.

The same program an operator runs on a manager: it asks a manager's engine for the nodes and
scrapes each node's exporter (the unit its user data installed on every GPU node, at the node's
own address), so what the rehearsal shows is what a cluster shows. The panel's PromQL is read from
the provisioned dashboard (swarm/monitoring.py), never written here.
"""
from __future__ import annotations

import re
import sys

from localswarm import monitoring_stack
from localswarm.host import CLI, REPO, RehearsalError
from swarm import monitoring, node_module


def _gpu_top():
    """node/gpu_top.py, loaded as the node programs load each other: its folder on the path."""
    node_dir = str(REPO / "node")
    if node_dir not in sys.path:
        sys.path.insert(0, node_dir)
    return node_module.load("gpu_top.py", "gpu_swarm_gpu_top")


gpu_top = _gpu_top()


def top() -> dict:
    """{"gpus": [{node, gpu, index, model, service, task, memory_used_mib, ...}], "errors": [...],
    "dashboard": {title, expr, unit, rows: [{legend, value}]} or {title, expr, absent}}"""
    from localswarm import pulumi_cli
    nodes = pulumi_cli.nodes() if pulumi_cli.holds_machines() else []
    manager = next((n for n in nodes if n.role == "manager"), None)
    if manager is None:
        raise RehearsalError(f"no rehearsal is up: `{CLI} pulumi up` makes one")
    try:
        swarm = gpu_top.swarm_nodes(manager.sock)
    except gpu_top.DockerUnavailable as e:
        raise RehearsalError(f"{e}; is the rehearsal's first manager up?") from None
    view = gpu_top.collect(swarm)
    view["dashboard"] = dashboard_top_panel(manager, nodes)
    return view


def dashboard_top_panel(manager, nodes: list) -> dict:
    """The dashboard's top panel, its first query asked of the rehearsal's Prometheus as Grafana would.
    A Prometheus that runs but refuses the query is an error (it raises); no monitoring stack is not."""
    panel = monitoring.top_panel()
    target = panel["targets"][0]
    shown = {"title": panel["title"], "expr": target["expr"], "unit": panel["fieldConfig"]["defaults"].get("unit")}
    where = monitoring_stack.prometheus_task(manager)
    if where is None:
        return {**shown, "absent": "the monitoring stack is not running: `pulumi config set gpu-swarm:monitoring "
                                   "true` and an up deploy it"}
    rows = [{"legend": legend(target.get("legendFormat", ""), r["metric"]), "value": float(r["value"][1])}
            for r in monitoring_stack.query(where, monitoring.as_grafana_sends(target["expr"]), nodes=nodes)]
    return {**shown, "prometheus_on": where["node"], "rows": sorted(rows, key=lambda r: r["legend"])}


def legend(fmt: str, labels: dict) -> str:
    """Grafana's legendFormat: {{label}} replaced by the series' label value; no format, all labels."""
    if not fmt:
        return ", ".join(f"{k}={v}" for k, v in sorted(labels.items())) or "(value)"
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m[1], ""), fmt)


def _value(value: float, unit: str | None) -> str:
    if unit == "percent":
        return f"{value:.1f}%"
    if unit == "bytes":
        return f"{value / 2**20:.0f} MiB"
    return f"{value:g}"


def render(view: dict) -> str:
    text = gpu_top.render(view)
    panel = view.get("dashboard")
    if not panel:
        return text
    lines = [f"\nDashboard's top panel: {panel['title']}", f"  {panel['expr']}"]
    if "absent" in panel:
        lines.append(f"  ({panel['absent']})")
    else:
        lines += [f"  {row['legend']:<20} {_value(row['value'], panel['unit'])}" for row in panel["rows"]]
        lines += [] if panel["rows"] else ["  No data: Prometheus has no series for this query yet"]
    return text + "\n" + "\n".join(lines)
