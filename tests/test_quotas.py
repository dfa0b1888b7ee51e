"""Service quotas and reservation states at preview, under mocks whose account answers as AWS does (fake_aws).

A quota of 0 (as new accounts have for G/VT and P) fails load_settings, before any resource,
naming the quota code, the need, the quota and the way to ask for more; credentials that may
not read quotas get a warning. A Capacity Block bought for later is named with its start, and
a reservation that has expired is named, where the provider's read would only say it is gone.
"""
from __future__ import annotations

import pulumi
import pytest

from components import capacity
from localswarm import fake_aws
from settings import SettingsError, load_settings, quota_checks
from tests.conftest import run_program, stack_config, use_mocks

T4 = {"name": "t4", "instanceType": "g4dn.xlarge", "count": 2}
P5 = {"name": "training", "instanceType": "p5.48xlarge", "count": 1}
SPOT_G = {"name": "cheap", "instanceType": "g6e.12xlarge", "count": 2, "marketType": "spot"}
EFA = {"name": "training", "instanceType": "p5.48xlarge", "count": 2, "efa": True, "availabilityZone": "us-east-1a"}


def load(config: dict, quotas: dict | None = None, readable: bool = True):
    use_mocks(config)
    fake_aws.ACCOUNT.quotas.update(quotas or {})
    fake_aws.ACCOUNT.quotas_readable = readable
    return load_settings()


def problems(config: dict, quotas: dict | None = None) -> str:
    with pytest.raises(SettingsError) as err:
        load(config, quotas)
    return str(err.value)


@pytest.mark.parametrize("pools,code,needed", [
    ([T4], "L-DB2E81BA", 8),  # 2 x g4dn.xlarge, 4 vCPUs each, on-demand G and VT
    ([P5], "L-417A185B", 192),  # on-demand P
    ([SPOT_G], "L-3819A6DF", 96),  # spot G and VT
    ([{**P5, "marketType": "spot"}], "L-C4BD4855", 192),  # spot P5 has its own quota
    ([{**P5, "instanceType": "p4d.24xlarge", "marketType": "spot"}], "L-7212CCBC", 96),
], ids=["on-demand-g", "on-demand-p", "spot-g", "spot-p5", "spot-p4d"])
def test_a_quota_of_zero_fails_the_preview_naming_the_code_the_need_and_the_fix(pools, code, needed):
    text = problems(stack_config("dev", gpuPools=pools), {code: 0})
    assert f"gpu-swarm:gpuPools: the cluster needs {needed} vCPUs of the EC2 quota {code}" in text
    assert "this account's quota in us-east-1 is 0" in text
    assert (f"aws service-quotas request-service-quota-increase --service-code ec2 --quota-code {code} "
            f"--desired-value {needed} --region us-east-1") in text
    assert f"'{quota_checks.vcpu_quota(pools[0]['instanceType'], 'marketType' in pools[0]).name}'" in text


def test_the_need_adds_up_every_pool_of_one_quota_and_the_managers_count_in_theirs():
    pools = [T4, {"name": "l4", "instanceType": "g6.xlarge", "count": 3}]
    text = problems(stack_config("dev", gpuPools=pools), {"L-DB2E81BA": 19})
    assert "needs 20 vCPUs of the EC2 quota L-DB2E81BA" in text  # 2 x 4 + 3 x 4
    assert "pool t4 (2 x g4dn.xlarge): 8, pool l4 (3 x g6.xlarge): 12" in text
    assert load(stack_config("dev", gpuPools=pools), {"L-DB2E81BA": 20})  # exactly enough
    text = problems(stack_config("dev", gpuPools=pools), {"L-1216C47A": 1})
    assert "gpu-swarm:managerCount: the cluster needs" in text and "L-1216C47A" in text


def test_elastic_ips_for_the_managers_and_the_efa_nodes_are_checked_against_their_quota():
    config = stack_config("dev", gpuPools=[EFA], managerCount=3)
    text = problems(config, {"L-0263D0A3": 4})
    assert "needs 5 Elastic IPs of the EC2 quota L-0263D0A3 ('EC2-VPC Elastic IPs')" in text
    assert "managers: 3, pool training (EFA): 2" in text
    assert load(config, {"L-0263D0A3": 5})


def test_enough_quota_passes_and_other_pools_quotas_are_not_asked_for():
    settings = load(stack_config("dev", gpuPools=[T4]), {"L-417A185B": 0, "L-3819A6DF": 0})
    assert [p.name for p in settings.gpu_pools] == ["t4"]


def test_credentials_that_cannot_read_quotas_get_a_warning_not_a_block(monkeypatch):
    warnings = []
    monkeypatch.setattr(pulumi.log, "warn", lambda message, *a, **k: warnings.append(message))
    settings = load(stack_config("dev", gpuPools=[T4]), {"L-DB2E81BA": 0}, readable=False)
    assert settings.gpu_pools
    (warning,) = [w for w in warnings if "CUDA" not in w]  # the stack's image is on Docker Hub, closed to tests
    assert "servicequotas:GetServiceQuota" in warning and "were not checked" in warning
    assert "VcpuLimitExceeded" in warning


def test_a_short_quota_stops_the_program_before_any_resource():
    fake_aws.reset_account()
    fake_aws.ACCOUNT.quotas["L-DB2E81BA"] = 0
    with pytest.raises(Exception, match="L-DB2E81BA"):
        run_program(stack_config("dev", gpuPools=[T4]), stack="dev", keep_account=True)
    assert not fake_aws.ACCOUNT.instances and not fake_aws.ACCOUNT.subnets


# ---------------------------------------------------------------- reservations and Capacity Blocks

BLOCK = {**P5, "count": 2, "marketType": "capacity-block"}


def test_an_active_reservation_and_an_active_block_pass():
    assert load(stack_config("dev", gpuPools=[{**P5, "capacityReservation": fake_aws.RESERVATION}]))
    assert load(stack_config("dev", gpuPools=[{**BLOCK, "capacityReservation": fake_aws.BLOCK_RESERVATION}]))


def test_a_scheduled_block_is_named_with_its_start():
    text = problems(stack_config("dev", gpuPools=[{**BLOCK, "capacityReservation": fake_aws.SCHEDULED_BLOCK}]))
    assert (f"gpu-swarm:gpuPools: training.capacityReservation: {fake_aws.SCHEDULED_BLOCK} is a Capacity Block "
            f"that starts at {fake_aws.BLOCK_START}") in text
    assert "set the pool's count to 0 until then" in text


def test_a_scheduled_block_for_a_pool_of_count_zero_waits_quietly():
    assert load(stack_config("dev", gpuPools=[T4, {**BLOCK, "count": 0,
                                                   "capacityReservation": fake_aws.SCHEDULED_BLOCK}]))


def test_an_expired_block_is_named_with_its_state():
    text = problems(stack_config("dev", gpuPools=[{**BLOCK, "capacityReservation": fake_aws.EXPIRED_BLOCK}]))
    assert f"{fake_aws.EXPIRED_BLOCK} is expired (it ended at 2026-11-08T11:30:00Z)" in text
    # Never "remove the block": the pool would then launch P instances on demand, at list price.
    assert "Set the pool's count to 0" in text and "buy a new Capacity Block" in text
    assert "marketType" not in text and "Remove the pool's capacityReservation" not in text


def test_the_advice_for_an_ended_block_is_followed_to_a_preview_that_passes():
    ended = stack_config("dev", gpuPools=[T4, {**BLOCK, "count": 0, "capacityReservation": fake_aws.EXPIRED_BLOCK}])
    assert load(ended)
    # The whole program too: a pool of no nodes reads no reservation, which the provider finds gone once ended.
    assert "gpu-swarm-training-reservation" not in run_program(ended).monitor.reads
    assert load(stack_config("dev", gpuPools=[T4, {**BLOCK, "capacityReservation": fake_aws.BLOCK_RESERVATION}]))


def test_an_expired_on_demand_reservation_is_named_at_preview():
    """The provider's read finds no reservation that has ended (fake_aws.capacity_reservation_state raises as it
    does); the preview names it and says why instead."""
    with pytest.raises(Exception, match="couldn't find resource"):
        fake_aws.capacity_reservation_state(fake_aws.EXPIRED_RESERVATION)
    text = problems(stack_config("dev", gpuPools=[{**P5, "capacityReservation": fake_aws.EXPIRED_RESERVATION}]))
    assert (f"gpu-swarm:gpuPools: training.capacityReservation: AWS has no active capacity reservation "
            f"{fake_aws.EXPIRED_RESERVATION} in us-east-1") in text
    assert "one that has expired or was cancelled is gone for good" in text


def test_a_block_id_that_is_no_block_is_named():
    text = problems(stack_config("dev", gpuPools=[{**BLOCK, "capacityReservation": fake_aws.RESERVATION}]))
    assert f"AWS describes no Capacity Block {fake_aws.RESERVATION} in us-east-1" in text


# ---------------------------------------------------------------- the error hook


@pytest.mark.parametrize("error,code", [
    ("VcpuLimitExceeded: You have requested more vCPU capacity than your current vCPU limit of 0 allows for the "
     "instance bucket that the specified instance type belongs to.", "L-DB2E81BA"),
    ("MaxSpotInstanceCountExceeded: Max spot instance count exceeded", "L-3819A6DF"),
    ("AddressLimitExceeded: The maximum number of addresses has been reached.", "L-0263D0A3"),
])
def test_a_quota_error_names_the_quota_and_the_fix(error, code):
    from settings import GpuPool
    from settings.pool_options import PoolOptions
    spot = "Spot" in error
    pool = GpuPool("cheap", "g6e.12xlarge", 2, spot, None, 200, 4, "L40S",
                   options=PoolOptions(market_type="spot" if spot else "on-demand"), zones=("us-east-1a",),
                   offered_in=("us-east-1a",))
    advice = capacity.capacity_advice(pool, [f"creating EC2 Instance: operation error EC2: RunInstances, {error}"])
    assert advice and f"quota {code}" in advice and "request-service-quota-increase" in advice
    assert f"--quota-code {code}" in advice and "no g6e.12xlarge capacity" not in advice
