"""python3 -m localswarm up|status|down|node: a real GPU swarm of namespaces on this machine."""
from __future__ import annotations

import argparse
import json
import sys

from localswarm import rehearsal
from localswarm.host import RehearsalError
from localswarm.placement import render_table
from swarm.gpu_kind import DEFAULT_KIND


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python3 -m localswarm", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="create nodes, form the swarm, deploy stacks, show placement")
    up.add_argument("--nodes", type=int, default=3)
    up.add_argument("--gpus-per-node", type=int, default=2)
    up.add_argument("--managers", type=int, default=1)
    up.add_argument("--stack", action="append", metavar="[NAME=]FILE",
                    help="compose file to deploy (repeatable); default: stacks/gpu-smoke.yml, "
                         "scaled to one more replica than there are GPUs")
    up.add_argument("--kind", default=DEFAULT_KIND, help="generic resource kind (default %(default)s)")
    up.add_argument("--json", action="store_true", help="print the result as JSON")
    st = sub.add_parser("status", help="show nodes, GPUs and task placement again")
    st.add_argument("--json", action="store_true")
    sub.add_parser("down", help="remove everything `up` made")
    node = sub.add_parser("node", help="stop/start one node's engine, or re-run its GPU agent")
    node.add_argument("action", choices=("stop", "start", "redetect"))
    node.add_argument("name")
    node.add_argument("--gpus", type=int, help="redetect: simulated GPU count for the new inventory")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    as_json = getattr(args, "json", False)
    # With --json, stdout carries only the JSON document; progress goes to stderr.
    say = (lambda m: print(m, file=sys.stderr, flush=True)) if as_json else (lambda m: print(m, flush=True))
    try:
        if args.command == "up":
            result = rehearsal.up(n_nodes=args.nodes, gpus=args.gpus_per_node, managers=args.managers,
                                  stacks=args.stack, kind=args.kind, progress=say)
        elif args.command == "status":
            result = rehearsal.status(progress=say)
        elif args.command == "down":
            rehearsal.down(progress=say)
            return 0
        else:
            print(json.dumps(rehearsal.node_engine(args.name, args.action, gpus=args.gpus), indent=2))
            return 0
    except RehearsalError as e:
        print(f"localswarm: {e}", file=sys.stderr)
        return 1
    if as_json:
        print(json.dumps(result, indent=2))
    else:
        print(render_table(result))
        if "timings" in result:
            t = result["timings"]
            print(f"\nnodes ready {t['nodes_ready_s']} s, swarm formed {t['swarm_ready_s']} s, "
                  f"stack converged {t['stack_converged_s']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
