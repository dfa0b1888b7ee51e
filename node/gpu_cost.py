#!/usr/bin/env python3
"""What this node's GPUs cost, and each task's share: the node's price (cost.env) split as the swarm splits them.

For the metrics exporter (gpu_metrics.py). The program writes the node's hourly price, as its
preview read it, to cost.env (to_node/software.py price_env); this reads the file again whenever
it changes, so a new price needs no restart. A GPU costs the node's price over the instance type's
GPUs; a task that holds a whole GPU pays all of it, one that holds a slot of a shared GPU pays the
GPU's price over its slots; what no task holds is idle. So the holders of a GPU and its idle cost add
up to the GPU's price, and a node's GPUs to the node's. Stdlib only.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import datetime

from contract import (PRICE_DATE_ENV, PRICE_ENV, PRICE_GPUS_ENV, PRICE_INSTANCE_TYPE_ENV, PRICE_MARKET_ENV)
from gpu_resources import SLOT_RE


@dataclass(frozen=True)
class NodePrice:
    per_hour: float  # USD, AWS's list price of the instance
    gpus: int  # the instance type's GPUs, which share it equally
    market: str
    instance_type: str
    set_at: float | None  # unix time AWS set the price; None when cost.env does not say

    @property
    def per_gpu(self) -> float:
        return self.per_hour / self.gpus


def parse_env(text: str) -> dict[str, str]:
    """KEY=VALUE lines as systemd's EnvironmentFile reads them (to_node/software.py env_text writes them)."""
    env = {}
    for line in text.splitlines():
        key, sep, value = line.strip().partition("=")
        if sep and key and not key.startswith("#"):
            env[key] = value[1:-1] if len(value) > 1 and value[0] == value[-1] == '"' else value
    return env


def node_price(env: dict[str, str]) -> NodePrice | None:
    """The node's price from cost.env's keys; None when it is not known (or not a price)."""
    try:
        per_hour, gpus = float(env.get(PRICE_ENV, "")), int(env.get(PRICE_GPUS_ENV, ""))
    except ValueError:
        return None
    if not per_hour >= 0 or gpus < 1:  # NaN and negatives are no price
        return None
    try:
        set_at = datetime.fromisoformat(env.get(PRICE_DATE_ENV, "").replace("Z", "+00:00")).timestamp()
    except ValueError:
        set_at = None
    return NodePrice(per_hour, gpus, env.get(PRICE_MARKET_ENV, ""), env.get(PRICE_INSTANCE_TYPE_ENV, ""), set_at)


class PriceFile:
    """cost.env, read again when its size or modification time changes; no file: no price."""

    def __init__(self, path: str | None, log=print):
        self.path, self.log = path, log
        self.seen: tuple[int, int] | None = None
        self.price: NodePrice | None = None

    def current(self) -> NodePrice | None:
        if not self.path:
            return None
        try:
            stat = os.stat(self.path)
            if (stat.st_mtime_ns, stat.st_size) != self.seen:
                with open(self.path, encoding="utf-8") as f:
                    env = parse_env(f.read())
                self.seen, self.price = (stat.st_mtime_ns, stat.st_size), node_price(env)
                if self.price is None:
                    self.log(f"{self.path} names no price ({env.get(PRICE_ENV) or 'empty'}): no cost metrics")
        except OSError:
            self.seen, self.price = None, None
        return self.price


def slots_per_gpu(config: dict, shared_kind: str) -> dict[str, int]:
    """{GPU UUID: its slots} of the GPUs daemon.json advertises as slots of shared_kind."""
    slots: dict[str, int] = {}
    for entry in config.get("node-generic-resources", []):
        name, _, value = entry.partition("=")
        slot = SLOT_RE.fullmatch(value) if name == shared_kind else None
        if slot:
            slots[slot["gpu"]] = slots.get(slot["gpu"], 0) + 1
    return slots


def shares(gpu_price: float, holders: list, slots: int) -> tuple[list[tuple[object, float]], float]:
    """([(holder, its share of the GPU's price)], the idle rest). A slot holder pays gpu_price / slots; the
    holder of a whole GPU all of it (were there two, which the guard refuses, they would split it)."""
    if slots:
        held = holders[:slots]
        return [(h, gpu_price / slots) for h in held], gpu_price * (slots - len(held)) / slots
    return [(h, gpu_price / len(holders)) for h in holders], 0.0 if holders else gpu_price


def add_gpu_cost(price: NodePrice, base: list[str], holders: list, slots: int, add) -> None:
    """The GPU's rows (base: its gpu, index, model and node labels): its price, its idle rest, and each holder's
    share under the exporter's holder labels (task_cost, a series of gpu_metrics.py's own families)."""
    held, idle = shares(price.per_gpu, holders, slots)
    add("gpu_cost", base, price.per_gpu)
    add("idle_cost", base, idle)
    for holder, share in held:
        add("task_cost", base + [holder.service, holder.task, holder.container, holder.slot], share)


def add_node_cost(price: NodePrice, node: str, add) -> None:
    add("node_cost", [node, price.instance_type, price.market], price.per_hour)
    if price.set_at is not None:
        add("price_set", [node], price.set_at)


_GPU = ["gpu", "index", "model", "node"]
# (row key, metric, help, labels) of the families above but task_cost, which has the GPU series' labels.
COST_FAMILIES = (
    ("gpu_cost", "gpu_swarm_gpu_cost_dollars_per_hour",
     "The GPU's share of the node's price (cost.env: AWS's list price, as the preview read it), USD per hour", _GPU),
    ("idle_cost", "gpu_swarm_idle_cost_dollars_per_hour",
     "What of the GPU's price no task holds, USD per hour: all of it for a free GPU, its free slots' for a shared one",
     _GPU),
    ("node_cost", "gpu_swarm_node_cost_dollars_per_hour", "The node's price, USD per hour, as the program's preview "
     "read it", ["node", "instance_type", "market"]),
    ("price_set", "gpu_swarm_node_price_set_timestamp_seconds", "When AWS set the node's price (a spot price's "
     "time, the Price List term's effective date)", ["node"]),
)
