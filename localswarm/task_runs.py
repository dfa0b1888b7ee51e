"""The rehearsal's view of node/stack_tasks.py: what counts as a settled task, and why one never will.

That file lands on every node, where the deploy command's waiter (node/stack_settle.py) imports
it as a sibling; the rehearsal and the tests load it by path, as swarm/node_contract.py loads the
contract, so "settled" has one copy. Import the names from here: `from localswarm.task_runs import converged`.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

RULES_PATH = Path(__file__).resolve().parent.parent / "node" / "stack_tasks.py"


def _load():
    spec = importlib.util.spec_from_file_location("gpu_swarm_stack_tasks", RULES_PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


_rules = _load()
__all__ = sorted(name for name in vars(_rules) if not name.startswith("__") and name not in ("annotations",))
globals().update({name: getattr(_rules, name) for name in __all__})
