"""Python's garbage collector for a program of thousands of resources.

A `pulumi up` holds its whole graph until the run ends: every resource, with its Outputs,
futures and callbacks, lives as long as the program. Python's collector walks again, at each
collection of an older generation, every object that survived the younger ones, to find almost
nothing to free. Measured with bench/scale.py and gc.callbacks (issue 25): at 1,000 GPU nodes the
collector took 13.6 s of a 45.4 s evaluation (young 5.3 s, middle 4.7 s, 2 full collections 3.6 s),
against 0.85 s of 4.1 s at 100 nodes; it grew 16 times for 10 times the nodes.

So what survives one young collection is frozen (gc.freeze): set aside, never walked again.
The young generation, where the short-lived garbage is (a registration's coroutines, a
serialized request), is still collected as before. The cost: a cycle that dies after it was
frozen is not freed before the process ends, which `pulumi up` does once its graph is done;
bench/scale.py measured the same peak memory either way (bench/results/scale-2core.md).
The SDK floor of bench/scale.py runs under the same setting, so that its ratio is the program's
own logic.
"""
from __future__ import annotations

import gc


# A process that runs the program once, as `pulumi up` does, freezes. The test suite runs it hundreds
# of times in one process and turns this off (tests/conftest.py): a run's frozen graph would never be freed,
# and freeing it (gc.unfreeze, then a full collection) cost 170 to 280 ms a run, as much as a small run.
FREEZE = True


def for_a_large_graph() -> None:
    if FREEZE and _freeze_survivors not in gc.callbacks:
        gc.callbacks.append(_freeze_survivors)


def _freeze_survivors(phase: str, info: dict) -> None:
    if phase == "stop":
        gc.freeze()
