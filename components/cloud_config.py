"""The EC2 user data of a node: a #cloud-config that writes the node's files and runs the installer at first boot.

A pure function of one NodeRelease (to_node/software.py): the files come from cloud-init/ and
the node's settings, so every change to what a node boots with is a diff of this text
(tests/test_cloud_config.py keeps a snapshot per example stack). The node software itself
is not here (EC2 caps user data at 16 KiB): the installer downloads its bundle and checks
it against the sha256 pinned in release.env.

It also hands the node its SSH host key (ssh_keys), which every connection of the program
pins (components/remote.py): see components/node_pool.py for why, and what that costs.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import yaml

from to_node.software import INSTALLER_PATH, NodeRelease

# EC2's limit on user data, before base64.
USER_DATA_LIMIT = 16 * 1024


@dataclass(frozen=True)
class HostKey:
    """A node's SSH host key (ed25519), in OpenSSH encodings, as the program generated it."""

    private_openssh: str
    public_openssh: str


def render_cloud_config(release: NodeRelease, host_key: HostKey | None = None) -> str:
    """The #cloud-config a node of this release boots with: plain text, the same bytes on every operator's machine."""
    keys = ""
    if host_key is not None:
        # cloud-init writes them before sshd first starts (cloud-init.service runs before it);
        # only ed25519, which it then has, is generated: the node answers with this key and no other.
        keys = _dump({"ssh_deletekeys": True, "ssh_genkeytypes": ["ed25519"],
                      "ssh_keys": {"ed25519_private": host_key.private_openssh.strip() + "\n",
                                   "ed25519_public": host_key.public_openssh.strip()}})
    text = "#cloud-config\n" + keys + _release_part(release)
    if len(text.encode()) > USER_DATA_LIMIT:
        raise ValueError(f"the user data is {len(text.encode())} bytes, over EC2's {USER_DATA_LIMIT}")
    return text


# What every node of a release shares, dumped once per release: a pool's nodes share one NodeRelease
# object, and dumping its files for each node was 8 % of the program's time at 1,000 nodes (issue 25).
# By identity (a release's files are read from disk when it is dumped); the last few releases only.
_RELEASE_PARTS: OrderedDict[int, tuple[NodeRelease, str]] = OrderedDict()


def _release_part(release: NodeRelease) -> str:
    made = _RELEASE_PARTS.get(id(release))
    if made is None or made[0] is not release:
        made = _RELEASE_PARTS[id(release)] = (release, _dump({
            "write_files": [{"path": f.path, "owner": "root:root", "permissions": f.mode, "content": f.content}
                            for f in release.files()],
            # runcmd runs once per instance, in cloud-init's final stage: cloud-init's result file
            # appears when the install has ended (to_node/commands.py wait_for_boot).
            "runcmd": [[INSTALLER_PATH]],
        }))
        while len(_RELEASE_PARTS) > 16:
            _RELEASE_PARTS.popitem(last=False)
    return made[1]


def _dump(mapping: dict) -> str:
    # Top-level keys dumped apart and joined are the mapping dumped whole (block style, no document marker).
    return yaml.dump(mapping, Dumper=_Dumper, sort_keys=False, width=4096)


class _Dumper(yaml.SafeDumper):
    """Writes multi-line strings as | blocks, so the file reads as it lands."""


_Dumper.add_representer(str, lambda dumper, value: dumper.represent_scalar(
    "tag:yaml.org,2002:str", value, style="|" if "\n" in value else None))
