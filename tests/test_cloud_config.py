"""The user data every node boots with, as the program renders it for each example stack: real cloud-init accepts it.

Each kind of node's #cloud-config is kept as a snapshot in tests/snapshots/, with the bundle's
hash and URL (which change with every edit of node/) replaced by placeholders: any other
change to what a node boots with shows in review as a diff. UPDATE_SNAPSHOTS=1 rewrites them.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from to_node import software as node_software
from components.cloud_config import USER_DATA_LIMIT, render_cloud_config
from to_node.software import NodeRelease
from tests.conftest import REPO, is_secret, request_inputs, run_program, stack_config, unwrap
from tests.tools import require_tool

SNAPSHOTS = Path(__file__).resolve().parent / "snapshots"
STACKS = sorted(p.name[len("Pulumi."):-len(".yaml")] for p in REPO.glob("Pulumi.*.yaml"))


def user_data_of(stack: str) -> dict[str, str]:
    """Each pool's user data, as the program hands it to aws.ec2.Instance (or, for a persistent spot pool, to its
    aws.ec2.SpotInstanceRequest): one per pool, as its nodes boot alike but for their own host key (which the
    snapshot leaves out)."""
    run = run_program(stack_config(stack), stack=stack)
    out = {}
    for request in run.monitor.requests.values():
        if request.type in ("aws:ec2/instance:Instance", "aws:ec2/spotInstanceRequest:SpotInstanceRequest"):
            inputs = request_inputs(request)
            assert is_secret(inputs["userData"]), "the user data holds the node's private host key"
            text = unwrap(inputs["userData"])
            out.setdefault(inputs["tags"]["gpu-swarm:pool"], {})[_without_host_key(text)] = text
    assert all(len(texts) == 1 for texts in out.values()), "the nodes of one pool boot with the same user data"
    return {pool: next(iter(texts.values())) for pool, texts in out.items()}


def _without_host_key(text: str) -> str:
    text = re.sub(r"-----BEGIN OPENSSH PRIVATE KEY-----\n[\s\S]*?-----END OPENSSH PRIVATE KEY-----", "<host key>", text)
    return re.sub(r"ssh-ed25519 [A-Za-z0-9+/=]+", "ssh-ed25519 <host key>", text)


@pytest.fixture(scope="module")
def rendered() -> dict[tuple[str, str], str]:
    return {(stack, pool): text for stack in STACKS for pool, text in user_data_of(stack).items()}


def _normalized(text: str) -> str:
    text = _without_host_key(re.sub(r"[0-9a-f]{64}", "<sha256>", text))
    return re.sub(r"https://[\w.-]+\.s3\.[\w-]+\.amazonaws\.com/", "https://<bucket>/", text)


def test_every_example_stacks_user_data_is_valid_for_real_cloud_init(rendered, tmp_path):
    cloud_init = require_tool("cloud-init")
    for (stack, pool), text in rendered.items():
        path = tmp_path / f"{stack}-{pool}"
        path.write_text(text)
        result = subprocess.run([cloud_init, "schema", "--config-file", str(path)], capture_output=True, text=True)
        assert result.returncode == 0, f"{stack}/{pool}: {result.stdout}{result.stderr}"


def test_it_starts_with_the_header_and_fits_ec2s_limit(rendered):
    for (stack, pool), text in rendered.items():
        assert text.startswith("#cloud-config\n"), (stack, pool)  # cloud-init ignores the document otherwise
        assert len(text.encode()) <= USER_DATA_LIMIT, (stack, pool)
        assert text.isascii()  # plain text: compressed bytes would differ by the operator's zlib and OS


def test_it_matches_its_snapshot(rendered):
    update = os.environ.get("UPDATE_SNAPSHOTS") == "1"
    for (stack, pool), text in rendered.items():
        path = SNAPSHOTS / f"cloud-config-{stack}-{pool}.yaml"
        if update:
            path.write_text(_normalized(text))
        assert path.exists(), f"no snapshot {path.name}: run UPDATE_SNAPSHOTS=1 pytest {__file__}"
        assert _normalized(text) == path.read_text(), f"{path.name} changed: review the diff, then UPDATE_SNAPSHOTS=1"
    # Every snapshot is still some pool's: one the program no longer renders would go unchecked.
    kept = {f"cloud-config-{stack}-{pool}.yaml" for stack, pool in rendered}
    assert {p.name for p in SNAPSHOTS.glob("cloud-config-*.yaml")} == kept


def test_it_writes_the_nodes_files_and_runs_the_installer_once(rendered):
    for (stack, pool), text in rendered.items():
        doc = yaml.safe_load(text)
        paths = {f["path"]: f for f in doc["write_files"]}
        assert paths[node_software.INSTALLER_PATH]["permissions"] == "0755"
        assert set(paths) == {node_software.UNATTENDED_CONFIG, node_software.SSHD_CONFIG, node_software.NODE_ENV_PATH,
                              node_software.RELEASE_ENV_PATH, node_software.INSTALLER_PATH}
        assert doc["runcmd"] == [[node_software.INSTALLER_PATH]]
        release = dict(line.split("=", 1) for line in paths[node_software.RELEASE_ENV_PATH]["content"].splitlines())
        assert release["GPU_SWARM_BUNDLE_SHA256"] == node_software.bundle_sha256()
        assert release["GPU_SWARM_BUNDLE_URL"].endswith(node_software.bundle_key(node_software.bundle_sha256()))


def test_it_keeps_unattended_upgrades_off_nvidia_packages_from_the_first_boot(rendered):
    for text in rendered.values():
        (entry,) = [f for f in yaml.safe_load(text)["write_files"] if f["path"] == node_software.UNATTENDED_CONFIG]
        assert "Unattended-Upgrade::Package-Blacklist" in entry["content"]
        for package in ("nvidia-", "libnvidia-", "linux-modules-nvidia-"):
            assert f'"{package}";' in entry["content"]


def test_every_node_takes_the_fan_out_of_pulumi_up_through_its_sshd(rendered):
    """sshd's default MaxStartups 10:30:100 refuses handshakes from 10 at once; a manager carries every worker's."""
    for text in rendered.values():
        (entry,) = [f for f in yaml.safe_load(text)["write_files"] if f["path"] == node_software.SSHD_CONFIG]
        assert "\nMaxStartups 256:30:1024\n" in entry["content"]


def test_same_bytes_in_any_process_and_hash_seed():
    code = ("import sys; from to_node import software as n; from components.cloud_config import render_cloud_config as r; "
            "sys.stdout.write(r(n.NodeRelease('https://b.s3.us-east-1.amazonaws.com/x.tar', n.bundle_sha256(), "
            "{'GPU_SWARM_KIND': 'NVIDIA-GPU'}, ('install-docker',))))")
    outputs = {subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True,
                              env={**os.environ, "PYTHONHASHSEED": seed}).stdout for seed in ("1", "2")}
    assert len(outputs) == 1


def test_user_data_over_ec2s_limit_is_refused_before_anything_is_created(monkeypatch):
    big = NodeRelease("https://b.s3.us-east-1.amazonaws.com/x.tar", node_software.bundle_sha256(),
                      {"GPU_SWARM_KIND": "NVIDIA-GPU", "GPU_SWARM_X": "x" * (USER_DATA_LIMIT + 1)}, ("install-docker",))
    with pytest.raises(ValueError, match="over EC2's 16384"):
        render_cloud_config(big)
