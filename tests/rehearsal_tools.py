"""What the rehearsal's integration tests share: the engine prerequisite, the CLI and waiting on status."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

from localswarm import machines, pulumi_cli, pulumi_host
from localswarm.host import REPO, RehearsalError, find_engine, run
from swarm.node_contract import DOCKER_TASK_ID

KIND = "NVIDIA-GPU"
CLI_MANAGER = "gpu-swarm-dev-manager-0"  # the first manager of the dev stack that Pulumi's CLI makes
CUDA_IMAGE = "nvidia/cuda:12.6.3-base-ubuntu24.04"  # the stand-in, as the CLI's machines pull it (their mirror)


def require_engine():
    """Root and an engine >= 25.0.3: in CI a missing one fails the run instead of skipping it."""
    missing = "needs root" if os.geteuid() != 0 else None
    if not missing:
        try:
            return find_engine()
        except RehearsalError as e:
            missing = str(e)
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI must run the rehearsal tests: {missing}")
    pytest.skip(missing)


def cli(*args: str, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "localswarm", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"localswarm {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}")
    return proc


def pulumi(*args: str, timeout: float = 1500) -> subprocess.CompletedProcess:
    """Pulumi's CLI on the rehearsal's dev stack (`localswarm pulumi --stack dev ARGS`), as it ended."""
    return cli("pulumi", "--stack", "dev", *args, check=False, timeout=timeout)


def config_set_all(settings: dict, secrets: dict | None = None) -> None:
    """The project's inputs set as a user sets them, `pulumi config set-all --json` on the dev stack: a string
    as a plain value, anything else as an object (the shape `pulumi config --json` prints)."""
    values = {f"gpu-swarm:{k}": ({"value": v, "secret": False} if isinstance(v, str) else
                                 {"value": json.dumps(v), "objectValue": v, "secret": False})
              for k, v in settings.items()}
    values.update({f"gpu-swarm:{k}": {"value": v, "secret": True} for k, v in (secrets or {}).items()})
    done = pulumi("config", "set-all", "--json", json.dumps(values))
    assert done.returncode == 0, done.stderr


def diagnostics(proc: subprocess.CompletedProcess) -> str:
    """What a failed CLI run said of its failed steps: each `error:` line of its display and what follows it
    (the display ends with the stack's outputs, which say nothing of what failed)."""
    lines = proc.stdout.splitlines()
    at = [i for i, line in enumerate(lines) if "error:" in line]
    shown = [line for i in at for line in lines[max(0, i - 2):i + 25]]
    return "\n".join(shown or lines[-60:])[-10000:] + proc.stderr[-3000:] + machines_named(proc.stdout)


def machines_named(said: str) -> str:
    """Each rehearsal machine at an address a failed run names (a dial that never got through), as it is now:
    every address its interface holds (its own, and an Elastic IP's), whether it runs, what answers on its
    port 22, and its console's last lines. The module's `down` removes them before anyone could look, and a
    port that never answered says nothing of why."""
    dialled = set(re.findall(r"dial (\d+\.\d+\.\d+\.\d+)[: ]", said))
    shown, held_somewhere = [], set()
    for m in machines.machines():
        held = set(re.findall(r"inet (\d+\.\d+\.\d+\.\d+)/", run(
            ["ip", "-n", m.netns, "-o", "-4", "addr", "show"], check=False).stdout)) | {m.address}
        if not held & dialled:
            continue
        held_somewhere |= held & dialled
        listening = machines.run(m, "ss -Hltn 'sport = :22' || true", check=False).stdout.strip() \
            if machines.running(m) else ""
        shown.append(f"\n--- machine {m.name} ({', '.join(sorted(held))}, dialled at "
                     f"{', '.join(sorted(held & dialled))}): {'running' if machines.running(m) else 'not running'}; "
                     f"listening on 22: {listening or 'nothing'}; its console's last lines:\n"
                     + "\n".join(machines.console(m).splitlines()[-40:]))
    missing = dialled - held_somewhere
    if missing:
        shown.append(f"\n--- no machine holds {', '.join(sorted(missing))} now")
    return "".join(shown)


def cli_json(*args: str) -> dict:
    return json.loads(cli(*args, "--json").stdout)


def status() -> dict:
    """The swarm of the CLI's machines (the dev stack's), as `localswarm status --json` shows it."""
    return cli_json("status")


def until(condition, timeout: float, what: str, interval: float = 0.5):
    """condition()'s first true value, asked every `interval` s; an AssertionError after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def wait_for(predicate, timeout: float, what: str, look=None) -> dict:
    """The first view of the swarm that predicate() accepts; look: how to see it (this rehearsal's status
    by default, pulumi_cli.status for the CLI's machines)."""
    deadline = time.monotonic() + timeout
    while True:
        view = (look or status)()
        if predicate(view):
            return view
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}:\n{json.dumps(view, indent=1)}")
        time.sleep(0.5)


def tasks_of(view: dict, service: str) -> list[dict]:
    return next((s["tasks"] for s in view["services"] if s["name"] == service), [])


def node_of(view: dict, name: str) -> dict:
    return next(n for n in view["nodes"] if n["name"] == name)


@dataclass(frozen=True)
class Engines:
    """How a test reaches the engines of a rehearsal's nodes: docker(hostname, *args) on one, the hostname
    of the manager that runs the swarm's commands, and the name its nodes pull the stand-in image by."""

    lead: str
    docker: Callable[..., subprocess.CompletedProcess]
    image: str


def cli_engines() -> Engines:
    """The machines Pulumi's CLI made (localswarm/pulumi_cli.py), each through its Docker socket."""
    engine = find_engine()

    def on(host: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        sock = pulumi_host.docker_socket(machine(host))
        return run([engine.docker, "-H", f"unix://{sock}", *args], check=check, env=engine.env(), timeout=120)
    return Engines(CLI_MANAGER, on, CUDA_IMAGE)


def task_output(engines: Engines, service: str) -> str:
    """What a service's tasks printed (stdout, then stderr), read from the engine of the node that ran each.

    Not `docker service logs`: swarm's log broker reaches a node only while that node's agent is
    subscribed to it, and an agent starts a new session (and so a new subscription) whenever its
    engine's labels change, as a node's condition labels do. Meanwhile it answers "incomplete log
    stream ... node ... is not available", which failed a CI run."""
    tasks = engines.docker(engines.lead, "service", "ps", "--no-trunc", "--format", "{{.ID}} {{.Node}}",
                           service).stdout
    out = []
    for task, _, host in (line.partition(" ") for line in tasks.splitlines()):
        if not host:
            continue  # never scheduled: it has no output
        for container in engines.docker(host, "ps", "-aq", "--filter",
                                        f"label={DOCKER_TASK_ID}={task}").stdout.split():
            logs = engines.docker(host, "logs", container)
            out.append(logs.stdout + logs.stderr)
    return "".join(out)


def one_off(engines: Engines, name: str, node: str, *extra: str) -> str:
    """A one-shot job on `node` that prints what nvidia-smi -L sees; its final state and error, then its output."""
    engines.docker(engines.lead, "service", "create", "--detach", "--mode", "replicated-job", "--name", name,
                   "--restart-condition", "none", "--constraint", f"node.hostname=={node}", *extra, engines.image,
                   "sh", "-c", "nvidia-smi -L; echo done")
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            states = engines.docker(engines.lead, "service", "ps", "--no-trunc", "--format",
                                    "{{.CurrentState}} {{.Error}}", name).stdout
            if states.startswith(("Complete", "Failed", "Rejected")):
                return states + task_output(engines, name)
            time.sleep(0.5)
        raise AssertionError(f"{name} did not finish: {states}")
    finally:
        engines.docker(engines.lead, "service", "rm", name, check=False)


# --- the real CLI's rehearsal (localswarm/pulumi_cli.py): its machines, by the hostnames the program gave them

def records() -> dict[str, dict]:
    """hostname -> the record of its machine in the aws plugin's world."""
    return {r["hostname"]: r for r in pulumi_cli.world()["machines"].values()}


def machine(hostname: str) -> machines.Machine:
    r = records()[hostname]
    return machines.Machine(r["machine"], r["index"])


def ami_of(hostname: str) -> str:
    """The AMI a node's instance was launched from, as the instance itself says (IMDS's ami-id, which
    cloud-init read at boot)."""
    out = machines.run(machine(hostname), ["cloud-init", "query", "ds.meta_data"], check=True).stdout
    return json.loads(out)["ami-id"]


def our_processes() -> list[str]:
    """Live (non-zombie) processes whose command line or environment points into this lane's rehearsal
    folders: its machines', and localswarm's own (another lane's rehearsal may run beside it:
    localswarm/lane.py)."""
    from localswarm import lane
    roots = (lane.MACHINES_STATE, lane.NAMESPACED_STATE, lane.NAMESPACED_RUN)
    ours = re.compile("|".join(rf"{re.escape(str(root))}(?=[/\s=:]|$)" for root in roots))
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            environ = (proc / "environ").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if (ours.search(cmdline) or ours.search(environ)) and "pytest" not in cmdline:
            found.append(f"{proc.name}: {cmdline}")
    return found
