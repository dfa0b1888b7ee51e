#!/usr/bin/env python3
"""nvidia-smi for the whole swarm: each GPU's node, model, utilization and memory, and the task on it.

Run it on a manager (every node has it, as part of the node software):

    sudo python3 /opt/gpu-swarm/software/gpu_top.py [--json]

It asks the manager's engine for the swarm's nodes, scrapes each node's GPU metrics exporter
(gpu_metrics.py, port 9835, open to cluster members) at once, and prints one row per GPU, or
per slot holder of a shared GPU, then what each service's GPUs and the idle ones cost per hour,
where the program told the nodes their price. No Prometheus needed. `python -m localswarm top` runs it on
the rehearsal. Stdlib only (managers have no venv).

Exit codes: 0 every GPU node answered; 1 some did not (their rows say why); 2 bad input.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
from contract import DOCKER_SOCKET, METRICS_PORT, POOL_GPU_COUNT_LABEL  # noqa: E402
from gpu_tasks import DockerUnavailable, docker_get  # noqa: E402

WANTED = ("gpu_swarm_gpu_up", "gpu_swarm_gpu_utilization_percent", "gpu_swarm_memory_used_bytes",
          "gpu_swarm_memory_total_bytes", "gpu_swarm_task_memory_used_bytes", "gpu_swarm_task_utilization_percent",
          "gpu_swarm_task_cost_dollars_per_hour", "gpu_swarm_idle_cost_dollars_per_hour",
          "gpu_swarm_node_cost_dollars_per_hour")
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"\s*,?')
MIB = 1024 * 1024


def parse(text: str) -> dict[str, list[tuple[dict, float]]]:
    """The samples of the metrics we show, from the Prometheus text format."""
    out: dict[str, list] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if not match or match[1] not in WANTED:
            continue
        labels = {k: v.replace('\\"', '"').replace("\\n", "\n").replace("\\\\", "\\")
                  for k, v in _LABEL.findall(match[2] or "")}
        out.setdefault(match[1], []).append((labels, float(match[3])))
    return out


def swarm_nodes(sock: str) -> list[dict]:
    """[{name, address, gpu_node}] of every node, as the manager's engine knows them."""
    nodes = docker_get(sock, "/nodes")
    return sorted(({"name": n["Description"]["Hostname"], "address": n["Status"].get("Addr", ""),
                    "gpu_node": int((n["Spec"].get("Labels") or {}).get(POOL_GPU_COUNT_LABEL, "0") or 0) > 0}
                   for n in nodes), key=lambda n: n["name"])


def scrape(address: str, port: int, timeout: float) -> str:
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(
            f"http://{address}:{port}/metrics", timeout=timeout) as answer:
        return answer.read().decode()


def rows_of(node: str, metrics: dict) -> list[dict]:
    """One row per GPU series (a GPU, or one holder of a shared GPU)."""
    def key(labels):
        return labels.get("gpu"), labels.get("slot", ""), labels.get("task", "")

    values = {name: {key(l): v for l, v in metrics.get(name, [])} for name in WANTED}
    rows = []
    for labels, up in metrics.get("gpu_swarm_gpu_up", []):
        k = key(labels)
        used, total = values["gpu_swarm_memory_used_bytes"].get(k), values["gpu_swarm_memory_total_bytes"].get(k)
        task_memory = values["gpu_swarm_task_memory_used_bytes"].get(k)
        task_util = values["gpu_swarm_task_utilization_percent"].get(k)
        task_cost = values["gpu_swarm_task_cost_dollars_per_hour"].get(k)
        rows.append({"node": labels.get("node") or node, "index": labels.get("index", ""),
                     "model": labels.get("model", ""), "gpu": labels.get("gpu", ""), "up": up == 1,
                     "utilization_percent": values["gpu_swarm_gpu_utilization_percent"].get(k),
                     "memory_used_mib": None if used is None else round(used / MIB),
                     "memory_total_mib": None if total is None else round(total / MIB),
                     "service": labels.get("service", ""), "task": labels.get("task", ""),
                     "slot": labels.get("slot", ""),
                     "task_memory_mib": None if task_memory is None else round(task_memory / MIB),
                     "task_utilization_percent": task_util, "task_cost_per_hour": task_cost})
    return rows


def cost_of(node: str, metrics: dict) -> dict | None:
    """{node, per_hour, idle, services: {service: USD per hour}} of one node; None when it has no price."""
    price = metrics.get("gpu_swarm_node_cost_dollars_per_hour")
    if not price:
        return None
    services: dict[str, float] = {}
    for labels, value in metrics.get("gpu_swarm_task_cost_dollars_per_hour", []):
        services[labels.get("service", "")] = services.get(labels.get("service", ""), 0.0) + value
    return {"node": price[0][0].get("node") or node, "per_hour": price[0][1], "services": services,
            "idle": sum(v for _, v in metrics.get("gpu_swarm_idle_cost_dollars_per_hour", []))}


def total_cost(nodes: list[dict], unpriced: list[str]) -> dict:
    """The cluster's GPU nodes: each service's cost, the idle GPUs', and the nodes' in all, USD per hour."""
    services: dict[str, float] = {}
    for node in nodes:
        for service, value in node["services"].items():
            services[service] = services.get(service, 0.0) + value
    return {"services": dict(sorted(services.items())), "idle": sum(n["idle"] for n in nodes),
            "nodes": sum(n["per_hour"] for n in nodes), "priced_nodes": sorted(n["node"] for n in nodes),
            "unpriced_nodes": sorted(unpriced)}


def collect(nodes: list[dict], port: int = METRICS_PORT, timeout: float = 3) -> dict:
    """{"gpus": rows, "errors": [{node, error}]}: every node's exporter, asked at once. A node
    without GPUs (a manager) that runs no exporter is skipped; a GPU node's failure is an error."""
    def ask(node):
        try:
            return node, scrape(node["address"], port, timeout), None
        except OSError as e:
            return node, None, str(getattr(e, "reason", e))

    gpus, errors, costs, unpriced = [], [], [], []
    with ThreadPoolExecutor(max_workers=max(1, min(16, len(nodes)))) as pool:
        for node, text, error in pool.map(ask, nodes):
            if text is not None:
                metrics = parse(text)
                gpus += rows_of(node["name"], metrics)
                cost = cost_of(node["name"], metrics)
                if cost:
                    costs.append(cost)
                else:
                    unpriced.append(node["name"])
            elif node.get("gpu_node", True):
                errors.append({"node": node["name"], "error": f"{node['address']}:{port}: {error}"})
    gpus.sort(key=lambda r: (r["node"], int(r["index"]) if r["index"].isdigit() else 1 << 20, r["slot"]))
    return {"gpus": gpus, "errors": errors, "cost": total_cost(costs, unpriced)}


def _mib(value) -> str:
    return "?" if value is None else f"{value}"


def render(view: dict) -> str:
    header = ("NODE", "GPU", "MODEL", "UTIL", "MEMORY MiB", "SERVICE", "TASK", "TASK MiB", "TASK UTIL")
    rows = [header]
    for r in view["gpus"]:
        gpu = f"{r['index']}" + (f" slot {r['slot'].rsplit('-s', 1)[1]}" if r["slot"] else "")
        util = "ERR" if not r["up"] else "-" if r["utilization_percent"] is None else f"{r['utilization_percent']:.0f}%"
        memory = f"{_mib(r['memory_used_mib'])} / {_mib(r['memory_total_mib'])}"
        task_util = r.get("task_utilization_percent")
        rows.append((r["node"], gpu, r["model"], util, memory, r["service"] or "-", r["task"] or "-",
                     "-" if r["task_memory_mib"] is None else str(r["task_memory_mib"]),
                     "-" if task_util is None else f"{task_util:.0f}%"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    lines += [f"{e['node']}: no metrics ({e['error']})" for e in view["errors"]]
    lines.append("UTIL ERR: NVML could not read that GPU (see gpu_swarm_nvml_errors_total). UTIL and MEMORY are the "
                 "GPU's, for each of a shared GPU's holders; TASK MiB and TASK UTIL that task's own processes' on it.")
    return "\n".join(lines + render_cost(view.get("cost")))


def render_cost(cost: dict | None) -> list[str]:
    """What each service's GPUs and the idle ones cost, USD per hour, as the exporters share their nodes' prices."""
    if not cost or not cost["priced_nodes"]:
        return ["", "COST: no node has a price (the program writes each GPU node's at `pulumi up`)"] if cost else []
    rows = [(service or "(no service)", f"{value:.4f}") for service, value in cost["services"].items()]
    rows += [("idle GPUs", f"{cost['idle']:.4f}"), ("GPU nodes in all", f"{cost['nodes']:.4f}")]
    width = max(len(r[0]) for r in rows)
    lines = ["", "COST, USD per hour at the nodes' list prices (a whole GPU: its node's price over its GPUs; a slot: "
                 "the GPU's over its slots)", f"{'SERVICE'.ljust(width)}  $/HOUR"]
    lines += [f"{name.ljust(width)}  {value}" for name, value in rows]
    if cost["unpriced_nodes"]:
        lines.append(f"not priced, and not counted: {', '.join(cost['unpriced_nodes'])}")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print each GPU as JSON: node, gpu, service, task, "
                                                            "memory_used_mib and more")
    parser.add_argument("--docker-socket", default=DOCKER_SOCKET, metavar="PATH",
                        help=f"a manager's engine (default {DOCKER_SOCKET})")
    parser.add_argument("--port", type=int, default=METRICS_PORT, help=f"the exporters' port (default {METRICS_PORT})")
    parser.add_argument("--timeout", type=float, default=3, help="seconds to wait for each node (default 3)")
    args = parser.parse_args(argv)
    try:
        nodes = swarm_nodes(args.docker_socket)
    except DockerUnavailable as e:
        print(f"gpu-swarm top: {e}; run it on a manager, as root", file=sys.stderr)
        return 2
    view = collect(nodes, args.port, args.timeout)
    print(json.dumps(view, indent=2) if args.json else render(view))
    return 1 if view["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
