"""The resources `pulumi up` would create, checked through Pulumi's mocks: no AWS, no CLI."""
import base64
import gzip
import json

import pytest
import yaml

import node_software
from tests.conftest import (
    DEEP_LEARNING_AMI, UBUNTU_AMI, VPC, is_secret, request_inputs, run_program, stack_config, unwrap,
)

SWARM_PORTS = {2377, 7946, 4789}


class Graph:
    """One program run: registered resources by name, with inputs (secrets still wrapped)."""

    def __init__(self, run):
        self.run = run
        self.requests = run.monitor.requests
        self.inputs = {name: request_inputs(r) for name, r in self.requests.items()}
        self.urns = {name: self._urn(r) for name, r in self.requests.items()}

    @staticmethod
    def _urn(request):
        return f"{request.type}::{request.name}"

    def of_type(self, typ):
        return {n: r for n, r in self.requests.items() if r.type == typ}

    def plain(self, name):
        return unwrap(self.inputs[name])

    def depends_on(self, name, other):
        return any(d.endswith(f"::{other}") for d in self.requests[name].dependencies)

    def commands(self, suffix):
        return {n: self.plain(n) for n in self.of_type("command:remote:Command") if n.endswith(suffix)}

    def instances(self):
        return {n: self.plain(n) for n in self.of_type("aws:ec2/instance:Instance")}


@pytest.fixture(scope="module")
def prod():
    return Graph(run_program(stack_config("prod"), stack="prod"))


@pytest.fixture(scope="module")
def dev():
    return Graph(run_program(stack_config("dev"), stack="dev"))


# ---------------------------------------------------------------- instances


def test_instances_per_pool(prod):
    pools = [i["tags"]["gpu-swarm:pool"] for i in prod.instances().values()]
    assert sorted(pools) == ["inference", "inference", "managers", "managers", "managers", "training"]


def test_every_instance_requires_imdsv2_and_encrypts_its_root_volume(prod):
    sizes = {"managers": 40, "training": 500, "inference": 200}
    for name, inst in prod.instances().items():
        assert inst["metadataOptions"] == {"httpEndpoint": "enabled", "httpTokens": "required",
                                           "httpPutResponseHopLimit": 1}, name
        root = inst["rootBlockDevice"]
        assert root["encrypted"] is True and root["volumeType"] == "gp3", name
        assert root["volumeSize"] == sizes[inst["tags"]["gpu-swarm:pool"]], name
        assert inst["userDataReplaceOnChange"] is True, name


def test_instances_carry_name_role_pool_and_user_tags(prod):
    for name, inst in prod.instances().items():
        tags = inst["tags"]
        assert tags["Name"].startswith("gpu-swarm-prod-"), name
        assert tags["gpu-swarm:role"] in ("manager", "worker")
        assert tags["gpu-swarm:cluster"] == "gpu-swarm-prod"
        assert tags["environment"] == "prod" and tags["team"] == "ml-platform"
        assert inst["rootBlockDevice"]["tags"] == tags


def test_spot_only_where_configured(prod):
    for name, inst in prod.instances().items():
        market = inst.get("instanceMarketOptions")
        if inst["tags"]["gpu-swarm:pool"] == "inference":
            assert market == {"marketType": "spot", "spotOptions": {
                "spotInstanceType": "one-time", "instanceInterruptionBehavior": "terminate"}}, name
        else:
            assert market is None, name


def test_images_managers_ubuntu_gpu_nodes_deep_learning(prod):
    for name, inst in prod.instances().items():
        expected = UBUNTU_AMI if inst["tags"]["gpu-swarm:role"] == "manager" else DEEP_LEARNING_AMI
        assert inst["ami"] == expected, name
        # A newer "latest" AMI must not replace running nodes.
        assert list(prod.requests[name].ignoreChanges) == ["ami"], name


def test_user_data_is_cloud_config_and_gpu_nodes_get_the_agent(prod):
    agent = node_software.AGENT_SOURCE.read_text()
    for name, inst in prod.instances().items():
        raw = base64.b64decode(inst["userDataBase64"])
        assert len(raw) <= node_software.USER_DATA_LIMIT, name  # EC2 refuses more
        text = gzip.decompress(raw).decode()  # cloud-init inflates gzip user data
        assert text.startswith("#cloud-config\n"), name
        doc = yaml.safe_load(text)
        files = {f["path"]: f["content"] for f in doc["write_files"]}
        assert doc["runcmd"], name
        if inst["tags"]["gpu-swarm:role"] == "worker":
            assert files[node_software.AGENT_PATH] == agent, name
            assert "GPU_SWARM_KIND=NVIDIA-GPU" in files[node_software.AGENT_ENV_PATH]
        else:
            assert node_software.AGENT_PATH not in files, name


def test_nodes_are_spread_over_the_zones_that_offer_every_type(prod):
    subnets = {inst["subnetId"] for inst in prod.instances().values()}
    assert subnets == {"gpu-swarm-network-us-east-1a-id", "gpu-swarm-network-us-east-1c-id"}
    zones = {s["availabilityZone"] for s in map(prod.plain, prod.of_type("aws:ec2/subnet:Subnet"))}
    assert zones == {"us-east-1a", "us-east-1c"}


# ---------------------------------------------------------------- security groups


def test_no_inline_rules(prod):
    for name in prod.of_type("aws:ec2/securityGroup:SecurityGroup"):
        assert not prod.plain(name).get("ingress") and not prod.plain(name).get("egress"), name


def test_swarm_ports_are_open_to_cluster_members_only(prod):
    rules = [prod.plain(n) for n in prod.of_type("aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule")]
    swarm = [r for r in rules if r.get("fromPort") in SWARM_PORTS or r["ipProtocol"] == "50"]
    assert sorted((r["ipProtocol"], r.get("fromPort")) for r in swarm) == [
        ("50", None), ("tcp", 2377), ("tcp", 7946), ("udp", 4789), ("udp", 7946)]
    for rule in swarm:
        assert "cidrIpv4" not in rule and "cidrIpv6" not in rule, rule
        assert rule["referencedSecurityGroupId"] == "gpu-swarm-sg-cluster-id", rule
    (api,) = [r for r in swarm if r.get("fromPort") == 2377]
    assert api["securityGroupId"] == "gpu-swarm-sg-managers-id"


def test_ssh_from_the_allowed_networks_reaches_managers_only(prod):
    rules = [prod.plain(n) for n in prod.of_type("aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule")]
    with_cidr = [r for r in rules if "cidrIpv4" in r or "cidrIpv6" in r]
    assert [(r["securityGroupId"], r["fromPort"], r["toPort"], r["cidrIpv4"]) for r in with_cidr] == [
        ("gpu-swarm-sg-managers-id", 22, 22, "198.51.100.0/24")]
    (workers_ssh,) = [r for r in rules if r["securityGroupId"] == "gpu-swarm-sg-workers-id"]
    assert (workers_ssh["fromPort"], workers_ssh["referencedSecurityGroupId"]) == (22, "gpu-swarm-sg-managers-id")


def test_egress_is_open(prod):
    rules = [prod.plain(n) for n in prod.of_type("aws:vpc/securityGroupEgressRule:SecurityGroupEgressRule")]
    assert sorted((r.get("cidrIpv4", ""), r.get("cidrIpv6", ""), r["ipProtocol"]) for r in rules) == [
        ("", "::/0", "-1"), ("0.0.0.0/0", "", "-1")]
    assert {r["securityGroupId"] for r in rules} == {"gpu-swarm-sg-cluster-id"}


def test_instances_get_the_groups_of_their_role(prod):
    for name, inst in prod.instances().items():
        role = "managers" if inst["tags"]["gpu-swarm:role"] == "manager" else "workers"
        assert sorted(inst["vpcSecurityGroupIds"]) == ["gpu-swarm-sg-cluster-id", f"gpu-swarm-sg-{role}-id"], name


# ---------------------------------------------------------------- the swarm


def test_commands_run_as_root(prod):
    for name, cmd in prod.commands("").items():
        assert cmd["create"].startswith("sudo -n bash -c "), name


def test_joins_wait_for_init_and_tokens(prod):
    joins = prod.commands("-join")
    assert len(joins) == 6
    assert prod.depends_on("gpu-swarm-swarm-tokens", "gpu-swarm-swarm-init")
    for name in joins:
        assert prod.depends_on(name, "gpu-swarm-swarm-init"), name
        assert prod.depends_on(name, "gpu-swarm-swarm-tokens"), name


def test_join_tokens_stay_secret(prod):
    tokens = prod.requests["gpu-swarm-swarm-tokens"]
    assert "stdout" in tokens.additionalSecretOutputs
    assert prod.plain("gpu-swarm-swarm-tokens")["logging"] == "none"
    for name in prod.commands("-join"):
        assert is_secret(prod.inputs[name]["stdin"]), name
    # No token appears anywhere outside a secret.
    for name, inputs in prod.inputs.items():
        visible = json.dumps(_drop_secrets(inputs))
        assert "SWMTKN" not in visible, name


def _drop_secrets(value):
    if is_secret(value):
        return "[secret]"
    if isinstance(value, dict):
        return {k: _drop_secrets(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_drop_secrets(v) for v in value]
    return value


def test_workers_are_reached_through_manager_0(prod):
    manager_0_ip = prod.run.exports["managerPublicIps"][0]
    for name, cmd in prod.commands("-join").items():
        conn = cmd["connection"]
        assert conn["privateKey"].startswith("-----BEGIN OPENSSH PRIVATE KEY-----")
        assert is_secret(prod.inputs[name]["connection"]), name
        if "-managers-" in name:
            assert "proxy" not in conn and conn["host"].startswith("54."), name
        else:
            assert conn["host"].startswith("10.42.") and conn["proxy"]["host"] == manager_0_ip, name


def test_joins_check_the_expected_gpus_and_use_the_token_of_their_role(prod):
    for name, cmd in prod.commands("-join").items():
        expected = 8 if "training" in name else 4 if "inference" in name else 0
        assert "docker swarm join" in cmd["create"] and f'[ "$n" -eq {expected} ]' in cmd["create"], name
        # The token decides the role the node joins with.
        role = "manager" if "-member-managers-" in name else "worker"
        assert cmd["stdin"] == f"SWMTKN-1-{role}-secret", name


def test_labels_run_on_manager_0_and_remove_the_node_when_deleted(prod):
    manager_0_ip = prod.run.exports["managerPublicIps"][0]
    labels = prod.commands("-label")
    assert len(labels) == 6
    for name, cmd in labels.items():
        assert cmd["connection"]["host"] == manager_0_ip and "proxy" not in cmd["connection"], name
        assert prod.depends_on(name, name.replace("-label", "-join")), name
        node_id = cmd["triggers"][0]
        assert len(node_id) == 25 and node_id in cmd["create"], name
        if name == "gpu-swarm-member-managers-0-label":
            assert "delete" not in cmd  # manager-0 cannot drain and remove itself
        else:
            assert "docker node rm --force" in cmd["delete"] and node_id in cmd["delete"], name
    assert "gpu-swarm.pool=training" in labels["gpu-swarm-member-training-0-label"]["create"]
    assert "gpu-swarm.gpu-model=H100" in labels["gpu-swarm-member-training-0-label"]["create"]


def test_bootstrap_timings_are_read_after_the_join(prod):
    for name in prod.commands("-timings"):
        assert prod.depends_on(name, name.replace("-timings", "-join")), name


def test_stacks_deploy_after_every_node_is_in_and_only_on_content_change(prod):
    labels = prod.commands("-label")
    (copy_name,) = prod.of_type("command:remote:CopyToRemote")
    deploy_name = "gpu-swarm-stack-gpu-smoke-deploy"
    for name in (copy_name, deploy_name):
        for label in labels:
            assert prod.depends_on(name, label), (name, label)
    assert prod.depends_on(deploy_name, copy_name)
    copy, deploy = prod.plain(copy_name), prod.plain(deploy_name)
    sha = copy["triggers"][0]
    assert len(sha) == 64 and copy["source"]["path"] == "stacks/gpu-smoke.yml"
    assert copy["remotePath"] == f"/tmp/gpu-swarm-stacks/gpu-smoke-{sha[:16]}.yml"
    # The hash reaches the deploy through its create command (an in-place update), never
    # through triggers (a replacement whose old `docker stack rm` would undo the new deploy).
    assert copy["remotePath"] in deploy["create"] and "docker stack deploy" in deploy["create"]
    assert "triggers" not in deploy
    assert "docker stack rm" in deploy["delete"]
    assert prod.requests[deploy_name].deleteBeforeReplace


# ---------------------------------------------------------------- outputs


def test_inventory_lists_expected_and_advertised_gpus(prod):
    nodes = prod.run.exports["inventory"]
    assert [(n["pool"], n["gpusExpected"], len(n["gpusAdvertised"])) for n in nodes] == [
        ("managers", 0, 0), ("managers", 0, 0), ("managers", 0, 0),
        ("training", 8, 8), ("inference", 4, 4), ("inference", 4, 4)]
    assert all(u.startswith("GPU-") for n in nodes for u in n["gpusAdvertised"])
    assert {n["instanceType"] for n in nodes} == {"m7i.large", "p5.48xlarge", "g6e.12xlarge"}


def test_ssh_commands_hop_through_manager_0_for_workers(prod):
    manager_0 = prod.run.exports["managerPublicIps"][0]
    commands = prod.run.exports["sshCommands"]
    assert commands["gpu-swarm-prod-manager-0"] == f"ssh ubuntu@{manager_0}"
    worker = next(n for n in prod.run.exports["inventory"] if n["pool"] == "training")
    assert commands[worker["name"]] == f"ssh -J ubuntu@{manager_0} ubuntu@{worker['privateIp']}"


def test_bootstrap_timings_are_parsed_per_node(prod):
    timings = prod.run.exports["bootstrapTimings"]
    assert len(timings) == 6
    assert all(t["install-docker"]["status"] == "done" for t in timings.values())


def test_generated_private_key_is_exported_as_a_secret(prod):
    assert prod.run.exports["privateKey"].startswith("-----BEGIN OPENSSH PRIVATE KEY-----")
    assert prod.run.secret_exports == {"privateKey"}
    (key,) = prod.of_type("tls:index/privateKey:PrivateKey")
    assert prod.plain(key)["algorithm"] == "ED25519"


def test_manager_addresses_are_exported(dev):
    assert len(dev.run.exports["managerPublicIps"]) == len(dev.run.exports["managerPrivateIps"]) == 1


# ---------------------------------------------------------------- structure


def test_components_own_their_children_and_names_do_not_collide(prod):
    assert prod.run.monitor.duplicate_names == []
    types = {r.type for r in prod.requests.values()}
    assert {"gpu-swarm:swarm:Cluster", "gpu-swarm:aws:Network", "gpu-swarm:aws:SecurityGroups",
            "gpu-swarm:aws:SshKey", "gpu-swarm:aws:NodePool", "gpu-swarm:swarm:Init",
            "gpu-swarm:swarm:Membership", "gpu-swarm:swarm:GpuStack"} <= types
    for name, request in prod.requests.items():
        if request.type not in ("pulumi:pulumi:Stack", "gpu-swarm:swarm:Cluster"):
            assert "gpu-swarm:" in request.parent, name


def test_existing_vpc_creates_no_network():
    subnets = ["subnet-0cccccccccccccccc", "subnet-0aaaaaaaaaaaaaaaa"]
    graph = Graph(run_program(stack_config("prod", vpcId=VPC, subnetIds=subnets)))
    assert not graph.of_type("aws:ec2/vpc:Vpc") and not graph.of_type("aws:ec2/subnet:Subnet")
    assert {i["subnetId"] for i in graph.instances().values()} == set(subnets)
    assert {graph.plain(n)["vpcId"] for n in graph.of_type("aws:ec2/securityGroup:SecurityGroup")} == {VPC}


def test_supplied_key_is_used_and_not_exported():
    private = "-----BEGIN OPENSSH PRIVATE KEY-----\nbWluZQ==\n-----END OPENSSH PRIVATE KEY-----\n"
    graph = Graph(run_program(
        stack_config("dev", sshPublicKey="ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIMine me@host", sshPrivateKey=private),
        secret_keys=("gpu-swarm:sshPrivateKey",),
    ))
    assert not graph.of_type("tls:index/privateKey:PrivateKey")
    (pair,) = graph.of_type("aws:ec2/keyPair:KeyPair")
    assert graph.plain(pair)["publicKey"] == "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIMine me@host"
    assert "privateKey" not in graph.run.exports
    join = graph.inputs["gpu-swarm-member-t4-0-join"]
    assert is_secret(join["connection"]) and unwrap(join["connection"])["privateKey"] == private


def test_custom_ami_nodes_follow_an_ami_change():
    graph = Graph(run_program(stack_config("dev", image="custom", amiId="ami-0123456789abcdef0")))
    worker = graph.requests["gpu-swarm-t4-0"]
    assert graph.plain("gpu-swarm-t4-0")["ami"] == "ami-0123456789abcdef0"
    assert list(worker.ignoreChanges) == []
    assert list(graph.requests["gpu-swarm-managers-0"].ignoreChanges) == ["ami"]
