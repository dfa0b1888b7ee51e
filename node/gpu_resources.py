#!/usr/bin/env python3
"""The GPU resource rules every part of gpu-swarm shares: kinds, UUIDs, slots, variable names.

The agent writes node-generic-resources with them, the runtime guard reads tasks'
variables with them, and the Pulumi program checks stack files with them (through
swarm/gpu_kind.py, which loads this file), so there is one source of truth. Stdlib only.
"""
from __future__ import annotations

import re

DEFAULT_KIND = "NVIDIA-GPU"
SHARED_SUFFIX = "-SHARED"
MAX_SLOTS_PER_GPU = 48  # also MPS's limit of clients per GPU (Volta and later)
# How the tasks on a GPU share it: time-slicing shares compute time only; mps runs them as
# clients of one MPS server per GPU, each with a memory limit and a thread ceiling.
SHARING_MODES = ("time-slicing", "mps")
# What an MPS slot's memory share leaves out of the GPU's: the MPS server's own context and
# the driver's reserve (bench/gpu_mps.py reports what is left on a real GPU).
MPS_RESERVED_MIB = 1024

_KIND_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")
_HEX_UUID = "[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"
# [0-9], not \d: \d also matches other scripts' digits, which int() reads too.
UUID_RE = re.compile(rf"GPU-{_HEX_UUID}|MIG-{_HEX_UUID}|MIG-GPU-{_HEX_UUID}/[0-9]+/[0-9]+")
# A slot of a shared GPU: its UUID and a slot number. swarm needs distinct values per
# slot (it consumes every entry with the claimed value), and a value that is a plain
# number would be read as a count, and one with '=' or ',' would not parse.
SLOT_RE = re.compile(rf"(?P<gpu>{UUID_RE.pattern})-s(?P<slot>[0-9]+)")


def validate_kind(kind: str) -> str:
    """Return kind if it is a usable swarm generic-resource kind, else raise ValueError."""
    if not isinstance(kind, str) or not _KIND_RE.fullmatch(kind):
        raise ValueError(
            f"invalid GPU resource kind {kind!r}: expected 1-64 letters, digits, '-' or '_' "
            f"(for example {DEFAULT_KIND}); choose such a name, since it becomes the "
            "generic-resource name services reserve and the DOCKER_RESOURCE_<KIND> variable")
    return kind


def resource_env_name(kind: str) -> str:
    """The variable swarm sets in a task with the UUIDs it assigned (swarmkit EnvFormat)."""
    return "DOCKER_RESOURCE_" + validate_kind(kind).upper()


def validate_uuid(uuid: object) -> str:
    if not isinstance(uuid, str) or not UUID_RE.fullmatch(uuid):
        raise ValueError(
            f"GPU UUID {uuid!r} is not a full UUID: expected GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx "
            "or MIG-... (see nvidia-smi -L); current toolkits refuse truncated UUIDs such as "
            "GPU-be74ca1f, so give the whole UUID")
    return uuid


def resource_entries(kind: str, uuids) -> list[str]:
    """The daemon.json node-generic-resources entries: one KIND=UUID per device."""
    kind = validate_kind(kind)
    return [f"{kind}={validate_uuid(uuid)}" for uuid in uuids]


def default_shared_kind(kind: str) -> str:
    """The kind that slots of shared GPUs are advertised under, unless configured otherwise."""
    return validate_kind(kind) + SHARED_SUFFIX


def slot_entries(shared_kind: str, uuids, slots_per_gpu: int) -> list[str]:
    """node-generic-resources for GPUs shared by slots: KIND=<uuid>-s<n>, slots_per_gpu of them per GPU.

    Ordered slot by slot, each GPU's s0 first, then each GPU's s1, and so on. swarmkit gives a
    task the first free entries in this order (api/genericresource/resource_management.go:
    selectNodeResources takes the first it finds; the scheduler rebuilds the free list in the
    node's order whenever the node changes, manager/scheduler/scheduler.go createOrUpdateNode),
    so tasks spread over the GPUs before two share one. GPU by GPU, the first K tasks would
    all land on the first GPU while the others sat idle."""
    shared_kind = validate_kind(shared_kind)
    if not 2 <= slots_per_gpu <= MAX_SLOTS_PER_GPU:
        raise ValueError(f"slots per GPU must be from 2 to {MAX_SLOTS_PER_GPU}, got {slots_per_gpu}")
    uuids = [validate_uuid(uuid) for uuid in uuids]
    return [f"{shared_kind}={uuid}-s{n}" for n in range(slots_per_gpu) for uuid in uuids]


def mps_slot_memory_mib(memory_mib: int, slots_per_gpu: int) -> int:
    """An MPS slot's memory limit: its share of what the GPU has once the MPS server is running."""
    return max((memory_mib - MPS_RESERVED_MIB) // slots_per_gpu, 0)


def mps_thread_percent(slots_per_gpu: int) -> int:
    """An MPS slot's default thread ceiling: its share of the GPU's SMs, rounded up so that the
    shares cover the whole GPU. A ceiling, not a reservation: a stack may set its own."""
    return -(-100 // slots_per_gpu)


def mps_daemon_limits(memory_mibs, slots_per_gpu: int) -> tuple[int, int]:
    """(memory ceiling MiB, thread percentage) that gpu-swarm-mps gives every GPU's control daemon
    before its server starts. The node's smallest GPU sets the share, as the agent's runtime.env
    says it to the guard: a slot's value names its GPU, but a stack asks for a share of "a GPU of
    this pool". The daemon's ceiling is what no client can raise (FACTS: its own
    CUDA_MPS_PINNED_DEVICE_MEM_LIMIT only lowers it); the guard's variables may only ask for less."""
    memory = [int(m) for m in memory_mibs]
    if not memory or min(memory) <= MPS_RESERVED_MIB:
        raise ValueError(f"GPU memory {memory} MiB leaves nothing to share after the MPS server's "
                         f"{MPS_RESERVED_MIB} MiB")
    if not 2 <= slots_per_gpu <= MAX_SLOTS_PER_GPU:
        raise ValueError(f"slots per GPU must be from 2 to {MAX_SLOTS_PER_GPU}, got {slots_per_gpu}")
    return mps_slot_memory_mib(min(memory), slots_per_gpu), mps_thread_percent(slots_per_gpu)


def slot_gpu(value: str) -> str:
    """The GPU UUID a slot value such as GPU-...-s3 belongs to."""
    match = SLOT_RE.fullmatch(value or "")
    if not match:
        raise ValueError(f"{value!r} is not a GPU slot (expected <GPU UUID>-s<number>)")
    return match["gpu"]


def main(argv: list[str]) -> int:
    """`gpu_resources.py mps-limits SLOTS MIB...`: what node/gpu-swarm-mps tells each control
    daemon ("<ceiling MiB> <thread percent>"), from the one copy of the rule, here."""
    import sys
    if len(argv) < 3 or argv[0] != "mps-limits" or not all(a.isdigit() for a in argv[1:]):
        print("usage: gpu_resources.py mps-limits SLOTS_PER_GPU GPU_MEMORY_MIB...", file=sys.stderr)
        return 2
    try:
        ceiling, threads = mps_daemon_limits(argv[2:], int(argv[1]))
    except ValueError as e:
        print(f"gpu_resources.py: {e}", file=sys.stderr)
        return 2
    print(ceiling, threads)
    return 0


if __name__ == "__main__":
    import sys
    sys.exit(main(sys.argv[1:]))
