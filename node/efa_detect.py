#!/usr/bin/env python3
"""The node's EFA devices, as the kernel lists them: for the agent's efa.count label and the EFA step's check.

An EFA interface appears in /sys/class/infiniband as an RDMA device whose driver is `efa`
(rdmap<bus>s<slot> on Ubuntu, efa_<n> elsewhere), with its user-space verbs device under
/dev/infiniband. Other RDMA devices (a Mellanox card) are not counted. Stdlib only.
"""
from __future__ import annotations

import os
import sys

from contract import EFA_COUNT_LABEL, EFA_SYSFS

EFA_DRIVER = "efa"


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


if __name__ == "__main__":  # what install-efa.sh checks: how many EFA devices the kernel shows
    print(len(efa_devices(sys.argv[1] if len(sys.argv) > 1 else EFA_SYSFS)))
