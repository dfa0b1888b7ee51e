"""One node brought to the cluster's release and admitted: drained, upgraded in place, checked, given back.

The three steps run on every `pulumi up` whose release differs from what the node runs,
and only then (their scripts name the release):
- cordon, on the first manager: drain the node if it runs another release;
- upgrade, on the node: write the files its user data wrote and run the same installer its
  first boot ran (node_commands.upgrade), so a roll and a boot are one path;
- admit, on the first manager: label the node, check that the swarm sees its GPUs, prove
  them (the post-join check), record the release and give back what cordon took.
Cluster rolls each pool in waves of at most its maxUnavailable nodes (RollWaves): a node's
cordon waits for every admit of the wave before. So at most that many nodes per pool are out
at a time, and no command ever waits for one that has not started, whatever
`pulumi up --parallel` is (a lease held across commands would deadlock there).

A node that has just booted with the release needs neither cordon nor upgrade: it joined drained
(swarm/script.py), so it takes no task before admit has checked it (admit gives that drain back),
and its boot applied the release. So cordon and upgrade run as pulumi-command's `update`, and
their `create` is empty (the provider then runs nothing, and dials nothing) when the boot wait
saw the node run this very release; otherwise, for a node that booted another release before its
rollout was first made (an up that stopped in between), `create` is the same script. That saves
two commands per new node, each an SSH session through a manager.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import pulumi
import pulumi_command as command

from to_node import commands as node_commands
from components.chain import after
from components.remote import as_root
from to_node.software import NodeRelease
from swarm.gpu_check import GpuCheck
from swarm.rollout import admit_node, admitted, advertised_gpus, cordon_node


@dataclass
class NodeRolloutArgs:
    pool: str
    release: pulumi.Input[NodeRelease]  # where the bundle is, and what the node runs
    release_id: str  # release.id, known before the bundle's URL is
    node: pulumi.Input[command.remote.ConnectionArgs]  # to the node
    manager: pulumi.Input[command.remote.ConnectionArgs]  # to the first manager
    node_id: pulumi.Input[str]  # as joined
    ran_release: pulumi.Input[str | None]  # the release the node ran when its boot wait last looked (NodeBoot)
    labels: pulumi.Input[Mapping[str, str]]
    expected_gpus: int
    kind: str
    slots_per_gpu: int  # 0: whole GPUs
    shared_kind: str
    check: GpuCheck | None = None  # prove the node's GPUs (GPU nodes)
    # The join, and what the node's wave waits for (RollWaves.next).
    after: Sequence[pulumi.Resource] = field(default_factory=list)


class NodeRollout(pulumi.ComponentResource):
    admitted: command.remote.Command  # done once the node runs the release, checked and schedulable
    advertised_gpus: pulumi.Output[list[str]]  # GPU UUIDs (or slots) the swarm sees on the node
    gpus_verified: pulumi.Output[dict | None]  # the post-join check's result; None: no GPUs to check

    def __init__(self, name: str, args: NodeRolloutArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-swarm:node:Rollout", name, None, opts)
        release = args.release_id
        cordon_script = pulumi.Output.from_input(args.node_id).apply(
            lambda node: as_root(cordon_node(node, pool=args.pool, software=release)))
        cordon = command.remote.Command(
            f"{name}-cordon",
            connection=args.manager,
            create=_unless_booted_with(release, args.ran_release, cordon_script),
            update=cordon_script,
            opts=pulumi.ResourceOptions(parent=self, depends_on=[after(r) for r in args.after]),
        )
        upgrade_script = pulumi.Output.from_input(args.release).apply(
            lambda r: as_root(node_commands.upgrade(r, expected_gpus=args.expected_gpus)))
        upgrade = command.remote.Command(
            f"{name}-upgrade",
            connection=args.node,
            create=_unless_booted_with(release, args.ran_release, upgrade_script),
            update=upgrade_script,
            opts=pulumi.ResourceOptions(parent=self, depends_on=[after(cordon)]),
        )
        self.admitted = command.remote.Command(
            f"{name}-admit",
            connection=args.manager,
            create=pulumi.Output.all(args.node_id, args.labels).apply(lambda v: as_root(admit_node(
                v[0], dict(v[1]), expected_gpus=args.expected_gpus, kind=args.kind, software=release,
                slots_per_gpu=args.slots_per_gpu, shared_kind=args.shared_kind, check=args.check))),
            opts=pulumi.ResourceOptions(parent=self, depends_on=[after(upgrade)]),
        )
        shown = args.shared_kind if args.slots_per_gpu else args.kind
        result = self.admitted.stdout.apply(admitted)
        self.advertised_gpus = result.apply(lambda r: advertised_gpus(json.dumps(r[0]), shown))
        self.gpus_verified = result.apply(lambda r: r[1])
        self.register_outputs({"release": release})


def _unless_booted_with(release: str, ran: pulumi.Input[str | None], script: pulumi.Output[str]):
    """A rollout step's `create`: nothing (None: the input is left out) for a node that ran `release`
    when its boot wait looked, else `script`. Only a create reads it: an update runs `update`."""
    return pulumi.Output.all(ran, script).apply(lambda v: None if v[0] == release else v[1])


class RollWaves:
    """Each pool's rollouts in waves: wave w+1's cordons wait until every node of wave w is admitted.

    The dependency chain is then as deep as the waves, not the nodes (the SDK walks each new
    dependency's ancestors recursively, and crashed on a chain of a pool of 400). Between two
    waves of several nodes stands a gate, a command that does nothing but wait for the wave's
    admits: each node depends on one gate and each gate on its wave, 2 edges a node, where every
    node depending on every admit before it would be wave-size edges a node, which the SDK walks
    too. A wave of one node waits for the previous admit itself, as managers roll one at a time.
    Every edge along the chain is declared with components/chain.after, so that the SDK's cycle check
    does not walk the whole roll before it again at each node.
    """

    def __init__(self, name: str, opts: pulumi.ResourceOptions):
        self._name, self._opts = name, opts
        self._open: dict[str, list[pulumi.Resource]] = {}  # pool -> admits of the wave being filled
        self._gate: dict[str, pulumi.Resource] = {}  # pool -> what the wave being filled waits for
        self._closed: dict[str, int] = {}  # pool -> waves closed so far

    def next(self, pool: str, size: int) -> list[pulumi.Resource]:
        """What the next node of `pool` waits for, with waves of `size` nodes; then add() its admit."""
        if len(self._open.setdefault(pool, [])) >= size:
            self._close(pool)
        return [self._gate[pool]] if pool in self._gate else []

    def add(self, pool: str, admitted: pulumi.Resource) -> None:
        self._open[pool].append(admitted)

    def rolled(self) -> list[pulumi.Resource]:
        """Per pool, what is done once all of its nodes are admitted: its last wave's gate."""
        for pool, admits in self._open.items():
            if admits:
                self._close(pool)
        return list(self._gate.values())

    def _close(self, pool: str) -> None:
        admits, wave = self._open[pool], self._closed.get(pool, 0)
        self._gate[pool] = admits[0] if len(admits) == 1 else command.local.Command(
            f"{self._name}-{pool}-wave-{wave}", opts=pulumi.ResourceOptions.merge(
                self._opts, pulumi.ResourceOptions(depends_on=[after(a) for a in admits])))
        self._open[pool], self._closed[pool] = [], wave + 1
