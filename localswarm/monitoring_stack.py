"""The monitoring stack in the rehearsal: the program's own stack file and deploy script, with images served here.

Docker Hub is unreachable, so prom/prometheus and grafana/grafana cannot be pulled. The stack's
images are pinned by digest and a local build cannot have those digests, so the rehearsal does
what `gpu-swarm:monitoringImages` lets an operator do: it deploys the same stack with other
images, pinned by their own digests:
- Prometheus: Debian's `prometheus` package (its binary needs only libc), with busybox and that
  libc, as an image in the local registry; a real Prometheus, so exporter -> Prometheus -> a query
  by service name is the real chain;
- Grafana: Debian does not package it; the stand-in image takes its place, and the integration
  test runs every dashboard query against Prometheus instead.
The program deploys the stack itself, with its own script, as on AWS; the rehearsal sets
monitoringImages to these (localswarm/pulumi_host.py), pushed under Docker Hub names, because its
machines use the local registry as their Hub mirror. `python -m localswarm.monitoring_stack
--hub-images` pushes them and prints the value.
"""
from __future__ import annotations

import argparse
import fcntl
import gzip
import io
import json
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

from localswarm import api, registry
from localswarm.host import RehearsalError, find_engine, run
from localswarm.nodes import REGISTRY, docker
from swarm import monitoring
from swarm.node_contract import MONITORING_STACK

CACHE = Path("/var/cache/gpu-swarm/prometheus")
HUB_NAMES = {"prometheus": "gpu-swarm-rehearsal/prometheus", "grafana": "gpu-swarm-rehearsal/grafana-standin"}
_ACCEPT = {"Accept": registry.MANIFEST_V2}


def prometheus_deb(progress=print) -> Path:
    """Debian's prometheus package, downloaded once (about 19 MB) into CACHE."""
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / ".lock", "w") as lock:  # two lanes (localswarm/lane.py) may ask at once
        fcntl.flock(lock, fcntl.LOCK_EX)
        found = sorted(CACHE.glob("prometheus_*.deb"))
        if found:
            return found[-1]
        progress("monitoring: downloading Debian's prometheus package (about 19 MB, once) ...")
        done = subprocess.run(["apt-get", "download", "prometheus"], cwd=CACHE, capture_output=True, text=True)
        found = sorted(CACHE.glob("prometheus_*.deb"))
    if done.returncode != 0 or not found:
        raise RehearsalError(f"`apt-get download prometheus` failed ({done.stderr.strip()[-300:]}); the rehearsal's "
                             "Prometheus comes from Debian's package: run `apt-get update` and try again")
    return found[-1]


def prometheus_rootfs(deb: Path) -> bytes:
    """busybox (the stand-in's root) plus Debian's prometheus and promtool and the libc they link."""
    with tempfile.TemporaryDirectory() as tmp:
        run(["dpkg-deb", "-x", str(deb), tmp])
        binary = Path(tmp) / "usr/bin/prometheus"
        libs = [line.split("=>")[-1].split("(")[0].strip() for line in run(["ldd", str(binary)]).stdout.splitlines()
                if "/" in line]
        out = io.BytesIO()
        with tarfile.open(fileobj=io.BytesIO(registry._standin_rootfs())) as base, \
                tarfile.open(fileobj=out, mode="w") as tar:
            for member in base.getmembers():
                tar.addfile(member, base.extractfile(member) if member.isfile() else None)
            for d in ("lib", "lib64", "lib/x86_64-linux-gnu", "etc/prometheus", "prometheus"):
                info = tarfile.TarInfo(d)
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(info)
            for name, text in (("etc/passwd", "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n"),
                               ("etc/group", "root:x:0:\nnogroup:x:65534:\n")):
                info = tarfile.TarInfo(name)
                info.size, info.mode = len(text), 0o644
                tar.addfile(info, io.BytesIO(text.encode()))
            for name in ("prometheus", "promtool"):
                tar.add(str(Path(tmp) / "usr/bin" / name), f"bin/{name}")
            for lib in libs:  # resolved: the loader and libc are symlinks on the host
                tar.add(str(Path(lib).resolve()), lib.lstrip("/"))
        return out.getvalue()


def push_image(repository: str, tag: str, rootfs: bytes, config: dict, registry_addr: str = REGISTRY) -> str:
    """Push a one-layer image over the Registry HTTP API; returns its manifest's digest."""
    layer = gzip.compress(rootfs, mtime=0)
    config_blob = json.dumps({"architecture": "amd64", "os": "linux", "config": config,
                              "rootfs": {"type": "layers", "diff_ids": [registry._digest(rootfs)]}},
                             sort_keys=True).encode()
    manifest = json.dumps({
        "schemaVersion": 2, "mediaType": registry.MANIFEST_V2,
        "config": {"mediaType": "application/vnd.docker.container.image.v1+json", "size": len(config_blob),
                   "digest": registry._digest(config_blob)},
        "layers": [{"mediaType": "application/vnd.docker.image.rootfs.diff.tar.gzip", "size": len(layer),
                    "digest": registry._digest(layer)}]}, indent=3).encode()
    base = f"http://{registry_addr}/v2/{repository}"
    for blob in (layer, config_blob):
        digest = registry._digest(blob)
        if registry._ask("HEAD", f"{base}/blobs/{digest}")[0] != 200:
            _, headers = registry._ask("POST", f"{base}/blobs/uploads/", b"")
            location = urllib.parse.urljoin(f"http://{registry_addr}/", headers["Location"])
            sep = "&" if "?" in location else "?"
            registry._ask("PUT", f"{location}{sep}digest={urllib.parse.quote(digest)}", blob,
                          {"Content-Type": "application/octet-stream"})
    registry._ask("PUT", f"{base}/manifests/{tag}", manifest, {"Content-Type": registry.MANIFEST_V2})
    return registry._digest(manifest)


def manifest_digest(repository: str, tag: str, registry_addr: str = REGISTRY) -> str:
    status, headers = registry._ask("HEAD", f"http://{registry_addr}/v2/{repository}/manifests/{tag}", None, _ACCEPT)
    if status != 200 or not headers.get("Docker-Content-Digest"):
        raise RehearsalError(f"the local registry has no {repository}:{tag}")
    return headers["Docker-Content-Digest"]


def prometheus_config() -> dict:
    """What prom/prometheus's image sets, so that the stack's `command` means the same here."""
    return {"Entrypoint": ["/bin/prometheus"], "Cmd": ["--config.file=/etc/prometheus/prometheus.yml"],
            "Env": ["PATH=/bin:/usr/bin"], "WorkingDir": "/prometheus", "ExposedPorts": {"9090/tcp": {}}}


def hub_images(progress=print) -> dict[str, str]:
    """The same, under Docker Hub names, for `localswarm pulumi up` (machines pull through the mirror)."""
    deb = prometheus_deb(progress)
    version = deb.name.split("_")[1].split("+")[0]
    prometheus = push_image(HUB_NAMES["prometheus"], version, prometheus_rootfs(deb), prometheus_config())
    registry.push_standin_as([f"{HUB_NAMES['grafana']}:1"])
    grafana = manifest_digest(HUB_NAMES["grafana"], "1")
    return {"prometheus": f"{HUB_NAMES['prometheus']}@{prometheus}", "grafana": f"{HUB_NAMES['grafana']}@{grafana}"}


def prometheus_task(manager) -> dict | None:
    """{"node", "container"} of the running Prometheus task, or None."""
    try:
        tasks = api.get(manager.sock, "/tasks", filters={"service": [f"{MONITORING_STACK}_prometheus"],
                                                          "desired-state": ["running"]})
        names = {n["ID"]: n["Description"]["Hostname"] for n in api.get(manager.sock, "/nodes")}
    except (OSError, api.ApiError):
        return None
    for task in tasks:
        container = task["Status"].get("ContainerStatus", {}).get("ContainerID")
        if task["Status"]["State"] == "running" and container:
            return {"node": names.get(task["NodeID"], ""), "container": container}
    return None


def _wget(where: dict, path: str, check: bool = True, nodes: list | None = None) -> str | None:
    """Ask Prometheus inside its task; nodes: the machines of Pulumi's CLI (pulumi_cli.nodes(), unless given)."""
    if nodes is None:
        from localswarm import pulumi_cli
        nodes = pulumi_cli.nodes()
    node = next((n for n in nodes if n.name == where["node"]), None)
    if node is None:
        raise RehearsalError(f"Prometheus runs on {where['node']}, which the rehearsal does not have")
    proc = docker(node, find_engine(), "exec", where["container"], "wget", "-qO-", f"http://127.0.0.1:9090{path}",
                  check=False, timeout=30)
    if proc.returncode != 0:
        if check:
            raise RehearsalError(f"Prometheus on {node.name} did not answer {path}: {proc.stderr.strip()[-300:]}")
        return None
    return proc.stdout


def query(prometheus: dict, expr: str, nodes: list | None = None) -> list[dict]:
    """An instant query, the result vector ([{metric, value}]); a query Prometheus refuses raises
    (busybox's wget fails on its HTTP 400)."""
    data = json.loads(_wget(prometheus, f"/api/v1/query?{urllib.parse.urlencode({'query': expr})}", nodes=nodes))
    if data.get("status") != "success":
        raise RehearsalError(f"Prometheus refused {expr!r}: {data}")
    return data["data"]["result"]


def program_access(outputs: dict, nodes: list, timeout: float = 90) -> dict | None:
    """Where to look after `localswarm pulumi up` with monitoring on, or None when it is off: the program's own
    `monitoring` output (the SSH tunnel and the addresses it opens on the operator's machine) and
    where each answers in this rehearsal. Each is asked, so the report says what answers, not what
    should. The stack deploys with --detach=true, so Prometheus gets up to timeout seconds to start;
    it is asked inside its task, and each published port once
    from this host, over the bridge."""
    access = outputs.get("monitoring") or {}
    if not access.get("tunnel"):
        return None
    manager = next(n for n in nodes if n.role == "manager")
    deadline = time.monotonic() + timeout
    while not ((where := prometheus_task(manager)) and _wget(where, "/-/ready", check=False, nodes=nodes) is not None):
        if time.monotonic() > deadline:
            where = None
            break
        time.sleep(2)
    published = {service: f"http://{manager.address}:{port}" for service, port in monitoring.PORTS.items()}
    return {"tunnel": access["tunnel"], "grafana": access.get("grafana"), "prometheus": access.get("prometheus"),
            "rehearsal": {
                "prometheus": {"task": where, "published": published["prometheus"],
                               "published_answers": _answers(f"{published['prometheus']}/-/ready")},
                "grafana": {"published": published["grafana"], "published_answers": _answers(published["grafana"]),
                            "note": "a stand-in that serves nothing: the rehearsal cannot pull grafana/grafana "
                                    "(Docker Hub is out of reach) and Debian does not package Grafana"}}}


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=3) as reply:
            return reply.status == 200
    except OSError:
        return False


def render_access(access: dict) -> str:
    """program_access() as `localswarm pulumi up` prints it."""
    prometheus, grafana = access["rehearsal"]["prometheus"], access["rehearsal"]["grafana"]
    answers = {True: "answers", False: "does not answer"}
    task = (f"runs on {prometheus['task']['node']} and answers /-/ready in its task" if prometheus["task"]
            else "did not answer /-/ready in its task")
    return "\n".join([
        "\nmonitoring (the stack output `monitoring`): open the tunnel, then browse",
        f"  {access['tunnel']}",
        f"  Grafana:    {access['grafana']}",
        f"  Prometheus: {access['prometheus']}",
        "in this rehearsal:",
        f"  Prometheus: {task}; its published port {prometheus['published']} "
        f"{answers[prometheus['published_answers']]} from this host",
        f"  Grafana:    {grafana['published']} {answers[grafana['published_answers']]}: {grafana['note']}"])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m localswarm.monitoring_stack", description=__doc__.split("\n")[0])
    parser.add_argument("--hub-images", action="store_true", required=True,
                        help="push the rehearsal's Prometheus and Grafana stand-in under Docker Hub names (the "
                             "rehearsal must be up) and print the monitoringImages value for `pulumi config set`")
    parser.parse_args(argv)
    try:
        print(json.dumps(hub_images(lambda m: print(m, file=sys.stderr))))
    except RehearsalError as e:
        print(f"localswarm: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
