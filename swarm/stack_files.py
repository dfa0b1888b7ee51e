"""Checks a compose file for `docker stack deploy` on a GPU swarm, before anything is deployed.

Pure Python + PyYAML, so `pulumi preview` and the local rehearsal run the same
checks. Compose's own GPU requests are first rewritten into the reservation swarm
understands (swarm/compose_gpus.py); the checks then run on what will be deployed.
Every mistake below deploys without complaint and then fails quietly: tasks that
never schedule, or tasks that see GPUs the scheduler did not give them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import yaml

from swarm.compose_gpus import rewrite_gpu_requests
from swarm.node_contract import EFA_KIND

_GOOD_SHAPE = """\
    deploy:
      resources:
        reservations:
          generic_resources:
            - discrete_resource_spec:
                kind: "{kind}"
                value: 1"""


class StackFileError(ValueError):
    """A stack file that would not schedule GPU tasks as written; lists every problem."""

    def __init__(self, source: str, problems: list[str]):
        self.source = source
        self.problems = tuple(problems)
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"{source}: {len(problems)} problem(s):\n{lines}")


@dataclass(frozen=True)
class ServiceInfo:
    name: str
    image: str
    replicas: int | None  # None for `mode: global`
    gpus: int  # whole GPUs reserved per replica (0: the task sees no GPU)
    slots: int = 0  # slots of shared GPUs per replica: 0 or 1
    efa: int = 0  # EFA devices (EFA_KIND) per replica


@dataclass(frozen=True)
class StackInfo:
    services: tuple[ServiceInfo, ...]
    content: str = ""  # what to deploy: the file with its Compose GPU requests rewritten (swarm/compose_gpus.py)
    rewrites: tuple[str, ...] = ()  # what the rewrite changed, each naming the key the user wrote
    warnings: tuple[str, ...] = ()  # keys ignored on gpu-swarm, left out of content, and why
    diff: str = ""  # unified diff from the file as written to content; "" when content is the file itself

    @property
    def gpu_services(self) -> tuple[ServiceInfo, ...]:
        return tuple(s for s in self.services if s.gpus or s.slots)


def validate_stack_file(
    text: str, *, kind: str, max_gpus_per_node: int, shared_kind: str | None = None, source: str = "<stack>",
    pool_sizes: Mapping[str, int] | None = None, efa_max: int = 0,
) -> StackInfo:
    """Parse a compose file, rewrite its Compose GPU requests, and check what is left against the cluster.

    `kind` is the cluster's generic resource kind (gpu-swarm:gpuKind) and
    `max_gpus_per_node` the largest GPU count of any pool with whole GPUs (0: every
    pool shares its GPUs): a replica that reserves more can never be placed.
    `pool_sizes` names those pools (pool -> GPUs per node), for `count: all`; by default
    one unnamed pool of `max_gpus_per_node`. `shared_kind` is the kind of shared GPUs'
    slots, or None when no pool shares. `efa_max` is the most EFA devices a node of a pool
    with `efa: true` has (0: no such pool), which a service may reserve as EFA_KIND (AWS-EFA)
    beside its GPUs. The checks run on the rewritten file, which is StackInfo.content.
    Raises StackFileError listing all problems.
    """
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise StackFileError(source, [f"is not valid YAML: {exc}"]) from None
    if not isinstance(doc, dict):
        raise StackFileError(source, ["must be a mapping with a top-level `services:` key"])
    services = doc.get("services")
    if not isinstance(services, dict) or not services:
        raise StackFileError(source, ["has no services: add a top-level `services:` mapping"])

    sizes = dict(pool_sizes) if pool_sizes is not None else ({"": max_gpus_per_node} if max_gpus_per_node else {})
    rewrite = rewrite_gpu_requests(text, doc, kind=kind, pool_sizes=sizes, shared_kind=shared_kind, source=source)
    problems = list(rewrite.problems)
    if rewrite.text is not text:
        doc = yaml.safe_load(rewrite.text)  # the checks below see what will be deployed
        services = doc["services"]
    for section in ("configs", "secrets"):
        entries = doc.get(section)
        for item, spec in (entries.items() if isinstance(entries, dict) else ()):
            if isinstance(spec, dict) and "file" in spec:
                problems.append(
                    f"{section}.{item}.file: only the compose file itself reaches the manager, so "
                    f"{spec['file']!r} would be missing there; create it beforehand "
                    f"(docker {section[:-1]} create {item} ...) and declare it `external: true`"
                )
    infos = []
    for name, service in services.items():
        where = f"services.{name}"
        if not isinstance(service, dict):
            problems.append(f"{where}: must be a mapping")
            continue
        image = service.get("image")
        if not isinstance(image, str) or not image.strip():
            problems.append(
                f"{where}: has no `image`; `docker stack deploy` cannot build images, "
                "so push one to a registry and name it here"
            )
            image = ""
        reserved = _check_resources(where, service, kind, max_gpus_per_node, shared_kind, efa_max, problems)
        _check_env_file(where, service, problems)
        _check_environment(where, service.get("environment"), problems)
        infos.append(ServiceInfo(str(name), image, _replicas(where, service, problems),
                                 reserved.get(kind, 0), reserved.get(shared_kind, 0) if shared_kind else 0,
                                 reserved.get(EFA_KIND, 0)))

    if problems:
        raise StackFileError(source, problems)
    return StackInfo(tuple(infos), rewrite.text, rewrite.changes, rewrite.warnings, rewrite.diff)


def _replicas(where: str, service: dict, problems: list[str]) -> int | None:
    deploy = service.get("deploy") or {}
    if not isinstance(deploy, dict):
        return 1
    if deploy.get("mode") == "global":
        return None
    replicas = deploy.get("replicas", 1)
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 0:
        problems.append(f"{where}.deploy.replicas: expected a whole number >= 0, got {replicas!r}")
        return 0
    return replicas


def _check_resources(
    where: str, service: dict, kind: str, max_gpus: int, shared_kind: str | None, efa_max: int, problems: list[str]
) -> dict[str, int]:
    """Check the reservations; return what one replica reserves, by kind."""
    deploy = service.get("deploy")
    if deploy is None:
        return {}
    if not isinstance(deploy, dict):
        problems.append(f"{where}.deploy: must be a mapping")
        return {}
    resources = deploy.get("resources") or {}
    reservations = resources.get("reservations") if isinstance(resources, dict) else None
    if not isinstance(reservations, dict):
        return {}
    where = f"{where}.deploy.resources.reservations"

    entries = reservations.get("generic_resources")
    if entries is None:
        return {}
    if not isinstance(entries, list):
        problems.append(f"{where}.generic_resources: must be a list of `- discrete_resource_spec:` entries")
        return {}

    reserved: dict[str, int] = {}
    kinds = [kind] + ([shared_kind] if shared_kind else []) + [EFA_KIND]  # EFA_KIND: checked against efa_max below
    for i, entry in enumerate(entries):
        at = f"{where}.generic_resources[{i}]"
        if not isinstance(entry, dict):
            problems.append(f"{at}: must be a mapping with a `discrete_resource_spec` key")
            continue
        if "named_resource_spec" in entry:
            problems.append(
                f"{at}.named_resource_spec: swarm refuses named resources in a service "
                "(\"invalid argument for resource\"); a service reserves a count and the "
                "scheduler picks the GPUs. Use:\n" + _GOOD_SHAPE.format(kind=kind)
            )
            continue
        spec = entry.get("discrete_resource_spec")
        if spec is None and ("kind" in entry or "value" in entry):
            # The layout some guides print: kind/value one level too shallow, which
            # leaves discrete_resource_spec null and the reservation silently empty.
            problems.append(
                f"{at}: `kind` and `value` sit beside `discrete_resource_spec` instead of "
                "under it, so the reservation is empty. Indent them under it:\n"
                + _GOOD_SHAPE.format(kind=kind)
            )
            continue
        if not isinstance(spec, dict):
            problems.append(
                f"{at}: needs `discrete_resource_spec:` with `kind` and `value` under it:\n"
                + _GOOD_SHAPE.format(kind=kind)
            )
            continue
        extra = sorted(set(entry) - {"discrete_resource_spec"})
        if extra:
            problems.append(f"{at}: unexpected key(s) {', '.join(extra)} beside discrete_resource_spec")
        entry_kind, value = spec.get("kind"), spec.get("value")
        if isinstance(value, str) and value.strip().isdigit():
            value = int(value)  # the compose schema allows a quoted number
        if entry_kind not in kinds:
            offered = f"{kind!r} (gpu-swarm:gpuKind)" + (
                f" and {shared_kind!r} (gpu-swarm:sharedGpuKind)" if shared_kind else "") + (
                f" and {EFA_KIND!r} (pools with efa: true)" if efa_max else "")
            problems.append(
                f"{at}.discrete_resource_spec.kind: is {entry_kind!r}, but this cluster's nodes "
                f"advertise {offered}; tasks would never be scheduled"
            )
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            problems.append(
                f"{at}.discrete_resource_spec.value: expected a whole number of "
                f"{'EFA devices' if entry_kind == EFA_KIND else 'GPUs'} >= 1, got {value!r}"
            )
            continue
        if entry_kind in reserved:
            problems.append(f"{at}: {entry_kind} is reserved twice in one service; reserve it once with the total")
            continue
        if entry_kind == EFA_KIND:
            _check_efa(at, value, efa_max, reserved, problems)
            continue
        if set(reserved) - {EFA_KIND}:  # EFA devices go with either
            problems.append(f"{at}: a service reserves whole GPUs or one slot of a shared GPU, not both")
            continue
        if entry_kind == shared_kind and value != 1:
            problems.append(
                f"{at}.discrete_resource_spec.value: {value} slots of {shared_kind} per replica; reserve 1. "
                "Two slots may come from two GPUs, or from the same one: they do not add up to more GPU. "
                f"For more than a share, reserve whole GPUs ({kind})"
            )
            continue
        if entry_kind == kind and max_gpus == 0:
            problems.append(
                f"{at}.discrete_resource_spec.kind: every pool shares its GPUs, so no node advertises whole "
                f"{kind}; reserve value 1 of {shared_kind}, or add a pool without sharing"
            )
            continue
        if entry_kind == kind and value > max_gpus:
            problems.append(
                f"{at}.discrete_resource_spec.value: {value} GPUs per replica, but the largest "
                f"node pool has {max_gpus} per node; the tasks would stay Pending forever"
            )
            continue
        reserved[entry_kind] = value
    return reserved


def _check_efa(at: str, value: int, efa_max: int, reserved: dict[str, int], problems: list[str]) -> None:
    if not efa_max:
        problems.append(
            f"{at}.discrete_resource_spec.kind: {EFA_KIND} are the EFA devices of pools with `efa: true` "
            "(gpu-swarm:gpuPools), and no pool has them, so the tasks would never be scheduled; set efa: true on a "
            "pool of an EFA instance type (p4d, p5), or remove the reservation (NCCL then uses TCP sockets)"
        )
    elif value > efa_max:
        problems.append(
            f"{at}.discrete_resource_spec.value: {value} EFA devices per replica, but a node of the pools with "
            f"efa: true has at most {efa_max}; the tasks would stay Pending forever. Reserve at most {efa_max}"
        )
    else:
        reserved[EFA_KIND] = value


def _check_env_file(where: str, service: dict, problems: list[str]) -> None:
    if "env_file" in service:
        problems.append(
            f"{where}.env_file: only the compose file itself reaches the manager, so the env file "
            "would be missing there; list the variables under `environment:` instead"
        )


def _check_environment(where: str, env, problems: list[str]) -> None:
    names = list(env) if isinstance(env, dict) else [str(e).partition("=")[0] for e in env or []
                                                      if isinstance(e, str)] if isinstance(env, list) else []
    for name in names:
        if str(name).startswith("DOCKER_RESOURCE_"):
            problems.append(
                f"{where}.environment: sets {name}, the variable swarm itself sets to the GPUs it "
                "assigned; the node's runtime guard cannot tell it from swarm's. Remove it and reserve "
                "GPUs with generic_resources"
            )
