"""The GPU resource rules, from their one source of truth: node/gpu_resources.py.

That file lands on every node (the agent and the runtime guard use it), so the rest of the
project loads it by path instead of keeping a second copy of the rules that tie a kind to
daemon.json, the task's DOCKER_RESOURCE_<KIND> variable and the shared slots.
"""
from __future__ import annotations

from swarm.node_module import NODE_DIR, load

RULES_PATH = NODE_DIR / "gpu_resources.py"
_rules = load(RULES_PATH.name, "gpu_resources")

DEFAULT_KIND: str = _rules.DEFAULT_KIND
MAX_SLOTS_PER_GPU: int = _rules.MAX_SLOTS_PER_GPU
validate_kind = _rules.validate_kind
resource_env_name = _rules.resource_env_name
default_shared_kind = _rules.default_shared_kind
slot_gpu = _rules.slot_gpu
SHARING_MODES: tuple[str, ...] = _rules.SHARING_MODES
