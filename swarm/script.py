"""What every swarm script shares: strict bash, values validated before they reach a shell.

The builders in this package are small pure functions that return bash scripts. The
Pulumi components send them over SSH (pulumi-command, as root) and the local rehearsal
runs the very same strings against its namespaced engines, so what the tests prove
locally is what runs on AWS. Secrets never appear in a script: tokens travel on stdin.
"""
from __future__ import annotations

import ipaddress
import re
import shlex

SWARM_PORT = 2377
_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")
_LABEL_KEY_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_NODE_ID_RE = re.compile(r"[a-z0-9]{25}")
_CLUSTER_ID_RE = re.compile(r"[a-z0-9]{25}")
_HASH_RE = re.compile(r"[0-9a-f]{64}")


def script(*lines: str) -> str:
    return "\n".join(("set -eu", *lines)) + "\n"


def ip_address(value: str) -> str:
    try:
        return str(ipaddress.ip_address(value))
    except ValueError:
        raise ValueError(f"expected an IP address, got {value!r}") from None


def swarm_name(value: str, what: str) -> str:
    if not isinstance(value, str) or not _NAME_RE.match(value):
        raise ValueError(
            f"{what} {value!r} is not valid: use lowercase letters, digits, '-' and '_' "
            "(at most 63 characters, starting with a letter or digit)"
        )
    return value


def node_id(value: str) -> str:
    if not isinstance(value, str) or not _NODE_ID_RE.fullmatch(value):
        raise ValueError(f"expected a 25-character swarm node ID, got {value!r}")
    return value


def cluster_id(value: str) -> str:
    if not isinstance(value, str) or not _CLUSTER_ID_RE.fullmatch(value):
        raise ValueError(f"expected a 25-character swarm cluster ID, got {value!r}")
    return value


def sha256_hex(value: str, what: str = "the node software") -> str:
    if not isinstance(value, str) or not _HASH_RE.fullmatch(value):
        raise ValueError(f"expected a sha256 hex digest of {what}, got {value!r}")
    return value


def label_key(key: str) -> str:
    if not isinstance(key, str) or not _LABEL_KEY_RE.match(key):
        raise ValueError(f"node label key {key!r} is not valid")
    return key


def quote(value: str) -> str:
    return shlex.quote(value)


# `docker info --format` exits 0 with empty output when the engine is down, so check it.
ENGINE_STATE = (
    'state=$(docker info --format "{{.Swarm.LocalNodeState}}" 2>/dev/null || true); '
    '[ -n "$state" ] || { echo "gpu-swarm: cannot reach the Docker engine" >&2; exit 1; }'
)

# The swarm a node belongs to. A manager knows it; a worker does not say, but its TLS
# certificate, issued by the swarm, carries the cluster ID as its organisation (O=).
CLUSTER_OF_THIS_NODE = (
    "cluster_of_this_node() {\n"
    '  if [ "$(docker info --format "{{.Swarm.ControlAvailable}}")" = true ]; then\n'
    "    docker info --format '{{.Swarm.Cluster.ID}}'; return\n"
    "  fi\n"
    "  root=$(docker info --format '{{.DockerRootDir}}')\n"
    '  openssl x509 -noout -subject -in "$root/swarm/certificates/swarm-node.crt" 2>/dev/null |\n'
    "    sed -n 's/.*O *= *\\([a-z0-9]*\\).*/\\1/p'\n"
    "}"
)


# For scripts that talk to a manager: while a manager's engine restarts (its software rolls)
# the swarm elects a leader, and calls fail for seconds with "context deadline exceeded" or
# "rpc error". Those, and only those, are tried again, for up to a minute.
RETRY_TRANSIENT_SWARM_ERRORS = (
    "docker() {\n"
    "  local try=0 rc err\n"
    "  err=$(mktemp)\n"
    "  while :; do\n"
    '    rc=0; command docker "$@" 2>"$err" || rc=$?\n'
    "    if [ \"$rc\" -eq 0 ] || [ \"$try\" -ge 30 ] ||\n"
    "       ! grep -qiE 'deadline exceeded|rpc error|no leader|cannot connect to the docker daemon|unavailable' \"$err\"; then\n"
    '      cat "$err" >&2; rm -f "$err"; return "$rc"\n'
    "    fi\n"
    "    try=$((try + 1)); sleep 2\n"
    "  done\n"
    "}"
)


def wait_until(condition: str, timeout_s: int, message: str, interval_s: float = 2) -> list[str]:
    """Lines that poll `condition` (a shell test) until it holds; exit 1 with `message` after timeout_s."""
    return [
        f"end=$(( $(date +%s) + {int(timeout_s)} ))",
        f"until {condition}; do",
        f'  [ "$(date +%s)" -lt "$end" ] || {{ echo "gpu-swarm: {message} (gave up after {int(timeout_s)} s)" >&2; exit 1; }}',
        f"  sleep {interval_s:g}",
        "done",
    ]
