#!/usr/bin/python3 -I
"""The `create` step of the rehearsal's nvidia-container-runtime stand-in (see nvidia-container-runtime).

The container's GPUs are chosen as the real toolkit chooses them: the first variable named by
the top-level `swarm-resource` key of the toolkit config that is set in the container's
environment, else NVIDIA_VISIBLE_DEVICES. A value is `all`, `void`/`none`/empty (no GPU), or a
comma-separated list of GPU UUIDs or indexes. For each GPU the container gets what the toolkit
gives it, minus the driver's libraries: /dev/nvidia<minor> (a bind mount of /dev/null: there is
no device to open) and, read-only at the driver's path /usr/bin/nvidia-smi, an nvidia-smi that
lists exactly those GPUs. An unknown GPU stops the container, as the toolkit's does. Then runc
runs the same call. Stdlib, and the guard's (node/gpu_guard.py) reading of runc's arguments.
"""
from __future__ import annotations

import json
import os
import sys

_HERE = os.path.dirname(os.path.realpath(__file__))
# The guard and this stand-in read the same runc call: one copy, the guard's. In the image it is
# installed beside this file (STANDINS' node_files); in a checkout it is in node/.
sys.path[:0] = [_HERE, os.path.join(os.path.dirname(os.path.dirname(_HERE)), "node")]
import hardware  # noqa: E402  (beside this file in /usr/lib/gpu-swarm-rehearsal)
from gpu_guard import bundle_of, report_error as log_error  # noqa: E402

TOOLKIT_CONFIG = os.environ.get("GPU_SWARM_REHEARSAL_TOOLKIT_CONFIG", "/etc/nvidia-container-runtime/config.toml")
VISIBLE = "NVIDIA_VISIBLE_DEVICES"
NO_GPU = ("", "void", "none")


class DeviceError(Exception):
    """The container asked for a GPU this machine does not have."""


def swarm_resource_names(toml: str) -> list[str]:
    """The top-level swarm-resource key's names; under a [section] the toolkit ignores it (FACTS)."""
    for line in toml.splitlines():
        line = line.strip()
        if line.startswith("["):
            break
        key, sep, value = line.partition("=")
        if sep and key.strip().strip("\"'") == "swarm-resource":
            value = value.split("#", 1)[0].strip().strip("\"'")
            return [name.strip() for name in value.split(",") if name.strip()]
    return []


def requested(env: list[str], names: list[str]) -> str | None:
    """The device list the toolkit reads: the first swarm-resource variable set, else NVIDIA_VISIBLE_DEVICES."""
    values = {}
    for entry in env:
        key, sep, value = entry.partition("=")
        if sep:
            values[key] = value  # the last one wins, as in execve
    for name in names:
        if name in values:
            return values[name]
    return values.get(VISIBLE)


def select(value: str | None, gpus: list[dict]) -> list[dict]:
    """The GPUs a device list names; `all` is every GPU the driver sees."""
    value = (value or "").strip()
    if value in NO_GPU:
        return []
    if value == "all":
        return gpus
    chosen = []
    for item in (part.strip() for part in value.split(",") if part.strip()):
        match = [g for g in gpus if g["uuid"] == item or (item.isdigit() and g["index"] == int(item))]
        if not match:
            raise DeviceError(f"nvidia-container-cli: device error: {item}: unknown device")
        if match[0] not in chosen:
            chosen.append(match[0])
    return chosen


def inject(spec: dict, bundle: str, gpus: list[dict], driver: str) -> dict:
    """spec with the GPUs' device nodes and their nvidia-smi mounted in."""
    if not gpus:
        return spec
    smi = os.path.join(bundle, "nvidia-smi")
    with open(smi, "w", encoding="utf-8") as f:
        f.write(hardware.smi_script(gpus, driver))
    os.chmod(smi, 0o755)
    mounts = spec.setdefault("mounts", [])
    mounts.append({"destination": "/usr/bin/nvidia-smi", "type": "bind", "source": smi,
                   "options": ["bind", "ro", "nosuid", "nodev"]})
    for gpu in gpus:
        mounts.append({"destination": f"/dev/nvidia{gpu['minor']}", "type": "bind", "source": "/dev/null",
                       "options": ["bind", "rw", "nosuid", "noexec"]})
    return spec


def report_error(args: list[str], message: str) -> None:
    """Where containerd reads a runtime's error (runc's --log file), and on stderr."""
    print(message, file=sys.stderr)
    log_error(args, message)


def main(args: list[str]) -> int:
    try:
        bundle = bundle_of(args)
        path = os.path.join(bundle, "config.json")
        with open(path, encoding="utf-8") as f:
            spec = json.load(f)
        try:
            with open(TOOLKIT_CONFIG, encoding="utf-8") as f:
                names = swarm_resource_names(f.read())
        except FileNotFoundError:
            names = []
        description = hardware.load()
        value = requested((spec.get("process") or {}).get("env") or [], names)
        gpus = select(value, hardware.present(description))
        if gpus:
            spec = inject(spec, bundle, gpus, description.get("driver", hardware.DEFAULT_DRIVER))
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(spec, f)
            os.replace(tmp, path)
    except DeviceError as e:
        report_error(args, str(e))
        return 1
    except (OSError, ValueError, KeyError, TypeError) as e:
        report_error(args, f"nvidia-container-runtime (rehearsal stand-in): cannot prepare this container "
                           f"({type(e).__name__}: {e})")
        return 1
    os.environ["PATH"] = os.environ.get("PATH", "/usr/bin:/bin") + ":/usr/sbin:/sbin"
    os.execvp("runc", ["runc", *args])
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
