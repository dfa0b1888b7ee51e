"""What a rehearsal provider plugin does outside a preview: the rehearsal's cloud, one resource at a time.

Under Pulumi's real CLI the engine decides every step (create, update, replace, delete, in its
own order and parallelism) and sends each to the plugin of the resource's package. The plugin
does it with the rehearsal's own resource handlers (localswarm/local_cloud.py): an
aws.ec2.Instance becomes a machine that boots its user data, a command.remote.Command runs its
script over real SSH, a tls.PrivateKey is a real key. What the engine's state does not hold for
the plugin (the machines behind instances, what a key pair's lookup finds) the plugin keeps in a
world file of its package, under the rehearsal's Pulumi folder, so that the next CLI run (a
second `up`, a `destroy`) finds it. Each command that ran a script is also appended to the folder's
actions.jsonl as it finishes, with its host and seconds: what the rehearsal's report says each CLI
run did on the nodes (localswarm/pulumi_cli.py), which the CLI's display does not show.
"""
from __future__ import annotations

import fcntl
import json
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from pulumi.runtime import mocks as pulumi_mocks

from localswarm import object_store
from localswarm.local_cloud import COMMAND, GROUP, INSTANCE, SPOT_REQUEST, LocalCloud


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)  # the plugin's stderr: the CLI's log (-v), not its display


class PluginCloud:
    def __init__(self, package: str, root: Path, region: str = "us-east-1"):
        self.world = root / f"world-{package}.json"
        self.actions_log = root / "actions.jsonl"
        self.lock = threading.Lock()
        self._logged = 0
        known = self._load()
        self.cloud = LocalCloud(previous={}, region=region, say=_say, clock=time.monotonic,
                                machines_by_instance=known.get("machines", {}), next_index=known.get("next_index", 1))
        self.cloud.current = known.get("current", {})

    def _load(self) -> dict:
        try:
            return json.loads(self.world.read_text())
        except (OSError, ValueError):
            return {}

    @contextmanager
    def _saved(self):
        """The world written after the step, under a file lock (the engine runs steps in parallel)."""
        yield
        with self.lock, open(self.world.with_suffix(".lock"), "w") as held:
            fcntl.flock(held, fcntl.LOCK_EX)
            c = self.cloud
            with c.lock:  # written out while no other step changes it
                doc = json.dumps({"current": c.current, "machines": c.machines_by_instance, "next_index": c.next_index},
                                 default=str)
                done, self._logged = c.actions[self._logged:], len(c.actions)
            tmp = self.world.with_suffix(".tmp")
            tmp.write_text(doc)
            tmp.replace(self.world)
            with open(self.actions_log, "a") as log:
                for a in done:
                    if a.typ == COMMAND and a.host:
                        log.write(json.dumps({"name": a.name, "action": a.action, "host": a.host,
                                              "seconds": a.seconds, "at": time.time()}) + "\n")

    def _step(self, urn: str, typ: str, inputs: dict, before: dict | None) -> tuple[str, dict]:
        c = self.cloud
        c.options.urn, c.options.name = urn, urn.rsplit("::", 1)[1]
        with c.lock:
            if before:
                c.previous[urn] = before
            else:
                c.previous.pop(urn, None)
        with self._saved():
            return c.new_resource(pulumi_mocks.MockResourceArgs(typ, urn.rsplit("::", 1)[1], inputs, custom=True))

    def invoke(self, token: str, args: dict) -> dict:
        """A lookup, answered from what exists: the world's resources (the subnets made, the instances whose
        machines run), as LocalCloud answers the ones AWS answers from its account."""
        return self.cloud.call(pulumi_mocks.MockCallArgs(token, args, ""))

    def create(self, urn: str, typ: str, inputs: dict) -> tuple[str, dict]:
        return self._step(urn, typ, inputs, None)

    def update(self, urn: str, typ: str, rid: str, old_inputs: dict, old_outputs: dict, news: dict) -> dict:
        before = {"type": typ, "id": rid, "inputs": old_inputs, "outputs": old_outputs}
        return self._step(urn, typ, news, before)[1]

    def delete(self, urn: str, typ: str, rid: str, outputs: dict) -> None:
        c = self.cloud
        with self._saved():
            if typ in (INSTANCE, SPOT_REQUEST):
                c._terminate({"id": rid, "outputs": outputs})
            elif typ == GROUP:
                from localswarm import elastic_cloud
                elastic_cloud.delete_group(rid)
            elif typ == "aws:ec2/eipAssociation:EipAssociation":
                c.disassociate(outputs)
            elif typ == "aws:s3/bucketObjectv2:BucketObjectv2":
                object_store.object_path(outputs["bucket"], outputs["key"]).unlink(missing_ok=True)
            elif typ == COMMAND and outputs.get("delete"):
                from localswarm import ssh
                done = ssh.run(outputs["connection"], outputs["delete"])
                c._record(urn.rsplit("::", 1)[1], COMMAND, "delete", done.seconds, outputs["connection"]["host"])
            with c.lock:
                # A replacement is made before its original goes, under the same URN: only the original goes.
                if (c.current.get(urn) or {}).get("id") in (rid, None):
                    c.current.pop(urn, None)

    def instance_state(self, rid: str) -> str | None:
        """running or stopped as the machine is now; None when it is gone (terminated, or never this rehearsal's).
        A machine gone behind the program's back leaves the world too: the refresh drops its instance from
        the state, so nothing would ever delete its record (as AWS forgets a terminated instance)."""
        from localswarm import machines
        c = self.cloud
        with c.lock:
            record = c.machines_by_instance.get(rid)
        if not record:
            return None
        m = machines.Machine(record["machine"], record["index"])
        if machines.running(m):
            return "running"
        if m.dir.exists():
            return "stopped"
        with self._saved(), c.lock:
            c.machines_by_instance.pop(rid, None)
        return None
