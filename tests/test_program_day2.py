"""The README's Day-2 rows that tests/test_pulumi_up.py does not reach, through Pulumi's real CLI.

One cluster through seven `pulumi up`s and a `pulumi destroy`, each checked on the real swarm:
1. the first up: two zones, one GPU pool on a custom AMI (`image: custom`, from the start: a
   change of `image` rolls every GPU node), two stacks, monitoring, and a second authorized key
   (step 1 of a key rotation);
2. one up of several changes: the zone list moved on, a new custom `amiId`, a new pool whose
   type only one zone offers, step 2 of the rotation, a new gpuKind and time-slicing on the
   running pool;
3. MPS turned on for the running pool (`sharing: {mode: mps}`), with a stack that reserves a
   slot, and `amiId` back to the first AMI: the node rolls in place, runs its MPS daemon and relay
   (the stand-ins of localswarm/standins), advertises MPS slots, and the slot task gets the relay's
   pipe; the other pool's node neither rolls nor changes its AMI;
4. the only manager replaced (`pulumi up --replace`): a new swarm, which gets every stack and
   the monitoring stack again;
5. two managers added (three in all), then the first one replaced (`pulumi up --replace`): it joins
   the swarm the other two hold, which keeps its ID, its quorum and its stacks;
6. EFA turned on for a running pool: its node is replaced new-first with the current inputs;
   the rehearsal has no EFA devices, so the new node fails its boot, the up fails, and the old
   node is still serving;
7. `pulumi destroy` with the first manager already gone.
Each up's inputs are set as a user sets them, with `pulumi config set-all --json` (the shape
`pulumi config --json` prints), and the state is read with `pulumi stack export`.
"""
from __future__ import annotations

import json
import subprocess

import pytest

from localswarm import api, machines, network, nspawn, object_store, pulumi_cli, pulumi_host, ssh
from localswarm.fake_aws import CUSTOM_AMI, CUSTOM_AMI_NEXT
from localswarm.local_cloud import EC2_SUBNET, INSTANCE
from node.contract import CLOUD_INIT_STATUS
from swarm.node_contract import MONITORING_STACK, MPS_DIR
from tests.rehearsal_tools import ami_of, cli, config_set_all, diagnostics, pulumi, require_engine, tasks_of, until

pytestmark = pytest.mark.integration

STACKS = [{"name": "infer", "file": "tests/data/day2/gpu.yml"}, {"name": "web", "file": "tests/data/day2/web.yml"}]
T4 = {"name": "t4", "instanceType": "g4dn.xlarge", "count": 1}
A100 = {"name": "a100", "instanceType": "p4d.24xlarge", "count": 1}  # offered in us-east-1b only (fake_aws)
FIRST = {"availabilityZones": ["us-east-1a", "us-east-1b"], "gpuPools": [T4], "stacks": STACKS,
         "monitoring": True, "image": "custom", "amiId": CUSTOM_AMI}
CHANGED = {"availabilityZones": ["us-east-1b", "us-east-1c"], "stacks": STACKS, "monitoring": True,
           "gpuPools": [{**T4, "sharing": {"slotsPerGpu": 2}}, A100], "gpuKind": "GPU", "sshAuthorizedKeys": [],
           "image": "custom", "amiId": CUSTOM_AMI_NEXT}
SLOT = {"name": "slot", "file": "tests/data/day2/slot.yml"}  # reserves one GPU-SHARED slot
MPS_ON = {**CHANGED, "stacks": [*STACKS, SLOT], "amiId": CUSTOM_AMI,  # back to the first AMI
          "gpuPools": [{**T4, "sharing": {"slotsPerGpu": 2, "mode": "mps"}}, A100]}  # from the third up on
THREE_MANAGERS = {**MPS_ON, "managerCount": 3}  # from the fifth up on
MANAGERS = ["gpu-swarm-dev-manager-0", "gpu-swarm-dev-manager-1", "gpu-swarm-dev-manager-2"]


def up(settings: dict, *extra: str, secrets: dict | None = None, check: bool = True):
    """The inputs set (`pulumi config set-all --json`), then `pulumi up --yes`; the swarm's view after it,
    with the run's commands and drains (pulumi_cli.last_run()) and each node's GPU check (the inventory)."""
    config_set_all(settings, secrets)
    proc = pulumi("up", "--yes", *extra)
    if not check:
        return proc
    assert proc.returncode == 0, diagnostics(proc)
    view = pulumi_cli.status("dev")
    checked = {n["name"]: n.get("gpusVerified") for n in outputs()["inventory"]}
    for node in view["nodes"]:
        node["gpus_verified"] = checked.get(node["name"])
    return {**view, **pulumi_cli.last_run(), "out": proc.stdout}


def outputs() -> dict:
    return json.loads(pulumi("stack", "output", "--json", "--show-secrets").stdout)


def exported() -> list[dict]:
    return pulumi_cli.exported("dev")


def urn_of(name: str) -> str:
    (urn,) = [r["urn"] for r in exported() if r["urn"].endswith(f"::{name}") and not r.get("delete")]
    return urn


def records() -> dict[str, dict]:
    return {r["hostname"]: r for r in pulumi_cli.world()["machines"].values()}


def machine(record: dict) -> machines.Machine:
    return machines.Machine(record["machine"], record["index"])


def manager_sock() -> str:
    return pulumi_host.docker_socket(machine(records()["gpu-swarm-dev-manager-0"]))


def resources(typ: str) -> dict[str, dict]:
    """The state's live resources of a type, by name (those a failed replacement left to delete aside)."""
    return {r["urn"].rsplit("::", 1)[1]: r for r in exported() if r["type"] == typ and not r.get("delete")}


def logs_in(address: str, private_key: str) -> bool:
    try:
        ssh.run({"host": address, "user": "ubuntu", "privateKey": private_key, "dialErrorLimit": 1,
                 "perDialTimeout": 10}, "true")
    except ssh.CommandFailed:
        return False
    return True


def kinds_advertised() -> dict[str, dict[str, int]]:
    """Each swarm node's generic resources, by kind: what the scheduler places on."""
    out = {}
    for info in api.get(manager_sock(), "/nodes", timeout=10):
        counts: dict[str, int] = {}
        for res in info["Description"].get("Resources", {}).get("GenericResources") or []:
            spec = res.get("NamedResourceSpec") or res.get("DiscreteResourceSpec")
            counts[spec["Kind"]] = counts.get(spec["Kind"], 0) + (spec["Value"] if "DiscreteResourceSpec" in res else 1)
        out[info["Description"]["Hostname"]] = counts
    return out


def running_on(report: dict, service: str) -> list[str]:
    return sorted(t["node"] for t in tasks_of(report, service) if t["state"] == "running")


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    folder = tmp_path_factory.mktemp("keys")
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "next@ops", "-f", str(folder / "next")],
                   check=True)
    return {"public": (folder / "next.pub").read_text().strip(), "private": (folder / "next").read_text()}


@pytest.fixture(scope="module")
def first(keys):
    require_engine()
    cli("down")
    report = up({**FIRST, "sshAuthorizedKeys": [keys["public"]]})  # rotation, step 1
    yield report
    cli("down")


def test_zones_a_pool_in_fewer_zones_the_keys_second_step_and_a_new_gpu_kind_with_sharing_in_one_up(first, keys):
    assert sorted(running_on(first, "infer_infer")) == ["gpu-swarm-dev-t4-0"]  # one GPU, the other replica waits
    before = records()
    pids = {name: nspawn.init_pid(machine(r)) for name, r in before.items()}
    subnets = {r["inputs"]["availabilityZone"]: r["id"] for r in resources(EC2_SUBNET).values()}
    assert set(subnets) == {"us-east-1a", "us-east-1b"}
    (old_key,) = [r["outputs"]["privateKeyOpenssh"] for n, r in resources("tls:index/privateKey:PrivateKey").items()
                  if not n.endswith("-host-key")]

    report = up(CHANGED, secrets={"sshPublicKey": keys["public"], "sshPrivateKey": keys["private"]})

    after = records()
    # Running nodes stay where and what they are: the same machines, never stopped (the same init).
    for name in ("gpu-swarm-dev-manager-0", "gpu-swarm-dev-t4-0"):
        assert after[name]["machine"] == before[name]["machine"] and nspawn.init_pid(machine(after[name])) == pids[name]
    # A new custom amiId reaches new nodes only: the running GPU node keeps the AMI it was launched
    # from, the new pool's node is launched from the new one.
    assert (ami_of("gpu-swarm-dev-t4-0"), ami_of("gpu-swarm-dev-a100-0")) == (CUSTOM_AMI, CUSTOM_AMI_NEXT)
    # The zone list moved on: us-east-1a's subnet stays (the running nodes are in it), us-east-1c's is new;
    # the new pool takes the one cluster zone that offers its type, with no subnet of its own.
    now = {r["inputs"]["availabilityZone"]: r["id"] for r in resources(EC2_SUBNET).values()}
    assert set(now) == {"us-east-1a", "us-east-1b", "us-east-1c"} and all(now[z] == subnets[z] for z in subnets)
    instances = resources(INSTANCE)
    assert instances["gpu-swarm-a100-0"]["inputs"]["subnetId"] == now["us-east-1b"]
    assert instances["gpu-swarm-t4-0"]["inputs"]["subnetId"] == subnets["us-east-1a"]
    # The new kind and the sharing rolled through the running nodes in place, one roll for both and
    # for the new key; the swarm advertises only the new kinds.
    ran = {c["name"]: c["action"] for c in report["commands"]}
    assert {"gpu-swarm-rollout-t4-0-upgrade", "gpu-swarm-rollout-managers-0-upgrade"} <= set(ran)
    # The new key is a new connection: the boot wait and the join run again and find their work done.
    assert ran["gpu-swarm-boot-t4-0-wait"] == ran.get("gpu-swarm-member-t4-0-join", "update") == "update"
    assert report["peak_drained_per_pool"].get("t4", 0) <= 1
    assert kinds_advertised() == {"gpu-swarm-dev-manager-0": {}, "gpu-swarm-dev-t4-0": {"GPU-SHARED": 2},
                                  "gpu-swarm-dev-a100-0": {"GPU": 8}}
    nodes = {n["name"]: n for n in report["nodes"]}
    assert all(n["state"] == "ready" and n["availability"] == "active" for n in nodes.values())
    assert nodes["gpu-swarm-dev-a100-0"]["gpus_verified"] is True and len(nodes["gpu-swarm-dev-t4-0"]["slots"]) == 2
    # The stack's device requests follow the kind: both replicas run on the pool of whole GPUs.
    assert running_on(report, "infer_infer") == ["gpu-swarm-dev-a100-0"] * 2
    # Step 2 of the rotation: the program's key is the new one, and the old one left every node.
    for name, r in after.items():
        address = network.node_addr(r["index"])
        assert logs_in(address, keys["private"]) and not logs_in(address, old_key), name


def engine_labels(hostname: str) -> dict[str, str]:
    node = next(n for n in api.get(manager_sock(), "/nodes", timeout=10) if n["Description"]["Hostname"] == hostname)
    return node["Description"].get("Engine", {}).get("Labels") or {}


def slot_task_output(hostname: str) -> str:
    """What the slot stack's running task printed (tests/data/day2/slot.yml), from its node's engine."""
    sock = pulumi_host.docker_socket(machine(records()[hostname]))
    running = {"label": ["com.docker.swarm.service.name=slot_slot"], "status": ["running"]}
    (container,) = api.get(sock, "/containers/json", timeout=10, filters=running)
    return api.request(sock, f"/containers/{container['Id']}/logs", timeout=10, stdout=1).decode(errors="replace")


def test_mps_turned_on_for_a_running_pool_rolls_its_node_in_place_and_a_slot_task_gets_the_relays_pipe(first, keys):
    before = records()
    pids = {name: nspawn.init_pid(machine(r)) for name, r in before.items()}
    report = up(MPS_ON, secrets={"sshPublicKey": keys["public"], "sshPrivateKey": keys["private"]})
    # In place: the same machines, never stopped; only the pool's node rolled (install-mps started
    # gpu-swarm-mps: the GPU's daemon, its relay, compute mode Exclusive_Process). amiId went back to
    # the first AMI in the same up: that rolls nothing, and the a100 node keeps the AMI it was launched from.
    after = records()
    for name in ("gpu-swarm-dev-t4-0", "gpu-swarm-dev-a100-0"):
        assert after[name]["machine"] == before[name]["machine"] and nspawn.init_pid(machine(after[name])) == pids[name]
    ran = {c["name"]: c["action"] for c in report["commands"]}
    assert "gpu-swarm-rollout-t4-0-upgrade" in ran and "gpu-swarm-rollout-a100-0-upgrade" not in ran, sorted(ran)
    assert ami_of("gpu-swarm-dev-a100-0") == CUSTOM_AMI_NEXT
    assert report["peak_drained_per_pool"].get("t4", 0) <= 1
    # The agent advertises the GPU's slots as MPS slots: it saw the GPU in Exclusive_Process.
    assert kinds_advertised()["gpu-swarm-dev-t4-0"] == {"GPU-SHARED": 2}
    labels = engine_labels("gpu-swarm-dev-t4-0")
    assert labels.get("gpu.sharing") == "mps" and labels.get("gpu.replicas") == "2", labels
    # A stack that reserves a slot runs, and its task's pipe directory holds the relay's socket
    # (the stand-in daemon's own control is a plain file): the guard mounted the relay's folder there.
    assert running_on(report, "slot_slot") == ["gpu-swarm-dev-t4-0"]
    (gpu,) = {t["gpus"][0] for t in tasks_of(report, "slot_slot") if t["state"] == "running"}
    printed = slot_task_output("gpu-swarm-dev-t4-0")
    assert f"pipe={MPS_DIR}/{gpu}/pipe" in printed and "control=socket" in printed, printed


def test_the_only_manager_replaced_makes_a_new_swarm_that_gets_every_stack_and_monitoring_again(first, keys):
    swarm_before = api.get(manager_sock(), "/swarm", timeout=10)["ID"]
    old = records()["gpu-swarm-dev-manager-0"]
    report = up(MPS_ON, "--replace", urn_of("gpu-swarm-managers-0"),
                secrets={"sshPublicKey": keys["public"], "sshPrivateKey": keys["private"]})
    new = records()["gpu-swarm-dev-manager-0"]
    assert new["machine"] != old["machine"] and not machine(old).dir.exists()  # new first, the old one deleted
    # A new swarm, made on the new manager: its boot wait and the swarm init reached the new machine, which
    # holds the Elastic IP once the old association is gone (DisassociateAddress, before the new one is made).
    assert api.get(manager_sock(), "/swarm", timeout=10)["ID"] != swarm_before
    # The boot wait read the new machine's own first boot: the cloud-init time it reported is the one in the
    # new machine's status.json (the old manager, answering at the same address, would report its own). Not its
    # duration: a boot that ended while the engine ran other steps is waited for in well under a second.
    v1 = json.loads(machines.run(machine(new), ["cat", CLOUD_INIT_STATUS]).stdout)["v1"]
    booted = round(v1["modules-final"]["finished"] - (v1["init-local"]["start"] or v1["init"]["start"]), 3)
    assert outputs()["bootstrapTimings"]["gpu-swarm-dev-manager-0"]["cloud-init"]["seconds"] == booted
    # Every node moved to it, and nothing of the old swarm is listed.
    assert sorted(n["name"] for n in report["nodes"]) == [
        "gpu-swarm-dev-a100-0", "gpu-swarm-dev-manager-0", "gpu-swarm-dev-t4-0"]
    assert all(n["state"] == "ready" and n["availability"] == "active" for n in report["nodes"])
    # Every stack and the monitoring stack were deployed into it, and their tasks run.
    assert running_on(report, "infer_infer") == ["gpu-swarm-dev-a100-0"] * 2
    assert len(running_on(report, "web_web")) == 1
    monitoring = [s for s in report["services"] if s["name"].startswith(f"{MONITORING_STACK}_")]
    assert monitoring and all(running_on(report, s["name"]) for s in monitoring), monitoring
    assert kinds_advertised()["gpu-swarm-dev-a100-0"] == {"GPU": 8}


def test_three_managers_with_the_first_replaced_keep_the_swarm_its_quorum_and_its_stacks(first, keys):
    secrets = {"sshPublicKey": keys["public"], "sshPrivateKey": keys["private"]}
    grown = up(THREE_MANAGERS, secrets=secrets)
    assert sorted(n["name"] for n in grown["nodes"] if n["role"] == "manager") == MANAGERS
    swarm = api.get(manager_sock(), "/swarm", timeout=10)["ID"]
    services = {s["ID"]: s["Spec"]["Name"] for s in api.get(manager_sock(), "/services", timeout=10)}
    old = records()["gpu-swarm-dev-manager-0"]
    # The stacks with a task on the first manager: the reconcile drains it, and waits until they run again.
    (old_id,) = [n["ID"] for n in api.get(manager_sock(), "/nodes", timeout=10)
                 if n["Description"]["Hostname"] == "gpu-swarm-dev-manager-0"]
    on_old = {t["Spec"]["ContainerSpec"]["Labels"].get("com.docker.stack.namespace")
              for t in api.get(manager_sock(), "/tasks", timeout=10)
              if t.get("NodeID") == old_id and t["DesiredState"] == "running"} - {None}

    report = up(THREE_MANAGERS, "--replace", urn_of("gpu-swarm-managers-0"), secrets=secrets)
    reconciled = resources("command:remote:Command")["gpu-swarm-reconcile-run"]["outputs"]
    assert f"removing node {old_id}" in reconciled["stdout"], reconciled
    for stack in on_old:
        assert f"waiting for stack {stack}, whose tasks moved, to settle" in reconciled["stderr"], reconciled

    new = records()["gpu-swarm-dev-manager-0"]
    assert new["machine"] != old["machine"] and not machine(old).dir.exists()  # new first, the old one deleted
    # The new first manager joined the swarm the other two hold: the same swarm, the same services.
    assert api.get(manager_sock(), "/swarm", timeout=10)["ID"] == swarm
    assert {s["ID"]: s["Spec"]["Name"] for s in api.get(manager_sock(), "/services", timeout=10)} == services
    # Quorum kept: three managers, each reachable, one leader; the old first manager's entry removed.
    listed = api.get(manager_sock(), "/nodes", timeout=10)
    managers = {n["Description"]["Hostname"]: n["ManagerStatus"] for n in listed if n["Spec"]["Role"] == "manager"}
    assert sorted(managers) == MANAGERS and len(listed) == 5, [n["Description"]["Hostname"] for n in listed]
    assert all(m["Reachability"] == "reachable" for m in managers.values()), managers
    assert sum(bool(m.get("Leader")) for m in managers.values()) == 1
    assert all(n["state"] == "ready" and n["availability"] == "active" for n in report["nodes"])
    # The stacks kept running.
    assert running_on(report, "infer_infer") == ["gpu-swarm-dev-a100-0"] * 2
    assert len(running_on(report, "web_web")) == 1
    monitoring = [s for s in report["services"] if s["name"].startswith(f"{MONITORING_STACK}_")]
    assert monitoring and all(running_on(report, s["name"]) for s in monitoring), monitoring


def test_a_manager_stopped_leaves_the_next_up_to_the_next_running_manager_and_nothing_is_drained(first, keys):
    """docs/operations/day-2.md's row "a manager stopped or lost": the first manager's machine stopped (as
    an operator or AWS stops one); the refresh reads it stopped, and the next up reaches every node through
    the second manager. What runs again only checks: no node drained, rolled or replaced, the same swarm.
    The reconcile keeps the stopped manager's node and does not wait for it: it failed every up after 120 s
    on it ("kept node(s) not ready") until the program read which instances AWS reports stopped."""
    stopped = records()["gpu-swarm-dev-manager-0"]
    swarm = api.get(manager_sock(), "/swarm", timeout=10)["ID"]
    before = {r["hostname"]: r["machine"] for r in records().values()}
    machines.stop(machine(stopped))
    report = up(THREE_MANAGERS, secrets={"sshPublicKey": keys["public"], "sshPrivateKey": keys["private"]})
    conns = {name: r["inputs"]["connection"] for name, r in resources("command:remote:Command").items()
             if r["inputs"].get("connection")}
    second = conns["gpu-swarm-member-managers-1-join"]["host"]
    assert {c["proxy"]["host"] for c in conns.values() if c.get("proxy")} == {second}
    swarm_steps = {n: c["host"] for n, c in conns.items() if n.endswith(("-cordon", "-admit"))}
    assert swarm_steps and set(swarm_steps.values()) == {second}, swarm_steps
    assert {r["hostname"]: r["machine"] for r in records().values()} == before  # none replaced
    assert not max(report["peak_drained_per_pool"].values(), default=0)
    reconciled = resources("command:remote:Command")["gpu-swarm-reconcile-run"]["outputs"]
    assert "is kept, not waited for: AWS reports its instance stopped" in reconciled["stderr"], reconciled
    on_second = pulumi_host.docker_socket(machine(records()["gpu-swarm-dev-manager-1"]))
    assert api.get(on_second, "/swarm", timeout=10)["ID"] == swarm
    nodes = {n["name"]: n for n in report["nodes"]}
    assert all(n["state"] == "ready" for name, n in nodes.items() if name != "gpu-swarm-dev-manager-0"), nodes
    machines.start(machine(stopped))  # back for the next test, which goes through it again
    until(lambda: next((n for n in pulumi_cli.status("dev")["nodes"] if n["name"] == "gpu-swarm-dev-manager-0"
                        and n["state"] == "ready"), None), 120, "the first manager ready again")


def test_efa_turned_on_replaces_the_node_new_first_and_a_new_node_that_fails_its_boot_leaves_the_old_one_serving(
        first, keys):
    """EFA turned on for a running pool: its node is replaced, the new instance first, with the program's
    current inputs (the EFA launch template, and user data whose boot runs install-efa). The rehearsal
    has no EFA devices, so the new node's boot fails: the up fails, and the old node serves on."""
    old = records()["gpu-swarm-dev-a100-0"]
    efa = {**THREE_MANAGERS, "gpuPools": [MPS_ON["gpuPools"][0], {**A100, "efa": True}]}
    failed = up(efa, secrets={"sshPublicKey": keys["public"], "sshPrivateKey": keys["private"]}, check=False)
    said = failed.stdout + failed.stderr
    assert failed.returncode != 0, said[-3000:]
    # The new node booted the program's current user data (with the EFA step), not the old node's.
    assert "gpu-swarm-boot-a100-0-wait" in said and "install-efa" in said, diagnostics(failed)
    # The N+1 moment: both instances exist, the new one (EFA interfaces from its launch template) beside the old.
    held = pulumi_cli.world()["machines"]
    both = [r for r in held.values() if r["hostname"] == "gpu-swarm-dev-a100-0"]
    assert len(both) == 2 and old in both and all(machines.running(machine(r)) for r in both)
    # The engine keeps the replaced instance in its state, marked for deletion by a later up.
    doomed = [r["id"] for r in exported() if r["type"] == INSTANCE and r.get("delete")]
    assert doomed == [next(i for i, r in held.items() if r == old)]
    new = resources(INSTANCE)["gpu-swarm-a100-0"]
    assert new["inputs"].get("launchTemplate") and not new["inputs"].get("subnetId")
    assert new["inputs"]["ami"] == CUSTOM_AMI  # the current amiId; the old node's is CUSTOM_AMI_NEXT
    # Nothing lost: the old node is still the swarm's, active, with its GPUs and both replicas.
    view = pulumi_cli.status("dev")
    node = next(n for n in view["nodes"] if n["name"] == "gpu-swarm-dev-a100-0")
    assert node["state"] == "ready" and node["availability"] == "active" and len(node["gpus"]) == 8
    assert [n["name"] for n in view["nodes"]].count("gpu-swarm-dev-a100-0") == 1
    assert running_on(view, "infer_infer") == ["gpu-swarm-dev-a100-0"] * 2


def test_pulumi_destroy_with_the_manager_gone_deletes_everything_and_connects_to_no_node(first):
    held = list(pulumi_cli.world()["machines"].values())
    bundles = [object_store.object_path(r["outputs"]["bucket"], r["inputs"]["key"])
               for r in resources("aws:s3/bucketObjectv2:BucketObjectv2").values()]
    assert bundles and all(p.exists() for p in bundles)
    machines.terminate(machine(records()["gpu-swarm-dev-manager-0"]))  # the manager is already gone
    gone = pulumi("destroy", "--yes")
    assert gone.returncode == 0, gone.stdout[-3000:] + gone.stderr[-3000:]
    assert pulumi_cli.last_run()["commands"] == []  # no command has a delete script: no node was dialled
    assert not any(machine(r).dir.exists() for r in held) and machines.machines() == []
    assert not any(p.exists() for p in bundles)
    assert not pulumi_cli.holds_machines() and not exported()
