#!/usr/bin/env python3
"""A sample of the GPU dashboard, as text: every panel's queries answered by the rehearsal's Prometheus.

    sudo .venv/bin/python bench/metrics_sample.py [--out FILE]      # under the rehearsal lock; ends with `down`
    sudo .venv/bin/python bench/metrics_sample.py --smoke           # one GPU node of one GPU, one task "busy"
    sudo .venv/bin/python bench/metrics_sample.py --smoke --running # the rehearsal that is up, left up

--running samples the rehearsal of Pulumi's CLI that is up, with `monitoring: true` and the stack
tests/data/metrics/smoke.yml as `smoke`, and leaves it up: CI's smoke runs so on
tests/test_metrics_rehearsal.py's rehearsal, which has both, rather than bringing up one of its own.

Grafana cannot run here (Debian does not package it), so this shows what its panels plot: it
brings up the rehearsal with Pulumi's CLI (a CPU manager, a g4dn.12xlarge of 4 GPUs, or with --smoke a
g4dn.xlarge, running that stack with monitoring on), makes up to three tasks "use" their GPUs
(localswarm/machine_health.py gpu_load: memory and utilization), waits until Prometheus has it, then runs each
panel's PromQL (stacks/monitoring/gpu-swarm-dashboard.json) as an instant query and prints the answers,
followed by `localswarm top`. It exits 1 when no panel had an answer (the dashboard no longer matches
the exporter's series).
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
from localswarm import machine_health, monitoring_stack, pulumi_cli  # noqa: E402
from localswarm.host import find_engine, run  # noqa: E402
from swarm import monitoring  # noqa: E402

LOADS = [(2048, 91), (6144, 64), (512, 12)]  # (MiB, utilization %) of three tasks
SERVICE = "smoke_gpu"


def cli(*args: str) -> str:
    return subprocess.run([sys.executable, "-m", "localswarm", *args], cwd=REPO, capture_output=True, text=True,
                          check=True, timeout=900).stdout


def up(smoke: bool) -> None:
    """The rehearsal's own: the dev stack's config set as a user sets it, then Pulumi's `up`."""
    pools = [{"name": "t4", "instanceType": "g4dn.xlarge" if smoke else "g4dn.12xlarge", "count": 1}]
    stacks = [{"name": "smoke", "file": "tests/data/metrics/smoke.yml"}]
    values = {f"gpu-swarm:{k}": {"value": json.dumps(v), "objectValue": v, "secret": False}
              for k, v in {"gpuPools": pools, "stacks": stacks}.items()}
    values["gpu-swarm:monitoring"] = {"value": "true", "secret": False}
    cli("pulumi", "--stack", "dev", "config", "set-all", "--json", json.dumps(values))
    cli("pulumi", "--stack", "dev", "up", "--yes")


def running_tasks(manager) -> list[tuple[str, str]]:
    """(hostname, container ID) of each running task of the smoke stack, through the manager's engine."""
    engine = find_engine()

    def docker(*args: str) -> str:
        return run([engine.docker, "-H", f"unix://{manager.sock}", *args], env=engine.env(), timeout=60).stdout
    found = []
    ids = docker("service", "ps", "-q", "--no-trunc", "--filter", "desired-state=running", SERVICE).split()
    for task in json.loads(docker("inspect", "--type", "task", *ids)) if ids else []:
        container = task["Status"].get("ContainerStatus", {}).get("ContainerID")
        if task["Status"]["State"] == "running" and container:
            node = json.loads(docker("node", "inspect", task["NodeID"]))[0]
            found.append((node["Description"]["Hostname"], container))
    return found


def label_text(metric: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(metric.items()) if v) or "(all)"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the sample here")
    parser.add_argument("--smoke", action="store_true", help="one GPU node of one GPU, one task busy: that CI runs")
    parser.add_argument("--running", action="store_true",
                        help="sample the rehearsal of Pulumi's CLI that is up (monitoring on, the smoke stack); leave it up")
    args = parser.parse_args()
    lines, answered = [], 0
    if not args.running:
        cli("down")
    try:
        if not args.running:
            up(args.smoke)
        nodes = pulumi_cli.nodes()
        manager = next(n for n in nodes if n.role == "manager")
        deadline = time.monotonic() + 120
        while (prometheus := monitoring_stack.prometheus_task(manager)) is None:
            if time.monotonic() > deadline:
                raise SystemExit("Prometheus does not run: is `monitoring: true` set?")
            time.sleep(2)
        loaded = [machine_health.gpu_load(host, container, "NVIDIA-GPU", mib, util)
                  for (host, container), (mib, util) in zip(running_tasks(manager), LOADS)]
        # Until Prometheus has scraped every load (the program's 15 s scrape interval, and its discovery's).
        want = sum(load["mib"] for load in loaded) * 2**20
        while not any(float(r["value"][1]) >= want for r in monitoring_stack.query(
                prometheus, f'sum(gpu_swarm_task_memory_used_bytes{{service="{SERVICE}"}})', nodes=nodes)):
            if time.monotonic() > deadline + 120:
                raise SystemExit(f"Prometheus did not see the tasks' {want} bytes in time")
            time.sleep(2)
        dashboard = json.loads((REPO / "stacks" / "monitoring" / "gpu-swarm-dashboard.json").read_text())
        lines.append(f"# {dashboard['title']} (rehearsal, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})")
        for panel in dashboard["panels"]:
            lines.append(f"\n## {panel['title']}")
            for target in panel["targets"]:
                lines.append(f"  {target['expr']}")
                # Prometheus knows no Grafana $__ variables: ask what Grafana would send.
                result = monitoring_stack.query(prometheus, monitoring.as_grafana_sends(target["expr"]), nodes=nodes)
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
