""".venv/bin/python -m localswarm, as root: Pulumi's own CLI runs the program against machines on this host, and the drills act on them."""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from localswarm import rehearsal
from localswarm.host import CLI, RehearsalError
from localswarm.machine_health import DEFAULT_XID
from localswarm.placement import render_table

HEALTH_ACTIONS = ("gpu-fault", "gpu-heal", "spot-notice", "maintenance-notice")

def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=CLI, description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    def command(name: str, text: str) -> argparse.ArgumentParser:
        c = sub.add_parser(name, help=text, description=text)
        c.add_argument("--json", action="store_true", help="print the result as JSON (progress goes to stderr)")
        return c

    command("top", "each GPU's node, model, utilization, memory and the task on it (node/gpu_top.py), and with "
                   "`monitoring: true` the dashboard's top panel as Prometheus answers it")
    st = command("status", "show nodes, GPUs and task placement")
    st.add_argument("--watch", action="store_true", help="refresh every --interval seconds until Ctrl-C")
    st.add_argument("--interval", type=float, default=1.0)
    command("down", "remove every machine and everything else the rehearsal made")
    node = command("node", "make one machine's GPU or instance sick, or well again")
    node.add_argument("action", choices=HEALTH_ACTIONS,
                      help="gpu-fault: a GPU reports an XID (--gpu, --xid); gpu-heal: clear faults and notices; "
                           "spot-notice: its IMDS announces a spot reclaim; maintenance-notice: its IMDS "
                           "lists a system-reboot that AWS scheduled a minute from now")
    node.add_argument("name", help="the hostname of a machine of Pulumi's CLI (gpu-swarm-dev-t4-0)")
    node.add_argument("--gpu", metavar="UUID", help="gpu-fault: which GPU (default: the node's first)")
    node.add_argument("--xid", type=int, default=DEFAULT_XID,
                      help="gpu-fault: the XID it reports (default %(default)s, fallen off the bus)")
    # Nodes made, replaced, added, removed and rolled, and stacks changed, are the program's: `pulumi up` does
    # them in the rehearsal (`pulumi --stack dev ...` below), through Pulumi's own engine.
    real = sub.add_parser("pulumi", help="Pulumi's real CLI on the unchanged program, with the rehearsal's "
                          "local providers (localswarm/pulumi_cli.py): preview, stack, config",
                          description="Pulumi's real CLI on the unchanged program, with the rehearsal's local "
                                      "providers (localswarm/pulumi_cli.py), e.g. `pulumi preview --diff`.")
    real.add_argument("--stack", default="dev", help="Pulumi.<stack>.yaml to use (default %(default)s)")
    real.add_argument("--stack-file", type=Path, default=None, metavar="PATH",
                      help="the stack's config file (default Pulumi.<stack>.yaml of the project)")
    real.add_argument("--report", action="store_true",
                      help="after a successful `up`, print the rehearsal's report from the stack's outputs")
    real.add_argument("--bump-node-software", action="store_true",
                      help="as if node/ had changed (and stays changed for later runs): a new bundle that rolls "
                           "through the nodes")
    real.add_argument("--status", action="store_true",
                      help="instead of running the CLI: the swarm of its machines (nodes, GPUs, tasks); JSON with --json")
    real.add_argument("--json", action="store_true", help="with --status: the view as JSON")
    real.add_argument("args", nargs=argparse.REMAINDER, help="the CLI's own arguments")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "pulumi":
        from localswarm import pulumi_cli
        if args.status:
            try:
                view = pulumi_cli.status(args.stack)
            except RehearsalError as e:
                print(f"localswarm: {e}", file=sys.stderr)
                return 1
            print(json.dumps(view, indent=2) if args.json else render_table(view))
            return 0
        try:
            done = pulumi_cli.run(args.args, args.stack, args.stack_file, bump_software=args.bump_node_software)
        except RehearsalError as e:  # what the rehearsal could not prepare, before the CLI ran
            print(f"localswarm: {e}", file=sys.stderr)
            return 1
        if done.returncode == 0 and args.report and args.args[:1] == ["up"]:
            print("\n".join(["", *pulumi_cli.report(args.stack)]))
        return done.returncode
    # With --json, stdout carries only the JSON document; progress goes to stderr.
    say = (lambda m: print(m, file=sys.stderr, flush=True)) if args.json else (lambda m: print(m, flush=True))
    try:
        if args.command == "status" and args.watch:
            return _watch(args.interval)
        result = _run(args, say)
    except RehearsalError as e:
        print(f"localswarm: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    view = result.get("view", result) if isinstance(result, dict) else None
    if view and "nodes" in view:
        print(render_table(view))
    if args.command == "top":
        from localswarm import top
        print(top.render(result))
        return 1 if result["errors"] else 0
    elif args.command == "node":
        print(f"{args.name}: {_health_summary(args.action, result)}; its health watcher reports it within a "
              f"second and stops the node's sentinel task, and the manager drains the node on that at once (or "
              f"reactivates it once it sees the healthy label, up to 20 s)")
    return 0


def _run(args, say):
    if args.command == "top":
        from localswarm import top
        return top.top()
    if args.command == "status":
        return rehearsal.status(progress=say)
    if args.command == "down":
        return rehearsal.down(progress=say)
    if args.command == "node":
        return _node_health(args)
    raise AssertionError(args.command)


def _node_health(args) -> dict:
    """On the machine of Pulumi's CLI whose hostname is NAME."""
    from localswarm import machine_health
    if args.action == "gpu-fault":
        return machine_health.gpu_fault(args.name, args.gpu, args.xid)
    if args.action == "gpu-heal":
        return machine_health.gpu_heal(args.name)
    if args.action == "spot-notice":
        return machine_health.spot_notice(args.name)
    return machine_health.maintenance_notice(args.name)


def _health_summary(action: str, result: dict) -> str:
    if action == "gpu-fault":
        return f"GPU {result['gpu']} reports XID {result['xid']}"
    if action == "spot-notice":
        return f"its IMDS announces a spot {result['action']} at {result['time']}"
    if action == "maintenance-notice":
        return f"its IMDS lists a scheduled {result['Code']} from {result['NotBefore']}"
    return f"faults cleared on {', '.join(result['healed']) or 'no GPU'}, {result['notices_cleared']} notice(s) cleared"


def _watch(interval: float) -> int:
    """Like `watch`: redraw the status until Ctrl-C."""
    try:
        while True:
            try:
                text = render_table(rehearsal.status(progress=lambda _: None))
            except RehearsalError as e:
                text = f"localswarm: {e}"
            sys.stdout.write("\033[H\033[2J" + time.strftime("%H:%M:%S") + f"  every {interval:g}s, Ctrl-C to stop\n\n"
                             + text + "\n")
            sys.stdout.flush()
            time.sleep(interval)
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
