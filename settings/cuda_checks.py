"""Each GPU service's CUDA requirement against the driver of the pools it can land on, at preview.

nvidia/cuda-based images say what they need in their config's NVIDIA_REQUIRE_CUDA
("cuda>=12.8 brand=tesla,driver>=535,driver<536 ..."); nvidia-container-toolkit refuses to
start the task on an older driver ("unsatisfied condition: cuda>=12.8"), or a framework that
checks for itself falls back to the CPU. The image's config is read from its registry
(settings/image_registry.py), with gpu-swarm:registryCredentials, which must be a Pulumi
secret. No pool that runs it: refused. Some pools: a warning naming the others. A registry
that does not answer: a warning, and preview goes on.
"""
from __future__ import annotations

from typing import Any

import pulumi
import pulumi.runtime.config as runtime_config
import yaml

from to_node import software as node_software
from settings import image_registry
from settings.cuda_drivers import max_cuda, parse_requirement, version_text
from settings.model import GpuPool, StackFile
from settings.reader import Reader, key
from swarm.compose_gpus import _constrained, _constraints  # the pools a service's constraints leave: one copy
from swarm.labels import POOL_LABEL

CREDENTIALS_EXAMPLE = ("pulumi config set --secret --path 'registryCredentials[\"nvcr.io\"].username' '$oauthtoken' "
                       "and --secret --path 'registryCredentials[\"nvcr.io\"].password' nvapi-...")
REQUIRE_ENV, DISABLE_ENV = "NVIDIA_REQUIRE_CUDA", "NVIDIA_DISABLE_REQUIRE"


def read_registry_credentials(r: Reader) -> dict[str, tuple[str, str]]:
    """{registry: (username, password)} from gpu-swarm:registryCredentials, which must be a secret."""
    raw = r.json("registryCredentials", dict, CREDENTIALS_EXAMPLE)
    if not raw:
        return {}
    if not runtime_config.is_config_secret(key("registryCredentials")):
        r.error("registryCredentials", f"is stored in plain text; set it as a secret: {CREDENTIALS_EXAMPLE}")
        return {}
    out = {}
    for registry, entry in raw.items():
        if not isinstance(entry, dict) or not all(isinstance(entry.get(k), str) and entry.get(k)
                                                  for k in ("username", "password")):
            r.error(f"registryCredentials.{registry}", "expected {username, password}, both text; "
                                                       f"set them with {CREDENTIALS_EXAMPLE}")
            continue
        name = "docker.io" if registry in ("index.docker.io", "registry-1.docker.io") else registry
        out[name] = (entry["username"], entry["password"])
    return out


def pool_driver_branches(pools: list[GpuPool], image: str | None) -> dict[str, int | None]:
    """Each pool's NVIDIA driver branch; None where it is not known before the node boots.

    On image ubuntu every node gets node/versions.env's branch. The Deep Learning AMI and a
    custom AMI bring their own driver, which preview cannot read.
    """
    branch = int(node_software.min_versions()["NVIDIA_DRIVER_BRANCH"]) if image == "ubuntu" else None
    return {p.name: branch for p in pools}


def check_cuda(r: Reader, stacks: list[StackFile], indexes: dict[str, int], pools: list[GpuPool],
               image: str | None, credentials: dict[str, tuple[str, str]],
               registry: image_registry.Registry | None = None) -> None:
    """Refuse (r.error) or warn for each GPU service whose image needs a newer CUDA than its pools' drivers."""
    wanted = [(s, svc) for s in stacks for svc in s.info.gpu_services]
    if not wanted:
        return  # no GPU service: no registry is asked
    branches = pool_driver_branches(pools, image)
    if not any(b is not None for b in branches.values()):
        pulumi.log.info(f"the CUDA that stack images need is not checked: the driver of {key('image')} {image} "
                        "is the AMI's, which preview cannot read")
        return
    registry = registry or image_registry.Registry(credentials)
    specs = {s.name: yaml.safe_load(s.info.shown).get("services") or {} for s in stacks if s.info.gpu_services}
    for stack, service in wanted:
        spec = specs[stack.name].get(service.name) or {}
        where = f"{stack.file}: services.{service.name}"
        landing = _landing_pools(pools, service, spec)
        known = {p: branches[p] for p in landing if branches[p] is not None}
        if not known:
            continue
        env = _service_env(spec.get("environment"))
        if not _true(env.get(DISABLE_ENV, "")) and REQUIRE_ENV not in env:
            try:
                image_env = _env(registry.image_config(service.image).env)
            except image_registry.RegistryUnreachable as exc:
                pulumi.log.warn(f"{where}: the CUDA that {service.image} needs was not checked: {exc}. "
                                "Preview goes on; the node checks it when the task starts")
                continue
            except (image_registry.RegistryRefused, ValueError) as exc:
                pulumi.log.warn(f"{where}: the CUDA that {service.image} needs was not checked: {exc}")
                continue
            env = {**image_env, **env}  # the service's environment wins, as the container gets it
        if _true(env.get(DISABLE_ENV, "")) or not env.get(REQUIRE_ENV, "").strip():
            continue
        try:
            requirement = parse_requirement(env[REQUIRE_ENV])
        except ValueError as exc:
            pulumi.log.warn(f"{where}: {service.image}'s {REQUIRE_ENV} is not read: {exc}")
            continue
        runs = [p for p, b in known.items() if requirement.met_by(b)]
        if runs == list(known):
            continue
        needs = f"CUDA {version_text(requirement.cuda)}" if requirement.cuda else "a newer driver"
        others = ", ".join(f"{p} (driver {b}, CUDA up to {version_text(max_cuda(b))})"
                           for p, b in known.items() if p not in runs)
        said = f"{where}: {service.image} needs {needs} ({REQUIRE_ENV}={requirement.text!r})"
        if runs:
            pulumi.log.warn(f"{said}; its tasks fail on the pools {others}, where the toolkit refuses the image "
                            f"(\"unsatisfied condition\"); pin it to {', '.join(runs)}: deploy.placement."
                            f"constraints: [node.labels.{POOL_LABEL} == {runs[0]}]")
            continue
        newest = min(max_cuda(b) for b in known.values())
        r.error(f"stacks[{indexes[stack.name]}].file",
                f"{said}, but no pool it can land on runs it: {others}. nvidia-container-toolkit would refuse "
                f"every task (\"unsatisfied condition: cuda>=...\"). Use an image built for CUDA "
                f"{version_text(newest)} or older, or give the pools a newer driver branch "
                "(NVIDIA_DRIVER_BRANCH in node/versions.env, a row of settings/cuda_drivers.py)")


def _landing_pools(pools: list[GpuPool], service, spec: dict) -> list[str]:
    """The pools whose nodes offer what the service reserves, as its placement constraints leave them."""
    if service.slots:
        fitting = {p.name: p.gpus_per_node for p in pools if p.slots_per_gpu}
    else:
        fitting = {p.name: p.gpus_per_node for p in pools if not p.slots_per_gpu and p.gpus_per_node >= service.gpus}
    return list(_constrained(fitting, _constraints(spec)))


def _service_env(environment: Any) -> dict[str, str]:
    if isinstance(environment, dict):
        return {str(k): "" if v is None else str(v) for k, v in environment.items()}
    if isinstance(environment, list):
        return _env(str(e) for e in environment if "=" in str(e))
    return {}


def _env(entries) -> dict[str, str]:
    return dict(e.partition("=")[::2] for e in entries)


def _true(value: str) -> bool:
    # As the toolkit reads it (strconv.ParseBool): 1, t, true; anything else keeps the check.
    return value.strip().lower() in ("1", "t", "true")
