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


