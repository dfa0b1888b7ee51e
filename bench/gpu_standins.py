"""Stand-in GPUs for the GPU benches' smoke mode and their tests: a machine of N GPUs that has none.

    with standin_gpus(tmp, gpus=2) as env:        # then run a GPU bench with that environment
        subprocess.run([sys.executable, "bench/gpu_mps.py", "--out", OUT], env=env)

What the benches run stays real: dockerd, swarm, the agent, the guard and its ledger,
node/gpu-swarm-mps, the exporter. What the GPU does is played by:
- the rehearsal's stand-ins (localswarm/standins): NVML (pynvml.py) and nvidia-container-runtime,
  which gives a container the device nodes and an nvidia-smi of exactly the GPUs it asked for;
- the rehearsal's nvidia-cuda-mps-control: the control daemon, its utility and its MPS server on the
  recorded wire, with the failure modes measured on an H200 (the rehearsal's GPU nodes run it too);
- written here: an nvidia-smi for the host that also answers -i, compute modes (-c, the
  rehearsal's hardware.with_compute_mode) and --query-compute-apps; a cuda-probe (bench/cuda_probe.c's
  output) that allocates on the GPUs its container's nvidia-smi lists, within the lower of the
  ceiling its MPS server gives it (a client's handshake through the task's socket, bench/mps_peer.c)
  and its own CUDA_MPS_PINNED_DEVICE_MEM_LIMIT, as MPS does (FACTS), and
  gets no context on an MPS GPU without its pipe (CUDA error 46 in Exclusive_Process, FACTS);
- a "driver" thread: it finds the probes' processes in /proc and writes each GPU's compute
  processes (host pid, MiB) into the hardware file, so that NVML and nvidia-smi see who holds
  what memory, as a driver knows it.
All of them share one hardware file (pynvml.py's format), changed under one lock.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import sys
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
STANDINS = REPO / "localswarm" / "standins"
MARK = "GPU_SWARM_STANDIN_CUDA"  # in a probe's environment: "<uuid>=<MiB>,..." it holds
MEMORY_MIB = 81559  # an H100's


def uuid(index: int) -> str:
    return f"GPU-5e551011-0000-4000-8000-{index + 1:012x}"


@contextlib.contextmanager
def locked(hardware: Path):
    """The hardware file's description, for reading and changing it under the stand-ins' one lock."""
    with open(f"{hardware}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        description = json.loads(hardware.read_text())
        before = json.dumps(description)
        yield description
        if json.dumps(description) != before:
            tmp = hardware.with_suffix(f".{os.getpid()}.{threading.get_ident()}")
            tmp.write_text(json.dumps(description))
            os.replace(tmp, hardware)


SMI = r'''#!@PYTHON@ -I
"""nvidia-smi stand-in for the host (bench/gpu_standins.py): the hardware file's GPUs."""
import sys
sys.path.insert(0, "@BENCH@")
from gpu_standins import smi_main
sys.exit(smi_main(sys.argv[1:]))
'''


# Runs in the task's container (the stand-in image: busybox sh, and mps-peer). CUDA sees the GPUs the
# runtime gave the container; the rehearsal's runtime mounts an nvidia-smi that lists exactly those. An MPS
# client's ceiling is what its server says, through the task's socket (the relay's): mps-peer's stand-in client.
CUDA_PROBE = r'''#!/bin/sh
mib=${1:-1024}
if ! uuids=$(nvidia-smi --query-gpu=uuid --format=csv,noheader 2>/dev/null) || [ -z "$uuids" ]; then
  echo "cuda-probe: no libcuda.so.1 (stand-in): this container got no GPU" >&2
  exit 2
fi
mib_of() { # 0=4G | 0=35686M -> MiB
  v=${1#0=}
  case $v in *G) echo $((${v%G} * 1024)) ;; *M) echo "${v%M}" ;; *) echo "$v" ;; esac
}
# A GPU shared by MPS is in Exclusive_Process mode, its server the one process on it: a client that
# leaves MPS (no pipe directory) gets no context. Its GPU's pipe is mounted only on such a GPU.
if [ -z "${CUDA_MPS_PIPE_DIRECTORY:-}" ] && ls -d @MPS_DIR@/*/pipe >/dev/null 2>&1; then
  echo "cuda-probe: cuInit(0) failed with CUDA error 46 (all CUDA-capable devices are busy or unavailable)" >&2
  exit 3
fi
limit=""
if [ -n "${CUDA_MPS_PINNED_DEVICE_MEM_LIMIT:-}" ]; then limit=$(mib_of "$CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"); fi
if [ -n "${CUDA_MPS_PIPE_DIRECTORY:-}" ]; then
  if ! said=$(mps-peer standin-client "$CUDA_MPS_PIPE_DIRECTORY/control"); then
    echo "cuda-probe: cuInit(0) failed with CUDA error 46 (the MPS server did not answer: $said)" >&2
    exit 3
  fi
  c=${said#limit }
  c=${c%% *}
  ready=${said##* in }
  if [ -z "$limit" ] || [ "$c" -lt "$limit" ]; then limit=$c; fi
fi
count=0
for u in $uuids; do count=$((count + 1)); done
echo "cuda-probe: $count GPU(s) visible"
held="" i=0
for u in $uuids; do
  if [ -n "$limit" ] && [ "$mib" -gt "$limit" ]; then
    echo "cuda-probe: cuMemAlloc_v2(&ptr, mib << 20) failed with CUDA error 2" >&2
    exit 3
  fi
  echo "GPU $i: allocated $mib MiB (UUID: $u)"
  held="${held:+$held,}$u=$mib" i=$((i + 1))
done
echo "cuda-probe: ready in ${ready:-0 ms}"  # a stand-in's client: its handshake with the MPS server, as timed
if [ "${2:-}" = once ]; then exit 0; fi
trap 'exit 0' TERM INT
export @MARK@="$held"
sleep 2147483647 &
wait
'''


def smi_main(args: list[str]) -> int:
    """-L, -i UUID|INDEX, --query-gpu=..., --query-compute-apps=..., --format=csv[,noheader][,nounits], -c MODE."""
    hardware = Path(os.environ["GPU_SWARM_REHEARSAL_HARDWARE"])
    select = args[args.index("-i") + 1] if "-i" in args else None
    fmt = next((a.split("=", 1)[1] for a in args if a.startswith("--format=")), "").split(",")
    with locked(hardware) as description:
        gpus = [(i, g) for i, g in enumerate(description["gpus"]) if select in (None, g["uuid"], str(i))]
        if not gpus:
            print(f"No devices were found matching {select}" if select else "No devices were found")
            return 6
        if "-c" in args:  # the rehearsal's nvidia-smi's rule, on this machine's file
            sys.path.insert(0, str(REPO))
            from localswarm.standins.hardware import with_compute_mode
            description.update(with_compute_mode(description, select, args[args.index("-c") + 1]))
            return 0
    rows = []
    for arg in args:
        if arg in ("-L", "--list-gpus"):
            rows += [f"GPU {i}: {g['name']} (UUID: {g['uuid']})" for i, g in gpus]
        elif arg.startswith("--query-gpu="):
            rows += [", ".join(_field(f, i, g, "nounits" not in fmt) for f in arg.split("=", 1)[1].split(","))
                     for i, g in gpus]
        elif arg.startswith("--query-compute-apps="):
            fields = arg.split("=", 1)[1].split(",")
            rows += [", ".join(_app_field(f, p, g, "nounits" not in fmt) for f in fields)
                     for _, g in gpus for p in g.get("processes") or ()]
    print("\n".join(rows))
    return 0


def _used(g: dict) -> int:
    return g.get("memory_used_mib", 0) + sum(p.get("used_mib", 0) for p in g.get("processes") or ())


def _field(name: str, index: int, g: dict, units: bool) -> str:
    mib = " MiB" if units else ""
    values = {"index": str(index), "uuid": g["uuid"], "gpu_uuid": g["uuid"], "name": g["name"],
              "driver_version": "580.159.04", "memory.total": f"{g['memory_mib']}{mib}",
              "memory.used": f"{_used(g)}{mib}",
              "compute_mode": {0: "Default", 3: "Exclusive_Process"}[g.get("compute_mode", 0)]}
    return values[name]


def _app_field(name: str, process: dict, g: dict, units: bool) -> str:
    return {"pid": str(process["pid"]), "process_name": process.get("name", "cuda-probe"), "gpu_uuid": g["uuid"],
            "used_memory": f"{process['used_mib']}{' MiB' if units else ''}"}[name]


def _probes() -> dict[str, list[dict]]:
    """GPU UUID -> the probes' processes on it, from /proc (host pids, as a driver reports them)."""
    held: dict[str, list[dict]] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for entry in environ:
            if entry.startswith(MARK.encode() + b"="):
                for item in filter(None, entry.split(b"=", 1)[1].decode().split(",")):
                    gpu, mib = item.rsplit("=", 1)
                    held.setdefault(gpu, []).append({"pid": int(pid), "used_mib": int(mib)})
    return held


def _drive(hardware: Path, stop: threading.Event) -> None:
    while not stop.wait(0.3):
        held = _probes()
        with locked(hardware) as description:
            for g in description["gpus"]:
                g["processes"] = sorted(held.get(g["uuid"], []), key=lambda p: p["pid"])


def write_tools(root: Path, gpus: int) -> dict[str, str]:
    """The stand-in machine's files under root; the environment that puts them in front of the real tools."""
    sys.path.insert(0, str(REPO))
    from localswarm.host import find_engine  # the rehearsal's engine: dockerd >= 25.0.3 and its CLI
    bin_dir = root / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    from localswarm import standins
    tools = {"nvidia-smi": SMI.replace("@PYTHON@", sys.executable).replace("@BENCH@", str(REPO / "bench")),
             "nvidia-cuda-mps-control": standins.source("nvidia-cuda-mps-control").decode()}
    for name, text in tools.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    runtime = bin_dir / "nvidia-container-runtime"
    if not runtime.exists():
        runtime.symlink_to(STANDINS / "nvidia-container-runtime")
    from node.contract import MPS_DIR  # where the guard mounts a slot task's GPU's pipe
    (root / "cuda-probe").write_text(CUDA_PROBE.replace("@MARK@", MARK).replace("@MPS_DIR@", MPS_DIR))
    (root / "cuda-probe").chmod(0o755)
    import subprocess  # the tasks' MPS peer, as bench/build_gpu_kit.sh builds it for a GPU machine
    subprocess.run(["cc", "-O2", "-static", "-o", str(root / "mps-peer"), str(REPO / "bench" / "mps_peer.c")],
                   check=True)
    hardware = root / "hardware.json"
    hardware.write_text(json.dumps({"driver": "580.159.04", "cuda": 13000, "gpus": [
        {"uuid": uuid(i), "name": "Stand-in H100", "memory_mib": MEMORY_MIB, "compute_mode": 0, "processes": []}
        for i in range(gpus)]}))
    toolkit = root / "config.toml"
    toolkit.write_text('swarm-resource = "DOCKER_RESOURCE_NVIDIA-GPU"\n')
    engine = find_engine()
    path = [str(bin_dir), str(Path(engine.dockerd).parent), str(Path(engine.docker).parent), os.environ["PATH"]]
    return {**os.environ, "PATH": os.pathsep.join(path), "PYTHONPATH": str(STANDINS),
            "GPU_SWARM_REHEARSAL_HARDWARE": str(hardware), "GPU_SWARM_REHEARSAL_TOOLKIT_CONFIG": str(toolkit),
            "CUDA_PROBE": str(root / "cuda-probe"), "MPS_PEER": str(root / "mps-peer")}


@contextlib.contextmanager
def standin_gpus(root: Path, gpus: int):
    """A machine of `gpus` stand-in GPUs while the block runs: its environment, and the driver thread."""
    env = write_tools(Path(root), gpus)
    stop = threading.Event()
    driver = threading.Thread(target=_drive, args=(Path(env["GPU_SWARM_REHEARSAL_HARDWARE"]), stop), daemon=True)
    driver.start()
    try:
        yield env
    finally:
        stop.set()
        driver.join()


def hardware_of(env: dict) -> dict:
    return json.loads(Path(env["GPU_SWARM_REHEARSAL_HARDWARE"]).read_text())


SMOKE_HELP = "run against N stand-in GPUs (bench/gpu_standins.py): no GPU, a few minutes; root and the rehearsal's engine"


def smoke(script: str, gpus: int, *args: str, out: str | None = None, timeout: float = 600) -> int:
    """A GPU bench's --smoke: the bench itself, as a child, on a stand-in machine of `gpus` GPUs;
    its results in `out` when given (bench/gpu_session.sh --smoke packs them), else a temporary folder."""
    import subprocess
    import tempfile
    if os.geteuid() != 0:
        sys.exit("--smoke runs as root: it starts an engine of its own (run under the rehearsal's lock)")
    with tempfile.TemporaryDirectory(prefix="gpu-standins-") as tmp, standin_gpus(Path(tmp), gpus) as env:
        out = Path(out) if out else Path(tmp) / "out"
        print(f"smoke: {script} on {gpus} stand-in GPU(s): {', '.join(uuid(i) for i in range(gpus))}", flush=True)
        done = subprocess.run([sys.executable, str(REPO / "bench" / script), "--out", str(out), *args], env=env,
                              timeout=timeout)
        mode = [g.get("compute_mode", 0) for g in hardware_of(env)["gpus"]]
        if any(mode):
            print(f"smoke: FAIL: the bench left compute modes {mode}; every GPU must be back in Default")
            return 1
        return judged(out / "results.json", done.returncode)


# Timings of a stand-in runtime on a busy small machine say nothing about a GPU machine's: on
# stand-ins these checks count as run once they were measured; every other check must pass.
TIMED = ("cost per container start", "a neighbour's new client under", "from a stalled server to a working GPU")


def judged(results_file: Path, returncode: int) -> int:
    if not results_file.exists():
        print(f"smoke: FAIL: the bench wrote no {results_file.name} (exit {returncode})")
        return 1
    results = json.loads(results_file.read_text())
    timed = [r for r in results if any(t in r["check"] for t in TIMED)]
    failed = [r["check"] for r in results if r not in timed and not r["ok"]]
    unmeasured = [r["check"] for r in timed if "not measured" in r["detail"]]
    print(f"smoke: {len(results) - len(timed) - len(failed)} of {len(results) - len(timed)} checks passed on "
          f"stand-in GPUs; {len(timed)} timings measured (not judged on stand-ins)"
          + (f"; FAILED: {failed + unmeasured}" if failed or unmeasured else ""))
    return 1 if failed or unmeasured or not results else 0


def main() -> int:
    """For shell benches: `eval "$(python3 bench/gpu_standins.py DIR --gpus N)"` puts N stand-in GPUs in front."""
    import argparse
    import shlex
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("dir", type=Path, help="where the stand-in machine's files go")
    parser.add_argument("--gpus", type=int, default=2)
    args = parser.parse_args()
    env = write_tools(args.dir, args.gpus)
    print("\n".join(f"export {k}={shlex.quote(v)}" for k, v in env.items() if os.environ.get(k) != v))
    return 0


if __name__ == "__main__":
    sys.exit(main())
