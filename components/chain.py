"""Dependencies along the roll's chain that the SDK's cycle check need not walk.

At every registration the Python SDK checks each new dependency for a cycle by walking the whole
ancestry of that dependency (pulumi/runtime/resource_cycle_breaker.py). Along a roll, a node of a
late wave has every node of the waves before it as ancestors, and each node adds four such edges
(cordon on the gate, upgrade on cordon, admit on upgrade, the next gate on admit), so evaluation
grew with the square of the pool (bench/results/scale-2core.md).

after() gives the same dependency as a DependencyResource, the SDK's own stand-in for a resource
known only by its URN, made once the resource's URN is known: the SDK still waits for the resource's
registration, and the engine gets the same URN among the dependencies, but the stand-in has no
ancestry of its own to walk. A new resource cannot be part of a cycle anyway: nothing depends on it yet.
"""
from __future__ import annotations

import asyncio
import weakref

import pulumi
from pulumi.resource import DependencyResource

# One stand-in per resource: a wave's gate is waited for by every node of the next wave.
_stand_ins: "weakref.WeakKeyDictionary[pulumi.Resource, pulumi.Output]" = weakref.WeakKeyDictionary()


def after(resource: pulumi.Resource) -> pulumi.Output[pulumi.Resource]:
    """`resource` for depends_on, as a dependency whose ancestry is not walked again."""
    if resource not in _stand_ins:
        async def stand_in() -> pulumi.Resource:
            return DependencyResource(await resource.urn.future())

        async def known() -> bool:
            return True

        async def secret() -> bool:
            return False
        _stand_ins[resource] = pulumi.Output(set(), asyncio.ensure_future(stand_in()), asyncio.ensure_future(known()),
                                             asyncio.ensure_future(secret()))
    return _stand_ins[resource]
