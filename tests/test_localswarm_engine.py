"""The rehearsal's engine (localswarm/local_cloud.py, engine.py) does what Pulumi's engine does, step by step.

A small program (a key pair, an instance in a component, a command on it) runs twice through
LocalCloud, as `program up` runs the real one, with the machines and SSH recorded instead of
started: what matters here is the order and the inputs of each step, not a machine booting.
"""
from __future__ import annotations

import asyncio
import threading
import time

import pulumi
import pulumi_aws as aws
import pulumi_command as command
import pytest
from pulumi.runtime import mocks as pulumi_mocks

from localswarm import engine, fake_aws, local_cloud, machines, program, ssh


class Recorder:
    """machines and ssh, as calls in order."""

    def __init__(self, monkeypatch):
        self.events: list[tuple] = []
        self.fail: set[str] = set()
        self.slow: dict[str, float] = {}
        self.during: dict[str, object] = {}
        monkeypatch.setattr(machines, "launch", self.launch)
        monkeypatch.setattr(machines, "terminate", lambda m, *a, **k: self.events.append(("terminate", m.name)))
        monkeypatch.setattr(machines, "stop", lambda m, *a, **k: self.events.append(("stop", m.name)))
        monkeypatch.setattr(machines, "start", lambda m, *a, **k: self.events.append(("start", m.name)))
        monkeypatch.setattr(machines, "set_gpus", lambda m, gpus: self.events.append(("set_gpus", m.name, len(gpus))))
        monkeypatch.setattr(ssh, "run", self.ssh)

    def launch(self, name, index, *, user_data, meta_data, gpus, hosts=None, image=None):
        self.events.append(("launch", name, user_data, len(gpus)))
        return machines.Machine(name, index)

    def ssh(self, connection, script, *, stdin=None, **_):
        self.events.append(("ssh", script))
        if script in self.during:
            self.during[script]()
        time.sleep(self.slow.get(script, 0))
        if script in self.fail:
            raise ssh.CommandFailed("Process exited with status 1")
        return ssh.Result("ok", "", 1, 0.0)

    def kinds(self) -> list[str]:
        return [e[0] if e[0] != "ssh" else f"ssh {e[1]}" for e in self.events]


def build(instance_type="g4dn.xlarge", user_data="boot-1", *, pool_type="test:aws:Pool", replace_on=("instanceType",),
          delete_before_replace=False, scripts=("setup",), after_slow: str | None = None, update_only: str = ""):
    class Pool(pulumi.ComponentResource):
        def __init__(self, name):
            super().__init__(pool_type, name, None)
            pair = aws.ec2.KeyPair("pair", public_key="ssh-ed25519 AAAA test", opts=pulumi.ResourceOptions(parent=self))
            self.node = aws.ec2.Instance(
                "node", ami="ami-1", instance_type=instance_type, key_name=pair.key_name, user_data=user_data,
                tags={"Name": "node"}, opts=pulumi.ResourceOptions(
                    parent=self, ignore_changes=["userData"], replace_on_changes=list(replace_on),
                    delete_before_replace=delete_before_replace))

    pool = Pool("pool")
    conn = command.remote.ConnectionArgs(host=pool.node.private_ip, private_key="k")
    slow = command.remote.Command("slow", connection=conn, create=after_slow) if after_slow else None
    for script in scripts:
        command.remote.Command(f"run-{script}", connection=conn, create=script,
                               opts=pulumi.ResourceOptions(depends_on=[slow] if slow and script == "late" else []))
    if update_only:  # no `create`: the rollout's cordon and upgrade for a node that booted the release
        command.remote.Command("on-update", connection=conn, update=update_only)


def up(cloud: local_cloud.LocalCloud, **kwargs) -> None:
    # The tests after these run the program under the test mocks in this process, on the loop
    # they find: put back whatever loop there was, not none.
    before = asyncio.get_event_loop_policy().get_event_loop()
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    pulumi.runtime.settings.ROOT.set(None)
    pulumi_mocks.set_mocks(cloud, project="gpu-swarm", stack="dev", preview=False, monitor=program._Monitor(cloud))

    @pulumi.runtime.test
    def run():
        build(**kwargs)
        return pulumi.Output.from_input(1)

    try:
        run()
    finally:
        loop.close()
        asyncio.set_event_loop(before)
    cloud.delete_the_rest()


def cloud_after(previous: local_cloud.LocalCloud | None = None, **fields) -> local_cloud.LocalCloud:
    return local_cloud.LocalCloud(
        previous=previous.current if previous else {}, region="us-east-1", say=lambda _: None, clock=time.monotonic,
        machines_by_instance=dict(previous.machines_by_instance) if previous else {},
        next_index=previous.next_index if previous else 1, **fields)


def test_a_replacement_is_created_first_with_the_programs_current_inputs_and_the_old_one_deleted_last(monkeypatch):
    rec = Recorder(monkeypatch)
    first = cloud_after()
    up(first)
    rec.events.clear()
    second = cloud_after(first)
    up(second, instance_type="g4dn.12xlarge", user_data="boot-2")
    launch = next(e for e in rec.events if e[0] == "launch")
    # ignore_changes kept userData out of the diff; the new instance still boots the program's new one.
    assert launch[2] == "boot-2" and launch[3] == 4
    assert rec.kinds() == ["launch", "ssh setup", "terminate"]  # the old machine goes at the very end
    node = next(r for k, r in second.current.items() if k.endswith("::node"))
    assert node["inputs"]["userData"] == "boot-2"


def test_a_command_with_no_create_runs_nothing_until_an_update_runs_its_update(monkeypatch):
    """pulumi-command's Create returns at once when `create` is unset, dialling nothing; an update runs
    `update`, and a run with nothing to run keeps the stdout the last one printed."""
    rec = Recorder(monkeypatch)
    first = cloud_after()
    up(first, update_only="release-1")
    assert "ssh release-1" not in rec.kinds() and rec.kinds() == ["launch", "ssh setup"]
    (made,) = [a for a in first.actions if a.name == "on-update"]
    assert made.action == "create" and made.host == ""  # made, and no command ran: program.py counts none
    rec.events.clear()
    second = cloud_after(first)
    up(second, update_only="release-2")
    assert rec.kinds() == ["ssh release-2"]
    (urn,) = [u for u in second.current if u.endswith("::on-update")]
    assert second.current[urn]["outputs"]["stdout"] == "ok"
    rec.events.clear()
    third = cloud_after(second)
    up(third, update_only="release-2")
    assert rec.kinds() == []


def test_delete_before_replace_terminates_the_old_machine_first(monkeypatch):
    rec = Recorder(monkeypatch)
    first = cloud_after()
    up(first, delete_before_replace=True)
    rec.events.clear()
    up(cloud_after(first), instance_type="g4dn.12xlarge", delete_before_replace=True)
    assert rec.kinds() == ["terminate", "launch", "ssh setup"]


def test_an_in_place_type_change_stops_the_machine_gives_it_the_new_types_gpus_and_starts_it(monkeypatch):
    rec = Recorder(monkeypatch)
    first = cloud_after()
    up(first, replace_on=())
    rec.events.clear()
    up(cloud_after(first), instance_type="g4dn.12xlarge", replace_on=())
    assert rec.events == [("stop", "lsw-1"), ("set_gpus", "lsw-1", 4), ("start", "lsw-1")]


def test_pulumi_up_replace_replaces_an_unchanged_resource_by_name_or_urn(monkeypatch):
    rec = Recorder(monkeypatch)
    first = cloud_after()
    up(first)
    urn = next(k for k in first.current if k.endswith("::node"))
    assert urn == "urn:pulumi:dev::gpu-swarm::test:aws:Pool$aws:ec2/instance:Instance::node"
    for target in ("node", urn):
        rec.events.clear()
        again = cloud_after(first, replace_targets=frozenset({target}))
        up(again)
        assert rec.kinds() == ["launch", "ssh setup", "terminate"], target


def test_identity_is_the_urn_a_new_parent_type_makes_a_new_resource(monkeypatch):
    rec = Recorder(monkeypatch)
    first = cloud_after()
    up(first)
    rec.events.clear()
    second = cloud_after(first)
    up(second, pool_type="test:aws:NodePool")  # a refactor without an alias
    assert rec.kinds() == ["launch", "ssh setup", "terminate"]
    assert not set(first.current) & {k for k in second.current if "Instance" in k}


def test_after_a_failure_no_new_step_starts_and_the_state_keeps_what_finished(monkeypatch):
    rec = Recorder(monkeypatch)
    rec.fail.add("setup")
    rec.slow["wait"] = 0.5
    # The two steps are independent, so the SDK may start "wait" after "setup" has failed, when no
    # new step may start: "setup" fails only once "wait" is in flight.
    def once_wait_runs():
        deadline = time.monotonic() + 5
        while ("ssh", "wait") not in rec.events and time.monotonic() < deadline:
            time.sleep(0.01)

    rec.during["setup"] = once_wait_runs
    cloud = cloud_after()
    with pytest.raises(Exception, match="run-setup"):
        up(cloud, scripts=("setup", "late"), after_slow="wait")
    time.sleep(0.2)  # the SDK may still register what it had queued
    ran = [e[1] for e in rec.events if e[0] == "ssh"]
    assert "setup" in ran and "wait" in ran  # a step in flight finishes
    assert "late" not in ran  # registered after the failure: never started
    names = {engine.name_of(k) for k in cloud.current}
    assert {"node", "slow"} <= names and "run-setup" not in names and "run-late" not in names


def test_a_step_in_flight_is_a_pending_operation_in_the_saved_state(monkeypatch):
    rec = Recorder(monkeypatch)
    cloud = cloud_after()
    seen = {}
    rec.during["setup"] = lambda: seen.update(program._state_of(cloud, {}, "dev", 0, failed=True))
    up(cloud)
    pending = seen["pending_operations"]
    assert [(engine.name_of(k), op["operation"]) for k, op in pending.items()] == [("run-setup", "creating")]
    assert any(k.endswith("::node") for k in seen["resources"])  # what finished is saved with it
    assert program._state_of(cloud, {}, "dev", 0, failed=False)["pending_operations"] == {}


def test_refresh_drops_a_terminated_instance_and_reads_a_stopped_one_as_stopped(monkeypatch, tmp_path):
    Recorder(monkeypatch)
    cloud = cloud_after()
    up(cloud)
    node = next(k for k in cloud.current if k.endswith("::node"))
    monkeypatch.setattr(machines, "MACHINES", tmp_path)
    known = dict(cloud.machines_by_instance)
    refreshed, notes = engine.refresh(cloud.current, lambda r: program._instance_state(r, known))
    assert node not in refreshed and notes == ["refresh: node is gone (terminated behind the program's back)"]
    assert known == {}  # nothing of the machine is left to reach
    (tmp_path / "lsw-1").mkdir()  # the machine is there, but not running: stopped
    refreshed, notes = engine.refresh(cloud.current, lambda r: program._instance_state(
        r, dict(cloud.machines_by_instance)))
    assert refreshed[node]["outputs"]["instanceState"] == "stopped" and notes == ["refresh: node is stopped"]
    # Terminated, the program creates it again: a new machine, and the command runs on it again.
    rec = Recorder(monkeypatch)
    after = cloud_after(cloud)
    after.previous, _ = engine.refresh(cloud.current, lambda r: None)
    up(after)
    assert rec.kinds() == ["launch", "ssh setup"]


def test_the_project_refreshes_at_every_up():
    assert engine.project_refreshes(program.REPO)


def test_a_failed_update_keeps_the_replaced_resource_to_delete_on_the_next_success(monkeypatch):
    rec = Recorder(monkeypatch)
    first = cloud_after()
    up(first)
    rec.fail.add("setup")
    rec.events.clear()
    failed = cloud_after(first, replace_targets=frozenset({"node"}))
    with pytest.raises(Exception, match="run-setup"):
        up(failed)
    state = program._state_of(failed, {}, "dev", 0, failed=True)
    old_node = next(r["id"] for k, r in first.current.items() if k.endswith("::node"))
    assert [r["id"] for r in state["doomed"]] == [old_node]
    assert ("terminate", "lsw-1") not in rec.events  # a failed update deletes nothing
    rec.fail.clear()
    again = local_cloud.LocalCloud(previous=state["resources"], region="us-east-1", say=lambda _: None,
                                   clock=time.monotonic, machines_by_instance=state["machines"],
                                   next_index=state["next_index"], doomed=state["doomed"])
    up(again)
    assert rec.events[-1] == ("terminate", "lsw-1")  # the next successful update deletes it, last


def test_pending_operations_are_named_in_the_next_ups_warning():
    urn = "urn:pulumi:dev::gpu-swarm::gpu-swarm:aws:NodePool$aws:ec2/instance:Instance::gpu-swarm-t4-0"
    text = engine.pending_warning({urn: {"type": engine.INSTANCE, "operation": "creating"}})
    assert "1 operation(s) pending: gpu-swarm-t4-0 (creating)" in text and "check those resources in AWS" in text


def test_subnet_lookups_answer_from_the_subnets_the_last_run_made(monkeypatch):
    """AWS lists the subnets that exist: a zone dropped from availabilityZones keeps its subnet, which
    the program finds through get_subnets. With no answer the rehearsal deleted it under running nodes."""
    monkeypatch.setattr(fake_aws, "ACCOUNT", fake_aws.Account())
    tags = {"gpu-swarm:cluster": "gpu-swarm-dev", "Name": "gpu-swarm-network-us-east-1a"}
    made = {"type": local_cloud.EC2_SUBNET, "id": "subnet-made-in-1a", "outputs": {},
            "inputs": {"vpcId": "vpc-made", "availabilityZone": "us-east-1a", "tags": tags}}
    cloud = cloud_after()
    cloud.previous = {engine.urn("dev", "gpu-swarm", "", local_cloud.EC2_SUBNET, tags["Name"]): made}
    found = cloud.call(pulumi_mocks.MockCallArgs("aws:ec2/getSubnets:getSubnets",
                                                 {"tags": {"gpu-swarm:cluster": "gpu-swarm-dev"}}, ""))
    assert found["ids"] == ["subnet-made-in-1a"]
    subnet = cloud.call(pulumi_mocks.MockCallArgs("aws:ec2/getSubnet:getSubnet", {"id": "subnet-made-in-1a"}, ""))
    assert subnet["availabilityZone"] == "us-east-1a" and subnet["vpcId"] == "vpc-made"


def test_destroy_runs_only_the_delete_scripts_commands_have_then_terminates_every_machine(monkeypatch, tmp_path):
    """`pulumi destroy`: a command is deleted by its `delete` script when it has one (the program's have
    none, so nothing reaches a node); instances go, and so does one a failed update had replaced."""
    recorder = Recorder(monkeypatch)
    monkeypatch.setattr(program, "STATE_FILE", tmp_path / "program.json")
    monkeypatch.setattr(program, "STATE_ROOT", tmp_path)

    def urn(typ, name):
        return engine.urn("dev", "gpu-swarm", "", typ, name)

    node = {"type": engine.INSTANCE, "id": "i-new", "inputs": {}, "outputs": {}}
    program._save_state({"stack": "dev", "resources": {
        urn(engine.INSTANCE, "node"): node,
        urn(local_cloud.COMMAND, "join"): {"type": local_cloud.COMMAND, "id": "c1", "outputs": {},
                                           "inputs": {"create": "join", "connection": {"host": "10.0.0.1"}}},
        urn(local_cloud.COMMAND, "leave"): {"type": local_cloud.COMMAND, "id": "c2", "outputs": {},
                                            "inputs": {"create": "x", "delete": "leave", "connection": {"host": "h"}}},
    }, "doomed": [{**node, "id": "i-old"}], "machines": {
        "i-new": {"machine": "lsw-2", "index": 2, "hostname": "node", "role": "worker"},
        "i-old": {"machine": "lsw-1", "index": 1, "hostname": "node", "role": "worker"}}})
    result = program.destroy(progress=lambda _: None)
    assert recorder.events == [("ssh", "leave"), ("terminate", "lsw-2"), ("terminate", "lsw-1")]
    assert result["commands_run"] == ["leave"] and result["machines_left"] == []
    assert program.load_state()["resources"] == {} and program.load_state()["machines"] == {}
