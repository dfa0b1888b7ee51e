"""Pulumi's real CLI (built by scripts/setup.sh from its Go module) on the unchanged program.

The CLI's engine runs the program through Pulumi's own inline-program language server and the
rehearsal's provider plugins (localswarm/pulumi_cli.py, localswarm/provider_plugin.py). These
tests hold what the mocks assume to what the CLI does: the config it hands the program, the
graph it previews, what it refuses before the program runs.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf import json_format, struct_pb2

from conftest import REPO, run_program, stack_config
from localswarm import provider_plugin, pulumi_cli
from pulumi.runtime.proto import provider_pb2


def _cli(tmp_path: Path, *args: str, stack: str = "dev", stack_file: Path | None = None):
    """`localswarm pulumi` in a process of its own (the program runs in it), its home and state under tmp_path."""
    cmd = [sys.executable, "-m", "localswarm", "pulumi", "--stack", stack]
    if stack_file:
        cmd += ["--stack-file", str(stack_file)]
    return subprocess.run([*cmd, *args], cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "GPU_SWARM_PULUMI_ROOT": str(tmp_path / "pulumi")})


def _preview(tmp_path: Path, stack: str) -> dict:
    done = _cli(tmp_path, "preview", "--json", stack=stack)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(done.stdout)


def _parsed(value: str):
    try:
        return json.loads(value)
    except ValueError:
        return value


@pytest.fixture(scope="module")
def prod_preview(tmp_path_factory) -> dict:
    return _preview(tmp_path_factory.mktemp("prod"), "prod")


def test_the_cli_hands_the_program_the_config_the_mocks_assume(prod_preview):
    """localswarm/stack_config.py merges Pulumi.yaml's defaults under the stack's file, as every mocks test
    assumes the CLI does; the CLI's own merge is the judge."""
    assert {k: _parsed(v) for k, v in prod_preview["config"].items()} == \
        {k: _parsed(v) for k, v in stack_config("prod").items()}


def test_the_cli_previews_the_graph_the_mocks_register(prod_preview):
    steps = [s for s in prod_preview["steps"] if "::pulumi:providers:" not in s["urn"]]
    mocked = run_program(stack_config("prod"), stack="prod").monitor
    made = {s["urn"] for s in steps if s["op"] == "create"}
    read = {s["urn"] for s in steps if s["op"] == "read"}
    assert made == set(mocked.urns.values())
    assert {u.rsplit("::", 1)[1] for u in read} == set(mocked.reads)
    assert prod_preview["changeSummary"] == {"create": len(made)}
    assert not [d for d in prod_preview["diagnostics"] if d["severity"] == "error"]


def test_the_cli_refuses_a_value_of_the_wrong_type_before_the_program_runs(tmp_path):
    stack_file = tmp_path / "Pulumi.bad.yaml"
    stack_file.write_text((REPO / "Pulumi.dev.yaml").read_text().replace(
        "  gpu-swarm:managerInstanceType: t3.medium\n",
        "  gpu-swarm:managerInstanceType: t3.medium\n  gpu-swarm:allowSshFromAnywhere: maybe\n"))
    done = _cli(tmp_path, "preview", stack="bad", stack_file=stack_file)
    assert done.returncode != 0
    assert "configuration key 'allowSshFromAnywhere' must be of type 'boolean'" in done.stdout + done.stderr


def test_a_settings_error_reaches_the_cli_with_its_key_and_fix(tmp_path):
    stack_file = tmp_path / "Pulumi.bad.yaml"
    stack_file.write_text((REPO / "Pulumi.dev.yaml").read_text().replace("count: 1", "count: -1"))
    done = _cli(tmp_path, "preview", stack="bad", stack_file=stack_file)
    assert done.returncode != 0
    assert "gpu-swarm:gpuPools[0].count: -1 is out of range; use a number from 0 to 1000" in done.stdout, \
        done.stdout[-2000:]
    planned = [line.split()[1] for line in done.stdout.splitlines() if line.startswith(" +  ")]
    assert set(planned) == {"pulumi:pulumi:Stack"}  # the program stopped before any resource of its own


def test_the_users_stack_file_stays_as_it_is(tmp_path):
    before = (REPO / "Pulumi.dev.yaml").read_text()
    first = _cli(tmp_path, "preview", "--json")
    assert first.returncode == 0, first.stderr[-2000:]
    copy = tmp_path / "pulumi" / "project" / "Pulumi.dev.yaml"
    salt = [line for line in copy.read_text().splitlines() if line.startswith("encryptionsalt:")]
    assert len(salt) == 1  # the CLI's passphrase salt went into the rehearsal's copy ...
    assert (REPO / "Pulumi.dev.yaml").read_text() == before  # ... not into the user's file
    again = _cli(tmp_path, "config", "set", "gpu-swarm:managerRootVolumeGiB", "60")
    assert again.returncode == 0, again.stderr
    shown = _cli(tmp_path, "config", "get", "gpu-swarm:managerRootVolumeGiB")
    assert shown.stdout.strip() == "60"  # a config set lasts in the rehearsal's copy
    assert salt[0] in copy.read_text()
    assert (REPO / "Pulumi.dev.yaml").read_text() == before


def test_a_pulumi_on_path_of_the_pinned_version_is_used(tmp_path, monkeypatch):
    fake = tmp_path / "bin" / "pulumi"
    fake.parent.mkdir()
    fake.write_text(f"#!/bin/sh\necho v{pulumi_cli.VERSION}\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    assert pulumi_cli.cli() == str(fake)
    fake.write_text("#!/bin/sh\necho v3.100.0\n")  # another version: the one setup built
    assert pulumi_cli.cli() == str(pulumi_cli.TOOLS / "pulumi")
    assert subprocess.run([pulumi_cli.cli(), "version"], capture_output=True, text=True).stdout.strip() == \
        f"v{pulumi_cli.VERSION}"


def _struct(value: dict) -> struct_pb2.Struct:
    out = struct_pb2.Struct()
    out.update(value)
    return out


INSTANCE_URN = ("urn:pulumi:prod::gpu-swarm::gpu-swarm:swarm:Cluster$gpu-swarm:aws:NodePool$"
                "aws:ec2/instance:Instance::gpu-swarm-t4-0")


def test_the_plugin_diffs_with_the_real_providers_replace_rules():
    provider = provider_plugin.Provider("aws")
    old = {"ami": "ami-1", "instanceType": "g4dn.xlarge", "tags": {"a": "1"}}
    diff = provider.Diff(provider_pb2.DiffRequest(urn=INSTANCE_URN, old_inputs=_struct(old),
                                                  news=_struct({**old, "ami": "ami-2", "tags": {"a": "2"}})), None)
    assert diff.changes == provider_pb2.DiffResponse.DIFF_SOME
    assert list(diff.replaces) == ["ami"] and sorted(diff.diffs) == ["ami", "tags"]
    same = provider.Diff(provider_pb2.DiffRequest(urn=INSTANCE_URN, old_inputs=_struct(old),
                                                  news=_struct({**old, "ami": "ami-2"}), ignoreChanges=["ami"]), None)
    assert same.changes == provider_pb2.DiffResponse.DIFF_NONE


def test_the_plugin_answers_lookups_from_the_fake_aws_and_passes_on_its_refusals():
    provider = provider_plugin.Provider("aws")
    zones = provider.Invoke(provider_pb2.InvokeRequest(
        tok="aws:index/getAvailabilityZones:getAvailabilityZones", args=_struct({"state": "available"})), None)
    assert not zones.failures and "us-east-1a" in list(getattr(zones, "return")["names"])
    unknown = provider.Invoke(provider_pb2.InvokeRequest(tok="aws:nowhere/getNothing:getNothing"), None)
    assert "no fake AWS answer" in unknown.failures[0].reason


def test_secrets_reach_the_fake_aws_as_plain_values():
    wrapped = {provider_plugin.SECRET_SIG: provider_plugin.SECRET_VALUE, "value": {"k": [1, "x"]}}
    assert provider_plugin.plain({"a": wrapped, "b": [wrapped]}) == {"a": {"k": [1, "x"]}, "b": [{"k": [1, "x"]}]}
    assert provider_plugin.resource_type(INSTANCE_URN) == "aws:ec2/instance:Instance"


def test_the_plugins_check_refuses_what_the_real_providers_validators_refuse():
    aws_plugin, tls_plugin = provider_plugin.Provider("aws"), provider_plugin.Provider("tls")
    good = {"ami": "ami-1", "metadataOptions": {"httpTokens": "required", "httpPutResponseHopLimit": 1}}
    passed = aws_plugin.Check(provider_pb2.CheckRequest(urn=INSTANCE_URN, news=_struct(good)), None)
    assert not passed.failures and json_format.MessageToDict(passed.inputs) == json_format.MessageToDict(_struct(good))
    refused = aws_plugin.Check(provider_pb2.CheckRequest(urn=INSTANCE_URN, news=_struct(
        {**good, "metadataOptions": {"httpTokens": "none"}})), None)
    assert [(f.property, f.reason) for f in refused.failures] == [
        ("metadataOptions.httpTokens", 'expected http_tokens to be one of ["optional" "required"], got none')]
    key_urn = "urn:pulumi:prod::gpu-swarm::tls:index/privateKey:PrivateKey::gpu-swarm-key"
    refused = tls_plugin.Check(provider_pb2.CheckRequest(urn=key_urn, news=_struct({"algorithm": "DSA"})), None)
    assert refused.failures[0].property == "algorithm" and 'got: "DSA"' in refused.failures[0].reason
