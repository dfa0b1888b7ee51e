#!/usr/bin/env python3
"""gpu-swarm end to end on real NVIDIA GPUs: the project's own agent, runtime guard, swarm scripts and stacks.

    python3 bench/gpu_e2e.py [--slots-per-gpu 4] [--start-runs 15] [--out DIR]   # as root
    bash bench/gpu_session.sh 'e2e:300=bench/gpu_e2e.py'    # on a bare GPU machine, with .kit
    python3 bench/gpu_e2e.py --smoke [--gpus 2]     # no GPU: stand-in GPUs (bench/gpu_standins.py), as root

Needs root, one or more NVIDIA GPUs, Docker Engine >= 25.0.3 (dockerd, docker) and
nvidia-container-toolkit >= 1.19 (nvidia-ctk, nvidia-container-runtime, its hooks) on PATH,
python3 with nvidia-ml-py and PyYAML, a static busybox, and a built bench/cuda_probe.c
(--cuda-probe, else $CUDA_PROBE as bench/gpu_session.sh sets it, else built here with cc).
It starts an engine of its own (data under /var/lib/gpu-swarm-e2e) with the agent's
daemon.json, makes a one-node swarm with swarm/formation.py, admits the node with
swarm/rollout.py (which runs the post-join GPU check), and then checks, on that swarm:
- the agent advertises every GPU by its full UUID, and the node's boot path works on the real
  driver: agent -> daemon.json -> dockerd -> swarm -> guard -> nvidia runtime -> task;
- stacks/gpu-smoke.yml with one replica more than GPUs, while a holder service takes one GPU:
  the replicas wait Pending ("insufficient resources"); freeing the holder's GPU lets one start;
  then one task per GPU runs, each seeing exactly its GPU (nvidia-smi -L and /dev/nvidia*),
  and one more waits;
- a task that reserved nothing, on an image with NVIDIA_VISIBLE_DEVICES=all, sees no GPU
  (while every GPU is held by other tasks);
- a service that sets the swarm's GPU variable itself does not start;
- `docker run --gpus all` by an administrator still gets every GPU;
- the health reconciler's sentinel task runs with no GPU, and the watcher's signal makes it exit 75,
  which the reconciler reads as the node's fault;
- the runtime guard's cost per container start, against nvidia-container-runtime alone
  (--start-runs interleaved `docker run --rm` per variant);
- with --slots-per-gpu K: K slots per GPU, stacks/inference-shared.yml running CUDA work
  (bench/cuda_probe.c) in K tasks per GPU at once, one more waiting; the slot mapping's cost.
On ONE GPU every check runs as written, as its one-GPU equivalent: "exactly its GPU" is not
told from "every GPU" by UUID there, so it rests on the task's one /dev/nvidiaN, the task without
a reservation that sees none, and the replica that stays Pending (not sharing) while the GPU is
held; K=4 slots are 4 CUDA tasks on the one GPU, the 5th Pending.
It prints a table of every check and exits 1 when one fails (any GPU leak among them).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import signal
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from swarm import formation, rollout, stacks  # noqa: E402  (pure Python: no Pulumi needed here)
from swarm.gpu_check import CHECK_IMAGE, GpuCheck  # noqa: E402
from swarm.labels import (DRAINED_BY_LABEL, GPU_REPLICAS_LABEL, GPU_SHARING_LABEL, POOL_LABEL,  # noqa: E402
                          STACK_NAMESPACE_LABEL)

import yaml  # noqa: E402

sys.path.insert(0, str(REPO / "bench"))
import gpu_standins  # noqa: E402  (--smoke)
from gpu_bench import (CUDA_IMAGE, KIND, PROBE_IMAGE, SHARED_KIND, UUID, Engine, agent, check,  # noqa: E402
                       gpus_of_host, print_results, run, sample_starts, start_guard_server, wait)

ENGINE = Engine("gpu-swarm-e2e")
docker, script = ENGINE.docker, ENGINE.script


def remove_stack(name: str) -> None:
    """Remove a stack and wait until its containers have stopped: until then they still hold
    their GPUs, and the guard's ledger refuses a new holder of a GPU that a live one holds."""
    script(stacks.remove_stack(name))
    wait(lambda: not docker("ps", "-q", "--filter", f"label={STACK_NAMESPACE_LABEL}={name}").stdout.strip(),
         60, f"the containers of stack {name} to stop")


def tasks(service: str, desired: str = "running") -> list[dict]:
    ids = docker("service", "ps", "-q", "--no-trunc", *(("--filter", f"desired-state={desired}") if desired else ()),
                 service).stdout.split()
    return json.loads(docker("inspect", *ids).stdout) if ids else []


def container_env(task: dict) -> dict:
    cid = task["Status"]["ContainerStatus"]["ContainerID"]
    env = json.loads(docker("inspect", "--format", "{{json .Config.Env}}", cid).stdout)
    return dict(e.split("=", 1) for e in env)


START_RUNS = 15  # --start-runs
START_LIMIT_MS = 30  # issue 8: the guard's median overhead per container start


def start_times(variants: dict[str, list[str]], keep: Path) -> dict[str, float]:
    """Median seconds of `docker run --rm` per variant, interleaved so drift hits each alike.
    Every sample goes to `keep`: a median of ~20 starts of ~0.5 s moves by some 10 ms between runs."""
    samples = sample_starts(ENGINE, variants, START_RUNS)
    keep.write_text(json.dumps(samples, indent=1))
    return {name: statistics.median(s) for name, s in samples.items()}


def release() -> str:
    return hashlib.sha256(b"gpu-swarm e2e").hexdigest()


def admit(out: Path, what: str, node: str, gpus: int, software: str, **sharing) -> None:
    """Admit the node with swarm/rollout.py, which runs the post-join GPU check. A failed check
    is recorded with its evidence; the node is then made active again so that the checks
    after it still say something."""
    try:
        admitted = rollout.admitted(script(rollout.admit_node(
            node, {POOL_LABEL: "e2e"}, expected_gpus=gpus, kind=KIND, software=software, check=GpuCheck(),
            **sharing)))
    except RuntimeError as e:
        (out / f"gpu-check-{what}.txt").write_text(str(e))
        check(f"post-join GPU check ({what} GPUs)", False, str(e)[:300])
        docker("node", "update", "--availability", "active", "--label-rm", DRAINED_BY_LABEL, node,
               check_rc=False)
        return
    (out / f"gpu-check-{what}.json").write_text(json.dumps(admitted[1], indent=2))
    check(f"post-join GPU check ({what} GPUs)", bool(admitted[1]) and admitted[1]["verified"] is True,
          f"reserved saw {admitted[1]['reserved_saw']} ({admitted[1]['reserved_devices']} devices), "
          f"unreserved saw {admitted[1]['unreserved_saw']} ({admitted[1]['unreserved_devices']} devices)")


def whole_gpus(out: Path, host: list[str], node: str) -> None:
    admit(out, "whole", node, len(host), release())

    n = len(host)
    holder = ("services:\n  hold:\n    image: " + CUDA_IMAGE + "\n    command: [sleep, infinity]\n    deploy:\n"
              "      resources:\n        reservations:\n          generic_resources:\n"
              "            - discrete_resource_spec: {kind: NVIDIA-GPU, value: 1}\n")
    script(stacks.deploy_stack("holder", hashlib.sha256(holder.encode()).hexdigest()), stdin=holder)
    wait(lambda: [t for t in tasks("holder_hold") if t["Status"]["State"] == "running"], 60, "the holder")
    smoke = yaml.safe_load((REPO / "stacks" / "gpu-smoke.yml").read_text())
    smoke["services"]["gpu"]["deploy"]["replicas"] = n + 1  # the file's own scaling advice: more than GPUs
    text = yaml.safe_dump(smoke)
    script(stacks.deploy_stack("smoke", hashlib.sha256(text.encode()).hexdigest()), stdin=text)
    wait(lambda: len([t for t in tasks("smoke_gpu") if t["Status"]["State"] in ("running", "pending")]) == n + 1
         and len([t for t in tasks("smoke_gpu") if t["Status"]["State"] == "running"]) == n - 1, 120,
         "the smoke stack with one GPU held")
    remove_stack("holder")
    started = time.monotonic()
    def all_gpus_busy():
        running_ = [t for t in tasks("smoke_gpu") if t["Status"]["State"] == "running"]
        return running_ if len(running_) == n else None
    running = wait(all_gpus_busy, 120, "the pending task to take the freed GPU")
    check("a freed GPU lets a pending task start", True, f"{time.monotonic() - started:.1f} s after it was freed")
    pending = [t for t in tasks("smoke_gpu") if t["Status"]["State"] == "pending"]
    check("one task per GPU, one more waits", len(pending) == 1 and "insufficient resources" in pending[0]["Status"]
          .get("Err", ""), pending[0]["Status"].get("Err", "") if pending else "no pending task")
    seen_all = []
    for t in running:
        assigned = container_env(t)["DOCKER_RESOURCE_NVIDIA-GPU"]
        cid = t["Status"]["ContainerStatus"]["ContainerID"]
        saw = UUID.findall(docker("logs", cid).stdout)
        devices = docker("exec", cid, "sh", "-c", "ls /dev | grep -E '^nvidia[0-9]+$' || true").stdout.split()
        seen_all += saw
        check(f"smoke task {t['Slot']} sees exactly its GPU", saw == [assigned] and len(devices) == 1,
              f"assigned {assigned}, nvidia-smi -L saw {saw}, /dev has {devices}")
    check("no GPU held twice", sorted(seen_all) == sorted(host), f"{len(set(seen_all))} of {n} GPUs in use")

    log = ENGINE.job("nores", CUDA_IMAGE, "nvidia-smi -L 2>&1; ls /dev | grep -E '^nvidia[0-9]+$' || true; echo end")
    (out / "no-reservation.log").write_text(log)
    check("a task that reserved nothing sees no GPU (image says NVIDIA_VISIBLE_DEVICES=all)",
          log.startswith("Complete") and not UUID.search(log) and not re.search(r"^nvidia\d", log, re.M),
          " | ".join(line for line in log.splitlines()[1:3]))
    log = ENGINE.job("sneaky", CUDA_IMAGE, "nvidia-smi -L", "--env", "DOCKER_RESOURCE_NVIDIA-GPU=all")
    check("a service that sets the swarm's GPU variable does not start",
          log.startswith(("Failed", "Rejected")) and "gpu-swarm guard" in log, log.splitlines()[0][:160])
    guarded = docker("run", "--rm", "--gpus", "all", CUDA_IMAGE, "nvidia-smi", "-L", check_rc=False)
    plain = docker("run", "--rm", "--gpus", "all", "--runtime", "nvidia", CUDA_IMAGE, "nvidia-smi", "-L",
                   check_rc=False)
    got = UUID.findall(guarded.stdout)
    (out / "docker-run-gpus.log").write_text(f"guard: rc {guarded.returncode}\n{guarded.stdout}{guarded.stderr}\n"
                                             f"nvidia alone: rc {plain.returncode}\n{plain.stdout}{plain.stderr}")
    if plain.returncode == 0:
        check("docker run --gpus all still gets every GPU", sorted(got) == sorted(host), f"{len(got)} GPU(s)")
    else:  # this machine's toolkit cannot serve --gpus at all: then the guard must change nothing about it
        check("docker run --gpus all: the guard changes nothing", guarded.returncode == plain.returncode,
              f"nvidia-container-runtime alone fails here too: {(plain.stderr or plain.stdout).strip()[-160:]}")
    remove_stack("smoke")

    times = start_times({
        "guard, no GPU": [],
        "nvidia alone, no GPU": ["--runtime", "nvidia"],
        "guard, one GPU": ["--env", f"DOCKER_RESOURCE_NVIDIA-GPU={host[0]}"],
        "nvidia alone, one GPU": ["--runtime", "nvidia", "--env", f"DOCKER_RESOURCE_NVIDIA-GPU={host[0]}"],
    }, out / "start-samples.json")
    (out / "start-times.json").write_text(json.dumps(times, indent=2))
    WHOLE_GPU_START.update(times)  # the shared phase compares a slot's start with it
    for what in ("no GPU", "one GPU"):
        extra = (times[f"guard, {what}"] - times[f"nvidia alone, {what}"]) * 1000
        check(f"guard's cost per container start ({what})", extra <= START_LIMIT_MS,
              f"{times[f'guard, {what}'] * 1000:.0f} ms vs {times[f'nvidia alone, {what}'] * 1000:.0f} ms: "
              f"{extra:+.0f} ms (median of {START_RUNS}, interleaved)")


WHOLE_GPU_START: dict[str, float] = {}  # medians of the whole-GPU phase's starts, seconds


def sentinel(out: Path, node: str) -> None:
    """The health reconciler's sentinel on this GPU node (node/swarm_reconciler.py makes it on workers; this
    one-node swarm's node is a manager, so only the constraint differs), stopped by the watcher's own call
    (node/sentinel.py): it runs with no GPU, exits 75, and the reconciler reads that as this node's fault."""
    sys.path.insert(0, str(REPO / "node"))
    import sentinel as node_sentinel
    import swarm_reconciler as reconciler
    docker(*reconciler.sentinel_service(CHECK_IMAGE, constraint="node.role==manager"))
    try:
        task = wait(lambda: next((t for t in tasks(reconciler.SENTINEL_SERVICE)
                                  if t["Status"]["State"] == "running"), None), 60, "the sentinel task")
        cid = task["Status"]["ContainerStatus"]["ContainerID"]
        devices = docker("exec", cid, "sh", "-c", "ls /dev | grep -E '^nvidia' || true").stdout.split()
        wrote = docker("exec", cid, "sh", "-c", "echo x > /written", check_rc=False).returncode
        check("the sentinel runs with no GPU and a read-only root", devices == [] and wrote != 0,
              f"/dev has {devices or 'no nvidia device'}; a write exits {wrote}")
        previous = {k: os.environ.get(k) for k in ("DOCKER_HOST", "PATH")}
        os.environ.update({k: ENGINE.env()[k] for k in previous})  # the reconciler's CLI, on this engine
        try:
            engine = reconciler.Engine("docker")
            watch, nodes = reconciler.Sentinel(), engine.nodes()
            learned = watch.signalled(engine, nodes, print)  # what is there already is history
            said = node_sentinel.signal_sentinel(ENGINE.sock.removeprefix("unix://"))
            try:  # every task swarm keeps: the one that failed is no longer desired running
                failed = wait(lambda: [t for t in tasks(reconciler.SENTINEL_SERVICE, desired="")
                                       if "non-zero exit (75)" in t["Status"].get("Err", "")], 30, "the sentinel's exit")
            except RuntimeError as e:
                raise RuntimeError(f"{e}; the watcher's call: {said}") from None
            heard = watch.signalled(engine, nodes, print)
            actions = reconciler.decide(nodes, True, int(time.time()), signalled=heard)
        finally:
            for key, value in previous.items():
                os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)
        check("the watcher's signal stops the sentinel with exit 75, and the reconciler drains on it",
              not learned and heard == {node} and [(a.action, a.reason) for a in actions] == [("drain", "unhealthy:sentinel")],
              f"{said}; swarm: {failed[0]['Status']['Err']}; actions {[(a.node, a.action, a.reason) for a in actions]}")
    finally:
        docker("service", "rm", reconciler.SENTINEL_SERVICE, check_rc=False)


def shared_gpus(out: Path, host: list[str], node: str, slots: int) -> None:
    report = agent(ENGINE, out, slots)
    check("the agent advertises slots only", all(r.startswith(f"{SHARED_KIND}=") for r in report["resources"])
          and len(report["resources"]) == len(host) * slots, f"{len(report['resources'])} slots, "
          f"labels {report['labels'].get(GPU_SHARING_LABEL)} x{report['labels'].get(GPU_REPLICAS_LABEL)}")
    ENGINE.restart()
    admit(out, "shared", node, len(host), release()[::-1], slots_per_gpu=slots, shared_kind=SHARED_KIND)

    doc = yaml.safe_load((REPO / "stacks" / "inference-shared.yml").read_text())
    svc = doc["services"]["embed"]
    svc["image"], svc["command"] = PROBE_IMAGE, ["cuda-probe", "2560"]  # real CUDA work in every task
    svc["deploy"]["replicas"] = len(host) * slots + 1
    text = yaml.safe_dump(doc)
    script(stacks.deploy_stack("infer", hashlib.sha256(text.encode()).hexdigest()), stdin=text)

    def settled():
        ts = tasks("infer_embed")
        run_ = [t for t in ts if t["Status"]["State"] == "running"]
        logs = {t["ID"]: docker("logs", t["Status"]["ContainerStatus"]["ContainerID"]).stdout for t in run_}
        return (ts, run_, logs) if len(run_) == len(host) * slots and all("allocated" in v for v in logs.values()) \
            else None
    all_tasks, running, logs = wait(settled, 240, "every slot running CUDA work")
    per_gpu: dict[str, int] = {}
    for t in running:
        env = container_env(t)
        slot = env["DOCKER_RESOURCE_NVIDIA-GPU-SHARED"]
        saw = UUID.findall(logs[t["ID"]])
        gpu = slot.rsplit("-s", 1)[0]
        per_gpu[gpu] = per_gpu.get(gpu, 0) + 1
        check(f"shared task {t['Slot']} runs CUDA on exactly its slot's GPU", saw == [gpu],
              f"slot {slot[-40:]}, cuda saw {saw}, {logs[t['ID']].splitlines()[0]}")
    check(f"{slots} tasks per GPU", sorted(per_gpu.values()) == [slots] * len(host) and set(per_gpu) == set(host),
          json.dumps(per_gpu))
    pending = [t for t in all_tasks if t["Status"]["State"] == "pending"]
    check("one more waits for a slot", len(pending) == 1 and "insufficient resources" in pending[0]["Status"]
          .get("Err", ""), pending[0]["Status"].get("Err", "") if pending else "none pending")
    apps = run(["nvidia-smi", "--query-compute-apps=pid,gpu_uuid,used_memory", "--format=csv,noheader"]).stdout
    (out / "compute-apps.csv").write_text(apps)
    on_gpu = [line for line in apps.splitlines() if line.strip()]
    check("the sharing tasks hold GPU memory at the same time", len(on_gpu) >= len(host) * slots,
          f"{len(on_gpu)} CUDA processes on the host's nvidia-smi")
    remove_stack("infer")

    # A sharing node refuses a whole GPU (the guard: swarm gives its GPUs only as slots there),
    # so a slot's start is compared with the whole GPU's start timed in the whole-GPU phase.
    times = start_times({"slot of a GPU": ["--env", f"DOCKER_RESOURCE_NVIDIA-GPU-SHARED={host[0]}-s0"]},
                        out / "start-samples-shared.json")
    times["whole GPU"] = WHOLE_GPU_START.get("guard, one GPU", times["slot of a GPU"])
    (out / "start-times-shared.json").write_text(json.dumps(times, indent=2))
    extra = (times["slot of a GPU"] - times["whole GPU"]) * 1000
    check("slot mapping's cost per container start", extra <= START_LIMIT_MS,
          f"{times['slot of a GPU'] * 1000:.0f} ms vs {times['whole GPU'] * 1000:.0f} ms: {extra:+.0f} ms")


class Stopped(Exception):
    """SIGTERM (a time budget ran out): recorded as a failed check, after which the engine is stopped."""


def stopped(signum, frame):
    raise Stopped(f"stopped by signal {signum}, probably a time budget; the checks before this one ran")


def main() -> int:
    global START_RUNS
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slots-per-gpu", type=int, default=4)
    parser.add_argument("--out", default="/tmp/gpu-swarm-e2e", help="logs and JSON results go here")
    parser.add_argument("--cuda-probe", default=os.environ.get("CUDA_PROBE"),
                        help="a built bench/cuda_probe.c (default: $CUDA_PROBE, else build it with cc)")
    parser.add_argument("--start-runs", type=int, default=START_RUNS,
                        help="interleaved `docker run` starts per variant for the cost figures (default %(default)s)")
    parser.add_argument("--smoke", action="store_true", help=gpu_standins.SMOKE_HELP)
    parser.add_argument("--gpus", type=int, default=2, help="stand-in GPUs for --smoke (default %(default)s)")
    args = parser.parse_args()
    if args.smoke:
        return gpu_standins.smoke("gpu_e2e.py", args.gpus, "--start-runs", "1", "--slots-per-gpu", "2",
                                  out=args.out)
    START_RUNS = args.start_runs
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        sys.exit("run as root: it starts an engine and writes the toolkit's config")
    host = gpus_of_host()
    print(f"host GPUs ({len(host)}): {', '.join(host)}", flush=True)
    if not host:
        sys.exit("nvidia-smi -L lists no GPU: this needs a machine with one or more NVIDIA GPUs")
    ENGINE.clear()
    probe = args.cuda_probe or str(ENGINE.root / "cuda-probe")
    if not args.cuda_probe:
        run(["cc", "-O2", "-o", probe, str(REPO / "bench" / "cuda_probe.c"), "-ldl"])

    signal.signal(signal.SIGTERM, stopped)  # so that the engine below is stopped and the table printed
    report = agent(ENGINE, out)
    check("the agent advertises every GPU by its full UUID", sorted(g["uuid"] for g in report["gpus"]) == sorted(host),
          f"{len(report['gpus'])} GPUs, default runtime gpu-swarm")
    server = start_guard_server(out, ENGINE.root / "runtime.env")
    check("the guard's server answers the runtime's creates", server.poll() is None, str(ENGINE.run_dir / "guard"))
    try:
        ENGINE.start(out)
        ENGINE.build_images(out, probe)
        init = json.loads(script(formation.init_swarm(run(["hostname", "-I"]).stdout.split()[0])))
        node = docker("info", "--format", "{{.Swarm.NodeID}}").stdout.strip()
        check("swarm formed by swarm/formation.py", init["created"] is True, f"cluster {init['cluster_id']}")
        try:
            whole_gpus(out, host, node)
        except Stopped:
            raise
        except Exception as e:  # recorded; the shared GPUs' checks still run, on a swarm without these stacks
            check("the run itself (whole GPUs)", False, f"{type(e).__name__}: {e}"[:400])
            for stack in ("holder", "smoke"):
                remove_stack(stack)
        try:
            sentinel(out, node)
        except Stopped:
            raise
        except Exception as e:
            check("the run itself (the sentinel)", False, f"{type(e).__name__}: {e}"[:400])
        if args.slots_per_gpu:
            shared_gpus(out, host, node, args.slots_per_gpu)
    except Exception as e:  # a broken step is a failed check, with its reason in the table
        check("the run itself", False, f"{type(e).__name__}: {e}"[:400])
    finally:
        docker("swarm", "leave", "--force", check_rc=False)
        ENGINE.stop()  # the one running now: the shared phase restarts it
        server.kill()
        server.wait()
    return print_results(out)


if __name__ == "__main__":
    sys.exit(main())
