#!/usr/bin/env python3
"""MPS sharing and the guard's ledger on real NVIDIA GPUs (one or more), with the project's own node software.

    python3 bench/gpu_mps.py --out DIR [--slots 4] [--start-runs 15]     # as root
    bash bench/gpu_session.sh 'mps:480=bench/gpu_mps.py --start-runs 9'  # on a bare GPU machine, with .kit
    python3 bench/gpu_mps.py --smoke [--gpus 2]     # no GPU: stand-in GPUs (bench/gpu_standins.py), as root

Needs root, an NVIDIA GPU and its driver (nvidia-smi, nvidia-cuda-mps-control), Docker Engine
>= 25.0.3 and nvidia-container-toolkit >= 1.19 on PATH, and a built bench/cuda_probe.c
(--cuda-probe, else $CUDA_PROBE as bench/gpu_session.sh sets it) and bench/mps_peer.c ($MPS_PEER, else
built here with cc). It starts an engine of its
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
   slot does not start. Then what a task may try against its GPU's daemon (bench/gpu_mps_daemon.py), as
   root in its container, by a slot task and by one with no reservation: mounts that reach the MPS folder,
   control words through the relay, a passed descriptor, one idle connection and a flood of 1,000 (a
   neighbour's new client timed, median of --latency-runs), a dropped server descriptor (found, drained,
   named and restarted by the health watcher; stall to a working GPU, median of --stall-rounds); after
   each, the ceilings read on the host, the daemon answering, a neighbour allocating within its share.
   node/gpu-swarm-mps stop puts every GPU back in the compute mode it had when the bench began.
It prints a table of every check, writes results.json, logs and nvidia-smi evidence to --out,
and exits 1 when a check fails.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
import gpu_standins  # noqa: E402  (--smoke)
from gpu_bench import KIND, SHARED_KIND, UUID, check, print_results, run, wait  # noqa: E402
from gpu_bench import start_guard_server as guard_server  # noqa: E402
from gpu_mps_daemon import daemon_escapes  # noqa: E402
from gpu_mps_escapes import hostile  # noqa: E402
from gpu_mps_node import (ENGINE, IMAGE, Exporter, containers, docker, given, gone, gpu_of_slot,  # noqa: E402
                          job, modes, paired_cost, smi, start_times, task_env, time_left, used, apps)
from swarm import formation  # noqa: E402  (pure Python)

sys.path.insert(0, str(REPO / "node"))
import guard_files  # noqa: E402  (the guard's own test of an MPS daemon)
from swarm.node_contract import GPU_SHARING_LABEL, MPS_DIR, MPS_RELAY_LOG, RUNTIME_ENV_PATH  # noqa: E402


def agent(out: Path, name: str, *extra: str) -> dict:
    cmd = [sys.executable, str(REPO / "node" / "gpu_agent.py"), "--json", "--daemon-json", str(ENGINE.root / "daemon.json"),
           "--runtime-config", RUNTIME_ENV_PATH, "--guard", str(REPO / "node" / "gpu-swarm-runtime"),
           "--runtime-delegate", shutil.which("nvidia-container-runtime") or "/usr/bin/nvidia-container-runtime",
           *extra]
    report = json.loads(run(cmd).stdout)
    (out / f"agent-{name}.json").write_text(json.dumps(report, indent=2))
    shutil.copy(ENGINE.root / "daemon.json", out / f"daemon-{name}.json")
    shutil.copy(RUNTIME_ENV_PATH, out / f"runtime-{name}.env")
    return report


def start_guard_server(out: Path) -> subprocess.Popen:
    """The guard's server, where the agent pointed the runtime (the node's own path)."""
    proc = guard_server(out, Path(RUNTIME_ENV_PATH))
    check("the guard's server answers the runtime's creates", proc.poll() is None, str(Path(RUNTIME_ENV_PATH)))
    return proc


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


def mps(out: Path, gpus: list[str], slots: int, mib: int, latency_runs: int = 11, stall_rounds: int = 5) -> None:
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
    ENGINE.restart()
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
        daemon_escapes(out, share, slot, gpus, exporter, slots, latency_runs, stall_rounds)
    finally:
        exporter.stop()
    gone("steady")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="logs and JSON results go here (required but with --smoke)")
    parser.add_argument("--slots", type=int, default=4, help="MPS slots per GPU (default %(default)s)")
    parser.add_argument("--mib", type=int, default=1024, help="what each steady slot task allocates")
    parser.add_argument("--start-runs", type=int, default=15, help="interleaved starts per variant")
    parser.add_argument("--cuda-probe", default=os.environ.get("CUDA_PROBE"), help="a built bench/cuda_probe.c")
    parser.add_argument("--guard-cost-runs", type=int, default=100, help="bench/guard_cost.py's --runs")
    parser.add_argument("--mps-peer", default=os.environ.get("MPS_PEER"), help="a built bench/mps_peer.c (else "
                        "$MPS_PEER, as bench/gpu_session.sh sets it; else built here with cc)")
    parser.add_argument("--latency-runs", type=int, default=11, help="a neighbour's new clients timed per case")
    parser.add_argument("--stall-rounds", type=int, default=5, help="dropped server descriptors, each recovered")
    parser.add_argument("--smoke", action="store_true", help=gpu_standins.SMOKE_HELP)
    parser.add_argument("--gpus", type=int, default=2, help="stand-in GPUs for --smoke (default %(default)s)")
    args = parser.parse_args()
    if args.smoke:
        return gpu_standins.smoke("gpu_mps.py", args.gpus, "--start-runs", "1", "--guard-cost-runs", "3",
                                  "--slots", "2", "--mib", "512", "--latency-runs", "3", "--stall-rounds", "2",
                                  out=args.out)
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
    if not args.mps_peer:  # the kit carries one; a machine with a compiler builds it
        args.mps_peer = str(out / "mps-peer")
        run(["cc", "-O2", "-static", "-o", args.mps_peer, str(REPO / "bench" / "mps_peer.c")])
    found = modes(gpus)
    print(f"{len(gpus)} GPU(s): {', '.join(gpus)}; compute modes {found}", flush=True)
    saved = Path(RUNTIME_ENV_PATH).read_bytes() if Path(RUNTIME_ENV_PATH).exists() else None
    made_dir = not Path(RUNTIME_ENV_PATH).parent.exists()
    ENGINE.clear()
    Path(RUNTIME_ENV_PATH).parent.mkdir(parents=True, exist_ok=True)
    server = None
    try:
        report = agent(out, "whole")
        daemon = json.loads((ENGINE.root / "daemon.json").read_text())
        check("the agent advertises every GPU and makes the guard the default runtime, as on a node",
              sorted(report["resources"]) == sorted(f"{KIND}={g}" for g in gpus) and daemon["runtimes"]["gpu-swarm"] == {
                  "path": str(REPO / "node" / "gpu-swarm-runtime")}, "no runtimeArgs: no /bin/sh wrapper")
        server = start_guard_server(out)
        ENGINE.start(out)
        run(["bash", str(REPO / "bench" / "cuda_standin.sh"), IMAGE, args.cuda_probe, args.mps_peer], env=ENGINE.env())
        ENGINE.script(formation.init_swarm(run(["hostname", "-I"]).stdout.split()[0]))
        whole_gpu(out, gpus, args.start_runs, args.guard_cost_runs)
        mps(out, gpus, args.slots, args.mib, args.latency_runs, args.stall_rounds)
    except Exception as e:  # a broken step is a failed check, with its reason in the table
        check("the run itself", False, f"{type(e).__name__}: {e}"[:400])
    finally:
        for name in ("holder", "steady", "big", "twice", "attacker", "loner"):
            docker("service", "rm", name, check_rc=False)
        docker("swarm", "leave", "--force", check_rc=False)
        ENGINE.stop()
        if server:
            server.kill()
            server.wait()
        stopped = run(["bash", str(REPO / "node" / "gpu-swarm-mps"), "stop"], check_rc=False, timeout=90)
        for log in Path(MPS_DIR).glob("*/log/*.log"):
            shutil.copy(log, out / f"mps-{log.parent.parent.name[:12]}-{log.name}")
        if Path(MPS_DIR, MPS_RELAY_LOG).exists():
            shutil.copy(Path(MPS_DIR, MPS_RELAY_LOG), out / "mps-relay.log")
        mode = modes(gpus)
        check("gpu-swarm-mps stop: every GPU back in the compute mode it had when the bench began",
              stopped.returncode == 0 and mode == found,
              f"{sorted(set(mode.values()))}, found {sorted(set(found.values()))}; {stopped.stdout.strip()[-120:]}")
        if saved is None:
            Path(RUNTIME_ENV_PATH).unlink(missing_ok=True)
            if made_dir:
                Path(RUNTIME_ENV_PATH).parent.rmdir()
        else:
            Path(RUNTIME_ENV_PATH).write_bytes(saved)
    return print_results(out)


if __name__ == "__main__":
    sys.exit(main())
