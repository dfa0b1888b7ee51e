"""An elastic pool as the program makes it (components/elastic_pool.py, elastic_cluster.py), under mocks.

The group that Pulumi creates and then leaves the scaler to size; its launch template's user data, the same a
fixed node of the pool boots with but for its join; the join parameter that only the pool's role may read; the
managers' role, which may change only their pools' groups (each policy evaluated as IAM would, with the fake
account's iam_allows); the scaler's settings on each manager, run in real bash; the one admit for any node of
the pool; and the reconcile that leaves the scaler's nodes alone.
"""
from __future__ import annotations

import base64
import importlib.util
import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from localswarm import fake_groups, fake_iam
from swarm import reconcile, rollout
from swarm.gpu_check import GpuCheck
from swarm.script import NODE_ARGUMENT
from tests.conftest import fake_gpu_uuid, is_secret, request_inputs, run_program, stack_config, unwrap
from tests.test_swarm_scripts import FakeNode
from tests.tools import require_tool
from to_node import software as node_software

NODE = Path(__file__).resolve().parents[1] / "node"
ELASTIC = {"name": "t4", "instanceType": "g4dn.xlarge", "autoscale": {"max": 3, "idleMinutes": 15}}
FIXED = {"name": "l4", "instanceType": "g6.xlarge", "count": 1}
NODE_ID = "abcdefghijklmnopqrstuvwxy"
RELEASE = "c" * 64


@pytest.fixture(scope="module")
def run():
    return run_program(stack_config("dev", gpuPools=[ELASTIC, FIXED]))


def inputs(run, name: str) -> dict:
    return unwrap(request_inputs(run.monitor.requests[name]))


def of_type(run, typ: str) -> list[str]:
    return sorted(n for n, r in run.monitor.requests.items() if r.type == typ)


def test_an_elastic_pool_is_a_group_that_pulumi_makes_at_min_and_never_sizes_again(run):
    assert of_type(run, "aws:autoscaling/group:Group") == ["gpu-swarm-t4-group"]
    group = inputs(run, "gpu-swarm-t4-group")
    assert (group["name"], group["minSize"], group["maxSize"], group["desiredCapacity"]) == ("gpu-swarm-test-t4", 0, 3, 0)
    assert list(run.monitor.requests["gpu-swarm-t4-group"].ignoreChanges) == ["desiredCapacity"]
    # Only the scaler's own call removes a node: every instance protected, no zone rebalancing.
    assert group["protectFromScaleIn"] is True and group["suspendedProcesses"] == ["AZRebalance"]
    assert group["forceDelete"] is True and group["waitForCapacityTimeout"] == "0"
    assert group["launchTemplate"] == {"id": run.monitor.ids["gpu-swarm-t4-template"], "version": "1"}
    # The program makes no instance of an elastic pool: the group does.
    assert not [n for n in of_type(run, "aws:ec2/instance:Instance") if "-t4-" in n]


def _user_data(run) -> str:
    return base64.b64decode(inputs(run, "gpu-swarm-t4-template")["userData"]).decode()


def test_its_nodes_boot_what_a_fixed_node_of_the_pool_boots_but_for_the_join_and_no_host_key(run, tmp_path):
    text = _user_data(run)
    doc = yaml.safe_load(text)
    files = {f["path"]: f["content"] for f in doc["write_files"]}
    env = dict(line.split("=", 1) for line in files[node_software.NODE_ENV_PATH].splitlines())
    assert env["GPU_SWARM_JOIN_PARAMETER"] == "/gpu-swarm/gpu-swarm-test/t4/join"
    assert (env["GPU_SWARM_REGION"], env["GPU_SWARM_ELASTIC_POOL"]) == ("us-east-1", "t4")
    release = dict(line.split("=", 1) for line in files[node_software.RELEASE_ENV_PATH].splitlines())
    steps = release["GPU_SWARM_STEPS"].strip('"').split()
    fixed_steps = node_software.bootstrap_steps(gpu=True, instance_type="g4dn.xlarge")
    assert steps == [*fixed_steps, "join-swarm"]
    # One template serves every node, so it holds no host key (each node makes its own) and no secret.
    assert "ssh_keys" not in doc and "PRIVATE KEY" not in text and "SWMTKN" not in text
    fixed = yaml.safe_load(inputs(run, "gpu-swarm-l4-0")["userData"])
    assert {f["path"] for f in fixed["write_files"]} == set(files) and fixed["runcmd"] == doc["runcmd"]
    cloud_init = require_tool("cloud-init")
    (tmp_path / "user-data").write_text(text)
    checked = subprocess.run([cloud_init, "schema", "--config-file", str(tmp_path / "user-data")],
                             capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    template = inputs(run, "gpu-swarm-t4-template")
    assert template["metadataOptions"] == {"httpEndpoint": "enabled", "httpTokens": "required",
                                           "httpPutResponseHopLimit": 1}
    assert template["blockDeviceMappings"][0]["ebs"]["encrypted"] == "true"


def test_the_join_is_a_secret_that_only_the_pools_role_reads(run):
    parameter = request_inputs(run.monitor.requests["gpu-swarm-t4-join"])
    assert is_secret(parameter["value"]) and parameter["type"] == "SecureString"
    join = json.loads(unwrap(parameter["value"]))
    assert set(join) == {"token", "managers", "cluster"} and join["token"].startswith("SWMTKN-1-worker")
    arn = "arn:aws:ssm:us-east-1:123456789012:parameter/gpu-swarm/gpu-swarm-test/t4/join"
    node_policy = json.loads(inputs(run, "gpu-swarm-t4-node-join")["policy"])
    assert fake_iam.iam_allows([node_policy], "ssm:GetParameter", arn)
    assert not fake_iam.iam_allows([node_policy], "ssm:GetParameter", arn.replace("/t4/", "/l4/"))
    assert not fake_iam.iam_allows([node_policy], "ssm:PutParameter", arn)
    scaler_policy = json.loads(inputs(run, "gpu-swarm-scaler")["policy"])
    assert not fake_iam.iam_allows([scaler_policy], "ssm:GetParameter", arn)


def test_the_managers_may_describe_every_group_and_change_only_their_pools(run):
    policy = [json.loads(inputs(run, "gpu-swarm-scaler")["policy"])]
    arn = fake_groups.group_arn("gpu-swarm-test-t4")  # as the fake account gave the group (its create's output)
    assert policy[0]["Statement"][1]["Resource"] == [arn]
    for action in ("autoscaling:SetDesiredCapacity", "autoscaling:TerminateInstanceInAutoScalingGroup"):
        assert fake_iam.iam_allows(policy, action, arn)
        assert not fake_iam.iam_allows(policy, action, arn.replace("gpu-swarm-test-t4", "someone-elses"))
    assert fake_iam.iam_allows(policy, "autoscaling:DescribeAutoScalingGroups", "*")
    assert not fake_iam.iam_allows(policy, "autoscaling:UpdateAutoScalingGroup", arn)
    profile = inputs(run, "gpu-swarm-managers-0")["iamInstanceProfile"]
    assert profile == run.monitor.ids["gpu-swarm-scaler-profile"]
    assert "iamInstanceProfile" not in inputs(run, "gpu-swarm-l4-0")  # fixed GPU nodes have no role


def test_a_cluster_without_an_elastic_pool_has_no_role_at_all():
    plain = run_program(stack_config("dev"))
    assert not [r for r in plain.monitor.requests.values() if r.type.startswith(("aws:iam/", "aws:autoscaling/"))]
    assert "iamInstanceProfile" not in inputs(plain, "gpu-swarm-managers-0")
    assert not [n for n in plain.monitor.requests if "autoscale" in n]


def _scale_plan():
    spec = importlib.util.spec_from_file_location("scale_plan_for_settings", NODE / "scale_plan.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_each_manager_gets_the_scalers_settings_which_the_scaler_reads(run, tmp_path):
    wrapped = shlex.split(inputs(run, "gpu-swarm-autoscale-0")["create"])  # sudo -n bash -c SCRIPT (as_root)
    assert wrapped[:4] == ["sudo", "-n", "bash", "-c"]
    inner = wrapped[4].replace("/etc/gpu-swarm/autoscale", f"{tmp_path}/autoscale")
    result = subprocess.run(["bash", "-c", inner], capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.strip() == "changed", result.stderr
    doc = json.loads((tmp_path / "autoscale" / "pools.json").read_text())
    pool = _scale_plan().Pool.from_json(doc["pools"][0])
    assert doc["region"] == "us-east-1"
    assert (pool.name, pool.group, pool.min, pool.max, pool.idle_s, pool.kind, pool.units) == \
        ("t4", "gpu-swarm-test-t4", 0, 3, 900, "NVIDIA-GPU", 1)
    assert pool.labels["gpu-swarm.pool"] == "t4" and len(pool.release) == 64
    admit = (tmp_path / "autoscale" / "t4.admit.sh").read_text()
    assert admit.startswith("# shellcheck disable=SC2086") and "gpu-swarm-check-${node:0:12}" in admit
    assert again(inner) == "unchanged"


def again(script: str) -> str:
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True).stdout.strip()


def _admit(node: str) -> str:
    return rollout.admit_node(node, {"gpu-swarm.pool": "t4"}, expected_gpus=1, kind="NVIDIA-GPU", software=RELEASE,
                              check=GpuCheck())


def test_the_admit_of_any_node_of_the_pool_is_the_admit_of_that_node():
    """One copy of the post-join check: the script for the argument, given a node, is the script for that node."""
    given = _admit(NODE_ARGUMENT)
    header, lines = given.split("\n", 1)[0], given.split("\n", 1)[1].splitlines()
    assert header.startswith("# shellcheck disable=SC2086")
    assert lines[1] == "node=${1:-}" and lines[2].startswith("[[ $node =~ ^[a-z0-9]{25}$ ]]")
    body = "\n".join([lines[0], *lines[3:]]) + "\n"
    assert body.replace("${node:0:12}", NODE_ID[:12]).replace("$node", NODE_ID) == _admit(NODE_ID)


def test_the_admit_passes_shellcheck_and_refuses_what_is_no_node_id(tmp_path):
    require_tool("shellcheck")
    text = _admit(NODE_ARGUMENT)
    checked = subprocess.run(["shellcheck", "-s", "bash", "-"], input=text, capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout
    node = FakeNode(tmp_path)
    try:
        script = tmp_path / "admit.sh"
        script.write_text(text)
        for bad in ("", "ab; rm -rf /", NODE_ID.upper()):
            result = node.run(f"bash {script} '{bad}'")
            assert result.returncode == 2 and "expected a 25-character swarm node ID" in result.stderr
            assert not node.calls()  # nothing ran against the engine
    finally:
        node.close()


def test_the_reconcile_leaves_the_elastic_pools_nodes_to_the_scaler(tmp_path):
    node = FakeNode(tmp_path)
    elastic, gone = "elasticaaaaaaaaaaaaaaaaaa", "goneaaaaaaaaaaaaaaaaaaaaa"
    try:
        node.set(pool=f"{NODE_ID}\n{elastic}\n{gone}", nodes=f"{NODE_ID} Ready manager-0", markers="")
        # The fake engine answers one label value for every node: first the elastic pool's, then another's.
        node.set(**{"label-gpu-swarm.pool": "t4"})
        kept = node.run(reconcile.reconcile(nodes=[NODE_ID], stacks=[], elastic_pools=["t4"]))
        assert kept.returncode == 0, kept.stderr
        assert not [c for c in node.calls() if c.startswith("docker node rm")]
        node.set(**{"label-gpu-swarm.pool": "old"})  # a pool the program no longer has: its nodes go
        gone_run = node.run(reconcile.reconcile(nodes=[NODE_ID], stacks=[], elastic_pools=["t4"]))
        assert gone_run.returncode == 0, gone_run.stderr
        assert f"docker node rm --force {elastic}" in node.calls() and f"docker node rm --force {gone}" in node.calls()
    finally:
        node.close()


def test_the_inventory_lists_the_elastic_nodes_the_swarm_has_with_their_gpus(run):
    """Read at each `pulumi up` from the swarm (the program never has them); the mock's manager knows one."""
    elastic = [e for e in run.exports["inventory"] if e.get("elastic")]
    assert len(elastic) == 1 and elastic[0]["pool"] == "t4" and elastic[0]["instanceId"].startswith("i-")
    assert elastic[0]["gpusAdvertised"] == [fake_gpu_uuid("elastic", 0)] and elastic[0]["gpusExpected"] == 1
    assert elastic[0]["gpusVerified"] is False  # its admit has not proved this release's GPUs
    assert {e["name"] for e in run.exports["inventory"] if not e.get("elastic")} == \
        {"gpu-swarm-test-manager-0", "gpu-swarm-test-l4-0"}
    read = inputs(run, "gpu-swarm-health-elastic")["create"]
    assert "docker node inspect" in read and "gpu-swarm.elastic-pool" in read


def test_the_elastic_read_passes_shellcheck_and_keeps_only_nodes_that_name_a_pool(tmp_path):
    require_tool("shellcheck")
    from swarm.health import parse_elastic_nodes, read_elastic_nodes
    text = read_elastic_nodes("2027-01-15T08:00:00+00:00")
    checked = subprocess.run(["shellcheck", "-s", "bash", "-"], input=text, capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout
    lines = '{"id": "a", "pool": "t4"}\n{"id": "b", "pool": ""}\n'
    kept = subprocess.run(["bash", "-c", "grep -v '\"pool\":\"\"' || true"], input=lines.replace(": ", ":"),
                          capture_output=True, text=True).stdout
    assert [n["id"] for n in parse_elastic_nodes(kept)] == ["a"]
