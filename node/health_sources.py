#!/usr/bin/env python3
"""What the GPU health watcher (gpu_health.py) listens to: simulated GPUs, NVML, and IMDS.

A GPU source has check() (the periodic check), wait(seconds) -> True when it recorded an
event (seconds=0: one already queued), and close(). Spot polls IMDSv2 for AWS's notices.
Stdlib plus pynvml (package nvidia-ml-py), imported only when NVML is used.
"""
from __future__ import annotations

import http.client
import json
import os
import time
import urllib.error
import urllib.request

from gpu_detect import BadInput, DetectionFailed, _text, load_inventory
from health_rules import OK, Tracker, record_event

# nvmlEventType* bits, in case a pynvml lacks the names.
EVENT_BITS = {"xid": ("nvmlEventTypeXidCriticalError", 0x8), "ecc_double": ("nvmlEventTypeDoubleBitEccError", 0x2),
              "ecc_single": ("nvmlEventTypeSingleBitEccError", 0x1)}
DEFAULT_IMDS = "http://169.254.169.254"
SPOT_PATHS = ("/latest/meta-data/spot/instance-action", "/latest/meta-data/events/recommendations/rebalance")


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
    """Events and checks through NVML. A MIG device's events arrive on its parent GPU, so
    events are registered per parent and count against each advertised MIG device on it."""

    def __init__(self, uuids: list[str], log):
        try:
            import pynvml  # here, so that the module (and simulation mode) works without it
        except ImportError as e:
            raise DetectionFailed(f"pynvml is not importable ({e}); install nvidia-ml-py or use --inventory")
        self.nv, self.log, self.children = pynvml, log, {}
        try:
            pynvml.nvmlInit()
            self.events = pynvml.nvmlEventSetCreate()
        except pynvml.NVMLError as e:
            raise DetectionFailed(f"NVML initialisation failed: {e}")
        self.bits = {kind: getattr(pynvml, name, bit) for kind, (name, bit) in EVENT_BITS.items()}
        for uuid in uuids:
            try:
                parent = self._parent(pynvml.nvmlDeviceGetHandleByUUID(uuid))
                parent_uuid = _text(pynvml.nvmlDeviceGetUUID(parent))
                self.children.setdefault(parent_uuid, []).append(uuid)
                if len(self.children[parent_uuid]) > 1:
                    continue  # registered already, for another MIG device of this GPU
                # Asking for a type the device lacks fails the whole registration: ask first.
                wanted = pynvml.nvmlDeviceGetSupportedEventTypes(parent) & sum(self.bits.values())
                if wanted:
                    pynvml.nvmlDeviceRegisterEvents(parent, wanted, self.events)
                names = ", ".join(kind for kind, bit in self.bits.items() if wanted & bit)
                log(f"{parent_uuid}: watching events: {names or 'none supported'}")
            except pynvml.NVMLError as e:
                log(f"{uuid}: no events registered ({e}); the periodic check still watches it")

    def _parent(self, handle):
        try:
            if self.nv.nvmlDeviceIsMigDeviceHandle(handle):
                return self.nv.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(handle)
        except (AttributeError, self.nv.NVMLError):
            pass  # a pynvml or driver without MIG: every handle is a GPU
        return handle

    def _optional(self, call, handle):
        try:
            return call(handle)
        except self.nv.NVMLError:
            return None  # NotSupported: not every GPU has it (a broken one fails the memory query)

    def check(self, uuids: list[str], tracker: Tracker, now: float, ignored) -> None:
        nv = self.nv
        for uuid in uuids:
            try:
                handle = nv.nvmlDeviceGetHandleByUUID(uuid)
                nv.nvmlDeviceGetMemoryInfo(handle)  # cheap, and fails on a GPU that is lost
            except nv.NVMLError as e:
                what = "not_found" if isinstance(e, nv.NVMLError_NotFound) else f"no_answer:{e}"
                tracker.check(uuid, "unhealthy", f"{what}_on_{uuid}", now)
                continue
            parent = self._parent(handle)
            rows = self._optional(nv.nvmlDeviceGetRemappedRows, parent)  # (corr, unc, isPending, failure)
            pending = self._optional(nv.nvmlDeviceGetRetiredPagesPendingStatus, parent)
            if pending == getattr(nv, "NVML_FEATURE_ENABLED", 1):
                tracker.check(uuid, "degraded", f"pages_pending_retirement_on_{uuid}", now)
            elif rows and rows[2]:
                tracker.check(uuid, "degraded", f"rows_pending_remap_on_{uuid}", now)
            else:
                tracker.check(uuid, *OK, now)

    def wait(self, seconds: float, tracker: Tracker, ignored, clock) -> bool:
        nv, wait = self.nv, getattr(self.nv, "nvmlEventSetWait_v2", None) or self.nv.nvmlEventSetWait
        if not self.children:
            time.sleep(max(seconds, 0))
            return False
        try:
            data = wait(self.events, max(int(seconds * 1000), 0))  # idles here, in the driver
        except nv.NVMLError_Timeout:
            return False
        except nv.NVMLError as e:
            self.log(f"waiting for NVML events failed ({e}); the periodic check goes on")
            time.sleep(max(seconds, 0))
            return False
        try:
            targets = self.children.get(_text(nv.nvmlDeviceGetUUID(data.device)), [])
        except nv.NVMLError:
            targets = [uuid for children in self.children.values() for uuid in children]  # whose? all
        kind = next((kind for kind, bit in self.bits.items() if data.eventType & bit), None)
        for uuid in targets if kind else []:
            xid = int(data.eventData) if kind == "xid" else None
            record_event(tracker, uuid, kind, xid, ignored, clock(), self.log)
        return True

    def close(self) -> None:
        try:
            self.nv.nvmlEventSetFree(self.events)
            self.nv.nvmlShutdown()
        except self.nv.NVMLError:
            pass


class Spot:
    """Spot interruption and rebalance notices from IMDSv2; an IMDS that does not answer
    is logged and changes nothing."""

    def __init__(self, imds: str, log, timeout: float = 2):
        self.base, self.log, self.timeout = imds.rstrip("/"), log, timeout
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
        try:
            if self.token is None or now >= self.token_until:
                status, body = self._ask("PUT", "/latest/api/token", {"X-aws-ec2-metadata-token-ttl-seconds": "21600"})
                if status != 200:
                    raise OSError(f"the token request answered HTTP {status}")
                self.token, self.token_until = body.strip(), now + 21600 - 600
            notices = []
            for path in SPOT_PATHS:
                status, body = self._ask("GET", path, {"X-aws-ec2-metadata-token": self.token})
                if status not in (200, 404):
                    self.token = None if status == 401 else self.token  # expired: a new one next time
                    raise OSError(f"{path} answered HTTP {status}")
                if status == 200:
                    try:
                        data = dict(json.loads(body))
                    except (ValueError, TypeError):
                        data = {}  # a notice all the same
                    notices.append(f"spot_{data.get('action', 'interruption')}_at_{data.get('time', 'unknown')}"
                                   if path == SPOT_PATHS[0] else
                                   f"rebalance_recommended_at_{data.get('noticeTime', 'unknown')}")
        except (OSError, http.client.HTTPException) as e:
            if str(e) != self.error:
                self.log(f"IMDS {self.base} did not answer ({e}); the spot state stays {self.state[0]}")
            self.error = str(e)
            return self.state
        if self.error:
            self.log(f"IMDS {self.base} answers again")
        # An interruption notice (two minutes) drains the node. A rebalance recommendation
        # only says the risk went up, often hours ahead: it is shown, as degraded, and the
        # node keeps its tasks (AWS's Node Termination Handler does not drain on it either,
        # unless told to).
        reclaim = [n for n in notices if n.startswith("spot_")]
        self.error = None
        self.state = ("reclaim", reclaim[0]) if reclaim else ("degraded", notices[0]) if notices else OK
        return self.state
