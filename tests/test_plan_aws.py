"""What AWS itself does to a running cluster, under mocks whose account answers as EC2 does (localswarm/fake_aws.py).

Each test runs the program as `pulumi up` would, lets the fake account do what AWS does
between two ups (a stop and start, a replacement, a destroy), and checks what the next up
or the destroy does: EC2 refuses an Elastic IP by instance id for an instance with several
network interfaces; a stopped worker's refresh reads no public address
(terraform-provider-aws#33775); terminating an instance leaves its persistent spot request
open (terraform-provider-aws#38142), while the provider's delete cancels it first; a persistent request
that names no end is cancelled after 7 days.
"""
from __future__ import annotations

import pytest

import json
import re
from datetime import timedelta

from components import node_pool, provider_facts
from localswarm import fake_account, fake_aws
from settings import aws_lookups
from tests.conftest import request_inputs, run_program, stack_config, unwrap
from tests.test_plan import INFERENCE, INSTANCE, PROD, SPOT_REQUEST, TRAINING, plan, with_
from tests.test_resource_graph import Graph

ASSOCIATION = "aws:ec2/eipAssociation:EipAssociation"


def destroy(run) -> None:
    """`pulumi destroy`: every resource the run made goes, as its provider deletes it."""
    for name, resource_id in reversed(list(run.monitor.ids.items())):
        fake_aws.provider_delete(run.monitor.requests[name].type, resource_id)


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
    result = plan(STOPPING, STOPPING, between=stop_and_start_workers, refresh=True)
    assert result.instances_replaced() == {"gpu-swarm-t4-0": {"associatePublicIpAddress"},
                                           "gpu-swarm-inference-0": {"associatePublicIpAddress"}}


# ---------------------------------------------------------------- persistent spot requests


def test_the_fake_account_ends_and_keeps_persistent_requests_as_ec2_does():
    """The account answers as EC2 documents it, or the tests below prove nothing."""
    account = fake_aws.reset_account()
    stop = {"marketType": "spot", "spotOptions": {"spotInstanceType": "persistent",
                                                  "instanceInterruptionBehavior": "stop"}}
    # A request that names no end ends 7 days on; its running instance runs on, with no request.
    running, _ = fake_aws.launch("a", {"instanceMarketOptions": stop})
    stopped, _ = fake_aws.launch("b", {"instanceMarketOptions": stop, "tags": {"Name": "b"}})
    account.stop("b")
    account.advance(8)
    request = account.spot_requests[account.instances[running]["spotRequest"]]
    assert (request["state"], request["status"]) == ("cancelled", "request-canceled-and-instance-running")
    assert account.instances[running]["state"] == "running"
    assert account.instances[stopped]["state"] == "terminated"  # instance-terminated-by-service
    # Terminating an instance leaves its request open, and EC2 launches another, which nothing tracks.
    orphaned, _ = fake_aws.launch("c", {"instanceMarketOptions": {**stop, "spotOptions": {
        **stop["spotOptions"], "validUntil": "2036-12-01T00:00:00Z"}}})
    fake_account.terminate(orphaned)
    account.advance(1)
    assert [i for i in account.running() if not account.instances[i]["tracked"]]
    # The provider's delete of the instance cancels the request first: nothing comes back.
    fake_aws.reset_account()
    kept, _ = fake_aws.launch("d", {"instanceMarketOptions": stop})
    fake_aws.provider_delete(INSTANCE, kept)
    fake_aws.ACCOUNT.advance(1)
    assert fake_aws.ACCOUNT.running() == [] and fake_aws.ACCOUNT.live_spot_requests() == []


def test_the_fake_account_refuses_and_drops_what_ec2_does():
    fake_aws.reset_account()
    stop = {"marketType": "spot", "spotOptions": {"spotInstanceType": "persistent",
                                                  "instanceInterruptionBehavior": "stop"}}
    with pytest.raises(fake_aws.AwsError, match="placement group"):
        fake_aws.launch("pg", {"instanceMarketOptions": stop, "placementGroup": "pg"})
    with pytest.raises(fake_aws.AwsError, match="validUntil"):
        fake_aws.launch("one", {"instanceMarketOptions": {"marketType": "spot", "spotOptions": {
            "spotInstanceType": "one-time", "validUntil": "2036-12-01T00:00:00Z"}}})
    with pytest.raises(fake_aws.AwsError, match="TagLimitExceeded"):
        fake_aws.launch("tags", {"tags": {f"k{i}": "v" for i in range(51)}})
    with pytest.raises(fake_aws.AwsError, match="InvalidTag"):
        fake_aws.put_object("b", "k", {f"k{i}": "v" for i in range(11)})
    # The legacy RequestSpotInstances keeps none of the node's metadata options, root volume tags or template.
    template, _ = fake_aws.launch_template("t", {"networkInterfaces": [{}] * 4})
    request, state = fake_aws.request_spot("legacy", {
        "spotType": "persistent", "instanceInterruptionBehavior": "stop", "placementGroup": "pg",
        "metadataOptions": {"httpTokens": "required", "httpPutResponseHopLimit": 1},
        "rootBlockDevice": {"tags": {"team": "ml"}}, "launchTemplate": {"id": template}})
    inst = fake_aws.ACCOUNT.instances[state["spotInstanceId"]]
    assert inst["metadataOptions"]["httpTokens"] == "optional" and inst["rootVolumeTags"] == {}
    assert (inst["launchTemplate"], inst["placementGroup"], inst["interfaces"]) == (None, None, 1)


STOP_EFA = {"name": "train", "instanceType": "p4d.24xlarge", "count": 2, "marketType": "spot", "interruption": "stop",
            "efa": True}
TWELVE_TAGS = {f"team-{k}": f"value-{k}" for k in "abcdefghijkl"}


def test_the_fake_account_reports_each_instances_lifecycle_as_ec2_does():
    """DescribeInstances' InstanceLifecycle (EC2 API reference, InstanceLifecycleType): spot for any spot
    instance, a Capacity Block's for one in a block, none on demand."""
    fake_aws.reset_account()
    spot = lambda options: {"instanceMarketOptions": {"marketType": "spot", "spotOptions": options}}  # noqa: E731
    assert "instanceLifecycle" not in fake_aws.launch("od", {})[1]
    assert fake_aws.launch("one", spot({"spotInstanceType": "one-time"}))[1]["instanceLifecycle"] == "spot"
    assert fake_aws.launch("stop", spot({"spotInstanceType": "persistent", "instanceInterruptionBehavior": "stop"})
                           )[1]["instanceLifecycle"] == "spot"
    assert fake_aws.launch("cb", {"instanceMarketOptions": {"marketType": "capacity-block"}}
                           )[1]["instanceLifecycle"] == "capacity-block"
    assert fake_aws.request_spot("legacy", {"spotType": "one-time"})[1]["instanceLifecycle"] == "spot"


@pytest.mark.parametrize("config", [PROD, stack_config("prod", gpuPools=[INFERENCE, STOP_EFA], tags=TWELVE_TAGS)],
                         ids=["prod", "spot-stop-efa-12-tags"])
def test_every_node_reaches_aws_as_the_program_meant(config):
    """What EC2 holds for each node, not what the program registered: IMDSv2 with a hop limit of 1, the root
    volume's tags, its template's interfaces (and with them its subnet and groups), its request's end."""
    run = run_program(config, stack="prod")
    nodes = [n for n, r in run.monitor.requests.items() if r.type == INSTANCE]
    assert nodes and not [n for n, r in run.monitor.requests.items() if r.type == SPOT_REQUEST]
    for name in nodes:
        registered = run.monitor.requests[name]
        inst = fake_aws.ACCOUNT.instances[run.monitor.ids[name]]
        assert (inst["metadataOptions"]["httpTokens"], inst["metadataOptions"]["httpPutResponseHopLimit"]) == \
            ("required", 1), name
        assert inst["rootVolumeTags"] == inst["tags"] and inst["tags"]["gpu-swarm:pool"], name
        assert json.loads(config["gpu-swarm:tags"]).items() <= inst["tags"].items(), name
        assert inst["subnetId"] != "default-vpc" and inst["securityGroupIds"], name
        if name.startswith("gpu-swarm-train-"):
            assert inst["interfaces"] == 4 and inst["launchTemplate"], name
        request = fake_aws.ACCOUNT.spot_requests.get(inst["spotRequest"] or "")
        if request:
            assert request["validUntil"] > fake_aws.ACCOUNT.now + timedelta(days=365 * 9), name
        assert registered.type == INSTANCE


def test_a_week_later_every_stop_node_is_still_one_instance_and_its_request_still_runs():
    """A request that names no end is cancelled by EC2 after 7 days; with aws.ec2.SpotInstanceRequest the
    provider's read then dropped it from the state, and the next up launched a second instance for every
    `stop` node while the first billed on, untracked."""
    result = plan(PROD, PROD, between=lambda: fake_aws.ACCOUNT.advance(8), refresh=True)
    assert result.changed() == set()
    tracked = {i for i, inst in fake_aws.ACCOUNT.instances.items() if inst["tracked"]}
    assert set(fake_aws.ACCOUNT.running()) <= tracked
    inference = [i for i in fake_aws.ACCOUNT.running()
                 if fake_aws.ACCOUNT.instances[i]["tags"].get("gpu-swarm:pool") == "inference"]
    assert len(inference) == INFERENCE["count"]
    assert all(fake_aws.ACCOUNT.spot_requests[fake_aws.ACCOUNT.instances[i]["spotRequest"]]["state"] == "active"
               for i in inference)


def test_a_cancelled_request_never_leads_to_a_second_instance():
    """An operator cancels a node's request in the console: the instance runs on, and stays the node."""
    def cancel_one():
        inst = next(i for i in fake_aws.ACCOUNT.instances.values() if i["tags"].get("Name") == "gpu-swarm-prod-inference-0")
        fake_account.cancel_spot_request(inst["spotRequest"])

    result = plan(PROD, PROD, between=cancel_one, refresh=True)
    assert result.changed() == set()
    assert len([i for i in fake_aws.ACCOUNT.running()
                if fake_aws.ACCOUNT.instances[i]["tags"].get("gpu-swarm:pool") == "inference"]) == 2


def test_destroy_cancels_every_persistent_spot_request():
    run = run_program(PROD, stack="prod")
    nodes = [n for n in ("gpu-swarm-inference-0", "gpu-swarm-inference-1")]
    requests = {fake_aws.ACCOUNT.instances[run.monitor.ids[n]]["spotRequest"] for n in nodes}
    assert sorted(fake_aws.ACCOUNT.live_spot_requests()) == sorted(requests)
    destroy(run)
    fake_aws.ACCOUNT.advance(1)  # an open request would have launched another instance by now
    assert fake_aws.ACCOUNT.live_spot_requests() == [] and fake_aws.ACCOUNT.running() == []


def test_a_replaced_spot_node_cancels_its_old_request():
    def engine_makes_new_instances():
        for i in (0, 1):
            fake_aws.ACCOUNT.replace(f"gpu-swarm-inference-{i}")

    old = run_program(PROD, stack="prod").monitor.ids
    before = {fake_aws.ACCOUNT.instances[old[f"gpu-swarm-inference-{i}"]]["spotRequest"] for i in (0, 1)}
    result = plan(PROD, with_(gpuPools=[TRAINING, {**INFERENCE, "instanceType": "g4dn.12xlarge"}]),
                  between=engine_makes_new_instances)
    assert set(result.instances_replaced()) == {"gpu-swarm-inference-0", "gpu-swarm-inference-1"}
    fake_aws.ACCOUNT.advance(1)
    live = set(fake_aws.ACCOUNT.live_spot_requests())
    assert len(live) == 2 and not live & before
    assert all(fake_aws.ACCOUNT.spot_requests[r]["state"] == "cancelled" for r in before)
    assert all(fake_aws.ACCOUNT.instances[i]["tracked"] for i in fake_aws.ACCOUNT.running())


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


# ---------------------------------------------------------------- the Deep Learning AMI's "latest" moves


def test_a_node_made_after_the_images_latest_moved_boots_its_pools_image(monkeypatch):
    """AWS publishes a new Deep Learning AMI (a new driver branch) between two ups that add a node: the new
    node launches from the image its pool was made with, as its running neighbours do; replacing the pool's
    image parameter moves the pool's new nodes to the newest."""
    first, newer = fake_aws.DEEP_LEARNING_AMI, fake_aws.CUSTOM_AMI_NEXT  # both described by the fake, x86_64
    pools = lambda n: with_(gpuPools=[TRAINING, {**INFERENCE, "count": n}])  # noqa: E731
    result = plan(pools(2), pools(3), between=lambda: monkeypatch.setitem(
        fake_aws.LATEST, aws_lookups.DEEP_LEARNING_AMI_PARAMETER, newer))
    assert result.instances_replaced() == {} and "gpu-swarm-inference-2" in result.created
    run = run_program(pools(3), stack="prod", keep_account=True)
    amis = {n: run.monitor.requests[n] for n in ("gpu-swarm-inference-0", "gpu-swarm-inference-2")}
    assert {unwrap(request_inputs(r))["ami"] for r in amis.values()} == {first}
    fake_aws.ACCOUNT.replace("gpu-swarm-inference-image")  # pulumi up --replace <its URN>
    run = run_program(pools(3), stack="prod", keep_account=True)
    assert unwrap(request_inputs(run.monitor.requests["gpu-swarm-inference-2"]))["ami"] == newer


def test_a_stopped_worker_is_kept_in_the_swarm_and_the_reconcile_does_not_wait_for_it():
    """An operator's stop, or AWS's of a spot node (interruption: stop): the next up keeps its node, and its
    reconcile says it does not wait for it (swarm/reconcile.py), instead of failing on it after 120 s."""
    def lists(graph: Graph) -> tuple[set[str], set[str]]:
        script = graph.plain("gpu-swarm-reconcile-run")["create"]
        listed = lambda var: set(re.search(rf"{var}=\W* ([\w ]*?) \W", script)[1].split())  # noqa: E731
        return listed("keep_nodes"), listed("not_waited")

    kept, not_waited = lists(Graph(run_program(STOPPING, stack="prod")))
    assert len(kept) == 7 and not_waited == set()
    fake_aws.ACCOUNT.stop("gpu-swarm-prod-t4-0")
    kept_after, not_waited = lists(Graph(run_program(STOPPING, stack="prod", keep_account=True)))
    assert kept_after == kept and len(not_waited) == 1 and not_waited <= kept
