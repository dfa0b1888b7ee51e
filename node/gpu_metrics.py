#!/usr/bin/env python3
"""GPU metrics exporter for gpu-swarm nodes: what each GPU is doing, and for which swarm task.

Serves Prometheus metrics (prometheus_client) for every GPU NVML sees, read at each scrape
through the node's one NVML reader (nvml_reader.py): utilization, memory, power, temperature,
SM clock, throttle reasons, ECC counts, the XIDs it has seen since it started, and the condition
the health watcher published. Every GPU series has the labels gpu (UUID), index, model and
node; a GPU held by a swarm task also has service, task and container, and slot for a slot of
a shared GPU (one series per holder then, so sum over a shared GPU with max by (gpu)): those are
the GPU's figures. Each task's own GPU memory and utilization come from NVML's compute processes,
MPS clients and per-process samples, mapped to containers through their cgroups (gpu_tasks.py),
so a sharer's series never carry a neighbour's; the MPS server is no task's. A GPU whose NVML
calls fail reports gpu_swarm_gpu_up 0 and counts the failures in gpu_swarm_nvml_errors_total;
the other GPUs go on. Where the program told the node its price (cost.env), each GPU's cost, each
holder's share of it and the idle rest (gpu_cost.py), in USD per hour.
Stdlib plus pynvml (nvidia-ml-py) and prometheus_client.

Exit codes: 0 stopped (SIGTERM), or --once done; 1 the port could not be opened; 2 bad input.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import threading
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)  # its siblings ship beside it (tests load it by path)
from contract import (CONDITION_GPU_LABEL, CONDITION_LABEL, CONDITION_REASON_LABEL, COST_ENV_PATH,  # noqa: E402
                      DOCKER_DAEMON_JSON, DOCKER_SOCKET, KIND_ENV, METRICS_PORT, SHARED_KIND_ENV)
from gpu_cost import COST_FAMILIES, PriceFile, add_gpu_cost, add_node_cost, slots_per_gpu  # noqa: E402
from gpu_resources import DEFAULT_KIND, default_shared_kind, validate_kind  # noqa: E402
from gpu_tasks import Holder, Tasks  # noqa: E402
from health_rules import RANK, watched_uuids  # noqa: E402
from nvml_reader import MIB, THROTTLE_REASONS, Nvml, NvmlFailed, NvmlMissing, text  # noqa: E402

from prometheus_client import CollectorRegistry, generate_latest, start_http_server  # noqa: E402
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily  # noqa: E402
from prometheus_client.process_collector import ProcessCollector  # noqa: E402

GPU_LABELS = ["gpu", "index", "model", "node", "service", "task", "container", "slot"]
FREE = Holder("", "", "")  # a GPU no task holds: its holder labels are empty, which Prometheus drops
NVML_RETRY_S = 60  # NVML that failed to start is tried again this often, at a scrape
EVENT_WAIT_S = 5  # the XID listener wakes this often to see whether it should stop


def lean_malloc():
    """glibc's malloc gives each thread that allocates an arena of its own, up to 8 per core, and an
    arena does not shrink: on a 16-core GPU node the scrape threads, NVML's and the XID listener's
    spread the exporter's garbage over many of them (60.6 MiB RSS with real NVML and 8 sharers on
    2xH100, budget 60; 26 MiB here with the fake NVML). Two arenas, and what a scrape freed given back
    before the next, keep the RSS near what it holds. Returns malloc_trim; None if libc is not glibc."""
    try:
        import ctypes  # pynvml imports it anyway
        libc = ctypes.CDLL(None)
        libc.mallopt(-8, 2)  # M_ARENA_MAX, before any thread starts
        return libc.malloc_trim
    except (OSError, AttributeError):
        return None


class GpuCollector:
    """Reads everything at each scrape (collect); only the XID counts accumulate between scrapes."""

    def __init__(self, node: str, kind: str, shared_kind: str, daemon_json: str, docker_socket: str, log=print,
                 proc: str = "/proc", cost_env: str | None = None):
        self.node, self.kind, self.shared_kind, self.daemon_json, self.log = node, kind, shared_kind, daemon_json, log
        self.tasks = Tasks(kind, shared_kind, docker_socket, proc)
        self.price = PriceFile(cost_env, log)  # no path: no cost metrics
        self.nvml: Nvml | None = None
        self.nvml_error, self.next_init = None, 0.0
        self.lock = threading.Lock()  # one scrape at a time: NVML and the caches are shared
        self.known: dict[str, tuple[str, str]] = {}  # uuid -> (index, model) last seen, for a GPU that vanished
        self.parents: dict[str, str] = {}  # device uuid -> its GPU's uuid (MIG), where events arrive
        self.xids: dict[tuple[str, int], int] = {}
        self.errors: dict[tuple[str, str], int] = {}
        self.stopping = threading.Event()
        self.last_scrape_s = 0.0
        self.trim = None  # lean_malloc()'s malloc_trim, which main() sets: the last scrape's garbage given back

    # ---------------------------------------------------------------- NVML and its XID listener
    def _ensure_nvml(self) -> Nvml | None:
        if self.nvml is None and time.monotonic() >= self.next_init:
            try:
                self.nvml, self.nvml_error = Nvml(), None
                threading.Thread(target=self._listen, args=(self.nvml,), name="xid-events", daemon=True).start()
            except (NvmlMissing, NvmlFailed) as e:
                if str(e) != self.nvml_error:
                    self.log(f"NVML is not available ({e}); trying again every {NVML_RETRY_S} s")
                self.nvml_error, self.next_init = str(e), time.monotonic() + NVML_RETRY_S
        return self.nvml

    def _listen(self, nvml: Nvml) -> None:
        """Count XIDs as they come: a scrape only sees state, and an XID is an event."""
        try:
            events, devices, registered = nvml.event_set(), nvml.devices([]), set()
        except nvml.Error as e:
            self.log(f"no XID events will be counted ({e}); the readings go on")
            return
        for device in devices:
            try:
                parent = nvml.parent(device.handle)
                if nvml.uuid(parent) not in registered:  # a MIG device's events arrive on its GPU
                    registered.add(nvml.uuid(parent))
                    nvml.register(parent, events, kinds=("xid",))
            except nvml.Error as e:  # one broken GPU must not cost the others their XID counts
                self.log(f"GPU {device.index}: no XID events will be counted ({e}); its readings go on")
        while not self.stopping.is_set():
            try:
                event = nvml.wait(events, EVENT_WAIT_S)
                if event and event[1] == "xid":
                    key = (nvml.uuid(event[0]), event[2])
                    with self.lock:
                        self.xids[key] = self.xids.get(key, 0) + 1
            except nvml.Error as e:
                self.log(f"waiting for XID events failed ({e}); trying again in {EVENT_WAIT_S} s")
                self.stopping.wait(EVENT_WAIT_S)

    # ---------------------------------------------------------------- what the node says about itself
    def _daemon_config(self) -> dict:
        try:
            with open(self.daemon_json, encoding="utf-8") as f:
                config = json.load(f)
            return config if isinstance(config, dict) else {}
        except (OSError, ValueError):
            return {}  # no advertised GPUs or conditions to add: NVML's GPUs are still reported

    # ---------------------------------------------------------------- a scrape
    def collect(self):
        with self.lock:
            if self.trim:
                self.trim(0)
            t0 = time.perf_counter()
            families = self._read()
            self.last_scrape_s = time.perf_counter() - t0
            families.append(self._gauge("gpu_swarm_exporter_scrape_duration_seconds",
                                        "Seconds the exporter took to read its GPUs and tasks for this scrape",
                                        ["node"], [([self.node], self.last_scrape_s)]))
        yield from families

    def _gauge(self, name, doc, labels, rows, counter=False):
        family = (CounterMetricFamily if counter else GaugeMetricFamily)(name, doc, labels=labels)
        for values, value in rows:
            family.add_metric(values, value)
        return family

    def _read(self) -> list:
        config = self._daemon_config()
        advertised = watched_uuids(config, self.kind, self.shared_kind)
        self.tasks.refresh()
        nvml = self._ensure_nvml()
        rows: dict[str, list] = {}  # family name -> [(label values, value)]
        seen = set()
        price, slots = self.price.current(), slots_per_gpu(config, self.shared_kind)

        def add(family, gpu_labels, value, *extra):
            rows.setdefault(family, []).append(([*gpu_labels, *extra], value))

        def cost(uuid, base, holders):
            if price:
                add_gpu_cost(price, base, [h for h in holders if h is not FREE], slots.get(uuid, 0), add)

        for device, uuid, index, model, values, errors in (self._devices(nvml) if nvml else []):
            seen.add(uuid)
            base = [uuid, index, model, self.node]
            holders = self.tasks.by_gpu.get(uuid) or [FREE]
            memory = values.get("memory")
            for holder in holders:
                labels = base + [holder.service, holder.task, holder.container, holder.slot]
                add("up", labels, 0 if errors else 1)
                if "utilization" in values:
                    add("util", labels, values["utilization"].gpu)
                    add("memutil", labels, values["utilization"].memory)
                if memory is not None:
                    add("used", labels, memory.used)
                    add("total", labels, memory.total)
                for name, key, scale in (("power", "power_mw", 1e-3), ("temp", "temperature_c", 1),
                                         ("clock", "sm_clock_mhz", 1e6)):
                    if key in values:
                        add(name, labels, values[key] * scale)
                if "throttle_reasons" in values:
                    add("reasons", labels, values["throttle_reasons"])
                    for reason, bit in THROTTLE_REASONS.items():
                        add("throttled", labels, 1 if values["throttle_reasons"] & bit else 0, reason)
                for kind in ("corrected", "uncorrected"):
                    if f"ecc_{kind}" in values:
                        add("ecc", labels, values[f"ecc_{kind}"], kind)
                for (gpu, xid), count in sorted(self.xids.items()):
                    if gpu == self.parents.get(uuid, uuid):
                        add("xid", labels, count, str(xid))
                for (gpu, error), count in sorted(self.errors.items()):
                    if gpu == uuid:
                        add("errors", labels, count, error)
                condition = self._condition(config, uuid)
                if condition:
                    add("condition", labels, RANK[condition[0]], *condition)
            self._task_memory(uuid, base, holders, _processes(values), add)
            self._task_utilization(uuid, base, holders, values.get("process_utilization"), add)
            cost(uuid, base, holders)
        for uuid in advertised:  # advertised to swarm, but NVML does not list it: off the bus, or NVML is down
            if uuid not in seen:
                index, model = self.known.get(uuid, ("", ""))
                what = "not_found" if nvml else "nvml_unavailable"
                self.errors[(uuid, what)] = self.errors.get((uuid, what), 0) + 1
                for holder in self.tasks.by_gpu.get(uuid) or [FREE]:
                    labels = [uuid, index, model, self.node, holder.service, holder.task, holder.container,
                              holder.slot]
                    add("up", labels, 0)
                    add("errors", labels, self.errors[(uuid, what)], what)
                cost(uuid, [uuid, index, model, self.node], self.tasks.by_gpu.get(uuid) or [])  # paid for all the same
        if price:
            add_node_cost(price, self.node, add)
        return self._families(rows)

    def _devices(self, nvml: Nvml):
        """(device, uuid, index, model, readings, errors) of every device NVML lists; a device whose
        name or UUID cannot be read is skipped (its UUID is what every series is named by)."""
        try:
            devices = nvml.devices([])
        except nvml.Error as e:
            self.errors[("", "enumeration")] = self.errors.get(("", "enumeration"), 0) + 1
            self.log(f"NVML cannot list the GPUs ({e})")
            return
        for device in devices:
            try:
                uuid, model = nvml.uuid(device.handle), text(nvml.nv.nvmlDeviceGetName(device.handle))
                parent = nvml.parent(device.handle)
                self.parents[uuid] = nvml.uuid(parent)
            except nvml.Error:
                continue
            values, errors = nvml.sample(device.handle, parent)
            for error in errors:
                key = (uuid, error.split(":", 1)[0])
                self.errors[key] = self.errors.get(key, 0) + 1
            self.known[uuid] = (str(device.index), model)
            yield device, uuid, str(device.index), model, values, errors

    def _condition(self, config: dict, uuid: str) -> tuple[str, str] | None:
        """The watcher's node condition, on the GPU it names (on every GPU when it names none)."""
        labels = dict(entry.split("=", 1) for entry in config.get("labels", []) if "=" in entry)
        condition = labels.get(CONDITION_LABEL)
        if condition not in RANK:
            return None  # no watcher has reported on this node
        if labels.get(CONDITION_GPU_LABEL, "-") in ("-", uuid):
            return condition, labels.get(CONDITION_REASON_LABEL, "-")
        return "healthy", "ok"

    def _task_memory(self, uuid, base, holders, processes, add) -> None:
        """Each holder's memory on this GPU (0 when its processes hold none), and what no task holds."""
        used = {holder: 0 for holder in holders if holder is not FREE}
        untracked = 0
        for pid, memory in processes or ():
            holder = self.tasks.holder_of_process(pid, uuid)
            if holder is None:
                untracked += memory
            else:
                used[holder] = used.get(holder, 0) + memory
        for holder, memory in used.items():
            add("task_memory", base + [holder.service, holder.task, holder.container, holder.slot], memory)
        if processes is not None:
            add("untracked", base, untracked)

    def _task_utilization(self, uuid, base, holders, samples, add) -> None:
        """Each holder's share of the GPU's kernel time, from NVML's per-process samples: its own
        processes' only, never the GPU's figure under its name. A sample of a process in no task
        (the MPS server, where the driver names it for its clients) goes to no task."""
        if samples is None:
            return  # NVML cannot say per process: no series, rather than a neighbour's figure
        busy = {holder: 0 for holder in holders if holder is not FREE}
        untracked = 0
        for pid, sm in samples.items():
            holder = self.tasks.holder_of_process(pid, uuid)
            if holder is None:
                untracked += sm
            else:
                busy[holder] = busy.get(holder, 0) + sm
        for holder, sm in busy.items():
            add("task_util", base + [holder.service, holder.task, holder.container, holder.slot], min(sm, 100))
        add("untracked_util", base, min(untracked, 100))

    def _families(self, rows: dict[str, list]) -> list:
        described = {
            "up": ("gpu_swarm_gpu_up", "1 when every NVML reading of the GPU succeeded at this scrape, else 0", []),
            "util": ("gpu_swarm_gpu_utilization_percent", "Percent of the last sample period a kernel ran", []),
            "memutil": ("gpu_swarm_memory_utilization_percent", "Percent of the period memory was read or written",
                        []),
            "used": ("gpu_swarm_memory_used_bytes", "GPU memory in use, by every process", []),
            "total": ("gpu_swarm_memory_total_bytes", "GPU memory in all", []),
            "power": ("gpu_swarm_power_watts", "Power draw of the GPU board", []),
            "temp": ("gpu_swarm_temperature_celsius", "GPU core temperature", []),
            "clock": ("gpu_swarm_sm_clock_hertz", "Streaming multiprocessor clock", []),
            "reasons": ("gpu_swarm_throttle_reasons", "NVML's clocks event (throttle) reasons, as a bit mask", []),
            "throttled": ("gpu_swarm_throttled", "1 while the clocks are held down for this reason", ["reason"]),
            "ecc": ("gpu_swarm_ecc_errors", "Memory errors (volatile ECC counts) since the driver loaded",
                    ["type"], True),
            "xid": ("gpu_swarm_xid_events", "XID events NVML reported since the exporter started", ["xid"], True),
            "errors": ("gpu_swarm_nvml_errors", "NVML readings of the GPU that failed, by what was asked",
                       ["error"], True),
            "condition": ("gpu_swarm_condition", "The health watcher's condition (0 healthy, 1 degraded, "
                          "2 unhealthy, 3 reclaim), on the GPU it names", ["condition", "reason"]),
            "task_memory": ("gpu_swarm_task_memory_used_bytes", "GPU memory of the task's processes on this GPU", []),
            "task_util": ("gpu_swarm_task_utilization_percent", "Percent of the last sample period the task's "
                          "own processes ran kernels on this GPU (NVML's per-process samples)", []),
            "task_cost": ("gpu_swarm_task_cost_dollars_per_hour", "The task's share of the GPU's price, USD per hour: "
                          "all of it for a whole GPU, the price over the slots for a slot", []),
        }
        families = [self._gauge(name, doc, GPU_LABELS + extra, rows.get(key, []), *counter)
                    for key, (name, doc, extra, *counter) in described.items()]
        families.append(self._gauge("gpu_swarm_untracked_memory_used_bytes",
                                    "GPU memory of processes in no swarm task (docker run, the host)",
                                    ["gpu", "index", "model", "node"], rows.get("untracked", [])))
        families.append(self._gauge("gpu_swarm_untracked_utilization_percent",
                                    "Percent of the period processes in no swarm task ran kernels (under MPS: "
                                    "what NVML gives the MPS server rather than its clients)",
                                    ["gpu", "index", "model", "node"], rows.get("untracked_util", [])))
        families += [self._gauge(name, doc, labels, rows.get(key, [])) for key, name, doc, labels in COST_FAMILIES]
        families.append(self._gauge("gpu_swarm_exporter_nvml_up", "1 when NVML answers the exporter", ["node"],
                                    [([self.node], 1 if self.nvml else 0)]))
        families.append(self._gauge("gpu_swarm_exporter_docker_up", "1 when dockerd said which task holds which GPU",
                                    ["node"], [([self.node], 0 if self.tasks.error else 1)]))
        return families


def _processes(values: dict) -> list[tuple[int, int]] | None:
    """The GPU's compute processes and MPS clients, each pid once (with the larger figure, where
    both lists name it): under MPS a task's memory is its client processes', the server's is no task's."""
    if "processes" not in values and "mps_processes" not in values:
        return None
    memory: dict[int, int] = {}
    for pid, used in (values.get("processes") or []) + (values.get("mps_processes") or []):
        memory[pid] = max(memory.get(pid, 0), used)
    return sorted(memory.items())


def parse_args(argv, env=os.environ) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Serve Prometheus metrics of this node's GPUs, labelled with the "
                                                 "swarm task that holds each. A $NAME in the help is the environment "
                                                 "variable that sets the default.")
    add = parser.add_argument
    add("--port", type=int, default=METRICS_PORT, help=f"(default {METRICS_PORT})")
    add("--address", default="0.0.0.0", help="listen address (default: every address; the security group "
                                             "lets only cluster members in)")
    add("--node-name", default=socket.gethostname(), help="the node label (default: the hostname, as swarm names it)")
    add("--kind", default=env.get(KIND_ENV) or DEFAULT_KIND, help=f"GPU kind (${KIND_ENV}, {DEFAULT_KIND})")
    add("--shared-kind", default=env.get(SHARED_KIND_ENV) or None,
        help=f"the kind of shared GPUs' slots (${SHARED_KIND_ENV}, <kind>-SHARED)")
    add("--daemon-json", default=DOCKER_DAEMON_JSON, metavar="PATH",
        help=f"the advertised GPUs and the watcher's condition (default {DOCKER_DAEMON_JSON})")
    add("--docker-socket", default=DOCKER_SOCKET, metavar="PATH", help=f"(default {DOCKER_SOCKET})")
    add("--cost-env", default=COST_ENV_PATH, metavar="PATH",
        help=f"the node's price, which the program writes (default {COST_ENV_PATH}; none there: no cost metrics)")
    add("--proc", default="/proc", metavar="PATH", help="where processes' cgroups are read (default /proc; "
                                                         "tests and bench/metrics_budget.py point it elsewhere)")
    add("--once", action="store_true", help="print one scrape's metrics and exit")
    args = parser.parse_args(argv)
    try:
        args.kind = validate_kind(args.kind)
        args.shared_kind = validate_kind(args.shared_kind or default_shared_kind(args.kind))
    except ValueError as e:
        parser.error(f"--kind/--shared-kind: {e}")
    if not 0 < args.port < 65536:
        parser.error(f"--port {args.port} is not a TCP port (1 to 65535)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    trim = lean_malloc()

    def log(message: str) -> None:
        print(f"gpu-swarm metrics: {message}", file=sys.stderr, flush=True)
    collector = GpuCollector(args.node_name, args.kind, args.shared_kind, args.daemon_json, args.docker_socket, log,
                             args.proc, args.cost_env)
    collector.trim = trim
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    ProcessCollector(registry=registry)  # process_resident_memory_bytes, process_cpu_seconds_total: its own cost
    if args.once:
        sys.stdout.write(generate_latest(registry).decode())
        collector.stopping.set()
        return 0
    try:
        start_http_server(args.port, addr=args.address, registry=registry)
    except OSError as e:
        log(f"cannot listen on {args.address}:{args.port} ({e.strerror or e})")
        return 1
    log(f"serving {args.node_name}'s GPUs on {args.address}:{args.port}/metrics")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop.wait()
    collector.stopping.set()
    return 0


if __name__ == "__main__":
    sys.exit(main())
