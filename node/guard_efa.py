"""The EFA devices a task reserved, added to its config.json as `docker run --device` adds them.

The runtime guard (gpu_guard.py) loads it only for a task that reserved EFA (AWS-EFA). Each
device's verbs node (/dev/infiniband/uverbsN, which libibverbs and so libfabric's efa provider
open) goes into linux.devices, so runc creates it in the container, and into the device cgroup's
allow list, after dockerd's deny-all rule. Swarm services cannot add devices themselves: a task
that reserved none gets none. Like the guard: posix only, and it fails closed.
"""

import posix

_CHAR_DEVICE = 0o020000
_FILE_TYPE = 0o170000


class NotGiven(Exception):
    """A reserved device cannot be given: the message says why and what to do."""


def add_devices(spec: dict, paths: list[str]) -> None:
    """Add each character device at paths to spec, with its major and minor as the node has them.
    A second create of the same bundle adds nothing twice."""
    linux = spec.setdefault("linux", {})
    devices = linux.get("devices") or []
    resources = linux.get("resources") or {}
    rules = resources.get("devices") or []
    for path in paths:
        try:
            st = posix.stat(path)
        except OSError as e:
            raise NotGiven(f"the EFA device {path} is missing on this node ({e.strerror}), though the agent found it "
                           "at boot: check the efa driver (fi_info -p efa) and restart the agent (systemctl restart "
                           "gpu-swarm-agent), or drain the node") from None
        if st.st_mode & _FILE_TYPE != _CHAR_DEVICE:
            raise NotGiven(f"{path} is not a character device, so it is no EFA device; restart the agent "
                           "(systemctl restart gpu-swarm-agent), or drain the node")
        major, minor = posix.major(st.st_rdev), posix.minor(st.st_rdev)
        if not any(d.get("path") == path for d in devices):
            # fileMode 0666: the task's user may not be root; the node's own node is 0666 too (rdma-core's udev rule)
            devices.append({"path": path, "type": "c", "major": major, "minor": minor, "fileMode": 0o666,
                            "uid": 0, "gid": 0})
        rule = {"allow": True, "type": "c", "major": major, "minor": minor, "access": "rwm"}
        if rule not in rules:
            rules.append(rule)
    linux["devices"], linux["resources"], resources["devices"] = devices, resources, rules
