"""Compose's GPU requests, rewritten into the reservation a gpu-swarm node offers.

Users write `deploy.resources.reservations.devices` or `gpus:` (the Compose spec), often
with `runtime: nvidia` and NVIDIA_VISIBLE_DEVICES from older guides. `docker stack deploy`
refuses all three keys (swarm has no device requests: docker/cli#3051, moby/swarmkit#1244),
and a swarm task only gets GPUs through a generic-resource reservation of the cluster's kind.
So a request for N GPUs becomes a reservation of N of that kind, the keys that swarm cannot
use are left out, and what cannot be expressed on a swarm is refused with what to write.
The user's file is never changed: the rewritten text is what gets deployed.
"""
from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field
from typing import AbstractSet as Set, Mapping

from swarm import compose_nodes as nodes
from swarm.labels import GPU_COUNT_LABEL, GPU_MEMORY_LABEL, GPU_PRODUCT_LABEL, POOL_GPU_COUNT_LABEL, POOL_LABEL

NVIDIA = "nvidia"
CDI = "cdi"  # docker's CDI driver: device_ids are CDI names, and NVIDIA's GPUs are nvidia.com/gpu=<index|uuid|all>
CDI_GPU = "nvidia.com/gpu="
GPU_CAPABILITY = "gpu"
# The capabilities moby's nvidia device driver accepts (daemon/nvidia_linux.go): gpu and nvidia
# select the driver, the rest are NVIDIA driver capabilities, which docker hands the toolkit
# as NVIDIA_DRIVER_CAPABILITIES; the rewrite does the same.
DRIVER_CAPABILITIES = ("compute", "compat32", "graphics", "utility", "video", "display")
_KNOWN_CAPABILITIES = (GPU_CAPABILITY, NVIDIA, *DRIVER_CAPABILITIES)
_DEVICE_KEYS = ("capabilities", "count", "device_ids", "driver", "options")
VISIBLE_DEVICES = "NVIDIA_VISIBLE_DEVICES"
DRIVER_CAPABILITIES_ENV = "NVIDIA_DRIVER_CAPABILITIES"
_ASKS_FOR_NONE = ("void", "none", "")  # values of NVIDIA_VISIBLE_DEVICES that ask for no GPU
_CONSTRAINT = re.compile(r"\s*(\S+?)\s*(==|!=)\s*(\S.*?)\s*$")


@dataclass(frozen=True)
class ComposeRewrite:
    text: str  # the file to deploy; the user's own text, byte for byte, when nothing changed
    changes: tuple[str, ...] = ()  # each rewrite, naming the key the user wrote
    warnings: tuple[str, ...] = ()  # keys left out because gpu-swarm ignores them, and why
    problems: tuple[str, ...] = ()  # requests a swarm cannot honour; nothing is deployed
    diff: str = ""  # unified diff from the file as written to the file as deployed
    every_gpu: tuple[str, ...] = ()  # services whose request was `all`: every GPU of the node a task lands on


@dataclass
class _Plan:
    """What to change in one service."""

    gpus: int = 0  # GPUs to reserve as the cluster's kind
    drop: list[str] = field(default_factory=list)  # service keys to leave out: gpus, runtime
    drop_visible: bool = False
    driver_capabilities: tuple[str, ...] = ()
    every_gpu: bool = False  # the request was `all`

    def __bool__(self) -> bool:
        return bool(self.gpus or self.drop or self.drop_visible)


def rewrite_gpu_requests(text: str, doc: dict, *, kind: str, pool_sizes: Mapping[str, int],
                         shared_kind: str | None = None, source: str = "<stack>",
                         unresolved: Set[str] = frozenset()) -> ComposeRewrite:
    """Rewrite every service's Compose GPU request for a swarm whose whole-GPU pools have
    `pool_sizes` GPUs per node (pool name -> GPUs; empty when every pool shares its GPUs).
    unresolved: the paths of values whose ${...} is not set (compose_resolve.Resolved)."""
    problems: list[str] = []
    warnings: list[str] = []
    changes: list[str] = []
    plans = {}
    for name, service in (doc.get("services") or {}).items():
        if isinstance(service, dict):
            plan = _plan(f"services.{name}", service, kind, pool_sizes, shared_kind, problems, warnings, changes,
                         unresolved)
            if plan:
                plans[str(name)] = plan
    every = tuple(n for n, plan in plans.items() if plan.every_gpu)
    if problems or not plans:
        return ComposeRewrite(text, (), tuple(warnings), tuple(problems), every_gpu=every)
    root = nodes.flattened(nodes.parse(text))
    for name, plan in plans.items():
        _apply(nodes.own_path(root, ["services", name]), plan, kind)
    out = nodes.dump(root)
    diff = "".join(difflib.unified_diff(nodes.dump(nodes.parse(text)).splitlines(keepends=True),
                                        out.splitlines(keepends=True),
                                        f"{source} (as written; comments and anchor names not kept)",
                                        f"{source} (as deployed)"))
    return ComposeRewrite(out, tuple(changes), tuple(warnings), (), diff, every)


def _plan(where: str, service: dict, kind: str, pool_sizes: Mapping[str, int], shared_kind: str | None,
          problems: list[str], warnings: list[str], changes: list[str], unresolved: Set[str]) -> _Plan:
    plan = _Plan()
    before = len(problems)
    deploy = service.get("deploy") if isinstance(service.get("deploy"), dict) else {}
    resources = deploy.get("resources") if isinstance(deploy.get("resources"), dict) else {}
    reservations = resources.get("reservations") if isinstance(resources.get("reservations"), dict) else {}

    requests = []  # (key, request, gpu implied)
    at_devices = f"{where}.deploy.resources.reservations.devices"
    if "devices" in reservations:
        devices = reservations["devices"]
        if isinstance(devices, list) and devices:
            requests += [(f"{at_devices}[{i}]", entry, False) for i, entry in enumerate(devices)]
        else:
            problems.append(f"{at_devices}: expected a list of device requests such as "
                            "[{driver: nvidia, count: 1, capabilities: [gpu]}], got " + repr(devices))
    if "gpus" in service:
        gpus = service["gpus"]
        if gpus == "all":
            requests.append((f"{where}.gpus", {}, True))  # no count: all
        elif isinstance(gpus, list) and gpus:
            requests += [(f"{where}.gpus[{i}]", entry, True) for i, entry in enumerate(gpus)]
        else:
            problems.append(f"{where}.gpus: expected `all` or a list of device requests such as "
                            f"[{{count: 1}}], got {gpus!r}")
    if "devices" in reservations and "gpus" in service:
        problems.append(f"{where}: asks for GPUs twice, in `gpus` and in deploy.resources.reservations.devices; "
                        "keep one")
    elif len(requests) > 1:
        problems.append(f"{requests[1][0]}: one GPU request per service; write a single request with the total count")
    generic = _generic_kinds(reservations, kind, shared_kind)
    if requests and generic:
        problems.append(f"{requests[0][0]}: the service also reserves {', '.join(generic)} under "
                        "generic_resources; keep one of the two")

    if requests and len(problems) == before:
        resolved = _resolve(*requests[0], service, kind, pool_sizes, shared_kind, problems, warnings, unresolved)
        if resolved:
            plan.gpus, plan.driver_capabilities, how, plan.every_gpu = resolved
            if "gpus" in service:
                plan.drop.append("gpus")
            changes.append(f"{requests[0][0].rsplit('[', 1)[0]}: {how} -> deploy.resources.reservations."
                           f"generic_resources: {{kind: {kind}, value: {plan.gpus}}}")
            if plan.driver_capabilities and not _env_value(service.get("environment"), DRIVER_CAPABILITIES_ENV)[0]:
                changes.append(f"{requests[0][0]}.capabilities: {', '.join(plan.driver_capabilities)} -> "
                               f"environment {DRIVER_CAPABILITIES_ENV}={','.join(plan.driver_capabilities)}")
    asks = bool(requests or generic)
    _runtime(where, service, asks, plan, problems, warnings)
    _visible_devices(where, service, asks, plan, problems, warnings)
    return plan


def _resolve(at: str, request, gpu_implied: bool, service: dict, kind: str, pool_sizes: Mapping[str, int],
             shared_kind: str | None, problems: list[str], warnings: list[str], unresolved: Set[str]):
    """(GPUs, driver capabilities, how the count was read, whether it was `all`) for one request, or None
    when refused."""
    if not isinstance(request, dict):
        problems.append(f"{at}: expected a mapping such as {{driver: nvidia, count: 1, capabilities: [gpu]}}, "
                        f"got {request!r}")
        return None
    before = len(problems)
    for key in sorted(set(map(str, request)) - set(_DEVICE_KEYS)):
        problems.append(f"{at}.{key}: not a key of a device request ({', '.join(_DEVICE_KEYS)})")
    driver = request.get("driver")
    cdi_all = driver == CDI and _cdi_all(request.get("device_ids"))
    if driver not in (None, NVIDIA, CDI):
        problems.append(f"{at}.driver: is {driver!r}, but gpu-swarm nodes offer NVIDIA GPUs only, reserved as "
                        f"{kind}; write `driver: nvidia`, or leave it out")
    elif driver == CDI and not _cdi_gpus(request.get("device_ids")):
        problems.append(f"{at}.device_ids: with driver: cdi, gpu-swarm reserves NVIDIA GPUs named {CDI_GPU}all "
                        f"(or {CDI_GPU}<index>), got {request.get('device_ids')!r}; write `driver: nvidia` and "
                        "`count: N`")
    capabilities = request.get("capabilities")
    gpu_implied = gpu_implied or driver == CDI  # a CDI name says what the device is
    if capabilities is None and not gpu_implied:
        problems.append(f"{at}.capabilities: missing; Compose requires it, and a GPU request is [gpu]")
    elif capabilities is not None and (not isinstance(capabilities, list)
                                       or not all(isinstance(c, str) for c in capabilities)):
        problems.append(f"{at}.capabilities: expected a list such as [gpu], got {capabilities!r}")
    elif capabilities is not None:
        # Any of them selects docker's nvidia driver, and the container gets the GPUs (moby's capset for it):
        # [compute, utility] asks for a GPU as [gpu] does.
        if not set(capabilities) & set(_KNOWN_CAPABILITIES) and not gpu_implied:
            problems.append(f"{at}.capabilities: {capabilities} does not ask for a GPU; gpu-swarm turns GPU "
                            "requests into reservations and nothing else, so add `gpu`, or remove the request")
        for unknown in [c for c in capabilities if c not in _KNOWN_CAPABILITIES]:
            problems.append(f"{at}.capabilities: {unknown!r} is not a capability of NVIDIA's driver; use "
                            f"{', '.join(_KNOWN_CAPABILITIES)}")
    if "device_ids" in request and not cdi_all and (driver != CDI or _cdi_gpus(request["device_ids"])):
        problems.append(_device_ids_problem(at, request["device_ids"], kind, driver == CDI, unresolved))
    count_at = f"{at}.count" if "count" in request or not gpu_implied else f"{at}.device_ids" if cdi_all else at
    count = request.get("count", "all")  # Compose: no count (and no device_ids) means all; so does nvidia.com/gpu=all
    if isinstance(count, str) and count.strip().isdigit():
        count = int(count)
    if len(problems) > before:
        return None
    if "options" in request:
        warnings.append(f"{at}.options: ignored on gpu-swarm and left out of the deployed file: "
                        "docker's NVIDIA driver reads no options either")
    whole = {pool: n for pool, n in pool_sizes.items() if n > 0}
    if count != "all" and (isinstance(count, bool) or not isinstance(count, int) or count < 1):
        problems.append(f"{count_at}: expected a whole number of GPUs >= 1, or `all`, got {count!r}")
        return None
    if not whole:
        slot = f"reserve one slot of a shared GPU instead (generic_resources: kind {shared_kind}, value 1), or " \
            if shared_kind else ""
        problems.append(f"{count_at}: no node offers whole GPUs ({kind}): every pool shares its GPUs; "
                        f"{slot}add a pool without sharing")
        return None
    driver_caps = tuple(dict.fromkeys(c for c in capabilities or () if c in DRIVER_CAPABILITIES))
    if count == "all":
        n = _count_all(count_at, service, whole, problems)
        return (n, driver_caps, f"count all (every GPU of one node: {_sizes(whole)})", True) if n else None
    largest = max(whole.values())
    if count > largest:
        problems.append(f"{count_at}: {count} GPUs per task, but the largest node has {largest} "
                        f"({_sizes(whole)}); the tasks would stay Pending forever")
        return None
    return count, driver_caps, f"count {count}", False


def _count_all(at: str, service: dict, whole: Mapping[str, int], problems: list[str]) -> int | None:
    """`all` as a number: the GPUs per node of the pools the service may land on, when they agree.

    Swarm reserves a fixed number, so `all` must be one. Taking the largest node size when
    sizes differ would keep the service off the smaller nodes for good, and the smallest
    would leave GPUs of the larger nodes unused: neither is "every GPU of the node", so the
    user picks, with a count or with a constraint that narrows the pools to one size.
    """
    candidates = _constrained(whole, _constraints(service))
    sizes = sorted(set(candidates.values()), reverse=True)
    if len(sizes) == 1:
        return sizes[0]
    if not sizes:
        problems.append(f"{at}: `all` means every GPU of the node a task lands on, but the service's placement "
                        f"constraints leave no node with whole GPUs ({_sizes(whole)})")
        return None
    largest = max(candidates, key=lambda p: (candidates[p], p))
    problems.append(
        f"{at}: `all` means every GPU of the node a task lands on, but swarm reserves a fixed number and the "
        f"nodes it may land on differ: {_sizes(candidates)} GPUs. Write the number (count: {sizes[0]} runs only "
        f"on {sizes[0]}-GPU nodes), or pin the service to nodes of one size: deploy.placement.constraints: "
        f"[node.labels.{POOL_LABEL} == {largest}]")
    return None


def _constraints(service: dict) -> list[str]:
    deploy = service.get("deploy") if isinstance(service.get("deploy"), dict) else {}
    placement = deploy.get("placement") if isinstance(deploy.get("placement"), dict) else {}
    found = placement.get("constraints")
    return [c for c in found if isinstance(c, str)] if isinstance(found, list) else []


def _constrained(pools: Mapping[str, int], constraints: list[str]) -> dict[str, int]:
    """The pools that the constraints on a pool or on a GPU count leave; other constraints are not read."""
    left = dict(pools)
    for constraint in constraints:
        match = _CONSTRAINT.fullmatch(constraint)
        if not match:
            continue
        label, op, value = match.groups()
        if label == f"node.labels.{POOL_LABEL}":
            def keep(pool, n): return pool == value  # noqa: E704
        elif label in (f"node.labels.{POOL_GPU_COUNT_LABEL}", f"node.engine.labels.{GPU_COUNT_LABEL}"):
            def keep(pool, n): return str(n) == value  # noqa: E704
        else:
            continue
        left = {p: n for p, n in left.items() if keep(p, n) == (op == "==")}
    return left


def _sizes(pools: Mapping[str, int]) -> str:
    """'8 (training), 4 (infer-a, infer-b)': node sizes, largest first, with their pools."""
    by_size: dict[int, list[str]] = {}
    for pool, n in sorted(pools.items()):
        by_size.setdefault(n, []).append(pool)
    return ", ".join(f"{n}" + (f" ({', '.join(p for p in names if p)})" if any(names) else "")
                     for n, names in sorted(by_size.items(), reverse=True))


def _device_ids_problem(at: str, ids, kind: str, cdi: bool, unresolved: Set[str]) -> str:
    ids = ids if isinstance(ids, list) else [ids]
    if any(f"{at}.device_ids[{i}]" in unresolved for i in range(len(ids))):
        count = "`count: N`, N the number of GPUs the variable names,"
    else:
        # docker's nvidia driver joins the ids into NVIDIA_VISIBLE_DEVICES, so "0,1,2,3" is four GPUs; a CDI
        # name is one device
        named = [part.strip() for i in ids for part in ([str(i)] if cdi else str(i).split(",")) if part.strip()]
        every = any(n.lower() == "all" for n in named)
        count = "`count: all`" if every else f"`count: {len(named) or 1}`"
    return (f"{at}.device_ids: swarm cannot pin devices. A service reserves a number of {kind} and the scheduler "
            "picks which GPUs, on whichever node it places each task; an index or UUID names a GPU of one "
            "machine (indexes differ from node to node), so there is nothing to pin it to. Write "
            f"{count} instead, and choose the kind of GPU with a placement constraint on the engine labels "
            "each node's GPU agent sets: deploy.placement.constraints: "
            f"[node.engine.labels.{GPU_PRODUCT_LABEL} == NVIDIA-H100-80GB-HBM3] (or {GPU_MEMORY_LABEL}, "
            f"{GPU_COUNT_LABEL}; node.labels.{POOL_LABEL} for a pool)")


def _cdi_gpus(ids) -> bool:
    return isinstance(ids, list) and bool(ids) and all(isinstance(i, str) and i.startswith(CDI_GPU) for i in ids)


def _cdi_all(ids) -> bool:
    return _cdi_gpus(ids) and f"{CDI_GPU}all" in ids


def _generic_kinds(reservations: dict, kind: str, shared_kind: str | None) -> list[str]:
    entries = reservations.get("generic_resources")
    found = []
    for entry in entries if isinstance(entries, list) else ():
        spec = entry.get("discrete_resource_spec") if isinstance(entry, dict) else None
        if isinstance(spec, dict) and spec.get("kind") in (kind, shared_kind) and spec.get("kind") not in found:
            found.append(spec["kind"])
    return found


def _runtime(where: str, service: dict, asks_gpus: bool, plan: _Plan, problems: list[str],
             warnings: list[str]) -> None:
    if "runtime" not in service:
        return
    runtime = service["runtime"]
    if runtime != NVIDIA:
        problems.append(f"{where}.runtime: swarm services cannot choose a runtime ({runtime!r} would not be "
                        "used); every GPU node runs NVIDIA's runtime behind the gpu-swarm guard, so remove the key")
    elif asks_gpus:
        warnings.append(f"{where}.runtime: nvidia is ignored on gpu-swarm and left out of the deployed file: "
                        "`docker stack deploy` refuses the key, and every GPU node already runs NVIDIA's runtime "
                        "(behind the gpu-swarm guard), which gives the task the GPUs it reserves")
        plan.drop.append("runtime")
    else:
        problems.append(f"{where}.runtime: nvidia, but the service reserves no GPU, so on gpu-swarm it would run "
                        "without one (swarm cannot choose a runtime; a task gets exactly the GPUs it reserves). "
                        f"Ask for them: deploy.resources.reservations.devices: [{{driver: nvidia, {_count(service)}, "
                        "capabilities: [gpu]}], and remove `runtime`")


def _visible_devices(where: str, service: dict, asks_gpus: bool, plan: _Plan, problems: list[str],
                     warnings: list[str]) -> None:
    found, value = _env_value(service.get("environment"), VISIBLE_DEVICES)
    if not found:
        return
    if asks_gpus:
        warnings.append(f"{where}.environment.{VISIBLE_DEVICES}: ignored on gpu-swarm and left out of the "
                        "deployed file: each task sees exactly the GPUs swarm assigned to its reservation (the "
                        "node's runtime guard sets this variable to them), whatever the service says; to choose "
                        f"a GPU model, add a placement constraint such as node.engine.labels.{GPU_PRODUCT_LABEL} "
                        "== NVIDIA-H100-80GB-HBM3")
        plan.drop_visible = True
    elif str(value if value is not None else "-").strip().lower() not in _ASKS_FOR_NONE:
        problems.append(f"{where}.environment.{VISIBLE_DEVICES}: {value if value is not None else '(from the shell)'}"
                        " asks for GPUs, but the service reserves none, so on gpu-swarm it gets none (the node's "
                        "runtime guard gives a task only the GPUs swarm assigned it). Ask for them: "
                        f"deploy.resources.reservations.devices: [{{driver: nvidia, {_count(service)}, "
                        "capabilities: [gpu]}], and remove the variable")


def _count(service: dict) -> str:
    """The count that asks for the GPUs NVIDIA's runtime gives the service: those NVIDIA_VISIBLE_DEVICES names."""
    found, value = _env_value(service.get("environment"), VISIBLE_DEVICES)
    ids = [i for i in str(value).split(",") if i.strip()] if found and value is not None else []
    if [i.strip().lower() for i in ids] == ["all"]:
        return "count: all"
    return f"count: {len(ids)}" if ids else "count: 1 (or count: all, every GPU of the node)"


def _env_value(env, name: str) -> tuple[bool, object]:
    """Whether the environment sets `name`, and its value (None: passed on from the deploying shell)."""
    if isinstance(env, dict):
        return name in env, env.get(name)
    found, value = False, None
    for entry in env if isinstance(env, list) else ():
        if isinstance(entry, str) and entry.partition("=")[0] == name:
            found, value = True, entry.partition("=")[2] if "=" in entry else None
    return found, value


def _apply(service: nodes.MappingNode, plan: _Plan, kind: str) -> None:
    for key in plan.drop:
        nodes.delete(service, key)
    if plan.gpus:
        reservations = nodes.own_path(service, ["deploy", "resources", "reservations"], create=True)
        nodes.delete(reservations, "devices")
        entries = nodes.own_sequence(reservations, "generic_resources", create=True)
        entries.value.append(nodes.mapping([("discrete_resource_spec", nodes.mapping([
            ("kind", nodes.scalar(kind)), ("value", nodes.scalar(plan.gpus))]))]))
    env = nodes.get(service, "environment")
    has_caps = _has_key(env, DRIVER_CAPABILITIES_ENV)
    caps = ",".join(plan.driver_capabilities) if plan.driver_capabilities and not has_caps else ""
    if isinstance(env, nodes.SequenceNode) and (plan.drop_visible or caps):
        env = nodes.own_sequence(service, "environment")
        env.value[:] = [e for e in env.value if not (plan.drop_visible and _names(e, VISIBLE_DEVICES))]
        if caps:
            env.value.append(nodes.scalar(f"{DRIVER_CAPABILITIES_ENV}={caps}"))
    elif plan.drop_visible or caps:
        env = nodes.own_mapping(service, "environment", create=True)
        if env is not None:
            if plan.drop_visible:
                nodes.delete(env, VISIBLE_DEVICES)
            if caps:
                nodes.put(env, DRIVER_CAPABILITIES_ENV, nodes.scalar(caps))


def _names(entry: nodes.Node, name: str) -> bool:
    return isinstance(entry, nodes.ScalarNode) and entry.value.partition("=")[0] == name


def _has_key(env: nodes.Node | None, name: str) -> bool:
    if isinstance(env, nodes.SequenceNode):
        return any(_names(e, name) for e in env.value)
    return isinstance(env, nodes.MappingNode) and nodes.get(nodes.flattened(env), name) is not None
