"""The program's view of node/contract.py: every label, environment key and node path the program shares with the nodes.

That file lands on every node, where the node programs import it as a sibling; the program
loads it by path, as swarm/gpu_kind.py loads the GPU resource rules, so there is no second
copy. Import the names from here: `from swarm.node_contract import NODE_ENV_PATH, KIND_ENV`.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

CONTRACT_PATH = Path(__file__).resolve().parent.parent / "node" / "contract.py"


def _load():
    spec = importlib.util.spec_from_file_location("gpu_swarm_node_contract", CONTRACT_PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_contract = _load()
# Every public name of the contract, as this module's own.
__all__ = sorted(name for name in vars(_contract) if name.isupper())
globals().update({name: getattr(_contract, name) for name in __all__})
