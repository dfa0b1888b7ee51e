"""gpu-swarm:stacks and gpu-swarm:stackSecrets: each stack's file, profiles, variables and secrets, checked.

A stack file is read as Compose means it and made what swarm accepts (swarm/stack_files.py)
here, at preview, so every problem is reported before anything is created. Its ${...}
values come only from the config: plain ones from stacks[].variables, secret ones from
stackSecrets, which must be a Pulumi secret, so a token never sits in the config in clear.
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pulumi.runtime.config as runtime_config

from settings import reader
from settings.model import GpuPool, StackFile
from settings.reader import STACK_DEFAULTS, Reader, integer, key, suggest
from swarm.labels import pool_labels
from swarm.stack_files import StackFileError, validate_stack_file

_STACK_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")  # what swarm/script.py's swarm_name accepts
_VARIABLE_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")  # what ${...} can name
SECRETS_EXAMPLE = "pulumi config set --secret --path 'stackSecrets.<stack>.<VARIABLE>' VALUE"


@dataclass(frozen=True)
class StackConfig:
    index: int
    name: str
    file: str  # relative to the project directory
    wait_seconds: int
    profiles: tuple[str, ...] = ()
    variables: tuple[tuple[str, str], ...] = ()
    secrets: tuple[tuple[str, str], ...] = ()


def read_stacks(r: Reader) -> list[StackConfig]:
    example = "pulumi config set --path 'stacks[0].name' smoke and --path 'stacks[0].file' stacks/gpu-smoke.yml"
    raw = r.json("stacks", list, example)
    out, names = [], set()
    for i, entry in enumerate(raw or []):
        at = f"stacks[{i}]"
        if not isinstance(entry, dict):
            r.error(at, f"expected an object with name and file, found {entry!r}")
            continue
        for unknown in sorted(set(entry) - set(STACK_DEFAULTS)):
            r.error(f"{at}.{unknown}", "is not a stack setting" + suggest(unknown, STACK_DEFAULTS))
        name, file = str(entry.get("name") or "").strip(), str(entry.get("file") or "").strip()
        # How long the deploy waits for the stack to settle (node/stack_settle.py) before it fails `pulumi up`.
        wait = integer(entry.get("waitSeconds"), STACK_DEFAULTS["waitSeconds"], 1, 86400,
                       lambda m: r.error(f"{at}.waitSeconds", m))
        profiles = _profiles(r, at, entry.get("profiles"))
        variables = _variables(r, f"{at}.variables", entry.get("variables"),
                               f"pulumi config set --path '{at}.variables.MODEL' meta-llama/Llama-3.1-8B")
        if not _STACK_NAME_RE.match(name):
            r.error(f"{at}.name", f"{name!r} is not a stack name; use lowercase letters, digits, '-' and '_'")
            continue
        if name in names:
            r.error(f"{at}.name", f"{name!r} is deployed twice; stack names must be unique")
            continue
        names.add(name)
        path = (reader.PROJECT_DIR / file).resolve()
        if not file:
            r.error(f"{at}.file", "required: the compose file, relative to the project directory")
        elif Path(file).is_absolute() or not path.is_relative_to(reader.PROJECT_DIR):
            r.error(f"{at}.file", f"{file!r}: give a path inside the project directory, e.g. stacks/gpu-smoke.yml")
        elif not path.is_file():
            r.error(f"{at}.file", f"{file} does not exist (paths are relative to {reader.PROJECT_DIR})")
        elif wait is not None and profiles is not None and variables is not None:
            out.append(StackConfig(i, name, file, wait, profiles, variables))
    return _with_secrets(r, out)


def _profiles(r: Reader, at: str, value: Any) -> tuple[str, ...] | None:
    """The active profiles; "" is Compose's default one (services with profiles: ["", rag] run without --profile),
    so profiles: ["", ingest] runs them and ingest's, as COMPOSE_PROFILES=,ingest does."""
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(p, str) for p in value):
        r.error(f"{at}.profiles", f"expected a list of Compose profile names, found {value!r}; set it with "
                                  f"pulumi config set --path '{at}.profiles[0]' cuda")
        return None
    return tuple(p.strip() for p in value)


def _variables(r: Reader, at: str, value: Any, example: str) -> tuple[tuple[str, str], ...] | None:
    if value is None:
        return ()
    if not isinstance(value, dict):
        r.error(at, f"expected an object of variable names and values, found {value!r}; set one with {example}")
        return None
    ok = True
    for name, item in value.items():
        if not _VARIABLE_RE.match(str(name)):
            r.error(f"{at}.{name}", "is not a variable name; use letters, digits and _, not starting with a digit")
            ok = False
        elif isinstance(item, (dict, list)) or item is None:
            r.error(f"{at}.{name}", f"expected a text, number or boolean value, found {item!r}")
            ok = False
    if not ok:
        return None
    # A boolean as Compose's environment gives it: true/false, as the YAML the user would write.
    return tuple((str(n), str(v).lower() if isinstance(v, bool) else str(v)) for n, v in value.items())


def _with_secrets(r: Reader, stacks: list[StackConfig]) -> list[StackConfig]:
    raw = r.json("stackSecrets", dict, SECRETS_EXAMPLE)
    if not raw:
        return stacks
    if not runtime_config.is_config_secret(key("stackSecrets")):
        r.error("stackSecrets", f"is stored in plain text; set each value as a secret: {SECRETS_EXAMPLE}")
        return stacks
    by_name = {s.name: s for s in stacks}
    out = {s.name: s for s in stacks}
    for name, values in raw.items():
        if name not in by_name:
            r.error(f"stackSecrets.{name}", "names no stack of gpu-swarm:stacks" + suggest(name, by_name))
            continue
        secrets = _variables(r, f"stackSecrets.{name}", values, SECRETS_EXAMPLE)
        if secrets is None:
            continue
        both = sorted(set(dict(secrets)) & set(dict(by_name[name].variables)))
        if both:
            r.error(f"stackSecrets.{name}", f"{', '.join(both)} also set in stacks[{by_name[name].index}].variables; "
                                            "keep the secret one")
            continue
        out[name] = StackConfig(**{**by_name[name].__dict__, "secrets": secrets})
    return [out[s.name] for s in stacks]


def check_stacks(r: Reader, stacks: list[StackConfig], pools: list[GpuPool], kind: str,
                 shared_kind: str) -> list[StackFile]:
    """Each stack file as it will be deployed, checked against the pools; problems go to r."""
    max_whole = max((p.gpus_per_node for p in pools if not p.slots_per_gpu), default=0)
    sharing = shared_kind if any(p.slots_per_gpu for p in pools) else None
    whole_pools = {p.name: p.gpus_per_node for p in pools if not p.slots_per_gpu}
    efa_max = max((p.efa_interfaces for p in pools), default=0)  # 0: no pool has efa: true
    out = []
    for stack in stacks:
        path = reader.PROJECT_DIR / stack.file
        text = path.read_text(encoding="utf-8")  # not the operator's locale (Windows)
        try:
            info = validate_stack_file(text, kind=kind, max_gpus_per_node=max_whole, shared_kind=sharing,
                                       source=stack.file, pool_sizes=whole_pools, efa_max=efa_max,
                                       profiles=stack.profiles, variables=dict(stack.variables),
                                       secrets=dict(stack.secrets), base_dir=path.parent,
                                       pools={p.name: pool_labels(p) for p in pools},
                                       pool_nodes={p.name: p.most_nodes for p in pools})  # an elastic pool at its max
        except StackFileError as exc:
            for problem in exc.problems:
                r.error(f"stacks[{stack.index}].file", f"{stack.file}: {problem}")
            continue
        # The hash names what is deployed with its secrets masked, so a second `pulumi up` changes nothing and
        # no hash of a secret is in clear; a changed secret still redeploys, as it changes the deploy's stdin.
        out.append(StackFile(stack.name, stack.file, hashlib.sha256(info.shown.encode()).hexdigest(), info.content,
                             info, wait_seconds=stack.wait_seconds))
    return out
