"""What a stack asks of the nodes it lands on: host paths that must be there, and GPUs its pools must hold.

Compose runs a file on one machine, where a missing bind source is created and services share the
GPUs. On a swarm each task lands on a node of the pools its reservation and constraints allow: swarm
does not create a bind source ("bind source path does not exist"), and a GPU is never shared between
tasks, so GPUs past what the pools hold leave tasks Pending while `pulumi up` succeeds. This is the one
place a stack's GPUs are compared with what its pools hold (node counts from settings/stack_checks.py);
it runs on the file as deployed (swarm/stack_files.py).
"""
from __future__ import annotations

from typing import Mapping

import yaml

from swarm import compose_nodes as nodes
from swarm.compose_spot import can_land_on
from swarm.compose_volumes import mount_source, mount_target, volume_name
from swarm.labels import POOL_GPU_COUNT_LABEL

# Host paths every node has (Ubuntu with docker): a bind of these needs no warning.
_ON_EVERY_NODE = ("/dev", "/proc", "/sys", "/run", "/var/run", "/tmp", "/etc/localtime")


def reserved(service: dict, kind: str) -> int:
    """Whole GPUs of `kind` one replica reserves (the file as deployed)."""
    deploy = service.get("deploy") if isinstance(service.get("deploy"), dict) else {}
    reservations = ((deploy.get("resources") or {}).get("reservations") or {}) if deploy else {}
    for entry in reservations.get("generic_resources") or []:
        spec = entry.get("discrete_resource_spec") if isinstance(entry, dict) else None
        if isinstance(spec, dict) and spec.get("kind") == kind and str(spec.get("value", "")).isdigit():
            return int(spec["value"])
    return 0


def landing_pools(service: dict, pools: Mapping[str, Mapping[str, str]], kind: str,
                  shared_kind: str | None) -> list[str]:
    """The pools whose nodes can take a task of the service: its reservation fits a node, and no placement
    constraint on the pool's labels rules the pool out."""
    gpus = reserved(service, kind)
    return [name for name, labels in pools.items() if can_land_on(service, labels, kind, shared_kind)
            and (not gpus or int(labels.get(POOL_GPU_COUNT_LABEL) or gpus) >= gpus)]


def host_path_warnings(services: dict, pools: Mapping[str, Mapping[str, str]], kind: str,
                       shared_kind: str | None) -> list[str]:
    """A warning for each absolute bind source, naming the nodes it must exist on."""
    warnings = []
    for name, service in services.items():
        for i, volume in enumerate((service.get("volumes") or []) if isinstance(service, dict) else ()):
            mount, source = mount_source(volume)
            target = mount_target(volume)
            if mount != "bind" or not source.startswith("/") or any(
                    source == p or source.startswith(p + "/") for p in _ON_EVERY_NODE):
                continue
            gpus = reserved(service, kind)
            on = landing_pools(service, pools, kind, shared_kind) if pools else []
            where = (f"every node of the pool{'s' if len(on) > 1 else ''} {', '.join(on)}" if on and gpus else
                     f"every node, managers and the pools {', '.join(on)}, that its constraints allow" if on else
                     "every node the service can land on")
            named = volume_name(source)
            warnings.append(
                f"services.{name}.volumes[{i}]: the bind source {source} must exist on {where}: swarm does not "
                f"create it (Compose does), and rejects a task on a node where it is missing (\"bind source path "
                f"does not exist\"). Create it on those nodes, or use a named volume (`{named}:{target}` with "
                f"`volumes: {{{named}: {{}}}}` at the top level)")
    return warnings


def capacity_warnings(services: dict, pools: Mapping[str, Mapping[str, str]], pool_nodes: Mapping[str, int],
                      kind: str, shared_kind: str | None, every_gpu: tuple[str, ...] = (), text: str = "") -> list[str]:
    """A warning when the stack's replicas x GPUs exceed what the pools they can land on hold.

    pool_nodes: each pool's node count; every_gpu: the services whose request was `all`; text: the user's
    file, to name the services that get their request from a YAML anchor (`<<: *gpu`).
    """
    size = {p: int(labels.get(POOL_GPU_COUNT_LABEL) or 0) for p, labels in pools.items()}
    demand: dict[str, tuple[int, frozenset[str], str]] = {}  # service -> (GPUs, its pools, tasks x GPUs)
    for name, service in services.items():
        gpus = reserved(service, kind) if isinstance(service, dict) else 0
        if not gpus:
            continue
        on = frozenset(landing_pools(service, pools, kind, shared_kind))
        deploy = service.get("deploy") if isinstance(service.get("deploy"), dict) else {}
        if deploy.get("mode") == "global":
            tasks = sum(pool_nodes.get(p, 0) for p in on)  # one on each node it can land on
        else:
            tasks = int(deploy.get("replicas", 1)) if str(deploy.get("replicas", 1)).isdigit() else 1
        demand[str(name)] = (tasks * gpus, on, f"{tasks} × {gpus}")
    groups = [frozenset().union(*(on for _, on, _ in demand.values()))] if demand else []
    groups += sorted({on for _, on, _ in demand.values()} - set(groups), key=len, reverse=True)
    for group in groups:  # all the GPU services together, then those pinned to fewer pools
        wanted = {n: d for n, d in demand.items() if d[1] <= group}
        need, hold = sum(d[0] for d in wanted.values()), sum(pool_nodes.get(p, 0) * size.get(p, 0) for p in group)
        if need <= hold:
            continue
        held = ", ".join(f"{p}: {_nodes(pool_nodes.get(p, 0))} × {size.get(p, 0)}" for p in sorted(group)) or "none"
        every = [n for n in wanted if n in every_gpu]
        anchored = anchored_requests(text) if every and text else {}
        shared = [n for n in every if n in anchored]
        anchors = sorted({anchored[n] for n in shared})
        return [
            f"the stack reserves {need} whole GPUs, but the pools its GPU services can land on hold {hold} ({held}): "
            f"tasks that reserve {need - hold} of them would wait, Pending, until GPUs are freed or the pools grow, "
            "and `pulumi up` does not fail for a task that waits for a GPU. Tasks × GPUs: "
            f"{', '.join(f'{n} {d[2]}' for n, d in wanted.items())}. On swarm a GPU is never shared between tasks"
            + (f": `count: all` ({', '.join(every)}) takes every GPU of a node for each task, where Compose on one "
               "machine lets services share them" if every else "")
            + (f", and {', '.join(shared)} get it from {', '.join(anchors)}, a YAML anchor, so one of them that "
               "needs no GPU takes a whole node too: remove the request there" if shared else "")
            + ". Give each service the GPUs it needs (count: N), fewer replicas, or the pools more nodes"]
    return []


def _nodes(n: int) -> str:
    return f"{n} node{'' if n == 1 else 's'}"


def anchored_requests(text: str) -> dict[str, str]:
    """Service -> where its GPU request comes from, for the services of the user's own file whose request
    (`gpus`, or deploy.resources.reservations.devices) is a YAML node shared with another place: an
    extension (`x-gpu: &gpu`) or another service, through an anchor and its aliases or `<<` merges."""
    try:
        root = nodes.parse(text)
    except yaml.YAMLError:
        return {}
    if not isinstance(root, nodes.MappingNode):
        return {}
    root = nodes.flattened(root)
    services = nodes.get(root, "services")
    if not isinstance(services, nodes.MappingNode):
        return {}
    found = {str(k.value): id(r) for k, v in nodes.flattened(services).value if (r := _request_node(v)) is not None}
    extensions = {id(n): str(k.value) for k, v in root.value if str(k.value).startswith("x-") for n in _walk(v)}
    out = {}
    for name, request in found.items():
        others = [n for n, r in found.items() if r == request and n != name]
        if request in extensions or others:
            out[name] = extensions.get(request) or f"the one shared with {', '.join(others)}"
    return out


def _request_node(service) -> nodes.Node | None:
    node = service
    for key in ("deploy", "resources", "reservations", "devices"):
        node = nodes.get(nodes.flattened(node), key) if isinstance(node, nodes.MappingNode) else None
        if node is None:
            break
    if node is not None:
        return node
    return nodes.get(nodes.flattened(service), "gpus") if isinstance(service, nodes.MappingNode) else None


def _walk(node):
    yield node
    if isinstance(node, nodes.MappingNode):
        for _, v in node.value:
            yield from _walk(v)
    elif isinstance(node, nodes.SequenceNode):
        for v in node.value:
            yield from _walk(v)
