#!/usr/bin/env python3
"""The GPU metrics exporter on a real GPU: a reserving task allocates memory, and its GPU's series say so, by name.

    python3 bench/gpu_metrics.py --out DIR [--mib 2048] [--cuda-probe PATH]     # as root; one GPU is enough
    bash bench/gpu_session.sh 'metrics:150=bench/gpu_metrics.py'               # on a bare GPU machine, with .kit
    python3 bench/gpu_metrics.py --smoke [--gpus 2]    # no GPU: stand-in GPUs (bench/gpu_standins.py), as root

Needs what bench/gpu_e2e.py needs, and sets up the same way (bench/gpu_bench.py): root, an NVIDIA
GPU and its driver, Docker Engine >= 25.0.3 and nvidia-container-toolkit >= 1.19 on PATH, python3
with nvidia-ml-py, PyYAML and prometheus_client (bench/gpu_session.sh's venv has all three), and
a built bench/cuda_probe.c (--cuda-probe, else $CUDA_PROBE as gpu_session.sh sets it, else built
with cc). It runs the agent into a daemon.json of its own, starts its own engine (data under
/var/lib/gpu-swarm-metrics), builds the CUDA stand-in image with cuda-probe, makes a one-node
swarm (swarm/formation.py), and then:
1. starts the real exporter (node/gpu_metrics.py, real NVML) on a free local port and scrapes it;
2. creates a service that reserves one GPU and runs `cuda-probe MIB` (a CUDA context, MIB MiB
   allocated and touched, held until it is stopped);
3. scrapes again once the probe says it allocated, and checks that the series of the GPU swarm
   gave the task carry the service's name, task and container; that the GPU's memory rose by at
   least MIB; that the task's own memory (NVML's compute processes -> cgroup -> container) is at
   least MIB; that no other GPU's series name the task; that the GPU's other readings are there;
   and times the exporter's scrape. Swarm picks the GPU: any number of GPUs will do.
4. time-slicing (--slots K): the agent advertises K slots per GPU, the engine restarts, and a task
   holds every slot of every GPU, each allocating 1 to 4 times --slots-mib by its slot in the
   service; each sharer's memory series must carry its own service, task, container and slot and
   its own size (never a neighbour's), its utilization series (NVML's per-process samples) its
   own, and the exporter's RSS stay within 60 MiB. (MPS sharers: bench/gpu_mps.py.)
It writes results.json (every check), figures.json, scrape-before.txt, scrape-after.txt,
exporter.log, dockerd.log and the agent's report to --out, prints a table, and exits 1 when a
check fails. It removes its service, stops the exporter and its engine.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
import gpu_standins  # noqa: E402  (--smoke)
from gpu_bench import (KIND, PROBE_IMAGE, SHARED_KIND, Engine, agent, check, gpus_of_host,  # noqa: E402
                       print_results, run, samples, wait)
from node import contract  # noqa: E402  (cost.env's keys, as the program writes them)
from swarm import formation  # noqa: E402  (pure Python: no Pulumi needed here)

# An engine of its own, beside (never instead of) gpu_e2e.py's: its own data and socket.
ENGINE = Engine("gpu-swarm-metrics")
docker = ENGINE.docker
SERVICE = "gpu-metrics-probe"
SHARERS = "gpu-metrics-sharers"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def value(text: str, name: str, **labels) -> tuple[dict, float] | None:
    for metric, got, v in samples(text):
        if metric == name and all(got.get(k) == want for k, want in labels.items()):
            return got, v
    return None


def time_sliced(out: Path, host: list[str], slots: int, mib: int, scrape) -> None:
    """Time-slicing: every slot of every GPU held by a task of its own size (1 to 4 times mib, by its
    slot in the service); each sharer's memory and utilization series must carry its own service,
    task, container and slot, and its own size, never a neighbour's."""
    report = agent(ENGINE, out, slots)
    check("the agent advertises every GPU's time-slicing slots", len(report["resources"]) == len(host) * slots,
          f"{len(report['resources'])} slots")
    ENGINE.restart()
    wait(lambda: SHARED_KIND in docker("node", "inspect", "self", "--format",
                                           "{{json .Description.Resources.GenericResources}}").stdout, 60, "the slots")
    every = len(host) * slots
    docker("service", "create", "--detach", "--name", SHARERS, "--replicas", str(every), "--generic-resource",
           f"{SHARED_KIND}=1", "--env", "SIZE={{.Task.Slot}}", PROBE_IMAGE, "sh", "-c",
           f"exec cuda-probe $(({mib} * (1 + SIZE % 4)))")

    def running():
        ids = docker("ps", "-q", "--no-trunc", "--filter",
                     f"label=com.docker.swarm.service.name={SHARERS}").stdout.split()
        logs = {c: docker("logs", c, check_rc=False).stdout for c in ids}
        return logs if len(logs) == every and all("allocated" in v for v in logs.values()) else None
    logs = wait(running, 120, f"{every} sharers allocating")
    own = {}
    for c in logs:
        env = dict(e.split("=", 1) for e in json.loads(docker("inspect", "--format", "{{json .Config.Env}}",
                                                              c).stdout) if "=" in e)
        own[c] = (env[f"DOCKER_RESOURCE_{SHARED_KIND}"], mib * (1 + int(env["SIZE"]) % 4))

    def named():
        text = scrape() or ""
        rows = {c: [(labels, v) for name, labels, v in samples(text) if name == "gpu_swarm_task_memory_used_bytes"
                    and labels.get("container") == c[:12]] for c in logs}
        return (text, rows) if all(len(r) == 1 and r[0][1] >= own[c][1] * 2**20 for c, r in rows.items()) else None
    try:
        text, rows = wait(named, 45, "every sharer's memory in the exporter's series")
    except RuntimeError:
        text = scrape() or ""
        rows = {c: [(labels, v) for name, labels, v in samples(text) if name == "gpu_swarm_task_memory_used_bytes"
                    and labels.get("container") == c[:12]] for c in logs}
    (out / "scrape-sharers.txt").write_text(text)
    wrong = []
    for c, found in rows.items():
        slot, size = own[c]
        labels, v = found[0] if len(found) == 1 else ({}, 0)
        if not (labels.get("slot") == slot and labels.get("gpu") == slot.rsplit("-s", 1)[0] and
                labels.get("service") == SHARERS and labels.get("task", "").startswith(f"{SHARERS}.") and
                size * 2**20 <= v < (size + mib) * 2**20):
            wrong.append(f"{c[:12]} ({size} MiB, {slot[-6:]}): {len(found)} series, {labels.get('slot', '')[-6:]} "
                         f"{v / 2**20:.0f} MiB")
    check(f"time-slicing: the exporter names every sharer's memory with its own service, task, container and slot "
          f"({every} sharers, {slots} per GPU, 4 sizes)", not wrong,
          "; ".join(wrong)[:300] or "each at its own size, none at a neighbour's")
    util = sorted(labels.get("container", "") for name, labels, _ in samples(text)
                  if name == "gpu_swarm_task_utilization_percent")
    check("time-slicing: each sharer's utilization series (NVML's per-process samples) is its own, once",
          util == sorted(c[:12] for c in logs) or not util,
          f"{len(util)} series" + ("" if util else ": NVML gave no per-process samples"))
    rss = (value(scrape() or "", "process_resident_memory_bytes") or ({}, 0))[1] / 2**20
    check(f"the exporter's RSS with real NVML and {every} sharers", 0 < rss <= 60, f"{rss:.1f} MiB")
    docker("service", "rm", SHARERS, check_rc=False)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="results go here (a folder; made if missing); required but with --smoke")
    parser.add_argument("--mib", type=int, default=2048, help="MiB the probe allocates (default %(default)s); "
                        "the time-slicing sharers 1 to 4 times --slots-mib")
    parser.add_argument("--slots", type=int, default=4, help="time-slicing slots per GPU (default %(default)s)")
    parser.add_argument("--slots-mib", type=int, default=1024, help="the smallest sharer's MiB (default %(default)s)")
    parser.add_argument("--cuda-probe", default=os.environ.get("CUDA_PROBE"),
                        help="a built bench/cuda_probe.c (default: $CUDA_PROBE, else build it with cc)")
    parser.add_argument("--smoke", action="store_true", help=gpu_standins.SMOKE_HELP)
    parser.add_argument("--gpus", type=int, default=2, help="stand-in GPUs for --smoke (default %(default)s)")
    args = parser.parse_args()
    if args.smoke:
        return gpu_standins.smoke("gpu_metrics.py", args.gpus, "--mib", "512", "--slots-mib", "256", out=args.out)
    if not args.out:
        parser.error("--out is required")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        sys.exit("run as root: it makes a swarm and reads every process's cgroup")
    made_swarm, exporter, log = False, None, None
    sock = str(ENGINE.run_dir / "docker.sock")
    try:
        host = gpus_of_host()
        ENGINE.clear()
        probe = args.cuda_probe or str(ENGINE.root / "cuda-probe")
        if not args.cuda_probe:
            run(["cc", "-O2", "-o", probe, str(REPO / "bench" / "cuda_probe.c"), "-ldl"])
        report = agent(ENGINE, out)
        check("the agent advertises every GPU", sorted(g["uuid"] for g in report["gpus"]) == sorted(host),
              f"{len(host)} GPU(s): {', '.join(host)}")
        ENGINE.start(out)
        ENGINE.build_images(out, probe)
        address = subprocess.run(["hostname", "-I"], capture_output=True, text=True).stdout.split()[0]
        ENGINE.script(formation.init_swarm(address))
        made_swarm = True
        advertised = docker("node", "inspect", "self", "--format",
                            "{{json .Description.Resources.GenericResources}}").stdout
        check("the engine advertises its GPUs to swarm", KIND in advertised, advertised.strip()[:200])

        # The node's price as the program writes it (to_node/software.py price_env): the exporter splits it
        # among the machine's GPUs, and gives a reserved GPU's share to the task holding it.
        gpu_count = max(len(host), 1)
        price = 12.5 * gpu_count
        cost_env = out / "cost.env"
        cost_env.write_text(f"{contract.PRICE_ENV}={price}\n{contract.PRICE_MARKET_ENV}=on-demand\n"
                            f"{contract.PRICE_INSTANCE_TYPE_ENV}=bench.{gpu_count}gpu\n"
                            f"{contract.PRICE_GPUS_ENV}={gpu_count}\n")
        port = free_port()
        log = open(out / "exporter.log", "w")
        exporter = subprocess.Popen([sys.executable, str(REPO / "node" / "gpu_metrics.py"), "--address", "127.0.0.1",
                                     "--port", str(port), "--kind", KIND, "--docker-socket", sock,
                                     "--daemon-json", str(ENGINE.root / "daemon.json"),
                                     "--cost-env", str(cost_env)], stdout=log,
                                    stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}/metrics"

        def scrape() -> str | None:
            try:
                return urllib.request.urlopen(url, timeout=10).read().decode()
            except OSError:
                return None
        before = wait(scrape, 30, "the exporter to serve")
        before = scrape()  # the first scrape started NVML; take a settled one
        (out / "scrape-before.txt").write_text(before)
        check("NVML answers the exporter", (value(before, "gpu_swarm_exporter_nvml_up") or ({}, 0))[1] == 1)
        gpus = {labels["gpu"]: v for _, labels, v in samples(before) if _ == "gpu_swarm_memory_used_bytes"}
        check("every GPU is reported, and up", gpus and all(
            (value(before, "gpu_swarm_gpu_up", gpu=g) or ({}, 0))[1] == 1 for g in gpus), f"{len(gpus)} GPU(s)")

        idle_before = {g: (value(before, "gpu_swarm_idle_cost_dollars_per_hour", gpu=g) or ({}, -1))[1] for g in gpus}
        check("cost: every GPU's share of the node's price is idle before any task", gpus and all(
            abs(v - price / gpu_count) < 1e-9 for v in idle_before.values()),
            f"${price:g}/h over {gpu_count} GPU(s): " + ", ".join(f"{v:g}" for v in idle_before.values()))
        docker("service", "create", "--detach", "--name", SERVICE, "--generic-resource", f"{KIND}=1",
               "--restart-condition", "none", PROBE_IMAGE, "cuda-probe", str(args.mib))
        started = time.monotonic()

        def allocated():
            ids = docker("service", "ps", "-q", "--no-trunc", "--filter", "desired-state=running", SERVICE).stdout.split()
            for task in json.loads(docker("inspect", *ids).stdout) if ids else []:
                cid = task["Status"].get("ContainerStatus", {}).get("ContainerID")
                if cid and "allocated" in docker("logs", cid, check_rc=False).stdout:
                    return task, cid
            return None
        task, container = wait(allocated, 120, f"the probe to allocate {args.mib} MiB")
        env = json.loads(docker("inspect", "--format", "{{json .Config.Env}}", container).stdout)
        gpu = next(e.split("=", 1)[1] for e in env if e.startswith(f"DOCKER_RESOURCE_{KIND}="))
        print(f"probe task {task['ID'][:12]} holds {gpu} and allocated after {time.monotonic() - started:.1f} s",
              flush=True)

        def grown():
            text = scrape()
            found = text and value(text, "gpu_swarm_task_memory_used_bytes", gpu=gpu, service=SERVICE)
            return text if found and found[1] >= args.mib * 2**20 else None
        try:
            after = wait(grown, 45, "the task's memory in the exporter's series")
        except RuntimeError:
            after = scrape() or ""
        (out / "scrape-after.txt").write_text(after)
        held = value(after, "gpu_swarm_memory_used_bytes", gpu=gpu)
        labels = held[0] if held else {}
        check("the GPU's series carry the task's service name", labels.get("service") == SERVICE,
              f"service={labels.get('service')!r} task={labels.get('task')!r} container={labels.get('container')!r}")
        check("... and its task and container", labels.get("task", "").startswith(f"{SERVICE}.1.")
              and container.startswith(labels.get("container") or "-"), f"container {container[:12]}")
        rise = (held[1] if held else 0) - gpus.get(gpu, 0)
        check(f"the GPU's memory rose by at least the {args.mib} MiB allocated", rise >= args.mib * 2**20,
              f"{gpus.get(gpu, 0) / 2**20:.0f} -> {(held[1] if held else 0) / 2**20:.0f} MiB (+{rise / 2**20:.0f})")
        own = value(after, "gpu_swarm_task_memory_used_bytes", gpu=gpu, service=SERVICE)
        check("the task's own memory (compute processes -> cgroup -> container) is at least what it allocated",
              bool(own) and own[1] >= args.mib * 2**20, f"{(own[1] if own else 0) / 2**20:.0f} MiB")
        others = sorted(set(gpus) - {gpu})
        theirs = [f"{labels.get('gpu')}: {labels.get('service')}" for metric, labels, _ in samples(after)
                  if labels.get("gpu") in others and labels.get("service") == SERVICE]
        check("no other GPU's series name the task", bool(gpus) and gpu in gpus and not theirs,
              "; ".join(theirs)[:200] or (f"{len(others)} other GPU(s) name no task of it" if others
                                          else "one GPU: no other to compare"))
        share = price / gpu_count
        task_cost = (value(after, "gpu_swarm_task_cost_dollars_per_hour", gpu=gpu, service=SERVICE) or ({}, -1))[1]
        idle_cost = (value(after, "gpu_swarm_idle_cost_dollars_per_hour", gpu=gpu) or ({}, -1))[1]
        node_cost = (value(after, "gpu_swarm_node_cost_dollars_per_hour") or ({}, -1))[1]
        check("cost: the task holding the GPU carries its whole share, the GPU none idle, the node its price",
              abs(task_cost - share) < 1e-9 and abs(idle_cost) < 1e-9 and abs(node_cost - price) < 1e-9,
              f"task ${task_cost:g}/h, idle ${idle_cost:g}/h, node ${node_cost:g}/h (share ${share:g}/h)")
        readings = [n for n in ("gpu_swarm_gpu_utilization_percent", "gpu_swarm_power_watts",
                                "gpu_swarm_temperature_celsius", "gpu_swarm_sm_clock_hertz",
                                "gpu_swarm_throttle_reasons") if value(after, n, gpu=gpu)]
        check("utilization, power, temperature, SM clock and throttle reasons are read", len(readings) == 5,
              ", ".join(readings))
        durations = []
        for _ in range(20):
            durations.append((value(scrape(), "gpu_swarm_exporter_scrape_duration_seconds") or ({}, 0))[1] * 1000)
        durations.sort()
        rss = (value(scrape(), "process_resident_memory_bytes") or ({}, 0))[1] / 2**20
        figures = {"gpus": len(gpus), "scrape_ms_median": round(durations[len(durations) // 2], 2),
                   "scrape_ms_max": round(durations[-1], 2), "rss_mib": round(rss, 1), "allocated_mib": args.mib,
                   "nvidia_smi": subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                                                capture_output=True, text=True).stdout.strip()}
        (out / "figures.json").write_text(json.dumps(figures, indent=2) + "\n")
        check("the exporter's scrape on real NVML (its own timing, median of 20)", figures["scrape_ms_median"] <= 50,
              f"{figures['scrape_ms_median']} ms for {len(gpus)} GPU(s), RSS {figures['rss_mib']} MiB")
        docker("service", "rm", SERVICE, check_rc=False)
        time_sliced(out, host, args.slots, args.slots_mib, scrape)
    except Exception as e:  # a broken step is a failed check, with its reason in the table
        check("the run itself", False, f"{type(e).__name__}: {e}"[:400])
    finally:
        docker("service", "rm", SERVICE, check_rc=False)
        docker("service", "rm", SHARERS, check_rc=False)
        if exporter:
            exporter.terminate()
            try:
                exporter.wait(10)
            except subprocess.TimeoutExpired:
                exporter.kill()
        if log:
            log.close()
        if made_swarm:
            docker("swarm", "leave", "--force", check_rc=False)
        ENGINE.stop()
    return print_results(out)


if __name__ == "__main__":
    sys.exit(main())
