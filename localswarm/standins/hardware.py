"""A rehearsal machine's simulated GPUs: its hardware file, and the nvidia-smi that reports them.

Installed in the node image as /usr/lib/gpu-swarm-rehearsal/hardware.py, beside the hardware
file that localswarm/machines.py writes at launch. The machine's nvidia-smi and the
nvidia-container-runtime stand-in read the file through this module; the pynvml stand-in
reads it by itself (it lives in a venv). Its format is pynvml.py's description. Stdlib only.
"""
from __future__ import annotations

import json
import os

DEFAULT_PATH = "/usr/lib/gpu-swarm-rehearsal/hardware.json"
DEFAULT_DRIVER = "580.159.04"


def path() -> str:
    return os.environ.get("GPU_SWARM_REHEARSAL_HARDWARE", DEFAULT_PATH)


def describe(gpus: list[dict], driver: str = DEFAULT_DRIVER, cuda: int = 13000) -> dict:
    """The hardware file for these GPUs ([{"uuid", "name", "memory_mib"}, ...], in index order)."""
    return {"driver": driver, "cuda": cuda,
            "gpus": [{"uuid": g["uuid"], "name": g["name"], "memory_mib": int(g["memory_mib"]),
                      **{k: v for k, v in g.items() if k not in ("uuid", "name", "memory_mib", "index")}}
                     for g in gpus]}


def with_fault(description: dict, uuid: str, fault: dict | None) -> dict:
    """The description with one GPU's fault set ({"xid": 79}, {"ecc": "double"}, {"missing": true},
    {"pending_retirement": true}: pynvml.py says what each does) or, with None, cleared."""
    new = json.loads(json.dumps(description))
    gpu = next((g for g in new.get("gpus", []) if g["uuid"] == uuid), None)
    if gpu is None:
        raise KeyError(f"no GPU {uuid} in the hardware file")
    gpu.pop("fault", None)
    if fault:
        gpu["fault"] = fault
    return new


COMPUTE_MODES = {"DEFAULT": 0, "0": 0, "EXCLUSIVE_PROCESS": 3, "3": 3}  # as `nvidia-smi -c` takes them


def with_compute_mode(description: dict, select: str | None, mode: str) -> dict:
    """The description with the compute mode `nvidia-smi [-i UUID|INDEX] -c MODE` sets: of one GPU, or of all."""
    if mode.upper() not in COMPUTE_MODES:
        raise ValueError(f"compute mode {mode}: expected one of {', '.join(COMPUTE_MODES)}")
    new = json.loads(json.dumps(description))
    chosen = [g["minor"] for g in present(new) if select in (None, g["uuid"], str(g["index"]))]
    if not chosen:
        raise KeyError(f"No devices were found matching {select}" if select else "No devices were found")
    for minor in chosen:
        new["gpus"][minor]["compute_mode"] = COMPUTE_MODES[mode.upper()]
    return new


def save(description: dict, file: str | None = None) -> None:
    """Replace the hardware file whole: a reader sees the old description or the new one."""
    target = file or path()
    tmp = f"{target}.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(description, f, indent=1)
    os.replace(tmp, target)


def load(file: str | None = None) -> dict:
    """The description; a machine without the file has no NVIDIA hardware at all."""
    try:
        with open(file or path(), encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        return {"gpus": []}


def present(description: dict) -> list[dict]:
    """The GPUs the driver sees, each with its "minor" (its /dev/nvidiaN: the position in the
    file) and its "index" (enumeration order: a GPU that fell off the bus is not counted)."""
    seen = []
    for minor, gpu in enumerate(description.get("gpus", [])):
        if not (gpu.get("fault") or {}).get("missing"):
            seen.append({**gpu, "minor": minor, "index": len(seen)})
    return seen


def _sh_quote(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"


# POSIX sh, and only its builtins: the check image (node/build-check-image.sh) has a few
# busybox applets and no awk. Fields as nvidia-smi names them; csv rows joined by ", ".
_SMI_BODY = r'''set -f # GPU names are data, never patterns
list=false query="" header=true units=true
for arg in "$@"; do
  case $arg in
  -L | --list-gpus) list=true ;;
  --query-gpu=*) query=${arg#--query-gpu=} ;;
  --format=*)
    case ,${arg#--format=}, in *,noheader,*) header=false ;; esac
    case ,${arg#--format=}, in *,nounits,*) units=false ;; esac
    ;;
  *)
    echo "Invalid combination of input arguments. Please run 'nvidia-smi -h' for help." >&2
    exit 2
    ;;
  esac
done
if [ -z "$gpus" ]; then
  echo "No devices were found"
  exit 6
fi
IFS=, # rows and query fields are comma-separated; a GPU name has spaces
count=0
for line in $gpus; do count=$((count + 1)); done
value() { # value FIELD: of the GPU in $index $uuid $name $memory
  case $1 in
  index) v=$index ;;
  uuid | gpu_uuid) v=$uuid ;;
  name | gpu_name) v=$name ;;
  memory.total) if $units; then v="$memory MiB"; else v=$memory; fi ;;
  memory.used) if $units; then v="0 MiB"; else v=0; fi ;;
  driver_version) v=$driver ;;
  count) v=$count ;;
  compute_mode) if [ "$mode" = 3 ]; then v=Exclusive_Process; else v=Default; fi ;;
  *)
    echo "Field \"$1\" is not a valid field to query." >&2
    exit 2
    ;;
  esac
}
for f in $query; do value "$f"; done # an unknown field fails before any output
if [ -n "$query" ] && $header; then
  row=""
  for f in $query; do
    case $f in memory.*) if $units; then f="$f [MiB]"; fi ;; esac
    row="${row:+$row, }$f"
  done
  echo "$row"
fi
for line in $gpus; do
  index=${line%%|*} rest=${line#*|}
  uuid=${rest%%|*} rest=${rest#*|}
  name=${rest%%|*} rest=${rest#*|}
  memory=${rest%%|*} mode=${rest#*|}
  if [ -n "$query" ]; then
    row=""
    for f in $query; do
      value "$f"
      row="${row:+$row, }$v"
    done
    echo "$row"
  elif $list; then
    echo "GPU $index: $name (UUID: $uuid)"
  else
    echo "GPU $index: $name | $memory MiB | driver $driver | stand-in of the gpu-swarm rehearsal (no GPU)"
  fi
done
'''


def smi_script(gpus: list[dict], driver: str) -> str:
    """An nvidia-smi (POSIX sh) that answers -L and --query-gpu for exactly these GPUs, numbered
    from 0 as a container sees the GPUs it was given (`-c` is the machine's nvidia-smi's alone)."""
    rows = ",".join(f"{n}|{g['uuid']}|{g['name']}|{int(g['memory_mib'])}|{int(g.get('compute_mode', 0))}"
                    for n, g in enumerate(gpus))
    if any(c in g["name"] + g["uuid"] for g in gpus for c in "|,\n"):
        raise ValueError("a GPU name or UUID holds '|', ',' or a newline, which the stand-in nvidia-smi cannot list")
    return ("#!/bin/sh\n# nvidia-smi stand-in of the gpu-swarm rehearsal (no GPU here): its GPUs are listed below,\n"
            "# from the machine's hardware file (localswarm/standins). Made by localswarm/standins/hardware.py.\n"
            f"driver={_sh_quote(driver)}\ngpus={_sh_quote(rows)}\n" + _SMI_BODY)
