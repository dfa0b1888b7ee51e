"""The swarm's membership: find a live manager, init only when there is none, join, leave.

One cluster is one swarm for its whole life. The scripts below never create a second
swarm while a manager of the cluster is in one, and a node that finds itself in another
swarm (its managers all gone and the swarm re-created) leaves it and joins the current one.
"""
from __future__ import annotations

import ipaddress
import json

from swarm.script import (CLUSTER_OF_THIS_NODE, ENGINE_STATE, JOIN_WITH_TOKEN, SWARM_JOIN, SWARM_PORT, cluster_id,
                          ip_address, quote, script)

ROLES = ("manager", "worker")


def probe_manager() -> str:
    """On a manager other than the first: say whether it is a manager of a swarm.

    Prints one JSON object. When the node manages a swarm, the object holds the swarm's
    manager join token, so callers must treat stdout as secret. A node where Docker is not
    installed yet, or not running, is simply not in a swarm.
    """
    return script(
        'state=$(docker info --format "{{.Swarm.LocalNodeState}}" 2>/dev/null || true)',
        'control=$(docker info --format "{{.Swarm.ControlAvailable}}" 2>/dev/null || true)',
        'if [ "$state" = active ] && [ "$control" = true ]; then',
        "  printf '{\"state\": \"active\", \"manager\": true, \"cluster_id\": \"%s\", \"address\": \"%s\", \"token\": \"%s\"}\\n' \\",
        "    \"$(docker info --format '{{.Swarm.Cluster.ID}}')\" \"$(docker info --format '{{.Swarm.NodeAddr}}')\" \\",
        '    "$(docker swarm join-token -q manager)"',
        "else",
        "  printf '{\"state\": \"%s\", \"manager\": false}\\n' \"${state:-absent}\"",
        "fi",
    )


def live_peers(probe_outputs: list[str]) -> str:
    """The probes' answers as init_swarm reads them on stdin: `ADDRESS TOKEN` per live manager."""
    lines = []
    for text in probe_outputs:
        try:
            probe = json.loads(text or "{}")
        except ValueError:
            continue  # an unreadable probe is no evidence of a swarm; init checks the peers' ports too
        if probe.get("state") == "active" and probe.get("manager") and probe.get("token"):
            lines.append(f"{ip_address(probe['address'])} {probe['token']}")
    return "".join(f"{line}\n" for line in lines)


def init_swarm(advertise_addr: str, *, peers: list[str] = (), address_pool: str = "10.200.0.0/16",
               pool_mask_length: int = 24) -> str:
    """Make the first manager part of the cluster's swarm: join a live one, or create it.

    stdin: live_peers() of the other managers' probes. A node already in a swarm is left
    as it is. Otherwise it joins the first live peer that takes it; only when no peer
    manages a swarm, and none answers on the swarm port, is a new swarm created, its
    overlay networks taken from address_pool. Prints {"cluster_id", "node_id", "created"}.
    """
    addr = quote(ip_address(advertise_addr))
    pool = ipaddress.ip_network(address_pool)
    if pool.version != 4 or not 8 <= pool.prefixlen <= pool_mask_length <= 29:
        raise ValueError(f"address pool {address_pool} must be IPv4 and larger than its /{pool_mask_length} subnets")
    others = " ".join(ip_address(p) for p in peers if ip_address(p) != ip_address(advertise_addr))
    create = [
        f"docker swarm init --advertise-addr {addr} --default-addr-pool {quote(str(pool))} \\",
        f"  --default-addr-pool-mask-length {int(pool_mask_length)} >/dev/null",
        'created=true; echo "created a new swarm" >&2',
    ]
    if others:
        create = [
            "joined=''",
            "while read -r peer token; do",
            '  if [ -z "$peer" ] || [ -z "$token" ]; then continue; fi',
            f'  if {JOIN_WITH_TOKEN} {addr} "$peer:{SWARM_PORT}" >/dev/null; then',
            '    joined=$peer; echo "joined the swarm of manager $peer" >&2; break',
            "  fi",
            "done",
            'if [ -z "$joined" ]; then',
            f"  peers={quote(others)}",
            "  for peer in $peers; do",
            "    # A manager that answers on the swarm port holds a swarm we have no token for:",
            "    # creating another one here would split the cluster.",
            f'    if timeout 3 bash -c "exec 3<>/dev/tcp/$peer/{SWARM_PORT}" 2>/dev/null; then',
            '      echo "gpu-swarm: manager $peer runs a swarm, but no manager gave a join token;" \\',
            '        "refusing to create a second swarm. Check the managers (docker node ls) and run pulumi up again" >&2',
            "      exit 1",
            "    fi",
            "  done",
            *(f"  {line}" for line in create),
            "fi",
        ]
    return script(
        *([SWARM_JOIN] if others else []),
        "created=false",
        ENGINE_STATE,
        'if [ "$state" = active ]; then',
        '  [ "$(docker info --format "{{.Swarm.ControlAvailable}}")" = true ] ||',
        '    { echo "gpu-swarm: this node is in a swarm but is not a manager; refusing to init" >&2; exit 1; }',
        'elif [ "$state" != inactive ]; then',
        '  echo "gpu-swarm: swarm state is $state; run docker swarm leave --force on this node and retry" >&2; exit 1',
        "else",
        *(f"  {line}" for line in create),
        "fi",
        'printf \'{"cluster_id": "%s", "node_id": "%s", "created": %s}\\n\' '
        "\"$(docker info --format '{{.Swarm.Cluster.ID}}')\" \"$(docker info --format '{{.Swarm.NodeID}}')\" \"$created\"",
    )


def read_join_tokens(expected_cluster: str) -> str:
    """Print both join tokens as one JSON object; callers must treat stdout as secret.

    The cluster ID makes the tokens follow the swarm: when it changes, so does this script.
    """
    want = quote(cluster_id(expected_cluster))
    return script(
        "got=$(docker info --format '{{.Swarm.Cluster.ID}}')",
        f'[ "$got" = {want} ] || {{ echo "gpu-swarm: this manager is in swarm $got, expected {expected_cluster}" >&2; exit 1; }}',
        "w=$(docker swarm join-token -q worker)",
        "m=$(docker swarm join-token -q manager)",
        'printf \'{"worker": "%s", "manager": "%s"}\\n\' "$w" "$m"',
    )


def join_swarm(*, role: str, managers: list[str], advertise_addr: str, expected_cluster: str) -> str:
    """Join the node to the cluster's swarm; the token is read from stdin. Prints the node ID.

    A node already in that swarm stays. A node in another swarm, or stuck half-way, leaves
    it first: its managers are gone and the swarm was created anew (see init_swarm).
    """
    if role not in ROLES:
        raise ValueError(f"role must be 'manager' or 'worker', got {role!r}")
    if not managers:
        raise ValueError("join_swarm needs at least one manager address")
    targets = " ".join(f"{ip_address(m)}:{SWARM_PORT}" for m in managers)
    addr = quote(ip_address(advertise_addr))
    want = quote(cluster_id(expected_cluster))
    return script(
        # The token is read before anything else runs, so no later command can swallow stdin.
        "IFS= read -r token || true",
        '[ -n "$token" ] || { echo "gpu-swarm: no join token on stdin" >&2; exit 1; }',
        CLUSTER_OF_THIS_NODE,
        SWARM_JOIN,
        ENGINE_STATE,
        'if [ "$state" = active ]; then',
        "  current=$(cluster_of_this_node)",
        f'  if [ "$current" != {want} ]; then',
        f'    echo "gpu-swarm: this node is in swarm ${{current:-unknown}}, not {expected_cluster}; leaving it" >&2',
        "    docker swarm leave --force >/dev/null; state=inactive",
        "  fi",
        'elif [ "$state" != inactive ]; then',
        '  echo "gpu-swarm: swarm state is $state; leaving to join again" >&2',
        "  docker swarm leave --force >/dev/null 2>&1 || true; state=inactive",
        "fi",
        'if [ "$state" = inactive ]; then',
        "  joined=''",
        f"  targets={quote(targets)}",
        "  for target in $targets; do",
        f'    if {JOIN_WITH_TOKEN} {addr} "$target" >/dev/null; then joined=$target; break; fi',
        "  done",
        f'  [ -n "$joined" ] || {{ echo "gpu-swarm: no manager took the join ({targets})" >&2; exit 1; }}',
        "fi",
        "current=$(cluster_of_this_node)",
        f'[ "$current" = {want} ] || {{ echo "gpu-swarm: joined swarm $current, expected {expected_cluster}" >&2; exit 1; }}',
        f'[ "$(docker info --format "{{{{.Swarm.ControlAvailable}}}}")" = {"true" if role == "manager" else "false"} ] ||',
        f'  {{ echo "gpu-swarm: this node is in the swarm, but not as a {role}; see docker node ls" >&2; exit 1; }}',
        'docker info --format "{{.Swarm.NodeID}}"',
    )


def leave_swarm() -> str:
    """Leave whatever swarm this node is in; a node in none is left alone."""
    return script(
        ENGINE_STATE,
        'if [ "$state" = inactive ]; then echo "not in a swarm"; exit 0; fi',
        "docker swarm leave --force >/dev/null",
        'echo "left the swarm"',
    )
