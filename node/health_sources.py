#!/usr/bin/env python3
"""What the GPU health watcher (gpu_health.py) listens to: simulated GPUs, NVML, and IMDS.

A GPU source has check() (the periodic check), wait(seconds) -> True when it recorded an
event (seconds=0: one already queued), and close(). Spot polls IMDSv2 for AWS's notices.
NVML is read through nvml_reader.py, the node's one NVML reader; stdlib plus pynvml (package
nvidia-ml-py), imported only when NVML is used.
"""
from __future__ import annotations

import http.client
import json
import os
import time
import urllib.error
import urllib.request
from datetime import datetime, timezone

from gpu_detect import BadInput, DetectionFailed, load_inventory
from health_rules import OK, Tracker, record_event
from nvml_reader import Nvml as Nvml_, NvmlFailed, NvmlMissing, PynvmlMissing

DEFAULT_IMDS = "http://169.254.169.254"
SPOT_PATHS = ("/latest/meta-data/spot/instance-action", "/latest/meta-data/events/recommendations/rebalance")
# The instance's purchasing option: spot, on-demand, scheduled or capacity-block (EC2 User Guide, "Instance
# metadata categories"). A node asks it, not its node.env: a running node keeps the market it was launched on
# when its pool's marketType changes, and the program no longer writes one (a pool's move rolled every node).
LIFECYCLE_PATH = "/latest/meta-data/instance-life-cycle"
# AWS schedules maintenance for on-demand and reserved instances too, so every node asks for it.
MAINTENANCE_PATH = "/latest/meta-data/events/maintenance/scheduled"
# A scheduled maintenance event (a reboot, a stop, a retirement) drains its node this long before it
# begins; until then it is shown, as degraded. AWS schedules them days ahead.
MAINTENANCE_LEAD_S = 300
# A Capacity Block's instances "begin to be terminated 30 minutes before the end time" (EC2 User Guide,
# "Monitor Capacity Blocks using EventBridge"; the warning event comes 40 minutes before). The node drains
# 10 minutes before that, so that tasks with a stop_grace_period of up to 10 minutes end as they choose;
# it is shown, as degraded, from an hour before the drain.
CAPACITY_BLOCK_TERMINATION_S = 30 * 60
CAPACITY_BLOCK_DRAIN_S = CAPACITY_BLOCK_TERMINATION_S + 10 * 60
CAPACITY_BLOCK_SHOWN_S = CAPACITY_BLOCK_DRAIN_S + 60 * 60


FAULT_KEYS = {"xid": lambda v: type(v) is int and v >= 0, "ecc": lambda v: v in ("single", "double"),
              "missing": lambda v: v is True, "pending_retirement": lambda v: v is True}


def load_faults(path: str | None) -> dict[str, dict]:
    """The rehearsal's faults file; a missing or empty one means no faults."""
    try:
        with open(path or os.devnull, encoding="utf-8") as f:
            text = f.read()
        data = json.loads(text) if text.strip() else {}
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise BadInput(f"{path}: cannot read the faults file ({e}); fix it")
    if not isinstance(data, dict) or not all(
            isinstance(fault, dict) and fault and all(k in FAULT_KEYS and FAULT_KEYS[k](v) for k, v in fault.items())
            for fault in data.values()):
        raise BadInput(f'{path}: expected {{"<uuid>": FAULT, ...}} where FAULT is {{"xid": N}}, {{"ecc": "single"|'
                       '"double"}, {"missing": true} or {"pending_retirement": true}; fix the file')
    return data


class Simulation:
    """GPUs from an inventory, faults from a file re-read at each check; no NVML."""

    def __init__(self, inventory: str, faults: str | None, log):
        self.present = {gpu["uuid"] for gpu in load_inventory(inventory)[0]}
        self.faults, self.log, self.said = faults, log, set()

    def check(self, uuids: list[str], tracker: Tracker, now: float, ignored) -> None:
        faults = load_faults(self.faults)
        seen = set(faults) - set(uuids)
        for uuid in sorted(seen - self.said):
            self.log(f"the faults file names {uuid}, which this node does not advertise: ignored")
        for uuid in uuids:
            fault = faults.get(uuid, {})
            if uuid not in self.present or fault.get("missing"):
                tracker.check(uuid, "unhealthy", f"not_found_on_{uuid}", now)
            elif fault.get("pending_retirement"):
                tracker.check(uuid, "degraded", f"pages_pending_retirement_on_{uuid}", now)
            else:
                tracker.check(uuid, *OK, now)
            # An event fault recurs at each check while it is in the file, so recovery counts
            # from its removal; it is logged when first seen.
            events = [("xid", fault["xid"])] if "xid" in fault else []
            for kind, xid in events + ([("ecc_" + fault["ecc"], None)] if "ecc" in fault else []):
                quiet = (uuid, kind, xid) in self.said
                seen.add((uuid, kind, xid))
                record_event(tracker, uuid, kind, xid, ignored, now, (lambda _: None) if quiet else self.log)
        self.said = seen

    def wait(self, seconds: float, tracker: Tracker, ignored, clock) -> bool:
        time.sleep(max(seconds, 0))
        return False

    def close(self) -> None:
        """Nothing to free."""


class Nvml:
    """Events and checks through NVML (nvml_reader.py). A MIG device's events arrive on its parent
    GPU, so events are registered per parent and count against each advertised MIG device on it."""

    def __init__(self, uuids: list[str], log):
        try:
            self.nvml = nvml = Nvml_()
        except PynvmlMissing as e:
            raise DetectionFailed(f"{e}; install nvidia-ml-py or use --inventory")
        except (NvmlMissing, NvmlFailed) as e:  # no library, no driver: NVML does not start
            raise DetectionFailed(e if isinstance(e, NvmlFailed) else f"NVML initialisation failed: {e}")
        self.log, self.children = log, {}
        try:
            self.events = nvml.event_set()
        except nvml.Error as e:
            raise DetectionFailed(f"NVML initialisation failed: {e}")
        for uuid in uuids:
            try:
                parent = nvml.parent(nvml.by_uuid(uuid))
                parent_uuid = nvml.uuid(parent)
                self.children.setdefault(parent_uuid, []).append(uuid)
                if len(self.children[parent_uuid]) > 1:
                    continue  # registered already, for another MIG device of this GPU
                log(f"{parent_uuid}: watching events: {', '.join(nvml.register(parent, self.events)) or 'none supported'}")
            except nvml.Error as e:
                log(f"{uuid}: no events registered ({e}); the periodic check still watches it")

    def check(self, uuids: list[str], tracker: Tracker, now: float, ignored) -> None:
        nvml = self.nvml
        for uuid in uuids:
            try:
                handle = nvml.by_uuid(uuid)
                nvml.nv.nvmlDeviceGetMemoryInfo(handle)  # cheap, and fails on a GPU that is lost
            except nvml.Error as e:
                what = "not_found" if isinstance(e, nvml.nv.NVMLError_NotFound) else f"no_answer:{e}"
                tracker.check(uuid, "unhealthy", f"{what}_on_{uuid}", now)
                continue
            pages, rows = nvml.pending_repairs(nvml.parent(handle))
            if pages:
                tracker.check(uuid, "degraded", f"pages_pending_retirement_on_{uuid}", now)
            elif rows:
                tracker.check(uuid, "degraded", f"rows_pending_remap_on_{uuid}", now)
            else:
                tracker.check(uuid, *OK, now)

    def wait(self, seconds: float, tracker: Tracker, ignored, clock) -> bool:
        nvml = self.nvml
        if not self.children:
            time.sleep(max(seconds, 0))
            return False
        try:
            event = nvml.wait(self.events, seconds)  # idles here, in the driver
        except nvml.Error as e:
            self.log(f"waiting for NVML events failed ({e}); the periodic check goes on")
            time.sleep(max(seconds, 0))
            return False
        if event is None:
            return False
        device, kind, xid = event
        try:
            targets = self.children.get(nvml.uuid(device), [])
        except nvml.Error:
            targets = [uuid for children in self.children.values() for uuid in children]  # whose? all
        for uuid in targets if kind else []:
            record_event(tracker, uuid, kind, xid, ignored, clock(), self.log)
        return True

    def close(self) -> None:
        self.nvml.free(self.events)
        self.nvml.close()


class Imds:
    """Scheduled maintenance events and, on a spot node, interruption and rebalance notices, from IMDSv2;
    an IMDS that does not answer is logged and changes nothing."""

    def __init__(self, imds: str, log, spot: bool | None = True, maintenance: bool = True, timeout: float = 2,
                 block_end: float | None = None):
        """spot None: as the instance's lifecycle says (LIFECYCLE_PATH), asked until IMDS answers it; until
        then the spot notices are asked too, so that a spot node never misses its two minutes."""
        self.base, self.log, self.timeout, self.block_end = imds.rstrip("/"), log, timeout, block_end
        self.spot, self.maintenance = spot, maintenance
        self.state, self.token, self.token_until, self.error = OK, None, 0.0, None
        self.opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never through a proxy

    def _ask(self, method: str, path: str, headers: dict) -> tuple[int, str]:
        request = urllib.request.Request(self.base + path, method=method, headers=headers)
        try:
            with self.opener.open(request, timeout=self.timeout) as answer:
                return answer.status, answer.read().decode("utf-8", "replace")
        except urllib.error.HTTPError as e:
            return e.code, ""

    def poll(self, now: float) -> tuple[str, str]:
        # A block's end is known without asking IMDS, so no IMDS outage can hold the drain back.
        block = capacity_block(self.block_end, now)
        if block and block[0] == "reclaim":
            self.state = block
            return block
        state = self._poll_imds(now)
        return block if block and state == OK else state

    def _poll_imds(self, now: float) -> tuple[str, str]:
        try:
            if self.token is None or now >= self.token_until:
                status, body = self._ask("PUT", "/latest/api/token", {"X-aws-ec2-metadata-token-ttl-seconds": "21600"})
                if status != 200:
                    raise OSError(f"the token request answered HTTP {status}")
                self.token, self.token_until = body.strip(), now + 21600 - 600
            if self.spot is None:
                status, body = self._ask("GET", LIFECYCLE_PATH, {"X-aws-ec2-metadata-token": self.token})
                if status == 401:
                    self.token = None
                    raise OSError(f"{LIFECYCLE_PATH} answered HTTP {status}")
                if status in (200, 404):
                    self.spot = status == 200 and body.strip() == "spot"
                    self.log(f"IMDS says this instance is {body.strip() or 'not spot'}: "
                             f"{'its spot notices are watched' if self.spot else 'no spot notice can come to it'}")
                else:  # asked again next time; its notices meanwhile
                    self.log(f"IMDS did not answer {LIFECYCLE_PATH} (HTTP {status}); spot notices are asked until it does")
            notices = []
            for path in (SPOT_PATHS if self.spot is not False else ()) + ((MAINTENANCE_PATH,) if self.maintenance
                                                                           else ()):
                status, body = self._ask("GET", path, {"X-aws-ec2-metadata-token": self.token})
                if status not in (200, 404):
                    self.token = None if status == 401 else self.token  # expired: a new one next time
                    raise OSError(f"{path} answered HTTP {status}")
                if status == 200 and path == MAINTENANCE_PATH:
                    notices += maintenance(body, time.time())
                elif status == 200:
                    try:
                        data = dict(json.loads(body))
                    except (ValueError, TypeError):
                        data = {}  # a notice all the same
                    notices.append(f"spot_{data.get('action', 'interruption')}_at_{data.get('time', 'unknown')}"
                                   if path == SPOT_PATHS[0] else
                                   f"rebalance_recommended_at_{data.get('noticeTime', 'unknown')}")
        except (OSError, http.client.HTTPException) as e:
            if str(e) != self.error:
                self.log(f"IMDS {self.base} did not answer ({e}); its state stays {self.state[0]}")
            self.error = str(e)
            return self.state
        if self.error:
            self.log(f"IMDS {self.base} answers again")
        # An interruption notice (two minutes) drains the node. A rebalance recommendation
        # only says the risk went up, often hours ahead: it is shown, as degraded, and the
        # node keeps its tasks (AWS's Node Termination Handler does not drain on it either,
        # unless told to).
        reclaim = [n for n in notices if n.startswith(("spot_", "maintenance_now_"))]
        self.error = None
        self.state = ("reclaim", reclaim[0]) if reclaim else ("degraded", notices[0]) if notices else OK
        return self.state


def capacity_block(end: float | None, now: float) -> tuple[str, str] | None:
    """A Capacity Block's end as a condition: reclaim from CAPACITY_BLOCK_DRAIN_S before it, degraded from
    CAPACITY_BLOCK_SHOWN_S before it, None earlier or without a block."""
    if end is None or now < end - CAPACITY_BLOCK_SHOWN_S:
        return None
    stamp = datetime.fromtimestamp(end, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return ("reclaim" if now >= end - CAPACITY_BLOCK_DRAIN_S else "degraded", f"capacity_block_ends_at_{stamp}")


def parse_block_end(text: str) -> float | None:
    """HEALTH_CAPACITY_BLOCK_END (RFC 3339, as AWS writes it) as a time; None when unset."""
    if not text.strip():
        return None
    return datetime.fromisoformat(text.strip().replace("Z", "+00:00")).timestamp()


def maintenance(body: str, now: float) -> list[str]:
    """IMDS's scheduled events (a JSON list, [] when none) as notices: maintenance_now_<code>_at_<start> for
    an event that begins within MAINTENANCE_LEAD_S (or has begun), which drains the node as a spot
    reclaim does; maintenance_<code>_at_<start> for a later one, shown only. Completed and canceled
    events say nothing; an event whose start cannot be read is shown, not acted on."""
    try:
        events = json.loads(body) if body.strip() else []
    except ValueError:
        events = None
    if not isinstance(events, list):
        return ["maintenance_unreadable_at_unknown"]
    out = []
    for event in events:
        if not isinstance(event, dict) or event.get("State") in ("completed", "canceled"):
            continue
        code, start = str(event.get("Code", "event")), str(event.get("NotBefore", "unknown"))
        try:  # "21 Jan 2019 09:00:43 GMT", as EC2 writes it
            begins = datetime.strptime(start, "%d %b %Y %H:%M:%S %Z").replace(tzinfo=timezone.utc).timestamp()
        except ValueError:
            begins = None
        soon = begins is not None and begins - now <= MAINTENANCE_LEAD_S
        stamp = datetime.fromtimestamp(begins, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ") if begins else "unknown"
        out.append(f"maintenance_{'now_' if soon else ''}{code}_at_{stamp}")
    return sorted(out, key=lambda n: not n.startswith("maintenance_now_"))
