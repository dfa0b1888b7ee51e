"""Taking a node out of scheduling for a software change, and admitting it (back) afterwards.

Run on a manager. A node whose software is about to change is drained first (cordon),
holding its pool's maintenance lease, so at most one node per pool is out at a time while
the rest of the pool keeps its GPUs in service. admit labels the node, checks what the swarm
sees of its GPUs, records the software it runs, and gives back only what cordon (or a
failed GPU check) took: a node an operator drained stays drained.
"""
from __future__ import annotations

import json

from swarm.gpu_check import GpuCheck, verify_gpus
from swarm.gpu_kind import validate_kind
from swarm.labels import DRAINED_BY_LABEL, MAINTENANCE_LABEL, POOL_LABEL, SOFTWARE_LABEL, node_label_function
from swarm.script import (RETRY_TRANSIENT_SWARM_ERRORS, ip_address, label_key, node_id, quote, script, sha256_hex,
                          swarm_name, wait_until)

LOCK_PATH = "/run/lock/gpu-swarm-rollout.lock"
# A lease older than this belongs to a `pulumi up` that died half-way: it no longer blocks.
STALE_LEASE_S = 2 * 3600


def manager_ready(timeout_s: int = 180) -> list[str]:
    """Lines that wait until this manager's engine answers and the swarm has a leader.

    A manager restarts its engine when its own software changes; the commands that other
    nodes run on it meanwhile wait rather than fail.
    """
    return [RETRY_TRANSIENT_SWARM_ERRORS,
            *wait_until("command docker node ls -q >/dev/null 2>&1", timeout_s,
                        "this manager's engine does not answer or the swarm has no leader; see docker node ls")]


def node_by_address() -> str:
    """A bash function: the ID of the swarm node whose address is $1, or nothing."""
    return (
        "node_by_address() {\n"
        "  local ids\n"
        "  mapfile -t ids < <(docker node ls -q)\n"
        "  docker node inspect --format '{{.ID}} {{.Status.Addr}}' \"${ids[@]}\" | awk -v a=\"$1\" '$2 == a { print $1; exit }'\n"
        "}"
    )


def cordon_node(address: str, *, pool: str, software: str, lock_path: str = LOCK_PATH,
                lease_timeout_s: int = 3600, drain_timeout_s: int = 300) -> str:
    """Drain the node at `address` before its software changes; a no-op for new nodes.

    Waits for its pool's maintenance lease (one node per pool at a time), then drains the
    node, if it was active, and waits for its tasks to move.
    """
    addr = quote(ip_address(address))
    pool = swarm_name(pool, "pool name")
    want = sha256_hex(software)
    lease_filter = quote(f"node.label={POOL_LABEL}={pool}")
    return script(
        *manager_ready(),
        node_by_address(),
        node_label_function(),
        f"id=$(node_by_address {addr})",
        f'if [ -z "$id" ]; then echo "node {address} is not in the swarm yet: nothing to drain"; exit 0; fi',
        f'if [ "$(node_label "$id" {SOFTWARE_LABEL})" = {want} ]; then echo "node $id already runs this software"; exit 0; fi',
        f"exec 9>{quote(lock_path)}",
        f"end=$(( $(date +%s) + {int(lease_timeout_s)} ))",
        "while :; do",
        "  flock 9",
        "  holder=''",
        f"  for other in $(docker node ls -q --filter {lease_filter}); do",
        '    [ "$other" != "$id" ] || continue',
        f'    since=$(node_label "$other" {MAINTENANCE_LABEL})',
        f'    if [ -n "$since" ] && [ $(( $(date +%s) - ${{since%%:*}} )) -lt {STALE_LEASE_S} ]; then holder=$other; fi',
        "  done",
        '  if [ -z "$holder" ]; then',
        f"    set -- --label-add {MAINTENANCE_LABEL}=\"$(date +%s):{want[:12]}\"",
        "    if [ \"$(docker node inspect --format '{{.Spec.Availability}}' \"$id\")\" = active ]; then",
        f"      set -- \"$@\" --availability drain --label-add {DRAINED_BY_LABEL}=rollout",
        "    fi",
        '    docker node update "$@" "$id" >/dev/null',
        "    flock -u 9; break",
        "  fi",
        "  flock -u 9",
        '  [ "$(date +%s)" -lt "$end" ] || { echo "gpu-swarm: node $holder of pool'
        f' {pool} has been out for maintenance too long; its software update failed or is still running. '
        f'Fix it, or remove its {MAINTENANCE_LABEL} label, and run pulumi up again" >&2; exit 1; }}',
        f'  echo "waiting: node $holder of pool {pool} is being updated" >&2',
        "  sleep 5",
        "done",
        *wait_until('[ -z "$(docker node ps "$id" --filter desired-state=running -q)" ]', drain_timeout_s,
                    "tasks on node $id did not move away"),
        'echo "node $id drained for its software update"',
    )


def admit_node(node: str, labels: dict[str, str], *, expected_gpus: int, kind: str, software: str,
               slots_per_gpu: int = 0, shared_kind: str = "", check: GpuCheck | None = None) -> str:
    """Label a node, check the swarm sees its GPUs, end its maintenance, prove its GPUs (check).

    A node that shares its GPUs advertises slots_per_gpu slots of shared_kind per GPU.
    Prints {"resources": <its generic resources>, "check": <the GPU check's result or null>}.
    """
    node = node_id(node)
    kind = validate_kind(kind)
    want = sha256_hex(software)
    if expected_gpus < 0:
        raise ValueError(f"expected_gpus must be >= 0, got {expected_gpus}")
    advertised_kind = validate_kind(shared_kind) if slots_per_gpu else kind
    expected = expected_gpus * (slots_per_gpu or 1)
    adds = [f"--label-add {quote(f'{label_key(k)}={v}')}" for k, v in sorted(labels.items())]
    adds.append(f"--label-add {SOFTWARE_LABEL}={want}")
    kind_field = quote(f'"Kind":"{advertised_kind}"')
    if check and slots_per_gpu:
        check = GpuCheck(image=check.image, devices=check.devices, shared_kind=advertised_kind,
                         timeout_s=check.timeout_s)
    return script(
        *manager_ready(),
        node_label_function(),
        f"docker node update {' '.join(adds)} {node} >/dev/null",
        f"res=$(docker node inspect {node} --format '{{{{json .Description.Resources.GenericResources}}}}')",
        f"n=$(printf '%s' \"$res\" | grep -o {kind_field} | wc -l)",
        f'[ "$n" -eq {expected} ] || '
        f'{{ echo "gpu-swarm: swarm sees $n {advertised_kind} on node {node}, expected {expected}" >&2; exit 1; }}',
        # End of maintenance: release the lease, and give back only what the program took.
        # (`docker node update --label-rm` fails on a label that is not there.)
        "set --",
        f'if [ -n "$(node_label {node} {MAINTENANCE_LABEL})" ]; then set -- --label-rm {MAINTENANCE_LABEL}; fi',
        f'case "$(node_label {node} {DRAINED_BY_LABEL})" in',
        f'  rollout|gpu-check) set -- "$@" --availability active --label-rm {DRAINED_BY_LABEL} ;;',
        "esac",
        f'if [ $# -gt 0 ]; then docker node update "$@" {node} >/dev/null; fi',
        "check=null",
        *(verify_gpus(node, kind=kind, count=expected_gpus, release=want, check=check)
          if check and expected_gpus else []),
        "printf '{\"resources\": %s, \"check\": %s}\\n' \"$res\" \"$check\"",
    )


def admitted(stdout: str) -> tuple[list, dict | None]:
    """admit_node's output: the node's generic resources, and its GPU check's result (None: not checked)."""
    doc = json.loads(stdout.strip().splitlines()[-1]) if stdout.strip() else {}
    return doc.get("resources") or [], doc.get("check")


def advertised_gpus(generic_resources_json: str, kind: str) -> list[str]:
    """The UUIDs in `docker node inspect`'s GenericResources JSON that are of `kind`."""
    entries = json.loads(generic_resources_json.strip() or "null") or []
    return sorted(
        e["NamedResourceSpec"]["Value"]
        for e in entries
        if "NamedResourceSpec" in e and e["NamedResourceSpec"].get("Kind") == kind
    )
