"""What the real providers' Check refuses before any call to AWS: their schemas' validators, for the
resource types whose inputs the program computes. The rehearsal's plugins (localswarm/provider_plugin.py)
answer Check with these failures, and the tests' mocks (tests/conftest.py) refuse the same inputs, so a
program that sends a value the real provider would refuse fails its preview here too.

Sources, next to each rule below:
- aws.ec2.Instance: terraform-provider-aws internal/service/ec2/ec2_instance.go, the resource's schema
  (enum.Validate[...] is StringInSlice over the aws-sdk-go-v2 ec2 types' Values(); IntBetween; ExactlyOneOf;
  ConflictsWith; AtLeastOneOf), in the words of terraform-plugin-sdk v2's validators.
- tls.PrivateKey: terraform-provider-tls internal/provider/resource_private_key.go (localswarm/tls_keys.py).
Rules the provider applies only at create (iops or throughput on a volume type without them) are not here.
"""
from __future__ import annotations

from datetime import datetime

from pulumi.runtime import rpc

from localswarm import tls_keys

INSTANCE = "aws:ec2/instance:Instance"
PRIVATE_KEY = "tls:index/privateKey:PrivateKey"

# (input path, its Terraform name, the values its enum.Validate allows: aws-sdk-go-v2 service/ec2 types)
INSTANCE_ENUMS = (
    ("metadataOptions.httpEndpoint", "http_endpoint", ("disabled", "enabled")),  # InstanceMetadataEndpointState
    ("metadataOptions.httpTokens", "http_tokens", ("optional", "required")),  # HttpTokensState
    ("metadataOptions.httpProtocolIpv6", "http_protocol_ipv6", ("disabled", "enabled")),
    ("metadataOptions.instanceMetadataTags", "instance_metadata_tags", ("disabled", "enabled")),
    ("rootBlockDevice.volumeType", "volume_type", ("standard", "io1", "io2", "gp2", "sc1", "st1", "gp3")),
    ("instanceMarketOptions.marketType", "market_type",  # MarketType
     ("spot", "capacity-block", "interruptible-capacity-reservation", "on-demand")),
    ("instanceMarketOptions.spotOptions.instanceInterruptionBehavior", "instance_interruption_behavior",
     ("hibernate", "stop", "terminate")),
    ("instanceMarketOptions.spotOptions.spotInstanceType", "spot_instance_type", ("one-time", "persistent")),
    ("capacityReservationSpecification.capacityReservationPreference", "capacity_reservation_preference",
     ("capacity-reservations-only", "open", "none")),
)


def check(typ: str, inputs: dict) -> list[tuple[str, str]]:
    """(property, reason) for each input of a resource of this type that its provider's Check refuses."""
    if typ == PRIVATE_KEY:
        return [(prop, why) for prop, why in tls_keys.check(inputs) if _known(inputs.get(prop, ""))]
    if typ == INSTANCE:
        return _instance(inputs)
    return []


def _known(value) -> bool:
    return value != rpc.UNKNOWN


def _at(inputs: dict, path: str):
    value = inputs
    for key in path.split("."):
        value = value.get(key) if isinstance(value, dict) else None
    return value


def _instance(inputs: dict) -> list[tuple[str, str]]:
    failures = []
    for path, name, allowed in INSTANCE_ENUMS:
        value = _at(inputs, path)
        if value is not None and _known(value) and value not in allowed:
            quoted = " ".join(f'"{v}"' for v in allowed)
            failures.append((path, f"expected {name} to be one of [{quoted}], got {value}"))
    hops = _at(inputs, "metadataOptions.httpPutResponseHopLimit")
    if hops is not None and _known(hops) and not (isinstance(hops, (int, float)) and 1 <= hops <= 64):
        failures.append(("metadataOptions.httpPutResponseHopLimit",
                         f"expected http_put_response_hop_limit to be in the range (1 - 64), got {hops}"))
    until = _at(inputs, "instanceMarketOptions.spotOptions.validUntil")
    if until and _known(until) and not _rfc3339(until):  # verify.ValidUTCTimestamp: time.Parse(time.RFC3339)
        failures.append(("instanceMarketOptions.spotOptions.validUntil",
                         f'"valid_until" must be in RFC3339 time format "2006-01-02T15:04:05Z07:00". '
                         f"Example: 2006-01-02T15:04:05Z, got {until}"))
    given = {key for key in ("userData", "userDataBase64") if inputs.get(key) is not None}
    if len(given) == 2:  # ConflictsWith
        failures.append(("userDataBase64", '"user_data_base64": conflicts with user_data'))
    spec = inputs.get("capacityReservationSpecification") or {}
    if isinstance(spec, dict) and spec and len({"capacityReservationPreference", "capacityReservationTarget"}
                                               & {k for k, v in spec.items() if v is not None}) != 1:
        failures.append(("capacityReservationSpecification", '"capacity_reservation_specification.0.'
                         'capacity_reservation_preference": only one of `capacity_reservation_preference,'
                         'capacity_reservation_target` can be specified'))  # ExactlyOneOf
    if inputs.get("ami") is None and inputs.get("launchTemplate") is None:  # AtLeastOneOf
        failures.append(("ami", '"ami": one of `ami,launch_template` must be specified'))
    return failures


def _rfc3339(text) -> bool:
    if not isinstance(text, str) or "T" not in text:
        return False
    try:
        datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return False
    return text.endswith("Z") or text[-6] in "+-"
