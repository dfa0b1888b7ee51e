"""The EC2 user data: a small, constant cloud-config, the same for every node.

The node software does not travel here (see components/node_software.py): user data is
read once, at first boot, EC2 caps it at 16 KiB, and changing it replaces or reboots the
instance. What stays is what must hold before `pulumi up` first reaches the node.
"""
from __future__ import annotations

import yaml

# Regexes of packages unattended-upgrades leaves alone from the first boot on. The
# bootstrap also holds them (apt-mark hold) once it has installed the driver.
NVIDIA_PACKAGES = ("nvidia-", "libnvidia-", "linux-modules-nvidia-", "linux-objects-nvidia-",
                   "linux-signatures-nvidia-")
UNATTENDED_CONFIG = "/etc/apt/apt.conf.d/51gpu-swarm-unattended"


def render_user_data() -> str:
    """The #cloud-config every node boots with: plain text, byte for byte the same everywhere."""
    blacklist = " ".join(f'"{p}";' for p in NVIDIA_PACKAGES)
    config = {
        "write_files": [{
            "path": UNATTENDED_CONFIG,
            "permissions": "0644",
            "content": (
                "// gpu-swarm: the driver's user space must match its loaded kernel module,\n"
                "// so NVIDIA packages change only when gpu-swarm rolls new node software.\n"
                f"Unattended-Upgrade::Package-Blacklist {{ {blacklist} }};\n"
            ),
        }],
    }
    return "#cloud-config\n" + yaml.dump(config, Dumper=_Dumper, sort_keys=False, width=4096)


class _Dumper(yaml.SafeDumper):
    """Writes multi-line strings as | blocks, so the file reads as it lands."""


_Dumper.add_representer(str, lambda dumper, value: dumper.represent_scalar(
    "tag:yaml.org,2002:str", value, style="|" if "\n" in value else None))
