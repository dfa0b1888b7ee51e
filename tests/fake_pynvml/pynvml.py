"""A stand-in for nvidia-ml-py's pynvml, so the agent's NVML path runs without a GPU.

The node it pretends to be comes from the FAKE_PYNVML environment variable (JSON),
read at nvmlInit(), so in-process tests and subprocesses share one description:
  {"init_error": "LibraryNotFound" | "DriverNotLoaded" | null,
   "driver": "580.159.04", "cuda": 13000, "bytes": false,
   "gpus": [{"uuid": "GPU-...", "name": "NVIDIA H200", "memory_mib": 143771,
             "compute": [9, 0], "mig_slots": [null, {"uuid": "MIG-...", ...}]}]}
A GPU with "mig_slots" is in MIG mode; null slots are empty. "bytes" makes string
calls return bytes, as pynvml releases before 11.5 did. Only the calls the agent
makes exist here; an unexpected call fails loudly with AttributeError.
"""
import json
import os

NVML_DEVICE_MIG_DISABLE = 0
NVML_DEVICE_MIG_ENABLE = 1


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


_node = None


class _Memory:
    def __init__(self, mib):
        self.total = mib * 1024 * 1024


def _device(handle):
    if _node is None:
        raise NVMLError_Unknown("Uninitialized")
    gpu_index, slot = handle
    gpu = _node["gpus"][gpu_index]
    return gpu if slot is None else gpu["mig_slots"][slot]


def _str(value):
    return value.encode() if _node.get("bytes") else value


def nvmlInit():
    global _node
    node = json.loads(os.environ.get("FAKE_PYNVML", '{"gpus": []}'))
    error = node.get("init_error")
    if error:
        raise globals()[f"NVMLError_{error}"](f"fake NVML: {error}")
    _node = node


def nvmlShutdown():
    global _node
    _node = None


def nvmlDeviceGetCount():
    if _node.get("query_error"):
        raise NVMLError_Unknown("fake NVML: Unknown Error")
    return len(_node["gpus"])


def nvmlDeviceGetHandleByIndex(index):
    return (index, None)


def nvmlDeviceGetUUID(handle):
    return _str(_device(handle)["uuid"])


def nvmlDeviceGetName(handle):
    return _str(_device(handle)["name"])


def nvmlDeviceGetComputeMode(handle):
    gpu = _device(handle)
    if "compute_mode" not in gpu:
        raise NVMLError_NotSupported("Not Supported")
    return gpu["compute_mode"]


def nvmlDeviceGetMemoryInfo(handle):
    return _Memory(_device(handle)["memory_mib"])


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


def nvmlSystemGetDriverVersion():
    return _str(_node.get("driver", "580.159.04"))


def nvmlSystemGetCudaDriverVersion():
    return _node.get("cuda", 13000)


def nvmlSystemGetCudaDriverVersion_v2():
    return _node.get("cuda", 13000)
