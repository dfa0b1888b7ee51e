"""What each routine change does to a running cluster: the program under mocks with config A, then B.

Each test runs the program twice and compares the registered inputs resource by resource,
as the engine diffs the new program against the last state. components/provider_facts.py
says which input changes replace a resource; the node pools' ignore_changes say which a
running node keeps. The promise under test: routine changes replace no instance, and each
touches only the resources it must.
"""
from __future__ import annotations

import gzip
import platform
import shutil
from dataclasses import dataclass, field

import pulumi
import pytest

from to_node import software as node_software
from components import provider_facts, swarm_health
from localswarm import fake_aws
from tests.conftest import CUSTOM_AMI, CUSTOM_AMI_NEXT, request_inputs, run_program, stack_config, unwrap

INSTANCE = "aws:ec2/instance:Instance"
# What a persistent spot node was before it was an aws.ec2.Instance (tests/test_plan_aws.py checks none is left).
SPOT_REQUEST = "aws:ec2/spotInstanceRequest:SpotInstanceRequest"
REPLACE_FACTS = (INSTANCE, "command:remote:Command")


@dataclass
class Plan:
    created: set[str] = field(default_factory=set)
    deleted: set[str] = field(default_factory=set)
    updated: dict[str, set[str]] = field(default_factory=dict)  # name -> changed inputs
    replaced: dict[str, set[str]] = field(default_factory=dict)  # name -> the inputs that force it
    instances: set[str] = field(default_factory=set)

    def changed(self) -> set[str]:
        return self.created | self.deleted | set(self.updated) | set(self.replaced)

    def instances_replaced(self) -> dict[str, set[str]]:
        return {n: why for n, why in self.replaced.items() if n in self.instances}


def _registered(run) -> dict:
    """URN -> (type, inputs, request, name): the engine knows a resource by its URN, not its name."""
    return {run.monitor.urns[name]: (req.type, unwrap(request_inputs(req)), req, name)
            for name, req in run.monitor.requests.items() if not req.type.startswith(("pulumi:", "gpu-swarm:"))}


HEALTH_READ = "gpu-swarm-health-read"  # reads each node's condition at every `pulumi up`


def plan(config_a: dict, config_b: dict, *, between=None, secret_keys=(), stack: str = "prod",
         monkeypatch=None, refresh: bool = False) -> Plan:
    """Run the program with config A, then (after `between()`, if given) with config B; diff them.

    The two runs are two `pulumi up`s, a minute apart: the health read that runs at each
    up is checked to be an update of its script alone, and left out of the result.
    refresh: the second up starts from what AWS reports after `between` (pulumi up --refresh),
    not from what the first up registered. What the plan deletes or replaces is then deleted
    in the fake account, as the engine's last steps do (fake_aws.delete)."""
    stamps = iter(["2026-11-23T01:00:00+00:00", "2026-11-23T01:01:00+00:00"])
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(swarm_health, "read_stamp", lambda: next(stamps))
        first = run_program(config_a, secret_keys, stack=stack)
        a = _registered(first)
        if between:
            between()
        if refresh:  # what the provider's Read finds gone leaves the state: the next up creates it again
            read = {urn: (typ, fake_aws.provider_read(typ, first.monitor.ids[name], old), req, name)
                    for urn, (typ, old, req, name) in a.items()}
            a = {urn: entry for urn, entry in read.items() if entry[1] is not None}
        # AWS still holds what the first up made: its subnets, its instances (tests/conftest.py).
        second = run_program(config_b, secret_keys, stack=stack, keep_account=True)
        b = _registered(second)
    result = Plan(created={b[u][3] for u in set(b) - set(a)}, deleted={a[u][3] for u in set(a) - set(b)},
                  instances={name for typ, _, _, name in b.values() if typ in (INSTANCE, SPOT_REQUEST)})
    for urn in set(a) & set(b):
        typ, old, _, name = a[urn]
        _, new, request, _ = b[urn]  # the same URN: the same type (another type is another resource)
        new = provider_facts.as_diffed(old, new, request.ignoreChanges)  # what a running resource keeps
        if old == new:
            continue
        forcing = provider_facts.replaced_by(typ, old, new) if typ in provider_facts.KNOWN_TYPES else set()
        forcing |= {p for p in request.replaceOnChanges if old.get(p) != new.get(p)}
        if forcing:
            result.replaced[name] = forcing
        else:
            result.updated[name] = {k for k in set(old) | set(new) if old.get(k) != new.get(k)}
    for urn, (typ, _, _, name) in a.items():  # the engine deletes the old ones last
        if urn not in b or name in result.replaced and first.monitor.ids[name] != second.monitor.ids[name]:
            fake_aws.provider_delete(typ, first.monitor.ids[name])
    read = result.updated.pop(HEALTH_READ, None)
    assert read is None or "create" in read and read <= {"create", "connection"}, read  # None: inventoryEachUp off
    return result


PROD = stack_config("prod")
# The prod stack's training pool (Pulumi.prod.yaml), for the tests that change the other pool.
TRAINING = {"name": "training", "instanceType": "p5.48xlarge", "count": 1, "rootVolumeGiB": 500,
            "capacityReservation": "cr-0a5a0000000000001", "placement": "cluster", "efa": True}
# And its inference pool: persistent spot requests (interruption: stop).
INFERENCE = {"name": "inference", "instanceType": "g6e.12xlarge", "count": 2, "marketType": "spot",
             "interruption": "stop", "sharing": {"slotsPerGpu": 4}}


def with_(**overrides) -> dict:
    return stack_config("prod", **overrides)


def test_a_second_pulumi_up_with_nothing_changed_changes_nothing():
    assert plan(PROD, PROD).changed() == set()


def test_each_pulumi_up_reads_the_conditions_and_with_inventory_each_up_off_nothing_at_all():
    each = plan(PROD, PROD)  # plan() checks the read itself
    assert each.changed() == set()
    quiet = with_(health={"inventoryEachUp": False})
    a = run_program(quiet, stack="prod").monitor.requests[HEALTH_READ]
    b = run_program(quiet, stack="prod").monitor.requests[HEALTH_READ]
    assert unwrap(request_inputs(a)) == unwrap(request_inputs(b))
    assert "conditions read at" not in unwrap(request_inputs(a))["create"]


def test_a_health_setting_restarts_the_health_services_and_drains_nothing():
    changed = plan(PROD, with_(health={"ignoreXids": [94], "checkIntervalSeconds": 5}))
    assert changed.created == changed.deleted == set() and not changed.replaced
    assert set(changed.updated) == {n for n in changed.updated if n.endswith("-health")} and changed.updated
    assert all(why == {"create"} for why in changed.updated.values())
    assert not any(n.endswith(("-upgrade", "-cordon", "-admit")) for n in changed.changed())


def test_an_operator_on_another_os_and_python_changes_nothing(monkeypatch):
    """The old user data was gzipped, and zlib's OS byte (3 Linux, 19 macOS, 10 Windows, 255 on
    Python 3.10) replaced every instance when a colleague ran `pulumi up`. Nothing the program
    registers may depend on the operator's machine."""
    real = gzip.compress

    def other_os(pretend):
        monkeypatch.setattr(platform, "system", lambda: pretend)
        monkeypatch.setattr(gzip, "compress", lambda data, *a, **k: real(data, *a, **k)[:9] + b"\x13" + real(data, *a, **k)[10:])

    assert plan(PROD, PROD, between=lambda: other_os("Darwin")).changed() == set()
    assert plan(PROD, PROD, between=lambda: other_os("Windows")).changed() == set()


def test_a_refactor_that_renames_a_component_type_without_an_alias_replaces_everything_under_it(monkeypatch):
    """The engine knows a resource by its URN (its parents' types and its name): the same names
    under a renamed component are new resources, and the old ones are deleted."""
    real = pulumi.ComponentResource.__init__

    def renamed(self, t, name, props=None, opts=None, *args, **kwargs):
        real(self, "gpu-swarm:aws:Pool" if t == "gpu-swarm:aws:NodePool" else t, name, props, opts, *args, **kwargs)

    result = plan(PROD, PROD, between=lambda: monkeypatch.setattr(pulumi.ComponentResource, "__init__", renamed))
    nodes = {f"gpu-swarm-{n}" for n in NODES}
    assert nodes <= result.created and nodes <= result.deleted
    assert not result.updated.keys() & nodes


def test_a_new_manager_type_resizes_the_managers_in_place():
    result = plan(PROD, with_(managerInstanceType="m7i.xlarge"))
    assert result.instances_replaced() == {}
    assert set(result.updated) == {"gpu-swarm-managers-0", "gpu-swarm-managers-1", "gpu-swarm-managers-2"}
    assert all(keys == {"instanceType"} for keys in result.updated.values())
    assert not result.created and not result.deleted


def test_a_new_gpu_type_replaces_an_on_demand_pools_nodes_new_ones_first_never_resizing_them_undrained():
    t4 = {"name": "t4", "instanceType": "g4dn.xlarge", "count": 2}
    result = plan(with_(gpuPools=[TRAINING, INFERENCE, t4]),
                  with_(gpuPools=[TRAINING, INFERENCE, {**t4, "instanceType": "g4dn.12xlarge"}]))
    # An in-place resize would stop every node of the pool at once, before any command of theirs
    # could drain it (the engine reaches the instances first): a replacement instead.
    assert result.instances_replaced() == {"gpu-swarm-t4-0": {"instanceType"}, "gpu-swarm-t4-1": {"instanceType"}}
    assert not any(name in result.instances for name in result.updated)
    # The new nodes join (their joins' triggers name the new instances, which the mocks cannot
    # show: tests/test_localswarm_engine.py and the rehearsal do) and are admitted expecting their
    # new GPU count; the reconcile then drains and removes the old nodes, one after the other.
    for i in (0, 1):
        assert "create" in result.updated[f"gpu-swarm-rollout-t4-{i}-admit"]  # 4 GPUs now, not 1
    assert not any(name.startswith(("gpu-swarm-training", "gpu-swarm-inference", "gpu-swarm-rollout-training"))
                   for name in result.changed())


def test_a_new_gpu_type_replaces_spot_nodes():
    one_time = {**INFERENCE, "interruption": "terminate"}
    result = plan(with_(gpuPools=[TRAINING, one_time]),
                  with_(gpuPools=[TRAINING, {**one_time, "rootVolumeGiB": 300}]))
    assert result.instances_replaced() == {}  # a bigger root volume grows in place
    assert set(result.updated) == {"gpu-swarm-inference-0", "gpu-swarm-inference-1"}
    result = plan(with_(gpuPools=[TRAINING, one_time]),
                  with_(gpuPools=[TRAINING, {**one_time, "instanceType": "g4dn.12xlarge"}]))
    # A one-time spot instance cannot be stopped to be resized: it is replaced, as the README says.
    assert result.instances_replaced() == {"gpu-swarm-inference-0": {"instanceType"},
                                           "gpu-swarm-inference-1": {"instanceType"}}
    # A persistent spot node is an instance too (its request made by RunInstances): its disk grows in place,
    # and a new type replaces it.
    result = plan(PROD, with_(gpuPools=[TRAINING, {**INFERENCE, "rootVolumeGiB": 300}]))
    assert result.instances_replaced() == {}
    assert set(result.updated) == {"gpu-swarm-inference-0", "gpu-swarm-inference-1"}


NODES = ["managers-0", "managers-1", "managers-2", "training-0", "inference-0", "inference-1"]


def test_rotating_the_ssh_key_replaces_no_node():
    old_pub = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOld old@key"
    new_pub = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAINew new@key"
    old_key = "-----BEGIN OPENSSH PRIVATE KEY-----\nb2xk\n-----END OPENSSH PRIVATE KEY-----\n"
    new_key = "-----BEGIN OPENSSH PRIVATE KEY-----\nbmV3\n-----END OPENSSH PRIVATE KEY-----\n"
    secret = ("gpu-swarm:sshPrivateKey",)
    a = with_(sshPublicKey=old_pub, sshPrivateKey=old_key)
    # Step 1: the new key is authorized while the old one is still in use.
    step1 = with_(sshPublicKey=old_pub, sshPrivateKey=old_key, sshAuthorizedKeys=[new_pub])
    result = plan(a, step1, secret_keys=secret)
    assert not result.replaced and not result.created and not result.deleted
    assert set(result.updated) == {f"gpu-swarm-boot-{n}-access" for n in NODES}
    # Step 2: the program switches to the new key; the old one leaves every node.
    step2 = with_(sshPublicKey=new_pub, sshPrivateKey=new_key)
    result = plan(step1, step2, secret_keys=secret)
    assert result.instances_replaced() == {}
    assert set(result.replaced) == {"gpu-swarm-ssh-pair"}  # a new EC2 key pair, for new nodes only
    for name in (f"gpu-swarm-rollout-{n}-{s}" for n in NODES for s in ("upgrade", "cordon", "admit")):
        assert "connection" in result.updated[name], name  # re-run with the new key: all idempotent
    for name in (f"gpu-swarm-boot-{n}-wait" for n in NODES):
        assert result.updated[name] == {"connection"}, name  # it finds the boot done and says so
    access = result.updated["gpu-swarm-boot-training-0-access"]
    assert access == {"create", "connection"}


def test_a_new_zone_list_moves_no_running_node():
    pools = [{"name": "t4", "instanceType": "g4dn.xlarge", "count": 4}]
    a = stack_config("dev", gpuPools=pools, availabilityZones=["us-east-1a", "us-east-1c"])
    for zones in (["us-east-1a", "us-east-1c", "us-east-1b"], ["us-east-1c", "us-east-1d"]):
        result = plan(a, stack_config("dev", gpuPools=pools, availabilityZones=zones), stack="dev")
        assert result.instances_replaced() == {}
        assert not result.updated.keys() & result.instances  # running nodes keep their subnet
    assert "gpu-swarm-network-us-east-1b" in plan(a, stack_config("dev", gpuPools=pools, availabilityZones=[
        "us-east-1a", "us-east-1c", "us-east-1b"]), stack="dev").created


def test_turning_efa_on_or_off_replaces_the_pools_running_nodes():
    """EFA interfaces exist only from launch. Kept whole, launchTemplate left a running node as it was
    launched while the roll installed EFA on it, which fails on a node without EFA interfaces."""
    plain = [{"name": "a100", "instanceType": "p4d.24xlarge", "count": 1}]
    efa = [{**plain[0], "efa": True}]
    for before, after in ((plain, efa), (efa, plain)):
        result = plan(stack_config("dev", gpuPools=before, stacks=[]), stack_config("dev", gpuPools=after, stacks=[]),
                      stack="dev")
        assert set(result.instances_replaced()) == {"gpu-swarm-a100-0"}
        assert "launchTemplate" in result.instances_replaced()["gpu-swarm-a100-0"]


def test_changed_node_software_rolls_through_the_nodes_and_replaces_none(tmp_path, monkeypatch):
    """An edit under node/ (or a versions.env bump): a new bundle, then per node drain, upgrade in
    place and admit again. Running instances keep their user data: nothing stops or replaces them."""
    copy = tmp_path / "node"
    shutil.copytree(node_software.SOURCE_DIR, copy, ignore=shutil.ignore_patterns("__pycache__"))

    def edit_node_software():
        (copy / "versions.env").write_text((copy / "versions.env").read_text() + "# a new version\n")
        monkeypatch.setattr(node_software, "SOURCE_DIR", copy)

    result = plan(PROD, PROD, between=edit_node_software)
    assert result.instances_replaced() == {} and not result.updated.keys() & result.instances
    (old_object,) = {n for n in result.deleted if n.startswith("gpu-swarm-nodes-")}
    (new_object,) = {n for n in result.created if n.startswith("gpu-swarm-nodes-")}
    assert result.created == {new_object} and result.deleted == {old_object}  # the new bundle, then the old goes
    assert set(result.updated) == {f"gpu-swarm-rollout-{n}-{step}" for n in NODES
                                   for step in ("cordon", "upgrade", "admit")}
    assert not result.replaced


def test_a_new_gpu_kind_rolls_the_nodes_without_replacing_them():
    result = plan(with_(stacks=[]), with_(stacks=[], gpuKind="GPU"))
    assert result.instances_replaced() == {} and not result.replaced
    # Every node's settings change (node.env), so each is drained, upgraded and admitted again.
    for step in ("cordon", "upgrade", "admit"):
        assert {f"gpu-swarm-rollout-{n}-{step}" for n in NODES} <= set(result.updated)


@pytest.mark.parametrize("turned", ["on", "off"])
def test_mps_turned_on_or_off_for_a_running_pool_rolls_that_pools_nodes_in_place(turned):
    mps = with_(gpuPools=[TRAINING, {**INFERENCE, "sharing": {"slotsPerGpu": 4, "mode": "mps"}}])
    result = plan(PROD, mps) if turned == "on" else plan(mps, PROD)
    assert result.instances_replaced() == {} and not result.replaced and not result.created
    # The pool's node.env names the mode (install-mps reads it): its nodes are drained, upgraded
    # (install-mps adds or removes gpu-swarm-mps.service) and admitted again; no other node is.
    rolled = {n for n in NODES if f"gpu-swarm-rollout-{n}-upgrade" in result.updated}
    assert rolled == {"inference-0", "inference-1"}


def test_a_new_custom_ami_reaches_new_nodes_only():
    a = with_(image="custom", amiId=CUSTOM_AMI)
    result = plan(a, with_(image="custom", amiId=CUSTOM_AMI_NEXT))
    assert result.changed() == set()  # running nodes keep theirs; a new or replaced node boots the new one


def test_scaling_a_pool_up_adds_its_nodes_and_touches_nothing_else_but_the_reconcile():
    result = plan(PROD, with_(gpuPools=[
        TRAINING,
        {**INFERENCE, "count": 3},
    ]))
    assert not result.replaced and not result.deleted
    assert "gpu-swarm-inference-2" in result.created and "gpu-swarm-member-inference-2-join" in result.created
    assert set(result.updated) == {"gpu-swarm-reconcile-run"}


def test_scaling_a_pool_down_drains_the_node_in_the_reconcile_before_the_instance_goes():
    result = plan(PROD, with_(gpuPools=[
        TRAINING,
        {**INFERENCE, "count": 1},
    ]))
    assert not result.replaced and not result.created
    assert {"gpu-swarm-inference-1", "gpu-swarm-member-inference-1-join"} <= result.deleted
    # Deletes run last in `pulumi up`; the reconcile, an update, drains and removes the node first.
    assert set(result.updated) == {"gpu-swarm-reconcile-run"}


def test_adding_a_pool_adds_its_nodes_only():
    result = plan(PROD, with_(gpuPools=[
        TRAINING,
        INFERENCE,
        {"name": "t4", "instanceType": "g4dn.xlarge", "count": 1},
    ]))
    assert not result.replaced and not result.deleted
    assert "gpu-swarm-t4-0" in result.created
    assert set(result.updated) == {"gpu-swarm-reconcile-run"}


def test_adding_and_removing_a_stack_touches_the_stack_and_the_reconcile_only():
    two = [{"name": "gpu-smoke", "file": "stacks/gpu-smoke.yml"}, {"name": "inference", "file": "stacks/inference-shared.yml"},
           {"name": "second", "file": "stacks/gpu-smoke.yml"}]
    result = plan(PROD, with_(stacks=two))
    assert result.created == {"gpu-swarm-stack-second-deploy"}
    assert set(result.updated) == {"gpu-swarm-reconcile-run"} and not result.replaced
    result = plan(with_(stacks=two), PROD)
    assert result.deleted == {"gpu-swarm-stack-second-deploy"}
    assert set(result.updated) == {"gpu-swarm-reconcile-run"} and not result.replaced


def test_a_changed_compose_file_updates_its_deploy_in_place(tmp_path, monkeypatch):
    from settings import reader
    stacks = tmp_path / "stacks"
    shutil.copytree(reader.PROJECT_DIR / "stacks", stacks)
    original = (stacks / "gpu-smoke.yml").read_text()
    monkeypatch.setattr(reader, "PROJECT_DIR", tmp_path)
    result = plan(PROD, PROD, between=lambda: (stacks / "gpu-smoke.yml").write_text(original.replace(
        "replicas: 2", "replicas: 3")))
    assert set(result.updated) == {"gpu-swarm-stack-gpu-smoke-deploy"} and not result.replaced
    assert result.updated["gpu-swarm-stack-gpu-smoke-deploy"] == {"create", "stdin"}


def test_the_facts_know_what_replaces_an_instance():
    old = {"ami": "ami-1", "instanceType": "m7i.large", "keyName": "a", "userData": "x",
           "rootBlockDevice": {"encrypted": True, "volumeSize": 40}}
    assert provider_facts.replaced_by(INSTANCE, old, {**old, "instanceType": "m7i.xlarge"}) == set()
    assert provider_facts.replaced_by(INSTANCE, old, {**old, "ami": "ami-2"}) == {"ami"}
    assert provider_facts.replaced_by(INSTANCE, old, {**old, "rootBlockDevice": {"encrypted": True,
                                                                                  "volumeSize": 80}}) == set()
    assert provider_facts.replaced_by(INSTANCE, old, {**old, "userData": "y"}) == set()
    assert provider_facts.replaced_by(INSTANCE, old, {**old, "userData": "y", "userDataReplaceOnChange": True}) \
        == {"userData"}
    assert provider_facts.replaced_by("command:remote:Command", {"create": "a"}, {"create": "b"}) == set()
    assert provider_facts.replaced_by("command:remote:Command", {"triggers": [1]}, {"triggers": [2]}) == {"triggers"}
    with pytest.raises(ValueError):
        provider_facts.replaced_by("aws:s3/bucket:Bucket", {}, {})


def test_a_new_swarm_gets_every_stack_and_the_monitoring_stack_deployed_again(monkeypatch):
    """The only manager replaced: its swarm init makes a new swarm (a new cluster ID). The deploys' inputs
    must change with it, or nothing would be deployed into the new swarm (issue 28, point 7)."""
    from tests import conftest
    config = with_(monitoring="true")
    result = plan(config, config, between=lambda: monkeypatch.setattr(conftest, "FAKE_CLUSTER_ID",
                                                                       "newswarm00000000000000002"))
    deploys = {name for name in result.updated if name.endswith("-deploy")}
    assert deploys == {"gpu-swarm-stack-gpu-smoke-deploy", "gpu-swarm-stack-inference-deploy",
                       "gpu-swarm-monitoring-deploy"}
    assert all(result.updated[name] == {"create"} for name in deploys)  # an update re-runs the deploy
