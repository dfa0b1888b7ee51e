"""Taking a node out of scheduling for a software change, and admitting it (back) afterwards.

Run on a manager. A node whose release is about to change is drained first (cordon) and
marked as under maintenance; the program rolls each pool in waves of at most its
rollout.maxUnavailable nodes (components/node_rollout.py), so the rest of the pool keeps its
GPUs in service. admit labels the node, checks what the swarm
sees of its GPUs, records the software it runs, and gives back only what cordon (or a
failed GPU check) took: a node an operator drained stays drained.
"""
from __future__ import annotations

import dataclasses
import json

from swarm.gpu_check import GpuCheck, verify_gpus
from swarm.gpu_kind import validate_kind
from swarm.labels import DRAINED_BY_LABEL, MAINTENANCE_LABEL, SOFTWARE_LABEL, node_label_function
from swarm.script import (ARGUMENT_HEADER, NODE_ARGUMENT, RETRY_TRANSIENT_SWARM_ERRORS, label_key,
                          node_argument_lines, node_id, node_ref, quote, script, sha256_hex, swarm_name, wait_until)


def manager_ready(timeout_s: int = 180) -> list[str]:
    """Lines that wait until this manager's engine answers and the swarm has a leader.

    A manager restarts its engine when its own software changes; the commands that other
    nodes run on it meanwhile wait rather than fail.
    """
    return [RETRY_TRANSIENT_SWARM_ERRORS,
            *wait_until("command docker node ls -q >/dev/null 2>&1", timeout_s,
                        "this manager's engine does not answer or the swarm has no leader; see docker node ls")]


def tasks_stopped(node: str) -> str:
    """A shell test: no task of `node` (an ID or a shell expansion) is meant to run, and none still
    does. Draining sets every task's desired state to shutdown at once, but its container runs on
    through its stop_grace_period (its checkpoint, or 90 s on a spot pool: swarm/compose_spot.py), and
    holds its GPUs until it exits; until then `docker node ps` shows it Running. A node that is not
    ready reports nothing more, so only its desired states count: no wait for what it cannot say."""
    return (f'[ -z "$(docker node ps {node} --filter desired-state=running -q)" ] && '
            f"{{ [ \"$(docker node inspect --format '{{{{.Status.State}}}}' {node})\" != ready ] || "
            # A here-string, not a pipe: grep -q quitting early must not read as docker failing (pipefail).
            f"! grep -qE '^(Running|Starting|Preparing)' <<<\"$(docker node ps {node} --format '{{{{.CurrentState}}}}')\"; }}")


GRACE_SLACK_S = 60  # beyond a task's stop_grace_period: its exit reaching the manager, and a slow kill


def longest_grace_function() -> list[str]:
    """Lines that define longest_grace NODE: it prints, in whole seconds, the longest stop_grace_period
    of the tasks meant to run on NODE; 0 when none sets one (swarm's default, 10 s, is inside any drain
    timeout). Asked before the drain: after it, no task of the node is meant to run. The grace is read
    from the swarm, not from the program's compose files: only the swarm knows every stack, the
    program's and those deployed by hand."""
    return [
        "longest_grace() {",
        '  local max=0 ids g',
        '  ids=$(docker node ps "$1" -q --no-trunc --filter desired-state=running 2>/dev/null || true)',
        '  if [ -z "$ids" ]; then echo "$max"; return; fi',
        "  # shellcheck disable=SC2086 # one task ID a word",
        "  for g in $(docker inspect --type task --format '{{json (index .Spec.ContainerSpec \"StopGracePeriod\")}}' "
        "$ids 2>/dev/null || true); do",
        '    case $g in ""|*[!0-9]*) ;; *) g=$((g / 1000000000)); if [ "$g" -gt "$max" ]; then max=$g; fi ;; esac',
        "  done",
        '  echo "$max"',
        "}",
    ]


def wait_tasks_stopped(node: str, timeout_s: int, shown: str = "") -> list[str]:
    """Lines that wait until tasks_stopped(node): for timeout_s, or for the tasks' longest stop_grace_period
    ($grace, from longest_grace before the drain) plus GRACE_SLACK_S where that is longer. Swarm kills
    a task once its grace has passed, so a longer wait is a fault, and a shorter one would fail a roll
    under a stack that asked for its time to checkpoint. shown: the node as the message names it."""
    return [
        f"limit=$(( grace > 0 && grace + {GRACE_SLACK_S} > {int(timeout_s)} ? grace + {GRACE_SLACK_S} : {int(timeout_s)} ))",
        *wait_until(tasks_stopped(node), "limit", f"tasks on node {shown or node} did not stop", interval_s=1,
                    detail="the longest stop_grace_period among them is $grace s"),
    ]


def cordon_node(node: str, *, pool: str, software: str, drain_timeout_s: int = 300) -> str:
    """Drain swarm node `node` before it changes to release `software`; a no-op if it runs it.

    It marks the node as under maintenance (the health reconciler then leaves it alone) and
    drains it if it was active. It never waits for another node: the program orders each
    pool's nodes in waves (components/node_rollout.py), so at most maxUnavailable are out at a time.
    """
    node = node_id(node)
    swarm_name(pool, "pool name")
    want = sha256_hex(software)
    return script(
        *manager_ready(),
        node_label_function(),
        f'if [ "$(node_label {node} {SOFTWARE_LABEL})" = {want} ]; then echo "node {node} already runs this release"; exit 0; fi',
        f'set -- --label-add {MAINTENANCE_LABEL}="$(date +%s):{want[:12]}"',
        f"if [ \"$(docker node inspect --format '{{{{.Spec.Availability}}}}' {node})\" = active ]; then",
        f'  set -- "$@" --availability drain --label-add {DRAINED_BY_LABEL}=rollout',
        # A node joins drained (swarm/script.py's join) and has no release until its first admit:
        # that drain is the program's to give back, as one it made here would be.
        f'elif [ -z "$(node_label {node} {SOFTWARE_LABEL})" ] && [ -z "$(node_label {node} {DRAINED_BY_LABEL})" ]; then',
        f'  set -- "$@" --label-add {DRAINED_BY_LABEL}=rollout',
        "fi",
        *longest_grace_function(),
        f"grace=$(longest_grace {node})",
        f'docker node update "$@" {node} >/dev/null',
        # Its tasks stop before the upgrade changes what they run on, and before admit's check
        # wants the GPUs they hold.
        *wait_tasks_stopped(node, drain_timeout_s),
        f'echo "node {node} drained for its release"',
    )


def admit_node(node: str, labels: dict[str, str], *, expected_gpus: int, kind: str, software: str,
               slots_per_gpu: int = 0, shared_kind: str = "", check: GpuCheck | None = None) -> str:
    """Label a node, check the swarm sees its GPUs, end its maintenance, prove its GPUs (check).

    A node that shares its GPUs advertises slots_per_gpu slots of shared_kind per GPU. node may be
    NODE_ARGUMENT: the script then admits the node whose ID is its first argument (an elastic pool's).
    Prints {"resources": <its generic resources>, "check": <the GPU check's result or null>}.
    """
    node = node_ref(node)
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
        check = dataclasses.replace(check, shared_kind=advertised_kind)  # every other setting as given
    return (ARGUMENT_HEADER if node == NODE_ARGUMENT else "") + script(
        *node_argument_lines(node),
        *manager_ready(),
        node_label_function(),
        # Never admitted and drained by nobody: it joined drained (swarm/script.py), and is ours to give back.
        "joined_drained=''",
        f'if [ -z "$(node_label {node} {SOFTWARE_LABEL})" ] && [ -z "$(node_label {node} {DRAINED_BY_LABEL})" ] && '
        f"[ \"$(docker node inspect --format '{{{{.Spec.Availability}}}}' {node})\" = drain ]; then joined_drained=1; fi",
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
        '  *) if [ -n "$joined_drained" ]; then set -- "$@" --availability active; fi ;;',
        "esac",
        f'if [ $# -gt 0 ]; then docker node update "$@" {node} >/dev/null; fi',
        "check=null",
        *(verify_gpus(node, kind=kind, count=expected_gpus, release=want, check=check, units=expected)
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
