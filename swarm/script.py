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

from swarm.node_contract import DOCKER_SOCKET

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


# An admit rendered once for every node of an elastic pool, whose node ID comes at run time as the script's first
# argument (node/swarm_scaler.py runs it on the leader for each node that joins): the builders take NODE_ARGUMENT
# where an ID goes, and the script opens with node_argument_lines(), which check it as node_id() checks an ID
# given here. Checked so, it is safe unquoted, and the script tells shellcheck so (ARGUMENT_HEADER).
NODE_ARGUMENT = "$node"
ARGUMENT_HEADER = "# shellcheck disable=SC2086 # $node is checked first: 25 characters [a-z0-9]\n"


def node_ref(value: str) -> str:
    """A node ID checked as node_id() checks it, or NODE_ARGUMENT."""
    return value if value == NODE_ARGUMENT else node_id(value)


def node_prefix(value: str) -> str:
    """Its first 12 characters, as docker shows a short ID."""
    return "${node:0:12}" if value == NODE_ARGUMENT else value[:12]


def node_argument_lines(value: str) -> list[str]:
    if value != NODE_ARGUMENT:
        return []
    return ["node=${1:-}",
            "[[ $node =~ ^[a-z0-9]{25}$ ]] || "
            "{ echo \"gpu-swarm: expected a 25-character swarm node ID as the argument, got '$node'\" >&2; exit 2; }"]


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


# `docker swarm join --token T` puts the join token in the CLI's argv, where `ps` and
# /proc/<pid>/cmdline show it to every user of the node. swarm_join makes the CLI's own
# request instead (POST /swarm/join to the Engine API, ListenAddr the CLI's default) with the
# token read from stdin, and fails as the CLI does: exit 1 and "Error response from daemon:
# <its message>", or "Cannot connect to the Docker daemon at ...". It talks to DOCKER_HOST's
# unix socket when that is set (the rehearsal's engines), else to dockerd's own.
# The node joins drained (`docker swarm join --availability drain`): it takes no task until
# swarm/rollout.py's admit has checked it, even when `pulumi up` stops between the join and
# the admit (another pool's capacity error), so the swarm is never half-joined.
_JOIN_REQUEST = f"""import http.client, json, socket, sys
addr, remote, path = sys.argv[1:4]
token = sys.stdin.readline().strip()
class Engine(http.client.HTTPConnection):
    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(path)
body = json.dumps({{"ListenAddr": "0.0.0.0:{SWARM_PORT}", "AdvertiseAddr": addr, "RemoteAddrs": [remote],
                   "JoinToken": token, "Availability": "drain"}})
try:
    engine = Engine("localhost")
    engine.request("POST", "/swarm/join", body, {{"Content-Type": "application/json"}})
    answer = engine.getresponse()
    text = answer.read().decode("utf-8", "replace")
except (OSError, http.client.HTTPException):
    sys.exit(f"Cannot connect to the Docker daemon at unix://{{path}}. Is the docker daemon running?")
if answer.status != 200:
    try:
        text = json.loads(text)["message"]
    except (ValueError, KeyError, TypeError):
        pass
    sys.exit(f"Error response from daemon: {{text.strip()}}")
"""
SWARM_JOIN = (
    "# docker swarm join, with the token on stdin rather than on its command line, where ps shows it.\n"
    "swarm_join() {  # ADVERTISE_ADDR MANAGER:PORT\n"
    f"  local sock={DOCKER_SOCKET}\n"
    "  case ${DOCKER_HOST:-} in\n"
    "    '') ;;\n"
    "    unix://*) sock=${DOCKER_HOST#unix://} ;;\n"
    '    *) echo "gpu-swarm: DOCKER_HOST=$DOCKER_HOST is not a unix socket, which the join needs" >&2; return 1 ;;\n'
    "  esac\n"
    f'  python3 -I -c {shlex.quote(_JOIN_REQUEST)} "$1" "$2" "$sock"\n'
    "}"
)
# The line that joins: the token from $token, on a pipe.
JOIN_WITH_TOKEN = "printf '%s\\n' \"$token\" | swarm_join"


# For scripts that talk to a manager: while a manager's engine restarts (its software rolls)
# the swarm elects a leader, and calls fail for seconds with "context deadline exceeded" or
# "rpc error". Those, and only those, are tried again, for up to a minute.
# One of them is no outage: `docker node update` sends the node's version as it read it, and
# swarm refuses the write ("update out of sequence") when the node changed in between. Swarm
# writes a node itself whenever its agent registers again, which an agent does each time its
# engine's labels change (a node's condition labels, on every condition change). Named here
# on its own, as it is a race to read again, not a swarm to wait for.
RETRY_TRANSIENT_SWARM_ERRORS = (
    "docker() {\n"
    "  local try=0 rc err\n"
    "  err=$(mktemp)\n"
    "  while :; do\n"
    '    rc=0; command docker "$@" 2>"$err" || rc=$?\n'
    "    if [ \"$rc\" -eq 0 ] || [ \"$try\" -ge 30 ] ||\n"
    "       ! grep -qiE 'deadline exceeded|rpc error|no leader|cannot connect to the docker daemon|unavailable|update out of sequence' \"$err\"; then\n"
    '      cat "$err" >&2; rm -f "$err"; return "$rc"\n'
    "    fi\n"
    "    try=$((try + 1)); sleep 2\n"
    "  done\n"
    "}"
)


def wait_until(condition: str, timeout_s: int | str, message: str, interval_s: float = 2, detail: str = "") -> list[str]:
    """Lines that poll `condition` (a shell test) until it holds; exit 1 with `message` after timeout_s.

    timeout_s: seconds, or the name of a shell variable that the script computed ("limit");
    detail: more for the message, after how long it waited."""
    if isinstance(timeout_s, str):
        if not re.fullmatch(r"[a-z_]+", timeout_s):
            raise ValueError(f"timeout_s: expected seconds or a shell variable's name, found {timeout_s!r}")
        limit, shown = timeout_s, f"${timeout_s}"
    else:
        limit = shown = str(int(timeout_s))
    more = f"; {detail}" if detail else ""
    return [
        f"end=$(( $(date +%s) + {limit} ))",
        f"until {condition}; do",
        f'  [ "$(date +%s)" -lt "$end" ] || {{ echo "gpu-swarm: {message} (gave up after {shown} s{more})" >&2; exit 1; }}',
        f"  sleep {interval_s:g}",
        "done",
    ]
