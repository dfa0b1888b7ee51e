"""monitoring and monitoringImages: whether the monitoring stack is deployed, and with which images."""
from __future__ import annotations

from settings.model import Monitoring
from settings.reader import Reader, suggest
from swarm.monitoring import SERVICES, image_problem
from swarm.node_contract import MONITORING_STACK


def read_monitoring(r: Reader, stack_names: list[str]) -> Monitoring:
    enabled = r.boolean("monitoring")
    raw = r.json("monitoringImages", dict, "pulumi config set --path 'monitoringImages.prometheus' "
                                           "'prom/prometheus:v3.5.0@sha256:<digest>'")
    images = []
    for service, image in sorted((raw or {}).items()):
        if service not in SERVICES:
            r.error(f"monitoringImages.{service}", "is not a service of the monitoring stack"
                    + suggest(service, SERVICES))
        elif image_problem(image):
            r.error(f"monitoringImages.{service}", image_problem(image))
        else:
            images.append((service, image.strip()))
    if MONITORING_STACK in stack_names:
        r.error("stacks", f"{MONITORING_STACK!r} is the name of the program's monitoring stack (monitoring: true); "
                          "give your stack another name")
    return Monitoring(enabled=enabled, images=tuple(images))
