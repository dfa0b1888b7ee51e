"""`localswarm top`: node/gpu_top.py, the operator's view of every GPU and the task on it, on the rehearsal.

The same program an operator runs on a manager: it asks a manager's engine for the nodes and
scrapes each node's exporter (localswarm/metrics.py runs one on every node, at the node's own
address), so what the rehearsal shows is what a cluster shows.
"""
from __future__ import annotations

import importlib.util
import sys

from localswarm import metrics
from localswarm.host import REPO, RehearsalError
from localswarm.state import nodes_of, require_state


def _gpu_top():
    """node/gpu_top.py, loaded as the node programs load each other: its folder on the path."""
    node_dir = str(REPO / "node")
    if node_dir not in sys.path:
        sys.path.insert(0, node_dir)
    spec = importlib.util.spec_from_file_location("gpu_swarm_gpu_top", REPO / "node" / "gpu_top.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gpu_top = _gpu_top()


def top() -> dict:
    """{"gpus": [{node, gpu, index, model, service, task, memory_used_mib, ...}], "errors": [...]}"""
    state = require_state()
    nodes = nodes_of(state)
    manager = next((n for n in nodes if n.role == "manager"), None)
    try:
        swarm = gpu_top.swarm_nodes(manager.sock)
    except gpu_top.DockerUnavailable as e:
        raise RehearsalError(f"{e}; is the rehearsal's first manager up?") from None
    missing = [n.name for n in nodes if not metrics.exporting(n)]
    view = gpu_top.collect(swarm)
    if missing:
        view["errors"] += [{"node": name, "error": f"no exporter running (see {metrics.log_file(n)})"}
                           for name, n in ((n.name, n) for n in nodes) if name in missing
                           and not any(e["node"] == name for e in view["errors"])]
    return view


def render(view: dict) -> str:
    return gpu_top.render(view)
