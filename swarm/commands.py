"""Shell commands that form and run the swarm, as small pure functions.

The Pulumi components send these over SSH (pulumi-command) and the local
rehearsal runs the very same strings against its namespaced dockerds, so
what the tests prove locally is what runs on AWS. Every value that lands in
a command is validated or shell-quoted here; secrets never do: join tokens
travel on stdin.
"""
from __future__ import annotations

import ipaddress
import json
import re
import shlex
from dataclasses import dataclass

from node_software import BOOTSTRAP_DONE, BOOTSTRAP_FAILED, BOOTSTRAP_LOG, BOOTSTRAP_TIMINGS
from swarm.gpu_kind import validate_kind

SWARM_PORT = 2377
_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")
_LABEL_KEY_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


@dataclass(frozen=True)
class NodePaths:
    """Where a node keeps what the join step checks. Defaults are the AWS node's."""

    daemon_json: str = "/etc/docker/daemon.json"
    bootstrap_log: str = BOOTSTRAP_LOG
    bootstrap_done: str | None = BOOTSTRAP_DONE
    bootstrap_failed: str | None = BOOTSTRAP_FAILED
    bootstrap_timings: str = BOOTSTRAP_TIMINGS
    wait_for_cloud_init: bool = True


def _addr(value: str) -> str:
    try:
        return str(ipaddress.ip_address(value))
    except ValueError:
        raise ValueError(f"expected an IP address, got {value!r}") from None


def _name(value: str, what: str) -> str:
    if not _NAME_RE.match(value):
        raise ValueError(
            f"{what} {value!r} is not valid: use lowercase letters, digits, '-' and '_' "
            "(at most 63 characters, starting with a letter or digit)"
        )
    return value


def _node_id(value: str) -> str:
    if not re.fullmatch(r"[a-z0-9]{25}", value):
        raise ValueError(f"expected a 25-character swarm node ID, got {value!r}")
    return value


# `docker info --format` exits 0 with empty output when the engine is down, so check it.
_SWARM_STATE = (
    'state=$(docker info --format "{{.Swarm.LocalNodeState}}" 2>/dev/null); '
    '[ -n "$state" ] || { echo "gpu-swarm: cannot reach the Docker engine" >&2; exit 1; }'
)


def _script(*lines: str) -> str:
    return "\n".join(("set -eu", *lines)) + "\n"


def init_swarm(advertise_addr: str) -> str:
    """Make this node the first manager; a node already in a swarm is left as it is."""
    addr = shlex.quote(_addr(advertise_addr))
    return _script(
        _SWARM_STATE,
        'if [ "$state" = active ]; then',
        '  if [ "$(docker info --format "{{.Swarm.ControlAvailable}}")" != true ]; then',
        '    echo "this node is in a swarm but is not a manager; refusing to init" >&2; exit 1',
        "  fi",
        '  echo "swarm already initialised"',
        "else",
        f"  docker swarm init --advertise-addr {addr} >/dev/null",
        '  echo "swarm initialised"',
        "fi",
    )


def read_join_tokens() -> str:
    """Print both join tokens as one JSON object; callers must treat stdout as secret."""
    return _script(
        "w=$(docker swarm join-token -q worker)",
        "m=$(docker swarm join-token -q manager)",
        'printf \'{"worker": "%s", "manager": "%s"}\\n\' "$w" "$m"',
    )


def _fail_with_log(paths: NodePaths) -> str:
    log = shlex.quote(paths.bootstrap_log)
    return (
        "fail() { echo \"gpu-swarm: $1\" >&2; "
        f"echo '--- last 40 lines of {paths.bootstrap_log} ---' >&2; "
        f"tail -n 40 {log} >&2 2>/dev/null || echo '(no bootstrap log)' >&2; exit 1; }}"
    )


def wait_for_node(*, expected_gpus: int, kind: str, paths: NodePaths = NodePaths()) -> str:
    """Wait for the node's bootstrap, then check it advertises exactly the GPUs it should."""
    kind = validate_kind(kind)
    if expected_gpus < 0:
        raise ValueError(f"expected_gpus must be >= 0, got {expected_gpus}")
    lines = [_fail_with_log(paths)]
    if paths.wait_for_cloud_init:
        lines.append(
            "if command -v cloud-init >/dev/null 2>&1; then "
            "cloud-init status --wait >/dev/null 2>&1 || cloud_init_failed=1; fi"
        )
    if paths.bootstrap_failed:  # names the step that failed, which beats a generic error
        failed = shlex.quote(paths.bootstrap_failed)
        lines.append(f'[ ! -e {failed} ] || fail "bootstrap step $(cat {failed}) failed"')
    if paths.wait_for_cloud_init:
        lines.append("[ -z \"${cloud_init_failed:-}\" ] || fail 'cloud-init finished with errors'")
    if paths.bootstrap_done:
        lines.append(
            f"[ -e {shlex.quote(paths.bootstrap_done)} ] || fail 'bootstrap did not finish'"
        )
    # dockerd reads node-generic-resources only at start, and the agent restarts it
    # after writing them, so daemon.json is what the engine advertises.
    entry = shlex.quote(f'"{kind}=')
    lines += [
        f"n=$(grep -o {entry} {shlex.quote(paths.daemon_json)} 2>/dev/null | wc -l)",
        f'[ "$n" -eq {expected_gpus} ] || '
        f'fail "node advertises $n {kind} resources in {paths.daemon_json}, expected {expected_gpus}"',
        "docker info >/dev/null 2>&1 || fail 'docker is not running'",
    ]
    return _script(*lines)


def join_swarm(
    *,
    role: str,
    manager_addr: str,
    advertise_addr: str,
    expected_gpus: int,
    kind: str,
    paths: NodePaths = NodePaths(),
) -> str:
    """Wait for the node, then join it; the token is read from stdin. Prints the node ID."""
    if role not in ("manager", "worker"):
        raise ValueError(f"role must be 'manager' or 'worker', got {role!r}")
    mgr = shlex.quote(f"{_addr(manager_addr)}:{SWARM_PORT}")
    addr = shlex.quote(_addr(advertise_addr))
    wait = wait_for_node(expected_gpus=expected_gpus, kind=kind, paths=paths)
    # The token is read before anything else runs, so no later command can swallow stdin.
    read_token = _script(
        "IFS= read -r token || true",
        '[ -n "$token" ] || { echo "gpu-swarm: no join token on stdin" >&2; exit 1; }',
    )
    return read_token + wait + _script(
        _SWARM_STATE,
        'case "$state" in',
        "  active) ;;",
        f'  inactive) docker swarm join --token "$token" --advertise-addr {addr} {mgr} >/dev/null ;;',
        '  *) echo "gpu-swarm: swarm state is $state; run docker swarm leave --force and retry" >&2; exit 1 ;;',
        "esac",
        'docker info --format "{{.Swarm.NodeID}}"',
    )


def label_node(node_id: str, labels: dict[str, str], *, expected_gpus: int, kind: str) -> str:
    """On a manager: label a node, check the swarm sees its GPUs, print them as JSON."""
    node = shlex.quote(_node_id(node_id))
    kind = validate_kind(kind)
    args = []
    for key, value in sorted(labels.items()):
        if not _LABEL_KEY_RE.match(key):
            raise ValueError(f"node label key {key!r} is not valid")
        args.append("--label-add " + shlex.quote(f"{key}={value}"))
    kind_field = shlex.quote(f'"Kind":"{kind}"')
    update = f"docker node update {' '.join(args)} {node} >/dev/null" if args else ":"
    return _script(
        update,
        f"res=$(docker node inspect {node} --format '{{{{json .Description.Resources.GenericResources}}}}')",
        f"n=$(printf '%s' \"$res\" | grep -o {kind_field} | wc -l)",
        f'[ "$n" -eq {expected_gpus} ] || '
        f'{{ echo "gpu-swarm: swarm sees $n {kind} on node {node_id}, expected {expected_gpus}" >&2; exit 1; }}',
        "printf '%s\\n' \"$res\"",
    )


def advertised_gpus(generic_resources_json: str, kind: str) -> list[str]:
    """The UUIDs in `docker node inspect`'s GenericResources JSON that are of `kind`."""
    entries = json.loads(generic_resources_json.strip() or "null") or []
    return sorted(
        e["NamedResourceSpec"]["Value"]
        for e in entries
        if "NamedResourceSpec" in e and e["NamedResourceSpec"].get("Kind") == kind
    )


def remove_node(node_id: str, *, drain_timeout_s: int = 120) -> str:
    """On a manager: drain a node, wait for its tasks to move, demote it if needed, remove it."""
    node = shlex.quote(_node_id(node_id))
    return _script(
        f"docker node inspect {node} >/dev/null 2>&1 || {{ echo 'node already gone'; exit 0; }}",
        f"docker node update --availability drain {node} >/dev/null",
        f"end=$(( $(date +%s) + {int(drain_timeout_s)} ))",
        f'while [ -n "$(docker node ps {node} --filter desired-state=running -q)" ] '
        '&& [ "$(date +%s)" -lt "$end" ]; do sleep 2; done',
        f"if [ \"$(docker node inspect {node} --format '{{{{.Spec.Role}}}}')\" = manager ]; then "
        f"docker node demote {node} >/dev/null; fi",
        f"docker node rm --force {node} >/dev/null",
        "echo 'node removed'",
    )


def deploy_stack(name: str, compose_path: str) -> str:
    """Deploy (or update) a stack from a compose file already on the manager."""
    return _script(
        f"docker stack deploy --with-registry-auth --prune -c {shlex.quote(compose_path)} "
        f"{shlex.quote(_name(name, 'stack name'))}"
    )


def remove_stack(name: str, *, timeout_s: int = 120) -> str:
    """Remove a stack and wait until it is gone; removing one that is not there succeeds.

    `docker stack rm` returns before its services and networks are gone, and a deploy
    of the same name meanwhile fails on the leftover network.
    """
    stack = shlex.quote(_name(name, "stack name"))
    label = shlex.quote(f"label=com.docker.stack.namespace={name}")
    return _script(
        f"if docker stack ls --format '{{{{.Name}}}}' | grep -qx {stack}; then "
        f"docker stack rm {stack}; else echo 'stack not deployed'; fi",
        f"end=$(( $(date +%s) + {int(timeout_s)} ))",
        f'while [ -n "$(docker service ls -q --filter {label})$(docker network ls -q --filter {label})" ]; do',
        f'  [ "$(date +%s)" -lt "$end" ] || {{ echo "gpu-swarm: stack {name} still has services or networks" >&2; exit 1; }}',
        "  sleep 1",
        "done",
    )


def read_bootstrap_timings(paths: NodePaths = NodePaths()) -> str:
    """Print the node's bootstrap step timings (JSON), or {} when there are none."""
    return _script(f"cat {shlex.quote(paths.bootstrap_timings)} 2>/dev/null || echo '{{}}'")
