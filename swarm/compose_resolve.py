"""Compose's own meaning of a file, resolved on the operator's machine: variables, extends, profiles.

Swarm's loader refuses `profiles` and `extends` and interpolates from the manager's shell, so
what Compose would make of the file is worked out here first, as `docker compose config` does:
${...} from the stack's config (compose_vars.py), `extends` from this file or one beside it
with Compose's merge rules and its `!reset`/`!override` tags, and only the services of the
active profiles. What comes out is still the user's data (compose_yaml.Scalar keeps each
value's text); compose_swarm.py then makes it what swarm accepts.
"""
from __future__ import annotations

import posixpath
from dataclasses import dataclass, field
from typing import Any, Callable

import yaml

from swarm.compose_gpus import VISIBLE_DEVICES
from swarm.compose_vars import InterpolationError, Variables, interpolate
from swarm.compose_yaml import STR, Override, Reset, Scalar, Unresolved, load

# Compose's merge rules (compose-spec merge.md), for `extends`: these replace what they extend...
_REPLACED = {"command", "entrypoint"}
# ...these are key=value lists or mappings, merged by key...
_BY_KEY = {"environment", "labels", "annotations", "extra_hosts", "sysctls", "build_args"}
# ...these sequences are merged on the field that identifies an entry (a volume by its target)...
_BY_FIELD = {"volumes": "target", "devices": "target", "secrets": "target", "configs": "target"}
# ...and every other sequence is appended to, without repeating an entry.


class ComposeError(ValueError):
    """Problems that keep the file from meaning anything: each names its key and the fix."""

    def __init__(self, problems: list[str]):
        super().__init__("; ".join(problems))
        self.problems = problems


DEFAULT_PROFILE = ""  # Compose's profile of `docker compose up` with no --profile: `profiles: ["", gpu]` runs there


@dataclass
class Resolved:
    """The file as Compose means it, and what kept it from meaning all of it."""

    doc: dict  # Scalars, with every variable, extends and profile applied that could be
    problems: list[str] = field(default_factory=list)  # each names its key and the fix
    # Paths (services.x.command[2], services.y) whose value is not known: a ${...} that is not set, a service
    # whose extends failed. The later checks do not judge them, so each problem is said once, in one preview.
    unresolved: set[str] = field(default_factory=set)


def resolve(text: str, *, variables: Variables, profiles: tuple[str, ...] = (),
            read: Callable[[str], str] | None = None, warnings: list[str] | None = None) -> Resolved:
    """The file as Compose means it, with the problems that every later check can still run beside.

    read(name) returns the text of a file that `extends: {file: name}` names (a path relative to the
    stack file's folder); without it, extends from another file is refused. Raises ComposeError only
    when nothing is left to check: the file is no YAML mapping, or has no service to deploy.
    """
    doc = _load(text, "the file")
    problems: list[str] = []
    doc = _interpolated(doc, variables, "", problems)
    services = doc.get("services")
    if not isinstance(services, dict) or not services:
        raise ComposeError(problems or ["has no services: add a top-level `services:` mapping"])
    # A value that cannot be interpolated matters only in a service that is deployed, or that one extends.
    wanted = _deployed_or_extended(services, profiles)
    problems = [p for p in problems if not p.startswith("services.") or p.split(".")[1] in wanted]
    failed: set[str] = set()
    files: dict[str, dict] = {}

    def other_file(name: str) -> dict:
        if name not in files:
            if read is None:
                raise ComposeError([f"extends.file: {name}: no file can be read beside this one"])
            try:
                files[name] = _interpolated(_load(read(name), name), variables, f"{name}: ", problems)
            except OSError as exc:
                raise ComposeError([f"extends.file: cannot read {name} ({exc.strerror or exc})"]) from None
        found = files[name].get("services")
        return found if isinstance(found, dict) else {}

    for name in list(services):
        if isinstance(services[name], dict):
            try:
                services[name] = _extended(name, services, "", other_file, [])
            except ComposeError as exc:
                problems += [p for p in exc.problems if p not in problems]
                failed.add(f"services.{name}")
            if name in wanted:
                _passed_through(f"services.{name}.environment", services[name], variables, problems)
    known = _apply_profiles(services, profiles, problems, warnings if warnings is not None else [])
    if not services:
        raise ComposeError(problems + [_nothing_left(known, profiles)])
    unresolved = {f for f in failed if f.split(".")[1] in services}
    _find_unresolved(services, "services.", unresolved)
    return Resolved(doc, problems, unresolved)


def _find_unresolved(value: Any, where: str, found: set[str]) -> None:
    if isinstance(value, Unresolved):
        found.add(where.rstrip("."))
    elif isinstance(value, dict):
        for k, v in value.items():
            _find_unresolved(v, f"{where}{k}.", found)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _find_unresolved(v, f"{where.rstrip('.')}[{i}].", found)


def _active(service, active: tuple[str, ...]) -> bool:
    """Whether Compose runs the service with these profiles active (none: its default profile, "")."""
    profiles = service.get("profiles") if isinstance(service, dict) else None
    if not isinstance(profiles, list):
        return True
    return "*" in active or bool(set(map(str, profiles)) & set(active or (DEFAULT_PROFILE,)))


def _deployed_or_extended(services: dict, active: tuple[str, ...]) -> set[str]:
    wanted = {str(n) for n, s in services.items() if _active(s, active)}
    for name in list(wanted):
        seen = services.get(name)
        while isinstance(seen, dict) and "extends" in seen:
            base = seen["extends"] if isinstance(seen["extends"], str) else (seen["extends"] or {}).get("service")
            if not isinstance(seen["extends"], str) and (seen["extends"] or {}).get("file") or base in wanted:
                break  # another file's problems name that file; a wanted base is there already
            wanted.add(str(base))
            seen = services.get(base)
    return wanted


def _load(text: str, what: str) -> dict:
    try:
        doc = load(text)
    except yaml.YAMLError as exc:
        raise ComposeError([f"is not valid YAML ({what}): {exc}"]) from None
    if not isinstance(doc, dict):
        raise ComposeError(["must be a mapping with a top-level `services:` key"])
    return doc


def _interpolated(value: Any, variables: Variables, where: str, problems: list[str]) -> Any:
    """Every value's ${...} resolved; keys are not interpolated, as in Compose."""
    if isinstance(value, Scalar):
        if "$" not in value:
            return value
        try:
            return value.with_text(interpolate(value, variables))
        except InterpolationError as exc:
            problem = f"{where.rstrip('.')}: {exc}" if where else str(exc)
            if problem not in problems:
                problems.append(problem)
            return Unresolved(value, value.tag, value.style)
    if isinstance(value, dict):
        return type(value)((k, _interpolated(v, variables, f"{where}{k}.", problems)) for k, v in value.items())
    if isinstance(value, list):
        return type(value)(_interpolated(v, variables, f"{where.rstrip('.')}[{i}].", problems)
                           for i, v in enumerate(value))
    if isinstance(value, Override):
        return Override(_interpolated(value.value, variables, where, problems))
    return value


def _passed_through(where: str, service: dict, variables: Variables, problems: list[str]) -> None:
    """`- NAME` and `NAME:` in environment take their value from where Compose runs: here, the stack's values.

    Left as they are, `docker stack deploy` would take them from the manager's shell.
    """
    env = service.get("environment")
    missing = []
    owned = (VISIBLE_DEVICES,)  # the GPU rewrite's to judge (compose_gpus.py): dropped beside a GPU request
    if isinstance(env, dict):
        for name, value in env.items():
            if str(name) not in owned and (value is None or (isinstance(value, Scalar) and value.is_null)):
                found = variables.get(str(name))
                if found is None:
                    missing.append(str(name))
                else:
                    env[name] = Scalar(found, STR, '"')
    elif isinstance(env, list):
        for i, entry in enumerate(env):
            if isinstance(entry, Scalar) and "=" not in entry and entry.strip() not in owned:
                found = variables.get(entry.strip())
                if found is None:
                    missing.append(entry.strip())
                else:
                    env[i] = Scalar(f"{entry.strip()}={found}", STR, '"')
    for name in missing:
        problems.append(f"{where}.{name}: takes its value from the environment Compose runs in, which for gpu-swarm is "
                        f"the stack's config; set it there (variables: {{{name}: ...}}, or as a secret: pulumi config set "
                        f"--secret --path 'stackSecrets.<stack>.{name}' ...), or write {name}=value")


def _extended(name: str, services: dict, file: str, other_file: Callable[[str], dict],
              seen: list[tuple[str, str]]) -> dict:
    """The service with what it extends merged under it (recursively), and its tags applied.

    file is where `services` come from ("" for the stack file), seen the (file, service) pairs on the way
    here: a chain across files may keep one name (a CUDA variant of `app` extends the base file's `app`),
    and only a pair met twice is a cycle, as in Compose. A `file:` is relative to the file that names it.
    """
    service = services[name]
    where = f"{file + ': ' if file else ''}services.{name}.extends"
    if "extends" not in service:
        return _untagged(service)
    if (file, name) in seen:
        chain = " -> ".join(f"{n} ({f or 'this file'})" for f, n in [*seen, (file, name)])
        raise ComposeError([f"{where}: extends itself through {chain}"])
    spec = service["extends"]
    base_name, base_file = (spec, None) if isinstance(spec, str) else (
        (spec.get("service"), spec.get("file")) if isinstance(spec, dict) else (None, None))
    if not isinstance(base_name, str) or not base_name:
        raise ComposeError([f"{where}: expected a service name, or {{service: NAME, file: FILE}}, got {spec!r}"])
    into = posixpath.normpath(posixpath.join(posixpath.dirname(file), str(base_file))) if base_file else file
    pool = other_file(into) if into else services
    if base_name not in pool or not isinstance(pool[base_name], dict):
        known = ", ".join(sorted(pool)) or "none"
        raise ComposeError([f"{where}: no service {base_name!r} in {into or 'this file'} (its services: {known})"])
    base = _extended(base_name, pool, into, other_file, [*seen, (file, name)])
    own = {k: v for k, v in service.items() if k != "extends"}
    return _merge(base, own)


def _merge(base: Any, over: Any, key: str = "") -> Any:
    """Compose's merge of `over` into `base` (compose-spec merge.md)."""
    if isinstance(over, Override):
        return _untagged(over.value)
    if isinstance(base, dict) and isinstance(over, dict):
        out = dict(base)
        for k, v in over.items():
            if isinstance(v, Reset):
                out.pop(k, None)
            else:
                out[k] = _merge(base[k], v, k) if k in base else _untagged(v)
        return out
    if key in _BY_KEY and isinstance(base, (dict, list)) and isinstance(over, (dict, list)):
        return _merge_by_key(base, over)
    if isinstance(base, list) and isinstance(over, list) and key not in _REPLACED:
        return _merge_list(base, over, _BY_FIELD.get(key))
    return _untagged(over)


def _merge_by_key(base, over):
    merged = {**_key_values(base), **_key_values(over)}
    if isinstance(base, dict) or isinstance(over, dict):
        return merged
    return [Scalar(k if v is None else f"{k}={v}") for k, v in merged.items()]


def _key_values(value) -> dict:
    if isinstance(value, dict):
        return dict(value)
    out = {}
    for entry in value:
        text = str(entry)
        k, sep, v = text.partition("=") if "=" in text else text.partition(":")
        out[k.strip()] = Scalar(v) if sep else None
    return out


def _merge_list(base: list, over: list, field: str | None) -> list:
    def ident(entry):
        if field and isinstance(entry, dict):
            return entry.get(field)
        if field == "target" and isinstance(entry, str):
            parts = entry.split(":")  # source:target[:mode], or a bare target
            return parts[1] if len(parts) > 1 else parts[0]
        return str(entry) if not isinstance(entry, (dict, list)) else repr(entry)
    out = list(base)
    for entry in over:
        out = [e for e in out if ident(e) != ident(entry)] + [_untagged(entry)]
    return out


def _untagged(value: Any) -> Any:
    """The value with `!override` taken as written and `!reset` keys removed: nothing left to merge into."""
    if isinstance(value, Override):
        return _untagged(value.value)
    if isinstance(value, dict):
        return type(value)((k, _untagged(v)) for k, v in value.items() if not isinstance(v, Reset))
    if isinstance(value, list):
        return type(value)(_untagged(v) for v in value if not isinstance(v, Reset))
    return value


def _apply_profiles(services: dict, active: tuple[str, ...], problems: list[str], warnings: list[str]) -> list[str]:
    """Leave out the services whose profiles are all inactive, as `docker compose --profile` does; returns
    the file's profiles. With no profile chosen Compose's default one, "", is active."""
    declared: dict[str, list[str]] = {}
    for name, service in services.items():
        profiles = service.get("profiles") if isinstance(service, dict) else None
        if profiles is None:
            continue
        if not isinstance(profiles, list) or not all(isinstance(p, str) for p in profiles):
            problems.append(f"services.{name}.profiles: expected a list of names, got {profiles!r}")
            continue
        declared[name] = [str(p) for p in profiles]
    known = sorted({p for names in declared.values() for p in names})
    for profile in active:
        if profile not in ("*", DEFAULT_PROFILE) and profile not in known:
            problems.append(f"profiles: {profile!r} is no profile of the file (its profiles: "
                            f"{profile_names(known) or 'none'}); fix the stack's `profiles` setting")
    left_out = [n for n in declared if not _active(services[n], active)]
    for name in left_out:
        del services[name]
    if left_out:
        warnings.append("left out, as `docker compose` leaves them out without their profile: "
                        + ", ".join(f"{n} ({profile_names(declared[n])})" for n in left_out)
                        + (f"; active profiles: {profile_names(active)}" if active else
                           "; no profile is active (set the stack's `profiles` setting to deploy them)"))
    for service in services.values():
        if isinstance(service, dict):
            service.pop("profiles", None)
    for name, service in services.items():
        deps = service.get("depends_on") if isinstance(service, dict) else None
        wanted = deps if isinstance(deps, list) else list(deps) if isinstance(deps, dict) else []
        for dep in wanted:
            optional = isinstance(deps, dict) and isinstance(deps[dep], dict) and \
                str(deps[dep].get("required", "true")).lower() == "false"
            if str(dep) not in services and not optional:
                why = (f"it is only in profile(s) {', '.join(declared[str(dep)])}, which are not active; add one to "
                       "the stack's `profiles` setting") if str(dep) in declared else "there is no such service"
                problems.append(f"services.{name}.depends_on: {dep} is not deployed: {why}")
    return known


def profile_names(names) -> str:
    """Profiles as a list to read: the default profile is `""`, as a file writes it."""
    return ", ".join(p if p else '""' for p in names)


def _nothing_left(known: list[str], active: tuple[str, ...]) -> str:
    if not known:
        return "has no services left to deploy: add a top-level `services:` mapping"
    active_text = profile_names(active) if active else 'none chosen, so only Compose\'s default profile ""'
    return (f"has no services left to deploy: every service is in a profile, and no active profile names it "
            f"(active: {active_text}). The file's profiles: {profile_names(known)}; choose the ones to deploy in "
            f"the stack's `profiles` setting (gpu-swarm:stacks[].profiles, as `docker compose --profile "
            f"{next((p for p in reversed(known) if p), '')}`)")
