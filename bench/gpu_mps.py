#!/usr/bin/env python3
"""MPS sharing and the guard's ledger on real NVIDIA GPUs (one or more), with the project's own node software.

    python3 bench/gpu_mps.py --out DIR [--slots 4] [--start-runs 15]     # as root
    bash bench/gpu_session.sh 'mps:200=bench/gpu_mps.py'                # on a bare GPU machine, with .kit
    python3 bench/gpu_mps.py --smoke [--gpus 2]     # no GPU: stand-in GPUs (bench/gpu_standins.py), as root

Needs root, an NVIDIA GPU and its driver (nvidia-smi, nvidia-cuda-mps-control), Docker Engine
>= 25.0.3 and nvidia-container-toolkit >= 1.19 on PATH, and a built bench/cuda_probe.c
(--cuda-probe, else $CUDA_PROBE as bench/gpu_session.sh sets it). It starts an engine of its
own (data under /var/lib/gpu-swarm-mps), a one-node swarm, and writes the guard's settings where
a node has them (/etc/gpu-swarm/runtime.env, put back at the end), so that daemon.json names the
guard without runtimeArgs, as on a node. Swarm chooses which GPU or slot a task gets, so every
check is about what a task got against what swarm gave it (its DOCKER_RESOURCE_* variable), never
about a GPU's index: the same checks hold on 1, 2 or 4 GPUs.
1. Whole GPU (compute mode Default): a service that reserved a GPU holds it; a service that
   reserved nothing but sets DOCKER_RESOURCE_NVIDIA-GPU=<the held UUID> does not start, and the
   guard's message names the holder (the bug seen on an H100); once the holder is gone the same
   service gets the free GPU (README "Isolation": the guard cannot tell its variable from
   swarm's); a task that reserved nothing sees no GPU. Then the guard's cost, its server
   running as gpu-swarm-guard.service runs it on a node: --start-runs interleaved `docker run
   --rm` each, guard against nvidia-container-runtime alone, with one GPU and with none; and
   bench/guard_cost.py per OCI call on this machine (with and without the server).
2. MPS (--slots K): node/gpu-swarm-mps start (what gpu-swarm-mps.service runs, with node.env's
   slots), whose daemons' ceiling must be the share the agent gives the guard; the agent with
   --sharing-mode mps, the engine restarted. K slot tasks per GPU (every slot) allocate 1 to 4
   times --mib each (by their slot in the service) through CUDA at once, each on its slot's GPU,
   with that GPU's MPS pipe and its share as its limit; the node's exporter (real NVML) names each
   one's memory with its own service, task, container and slot, and stays within 60 MiB RSS. On a
   freed slot, one task at a time tries to get more than its share: asking for it, raising its
   limit to 200G, re-setting it, unsetting it, a child started with another environment, leaving
   MPS; each fails while the others keep running and keep their memory. A task's two CUDA
   processes get a ceiling each (what MPS limits is a process: README). A task gets almost its
   whole share; a task with no reservation sees no GPU and no MPS pipe; one that names a held
   slot, or mounts the MPS directory, does not start. Last, a task that brings nvidia-cuda-mps-control
   and sends set_device_pinned_mem_limit <server> 0 200G through its socket (the relay's,
   node/mps_relay.py) is refused: every server keeps its ceiling, and the task gets no more.
   node/gpu-swarm-mps stop puts every GPU back in compute mode Default.
It prints a table of every check, writes results.json, logs and nvidia-smi evidence to --out,
and exits 1 when a check fails.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
import gpu_e2e as e2e  # noqa: E402  (its guard server step)
import gpu_standins  # noqa: E402  (--smoke)
from swarm import formation  # noqa: E402  (pure Python)

sys.path.insert(0, str(REPO / "node"))
import guard_files  # noqa: E402  (the guard's own test of an MPS daemon)
from swarm.node_contract import GPU_SHARING_LABEL, MPS_DIR, MPS_RELAY_LOG, RUNTIME_ENV_PATH  # noqa: E402

KIND, SHARED_KIND = "NVIDIA-GPU", "NVIDIA-GPU-SHARED"
ROOT, RUN = Path("/var/lib/gpu-swarm-mps"), Path("/run/gpu-swarm-mps-bench")
SOCK = f"unix://{RUN}/docker.sock"
IMAGE = "nvidia/cuda:12.6.3-base-ubuntu24.04"  # the stand-in (bench/cuda_standin.sh), with cuda-probe
UUID = re.compile(r"UUID: (GPU-[0-9a-f-]{36})")
check = e2e.check  # one table of checks, printed by e2e.print_results


def run(cmd: list[str], *, check_rc: bool = True, env: dict | None = None, timeout: float = 120,
        input: str | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, input=input)
    if check_rc and proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)[:200]} failed ({proc.returncode}): {(proc.stderr or proc.stdout)[-600:]}")
    return proc


def engine_env() -> dict:
    return {**os.environ, "DOCKER_HOST": SOCK}


def docker(*args: str, **kw) -> subprocess.CompletedProcess:
    return run(["docker", *args], env=engine_env(), **kw)


wait = e2e.wait  # one polling loop for the benches


def smi(*query: str) -> str:
    return run(["nvidia-smi", *query]).stdout


def agent(out: Path, name: str, *extra: str) -> dict:
    cmd = [sys.executable, str(REPO / "node" / "gpu_agent.py"), "--json", "--daemon-json", str(ROOT / "daemon.json"),
           "--runtime-config", RUNTIME_ENV_PATH, "--guard", str(REPO / "node" / "gpu-swarm-runtime"),
           "--runtime-delegate", shutil.which("nvidia-container-runtime") or "/usr/bin/nvidia-container-runtime",
           *extra]
    report = json.loads(run(cmd).stdout)
    (out / f"agent-{name}.json").write_text(json.dumps(report, indent=2))
    shutil.copy(ROOT / "daemon.json", out / f"daemon-{name}.json")
    shutil.copy(RUNTIME_ENV_PATH, out / f"runtime-{name}.env")
    return report


class Engine:
    """This bench's own dockerd (and the containerd it starts), as a node runs it."""

    def __init__(self, out: Path):
        self.out, self.proc = out, None

    def start(self) -> None:
        RUN.mkdir(parents=True, exist_ok=True)
        cmd = ["dockerd", "--config-file", str(ROOT / "daemon.json"), "--data-root", str(ROOT / "docker"),
               "--exec-root", str(RUN / "exec"), "--pidfile", str(RUN / "dockerd.pid"), "-H", SOCK,
               "--iptables=false", "--ip6tables=false"]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=open(self.out / "dockerd.log", "ab"),
                                     stderr=subprocess.STDOUT, env={**engine_env(),
                                                                    "DOCKER_SERVICE_PREFER_OFFLINE_IMAGE": "1"},
                                     start_new_session=True)
        wait(lambda: docker("version", check_rc=False).returncode == 0, 60, "dockerd to answer")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def state_of(service: str) -> list[str]:
    return docker("service", "ps", "--no-trunc", "--format", "{{.CurrentState}} {{.Error}}", service,
                  check_rc=False).stdout.splitlines()


def job(name: str, command: str, *extra: str, timeout: float = 60) -> str:
    """A one-shot job; its final state line and log."""
    docker("service", "create", "--detach", "--mode", "replicated-job", "--restart-condition", "none", "--name", name,
           *extra, IMAGE, "sh", "-c", command)
    try:
        state = wait(lambda: next((s for s in state_of(name) if s.startswith(("Complete", "Failed", "Rejected"))),
                                  None), timeout, name)
        logs = ""
        for _ in range(10):  # a task's last lines reach the service's log a moment after it ends
            logs = docker("service", "logs", "--raw", name, check_rc=False)
            logs = logs.stdout + logs.stderr
            if logs.strip() or state.startswith("Rejected"):
                break
            time.sleep(0.5)
        return state + "\n" + logs
    finally:
        docker("service", "rm", name, check_rc=False)


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
    return e2e.sample_starts(docker, IMAGE, variants, runs)


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


def start_guard_server(out: Path) -> subprocess.Popen:
    """The guard's server, where the agent pointed the runtime (the node's own path)."""
    proc = e2e.start_guard_server(out, Path(RUNTIME_ENV_PATH))
    check("the guard's server answers the runtime's creates", proc.poll() is None, str(Path(RUNTIME_ENV_PATH)))
    return proc


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
                                      "--docker-socket", str(RUN / "docker.sock"), "--daemon-json",
                                      str(ROOT / "daemon.json")], stdout=self.log, stderr=subprocess.STDOUT)
        wait(self.scrape, 30, "the exporter to serve")

    def scrape(self) -> list[tuple[str, dict, float]] | None:
        try:
            text = urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=10).read().decode()
        except OSError:
            return None
        (self.out / "scrape-last.txt").write_text(text)
        found = []
        for line in text.splitlines():
            match = re.match(r"^([a-zA-Z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)$", line)
            if match:
                found.append((match[1], dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', match[2] or "")),
                              float(match[3])))
        return found

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


def time_left() -> float:
    ends = os.environ.get("GPU_SESSION_ENDS_AT")
    return float(ends) - time.time() if ends else float("inf")


def whole_gpu(out: Path, gpus: list[str], start_runs: int, cost_runs: int) -> None:
    docker("service", "create", "--detach", "--name", "holder", "--generic-resource", f"{KIND}=1", IMAGE,
           "sleep", "3600")
    holder = next(iter(wait(lambda: containers("holder"), 60, "the holder to run")))
    gpu = given(holder, KIND)  # whichever GPU swarm chose
    check("the holder got one of the machine's GPUs", gpu in gpus, f"swarm gave it {gpu or 'nothing'}")
    log = job("names-held", "nvidia-smi -L", "--env", f"DOCKER_RESOURCE_{KIND}={gpu}")
    (out / "names-held-gpu.log").write_text(log)
    check("a service naming a held GPU without a reservation does not start",
          log.startswith(("Failed", "Rejected")) and f"GPU {gpu} is held by container" in log, log.splitlines()[0][:200])
    log = job("nores", "nvidia-smi -L 2>&1; ls /dev | grep -cE '^nvidia[0-9]+$' || true")
    (out / "no-reservation-whole.log").write_text(log)
    check("a task that reserved nothing sees no GPU", log.startswith("Complete") and not UUID.search(log),
          " | ".join(log.splitlines()[1:3]))
    gone("holder")
    log = job("names-free", "nvidia-smi -L", "--env", f"DOCKER_RESOURCE_{KIND}={gpu}")
    (out / "names-free-gpu.log").write_text(log)
    check("a service naming a free GPU gets it (documented: held in the ledger while it runs)",
          log.startswith("Complete") and gpu in log, log.splitlines()[0][:120])

    # Four variants of start_runs starts (about 0.7 s each on an H100), then guard_cost.py's 100 runs.
    if time_left() < 40 + 4 * start_runs:
        check("guard's cost per container start", False, f"not measured: {time_left():.0f} s left")
        return
    one = ["--env", f"DOCKER_RESOURCE_{KIND}={gpu}"]
    samples = start_times({"guard, one GPU": one, "nvidia alone, one GPU": ["--runtime", "nvidia", *one],
                           "guard, no GPU": [], "nvidia alone, no GPU": ["--runtime", "nvidia"]}, start_runs)
    (out / "start-times.json").write_text(json.dumps(samples, indent=2))
    guard, alone = samples["guard, one GPU"], samples["nvidia alone, one GPU"]
    cost, low, high = paired_cost(guard, alone)
    check(f"guard's cost per container start, one GPU: no more than 15 ms, unless the {start_runs} interleaved "
          "pairs' 95 % interval lies above it", low <= 15,
          f"median of the pairs' differences {cost:+.1f} ms, 95 % interval [{low:+.1f}, {high:+.1f}] ms "
          f"({statistics.median(guard) * 1000:.0f} vs {statistics.median(alone) * 1000:.0f} ms); per OCI call: "
          "guard-cost.txt")
    guard, alone = (statistics.median(samples[f"{who}, no GPU"]) * 1000 for who in ("guard", "nvidia alone"))
    print(f"evidence: a no-GPU start, guard {guard:.0f} ms vs nvidia alone {alone:.0f} ms: alone, the toolkit sets "
          "up every GPU for the image's NVIDIA_VISIBLE_DEVICES=all, which the guard makes void", flush=True)
    cost = run([sys.executable, str(REPO / "bench" / "guard_cost.py"), "--runs", str(cost_runs)], check_rc=False,
               timeout=240)
    (out / "guard-cost.txt").write_text(cost.stdout + cost.stderr)
    check("bench/guard_cost.py on this machine", cost.returncode == 0, cost.stdout.strip().splitlines()[-1][:160]
          if cost.stdout.strip() else cost.stderr[-200:])


def mps(out: Path, gpus: list[str], slots: int, mib: int, engine: Engine) -> None:
    # The unit loads node.env, where the pool's slots are; the daemons' ceilings come from them.
    started = run(["bash", str(REPO / "node" / "gpu-swarm-mps"), "start"], check_rc=False, timeout=120,
                  env={**os.environ, "GPU_SWARM_SLOTS_PER_GPU": str(slots)})
    (out / "gpu-swarm-mps-start.log").write_text(started.stdout + started.stderr)
    mode = modes(gpus)
    daemons = [g for g in gpus if guard_files.mps_daemon_alive(MPS_DIR, g)]  # as the guard sees them
    check("gpu-swarm-mps start: every GPU in Exclusive_Process, with an MPS daemon and server",
          started.returncode == 0 and set(mode.values()) == {"Exclusive_Process"} and len(daemons) == len(gpus),
          f"{len(daemons)} of {len(gpus)} daemons; modes {sorted(set(mode.values()))}; "
          f"memory used by the MPS servers alone: {[used(g) for g in gpus]} MiB")
    if started.returncode:
        return
    report = agent(out, "mps", "--slots-per-gpu", str(slots), "--shared-kind", SHARED_KIND, "--sharing-mode", "mps")
    settings = dict(line.split("=", 1) for line in Path(RUNTIME_ENV_PATH).read_text().splitlines()
                    if "=" in line and not line.startswith("#"))
    share = int(settings["MPS_MEMORY_MIB"])
    per_gpu = {g: sum(r.startswith(f"{SHARED_KIND}={g}-s") for r in report["resources"]) for g in gpus}
    ceilings = set(re.findall(r"each client at most (\d+) MiB", started.stdout))
    check("every GPU's MPS daemon has the slot's share as its ceiling, the share the guard gives a task",
          ceilings == {str(share)} and started.stdout.count("each client at most") == len(gpus),
          f"daemons' ceilings {sorted(ceilings)} MiB, the guard's share {share} MiB")
    check("the agent advertises every GPU's MPS slots", report["labels"].get(GPU_SHARING_LABEL) == "mps" and
          set(per_gpu.values()) == {slots} and len(report["resources"]) == slots * len(gpus),
          f"{len(report['resources'])} slots, {sorted(set(per_gpu.values()))} per GPU; share {share} MiB, "
          f"threads {settings['MPS_THREAD_PERCENT']} %")
    engine.stop()
    engine.start()  # dockerd reads node-generic-resources only at start
    wait(lambda: SHARED_KIND in docker("node", "inspect", "self", "--format",
                                       "{{json .Description.Resources.GenericResources}}").stdout, 30, "the slots")

    slot = ["--generic-resource", f"{SHARED_KIND}=1"]
    every = slots * len(gpus)
    # Sizes of 1 to 4 times --mib, by the task's slot in the service (a template swarm fills in), so
    # that a neighbour's memory under a task's name would show.
    docker("service", "create", "--detach", "--name", "steady", "--replicas", str(every), *slot,
           "--env", "SIZE={{.Task.Slot}}", IMAGE, "sh", "-c", f"exec cuda-probe $(({mib} * (1 + SIZE % 4)))")
    logs = wait(lambda: (lambda c: c if len(c) == every and all("allocated" in v for v in c.values()) else None)(
        containers("steady")), 120, f"{every} slot tasks allocating")
    sizes = {c: mib * (1 + int(dict(e.split("=", 1) for e in json.loads(docker(
        "inspect", "--format", "{{json .Config.Env}}", c).stdout) if "=" in e)["SIZE"]) % 4) for c in logs}
    (out / "steady.log").write_text(json.dumps(logs, indent=2))
    (out / "compute-apps-steady.csv").write_text(apps())
    wrong, wrong_env, on_gpu = [], [], {g: 0 for g in gpus}
    for container, log in logs.items():
        held = given(container, SHARED_KIND)
        gpu = gpu_of_slot(held)
        on_gpu[gpu] = on_gpu.get(gpu, 0) + 1
        if UUID.findall(log) != [gpu] or f"allocated {sizes[container]} MiB (UUID: {gpu})" not in log:
            wrong.append(f"{container[:12]} holds {held[-44:] or 'no slot'}, CUDA saw {UUID.findall(log)}")
        env = task_env(container)  # as the task runs it (docker inspect shows the environment before the guard)
        pipe = f"{MPS_DIR}/{gpu}/pipe"
        listed = docker("exec", container, "ls", pipe, check_rc=False).stdout.split()
        # the relay's folder: its socket, never the daemon's own (control_privileged, its pid file)
        if not (env.get("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT") == f"0={share}M" and
                env.get("CUDA_MPS_PIPE_DIRECTORY") == pipe and "control" in listed and
                not {"control_privileged", "nvidia-cuda-mps-control.pid"} & set(listed)):
            wrong_env.append(f"{container[:12]} on {gpu}: " + ", ".join(
                f"{k}={v}" for k, v in env.items() if k.startswith("CUDA_MPS_")) + f"; {pipe} holds {listed}")
    check(f"{every} MPS slot tasks ({slots} per GPU) allocate {mib} to {4 * mib} MiB each at once, each on its "
          "slot's GPU",
          not wrong and set(on_gpu.values()) == {slots}, "; ".join(wrong)[:300] or
          f"tasks per GPU {sorted(on_gpu.values())}; GPU memory used {[used(g) for g in gpus]} MiB")
    check("each gets its own GPU's MPS socket (the relay's folder, mounted by the guard) and its share as a limit",
          not wrong_env, "; ".join(wrong_env)[:300] or
          f"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0={share}M; where its pipe goes, the relay's socket of its slot's GPU")

    exporter = Exporter(out)
    try:
        exporter.check_sharers(logs, sizes, mib)
        hostile(out, share, slot, gpus, exporter)
    finally:
        exporter.stop()
    gone("steady")


def hostile(out: Path, share: int, slot: list[str], gpus: list[str], exporter: "Exporter") -> None:
    """What a slot task may do to its own environment, on a freed slot beside the others, and what it gets."""
    every = len(containers("steady"))
    docker("service", "scale", "--detach", f"steady={every - 1}")
    wait(lambda: len(containers("steady")) == every - 1, 60, "one slot freed")
    time.sleep(2)
    kept, used_before = containers("steady"), {g: used(g) for g in gpus}
    over = share + 1024
    # Each a slot task of its own on the freed slot: what it does to the environment the guard gave it.
    # The daemon's ceiling holds for every one; leaving MPS finds the GPU held by the MPS server alone.
    tries = [("greedy", "asks for more than its share", f"cuda-probe {over}", "CUDA error 2"),
             ("raise", "raises its limit to 200G", f"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=200G cuda-probe {over}",
              "CUDA error 2"),
             ("reset", "re-sets its limit to what it wants", f"export CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0={over}M; "
              f"cuda-probe {over}", "CUDA error 2"),
             ("unset", "unsets its limit", f"unset CUDA_MPS_PINNED_DEVICE_MEM_LIMIT; cuda-probe {over}",
              "CUDA error 2"),
             ("child", "starts a child with another environment (env -i, its pipe only, threads 100)",
              f"env -i PATH=$PATH CUDA_MPS_PIPE_DIRECTORY=$CUDA_MPS_PIPE_DIRECTORY "
              f"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=100 cuda-probe {over}", "CUDA error 2"),
             ("leave", "leaves MPS (unsets its pipe)", "unset CUDA_MPS_PIPE_DIRECTORY; cuda-probe 64", "CUDA error")]
    for name, what, command, said in tries:
        log = job(name, command, *slot)
        (out / f"hostile-{name}.log").write_text(log)
        got = " | ".join(line for line in log.splitlines() if "cuda-probe" in line or "allocated" in line or
                         line.startswith(("Failed", "Complete")))
        check(f"a slot task that {what} gets no more than its {share} MiB", log.startswith("Failed") and
              said in log and "allocated" not in log, got[:200])
    time.sleep(2)
    now, used_after = containers("steady"), {g: used(g) for g in gpus}
    (out / "compute-apps-after-hostile.csv").write_text(apps())
    check("the others keep running and keep their memory through all of it", set(now) == set(kept) and
          all(used_after[g] >= used_before[g] - 64 for g in gpus),
          f"{len(now)} still running; GPU memory used {list(used_before.values())} -> {list(used_after.values())} MiB")
    two_processes(out, share, slot, exporter)
    big = share - 2048
    docker("service", "create", "--detach", "--name", "big", *slot, IMAGE, "cuda-probe", str(big))
    try:
        said = wait(lambda: next((v for v in containers("big").values() if "allocated" in v or "error" in v), None),
                    60, "the big task to allocate")
    except RuntimeError as e:
        said = str(e)
    check(f"a task gets almost its whole share ({big} of {share} MiB)", "allocated" in said, said.strip()[-120:])
    gone("big")

    log = job("nores-mps", f"nvidia-smi -L 2>&1; ls {MPS_DIR} 2>&1; cuda-probe 64; echo exit $?")
    (out / "no-reservation-mps.log").write_text(log)
    check("a task that reserved nothing sees no GPU and no MPS pipe", log.startswith("Complete") and
          not UUID.search(log) and "exit 2" in log, " | ".join(log.splitlines()[1:4])[:200])
    held_slot = given(next(iter(now)), SHARED_KIND)
    log = job("names-slot", "nvidia-smi -L", "--env", f"DOCKER_RESOURCE_{SHARED_KIND}={held_slot}")
    check("a service naming a held slot without a reservation does not start",
          log.startswith(("Failed", "Rejected")) and f"slot {held_slot} is held by container" in log,
          log.splitlines()[0][:200])
    log = job("mounts-mps", "ls /mps", "--mount", f"type=bind,source={MPS_DIR},target=/mps")
    check("a service that mounts the MPS pipes itself does not start", log.startswith(("Failed", "Rejected")) and
          "where the node's MPS daemons listen" in log, log.splitlines()[0][:200])
    control_commands(out, share, over, slot, gpus)


def two_processes(out: Path, share: int, slot: list[str], exporter: "Exporter") -> None:
    """MPS limits each client process: two CUDA processes in one task get a ceiling each (README says so)."""
    each = share * 3 // 4
    docker("service", "create", "--detach", "--name", "twice", *slot, IMAGE, "sh", "-c",
           f"cuda-probe {each} & exec cuda-probe {each}")
    try:
        said = wait(lambda: next((v for v in containers("twice").values() if v.count("allocated") == 2 or
                                  "error" in v), None), 90, "the two processes to allocate")
        container = next(iter(containers("twice")), "")
        try:  # the driver reports a process's memory a moment after it allocated
            memory = wait(lambda: (lambda m: m if m and m >= 2 * each else None)(
                exporter.task_memory_mib(container[:12])), 30, "the task's two processes in the exporter")
        except RuntimeError:
            memory = exporter.task_memory_mib(container[:12])
    except RuntimeError as e:
        said, memory = str(e), None
    (out / "two-processes.log").write_text(said)
    check(f"a slot task's two CUDA processes get {share} MiB each (documented: MPS limits processes, not tasks); "
          "the exporter shows the task's total", said.count("allocated") == 2 and memory is not None and
          memory >= 2 * each, f"{said.count('allocated')} of 2 allocated {each} MiB; the task's memory in the "
          f"exporter {memory} MiB")
    gone("twice")


def mps_control(gpu: str, command: str) -> str:
    """One command to a GPU's control daemon on the host, through its own pipe (as gpu-swarm-mps does)."""
    done = subprocess.run(["nvidia-cuda-mps-control"], input=command + "\n", capture_output=True, text=True,
                          timeout=20, env={**os.environ, "CUDA_MPS_PIPE_DIRECTORY": f"{MPS_DIR}/{gpu}/pipe"})
    return done.stdout.strip()


def control_commands(out: Path, share: int, over: int, slot: list[str], gpus: list[str]) -> None:
    """A slot task that brings nvidia-cuda-mps-control and tells its GPU's daemon a higher ceiling, the hole
    found on 2xH100 (bench/results/gpu-session-2xH100-sharing/): now through the socket the guard gives it, the
    relay's (node/mps_relay.py). Given every server's pid, as a task that guessed them; then it allocates past
    its share with no limit of its own. Run last: had the daemon obeyed, every later client would have the
    raised ceiling. What the daemons hold is read on the host, before and after."""
    control = shutil.which("nvidia-cuda-mps-control")
    servers = {g: mps_control(g, "get_server_list").split() for g in gpus}

    def limits() -> dict[str, list[str]]:
        return {g: [mps_control(g, f"get_device_pinned_mem_limit {s} 0") for s in servers[g]] for g in gpus}
    before = limits()
    own = "/usr/local/bin/own-mps-control"  # the task's own copy; the toolkit may mount one too (utility)
    pids = " ".join(p for g in gpus for p in servers[g])
    own_cmd = f"timeout 10 {own}"  # refused mid-way, it might wait for an answer: it has 10 s
    attack = (f"ls -la $CUDA_MPS_PIPE_DIRECTORY; touch $CUDA_MPS_PIPE_DIRECTORY/x 2>&1; "
              f"echo get_server_list | {own_cmd}; echo \"list: rc $?\"; "
              f"echo set_default_device_pinned_mem_limit 0 200G | {own_cmd}; echo \"default: rc $?\"; "
              f"for s in {pids}; do echo set_device_pinned_mem_limit $s 0 200G | {own_cmd}; "
              "echo \"server $s: rc $?\"; "
              # a probe that got the memory holds it until stopped: it has 5 s to say which
              f"done; unset CUDA_MPS_PINNED_DEVICE_MEM_LIMIT; cuda-probe {over} & p=$!; sleep 5; kill $p; wait $p; "
              "echo \"cuda-probe: exit $?\"")
    try:
        log = job("control", attack, *slot, "--mount", f"type=bind,source={control},target={own},readonly",
                  timeout=90)
    except RuntimeError as e:
        log = f"no answer: {e}"
    (out / "control-commands.log").write_text(log)
    after = limits()
    relay_log = Path(MPS_DIR, MPS_RELAY_LOG)
    refused = relay_log.read_text().count("a control command") if relay_log.exists() else 0
    probe = next((line for line in log.splitlines() if "allocated" in line or "CUDA error" in line), "no probe line")
    check(f"a slot task that sends set_device_pinned_mem_limit <server> 0 200G through its MPS socket is refused, "
          f"every server keeps its ceiling, and the task gets no more than its {share} MiB",
          before == after and all(before.values()) and "allocated" not in log and "CUDA error 2" in log and
          "Read-only file system" in log,
          f"servers' limits {before} -> {after}; the relay refused {refused} control connection(s); {probe}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="logs and JSON results go here (required but with --smoke)")
    parser.add_argument("--slots", type=int, default=4, help="MPS slots per GPU (default %(default)s)")
    parser.add_argument("--mib", type=int, default=1024, help="what each steady slot task allocates")
    parser.add_argument("--start-runs", type=int, default=15, help="interleaved starts per variant")
    parser.add_argument("--cuda-probe", default=os.environ.get("CUDA_PROBE"), help="a built bench/cuda_probe.c")
    parser.add_argument("--guard-cost-runs", type=int, default=100, help="bench/guard_cost.py's --runs")
    parser.add_argument("--smoke", action="store_true", help=gpu_standins.SMOKE_HELP)
    parser.add_argument("--gpus", type=int, default=2, help="stand-in GPUs for --smoke (default %(default)s)")
    args = parser.parse_args()
    if args.smoke:
        return gpu_standins.smoke("gpu_mps.py", args.gpus, "--start-runs", "1", "--guard-cost-runs", "3",
                                  "--slots", "2", "--mib", "512", out=args.out)
    if not args.out:
        parser.error("--out is required")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        sys.exit("run as root: it starts an engine, MPS daemons and writes the guard's settings")
    if not args.cuda_probe:
        sys.exit("no cuda-probe: give --cuda-probe (bench/gpu_session.sh sets $CUDA_PROBE)")
    missing = [t for t in ("nvidia-smi", "nvidia-cuda-mps-control", "dockerd", "nvidia-container-runtime")
               if not shutil.which(t)]
    if missing:
        sys.exit(f"not on PATH: {', '.join(missing)}")
    gpus = UUID.findall(smi("-L"))
    if not gpus:
        sys.exit("nvidia-smi -L lists no GPU")
    print(f"{len(gpus)} GPU(s): {', '.join(gpus)}", flush=True)
    saved = Path(RUNTIME_ENV_PATH).read_bytes() if Path(RUNTIME_ENV_PATH).exists() else None
    made_dir = not Path(RUNTIME_ENV_PATH).parent.exists()
    shutil.rmtree(ROOT, ignore_errors=True)
    ROOT.mkdir(parents=True)
    Path(RUNTIME_ENV_PATH).parent.mkdir(parents=True, exist_ok=True)
    engine, server = Engine(out), None
    try:
        report = agent(out, "whole")
        daemon = json.loads((ROOT / "daemon.json").read_text())
        check("the agent advertises every GPU and makes the guard the default runtime, as on a node",
              sorted(report["resources"]) == sorted(f"{KIND}={g}" for g in gpus) and daemon["runtimes"]["gpu-swarm"] == {
                  "path": str(REPO / "node" / "gpu-swarm-runtime")}, "no runtimeArgs: no /bin/sh wrapper")
        server = start_guard_server(out)
        engine.start()
        run(["bash", str(REPO / "bench" / "cuda_standin.sh"), IMAGE, args.cuda_probe], env=engine_env())
        addr = run(["hostname", "-I"]).stdout.split()[0]
        run(["bash", "-c", formation.init_swarm(addr)], env=engine_env(), input="")
        whole_gpu(out, gpus, args.start_runs, args.guard_cost_runs)
        mps(out, gpus, args.slots, args.mib, engine)
    except Exception as e:  # a broken step is a failed check, with its reason in the table
        check("the run itself", False, f"{type(e).__name__}: {e}"[:400])
    finally:
        for name in ("holder", "steady", "big", "twice"):
            docker("service", "rm", name, check_rc=False)
        docker("swarm", "leave", "--force", check_rc=False)
        engine.stop()
        if server:
            server.kill()
            server.wait()
        stopped = run(["bash", str(REPO / "node" / "gpu-swarm-mps"), "stop"], check_rc=False, timeout=90)
        for log in Path(MPS_DIR).glob("*/log/*.log"):
            shutil.copy(log, out / f"mps-{log.parent.parent.name[:12]}-{log.name}")
        if Path(MPS_DIR, MPS_RELAY_LOG).exists():
            shutil.copy(Path(MPS_DIR, MPS_RELAY_LOG), out / "mps-relay.log")
        mode = modes(gpus)
        check("gpu-swarm-mps stop: every GPU back in compute mode Default",
              stopped.returncode == 0 and set(mode.values()) == {"Default"},
              f"{sorted(set(mode.values()))}; {stopped.stdout.strip()[-120:]}")
        if saved is None:
            Path(RUNTIME_ENV_PATH).unlink(missing_ok=True)
            if made_dir:
                Path(RUNTIME_ENV_PATH).parent.rmdir()
        else:
            Path(RUNTIME_ENV_PATH).write_bytes(saved)
    return e2e.print_results(out)


if __name__ == "__main__":
    sys.exit(main())
