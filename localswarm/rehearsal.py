"""Bring a rehearsal swarm up, show it, and take it down again.

The swarm is formed with swarm.commands, the same scripts the Pulumi
components send over SSH, and each node's GPUs come from the real agent.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import yaml

from localswarm import network, nodes as nodes_mod, placement, registry
from localswarm.host import REPO, RehearsalError, check_host, find_engine, run
from localswarm.nodes import RUN_ROOT, STATE_ROOT, Node
from swarm import commands
from swarm.gpu_kind import DEFAULT_KIND, validate_kind
from swarm.stack_files import StackFileError, validate_stack_file

STATE_FILE = STATE_ROOT / "state.json"
DEFAULT_STACK = REPO / "stacks" / "gpu-smoke.yml"
POOL = "rehearsal"
Progress = Callable[[str], None]


def _say(progress: Progress, started: float, message: str) -> None:
    progress(f"[{time.monotonic() - started:5.1f}s] {message}")


def load_state() -> dict | None:
    try:
        return json.loads(STATE_FILE.read_text())
    except (OSError, ValueError):
        return None


def _save_state(state: dict) -> None:
    STATE_ROOT.mkdir(parents=True, exist_ok=True)
    STATE_FILE.write_text(json.dumps(state, indent=2) + "\n")


def _nodes(state: dict) -> list[Node]:
    return [Node(**n) for n in state["nodes"]]


def _check_args(n_nodes: int, gpus: int, managers: int, kind: str) -> None:
    problems = []
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


def _prepare_stack(path: Path, name: str, kind: str, gpus: int, total_gpus: int, scale: bool,
                   progress: Progress) -> Path:
    """Validate a stack file as the Pulumi program does, then point it at images we can serve."""
    try:
        text = path.read_text()
    except OSError as e:
        raise RehearsalError(f"--stack {path}: cannot read it ({e.strerror})") from None
    try:
        info = validate_stack_file(text, kind=kind, max_gpus_per_node=gpus, source=str(path))
    except StackFileError as e:
        raise RehearsalError(str(e)) from None
    gpu_services = {svc.name for svc in info.gpu_services}
    doc = yaml.safe_load(text)
    for svc_name, svc in (doc.get("services") or {}).items():
        image = svc.get("image", "")
        if not image.startswith(nodes_mod.REGISTRY + "/"):
            # Nothing outside this machine is reachable; the stand-in prints its GPUs and
            # stays up, so the service's own command (which needs its image) is dropped too.
            progress(f"  {name}/{svc_name}: image {image} is not available offline; using the stand-in "
                     f"{registry.STANDIN_IMAGE}")
            svc["image"] = registry.STANDIN_IMAGE
            svc.pop("command", None)
            svc.pop("entrypoint", None)
        if scale and svc_name in gpu_services:
            svc.setdefault("deploy", {})["replicas"] = total_gpus + 1
            progress(f"  {name}/{svc_name}: scaled to {total_gpus + 1} replicas, one more than there are GPUs")
    out = STATE_ROOT / "stacks" / f"{name}.yml"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(yaml.safe_dump(doc, sort_keys=False))
    return out


def stack_name(path: Path) -> str:
    stem = path.stem.lower()
    stem = stem[4:] if stem.startswith("gpu-") and len(stem) > 4 else stem
    return "".join(c if c.isalnum() or c in "-_" else "-" for c in stem)


def up(*, n_nodes: int = 3, gpus: int = 2, managers: int = 1, stacks: list[str] | None = None,
       kind: str = DEFAULT_KIND, progress: Progress = print, converge_timeout: float = 120) -> dict:
    started = time.monotonic()
    say = lambda msg: _say(progress, started, msg)  # noqa: E731
    _check_args(n_nodes, gpus, managers, kind)
    check_host()
    engine = find_engine()
    if load_state() or network.our_netns():
        raise RehearsalError("a rehearsal is already up; see it with `python3 -m localswarm status`, "
                             "or run `python3 -m localswarm down` first")
    stack_args = stacks or [str(DEFAULT_STACK)]
    stack_files = []
    for arg in stack_args:
        name, _, file = arg.rpartition("=") if "=" in arg else ("", "", arg)
        stack_files.append((name or stack_name(Path(file)), Path(file)))

    nodes = [Node(f"node-{i}", i, "manager" if i <= managers else "worker") for i in range(1, n_nodes + 1)]
    state = {"kind": kind, "gpus_per_node": gpus, "nodes": [n.to_dict() for n in nodes], "stacks": []}
    _save_state(state)  # first, so that `down` can clean up after a failure below
    say(f"engine {engine.version} ({engine.dockerd})")
    network.create_bridge()
    registry.start_registry()
    for node in nodes:
        network.create_node_netns(node.name, node.index)
        nodes_mod.prepare(node)
        report = nodes_mod.run_agent(node, nodes_mod.simulated_gpus(gpus), kind)
        say(f"{node.name}: agent wrote {len(report['resources'])} {kind} resources to {node.daemon_json}")
    for node in nodes:
        nodes_mod.start_dockerd(node, engine)
    for node in nodes:
        nodes_mod.wait_ready(node, engine)
    nodes_ready = time.monotonic() - started
    say(f"{n_nodes} engines ready at {', '.join(n.address for n in nodes)}")

    with ThreadPoolExecutor(max_workers=1) as pool:
        standin = pool.submit(registry.push_standin, nodes[0], engine)
        _form_swarm(nodes, engine, kind, gpus, say)
        standin.result()
    swarm_ready = time.monotonic() - started
    say(f"swarm formed: {managers} manager(s), {n_nodes - managers} worker(s); stand-in image pushed")

    manager = nodes[0]
    for name, path in stack_files:
        prepared = _prepare_stack(path, name, kind, gpus, gpus * n_nodes, scale=not stacks, progress=say)
        nodes_mod.run_script(manager, engine, commands.deploy_stack(name, str(prepared)))
        state["stacks"].append({"name": name, "file": str(path)})
        say(f"stack {name} deployed from {path}")
    _save_state(state)

    view = wait_converged(nodes, engine, kind, converge_timeout)
    view["timings"] = {"nodes_ready_s": round(nodes_ready, 2), "swarm_ready_s": round(swarm_ready, 2),
                       "stack_converged_s": round(time.monotonic() - started, 2)}
    say("stack converged")
    return view


def _form_swarm(nodes: list[Node], engine, kind: str, gpus: int, say: Callable[[str], None]) -> None:
    first = nodes[0]
    nodes_mod.run_script(first, engine, commands.init_swarm(first.address))
    # Rehearsal only: notice a stopped engine in seconds rather than the default ~15 s.
    nodes_mod.docker(first, engine, "swarm", "update", "--dispatcher-heartbeat", "1s")
    tokens = json.loads(nodes_mod.run_script(first, engine, commands.read_join_tokens()))

    def join(node: Node) -> str:
        role = "manager" if node.role == "manager" else "worker"
        script = commands.join_swarm(role=role, manager_addr=first.address, advertise_addr=node.address,
                                     expected_gpus=gpus, kind=kind, paths=node.paths)
        return nodes_mod.run_script(node, engine, script, stdin=tokens[role] + "\n").strip()

    node_ids = {first.name: join(first)}
    for node in nodes[1:]:
        if node.role == "manager":  # managers one at a time, so raft grows by one member per step
            node_ids[node.name] = join(node)
    workers = [n for n in nodes if n.role == "worker"]
    with ThreadPoolExecutor(max_workers=4) as pool:
        for node, node_id in zip(workers, pool.map(join, workers)):
            node_ids[node.name] = node_id
    for node in nodes:
        script = commands.label_node(node_ids[node.name], {"gpu-swarm.pool": POOL}, expected_gpus=gpus, kind=kind)
        seen = commands.advertised_gpus(nodes_mod.run_script(first, engine, script), kind)
        say(f"{node.name} joined as {node.role}, advertising {len(seen)} GPU(s)")


def wait_converged(nodes: list[Node], engine, kind: str, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        view = placement.collect(nodes, engine, kind)
        if placement.converged(view) or time.monotonic() > deadline:
            if not placement.converged(view):
                raise RehearsalError(f"the stacks did not converge in {timeout:.0f} s:\n"
                                     + placement.render_table(view))
            return view
        time.sleep(0.25)


def status(*, progress: Progress = print) -> dict:
    state = load_state()
    if not state:
        raise RehearsalError("no rehearsal is up; start one with `python3 -m localswarm up`")
    nodes = _nodes(state)
    engine = find_engine()
    manager = next((n for n in nodes if n.role == "manager" and nodes_mod.is_running(n)), None)
    if manager is None:
        raise RehearsalError("no manager engine is running; run `python3 -m localswarm down` and `up` again")
    return placement.collect([manager] + [n for n in nodes if n is not manager], engine, state["kind"])


def node_engine(name: str, action: str, *, gpus: int | None = None) -> dict:
    """Stop or start one node's engine, or re-run its agent on a new simulated inventory."""
    state = load_state()
    if not state:
        raise RehearsalError("no rehearsal is up")
    node = next((n for n in _nodes(state) if n.name == name), None)
    if node is None:
        raise RehearsalError(f"no node {name!r}; nodes are {', '.join(n['name'] for n in state['nodes'])}")
    engine = find_engine()
    if action == "stop":
        nodes_mod.stop_dockerd(node)
        return {"node": name, "running": False}
    if action == "start":
        nodes_mod.start_dockerd(node, engine)
        nodes_mod.wait_ready(node, engine)
        return {"node": name, "running": True}
    if action == "redetect":
        count = state["gpus_per_node"] if gpus is None else gpus
        return nodes_mod.run_agent(node, nodes_mod.simulated_gpus(count), state["kind"])
    raise ValueError(action)


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
    nodes = _nodes(state) if state.get("nodes") else [
        Node(p.name, 0, "worker") for p in sorted(RUN_ROOT.glob("node-*"))]
    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(nodes_mod.stop_dockerd, nodes))
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
    report = {"removed_nodes": [n.name for n in nodes], "unmounted": len(mounts)}
    progress(f"rehearsal removed ({len(nodes)} node(s), {len(mounts)} mount(s))")
    return report
