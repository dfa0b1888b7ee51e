#!/usr/bin/env python3
"""Boot-time GPU agent for gpu-swarm nodes.

Asks NVML which GPUs this node has, then writes the Docker daemon.json and the
nvidia-container-toolkit config.toml that make swarm schedule each GPU as a
generic resource and hand a task only the GPU it was given. It runs before
docker at every boot (gpu-swarm-agent.service), so a node that comes back on
other hardware or another driver advertises what it really has.
Stdlib plus pynvml (package nvidia-ml-py) only. The rest of the project imports
DEFAULT_KIND, validate_kind, resource_env_name and resource_entries from here.

Exit codes: 0 done; 1 a file could not be read or written; 2 bad input
(nothing was written); 3 NVML or nvidia-smi present but failing.
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile

DEFAULT_KIND = "NVIDIA-GPU"
DEFAULT_DAEMON_JSON = "/etc/docker/daemon.json"
DEFAULT_TOOLKIT_CONFIG = "/etc/nvidia-container-runtime/config.toml"
DEFAULT_RUNTIME_PATH = "nvidia-container-runtime"
# nvidia-container-toolkit 1.18.0-1.18.2 default to jit-cdi mode, which ignores
# swarm-resource so every task sees every GPU (toolkit#1599, fixed in 1.19.0).
TOOLKIT_JIT_CDI_TRAP = ((1, 18, 0), (1, 18, 2))

_KIND_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")
_HEX_UUID = "[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"
_UUID_RE = re.compile(rf"GPU-{_HEX_UUID}|MIG-{_HEX_UUID}|MIG-GPU-{_HEX_UUID}/\d+/\d+")
_SECTION_RE = re.compile(r"\s*\[\[?[^\[\]=]+\]\]?\s*(#.*)?$")  # a [table] or [[array]] header
_SWARM_KEY_RE = re.compile(r"""\s*["']?swarm-resource["']?\s*=""")
_SWARM_COMMENT_RE = re.compile(r"\s*#\s*swarm-resource\s*=")
_MODE_KEY_RE = re.compile(r"""\s*["']?mode["']?\s*=""")
_RUNTIME_SECTION_RE = re.compile(r"""\s*\[\s*["']?nvidia-container-runtime["']?\s*\]\s*(#.*)?$""")


class BadInput(Exception):
    """Input a person must fix: exit 2, nothing written."""


class DetectionFailed(Exception):
    """NVML or nvidia-smi exists but does not work: exit 3."""


class _NvmlMissing(Exception):
    """There is no NVML to ask (no pynvml, or no libnvidia-ml): not an error by itself."""


def validate_kind(kind: str) -> str:
    """Return kind if it is a usable swarm generic-resource kind, else raise ValueError."""
    if not isinstance(kind, str) or not _KIND_RE.fullmatch(kind):
        raise ValueError(
            f"invalid GPU resource kind {kind!r}: expected 1-64 letters, digits, '-' or '_' "
            f"(for example {DEFAULT_KIND}); choose such a name, since it becomes the "
            "generic-resource name services reserve and the DOCKER_RESOURCE_<KIND> variable")
    return kind


def resource_env_name(kind: str) -> str:
    """The variable swarm sets in a task with the UUIDs it assigned (swarmkit EnvFormat)."""
    return "DOCKER_RESOURCE_" + validate_kind(kind).upper()


def validate_uuid(uuid: object) -> str:
    if not isinstance(uuid, str) or not _UUID_RE.fullmatch(uuid):
        raise ValueError(
            f"GPU UUID {uuid!r} is not a full UUID: expected GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx "
            "or MIG-... (see nvidia-smi -L); current toolkits refuse truncated UUIDs such as "
            "GPU-be74ca1f, so give the whole UUID")
    return uuid


def resource_entries(kind: str, uuids) -> list[str]:
    """The daemon.json node-generic-resources entries: one KIND=UUID per device."""
    kind = validate_kind(kind)
    return [f"{kind}={validate_uuid(uuid)}" for uuid in uuids]


def _text(value) -> str:
    # nvidia-ml-py returns str; older pynvml releases returned bytes.
    return value.decode() if isinstance(value, bytes) else str(value)


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
        raise BadInput(f"{path}: expected a JSON list of GPUs, found {_json_type(data)}; wrap the entries in [...]")
    gpus, extra = [], {}
    for n, entry in enumerate(data):
        where = f"{path}: GPU entry {n}"
        if not isinstance(entry, dict):
            raise BadInput(f"{where}: expected an object, found {_json_type(entry)}")
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
        for key in ("driver", "cuda", "compute"):
            if isinstance(entry.get(key), str) and entry[key]:
                extra.setdefault(f"gpu.{key}", entry[key])
    _check_unique(gpus, path, BadInput)
    return gpus, extra


def detect_with_nvml(warnings: list[str]) -> tuple[list[dict], dict]:
    try:
        import pynvml  # imported here so the module (and --inventory) works without it
    except ImportError as e:
        raise _NvmlMissing(f"pynvml is not importable ({e})")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        if isinstance(e, getattr(pynvml, "NVMLError_LibraryNotFound", ())):
            raise _NvmlMissing("libnvidia-ml.so.1 was not found (no NVIDIA driver installed)")
        raise DetectionFailed(f"NVML initialisation failed: {e}")
    try:
        gpus: list[dict] = []
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        for index, handle in enumerate(handles):
            if not _mig_enabled(pynvml, handle):
                gpus.append(_nvml_device(pynvml, handle, index, mig=False))
                continue
            before = len(gpus)
            for slot in range(pynvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
                try:
                    mig_handle = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
                except pynvml.NVMLError_NotFound:
                    continue  # an empty slot: no MIG device was created there
                gpus.append(_nvml_device(pynvml, mig_handle, index, mig=True))
            if len(gpus) == before:
                warnings.append(f"GPU {index} is in MIG mode but has no MIG devices; it advertises nothing "
                                "until MIG instances are created (or MIG mode is turned off)")
        extra = {"gpu.driver": _optional(pynvml, pynvml.nvmlSystemGetDriverVersion)}
        cuda = (_optional(pynvml, getattr(pynvml, "nvmlSystemGetCudaDriverVersion_v2", None))
                or _optional(pynvml, pynvml.nvmlSystemGetCudaDriverVersion))
        if cuda:  # NVML encodes 13.0 as 13000
            extra["gpu.cuda"] = f"{int(cuda) // 1000}.{int(cuda) % 1000 // 10}"
        if gpus:
            capability = _optional(pynvml, pynvml.nvmlDeviceGetCudaComputeCapability, handles[gpus[0]["index"]])
            if capability:
                extra["gpu.compute"] = f"{capability[0]}.{capability[1]}"
        for gpu in gpus:
            validate_uuid(gpu["uuid"])
        _check_unique(gpus, "NVML", DetectionFailed)
        return gpus, {k: _text(v) for k, v in extra.items() if v}
    except pynvml.NVMLError as e:
        raise DetectionFailed(f"NVML query failed: {e}")
    except ValueError as e:
        raise DetectionFailed(f"NVML returned unusable data: {e}")
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError as e:
            warnings.append(f"nvmlShutdown failed ({e}); harmless, the process exits next")


def _mig_enabled(pynvml, handle) -> bool:
    try:
        current, _pending = pynvml.nvmlDeviceGetMigMode(handle)
    except (pynvml.NVMLError_NotSupported, pynvml.NVMLError_FunctionNotFound):
        return False  # a GPU (or driver) without MIG
    return current == getattr(pynvml, "NVML_DEVICE_MIG_ENABLE", 1)


def _nvml_device(pynvml, handle, index: int, mig: bool) -> dict:
    return {"index": index, "uuid": _text(pynvml.nvmlDeviceGetUUID(handle)),
            "name": _text(pynvml.nvmlDeviceGetName(handle)),
            "memory_mib": int(pynvml.nvmlDeviceGetMemoryInfo(handle).total) // (1024 * 1024), "mig": mig}


def _optional(pynvml, call, *args):
    # Labels only describe the node: an older driver lacking a call must not cost it its GPUs.
    if call is None:
        return None
    try:
        return call(*args)
    except pynvml.NVMLError:
        return None


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
        warnings.append("this node's GPUs differ; gpu.product and gpu.memory describe the first one")
    labels = {"gpu.count": str(len(gpus)), "gpu.product": gpus[0]["name"].strip().replace(" ", "-"),
              "gpu.memory": str(gpus[0]["memory_mib"])}
    for key in ("gpu.driver", "gpu.cuda", "gpu.compute"):
        if extra.get(key):
            labels[key] = extra[key]
    return labels


def _json_type(value) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}
    return names.get(type(value), "a number")


def read_daemon_json(path: str) -> dict | None:
    """The current daemon.json, None when absent; BadInput (never a rewrite) when unusable."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return None
    fix = "the file was left untouched; fix it (or move it away) and run the agent again"
    try:
        text = raw.decode("utf-8")
        config = json.loads(text) if text.strip() else {}  # dockerd accepts an empty file too
    except (UnicodeDecodeError, ValueError) as e:
        raise BadInput(f"{path}: not valid JSON ({e}); {fix}")
    if not isinstance(config, dict):
        raise BadInput(f"{path}: expected a JSON object at the top level, found {_json_type(config)}; {fix}")
    for key, kind in (("node-generic-resources", list), ("labels", list), ("runtimes", dict),
                      ("default-runtime", str)):
        if key in config and not isinstance(config[key], kind):
            raise BadInput(f"{path}: {key!r} must be {_json_type(kind())}, found {_json_type(config[key])}; {fix}")
    for key in ("node-generic-resources", "labels"):
        if not all(isinstance(item, str) for item in config.get(key, [])):
            raise BadInput(f"{path}: {key!r} must be a list of \"key=value\" strings; {fix}")
    nvidia = config.get("runtimes", {}).get("nvidia", {})
    if not isinstance(nvidia, dict) or not isinstance(nvidia.get("path", ""), str):
        raise BadInput(f"{path}: runtimes.nvidia must be an object with a string \"path\"; {fix}")
    return config


def merge_daemon_config(config: dict, kind: str, gpus: list[dict], labels: dict,
                        set_runtime: bool, warnings: list[str]) -> dict:
    """config with the agent's keys set; every other key kept as it was, in order."""
    new = json.loads(json.dumps(config))  # a deep copy that keeps key order
    if gpus:
        new["node-generic-resources"] = resource_entries(kind, [g["uuid"] for g in gpus])
    else:
        new.pop("node-generic-resources", None)
    if "labels" in new or labels:
        kept = [label for label in new.get("labels", []) if not label.split("=", 1)[0].startswith("gpu.")]
        new["labels"] = kept + [f"{key}={value}" for key, value in labels.items()]
    if gpus and set_runtime:
        runtimes = new.setdefault("runtimes", {})
        runtimes.setdefault("nvidia", {"path": DEFAULT_RUNTIME_PATH, "runtimeArgs": []})
        runtimes["nvidia"].setdefault("path", DEFAULT_RUNTIME_PATH)
        if new.get("default-runtime", "nvidia") != "nvidia":
            warnings.append(f"default-runtime was {new['default-runtime']!r}; set it to 'nvidia' because "
                            "swarm services cannot choose a runtime")
        new["default-runtime"] = "nvidia"
    return new


def edit_toolkit_config(text: str, env_name: str, legacy_mode: bool, warnings: list[str]) -> str:
    """config.toml with a top-level swarm-resource (and mode = "legacy" when asked).

    Edited as lines, not parsed, so comments and layout survive byte for byte. A
    commented-out #swarm-resource line is kept as the packaged file has it, and the
    real key goes right below it. A swarm-resource inside a [section] is ignored by
    the runtime, so it is moved to the top level.
    """
    want = f'swarm-resource = "{env_name}"\n'
    lines, section = [], None
    for line in text.splitlines(keepends=True):
        if _SECTION_RE.match(line):
            section = line.strip()
        elif section and _SWARM_KEY_RE.match(line):
            warnings.append(f"removed swarm-resource from {section} in the toolkit config, where the runtime "
                            "ignores it; it is set at the top level instead")
            continue
        lines.append(line)
    top_end = next((i for i, line in enumerate(lines) if _SECTION_RE.match(line)), len(lines))
    keys = [i for i in range(top_end) if _SWARM_KEY_RE.match(lines[i])]
    if keys:
        lines[keys[0]] = want
        for i in reversed(keys[1:]):  # a duplicate key would make the TOML invalid
            del lines[i]
    else:
        comments = [i for i in range(top_end) if _SWARM_COMMENT_RE.match(lines[i])]
        settings = [i for i in range(top_end) if lines[i].strip() and not lines[i].lstrip().startswith("#")]
        anchor = (comments or settings or [None])[-1]
        if anchor is None:  # no top-level content: go first, a blank line before any section
            _insert(lines, 0, [want, "\n"] if lines else [want])
        else:
            _insert(lines, anchor + 1, [want])
    if legacy_mode:
        _set_legacy_mode(lines)
    return "".join(lines)


def _insert(lines: list[str], at: int, new: list[str]) -> None:
    if at > 0 and not lines[at - 1].endswith("\n"):
        lines[at - 1] += "\n"
    lines[at:at] = new


def _set_legacy_mode(lines: list[str]) -> None:
    header = next((i for i, line in enumerate(lines) if _RUNTIME_SECTION_RE.match(line)), None)
    if header is None:
        _insert(lines, len(lines), (["\n"] if lines else []) + ["[nvidia-container-runtime]\n", 'mode = "legacy"\n'])
        return
    end = next((i for i in range(header + 1, len(lines)) if _SECTION_RE.match(lines[i])), len(lines))
    for i in range(header + 1, end):
        if _MODE_KEY_RE.match(lines[i]):
            indent = lines[i][: len(lines[i]) - len(lines[i].lstrip())]
            lines[i] = f'{indent}mode = "legacy"\n'
            return
    _insert(lines, header + 1, ['mode = "legacy"\n'])


def read_toolkit_config(path: str) -> str | None:
    """The config's text; "" when the toolkit is installed without one; None when not installed."""
    if not os.path.exists(path):
        return "" if os.path.isdir(os.path.dirname(os.path.abspath(path))) else None
    try:
        with open(path, "rb") as f:
            return f.read().decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadInput(f"{path}: not UTF-8 text ({e}); the file was left untouched, fix it")


def toolkit_version(override: str | None, warnings: list[str]) -> tuple[int, ...] | None:
    text = override
    if text is None:
        ctk = shutil.which("nvidia-ctk")
        if ctk is None:
            warnings.append("nvidia-ctk is not on PATH, so the toolkit version is unknown; toolkit "
                            "1.18.0-1.18.2 ignores swarm-resource unless mode = \"legacy\" (use >= 1.19)")
            return None
        try:
            done = subprocess.run([ctk, "--version"], capture_output=True, text=True, timeout=30)
            text = done.stdout + done.stderr
        except (OSError, subprocess.TimeoutExpired) as e:
            warnings.append(f"could not run {ctk} --version ({e}); the toolkit version is unknown")
            return None
    match = re.search(r"(\d+)\.(\d+)\.(\d+)", text)
    if match is None:
        if override is not None:
            raise BadInput(f"--toolkit-version {override!r}: expected a version such as 1.19.0")
        warnings.append(f"could not read a version from nvidia-ctk --version output {text.strip()!r}")
        return None
    return tuple(int(part) for part in match.groups())


def write_atomic(path: str, data: bytes) -> None:
    """Replace path with data via a temp file in the same dir, keeping its mode and owner."""
    path = os.path.realpath(path)  # a symlinked daemon.json stays a symlink
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    try:
        st = os.stat(path)
        mode, owner = stat.S_IMODE(st.st_mode), (st.st_uid, st.st_gid)
    except FileNotFoundError:
        mode, owner = 0o644, None  # mkstemp's 0600 would hide daemon.json from non-root tools
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        if owner and owner != (os.getuid(), os.getgid()):
            os.chown(tmp, *owner)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself survive a power cut
    finally:
        os.close(dir_fd)


def run(args: argparse.Namespace, warnings: list[str]) -> dict:
    """Validate everything, then detect, then write; returns the report."""
    try:
        kind = validate_kind(args.kind)
    except ValueError as e:
        raise BadInput(f"--kind: {e}")
    gpus, extra = load_inventory(args.inventory) if args.inventory else (None, {})
    old_daemon = read_daemon_json(args.daemon_json)
    toolkit_text = read_toolkit_config(args.toolkit_config)
    legacy_mode = False
    if toolkit_text is not None:
        version = toolkit_version(args.toolkit_version, warnings)
        if version and TOOLKIT_JIT_CDI_TRAP[0] <= version <= TOOLKIT_JIT_CDI_TRAP[1]:
            legacy_mode = True
            warnings.append(f"nvidia-container-toolkit {'.'.join(map(str, version))} ignores swarm-resource "
                            "in its default jit-cdi mode (toolkit#1599); set mode = \"legacy\". Upgrade to >= 1.19")
    if gpus is None:
        gpus, extra = detect_gpus(warnings)
    if not gpus:
        warnings.append("no GPUs found: removing node-generic-resources and gpu.* labels from daemon.json")
    labels = gpu_labels(gpus, extra, warnings)

    new_daemon = merge_daemon_config(old_daemon or {}, kind, gpus, labels, not args.no_runtime, warnings)
    plans = {}
    # Compared as data, so a hand-formatted file that already says the right thing is
    # not rewritten (nor docker restarted); a missing one with nothing to say stays missing.
    if new_daemon != old_daemon and (old_daemon is not None or new_daemon):
        plans["daemon_json"] = (args.daemon_json, json.dumps(new_daemon, indent=2, ensure_ascii=False) + "\n")
    files = {"daemon_json": "unchanged", "toolkit_config": "unchanged"}
    if toolkit_text is None:
        files["toolkit_config"] = "absent"
        warnings.append(f"{os.path.dirname(args.toolkit_config)} does not exist: nvidia-container-toolkit is "
                        "not installed, so swarm-resource was not set and tasks would see every GPU")
    else:
        new_toolkit = edit_toolkit_config(toolkit_text, resource_env_name(kind), legacy_mode, warnings)
        if new_toolkit != toolkit_text:
            plans["toolkit_config"] = (args.toolkit_config, new_toolkit)
    for name, (path, content) in plans.items():
        if args.dry_run:
            files[name] = "would-change"
        else:
            write_atomic(path, content.encode("utf-8"))
            files[name] = "written"
    return {"gpus": gpus, "resources": resource_entries(kind, [g["uuid"] for g in gpus]), "labels": labels,
            "changed": bool(plans), "files": files, "warnings": warnings}


def parse_args(argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Advertise this node's GPUs to Docker Swarm: writes daemon.json and the "
                    "nvidia-container-toolkit config. Exit 0 ok, 1 I/O error, 2 bad input "
                    "(nothing written), 3 NVML/nvidia-smi failing.",
        epilog="The report's \"changed\" is true when a file was written (with --dry-run: would be).")
    parser.add_argument("--daemon-json", default=DEFAULT_DAEMON_JSON, metavar="PATH",
                        help=f"Docker daemon config to merge into (default {DEFAULT_DAEMON_JSON})")
    parser.add_argument("--toolkit-config", default=DEFAULT_TOOLKIT_CONFIG, metavar="PATH",
                        help=f"nvidia-container-toolkit config (default {DEFAULT_TOOLKIT_CONFIG})")
    parser.add_argument("--kind", default=DEFAULT_KIND, metavar="NAME",
                        help=f"generic-resource kind services reserve (default {DEFAULT_KIND})")
    parser.add_argument("--inventory", metavar="FILE",
                        help="read GPUs from a JSON list instead of NVML (simulated GPUs; NVML is not touched)")
    parser.add_argument("--no-runtime", action="store_true",
                        help="for simulated GPUs: advertise resources but do not set the nvidia runtime")
    parser.add_argument("--toolkit-version", metavar="X.Y.Z",
                        help="assume this nvidia-container-toolkit version instead of asking nvidia-ctk")
    parser.add_argument("--dry-run", action="store_true", help="write nothing; show what would change")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    warnings: list[str] = []
    try:
        report = run(args, warnings)
    except BadInput as e:
        print(f"gpu-swarm agent: {e}", file=sys.stderr)
        return 2
    except DetectionFailed as e:
        print(f"gpu-swarm agent: {e}", file=sys.stderr)
        return 3
    except OSError as e:
        print(f"gpu-swarm agent: {e.filename or ''}: {e.strerror or e}; nothing was finished, run again "
              "once the file can be read and written", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    print(f"{len(report['gpus'])} GPU device(s): " + ", ".join(report["resources"] or ["none"]))
    print("labels: " + (" ".join(f"{k}={v}" for k, v in report["labels"].items()) or "none"))
    for name, path in (("daemon_json", args.daemon_json), ("toolkit_config", args.toolkit_config)):
        print(f"{path}: {report['files'][name]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
