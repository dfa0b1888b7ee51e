#!/usr/bin/env python3
"""What the runtime guard (node/gpu-swarm-runtime + gpu_guard.py) costs per OCI runtime call.

    python3 bench/guard_cost.py [--runs 200] [--baseline REV]
    python3 bench/guard_cost.py --smoke          # 3 runs: that the bench runs

A container start makes the shim call its runtime several times (create, start, state,
delete). Timing `docker run` on a GPU machine measures those plus the engine, the toolkit
and the driver, which vary by more than the guard costs. This times the calls alone: the
guard in front of a delegate that does nothing (/bin/true), against that delegate called
directly, on a copy of a real swarm task's config.json, interleaved, median of --runs:
- `create` of a task holding one GPU (config.json rewritten, the GPU claimed in the ledger);
- `create` of a task holding a slot of an MPS pool (pipe mounted, limits set, daemon checked);
- `create` of a task that reserved nothing (rewritten to NVIDIA_VISIBLE_DEVICES=void);
- `start` (and every other call): the sh front alone, which execs the delegate;
- per container: create + start + state + delete, one GPU.
"guard" runs as on a node, its server (guard_server.py, gpu-swarm-guard.service) answering
each create; "guard, no server" is the runtime running gpu_guard.py itself, as it does when
the server is not up.
With --baseline REV, the guard of that commit runs in the same interleaved loop, called as
dockerd called it then: its daemon.json entry had runtimeArgs, so dockerd ran it through a
/bin/sh wrapper of its own (moby daemon/runtime_unix.go writes `#!/bin/sh\\n<path> <args> $@`).
Needs nothing but python3, sh and git (for --baseline); no GPU, no Docker.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from swarm.node_contract import MPS_RELAY_PID  # noqa: E402  (where the guard looks for the relay)

GPU = "GPU-e282fbe7-2973-2b00-45d8-019e7e863f55"
SLOT = f"{GPU}-s1"
# The parts of a swarm task's config.json the guard reads, as dockerd 26 writes them.
SPEC = {"ociVersion": "1.0.2-dev", "process": {"args": ["sh", "-c", "nvidia-smi -L; exec sleep infinity"], "env": [
    "PATH=/usr/local/nvidia/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "NVIDIA_VISIBLE_DEVICES=all", "NVIDIA_DRIVER_CAPABILITIES=compute,utility", "HOSTNAME=4f2a9c1e0b7d"]},
    "root": {"path": "rootfs"}, "hooks": {}, "annotations": {}, "linux": {"namespaces": [{"type": "pid"}]},
    "mounts": [{"destination": "/proc", "type": "proc", "source": "proc", "options": ["nosuid", "noexec", "nodev"]}]}
CASES = {  # case -> (the variable swarm adds, the settings it runs under)
    "create, one GPU": (f"DOCKER_RESOURCE_NVIDIA-GPU={GPU}", "whole"),
    "create, MPS slot": (f"DOCKER_RESOURCE_NVIDIA-GPU-SHARED={SLOT}", "mps"),
    "create, no GPU": ("", "whole"),
}


def timed(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0


class Guard:
    """One version of the guard: its files, its settings per pool kind, how dockerd calls it."""

    def __init__(self, work: Path, name: str, node: Path, wrapped: bool, server: bool = False):
        self.name, self.front, self.server = name, node / "gpu-swarm-runtime", None
        own = work / name.replace(" ", "-").replace(",", "")
        own.mkdir()
        common = (f"DELEGATE=/bin/true\nGUARD={node / 'gpu_guard.py'}\nGUARD_PYTHON={sys.executable}\nKIND=NVIDIA-GPU\n"
                  f"GPUS={GPU}\nALLOW_DOCKER_RUN_GPUS=true\nLEDGER={own / 'claims'}\n")
        if server:  # as gpu-swarm-guard.service runs it on a node
            common += f"GUARD_SERVER={own / 'server'}\n"
            self.server = subprocess.Popen([sys.executable, "-I", "-S", str(node / "guard_server.py"), str(own / "server")],
                                           stdout=subprocess.DEVNULL)
            deadline = time.monotonic() + 10
            while not (own / "server" / "server.pid").exists():
                if time.monotonic() > deadline or self.server.poll() is not None:
                    raise RuntimeError("the guard's server did not start")
                time.sleep(0.02)
        self.settings = {
            "whole": common + "SHARED_KIND=\nSLOTS_PER_GPU=0\n",
            "mps": common + (f"SHARED_KIND=NVIDIA-GPU-SHARED\nSLOTS_PER_GPU=4\nSHARING=mps\nMPS_DIR={work / 'mps'}\n"
                             "MPS_MEMORY_MIB=19968\nMPS_THREAD_PERCENT=25\n"),
        }
        self.wrappers = {}
        for kind, text in self.settings.items():
            path = own / f"{kind}.env"
            path.write_text(text)
            if wrapped:  # what dockerd writes for a runtime with runtimeArgs
                wrapper = own / f"dockerd-wrapper-{kind}"
                wrapper.write_text(f"#!/bin/sh\n{self.front} --gpu-swarm-config {path} $@\n")
                wrapper.chmod(0o700)
                self.wrappers[kind] = [str(wrapper)]
            else:
                self.wrappers[kind] = [str(self.front), "--gpu-swarm-config", str(path)]

    def call(self, kind: str, verb: str, bundle: Path, container: str, log: Path) -> list[str]:
        return [*self.wrappers[kind], "--root", "/run/runc", "--log", str(log), verb, "--bundle", str(bundle),
                container]


def baseline(work: Path, rev: str) -> Path:
    node = work / f"node-{rev}"
    node.mkdir()
    listed = subprocess.run(["git", "-C", str(REPO), "ls-tree", "--name-only", rev, "node/"], check=True,
                            capture_output=True, text=True).stdout.split()
    for name in [n[5:] for n in listed if n[5:] == "gpu-swarm-runtime" or ("guard" in n and n.endswith(".py"))]:
        text = subprocess.run(["git", "-C", str(REPO), "show", f"{rev}:node/{name}"], check=True,
                              capture_output=True, text=True).stdout
        (node / name).write_text(text)
    (node / "gpu-swarm-runtime").chmod(0o755)
    return node


def fake_mps_daemon(work: Path) -> list[subprocess.Popen]:
    """Processes named as MPS's control daemon and as the relay (node/mps_relay.py), with their pid
    files where the guard looks: it checks both before a slot task starts."""
    started = []
    for name, pid_file in (("nvidia-cuda-mps-control", f"{GPU}/daemon.pid"),
                           ("mps_relay", MPS_RELAY_PID)):
        binary = work / name
        shutil.copy(shutil.which("sleep"), binary)
        started.append(subprocess.Popen([str(binary), "3600"]))
        (work / "mps" / pid_file).parent.mkdir(parents=True, exist_ok=True)
        (work / "mps" / pid_file).write_text(f"{started[-1].pid}\n")
    return started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--baseline", metavar="REV", help="also time the guard of this commit, as dockerd ran it")
    parser.add_argument("--smoke", action="store_true", help="3 runs: that the bench runs")
    args = parser.parse_args()
    if args.smoke:
        args.runs = 3
    work = Path(tempfile.mkdtemp(prefix="guard-cost-"))
    daemons = fake_mps_daemon(work)
    try:
        guards = [Guard(work, "guard", REPO / "node", wrapped=False, server=True),
                  Guard(work, "guard, no server", REPO / "node", wrapped=False)]
        if args.baseline:
            guards.append(Guard(work, f"guard at {args.baseline}", baseline(work, args.baseline), wrapped=True))
        bundles = {}
        for case, (extra, _) in CASES.items():
            bundle = work / case.replace(" ", "-").replace(",", "")
            bundle.mkdir()
            spec = json.loads(json.dumps(SPEC))
            spec["process"]["env"] += [extra] if extra else []
            (bundle / "config.json.orig").write_text(json.dumps(spec, separators=(",", ":")))  # as Go writes it
            bundles[case] = bundle
        log = work / "log.json"
        who = [g.name for g in guards] + ["delegate alone"]
        samples = {case: {w: [] for w in who} for case in [*CASES, "start (any call but create)",
                                                           "per container: create+start+state+delete"]}
        for i in range(args.runs + 5):
            for case, (_, kind) in CASES.items():
                for guard in guards:
                    if "MPS" in case and guard.name.startswith("guard at"):
                        continue  # the baseline knew no MPS
                    shutil.copy(bundles[case] / "config.json.orig", bundles[case] / "config.json")
                    container = f"task-{case[8:11]}"
                    seconds = timed(guard.call(kind, "create", bundles[case], container, log))
                    if case == "create, one GPU":
                        rest = sum(timed(guard.call(kind, verb, bundles[case], container, log))
                                   for verb in ("start", "state", "delete"))
                        if i >= 5:
                            samples["per container: create+start+state+delete"][guard.name].append(seconds + rest)
                            samples["start (any call but create)"][guard.name].append(
                                timed(guard.call(kind, "start", bundles[case], container, log)))
                    if i >= 5:  # warm-up rounds are not counted
                        samples[case][guard.name].append(seconds)
                alone = timed(["/bin/true", "create", "--bundle", str(bundles[case]), "x"])
                if i >= 5:
                    samples[case]["delegate alone"].append(alone)
            if i >= 5:
                samples["start (any call but create)"]["delegate alone"].append(timed(["/bin/true", "start", "x"]))
                samples["per container: create+start+state+delete"]["delegate alone"].append(
                    sum(timed(["/bin/true", verb, "x"]) for verb in ("create", "start", "state", "delete")))
        shutil.copy(bundles["create, no GPU"] / "config.json.orig", bundles["create, no GPU"] / "config.json")
        timed(guards[0].call("whole", "create", bundles["create, no GPU"], "check", log))
        rewritten = json.loads((bundles["create, no GPU"] / "config.json").read_text())["process"]["env"]
        assert "NVIDIA_VISIBLE_DEVICES=void" in rewritten, "the guard did not run"
        print(f"median of {args.runs} interleaved calls, milliseconds; python {sys.version.split()[0]}; "
              f"{os.cpu_count()} cores")
        print(f"{'call':42} " + " ".join(f"{w:>18}" for w in who) + " | what each adds: " +
              " ".join(f"{g.name:>18}" for g in guards))
        for case, s in samples.items():
            medians = {w: statistics.median(v) * 1000 for w, v in s.items() if v}
            row = " ".join(f"{medians[w]:18.1f}" if w in medians else f"{'-':>18}" for w in who)
            adds = " ".join(f"{medians[g.name] - medians['delegate alone']:+18.1f}" if g.name in medians else f"{'-':>18}"
                            for g in guards)
            print(f"{case:42} {row} | {' ' * 16}{adds}")
        return 0
    finally:
        for process in daemons + [g.server for g in locals().get("guards", []) if g.server]:
            process.kill()
            process.wait()
        shutil.rmtree(work)


if __name__ == "__main__":
    sys.exit(main())
