"""The swarm made to match the program: nodes and stacks the program no longer has are removed.

Run on a manager during `pulumi up`, after every current node is admitted. Removal happens
here rather than in delete hooks: a delete hook runs with the connection of the past (a
manager that may be gone) and would hold up `pulumi destroy`, while this runs with today's
connection while the nodes to remove are still alive, so their tasks move before they go, and
`up` goes on only once the stacks they moved run again (or wait, saying why).
Only what the program made is touched: nodes with a pool label, stacks with a marker. The nodes of an
elastic pool the program still has are the scaler's to add and remove (node/swarm_scaler.py): kept; those
of a pool it no longer has go like any other.
"""
from __future__ import annotations

from swarm.labels import POOL_LABEL
from swarm.rollout import longest_grace_function, manager_ready, wait_tasks_stopped
from swarm.script import node_id, quote, script, swarm_name, wait_until
from swarm.stacks import (DEFAULT_WAIT_SECONDS, STACK_MARKER_PREFIX, note_moving_stacks, remove_stack_function,
                          settle_moved_stacks)


def reconcile(*, nodes: list[str], stacks: list[str], drain_timeout_s: int = 300,
              stack_timeout_s: int = 120, settle_timeout_s: int = 120,
              moved_timeout_s: int = DEFAULT_WAIT_SECONDS, elastic_pools: list[str] = (),
              stopped: list[str] = ()) -> str:
    """Drain and remove labelled nodes not in `nodes`; remove marked stacks not in `stacks`; then
    wait until every node in `nodes` is ready, and fail naming those that are not; then wait until
    every kept stack that had a task on a removed node has settled again (node/stack_settle.py).
    `stopped`: kept nodes whose instance AWS reports stopped. They stay in the swarm and are not
    waited for (they rejoin once started: an operator's stop, a spot node stopped on interruption),
    and the script says so."""
    keep_nodes = " ".join(node_id(n) for n in sorted(set(nodes)))
    stopped_nodes = " ".join(node_id(n) for n in sorted(set(stopped) & set(nodes)))
    keep_stacks = " ".join(swarm_name(s, "stack name") for s in sorted(set(stacks)))
    keep_pools = " ".join(swarm_name(p, "pool name") for p in sorted(set(elastic_pools)))
    return script(
        *manager_ready(),
        f"keep_nodes=' {keep_nodes} '",
        f"keep_stacks=' {keep_stacks} '",
        "moved=''",
        *longest_grace_function(),
        *remove_stack_function(),
        f"for id in $(docker node ls -q --filter {quote('node.label=' + POOL_LABEL)}); do",
        '  case "$keep_nodes" in *" $id "*) continue ;; esac',
        *_elastic_kept(keep_pools),
        "  role=$(docker node inspect --format '{{.Spec.Role}}' \"$id\")",
        '  echo "removing node $id ($role), which the program no longer has"',
        *_indent(note_moving_stacks('"$id"')),
        '  grace=$(longest_grace "$id")',
        '  docker node update --availability drain "$id" >/dev/null',
        *_indent(wait_tasks_stopped('"$id"', drain_timeout_s, shown="$id")),
        '  if [ "$role" = manager ]; then docker node demote "$id" >/dev/null; fi',
        '  docker node rm --force "$id" >/dev/null',
        "done",
        f"for marker in $(docker config ls --filter name={STACK_MARKER_PREFIX} --format '{{{{.Name}}}}'); do",
        f'  name=${{marker#"{STACK_MARKER_PREFIX}"}}',
        '  case "$keep_stacks" in *" $name "*) continue ;; esac',
        '  echo "removing stack $name, which the program no longer has"',
        f'  remove_stack "$name" {int(stack_timeout_s)} >/dev/null',
        '  docker config rm "$marker" >/dev/null',
        "done",
        *_kept_nodes_ready(settle_timeout_s, stopped_nodes),
        *settle_moved_stacks(moved_timeout_s),
        "echo reconciled",
    )


def _elastic_kept(pools: str) -> list[str]:
    """Lines in the removal loop that keep the nodes of the elastic pools the program has: none without one."""
    if not pools:
        return []
    return [f"  pool=$(docker node inspect --format '{{{{index .Spec.Labels \"{POOL_LABEL}\"}}}}' \"$id\")",
            f"  case ' {pools} ' in *\" $pool \"*) continue ;; esac"]


def _kept_nodes_ready(timeout_s: int, stopped: str) -> list[str]:
    """Lines that wait until every kept node the swarm lists is ready. A manager that was just
    stopped and started (a resize) lists its workers as down or unknown until each reconnects, and
    `up` should neither end on that view nor deploy stacks into it. A node that stays down is the
    truth `up` must tell: it fails, naming it; unless AWS reports its instance stopped, which is
    said and not waited for. One `docker node ls` a round keeps a big pool cheap."""
    said = [f"for id in {stopped}; do",
            '  echo "node $id is kept, not waited for: AWS reports its instance stopped; it rejoins once started" >&2',
            "done"] if stopped else []
    return [
        f"not_waited=' {stopped} '",
        *said,
        "not_ready() {",
        "  docker node ls --format '{{.ID}} {{.Status}} {{.Hostname}}' |",
        '    awk -v keep="$keep_nodes" -v skip="$not_waited" \'BEGIN { n = split(keep, k, " "); for (i = 1; i <= n; i++) want[k[i]] = 1;',
        '      n = split(skip, s, " "); for (i = 1; i <= n; i++) delete want[s[i]] }',
        '      ($1 in want) && $2 != "Ready" { printf "%s%s (%s, %s)", sep, $3, $1, tolower($2); sep = ", " }\'',
        "}",
        *wait_until('[ -z "$(not_ready)" ]', timeout_s,
                    "kept node(s) not ready: $(not_ready); see docker node ls, and the node's own dockerd"),
    ]


def _indent(lines: list[str]) -> list[str]:
    return ["  " + line for line in lines]
