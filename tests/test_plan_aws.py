"""What AWS itself does to a running cluster, under mocks whose account answers as EC2 does (localswarm/fake_aws.py).

Each test runs the program as `pulumi up` would, lets the fake account do what AWS does
between two ups (a stop and start, a replacement, a destroy), and checks what the next up
or the destroy does: EC2 refuses an Elastic IP by instance id for an instance with several
network interfaces; a stopped worker's refresh reads no public address
(terraform-provider-aws#33775); terminating an instance leaves its persistent spot request
open (terraform-provider-aws#38142), while deleting the request cancels it.
"""
from __future__ import annotations

import pytest

from components import node_pool, provider_facts
from localswarm import fake_aws
from tests.conftest import run_program, stack_config
from tests.test_plan import INFERENCE, PROD, SPOT_REQUEST, TRAINING, plan, with_
from tests.test_resource_graph import Graph

ASSOCIATION = "aws:ec2/eipAssociation:EipAssociation"


def destroy(run) -> None:
    """`pulumi destroy`: every resource the run made goes, as its provider deletes it."""
    for name, resource_id in reversed(list(run.monitor.ids.items())):
        fake_aws.delete(run.monitor.requests[name].type, resource_id)


# ---------------------------------------------------------------- Elastic IPs on multi-card nodes


def test_ec2_refuses_an_address_by_instance_id_for_an_instance_with_several_interfaces():
    """The mock answers as EC2 does, or the next test would prove nothing."""
    fake_aws.reset_account()
    template, _ = fake_aws.launch_template("t", {"networkInterfaces": [{}] * 32})
    efa, _ = fake_aws.launch("efa", {"launchTemplate": {"id": template}})
    plain, plain_state = fake_aws.launch("plain", {"associatePublicIpAddress": True})
    allocation, _ = fake_aws.allocate_address("ip", {})
    with pytest.raises(Exception, match="multiple interfaces attached to instance"):
        fake_aws.associate_address({"allocationId": allocation, "instanceId": efa})
    assert fake_aws.associate_address({"allocationId": allocation, "instanceId": plain})  # one interface: accepted
    assert fake_aws.ACCOUNT.instances[plain]["publicIp"] == fake_aws.ACCOUNT.addresses[allocation]


def test_every_elastic_ip_goes_to_the_primary_interface_and_the_efa_node_gets_its_address():
    graph = Graph(run_program(PROD, stack="prod"))
    associations = graph.of_type(ASSOCIATION)
    assert len(associations) == 4  # three managers and the 32-card training node
    for name in associations:
        inputs = graph.plain(name)
        assert "instanceId" not in inputs and inputs["networkInterfaceId"].startswith("eni-"), name
    training = graph.run.monitor.ids["gpu-swarm-training-0"]
    assert fake_aws.ACCOUNT.instances[training]["interfaces"] == 32
    address = fake_aws.ACCOUNT.instances[training]["publicIp"]
    assert address and address == fake_aws.ACCOUNT.instances[training]["elasticIp"]
    inventory = {n["name"]: n for n in graph.run.exports["inventory"]}
    assert inventory["gpu-swarm-prod-training-0"]["publicIp"] == address


# ---------------------------------------------------------------- a stopped and started worker

STOPPING = with_(gpuPools=[TRAINING, INFERENCE, {"name": "t4", "instanceType": "g4dn.xlarge", "count": 1}])


def stop_and_start_workers():
    for name in ("gpu-swarm-prod-t4-0", "gpu-swarm-prod-inference-0"):
        fake_aws.ACCOUNT.stop_and_start(name)


def test_a_stopped_and_started_worker_is_the_same_node_on_the_next_up():
    result = plan(STOPPING, STOPPING, between=stop_and_start_workers, refresh=True)
    assert result.changed() == set()
    # The refresh did read the lost address: the t4 node's instance now has no public IP.
    t4 = next(i for i in fake_aws.ACCOUNT.instances.values() if i["tags"].get("Name") == "gpu-swarm-prod-t4-0")
    assert t4["publicIp"] is None and t4["lostPublicIp"]


def test_without_keeping_the_address_input_the_refresh_would_replace_the_stopped_workers(monkeypatch):
    """Why the input is kept: the same refresh, with running nodes taking associatePublicIpAddress, replaces them."""
    monkeypatch.setattr(node_pool, "INSTANCE_INPUTS_KEPT_BY_RUNNING_NODES", tuple(
        k for k in provider_facts.INSTANCE_INPUTS_KEPT_BY_RUNNING_NODES if k != "associatePublicIpAddress"))
    monkeypatch.setattr(node_pool, "SPOT_REQUEST_INPUTS_KEPT_BY_RUNNING_NODES", tuple(
        k for k in provider_facts.SPOT_REQUEST_INPUTS_KEPT_BY_RUNNING_NODES if k != "associatePublicIpAddress"))
    result = plan(STOPPING, STOPPING, between=stop_and_start_workers, refresh=True)
    assert result.instances_replaced() == {"gpu-swarm-t4-0": {"associatePublicIpAddress"},
                                           "gpu-swarm-inference-0": {"associatePublicIpAddress"}}


# ---------------------------------------------------------------- persistent spot requests


def test_terminating_an_instance_leaves_its_persistent_request_open_in_the_fake_account():
    """The mock answers as EC2 does (a persistent request outlives its instance), or the tests below prove nothing."""
    fake_aws.reset_account()
    instance, _ = fake_aws.launch("n", {"instanceMarketOptions": {"marketType": "spot", "spotOptions": {
        "spotInstanceType": "persistent", "instanceInterruptionBehavior": "stop"}}})
    fake_aws.delete("aws:ec2/instance:Instance", instance)
    assert len(fake_aws.ACCOUNT.live_spot_requests()) == 1


def test_destroy_cancels_every_persistent_spot_request():
    run = run_program(PROD, stack="prod")
    requests = [n for n, r in run.monitor.requests.items() if r.type == SPOT_REQUEST]
    assert requests == ["gpu-swarm-inference-0", "gpu-swarm-inference-1"]
    assert sorted(fake_aws.ACCOUNT.live_spot_requests()) == sorted(run.monitor.ids[n] for n in requests)
    destroy(run)
    assert fake_aws.ACCOUNT.live_spot_requests() == []
    for name in requests:
        request = fake_aws.ACCOUNT.spot_requests[run.monitor.ids[name]]
        assert request["state"] == "cancelled" and fake_aws.ACCOUNT.instances[request["instance"]]["state"] == \
            "terminated", name


def test_a_replaced_spot_node_cancels_its_old_request():
    def engine_makes_new_requests():
        for i in (0, 1):
            fake_aws.ACCOUNT.replace(f"gpu-swarm-inference-{i}")

    old = run_program(PROD, stack="prod").monitor.ids
    before = {old["gpu-swarm-inference-0"], old["gpu-swarm-inference-1"]}
    result = plan(PROD, with_(gpuPools=[TRAINING, {**INFERENCE, "rootVolumeGiB": 300}]),
                  between=engine_makes_new_requests)
    assert set(result.instances_replaced()) == {"gpu-swarm-inference-0", "gpu-swarm-inference-1"}
    live = set(fake_aws.ACCOUNT.live_spot_requests())
    assert len(live) == 2 and not live & before
    assert all(fake_aws.ACCOUNT.spot_requests[r]["state"] == "cancelled" for r in before)


# ---------------------------------------------------------------- the jump host


def test_replacing_a_manager_keeps_the_jump_host_and_touches_no_worker_command():
    def replace_first_manager():
        fake_aws.ACCOUNT.replace("gpu-swarm-managers-0")  # pulumi up --replace: a new instance id

    result = plan(PROD, PROD, between=replace_first_manager)
    graph = Graph(run_program(PROD, stack="prod", keep_account=True))
    workers = {n for n, cmd in graph.commands("").items() if "proxy" in cmd["connection"]}
    assert workers and not workers & result.changed()
    # What the replacement itself changes: manager-0's own commands and the other managers' swarm
    # probes (they trigger on its instance), and its address's association (a new primary interface).
    assert result.replaced["gpu-swarm-managers-0-ip-association"] == {"networkInterfaceId"}
    assert all("-managers-0-" in n or "-swarm-probe-" in n for n in result.replaced), result.replaced
    assert not result.updated


def test_the_monitoring_tunnel_goes_through_the_live_manager():
    config = with_(monitoring=True)
    first = run_program(config, stack="prod")
    ips = first.exports["managerPublicIps"]
    assert first.exports["monitoring"]["tunnel"].endswith(f"@{ips[0]}")
    fake_aws.ACCOUNT.stop("gpu-swarm-prod-manager-0")
    second = run_program(config, stack="prod", keep_account=True)
    assert second.exports["monitoring"]["tunnel"].endswith(f"@{ips[1]}")


# ---------------------------------------------------------------- timeouts


def test_launch_timeouts_fit_the_instance_family():
    graph = Graph(run_program(PROD, stack="prod"))
    timeouts = {n: graph.requests[n].customTimeouts for n in graph.instances()}
    assert timeouts["gpu-swarm-training-0"].create == "45m"  # p5: many cards, NVSwitch
    assert timeouts["gpu-swarm-training-0"].update == "45m"  # a resize stops and starts it
    assert timeouts["gpu-swarm-inference-0"].create == "20m"
    assert timeouts["gpu-swarm-managers-0"].create == ""  # the provider's own 10 minutes
    assert node_pool.launch_timeouts("p4d.24xlarge").create == "45m"
    assert node_pool.launch_timeouts("p6-b200.48xlarge").create == "45m"
    assert node_pool.launch_timeouts("m7i.large") is None


def test_stack_config_has_the_prod_pools_the_tests_assume():
    pools = {p["name"]: p for p in __import__("json").loads(stack_config("prod")["gpu-swarm:gpuPools"])}
    assert pools["inference"]["interruption"] == "stop" and pools["training"]["efa"] is True
