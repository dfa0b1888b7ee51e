"""Capacity, placement and EFA in the resource graph, under mocks that answer as AWS would.

The prod stack's training pool: p5.48xlarge in an On-Demand Capacity Reservation, a cluster
placement group and 32 EFA interfaces. What mocks prove is the graph and the inputs; that AWS
launches such an instance was not checked here (no AWS is reachable).
"""
import re
from datetime import datetime, timedelta, timezone

import pytest

from components import capacity
from components.capacity import ReservationMismatch, capacity_advice
from settings import GpuPool
from settings.pool_options import PoolOptions
from localswarm import fake_aws
from tests.conftest import BLOCK_RESERVATION, RESERVATION, run_program, stack_config
from tests.test_resource_graph import Graph

P5 = {"name": "training", "instanceType": "p5.48xlarge", "count": 2}
LAUNCH_TEMPLATE = "aws:ec2/launchTemplate:LaunchTemplate"


@pytest.fixture(scope="module")
def prod():
    return Graph(run_program(stack_config("prod"), stack="prod"))


def test_the_reserved_pool_runs_in_its_reservation_and_the_reservations_zone(prod):
    (read,) = [r for r in prod.run.monitor.reads.values() if r.type == "aws:ec2/capacityReservation:CapacityReservation"]
    assert read.name == "gpu-swarm-training-reservation"
    node = prod.plain("gpu-swarm-training-0")
    assert node["capacityReservationSpecification"] == {
        "capacityReservationTarget": {"capacityReservationId": RESERVATION}}
    (template,) = prod.of_type(LAUNCH_TEMPLATE)
    # The reservation (fake_aws) is in us-east-1a: the EFA interfaces are made in that zone's subnet.
    assert {i["subnetId"] for i in prod.plain(template)["networkInterfaces"]} == {"gpu-swarm-network-us-east-1a-id"}
    assert prod.depends_on(template, read.name)  # through the checked zone: nothing launches before the check


def test_an_efa_node_gets_one_efa_interface_per_network_card_from_its_template(prod):
    (template,) = prod.of_type(LAUNCH_TEMPLATE)
    interfaces = prod.plain(template)["networkInterfaces"]
    assert len(interfaces) == 32
    assert [(i["networkCardIndex"], i["deviceIndex"], i["interfaceType"]) for i in interfaces[:3]] == [
        (0, 0, "efa"), (1, 1, "efa"), (2, 1, "efa")]
    assert all(i["deleteOnTermination"] == "true" for i in interfaces)
    assert set(interfaces[0]["securityGroups"]) == {"gpu-swarm-sg-cluster-id", "gpu-swarm-sg-workers-id",
                                                    "gpu-swarm-sg-efa-id"}
    node = prod.plain("gpu-swarm-training-0")
    assert node["launchTemplate"]["id"].startswith("lt-") and node["launchTemplate"]["version"] == "1"
    assert prod.depends_on("gpu-swarm-training-0", template)
    # The interfaces come from the template only: RunInstances takes them from one place.
    assert not {"subnetId", "vpcSecurityGroupIds", "associatePublicIpAddress"} & set(node)
    # No automatic public address with more than one interface: an Elastic IP gives it egress.
    assert "gpu-swarm-training-0-ip" in prod.of_type("aws:ec2/eip:Eip")


def test_the_pool_has_its_cluster_placement_group(prod):
    (group,) = prod.of_type("aws:ec2/placementGroup:PlacementGroup")
    assert prod.plain(group)["strategy"] == "cluster"
    assert prod.plain("gpu-swarm-training-0")["placementGroup"] == f"{group}-pg"  # the group's name (the mock's)
    assert prod.depends_on("gpu-swarm-training-0", group)
    assert not prod.plain("gpu-swarm-inference-0").get("placementGroup")


def test_efa_nodes_admit_all_traffic_from_each_other_and_no_one_else(prod):
    rules = {n: prod.plain(n) for n in prod.of_type("aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule")}
    (efa,) = [r for r in rules.values() if r["securityGroupId"] == "gpu-swarm-sg-efa-id"]
    assert (efa["ipProtocol"], efa["referencedSecurityGroupId"]) == ("-1", "gpu-swarm-sg-efa-id")
    assert "cidrIpv4" not in efa and "fromPort" not in efa
    (out,) = [prod.plain(n) for n in prod.of_type("aws:vpc/securityGroupEgressRule:SecurityGroupEgressRule")
              if prod.plain(n)["securityGroupId"] == "gpu-swarm-sg-efa-id"]
    assert (out["ipProtocol"], out["referencedSecurityGroupId"]) == ("-1", "gpu-swarm-sg-efa-id")
    # The other pools keep the narrow swarm ports: only EFA nodes are in the EFA group.
    assert "gpu-swarm-sg-efa-id" not in prod.plain("gpu-swarm-inference-0")["vpcSecurityGroupIds"]


def test_efa_nodes_install_efa_and_say_how_many_interfaces_they_have(prod):
    upgrade = prod.plain("gpu-swarm-rollout-training-0-upgrade")["update"]
    assert "GPU_SWARM_EFA_INTERFACES=32" in upgrade and " install-efa " in upgrade
    assert "install-efa" not in prod.plain("gpu-swarm-rollout-inference-0-upgrade")["update"]


def test_a_stop_spot_pool_launches_instances_whose_requests_are_persistent_and_end_years_ahead(prod):
    """RunInstances makes the request, with the node's own metadata options, root volume tags and placement;
    it ends SPOT_REQUEST_YEARS ahead, not the 7 days EC2 gives a request that names no end."""
    for name in ("gpu-swarm-inference-0", "gpu-swarm-inference-1"):
        node = prod.plain(name)
        assert prod.requests[name].type == "aws:ec2/instance:Instance"
        spot = node["instanceMarketOptions"]["spotOptions"]
        assert (node["instanceMarketOptions"]["marketType"], spot["spotInstanceType"],
                spot["instanceInterruptionBehavior"]) == ("spot", "persistent", "stop"), name
        until = datetime.fromisoformat(spot["validUntil"].replace("Z", "+00:00"))
        assert until - datetime.now(timezone.utc) > timedelta(days=365 * (capacity.SPOT_REQUEST_YEARS - 1)), name
        assert re.fullmatch(r"\d{4}-\d\d-01T00:00:00Z", spot["validUntil"]), name  # EC2 takes no fraction
        assert node["metadataOptions"] == {"httpEndpoint": "enabled", "httpTokens": "required",
                                           "httpPutResponseHopLimit": 1}, name
        assert node["rootBlockDevice"]["tags"]["gpu-swarm:pool"] == "inference", name
    assert "instanceMarketOptions" not in prod.plain("gpu-swarm-training-0")
    assert not prod.of_type("aws:ec2/tag:Tag")


def test_a_one_time_spot_request_names_no_end_date():
    """RunInstances refuses validUntil for a one-time request (InvalidParameterCombination)."""
    graph = Graph(run_program(stack_config("dev", gpuPools=[
        {"name": "t4", "instanceType": "g4dn.xlarge", "count": 1, "marketType": "spot"}])))
    spot = graph.plain("gpu-swarm-t4-0")["instanceMarketOptions"]["spotOptions"]
    assert spot["spotInstanceType"] == "one-time" and "validUntil" not in spot


def test_the_request_end_is_the_same_all_month_and_moves_with_it():
    assert capacity.spot_request_end(datetime(2026, 12, 1, tzinfo=timezone.utc)) == "2036-12-01T00:00:00Z"
    assert capacity.spot_request_end(datetime(2026, 12, 31, 23, 59, tzinfo=timezone.utc)) == "2036-12-01T00:00:00Z"
    assert capacity.spot_request_end(datetime(2027, 2, 28, tzinfo=timezone.utc)) == "2037-02-01T00:00:00Z"


def test_a_capacity_block_pool_runs_in_its_block():
    graph = Graph(run_program(stack_config("dev", gpuPools=[{
        **P5, "marketType": "capacity-block", "capacityReservation": BLOCK_RESERVATION}])))
    for name in ("gpu-swarm-training-0", "gpu-swarm-training-1"):
        node = graph.plain(name)
        assert node["instanceMarketOptions"] == {"marketType": "capacity-block"}
        assert node["capacityReservationSpecification"]["capacityReservationTarget"] == {
            "capacityReservationId": BLOCK_RESERVATION}
        assert node["subnetId"] == "gpu-swarm-network-us-east-1c-id"  # the block's zone
    # Its nodes' health settings carry the block's end, which their watchers drain ahead of.
    for name in ("gpu-swarm-boot-training-0-health", "gpu-swarm-boot-training-1-health"):
        assert "HEALTH_CAPACITY_BLOCK_END=2026-12-04T11:30:00Z\n" in graph.plain(name)["create"], name
    assert "HEALTH_CAPACITY_BLOCK_END" not in graph.plain("gpu-swarm-boot-managers-0-health")["create"]


def test_an_extended_block_restarts_its_nodes_watchers_and_drains_nothing(monkeypatch):
    """AWS extends a Capacity Block in place: the same reservation id, a later end."""
    from tests.test_plan import plan
    config = stack_config("prod", stacks=[], gpuPools=[{**P5, "marketType": "capacity-block",
                                                        "capacityReservation": BLOCK_RESERVATION}])
    monkeypatch.setitem(fake_aws.RESERVATIONS[BLOCK_RESERVATION], "endDate", "2026-12-04T11:30:00Z")

    def extend():
        fake_aws.RESERVATIONS[BLOCK_RESERVATION]["endDate"] = "2026-12-11T11:30:00Z"

    result = plan(config, config, between=extend)
    assert set(result.updated) == {"gpu-swarm-boot-training-0-health", "gpu-swarm-boot-training-1-health"}
    assert not result.replaced and not result.created and not result.deleted


def test_a_preference_or_a_group_is_handed_over_as_it_is():
    group = "arn:aws:resource-groups:us-east-1:123456789012:group/p5"
    graph = Graph(run_program(stack_config("dev", gpuPools=[
        {"name": "t4", "instanceType": "g4dn.xlarge", "count": 1, "capacityReservationPreference": "none"},
        {**P5, "capacityReservation": group}])))
    assert graph.plain("gpu-swarm-t4-0")["capacityReservationSpecification"] == {
        "capacityReservationPreference": "none"}
    assert graph.plain("gpu-swarm-training-0")["capacityReservationSpecification"] == {
        "capacityReservationTarget": {"capacityReservationResourceGroupArn": group}}


@pytest.mark.parametrize("pool,fragments", [
    ({**P5, "capacityReservation": "cr-0d0000000000000d1"},
     ["gpuPools training.capacityReservation: cr-0d0000000000000d1 reserves g6e.12xlarge, but the pool's "
      "instanceType is p5.48xlarge"]),
    ({"name": "l40s", "instanceType": "g6e.12xlarge", "count": 1, "capacityReservation": "cr-0d0000000000000d1"},
     ["cr-0d0000000000000d1 is in us-east-1d, but the pool's nodes can go only to us-east-1a, us-east-1c",
      "add us-east-1d to gpu-swarm:availabilityZones"]),
    ({**P5, "capacityReservation": RESERVATION, "availabilityZone": "us-east-1c"},
     ["is in us-east-1a, but the pool's availabilityZone is us-east-1c"]),
], ids=["another-type", "a-zone-outside-the-cluster", "another-zone-than-asked"])
def test_a_reservation_that_cannot_hold_the_pool_fails_the_preview_naming_both(pool, fragments):
    zones = {"availabilityZones": ["us-east-1a", "us-east-1c"]}
    with pytest.raises(ReservationMismatch) as err:
        run_program(stack_config("dev", gpuPools=[pool], **zones))
    for fragment in fragments:
        assert fragment in str(err.value), f"{fragment!r} not in {err.value}"


def test_no_instance_of_a_mismatched_pool_is_registered(monkeypatch):
    from tests import conftest
    monitors = []
    real = conftest.use_mocks
    monkeypatch.setattr(conftest, "use_mocks", lambda *a, **k: monitors.append(real(*a, **k)) or monitors[-1])
    with pytest.raises(ReservationMismatch):
        conftest.run_program(stack_config("dev", gpuPools=[{**P5, "capacityReservation": "cr-0d0000000000000d1"}]))
    (monitor,) = monitors
    assert not [n for n, r in monitor.requests.items() if r.type == "aws:ec2/instance:Instance" and "training" in n]


# ---------------------------------------------------------------- what to try when AWS has no capacity

POOL = GpuPool("training", "p5.48xlarge", 2, False, None, 500, 8, "H100", options=PoolOptions(placement="cluster"),
               zones=("us-east-1a",), offered_in=("us-east-1a", "us-east-1c"))


def test_a_capacity_error_says_what_to_try_naming_the_zones_that_offer_the_type():
    advice = capacity_advice(POOL, ["creating EC2 Instance: operation error EC2: RunInstances, api error "
                                    "InsufficientInstanceCapacity: We currently do not have sufficient p5.48xlarge "
                                    "capacity in the Availability Zone you requested (us-east-1a)."])
    assert advice.startswith("pool training: AWS has no p5.48xlarge capacity for it now (in us-east-1a; the type is "
                             "offered in us-east-1a, us-east-1c)")
    assert "p5.48xlarge is also offered in us-east-1c" in advice
    assert "Capacity Reservation or an EC2 Capacity Block" in advice and "--continue-on-error" in advice


def test_a_spot_pool_without_capacity_is_told_about_on_demand():
    spot = GpuPool("infer", "g6e.12xlarge", 2, True, None, 200, 4, "L40S", options=PoolOptions(market_type="spot"),
                   zones=("us-east-1a", "us-east-1c"), offered_in=("us-east-1a", "us-east-1c"))
    advice = capacity_advice(spot, ["api error InsufficientInstanceCapacity: There is no Spot capacity available"])
    assert "marketType on-demand" in advice and "one zone of us-east-1a, us-east-1c" in advice


def test_other_errors_get_no_capacity_advice():
    assert capacity_advice(POOL, ["api error UnauthorizedOperation: You are not authorized"]) is None


def test_every_gpu_instance_calls_the_capacity_hook_on_an_error(prod):
    for name in ("gpu-swarm-training-0", "gpu-swarm-inference-1"):
        assert list(prod.requests[name].hooks.on_error) == [f"gpu-swarm-capacity-{name.split('-')[2]}"], name
    assert not list(prod.requests["gpu-swarm-managers-0"].hooks.on_error)


def test_without_error_hooks_in_the_cli_there_is_no_hook_and_no_failure(monkeypatch):
    from pulumi.runtime import settings as runtime_settings
    monkeypatch.setattr(runtime_settings, "monitor_supports_feature", lambda feature: False)
    assert capacity.capacity_error_hook(POOL) is None


def test_a_pool_that_gets_no_capacity_holds_up_only_its_own_nodes_and_the_swarm_wide_steps(prod):
    """With `pulumi up --continue-on-error`, the engine goes on with every step that does not wait for the
    failed one: no resource of one GPU pool waits for another pool's instances, so the other pools join and
    are admitted; the reconcile, the stacks and the health read (which need every node) wait for the next up."""
    from tests.test_resource_graph import ancestors
    pools = ("training", "inference")
    for pool in pools:
        others = [p for p in pools if p != pool]
        for name in prod.requests:
            if f"-{pool}-" in name and not name.startswith("gpu-swarm-stack-"):  # a stack may share a pool's name
                waits_for = ancestors(prod, name)
                assert not [a for a in waits_for if any(f"-{o}-" in a for o in others)], name
    swarm_wide = ("gpu-swarm-reconcile-run", "gpu-swarm-stack-gpu-smoke-deploy", "gpu-swarm-health-read")
    for name in swarm_wide:
        assert {"gpu-swarm-training-0", "gpu-swarm-inference-1"} <= ancestors(prod, name), name


def test_a_node_joins_drained_so_a_run_cut_short_leaves_none_taking_tasks_unchecked(prod):
    for name, cmd in prod.commands("-join").items():
        assert '"Availability": "drain"' in cmd["create"], name
