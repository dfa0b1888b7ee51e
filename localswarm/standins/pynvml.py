"""Stand-in for nvidia-ml-py's pynvml: NVML without a GPU, for the rehearsal's machines and the unit tests.

The node it pretends to be is a description (JSON): the FAKE_PYNVML environment variable when
set (the unit tests; re-read when a test changes it), else the machine's hardware file (GPU_SWARM_REHEARSAL_HARDWARE, default
/usr/lib/gpu-swarm-rehearsal/hardware.json), re-read whenever it changes, so that a fault
written into it reaches a running watcher:
  {"driver": "580.159.04", "cuda": 13000, "init_error": "LibraryNotFound" | "DriverNotLoaded" | null,
   "bytes": false, "query_error": false,
   "gpus": [{"uuid": "GPU-...", "name": "NVIDIA H200", "memory_mib": 143771, "compute": [9, 0],
             "compute_mode": 0, "mig_slots": [null, {"uuid": "MIG-...", "name": ..., "memory_mib": ...}],
             "events_supported": 11, "lost": false,
             "pending_retirement": true | false | "unsupported", "remapped_pending": true | false | "unsupported",
             "fault": {"xid": 79} | {"ecc": "single" | "double"} | {"missing": true} | {"pending_retirement": true},
             "utilization": {"gpu": 37, "memory": 12}, "power_w": 71.5, "temperature_c": 41, "sm_clock_mhz": 1980,
             "throttle_reasons": 4, "ecc": {"corrected": 0, "uncorrected": 0} | "unsupported",
             "memory_used_mib": 0, "processes": [{"pid": 4242, "used_mib": 1024}],
             "mps_processes": [{"pid": 4243, "used_mib": 512}], "process_utilization": [{"pid": 4242, "sm": 37}],
             "failing": ["nvmlDeviceGetPowerUsage", ...]}],
   "events": [{"uuid": "GPU-...", "type": "xid" | "ecc_double" | "ecc_single", "xid": 79}]}
A GPU with "mig_slots" is in MIG mode; null slots are empty. "bytes" makes string calls return
bytes, as pynvml releases before 11.5 did. "events_supported" is the mask
nvmlDeviceGetSupportedEventTypes answers (default XID and both ECC kinds); registering a type
outside it fails with NotSupported, as real NVML does.
Two ways to raise an event:
- "events": a queue, delivered in order after each nvmlInit() to an event set that registered
  the GPU and type (the rest are dropped): one-shot, for tests;
- a GPU's "fault" (the rehearsal's faults-file format, node/health_sources.py FAULT_KEYS): a GPU
  that keeps failing. While it is there, an "xid" or "ecc" fault is delivered to each event set
  that registered it about once a second; "missing" takes the GPU out of NVML (fallen off the
  bus); "pending_retirement" is what nvmlDeviceGetRetiredPagesPendingStatus answers.
The exporter's readings (utilization, power, temperature, SM clock, throttle reasons, volatile
ECC counts, running compute processes, MPS clients, per-process utilization samples) come from
the GPU's keys of those names, with quiet defaults (an idle GPU; no samples is NotFound, as in
NVML); its memory used is "memory_used_mib" plus its processes' memory (an MPS client's is part of
its server's, as the driver counts it). A
call named in "failing" raises NVMLError_Unknown for that GPU, as a GPU that half answers does.
`registrations` records (uuid, mask) of each registration. Only the calls the agent, the health
watcher and the metrics exporter make exist here; any other fails loudly with AttributeError. Stdlib only.
"""
import json
import os
import time

HARDWARE_FILE = os.environ.get("GPU_SWARM_REHEARSAL_HARDWARE", "/usr/lib/gpu-swarm-rehearsal/hardware.json")
FAULT_REPEAT_S = 1.0  # a failing GPU keeps raising its event; a watcher sees it again this often
POLL_S = 0.2  # how often a waiting event set looks at the hardware file for a new fault

NVML_DEVICE_MIG_DISABLE = 0
NVML_DEVICE_MIG_ENABLE = 1
NVML_FEATURE_DISABLED = 0
NVML_FEATURE_ENABLED = 1
nvmlEventTypeSingleBitEccError = 0x1
nvmlEventTypeDoubleBitEccError = 0x2
nvmlEventTypePState = 0x4
nvmlEventTypeXidCriticalError = 0x8
NVML_TEMPERATURE_GPU = 0
NVML_CLOCK_SM = 1
NVML_MEMORY_ERROR_TYPE_CORRECTED = 0
NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
NVML_VOLATILE_ECC = 0
NVML_AGGREGATE_ECC = 1
_TYPES = {"xid": nvmlEventTypeXidCriticalError, "ecc_double": nvmlEventTypeDoubleBitEccError,
          "ecc_single": nvmlEventTypeSingleBitEccError}


class NVMLError(Exception):
    pass


class NVMLError_LibraryNotFound(NVMLError):
    pass


class NVMLError_DriverNotLoaded(NVMLError):
    pass


class NVMLError_NotFound(NVMLError):
    pass


class NVMLError_NotSupported(NVMLError):
    pass


class NVMLError_FunctionNotFound(NVMLError):
    pass


class NVMLError_Unknown(NVMLError):
    pass


class NVMLError_Timeout(NVMLError):
    pass


class NVMLError_GpuIsLost(NVMLError):
    pass


_node = None
_stamp = None  # the hardware file's (mtime, size), or FAKE_PYNVML's text, when _node was read from it
registrations = []
_queue = []
_sets = []


def _read() -> dict:
    global _stamp
    if "FAKE_PYNVML" in os.environ:
        _stamp = os.environ["FAKE_PYNVML"]
        return json.loads(_stamp)
    try:
        st = os.stat(HARDWARE_FILE)
        with open(HARDWARE_FILE, encoding="utf-8") as f:
            node = json.load(f)
    except OSError:
        # No hardware file: as on a machine without the NVIDIA driver.
        return {"init_error": "LibraryNotFound", "gpus": []}
    _stamp = (st.st_mtime_ns, st.st_size)
    return node


def _refresh() -> None:
    """Pick up a rewritten hardware file (a fault written or healed) without a new nvmlInit()."""
    global _node
    if _node is None:
        return
    if "FAKE_PYNVML" in os.environ:  # a test that changed the description: as a rewritten file
        if os.environ["FAKE_PYNVML"] != _stamp:
            _node = _read()
        return
    try:
        st = os.stat(HARDWARE_FILE)
    except OSError:
        return
    if (st.st_mtime_ns, st.st_size) != _stamp:
        try:
            _node = _read()
        except ValueError:
            pass  # caught in the middle of a rewrite that is not atomic: keep the last good one


class _Memory:
    def __init__(self, mib, used_mib=0):
        self.total = mib * 1024 * 1024
        self.used = min(int(used_mib * 1024 * 1024), self.total)
        self.free = self.total - self.used


class _Utilization:
    def __init__(self, gpu, memory):
        self.gpu, self.memory = gpu, memory


class _Process:
    def __init__(self, pid, used_bytes):
        self.pid, self.usedGpuMemory = pid, used_bytes
        self.gpuInstanceId = self.computeInstanceId = 0xFFFFFFFF


class _EventData:
    def __init__(self, device, event_type, data):
        self.device, self.eventType, self.eventData = device, event_type, data
        self.gpuInstanceId = self.computeInstanceId = 0xFFFFFFFF


def _initialized() -> dict:
    if _node is None:
        raise NVMLError_Unknown("Uninitialized")
    return _node


def _present() -> list:
    """Indexes (in the file) of the GPUs NVML can see: a GPU whose fault is "missing" is gone."""
    gpus = _initialized()["gpus"]
    return [i for i, gpu in enumerate(gpus) if not (gpu.get("fault") or {}).get("missing")]


def _device(handle):
    gpu_index, slot = handle
    gpu = _initialized()["gpus"][gpu_index]
    return gpu if slot is None else gpu["mig_slots"][slot]


def _gpu(handle):
    device = _device(handle)
    if device.get("lost"):
        raise NVMLError_GpuIsLost("fake NVML: GPU is lost")
    if handle[0] not in _present():
        raise NVMLError_NotFound("fake NVML: Not Found")
    return device


def _str(value):
    return value.encode() if _node.get("bytes") else value


def nvmlInit():
    global _node
    node = _read()
    error = node.get("init_error")
    if error:
        raise globals()[f"NVMLError_{error}"](f"fake NVML: {error}")
    _node = node
    registrations.clear()
    _sets.clear()
    _queue[:] = list(node.get("events", []))


def nvmlShutdown():
    global _node
    _node = None


def nvmlDeviceGetCount():
    _refresh()
    if _initialized().get("query_error"):
        raise NVMLError_Unknown("fake NVML: Unknown Error")
    return len(_present())


def nvmlDeviceGetHandleByIndex(index):
    _refresh()
    present = _present()
    if not 0 <= index < len(present):
        raise NVMLError_NotFound("fake NVML: Not Found")  # real NVML: NVML_ERROR_INVALID_ARGUMENT
    return (present[index], None)


def nvmlDeviceGetHandleByUUID(uuid):
    _refresh()
    for index in _present():
        gpu = _node["gpus"][index]
        if gpu["uuid"] == uuid:
            return (index, None)
        for slot, mig in enumerate(gpu.get("mig_slots") or []):
            if mig and mig["uuid"] == uuid:
                return (index, slot)
    raise NVMLError_NotFound("fake NVML: Not Found")


def nvmlDeviceGetUUID(handle):
    return _str(_device(handle)["uuid"])


def nvmlDeviceGetName(handle):
    return _str(_device(handle)["name"])


def nvmlDeviceGetComputeMode(handle):
    gpu = _device(handle)
    if "compute_mode" not in gpu:
        raise NVMLError_NotSupported("Not Supported")
    return gpu["compute_mode"]


def _reading(handle, call):
    """The GPU or MIG device, for a reading that "failing" may name."""
    _refresh()
    device = _gpu(handle)
    if call in (device.get("failing") or ()):
        raise NVMLError_Unknown(f"fake NVML: {call}: Unknown Error")
    return device


def nvmlDeviceGetMemoryInfo(handle):
    device = _reading(handle, "nvmlDeviceGetMemoryInfo")
    used = device.get("memory_used_mib", 0) + sum(p.get("used_mib", 0) for p in device.get("processes") or ())
    return _Memory(device["memory_mib"], used)


def nvmlDeviceGetUtilizationRates(handle):
    if handle[1] is not None:
        raise NVMLError_NotSupported("fake NVML: Not Supported")  # as on MIG devices
    rates = _reading(handle, "nvmlDeviceGetUtilizationRates").get("utilization") or {}
    return _Utilization(int(rates.get("gpu", 0)), int(rates.get("memory", 0)))


def nvmlDeviceGetPowerUsage(handle):
    return int(_reading(handle, "nvmlDeviceGetPowerUsage").get("power_w", 60.0) * 1000)  # milliwatts


def nvmlDeviceGetTemperature(handle, sensor):
    return int(_reading(handle, "nvmlDeviceGetTemperature").get("temperature_c", 35))


def nvmlDeviceGetClockInfo(handle, clock):
    return int(_reading(handle, "nvmlDeviceGetClockInfo").get("sm_clock_mhz", 1980))


def nvmlDeviceGetCurrentClocksEventReasons(handle):
    return int(_reading(handle, "nvmlDeviceGetCurrentClocksEventReasons").get("throttle_reasons", 0))


def nvmlDeviceGetCurrentClocksThrottleReasons(handle):
    return nvmlDeviceGetCurrentClocksEventReasons(handle)


def nvmlDeviceGetTotalEccErrors(handle, error_type, counter_type):
    ecc = _reading(handle, "nvmlDeviceGetTotalEccErrors").get("ecc", {})
    if ecc == "unsupported":
        raise NVMLError_NotSupported("fake NVML: Not Supported")
    return int(ecc.get("uncorrected" if error_type == NVML_MEMORY_ERROR_TYPE_UNCORRECTED else "corrected", 0))


def nvmlDeviceGetComputeRunningProcesses(handle):
    device = _reading(handle, "nvmlDeviceGetComputeRunningProcesses")
    return [_Process(int(p["pid"]), int(p.get("used_mib", 0) * 1024 * 1024)) for p in device.get("processes") or ()]


def nvmlDeviceGetMPSComputeRunningProcesses(handle):
    device = _reading(handle, "nvmlDeviceGetMPSComputeRunningProcesses")
    return [_Process(int(p["pid"]), int(p.get("used_mib", 0) * 1024 * 1024))
            for p in device.get("mps_processes") or ()]


class _ProcessSample:
    def __init__(self, pid, sm, mem, stamp):
        self.pid, self.smUtil, self.memUtil, self.timeStamp = pid, sm, mem, stamp
        self.encUtil = self.decUtil = 0


def nvmlDeviceGetProcessUtilization(handle, last_seen):
    device = _reading(handle, "nvmlDeviceGetProcessUtilization")
    samples = [_ProcessSample(int(p["pid"]), int(p.get("sm", 0)), int(p.get("mem", 0)),
                              int(p.get("stamp", time.time() * 1e6))) for p in device.get("process_utilization") or ()]
    if not samples:
        raise NVMLError_NotFound("fake NVML: Not Found")
    return samples


def nvmlDeviceGetCudaComputeCapability(handle):
    return tuple(_device(handle).get("compute", [9, 0]))


def nvmlDeviceGetMigMode(handle):
    mode = NVML_DEVICE_MIG_ENABLE if "mig_slots" in _device(handle) else NVML_DEVICE_MIG_DISABLE
    return [mode, mode]


def nvmlDeviceGetMaxMigDeviceCount(handle):
    return len(_device(handle)["mig_slots"])


def nvmlDeviceGetMigDeviceHandleByIndex(handle, index):
    if _device(handle)["mig_slots"][index] is None:
        raise NVMLError_NotFound("fake NVML: Not Found")
    return (handle[0], index)


def nvmlDeviceIsMigDeviceHandle(handle):
    return handle[1] is not None


def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(handle):
    return (handle[0], None)


def nvmlSystemGetDriverVersion():
    return _str(_initialized().get("driver", "580.159.04"))


def nvmlSystemGetCudaDriverVersion():
    return _initialized().get("cuda", 13000)


def nvmlSystemGetCudaDriverVersion_v2():
    return _initialized().get("cuda", 13000)


def _health(handle, key, answer):
    _refresh()
    gpu = _gpu(handle)
    value = gpu.get(key, False) or (gpu.get("fault") or {}).get(key, False)
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
    _sets.append({"masks": {}, "last": {}})
    return len(_sets) - 1


def nvmlDeviceRegisterEvents(handle, event_types, event_set):
    gpu = _gpu(handle)
    if event_types & ~gpu.get("events_supported", 0xB):
        raise NVMLError_NotSupported("fake NVML: Not Supported")
    registrations.append((gpu["uuid"], event_types))
    masks = _sets[event_set]["masks"]
    masks[gpu["uuid"]] = masks.get(gpu["uuid"], 0) | event_types


def _fault_event(event_set):
    """The event of a failing GPU that this set registered and has not seen for FAULT_REPEAT_S."""
    _refresh()
    now = time.monotonic()
    for index, gpu in enumerate(_node["gpus"]):
        fault = gpu.get("fault") or {}
        kind = "xid" if "xid" in fault else f"ecc_{fault['ecc']}" if fault.get("ecc") else None
        if not kind or not _sets[event_set]["masks"].get(gpu["uuid"], 0) & _TYPES[kind]:
            continue
        key = (gpu["uuid"], kind, fault.get("xid"))
        if now - _sets[event_set]["last"].get(key, -FAULT_REPEAT_S) >= FAULT_REPEAT_S:
            _sets[event_set]["last"][key] = now
            return _EventData((index, None), _TYPES[kind], fault.get("xid", 0))
    return None


def nvmlEventSetWait_v2(event_set, timeout_ms):
    _initialized()
    while _queue:
        event = _queue.pop(0)
        event_type = _TYPES[event["type"]]
        if _sets[event_set]["masks"].get(event["uuid"], 0) & event_type:
            return _EventData(nvmlDeviceGetHandleByUUID(event["uuid"]), event_type, event.get("xid", 0))
    # As real NVML does, it blocks until an event or the timeout.
    deadline = time.monotonic() + timeout_ms / 1000
    while True:
        event = _fault_event(event_set)
        if event:
            return event
        left = deadline - time.monotonic()
        if left <= 0:
            raise NVMLError_Timeout("fake NVML: Timeout")
        time.sleep(min(POLL_S, left) if "FAKE_PYNVML" not in os.environ else left)


def nvmlEventSetWait(event_set, timeout_ms):
    return nvmlEventSetWait_v2(event_set, timeout_ms)


def nvmlEventSetFree(event_set):
    _sets[event_set] = {"masks": {}, "last": {}}
