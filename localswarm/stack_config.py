"""A stack's configuration as the Pulumi CLI hands it to the program: Pulumi.<stack>.yaml over the project's defaults."""
from __future__ import annotations

import json

import yaml

from localswarm.host import REPO


def config_text(value) -> str:
    """A YAML config value as the CLI hands it to the program: text, or JSON for lists and objects."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    return str(value)


def project_defaults() -> dict[str, str]:
    """The defaults that Pulumi.yaml declares, qualified, as the CLI merges them into every stack."""
    project = yaml.safe_load((REPO / "Pulumi.yaml").read_text())
    out = {}
    for name, decl in (project.get("config") or {}).items():
        full = name if ":" in name else f"{project['name']}:{name}"
        if isinstance(decl, dict) and "default" in decl:
            out[full] = config_text(decl["default"])
    return out


def stack_config(stack: str, **overrides) -> dict[str, str]:
    """Pulumi.<stack>.yaml's config over the project defaults; overrides use unqualified keys (None removes)."""
    path = REPO / f"Pulumi.{stack}.yaml"
    if not path.exists():
        stacks = sorted(p.name[len("Pulumi."):-len(".yaml")] for p in REPO.glob("Pulumi.*.yaml"))
        raise FileNotFoundError(f"no stack {stack!r}: there is no {path.name}; stacks here: {', '.join(stacks)}")
    config = project_defaults()
    config.update({k: config_text(v) for k, v in (yaml.safe_load(path.read_text()).get("config") or {}).items()})
    for name, value in overrides.items():
        full = name if ":" in name else f"gpu-swarm:{name}"
        if value is None:
            config.pop(full, None)
        else:
            config[full] = value if isinstance(value, str) else config_text(value)
    return config
