#!/usr/bin/env python3
"""The node's EFA devices, as the kernel lists them: for the agent's efa.count label and AWS-EFA resources, and the EFA step's check.

An EFA interface appears in /sys/class/infiniband as an RDMA device whose driver is `efa`
(rdmap<bus>s<slot> on Ubuntu, efa_<n> elsewhere), with its user-space verbs device under
/dev/infiniband. Other RDMA devices (a Mellanox card) are not counted. Stdlib only.
"""
from __future__ import annotations

import os
import sys

from contract import EFA_COUNT_LABEL, EFA_KIND, EFA_SYSFS, EFA_VERBS_DIR

EFA_DRIVER = "efa"
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-")


def efa_devices(sysfs: str = EFA_SYSFS) -> list[str]:
    """The names of the EFA devices under sysfs (/sys/class/infiniband), sorted; [] when there are none."""
    try:
        names = sorted(os.listdir(sysfs))
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = []
    for name in names:
        driver = os.path.join(sysfs, name, "device", "driver")
        if os.path.basename(os.path.realpath(driver)) == EFA_DRIVER:
            found.append(name)
    return found


def efa_labels(sysfs: str = EFA_SYSFS) -> dict[str, str]:
    """The agent's EFA labels: efa.count on a node that has EFA, none on one that has not."""
    count = len(efa_devices(sysfs))
    return {EFA_COUNT_LABEL: str(count)} if count else {}


def efa_verbs(sysfs: str = EFA_SYSFS, warnings: list[str] | None = None) -> dict[str, str]:
    """Each EFA device's name and its user verbs node: {"rdmap16s27": "/dev/infiniband/uverbs0"}.

    The kernel lists the verbs node under the device's own PCI folder
    (<sysfs>/<name>/device/infiniband_verbs/uverbsN). A device whose node cannot be told is left
    out, with a warning: advertised, it would be a resource the guard cannot give."""
    found = {}
    for name in efa_devices(sysfs):
        folder = os.path.join(sysfs, name, "device", "infiniband_verbs")
        try:
            nodes = sorted(n for n in os.listdir(folder) if n.startswith("uverbs") and n[6:].isdigit())
        except OSError:
            nodes = []
        if len(nodes) > 1:  # one PCI function with several RDMA devices: each node names its own
            nodes = [n for n in nodes if _read(os.path.join(folder, n, "ibdev")) == name]
        if len(nodes) != 1 or not _NAME_CHARS.issuperset(name) or name.isdigit():  # a number: swarm reads a count
            if warnings is not None:
                warnings.append(f"EFA device {name}: cannot tell its verbs node under {folder} (found "
                                f"{', '.join(nodes) or 'none'}), so it is not advertised as {EFA_KIND}; "
                                "check the efa kernel module (fi_info -p efa)")
            continue
        found[name] = f"{EFA_VERBS_DIR}/{nodes[0]}"
    return found


def efa_resources(verbs: dict[str, str]) -> list[str]:
    """The daemon.json node-generic-resources entries of the EFA devices: AWS-EFA=<name>, one each."""
    return [f"{EFA_KIND}={name}" for name in sorted(verbs)]


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip()
    except OSError:
        return ""


if __name__ == "__main__":  # what install-efa.sh checks: how many EFA devices the kernel shows
    print(len(efa_devices(sys.argv[1] if len(sys.argv) > 1 else EFA_SYSFS)))
