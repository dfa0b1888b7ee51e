"""Reading raw `gpu-swarm:*` values: every key's default, and a reader that collects problems."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pulumi.runtime.config as runtime_config

from settings.model import PROJECT
from settings.pool_autoscale import AUTOSCALE_DEFAULTS  # noqa: F401 (the checks import it from here too)
from settings.values import boolean, integer, suggest  # noqa: F401 (the checks import them from here too)
from swarm.gpu_kind import DEFAULT_KIND

# Stack files are named relative to the project, so the state holds no path of this machine.
PROJECT_DIR = Path(__file__).resolve().parent.parent

# Every key, its default (None: required) and the shape that the Pulumi.yaml config
# block declares; a test keeps the two in step.
DEFAULTS: dict[str, Any] = {
    "allowedSshCidrs": None,
    "allowSshFromAnywhere": False,
    "vpcCidr": "10.42.0.0/16",
    "vpcId": "",
    "subnetIds": [],
    "s3GatewayEndpointId": "",
    "availabilityZones": [],
    "managerCount": 1,
    "managerInstanceType": "m7i.large",
    "managerRootVolumeGiB": 40,
    "gpuPools": None,
    "image": "ubuntu",
    "amiId": "",
    "gpuKind": DEFAULT_KIND,
    "stacks": [],
    "stackSecrets": {},  # {stack: {VARIABLE: value}}, a Pulumi secret (settings/stack_checks.py)
    "registryCredentials": {},  # {registry: {username, password}}, a Pulumi secret (settings/cuda_checks.py)
    "tags": {},
    "sshUser": "ubuntu",
    "sshPublicKey": "",
    "sshPrivateKey": "",
    "imdsHopLimit": 1,
    "overlayAddressPool": "10.200.0.0/16",
    "sshAuthorizedKeys": [],
    "sharedGpuKind": "",
    "health": {},  # see HEALTH_DEFAULTS
    "monitoring": False,
    "monitoringImages": {},  # {prometheus, grafana}: each NAME[:TAG]@sha256:...; empty: stacks/monitoring.yml's
}
POOL_DEFAULTS: dict[str, Any] = {
    "name": None,
    "instanceType": None,
    "count": None,
    "spot": False,
    "spotMaxPrice": "",
    "rootVolumeGiB": 200,
    # Capacity and placement (settings/pool_options.py).
    "marketType": "on-demand",  # spot, or capacity-block (an EC2 Capacity Block for ML)
    "interruption": "terminate",  # spot: or stop (a persistent request; the node resumes on the same disk)
    "capacityReservation": "",  # cr-... (On-Demand or a Capacity Block) or a resource group's ARN
    "capacityReservationPreference": "",  # open or none; AWS's default is open
    "placement": "",  # cluster: a cluster placement group of the pool's own
    "efa": False,  # every EFA interface the type has
    "availabilityZone": "",  # all of the pool's nodes in this zone
    "sharing": None,  # {slotsPerGpu: K, mode}: the pool's GPUs are shared by K tasks each (settings/pool_sharing.py)
    "rollout": None,  # {maxUnavailable}: how many nodes a roll drains at once (settings/pool_rollout.py)
    "autoscale": None,  # {min, max, idleMinutes}: an elastic pool, instead of count (settings/pool_autoscale.py)
}
SHARING_DEFAULTS: dict[str, Any] = {"slotsPerGpu": None, "mode": "time-slicing"}
ROLLOUT_DEFAULTS: dict[str, Any] = {"maxUnavailable": "10%"}  # or a number of nodes
HEALTH_DEFAULTS: dict[str, Any] = {
    "ignoreXids": [],  # besides the application XIDs 13, 31, 43, 45, 68 and 109
    "criticalXids": [],  # never ignored, even one of those
    "checkIntervalSeconds": 10,
    "recoverySeconds": 300,
    "maxDrainedPercent": 50,
    "inventoryEachUp": True,
}
STACK_DEFAULTS: dict[str, Any] = {"name": None, "file": None, "waitSeconds": 600,
                                  "profiles": [], "variables": {}}  # settings/stack_checks.py


def key(name: str) -> str:
    return f"{PROJECT}:{name}"


class Reader:
    """Reads raw config values and collects problems instead of stopping at the first."""

    def __init__(self):
        self.problems: list[str] = []

    def error(self, name: str, message: str) -> None:
        self.problems.append(f"{key(name)}: {message}")

    def raw(self, name: str) -> str | None:
        value = runtime_config.get_config(key(name))
        # Pulumi.yaml gives optional keys an empty default, which means "not set".
        return None if value is None or value == "" else str(value)

    def project_keys(self) -> set[str]:
        # The language host loads the whole stack config with set_all_config; the
        # environment is the fallback that get_config itself reads.
        names = set(runtime_config.CONFIG.get()) | set(runtime_config.get_config_env())
        return {n.split(":", 1)[1] for n in names if n.startswith(f"{PROJECT}:")}

    def string(self, name: str) -> str:
        value = self.raw(name)
        return DEFAULTS[name] if value is None else value.strip()

    def integer(self, name: str, low: int, high: int) -> int | None:
        return integer(self.raw(name), DEFAULTS[name], low, high, lambda m: self.error(name, m))

    def boolean(self, name: str) -> bool:
        return boolean(self.raw(name), DEFAULTS[name], lambda m: self.error(name, m))

    def json(self, name: str, kind: type, example: str) -> Any:
        """A list or object value (the CLI passes them as JSON); None if unset, or reported as bad."""
        value = self.raw(name)
        if value is None:
            return DEFAULTS[name]
        try:
            parsed = json.loads(value)
        except ValueError:
            parsed = None
        if not isinstance(parsed, kind):
            what = "a list" if kind is list else "an object"
            self.error(name, f"expected {what}, found {value!r}; set it with {example}")
            return None
        return parsed
