"""EFA on the node: the agent's efa.count label, and install-efa.sh run in real bash against fakes.

The kernel's view is a fake /sys/class/infiniband (devices whose driver links to `efa`), the
installer a tarball made here, whose sha256 a copy of versions.env pins. Real EFA hardware
was not available: docs/the report say what remains to be seen on a p4d/p5.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import tarfile
from pathlib import Path

import pytest

from tests.test_gpu_agent import Node as AgentNode
from tests.test_gpu_agent import inventory_gpu
from tests.test_shell_scripts import Node

NODE_SRC = Path(__file__).resolve().parents[1] / "node"


def fake_sysfs(root: Path, efa: int, other: int = 0) -> Path:
    """/sys/class/infiniband with `efa` EFA devices and `other` RDMA devices of another driver (mlx5)."""
    sysfs, drivers = root / "sys" / "class" / "infiniband", root / "sys" / "bus" / "pci" / "drivers"
    for driver in ("efa", "mlx5_core"):
        (drivers / driver).mkdir(parents=True, exist_ok=True)
    sysfs.mkdir(parents=True, exist_ok=True)
    for i in range(efa + other):
        device = sysfs / f"rdmap{16 + i}s0" / "device"
        device.mkdir(parents=True)
        (device / "driver").symlink_to(drivers / ("efa" if i < efa else "mlx5_core"))
    return sysfs


# ---------------------------------------------------------------- the agent's label


@pytest.fixture
def agent(tmp_path, monkeypatch):
    return AgentNode(tmp_path, monkeypatch)


def test_a_node_with_efa_is_labelled_with_its_count_and_other_rdma_devices_do_not_count(agent, capsys, tmp_path):
    sysfs = fake_sysfs(tmp_path, efa=4, other=1)
    rc, report, err = agent.run(capsys, "--inventory", agent.inventory([inventory_gpu(0)]), "--efa-sysfs", str(sysfs))
    assert rc == 0, err
    assert report["labels"]["efa.count"] == "4"
    assert "efa.count=4" in agent.daemon()["labels"]


def test_a_node_without_efa_has_no_efa_label_and_a_stale_one_goes(agent, capsys, tmp_path):
    agent.write_daemon({"labels": ["efa.count=32", "team=ml"]})
    rc, report, err = agent.run(capsys, "--inventory", agent.inventory([inventory_gpu(0)]),
                                "--efa-sysfs", str(tmp_path / "none"))
    assert rc == 0, err
    labels = agent.daemon()["labels"]
    assert "team=ml" in labels and not [label for label in labels if label.startswith("efa.")]


def test_the_efa_label_keeps_its_place_and_a_rerun_changes_nothing(agent, capsys, tmp_path):
    sysfs = fake_sysfs(tmp_path, efa=2)
    args = ("--inventory", agent.inventory([inventory_gpu(0)]), "--efa-sysfs", str(sysfs))
    assert agent.run(capsys, *args)[0] == 0
    first = agent.daemon_json.read_text()
    rc, report, _ = agent.run(capsys, *args)
    assert rc == 0 and report["changed"] is False and agent.daemon_json.read_text() == first


# ---------------------------------------------------------------- install-efa.sh

INSTALLED = ("ii efa\\nii efa-config\\nii libfabric-aws\\nii libfabric-aws-bin\\nii openmpi40-aws\\nii rdma-core\\n"
             "ii ibverbs-providers\\nii libibverbs1\\nii librdmacm1\\nii python3\\nii linux-aws\\n")


@pytest.fixture
def node(tmp_path) -> Node:
    n = Node(tmp_path)
    n.real_step("install-efa")
    for helper in ("efa_detect.py", "contract.py"):  # the step reads the devices as the agent does
        shutil.copy(NODE_SRC / helper, n.steps / helper)
    n.fake("dpkg-query", f"printf '{INSTALLED}'")
    n.fake("apt-mark", "exit 0")
    n.fake("modprobe", "exit 0")
    n.efa_dir = tmp_path / "opt" / "amazon" / "efa"
    return n


def working_fi_info(node: Node) -> None:
    node.write(node.efa_dir / "bin" / "fi_info", '#!/bin/sh\necho "fi_info $*" >>"$FAKE_CALLS"\nexit 0\n')
    node.write(node.efa_dir.parent / "efa_installed_packages", "# EFA installer version: 1.38.1\n")


def env(node: Node, sysfs: Path, want: int, **more) -> dict[str, str]:
    return {"GPU_SWARM_EFA_INTERFACES": str(want), "EFA_SYSFS": str(sysfs), "EFA_INSTALLER_DIR": str(node.efa_dir),
            **more}


def test_a_working_efa_is_kept_held_and_checked(node, tmp_path):
    """The Deep Learning AMI ships EFA: like a working driver, it stays, and is held."""
    working_fi_info(node)
    result = node.bootstrap("install-efa", **env(node, fake_sysfs(tmp_path, efa=4), 4))
    assert result.returncode == 0, node.log.read_text()
    assert node.statuses() == {"install-efa": "skipped"}
    assert "EFA: 4 device(s), libfabric's efa provider answers" in node.log.read_text()
    assert [c for c in node.called() if c.startswith("apt-mark")] == [
        "apt-mark hold efa efa-config libfabric-aws libfabric-aws-bin openmpi40-aws rdma-core ibverbs-providers "
        "libibverbs1 librdmacm1"]


def test_a_node_showing_fewer_efa_devices_than_its_type_has_fails_naming_both(node, tmp_path):
    working_fi_info(node)
    result = node.bootstrap("install-efa", **env(node, fake_sysfs(tmp_path, efa=1), 32))
    assert result.returncode == 1
    assert "the kernel shows 1 EFA device(s)" in node.log.read_text()
    assert "this instance type has 32" in node.log.read_text()


def installer_tarball(tmp_path: Path, script: str) -> tuple[Path, str]:
    data = io.BytesIO()
    with tarfile.open(fileobj=data, mode="w:gz") as tar:
        body = script.encode()
        info = tarfile.TarInfo("aws-efa-installer/efa_installer.sh")
        info.size, info.mode = len(body), 0o755
        tar.addfile(info, io.BytesIO(body))
    path = tmp_path / "aws-efa-installer.tar.gz"
    path.write_bytes(data.getvalue())
    return path, hashlib.sha256(data.getvalue()).hexdigest()


def versions_pinning(node: Node, tmp_path: Path, sha: str) -> str:
    text = (NODE_SRC / "versions.env").read_text()
    text = "".join(f"EFA_INSTALLER_SHA256={sha}\n" if line.startswith("EFA_INSTALLER_SHA256=") else line + "\n"
                   for line in text.splitlines())
    path = tmp_path / "versions.env"
    path.write_text(text)
    return str(path)


def test_the_installer_is_downloaded_checked_against_its_sha256_run_and_held(node, tmp_path):
    sysfs = tmp_path / "sysfs-after-install"
    installer = f"""#!/bin/sh
echo "efa_installer.sh $*" >>"$FAKE_CALLS"
mkdir -p "$EFA_INSTALLER_DIR/bin"
printf '#!/bin/sh\\nexit 0\\n' >"$EFA_INSTALLER_DIR/bin/fi_info"; chmod +x "$EFA_INSTALLER_DIR/bin/fi_info"
# the kernel module it loads shows the instance's two EFA interfaces
mkdir -p {sysfs}/drivers/efa
for i in 0 1; do mkdir -p {sysfs}/class/rdmap$i/device; ln -s {sysfs}/drivers/efa {sysfs}/class/rdmap$i/device/driver; done
"""
    tarball, sha = installer_tarball(tmp_path, installer)
    node.fake("curl", f'out=""; while [ $# -gt 0 ]; do [ "$1" = -o ] && out=$2; shift; done; cp {tarball} "$out"')
    node.fake("apt-get", "exit 0")
    result = node.bootstrap("install-efa", **env(node, sysfs / "class", 2,
                                                 GPU_SWARM_VERSIONS=versions_pinning(node, tmp_path, sha)))
    assert result.returncode == 0, node.log.read_text()
    calls = node.called()
    assert any(c.startswith("curl ") and "aws-efa-installer-1.41.0.tar.gz" in c for c in calls)
    assert "efa_installer.sh -y" in calls
    assert calls.index("efa_installer.sh -y") < next(i for i, c in enumerate(calls) if c.startswith("apt-mark hold"))
    assert node.statuses() == {"install-efa": "done"}


def test_an_installer_that_is_not_the_pinned_one_never_runs(node, tmp_path):
    tarball, _ = installer_tarball(tmp_path, '#!/bin/sh\necho "efa_installer.sh $*" >>"$FAKE_CALLS"\n')
    node.fake("curl", f'out=""; while [ $# -gt 0 ]; do [ "$1" = -o ] && out=$2; shift; done; cp {tarball} "$out"')
    result = node.bootstrap("install-efa", **env(node, fake_sysfs(tmp_path, efa=2), 2))
    assert result.returncode == 1
    assert "does not have the sha256 pinned in versions.env" in node.log.read_text()
    assert not [c for c in node.called() if c.startswith("efa_installer.sh")]


def test_the_pinned_installer_is_the_one_versions_env_names():
    versions = dict(line.split("=", 1) for line in (NODE_SRC / "versions.env").read_text().splitlines()
                    if line and not line.startswith("#"))
    assert versions["EFA_INSTALLER_VERSION"] == "1.41.0"
    assert len(versions["EFA_INSTALLER_SHA256"]) == 64 and int(versions["EFA_INSTALLER_SHA256"], 16) >= 0


def test_efa_detect_runs_as_the_step_runs_it(tmp_path):
    import subprocess
    import sys
    sysfs = fake_sysfs(tmp_path, efa=3, other=2)
    done = subprocess.run([sys.executable, str(NODE_SRC / "efa_detect.py"), str(sysfs)], capture_output=True,
                          text=True, check=True, env={**os.environ, "PYTHONPATH": str(NODE_SRC)})
    assert done.stdout.strip() == "3"
    assert json.loads(json.dumps({"n": int(done.stdout)})) == {"n": 3}
