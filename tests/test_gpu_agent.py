"""Tests for the boot-time GPU agent (node/gpu_agent.py), without a GPU.

NVML is played by localswarm/standins/pynvml.py, nvidia-smi and nvidia-ctk by small
shell scripts on PATH. Each test gets a node root under tmp_path with its own
daemon.json and toolkit config, run in-process through main(argv) or as a
subprocess for the command-line contract.
"""
import importlib.util
import json
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
AGENT = ROOT / "node" / "gpu_agent.py"
FAKE_NVML_DIR = ROOT / "localswarm" / "standins"
UNIT = ROOT / "node" / "gpu-swarm-agent.service"
HOST_PATH = os.environ.get("PATH", os.defpath)  # node fixtures narrow PATH to their fake tools


def _load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


sys.path.insert(0, str(ROOT / "node"))  # the agent imports its siblings, as on a node
agent = _load("gpu_agent", AGENT)
fake_pynvml = _load("pynvml", FAKE_NVML_DIR / "pynvml.py")


def uuid(n, prefix="GPU"):
    return f"{prefix}-{n:08x}-1111-2222-3333-{n:012x}"


def gpu(n, name="NVIDIA H200", memory_mib=143771, **more):
    return {"uuid": uuid(n), "name": name, "memory_mib": memory_mib, **more}


def inventory_gpu(n, **more):
    return {"index": n, "uuid": uuid(n), "name": "NVIDIA H200", "memory_mib": 143771, "mig": False, **more}


TOOLKIT_CONFIG = """\
#accept-nvidia-visible-devices-as-volume-mounts = false
#accept-nvidia-visible-devices-envvar-when-unprivileged = true
disable-require = false
supported-driver-capabilities = "compat32,compute,display,graphics,ngx,utility,video"
#swarm-resource = "DOCKER_RESOURCE_GPU"

[nvidia-container-cli]
#debug = "/var/log/nvidia-container-toolkit.log"
environment = []
ldconfig = "@/sbin/ldconfig.real"
load-kmods = true

[nvidia-container-runtime]
#debug = "/var/log/nvidia-container-runtime.log"
log-level = "info"
mode = "auto"
runtimes = ["docker-runc", "runc", "crun"]

[nvidia-container-runtime.modes]

[nvidia-container-runtime.modes.cdi]
default-kind = "nvidia.com/gpu"
spec-dirs = ["/etc/cdi", "/var/run/cdi"]
"""
SWARM_LINE = 'swarm-resource = "DOCKER_RESOURCE_NVIDIA-GPU"\n'


class Node:
    """A fake node: file paths, a bin dir for fake tools, and ways to run the agent."""

    def __init__(self, tmp_path, monkeypatch):
        self.root = tmp_path
        self.daemon_json = tmp_path / "etc" / "docker" / "daemon.json"
        self.toolkit = tmp_path / "etc" / "nvidia-container-runtime" / "config.toml"
        self.toolkit.parent.mkdir(parents=True)
        self.bin = tmp_path / "bin"
        self.bin.mkdir()
        self.monkeypatch = monkeypatch
        monkeypatch.setenv("PATH", str(self.bin))
        self.set_nvml({"gpus": []})
        monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml)

    def set_nvml(self, node):
        self.nvml = node
        self.monkeypatch.setenv("FAKE_PYNVML", json.dumps(node))

    def no_pynvml(self):
        self.monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` fail

    def tool(self, name, script):
        path = self.bin / name
        path.write_text("#!/bin/sh\n" + script)
        path.chmod(0o755)

    def inventory(self, gpus):
        path = self.root / "inventory.json"
        path.write_text(json.dumps(gpus))
        return str(path)

    @property
    def runtime_config(self):
        return self.root / "etc" / "gpu-swarm" / "runtime.env"

    def paths(self):
        return ["--daemon-json", str(self.daemon_json), "--toolkit-config", str(self.toolkit),
                "--runtime-config", str(self.runtime_config), "--runtime-delegate", "/usr/bin/nvidia-container-runtime"]

    def run(self, capsys, *args, version="1.19.0"):
        """Run main() in-process; returns (exit code, report or None, stderr)."""
        extra = ["--toolkit-version", version] if version else []
        rc = agent.main([*self.paths(), "--json", *extra, *args])
        out, err = capsys.readouterr()
        return rc, (json.loads(out) if rc == 0 else None), err

    def cli(self, *args, pynvml=True):
        env = {"PATH": str(self.bin), "FAKE_PYNVML": json.dumps(self.nvml)}
        if pynvml:
            env["PYTHONPATH"] = str(FAKE_NVML_DIR)
        else:
            # Hide a real nvidia-ml-py too (the GPU machine has one), so "no pynvml" holds anywhere.
            hidden = self.bin.parent / "no-pynvml"
            hidden.mkdir(exist_ok=True)
            (hidden / "pynvml.py").write_text("raise ImportError('pynvml hidden by the test')\n")
            env["PYTHONPATH"] = str(hidden)
        env["PYTHONPATH"] += os.pathsep + str(ROOT / "node")
        return subprocess.run([sys.executable, str(AGENT), *self.paths(), *args],
                              capture_output=True, text=True, env=env, timeout=60)

    def daemon(self):
        return json.loads(self.daemon_json.read_text())

    def write_daemon(self, config):
        self.daemon_json.parent.mkdir(parents=True, exist_ok=True)
        self.daemon_json.write_text(config if isinstance(config, str) else json.dumps(config, indent=4))

    def snapshot(self):
        return {p: (p.read_bytes() if p.exists() else None) for p in (self.daemon_json, self.toolkit)}


@pytest.fixture
def node(tmp_path, monkeypatch):
    return Node(tmp_path, monkeypatch)


# --- the names the rest of the project imports -----------------------------------

def test_module_imports_without_pynvml():
    code = (f"import sys, importlib.util; sys.modules['pynvml'] = None; sys.path.insert(0, {str(AGENT.parent)!r}); "
            f"s = importlib.util.spec_from_file_location('a', {str(AGENT)!r}); m = importlib.util.module_from_spec(s); "
            "s.loader.exec_module(m); print(m.DEFAULT_KIND, m.resource_env_name(m.DEFAULT_KIND))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["NVIDIA-GPU", "DOCKER_RESOURCE_NVIDIA-GPU"]


def test_public_names():
    assert agent.DEFAULT_KIND == "NVIDIA-GPU"
    assert agent.validate_kind("Tesla_T4-x") == "Tesla_T4-x"
    assert agent.resource_env_name("nvidia-gpu") == "DOCKER_RESOURCE_NVIDIA-GPU"
    assert agent.resource_entries("NVIDIA-GPU", [uuid(1), uuid(2, "MIG")]) == [
        f"NVIDIA-GPU={uuid(1)}", f"NVIDIA-GPU={uuid(2, 'MIG')}"]
    assert agent.resource_entries("K", ["MIG-GPU-" + uuid(3)[4:] + "/1/0"]) == ["K=MIG-GPU-" + uuid(3)[4:] + "/1/0"]
    with pytest.raises(ValueError, match="not a full UUID"):
        agent.resource_entries("NVIDIA-GPU", ["GPU-be74ca1f"])


BAD_KINDS = ["", "NVIDIA GPU", "gpu=1", "GPU,X", "a" * 65, "gpü", "$(reboot)", "GPU/0", "GPU.1"]


@pytest.mark.parametrize("kind", BAD_KINDS)
def test_invalid_kind_is_refused_and_nothing_written(node, capsys, kind):
    node.toolkit.write_text(TOOLKIT_CONFIG)
    before = node.snapshot()
    with pytest.raises(ValueError, match="invalid GPU resource kind"):
        agent.validate_kind(kind)
    rc, _, err = node.run(capsys, "--inventory", node.inventory([inventory_gpu(0)]), f"--kind={kind}")
    assert rc == 2
    assert "--kind" in err and "letters, digits" in err
    assert node.snapshot() == before


# --- detection through (fake) NVML ------------------------------------------------

@pytest.mark.parametrize("count", [0, 1, 2, 8])
def test_nvml_gpu_counts(node, capsys, count):
    node.set_nvml({"gpus": [gpu(n) for n in range(count)]})
    rc, report, _ = node.run(capsys)
    assert rc == 0
    expected = [f"NVIDIA-GPU={uuid(n)}" for n in range(count)]
    assert report["resources"] == expected
    assert [g["index"] for g in report["gpus"]] == list(range(count))
    if count:
        assert node.daemon()["node-generic-resources"] == expected
        assert report["labels"]["gpu.count"] == str(count)
        assert node.daemon()["default-runtime"] == "gpu-swarm"
    else:
        assert not node.daemon_json.exists()  # nothing to advertise, nothing to remove
        assert report["labels"] == {}
        assert any("no GPUs found" in w for w in report["warnings"])


def test_nvml_labels(node, capsys):
    node.set_nvml({"driver": "580.159.04", "cuda": 12080,
                   "gpus": [gpu(0, name="NVIDIA H100 80GB HBM3", memory_mib=81559, compute=[9, 0])] * 1})
    rc, report, _ = node.run(capsys)
    assert rc == 0
    assert report["labels"] == {"gpu.count": "1", "gpu.product": "NVIDIA-H100-80GB-HBM3", "gpu.memory": "81559",
                                "gpu.driver": "580.159.04", "gpu.cuda": "12.8", "gpu.compute": "9.0"}
    assert node.daemon()["labels"] == [f"{k}={v}" for k, v in report["labels"].items()]
    assert report["gpus"] == [{"index": 0, "uuid": uuid(0), "name": "NVIDIA H100 80GB HBM3",
                               "memory_mib": 81559, "mig": False}]


def test_nvml_returning_bytes(node, capsys):
    node.set_nvml({"bytes": True, "gpus": [gpu(0)]})
    rc, report, _ = node.run(capsys)
    assert rc == 0
    assert report["resources"] == [f"NVIDIA-GPU={uuid(0)}"]
    assert report["labels"]["gpu.product"] == "NVIDIA-H200" and report["labels"]["gpu.driver"] == "580.159.04"


def test_mig_devices_are_advertised_instead_of_the_parent(node, capsys):
    mig = [{"uuid": uuid(10, "MIG"), "name": "NVIDIA H100 80GB HBM3 MIG 3g.40gb", "memory_mib": 40192},
           None, {"uuid": uuid(11, "MIG"), "name": "NVIDIA H100 80GB HBM3 MIG 3g.40gb", "memory_mib": 40192},
           None, None, None, None]
    node.set_nvml({"gpus": [gpu(0, mig_slots=mig), gpu(1), gpu(2, mig_slots=[None] * 7)]})
    rc, report, _ = node.run(capsys)
    assert rc == 0
    assert report["resources"] == [f"NVIDIA-GPU={uuid(10, 'MIG')}", f"NVIDIA-GPU={uuid(11, 'MIG')}",
                                   f"NVIDIA-GPU={uuid(1)}"]
    assert [(g["index"], g["mig"]) for g in report["gpus"]] == [(0, True), (0, True), (1, False)]
    assert any("GPU 2 is in MIG mode but has no MIG devices" in w for w in report["warnings"])


NVIDIA_SMI_OK = f"""\
case "$*" in
  *--query-gpu=index,uuid,name,memory.total*--format=csv,noheader,nounits*)
    printf '0, {uuid(0)}, NVIDIA H200, 143771\\n1, {uuid(1)}, NVIDIA H200, 143771\\n' ;;
  *) echo "unexpected arguments: $*" >&2; exit 64 ;;
esac
"""
NVIDIA_SMI_BROKEN = ("echo 'NVIDIA-SMI has failed because it could not communicate with the NVIDIA driver.'\n"
                     "exit 9\n")


def test_nvml_init_failure_falls_back_to_nvidia_smi(node, capsys):
    node.set_nvml({"init_error": "DriverNotLoaded", "gpus": []})
    node.tool("nvidia-smi", NVIDIA_SMI_OK)
    rc, report, _ = node.run(capsys)
    assert rc == 0
    assert report["resources"] == [f"NVIDIA-GPU={uuid(0)}", f"NVIDIA-GPU={uuid(1)}"]
    assert report["labels"] == {"gpu.count": "2", "gpu.product": "NVIDIA-H200", "gpu.memory": "143771"}
    assert any("DriverNotLoaded" in w and "nvidia-smi" in w for w in report["warnings"])


def test_nvml_and_nvidia_smi_both_failing_exit_3(node, capsys):
    node.set_nvml({"init_error": "DriverNotLoaded", "gpus": []})
    node.tool("nvidia-smi", NVIDIA_SMI_BROKEN)
    rc, _, err = node.run(capsys)
    assert rc == 3
    assert "fallback failed too" in err and "could not communicate" in err
    assert not node.daemon_json.exists() and not node.toolkit.exists()
    done = node.cli("--json")  # the same through the command line
    assert done.returncode == 3 and done.stdout == ""


def test_nvml_query_failure_without_nvidia_smi_exit_3(node, capsys):
    node.set_nvml({"query_error": True, "gpus": [gpu(0)]})
    rc, _, err = node.run(capsys)
    assert rc == 3 and "no nvidia-smi on PATH" in err


def test_nvml_truncated_uuid_is_an_error(node, capsys):
    node.set_nvml({"gpus": [{"uuid": "GPU-be74ca1f", "name": "Tesla T4", "memory_mib": 15360}]})
    rc, _, err = node.run(capsys)
    assert rc == 3 and "GPU-be74ca1f" in err
    assert not node.daemon_json.exists()


@pytest.mark.parametrize("missing", ["no pynvml", "no libnvidia-ml"])
def test_no_driver_means_no_gpus_not_failure(node, capsys, missing):
    node.write_daemon({"node-generic-resources": [f"NVIDIA-GPU={uuid(0)}"], "labels": ["gpu.count=1", "team=ml"]})
    if missing == "no pynvml":
        node.no_pynvml()
    else:
        node.set_nvml({"init_error": "LibraryNotFound", "gpus": []})
    rc, report, _ = node.run(capsys)
    assert rc == 0
    assert report["gpus"] == [] and report["changed"] is True
    assert any("no NVIDIA driver found" in w for w in report["warnings"])
    assert node.daemon() == {"labels": ["team=ml"]}


def test_pynvml_missing_uses_nvidia_smi(node, capsys):
    node.no_pynvml()
    node.tool("nvidia-smi", NVIDIA_SMI_OK)
    rc, report, _ = node.run(capsys)
    assert rc == 0 and len(report["resources"]) == 2


def test_pynvml_missing_and_nvidia_smi_failing_exit_3(node, capsys):
    node.no_pynvml()
    node.tool("nvidia-smi", NVIDIA_SMI_BROKEN)
    assert node.run(capsys)[0] == 3


def test_nvidia_smi_without_devices_means_no_gpus(node, capsys):
    node.no_pynvml()
    node.tool("nvidia-smi", "echo 'No devices were found'\nexit 6\n")
    rc, report, _ = node.run(capsys)
    assert rc == 0 and report["gpus"] == []


# --- daemon.json merge ------------------------------------------------------------

TWO = [f"NVIDIA-GPU={uuid(0)}", f"NVIDIA-GPU={uuid(1)}"]
NV_RUNTIME = {"path": "nvidia-container-runtime", "runtimeArgs": []}
GUARD = {"path": "/opt/gpu-swarm/software/gpu-swarm-runtime", "runtimeArgs": ["--gpu-swarm-config", "RUNTIME_CONFIG"]}
LABELS = ["gpu.count=2", "gpu.product=NVIDIA-H200", "gpu.memory=143771"]
MERGE_TABLE = {
    "empty": ({}, {"node-generic-resources": TWO, "labels": LABELS, "runtimes": {"nvidia": NV_RUNTIME, "gpu-swarm": GUARD},
                   "default-runtime": "gpu-swarm"}),
    "foreign keys kept in order": (
        {"data-root": "/data/docker", "log-driver": "json-file", "log-opts": {"max-size": "10m"},
         "registry-mirrors": ["https://mirror.example"], "insecure-registries": ["10.0.0.5:5000"],
         "features": {"buildkit": True}, "mtu": 9001},
        {"data-root": "/data/docker", "log-driver": "json-file", "log-opts": {"max-size": "10m"},
         "registry-mirrors": ["https://mirror.example"], "insecure-registries": ["10.0.0.5:5000"],
         "features": {"buildkit": True}, "mtu": 9001, "node-generic-resources": TWO, "labels": LABELS,
         "runtimes": {"nvidia": NV_RUNTIME, "gpu-swarm": GUARD}, "default-runtime": "gpu-swarm"}),
    "other runtimes kept, nvidia path kept": (
        {"runtimes": {"crun": {"path": "/usr/bin/crun"},
                      "nvidia": {"path": "/usr/local/bin/nvidia-container-runtime", "runtimeArgs": ["--x"]}}},
        {"runtimes": {"crun": {"path": "/usr/bin/crun"},
                      "nvidia": {"path": "/usr/local/bin/nvidia-container-runtime", "runtimeArgs": ["--x"]},
                      "gpu-swarm": GUARD},
         "node-generic-resources": TWO, "labels": LABELS, "default-runtime": "gpu-swarm"}),
    "nvidia runtime without path": (
        {"runtimes": {"nvidia": {"runtimeArgs": []}}, "default-runtime": "nvidia"},
        {"runtimes": {"nvidia": {"runtimeArgs": [], "path": "nvidia-container-runtime"}, "gpu-swarm": GUARD},
         "default-runtime": "gpu-swarm", "node-generic-resources": TWO, "labels": LABELS}),
    "old gpu labels replaced in place, others kept in order": (
        {"labels": ["zone=a", "gpu.count=8", "gpu.product=Tesla-V100", "team=ml", "gpuish=yes"]},
        {"labels": ["zone=a", LABELS[0], LABELS[1], "team=ml", "gpuish=yes", LABELS[2]], "node-generic-resources": TWO,
         "runtimes": {"nvidia": NV_RUNTIME, "gpu-swarm": GUARD}, "default-runtime": "gpu-swarm"}),
    "stale resources replaced in place": (
        {"debug": False, "node-generic-resources": ["NVIDIA-GPU=GPU-be74ca1f", "FPGA=fpga0"], "iptables": True},
        {"debug": False, "node-generic-resources": TWO, "iptables": True, "labels": LABELS,
         "runtimes": {"nvidia": NV_RUNTIME, "gpu-swarm": GUARD}, "default-runtime": "gpu-swarm"}),
    "swarm-friendly settings kept": (
        {"live-restore": False, "default-address-pools": [{"base": "10.20.0.0/16", "size": 24}],
         "exec-opts": ["native.cgroupdriver=systemd"]},
        {"live-restore": False, "default-address-pools": [{"base": "10.20.0.0/16", "size": 24}],
         "exec-opts": ["native.cgroupdriver=systemd"], "node-generic-resources": TWO, "labels": LABELS,
         "runtimes": {"nvidia": NV_RUNTIME, "gpu-swarm": GUARD}, "default-runtime": "gpu-swarm"}),
}


@pytest.mark.parametrize("before,after", MERGE_TABLE.values(), ids=MERGE_TABLE.keys())
def test_merge_keeps_what_the_agent_does_not_own(node, capsys, before, after):
    node.write_daemon(before)
    rc, report, _ = node.run(capsys, "--inventory", node.inventory([inventory_gpu(0), inventory_gpu(1)]))
    assert rc == 0
    after = json.loads(json.dumps(after).replace("RUNTIME_CONFIG", str(node.runtime_config)))
    assert node.daemon() == after
    assert list(node.daemon()) == list(after)  # key order kept, new keys appended


def test_the_health_watchers_labels_keep_their_place_and_a_rerun_changes_nothing(node, capsys):
    """The watcher appends gpu-swarm.condition* labels after the agent's; the next boot's agent
    must not move them (that would rewrite daemon.json and restart dockerd for nothing)."""
    inventory = node.inventory([inventory_gpu(0), inventory_gpu(1)])
    assert node.run(capsys, "--inventory", inventory)[0] == 0
    config = node.daemon()
    watcher = ["gpu-swarm.condition=healthy", "gpu-swarm.condition.reason=ok", "gpu-swarm.condition.gpu=-"]
    config["labels"] += watcher
    node.write_daemon(config)
    rc, report, _ = node.run(capsys, "--inventory", inventory)
    assert rc == 0 and report["changed"] is False
    assert node.daemon()["labels"] == [*LABELS, *watcher]


def test_other_default_runtime_is_replaced_with_a_warning(node, capsys):
    node.write_daemon({"default-runtime": "crun", "runtimes": {"crun": {"path": "/usr/bin/crun"}}})
    rc, report, _ = node.run(capsys, "--inventory", node.inventory([inventory_gpu(0)]))
    assert node.daemon()["default-runtime"] == "gpu-swarm"
    assert any("default-runtime was 'crun'" in w for w in report["warnings"])


def test_no_runtime_flag_advertises_without_the_nvidia_runtime(node, capsys):
    node.write_daemon({"runtimes": {"crun": {"path": "/usr/bin/crun"}}})
    rc, report, _ = node.run(capsys, "--inventory", node.inventory([inventory_gpu(0)]), "--no-runtime")
    assert rc == 0
    assert node.daemon() == {"runtimes": {"crun": {"path": "/usr/bin/crun"}},
                             "node-generic-resources": [f"NVIDIA-GPU={uuid(0)}"],
                             "labels": ["gpu.count=1", "gpu.product=NVIDIA-H200", "gpu.memory=143771"]}


def test_no_gpus_removes_resources_and_gpu_labels_only(node, capsys):
    node.write_daemon({"labels": ["zone=a", "gpu.count=2"], "node-generic-resources": TWO,
                       "runtimes": {"nvidia": NV_RUNTIME}, "default-runtime": "nvidia"})
    rc, report, _ = node.run(capsys, "--inventory", node.inventory([]))
    assert rc == 0 and report["resources"] == [] and report["files"]["daemon_json"] == "written"
    assert node.daemon() == {"labels": ["zone=a"], "runtimes": {"nvidia": NV_RUNTIME}, "default-runtime": "nvidia"}
    assert any("no GPUs found" in w for w in report["warnings"])


def test_kind_flows_into_both_files(node, capsys):
    rc, report, _ = node.run(capsys, "--inventory", node.inventory([inventory_gpu(0)]), "--kind", "h200_gpu")
    assert node.daemon()["node-generic-resources"] == [f"h200_gpu={uuid(0)}"]
    assert node.toolkit.read_text() == 'swarm-resource = "DOCKER_RESOURCE_H200_GPU"\n'


BAD_DAEMON_JSON = {
    "unparseable": '{"data-root": "/data",,}',
    "trailing garbage": '{"debug": true} x',
    "top level is a list": '["NVIDIA-GPU=GPU-1"]',
    "top level is a string": '"hello"',
    "resources not a list": '{"node-generic-resources": "NVIDIA-GPU=x"}',
    "resources hold a number": '{"node-generic-resources": [1]}',
    "labels is an object": '{"labels": {"zone": "a"}}',
    "runtimes is a list": '{"runtimes": ["nvidia"]}',
    "runtimes.nvidia is a string": '{"runtimes": {"nvidia": "nvidia-container-runtime"}}',
    "runtimes.nvidia.path is a number": '{"runtimes": {"nvidia": {"path": 7}}}',
    "default-runtime is a number": '{"default-runtime": 1}',
    "not utf-8": b'{"data-root": "\xff"}',
}


@pytest.mark.parametrize("content", BAD_DAEMON_JSON.values(), ids=BAD_DAEMON_JSON.keys())
def test_bad_daemon_json_is_refused_and_left_intact(node, capsys, content):
    node.daemon_json.parent.mkdir(parents=True)
    (node.daemon_json.write_bytes if isinstance(content, bytes) else node.daemon_json.write_text)(content)
    node.toolkit.write_text(TOOLKIT_CONFIG)
    before = node.snapshot()
    node.set_nvml({"gpus": [gpu(0)]})
    rc, _, err = node.run(capsys)
    assert rc == 2
    assert str(node.daemon_json) in err and "left untouched" in err
    assert node.snapshot() == before  # neither file touched
    assert sorted(os.listdir(node.daemon_json.parent)) == ["daemon.json"]  # no temp file left


def test_empty_daemon_json_counts_as_no_settings(node, capsys):
    node.write_daemon("")
    rc, report, _ = node.run(capsys, "--inventory", node.inventory([inventory_gpu(0)]))
    assert rc == 0 and node.daemon()["default-runtime"] == "gpu-swarm"


# --- inventories (simulated GPUs) -------------------------------------------------

BAD_INVENTORIES = {
    "not json": "[{",
    "not a list": json.dumps({"gpus": []}),
    "entry not an object": json.dumps(["GPU-1"]),
    "missing uuid": json.dumps([{"index": 0, "name": "H200", "memory_mib": 1}]),
    "missing name": json.dumps([{"index": 0, "uuid": uuid(0), "memory_mib": 1}]),
    "missing memory": json.dumps([{"index": 0, "uuid": uuid(0), "name": "H200"}]),
    "missing index": json.dumps([{"uuid": uuid(0), "name": "H200", "memory_mib": 1}]),
    "duplicate uuid": json.dumps([inventory_gpu(0), {**inventory_gpu(1), "uuid": uuid(0)}]),
    "not GPU- or MIG-": json.dumps([{**inventory_gpu(0), "uuid": "UUID-" + uuid(0)[4:]}]),
    "truncated uuid": json.dumps([{**inventory_gpu(0), "uuid": "GPU-be74ca1f"}]),
    "uuid not hex": json.dumps([{**inventory_gpu(0), "uuid": "GPU-zzzzzzzz-1111-2222-3333-444444444444"}]),
    "memory is text": json.dumps([{**inventory_gpu(0), "memory_mib": "141GB"}]),
    "negative index": json.dumps([{**inventory_gpu(0), "index": -1}]),
    "empty name": json.dumps([{**inventory_gpu(0), "name": " "}]),
    "mig not boolean": json.dumps([{**inventory_gpu(0), "mig": "yes"}]),
}


@pytest.mark.parametrize("content", BAD_INVENTORIES.values(), ids=BAD_INVENTORIES.keys())
def test_malformed_inventory_exit_2_and_nothing_written(node, capsys, content):
    path = node.root / "inventory.json"
    path.write_text(content)
    node.toolkit.write_text(TOOLKIT_CONFIG)
    before = node.snapshot()
    rc, _, err = node.run(capsys, "--inventory", str(path))
    assert rc == 2 and str(path) in err
    assert node.snapshot() == before


def test_missing_inventory_file_exit_2(node, capsys):
    rc, _, err = node.run(capsys, "--inventory", str(node.root / "nope.json"))
    assert rc == 2 and "nope.json" in err


def test_inventory_never_touches_nvml_or_nvidia_smi(node, capsys):
    node.set_nvml({"init_error": "DriverNotLoaded", "gpus": []})  # would exit 3 if asked
    node.tool("nvidia-smi", f"touch {node.root}/nvidia-smi-ran\nexit 9\n")
    mig = {**inventory_gpu(5), "uuid": uuid(5, "MIG"), "mig": True, "driver": "550.1", "compute": "8.0"}
    rc, report, _ = node.run(capsys, "--inventory", node.inventory([inventory_gpu(0), mig]))
    assert rc == 0 and not (node.root / "nvidia-smi-ran").exists()
    assert report["gpus"][1] == {k: v for k, v in mig.items() if k not in ("driver", "compute")}
    assert report["labels"]["gpu.driver"] == "550.1" and report["labels"]["gpu.compute"] == "8.0"


# --- idempotency, atomic writes, dry run ------------------------------------------

def test_second_run_changes_nothing(node, capsys):
    node.write_daemon({"data-root": "/data", "labels": ["zone=a"]})
    node.toolkit.write_text(TOOLKIT_CONFIG)
    node.set_nvml({"gpus": [gpu(0), gpu(1)]})
    rc, first, _ = node.run(capsys)
    assert rc == 0 and first["changed"] is True
    assert first["files"] == {"daemon_json": "written", "toolkit_config": "written", "runtime_config": "written"}
    written = node.snapshot()
    rc, second, _ = node.run(capsys)
    assert rc == 0 and second["changed"] is False
    assert second["files"] == {"daemon_json": "unchanged", "toolkit_config": "unchanged",
                                 "runtime_config": "unchanged"}
    assert node.snapshot() == written
    assert node.daemon_json.read_text() == json.dumps(node.daemon(), indent=2) + "\n"


def test_file_modes_are_kept(node, capsys):
    node.write_daemon({})
    node.daemon_json.chmod(0o600)
    node.toolkit.write_text(TOOLKIT_CONFIG)
    node.toolkit.chmod(0o640)
    rc, report, _ = node.run(capsys, "--inventory", node.inventory([inventory_gpu(0)]))
    assert report["files"] == {"daemon_json": "written", "toolkit_config": "written", "runtime_config": "written"}
    assert stat.S_IMODE(node.daemon_json.stat().st_mode) == 0o600
    assert stat.S_IMODE(node.toolkit.stat().st_mode) == 0o640


def test_new_daemon_json_and_its_dir_are_created_readable(node, capsys):
    rc, report, _ = node.run(capsys, "--inventory", node.inventory([inventory_gpu(0)]))
    assert rc == 0 and report["files"]["daemon_json"] == "written"
    assert stat.S_IMODE(node.daemon_json.stat().st_mode) == 0o644
    assert sorted(os.listdir(node.daemon_json.parent)) == ["daemon.json"]


def test_symlinked_daemon_json_stays_a_symlink(node, capsys):
    real = node.root / "real-daemon.json"
    real.write_text("{}")
    node.daemon_json.parent.mkdir(parents=True)
    node.daemon_json.symlink_to(real)
    node.run(capsys, "--inventory", node.inventory([inventory_gpu(0)]))
    assert node.daemon_json.is_symlink() and "node-generic-resources" in json.loads(real.read_text())


def test_dry_run_writes_nothing(node, capsys):
    node.toolkit.write_text(TOOLKIT_CONFIG)
    inventory = node.inventory([inventory_gpu(0)])
    before = node.snapshot()
    rc, report, _ = node.run(capsys, "--inventory", inventory, "--dry-run")
    assert rc == 0 and report["changed"] is True
    assert report["files"] == {"daemon_json": "would-change", "toolkit_config": "would-change",
                              "runtime_config": "would-change"}
    assert node.snapshot() == before and not node.daemon_json.parent.exists()
    node.run(capsys, "--inventory", inventory)
    rc, report, _ = node.run(capsys, "--inventory", inventory, "--dry-run")
    assert report["changed"] is False
    assert report["files"] == {"daemon_json": "unchanged", "toolkit_config": "unchanged",
                                 "runtime_config": "unchanged"}


# --- toolkit config ----------------------------------------------------------------

def test_toolkit_config_keeps_comments_and_sections(node, capsys):
    node.toolkit.write_text(TOOLKIT_CONFIG)
    node.run(capsys, "--inventory", node.inventory([inventory_gpu(0)]))
    # The commented default stays; the real key goes right below it; nothing else moves.
    comment = '#swarm-resource = "DOCKER_RESOURCE_GPU"\n'
    assert node.toolkit.read_text() == TOOLKIT_CONFIG.replace(comment, comment + SWARM_LINE)


def test_toolkit_config_without_commented_key(node, capsys):
    config = "# site settings\ndisable-require = false\n\n# CLI\n[nvidia-container-cli]\nload-kmods = true\n"
    node.toolkit.write_text(config)
    node.run(capsys, "--inventory", node.inventory([inventory_gpu(0)]))
    assert node.toolkit.read_text() == config.replace("false\n", "false\n" + SWARM_LINE, 1)


def test_toolkit_config_with_only_sections(node, capsys):
    config = "[nvidia-container-cli]\nload-kmods = true\n"
    node.toolkit.write_text(config)
    node.run(capsys, "--inventory", node.inventory([inventory_gpu(0)]))
    assert node.toolkit.read_text() == SWARM_LINE + "\n" + config


def test_toolkit_config_wrong_top_level_value_replaced(node, capsys):
    node.toolkit.write_text('swarm-resource = "DOCKER_RESOURCE_GPU"\n[nvidia-container-cli]\n')
    node.run(capsys, "--inventory", node.inventory([inventory_gpu(0)]))
    assert node.toolkit.read_text() == SWARM_LINE + "[nvidia-container-cli]\n"


def test_toolkit_config_misplaced_key_moved_to_top_level(node, capsys):
    misplaced = TOOLKIT_CONFIG.replace('log-level = "info"\n',
                                       'log-level = "info"\nswarm-resource = "DOCKER_RESOURCE_NVIDIA-GPU"\n')
    node.toolkit.write_text(misplaced)
    rc, report, _ = node.run(capsys, "--inventory", node.inventory([inventory_gpu(0)]))
    comment = '#swarm-resource = "DOCKER_RESOURCE_GPU"\n'
    assert node.toolkit.read_text() == TOOLKIT_CONFIG.replace(comment, comment + SWARM_LINE)
    assert any("removed swarm-resource from [nvidia-container-runtime]" in w for w in report["warnings"])


def test_toolkit_config_created_when_toolkit_dir_exists(node, capsys):
    rc, report, _ = node.run(capsys, "--inventory", node.inventory([inventory_gpu(0)]))
    assert report["files"]["toolkit_config"] == "written"
    assert node.toolkit.read_text() == SWARM_LINE


def test_toolkit_absent_is_reported_not_fatal(node, capsys):
    node.toolkit.parent.rmdir()
    rc, report, _ = node.run(capsys, "--inventory", node.inventory([inventory_gpu(0)]), "--no-runtime")
    assert rc == 0 and report["files"]["toolkit_config"] == "absent"
    assert any("not installed" in w for w in report["warnings"])
    assert not node.toolkit.parent.exists()


LEGACY_SECTION = 'mode = "auto"\n'


@pytest.mark.parametrize("version,legacy", [("1.17.8", False), ("1.18.0", True), ("1.18.1", True),
                                            ("1.18.2", True), ("1.18.3", False), ("1.19.0", False),
                                            ("1.20.0", False)])
def test_toolkit_1_18_mode_guard(node, capsys, version, legacy):
    node.toolkit.write_text(TOOLKIT_CONFIG)
    rc, report, _ = node.run(capsys, "--inventory", node.inventory([inventory_gpu(0)]), version=version)
    text = node.toolkit.read_text()
    runtime_section = text.split("[nvidia-container-runtime]\n")[1].split("\n\n")[0]
    assert ('mode = "legacy"' in runtime_section) is legacy
    assert ('mode = "auto"' in runtime_section) is not legacy
    assert "[nvidia-container-runtime.modes]\n" in text and text.count("mode = ") == 1
    assert any("toolkit#1599" in w for w in report["warnings"]) is legacy


def test_toolkit_mode_guard_creates_the_section(node, capsys):
    node.toolkit.write_text('disable-require = false\n[nvidia-container-cli]\nload-kmods = true')
    node.run(capsys, "--inventory", node.inventory([inventory_gpu(0)]), version="1.18.1")
    assert node.toolkit.read_text() == ('disable-require = false\n' + SWARM_LINE + '[nvidia-container-cli]\n'
                                        'load-kmods = true\n\n[nvidia-container-runtime]\nmode = "legacy"\n')


@pytest.mark.parametrize("version,legacy", [("1.18.1", True), ("1.19.0", False)])
def test_toolkit_version_read_from_nvidia_ctk(node, version, legacy):
    node.toolkit.write_text(TOOLKIT_CONFIG)
    node.tool("nvidia-ctk", f'[ "$1" = --version ] || exit 64\necho "NVIDIA Container Toolkit CLI version {version}"\n'
                            'echo "commit: 4c5f0ed4e4d3b6f6c3b1c4b5b0ad2c8f0b7e0a1d"\n')
    done = node.cli("--inventory", node.inventory([inventory_gpu(0)]), "--json")
    assert done.returncode == 0, done.stderr
    assert ('mode = "legacy"' in node.toolkit.read_text()) is legacy


def test_bad_toolkit_version_override(node, capsys):
    node.toolkit.write_text(TOOLKIT_CONFIG)
    assert node.run(capsys, "--inventory", node.inventory([inventory_gpu(0)]), version="latest")[0] == 2


# --- the command-line contract -----------------------------------------------------

def test_cli_json_report(node):
    node.set_nvml({"gpus": [gpu(0), gpu(1)], "cuda": 13000})
    node.toolkit.write_text(TOOLKIT_CONFIG)
    done = node.cli("--json", "--toolkit-version", "1.20.0")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert set(report) == {"gpus", "resources", "labels", "changed", "files", "warnings"}
    assert report["gpus"][0] == {"index": 0, "uuid": uuid(0), "name": "NVIDIA H200", "memory_mib": 143771,
                                 "mig": False}
    assert report["resources"] == TWO and report["labels"]["gpu.cuda"] == "13.0"
    assert report["changed"] is True and report["files"] == {"daemon_json": "written", "toolkit_config": "written", "runtime_config": "written"}
    again = json.loads(node.cli("--json", "--toolkit-version", "1.20.0").stdout)
    assert again["changed"] is False


def test_cli_human_summary_and_warnings_on_stderr(node):
    done = node.cli("--inventory", node.inventory([]), pynvml=False)
    assert done.returncode == 0
    assert "0 GPU device(s): none" in done.stdout
    assert f"{node.daemon_json}: unchanged" in done.stdout
    assert "warning: no GPUs found" in done.stderr and "warning" not in done.stdout


def test_cli_without_pynvml_or_nvidia_smi_is_a_gpu_less_node(node):
    done = node.cli("--json", pynvml=False)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["gpus"] == []


def test_cli_bad_input_message(node):
    node.write_daemon("{not json")
    done = node.cli("--inventory", node.inventory([inventory_gpu(0)]))
    assert done.returncode == 2
    assert str(node.daemon_json) in done.stderr and "Traceback" not in done.stderr
    assert node.daemon_json.read_text() == "{not json"


def test_cli_help_documents_the_flags():
    done = subprocess.run([sys.executable, str(AGENT), "--help"], capture_output=True, text=True, check=True)
    text = " ".join(done.stdout.split())
    for flag in ("--daemon-json", "--toolkit-config", "--kind", "--inventory", "--dry-run", "--json"):
        assert flag in text
    assert "advertise resources only: set no runtime" in text and "--slots-per-gpu K" in text


# --- the systemd unit the cloud-init installs -------------------------------------

def test_unit_runs_the_agent_before_docker_at_every_boot():
    text = UNIT.read_text()
    settings = {}
    for line in text.splitlines():
        if "=" in line and not line.startswith("#"):
            key, value = line.split("=", 1)
            settings.setdefault(key, []).append(value)
    assert settings["Type"] == ["oneshot"]
    assert "docker.service" in settings["Before"][0].split()
    assert "docker.service" in settings["WantedBy"][0].split()
    # The default comes first so that a missing node.env still gives a kind.
    assert settings["Environment"][0] == f"GPU_SWARM_KIND={agent.DEFAULT_KIND}"
    assert settings["EnvironmentFile"] == ["-/etc/gpu-swarm/node.env"]
    assert "/opt/gpu-swarm/venv/bin/python /opt/gpu-swarm/software/gpu_agent.py --json --kind" in settings["ExecStart"][0]
    assert "systemctl --no-block restart docker" in settings["ExecStartPost"][0]
    assert "RemainAfterExit" not in settings  # docker's restarts re-run the agent too


# --- the real dockerd accepts what the agent writes ---------------------------------

def _find_dockerd():
    path = os.environ.get("GPU_SWARM_DOCKERD") or shutil.which("dockerd", path=HOST_PATH)
    if not path:
        return None, "no dockerd found: set GPU_SWARM_DOCKERD to a dockerd >= 23 or put one on PATH"
    try:
        version = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30).stdout
    except OSError as e:
        return None, f"{path} does not run: {e}"
    match = re.search(r"version (\d+)\.", version)
    if not match or int(match.group(1)) < 23:
        return None, f"{path} reports {version.strip()!r}; `dockerd --validate` needs Docker >= 23"
    return path, None


@pytest.fixture(scope="module")
def dockerd():
    path, why = _find_dockerd()
    if path is None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must check daemon.json with a real dockerd: {why}")
        pytest.skip(why)
    return path


def dockerd_validate(dockerd, config_file):
    # dockerd --validate looks for docker-proxy on PATH; it sits beside dockerd.
    env = {**os.environ, "PATH": os.pathsep.join([str(Path(dockerd).parent), HOST_PATH])}
    return subprocess.run([dockerd, "--validate", "--config-file", str(config_file)],
                          capture_output=True, text=True, env=env, timeout=60)


def test_dockerd_validate_is_not_a_rubber_stamp(tmp_path, dockerd):
    config = tmp_path / "daemon.json"
    config.write_text('{"node-generic-resources": "NVIDIA-GPU=GPU-1"}')
    assert dockerd_validate(dockerd, config).returncode != 0


DOCKERD_CASES = {
    "with nvidia runtime": ({}, []),
    "no-runtime": ({}, ["--no-runtime"]),
    "merged into foreign keys": (MERGE_TABLE["foreign keys kept in order"][0], []),
    "other runtimes": (MERGE_TABLE["other runtimes kept, nvidia path kept"][0], []),
}


@pytest.mark.parametrize("before,flags", DOCKERD_CASES.values(), ids=DOCKERD_CASES.keys())
def test_dockerd_validates_generated_daemon_json(node, capsys, dockerd, before, flags):
    node.write_daemon(before)
    mig = {**inventory_gpu(9), "uuid": uuid(9, "MIG"), "mig": True}
    rc, _, _ = node.run(capsys, "--inventory", node.inventory([inventory_gpu(0), inventory_gpu(1), mig]), *flags)
    assert rc == 0
    done = dockerd_validate(dockerd, node.daemon_json)
    assert done.returncode == 0, f"dockerd --validate refused {node.daemon_json.read_text()}: {done.stderr}"
    assert "configuration OK" in done.stdout + done.stderr


# --- the runtime guard's settings, and shared GPUs ------------------------------------


def runtime_env(node) -> dict:
    return dict(line.split("=", 1) for line in node.runtime_config.read_text().splitlines()
                if line and not line.startswith("#"))


def test_the_guard_becomes_the_default_runtime_with_its_settings(node, capsys):
    rc, report, _ = node.run(capsys, "--inventory", node.inventory([inventory_gpu(0), inventory_gpu(1)]))
    assert rc == 0 and report["files"]["runtime_config"] == "written"
    daemon = node.daemon()
    assert daemon["default-runtime"] == "gpu-swarm"
    assert daemon["runtimes"]["gpu-swarm"] == {"path": "/opt/gpu-swarm/software/gpu-swarm-runtime",
                                               "runtimeArgs": ["--gpu-swarm-config", str(node.runtime_config)]}
    assert daemon["runtimes"]["nvidia"]["path"] == "nvidia-container-runtime"  # `docker run --runtime=nvidia`
    env = runtime_env(node)
    assert env["DELEGATE"] == "/usr/bin/nvidia-container-runtime" and env["KIND"] == "NVIDIA-GPU"
    assert env["GUARD"] == "/opt/gpu-swarm/software/gpu_guard.py"
    assert env["GPUS"] == f"{uuid(0)},{uuid(1)}" and env["SLOTS_PER_GPU"] == "0" and env["SHARED_KIND"] == ""
    assert env["ALLOW_DOCKER_RUN_GPUS"] == "true"
    # The guard reads the same file the same way the sh front sources it.
    import gpu_guard
    assert gpu_guard.read_settings(str(node.runtime_config))["GPUS"] == env["GPUS"]
    sourced = subprocess.run(["/bin/sh", "-c", '. "$1"; echo "$DELEGATE|$GPUS"', "-", str(node.runtime_config)],
                             capture_output=True, text=True, check=True).stdout.strip()
    assert sourced == f"{env['DELEGATE']}|{env['GPUS']}"


def test_new_gpus_rewrite_the_guards_settings(node, capsys):
    node.run(capsys, "--inventory", node.inventory([inventory_gpu(0)]))
    rc, report, _ = node.run(capsys, "--inventory", node.inventory([inventory_gpu(3)]))
    assert report["files"]["runtime_config"] == "written" and runtime_env(node)["GPUS"] == uuid(3)


def test_a_shared_pool_advertises_slots_only(node, capsys):
    rc, report, _ = node.run(capsys, "--inventory", node.inventory([inventory_gpu(0), inventory_gpu(1)]),
                             "--slots-per-gpu", "4")
    assert rc == 0
    slots = [f"NVIDIA-GPU-SHARED={uuid(g)}-s{n}" for n in range(4) for g in (0, 1)]  # spread first: see slot_entries
    assert node.daemon()["node-generic-resources"] == slots == report["resources"]
    assert not any(r.startswith("NVIDIA-GPU=") for r in report["resources"])  # never advertised both ways
    assert report["labels"]["gpu.sharing"] == "time-slicing" and report["labels"]["gpu.replicas"] == "4"
    env = runtime_env(node)
    assert (env["SHARED_KIND"], env["SLOTS_PER_GPU"]) == ("NVIDIA-GPU-SHARED", "4")
    assert node.toolkit.read_text().count('swarm-resource = "DOCKER_RESOURCE_NVIDIA-GPU"') == 1


def test_a_gpu_not_in_default_compute_mode_is_not_shared(node, capsys):
    exclusive = inventory_gpu(1, compute_mode=3)  # EXCLUSIVE_PROCESS
    rc, report, _ = node.run(capsys, "--inventory", node.inventory([inventory_gpu(0), exclusive]),
                             "--slots-per-gpu", "2")
    assert rc == 0
    assert report["resources"] == [f"NVIDIA-GPU-SHARED={uuid(0)}-s0", f"NVIDIA-GPU-SHARED={uuid(0)}-s1"]
    assert report["labels"]["gpu.sharing"] == "refused-compute-mode"
    assert any(f"GPU {uuid(1)} is in compute mode 3, not Default" in w and "-c DEFAULT" in w for w in report["warnings"])


def test_nvml_reports_the_compute_mode(node, capsys):
    node.set_nvml({"gpus": [gpu(0, compute_mode=0), gpu(1)]})
    rc, report, _ = node.run(capsys)
    assert report["gpus"][0]["compute_mode"] == 0 and "compute_mode" not in report["gpus"][1]


@pytest.mark.parametrize("args, message", [
    (["--slots-per-gpu", "1"], "must be from 2 to 48"),
    (["--slots-per-gpu", "49"], "must be from 2 to 48"),
    (["--slots-per-gpu", "2", "--shared-kind", "NVIDIA-GPU"], "must differ from --kind"),
    (["--slots-per-gpu", "2", "--shared-kind", "GPU SLOTS"], "invalid GPU resource kind"),
])
def test_bad_sharing_flags_write_nothing(node, capsys, args, message):
    rc, _, err = node.run(capsys, "--inventory", node.inventory([inventory_gpu(0)]), *args)
    assert rc == 2 and message in err
    assert not node.daemon_json.exists() and not node.runtime_config.exists()


def test_sharing_settings_come_from_node_env(node):
    env = {"PATH": str(node.bin), "PYTHONPATH": f"{FAKE_NVML_DIR}{os.pathsep}{ROOT / 'node'}",
           "GPU_SWARM_KIND": "GPU", "GPU_SWARM_SLOTS_PER_GPU": "3", "FAKE_PYNVML": json.dumps({"gpus": []})}
    done = subprocess.run([sys.executable, str(AGENT), *node.paths(), "--json",
                           "--inventory", node.inventory([inventory_gpu(0)]), "--toolkit-version", "1.19.0"],
                          capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["resources"] == [f"GPU-SHARED={uuid(0)}-s{n}" for n in range(3)]
