"""Integration tests: the rehearsal's machines (localswarm/machines.py), booted for real.

Two machines from the node image, each with systemd, cloud-init (NoCloud), sshd and dockerd:
real SSH (direct and through the other), a swarm across them on an overlay network with GPU
generic resources, the hardware stand-ins, the node software's install steps, the S3 stand-in
and the registry mirror. They need root and the node image (scripts/setup.sh builds it); in CI
(CI=true) a missing prerequisite fails the run instead of skipping it.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import ssl
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from to_node import software as node_software

from localswarm import machines, network, node_image, nspawn, object_store, registry
from localswarm.host import REPO, RehearsalError
from localswarm.standins import nvml_version

pytestmark = pytest.mark.integration

KIND = "NVIDIA-GPU"
BUCKET = "gpu-swarm-machines-test"
S3_HOST = f"{BUCKET}.s3.us-east-1.amazonaws.com"
CUDA = "nvidia/cuda:12.6.3-base-ubuntu24.04"


def gpu(n: int) -> dict:
    return {"uuid": f"GPU-{n:08x}-aaaa-bbbb-cccc-{n:012x}", "name": "NVIDIA H100 80GB HBM3", "memory_mib": 81559}


# Indexes far above the rehearsal's nodes (1, 2, ...), so the two never meet on an address.
SPECS = {"lsm-a": (230, [gpu(1), gpu(2)]), "lsm-b": (231, [gpu(3)])}
USER_DATA = """#cloud-config
write_files:
  - path: /etc/gpu-swarm-test/written
    content: "by cloud-init\\n"
runcmd:
  - [sh, -c, "date +%s >> /root/runcmd-runs"]
"""


def require_machines() -> node_image.Image:
    missing = None
    if os.geteuid() != 0:
        missing = "needs root"
    elif not shutil.which("systemd-nspawn") or not shutil.which("docker-registry"):
        missing = "systemd-nspawn or docker-registry is missing; run ./scripts/setup.sh"
    else:
        image = node_image.built()
        if image:
            return image
        missing = "the node image is not built; run ./scripts/setup.sh"
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI must run the machine tests: {missing}")
    pytest.skip(missing)


def _answers(url: str) -> bool:
    try:
        urllib.request.urlopen(url, timeout=1).close()
        return True
    except OSError:
        return False


@pytest.fixture(scope="module")
def key(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("ssh")
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(folder / "id")], check=True)
    # One config for every hop: `ssh -J` does not pass -i on to the jump host, a config does.
    (folder / "config").write_text(f"Host *\n  User ubuntu\n  IdentityFile {folder / 'id'}\n  IdentitiesOnly yes\n"
                                   "  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n  LogLevel ERROR\n"
                                   "  ConnectTimeout 10\n  BatchMode yes\n")
    return folder


@pytest.fixture(scope="module")
def fleet(key):
    """Both machines booted, the registry (a Docker Hub mirror) and the S3 stand-in up; all removed after,
    what this module did not start (a rehearsal's bridge or registry) left as it was."""
    image = require_machines()
    for name in SPECS:  # what an interrupted run left
        if (machines.MACHINES / name).exists():
            machines.terminate(machines.machine(name))
    made_bridge = subprocess.run(["ip", "link", "show", network.BRIDGE], capture_output=True).returncode != 0
    if made_bridge:
        network.create_bridge()
    made_registry = not _answers(f"http://{registry.REGISTRY}/v2/")
    made_store = object_store._pid() is None
    launched = {}
    try:
        if made_registry:
            registry.start_registry()
        object_store.start()
        public_key = (key / "id.pub").read_text().strip()
        started = {}
        for name, (index, gpus) in SPECS.items():
            started[name] = time.monotonic()
            launched[name] = machines.launch(
                name, index, user_data=USER_DATA, gpus=gpus, image=image,
                meta_data={"instance-id": f"i-{name}", "local-hostname": name, "public-keys": [public_key]},
                hosts={S3_HOST: network.BRIDGE_ADDR})
        timings = {}
        for name, m in launched.items():  # one after the other: the second machine's are upper bounds
            machines.wait_sshd(m)
            sshd = time.monotonic() - started[name]
            machines.wait_cloud_init(m)
            timings[name] = {"sshd_s": round(sshd, 2), "cloud_init_done_s": round(time.monotonic() - started[name], 2)}
        print(f"\nmachine boot, seconds since its launch: {json.dumps(timings)}")
        yield launched
    finally:
        for m in launched.values():
            machines.terminate(m)
        shutil.rmtree(object_store.STORE / "objects" / BUCKET, ignore_errors=True)
        if made_store:
            object_store.stop()
        if made_registry:
            registry.stop_registry()
        if made_bridge:
            network.teardown_network()


def on(m: machines.Machine, script: str, timeout: float = 60) -> str:
    proc = machines.run(m, script, timeout=timeout)
    assert proc.returncode == 0, f"on {m.name}: {script}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def ssh(key: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ssh", "-F", str(key / "config"), *args], capture_output=True, text=True, timeout=60)


def test_machines_boot_through_cloud_init_with_the_ami_defaults(fleet):
    a, b = fleet["lsm-a"], fleet["lsm-b"]
    for m in (a, b):
        status = machines.wait_cloud_init(m)
        assert status["status"] == "done" and not status["errors"], status
        assert machines.wait_booted(m) == "running", on(m, "systemctl --failed --no-legend")
        assert on(m, "hostname").strip() == m.name
        assert on(m, "cat /etc/gpu-swarm-test/written") == "by cloud-init\n"
        assert "sudo" in on(m, "id -nG ubuntu").split()
        assert on(m, "systemctl is-active docker containerd ssh nvidia-fabricmanager").split() == ["active"] * 4
        assert on(m, "systemctl is-enabled apt-daily.timer apt-daily-upgrade.timer || true").split() == ["masked"] * 2
        # A baked AMI's first boot: /etc and /var up to date with /usr (its hardware file changes no date
        # of /usr), so no ConditionNeedsUpdate unit runs; and a locale that cloud-init need not generate.
        needs_update = "ldconfig systemd-sysusers systemd-journal-catalog-update systemd-update-done"
        assert on(m, f"systemctl show -P ConditionResult {needs_update}").split() == ["no"] * 4
        assert on(m, "cat /etc/default/locale") == "LANG=C.UTF-8\n"
        assert "update-locale" not in on(m, "cat /var/log/cloud-init.log")
    assert on(a, "cat /etc/machine-id") != on(b, "cat /etc/machine-id")
    assert on(a, "cat /etc/ssh/ssh_host_ed25519_key.pub") != on(b, "cat /etc/ssh/ssh_host_ed25519_key.pub")
    # A lookup fails at once: nothing answers DNS, and no machine waits on a resolver.
    started = time.monotonic()
    assert machines.run(a, "getent hosts deb.debian.org").returncode != 0
    assert time.monotonic() - started < 2
    assert "Reached target" in machines.console(a)


def test_ssh_direct_and_through_the_other_machine(fleet, key):
    a, b = fleet["lsm-a"], fleet["lsm-b"]
    direct = ssh(key, a.address, "sudo -n true && echo root-ok")
    assert direct.returncode == 0 and direct.stdout.strip() == "root-ok", direct.stderr
    jumped = ssh(key, "-J", a.address, b.address, "sudo -n true && echo $SSH_CLIENT")
    assert jumped.returncode == 0, jumped.stderr
    assert jumped.stdout.split()[0] == a.address  # b saw the connection come from a


def _swarm_ready(m: machines.Machine, gpus: list[dict]) -> None:
    """As the GPU agent leaves a node: its GPUs advertised, the nvidia runtime the default, the
    toolkit told which variable holds a task's GPUs (all through the stand-in nvidia-ctk)."""
    resources = json.dumps([f"{KIND}={g['uuid']}" for g in gpus])
    on(m, "nvidia-ctk runtime configure --runtime=docker --set-as-default >/dev/null && "
          f"nvidia-ctk config --in-place --set swarm-resource=DOCKER_RESOURCE_{KIND} && "
          f"python3 -c 'import json; p=\"/etc/docker/daemon.json\"; d=json.load(open(p)); "
          f"d[\"node-generic-resources\"]={resources}; json.dump(d, open(p, \"w\"))' && systemctl restart docker")


def test_swarm_across_machines_gives_each_task_exactly_its_gpu(fleet):
    a, b = fleet["lsm-a"], fleet["lsm-b"]
    registry.push_standin_as([CUDA])
    for m in (a, b):
        _swarm_ready(m, SPECS[m.name][1])
    on(a, f"docker swarm init --advertise-addr {a.address} >/dev/null")
    token = on(a, "docker swarm join-token -q worker").strip()
    on(b, f"docker swarm join --token {token} {a.address}:2377 >/dev/null")
    on(a, "docker network create -d overlay --attachable gpu-net >/dev/null")
    # 4 one-GPU replicas on 3 GPUs: 3 run, each on its own GPU, and 1 waits for one.
    on(a, f"docker service create -d --name gpu --replicas 4 --network gpu-net --generic-resource {KIND}=1 {CUDA}")
    deadline = time.monotonic() + 90
    while True:
        states = on(a, "docker service ps gpu --format '{{.CurrentState}}|{{.Error}}'").splitlines()
        if sum(s.startswith("Running") for s in states) == 3 and any(s.startswith("Pending") for s in states):
            break
        assert time.monotonic() < deadline, states
        time.sleep(0.5)
    seen = {}
    for m in (a, b):
        for cid in on(m, "docker ps -q --filter label=com.docker.swarm.service.name=gpu").split():
            env = json.loads(on(m, f"docker inspect --format '{{{{json .Config.Env}}}}' {cid}"))
            assigned = [e.split("=", 1)[1] for e in env if e.startswith(f"DOCKER_RESOURCE_{KIND}=")]
            listed = on(m, f"docker exec {cid} nvidia-smi -L").splitlines()
            devices = on(m, f"docker exec {cid} ls /dev").split()
            seen[cid] = (m.name, assigned, listed, [d for d in devices if d.startswith("nvidia")])
    assert len(seen) == 3
    for name, assigned, listed, devices in seen.values():
        (uuid,) = assigned
        assert listed == [f"GPU 0: NVIDIA H100 80GB HBM3 (UUID: {uuid})"]
        index = [g["uuid"] for g in SPECS[name][1]].index(uuid)
        assert devices == [f"nvidia{index}"]
    assert sorted(u for _, (u,), _, _ in seen.values()) == sorted(g["uuid"] for _, gs in SPECS.values() for g in gs)
    # The overlay network carries traffic between the machines' tasks.
    on_b = next(cid for cid, (name, *_) in seen.items() if name == "lsm-b")
    address = "{{(index .NetworkSettings.Networks \"gpu-net\").IPAddress}}"
    ip_b = on(b, f"docker inspect --format '{address}' {on_b}").strip()
    on_a = next(cid for cid, (name, *_) in seen.items() if name == "lsm-a")
    on(a, f"docker exec {on_a} ping -c 1 -W 5 {ip_b}")
    on(a, "docker service rm gpu >/dev/null")


def test_standins_answer_from_the_hardware_file(fleet):
    a = fleet["lsm-a"]
    one, two = SPECS["lsm-a"][1]
    assert on(a, "nvidia-smi -L").splitlines() == [f"GPU 0: NVIDIA H100 80GB HBM3 (UUID: {one['uuid']})",
                                                     f"GPU 1: NVIDIA H100 80GB HBM3 (UUID: {two['uuid']})"]
    assert on(a, "nvidia-smi --query-gpu=driver_version --format=csv,noheader").splitlines()[0] == "580.159.04"
    pinned = node_software.min_versions()["TOOLKIT_VERSION"]
    assert on(a, "nvidia-ctk --version").startswith(f"NVIDIA Container Toolkit CLI version {pinned}")
    run = f"docker run --rm --runtime nvidia -e NVIDIA_VISIBLE_DEVICES={{}} {CUDA} sh -c 'nvidia-smi -L; ls /dev'"
    out = on(a, run.format(two["uuid"])).split("\n")
    assert out[0] == f"GPU 0: NVIDIA H100 80GB HBM3 (UUID: {two['uuid']})"
    assert [d for d in " ".join(out[1:]).split() if d.startswith("nvidia")] == ["nvidia1"]
    void = on(a, run.format("void"))
    assert "UUID: GPU-" not in void and "nvidia0" not in void and "nvidia1" not in void
    unknown = machines.run(a, run.format("GPU-99999999-aaaa-bbbb-cccc-000000000000"))
    assert unknown.returncode != 0 and "unknown device" in unknown.stderr


def test_object_store_serves_machines_over_verified_tls_and_refuses_others(fleet):
    a = fleet["lsm-a"]
    object_store.put(BUCKET, "bundles/node-1.tar", b"node software\n")
    assert on(a, f"curl -fsS https://{S3_HOST}/bundles/node-1.tar") == "node software\n"
    missing = machines.run(a, f"curl -sS -o /dev/null -w '%{{http_code}}' https://{S3_HOST}/bundles/none")
    assert missing.stdout == "404"
    # This host is outside the subnet's machines, as an operator is outside the VPC.
    context = ssl.create_default_context(cafile=str(object_store.CA_CERT))
    with socket.create_connection((network.BRIDGE_ADDR, object_store.PORT), timeout=5) as raw:
        with context.wrap_socket(raw, server_hostname=S3_HOST) as tls:
            tls.sendall(f"GET /bundles/node-1.tar HTTP/1.1\r\nHost: {S3_HOST}\r\nConnection: close\r\n\r\n".encode())
            answer = b""
            while chunk := tls.recv(4096):
                answer += chunk
    answer = answer.decode()
    assert answer.startswith("HTTP/1.1 403") and "AccessDenied" in answer


def test_node_install_steps_skip_in_the_image_and_the_agent_reads_nvml(fleet):
    b = fleet["lsm-b"]
    software = b.root / "opt/gpu-swarm/software"
    shutil.copytree(REPO / "node", software, ignore=shutil.ignore_patterns("__pycache__"))
    steps = ["install-docker", "install-nvidia-driver", "install-container-toolkit", "install-fabric-manager",
             "install-gpu-agent"]
    out = on(b, f"bash /opt/gpu-swarm/software/bootstrap.sh {' '.join(steps)}", timeout=180)
    timings = json.loads(on(b, "cat /var/lib/gpu-swarm/bootstrap-timings.json"))
    expected = {**{step: "skipped" for step in steps[:4]}, "install-gpu-agent": "done"}  # a venv from the wheelhouse
    assert {step: timings[step]["status"] for step in steps} == expected, out
    venv = "/opt/gpu-swarm/venv/bin/python"
    installed = on(b, f"{venv} -c 'from importlib.metadata import version; print(version(\"nvidia-ml-py\"))'")
    assert installed.strip() == nvml_version()  # the pin, from the image's wheelhouse
    detect = ("import json, sys; sys.path.insert(0, '/opt/gpu-swarm/software'); import gpu_detect; "
              "print(json.dumps(gpu_detect.detect_with_nvml([])))")
    gpus, extra = json.loads(on(b, f"{venv} -c \"{detect}\""))
    assert [g["uuid"] for g in gpus] == [g["uuid"] for g in SPECS["lsm-b"][1]]
    assert extra["gpu.driver"] == "580.159.04"
    report = json.loads(on(b, "cat /run/gpu-swarm/report.json"))
    assert report["resources"] == [f"{KIND}={g['uuid']}" for g in SPECS["lsm-b"][1]]


def test_health_watcher_sees_a_fault_written_into_the_hardware_file(fleet):
    b = fleet["lsm-b"]
    (uuid,) = [g["uuid"] for g in SPECS["lsm-b"][1]]
    on(b, "cp /etc/docker/daemon.json /tmp/watched.json")
    watch = ("rm -f /tmp/health.json; "
             "/opt/gpu-swarm/venv/bin/python /opt/gpu-swarm/software/gpu_health.py --once --json "
             "--daemon-json /tmp/watched.json --state-file /tmp/health.json --dockerd-pidfile /nonexistent")
    assert json.loads(on(b, watch))["condition"] == "healthy"
    machines.set_gpu_fault(b, uuid, {"xid": 79})
    report = json.loads(on(b, watch))
    assert (report["condition"], report["reason"]) == ("unhealthy", f"xid_79_on_{uuid}")
    machines.set_gpu_fault(b, uuid, {"missing": True})
    assert on(b, "nvidia-smi -L; true").strip() == "No devices were found"
    assert json.loads(on(b, watch))["gpus"][uuid]["reason"] == f"not_found_on_{uuid}"
    machines.set_gpu_fault(b, uuid, None)
    assert on(b, "nvidia-smi -L").startswith("GPU 0:")


def test_stop_and_start_keep_the_disk_and_run_cloud_init_once(fleet):
    b = fleet["lsm-b"]
    on(b, "echo kept > /root/kept")
    machines.stop(b)
    assert not machines.running(b)
    machines.start(b)
    assert machines.wait_booted(b) == "running"
    assert machines.wait_cloud_init(b)["status"] == "done"
    assert on(b, "cat /root/kept") == "kept\n"
    assert len(on(b, "cat /root/runcmd-runs").splitlines()) == 1  # same instance-id: runcmd is per instance
    assert "Halting system" in machines.console(b) or "Power down" in machines.console(b)
    # A reboot from inside boots it again, as an instance's does.
    boots = len(on(b, "journalctl --list-boots --no-pager -q").splitlines())
    machines.run(b, "systemctl reboot")
    # Generous: on a loaded 2-core machine a boot has taken most of a minute.
    deadline = time.monotonic() + 150
    while True:
        assert machines.running(b), "the launcher stopped instead of booting again:\n" + machines.console(b)[-2000:]
        assert time.monotonic() < deadline, "no second boot in 150 s:\n" + machines.console(b)[-2000:]
        try:
            if len(on(b, "journalctl --list-boots --no-pager -q", timeout=20).splitlines()) > boots:
                break
        except (AssertionError, RehearsalError, subprocess.TimeoutExpired):
            pass  # between two boots: no PID 1 yet, or one whose journal does not answer yet
        time.sleep(0.2)
    assert machines.wait_booted(b) == "running"


def test_teardown_all_leaves_nothing(fleet):
    """Runs last in this module: every machine, mount, namespace, cgroup and process is gone."""
    names = machines.teardown_all()
    assert set(SPECS) <= set(names)
    assert not machines.machines()
    mounts = Path("/proc/self/mountinfo").read_text()
    assert str(machines.MACHINES) not in mounts
    assert not [ns for ns in network.our_netns() if ns in {network.netns_name(n) for n in SPECS}]
    for root in nspawn.cgroup_roots():
        assert not [p for p in root.glob("*") if p.is_dir()] if root.exists() else True
    nspawns = subprocess.run(["pgrep", "-af", "systemd-nspawn"], capture_output=True, text=True).stdout
    assert str(machines.MACHINES) not in nspawns
    with pytest.raises(RehearsalError):
        machines.run(fleet["lsm-a"], "true")
