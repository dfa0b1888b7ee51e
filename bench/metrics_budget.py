#!/usr/bin/env python3
"""The metrics exporter's budget, measured: scrape time of an 8-GPU node, CPU at a 15 s scrape, memory.

    .venv/bin/python bench/metrics_budget.py [--gpus 8] [--scrapes 50] [--minutes 5] [--out FILE]
    .venv/bin/python bench/metrics_budget.py --smoke     # 5 scrapes and 3 s of CPU: that the bench runs

Budget (issue 18): a scrape of an 8-GPU node in <= 50 ms with the fake NVML; <= 1% of one core
at a 15 s scrape interval; <= 60 MiB RSS. It runs the real exporter (node/gpu_metrics.py) as
its own process, with the fake NVML (localswarm/standins/pynvml.py) describing GPUs that are
busy: each held by a swarm task (a stand-in dockerd answers the exporter's two API calls) and
running two processes whose cgroups name the task's container, so every scrape does the
whole work of a node: NVML readings, the container list, the process-to-task mapping.
- scrape time: --scrapes HTTP GETs of /metrics back to back (wall time, as Prometheus sees it),
  and the exporter's own gpu_swarm_exporter_scrape_duration_seconds;
- CPU: --minutes of scrapes every 15 s; the exporter's utime+stime (/proc/PID/stat) over the
  wall time, idle listening included;
- memory: VmRSS at the end and VmHWM (the peak), from /proc/PID/status.
Exits 1 when a figure is over budget.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from tests.docker_api_stub import DockerApiStub, task_container  # noqa: E402

BUDGET = {"scrape_ms": 50, "cpu_percent": 1.0, "rss_mib": 60}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def busy_node(tmp: Path, gpus: int, docker: DockerApiStub) -> dict:
    """The fake NVML's description of a node whose every GPU a task holds and uses."""
    described, resources, pid = [], [], 400000
    for i in range(gpus):
        uuid = f"GPU-{i:08x}-0000-4000-8000-{i:012x}"
        cid = f"{i:064x}"
        docker.add(task_container(cid, "train_worker", i + 1, [f"DOCKER_RESOURCE_NVIDIA-GPU={uuid}"]))
        processes = []
        for _ in range(2):
            pid += 1
            (tmp / "proc" / str(pid)).mkdir(parents=True)
            (tmp / "proc" / str(pid) / "cgroup").write_text(f"0::/system.slice/docker-{cid}.scope\n")
            processes.append({"pid": pid, "used_mib": 4096})
        described.append({"uuid": uuid, "name": "NVIDIA H100 80GB HBM3", "memory_mib": 81559,
                          "utilization": {"gpu": 93, "memory": 41}, "power_w": 612.0, "temperature_c": 67,
                          "throttle_reasons": 0x4, "processes": processes})
        resources.append(f"NVIDIA-GPU={uuid}")
    (tmp / "daemon.json").write_text(json.dumps({"node-generic-resources": resources}))
    return {"gpus": described}


def proc_stat(pid: int) -> tuple[float, int, int]:
    """(CPU seconds, VmRSS bytes, VmHWM bytes) of a process."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return cpu, int(status["VmRSS"].split()[0]) * 1024, int(status["VmHWM"].split()[0]) * 1024


def scrape(url: str) -> tuple[float, str]:
    t0 = time.perf_counter()
    body = urllib.request.urlopen(url, timeout=10).read().decode()
    return time.perf_counter() - t0, body


def own_duration(body: str) -> float:
    line = next(line for line in body.splitlines() if line.startswith("gpu_swarm_exporter_scrape_duration_seconds"))
    return float(line.rsplit(" ", 1)[1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--scrapes", type=int, default=50, help="back-to-back scrapes for the scrape time")
    parser.add_argument("--minutes", type=float, default=5, help="how long to scrape every 15 s for the CPU figure")
    parser.add_argument("--interval", type=float, default=15)
    parser.add_argument("--out", help="also write the result as JSON here")
    parser.add_argument("--smoke", action="store_true", help="5 scrapes, 3 s for the CPU figure: that the bench runs")
    args = parser.parse_args()
    if args.smoke:
        args.scrapes, args.minutes = 5, 0.05
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        with DockerApiStub(tmp / "docker.sock") as docker:
            nvml = busy_node(tmp, args.gpus, docker)
            port = free_port()
            env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "FAKE_PYNVML": json.dumps(nvml),
                   "PYTHONPATH": str(REPO / "localswarm" / "standins")}
            cmd = [sys.executable, str(REPO / "node" / "gpu_metrics.py"), "--address", "127.0.0.1", "--port",
                   str(port), "--node-name", "bench", "--daemon-json", str(tmp / "daemon.json"), "--docker-socket",
                   docker.sock, "--proc", str(tmp / "proc")]
            proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
            url = f"http://127.0.0.1:{port}/metrics"
            try:
                deadline = time.monotonic() + 30
                while True:
                    try:
                        _, body = scrape(url)  # the first scrape starts NVML: not counted
                        break
                    except OSError:
                        if time.monotonic() > deadline or proc.poll() is not None:
                            raise SystemExit(f"the exporter did not serve: {proc.stderr.read() if proc.poll() else ''}")
                        time.sleep(0.1)
                series = sum(1 for line in body.splitlines() if line.startswith("gpu_swarm_"))
                walls, owns = [], []
                for _ in range(args.scrapes):
                    wall, body = scrape(url)
                    walls.append(wall * 1000)
                    owns.append(own_duration(body) * 1000)
                cpu0, _, _ = proc_stat(proc.pid)
                t0, n = time.monotonic(), 0
                end = t0 + args.minutes * 60
                while time.monotonic() < end:
                    scrape(url)
                    n += 1
                    time.sleep(max(0.0, min(args.interval, end - time.monotonic())))
                cpu1, rss, hwm = proc_stat(proc.pid)
                wall_s = time.monotonic() - t0
            finally:
                proc.terminate()
                proc.wait(10)
    walls.sort()
    result = {
        "gpus": args.gpus, "series_per_scrape": series,
        "scrape_ms": {"median": round(statistics.median(walls), 2), "p95": round(walls[int(len(walls) * .95) - 1], 2),
                      "max": round(walls[-1], 2), "exporter_own_median": round(statistics.median(owns), 2),
                      "scrapes": args.scrapes},
        "cpu_percent_of_one_core": round(100 * (cpu1 - cpu0) / wall_s, 3),
        "cpu": {"seconds": round(cpu1 - cpu0, 3), "over_s": round(wall_s, 1), "scrapes": n,
                "interval_s": args.interval},
        "rss_mib": round(rss / 2**20, 1), "peak_rss_mib": round(hwm / 2**20, 1),
        "python": sys.version.split()[0], "cores": os.cpu_count(),
    }
    over = [what for what, ok in (("scrape_ms", result["scrape_ms"]["median"] <= BUDGET["scrape_ms"]),
                                  ("cpu_percent", result["cpu_percent_of_one_core"] <= BUDGET["cpu_percent"]),
                                  ("rss_mib", result["peak_rss_mib"] <= BUDGET["rss_mib"])) if not ok]
    result["over_budget"] = over
    print(json.dumps(result, indent=2))
    print(f"\n{args.gpus}-GPU scrape: median {result['scrape_ms']['median']} ms (p95 {result['scrape_ms']['p95']}, "
          f"budget {BUDGET['scrape_ms']}); CPU at a {args.interval:g} s scrape: {result['cpu_percent_of_one_core']}% "
          f"of one core (budget {BUDGET['cpu_percent']}%); RSS {result['rss_mib']} MiB, peak "
          f"{result['peak_rss_mib']} MiB (budget {BUDGET['rss_mib']})" + (f"; OVER: {over}" if over else ""))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
