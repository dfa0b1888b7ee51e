"""Stacks: deploy a compose file read from stdin, and remove a stack completely.

The compose file travels on stdin, so a deploy never depends on a file that a reboot, a
new manager or a changed connection left behind. Each stack the program deploys is marked
with a swarm config object, which lives in the swarm's Raft store and so survives the loss
of any manager: reconcile() removes marked stacks the program no longer wants, and never
touches a stack someone deployed by hand.
"""
from __future__ import annotations

import json
import re
import posixpath

from swarm.labels import STACK_LABEL, STACK_NAMESPACE_LABEL
from swarm.node_contract import STACK_SETTLE_PATH
from swarm.script import quote, script, sha256_hex, swarm_name, wait_until

DEFAULT_WAIT_SECONDS = 600  # a stack's waitSeconds when its config gives none (settings/reader.py)
STACK_MARKER_PREFIX = f"{STACK_LABEL}."  # the marker of stack s is the config STACK_LABEL.s, labelled STACK_LABEL=s


def marker(name: str) -> str:
    return STACK_MARKER_PREFIX + swarm_name(name, "stack name")


def deploy_stack(name: str, content_sha256: str, wait_seconds: int = DEFAULT_WAIT_SECONDS, swarm_id: str = "") -> str:
    """Deploy (or update) a stack from the compose file on stdin, then wait until it has settled;
    content_sha256 names that content, swarm_id the swarm it goes into (a new swarm, as after the
    only manager was replaced, changes the script, so the stack is deployed into it). The last line of stdout is the waiter's JSON report
    (node/stack_settle.py); a task swarm refuses fails the command with swarm's reason."""
    stack = quote(swarm_name(name, "stack name"))
    sha = sha256_hex(content_sha256, "the compose file")
    if not isinstance(wait_seconds, int) or isinstance(wait_seconds, bool) or wait_seconds < 1:
        raise ValueError(f"the wait for stack {name} must be a whole number of seconds, 1 or more; got {wait_seconds!r}")
    return script(
        f'echo "deploying stack {name} (compose file sha256 {sha[:16]}){into_swarm(swarm_id)}"',
        # --detach=true: the CLI's own wait would hold `pulumi up` for ever on a task that waits
        # for a free GPU, and never says why a task was rejected. The waiter below does both.
        f"docker stack deploy --detach=true --with-registry-auth --prune -c - {stack} >&2",
        # The marker first: a stack whose tasks fail is still ours, for the reconcile to remove.
        f"docker config inspect {quote(marker(name))} >/dev/null 2>&1 ||",
        f"  printf '%s' {stack} | docker config create --label {STACK_LABEL}={stack} {quote(marker(name))} - "
        ">/dev/null",
        "exec " + settle_command(stack, wait_seconds),
    )


def note_moving_stacks(node: str) -> list[str]:
    """Lines that add to $moved the stacks of the tasks that run on node `node` (an ID or a shell
    expansion), read before it is drained. Draining only stops a node's tasks: their replacements
    start elsewhere after swarm's restart delay, so whoever drains waits for these stacks after
    (settle_moved_stacks). A task's container carries its stack's name."""
    label = f'{{{{index .Spec.ContainerSpec.Labels "{STACK_NAMESPACE_LABEL}"}}}}'
    return [
        f"for task in $(docker node ps {node} --filter desired-state=running -q); do",
        f"  moved=\"$moved $(docker inspect --type task --format '{label}' \"$task\" 2>/dev/null || true)\"",
        "done",
    ]


def settle_moved_stacks(timeout_s: int) -> list[str]:
    """Lines that run the stack waiter, as a deploy does, once for each stack named in $moved that
    the program deployed (it has a marker: a stack removed meanwhile, or one deployed by hand, is
    not waited for). The waiter fails with swarm's reason when a task that moved cannot run, and
    lets a task that waits for a GPU be. People read its lines on stderr; stdout stays the caller's."""
    return [
        "waited=' '",
        "for name in $moved; do",
        '  case "$waited" in *" $name "*) continue ;; esac',
        '  waited="$waited$name "',
        f'  docker config inspect "{STACK_MARKER_PREFIX}$name" >/dev/null 2>&1 || continue',
        '  echo "waiting for stack $name, whose tasks moved, to settle" >&2',
        "  " + settle_command('"$name"', timeout_s) + " >/dev/null",
        "done",
    ]


def settle_command(stack: str, wait_seconds: int) -> str:
    """The command line that waits until `stack` (a quoted name or a shell expansion) has settled:
    the installed node software's waiter (the rehearsal points GPU_SWARM_SOFTWARE at node/)."""
    software, settle = posixpath.split(STACK_SETTLE_PATH)
    return f'python3 -I "${{GPU_SWARM_SOFTWARE:-{software}}}/{settle}" --stack {stack} --timeout {wait_seconds}'


def into_swarm(swarm_id: str) -> str:
    """' into swarm <cluster ID>' for a deploy's first line, which makes the swarm part of the script."""
    if swarm_id and not re.fullmatch(r"[a-z0-9]{1,64}", swarm_id):
        raise ValueError(f"not a swarm's cluster ID: {swarm_id!r}")
    return f" into swarm {swarm_id}" if swarm_id else ""


def settle_report(stdout: str | None) -> dict:
    """The waiter's JSON report from a deploy command's stdout (its last line); {} when there is none
    (a preview, where the command has not run)."""
    lines = (stdout or "").strip().splitlines()
    try:
        found = json.loads(lines[-1]) if lines and lines[-1].startswith("{") else {}
    except ValueError:
        return {}
    return found if isinstance(found, dict) else {}


def remove_stack(name: str, *, timeout_s: int = 120) -> str:
    """Remove a stack and wait until it is gone; removing one that is not there succeeds.

    `docker stack rm` returns before its services and networks are gone, and a deploy
    of the same name meanwhile fails on the leftover network.
    """
    return script(*remove_stack_function(), f"remove_stack {quote(swarm_name(name, 'stack name'))} {int(timeout_s)}",
                  f"docker config rm {quote(marker(name))} >/dev/null 2>&1 || true")


def remove_stack_function() -> list[str]:
    """Lines that define `remove_stack NAME SECONDS`: remove the stack (one that is not there is
    fine) and wait until none of its services and networks is left, or fail after SECONDS.

    Swarm refuses to remove a network that a task still runs on (moby/swarmkit#2726), and
    `docker stack rm` removes the networks right after the services, whose tasks may take a moment
    to stop: it then fails with "... is in use by task" and leaves the network. The wait removes
    such a network again once the stack's services are gone, so the stack does go."""
    return [
        "stack_gone() {",
        '  [ -z "$(docker service ls -q --filter "$1")" ] || return 1',
        '  local nets; nets=$(docker network ls -q --filter "$1")',
        '  [ -n "$nets" ] || return 0',
        "  # shellcheck disable=SC2086  # one ID a word",
        "  docker network rm $nets >/dev/null 2>&1 || true",
        '  [ -z "$(docker network ls -q --filter "$1")" ]',
        "}",
        "remove_stack() {",
        f'  local name=$1 limit=$2 label="label={STACK_NAMESPACE_LABEL}=$1" err',
        "  if docker stack ls --format '{{.Name}}' | grep -qx -- \"$name\"; then",
        '    err=$(docker stack rm "$name" 2>&1 >/dev/null) || case "$err" in',
        '      *"is in use by task"*) ;;',
        '      *) printf \'%s\\n\' "$err" >&2; return 1 ;;',
        "    esac",
        '    echo "stack $name removed"',
        "  else",
        '    echo "stack $name not deployed"',
        "  fi",
        *["  " + line for line in wait_until('stack_gone "$label"', "limit", "stack $name still has services or networks",
                                          interval_s=1)],
        "}",
    ]
