"""components/provider_facts.py against the pulumi-aws that requirements.txt pins: every input classified, none stale.

The pulumi-aws SDK is generated from the provider's schema, so its InstanceArgs list every
input aws.ec2.Instance has at that version. A new pulumi-aws that adds, renames or drops one
fails here until someone reads the upstream source at that version and classifies it.
"""
from __future__ import annotations

import re
from importlib import metadata

import pulumi_aws as aws

from components import provider_facts
from tests.conftest import REPO


def inputs_of(args_class) -> set[str]:
    """The input names (camelCase, as the engine and the state spell them) of a pulumi-aws *Args class."""
    return {getattr(v.fget, "_pulumi_name", k) for k, v in vars(args_class).items() if isinstance(v, property)}


def schema_paths() -> set[str]:
    """Every input of aws.ec2.Instance, with the nested blocks whose parts differ spelled out (cpuOptions, rootBlockDevice)."""
    top = inputs_of(aws.ec2.InstanceArgs)
    nested = {"cpuOptions": aws.ec2.InstanceCpuOptionsArgs, "rootBlockDevice": aws.ec2.InstanceRootBlockDeviceArgs}
    return (top - set(nested)) | {f"{name}.{part}" for name, cls in nested.items() for part in inputs_of(cls)}


def test_the_installed_pulumi_aws_is_the_one_the_facts_were_checked_against():
    assert metadata.version("pulumi_aws") == provider_facts.PULUMI_AWS_VERSION


def test_requirements_pin_that_version():
    line = next(line for line in (REPO / "requirements.txt").read_text().splitlines() if line.startswith("pulumi-aws"))
    pin = re.match(r"pulumi-aws~=([0-9.]+)", line)
    assert pin and pin[1] == provider_facts.PULUMI_AWS_VERSION, line


def test_every_instance_input_is_classified_once():
    replacing, in_place = provider_facts.INSTANCE_FORCE_NEW, provider_facts.INSTANCE_UPDATED_IN_PLACE
    assert not replacing & in_place
    paths = schema_paths()
    assert paths - (replacing | in_place) == set(), "new inputs: read the upstream schema and classify them"
    assert (replacing | in_place) - paths == set(), "inputs this pulumi-aws no longer has"


def test_cpu_options_change_in_place_since_terraform_provider_aws_46568_but_amd_sev_snp_replaces():
    old = {"cpuOptions": {"coreCount": 4, "threadsPerCore": 2}}
    assert provider_facts.replaced_by("aws:ec2/instance:Instance", old, {"cpuOptions": {"coreCount": 8,
                                                                                        "threadsPerCore": 1}}) == set()
    assert provider_facts.replaced_by("aws:ec2/instance:Instance", old, {"cpuOptions": {
        **old["cpuOptions"], "amdSevSnp": "enabled"}}) == {"cpuOptions.amdSevSnp"}


def test_what_running_nodes_keep_are_inputs_of_this_version():
    kept = {path.split(".")[0] for path in provider_facts.INSTANCE_INPUTS_KEPT_BY_RUNNING_NODES}
    assert kept <= inputs_of(aws.ec2.InstanceArgs)
    # Each kept input is one that would replace or stop the instance: that is why nodes keep them.
    for name in kept:
        assert name in provider_facts.INSTANCE_FORCE_NEW | provider_facts.INSTANCE_USER_DATA | {
            "capacityReservationSpecification"}, name


def test_an_elastic_ip_moves_to_a_replaced_instance_by_a_new_association():
    assert provider_facts.replaced_by("aws:ec2/eipAssociation:EipAssociation", {"instanceId": "i-1"},
                                      {"instanceId": "i-2"}) == {"instanceId"}
    assert provider_facts.EIP_ASSOCIATION_FORCE_NEW <= inputs_of(aws.ec2.EipAssociationArgs)


def test_an_elastic_ip_on_the_primary_interface_moves_to_a_replaced_instance_by_a_new_association():
    """node_pool.py associates through the primary network interface, which a replaced instance has anew."""
    assert "networkInterfaceId" in provider_facts.EIP_ASSOCIATION_FORCE_NEW
    assert provider_facts.replaced_by("aws:ec2/eipAssociation:EipAssociation", {"networkInterfaceId": "eni-1"},
                                      {"networkInterfaceId": "eni-2"}) == {"networkInterfaceId"}


def test_the_pinned_provider_bridges_the_upstream_whose_instance_delete_cancels_its_spot_request():
    """components/provider_facts.py: terraform-provider-aws 6.45's resourceInstanceDelete cancels a persistent
    spot instance's request before it terminates it; the pinned SDK has resources that are new in 6.45."""
    assert aws.observabilityadmin.TelemetryEvaluation and aws.observabilityadmin.TelemetryEvaluationForOrganization
    assert aws.securityhub.AggregatorV2


def test_a_spot_nodes_market_options_replace_only_a_node_that_does_not_keep_them():
    """Every spot option is ForceNew (aws_instance instance_market_options); running nodes keep them."""
    typ = "aws:ec2/instance:Instance"
    old = {"instanceMarketOptions": {"marketType": "spot", "spotOptions": {"validUntil": "2036-11-01T00:00:00Z"}}}
    new = {"instanceMarketOptions": {"marketType": "spot", "spotOptions": {"validUntil": "2036-12-01T00:00:00Z"}}}
    assert provider_facts.replaced_by(typ, old, new) == {"instanceMarketOptions"}
    assert "instanceMarketOptions" in provider_facts.INSTANCE_INPUTS_KEPT_BY_RUNNING_NODES
    kept = provider_facts.as_diffed(old, new, provider_facts.INSTANCE_INPUTS_KEPT_BY_RUNNING_NODES)
    assert provider_facts.replaced_by(typ, old, kept) == set()
