"""The MPS bench's node (bench/gpu_mps.py, bench/gpu_mps_escapes.py): its engine, what its tasks hold and
see, and the node's exporter read the way Prometheus reads it. Not a bench: they import it."""
from __future__ import annotations

import json
import math
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from gpu_bench import CUDA_IMAGE as IMAGE  # the stand-in (bench/cuda_standin.sh), with cuda-probe
from gpu_bench import KIND, REPO, SHARED_KIND, Engine, check, run, sample_starts, samples, wait

ENGINE = Engine("gpu-swarm-mps", run="gpu-swarm-mps-bench")
docker = ENGINE.docker


def job(name: str, command: str, *extra: str, timeout: float = 60) -> str:
    """A one-shot job of the stand-in image; its final state line and log."""
    return ENGINE.job(name, IMAGE, command, *extra, timeout=timeout)


def smi(*query: str) -> str:
    return run(["nvidia-smi", *query]).stdout


def containers(service: str) -> dict[str, str]:
    """Running container id -> its log, for a service's tasks."""
    ids = docker("ps", "-q", "--no-trunc", "--filter", f"label=com.docker.swarm.service.name={service}").stdout.split()
    return {cid: docker("logs", cid, check_rc=False).stdout + docker("logs", cid, check_rc=False).stderr
            for cid in ids}


def gone(service: str) -> None:
    """Remove a service and wait for its containers: until they stop they hold their GPU or slot."""
    docker("service", "rm", service, check_rc=False)
    wait(lambda: not containers(service), 60, f"{service}'s containers to stop")


def used(gpu: str) -> int:
    return int(smi("-i", gpu, "--query-gpu=memory.used", "--format=csv,noheader,nounits").strip())


def modes(gpus: list[str]) -> dict[str, str]:
    return {g: smi("-i", g, "--query-gpu=compute_mode", "--format=csv,noheader").strip() for g in gpus}


def given(container: str, kind: str) -> str:
    """What swarm gave the task: its DOCKER_RESOURCE_<kind> in the container's config (the guard's
    rewrite shows only in the process's environment)."""
    env = json.loads(docker("inspect", "--format", "{{json .Config.Env}}", container).stdout)
    return next((e.split("=", 1)[1] for e in env if e.startswith(f"DOCKER_RESOURCE_{kind}=")), "")


def gpu_of_slot(slot: str) -> str:
    return slot.rsplit("-s", 1)[0]  # slots are <uuid>-s<k> (the agent's naming)


def apps() -> str:
    return smi("--query-compute-apps=pid,process_name,used_memory", "--format=csv,noheader")


def task_env(container: str) -> dict[str, str]:
    """The environment the task's first process runs with, after the guard's rewrite."""
    pid = docker("inspect", "--format", "{{.State.Pid}}", container).stdout.strip()
    raw = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
    return dict(e.split("=", 1) for e in raw.split("\0") if "=" in e)


def start_times(variants: dict[str, list[str]], runs: int) -> dict[str, list[float]]:
    """Seconds of `docker run --rm` per variant on this bench's engine, interleaved."""
    return sample_starts(ENGINE, variants, runs)


def paired_cost(guard: list[float], alone: list[float]) -> tuple[float, float, float]:
    """Milliseconds the guard adds to a start: the median of the interleaved rounds' differences, and
    its 95 % distribution-free interval (the order statistics a sign test gives: k of the n sorted
    differences left out on each side, the most with P(Binomial(n, 1/2) < k) <= 2.5 %). A start
    varies by tens of ms, so a median of ~10 runs cannot tell +15 ms from 0; the interval says how far
    it can, and the check fails only when the whole interval lies above the budget."""
    differences = sorted((g - a) * 1000 for g, a in zip(guard, alone))
    n, k, below = len(differences), 0, 0.0
    while k < n // 2 and below + math.comb(n, k) / 2 ** n <= 0.025:
        below += math.comb(n, k) / 2 ** n
        k += 1
    low, high = (differences[k - 1], differences[n - k]) if k else (differences[0], differences[-1])
    return statistics.median(differences), low, high


def time_left() -> float:
    ends = os.environ.get("GPU_SESSION_ENDS_AT")
    return float(ends) - time.time() if ends else float("inf")


class Exporter:
    """The node's exporter (node/gpu_metrics.py, real NVML) on this bench's engine: who holds what."""

    def __init__(self, out: Path):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.log = open(out / "exporter.log", "w")
        self.out = out
        self.proc = subprocess.Popen([sys.executable, str(REPO / "node" / "gpu_metrics.py"), "--address", "127.0.0.1",
                                      "--port", str(self.port), "--kind", KIND, "--shared-kind", SHARED_KIND,
                                      "--docker-socket", str(ENGINE.run_dir / "docker.sock"), "--daemon-json",
                                      str(ENGINE.root / "daemon.json")], stdout=self.log, stderr=subprocess.STDOUT)
        wait(self.scrape, 30, "the exporter to serve")

    def scrape(self) -> list[tuple[str, dict, float]] | None:
        try:
            text = urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=10).read().decode()
        except OSError:
            return None
        (self.out / "scrape-last.txt").write_text(text)
        return samples(text)

    def task_memory_mib(self, container: str) -> int | None:
        rows = [v for n, labels, v in self.scrape() or () if n == "gpu_swarm_task_memory_used_bytes" and
                labels.get("container") == container]
        return int(rows[0] / 2**20) if len(rows) == 1 else None

    def check_sharers(self, logs: dict[str, str], sizes: dict[str, int], mib: int) -> None:
        """Every sharer's memory series carries its own service, task, container and slot, with its own size."""
        def named():
            rows = [(labels, v) for n, labels, v in self.scrape() or () if n == "gpu_swarm_task_memory_used_bytes"]
            mine = {c: [(labels, v) for labels, v in rows if labels.get("container") == c[:12]] for c in logs}
            return mine if all(len(r) == 1 and r[0][1] >= sizes[c] * 2**20 for c, r in mine.items()) else None
        try:
            mine = wait(named, 45, "every sharer's memory in the exporter's series")
        except RuntimeError:
            mine = {c: [] for c in logs}
            rows = [(labels, v) for n, labels, v in self.scrape() or () if n == "gpu_swarm_task_memory_used_bytes"]
            for c in logs:
                mine[c] = [(labels, v) for labels, v in rows if labels.get("container") == c[:12]]
        wrong = []
        for c, rows in mine.items():
            slot_held = given(c, SHARED_KIND)
            labels, v = rows[0] if len(rows) == 1 else ({}, 0)
            # its own size (and its CUDA context), never a neighbour's: the next size is --mib more
            if not (labels.get("slot") == slot_held and labels.get("gpu") == gpu_of_slot(slot_held) and
                    labels.get("task", "").startswith("steady.") and labels.get("service") == "steady" and
                    sizes[c] * 2**20 <= v < (sizes[c] + mib) * 2**20):
                wrong.append(f"{c[:12]} ({sizes[c]} MiB on {slot_held[-6:]}): {len(rows)} series, "
                             f"{labels.get('slot', '')[-6:]} {v / 2**20:.0f} MiB")
        check(f"the exporter names every sharer's memory with its own service, task, container and slot "
              f"({len(logs)} sharers, {len(set(sizes.values()))} sizes)", not wrong,
              "; ".join(wrong)[:300] or "each at its own size, none at a neighbour's")
        util = [labels.get("container") for n, labels, _ in self.scrape() or ()
                if n == "gpu_swarm_task_utilization_percent"]
        check("every sharer's utilization series (NVML's per-process samples) is its own, once", sorted(util) ==
              sorted(c[:12] for c in logs) or not util, f"{len(util)} series" + ("" if util else ": NVML gave no "
                                                                                 "per-process samples on this GPU"))
        rss = next((v for n, _, v in self.scrape() or () if n == "process_resident_memory_bytes"), 0) / 2**20
        check("the exporter's RSS with real NVML and every sharer", 0 < rss <= 60, f"{rss:.1f} MiB")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


