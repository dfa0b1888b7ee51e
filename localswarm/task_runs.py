"""The rehearsal's view of node/stack_tasks.py: what counts as a settled task, and why one never will.

That file lands on every node, where the deploy command's waiter (node/stack_settle.py) imports
it as a sibling; the rehearsal and the tests load it by path, as swarm/node_contract.py loads the
contract, so "settled" has one copy. Import the names from here: `from localswarm.task_runs import converged`.
"""
from __future__ import annotations

from swarm.node_module import NODE_DIR, load

RULES_PATH = NODE_DIR / "stack_tasks.py"
_rules = load(RULES_PATH.name, "gpu_swarm_stack_tasks")
__all__ = sorted(name for name in vars(_rules) if not name.startswith("__") and name not in ("annotations",))
globals().update({name: getattr(_rules, name) for name in __all__})
