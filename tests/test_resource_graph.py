"""The resources `pulumi up` would create, checked through Pulumi's mocks: no AWS, no CLI."""
import hashlib
import json
import re
import shlex

import pytest
import yaml

from to_node import software as node_software
from components import provider_facts, remote
from components.cloud_config import USER_DATA_LIMIT
from swarm.node_contract import CLOUD_INIT_RESULT
from tests.conftest import (
    DEEP_LEARNING_AMI, FAKE_CLUSTER_ID, REPO, UBUNTU_AMI, VPC, is_secret, request_inputs, run_program, stack_config,
    unwrap,
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
        """Every node: instances, and the spot requests of persistent spot pools (each holds its instance)."""
        return {n: self.plain(n) for n, r in self.requests.items() if r.type in NODE_TYPES}


NODE_TYPES = ("aws:ec2/instance:Instance",)


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
        if inst["tags"]["gpu-swarm:pool"] == "inference":  # interruption: stop: a persistent request (test_capacity)
            assert (market["marketType"], market["spotOptions"]["spotInstanceType"],
                    market["spotOptions"]["instanceInterruptionBehavior"]) == ("spot", "persistent", "stop"), name
        else:
            assert prod.requests[name].type == "aws:ec2/instance:Instance" and market is None, name


def test_images_managers_ubuntu_gpu_nodes_deep_learning(prod):
    for name, inst in prod.instances().items():
        expected = UBUNTU_AMI if inst["tags"]["gpu-swarm:role"] == "manager" else DEEP_LEARNING_AMI
        assert inst["ami"] == expected, name


def test_running_nodes_keep_what_only_matters_at_creation(prod):
    """A new AMI release, a rotated key, another zone list or new user data never touch a running node."""
    for name in prod.instances():
        kept = provider_facts.INSTANCE_INPUTS_KEPT_BY_RUNNING_NODES
        assert set(prod.requests[name].ignoreChanges) == set(kept), name
        assert "associatePublicIpAddress" in kept  # a stop loses the automatic address (tests/test_plan_aws.py)
        assert prod.plain(name)["userDataReplaceOnChange"] is False


def test_gpu_nodes_are_replaced_on_a_new_type_and_managers_resized(prod):
    # A GPU node is replaced (new first, the old one drained by the reconcile); a manager is
    # resized in place, one at a time (node_pool.py says why).
    for name, inst in prod.instances().items():
        worker = inst["tags"]["gpu-swarm:pool"] != "managers"
        assert list(prod.requests[name].replaceOnChanges) == (["instanceType"] if worker else []), name


def test_managers_change_one_after_the_other(prod):
    assert prod.depends_on("gpu-swarm-managers-1", "gpu-swarm-managers-0")
    assert prod.depends_on("gpu-swarm-managers-2", "gpu-swarm-managers-1")
    assert not prod.depends_on("gpu-swarm-inference-1", "gpu-swarm-inference-0")


def test_each_pool_boots_its_own_cloud_config_and_running_nodes_keep_theirs(prod):
    by_pool, host_keys = {}, set()
    for inst in prod.instances().values():
        assert inst["userData"].startswith("#cloud-config\n") and len(inst["userData"].encode()) <= USER_DATA_LIMIT
        doc = yaml.safe_load(inst["userData"])
        host_keys.add(doc.pop("ssh_keys")["ed25519_public"])
        by_pool.setdefault(inst["tags"]["gpu-swarm:pool"], set()).add(yaml.safe_dump(doc))
    assert all(len(texts) == 1 for texts in by_pool.values())  # a pool's nodes boot alike, but for their host key
    assert len(host_keys) == len(prod.instances())  # each its own
    texts = [texts.pop() for texts in by_pool.values()]
    assert len(set(texts)) == 3  # managers, training and inference differ
    assert "userDataBase64" not in next(iter(prod.instances().values()))


def test_nodes_are_spread_over_the_zones_that_offer_every_type(prod):
    # An EFA node's subnet is its launch template's (tests/test_capacity.py).
    subnets = {inst["subnetId"] for inst in prod.instances().values() if "subnetId" in inst}
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
    rules = [r for r in rules if "referencedSecurityGroupId" not in r]  # EFA's, to its own group: test_capacity.py
    assert sorted((r.get("cidrIpv4", ""), r.get("cidrIpv6", ""), r["ipProtocol"]) for r in rules) == [
        ("", "::/0", "-1"), ("0.0.0.0/0", "", "-1")]
    assert {r["securityGroupId"] for r in rules} == {"gpu-swarm-sg-cluster-id"}


def test_instances_get_the_groups_of_their_role(prod):
    for name, inst in prod.instances().items():
        if "launchTemplate" in inst:
            continue  # an EFA node's groups are on its interfaces (tests/test_capacity.py)
        role = "managers" if inst["tags"]["gpu-swarm:role"] == "manager" else "workers"
        assert sorted(inst["vpcSecurityGroupIds"]) == ["gpu-swarm-sg-cluster-id", f"gpu-swarm-sg-{role}-id"], name


# ---------------------------------------------------------------- boot, and the order that works


def ancestors(graph, name: str) -> set[str]:
    """Every resource `name` waits for, directly or through others (by name)."""
    seen, todo = set(), [name]
    while todo:
        for dep in graph.requests[todo.pop()].dependencies:
            other = dep.split("::")[-1]
            if other in graph.requests and other not in seen:
                seen.add(other)
                todo.append(other)
    return seen


def node_of(graph, name: str) -> str:
    """The node a command runs on: the one whose address its connection names."""
    host = graph.plain(name)["connection"]["host"]
    return next(n["name"] for n in graph.run.exports["inventory"] if host in (n["privateIp"], n["publicIp"]))


def boot_of(node_name: str) -> str:
    pool, index = node_name.rsplit("-", 1)[0].split("-")[-1], node_name.rsplit("-", 1)[1]
    return f"gpu-swarm-boot-{'managers' if pool == 'manager' else pool}-{index}-wait"


def test_commands_run_as_root(prod):
    for name, cmd in prod.commands("").items():
        scripts = [cmd[k] for k in ("create", "update", "delete") if k in cmd]
        assert scripts and all(s.startswith("sudo -n bash -c ") for s in scripts), name


def test_nothing_but_the_instance_comes_before_a_nodes_boot(prod):
    """The first command on a fresh node waits for its boot, and for nothing that boot does not bring."""
    for name in prod.commands("-wait"):
        before = ancestors(prod, name)
        assert not [n for n in before if prod.requests[n].type.startswith("command:")], name
        assert any(prod.requests[n].type in NODE_TYPES for n in before), name


def test_every_command_on_a_node_comes_after_its_boot(prod):
    for name in prod.commands(""):
        node = node_of(prod, name)
        if name.endswith("-wait") or name.startswith("gpu-swarm-swarm-probe-"):
            continue  # the wait itself; probes answer "no swarm" on a node that is still booting
        assert boot_of(node) in ancestors(prod, name), f"{name} runs on {node} before its boot is done"


def test_the_swarm_is_made_after_the_first_managers_boot_and_every_manager_command_after_it(prod):
    init = "gpu-swarm-swarm-init"
    assert boot_of("gpu-swarm-prod-manager-0") in ancestors(prod, init)
    for name in prod.commands(""):
        on_first = node_of(prod, name) == "gpu-swarm-prod-manager-0"
        if on_first and name.endswith(("-cordon", "-admit", "-tokens", "-run", "-deploy", "-read")):
            assert init in ancestors(prod, name), name


def test_a_node_is_cordoned_only_once_it_is_in_the_swarm(prod):
    cordons = prod.commands("-cordon")
    assert len(cordons) == 6
    for name in cordons:
        join = name.replace("-rollout-", "-member-").replace("-cordon", "-join")
        assert join in ancestors(prod, name), name


def test_each_pools_nodes_roll_one_after_the_other_and_pools_side_by_side(prod):
    """A node's cordon waits for the previous node of its pool to be admitted: never for a lease
    that a command which has not started yet would have to release (a deadlock at --parallel 1)."""
    assert prod.depends_on("gpu-swarm-rollout-inference-1-cordon", "gpu-swarm-rollout-inference-0-admit")
    assert prod.depends_on("gpu-swarm-rollout-managers-2-cordon", "gpu-swarm-rollout-managers-1-admit")
    assert not prod.depends_on("gpu-swarm-rollout-inference-0-cordon", "gpu-swarm-rollout-training-0-admit")
    assert "gpu-swarm-rollout-managers-0-admit" not in ancestors(prod, "gpu-swarm-rollout-inference-0-cordon")
    for name in prod.commands("-upgrade"):
        assert prod.depends_on(name, name.replace("-upgrade", "-cordon")), name
        assert prod.depends_on(name.replace("-upgrade", "-admit"), name), name
    for name, cmd in prod.commands("-cordon").items():
        assert "flock" not in cmd["update"] and "waiting: node" not in cmd["update"], name


def _pool_graph(count: int, rollout: dict | None) -> Graph:
    pool = {"name": "gpu", "instanceType": "g6.xlarge", "count": count, **({"rollout": rollout} if rollout else {})}
    return Graph(run_program(stack_config("dev", gpuPools=[pool]), stack="dev"))


def _waves(graph: Graph, pool: str) -> list[set[str]]:
    """The pool's nodes by wave, as the graph orders them: a node is in wave w when the longest
    chain of earlier admits before its cordon is w nodes long."""
    nodes = sorted({n.split("-rollout-")[1].rsplit("-", 1)[0] for n in graph.commands("-cordon")
                    if f"-rollout-{pool}-" in n})
    before = {n: {m for m in nodes if f"gpu-swarm-rollout-{m}-admit" in ancestors(graph, f"gpu-swarm-rollout-{n}-cordon")}
              for n in nodes}
    depth: dict[str, int] = {}
    for n in sorted(nodes, key=lambda n: len(before[n])):
        depth[n] = 1 + max((depth[m] for m in before[n]), default=-1)
    return [{n for n in nodes if depth[n] == w} for w in range(max(depth.values()) + 1)]


def _longest_chain(graph: Graph) -> int:
    """The longest dependency chain through the registrations: what the SDK walks at each one."""
    memo: dict[str, int] = {}

    def depth(name: str) -> int:
        if name not in memo:
            deps = [d.split("::")[-1] for d in graph.requests[name].dependencies]
            memo[name] = 1 + max((depth(d) for d in deps if d in graph.requests), default=0)
        return memo[name]
    return max(depth(n) for n in graph.requests)


@pytest.mark.parametrize("count, rollout, waves", [
    (10, {"maxUnavailable": 3}, [3, 3, 3, 1]),
    (20, None, [2] * 10),  # the default, 10 %
    (6, {"maxUnavailable": "50%"}, [3, 3]),
    (5, {"maxUnavailable": 9}, [5]),  # more than the pool: the whole pool in one wave
])
def test_a_pool_rolls_in_waves_of_at_most_max_unavailable_nodes(count, rollout, waves):
    """No node of a wave is drained before every node of the wave before is admitted, and within a
    wave no node waits for another: at most maxUnavailable nodes of the pool are out at once."""
    graph = _pool_graph(count, rollout)
    found = _waves(graph, "gpu")
    assert [len(w) for w in found] == waves
    for w, wave in enumerate(found[1:], 1):
        for node in wave:
            before = ancestors(graph, f"gpu-swarm-rollout-{node}-cordon")
            assert all(f"gpu-swarm-rollout-{m}-admit" in before for m in found[w - 1]), node
    # Each cordon waits for its join and at most one thing of the wave before: a gate, or the one
    # admit of a wave of one. Every admit before it would be wave-size edges a node.
    for name in graph.commands("-cordon"):
        rolled = [d for d in graph.requests[name].dependencies if d.endswith("-admit") or "-wave-" in d]
        assert len(rolled) <= 1, (name, rolled)


def test_the_chain_is_as_deep_as_the_waves_not_the_nodes():
    """Twice the nodes in as many waves: the longest chain (what the SDK walks) does not grow."""
    small, large = _pool_graph(8, {"maxUnavailable": 2}), _pool_graph(16, {"maxUnavailable": 4})
    assert len(_waves(small, "gpu")) == len(_waves(large, "gpu")) == 4
    assert _longest_chain(large) == _longest_chain(small)
    one_by_one = _pool_graph(8, {"maxUnavailable": 1})
    assert _longest_chain(one_by_one) > _longest_chain(small)  # 8 waves of one


def test_instances_boot_once_their_bundle_is_readable_through_the_endpoint(prod):
    (obj,) = prod.of_type("aws:s3/bucketObjectv2:BucketObjectv2")
    (policy,) = prod.of_type("aws:s3/bucketPolicy:BucketPolicy")
    (endpoint,) = prod.of_type("aws:ec2/vpcEndpoint:VpcEndpoint")
    for name in prod.instances():
        for needed in (obj, policy, endpoint):
            assert prod.depends_on(name, needed), (name, needed)


def test_the_bundle_is_node_pinned_by_its_sha256_and_readable_only_through_the_endpoint(prod):
    import base64
    (obj,) = prod.of_type("aws:s3/bucketObjectv2:BucketObjectv2")
    data = base64.b64decode(prod.plain(obj)["contentBase64"])
    assert hashlib.sha256(data).hexdigest() == node_software.bundle_sha256()
    assert prod.plain(obj)["key"] == node_software.bundle_key(node_software.bundle_sha256())
    (block,) = prod.of_type("aws:s3/bucketPublicAccessBlock:BucketPublicAccessBlock")
    assert all(prod.plain(block)[k] for k in ("blockPublicAcls", "blockPublicPolicy", "ignorePublicAcls",
                                              "restrictPublicBuckets"))
    (policy,) = prod.of_type("aws:s3/bucketPolicy:BucketPolicy")
    assert prod.depends_on(policy, block)
    statements = json.loads(prod.plain(policy)["policy"])["Statement"]
    allow = [s for s in statements if s["Effect"] == "Allow"]
    assert [s["Action"] for s in allow] == ["s3:GetObject"]
    (endpoint,) = prod.of_type("aws:ec2/vpcEndpoint:VpcEndpoint")
    assert allow[0]["Condition"] == {"StringEquals": {"aws:SourceVpce": "vpce-" + hashlib.sha1(
        endpoint.encode()).hexdigest()[:17]}}
    assert any(s["Effect"] == "Deny" and s["Condition"] == {"Bool": {"aws:SecureTransport": "false"}}
               for s in statements)
    ep = prod.plain(endpoint)
    assert ep["vpcEndpointType"] == "Gateway" and ep["serviceName"] == "com.amazonaws.us-east-1.s3"
    assert ep["routeTableIds"] == ["gpu-swarm-network-public-id"]


def test_the_boot_wait_reports_and_the_upgrade_names_the_nodes_release(prod):
    waits = prod.commands("-wait")
    assert len(waits) == 6
    for name, cmd in waits.items():
        assert f"until [ -e {CLOUD_INIT_RESULT} ]" in cmd["create"] and "systemd-run" in cmd["create"], name
        node = name.replace("-boot-", "-").replace("-wait", "")
        (trigger,) = cmd["triggers"]
        if prod.requests[node].type == "aws:ec2/instance:Instance":
            assert trigger == prod.run.monitor.ids[node] == "i-" + hashlib.sha1(node.encode()).hexdigest()[:17], name
        else:  # a spot request's instance, not the request
            assert trigger.startswith("i-") and prod.run.monitor.ids[node].startswith("sir-"), name
    upgrades = prod.commands("-upgrade")
    training = inner(upgrades["gpu-swarm-rollout-training-0-upgrade"], "update")
    assert ('GPU_SWARM_STEPS="secure-imds install-agent-venv& install-docker install-nvidia-driver '
            'install-fabric-manager') in training
    assert "GPU_SWARM_IMAGE=deep-learning" in training and "NVIDIA_KERNEL_MODULES=open" in training
    manager = inner(upgrades["gpu-swarm-rollout-managers-0-upgrade"], "update")
    assert 'GPU_SWARM_STEPS="secure-imds install-docker apply-docker-config install-reconciler"' in manager
    assert "GPU_SWARM_IMAGE=ubuntu" in manager


def release_of(prod, name: str) -> str:
    """The release a node's upgrade brings it to: bundle, settings and steps in one hash."""
    upgrade = "gpu-swarm-rollout-" + name.split("-rollout-")[-1].split("-member-")[-1].rsplit("-", 1)[0] + "-upgrade"
    return re.search(r"GPU_SWARM_RELEASE=([0-9a-f]{64})", prod.plain(upgrade)["update"])[1]


def test_each_node_kind_has_its_own_release(prod):
    releases = {name: release_of(prod, name) for name in prod.commands("-upgrade")}
    assert len({releases["gpu-swarm-rollout-managers-0-upgrade"], releases["gpu-swarm-rollout-training-0-upgrade"],
                releases["gpu-swarm-rollout-inference-0-upgrade"]}) == 3
    assert releases["gpu-swarm-rollout-inference-0-upgrade"] == releases["gpu-swarm-rollout-inference-1-upgrade"]


def test_nodes_are_drained_from_the_first_manager_before_their_release_changes(prod):
    manager_0_ip = prod.run.exports["managerPublicIps"][0]
    for name, cmd in prod.commands("-cordon").items():
        assert cmd["connection"]["host"] == manager_0_ip, name
        assert release_of(prod, name) in cmd["update"] and "--availability drain" in cmd["update"]


def test_a_node_that_just_booted_the_release_is_neither_drained_nor_upgraded_again(prod):
    """Cordon and upgrade run as pulumi-command's `update` (a new release). Creating them runs
    nothing where the boot wait saw the node run the very release they bring: the provider runs
    and dials nothing for a command with no `create`."""
    for name in [*prod.commands("-cordon"), *prod.commands("-upgrade")]:
        cmd = prod.plain(name)
        assert "create" not in cmd and release_of(prod, name) in cmd["update"], name


def test_a_node_that_booted_another_release_is_drained_and_upgraded_when_its_rollout_is_made(monkeypatch):
    """An up that stopped between a node's boot and its rollout, then new node software: the rollout,
    made now, must bring the node to the new release. The boot wait (in the state) saw the old one."""
    import tests.conftest as mocks

    class Older(dict):
        def __getitem__(self, key):
            return "0" * 64

    monkeypatch.setattr(mocks, "BOOTED_RELEASE", Older())
    graph = Graph(run_program(stack_config("dev"), stack="dev"))
    for name in [*graph.commands("-cordon"), *graph.commands("-upgrade")]:
        cmd = graph.plain(name)
        assert cmd["create"] == cmd["update"] and release_of(graph, name) in cmd["create"], name


def test_the_program_key_and_the_extra_keys_may_log_in():
    extra = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAINext o'brien@laptop"
    graph = Graph(run_program(stack_config("dev", sshAuthorizedKeys=[extra])))
    for name, cmd in graph.commands("-access").items():
        assert "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIFakeFakeFake" in inner(cmd) and extra in inner(cmd), name


def test_commands_that_meet_a_node_first_wait_for_its_boot_others_give_up_soon(prod):
    patient = ("-probe-1", "-probe-2", "-wait")
    for name in prod.of_type("command:remote:Command"):
        conn = prod.plain(name)["connection"]
        expected = remote.BOOT if name.endswith(patient) else remote.LIVE
        assert (conn["dialErrorLimit"], conn["perDialTimeout"]) == expected, name
        if "proxy" in conn:
            assert (conn["proxy"]["dialErrorLimit"], conn["proxy"]["perDialTimeout"]) == expected, name


def test_nodes_wait_for_the_ssh_rules(prod):
    """An operator whose address changed is let in before `pulumi up` dials the nodes."""
    for name in prod.instances():
        assert prod.depends_on(name, "gpu-swarm-sg-managers-ssh-198-51-100-0-24"), name
        assert prod.depends_on(name, "gpu-swarm-sg-workers-ssh"), name


# ---------------------------------------------------------------- the swarm


def test_no_command_reaches_a_node_on_delete(prod):
    """`pulumi destroy` never needs the swarm: removal happens in SwarmReconcile during pulumi up."""
    for name in prod.of_type("command:remote:Command"):
        assert "delete" not in prod.plain(name), name
    assert not prod.of_type("command:remote:CopyToRemote")  # nothing travels over SSH but scripts


def test_the_other_managers_are_asked_again_whenever_the_first_is_new(prod):
    first = prod.plain("gpu-swarm-managers-0")
    for i in (1, 2):
        probe = prod.requests[f"gpu-swarm-swarm-probe-{i}"]
        assert "stdout" in probe.additionalSecretOutputs  # a live manager answers with its join token
        assert prod.plain(probe.name)["logging"] == "none"
        assert prod.plain(probe.name)["triggers"] == ["i-" + hashlib.sha1(b"gpu-swarm-managers-0").hexdigest()[:17]]
        assert prod.plain(probe.name)["connection"]["host"] == prod.run.exports["managerPublicIps"][i]
        assert prod.depends_on("gpu-swarm-swarm-init", f"gpu-swarm-swarm-probe-{i}")
    assert first  # the first manager itself is not probed
    init = prod.inputs["gpu-swarm-swarm-init"]
    assert is_secret(init["stdin"])
    assert "--default-addr-pool 10.200.0.0/16" in unwrap(init)["create"]


def test_joins_wait_for_the_tokens_and_their_boot(prod):
    joins = prod.commands("-join")
    assert len(joins) == 6
    assert prod.depends_on("gpu-swarm-swarm-tokens", "gpu-swarm-swarm-init")
    for name in joins:
        assert prod.depends_on(name, "gpu-swarm-swarm-tokens"), name
        assert prod.depends_on(name, name.replace("-member-", "-boot-").replace("-join", "-wait")), name


def test_join_tokens_stay_secret(prod):
    tokens = prod.requests["gpu-swarm-swarm-tokens"]
    assert "stdout" in tokens.additionalSecretOutputs
    assert prod.plain("gpu-swarm-swarm-tokens")["logging"] == "none"
    for name in prod.commands("-join"):
        assert is_secret(prod.inputs[name]["stdin"]), name
    for name, inputs in prod.inputs.items():
        visible = json.dumps(_drop_secrets(inputs))
        assert "SWMTKN" not in visible, name


def inner(cmd: dict, script: str = "create") -> str:
    """The script inside `sudo -n bash -c '...'`."""
    words = shlex.split(cmd[script])
    assert words[:4] == ["sudo", "-n", "bash", "-c"]
    return words[4]


def _drop_secrets(value):
    if is_secret(value):
        return "[secret]"
    if isinstance(value, dict):
        return {k: _drop_secrets(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_drop_secrets(v) for v in value]
    return value


def test_workers_are_reached_through_the_live_manager_at_its_elastic_ip(prod):
    """A new cluster has no manager running yet: the first one is the live one (tests/test_access.py has the rest)."""
    manager_0_ip = prod.run.exports["managerPublicIps"][0]
    for name, cmd in prod.commands("-join").items():
        conn = cmd["connection"]
        assert conn["privateKey"].startswith("-----BEGIN OPENSSH PRIVATE KEY-----")
        assert is_secret(prod.inputs[name]["connection"]), name
        if "-managers-" in name:
            assert "proxy" not in conn and conn["host"] in prod.run.exports["managerPublicIps"], name
        else:
            assert conn["host"].startswith("10.42.") and conn["proxy"]["host"] == manager_0_ip, name


def test_joins_name_the_cluster_every_manager_and_the_token_of_their_role(prod):
    manager_ips = prod.run.exports["managerPrivateIps"]
    for name, cmd in prod.commands("-join").items():
        assert "/swarm/join" in cmd["create"] and FAKE_CLUSTER_ID in cmd["create"], name
        assert "targets='" + " ".join(f"{ip}:2377" for ip in manager_ips) + "'" in inner(cmd), name
        role = "manager" if "-member-managers-" in name else "worker"
        assert cmd["stdin"] == f"SWMTKN-1-{role}-secret", name


def test_admits_run_on_manager_0_label_the_node_and_check_its_gpus(prod):
    manager_0_ip = prod.run.exports["managerPublicIps"][0]
    admits = prod.commands("-admit")
    assert len(admits) == 6
    for name, cmd in admits.items():
        assert cmd["connection"]["host"] == manager_0_ip and "proxy" not in cmd["connection"], name
        assert prod.depends_on(name, name.replace("-admit", "-upgrade")), name
        expected = 8 if "training" in name else 16 if "inference" in name else 0  # 4 GPUs x 4 slots
        assert f'[ "$n" -eq {expected} ]' in cmd["create"], name
        assert ("gpu-swarm-check" in cmd["create"]) == ("-managers-" not in name), name
        assert f"gpu-swarm.software={release_of(prod, name)}" in cmd["create"], name
    training = admits["gpu-swarm-rollout-training-0-admit"]["create"]
    assert "gpu-swarm.pool=training" in training and "gpu-swarm.gpu-model=H100" in training


def test_reconcile_keeps_every_node_and_stack_after_all_are_admitted(prod):
    (name,) = prod.commands("reconcile-run")
    cmd = prod.plain(name)
    node_ids = [n["swarmNodeId"] for n in prod.run.exports["inventory"]]
    assert "keep_nodes=' " + " ".join(sorted(node_ids)) + " '" in inner(cmd)
    assert "keep_stacks=' gpu-smoke inference '" in inner(cmd)
    for admit in prod.commands("-admit"):
        assert admit in ancestors(prod, name), admit  # through each pool's last wave


def test_stacks_deploy_from_stdin_after_every_node_is_in(prod):
    deploy_name = "gpu-swarm-stack-gpu-smoke-deploy"
    for admit in prod.commands("-admit"):
        assert admit in ancestors(prod, deploy_name), admit
    deploy = prod.plain(deploy_name)
    text = (REPO / "stacks" / "gpu-smoke.yml").read_text()
    assert deploy["stdin"] == text
    sha = hashlib.sha256(text.encode()).hexdigest()
    # The hash is in the script, so new content is an in-place update (docker stack deploy
    # rolls the services); there are no triggers to replace it.
    assert sha[:16] in deploy["create"] and "docker stack deploy --detach=true" in deploy["create"]
    assert "-c - gpu-smoke" in deploy["create"] and "triggers" not in deploy
    assert not prod.of_type("command:remote:CopyFile")


def test_stacks_deploy_after_the_reconcile_and_wait_until_they_settle(prod):
    """A swap of stacks frees the old stack's GPUs (the reconcile removes it) before the new one
    is deployed; each deploy then waits, bounded by the stack's waitSeconds, on the manager."""
    for deploy in prod.commands("-deploy"):
        assert prod.depends_on(deploy, "gpu-swarm-reconcile-run"), deploy
        assert not prod.depends_on("gpu-swarm-reconcile-run", deploy), deploy
    create = inner(prod.plain("gpu-swarm-stack-gpu-smoke-deploy"))
    assert create.index("docker stack deploy") < create.index('stack_settle.py" --stack gpu-smoke --timeout 600')


def test_each_stack_waits_as_long_as_its_config_says():
    stacks = [{"name": "gpu-smoke", "file": "stacks/gpu-smoke.yml", "waitSeconds": 90}]
    graph = Graph(run_program(stack_config("dev", stacks=stacks)))
    assert "--timeout 90" in inner(graph.plain("gpu-swarm-stack-gpu-smoke-deploy"))


def test_the_stack_tasks_output_reports_what_waits_for_a_gpu_with_the_schedulers_reason(dev):
    """Derived from the deploy command's own report (the mocks answer as node/stack_settle.py prints)."""
    assert dev.run.exports["stackTasks"] == {"gpu-smoke": {
        "services": {"gpu-smoke_gpu": "1 running, 1 waiting for resources"},
        "waitingForGpus": [{"service": "gpu-smoke_gpu", "task": 2,
                            "reason": "no suitable node (insufficient resources on 1 node)"}],
        "settledInSeconds": 4.2}}


# ---------------------------------------------------------------- outputs


def test_inventory_lists_expected_and_advertised_gpus(prod):
    nodes = prod.run.exports["inventory"]
    assert [(n["pool"], n["gpusExpected"], n["slotsPerGpu"], len(n["gpusAdvertised"])) for n in nodes] == [
        ("managers", 0, 0, 0), ("managers", 0, 0, 0), ("managers", 0, 0, 0),
        ("training", 8, 0, 8), ("inference", 4, 4, 16), ("inference", 4, 4, 16)]
    assert all(u.startswith("GPU-") for n in nodes for u in n["gpusAdvertised"])
    assert [n["gpusVerified"] for n in nodes] == [None, None, None, True, True, True]
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
    software = prod.run.exports["nodeSoftware"]
    assert software["bundleSha256"] == node_software.bundle_sha256() and software["url"].startswith("https://")


def test_generated_private_key_is_exported_as_a_secret(prod):
    assert prod.run.exports["privateKey"].startswith("-----BEGIN OPENSSH PRIVATE KEY-----")
    assert prod.run.secret_exports == {"privateKey"}
    (key,) = [k for k in prod.of_type("tls:index/privateKey:PrivateKey") if k == "gpu-swarm-ssh-key"]
    assert prod.plain(key)["algorithm"] == "ED25519"


def test_manager_addresses_are_exported(dev):
    assert len(dev.run.exports["managerPublicIps"]) == len(dev.run.exports["managerPrivateIps"]) == 1


# ---------------------------------------------------------------- structure


def test_components_own_their_children_and_names_do_not_collide(prod):
    assert prod.run.monitor.duplicate_names == []
    types = {r.type for r in prod.requests.values()}
    assert {"gpu-swarm:swarm:Cluster", "gpu-swarm:aws:Network", "gpu-swarm:aws:SecurityGroups",
            "gpu-swarm:aws:SshKey", "gpu-swarm:aws:NodePool", "gpu-swarm:swarm:Init",
            "gpu-swarm:swarm:Membership", "gpu-swarm:swarm:GpuStack", "gpu-swarm:node:Boot",
            "gpu-swarm:node:Rollout", "gpu-swarm:node:Bundle"} <= types
    for name, request in prod.requests.items():
        if request.type not in ("pulumi:pulumi:Stack", "gpu-swarm:swarm:Cluster"):
            assert "gpu-swarm:" in request.parent, name


def test_existing_vpc_creates_no_network():
    subnets = ["subnet-0cccccccccccccccc", "subnet-0aaaaaaaaaaaaaaaa"]
    graph = Graph(run_program(stack_config("prod", vpcId=VPC, subnetIds=subnets)))
    assert not graph.of_type("aws:ec2/vpc:Vpc") and not graph.of_type("aws:ec2/subnet:Subnet")
    assert {i["subnetId"] for i in graph.instances().values() if "subnetId" in i} == set(subnets)
    assert {graph.plain(n)["vpcId"] for n in graph.of_type("aws:ec2/securityGroup:SecurityGroup")} == {VPC}


def test_supplied_key_is_used_and_not_exported():
    private = "-----BEGIN OPENSSH PRIVATE KEY-----\nbWluZQ==\n-----END OPENSSH PRIVATE KEY-----\n"
    graph = Graph(run_program(
        stack_config("dev", sshPublicKey="ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIMine me@host", sshPrivateKey=private),
        secret_keys=("gpu-swarm:sshPrivateKey",),
    ))
    assert not [k for k in graph.of_type("tls:index/privateKey:PrivateKey") if not k.endswith("-host-key")]
    (pair,) = graph.of_type("aws:ec2/keyPair:KeyPair")
    assert graph.plain(pair)["publicKey"] == "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIMine me@host"
    assert "privateKey" not in graph.run.exports
    join = graph.inputs["gpu-swarm-member-t4-0-join"]
    assert is_secret(join["connection"]) and unwrap(join["connection"])["privateKey"] == private


def test_a_custom_ami_reaches_new_nodes_and_running_ones_keep_theirs():
    graph = Graph(run_program(stack_config("dev", image="custom", amiId="ami-0123456789abcdef0")))
    assert graph.plain("gpu-swarm-t4-0")["ami"] == "ami-0123456789abcdef0"
    assert "ami" in graph.requests["gpu-swarm-t4-0"].ignoreChanges


def test_a_shared_pool_advertises_slots_and_its_nodes_say_so(prod):
    upgrade = prod.plain("gpu-swarm-rollout-inference-0-upgrade")["update"]
    assert "GPU_SWARM_SLOTS_PER_GPU=4" in upgrade and "GPU_SWARM_SHARED_KIND=NVIDIA-GPU-SHARED" in upgrade
    assert "GPU_SWARM_SLOTS_PER_GPU" not in prod.plain("gpu-swarm-rollout-training-0-upgrade")["update"]
    admit = inner(prod.plain("gpu-swarm-rollout-inference-0-admit"))
    assert '"Kind":"NVIDIA-GPU-SHARED"' in admit and "gpu-swarm.slots-per-gpu=4" in admit
    assert "--generic-resource NVIDIA-GPU-SHARED=1" in admit  # the check reserves one slot
    assert "--generic-resource NVIDIA-GPU=8" in inner(prod.plain("gpu-swarm-rollout-training-0-admit"))


def test_inventory_shows_each_nodes_health_as_read_at_this_up(prod):
    """The read runs after every change to the swarm, on the first manager, and touches nothing."""
    nodes = prod.run.exports["inventory"]
    assert all(n["health"]["condition"] == "healthy" and n["health"]["availability"] == "active" for n in nodes)
    assert all(n["health"]["readAt"] and n["health"]["readAt"] == nodes[0]["health"]["readAt"] for n in nodes)
    read = prod.plain("gpu-swarm-health-read")
    assert f"# conditions read at {nodes[0]['health']['readAt']}" in read["create"]
    assert all(n["swarmNodeId"] in read["create"] for n in nodes)
    assert "docker node update" not in read["create"] and "delete" not in read
    for after in ("gpu-swarm-reconcile-run", "gpu-swarm-stack-gpu-smoke-deploy", "gpu-swarm-rollout-training-0-admit"):
        assert prod.depends_on("gpu-swarm-health-read", after), after


def test_gpu_nodes_run_the_health_watcher_and_managers_the_reconciler(prod):
    """Every node gets the health settings apart from its release."""
    for name in ("training-0", "inference-0", "managers-0"):
        upgrade = prod.plain(f"gpu-swarm-rollout-{name}-upgrade")["update"]
        gpu = not name.startswith("managers")
        assert ("install-health-watcher" in upgrade) is gpu and ("install-reconciler" in upgrade) is not gpu, name
        # No market in the release: the watcher asks IMDS whether its instance is spot, so a pool's move to
        # or from spot rolls no running node (which keeps the market it was launched on).
        assert "GPU_SWARM_SPOT" not in upgrade, name
        assert "HEALTH_" not in upgrade  # a health setting must not roll the node
        health = prod.plain(f"gpu-swarm-boot-{name}-health")["create"]
        assert "HEALTH_INTERVAL_SECONDS=10" in health and "try-restart" in health
        assert prod.depends_on(f"gpu-swarm-boot-{name}-health", f"gpu-swarm-boot-{name}-wait")


def test_the_sdks_cycle_check_walks_linearly_in_the_pool_size(monkeypatch):
    """At each registration the SDK walks every new dependency's ancestry for cycles
    (resource_cycle_breaker). The roll's chain edges are URN stand-ins (components/chain.py), whose
    ancestry is not walked again, so the walking grows with the pool, not with its square."""
    import pulumi.runtime.resource_cycle_breaker as breaker
    walk, steps = breaker._with_transitive_deps, [0]

    def counted(resource, visited):
        steps[0] += 1
        return walk(resource, visited)
    monkeypatch.setattr(breaker, "_with_transitive_deps", counted)

    def walked(count: int) -> int:
        steps[0] = 0
        _pool_graph(count, None)  # the default rollout, waves of 10 %
        return steps[0]
    small, big = walked(20), walked(80)
    # Four times the nodes: 3.7 times the steps (23,707 to 88,484). With plain edges along the chain
    # it was 7.0 times (33,686 to 234,879), and 6.4 times from 100 to 300 nodes.
    assert big < 5 * small, (small, big)
