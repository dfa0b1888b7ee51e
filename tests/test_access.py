"""How `pulumi up` reaches the nodes: pinned host keys, managers at Elastic IPs, any live manager as the jump host.

Under mocks: each node boots with its own host key (cloud-init ssh_keys) and every connection,
the proxy's included, pins that very key; a stopped first manager moves the workers' jump host
to the next running one on the next `pulumi up`, which re-runs only scripts that check and
change nothing. That real OpenSSH refuses another key is shown by the rehearsal
(`localswarm pulumi up`, see the report), and by tests/test_localswarm_ssh.py.
"""
import pytest
import yaml

from components import remote
from components.access import live_index
from localswarm import fake_aws
from tests.conftest import run_program, stack_config, unwrap
from tests.test_plan import plan
from tests.test_resource_graph import Graph, node_of


@pytest.fixture(scope="module")
def prod():
    return Graph(run_program(stack_config("prod"), stack="prod"))


def host_keys(graph) -> dict[str, str]:
    """Each node's public host key, as its user data hands it over ("ssh-ed25519 AAAA...")."""
    keys = {}
    for name, inst in graph.instances().items():
        keys[inst["tags"]["Name"]] = remote.pinned(yaml.safe_load(inst["userData"])["ssh_keys"]["ed25519_public"])
    return keys


def test_every_connection_pins_its_nodes_own_host_key_and_its_proxys(prod):
    keys = host_keys(prod)
    assert len(set(keys.values())) == len(keys) == 6
    live = "gpu-swarm-prod-manager-0"  # a new cluster: no manager runs yet, the first one is the live one
    for name in prod.of_type("command:remote:Command"):
        conn = prod.plain(name)["connection"]
        assert conn["hostKey"] == keys[node_of(prod, name)], name
        if "proxy" in conn:
            assert conn["proxy"]["hostKey"] == keys[live], name


def test_a_nodes_private_host_key_is_secret_in_its_user_data_and_the_state(prod):
    for name in prod.instances():
        inputs = prod.inputs[name]
        assert inputs["userData"].get("4dabf18193072939515e22adb298388d") == "1b47061264138c4ac30d75fd1eb44270", name
    for key in (k for k in prod.of_type("tls:index/privateKey:PrivateKey") if k.endswith("-host-key")):
        assert prod.plain(key)["algorithm"] == "ED25519"


def test_the_host_key_is_the_only_one_the_node_makes(prod):
    doc = yaml.safe_load(prod.plain("gpu-swarm-training-0")["userData"])
    assert doc["ssh_deletekeys"] is True and doc["ssh_genkeytypes"] == ["ed25519"]
    assert doc["ssh_keys"]["ed25519_private"].startswith("-----BEGIN OPENSSH PRIVATE KEY-----")


def test_managers_keep_their_address_an_elastic_ip_each(prod):
    eips = {n: prod.plain(n) for n in prod.of_type("aws:ec2/eip:Eip")}
    assert {"gpu-swarm-managers-0-ip", "gpu-swarm-managers-1-ip", "gpu-swarm-managers-2-ip"} <= set(eips)
    for i in range(3):
        association = prod.plain(f"gpu-swarm-managers-{i}-ip-association")
        # Through the instance's primary interface (the mock's eni- follows the instance id), never by instance id.
        instance_id = prod.run.monitor.ids[f"gpu-swarm-managers-{i}"]
        assert association["networkInterfaceId"] == "eni-" + __import__("hashlib").sha1(
            instance_id.encode()).hexdigest()[:17] and "instanceId" not in association
        # A replaced manager gets the same address: the old association goes first.
        assert prod.requests[f"gpu-swarm-managers-{i}-ip-association"].deleteBeforeReplace
    ips = prod.run.exports["managerPublicIps"]
    assert all(ip.startswith("3.") for ip in ips)  # the Elastic IPs (the mocks' 3.x), not the instances' own
    for name in prod.commands("-join"):
        conn = prod.plain(name)["connection"]
        assert (conn.get("proxy") or conn)["host"] in ips, name
        # Commands reach a manager only once its address is its own.
        assert any(prod.depends_on(name, f"gpu-swarm-managers-{i}-ip-association") for i in range(3)) or \
            "-managers-" not in name, name


def test_workers_have_no_elastic_ip_but_efa_nodes_do(prod):
    eips = set(prod.of_type("aws:ec2/eip:Eip"))
    assert "gpu-swarm-inference-0-ip" not in eips and "gpu-swarm-training-0-ip" in eips


def test_known_hosts_lists_every_node_at_the_addresses_it_is_dialled_at(prod):
    lines = prod.run.exports["knownHosts"].splitlines()
    assert len(lines) == 6
    keys = host_keys(prod)
    inventory = {n["name"]: n for n in prod.run.exports["inventory"]}
    for line in lines:
        hosts, key = line.split(" ", 1)
        node = next(name for name, k in keys.items() if k == key)
        assert inventory[node]["privateIp"] in hosts.split(","), line
        if "manager" in node:
            assert inventory[node]["publicIp"] in hosts.split(","), line


def test_the_first_running_manager_is_the_live_one():
    names = ["c-manager-0", "c-manager-1", "c-manager-2"]  # by Name tag: a replaced manager keeps its name
    assert live_index(names, []) == 0  # a new cluster: none runs yet
    assert live_index(names, ["c-manager-2", "c-manager-1"]) == 1
    assert live_index(names, ["c-manager-9"]) == 0


def test_a_host_key_must_be_one_openssh_public_key():
    assert remote.pinned("ssh-ed25519 AAAAC3Nz host@x\n") == "ssh-ed25519 AAAAC3Nz"
    for bad in ("", None, "AAAAC3Nz", "-----BEGIN OPENSSH PRIVATE KEY-----"):
        with pytest.raises(ValueError, match="expected an OpenSSH public host key"):
            remote.pinned(bad)


# ---------------------------------------------------------------- the first manager stops


PROD = stack_config("prod")
WORKER_STEPS = ("-join", "-cordon", "-upgrade", "-admit", "-wait", "-access", "-health")


def stop_first_manager():
    fake_aws.ACCOUNT.stop("gpu-swarm-prod-manager-0")


def test_with_the_first_manager_stopped_the_next_up_goes_through_the_second(monkeypatch):
    result = plan(PROD, PROD, between=stop_first_manager, monkeypatch=monkeypatch)
    assert result.instances_replaced() == {} and not result.created and not result.deleted
    assert not {n for n, why in result.replaced.items()}  # no trigger changed: no command is replaced
    b = Graph(run_program(PROD, stack="prod", keep_account=True))
    manager_1 = b.run.exports["managerPublicIps"][1]
    for name, cmd in b.commands("").items():
        conn = cmd["connection"]
        if "proxy" in conn:
            assert conn["proxy"]["host"] == manager_1, name
    for name in b.commands("-cordon") | b.commands("-admit") | b.commands("reconcile-run"):
        assert b.plain(name)["connection"]["host"] == manager_1, name
    # Only connections changed, and the reconcile's word that it does not wait for the stopped manager;
    # the commands whose connection changed only check, and say so.
    updated = dict(result.updated)
    assert updated.pop("gpu-swarm-reconcile-run") == {"connection", "create"}
    assert "is kept, not waited for" in b.plain("gpu-swarm-reconcile-run")["create"]
    assert all(why == {"connection"} for why in updated.values()), updated
    changed_nodes = {n.rsplit("-", 1)[0] for n in result.updated}
    assert not [n for n in changed_nodes if "-managers-" in n and "rollout" not in n], changed_nodes


def test_a_boot_wait_run_again_only_prints_the_first_boots_timings(prod):
    for name in prod.commands("-wait"):
        update = prod.plain(name)["update"]
        assert "booted already" in update and "result.json" not in update, name
        assert "bootstrap-timings.json" in update


def test_a_connection_unwraps_to_plain_args_with_both_keys(prod):
    conn = unwrap(prod.inputs["gpu-swarm-member-inference-0-join"]["connection"])
    assert set(conn) >= {"host", "user", "privateKey", "hostKey", "proxy", "dialErrorLimit", "perDialTimeout"}
    assert set(conn["proxy"]) >= {"host", "user", "privateKey", "hostKey"}


def test_the_boot_waits_update_prints_the_recorded_timings_and_refuses_a_node_with_no_boot(tmp_path):
    import json
    import subprocess

    from to_node import commands as node_commands
    from swarm.node_contract import APPLIED, BOOTSTRAP_DONE, BOOTSTRAP_TIMINGS
    script = node_commands.boot_recorded(root=str(tmp_path))
    missing = subprocess.run(["bash", "-c", script], capture_output=True, text=True)
    assert missing.returncode == 1 and "no record of its first boot" in missing.stderr
    for path, text in ((BOOTSTRAP_DONE, "bootstrap done\n"),
                       (BOOTSTRAP_TIMINGS, '{"install-docker": {"seconds": 1.5, "status": "done"}}\n')):
        (tmp_path / path.lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path.lstrip("/")).write_text(text)
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == {"install-docker": {"seconds": 1.5, "status": "done"}}
    # A node with no applied release (an install that never finished) names none: its rollout then drains
    # and upgrades it when it is made.
    assert node_commands.ran_release(done.stdout) is None
    (tmp_path / APPLIED.lstrip("/")).write_text("ab" * 32 + "\n")
    again = subprocess.run(["bash", "-c", script], capture_output=True, text=True)
    assert node_commands.ran_release(again.stdout) == "ab" * 32
