"""The rehearsal's hardware stand-ins: what a GPU instance has and this machine cannot (no GPU, no
NVIDIA driver, no NVIDIA apt repository), played by small programs baked into the node image.

STANDINS is the one list of them, each with the reason it exists. All of them read one file
per machine, HARDWARE_FILE, which localswarm/machines.py writes at launch (format: pynvml.py's
docstring; a fault is a GPU's "fault" key). Everything else a machine runs is real.
"""
from __future__ import annotations

import base64
import hashlib
import io
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from swarm import node_contract

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
LIB = "/usr/lib/gpu-swarm-rehearsal"  # the stand-ins' own folder in the image; nothing of node/ writes there
HARDWARE_FILE = f"{LIB}/hardware.json"
WHEELHOUSE = node_contract.WHEELHOUSE  # the image carries the venv's wheels, as a baked AMI may (no index here)


@dataclass(frozen=True)
class Standin:
    name: str
    reason: str
    files: tuple[str, ...] = ()  # files of this folder, installed under LIB
    node_files: tuple[str, ...] = ()  # files of node/ it imports, installed under LIB beside it
    commands: tuple[str, ...] = ()  # of those, the ones on PATH (/usr/bin, where the real ones are)
    etc: tuple[tuple[str, str], ...] = ()  # (path in the image, file of this folder)
    units: tuple[str, ...] = ()  # systemd units among etc, enabled in the image


STANDINS = (
    Standin("NVML: pynvml, as the wheel nvidia-ml-py at node/versions.env's pin",
            "no driver here: NVML answers from the hardware file, so the GPU agent and the health watcher run "
            "unchanged in NVML mode; install-agent-venv.sh finds it under the pinned wheel's file name in the image's "
            "wheelhouse (node/contract.py's WHEELHOUSE), which spares it the download",
            files=("pynvml.py",)),
    Standin("nvidia-smi",
            "the driver's tool, which the node scripts and the agent's fallback ask: lists the hardware file's GPUs "
            "and sets their compute modes there (-c, as node/gpu-swarm-mps does), which NVML then reports",
            files=("nvidia-smi", "hardware.py"), commands=("nvidia-smi",)),
    Standin("nvidia-cuda-mps-control",
            "the driver's MPS control daemon, its utility and its server (the compute utilities): the wire recorded "
            "on driver 580 and the failure modes measured on an H200 (one connection at a time, no credential "
            "timeout, a server stuck by a dropped descriptor), so install-mps.sh, gpu-swarm-mps, its relay "
            "(node/mps_relay.py), the health watcher's probe and the agent's MPS slots run unchanged; the GPU "
            "benches' smoke modes run it too",
            files=("nvidia-cuda-mps-control",), commands=("nvidia-cuda-mps-control",)),
    Standin("nvidia-ctk 1.20.0",
            "the toolkit's CLI (no NVIDIA apt repository here); the image ships with the nvidia runtime "
            "registered in daemon.json, so install-container-toolkit.sh takes its skip path",
            files=("nvidia-ctk",), commands=("nvidia-ctk",),
            etc=(("/etc/nvidia-container-runtime/config.toml", "config.toml"),)),
    Standin("nvidia-container-runtime",
            "a runc wrapper that gives a container what the toolkit gives it for the GPUs its swarm-resource "
            "variable or NVIDIA_VISIBLE_DEVICES names: /dev/nvidiaN (a bind of /dev/null) and an nvidia-smi "
            "listing exactly those GPUs",
            files=("nvidia-container-runtime", "nvidia_container_runtime.py"), commands=("nvidia-container-runtime",),
            node_files=("gpu_guard.py", "guard_files.py")),  # the guard's runc-argument helpers, not a copy
    Standin("nvidia-fabricmanager",
            "NVSwitch types need it running; with no NVSwitch here it is a unit that stays up, so "
            "install-fabric-manager.sh takes its skip path",
            files=("nv-fabricmanager",), commands=("nv-fabricmanager",),
            etc=(("/usr/lib/systemd/system/nvidia-fabricmanager.service", "nvidia-fabricmanager.service"),),
            units=("nvidia-fabricmanager.service",)),
)


def source(name: str) -> bytes:
    """A stand-in file of this folder as installed: node/contract.py's names filled in, never copied."""
    sys.path.insert(0, str(REPO))
    from node.contract import MPS_TASK_DIR
    return (HERE / name).read_bytes().replace(b"@MPS_TASK_DIR@", MPS_TASK_DIR.encode())


def nvml_version() -> str:
    """The pin the node software installs (node/versions.env), read, never copied."""
    for line in (REPO / "node" / "versions.env").read_text().splitlines():
        if line.startswith("NVIDIA_ML_PY_VERSION="):
            return line.split("=", 1)[1].strip().strip("\"'")
    raise RuntimeError("node/versions.env has no NVIDIA_ML_PY_VERSION")


def nvml_wheel() -> tuple[str, bytes]:
    """The pynvml stand-in as the wheel nvidia-ml-py==<pin>: its file name and bytes, the same every time."""
    version = nvml_version()
    info = f"nvidia_ml_py-{version}.dist-info"
    files = {
        "pynvml.py": (HERE / "pynvml.py").read_bytes(),
        f"{info}/METADATA": (f"Metadata-Version: 2.1\nName: nvidia-ml-py\nVersion: {version}\n"
                             "Summary: gpu-swarm rehearsal stand-in for NVIDIA's NVML bindings (no GPU)\n").encode(),
        f"{info}/WHEEL": (b"Wheel-Version: 1.0\nGenerator: gpu-swarm-rehearsal\nRoot-Is-Purelib: true\n"
                          b"Tag: py3-none-any\n"),
        f"{info}/top_level.txt": b"pynvml\n",
    }
    record = "".join(f"{name},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},"
                     f"{len(data)}\n" for name, data in files.items()) + f"{info}/RECORD,,\n"
    files[f"{info}/RECORD"] = record.encode()
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as whl:
        for name, data in files.items():
            entry = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
            entry.external_attr = 0o644 << 16
            whl.writestr(entry, data)
    return f"nvidia_ml_py-{version}-py3-none-any.whl", buf.getvalue()


def image_files() -> dict[str, tuple[bytes, int]]:
    """Every stand-in file: path in the image -> (content, mode)."""
    files = {}
    for standin in STANDINS:
        for name in standin.files:
            executable = (HERE / name).stat().st_mode & 0o111
            files[f"{LIB}/{name}"] = (source(name), 0o755 if executable else 0o644)
        for name in standin.node_files:
            files[f"{LIB}/{name}"] = ((REPO / "node" / name).read_bytes(), 0o644)
        for path, name in standin.etc:
            files[path] = ((HERE / name).read_bytes(), 0o644)
    wheel, data = nvml_wheel()
    files[f"{WHEELHOUSE}/{wheel}"] = (data, 0o644)
    return files


def image_links() -> dict[str, str]:
    """Commands on PATH: /usr/bin/NAME -> LIB/NAME."""
    return {f"/usr/bin/{name}": f"{LIB}/{name}" for standin in STANDINS for name in standin.commands}


def image_units() -> list[str]:
    return [unit for standin in STANDINS for unit in standin.units]
