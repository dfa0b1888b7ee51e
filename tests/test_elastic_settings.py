"""An elastic pool's settings (gpuPools[].autoscale): each bad value fails the preview naming the key and the fix,
and the preview holds autoscale.max to the quotas and the reservation as it holds a count."""
from __future__ import annotations

import pytest

from localswarm import fake_aws
from settings import SettingsError, load_settings
from settings.pool_autoscale import Autoscale
from tests.conftest import BLOCK_RESERVATION, RESERVATION, stack_config, use_mocks

ELASTIC = {"name": "t4", "instanceType": "g4dn.xlarge", "autoscale": {"max": 4}}


def with_autoscale(**keys):
    return {**ELASTIC, **keys}


BAD = [
    # (id, the pool entry, fragments of the message)
    ("count-and-autoscale", with_autoscale(count=2),
     ["gpu-swarm:gpuPools[0].count: an elastic pool (autoscale) takes no count", "remove count, or remove autoscale"]),
    ("max-missing", with_autoscale(autoscale={"min": 1}),
     ["gpu-swarm:gpuPools[0].autoscale.max: required: the most nodes the pool may grow to"]),
    ("max-zero", with_autoscale(autoscale={"max": 0}),
     ["gpu-swarm:gpuPools[0].autoscale.max: 0 is out of range; use a number from 1 to 1000"]),
    ("max-not-a-number", with_autoscale(autoscale={"max": "many"}),
     ["gpu-swarm:gpuPools[0].autoscale.max: expected a whole number, found 'many'"]),
    ("min-above-max", with_autoscale(autoscale={"min": 5, "max": 2}),
     ["gpu-swarm:gpuPools[0].autoscale.min: 5 is more than autoscale.max 2; make min at most max"]),
    ("min-negative", with_autoscale(autoscale={"min": -1, "max": 2}),
     ["gpu-swarm:gpuPools[0].autoscale.min: -1 is out of range; use a number from 0 to 1000"]),
    ("idle-zero", with_autoscale(autoscale={"max": 2, "idleMinutes": 0}),
     ["gpu-swarm:gpuPools[0].autoscale.idleMinutes: 0 is out of range; use a number from 1 to 10080"]),
    ("unknown-key", with_autoscale(autoscale={"max": 2, "idleMinute": 5}),
     ["gpu-swarm:gpuPools[0].autoscale.idleMinute: is not an autoscale setting; did you mean idleMinutes?"]),
    ("not-an-object", with_autoscale(autoscale=4),
     ["gpu-swarm:gpuPools[0].autoscale: expected an object such as {max: 4}"]),
    ("capacity-block", with_autoscale(instanceType="p5.48xlarge", marketType="capacity-block",
                                      capacityReservation=BLOCK_RESERVATION),
     ["gpu-swarm:gpuPools[0].autoscale: a Capacity Block holds a fixed number of instances",
      "set count to the block's size"]),
    ("spot-stop", with_autoscale(marketType="spot", interruption="stop"),
     ["gpu-swarm:gpuPools[0].interruption: stop needs a persistent spot request",
      "an Auto Scaling group makes one-time requests only"]),
    ("efa", with_autoscale(instanceType="p5.48xlarge", efa=True),
     ["gpu-swarm:gpuPools[0].efa: elastic EFA pools are not offered", "Remove autoscale and set count"]),
    ("count-missing-names-autoscale", {"name": "t4", "instanceType": "g4dn.xlarge"},
     ["gpu-swarm:gpuPools[0].count: required", "or autoscale: {max: N}"]),
]


@pytest.mark.parametrize("pool,fragments", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_autoscale_settings_name_the_key_and_the_fix(pool, fragments):
    use_mocks(stack_config("dev", gpuPools=[pool]))
    with pytest.raises(SettingsError) as err:
        load_settings()
    message = str(err.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in:\n{message}"


def test_an_elastic_pool_reads_its_bounds_and_defaults_and_has_no_fixed_nodes():
    use_mocks(stack_config("dev", gpuPools=[ELASTIC, {**ELASTIC, "name": "l4", "instanceType": "g6.xlarge",
                                                      "autoscale": {"min": 1, "max": 3, "idleMinutes": 30}}]))
    t4, l4 = load_settings().gpu_pools
    assert (t4.autoscale, t4.count, t4.most_nodes) == (Autoscale(0, 4, 10), 0, 4)
    assert (l4.autoscale, l4.most_nodes) == (Autoscale(1, 3, 30), 3)


def test_a_spot_pool_that_terminates_may_be_elastic():
    use_mocks(stack_config("dev", gpuPools=[with_autoscale(marketType="spot")]))
    assert load_settings().gpu_pools[0].spot


def test_the_quota_check_counts_an_elastic_pool_at_its_max():
    """4 x g4dn.xlarge is 16 vCPUs of on-demand G and VT: a quota of 12 holds 3, not max."""
    use_mocks(stack_config("dev", gpuPools=[ELASTIC]))
    fake_aws.ACCOUNT.quotas["L-DB2E81BA"] = 12
    with pytest.raises(SettingsError) as err:
        load_settings()
    assert "pool t4 (up to 4 x g4dn.xlarge): 16" in str(err.value)
    assert "--quota-code L-DB2E81BA --desired-value 16" in str(err.value)
    use_mocks(stack_config("dev", gpuPools=[ELASTIC]))
    fake_aws.ACCOUNT.quotas["L-DB2E81BA"] = 16
    assert load_settings().gpu_pools[0].most_nodes == 4


def test_an_elastic_pool_of_min_zero_still_has_its_reservation_checked():
    """A fixed pool of count 0 is not asked about (it takes nothing); an elastic one may grow into it."""
    pool = with_autoscale(instanceType="p5.48xlarge", capacityReservation=fake_aws.EXPIRED_RESERVATION)
    use_mocks(stack_config("dev", gpuPools=[pool]))
    with pytest.raises(SettingsError) as err:
        load_settings()
    assert f"t4.capacityReservation: AWS has no active capacity reservation {fake_aws.EXPIRED_RESERVATION}" \
        in str(err.value)
    use_mocks(stack_config("dev", gpuPools=[{**pool, "capacityReservation": RESERVATION}]))
    assert load_settings().gpu_pools[0].options.reservation_id == RESERVATION
