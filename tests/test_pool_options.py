"""A pool's capacity and placement keys: each bad value fails at preview, naming the key and the fix; zones are kept.

marketType, interruption, capacityReservation, capacityReservationPreference, placement, efa
and availabilityZone (settings/pool_options.py), then against the instance type and the
cluster's zones (settings/pool_placement.py). The reservation itself is checked by a read at
preview (tests/test_capacity.py).
"""
import pytest

from localswarm import fake_aws
from settings import SettingsError, load_settings
from tests.conftest import BLOCK_RESERVATION, RESERVATION, stack_config, use_mocks

T4 = {"name": "t4", "instanceType": "g4dn.xlarge", "count": 1}
P5 = {"name": "training", "instanceType": "p5.48xlarge", "count": 1}
GROUP = "arn:aws:resource-groups:us-east-1:123456789012:group/p5-reservations"

BAD = [
    ("market-unknown", [{**T4, "marketType": "reserved"}],
     ["gpu-swarm:gpuPools[0].marketType: 'reserved' is not a market; use on-demand, spot or capacity-block"]),
    ("spot-and-another-market", [{**T4, "spot": True, "marketType": "on-demand"}],
     ["gpu-swarm:gpuPools[0].spot: says spot, but marketType is on-demand"]),
    ("interruption-without-spot", [{**T4, "interruption": "stop"}],
     ["gpu-swarm:gpuPools[0].interruption: applies to spot nodes only; set marketType spot"]),
    ("interruption-unknown", [{**T4, "marketType": "spot", "interruption": "pause"}],
     ["gpu-swarm:gpuPools[0].interruption: 'pause': use terminate", "or stop (it resumes on the same instance"]),
    ("reservation-malformed", [{**P5, "capacityReservation": "cr-123"}],
     ["gpu-swarm:gpuPools[0].capacityReservation: 'cr-123' is neither a reservation id (cr- and 17 hex digits)"]),
    ("reservation-with-spot", [{**P5, "spot": True, "capacityReservation": RESERVATION}],
     ["gpu-swarm:gpuPools[0].capacityReservation: spot instances cannot run in a capacity reservation"]),
    ("block-without-reservation", [{**P5, "marketType": "capacity-block"}],
     ["gpu-swarm:gpuPools[0].capacityReservation: required with marketType capacity-block"]),
    ("block-with-a-group", [{**P5, "marketType": "capacity-block", "capacityReservation": GROUP}],
     ["gpu-swarm:gpuPools[0].capacityReservation: a capacity-block pool needs the Capacity Block's own"]),
    ("reservation-and-preference", [{**P5, "capacityReservation": RESERVATION, "capacityReservationPreference": "open"}],
     ["gpu-swarm:gpuPools[0].capacityReservationPreference: AWS takes either a reservation or a preference"]),
    ("preference-unknown", [{**T4, "capacityReservationPreference": "sometimes"}],
     ["gpu-swarm:gpuPools[0].capacityReservationPreference: 'sometimes': use open"]),
    ("preference-on-spot", [{**T4, "spot": True, "capacityReservationPreference": "none"}],
     ["gpu-swarm:gpuPools[0].capacityReservationPreference: applies to on-demand nodes only (this pool is spot)"]),
    ("placement-unknown", [{**T4, "placement": "spread"}],
     ["gpu-swarm:gpuPools[0].placement: 'spread': use cluster"]),
    ("efa-not-a-boolean", [{**P5, "efa": "yes"}], ["gpu-swarm:gpuPools[0].efa: expected true or false, found 'yes'"]),
    ("zone-malformed", [{**T4, "availabilityZone": "a"}],
     ["gpu-swarm:gpuPools[0].availabilityZone: 'a' is not an availability zone name"]),
    ("efa-on-a-type-without", [{**T4, "efa": True}],
     ["gpu-swarm:gpuPools[0].efa: g4dn.xlarge has no EFA; choose a type that has it (p4d.24xlarge, p5.48xlarge"]),
    ("zone-outside-the-cluster", [{**P5, "availabilityZone": "us-east-1b"}],
     ["gpu-swarm:gpuPools[0].availabilityZone: us-east-1b is not one of this cluster's zones (us-east-1a, "
      "us-east-1c); add it to gpu-swarm:availabilityZones, or choose one of us-east-1a, us-east-1c"]),
    ("zone-without-the-type", [T4, {**P5, "name": "p5", "availabilityZone": "us-east-1b"}],
     ["gpu-swarm:gpuPools[1].availabilityZone: us-east-1b does not offer p5.48xlarge; this cluster's zones that do: "
      "us-east-1a, us-east-1c"]),
    ("group-of-another-region", [{**P5, "capacityReservation": GROUP.replace("us-east-1", "eu-west-1")}],
     ["gpu-swarm:gpuPools[0].capacityReservation: the resource group is in eu-west-1, this stack deploys to us-east-1"]),
]


@pytest.mark.parametrize("pools,fragments", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_pool_options_name_the_key_and_the_fix(pools, fragments):
    # The second bad zone case needs the cluster to have us-east-1b: pin every zone.
    zones = ["us-east-1a", "us-east-1b", "us-east-1c"] if len(pools) > 1 else None
    use_mocks(stack_config("dev", gpuPools=pools, **({"availabilityZones": zones} if zones else {})))
    with pytest.raises(SettingsError) as err:
        load_settings()
    for fragment in fragments:
        assert fragment in str(err.value), f"{fragment!r} not in:\n{err.value}"


def test_the_prod_pools_read_their_capacity_placement_and_efa():
    use_mocks(stack_config("prod"), stack="prod")
    training, inference = load_settings().gpu_pools
    o = training.options
    assert (o.market_type, o.capacity_reservation, o.reservation_id, o.placement, o.efa) == (
        "on-demand", RESERVATION, RESERVATION, "cluster", True)
    assert training.efa_interfaces == 32  # one per network card of p5.48xlarge
    # A reserved pool may go to any of the cluster's zones that offer its type: the reservation picks one.
    assert training.zones == ("us-east-1a", "us-east-1c") and training.offered_in == ("us-east-1a", "us-east-1c")
    assert (inference.spot, inference.options.interruption, inference.efa_interfaces) == (True, "stop", 0)


def test_spot_true_and_market_type_spot_are_one_setting():
    use_mocks(stack_config("dev", gpuPools=[{**T4, "spot": True}]))
    old = load_settings().gpu_pools[0]
    use_mocks(stack_config("dev", gpuPools=[{**T4, "marketType": "spot"}]))
    new = load_settings().gpu_pools[0]
    assert old.spot and new.spot and old.options == new.options


def test_a_pool_held_to_one_zone_gets_the_first_that_offers_its_type_or_its_own():
    use_mocks(stack_config("dev", gpuPools=[{**P5, "placement": "cluster"}]))
    assert load_settings().gpu_pools[0].zones == ("us-east-1a",)
    use_mocks(stack_config("dev", gpuPools=[{**P5, "efa": True, "availabilityZone": "us-east-1c"}]))
    pool = load_settings().gpu_pools[0]
    assert pool.zones == ("us-east-1c",) and pool.efa_interfaces == 32


def test_a_capacity_block_and_a_resource_group_are_accepted():
    use_mocks(stack_config("dev", gpuPools=[{**P5, "marketType": "capacity-block", "capacityReservation": BLOCK_RESERVATION},
                                            {**P5, "name": "grouped", "capacityReservation": GROUP}]))
    block, grouped = load_settings().gpu_pools
    assert block.options.market_type == "capacity-block" and block.options.reservation_id == BLOCK_RESERVATION
    assert grouped.options.reservation_id is None and grouped.zones == ("us-east-1a", "us-east-1c")


# ---------------------------------------------------------------- zones are chosen once and kept


def test_a_new_cluster_takes_the_zones_that_offer_every_type_and_then_keeps_them():
    use_mocks(stack_config("dev"))  # t3.medium and g4dn.xlarge: offered everywhere
    assert load_settings().network.availability_zones == fake_aws.ZONES
    # Its subnets exist now; a p5 pool (offered in two zones) narrows itself only.
    fake_aws.ACCOUNT.subnets.update({f"gpu-swarm-network-{z}-id": {"vpcId": "vpc-1", "availabilityZone": z,
                                                                  "tags": {"gpu-swarm:cluster": "gpu-swarm-test"}}
                                     for z in fake_aws.ZONES})
    use_mocks(stack_config("dev", gpuPools=[T4, {**P5, "name": "p5"}]), keep_account=True)
    s = load_settings()
    assert s.network.availability_zones == fake_aws.ZONES
    t4, p5 = s.gpu_pools
    assert t4.zones == fake_aws.ZONES and p5.zones == ("us-east-1a", "us-east-1c")


def test_a_type_offered_in_none_of_the_kept_zones_says_which_zone_to_add():
    fake_aws.reset_account()
    fake_aws.ACCOUNT.subnets.update({f"s-{z}": {"vpcId": "vpc-1", "availabilityZone": z,
                                                "tags": {"gpu-swarm:cluster": "gpu-swarm-test"}}
                                     for z in ("us-east-1a", "us-east-1c")})
    use_mocks(stack_config("dev", gpuPools=[T4, {"name": "a100", "instanceType": "p4d.24xlarge", "count": 1}]),
              keep_account=True)
    with pytest.raises(SettingsError) as err:
        load_settings()
    assert ("gpu-swarm:gpuPools[1].instanceType: p4d.24xlarge is offered in us-east-1b, and none of this cluster's "
            "zones (us-east-1a, us-east-1c); add one of them to gpu-swarm:availabilityZones") in str(err.value)


def test_a_zone_dropped_from_the_list_keeps_its_subnet_but_takes_no_new_node():
    fake_aws.reset_account()
    fake_aws.ACCOUNT.subnets.update({f"s-{z}": {"vpcId": "vpc-1", "availabilityZone": z,
                                                "tags": {"gpu-swarm:cluster": "gpu-swarm-test"}}
                                     for z in ("us-east-1a", "us-east-1c")})
    use_mocks(stack_config("dev", availabilityZones=["us-east-1c", "us-east-1d"]), keep_account=True)
    s = load_settings()
    assert s.network.availability_zones == ("us-east-1a", "us-east-1c", "us-east-1d")  # us-east-1a stays
    assert s.network.active_zones == ("us-east-1c", "us-east-1d")
    assert s.gpu_pools[0].zones == ("us-east-1c", "us-east-1d") and s.managers.zones == ("us-east-1c", "us-east-1d")
