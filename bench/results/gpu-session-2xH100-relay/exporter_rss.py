#!/usr/bin/env python3
"""Where the exporter's RSS goes with real NVML (issue 23 item 2): VmRSS after each stage of a start,
then after 30 scrapes, with glibc's default arenas and with node/gpu_metrics.py's lean_malloc().

    python3 exporter_rss.py --out DIR      (bench/gpu_session.sh runs it: 'rss:40=...exporter_rss.py')

Each mode runs in a fresh process of the same Python (the session's venv, with nvidia-ml-py).
Writes DIR/rss.json and prints one line per mode.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def rss() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def stages(mode: str) -> dict:
    out = {"python": rss()}
    sys.path.insert(0, str(REPO / "node"))
    import gpu_metrics
    out["import gpu_metrics (prometheus_client)"] = rss()
    trim = gpu_metrics.lean_malloc() if mode == "lean" else None
    import pynvml  # noqa: F401
    out["import pynvml"] = rss()
    collector = gpu_metrics.GpuCollector("probe", "NVIDIA-GPU", "NVIDIA-GPU-SHARED", "/nonexistent/daemon.json",
                                         "/nonexistent/docker.sock", log=lambda m: None)
    collector.trim = trim
    list(collector.collect())
    out["first scrape (nvmlInit)"] = rss()
    for _ in range(30):
        list(collector.collect())
    out["after 30 scrapes"] = rss()
    out["threads"] = len(os.listdir("/proc/self/task"))
    return out


def main() -> int:
    if len(sys.argv) == 2 and sys.argv[1] in ("plain", "lean"):
        print(json.dumps(stages(sys.argv[1])))
        return 0
    out = Path(sys.argv[sys.argv.index("--out") + 1])
    out.mkdir(parents=True, exist_ok=True)
    result = {}
    for mode in ("plain", "lean"):
        done = subprocess.run([sys.executable, __file__, mode], capture_output=True, text=True, timeout=60)
        result[mode] = json.loads(done.stdout) if done.returncode == 0 else {"error": done.stderr[-500:]}
        print(f"exporter RSS, {mode}: {json.dumps(result[mode])}", flush=True)
    (out / "rss.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
