#!/usr/bin/env python3
"""A sample of the GPU dashboard, as text: every panel's queries answered by the rehearsal's Prometheus.

    sudo .venv/bin/python bench/metrics_sample.py [--out FILE]      # under the rehearsal lock; ends with `down`
    sudo .venv/bin/python bench/metrics_sample.py --smoke           # 2 nodes x 1 GPU, one task "busy"
    sudo .venv/bin/python bench/metrics_sample.py --smoke --running WHERE  # the rehearsal that is up, left up

--running samples a rehearsal already up with `--monitoring` (WHERE: its Prometheus, the JSON that
`up --json` gives as monitoring.prometheus), and leaves it up: CI's smoke runs so on tests/test_metrics_rehearsal.py's rehearsal, which
has the smoke stack and monitoring already, rather than bringing up one of its own for it.

Grafana cannot run here (Debian does not package it), so this shows what its panels plot: it
brings up the rehearsal (3 nodes x 2 GPUs, the smoke stack, `--monitoring`), makes three tasks
"use" their GPUs (localswarm/metrics.py simulate_load: memory and utilization), waits for two
scrapes, then runs each panel's PromQL (stacks/monitoring/gpu-swarm-dashboard.json) as an
instant query and prints the answers, followed by `localswarm top`. It exits 1 when no panel
had an answer (the dashboard no longer matches the exporter's series).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from localswarm import api, metrics, monitoring_stack  # noqa: E402
from localswarm.state import nodes_of, require_state  # noqa: E402
from swarm import monitoring  # noqa: E402

LOADS = [(2048, 91), (6144, 64), (512, 12)]  # (MiB, utilization %) of three tasks


def cli(*args: str) -> str:
    return subprocess.run([sys.executable, "-m", "localswarm", *args], cwd=REPO, capture_output=True, text=True,
                          check=True, timeout=900).stdout


def label_text(metric: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(metric.items()) if v) or "(all)"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the sample here")
    parser.add_argument("--smoke", action="store_true", help="2 nodes x 1 GPU, one task busy: that the bench runs")
    parser.add_argument("--running", metavar="WHERE", type=json.loads,
                        help="sample the rehearsal already up (with --monitoring), whose Prometheus this is (the JSON "
                             "of up's monitoring.prometheus); leave it up")
    args = parser.parse_args()
    shape = ("2", "1") if args.smoke else ("3", "2")
    lines, answered = [], 0
    if not args.running:
        cli("down")
    try:
        prometheus = args.running or json.loads(cli("up", "--nodes", shape[0], "--gpus-per-node", shape[1],
                                                    "--monitoring", "--json"))["monitoring"]["prometheus"]
        nodes = {n.name: n for n in nodes_of(require_state())}
        tasks = api.get(nodes["node-1"].sock, "/tasks", filters={"service": ["smoke_gpu"],
                                                                "desired-state": ["running"]})
        names = {n["ID"]: n["Description"]["Hostname"] for n in api.get(nodes["node-1"].sock, "/nodes")}
        busy = [t for t in tasks if t["Status"]["State"] == "running"
                and nodes[names[t["NodeID"]]].role == "worker"][:len(LOADS)]
        for task, (mib, util) in zip(busy, LOADS):
            metrics.simulate_load(nodes[names[task["NodeID"]]], task["Status"]["ContainerStatus"]["ContainerID"],
                                  "NVIDIA-GPU", mib, util)
        time.sleep(3 * int(monitoring_stack.SCRAPE_INTERVAL.rstrip("s")) + 2)
        dashboard = json.loads((REPO / "stacks" / "monitoring" / "gpu-swarm-dashboard.json").read_text())
        lines.append(f"# {dashboard['title']} (rehearsal, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})")
        for panel in dashboard["panels"]:
            lines.append(f"\n## {panel['title']}")
            for target in panel["targets"]:
                lines.append(f"  {target['expr']}")
                # Prometheus knows no Grafana $__ variables: ask what Grafana would send.
                result = monitoring_stack.query(prometheus, monitoring.as_grafana_sends(target["expr"]))
                unit = panel["fieldConfig"]["defaults"].get("unit")
                for row in sorted(result, key=lambda r: label_text(r["metric"])):
                    value = float(row["value"][1])
                    shown = f"{value / 2**20:.0f} MiB" if unit == "bytes" else f"{value:g}"
                    lines.append(f"    {label_text(row['metric'])}: {shown}")
                if not result:
                    lines.append("    (empty)")
                answered += bool(result)
        lines.append("\n## localswarm top\n" + cli("top"))
    finally:
        if not args.running:
            cli("down")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    if not answered:
        print("FAILED: no panel's query had an answer")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
