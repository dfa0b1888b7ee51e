"""Checks a compose file for `docker stack deploy` on a GPU swarm, before anything is deployed.

Pure Python + PyYAML, so `pulumi preview` and the local rehearsal run the same
checks. The file is first read as Compose means it (compose_resolve.py: variables,
extends, profiles), made what swarm accepts (compose_swarm.py), and its GPU requests
rewritten into the reservation swarm understands (compose_gpus.py); the checks then
run on what will be deployed.
Every mistake below deploys without complaint and then fails quietly: tasks that
never schedule, or tasks that see GPUs the scheduler did not give them.
"""
from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

import yaml

from swarm.compose_gpus import rewrite_gpu_requests
from swarm.compose_placement import capacity_warnings, host_path_warnings
from swarm.compose_resolve import ComposeError, resolve
from swarm.compose_spot import spot_grace
from swarm.compose_swarm import Translation, raise_version, to_swarm
from swarm.compose_vars import Variables
from swarm.compose_yaml import Scalar, dump, load, plain
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
    content: str = ""  # what to deploy: the file as Compose means it, in what swarm accepts; secrets in clear
    rewrites: tuple[str, ...] = ()  # what the translation changed, each naming the key the user wrote
    warnings: tuple[str, ...] = ()  # keys left out of content, and what is lost
    diff: str = ""  # unified diff from the file as written to `shown`; "" when it is the file itself
    shown: str = ""  # content with each secret masked: what preview shows, logs and hashes
    secrets: tuple[str, ...] = ()  # the secret variables content holds; () when content is `shown`

    @property
    def gpu_services(self) -> tuple[ServiceInfo, ...]:
        return tuple(s for s in self.services if s.gpus or s.slots)


def validate_stack_file(
    text: str, *, kind: str, max_gpus_per_node: int, shared_kind: str | None = None, source: str = "<stack>",
    pool_sizes: Mapping[str, int] | None = None, efa_max: int = 0, profiles: Sequence[str] = (),
    variables: Mapping[str, str] | None = None, secrets: Mapping[str, str] | None = None,
    base_dir: Path | None = None, pools: Mapping[str, Mapping[str, str]] | None = None,
    pool_nodes: Mapping[str, int] | None = None,
) -> StackInfo:
    """Read a compose file as Compose means it, make it what swarm accepts, and check it against the cluster.

    `kind` is the cluster's generic resource kind (gpu-swarm:gpuKind) and
    `max_gpus_per_node` the largest GPU count of any pool with whole GPUs (0: every
    pool shares its GPUs): a replica that reserves more can never be placed.
    `pool_sizes` names those pools (pool -> GPUs per node), for `count: all`; by default
    one unnamed pool of `max_gpus_per_node`. `shared_kind` is the kind of shared GPUs'
    slots, or None when no pool shares. `efa_max` is the most EFA devices a node of a pool
    with `efa: true` has (0: no such pool), which a service may reserve as EFA_KIND (AWS-EFA)
    beside its GPUs. `profiles`, `variables` and `secrets` are the stack's Compose profiles
    and the values of its ${...} references (compose_resolve.py); `extends: {file: ...}` is
    read from `base_dir`. `pools` gives each pool's node labels (swarm/labels.py pool_labels): a
    service that can land on a spot pool gets time to checkpoint (compose_spot.py), and an absolute bind
    source is named with the pools it must exist on. `pool_nodes` gives each pool's node count: the stack's
    GPUs are then compared with what the pools hold (compose_placement.py). The checks run on what will be
    deployed, StackInfo.content.
    Raises StackFileError listing all problems, each once: a value that cannot be known (an unset ${...})
    is named once, and every other check still runs, so one preview says all.
    """
    sizes = dict(pool_sizes) if pool_sizes is not None else ({"": max_gpus_per_node} if max_gpus_per_node else {})
    read = (lambda name: (base_dir / name).read_text(encoding="utf-8")) if base_dir is not None else None
    is_file = (lambda name: (base_dir / Path(name)).is_file()) if base_dir is not None else None
    unresolved: set[str] = set()

    def deployable(mask: bool) -> tuple[str, Variables, list[str], list[str], list[str], list[str]]:
        values = Variables(dict(variables or {}), dict(secrets or {}), mask_secrets=mask)
        warnings: list[str] = []
        try:
            resolved = resolve(text, variables=values, profiles=tuple(profiles), read=read, warnings=warnings)
        except ComposeError as exc:
            raise StackFileError(source, _once(exc.problems)) from None
        doc = resolved.doc
        unresolved.update(resolved.unresolved)
        translation = Translation(is_file)
        to_swarm(doc, translation)
        escaped = _dollars_escaped(doc)
        rewrite = rewrite_gpu_requests(dump(escaped), plain(escaped), kind=kind, pool_sizes=sizes,
                                       shared_kind=shared_kind, source=source, unresolved=resolved.unresolved)
        final = load(rewrite.text)
        changes = [*translation.changes, *rewrite.changes, *spot_grace(final, pools or {}, kind, shared_kind)]
        raise_version(final, changes)
        services = plain(final.get("services") or {})
        placed = host_path_warnings(services, pools or {}, kind, shared_kind)
        if pool_nodes is not None:
            placed += capacity_warnings(services, pools or {}, pool_nodes, kind, shared_kind, rewrite.every_gpu, text)
        return (dump(final), values, resolved.problems, [*translation.problems, *rewrite.problems],
                [*warnings, *translation.warnings, *rewrite.warnings, *placed], changes)

    shown, values, known, problems, warnings, changes = deployable(mask=True)
    unused = sorted(set(variables or {}) - values.used) + sorted(set(secrets or {}) - values.used_secrets)
    if unused:
        warnings.append(f"variables {', '.join(unused)}: set in the stack's config but not used by the file")
    doc = yaml.safe_load(shown)  # the checks below see what will be deployed
    services = doc.get("services") if isinstance(doc, dict) else None
    if not isinstance(services, dict) or not services:
        raise StackFileError(source, known + problems or ["has no services left to deploy: add a top-level "
                                                          "`services:` mapping"])
    for section in ("configs", "secrets"):
        entries = doc.get(section)
        for item, spec in (entries.items() if isinstance(entries, dict) else ()):
            if isinstance(spec, dict) and "file" in spec:
                problems.append(
                    f"{section}.{item}.file: only the compose file itself reaches the manager, so "
                    f"{spec['file']!r} would be missing there; create it beforehand "
                    f"(docker {section[:-1]} create {item} ...) and declare it `external: true`"
                )
            if isinstance(spec, dict) and "environment" in spec:
                problems.append(
                    f"{section}.{item}.environment: swarm does not read {section} from an environment variable "
                    f"(`docker stack deploy` would read {spec['environment']!r} from the manager's shell); create it "
                    f"beforehand (docker {section[:-1]} create {item} -) and declare it `external: true`, or pass "
                    f"the value as ${{{spec['environment']}}} from gpu-swarm:stackSecrets"
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

    problems = known + [p for p in problems if not _about(p, unresolved)]
    if problems:
        raise StackFileError(source, _once(problems))
    as_written = dump(load(text))
    if shown == as_written:
        shown = text  # nothing changed: the user's own bytes, comments and all
    content = deployable(mask=False)[0] if values.used_secrets else shown
    diff = "" if shown is text else "".join(difflib.unified_diff(
        as_written.splitlines(keepends=True), shown.splitlines(keepends=True),
        f"{source} (as written; comments and anchors not kept)", f"{source} (as deployed)"))
    return StackInfo(tuple(infos), content, tuple(changes), tuple(warnings), diff, shown,
                     tuple(sorted(values.used_secrets)))


def _dollars_escaped(value):
    """Every $ left after interpolation written as $$, so swarm's loader, which interpolates again, keeps it."""
    if isinstance(value, Scalar):
        return value.with_text(value.replace("$", "$$")) if "$" in value else value
    if isinstance(value, dict):
        return type(value)((k, _dollars_escaped(v)) for k, v in value.items())
    if isinstance(value, list):
        return type(value)(_dollars_escaped(v) for v in value)
    return value


def _about(problem: str, unresolved: set[str]) -> bool:
    """Whether a check's problem judges a value that is not known, at or under an unresolved path: the
    value's own problem (services.x.image: ${REGISTRY} is not set) says what to do."""
    return any(problem.startswith(path) and problem[len(path):len(path) + 1] in (".", "[", ":", " ", "")
               for path in unresolved)


_SERVICE_PROBLEM = re.compile(r"^services\.([^.\[:\s]+)(.*)$", re.DOTALL)


def _once(problems: list[str]) -> list[str]:
    """Each problem once: the same one in several services is said once, naming them all."""
    groups: dict[str, list[str]] = {}
    for problem in problems:
        match = _SERVICE_PROBLEM.match(problem)
        key = match[2] if match else problem
        names = groups.setdefault(key, [])
        if match and match[1] not in names:
            names.append(match[1])
    out = []
    for rest, names in groups.items():
        if not names:
            out.append(rest)
        elif len(names) == 1:
            out.append(f"services.{names[0]}{rest}")
        else:
            out.append(f"services.{names[0]}{rest} (the same in services {', '.join(names[1:])})")
    return out


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
