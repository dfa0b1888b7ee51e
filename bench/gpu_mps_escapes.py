"""What an MPS slot task may try, to get more than its share, and what it gets (bench/gpu_mps.py runs
these on a freed slot, beside slot tasks that keep running): a part of the MPS bench, not a bench."""
from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

from gpu_bench import SHARED_KIND, UUID, check, wait
from gpu_mps_node import IMAGE, Exporter, apps, containers, docker, given, gone, job, used
from swarm.node_contract import MPS_DIR, MPS_RELAY_LOG


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


