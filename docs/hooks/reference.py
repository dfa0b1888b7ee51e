"""MkDocs hook: pages made from the repository's own sources at build time, never written twice.

- reference/configuration.md: every config key, from the schema in Pulumi.yaml (the one place a key
  is declared and described; settings/ refuses any key it does not declare);
- index.md: README.md, the repository's front page, with its links into docs/ made site links.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import yaml
from mkdocs.structure.files import File, Files

REPO = Path(__file__).resolve().parents[2]
CONFIG_PAGE = "reference/configuration.md"
GENERATED = {CONFIG_PAGE, "index.md"}  # pages that exist only in the built site

CONFIG_INTRO = """\
# Configuration keys

Every key is in the `gpu-swarm:` namespace and declared in `Pulumi.yaml`, which is where this page
comes from: the site's build reads the schema's `config:` section, so a key is described once.
`settings/` reads the keys once into a frozen `Settings` and refuses a key that `Pulumi.yaml` does
not declare; every bad value fails at preview with a message that names the key and the fix,
before anything is created. A key without a default is required. How the keys fit together:
[Configuring a cluster](../configure/index.md).

"""


def _type(spec: dict) -> str:
    if "type" not in spec:  # Pulumi's schema cannot type objects; the default shows the shape
        default = spec.get("default")
        return "list" if isinstance(default, list) else "object" if isinstance(default, dict) else "YAML value"
    if spec["type"] == "array":
        return f"list of {spec.get('items', {}).get('type', 'values')}"
    return spec["type"]


def _default(spec: dict) -> str:
    if "default" not in spec:
        return "required"
    value = spec["default"]
    return f"`{json.dumps(value)}`" if not isinstance(value, str) or value == "" else f"`{value}`"


def config_reference(pulumi_yaml: Path = REPO / "Pulumi.yaml") -> str:
    """The reference page: a summary table, then each key under its own heading (a link target)."""
    keys = yaml.safe_load(pulumi_yaml.read_text(encoding="utf-8"))["config"]
    missing = [k for k, spec in keys.items() if not str(spec.get("description", "")).strip()]
    if missing:
        raise ValueError(f"Pulumi.yaml: config keys without a description: {', '.join(missing)}; "
                         "add one under each, since the documentation's reference is made from it")
    rows = ["| key | type | default |", "| --- | --- | --- |"]
    rows += [f"| [`{k}`](#{k.lower()}) | {_type(s)} | {_default(s)} |" for k, s in keys.items()]
    sections = [f"## `{k}`\n\n*{_type(s)}, {_default(s) if 'default' not in s else 'default ' + _default(s)}*"
                f"\n\n{s['description'].strip()}\n" for k, s in keys.items()]
    return CONFIG_INTRO + "\n".join(rows) + "\n\n" + "\n".join(sections)


# README links into the site as docs/PAGE.md; on the site they are PAGE.md.
_DOCS_LINK = re.compile(r"\]\(docs/")


def front_page(readme: Path = REPO / "README.md") -> str:
    return _DOCS_LINK.sub("](", readme.read_text(encoding="utf-8"))


def on_files(files: Files, config) -> Files:
    files.append(File.generated(config, CONFIG_PAGE, content=config_reference()))
    files.append(File.generated(config, "index.md", content=front_page()))
    return files
