"""The monitoring stack (stacks/monitoring.yml and stacks/monitoring/): rendered, packed, and deployed.

Its configs (Prometheus's file, Grafana's provisioning and dashboard) are files beside the
compose file, which `docker stack deploy` reads from disk. The program's other stacks travel
as one compose file on stdin; this one travels as a tar of its files, base64 on stdin, that the
deploy script unpacks into a temporary folder on the manager. Swarm configs cannot change, so
render() names each after its content's hash: a changed file becomes a new config and the
service rolls onto it; configs no service uses any more are removed after the deploy.
Pure functions of the files and their arguments, as every builder in swarm/.
"""
from __future__ import annotations

import base64
import hashlib
import io
import json
import re
import tarfile
from pathlib import Path

import yaml

from swarm.node_contract import DOCKER_SOCKET, METRICS_PORT, MONITORING_STACK
from swarm.script import quote, script, sha256_hex
from swarm.stacks import into_swarm, marker
from swarm.labels import STACK_LABEL, STACK_NAMESPACE_LABEL

STACKS = Path(__file__).resolve().parent.parent / "stacks"
COMPOSE = STACKS / "monitoring.yml"
DASHBOARD = STACKS / "monitoring" / "gpu-swarm-dashboard.json"  # what Grafana provisions
SERVICES = ("prometheus", "grafana")  # the services whose images monitoringImages may replace
PORTS = {"grafana": 3000, "prometheus": 9090}  # published, reached through an SSH tunnel
DIGEST_REF = re.compile(r"[a-z0-9][a-z0-9._/:-]*@sha256:[0-9a-f]{64}")


def default_images() -> dict[str, str]:
    """The pinned images, as stacks/monitoring.yml names them: the one place they are written."""
    services = yaml.safe_load(COMPOSE.read_text(encoding="utf-8"))["services"]
    return {name: services[name]["image"] for name in SERVICES}


def image_problem(value: object) -> str | None:
    """Why an image reference is not pinned by digest, or None."""
    if not isinstance(value, str) or not DIGEST_REF.fullmatch(value.strip()):
        return (f"{value!r} is not pinned by digest; give NAME[:TAG]@sha256:<64 hex digits>, e.g. "
                f"{default_images()['prometheus']}")
    return None


def render(images: dict[str, str] | None = None, *, docker_socket: str = DOCKER_SOCKET,
           scrape_interval: str = "15s") -> dict[str, str]:
    """Every file of the stack, as it is deployed: {path relative to the stack folder: text}.

    images replaces services' images (names from SERVICES); docker_socket is the manager's
    Engine API socket (the rehearsal's engines have their own); scrape_interval is Prometheus's.
    """
    doc = yaml.safe_load(COMPOSE.read_text(encoding="utf-8"))
    for name, image in (images or {}).items():
        if name not in SERVICES:
            raise ValueError(f"monitoring image for {name!r}: the stack's services are {', '.join(SERVICES)}")
        problem = image_problem(image)
        if problem:
            raise ValueError(f"monitoring image for {name}: {problem}")
        doc["services"][name]["image"] = image.strip()
    prometheus = doc["services"]["prometheus"]
    prometheus["volumes"] = [f"{docker_socket}:/var/run/docker.sock:ro" if v.endswith(":/var/run/docker.sock:ro")
                             else v for v in prometheus["volumes"]]
    files = {}
    for name, config in doc["configs"].items():
        rel = config["file"].removeprefix("./")
        text = (STACKS / rel).read_text(encoding="utf-8")
        if rel.endswith("prometheus.yml"):
            text = text.replace("scrape_interval: 15s", f"scrape_interval: {scrape_interval}", 1)
        files[rel] = text
        config["name"] = f"{MONITORING_STACK}-{name}-{hashlib.sha256(text.encode()).hexdigest()[:12]}"
    files["monitoring.yml"] = yaml.safe_dump(doc, sort_keys=False)
    return files


def bundle(files: dict[str, str]) -> str:
    """The files as one tar, base64 in lines: the same text for the same files, on any machine."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for rel in sorted(files):
            data = files[rel].encode()
            info = tarfile.TarInfo(rel)
            info.size, info.mtime, info.mode = len(data), 0, 0o644
            tar.addfile(info, io.BytesIO(data))
    return base64.encodebytes(out.getvalue()).decode()


def bundle_sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def deploy_monitoring(bundle_sha: str, swarm_id: str = "") -> str:
    """Deploy (or update) the monitoring stack from bundle() on stdin; bundle_sha names that content,
    swarm_id the swarm it goes into (a new swarm changes the script, so it is deployed again)."""
    stack = quote(MONITORING_STACK)
    sha = sha256_hex(bundle_sha, "the monitoring stack")
    return script(
        f'echo "deploying stack {MONITORING_STACK} (files sha256 {sha[:16]}){into_swarm(swarm_id)}"',
        'dir=$(mktemp -d)',
        'trap \'rm -rf "$dir"\' EXIT',
        'base64 -d | tar -x -C "$dir"',
        # --detach=true: as every stack of the program, it never holds `pulumi up`.
        f'docker stack deploy --detach=true --with-registry-auth --prune -c "$dir/monitoring.yml" {stack}',
        # Its marker: swarm/reconcile.py removes the stack once `monitoring` is turned off.
        f"docker config inspect {quote(marker(MONITORING_STACK))} >/dev/null 2>&1 ||",
        f"  printf '%s' {stack} | docker config create --label {STACK_LABEL}={stack} "
        f"{quote(marker(MONITORING_STACK))} - >/dev/null",
        # Configs of earlier versions: removing one that a task still uses fails, harmlessly.
        f"docker config ls -q --filter label={STACK_NAMESPACE_LABEL}={stack} | "
        "xargs -r docker config rm >/dev/null 2>&1 || true",
    )


def tunnel_command(user: str, manager: str) -> str:
    """What an operator runs to open Grafana and Prometheus: an SSH tunnel through a manager."""
    forwards = " ".join(f"-L {port}:localhost:{port}" for port in PORTS.values())
    return f"ssh -N {forwards} {user}@{manager}"


def dashboard_panels() -> list[dict]:
    """The provisioned dashboard's panels, in the order a reader meets them (top to bottom, left to
    right): what `localswarm top` and the tests take each panel's PromQL from, so it is written once."""
    panels = json.loads(DASHBOARD.read_text(encoding="utf-8"))["panels"]
    return sorted(panels, key=lambda p: (p["gridPos"]["y"], p["gridPos"]["x"]))


_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def as_grafana_sends(expr: str) -> str:
    """A panel's PromQL as Grafana sends it over the dashboard's own time range (time.from, now-3h): its
    $__range in seconds. What `localswarm top` and the tests ask Prometheus, which knows no $__ variables."""
    since = json.loads(DASHBOARD.read_text(encoding="utf-8"))["time"]["from"]
    found = re.fullmatch(r"now-(\d+)([smhdw])", since)
    if not found:
        raise ValueError(f"{DASHBOARD.name}: time.from {since!r} is not now-<n><unit>")
    return expr.replace("$__range", f"{int(found[1]) * _UNITS[found[2]]}s")


def top_panel() -> dict:
    """The dashboard's top-left panel: the first thing an operator sees when it opens."""
    return dashboard_panels()[0]


def scrape_port_in_config() -> int:
    """The exporter port Prometheus's relabelling points at (a test compares it with the contract's)."""
    text = (STACKS / "monitoring" / "prometheus.yml").read_text(encoding="utf-8")
    return int(re.search(r'replacement: "\$1:(\d+)"', text)[1])


__all__ = ["COMPOSE", "DASHBOARD", "METRICS_PORT", "PORTS", "SERVICES", "as_grafana_sends", "bundle", "bundle_sha256",
           "dashboard_panels", "default_images", "deploy_monitoring", "image_problem", "render",
           "scrape_port_in_config", "top_panel", "tunnel_command"]
