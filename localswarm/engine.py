"""What the Pulumi engine does around the providers, for `program up`: identity, refresh, interrupted steps.

- Identity is the URN: the stack, the project, the type of the resource and of every parent
  above it ($-joined), and the name. A resource whose parent or type changes is another
  resource to the engine: the new one is created and the old one deleted (unless aliased).
- `refresh: always` (Pulumi.yaml) reads every instance back before the program runs: one
  terminated or reclaimed behind the program's back is gone from the state (so the program
  creates it again), one stopped says instanceState "stopped".
- A step the engine started and never heard back from (Ctrl-C, a killed CLI) is a pending
  operation in the state; the next `pulumi up` warns about it and goes on without it.
"""
from __future__ import annotations

from pathlib import Path

import yaml

STACK_TYPE = "pulumi:pulumi:Stack"
INSTANCE = "aws:ec2/instance:Instance"
SPOT_REQUEST = "aws:ec2/spotInstanceRequest:SpotInstanceRequest"


def urn(stack: str, project: str, parent: str, typ: str, name: str) -> str:
    """The engine's URN: the parent's whole type chain, but not the stack's own type."""
    if parent:
        parent_type = parent.split("::")[2]
        if parent_type != STACK_TYPE:
            typ = f"{parent_type}${typ}"
    return f"urn:pulumi:{stack}::{project}::{typ}::{name}"


def name_of(urn_: str) -> str:
    return urn_.split("::")[-1]


def type_of(urn_: str) -> str:
    return urn_.split("::")[2].split("$")[-1]


def project_refreshes(project_dir: Path) -> bool:
    """Pulumi.yaml's `options: refresh: always`, which makes every `pulumi up` a `pulumi up --refresh`."""
    try:
        project = yaml.safe_load((project_dir / "Pulumi.yaml").read_text()) or {}
    except OSError:
        return False
    return (project.get("options") or {}).get("refresh") == "always"


def refresh(resources: dict, instance_state) -> tuple[dict, list[str]]:
    """The state as a refresh reads it back. instance_state(resource) says what AWS reports of its
    instance: "running", "stopped" or None (terminated: a refresh drops it from the state)."""
    kept, notes = {}, []
    for key, resource in resources.items():
        if resource["type"] not in (INSTANCE, SPOT_REQUEST):
            kept[key] = resource
            continue
        state = instance_state(resource)
        if state is None:
            notes.append(f"refresh: {name_of(key)} is gone (terminated behind the program's back)")
            continue
        if state != resource["outputs"].get("instanceState", "running"):
            notes.append(f"refresh: {name_of(key)} is {state}")
        kept[key] = {**resource, "outputs": {**resource["outputs"], "instanceState": state}}
    return kept, notes


def pending_warning(pending: dict) -> str:
    names = ", ".join(f"{name_of(k)} ({op['operation']})" for k, op in sorted(pending.items()))
    return (f"warning: the last update was interrupted with {len(pending)} operation(s) pending: {names}. "
            "Whether they completed is unknown: check those resources in AWS (a created instance may "
            "exist that the state does not hold); this update goes on without them")
