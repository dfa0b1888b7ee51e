"""The fake pynvml of pynvml.py, plus what the health watcher asks: events and health queries.

It reads the same FAKE_PYNVML description, with more keys:
  {"gpus": [{"uuid": ..., "events_supported": 11, "lost": false,
             "pending_retirement": true | false | "unsupported",
             "remapped_pending": true | false | "unsupported"}],
   "events": [{"uuid": "GPU-...", "type": "xid" | "ecc_double" | "ecc_single", "xid": 79}]}
"events_supported" is the mask nvmlDeviceGetSupportedEventTypes answers (default XID and
both ECC kinds); registering a type outside it fails with NotSupported, as real NVML does.
Queued "events" are delivered, in order, to an event set that registered their GPU and
type; the rest are dropped. `registrations` records (uuid, mask) of each registration.
Tests install this module as sys.modules["pynvml"].
"""
import importlib.util
import os
import time

_BASE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pynvml.py")
_spec = importlib.util.spec_from_file_location("_fake_pynvml_base", _BASE)
_base = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_base)
globals().update({name: value for name, value in vars(_base).items() if not name.startswith("__")})

NVML_FEATURE_DISABLED = 0
NVML_FEATURE_ENABLED = 1
nvmlEventTypeSingleBitEccError = 0x1
nvmlEventTypeDoubleBitEccError = 0x2
nvmlEventTypePState = 0x4
nvmlEventTypeXidCriticalError = 0x8
_TYPES = {"xid": nvmlEventTypeXidCriticalError, "ecc_double": nvmlEventTypeDoubleBitEccError,
          "ecc_single": nvmlEventTypeSingleBitEccError}


class NVMLError_Timeout(_base.NVMLError):
    pass


class NVMLError_GpuIsLost(_base.NVMLError):
    pass


registrations = []
_queue = []
_sets = []


class _EventData:
    def __init__(self, device, event_type, data):
        self.device, self.eventType, self.eventData = device, event_type, data
        self.gpuInstanceId = self.computeInstanceId = 0xFFFFFFFF


def nvmlInit():
    _base.nvmlInit()
    registrations.clear()
    _sets.clear()
    _queue[:] = list(_base._node.get("events", []))


def _gpu(handle):
    device = _base._device(handle)
    if device.get("lost"):
        raise NVMLError_GpuIsLost("fake NVML: GPU is lost")
    return device


def nvmlDeviceGetHandleByUUID(uuid):
    for index, gpu in enumerate(_base._node["gpus"]):
        if gpu["uuid"] == uuid:
            return (index, None)
        for slot, mig in enumerate(gpu.get("mig_slots") or []):
            if mig and mig["uuid"] == uuid:
                return (index, slot)
    raise NVMLError_NotFound("fake NVML: Not Found")


def nvmlDeviceIsMigDeviceHandle(handle):
    return handle[1] is not None


def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(handle):
    return (handle[0], None)


def nvmlDeviceGetMemoryInfo(handle):
    return _base._Memory(_gpu(handle)["memory_mib"])


def _health(handle, key, answer):
    value = _gpu(handle).get(key, False)
    if value == "unsupported":
        raise NVMLError_NotSupported("fake NVML: Not Supported")
    return answer(value)


def nvmlDeviceGetRetiredPagesPendingStatus(handle):
    return _health(handle, "pending_retirement", lambda v: NVML_FEATURE_ENABLED if v else NVML_FEATURE_DISABLED)


def nvmlDeviceGetRemappedRows(handle):
    return _health(handle, "remapped_pending", lambda v: (0, 0, bool(v), False))


def nvmlDeviceGetSupportedEventTypes(handle):
    return _gpu(handle).get("events_supported", 0xB)


def nvmlEventSetCreate():
    _sets.append({})
    return len(_sets) - 1


def nvmlDeviceRegisterEvents(handle, event_types, event_set):
    gpu = _gpu(handle)
    if event_types & ~gpu.get("events_supported", 0xB):
        raise NVMLError_NotSupported("fake NVML: Not Supported")
    registrations.append((gpu["uuid"], event_types))
    _sets[event_set][gpu["uuid"]] = _sets[event_set].get(gpu["uuid"], 0) | event_types


def nvmlEventSetWait_v2(event_set, timeout_ms):
    while _queue:
        event = _queue.pop(0)
        event_type = _TYPES[event["type"]]
        if _sets[event_set].get(event["uuid"], 0) & event_type:
            return _EventData(nvmlDeviceGetHandleByUUID(event["uuid"]), event_type, event.get("xid", 0))
    time.sleep(timeout_ms / 1000)  # as real NVML does: it blocks until an event or the timeout
    raise NVMLError_Timeout("fake NVML: Timeout")


def nvmlEventSetFree(event_set):
    _sets[event_set] = {}
