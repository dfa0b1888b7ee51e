"""Bring a rehearsal swarm up, show it, change it as `pulumi up` would, and take it down again.

The swarm is formed and changed by localswarm.converge, which runs the swarm/ scripts the
Pulumi components send over SSH, and each node's GPUs come from the real agent.
"""
from __future__ import annotations

import math
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

from localswarm import health, metrics, network, nodes as nodes_mod, placement, registry
from localswarm.converge import deploy_stacks, form_swarm
from localswarm.host import CLI, REPO, RehearsalError, check_host, find_engine, parallel, run
from localswarm.nodes import RUN_ROOT, STATE_ROOT, Node
from localswarm.stacks import prepare_stack
from localswarm.state import desired, first_boot, load_state, new_node, nodes_of, require_state, save_state
from swarm.gpu_kind import DEFAULT_KIND, MAX_SLOTS_PER_GPU, default_shared_kind, validate_kind

DEFAULT_STACK = REPO / "stacks" / "gpu-smoke.yml"
DEFAULT_SHARED_STACK = REPO / "stacks" / "inference-shared.yml"
Progress = Callable[[str], None]


def _check_args(n_nodes: int, gpus: int, managers: int, kind: str, slots: int = 0, shared_nodes: int = 0) -> None:
    problems = []
    if slots and not 2 <= slots <= MAX_SLOTS_PER_GPU:
        problems.append(f"--slots-per-gpu must be from 2 to {MAX_SLOTS_PER_GPU}, got {slots}")
    if not 0 <= shared_nodes <= n_nodes:
        problems.append(f"--shared-nodes must be from 0 to --nodes ({n_nodes}), got {shared_nodes}")
    if not 1 <= n_nodes <= 32:
        problems.append(f"--nodes must be between 1 and 32, got {n_nodes}")
    if not 0 <= gpus <= 16:
        problems.append(f"--gpus-per-node must be between 0 and 16, got {gpus}")
    if managers not in (1, 3, 5, 7) or managers > n_nodes:
        problems.append(f"--managers must be 1, 3, 5 or 7 (a raft majority) and at most --nodes, got {managers}")
    try:
        validate_kind(kind)
    except ValueError as e:
        problems.append(f"--kind: {e}")
    if problems:
        raise RehearsalError("; ".join(problems))


class NotConverged(RehearsalError):
    """The swarm is up, but its stacks did not settle: what is wrong is in a stack, and the swarm shows it."""


def up(*, n_nodes: int = 3, gpus: int = 2, managers: int = 1, stacks: list[str] | None = None,
       kind: str = DEFAULT_KIND, progress: Progress = print, converge_timeout: float = 120,
       keep_on_failure: bool | None = None, slots_per_gpu: int = 0, shared_nodes: int | None = None) -> dict:
    """keep_on_failure: None keeps the swarm when only its stacks failed to converge (the evidence is
    on the swarm: its tasks, their errors and logs) and removes a rehearsal whose building failed;
    True keeps it either way, False removes it either way."""
    clock = _Clock()
    say = lambda msg: progress(f"[{clock.now():5.1f}s] {msg}")  # noqa: E731
    shared = (n_nodes if shared_nodes is None else shared_nodes) if slots_per_gpu else 0
    _check_args(n_nodes, gpus, managers, kind, slots_per_gpu, shared)
    check_host()
    engine = find_engine()
    if load_state() or network.our_netns():
        raise RehearsalError(f"a rehearsal is already up; see it with `{CLI} status`, or run `{CLI} down` first")
    # The last `shared` nodes share their GPUs (as one pool of the program would); the rest don't.
    nodes = [new_node(i, "manager" if i <= managers else "worker", shared=i > n_nodes - shared)
             for i in range(1, n_nodes + 1)]
    whole_gpus = gpus * (n_nodes - shared)
    shared_kind = default_shared_kind(kind) if shared else ""
    defaults = ([str(DEFAULT_STACK)] if whole_gpus else []) + ([str(DEFAULT_SHARED_STACK)] if shared and gpus else [])
    prepared = {}
    for arg in stacks or defaults:  # every stack is checked before anything is created
        name, _, file = arg.rpartition("=") if "=" in arg else ("", "", arg)
        name = name or stack_name(Path(file))
        prepared[name] = prepare_stack(Path(file), name, kind, gpus if whole_gpus else 0, whole_gpus,
                                       scale=not stacks, say=say, shared_kind=shared_kind or None,
                                       total_slots=gpus * shared * slots_per_gpu)

    state = {"kind": kind, "gpus_per_node": gpus, "nodes": [n.to_dict() for n in nodes], "stacks": prepared,
             "slots_per_gpu": slots_per_gpu, "shared_kind": shared_kind}
    save_state(state)  # first, so that `down` can clean up after a failure below
    clock.lap("checks")  # arguments, host, engine and stack files
    try:
        timings = _build(state, engine, say, clock, converge_timeout)
    except BaseException as e:
        if keep_on_failure or (keep_on_failure is None and isinstance(e, NotConverged)):
            first = nodes_of(state)[0]
            raise RehearsalError(
                f"{e}\nThe rehearsal is still up, so you can look at what went wrong: `{CLI} status`, or "
                f"`DOCKER_HOST=unix://{first.sock} docker service ps --no-trunc <service>` (and `docker service "
                f"logs`); then run `{CLI} down`. (`up --no-keep-on-failure` removes it instead.)") from None
        say("up failed: removing what it made")
        down(progress=lambda _: None)
        if isinstance(e, RehearsalError):
            raise RehearsalError(f"{e}\nNothing is left behind (`{CLI} down` ran).") from None
        raise
    view = timings.pop("view")
    view["timings"] = timings
    return view


class _Clock:
    """Seconds since `up` started, and how long each of its phases took, for `up`'s timings."""

    def __init__(self) -> None:
        self.started, self.epoch = time.monotonic(), time.time()
        self.phases: dict[str, float] = {}
        self._last = self.started

    def now(self) -> float:
        return round(time.monotonic() - self.started, 2)

    def lap(self, phase: str) -> float:
        """End `phase`; returns the seconds since `up` started."""
        at = time.monotonic()
        self.phases[phase] = round(at - self._last, 2)
        self._last = at
        return round(at - self.started, 2)


def _build(state: dict, engine, say, clock: _Clock, converge_timeout: float) -> dict:
    nodes = nodes_of(state)
    network.create_bridge()
    registry.start_registry()
    for node in nodes:
        network.create_node_netns(node.name, node.index)
    clock.lap("network_and_registry")
    for node, report in zip(nodes, parallel(lambda n: first_boot(n, state), nodes)):
        say(f"{node.name}: agent wrote {len(report['resources'])} {state['kind']} resources to {node.daemon_json}")
    clock.lap("agents")
    # Engines start together, each after its own containerd (see nodes.start_containerd).
    parallel(lambda n: nodes_mod.start_dockerd(n, engine), nodes)
    parallel(lambda n: nodes_mod.wait_ready(n, engine), nodes)
    nodes_ready = clock.lap("engines")
    say(f"{len(nodes)} engines ready at {', '.join(n.address for n in nodes)}")

    def preload() -> None:  # the post-join GPU check runs the stand-in on each node, so it must be there first
        registry.push_standin(nodes[0], engine)
        registry.pull_standin(nodes[1:], engine)
        say("stand-in image pushed to the local registry and pulled by every node")

    def wait_for_preload() -> None:
        background.result()
        clock.lap("standin_wait")  # what is left of the push and the pulls once the nodes have joined

    # The stand-in travels while the swarm forms: init and joins mostly wait on the network.
    with ThreadPoolExecutor(max_workers=1) as pool:
        background = pool.submit(preload)
        formed = form_swarm(desired(state), engine, say, lap=clock.lap, before_admit=wait_for_preload)
    state["cluster_id"] = formed["cluster_id"]
    state["gpus_verified"] = {name: (check or {}).get("verified") for name, check in formed["checks"].items()}
    save_state(state)
    swarm_ready = clock.now()
    managers = sum(n.role == "manager" for n in nodes)
    proven = sum(v is True for v in state["gpus_verified"].values())
    checked = sum(check is not None for check in formed["checks"].values())
    say(f"swarm formed: {managers} manager(s), {len(nodes) - managers} worker(s), "
        f"GPUs proven on {proven} of {checked} GPU node(s)")
    try:
        # Each deploy command waits, on the manager, until its stack has settled (node/stack_settle.py):
        # the same wait, and the same failures, as the program's.
        deploy_stacks(desired(state), engine, wait_seconds=max(1, math.ceil(converge_timeout)))
    except RehearsalError as e:
        # The swarm stays up for a look (see up), so give it everything a working one has.
        health.start_all(nodes, engine, state["kind"], state.get("shared_kind", ""))
        metrics.start_all(nodes, state["kind"], state.get("shared_kind", ""))
        view = placement.collect(nodes, engine, state["kind"], state.get("shared_kind", ""))
        raise NotConverged(f"the stacks did not settle: {e}\n" + placement.render_table(view)) from None
    stacks_deployed = clock.lap("stack_deploy")
    say(f"stack(s) deployed and settled: {', '.join(state['stacks'])}")
    view = with_checks(placement.collect(nodes, engine, state["kind"], state.get("shared_kind", "")), state)
    converged = clock.lap("stack_converge")  # reading the view; the wait was the deploy's
    say("stacks converged: " + "; ".join(placement.outcome(view)))
    # As the node software installs them; started last, so that they leave the CPU to the steps above.
    health.start_all(nodes, engine, state["kind"], state.get("shared_kind", ""))
    metrics.start_all(nodes, state["kind"], state.get("shared_kind", ""))  # the GPU metrics exporter
    clock.lap("health")
    say("health watcher on every node, reconciler on every manager")
    return {"view": view, "nodes_ready_s": nodes_ready, "swarm_ready_s": swarm_ready,
            "stacks_deployed_s": stacks_deployed, "stack_converged_s": converged,
            "started_at": clock.epoch, "phases": clock.phases}


def stack_name(path: Path) -> str:
    stem = path.stem.lower()
    stem = stem[4:] if stem.startswith("gpu-") and len(stem) > 4 else stem
    return "".join(c if c.isalnum() or c in "-_" else "-" for c in stem)


def status(*, progress: Progress = print) -> dict:
    from localswarm import pulumi_cli
    if not load_state() and pulumi_cli.holds_machines():  # the machines of Pulumi's CLI in the rehearsal
        return pulumi_cli.status(pulumi_cli.held_stack() or "dev")
    state = require_state()
    return with_checks(placement.collect(nodes_of(state), find_engine(), state["kind"], state.get("shared_kind", "")),
                       state)


def with_checks(view: dict, state: dict) -> dict:
    """Each node's post-join GPU check (True, False, or None: not checked), as the program's inventory has it."""
    for node in view["nodes"]:
        node["gpus_verified"] = state.get("gpus_verified", {}).get(node["name"])
    return view


# ---------------------------------------------------------------- down


def _our_mounts() -> list[str]:
    roots = (str(STATE_ROOT) + "/", str(RUN_ROOT) + "/")
    points = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4]
        if point.startswith(roots) or point in (str(STATE_ROOT), str(RUN_ROOT)):
            points.append(point)
    return sorted(points, key=len, reverse=True)


def down(*, progress: Progress = print) -> dict:
    """Remove everything `up` made; safe to run twice, and after a failed `up`."""
    if os.geteuid() != 0:
        raise RehearsalError("run `down` as root, as `up` was")
    state = load_state() or {}
    nodes = nodes_of(state) if state.get("nodes") else []
    known = {n.name for n in nodes}
    nodes += [Node(p.name, 0, "worker") for p in sorted(RUN_ROOT.glob("node-*")) if p.name not in known]
    from localswarm import pulumi_cli, pulumi_host  # the machines of Pulumi's CLI in the rehearsal, its S3 stand-in
    machines_removed = pulumi_host.down(pulumi_cli.world().get("machines", {}))
    for node in nodes:
        health.stop(node)
        metrics.stop(node)
    health.stop_imds()
    parallel(nodes_mod.stop_dockerd, nodes)
    registry.stop_registry()
    for ns in network.our_netns():  # anything else still living in our namespaces
        for pid in network.netns_pids(ns):
            run(["kill", "-9", str(pid)], check=False)
    mounts = _our_mounts()
    for point in mounts:
        run(["umount", "-l", point], check=False)
    network.teardown_network()
    for root in (STATE_ROOT, RUN_ROOT):
        shutil.rmtree(root, ignore_errors=True)
    report = {"removed_nodes": [n.name for n in nodes] + machines_removed, "unmounted": len(mounts)}
    progress(f"rehearsal removed ({len(nodes) + len(machines_removed)} node(s), {len(mounts)} mount(s))")
    return report
