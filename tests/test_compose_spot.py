"""Services that can land on a spot pool get stop_grace_period 90s unless they set one (swarm/compose_spot.py,
the one copy of the rule), so that a reclaim notice's drain leaves their tasks time to checkpoint. Swarm's own
loader (the docker CLI, no engine) judges the file as deployed."""
from __future__ import annotations

from textwrap import dedent

import pytest
import yaml

from swarm.compose_spot import SPOT_STOP_GRACE
from swarm.labels import POOL_LABEL, POOL_SLOTS_PER_GPU_LABEL, POOL_SPOT_LABEL
from swarm.stack_files import validate_stack_file
from tests.test_compose_corpus import swarm_loader

POOLS = {"training": {POOL_LABEL: "training", POOL_SPOT_LABEL: "false", POOL_SLOTS_PER_GPU_LABEL: "0"},
         "inference": {POOL_LABEL: "inference", POOL_SPOT_LABEL: "true", POOL_SLOTS_PER_GPU_LABEL: "0"}}
SHARING = {"training": {POOL_LABEL: "training", POOL_SPOT_LABEL: "false", POOL_SLOTS_PER_GPU_LABEL: "0"},
           "inference": {POOL_LABEL: "inference", POOL_SPOT_LABEL: "true", POOL_SLOTS_PER_GPU_LABEL: "4"}}
FILE = """\
services:
  train:
    image: busybox:1.36
    stop_signal: SIGUSR1
    deploy:
      placement:
        constraints: [node.labels.gpu-swarm.pool == training]
  serve:
    image: busybox:1.36
  batch:
    image: busybox:1.36
    deploy:
      placement:
        constraints: ["node.labels.gpu-swarm.spot!=true", node.hostname != x]
  pinned:
    image: busybox:1.36
    deploy:
      placement:
        constraints: [node.labels.gpu-swarm.pool == inference]
  chosen:
    image: busybox:1.36
    stop_grace_period: 5m
  anywhere-signal:
    image: busybox:1.36
    stop_signal: SIGINT
"""


def deployed(text: str, pools=POOLS, **extra):
    info = validate_stack_file(dedent(text), kind="NVIDIA-GPU", max_gpus_per_node=4, pool_sizes={"gpu": 4},
                               pools=pools, **extra)
    return info, yaml.safe_load(info.content)["services"]


def test_only_services_that_can_land_on_a_spot_pool_get_the_grace(tmp_path):
    info, services = deployed(FILE)
    grace = {name: svc.get("stop_grace_period") for name, svc in services.items()}
    assert grace == {"train": None, "serve": SPOT_STOP_GRACE, "batch": None, "pinned": SPOT_STOP_GRACE,
                     "chosen": "5m", "anywhere-signal": SPOT_STOP_GRACE}
    said = [r for r in info.rewrites if "stop_grace_period" in r]
    assert [r.split(":", 1)[0] for r in said] == [f"services.{n}.stop_grace_period"
                                                  for n in ("serve", "pinned", "anywhere-signal")]
    assert "its tasks get SIGINT and 90s to checkpoint" in said[2] and "SIGTERM" in said[0]
    loaded = swarm_loader(tmp_path, info.content)["services"]  # swarm reads it as 1m30s
    assert loaded["serve"]["stop_grace_period"] == "1m30s" and loaded["anywhere-signal"]["stop_signal"] == "SIGINT"
    assert "stop_grace_period" not in loaded["train"]


@pytest.mark.parametrize("pools", [{}, {"training": POOLS["training"]}])
def test_without_a_spot_pool_the_file_is_deployed_as_written(pools):
    text = "services:\n  serve:\n    image: busybox:1.36\n"
    info, services = deployed(text, pools)
    assert info.content == text and "stop_grace_period" not in services["serve"]


def test_the_gpu_kind_decides_which_pools_a_service_can_land_on():
    """A spot pool that shares its GPUs advertises slots only: whole-GPU services cannot land there, slot ones can."""
    def service(name: str, kind: str) -> str:
        return (f"  {name}:\n    image: busybox:1.36\n    deploy: {{resources: {{reservations: {{generic_resources: "
                f"[{{discrete_resource_spec: {{kind: {kind}, value: 1}}}}]}}}}}}\n")
    text = "services:\n" + service("whole", "NVIDIA-GPU") + service("slot", "NVIDIA-GPU-SHARED")
    _, services = deployed(text, SHARING, shared_kind="NVIDIA-GPU-SHARED")
    assert "stop_grace_period" not in services["whole"] and services["slot"]["stop_grace_period"] == SPOT_STOP_GRACE
    _, services = deployed("services:\n" + service("whole", "NVIDIA-GPU"), POOLS)
    assert services["whole"]["stop_grace_period"] == SPOT_STOP_GRACE  # a spot pool of whole GPUs
