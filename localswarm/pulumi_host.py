"""What the machines of Pulumi's CLI in the rehearsal reach and how they are read: this host's side.

Before the CLI makes any machine: the bridge, the registry (the machines' Docker Hub mirror,
holding the stand-in under the stacks' image names) and the S3 stand-in, and nothing else. The
program's preview reads the stacks' images from that registry (their CUDA requirement), so all
of it is up before the program runs. The machines behind the aws plugin's instances (its world
file, localswarm/plugin_cloud.py) and those of its elastic pools' groups (localswarm/elastic_cloud.py)
are read as localswarm/placement.py reads nodes; `down` removes them all.
"""
from __future__ import annotations

import json
import shutil
import tempfile
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import yaml

from localswarm import elastic_cloud, fake_imds, machines, network, nspawn, object_store, registry
from localswarm.host import REPO, parallel, run
from localswarm.nodes import REGISTRY
from to_node import software as node_software

Progress = Callable[[str], None]


@dataclass(frozen=True)
class ViewNode:
    """A machine as localswarm/placement.py reads it: its swarm hostname, role, address and Docker socket."""

    name: str
    index: int
    role: str
    address: str
    sock: str


def prepare(config: dict, say: Progress) -> dict:
    """The bridge, the registry and the S3 stand-in, for a stack's config (`pulumi config --json`'s keys,
    plain values). Returns the config the rehearsal sets for the CLI: with monitoring on and no
    monitoringImages of the user's, the rehearsal's own Prometheus and Grafana stand-in, pinned by their
    digests, because Docker Hub is out of reach and a local build cannot have the stack's pinned ones."""
    if run(["ip", "link", "show", network.BRIDGE], check=False).returncode != 0:
        network.create_bridge()
    network.route_imds()
    try:
        urllib.request.urlopen(f"http://{REGISTRY}/v2/", timeout=2).close()
    except OSError:
        registry.start_registry()
    object_store.start()
    images = sorted(stack_images(config))
    registry.push_standin_as(images)
    extra = {}
    if config.get("gpu-swarm:monitoring") == "true" and not json.loads(config.get("gpu-swarm:monitoringImages") or "{}"):
        from localswarm import monitoring_stack
        extra["gpu-swarm:monitoringImages"] = json.dumps(monitoring_stack.hub_images(say))
    say(f"local registry serves the stand-in as {', '.join(images) or 'nothing'}; S3 stand-in on the bridge")
    return extra


def stack_images(config: dict) -> set[str]:
    images = set()
    for stack in json.loads(config.get("gpu-swarm:stacks") or "[]"):
        doc = yaml.safe_load((REPO / stack["file"]).read_text()) or {}
        images |= {svc["image"] for svc in (doc.get("services") or {}).values() if svc.get("image")}
    return images


def bumped_software(n: int) -> Path:
    """A copy of node/ with one changed byte in versions.env: what a developer's edit of node/ is. The
    program builds its bundle from it (to_node/software.py SOURCE_DIR) until restore_software()."""
    folder = Path(tempfile.mkdtemp(prefix="lsw-node-")) / "node"
    shutil.copytree(REPO / "node", folder, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    with open(folder / "versions.env", "a") as f:
        f.write(f"# rehearsal: node software bump {n}\n")
    node_software.SOURCE_DIR = folder
    return folder


def restore_software(folder: Path) -> None:
    node_software.SOURCE_DIR = REPO / "node"
    shutil.rmtree(folder.parent, ignore_errors=True)


def view_nodes(records: dict) -> list[ViewNode]:
    """The machines of records (instance id -> machine record), and those of the elastic pools' groups."""
    every = [*records.values(), *elastic_cloud.group_machines()]
    return [ViewNode(r["hostname"], r["index"], r["role"], network.node_addr(r["index"]),
                     docker_socket(machines.Machine(r["machine"], r["index"])))
            for r in sorted(every, key=lambda r: r["index"])]


def docker_socket(machine: machines.Machine) -> str:
    """The machine's Docker socket, reached from the host through its init's root (/proc/PID/root)."""
    return f"/proc/{nspawn.init_pid(machine) or 0}/root/run/docker.sock"


def down(records: dict) -> list[str]:
    """Every machine terminated and the S3 stand-in stopped (first: its groups would launch machines
    again); the hostnames of records' machines."""
    object_store.stop()
    elastic_cloud.STORE.path.unlink(missing_ok=True)
    # All at once, as `terminate-instances` of them all would: each waits for its own clean poweroff.
    parallel(machines.terminate, [machines.Machine(r["machine"], r["index"]) for r in records.values()])
    machines.teardown_all()
    shutil.rmtree(fake_imds.RECORDS, ignore_errors=True)  # what IMDS answered them, their notices too
    return sorted(r["hostname"] for r in records.values())
