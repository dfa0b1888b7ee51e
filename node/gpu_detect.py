#!/usr/bin/env python3
"""How the GPU agent learns this node's GPUs: NVML first, then nvidia-smi, or a simulated inventory.

NVML is read through nvml_reader.py, the node's one NVML reader. Stdlib plus pynvml (package
nvidia-ml-py), imported only when NVML is asked.
"""
from __future__ import annotations

import csv
import io
import json
import shutil
import subprocess

from contract import (GPU_COMPUTE_LABEL, GPU_COUNT_LABEL, GPU_CUDA_LABEL, GPU_DRIVER_LABEL, GPU_LABEL_PREFIX,
                      GPU_MEMORY_LABEL, GPU_PRODUCT_LABEL)
from gpu_resources import validate_uuid
from nvml_reader import Nvml, NvmlFailed, NvmlMissing


class BadInput(Exception):
    """Input a person must fix: exit 2, nothing written."""


class DetectionFailed(Exception):
    """NVML or nvidia-smi exists but does not work: exit 3."""


class _NvmlMissing(Exception):
    """There is no NVML to ask (no pynvml, or no libnvidia-ml): not an error by itself."""


def _check_unique(gpus: list[dict], source: str, error: type[Exception]) -> None:
    seen = set()
    for gpu in gpus:
        if gpu["uuid"] in seen:
            raise error(f"{source}: UUID {gpu['uuid']} appears twice; each device must be listed once")
        seen.add(gpu["uuid"])


def load_inventory(path: str) -> tuple[list[dict], dict]:
    """Simulated GPUs from a JSON list shaped like the report's "gpus"."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as e:
        raise BadInput(f"{path}: cannot read the GPU inventory ({e.strerror}); pass an existing file to --inventory")
    except (ValueError, UnicodeDecodeError) as e:
        raise BadInput(f"{path}: the GPU inventory is not valid JSON ({e}); fix the file")
    if not isinstance(data, list):
        raise BadInput(f"{path}: expected a JSON list of GPUs, found {json_type(data)}; wrap the entries in [...]")
    gpus, extra = [], {}
    for n, entry in enumerate(data):
        where = f"{path}: GPU entry {n}"
        if not isinstance(entry, dict):
            raise BadInput(f"{where}: expected an object, found {json_type(entry)}")
        for field, kind in (("index", int), ("uuid", str), ("name", str), ("memory_mib", int)):
            value = entry.get(field)
            if field not in entry:
                raise BadInput(f"{where} has no {field!r}; every GPU needs index, uuid, name and memory_mib")
            wrong = not isinstance(value, kind) or isinstance(value, bool)
            if wrong or (kind is str and not value.strip()) or (kind is int and value < 0):
                what = "a non-empty string" if kind is str else "a whole number >= 0"
                raise BadInput(f"{where}: {field!r} must be {what}, found {value!r}")
        if not isinstance(entry.get("mig", False), bool):
            raise BadInput(f"{where}: 'mig' must be true or false, found {entry['mig']!r}")
        try:
            validate_uuid(entry["uuid"])
        except ValueError as e:
            raise BadInput(f"{where}: {e}")
        gpus.append({"index": entry["index"], "uuid": entry["uuid"], "name": entry["name"],
                     "memory_mib": entry["memory_mib"], "mig": entry.get("mig", False)})
        if isinstance(entry.get("compute_mode"), int) and not isinstance(entry["compute_mode"], bool):
            gpus[-1]["compute_mode"] = entry["compute_mode"]
        for key in ("driver", "cuda", "compute"):
            if isinstance(entry.get(key), str) and entry[key]:
                extra.setdefault(f"{GPU_LABEL_PREFIX}{key}", entry[key])
    _check_unique(gpus, path, BadInput)
    return gpus, extra


def detect_with_nvml(warnings: list[str]) -> tuple[list[dict], dict]:
    try:
        nvml = Nvml()
    except NvmlMissing as e:
        raise _NvmlMissing(str(e))
    except NvmlFailed as e:
        raise DetectionFailed(str(e))
    try:
        devices = nvml.devices(warnings)
        gpus = [nvml.describe(device) for device in devices]
        system = nvml.system(devices[0] if devices else None)
        extra = {GPU_DRIVER_LABEL: system.get("driver"), GPU_CUDA_LABEL: system.get("cuda"),
                 GPU_COMPUTE_LABEL: system.get("compute")}
        for gpu in gpus:
            validate_uuid(gpu["uuid"])
        _check_unique(gpus, "NVML", DetectionFailed)
        return gpus, {k: v for k, v in extra.items() if v}
    except nvml.Error as e:
        raise DetectionFailed(f"NVML query failed: {e}")
    except ValueError as e:
        raise DetectionFailed(f"NVML returned unusable data: {e}")
    finally:
        failed = nvml.close()
        if failed:
            warnings.append(f"nvmlShutdown failed ({failed}); harmless, the process exits next")


def detect_with_nvidia_smi(smi: str) -> list[dict]:
    cmd = [smi, "--query-gpu=index,uuid,name,memory.total", "--format=csv,noheader,nounits"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise DetectionFailed(f"{smi} could not run: {e}")
    if done.returncode != 0:
        if "No devices were found" in done.stdout + done.stderr:
            return []  # a driver without GPUs (e.g. a GPU AMI on a CPU instance)
        raise DetectionFailed(f"{smi} exited {done.returncode}: {(done.stderr or done.stdout).strip()}")
    gpus = []
    for row in csv.reader(io.StringIO(done.stdout), skipinitialspace=True):
        if not row:
            continue
        try:
            index, uuid, name, memory = row
            gpus.append({"index": int(index), "uuid": validate_uuid(uuid.strip()), "name": name.strip(),
                         "memory_mib": int(float(memory)), "mig": False})
        except ValueError as e:
            raise DetectionFailed(f"{smi} printed an unexpected line {','.join(row)!r}: {e}")
    _check_unique(gpus, smi, DetectionFailed)
    return gpus


def detect_gpus(warnings: list[str]) -> tuple[list[dict], dict]:
    """NVML first, nvidia-smi second; no driver at all means no GPUs, not a failure."""
    try:
        return detect_with_nvml(warnings)
    except _NvmlMissing as e:
        nvml_missing, nvml_failure = str(e), None
    except DetectionFailed as e:
        nvml_missing, nvml_failure = None, str(e)
    smi = shutil.which("nvidia-smi")
    if smi is None:
        if nvml_failure:
            raise DetectionFailed(f"{nvml_failure}; there is no nvidia-smi on PATH to fall back to. "
                                  "Check the NVIDIA driver (dmesg, nvidia-smi) and reboot or reinstall it")
        warnings.append(f"no NVIDIA driver found: {nvml_missing} and there is no nvidia-smi on PATH; "
                        "this node advertises no GPUs")
        return [], {}
    warnings.append(f"{nvml_failure or 'NVML is unavailable: ' + nvml_missing}; read the GPUs from {smi} "
                    "instead, which cannot see MIG devices or the driver/CUDA labels")
    try:
        return detect_with_nvidia_smi(smi), {}
    except DetectionFailed as e:
        raise DetectionFailed(f"{nvml_failure or nvml_missing}; the nvidia-smi fallback failed too: {e}. "
                              "Check the NVIDIA driver (dmesg, nvidia-smi) and reboot or reinstall it")


def gpu_labels(gpus: list[dict], extra: dict, warnings: list[str]) -> dict:
    """Engine labels named like gpu-feature-discovery's; they describe GPU 0 of the node."""
    if not gpus:
        return {}
    if len({(g["name"], g["memory_mib"]) for g in gpus}) > 1:
        warnings.append(f"this node's GPUs differ; {GPU_PRODUCT_LABEL} and {GPU_MEMORY_LABEL} describe the first one")
    labels = {GPU_COUNT_LABEL: str(len(gpus)), GPU_PRODUCT_LABEL: gpus[0]["name"].strip().replace(" ", "-"),
              GPU_MEMORY_LABEL: str(gpus[0]["memory_mib"])}
    for key in (GPU_DRIVER_LABEL, GPU_CUDA_LABEL, GPU_COMPUTE_LABEL):
        if extra.get(key):
            labels[key] = extra[key]
    return labels


def json_type(value) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}
    return names.get(type(value), "a number")


