"""Two-config diffs for zones, capacity and placement: what a second `pulumi up` would do to a running cluster.

Each test runs the program twice under mocks (tests/test_plan.py's plan), AWS keeping what the
first run made, and compares the registrations as the engine diffs a program against its state.
"""
from tests.conftest import RESERVATION, stack_config
from tests.test_plan import PROD, plan

T4 = {"name": "t4", "instanceType": "g4dn.xlarge", "count": 2}
P5 = {"name": "p5", "instanceType": "p5.48xlarge", "count": 1}
ZONES = ("us-east-1a", "us-east-1b", "us-east-1c", "us-east-1d", "us-east-1f")


def test_a_pool_whose_type_is_offered_in_fewer_zones_deletes_and_recreates_no_subnet():
    """The zones were chosen once (every zone offers g4dn.xlarge); p5.48xlarge is offered in two of them.
    Choosing the zones again would drop three subnets with running nodes: DependencyViolation on AWS."""
    a, b = stack_config("dev", gpuPools=[T4]), stack_config("dev", gpuPools=[T4, P5])
    result = plan(a, b, stack="dev")
    network = {n for n in result.changed() if n.startswith("gpu-swarm-network-")}
    assert network == set(), network
    assert result.instances_replaced() == {} and not result.updated.keys() & result.instances
    assert {"gpu-swarm-p5-0", "gpu-swarm-member-p5-0-join"} <= result.created
    assert set(result.updated) == {"gpu-swarm-reconcile-run"}


def test_the_new_pool_goes_to_the_kept_zones_that_offer_its_type():
    from tests.conftest import run_program
    from tests.test_resource_graph import Graph
    run_program(stack_config("dev", gpuPools=[T4]), stack="dev")
    graph = Graph(run_program(stack_config("dev", gpuPools=[T4, P5]), stack="dev", keep_account=True))
    zones = {s["availabilityZone"] for s in map(graph.plain, graph.of_type("aws:ec2/subnet:Subnet"))}
    assert zones == set(ZONES)
    assert graph.plain("gpu-swarm-p5-0")["subnetId"] in {"gpu-swarm-network-us-east-1a-id",
                                                        "gpu-swarm-network-us-east-1c-id"}


def test_placement_market_and_reservation_reach_new_nodes_only():
    """A running node keeps how it was launched; a new or replaced one takes the pool's new settings."""
    inference = {"name": "inference", "instanceType": "g6e.12xlarge", "count": 2, "marketType": "spot",
                 "interruption": "stop", "sharing": {"slotsPerGpu": 4}}
    pools = [{"name": "training", "instanceType": "p5.48xlarge", "count": 1, "rootVolumeGiB": 500,
              "capacityReservation": RESERVATION, "placement": "cluster", "efa": True}]
    one_time = {**inference, "interruption": "terminate"}
    changed = stack_config("prod", gpuPools=[*pools, {**one_time, "marketType": "on-demand", "interruption": None,
                                                      "placement": "cluster"}])
    result = plan(stack_config("prod", gpuPools=[*pools, one_time]), changed)
    assert result.instances_replaced() == {} and not result.updated.keys() & result.instances
    assert result.created == {"gpu-swarm-inference-placement"}  # the group, for new nodes
    assert not result.deleted
    # Nor is their software rolled: no market is in the release (the watcher asks IMDS whether it is spot).
    assert not {k for k in result.updated if k.startswith("gpu-swarm-rollout-")}, result.updated
    # Moving a pool between `interruption: stop` and `terminate` is another market for new nodes only: a
    # running node keeps the request it was launched with (instanceMarketOptions is kept).
    result = plan(PROD, stack_config("prod", gpuPools=[*pools, one_time]))
    assert result.changed() == set()


def test_managers_that_are_stopped_and_started_keep_their_address_and_nothing_runs_again(monkeypatch):
    """A stop and start gives an instance a new public address; the managers' Elastic IPs do not move, and
    the workers are reached at their private address, which a stop keeps."""
    from tests import conftest
    real = conftest.AwsMocks.new_resource

    def restarted(self, args):
        rid, state = real(self, args)
        if args.typ == "aws:ec2/instance:Instance" and state.get("publicIp"):
            state = {**state, "publicIp": "52.0.0." + state["publicIp"].rsplit(".", 1)[1]}
        return rid, state

    result = plan(PROD, PROD, between=lambda: monkeypatch.setattr(conftest.AwsMocks, "new_resource", restarted))
    assert result.changed() == set()


def test_a_spot_node_reclaimed_with_terminate_is_replaced_by_the_next_up_and_no_other_node_is_touched(monkeypatch):
    """`pulumi up --refresh` finds the instance gone and makes a new one (a new instance id): that node's
    commands run again (their triggers name the instance), the reconcile drops its old swarm entry, and
    every other node is left alone."""
    from tests import conftest
    real = conftest.AwsMocks.new_resource

    def reclaimed(self, args):
        rid, state = real(self, args)
        return ("i-0replacement00000001" if args.name == "gpu-swarm-inference-1" else rid), state

    one_time = stack_config("prod", gpuPools=[
        {"name": "training", "instanceType": "p5.48xlarge", "count": 1, "rootVolumeGiB": 500,
         "capacityReservation": RESERVATION, "placement": "cluster", "efa": True},
        {"name": "inference", "instanceType": "g6e.12xlarge", "count": 2, "marketType": "spot",
         "sharing": {"slotsPerGpu": 4}}])
    result = plan(one_time, one_time,
                  between=lambda: monkeypatch.setattr(conftest.AwsMocks, "new_resource", reclaimed))
    touched = {n for n in result.changed() if n not in ("gpu-swarm-reconcile-run",)}
    assert touched and all("inference-1" in n for n in touched), touched
    assert {f"gpu-swarm-boot-inference-1-{s}" for s in ("wait", "access", "health")} <= set(result.replaced)
    assert "gpu-swarm-member-inference-1-join" in result.replaced
    assert result.instances_replaced() == {}  # the engine creates it anew after the refresh; the program is the same


def test_a_spot_node_stopped_by_a_reclaim_changes_nothing_for_the_next_up():
    """interruption: stop keeps the instance, its disk and its private address: AWS starts it again when it
    has capacity, and it rejoins as the same swarm node; the program has nothing to do for it but say, in
    its reconcile, that it keeps the node and does not wait for it (swarm/reconcile.py)."""
    from localswarm import fake_aws
    result = plan(PROD, PROD, between=lambda: fake_aws.ACCOUNT.stop("gpu-swarm-prod-inference-1"))
    assert result.changed() == {"gpu-swarm-reconcile-run"} and result.updated["gpu-swarm-reconcile-run"] == {"create"}
