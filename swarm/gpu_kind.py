"""The GPU resource kind, from its one source of truth: the node agent.

The agent must stay a single stdlib file that lands on nodes, so the rest of
the project loads it by path instead of keeping a second copy of the rules
that tie the kind to daemon.json and the toolkit's swarm-resource.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

AGENT_PATH = Path(__file__).resolve().parent.parent / "node" / "gpu_agent.py"


def _load_agent():
    spec = importlib.util.spec_from_file_location("gpu_agent", AGENT_PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_agent = _load_agent()

DEFAULT_KIND: str = _agent.DEFAULT_KIND
validate_kind = _agent.validate_kind
resource_env_name = _agent.resource_env_name
