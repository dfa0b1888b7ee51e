#!/usr/bin/env python3
"""Boot-time GPU agent for gpu-swarm nodes.

Asks NVML which GPUs this node has (gpu_detect.py), then writes the Docker
daemon.json, the nvidia-container-toolkit config.toml and the runtime guard's
settings that make swarm schedule each GPU (or each slot of a shared GPU) as a
generic resource and hand a task only what it was given. It runs before docker
at every boot (gpu-swarm-agent.service), so a node that comes back on other
hardware or another driver advertises what it really has.
Stdlib plus pynvml (package nvidia-ml-py) only.

Exit codes: 0 done; 1 a file could not be read or written; 2 bad input
(nothing was written); 3 NVML or nvidia-smi present but failing.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys

from contract import (DOCKER_DAEMON_JSON, EFA_COUNT_LABEL, EFA_KIND, EFA_LABEL_PREFIX, EFA_SYSFS, GPU_LABEL_PREFIX,
                      GPU_REPLICAS_LABEL, GPU_SHARING_LABEL, GUARD_LEDGER_PATH, GUARD_PATH, GUARD_SERVER_DIR, KIND_ENV,
                      MPS_DIR, RUNTIME_EFA_DEVICES_KEY, RUNTIME_EFA_KIND_KEY, RUNTIME_ENV_PATH, SHARED_KIND_ENV,
                      SHARING_MODE_ENV, SLOTS_PER_GPU_ENV, TOOLKIT_CONFIG)
from daemon_json import locked, read_daemon_json, set_labels, write_atomic
from efa_detect import efa_labels, efa_resources, efa_verbs
from gpu_detect import BadInput, DetectionFailed, detect_gpus, gpu_labels, load_inventory
from gpu_resources import (DEFAULT_KIND, MAX_SLOTS_PER_GPU, SHARING_MODES, default_shared_kind, mps_slot_memory_mib,
                           mps_thread_percent, resource_entries, resource_env_name, slot_entries, validate_kind)

DEFAULT_RUNTIME_PATH = "nvidia-container-runtime"
# The runtime guard (gpu-swarm-runtime + gpu_guard.py, beside this file on a node): the
# default runtime, in front of nvidia-container-runtime. Swarm services cannot pick a
# runtime, so the default is what every task gets.
GUARD_RUNTIME = "gpu-swarm"
COMPUTE_MODE_DEFAULT = 0  # NVML_COMPUTEMODE_DEFAULT: several processes may share the GPU
# NVML_COMPUTEMODE_EXCLUSIVE_PROCESS: one process only, which on an MPS pool is the MPS server
# (gpu-swarm-mps sets it and starts the server): a task that left MPS could not take the GPU
# past its memory limit.
COMPUTE_MODE_EXCLUSIVE_PROCESS = 3
# The compute mode each sharing mode needs, and what to run when a GPU is in another.
SHARING_COMPUTE_MODE = {
    "time-slicing": (COMPUTE_MODE_DEFAULT, "Default", "run nvidia-smi -i <index> -c DEFAULT, or turn sharing off"),
    "mps": (COMPUTE_MODE_EXCLUSIVE_PROCESS, "Exclusive_Process",
            "gpu-swarm-mps.service sets it and starts the GPU's MPS daemon: systemctl restart gpu-swarm-mps"),
}
# nvidia-container-toolkit 1.18.0-1.18.2 default to jit-cdi mode, which ignores
# swarm-resource so every task sees every GPU (toolkit#1599, fixed in 1.19.0).
TOOLKIT_JIT_CDI_TRAP = ((1, 18, 0), (1, 18, 2))

_SECTION_RE = re.compile(r"\s*\[\[?[^\[\]=]+\]\]?\s*(#.*)?$")  # a [table] or [[array]] header
_SWARM_KEY_RE = re.compile(r"""\s*["']?swarm-resource["']?\s*=""")
_SWARM_COMMENT_RE = re.compile(r"\s*#\s*swarm-resource\s*=")
_MODE_KEY_RE = re.compile(r"""\s*["']?mode["']?\s*=""")
_RUNTIME_SECTION_RE = re.compile(r"""\s*\[\s*["']?nvidia-container-runtime["']?\s*\]\s*(#.*)?$""")


def merge_daemon_config(config: dict, resources: list[str], labels: dict, guard: dict | None,
                        warnings: list[str]) -> dict:
    """config with the agent's keys set; every other key kept as it was, in order.

    guard: {"path", "config"} of the runtime guard to make the default runtime, or None.
    """
    new = json.loads(json.dumps(config))  # a deep copy that keeps key order
    if resources:
        new["node-generic-resources"] = resources
    else:
        new.pop("node-generic-resources", None)
    if "labels" in new or labels:
        current = new.get("labels", [])
        for prefix in (GPU_LABEL_PREFIX, EFA_LABEL_PREFIX):  # the agent's labels: gpu.* and efa.*
            current = set_labels(current, prefix, {k: v for k, v in labels.items() if k.startswith(prefix)})
        new["labels"] = current
    if resources and guard:
        runtimes = new.setdefault("runtimes", {})
        # nvidia stays registered for `docker run --runtime=nvidia`; tasks get the guard.
        runtimes.setdefault("nvidia", {"path": DEFAULT_RUNTIME_PATH, "runtimeArgs": []})
        runtimes["nvidia"].setdefault("path", DEFAULT_RUNTIME_PATH)
        # With runtimeArgs, dockerd runs a runtime through a /bin/sh wrapper it writes (moby
        # daemon/runtime_unix.go): one more shell on each of a container's runtime calls. The
        # runtime reads its settings from RUNTIME_ENV_PATH without being told.
        runtimes[GUARD_RUNTIME] = {"path": guard["path"]} if guard["config"] == RUNTIME_ENV_PATH else \
            {"path": guard["path"], "runtimeArgs": ["--gpu-swarm-config", guard["config"]]}
        if new.get("default-runtime", GUARD_RUNTIME) not in (GUARD_RUNTIME, "nvidia"):
            warnings.append(f"default-runtime was {new['default-runtime']!r}; set it to {GUARD_RUNTIME!r} because "
                            "swarm services cannot choose a runtime, and tasks must get only the GPUs they reserved")
        new["default-runtime"] = GUARD_RUNTIME
    return new


def runtime_settings(*, kind: str, shared_kind: str, slots: int, gpus: list[dict], guard: str, delegate: str,
                     allow_docker_run_gpus: bool, ledger: str = GUARD_LEDGER_PATH, mode: str = "time-slicing",
                     mps_dir: str = MPS_DIR, server: str = GUARD_SERVER_DIR, efa: dict | None = None) -> str:
    """The guard's runtime.env: read by its sh front (sourced) and by gpu_guard.py. efa: the advertised
    EFA devices' verbs nodes (efa_detect.efa_verbs); none: no EFA keys, as before EFA was given."""
    python = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable
    values = {
        "DELEGATE": delegate,
        "GUARD": os.path.join(os.path.dirname(guard), "gpu_guard.py"),
        "GUARD_PYTHON": python,
        "KIND": kind,
        "SHARED_KIND": shared_kind if slots else "",
        "SLOTS_PER_GPU": str(slots),
        "GPUS": ",".join(g["uuid"] for g in gpus),
        "ALLOW_DOCKER_RUN_GPUS": "true" if allow_docker_run_gpus else "false",
        "LEDGER": ledger,
        "GUARD_SERVER": server,  # where guard_server.py listens; while it does not, the runtime runs the guard
    }
    if slots and mode == "mps":
        values.update({
            "SHARING": "mps",
            "MPS_DIR": mps_dir,
            # The node's smallest GPU sets every slot's share: a slot's value names its GPU, but
            # a stack asks for a share of "a GPU of this pool".
            "MPS_MEMORY_MIB": str(mps_slot_memory_mib(min(g.get("memory_mib") or 0 for g in gpus), slots)),
            "MPS_THREAD_PERCENT": str(mps_thread_percent(slots)),
        })
    if efa:
        values[RUNTIME_EFA_KIND_KEY] = EFA_KIND
        values[RUNTIME_EFA_DEVICES_KEY] = ",".join(f"{name}:{path}" for name, path in sorted(efa.items()))
    for key, value in values.items():
        if not re.fullmatch(r"[A-Za-z0-9_./:,=+-]*", value):
            raise BadInput(f"{key}={value!r} cannot be written to the runtime settings safely")
    return "# Written by gpu-swarm's GPU agent at every boot; read by gpu-swarm-runtime.\n" + \
        "".join(f"{k}={v}\n" for k, v in values.items())


def advertised(kind: str, shared_kind: str, slots: int, gpus: list[dict], warnings: list[str],
               mode: str = "time-slicing") -> tuple[list, dict]:
    """node-generic-resources and the labels that describe sharing.

    A pool that shares GPUs advertises only slots, so a whole-GPU task and a slot never
    meet on one GPU. Time-slicing needs the GPU's compute mode to be Default, MPS needs
    Exclusive_Process: a GPU in another is left out, which the swarm-side check then reports.
    """
    if not slots:
        return resource_entries(kind, [g["uuid"] for g in gpus]), {}
    want, name, fix = SHARING_COMPUTE_MODE[mode]
    shareable = []
    for gpu in gpus:
        # NVML that cannot say is taken at its word for time-slicing (Default is the driver's
        # own), never for MPS: without the exclusive mode a task could leave MPS and its limit.
        have = gpu.get("compute_mode", COMPUTE_MODE_DEFAULT if mode == "time-slicing" else None)
        if have == want:
            shareable.append(gpu["uuid"])
        else:
            warnings.append(f"GPU {gpu['uuid']} is in compute mode {have}, not {name}, so tasks cannot share it "
                            f"by {mode}; it advertises nothing. {fix[0].upper()}{fix[1:]}")
    labels = {GPU_SHARING_LABEL: mode, GPU_REPLICAS_LABEL: str(slots)}
    if len(shareable) < len(gpus):
        labels[GPU_SHARING_LABEL] = "refused-compute-mode"
    return slot_entries(shared_kind, shareable, slots), labels


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


def run(args: argparse.Namespace, warnings: list[str]) -> dict:
    """Validate everything, then detect, then write; returns the report."""
    try:
        kind = validate_kind(args.kind)
    except ValueError as e:
        raise BadInput(f"--kind: {e}")
    try:
        shared_kind = validate_kind(args.shared_kind or default_shared_kind(kind))
        if args.slots_per_gpu and not 2 <= args.slots_per_gpu <= MAX_SLOTS_PER_GPU:
            raise ValueError(f"must be from 2 to {MAX_SLOTS_PER_GPU}, or 0 for whole GPUs")
        if shared_kind == kind:
            raise ValueError(f"the shared kind must differ from --kind {kind}: a GPU is advertised one way")
        if args.sharing_mode not in SHARING_MODES:
            raise ValueError(f"--sharing-mode {args.sharing_mode!r}: expected one of {', '.join(SHARING_MODES)}")
    except ValueError as e:
        raise BadInput(f"--slots-per-gpu/--shared-kind/--sharing-mode: {e}")
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
    resources, sharing = advertised(kind, shared_kind, args.slots_per_gpu, gpus, warnings, args.sharing_mode)
    labels = {**gpu_labels(gpus, extra, warnings), **sharing, **efa_labels(args.efa_sysfs)}
    guard = None if args.no_runtime else {"path": args.guard, "config": args.runtime_config}
    # EFA devices are advertised only where the guard gives them to the tasks that reserve them.
    efa = efa_verbs(args.efa_sysfs, warnings) if gpus and guard else {}
    resources = resources + efa_resources(efa)

    new_daemon = merge_daemon_config(old_daemon or {}, resources, labels, guard if gpus else None, warnings)
    plans = {}
    # Compared as data, so a hand-formatted file that already says the right thing is
    # not rewritten (nor docker restarted); a missing one with nothing to say stays missing.
    if new_daemon != old_daemon and (old_daemon is not None or new_daemon):
        plans["daemon_json"] = (args.daemon_json, json.dumps(new_daemon, indent=2, ensure_ascii=False) + "\n")
    files = {"daemon_json": "unchanged", "toolkit_config": "unchanged", "runtime_config": "absent"}
    if gpus and guard:
        text = runtime_settings(kind=kind, shared_kind=shared_kind, slots=args.slots_per_gpu, gpus=gpus,
                                guard=args.guard, delegate=args.runtime_delegate,
                                allow_docker_run_gpus=not args.refuse_docker_run_gpus, ledger=args.guard_ledger,
                                mode=args.sharing_mode, mps_dir=args.mps_dir, server=args.guard_server, efa=efa)
        old = open(args.runtime_config).read() if os.path.exists(args.runtime_config) else None
        files["runtime_config"] = "unchanged"
        if text != old:
            plans["runtime_config"] = (args.runtime_config, text)
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
    return {"gpus": gpus, "resources": resources, "labels": labels,
            "changed": bool(plans), "files": files, "warnings": warnings}


def parse_args(argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Advertise this node's GPUs to Docker Swarm: writes daemon.json and the "
                    "nvidia-container-toolkit config. Exit 0 ok, 1 I/O error, 2 bad input "
                    "(nothing written), 3 NVML/nvidia-smi failing.",
        epilog="The report's \"changed\" is true when a file was written (with --dry-run: would be).")
    parser.add_argument("--daemon-json", default=DOCKER_DAEMON_JSON, metavar="PATH",
                        help=f"Docker daemon config to merge into (default {DOCKER_DAEMON_JSON})")
    parser.add_argument("--toolkit-config", default=TOOLKIT_CONFIG, metavar="PATH",
                        help=f"nvidia-container-toolkit config (default {TOOLKIT_CONFIG})")
    # Defaults also come from the node's settings (node.env), which the unit loads.
    env = os.environ.get
    parser.add_argument("--kind", default=env(KIND_ENV) or DEFAULT_KIND, metavar="NAME",
                        help=f"generic-resource kind services reserve (default {DEFAULT_KIND})")
    parser.add_argument("--slots-per-gpu", type=int, default=int(env(SLOTS_PER_GPU_ENV) or 0), metavar="K",
                        help="share each GPU between K tasks: advertise K slots per GPU under --shared-kind "
                             "(default 0: whole GPUs)")
    parser.add_argument("--shared-kind", default=env(SHARED_KIND_ENV) or "", metavar="NAME",
                        help="kind of the slots of shared GPUs (default <kind>-SHARED)")
    parser.add_argument("--sharing-mode", default=env(SHARING_MODE_ENV) or SHARING_MODES[0], metavar="MODE",
                        help=f"how slots share a GPU: {' or '.join(SHARING_MODES)} (default {SHARING_MODES[0]}); mps "
                             "needs the GPUs in Exclusive_Process mode with their MPS daemons (gpu-swarm-mps.service)")
    parser.add_argument("--mps-dir", default=MPS_DIR, metavar="PATH",
                        help=f"where the GPUs' MPS daemons keep their pipes (default {MPS_DIR})")
    parser.add_argument("--guard-ledger", default=GUARD_LEDGER_PATH, metavar="PATH",
                        help=f"the guard's record of which container holds which GPU (default {GUARD_LEDGER_PATH})")
    parser.add_argument("--guard-server", default=GUARD_SERVER_DIR, metavar="PATH",
                        help=f"where the guard's server listens (default {GUARD_SERVER_DIR}; empty: none)")
    parser.add_argument("--efa-sysfs", default=EFA_SYSFS, metavar="PATH",
                        help=f"where the kernel lists EFA devices, for the {EFA_COUNT_LABEL} label and the "
                             f"{EFA_KIND} resources (default {EFA_SYSFS})")
    parser.add_argument("--guard", default=GUARD_PATH, metavar="PATH",
                        help=f"the runtime guard made the default runtime (default {GUARD_PATH})")
    parser.add_argument("--runtime-config", default=RUNTIME_ENV_PATH, metavar="PATH",
                        help=f"where the guard's settings go (default {RUNTIME_ENV_PATH})")
    parser.add_argument("--runtime-delegate", default=shutil.which("nvidia-container-runtime") or
                        f"/usr/bin/{DEFAULT_RUNTIME_PATH}", metavar="PATH",
                        help="the runtime the guard hands containers to (default nvidia-container-runtime)")
    parser.add_argument("--refuse-docker-run-gpus", action="store_true",
                        help="also refuse GPUs to `docker run --gpus` containers that reserved nothing in swarm")
    parser.add_argument("--inventory", metavar="FILE",
                        help="read GPUs from a JSON list instead of NVML (simulated GPUs; NVML is not touched)")
    parser.add_argument("--no-runtime", action="store_true",
                        help="advertise resources only: set no runtime (the tasks would not be guarded)")
    parser.add_argument("--toolkit-version", metavar="X.Y.Z",
                        help="assume this nvidia-container-toolkit version instead of asking nvidia-ctk")
    parser.add_argument("--dry-run", action="store_true", help="write nothing; show what would change")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    warnings: list[str] = []
    try:
        # A dry run writes nothing, so it takes no lock (and needs no right to create one).
        with contextlib.nullcontext() if args.dry_run else locked(args.daemon_json):
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
    for name, path in (("daemon_json", args.daemon_json), ("toolkit_config", args.toolkit_config),
                       ("runtime_config", args.runtime_config)):
        print(f"{path}: {report['files'][name]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
