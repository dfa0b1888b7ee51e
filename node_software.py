"""A node's cloud-init user data: a #cloud-config that writes the bootstrap steps in
cloud-init/ (and, on GPU nodes, the GPU agent) to the node and runs them once.

The document is a data structure serialized to YAML, never assembled from string
fragments. The shell steps read the pinned versions from node/versions.env.
"""
from __future__ import annotations

import base64
import gzip
import re
from pathlib import Path

import yaml

from swarm.gpu_kind import validate_kind

NODE_SOFTWARE_DIR = Path(__file__).resolve().parent / "node"
VERSIONS_ENV = NODE_SOFTWARE_DIR / "versions.env"
AGENT_SOURCE = NODE_SOFTWARE_DIR / "gpu_agent.py"
AGENT_UNIT_SOURCE = NODE_SOFTWARE_DIR / "gpu-swarm-agent.service"

# Paths on the node. cloud-init/common.sh has the same defaults (a test keeps them equal).
NODE_DIR = "/opt/gpu-swarm"
BOOTSTRAP_DIR = f"{NODE_DIR}/bootstrap"
BOOTSTRAP_SCRIPT = f"{BOOTSTRAP_DIR}/bootstrap.sh"
NODE_VERSIONS_ENV = f"{NODE_DIR}/versions.env"
AGENT_PATH = f"{NODE_DIR}/gpu_agent.py"
AGENT_VENV = f"{NODE_DIR}/venv"
AGENT_UNIT_PATH = "/etc/systemd/system/gpu-swarm-agent.service"
AGENT_ENV_PATH = "/etc/gpu-swarm/agent.env"
NODE_ENV_PATH = "/etc/gpu-swarm/node.env"
BOOTSTRAP_LOG = "/var/log/gpu-swarm/bootstrap.log"
STATE_DIR = "/var/lib/gpu-swarm"
BOOTSTRAP_TIMINGS = f"{STATE_DIR}/bootstrap-timings.json"
# Exactly one of these exists once the bootstrap has ended: done, or failed (holding the
# failed step's name). Neither: still running, or cloud-init never got to it.
BOOTSTRAP_DONE = f"{STATE_DIR}/bootstrap-done"
BOOTSTRAP_FAILED = f"{STATE_DIR}/bootstrap-failed"
NODE_PATHS = {
    "bootstrap_log": BOOTSTRAP_LOG,
    "bootstrap_timings": BOOTSTRAP_TIMINGS,
    "bootstrap_done": BOOTSTRAP_DONE,
    "bootstrap_failed": BOOTSTRAP_FAILED,
}

IMAGES = ("ubuntu", "deep-learning", "custom")
# EC2 rejects larger user data, counted in raw bytes before base64. A GPU node's document
# (~46 KB, most of it gpu_agent.py) only fits gzipped: see render_user_data().
USER_DATA_LIMIT = 16384

# Full-node sizes of these families have NVSwitches, which need nvidia-fabricmanager.
NVSWITCH_FAMILIES = frozenset({"p4d", "p4de", "p5", "p5e", "p5en", "p6-b200", "p6-b300"})
# Their GPUs (Maxwell, Volta) predate NVIDIA's open kernel modules; all others use them.
PROPRIETARY_MODULE_FAMILIES = frozenset({"g3", "g3s", "p3", "p3dn"})

_INSTANCE_TYPE_RE = re.compile(r"[a-z][a-z0-9-]*\.[a-z0-9-]+")
_ENV_LINE_RE = re.compile(r"([A-Z][A-Z0-9_]*)=(\S*)")


def min_versions() -> dict[str, str]:
    """Every KEY=VALUE in node/versions.env (DOCKER_MIN_VERSION, TOOLKIT_MIN_VERSION, ...)."""
    versions = {}
    for number, line in enumerate(VERSIONS_ENV.read_text().splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = _ENV_LINE_RE.fullmatch(line)
        if not match:
            raise ValueError(f"{VERSIONS_ENV}:{number}: expected KEY=VALUE (no spaces, no quotes), "
                             f"found {line!r}; the bootstrap scripts source this file")
        versions[match[1]] = match[2]
    return versions


def _instance_family(instance_type: str) -> tuple[str, str]:
    if not isinstance(instance_type, str) or not _INSTANCE_TYPE_RE.fullmatch(instance_type):
        raise ValueError(f"instance_type: expected an EC2 instance type such as 'g5.xlarge', "
                         f"found {instance_type!r}")
    family, size = instance_type.split(".", 1)
    return family, size


def needs_fabric_manager(instance_type: str) -> bool:
    """True for NVSwitch instance types, where CUDA fails with error 802 without nvidia-fabricmanager."""
    family, size = _instance_family(instance_type)
    # Single-GPU sizes of these families (p5.4xlarge) get no NVSwitch.
    units = re.fullmatch(r"(\d*)xlarge", size)
    full_node = size.startswith("metal") or (units is not None and int(units[1] or 1) >= 24)
    return family in NVSWITCH_FAMILIES and full_node


def kernel_modules(instance_type: str) -> str:
    """Which NVIDIA kernel modules the instance type's GPUs need: "open" or "proprietary"."""
    family, _ = _instance_family(instance_type)
    return "proprietary" if family in PROPRIETARY_MODULE_FAMILIES else "open"


def bootstrap_steps(*, gpu: bool, instance_type: str) -> list[str]:
    """The bootstrap steps for a node, in order; each is cloud-init/<step>.sh."""
    if not gpu:
        return ["install-docker", "apply-docker-config"]
    steps = ["install-docker", "install-nvidia-driver"]
    if needs_fabric_manager(instance_type):
        steps.append("install-fabric-manager")
    return steps + ["install-container-toolkit", "install-gpu-agent", "apply-docker-config"]


def _source(path: Path) -> str:
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: the user data embeds it")
    return path.read_text()


def _env_file(values: dict[str, str]) -> str:
    return "".join(f"{key}={value}\n" for key, value in values.items())


def _file(path: str, content: str, permissions: str = "0644") -> dict:
    return {"path": path, "permissions": permissions, "content": content}


def render_cloud_config(*, gpu: bool, gpu_kind: str, instance_type: str, image: str) -> str:
    """The user data for one node: GPU pool nodes (gpu=True) or CPU managers.

    image is "ubuntu" (install everything), "deep-learning" (AWS Deep Learning Base GPU
    AMI: steps find their work done and skip it) or "custom" (install what is missing).
    The result is byte-for-byte the same for the same arguments.
    """
    if image not in IMAGES:
        raise ValueError(f"image: expected one of {', '.join(IMAGES)}, found {image!r}")
    if not isinstance(gpu, bool):
        raise ValueError(f"gpu: expected True or False, found {gpu!r}")
    _instance_family(instance_type)  # node.env is sourced by the shell: nothing unchecked goes in
    kind = validate_kind(gpu_kind)
    steps = bootstrap_steps(gpu=gpu, instance_type=instance_type)

    node_env = {"GPU_SWARM_IMAGE": image, "GPU_SWARM_INSTANCE_TYPE": instance_type}
    if gpu:
        node_env["NVIDIA_KERNEL_MODULES"] = kernel_modules(instance_type)
    files = [
        _file(NODE_VERSIONS_ENV, _source(VERSIONS_ENV)),
        _file(NODE_ENV_PATH, _env_file(node_env)),
        _file(f"{BOOTSTRAP_DIR}/common.sh", _source(NODE_SOFTWARE_DIR / "common.sh")),
        _file(BOOTSTRAP_SCRIPT, _source(NODE_SOFTWARE_DIR / "bootstrap.sh"), "0755"),
    ]
    files += [_file(f"{BOOTSTRAP_DIR}/{step}.sh", _source(NODE_SOFTWARE_DIR / f"{step}.sh"), "0755")
              for step in steps]
    if gpu:
        files += [
            _file(AGENT_PATH, _source(AGENT_SOURCE), "0755"),
            _file(AGENT_UNIT_PATH, _source(AGENT_UNIT_SOURCE)),
            _file(AGENT_ENV_PATH, _env_file({"GPU_SWARM_KIND": kind})),
        ]
    config = {"write_files": files, "runcmd": [["bash", BOOTSTRAP_SCRIPT, *steps]]}
    return "#cloud-config\n" + yaml.dump(config, Dumper=_Dumper, sort_keys=False, width=4096,
                                         allow_unicode=True)


def render_user_data(*, gpu: bool, gpu_kind: str, instance_type: str, image: str) -> str:
    """render_cloud_config() gzipped and base64-encoded, for aws.ec2.Instance(user_data_base64=...).

    cloud-init inflates gzip user data before it looks for the #cloud-config line, and
    EC2's 16 KiB limit counts the compressed bytes. mtime=0 keeps the bytes identical
    from run to run, so user_data_replace_on_change fires only on a real change.
    """
    document = render_cloud_config(gpu=gpu, gpu_kind=gpu_kind, instance_type=instance_type, image=image)
    raw = gzip.compress(document.encode(), compresslevel=9, mtime=0)
    if len(raw) > USER_DATA_LIMIT:
        raise ValueError(f"user data for {instance_type} is {len(raw)} bytes gzipped, over EC2's "
                         f"{USER_DATA_LIMIT}; shrink the files in cloud-init/")
    return base64.b64encode(raw).decode()


class _Dumper(yaml.SafeDumper):
    """Writes multi-line strings as | blocks, so the scripts stay readable in the console."""


def _represent_str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _represent_str)
