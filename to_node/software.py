"""The node software in node/: its bundle, each node's settings and steps, and the files a node boots with.

Every node runs the same bundle: a tar of node/ that the program uploads (components/
node_bundle.py) and that the node's installer (cloud-init/install.sh) downloads, checks
against the sha256 pinned here and installs under /opt/gpu-swarm/software. What a node
runs is a *release*: the bundle, its settings (node.env) and its bootstrap steps. At first
boot cloud-init writes node_files() and runs the installer; when the release changes,
to_node/commands.py upgrade() writes the same files over SSH and runs the same installer.
"""
from __future__ import annotations

import hashlib
import io
import re
import tarfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from swarm.gpu_kind import validate_kind
from swarm.node_contract import (EFA_ENV, ELASTIC_POOL_ENV, JOIN_PARAMETER_ENV, PRICE_DATE_ENV, PRICE_ENV,
                                 PRICE_GPUS_ENV, PRICE_INSTANCE_TYPE_ENV, PRICE_MARKET_ENV, REGION_ENV)
from swarm.script import sha256_hex

REPO = Path(__file__).resolve().parent.parent
SOURCE_DIR = REPO / "node"
CLOUD_INIT_DIR = REPO / "cloud-init"
VERSIONS_ENV = SOURCE_DIR / "versions.env"

# Paths and keys on the node: one contract with node/ (node/contract.py), re-exported here.
from swarm.node_contract import (  # noqa: E402,F401
    AGENT_PATH, AGENT_VENV, APPLIED, BOOTSTRAP_DONE, BOOTSTRAP_FAILED, BOOTSTRAP_LOG, BOOTSTRAP_TIMINGS,
    BUNDLE_SHA256_ENV, BUNDLE_URL_ENV, COST_ENV_PATH, HEALTH_ENV_PATH, HEALTH_UNIT, IMAGE_ENV, INSTALL_TIMINGS,
    INSTALLER_PATH, KERNEL_MODULES_ENV, KIND_ENV, NODE_DIR, NODE_ENV_PATH, NODE_VERSIONS_ENV, RECONCILER_UNIT, RELEASE_ENV,
    RELEASE_ENV_PATH, SHARED_KIND_ENV, SHARING_MODE_ENV, SLOTS_PER_GPU_ENV, SOFTWARE_DIR, SSHD_CONFIG, STATE_DIR,
    STEPS_ENV,
    UNATTENDED_CONFIG,
)

HEALTH_UNITS = (HEALTH_UNIT, RECONCILER_UNIT)
IMAGES = ("ubuntu", "deep-learning", "custom")
ROLES = ("manager", "worker")
# Full-node sizes of these families have NVSwitches, which need nvidia-fabricmanager.
NVSWITCH_FAMILIES = frozenset({"p4d", "p4de", "p5", "p5e", "p5en", "p6-b200", "p6-b300"})
# Fifth-generation NVLink (HGX B200/B300): the fabric manager also needs the NVLink Subnet Manager.
NVLINK5_FAMILIES = frozenset({"p6-b200", "p6-b300"})
# Their GPUs (Maxwell, Volta) predate NVIDIA's open kernel modules; all others use them.
PROPRIETARY_MODULE_FAMILIES = frozenset({"g3", "g3s", "p3", "p3dn"})
# What runs from the bundle: everything else lands read-only.
_EXECUTABLE = re.compile(r"(\.sh|\.py|^gpu-swarm-runtime)$")

_INSTANCE_TYPE_RE = re.compile(r"[a-z][a-z0-9-]*\.[a-z0-9-]+")
_ENV_LINE_RE = re.compile(r"([A-Z][A-Z0-9_]*)=(\S*)")
# Words of these characters, one space apart: nothing that bash or systemd would read differently.
_ENV_VALUE_RE = re.compile(r"([A-Za-z0-9._:/,+=&-]+( [A-Za-z0-9._:/,+=&-]+)*)?")
# Files that are not part of the software: Python's caches and editors' leftovers.
_IGNORED = re.compile(r"(^|/)(__pycache__|\.[^/]*)(/|$)|(\.pyc|~)$")


def software_files(source: Path | None = None) -> list[tuple[str, bytes]]:
    """(path relative to node/, content) of every file that belongs to the software, sorted."""
    source = source or SOURCE_DIR
    files = []
    for path in source.rglob("*"):
        rel = path.relative_to(source).as_posix()
        if path.is_file() and not _IGNORED.search(rel):
            files.append((rel, path.read_bytes()))
    return sorted(files, key=lambda item: item[0].encode())


def software_hash(source: Path | None = None) -> str:
    """The node software's content: `sha256sum` of the `sha256sum` listing of every file, by path.

    It depends on file content only: not on timestamps, permissions, the operating system or
    the Python version of whoever runs `pulumi up`.
    """
    listing = "".join(f"{hashlib.sha256(data).hexdigest()}  ./{rel}\n" for rel, data in software_files(source))
    return hashlib.sha256(listing.encode()).hexdigest()


def bundle(source: Path | None = None) -> bytes:
    """node/ as one tar, the same bytes on every operator's machine.

    Plain tar, not gzip: zlib's output differs between builds and platforms (zlib-ng, the
    header's OS byte), and a new byte would be a new release that rolls every node. Owner,
    times and modes are fixed here, so only content and paths count. About 140 KB.
    """
    return _bundle(source or SOURCE_DIR, software_hash(source))


@lru_cache(maxsize=4)
def _bundle(source: Path, content: str) -> bytes:  # cached per content: the program asks once per pool
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for rel, data in software_files(source):
            info = tarfile.TarInfo(rel)
            info.size, info.mtime, info.uid, info.gid, info.uname, info.gname = len(data), 0, 0, 0, "", ""
            info.mode = 0o755 if _EXECUTABLE.search(rel) else 0o644
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def bundle_sha256(source: Path | None = None) -> str:
    return hashlib.sha256(bundle(source)).hexdigest()


def bundle_key(sha256: str) -> str:
    """Where the bundle lives in the bucket: named after its content, so versions never mix."""
    return f"node-software/{sha256_hex(sha256, 'the node software bundle')}.tar"


def min_versions() -> dict[str, str]:
    """Every KEY=VALUE in node/versions.env (DOCKER_MIN_VERSION, TOOLKIT_MIN_VERSION, ...)."""
    versions = {}
    for number, line in enumerate(VERSIONS_ENV.read_text(encoding="utf-8").splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = _ENV_LINE_RE.fullmatch(line)
        if not match:
            raise ValueError(f"{VERSIONS_ENV}:{number}: expected KEY=VALUE (no spaces, no quotes), "
                             f"found {line!r}; the bootstrap scripts source this file")
        versions[match[1]] = match[2]
    return versions


def pinned_wheel(prefix: str) -> tuple[str, str, str]:
    """versions.env's <prefix>_WHEEL (`URL#sha256=HEX`, as PyPI's simple index writes it), as (URL, file name,
    sha256): what install-agent-venv.sh downloads and checks, or finds in an image's wheelhouse by that name."""
    url, _, sha256 = min_versions()[f"{prefix}_WHEEL"].partition("#sha256=")
    return url, url.rsplit("/", 1)[1], sha256


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


def bootstrap_steps(*, gpu: bool, instance_type: str, efa: bool = False, elastic: bool = False) -> list[str]:
    """The bootstrap steps for a node, in order; each is node/<step>.sh, and <step>& runs in the background.
    efa: the pool's nodes have EFA interfaces. elastic: an elastic pool's, which join the swarm by themselves, last.

    secure-imds comes first on every node: its user data holds its SSH host key (node/imds-root-only.sh)."""
    if not gpu:  # a manager: it runs the health reconciler, which needs the engine up
        return ["secure-imds", "install-docker", "apply-docker-config", "install-reconciler"]
    # The agent's venv starts in the background (a head start: bootstrap.sh), for pip needs nothing
    # the steps before the agent make; install-gpu-agent waits for it.
    steps = ["secure-imds", "install-agent-venv&", "install-docker", "install-nvidia-driver"]
    if needs_fabric_manager(instance_type):
        if _instance_family(instance_type)[0] in NVLINK5_FAMILIES:
            steps.append("install-nvlink-subnet-manager")
        steps.append("install-fabric-manager")
    if efa:  # the EFA kernel driver and libfabric, held like the driver (after it: GPUDirect RDMA needs it)
        steps.append("install-efa")
    # The health watcher last: it watches the GPUs that the agent made docker advertise.
    # install-mps before the agent: on an MPS pool the agent checks the compute mode its unit sets.
    # build-check-image before the agent: it needs docker and the driver's nvidia-smi, not the GPU
    # configuration, so it runs while the agent's venv is still being made in the background,
    # not after the docker restart that the agent's new configuration costs.
    return steps + ["install-container-toolkit", "install-mps", "build-check-image", "install-gpu-agent",
                    "apply-docker-config", "install-health-watcher", "install-gpu-metrics",
                    *(["join-swarm"] if elastic else [])]


def node_env(*, gpu: bool, gpu_kind: str, instance_type: str, image: str, slots_per_gpu: int = 0,
             shared_kind: str = "", sharing_mode: str = "time-slicing") -> dict[str, str]:
    """The node's settings, written to /etc/gpu-swarm/node.env, which every step and unit sources."""
    if image not in IMAGES:
        raise ValueError(f"image: expected one of {', '.join(IMAGES)}, found {image!r}")
    if not isinstance(gpu, bool):
        raise ValueError(f"gpu: expected True or False, found {gpu!r}")
    _instance_family(instance_type)
    # Only what a step or unit reads: a value here that changes rolls the node.
    env = {IMAGE_ENV: image, KIND_ENV: validate_kind(gpu_kind)}
    if gpu:
        env[KERNEL_MODULES_ENV] = kernel_modules(instance_type)
    if gpu and slots_per_gpu:  # read by the agent: it advertises slots instead of whole GPUs
        env[SLOTS_PER_GPU_ENV] = str(slots_per_gpu)
        env[SHARED_KIND_ENV] = validate_kind(shared_kind)
        if sharing_mode == "mps":  # install-mps.sh, the agent and the watcher read it; unset: time-slicing
            env[SHARING_MODE_ENV] = sharing_mode
    return env


def efa_env(interfaces: int) -> dict[str, str]:
    """node.env's EFA setting, on nodes of pools with EFA: install-efa.sh checks the node shows that many."""
    return {EFA_ENV: str(interfaces)} if interfaces else {}


def price_env(per_hour: float | None, *, market: str, date: str, instance_type: str, gpus: int) -> dict[str, str]:
    """cost.env (COST_ENV_PATH), a GPU node's price as the preview read it (components/cost.py), which the
    metrics exporter shares between its GPUs. A price not known is written empty: the exporter then has none."""
    return {PRICE_ENV: "" if per_hour is None else repr(float(per_hour)), PRICE_MARKET_ENV: market,
            PRICE_DATE_ENV: date, PRICE_INSTANCE_TYPE_ENV: instance_type, PRICE_GPUS_ENV: str(gpus)}


def elastic_env(parameter: str, region: str, pool: str) -> dict[str, str]:
    """node.env's join settings, on an elastic pool's nodes: join-swarm.sh reads them."""
    return {JOIN_PARAMETER_ENV: parameter, REGION_ENV: region, ELASTIC_POOL_ENV: pool}


def env_text(env: dict[str, str]) -> str:
    """KEY=VALUE lines that bash sources and systemd's EnvironmentFile reads the same way."""
    for key, value in env.items():
        if not re.fullmatch(r"[A-Z][A-Z0-9_]*", key) or not _ENV_VALUE_RE.fullmatch(value):
            raise ValueError(f"node setting {key}={value!r} cannot be written to an env file safely")
    return "".join(f"{key}={_quoted(value)}\n" for key, value in env.items())


def _quoted(value: str) -> str:
    # Words (the steps) in double quotes: bash and systemd both strip them; nothing inside
    # is special to either (the value pattern above allows no $, quote or backslash). A space
    # or a & (a background step) outside them would end or fork the line that bash sources.
    return f'"{value}"' if " " in value or "&" in value else value


def release(bundle_sha: str, env: dict[str, str], steps: list[str]) -> str:
    """What a node runs: the bundle, its settings and its steps, as one hash.

    A node's `gpu-swarm.software` label holds it; any change drains the node, upgrades it
    in place and admits it again.
    """
    return hashlib.sha256(f"{sha256_hex(bundle_sha)}\n{env_text(env)}\n{' '.join(steps)}".encode()).hexdigest()


@dataclass(frozen=True)
class NodeFile:
    path: str
    content: str
    mode: str = "0644"


@dataclass(frozen=True)
class NodeRelease:
    """One kind of node (a pool), at one version of the software: what its boot and its upgrades install."""

    bundle_url: str
    bundle_sha: str
    env: dict[str, str]
    steps: tuple[str, ...]

    @property
    def id(self) -> str:
        return release(self.bundle_sha, self.env, list(self.steps))

    def files(self) -> list[NodeFile]:
        """What cloud-init writes at first boot, and to_node/commands.py upgrade() writes later: the same files."""
        for step in self.steps:
            if not re.fullmatch(r"[a-z0-9-]+&?", step) or not (SOURCE_DIR / f"{step.rstrip('&')}.sh").is_file():
                raise ValueError(f"bootstrap step {step!r} is not a script in node/")
        if not re.fullmatch(r"https://[A-Za-z0-9.-]+(:\d+)?/[A-Za-z0-9._/-]+", self.bundle_url):
            raise ValueError(f"bundle URL {self.bundle_url!r} is not a plain https URL")
        release_env = {BUNDLE_URL_ENV: self.bundle_url, BUNDLE_SHA256_ENV: sha256_hex(self.bundle_sha),
                       STEPS_ENV: " ".join(self.steps), RELEASE_ENV: self.id}
        return [
            # UTF-8, not the operator's locale: the same bytes from a Windows machine (cp1252).
            NodeFile(UNATTENDED_CONFIG, (CLOUD_INIT_DIR / "unattended-upgrades.conf").read_text(encoding="utf-8")),
            # cloud-init writes it before sshd first starts; the installer has sshd read it again after an upgrade.
            NodeFile(SSHD_CONFIG, (CLOUD_INIT_DIR / "sshd.conf").read_text(encoding="utf-8")),
            NodeFile(NODE_ENV_PATH, env_text(self.env)),
            NodeFile(RELEASE_ENV_PATH, env_text(release_env)),
            NodeFile(INSTALLER_PATH, (CLOUD_INIT_DIR / "install.sh").read_text(encoding="utf-8"), "0755"),
        ]
