"""How `pulumi up` reaches each node: its pinned host key, the managers' stable addresses, any live manager.

Managers are dialled at their Elastic IP (components/node_pool.py); workers, which take SSH
only from managers, at their private address through a manager. pulumi-command's proxy is
one host, so the program picks it: the first manager, in order, that AWS reports running
when the program starts (aws.ec2.get_instances by the manager's Name tag; a new cluster has
none, and gets the first). The same manager runs the swarm's own steps (cordon, admit,
reconcile, stacks, health). While the first manager lives, nothing changes; once it is
stopped or gone, the next `pulumi up` goes through the next live one, so a dead manager never
cuts the workers off.

The choice is by name, a plain value known before any resource: a manager being replaced is
still running, under its name, when the program starts, and its Elastic IP and host key stay,
so the jump host (address and pinned key) is the same and no worker command changes. Chosen
by instance id, the replaced manager's new id was not among the running ones, the workers
moved to the next manager, and moved back on the `up` after: two rounds of updates.

What a change of manager costs: the connection of each command that goes through it
changes, which pulumi-command treats as an update and runs again. Every such script checks
first and does nothing a working node does not need (the boot wait has an update of its
own that only says so; a join finds the node in its swarm; a cordon and an upgrade find the
node at its release; an admit finds its labels and its GPUs proven for that release): seconds
per node, and no drain, no restart, no reinstall.
"""
from __future__ import annotations

from typing import Sequence

import pulumi

from components.node_pool import Node
from components.remote import LIVE, connection, pinned


def live_index(manager_names: Sequence[str], running: Sequence[str]) -> int:
    """The first manager (by index) that is running; the first one when none is (a new cluster)."""
    return next((i for i, name in enumerate(manager_names) if name in set(running)), 0)


class Access:
    """Connections to the cluster's nodes, all through one chosen live manager."""

    def __init__(self, managers: Sequence[Node], running_managers: Sequence[str], user: str,
                 private_key: pulumi.Input[str]):
        """running_managers: the Name tags of the managers AWS reports running (settings/aws_lookups.py)."""
        if not managers:
            raise ValueError("a cluster needs at least one manager to reach its nodes")
        self._user, self._key = user, private_key
        self.live_index = live_index([m.name for m in managers], running_managers)
        live = managers[self.live_index]
        self.manager_address = live.public_ip
        self.manager_host_key = live.host_key

    def to(self, node: Node, budget: tuple[int, int] = LIVE) -> pulumi.Output:
        """SSH to `node`: a manager directly, a worker through the live manager; host keys pinned."""
        if node.role == "manager":
            return connection(host=node.public_ip, user=self._user, private_key=self._key, host_key=node.host_key,
                              budget=budget)
        return connection(host=node.private_ip, user=self._user, private_key=self._key, host_key=node.host_key,
                          jump_host=self.manager_address, jump_host_key=self.manager_host_key, budget=budget)

    def to_live_manager(self, budget: tuple[int, int] = LIVE) -> pulumi.Output:
        """SSH to the live manager, where the swarm's own steps run."""
        return connection(host=self.manager_address, user=self._user, private_key=self._key,
                          host_key=self.manager_host_key, budget=budget)

    def ssh_commands(self, nodes: Sequence[Node]) -> pulumi.Output[dict[str, str]]:
        """What an operator types, by node name: workers hop through the live manager (ssh -J).
        One Output for all of them: an Output per node costs the SDK more than the text does."""
        def command(node: Node, address: str, manager: str) -> str:
            if node.role == "manager":
                return f"ssh {self._user}@{address}"
            return f"ssh -J {self._user}@{manager} {self._user}@{address}"

        addresses = [n.public_ip if n.role == "manager" else n.private_ip for n in nodes]
        return pulumi.Output.all(self.manager_address, *addresses).apply(
            lambda v: {n.name: command(n, a, v[0]) for n, a in zip(nodes, v[1:])})

    @staticmethod
    def known_hosts(nodes: Sequence[Node]) -> pulumi.Output[str]:
        """A known_hosts file for the operator's own ssh: each node's pinned key at each address it is dialled at."""
        def line(node: Node, public_ip: str | None, private_ip: str | None, host_key: str) -> str:
            hosts = [public_ip, private_ip] if node.role == "manager" else [private_ip]
            return f"{','.join(h for h in hosts if h)} {pinned(host_key)}\n"

        values = [v for n in nodes for v in (n.public_ip, n.private_ip, n.host_key)]
        return pulumi.Output.all(*values).apply(
            lambda v: "".join(line(n, *v[3 * i:3 * i + 3]) for i, n in enumerate(nodes)))
