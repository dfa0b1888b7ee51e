"""What the cluster costs: the preview's table and the `cost` output, from the Price List and the spot price history.

Under the mocks, which answer aws.pricing.get_product and aws.ec2.get_spot_price as the provider does
(localswarm/fake_prices.py: a Price List product as JSON text, the spot price in effect in one zone with
its time). The figures expected here are computed from those answers, not copied from the table.
"""
from __future__ import annotations

import json
import re

import pulumi
import pytest

from components import cost as cost_module
from localswarm import fake_aws, fake_prices
from swarm.node_contract import (COST_ENV_PATH, PRICE_DATE_ENV, PRICE_ENV, PRICE_GPUS_ENV, PRICE_INSTANCE_TYPE_ENV,
                                 PRICE_MARKET_ENV)
from tests.conftest import request_inputs, run_program, stack_config, unwrap
from tests.test_plan import plan

PROD = stack_config("prod")
SPOT_TYPE = "g6e.12xlarge"  # Pulumi.prod.yaml's inference pool


@pytest.fixture
def logged(monkeypatch):
    said = {"info": [], "warn": []}
    monkeypatch.setattr(pulumi.log, "info", lambda message, *a, **k: said["info"].append(message))
    monkeypatch.setattr(pulumi.log, "warn", lambda message, *a, **k: said["warn"].append(message))
    return said


def table_of(said: dict) -> list[str]:
    (table,) = [m for m in said["info"] if "what its instances cost per hour" in m]
    return table.splitlines()


def spot(zone: str) -> float:
    return float(fake_prices.spot_price({"instanceType": SPOT_TYPE, "availabilityZone": zone, "filters": [
        {"name": "product-description", "values": ["Linux/UNIX"]}]}, fake_aws.OFFERED_IN, fake_aws.ZONES)["spotPrice"])


def row(table: list[str], first: str) -> list[str]:
    (found,) = [line.split() for line in table if line.split() and line.split()[0] == first]
    return found


def test_the_preview_of_prod_prints_the_cost_table_and_the_cost_output_holds_its_figures(logged):
    run = run_program(PROD, stack="prod")
    table, out = table_of(logged), run.exports["cost"]
    assert out["table"] == table and out["currency"] == "USD" and out["complete"] is True
    assert table[0].startswith("gpu-swarm-prod in us-east-1: what its instances cost per hour, in USD")
    pools = {p["pool"]: p for p in out["pools"]}
    assert [p["pool"] for p in out["pools"]] == ["managers", "training", "inference"]
    # Managers: 3 x m7i.large on demand; training: 1 x p5.48xlarge in its reservation, at the on-demand price.
    for name, instance_type, nodes in (("managers", "m7i.large", 3), ("training", "p5.48xlarge", 1)):
        price = float(fake_prices.ON_DEMAND[instance_type])
        (part,) = pools[name]["prices"]
        assert part == {"nodes": nodes, "perNodeHour": price, "date": fake_prices.EFFECTIVE, "source": "Price List"}
        assert pools[name]["perHour"] == round(nodes * price, 4)
        market = "on-demand" if name == "managers" else f"reserved {fake_aws.RESERVATION}"
        assert re.search(rf"^{name} +{nodes} +{re.escape(instance_type)} +{market} +\(region\) +{price:.4f} +"
                         rf"{nodes * price:.4f} +{fake_prices.EFFECTIVE[:10]} \(Price List\)$", "\n".join(table),
                         re.M), table
    assert pools["training"]["market"] == "reserved" and pools["training"]["reservation"] == fake_aws.RESERVATION
    # The spot pool: a row per zone its nodes go to, each zone's price with its time.
    inference = pools["inference"]
    assert inference["market"] == "spot" and inference["nodes"] == 2
    zones = [p["zone"] for p in inference["prices"]]
    assert len(zones) == 2 and all(p["nodes"] == 1 for p in inference["prices"])
    for part in inference["prices"]:
        assert part["perNodeHour"] == spot(part["zone"]) and part["source"] == "spot price history"
        shown = part["date"].replace("T", " ")[:16]
        assert re.search(rf" {part['zone']} +{part['perNodeHour']:.4f} +{part['perNodeHour']:.4f} +{shown} UTC "
                         r"\(spot price history\)$", "\n".join(table), re.M), table
        assert "olderThanADay" not in part
    assert inference["perHour"] == round(sum(spot(z) for z in zones), 4)
    total = 3 * 0.1008 + 55.04 + sum(spot(z) for z in zones)
    assert out["perHour"] == round(total, 4) and row(table, "TOTAL") == ["TOTAL", "6", f"{total:.4f}"]
    assert not [w for w in logged["warn"] if "prices" in w]


def test_an_instance_type_the_price_list_has_no_price_for_is_named_and_not_counted_as_zero(logged, monkeypatch):
    monkeypatch.delitem(fake_prices.ON_DEMAND, "m7i.large")  # the managers' type
    out = run_program(PROD, stack="prod").exports["cost"]
    managers = out["pools"][0]
    assert managers["perHour"] is None and managers["prices"][0]["perNodeHour"] is None
    why = "the Price List has no Linux on-demand price for m7i.large in us-east-1"
    assert managers["prices"][0]["notKnown"] == why and out["notPriced"] == [f"managers (m7i.large): {why}"]
    assert out["complete"] is False and out["perHour"] == round(sum(p["perHour"] for p in out["pools"][1:]), 4)
    table = table_of(logged)
    assert row(table, "managers")[-4:] == ["-", "-", "not", "known"]
    assert f"not priced: managers (m7i.large): {why}" in table
    assert row(table, "TOTAL")[-6:] == ["without", "the", "pools", "not", "priced", "below"]
    assert not [w for w in logged["warn"] if "prices" in w]  # no price is an answer, not a failure


def test_a_spot_price_set_more_than_a_day_ago_is_marked(logged, monkeypatch):
    for zone in fake_aws.ZONES[1:]:  # every zone but the first: its price was set three days ago
        monkeypatch.setitem(fake_prices.SPOT_AGE_DAYS, (SPOT_TYPE, zone), 3)
    out = run_program(PROD, stack="prod").exports["cost"]
    parts = out["pools"][2]["prices"]
    assert {p["zone"] == fake_aws.ZONES[0] for p in parts} == {True, False}  # the pool has one of each
    for part in parts:
        old = part["zone"] != fake_aws.ZONES[0]
        assert part.get("olderThanADay", False) is old
        (line,) = [line for line in table_of(logged) if f" {part['zone']} " in line]
        assert line.endswith("(spot price history, over a day old)" if old else "(spot price history)"), line


@pytest.mark.parametrize("action, priced, unpriced", [
    ("pricing:GetProducts", {"inference"}, {"managers", "training"}),
    ("ec2:DescribeSpotPriceHistory", {"managers", "training"}, {"inference"}),
])
def test_prices_the_credentials_may_not_read_warn_once_and_the_preview_goes_on(logged, action, priced, unpriced):
    run = run_program_denied(PROD, action)
    out = run.exports["cost"]
    warnings = [w for w in logged["warn"] if "prices not read" in w]
    assert len(warnings) == 1 and f"may not call {action}" in warnings[0], logged["warn"]
    assert "docs/reference/operator-policy.md" in warnings[0]
    assert {p["pool"] for p in out["pools"] if p["perHour"] is not None} == priced
    assert {p["pool"] for p in out["pools"] if p["perHour"] is None} == unpriced
    assert run.exports["inventory"]  # the rest of the program ran


def run_program_denied(config, action):
    """run_program with an account that denies `action` (run_program resets the account first)."""
    from localswarm import fake_account
    real = fake_account.reset_account

    def reset():
        account = real()
        account.denied.add(action)
        return account
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fake_aws, "reset_account", reset)
        return run_program(config, stack="prod")


def test_prices_that_cannot_be_reached_warn_once_and_the_preview_goes_on(logged, monkeypatch):
    def offline(_):
        raise Exception("reading Pricing Products: operation error Pricing: GetProducts, exceeded maximum number of "
                        "attempts, 3, https response error: dial tcp: lookup api.pricing.us-east-1.amazonaws.com: "
                        "no such host")
    monkeypatch.setitem(fake_aws.ANSWERS, "aws:pricing/getProduct:getProduct", offline)
    out = run_program(PROD, stack="prod").exports["cost"]
    warnings = [w for w in logged["warn"] if "prices not read" in w]
    assert len(warnings) == 1 and "no such host" in warnings[0] and "check this machine reaches it" in warnings[0]
    assert out["pools"][0]["prices"][0]["notKnown"].startswith("on-demand prices not read")
    assert out["pools"][2]["perHour"] is not None  # spot prices came from another API


def health_command(run, node: str) -> str:
    return unwrap(request_inputs(run.monitor.requests[f"gpu-swarm-boot-{node}-health"]))["create"]


def cost_env(script: str) -> dict[str, str]:
    """cost.env as the node's health command writes it (the script goes through sudo bash -c)."""
    found = re.search(rf"cat >{re.escape(COST_ENV_PATH)}\.new <<.*?\n((?:GPU_SWARM_PRICE_\w+=.*\n)+)COST_ENV\n", script)
    return dict(line.split("=", 1) for line in found[1].splitlines())


def test_each_gpu_node_is_told_its_price_and_managers_are_not():
    run = run_program(PROD, stack="prod")
    out = {p["pool"]: p for p in run.exports["cost"]["pools"]}
    assert cost_env(health_command(run, "training-0")) == {
        PRICE_ENV: "55.04", PRICE_MARKET_ENV: "reserved", PRICE_DATE_ENV: fake_prices.EFFECTIVE,
        PRICE_INSTANCE_TYPE_ENV: "p5.48xlarge", PRICE_GPUS_ENV: "8"}
    for i, part in enumerate(out["inference"]["prices"]):  # node i in the pool's i-th zone
        env = cost_env(health_command(run, f"inference-{i}"))
        assert (env[PRICE_ENV], env[PRICE_MARKET_ENV], env[PRICE_DATE_ENV], env[PRICE_GPUS_ENV]) == (
            repr(part["perNodeHour"]), "spot", part["date"], "4")
    assert "COST_ENV" not in health_command(run, "managers-0")


def test_a_running_node_is_priced_on_the_market_it_was_launched_on_when_its_pool_moved(monkeypatch, logged):
    """A pool's marketType reaches new and replaced nodes only (components/provider_facts.py): a node launched
    before the pool moved keeps its market, its instance says which (instanceLifecycle), and its price file
    follows the instance, with a warning; the table still prices the pool's setting."""
    from localswarm import fake_account
    real = fake_account.instance_lifecycle
    moved_from = {"inference-1": None, "training-0": "spot"}  # launched before their pools' markets moved

    def lifecycle(inputs, **kw):
        name = (inputs.get("tags") or {}).get("Name", "")
        node = next((n for n in moved_from if name.endswith(f"-{n}")), None)
        return moved_from[node] if node else real(inputs, **kw)
    monkeypatch.setattr(fake_account, "instance_lifecycle", lifecycle)
    run = run_program(PROD, stack="prod")
    out = {p["pool"]: p for p in run.exports["cost"]["pools"]}
    kept = cost_env(health_command(run, "inference-1"))
    assert (kept[PRICE_MARKET_ENV], kept[PRICE_ENV]) == ("on-demand", repr(float(fake_prices.ON_DEMAND[SPOT_TYPE])))
    assert cost_env(health_command(run, "inference-0"))[PRICE_MARKET_ENV] == "spot"  # launched as its pool says
    assert out["inference"]["market"] == "spot"  # the table: the pool's setting
    spot_node = cost_env(health_command(run, "training-0"))
    assert (spot_node[PRICE_MARKET_ENV], spot_node[PRICE_ENV]) == ("spot", "")
    assert any("inference-1 runs on-demand, as it was launched" in w for w in logged["warn"]), logged["warn"]
    assert any("training-0 runs spot" in w for w in logged["warn"])
    assert not any("inference-0 runs" in w for w in logged["warn"])


def test_a_capacity_block_is_named_without_a_price_and_its_nodes_get_none():
    config = stack_config("prod", stacks=[], gpuPools=[{"name": "block", "instanceType": "p5.48xlarge", "count": 1,
                                                        "marketType": "capacity-block",
                                                        "capacityReservation": fake_aws.BLOCK_RESERVATION}])
    run = run_program(config, stack="prod")
    (block,) = [p for p in run.exports["cost"]["pools"] if p["pool"] == "block"]
    assert block["market"] == "capacity-block" and block["perHour"] is None
    assert block["prices"][0]["notKnown"] == cost_module.BLOCK_PRICE
    assert cost_env(health_command(run, "block-0"))[PRICE_ENV] == ""


def test_a_new_spot_price_rewrites_the_price_file_only_and_rolls_no_node(monkeypatch):
    def moved():  # the next day's spot prices
        monkeypatch.setitem(fake_prices.SPOT_AGE_DAYS, (SPOT_TYPE, "us-east-1a"), -0.5)
        real = fake_prices.spot_price
        monkeypatch.setattr(fake_prices, "spot_price", lambda a, *rest: {
            **real(a, *rest), "spotPrice": f"{float(real(a, *rest)['spotPrice']) * 1.07:.6f}"})
        monkeypatch.setitem(fake_aws.ANSWERS, "aws:ec2/getSpotPrice:getSpotPrice",
                            lambda a: fake_prices.spot_price(a, fake_aws.OFFERED_IN, fake_aws.ZONES))
    changed = plan(PROD, PROD, between=moved)
    assert changed.created == changed.deleted == set() and not changed.replaced
    assert set(changed.updated) == {"gpu-swarm-boot-inference-0-health", "gpu-swarm-boot-inference-1-health"}
    assert all(why == {"create"} for why in changed.updated.values())


def test_a_region_without_the_price_list_asks_it_through_a_provider_in_us_east_1(monkeypatch):
    from tests.conftest import use_mocks
    monitor = use_mocks(PROD, stack="prod")
    asked = []
    real = monitor.Invoke

    def invoke(request):
        if request.tok == "aws:pricing/getProduct:getProduct":
            asked.append(request.provider)
        return real(request)
    monkeypatch.setattr(monitor, "Invoke", invoke)

    @pulumi.runtime.test
    def program():
        from settings import load_settings
        parent = pulumi.ComponentResource("test:index:Parent", "parent")
        provider = cost_module.price_list_provider("gpu-swarm", "eu-west-1", parent)
        assert cost_module.price_list_provider("gpu-swarm", "us-east-1", parent) is None
        found = cost_module.cluster_cost(load_settings(), "eu-west-1", provider)
        return pulumi.Output.from_input(found.pools[0].parts[0].price.why)
    program()
    provider_request = monitor.requests["gpu-swarm-price-list"]
    assert provider_request.type == "pulumi:providers:aws"
    assert json.loads(json.dumps(unwrap(request_inputs(provider_request))))["region"] == "us-east-1"
    assert asked and all(p.startswith(monitor.urns["gpu-swarm-price-list"] + "::") for p in asked)


def test_the_fake_price_list_and_spot_history_answer_as_the_providers_data_sources_do():
    """docs/reference/aws-behaviour.md: getProduct fails unless exactly one product matches, and its result is that
    product as JSON text; getSpotPrice fails unless exactly one price matches, and a zone has one per system."""
    def product(**filters):
        return fake_aws.answer("aws:pricing/getProduct:getProduct", {
            "serviceCode": "AmazonEC2", "filters": [{"field": k, "value": v} for k, v in filters.items()]})
    asked = {"instanceType": "p5.48xlarge", "regionCode": "us-east-1", **cost_module.ON_DEMAND_FILTERS}
    found = json.loads(product(**asked)["result"])
    assert found["product"]["attributes"]["instanceType"] == "p5.48xlarge" and set(found["terms"]) == {
        "OnDemand", "Reserved"}
    assert cost_module.on_demand_price(product(**asked)["result"], "p5.48xlarge").per_hour == 55.04
    loose = {k: v for k, v in asked.items() if k not in ("capacitystatus", "marketoption")}
    with pytest.raises(Exception, match="not precise enough. Returned 4 elements"):
        product(**loose)  # capacity reserved but unused, allocated, and the Capacity Block market
    with pytest.raises(Exception, match="did not return any elements"):
        product(**{**asked, "instanceType": "p6-b200.48xlarge"})

    def spot_price(zone, descriptions=("Linux/UNIX",)):
        return fake_aws.answer("aws:ec2/getSpotPrice:getSpotPrice", {
            "instanceType": "p5.48xlarge", "availabilityZone": zone,
            "filters": [{"name": "product-description", "values": list(descriptions)}] if descriptions else None})
    assert float(spot_price("us-east-1a")["spotPrice"]) > 0
    with pytest.raises(Exception, match="multiple EC2 Spot Price History results"):
        spot_price("us-east-1a", descriptions=())
    with pytest.raises(Exception, match="no EC2 Spot Price History found"):
        spot_price("us-east-1b")  # p5.48xlarge is offered in us-east-1a and us-east-1c only


def test_an_elastic_pool_is_priced_at_its_min_and_at_its_max():
    elastic = {"name": "t4", "instanceType": "g4dn.xlarge", "autoscale": {"min": 1, "max": 4, "idleMinutes": 15}}
    fixed = {"name": "l4", "instanceType": "g6.xlarge", "count": 1}
    out = run_program(stack_config("dev", stacks=[], gpuPools=[elastic, fixed])).exports["cost"]
    by_pool = {p["pool"]: p for p in out["pools"]}
    each = by_pool["t4"]["prices"][0]["perNodeHour"]
    assert each > 0
    assert by_pool["t4"]["nodes"] == 1 and by_pool["t4"]["perHour"] == round(each, 4)
    assert by_pool["t4"]["elastic"] == {"min": 1, "max": 4, "perHourAtMin": round(each, 4),
                                        "perHourAtMax": round(4 * each, 4)}
    assert "elastic" not in by_pool["l4"]
    assert out["perHour"] == round(sum(p["perHour"] for p in out["pools"]), 4)
    assert out["perHourAtMax"] == round(out["perHour"] + 3 * each, 4)
    assert next(line for line in out["table"] if "autoscale" in line).split()[:3] == ["max", "4", "autoscale"]
    at_max = next(line for line in out["table"] if line.startswith("AT MAX"))
    assert at_max.split()[2:4] == ["6", f"{out['perHourAtMax']:,.4f}"]  # 1 manager, 4 of t4, 1 of l4


def test_an_elastic_pool_of_min_0_whose_type_has_no_price_is_named_not_priced_at_0(monkeypatch):
    monkeypatch.delitem(fake_prices.ON_DEMAND, "g4dn.xlarge")
    elastic = {"name": "t4", "instanceType": "g4dn.xlarge", "autoscale": {"max": 2}}
    out = run_program(stack_config("dev", stacks=[], gpuPools=[elastic])).exports["cost"]
    (t4,) = [p for p in out["pools"] if p["pool"] == "t4"]
    assert t4["elastic"]["perHourAtMin"] == 0 and t4["elastic"]["perHourAtMax"] is None
    assert out["complete"] is False and out["notPriced"] == [
        "t4 (g4dn.xlarge): the Price List has no Linux on-demand price for g4dn.xlarge in us-east-1"]


def test_the_spot_price_in_effect_was_set_at_one_time_whenever_a_run_asks():
    """Two runs minutes apart (two processes of the aws plugin) read one spot price, set at one time: the node's
    price file, and so its health command, must not change between a preview and the up after it (a time that
    moved with each process did, and `pulumi up --expect-no-changes` failed after a passing preview)."""
    from datetime import datetime, timedelta, timezone
    at = datetime(2026, 12, 4, 23, 50, 30, tzinfo=timezone.utc)
    assert fake_prices.spot_set_at(at) == fake_prices.spot_set_at(at + timedelta(minutes=5)) \
        == datetime(2026, 12, 4, 10, 0, tzinfo=timezone.utc)
    for hours in range(0, 48):  # never stale (STALE_AFTER is a day), never in the future
        now = at + timedelta(hours=hours)
        assert timedelta(hours=2) <= now - fake_prices.spot_set_at(now) < timedelta(hours=14)
