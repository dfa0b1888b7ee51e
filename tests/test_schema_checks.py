"""What the providers' Check refuses (localswarm/schema_checks.py), and the tls keys the rehearsal makes
(localswarm/tls_keys.py): real keys of the algorithm asked, in the formats pulumi-tls returns."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from localswarm import schema_checks, tls_keys
from tests.conftest import run_program
from tests.test_plan import INSTANCE, PROD

GOOD_INSTANCE = {
    "ami": "ami-1", "instanceType": "g4dn.xlarge",
    "metadataOptions": {"httpEndpoint": "enabled", "httpTokens": "required", "httpPutResponseHopLimit": 1.0},
    "rootBlockDevice": {"volumeType": "gp3", "encrypted": True},
    "instanceMarketOptions": {"marketType": "spot", "spotOptions": {
        "instanceInterruptionBehavior": "stop", "spotInstanceType": "persistent",
        "validUntil": "2027-01-05T10:00:00Z"}},
    "capacityReservationSpecification": {"capacityReservationPreference": "open"},
}


def _with(path: str, value) -> dict:
    inputs = {k: (dict(v) if isinstance(v, dict) else v) for k, v in GOOD_INSTANCE.items()}
    keys = path.split(".")
    at = inputs
    for key in keys[:-1]:
        at[key] = dict(at.get(key) or {})
        at = at[key]
    if value is None:
        at.pop(keys[-1], None)
    else:
        at[keys[-1]] = value
    return inputs


def test_an_instance_as_the_program_sends_it_passes():
    assert schema_checks.check(schema_checks.INSTANCE, GOOD_INSTANCE) == []


@pytest.mark.parametrize("path, value, said", [
    ("metadataOptions.httpTokens", "maybe", 'expected http_tokens to be one of ["optional" "required"], got maybe'),
    ("metadataOptions.httpPutResponseHopLimit", 65.0,
     "expected http_put_response_hop_limit to be in the range (1 - 64), got 65"),
    ("metadataOptions.httpPutResponseHopLimit", 0, "in the range (1 - 64), got 0"),
    ("rootBlockDevice.volumeType", "gp4", "expected volume_type to be one of"),
    ("instanceMarketOptions.marketType", "reserved", "expected market_type to be one of"),
    ("instanceMarketOptions.spotOptions.instanceInterruptionBehavior", "pause", "instance_interruption_behavior"),
    ("instanceMarketOptions.spotOptions.spotInstanceType", "weekly", "spot_instance_type"),
    ("instanceMarketOptions.spotOptions.validUntil", "2027-01-05 10:00", "must be in RFC3339 time format"),
    ("instanceMarketOptions.spotOptions.validUntil", "2027-01-05T10:00:00", "must be in RFC3339 time format"),
    ("capacityReservationSpecification.capacityReservationTarget", {"capacityReservationId": "cr-1"},
     "only one of `capacity_reservation_preference,capacity_reservation_target`"),
    ("ami", None, "one of `ami,launch_template` must be specified"),
    ("userDataBase64", "eA==", "conflicts with user_data"),
])
def test_an_instance_input_the_provider_refuses_is_named(path, value, said):
    inputs = _with(path, value)
    if path == "userDataBase64":
        inputs["userData"] = "x"
    failures = schema_checks.check(schema_checks.INSTANCE, inputs)
    assert len(failures) == 1 and said in failures[0][1], failures
    assert failures[0][0] == ("ami" if value is None else path.split(".capacityReservationTarget")[0]
                              if "Target" in path else path)


def test_an_unknown_value_is_left_to_the_create():
    from pulumi.runtime import rpc
    assert schema_checks.check(schema_checks.INSTANCE, _with("metadataOptions.httpTokens", rpc.UNKNOWN)) == []
    assert schema_checks.check(schema_checks.PRIVATE_KEY, {"algorithm": rpc.UNKNOWN}) == []


def test_every_instance_and_key_of_the_prod_stack_passes_the_checks_the_mocks_apply():
    run = run_program(PROD, stack="prod")
    checked = [r for r in run.monitor.requests.values() if r.type in (INSTANCE, schema_checks.PRIVATE_KEY)]
    assert len(checked) > 4, "the prod stack registers its nodes and their keys"


def test_the_mocks_refuse_what_the_provider_would(monkeypatch):
    from components import node_pool
    real = node_pool.aws.ec2.InstanceMetadataOptionsArgs
    monkeypatch.setattr(node_pool.aws.ec2, "InstanceMetadataOptionsArgs",
                        lambda **kw: real(**{**kw, "http_put_response_hop_limit": 100}))
    with pytest.raises(Exception, match=r"metadataOptions.httpPutResponseHopLimit: expected "
                                        r"http_put_response_hop_limit to be in the range \(1 - 64\), got 100"):
        run_program(PROD, stack="prod")


def test_a_key_algorithm_the_provider_refuses_is_named_in_its_words():
    assert tls_keys.check({"algorithm": "DSA"}) == [
        ("algorithm", 'Attribute algorithm value must be one of: ["RSA" "ECDSA" "ED25519"], got: "DSA"')]
    assert tls_keys.check({"algorithm": "RSA", "ecdsaCurve": "P192"})[0][0] == "ecdsaCurve"
    assert tls_keys.check({})[0][0] == "algorithm"
    with pytest.raises(ValueError, match="must be one of"):
        tls_keys.make({"algorithm": "DSA"})


@pytest.mark.parametrize("inputs, pem, openssh_type, bits", [
    ({"algorithm": "ED25519"}, "PRIVATE KEY", "ssh-ed25519", "256"),
    ({"algorithm": "RSA"}, "RSA PRIVATE KEY", "ssh-rsa", "2048"),
    ({"algorithm": "RSA", "rsaBits": 3072.0}, "RSA PRIVATE KEY", "ssh-rsa", "3072"),
    ({"algorithm": "ECDSA", "ecdsaCurve": "P384"}, "EC PRIVATE KEY", "ecdsa-sha2-nistp384", "384"),
])
def test_a_key_is_real_and_of_the_algorithm_asked(tmp_path: Path, inputs, pem, openssh_type, bits):
    made = tls_keys.make(inputs)
    assert made["privateKeyPem"].startswith(f"-----BEGIN {pem}-----")
    assert made["privateKeyPemPkcs8"].startswith("-----BEGIN PRIVATE KEY-----")
    assert made["publicKeyPem"].startswith("-----BEGIN PUBLIC KEY-----")
    assert made["publicKeyOpenssh"].startswith(openssh_type + " ") and made["publicKeyOpenssh"].endswith("\n")
    assert len(made["publicKeyOpenssh"].split()) == 2, "no comment, as the provider's authorized_keys form"
    key = tmp_path / "key"
    key.write_text(made["privateKeyOpenssh"])
    os.chmod(key, 0o600)
    # ssh-keygen reads the OpenSSH private key, and its public key is the one the resource returns.
    derived = subprocess.run(["ssh-keygen", "-y", "-f", str(key)], check=True, capture_output=True, text=True)
    assert derived.stdout.split()[:2] == made["publicKeyOpenssh"].split()
    listed = subprocess.run(["ssh-keygen", "-l", "-E", "sha256", "-f", str(key)], check=True,
                            capture_output=True, text=True).stdout.split()
    assert listed[0] == bits and listed[1] == made["publicKeyFingerprintSha256"]
    assert len(made["publicKeyFingerprintMd5"].split(":")) == 16
    # The PEM forms are the same key: openssl's public key of each is the resource's public PEM.
    for form in ("privateKeyPem", "privateKeyPemPkcs8"):
        (tmp_path / form).write_text(made[form])
        public = subprocess.run(["openssl", "pkey", "-in", str(tmp_path / form), "-pubout"], check=True,
                                capture_output=True, text=True).stdout
        assert public == made["publicKeyPem"]
    assert made["rsaBits"] == int(bits if inputs["algorithm"] == "RSA" else 2048)


def test_a_p224_key_has_no_openssh_form_as_the_provider_says():
    made = tls_keys.make({"algorithm": "ECDSA"})
    assert made["ecdsaCurve"] == "P224" and made["privateKeyPem"].startswith("-----BEGIN EC PRIVATE KEY-----")
    assert made["privateKeyOpenssh"] == made["publicKeyOpenssh"] == made["publicKeyFingerprintSha256"] == ""
