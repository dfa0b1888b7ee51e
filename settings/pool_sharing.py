"""A GPU pool's `sharing` key: how many tasks share each GPU, and how (time-slicing or MPS).

    sharing: {slotsPerGpu: 4}               # time-slicing: compute time shared, memory not
    sharing: {slotsPerGpu: 4, mode: mps}    # MPS: each task a client with its own memory limit

The node software reads both (node.env): the agent advertises the slots, and with mps,
gpu-swarm-mps.service runs a daemon per GPU and the runtime guard gives each slot task its
GPU's daemon and limits (README "Sharing with MPS").
"""
from __future__ import annotations

from typing import Any, Callable

from settings.reader import SHARING_DEFAULTS, integer, suggest
from swarm.gpu_kind import MAX_SLOTS_PER_GPU, SHARING_MODES

NOT_SHARED = (0, SHARING_MODES[0])


def read_sharing(value: Any, error: Callable[[str, str], None]) -> tuple[int, str] | None:
    """(slots per GPU, mode): (0, time-slicing) without sharing; None when a problem was reported."""
    if value is None or value == {}:
        return NOT_SHARED
    if not isinstance(value, dict):
        error("sharing", f"expected an object such as {{slotsPerGpu: 4}} or {{slotsPerGpu: 4, mode: mps}}, "
                         f"found {value!r}")
        return None
    if "slots" in value:
        # Slots of different sizes on one GPU (README "Sharing with MPS"): MPS on today's drivers
        # holds one memory ceiling per GPU's server, so a smaller slot's size would be only its
        # environment, which its task can raise. Refused, rather than offered and not held.
        error("sharing.slots", "slots of different sizes on one GPU are not offered: MPS (driver r580) holds one "
                               "memory ceiling for all of a GPU's tasks, so a smaller slot's size could not be held "
                               "against its own task. Use slotsPerGpu (equal shares, each held by the GPU's MPS "
                               "daemon), or pools of different slotsPerGpu for different sizes")
        return None
    for unknown in sorted(set(value) - set(SHARING_DEFAULTS)):
        error(f"sharing.{unknown}", "is not a sharing setting" + suggest(unknown, SHARING_DEFAULTS))
        return None
    if "slotsPerGpu" not in value:
        error("sharing.slotsPerGpu", "required: how many tasks share each GPU (2 to 48)")
        return None
    slots = integer(value["slotsPerGpu"], None, 2, MAX_SLOTS_PER_GPU,
                    lambda m: error("sharing.slotsPerGpu", m + " (how many tasks share each GPU)"))
    mode = value.get("mode", SHARING_DEFAULTS["mode"])
    if mode not in SHARING_MODES:
        error("sharing.mode", f"{mode!r} is not a sharing mode; use time-slicing (the default: compute time is "
                              "shared, memory is not) or mps (each task gets its share of the GPU's memory as a limit)")
        return None
    return None if slots is None else (slots, mode)
