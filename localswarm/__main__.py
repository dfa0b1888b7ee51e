""".venv/bin/python -m localswarm, as root: a real GPU swarm of namespaces on this machine, changed as `pulumi up` changes one."""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from localswarm import changes, rehearsal
from localswarm.host import CLI, RehearsalError, find_engine
from localswarm.placement import render_table
from localswarm.health import DEFAULT_XID
from swarm.gpu_kind import DEFAULT_KIND

HEALTH_ACTIONS = ("gpu-fault", "gpu-heal", "spot-notice", "maintenance-notice")

NEXT_STEPS = f"""
Try next:
  {CLI} status --watch          # watch tasks move (Ctrl-C to stop)
  {CLI} node stop node-2        # a node fails; its tasks move to free GPUs
  {CLI} node start node-2
  {CLI} node gpu-fault node-2   # a GPU falls off the bus: the node is drained, its tasks move
  {CLI} node gpu-heal node-2    # healthy again (after 5 s of passing checks): active again
  {CLI} down                    # remove everything
  ./scripts/rehearse.sh         # the program's own `pulumi up`: replace, scale and roll nodes there"""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=CLI, description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    def command(name: str, text: str) -> argparse.ArgumentParser:
        c = sub.add_parser(name, help=text, description=text)
        c.add_argument("--json", action="store_true", help="print the result as JSON (progress goes to stderr)")
        return c

    up = command("up", "create nodes, form the swarm, deploy stacks, show placement")
    up.description = ("Create nodes, form the swarm, deploy stacks, wait until every task is settled, show "
                      "placement. Each stack's deploy command waits on the manager, as the program's does "
                      "(node/stack_settle.py). A task is settled when it runs, waits for a GPU that no task is "
                      "about to free, or has ended: tasks that exit, as jobs and smoke tests do, are shown with "
                      "their last state, exit code and GPUs, restarted or not. Stacks that do not settle (a task "
                      "swarm refuses, one that fails again and again without ever completing, or 120 s without "
                      "settling) fail `up` and keep the swarm to look at.")
    up.add_argument("--nodes", type=int, default=3)
    up.add_argument("--gpus-per-node", type=int, default=2)
    up.add_argument("--managers", type=int, default=1)
    up.add_argument("--stack", action="append", metavar="[NAME=]FILE",
                    help="compose file to deploy (repeatable), checked and rewritten as `pulumi preview` does "
                         "(Compose GPU requests become reservations); default: stacks/gpu-smoke.yml, "
                         "scaled to one more replica than there are GPUs")
    up.add_argument("--kind", default=DEFAULT_KIND, help="generic resource kind (default %(default)s)")
    up.add_argument("--slots-per-gpu", type=int, default=0, metavar="K",
                    help="share GPUs: K slots per GPU under <kind>-SHARED (default: whole GPUs)")
    up.add_argument("--shared-nodes", type=int, metavar="N",
                    help="with --slots-per-gpu: only the last N nodes share their GPUs (default: all)")
    up.add_argument("--keep-on-failure", action=argparse.BooleanOptionalAction, default=None,
                    help="leave a failed rehearsal in place to look at (then run `down`). Default: kept when only "
                         "its stacks did not converge, removed when building the swarm failed; "
                         "--no-keep-on-failure removes it in both cases")
    up.add_argument("--monitoring", action="store_true",
                    help="also deploy the monitoring stack (stacks/monitoring.yml) as `monitoring: true` does, with "
                         "Debian's Prometheus (downloaded once) and a stand-in for Grafana")
    command("top", "each GPU's node, model, utilization, memory and the task on it (node/gpu_top.py), and with "
                   "--monitoring the dashboard's top panel as Prometheus answers it")
    st = command("status", "show nodes, GPUs and task placement")
    st.add_argument("--watch", action="store_true", help="refresh every --interval seconds until Ctrl-C")
    st.add_argument("--interval", type=float, default=1.0)
    command("down", "remove everything `up` made")
    node = command("node", "fail, restore or re-detect one node; make its GPU or instance sick")
    node.add_argument("action", choices=("stop", "start", "redetect", *HEALTH_ACTIONS),
                      help="stop/start its engine; redetect: re-run its agent (--gpus) and restart the engine "
                           "if that changed anything; "
                           "gpu-fault: a GPU reports an XID (--gpu, --xid); gpu-heal: clear faults and notices; "
                           "spot-notice: its IMDS announces a spot reclaim; maintenance-notice: its IMDS "
                           "lists a system-reboot that AWS scheduled a minute from now")
    node.add_argument("name", help="a node of `up` (node-2), or for gpu-fault, gpu-heal, spot-notice and "
                                   "maintenance-notice the hostname of a machine of Pulumi's CLI (gpu-swarm-dev-t4-0)")
    node.add_argument("--gpus", type=int, help="redetect: simulated GPU count for the new inventory")
    node.add_argument("--gpu", metavar="UUID", help="gpu-fault: which GPU (default: the node's first)")
    node.add_argument("--xid", type=int, default=DEFAULT_XID,
                      help="gpu-fault: the XID it reports (default %(default)s, fallen off the bus)")
    # Nodes replaced, added, removed and rolled, and stacks changed, are the program's: `pulumi up` does them
    # in the rehearsal (`pulumi --stack dev ...` below), through Pulumi's own engine.
    command("converge", "run every swarm step of `pulumi up` again (nothing changed)")
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
        done = pulumi_cli.run(args.args, args.stack, args.stack_file, bump_software=args.bump_node_software)
        if done.returncode == 0 and args.report and args.args[:1] == ["up"]:
            print("\n".join(["", *pulumi_cli.report(args.stack)]))
        return done.returncode
    # With --json, stdout carries only the JSON document; progress goes to stderr.
    say = (lambda m: print(m, file=sys.stderr, flush=True)) if args.json else (lambda m: print(m, flush=True))
    try:
        if args.command == "status" and args.watch:
            return _watch(args.interval)
        result = _run(args, say)
        if args.command == "up":
            from localswarm import top
            result["cost"] = top.cost_now()
        if args.command == "up" and args.monitoring:
            from localswarm import monitoring_stack, state as state_mod
            manager = next(n for n in state_mod.nodes_of(state_mod.require_state()) if n.role == "manager")
            result["monitoring"] = monitoring_stack.deploy(manager, find_engine(), progress=say)
    except RehearsalError as e:
        print(f"localswarm: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    view = result.get("view", result) if isinstance(result, dict) else None
    if view and "nodes" in view:
        print(render_table(view))
    if args.command == "up":
        from localswarm.top import gpu_top
        print("\n".join(gpu_top.render_cost(result["cost"])))
        t = result["timings"]
        print(f"\nengines ready {t['nodes_ready_s']} s, swarm formed {t['swarm_ready_s']} s, "
              f"stacks converged {t['stack_converged_s']} s")
        print(NEXT_STEPS)
    elif args.command == "top":
        from localswarm import top
        print(top.render(result))
        return 1 if result["errors"] else 0
    elif args.command == "node" and args.action in ("stop", "start"):
        print(f"{args.name}: engine {'started' if result['running'] else 'stopped'}")
    elif args.command == "node" and args.action in HEALTH_ACTIONS:
        print(f"{args.name}: {_health_summary(args.action, result)}; its health watcher reports it within a "
              f"second and stops the node's sentinel task, and the manager drains the node on that at once (or "
              f"reactivates it once it sees the healthy label, up to 20 s)")
    elif args.command == "node" and args.action == "redetect":
        print(f"{args.name}: {len(result['gpus'])} GPU(s); daemon.json "
              f"{'changed, engine restarted' if result['engine_restarted'] else 'unchanged'}")
    return 0


def _run(args, say):
    if args.command == "up":
        return rehearsal.up(n_nodes=args.nodes, gpus=args.gpus_per_node, managers=args.managers, stacks=args.stack,
                            kind=args.kind, progress=say, keep_on_failure=args.keep_on_failure,
                            slots_per_gpu=args.slots_per_gpu, shared_nodes=args.shared_nodes)
    if args.command == "top":
        from localswarm import top
        return top.top()
    if args.command == "status":
        return rehearsal.status(progress=say)
    if args.command == "down":
        return rehearsal.down(progress=say)
    if args.command == "node":
        if args.action in HEALTH_ACTIONS:
            return _node_health(args)
        return changes.node_engine(args.name, args.action, gpus=args.gpus)
    if args.command == "converge":
        return changes.converge_again(progress=say)
    raise AssertionError(args.command)


def _node_health(args) -> dict:
    """On the fast rehearsal's node NAME, or on the machine of Pulumi's CLI whose hostname is NAME."""
    from localswarm import pulumi_cli, state
    if state.load_state() or not pulumi_cli.holds_machines():
        return changes.node_health(args.name, args.action, gpu=args.gpu, xid=args.xid)
    from localswarm import machine_health
    if args.action == "gpu-fault":
        return machine_health.gpu_fault(args.name, args.gpu, args.xid)
    if args.action == "gpu-heal":
        return machine_health.gpu_heal(args.name)
    if args.action == "spot-notice":
        return machine_health.spot_notice(args.name)
    return machine_health.maintenance_notice(args.name)


def _overrides(pairs: list[str]) -> dict:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise RehearsalError(f"--set {pair!r}: expected KEY=VALUE, e.g. --set managerCount=3")
        out[key] = value
    return out


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
