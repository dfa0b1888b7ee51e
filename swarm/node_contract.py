"""The program's view of node/contract.py: every label, environment key and node path the program shares with the nodes.

That file lands on every node, where the node programs import it as a sibling; the program
loads it by path, as swarm/gpu_kind.py loads the GPU resource rules, so there is no second
copy. Import the names from here: `from swarm.node_contract import NODE_ENV_PATH, KIND_ENV`.
"""
from __future__ import annotations

from swarm.node_module import NODE_DIR, load

CONTRACT_PATH = NODE_DIR / "contract.py"
_contract = load(CONTRACT_PATH.name, "gpu_swarm_node_contract")
# Every public name of the contract, as this module's own.
__all__ = sorted(name for name in vars(_contract) if name.isupper())
globals().update({name: getattr(_contract, name) for name in __all__})
