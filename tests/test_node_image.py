"""The node image's recipe (localswarm/node_image.py) and the machines' pure parts, without building or booting."""
from __future__ import annotations

import json
import subprocess

import pytest
import yaml

from localswarm import machines, node_image, nspawn, object_store, standins
from localswarm.network import BRIDGE_ADDR
from tests.tools import require_tool


@pytest.fixture
def ca(tmp_path):
    cert = tmp_path / "ca.crt"
    cert.write_text("-----BEGIN CERTIFICATE-----\nrehearsal\n-----END CERTIFICATE-----\n")
    return cert


def test_the_ami_configuration(ca):
    files = node_image.layer_files(ca)
    cloud = yaml.safe_load(files["/etc/cloud/cloud.cfg.d/90-gpu-swarm-rehearsal.cfg"][0])
    assert cloud["datasource_list"] == ["NoCloud"] and cloud["network"] == {"config": "disabled"}
    user = cloud["system_info"]["default_user"]
    assert (user["name"], user["sudo"], user["lock_passwd"]) == ("ubuntu", ["ALL=(ALL) NOPASSWD:ALL"], True)
    # What names the lane's bridge is each machine's own (machines.launch writes it), not the image's:
    # one image serves every lane.
    assert "/etc/docker/daemon.json" not in files and "/etc/resolv.conf" not in files
    lane = node_image.lane_files()
    daemon = json.loads(lane["etc/docker/daemon.json"])
    assert daemon["registry-mirrors"] == [f"http://{BRIDGE_ADDR}:5000"]
    assert daemon["insecure-registries"] == [f"{BRIDGE_ADDR}:5000"]
    assert daemon["log-opts"] == {"max-size": "1m"} and daemon["shutdown-timeout"] == 3
    assert f"nameserver {BRIDGE_ADDR}" in lane["etc/resolv.conf"]
    assert files["/etc/machine-id"][0] == b""
    assert files["/etc/locale.conf"][0] == b"LANG=C.UTF-8\n"  # as Ubuntu's cloud images set it
    assert files["/usr/local/share/ca-certificates/gpu-swarm-rehearsal-ca.crt"][0] == ca.read_bytes()
    assert set(standins.image_files()) <= set(files)
    assert {"apt-daily.timer", "apt-daily-upgrade.timer"} <= set(node_image.MASKED)
    assert {"cloud-init", "openssh-server", "python3"} <= set(node_image.PACKAGES)
    assert {"docker.io", "docker-cli", "containerd", "runc"} == set(node_image.ENGINE_PACKAGES)
    assert "python3-venv" not in node_image.PACKAGES  # as on plain Ubuntu: the agent's venv must not need it


def test_a_standin_change_rebuilds_only_the_layer(ca, monkeypatch):
    base, layer = node_image.base_dir(), node_image.layer_dir(node_image.layer_files(ca))
    assert layer == node_image.layer_dir(node_image.layer_files(ca))  # the same recipe, the same build
    files = standins.image_files()
    changed = {**files, "/usr/lib/gpu-swarm-rehearsal/nvidia-smi": (b"#!/bin/sh\n", 0o755)}
    monkeypatch.setattr(standins, "image_files", lambda: changed)
    assert node_image.base_dir() == base
    assert node_image.layer_dir(node_image.layer_files(ca)) != layer
    monkeypatch.setattr(node_image, "PACKAGES", node_image.PACKAGES + ("git",))
    assert node_image.base_dir() != base


def test_check_says_not_built_and_builds_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(node_image, "CACHE", tmp_path / "cache")
    monkeypatch.setattr(object_store, "CA_CERT", tmp_path / "no-ca.crt")
    assert node_image.main(["--check"]) == 1
    assert not (tmp_path / "cache").exists() and not (tmp_path / "no-ca.crt").exists()
    assert capsys.readouterr().out == ""


def test_machines_and_the_object_store_keep_their_state_together_apart_from_localswarm():
    assert object_store.STORE.parent == machines.STATE
    assert "localswarm" not in machines.STATE.parts


def test_lowerdir_puts_the_layer_over_the_base(tmp_path):
    image = node_image.Image(tmp_path / "base" / "rootfs", tmp_path / "node" / "layer")
    assert image.lowerdir == f"{tmp_path}/node/layer:{tmp_path}/base/rootfs"


def test_a_machine_hosts_file_names_itself_and_the_extra_hosts():
    m = machines.Machine("node-7", 7)
    text = machines.etc_hosts(m, "node-7", {"b.s3.us-east-1.amazonaws.com": BRIDGE_ADDR})
    lines = text.splitlines()
    assert lines[0] == "127.0.0.1\tlocalhost"
    assert f"{m.address}\tnode-7" in lines and f"{BRIDGE_ADDR}\tb.s3.us-east-1.amazonaws.com" in lines


def test_the_hardware_file_lists_the_gpus_in_index_order():
    gpus = [{"uuid": "GPU-1", "name": "A", "memory_mib": 1, "index": 0},
            {"uuid": "GPU-2", "name": "B", "memory_mib": 2}]
    description = json.loads(machines._hardware_json(gpus))
    assert [g["uuid"] for g in description["gpus"]] == ["GPU-1", "GPU-2"]
    assert "index" not in description["gpus"][0] and description["driver"]


def test_the_machine_launcher_passes_shellcheck(tmp_path):
    shellcheck = require_tool("shellcheck")
    (tmp_path / "launcher").write_text("#!/bin/sh\n" + nspawn.LAUNCHER)
    result = subprocess.run([shellcheck, "launcher"], cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


@pytest.mark.parametrize("name, index, message", [("bad_name", 1, "use a hostname"), ("Node-1", 1, "use a hostname"),
                                                  ("node-1", 245, "must be 0 to 244"), ("-x", 1, "use a hostname")])
def test_launch_refuses_names_and_indexes_that_cannot_be_a_machine(name, index, message):
    with pytest.raises(machines.RehearsalError, match=message):
        machines.launch(name, index, user_data="#cloud-config\n", meta_data={}, gpus=[])
