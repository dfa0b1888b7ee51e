"""`localswarm program up`: `pulumi up` of the program itself (__main__.py), against machines on this host.

The program runs in-process under Pulumi's mocks, as the tests run it, but the mocks do the
work (localswarm/local_cloud.py): every instance is a machine that boots the program's own
user data through real cloud-init, and every command of the program runs its own script on
its node over real SSH, in the program's dependency order, as many at a time as
`--parallel` allows. A second `program up` is a second `pulumi up`: only what changed runs.
Nothing here forms the swarm: the program's commands do.
"""
from __future__ import annotations

import asyncio
import http.client
import importlib
import json
import os
import runpy
import shutil
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pulumi
import yaml
from pulumi.runtime import mocks as pulumi_mocks

from to_node import software as node_software
from localswarm import api, engine, machines, network, node_image, nspawn, object_store, placement, registry, ssh
from localswarm.host import CLI, REPO, RehearsalError, check_host, find_engine, run
from localswarm import elastic_cloud
from localswarm.local_cloud import COMMAND, GROUP, LocalCloud
from localswarm.nodes import REGISTRY, STATE_ROOT
from localswarm.stack_config import stack_config
from settings import image_registry
from swarm.labels import POOL_LABEL

STATE_FILE = STATE_ROOT / "program.json"  # the rehearsal's Pulumi state: root only, secrets in clear
Progress = Callable[[str], None]
# What the program loads, beyond what importing this module loaded: pulumi_aws loads each service's
# package at its first use (ec2's alone took 0.8 s on 2 cores). They are loaded while the rehearsal's
# own registry and S3 stand-in start, which a real `pulumi up` has none of to wait for.
# tests/test_program_imports.py holds the list to what the program loads under the dev and prod stacks.
PROGRAM_IMPORTS = ("components.cluster", "settings", "pulumi_command.remote", "pulumi_aws.cloudcontrol",
                   "pulumi_aws.ec2", "pulumi_aws.pricing", "pulumi_aws.s3", "pulumi_aws.servicequotas", "pulumi_aws.ssm",
                   "pulumi_aws.vpc")


@dataclass(frozen=True)
class ViewNode:
    """A machine as localswarm/placement.py reads it: its swarm hostname, role, address and Docker socket."""

    name: str
    index: int
    role: str
    address: str
    sock: str


class _Monitor(pulumi_mocks.MockMonitor):
    """Hands LocalCloud each registration's options, which MockResourceArgs leaves out."""

    def __init__(self, cloud: LocalCloud):
        super().__init__(cloud)
        self.cloud = cloud

    def make_urn(self, parent: str, type_: str, name: str) -> str:
        # The engine's URN holds every parent's type; the SDK's mock keeps only the nearest one.
        return engine.urn(pulumi.get_stack(), pulumi.get_project(), parent, type_, name)

    def RegisterResource(self, request):
        options = self.cloud.options
        options.urn, options.name = self.make_urn(request.parent, request.type, request.name), request.name
        options.ignore_changes = list(request.ignoreChanges)
        options.replace_on_changes = list(request.replaceOnChanges)
        options.delete_before_replace = bool(request.deleteBeforeReplace)
        return super().RegisterResource(request)


def load_state() -> dict:
    try:
        return json.loads(STATE_FILE.read_text())
    except (OSError, ValueError):
        return {}


def _save_state(state: dict) -> None:
    STATE_ROOT.mkdir(parents=True, exist_ok=True)
    tmp = STATE_FILE.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=1) + "\n")
    tmp.chmod(0o600)
    tmp.replace(STATE_FILE)


def up(*, stack: str = "dev", overrides: dict | None = None, parallel: int = 6, bump_software: bool = False,
       replace: tuple[str, ...] = (), refresh: bool | None = None, secret_keys: tuple[str, ...] = (),
       progress: Progress = print) -> dict:
    """Run the program as `pulumi up` would; returns the report (as `up --json` prints it, and more)."""
    started = time.monotonic()
    say = lambda msg: progress(f"[{time.monotonic() - started:6.1f}s] {msg}")  # noqa: E731
    if parallel < 1:
        raise RehearsalError("--parallel must be 1 or more")
    imports = threading.Thread(target=_load, args=(PROGRAM_IMPORTS,), daemon=True)
    imports.start()
    config = _config(stack, overrides or {})
    check_host()
    state = load_state()
    if state and state.get("stack") != stack:
        raise RehearsalError(f"the rehearsal holds stack {state.get('stack')!r}; run `{CLI} down` first")
    from localswarm import pulumi_cli
    if pulumi_cli.holds_machines():
        raise RehearsalError(f"Pulumi's CLI holds a rehearsal (`{CLI} pulumi up`); run `{CLI} down` first")
    from localswarm.state import load_state as load_rehearsal
    if load_rehearsal():
        raise RehearsalError(f"a `localswarm up` rehearsal is up; run `{CLI} down` first")
    if any(not key.startswith("urn:") for key in state.get("resources", {})):
        raise RehearsalError(f"the rehearsal's state names resources by name, not URN (an older rehearsal); "
                             f"run `{CLI} down` first")
    node_image.ensure_image(say)
    _infrastructure(config, say)
    known = dict(state.get("machines", {}))
    resources = state.get("resources", {})
    if state.get("pending_operations"):
        say(engine.pending_warning(state["pending_operations"]))
    if engine.project_refreshes(REPO) if refresh is None else refresh:
        resources, notes = engine.refresh(resources, lambda r: _instance_state(r, known))
        for note in notes:
            say(note)

    # A bump stays, as an edit of node/ would: later runs build the same bundle until the next bump.
    bumps = state.get("bumps", 0) + (1 if bump_software else 0)
    source = _bumped_software(bumps) if bumps else None
    imports.join()  # pulumi's lazy load is not thread-safe: done before the program touches a module
    cloud = LocalCloud(previous=resources, region=config["aws:region"], say=say,
                       clock=time.monotonic, machines_by_instance=known, next_index=state.get("next_index", 1),
                       replace_targets=frozenset(replace), doomed=list(state.get("doomed", [])))
    error = None
    watcher = _DrainWatcher(cloud)
    watcher.start()
    try:
        secrets = [k if ":" in k else f"gpu-swarm:{k}" for k in secret_keys]
        exports = _run_program(cloud, config, stack, parallel, source, secrets)
    except Exception as e:  # the program's own error, or a command's, as `pulumi up` prints it
        error, exports = str(e), {}
    except BaseException:  # Ctrl-C: the engine saves what finished and what was in flight
        cloud.failed = "interrupted"
        _save_state(_state_of(cloud, config, stack, bumps, failed=True))
        raise
    finally:
        watcher.stop()
        if source:
            node_software.SOURCE_DIR = REPO / "node"
            shutil.rmtree(source.parent, ignore_errors=True)
    if error is None:
        cloud.delete_the_rest()
    _save_state(_state_of(cloud, config, stack, bumps, failed=error is not None))
    # The commands that ran: an empty `create` or `update` ran nothing, and has no host.
    ran = [a for a in cloud.actions if a.typ == COMMAND and a.action in ("create", "replace", "update") and a.host]
    if error:
        raise RehearsalError(f"pulumi up failed: {error}\nWhat it made is still there: fix the cause and run "
                             f"`{CLI} program up` again (it goes on where it stopped), or `{CLI} down`.")
    kind = config.get("gpu-swarm:gpuKind") or "NVIDIA-GPU"
    shared_kind = config.get("gpu-swarm:sharedGpuKind") or f"{kind}-SHARED"
    # No wait of the rehearsal's own: each stack's deploy command waited on the manager until its
    # stack settled (node/stack_settle.py), and failed the run above with swarm's reason if not.
    view = placement.collect(view_nodes(cloud), find_engine(), kind, shared_kind)
    _require_stacks(view, config)
    _add_inventory(view, exports.get("inventory") or [])
    say(f"the program ran {len(ran)} command(s); stacks settled: " + "; ".join(placement.outcome(view)))
    return {
        **view,
        "stack": stack,
        "commands_executed": len(ran),
        "commands": [{"name": a.name, "action": a.action, "host": a.host, "seconds": a.seconds} for a in ran],
        "unchanged_commands": sum(a.typ == COMMAND and a.action == "same" for a in cloud.actions),
        "resources": {action: sum(a.action == action for a in cloud.actions)
                      for action in ("create", "replace", "update", "same", "delete")},
        "peak_drained_per_pool": watcher.peak,
        "outputs": {k: v for k, v in exports.items() if k != "privateKey"},
        "timings": {"up_s": round(time.monotonic() - started, 1)},
    }


def _load(names: tuple[str, ...]) -> None:
    """Import each module, and load it whole where pulumi's lazy import left a stand-in for it. A
    failure here is the program's own to report, when it imports the module itself."""
    for name in names:
        try:
            # Any attribute that is not a module's introspection one makes a lazy module load itself.
            getattr(importlib.import_module(name), "_gpu_swarm_load", None)
        except Exception:  # noqa: BLE001
            return


def _state_of(cloud: LocalCloud, config: dict, stack: str, bumps: int, *, failed: bool) -> dict:
    """Like Pulumi's state after an update: what was made stays known, what failed is retried, what a
    replacement replaced is deleted by the next update, and steps in flight are pending operations.
    An edit of node/ (bumps) stays, whether or not the up that met it succeeded."""
    with cloud.lock:
        return {"stack": stack, "kind": config.get("gpu-swarm:gpuKind") or "NVIDIA-GPU",
                "shared_kind": config.get("gpu-swarm:sharedGpuKind") or "",
                "resources": {**(cloud.previous if failed else {}), **cloud.current},
                "doomed": list(cloud.doomed), "pending_operations": dict(cloud.pending),
                "machines": dict(cloud.machines_by_instance), "next_index": cloud.next_index, "bumps": bumps}


def _instance_state(resource: dict, known: dict) -> str | None:
    """What AWS says of a resource's instance: running, stopped, or None (terminated). A terminated
    machine's record goes too: nothing of it is left to reach."""
    instance_id = resource["outputs"].get("spotInstanceId") or resource["id"]
    record = known.get(instance_id)
    m = record and machines.Machine(record["machine"], record["index"])
    if not m or not m.dir.exists():
        known.pop(instance_id, None)
        return None
    return "running" if machines.running(m) else "stopped"


class _DrainWatcher(threading.Thread):
    """What the swarm itself says while the program runs: the most nodes of each pool drained at once."""

    def __init__(self, cloud: LocalCloud):
        super().__init__(daemon=True)
        self.cloud, self.peak, self._done = cloud, {}, threading.Event()

    def run(self) -> None:
        while not self._done.wait(0.5):
            managers = [n for n in view_nodes(self.cloud) if n.role == "manager"]
            try:
                infos = api.get(managers[0].sock, "/nodes", timeout=5) if managers else []
            except (OSError, api.ApiError, http.client.HTTPException, ValueError):
                continue  # no swarm yet, or its engine restarts
            counts: dict[str, int] = {}
            for info in infos:
                if info["Spec"].get("Availability") == "drain":
                    pool = (info["Spec"].get("Labels") or {}).get(POOL_LABEL, "?")
                    counts[pool] = counts.get(pool, 0) + 1
            for pool, n in counts.items():
                self.peak[pool] = max(self.peak.get(pool, 0), n)

    def stop(self) -> None:
        self._done.set()
        self.join()


def _config(stack: str, overrides: dict) -> dict:
    try:
        config = stack_config(stack, **overrides)
    except FileNotFoundError as e:
        raise RehearsalError(str(e)) from None
    # The program's own key when none is configured: the rehearsal holds its state like Pulumi's.
    return config


def _infrastructure(config: dict, say: Progress) -> None:
    """The bridge, the registry (a Docker Hub mirror holding the stand-in under the stacks' image names)
    and the S3 stand-in: what the machines reach, and nothing else. All of it before the program runs:
    its preview reads the stacks' images from this registry (their CUDA requirement)."""
    if run(["ip", "link", "show", network.BRIDGE], check=False).returncode != 0:
        network.create_bridge()
    network.route_imds()
    try:
        urllib.request.urlopen(f"http://{REGISTRY}/v2/", timeout=2).close()
    except OSError:
        registry.start_registry()
    object_store.start()
    images = sorted(_stack_images(config))
    registry.push_standin_as(images)
    if config.get("gpu-swarm:monitoring") == "true" and not json.loads(config.get("gpu-swarm:monitoringImages") or "{}"):
        # Docker Hub is out of reach and a local build cannot have the stack's pinned digests:
        # the rehearsal's own Prometheus and Grafana stand-in, pinned by theirs (monitoring_stack.py).
        from localswarm import monitoring_stack
        config["gpu-swarm:monitoringImages"] = json.dumps(monitoring_stack.hub_images(say))
    say(f"local registry serves the stand-in as {', '.join(images) or 'nothing'}; S3 stand-in on the bridge")


def _stack_images(config: dict) -> set[str]:
    images = set()
    for stack in json.loads(config.get("gpu-swarm:stacks") or "[]"):
        doc = yaml.safe_load((REPO / stack["file"]).read_text()) or {}
        images |= {svc["image"] for svc in (doc.get("services") or {}).values() if svc.get("image")}
    return images


def _bumped_software(n: int) -> Path:
    """A copy of node/ with one changed byte in versions.env: what a developer's edit of node/ is."""
    folder = Path(tempfile.mkdtemp(prefix="lsw-node-")) / "node"
    shutil.copytree(REPO / "node", folder, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    with open(folder / "versions.env", "a") as f:
        f.write(f"# rehearsal: node software bump {n}\n")
    node_software.SOURCE_DIR = folder
    return folder


def _run_program(cloud: LocalCloud, config: dict, stack: str, parallel: int, source: Path | None,
                 secret_keys: list[str]) -> dict:
    exports: dict = {}
    # Whoever called (a test that next runs the program under the test mocks) keeps the loop it had.
    policy = asyncio.get_event_loop_policy()
    try:
        before = policy.get_event_loop()
    except RuntimeError:
        before = None
    loop = asyncio.new_event_loop()
    # The SDK registers resources from the loop's default executor: its size is the engine's --parallel.
    loop.set_default_executor(ThreadPoolExecutor(max_workers=parallel, thread_name_prefix="pulumi"))
    asyncio.set_event_loop(loop)
    pulumi.runtime.settings.ROOT.set(None)
    pulumi_mocks.set_mocks(cloud, project="gpu-swarm", stack=stack, preview=False, monitor=_Monitor(cloud))
    # Preview reads the stacks' images (their CUDA requirement) where the machines pull them: this registry,
    # their Docker Hub mirror, which holds the stand-in under each image's name (registry.push_standin_as).
    image_registry.ENDPOINTS["docker.io"] = f"http://{REGISTRY}"
    pulumi.runtime.set_all_config(config, secret_keys)

    async def collect(outputs: dict) -> None:
        for name, value in outputs.items():
            exports[name] = await pulumi.Output.from_input(value).future()

    @pulumi.runtime.test
    def program():
        cwd = os.getcwd()
        os.chdir(REPO)  # Pulumi runs the program in the project directory
        try:
            runpy.run_path(str(REPO / "__main__.py"), run_name="__main__")
        finally:
            os.chdir(cwd)
        outputs = pulumi.runtime.settings.get_root_resource().outputs
        return pulumi.Output.from_input(asyncio.ensure_future(collect(outputs)))

    try:
        program()
    finally:
        loop.close()
        asyncio.set_event_loop(before)
    return exports


def view_nodes(cloud_or_state) -> list[ViewNode]:
    """The program's machines, and those of its elastic pools' groups (localswarm/elastic_cloud.py)."""
    records = [*(cloud_or_state.machines_by_instance if isinstance(cloud_or_state, LocalCloud)
                 else cloud_or_state.get("machines", {})).values(), *elastic_cloud.group_machines()]
    return [ViewNode(r["hostname"], r["index"], r["role"], network.node_addr(r["index"]),
                     docker_socket(machines.Machine(r["machine"], r["index"])))
            for r in sorted(records, key=lambda r: r["index"])]


def docker_socket(machine: machines.Machine) -> str:
    """The machine's Docker socket, reached from the host through its init's root (/proc/PID/root)."""
    return f"/proc/{nspawn.init_pid(machine) or 0}/root/run/docker.sock"


def _require_stacks(view: dict, config: dict) -> None:
    """Every configured stack has services on the swarm. A deploy command that did not run against
    this swarm (a new swarm made under unchanged deploys) leaves it empty, and that is no success."""
    names = {s["name"].split("_", 1)[0] for s in view["services"]}
    missing = [s["name"] for s in json.loads(config.get("gpu-swarm:stacks") or "[]") if s["name"] not in names]
    if missing:
        raise RehearsalError(f"pulumi up succeeded, but the swarm has no services of stack(s) {', '.join(missing)}: "
                             f"their deploy commands did not run against this swarm\n{placement.render_table(view)}\n"
                             f"The swarm is kept: look with `{CLI} program status`, then `{CLI} down`.")


def _add_inventory(view: dict, inventory: list[dict]) -> None:
    """Each node's post-join GPU check and release, as the program's inventory output has them."""
    by_name = {entry["name"]: entry for entry in inventory}
    for node in view["nodes"]:
        entry = by_name.get(node["name"], {})
        node["gpus_verified"] = entry.get("gpusVerified")
        node["release"] = entry.get("release")
        node["pool"] = entry.get("pool")


def status(*, progress: Progress = print) -> dict:
    state = load_state()
    if not state:
        raise RehearsalError(f"no program rehearsal is up; start one with `{CLI} program up`")
    kind = state.get("kind", "NVIDIA-GPU")
    return placement.collect(view_nodes(state), find_engine(), kind, state.get("shared_kind") or f"{kind}-SHARED")


def destroy(*, progress: Progress = print) -> dict:
    """`pulumi destroy`: every resource of the state deleted, commands first as they depend on the rest. A
    command.remote.Command is deleted by running its `delete` script, and only when it has one; the
    program's have none, so nothing connects to a node and a cluster whose managers are gone goes too."""
    state = load_state()
    if not state:
        raise RehearsalError(f"no program rehearsal is up; start one with `{CLI} program up`")
    resources, known = state.get("resources", {}), dict(state.get("machines", {}))
    ran, deleted = [], []
    for key, r in sorted(resources.items(), key=lambda kv: kv[1]["type"] != COMMAND):
        if r["type"] == COMMAND and r["inputs"].get("delete"):
            ssh.run(r["inputs"]["connection"], r["inputs"]["delete"])
            ran.append(engine.name_of(key))
        elif r["type"] in (engine.INSTANCE, engine.SPOT_REQUEST):
            record = known.pop(r["outputs"].get("spotInstanceId") or r["id"], None)
            if record:
                machines.terminate(machines.Machine(record["machine"], record["index"]))
        elif r["type"] == GROUP:  # force_delete: its machines go with it
            elastic_cloud.delete_group(r["id"])
        elif r["type"] == "aws:s3/bucketObjectv2:BucketObjectv2":
            object_store.object_path(r["outputs"]["bucket"], r["inputs"]["key"]).unlink(missing_ok=True)
        deleted.append(engine.name_of(key))
    for record in [*state.get("doomed", [])]:  # replaced by a failed update: still in the state, deleted too
        machine = known.pop(record["outputs"].get("spotInstanceId") or record["id"], None)
        if machine:
            machines.terminate(machines.Machine(machine["machine"], machine["index"]))
    _save_state({**state, "resources": {}, "machines": known, "doomed": []})
    progress(f"destroyed {len(deleted)} resource(s); ran {len(ran)} delete command(s)")
    return {"deleted": deleted, "commands_run": ran, "machines_left": sorted(r["hostname"] for r in known.values())}


def down(*, progress: Progress = print) -> dict:
    """Every machine terminated, the S3 stand-in stopped, the state gone: as `pulumi destroy` plus a clean host."""
    state = load_state()
    object_store.stop()  # first: its groups would launch machines again
    elastic_cloud.STORE.path.unlink(missing_ok=True)
    for record in state.get("machines", {}).values():
        machines.terminate(machines.Machine(record["machine"], record["index"]))
    machines.teardown_all()
    STATE_FILE.unlink(missing_ok=True)
    progress(f"program rehearsal removed ({len(state.get('machines', {}))} machine(s))")
    return {"removed_machines": sorted(r["hostname"] for r in state.get("machines", {}).values())}
