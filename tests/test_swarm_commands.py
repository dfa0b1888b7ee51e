"""The swarm command builders: checked as strings, by shellcheck, and run in real bash.

The local rehearsal's integration tests run the same scripts against real engines;
here a fake `docker` on PATH records what they would do on a node.
"""
from __future__ import annotations

import json
import subprocess

import pytest

from swarm import commands
from swarm.commands import NodePaths
from tests.tools import require_tool

NODE_ID = "abcdefghijklmnopqrstuvwxy"
KIND = "NVIDIA-GPU"


def all_scripts() -> dict[str, str]:
    return {
        "init": commands.init_swarm("10.0.0.5"),
        "tokens": commands.read_join_tokens(),
        "wait": commands.wait_for_node(expected_gpus=2, kind=KIND),
        "join": commands.join_swarm(role="worker", manager_addr="10.0.0.5", advertise_addr="10.0.1.7",
                                    expected_gpus=8, kind=KIND),
        "label": commands.label_node(NODE_ID, {"gpu-swarm.pool": "h100"}, expected_gpus=8, kind=KIND),
        "remove": commands.remove_node(NODE_ID),
        "deploy": commands.deploy_stack("smoke", "/home/ubuntu/stacks/smoke.yml"),
        "rm": commands.remove_stack("smoke"),
        "timings": commands.read_bootstrap_timings(),
    }


@pytest.mark.parametrize("call, message", [
    (lambda: commands.init_swarm("10.0.0.500"), "expected an IP address"),
    (lambda: commands.init_swarm("10.0.0.1; rm -rf /"), "expected an IP address"),
    (lambda: commands.join_swarm(role="boss", manager_addr="10.0.0.1", advertise_addr="10.0.0.2",
                                 expected_gpus=0, kind=KIND), "role must be"),
    (lambda: commands.join_swarm(role="worker", manager_addr="manager", advertise_addr="10.0.0.2",
                                 expected_gpus=0, kind=KIND), "expected an IP address"),
    (lambda: commands.wait_for_node(expected_gpus=-1, kind=KIND), "expected_gpus must be >= 0"),
    (lambda: commands.wait_for_node(expected_gpus=1, kind="NVIDIA GPU"), "invalid GPU resource kind"),
    (lambda: commands.label_node("node-1", {}, expected_gpus=0, kind=KIND), "25-character swarm node ID"),
    (lambda: commands.label_node(NODE_ID, {"bad key": "x"}, expected_gpus=0, kind=KIND), "label key"),
    (lambda: commands.remove_node("$(reboot)"), "25-character swarm node ID"),
    (lambda: commands.deploy_stack("My Stack", "/tmp/s.yml"), "stack name 'My Stack' is not valid"),
    (lambda: commands.remove_stack("x;y"), "is not valid"),
])
def test_bad_values_are_refused_before_any_shell_is_built(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_join_token_travels_on_stdin_not_in_the_command():
    script = all_scripts()["join"]
    assert "SWMTKN" not in script
    assert "IFS= read -r token" in script
    assert 'docker swarm join --token "$token" --advertise-addr 10.0.1.7 10.0.0.5:2377' in script


def test_values_with_shell_metacharacters_are_quoted():
    script = commands.deploy_stack("smoke", "/tmp/my stacks/$(x).yml")
    assert "'/tmp/my stacks/$(x).yml'" in script
    label = commands.label_node(NODE_ID, {"gpu-swarm.pool": "a b;c"}, expected_gpus=0, kind=KIND)
    assert "--label-add 'gpu-swarm.pool=a b;c'" in label


def test_every_script_passes_shellcheck():
    require_tool("shellcheck")
    for name, script in all_scripts().items():
        proc = subprocess.run(["shellcheck", "-s", "bash", "-"], input=script, capture_output=True, text=True)
        assert proc.returncode == 0, f"{name}:\n{proc.stdout}"


def test_advertised_gpus_reads_node_inspect_json():
    text = json.dumps([
        {"NamedResourceSpec": {"Kind": KIND, "Value": "GPU-b"}},
        {"NamedResourceSpec": {"Kind": "OTHER", "Value": "x"}},
        {"DiscreteResourceSpec": {"Kind": "SSD", "Value": 1}},
        {"NamedResourceSpec": {"Kind": KIND, "Value": "GPU-a"}},
    ])
    assert commands.advertised_gpus(text, KIND) == ["GPU-a", "GPU-b"]
    assert commands.advertised_gpus("null\n", KIND) == []


# --- real bash against a fake node ---------------------------------------------------------

FAKE_DOCKER = """#!/bin/sh
echo "$*" >> "$FAKE_LOG"
case "$*" in
  "info --format {{.Swarm.LocalNodeState}}") cat "$FAKE_STATE" ;;
  "info --format {{.Swarm.NodeID}}") echo abcdefghijklmnopqrstuvwxy ;;
  "info --format {{.Swarm.ControlAvailable}}") echo true ;;
  info) ;;
  "swarm join"*|"swarm init"*) echo active > "$FAKE_STATE" ;;
esac
"""


@pytest.fixture
def node(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "docker").write_text(FAKE_DOCKER)
    (bin_dir / "docker").chmod(0o755)
    (tmp_path / "state").write_text("inactive\n")
    paths = NodePaths(daemon_json=str(tmp_path / "daemon.json"), bootstrap_log=str(tmp_path / "bootstrap.log"),
                      bootstrap_done=str(tmp_path / "done"), bootstrap_failed=str(tmp_path / "failed"),
                      wait_for_cloud_init=False)
    (tmp_path / "bootstrap.log").write_text("step install-docker: done\nstep install-gpu-agent: FAILED\n")

    def run(script: str, stdin: str = "") -> subprocess.CompletedProcess:
        env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "FAKE_LOG": str(tmp_path / "calls"),
               "FAKE_STATE": str(tmp_path / "state")}
        return subprocess.run(["bash", "-c", script], input=stdin, capture_output=True, text=True, env=env)

    def calls() -> list[str]:
        log = tmp_path / "calls"
        return log.read_text().splitlines() if log.exists() else []

    def advertise(count: int) -> None:
        uuids = [f"{KIND}=GPU-{i:08d}-0000-0000-0000-000000000000" for i in range(count)]
        (tmp_path / "daemon.json").write_text(json.dumps({"node-generic-resources": uuids}))
        (tmp_path / "done").touch()

    return type("Node", (), {"run": staticmethod(run), "calls": staticmethod(calls), "paths": paths,
                             "advertise": staticmethod(advertise), "dir": tmp_path})


def join(node, gpus: int = 2) -> str:
    return commands.join_swarm(role="worker", manager_addr="10.0.0.5", advertise_addr="10.0.1.7",
                               expected_gpus=gpus, kind=KIND, paths=node.paths)


def test_join_reads_the_token_from_stdin_and_prints_the_node_id(node):
    node.advertise(2)
    done = node.run(join(node), stdin="SWMTKN-1-secret\n")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == NODE_ID
    assert "swarm join --token SWMTKN-1-secret --advertise-addr 10.0.1.7 10.0.0.5:2377" in node.calls()


def test_join_is_idempotent(node):
    node.advertise(2)
    node.run(join(node), stdin="SWMTKN-1-secret\n")
    again = node.run(join(node), stdin="SWMTKN-1-secret\n")
    assert again.returncode == 0
    assert sum(c.startswith("swarm join") for c in node.calls()) == 1


def test_join_refuses_a_node_missing_gpus_and_shows_the_bootstrap_log(node):
    node.advertise(1)
    done = node.run(join(node, gpus=2), stdin="SWMTKN-1-secret\n")
    assert done.returncode == 1
    assert "advertises 1 NVIDIA-GPU resources" in done.stderr and "expected 2" in done.stderr
    assert "step install-gpu-agent: FAILED" in done.stderr  # the tail of the bootstrap log
    assert not any(c.startswith("swarm join") for c in node.calls())


def test_join_names_the_failed_bootstrap_step(node):
    (node.dir / "failed").write_text("install-container-toolkit\n")
    done = node.run(join(node), stdin="t\n")
    assert done.returncode == 1
    assert "bootstrap step install-container-toolkit failed" in done.stderr


def test_join_without_a_token_fails(node):
    node.advertise(2)
    done = node.run(join(node), stdin="")
    assert done.returncode == 1 and "no join token on stdin" in done.stderr


def test_init_is_idempotent(node):
    assert node.run(commands.init_swarm("10.0.0.5")).stdout.strip() == "swarm initialised"
    assert node.run(commands.init_swarm("10.0.0.5")).stdout.strip() == "swarm already initialised"
    assert sum(c.startswith("swarm init") for c in node.calls()) == 1


def test_scripts_fail_clearly_when_the_engine_is_down(node):
    (node.dir / "state").write_text("")  # `docker info --format` prints nothing when it cannot connect
    done = node.run(commands.init_swarm("10.0.0.5"))
    assert done.returncode == 1 and "cannot reach the Docker engine" in done.stderr
