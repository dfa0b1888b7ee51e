"""The node software in node/: what lands on every node, its version hash, and how a node applies it.

Pulumi copies the whole node/ folder to each node over SSH (components/node_software.py)
and runs apply_software() there: it checks the copy against the hash computed here,
installs it under /opt/gpu-swarm/software, writes the node's settings and runs the
bootstrap steps. The same path serves a node's first boot and every later change, one
node of a pool at a time, so changing a script never replaces or reboots a node.
"""
from __future__ import annotations

import hashlib
import re
from pathlib import Path

from swarm.gpu_kind import validate_kind
from swarm.script import quote, script, sha256_hex

SOURCE_DIR = Path(__file__).resolve().parent / "node"
VERSIONS_ENV = SOURCE_DIR / "versions.env"

# Paths on the node. node/common.sh has the same defaults (a test keeps them equal).
NODE_DIR = "/opt/gpu-swarm"
SOFTWARE_DIR = f"{NODE_DIR}/software"
NODE_VERSIONS_ENV = f"{SOFTWARE_DIR}/versions.env"
AGENT_PATH = f"{SOFTWARE_DIR}/gpu_agent.py"
AGENT_VENV = f"{NODE_DIR}/venv"
NODE_ENV_PATH = "/etc/gpu-swarm/node.env"
# The health settings, apart from node.env: changing them restarts two services and drains
# no node, where a node.env change rolls the node (drain, apply, admit).
HEALTH_ENV_PATH = "/etc/gpu-swarm/health.env"
HEALTH_UNITS = ("gpu-swarm-health.service", "gpu-swarm-reconciler.service")
BOOTSTRAP_LOG = "/var/log/gpu-swarm/bootstrap.log"
STATE_DIR = "/var/lib/gpu-swarm"
BOOTSTRAP_TIMINGS = f"{STATE_DIR}/bootstrap-timings.json"
# Exactly one of these exists once the bootstrap has ended: done, or failed (holding the
# failed step's name). Neither: still running, or it never ran.
BOOTSTRAP_DONE = f"{STATE_DIR}/bootstrap-done"
BOOTSTRAP_FAILED = f"{STATE_DIR}/bootstrap-failed"
# The software and settings the node last applied successfully (software_hash + node.env).
APPLIED = f"{STATE_DIR}/applied"
# Where CopyToRemote puts a software version: the SSH user can write here, and unlike
# /tmp it survives a reboot. The folder is named after the hash, so versions never mix.
STAGING_PARENT = "/var/tmp"

IMAGES = ("ubuntu", "deep-learning", "custom")
ROLES = ("manager", "worker")
# Full-node sizes of these families have NVSwitches, which need nvidia-fabricmanager.
NVSWITCH_FAMILIES = frozenset({"p4d", "p4de", "p5", "p5e", "p5en", "p6-b200", "p6-b300"})
# Their GPUs (Maxwell, Volta) predate NVIDIA's open kernel modules; all others use them.
PROPRIETARY_MODULE_FAMILIES = frozenset({"g3", "g3s", "p3", "p3dn"})

_INSTANCE_TYPE_RE = re.compile(r"[a-z][a-z0-9-]*\.[a-z0-9-]+")
_ENV_LINE_RE = re.compile(r"([A-Z][A-Z0-9_]*)=(\S*)")
_ENV_VALUE_RE = re.compile(r"[A-Za-z0-9._:/,+=-]*")
# Files that are not part of the software: Python's caches and editors' leftovers. The node
# leaves them out of its hash in the same way (see apply_software).
_IGNORED = re.compile(r"(^|/)(__pycache__|\.[^/]*)(/|$)|(\.pyc|~)$")


def software_files(source: Path = SOURCE_DIR) -> list[tuple[str, bytes]]:
    """(path relative to node/, content) of every file that belongs to the software, sorted."""
    files = []
    for path in source.rglob("*"):
        rel = path.relative_to(source).as_posix()
        if path.is_file() and not _IGNORED.search(rel):
            files.append((rel, path.read_bytes()))
    return sorted(files, key=lambda item: item[0].encode())


def software_hash(source: Path = SOURCE_DIR) -> str:
    """The version of the node software: the same digest the node computes over its copy.

    It is `sha256sum` of the `sha256sum` listing of every file, by path (as `./path`, in
    byte order), so it depends on file content only: not on timestamps, permissions, the
    operating system or the Python version of whoever runs `pulumi up`.
    """
    listing = "".join(f"{hashlib.sha256(data).hexdigest()}  ./{rel}\n" for rel, data in software_files(source))
    return hashlib.sha256(listing.encode()).hexdigest()


def staging_dir(software: str) -> str:
    """Where the copy of one software version lands (CopyToRemote adds node/ below it)."""
    return f"{STAGING_PARENT}/gpu-swarm-{sha256_hex(software)[:16]}"


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
    """The bootstrap steps for a node, in order; each is node/<step>.sh."""
    if not gpu:  # a manager: it runs the health reconciler, which needs the engine up
        return ["install-docker", "apply-docker-config", "install-reconciler"]
    steps = ["install-docker", "install-nvidia-driver"]
    if needs_fabric_manager(instance_type):
        steps.append("install-fabric-manager")
    # The health watcher last: it watches the GPUs that the agent made docker advertise.
    return steps + ["install-container-toolkit", "install-gpu-agent", "build-check-image", "apply-docker-config",
                    "install-health-watcher"]


def node_env(*, gpu: bool, gpu_kind: str, instance_type: str, image: str, slots_per_gpu: int = 0,
             shared_kind: str = "", spot: bool = False) -> dict[str, str]:
    """The node's settings, written to /etc/gpu-swarm/node.env, which every step and unit sources."""
    if image not in IMAGES:
        raise ValueError(f"image: expected one of {', '.join(IMAGES)}, found {image!r}")
    if not isinstance(gpu, bool):
        raise ValueError(f"gpu: expected True or False, found {gpu!r}")
    _instance_family(instance_type)
    # Only what a step or unit reads: a value here that changes reruns the node's bootstrap.
    env = {"GPU_SWARM_IMAGE": image, "GPU_SWARM_KIND": validate_kind(gpu_kind)}
    if gpu:
        env["NVIDIA_KERNEL_MODULES"] = kernel_modules(instance_type)
    if gpu and slots_per_gpu:  # read by the agent: it advertises slots instead of whole GPUs
        env["GPU_SWARM_SLOTS_PER_GPU"] = str(slots_per_gpu)
        env["GPU_SWARM_SHARED_KIND"] = validate_kind(shared_kind)
    if gpu and spot:  # read by the health watcher: it watches for AWS's reclaim notices
        env["GPU_SWARM_SPOT"] = "true"
    return env


def _env_text(env: dict[str, str]) -> str:
    for key, value in env.items():
        # Sourced by bash and read by systemd: nothing that either would read differently.
        if not re.fullmatch(r"[A-Z][A-Z0-9_]*", key) or not _ENV_VALUE_RE.fullmatch(value):
            raise ValueError(f"node setting {key}={value!r} cannot be written to node.env safely")
    return "".join(f"{key}={value}\n" for key, value in env.items())


def release(software: str, env: dict[str, str], steps: list[str]) -> str:
    """What a node runs: the software, its settings and its steps, as one hash.

    A node's `gpu-swarm.software` label holds it; any change drains the node, applies it
    and admits the node again.
    """
    return hashlib.sha256(f"{sha256_hex(software)}\n{_env_text(env)}\n{' '.join(steps)}".encode()).hexdigest()


def apply_software(*, software: str, steps: list[str], env: dict[str, str], expected_gpus: int,
                   bootstrap_timeout_s: int = 2700, cloud_init_timeout_s: int = 600, root: str = "") -> str:
    """On the node, as root: install the staged software, write node.env, run the bootstrap.

    Skips the bootstrap when this node already applied the same software and settings, so a
    re-run (a new SSH key, a node that changed its address) costs a second. The bootstrap
    runs as a transient systemd unit: if the SSH session drops, it goes on, and the next
    `pulumi up` waits for it instead of starting another. Prints the step timings as JSON.
    `root` prefixes every node path (tests run the script in a scratch folder).
    """
    want = sha256_hex(software)
    env_text = _env_text(env)
    applied = release(software, env, steps)
    for step in steps:
        if not re.fullmatch(r"[a-z0-9-]+", step):
            raise ValueError(f"bootstrap step {step!r} is not a step name")
    at = {name: quote(root + path) for name, path in (
        ("software", SOFTWARE_DIR), ("state", STATE_DIR), ("env", NODE_ENV_PATH), ("log", BOOTSTRAP_LOG),
        ("done", BOOTSTRAP_DONE), ("failed", BOOTSTRAP_FAILED), ("applied", APPLIED),
        ("timings", BOOTSTRAP_TIMINGS), ("staged", f"{staging_dir(want)}/node"),
        ("daemon", "/etc/docker/daemon.json"))}
    sw, log = at["software"], at["log"]
    minutes = bootstrap_timeout_s // 60
    return script(
        "set -o pipefail",
        "say() { echo \"gpu-swarm: $*\" >&2; }",
        f"fail() {{ say \"$1\"; echo '--- last 40 lines of {BOOTSTRAP_LOG} ---' >&2; "
        f"tail -n 40 {log} >&2 2>/dev/null || true; exit 1; }}",
        f'mkdir -p {at["state"]} "$(dirname {at["env"]})" "$(dirname {log})" && touch {log}',
        f"cat >{at['env']}.new <<'NODE_ENV'\n{env_text}NODE_ENV",
        f"mv {at['env']}.new {at['env']}",
        f'if [ "$(cat {at["applied"]} 2>/dev/null || true)" = {applied} ] && [ -e {at["done"]} ]; then',
        '  say "software and settings already applied"',
        "else",
        f'  if [ "$(cat {sw}/.hash 2>/dev/null || true)" != {want} ]; then',
        f"    staged={at['staged']}",
        '    [ -d "$staged" ] || fail "the copy of the node software is missing ($staged); run pulumi up again"',
        # The copy was written by the SSH user: check it is exactly what the program sent
        # before root runs any of it.
        "    got=$(cd \"$staged\" && find . -type f ! -path '*/__pycache__/*' ! -path '*/.*' ! -name '*.pyc' "
        "! -name '*~' -print0 | LC_ALL=C sort -z | xargs -0 sha256sum | sha256sum | cut -d' ' -f1)",
        f'    [ "$got" = {want} ] || fail "the copy in $staged has hash $got, expected {want}"',
        f'    mkdir -p "$(dirname {sw})" && rm -rf {sw}.new && cp -R "$staged" {sw}.new',
        f"    chown -R 0:0 {sw}.new && chmod -R go-w {sw}.new",
        # The copy keeps no modes (SFTP): the runtime guard and the scripts must be executable.
        f'    chmod 0755 {sw}.new/gpu-swarm-runtime {sw}.new/*.sh {sw}.new/*.py',
        f"    echo {want} >{sw}.new/.hash",
        f"    rm -rf {sw}.old; if [ -e {sw} ]; then mv {sw} {sw}.old; fi",
        f"    mv {sw}.new {sw}; rm -rf {sw}.old",
        f'    say "installed node software {want[:12]}"',
        "  fi",
        # cloud-init may still be at work on a fresh node (apt, its own first-boot units).
        # Its verdict is advice: exit 2 means recoverable warnings (cloud-init >= 23.4).
        "  if command -v cloud-init >/dev/null 2>&1; then",
        f"    rc=0; timeout {int(cloud_init_timeout_s)} cloud-init status --wait >/dev/null 2>&1 || rc=$?",
        '    case $rc in 0|2) ;; 124) say "cloud-init is still running after '
        f'{cloud_init_timeout_s // 60} min; going on" ;;',
        '      *) say "cloud-init reported errors (exit $rc, see cloud-init status --long); going on" ;; esac',
        "  fi",
        "  unit=gpu-swarm-bootstrap",
        f"  lines=$(wc -l <{log})",
        '  if systemctl is-active -q "$unit"; then say "a bootstrap is already running; waiting for it"',
        "  else",
        '    systemctl reset-failed "$unit" >/dev/null 2>&1 || true',
        f'    systemd-run --unit "$unit" --collect --quiet bash {sw}/bootstrap.sh {" ".join(steps)}',
        "  fi",
        f"  end=$(( $(date +%s) + {int(bootstrap_timeout_s)} ))",
        '  while systemctl is-active -q "$unit"; do',
        f"    tail -n +$((lines + 1)) {log} | sed 's/^/  | /' >&2",
        f"    lines=$(wc -l <{log})",
        f'    [ "$(date +%s)" -lt "$end" ] || fail "the bootstrap is still running after {minutes} min; it goes on'
        f' (journalctl -u $unit): run pulumi up again to wait for it"',
        "    sleep 5",
        "  done",
        f"  tail -n +$((lines + 1)) {log} | sed 's/^/  | /' >&2",
        f'  if [ -e {at["failed"]} ]; then fail "bootstrap step $(cat {at["failed"]}) failed; '
        'its steps are idempotent, so pulumi up retries it"; fi',
        f'  [ -e {at["done"]} ] || fail "the bootstrap ended without finishing (journalctl -u $unit)"',
        f"  echo {applied} >{at['applied']}",
        "fi",
        *_advertised_gpus_check(env, expected_gpus, at["daemon"]),
        f"cat {at['timings']} 2>/dev/null || echo '{{}}'",
    )


def _advertised_gpus_check(env: dict[str, str], gpus: int, daemon_json: str) -> list[str]:
    # dockerd reads node-generic-resources only at start, and the agent restarts it after
    # writing them, so daemon.json is what the engine advertises: each GPU whole, or as
    # GPU_SWARM_SLOTS_PER_GPU slots of the shared kind.
    kind, slots = env.get("GPU_SWARM_KIND", ""), int(env.get("GPU_SWARM_SLOTS_PER_GPU") or 0)
    if not kind:
        return []
    if slots:
        kind = env["GPU_SWARM_SHARED_KIND"]
    expected = gpus * (slots or 1)
    entry = quote(f'"{kind}=')
    return [
        f"n=$({{ grep -o {entry} {daemon_json} 2>/dev/null || true; }} | wc -l)",
        f'[ "$n" -eq {int(expected)} ] || fail "node advertises $n {kind} resources in {daemon_json},'
        f' expected {int(expected)}"',
        "docker info >/dev/null 2>&1 || fail 'docker is not running'",
    ]


def health_settings(env: dict[str, str], root: str = "") -> str:
    """On the node, as root: write health.env and restart the health services that run, if it changed.

    Prints "changed" or "unchanged". The services read it at start; one not installed yet
    (a node still in its bootstrap) starts with it later.
    """
    path = quote(root + HEALTH_ENV_PATH)
    return script(
        f'mkdir -p "$(dirname {path})"',
        f"cat >{path}.new <<'HEALTH_ENV'\n{_env_text(env)}HEALTH_ENV",
        f"if cmp -s {path}.new {path}; then rm -f {path}.new; echo unchanged; exit 0; fi",
        f"mv {path}.new {path}",
        # A manager has no watcher, a GPU node no reconciler; try-restart leaves a stopped one stopped.
        f"for unit in {' '.join(HEALTH_UNITS)}; do",
        '  if systemctl cat "$unit" >/dev/null 2>&1; then systemctl try-restart "$unit"; fi',
        "done",
        "echo changed",
    )


_USER_RE = re.compile(r"[a-z_][a-z0-9_-]{0,31}")
_PUBLIC_KEY_RE = re.compile(r"(ssh-ed25519|ssh-rsa|ecdsa-sha2-nistp(256|384|521)) [A-Za-z0-9+/]+=*( [^\n'\\]*)?")


def authorize_keys(user: str, keys: list[str]) -> str:
    """On the node, as root: make `keys` the only keys that may log in as `user`.

    The program owns the whole authorized_keys file. That is what lets it rotate its own
    key: first add the new key (sshAuthorizedKeys), then switch to it and drop the old one.
    """
    if not _USER_RE.fullmatch(user or ""):
        raise ValueError(f"{user!r} is not a Linux user name")
    keys = [k.strip() for k in keys]
    if not keys:
        raise ValueError("at least one public key must stay authorized, or nobody can log in again")
    for k in keys:
        if not _PUBLIC_KEY_RE.fullmatch(k):
            raise ValueError(f"{k[:40]!r}... is not one OpenSSH public key line")
    body = "".join(f"{k}\n" for k in dict.fromkeys(keys))
    return script(
        f"home=$(getent passwd {user} | cut -d: -f6)",
        f'[ -n "$home" ] || {{ echo "gpu-swarm: there is no user {user} on this node" >&2; exit 1; }}',
        f'install -d -m 0700 -o {user} -g "$(id -gn {user})" "$home/.ssh"',
        "tmp=$home/.ssh/authorized_keys.gpu-swarm",
        f"cat >\"$tmp\" <<'KEYS'\n{body}KEYS",
        f'chown {user}:"$(id -gn {user})" "$tmp" && chmod 0600 "$tmp"',
        'mv -f "$tmp" "$home/.ssh/authorized_keys"',
        f'echo "{len(dict.fromkeys(keys))} key(s) may log in as {user}"',
    )
