#!/usr/bin/env python3
"""The one NVML reader of a node: the agent (gpu_detect.py), the health watcher (health_sources.py)
and the metrics exporter (gpu_metrics.py) all ask NVML through it.

It owns what they would otherwise each get wrong on their own: pynvml imported only when NVML
is asked (so simulation modes work without it), strings that older pynvml returned as bytes,
MIG devices and their parent GPU, calls a driver or GPU does not support, and the event bits.
Stdlib plus pynvml (package nvidia-ml-py).
"""
from __future__ import annotations

from dataclasses import dataclass

# nvmlEventType* bits, in case a pynvml lacks the names.
EVENT_BITS = {"xid": ("nvmlEventTypeXidCriticalError", 0x8), "ecc_double": ("nvmlEventTypeDoubleBitEccError", 0x2),
              "ecc_single": ("nvmlEventTypeSingleBitEccError", 0x1)}
# nvmlClocksEventReason* (formerly ClocksThrottleReason*) bits, named as nvidia-smi -q names them.
THROTTLE_REASONS = {"gpu_idle": 0x1, "applications_clocks_setting": 0x2, "sw_power_cap": 0x4, "hw_slowdown": 0x8,
                    "sync_boost": 0x10, "sw_thermal_slowdown": 0x20, "hw_thermal_slowdown": 0x40,
                    "hw_power_brake_slowdown": 0x80, "display_clocks_setting": 0x100}
MIB = 1024 * 1024


class NvmlMissing(Exception):
    """There is no NVML to ask (no pynvml, or no libnvidia-ml): not an error by itself."""


class PynvmlMissing(NvmlMissing):
    """No pynvml module at all (the package nvidia-ml-py is not installed)."""


class NvmlFailed(Exception):
    """NVML is there but does not start."""


def text(value) -> str:
    # nvidia-ml-py returns str; older pynvml releases returned bytes.
    return value.decode() if isinstance(value, bytes) else str(value)


@dataclass(frozen=True)
class Device:
    index: int  # the GPU's NVML index; a MIG device has its parent's
    handle: object
    mig: bool


class Nvml:
    """One NVML session: nvmlInit() here, nvmlShutdown() in close(). `nv` is the pynvml module and
    `Error` its NVMLError, for callers that tell failures apart."""

    def __init__(self):
        try:
            import pynvml  # here, so that every module that imports this one works without it
        except ImportError as e:
            raise PynvmlMissing(f"pynvml is not importable ({e})")
        self.nv, self.Error = pynvml, pynvml.NVMLError
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as e:
            if isinstance(e, getattr(pynvml, "NVMLError_LibraryNotFound", ())):
                raise NvmlMissing("libnvidia-ml.so.1 was not found (no NVIDIA driver installed)")
            raise NvmlFailed(f"NVML initialisation failed: {e}")
        self.bits = {kind: getattr(pynvml, name, bit) for kind, (name, bit) in EVENT_BITS.items()}

    def close(self) -> str | None:
        """Shut NVML down; says why when that failed (harmless: the process usually exits next)."""
        try:
            self.nv.nvmlShutdown()
        except self.nv.NVMLError as e:
            return str(e)
        return None

    def optional(self, call, *args):
        """call(*args), or None where the driver lacks the call or the GPU does not support it."""
        if call is None:
            return None
        try:
            return call(*args)
        except self.nv.NVMLError:
            return None

    # ---------------------------------------------------------------- what the node has
    def devices(self, warnings: list[str]) -> list[Device]:
        """Every GPU, and in place of a GPU in MIG mode its MIG devices, in index order."""
        nv, found = self.nv, []
        handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(nv.nvmlDeviceGetCount())]
        for index, handle in enumerate(handles):
            if not self._mig_enabled(handle):
                found.append(Device(index, handle, False))
                continue
            before = len(found)
            for slot in range(nv.nvmlDeviceGetMaxMigDeviceCount(handle)):
                try:
                    found.append(Device(index, nv.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot), True))
                except nv.NVMLError_NotFound:
                    continue  # an empty slot: no MIG device was created there
            if len(found) == before:
                warnings.append(f"GPU {index} is in MIG mode but has no MIG devices; it advertises nothing "
                                "until MIG instances are created (or MIG mode is turned off)")
        return found

    def _mig_enabled(self, handle) -> bool:
        try:
            current, _pending = self.nv.nvmlDeviceGetMigMode(handle)
        except (self.nv.NVMLError_NotSupported, self.nv.NVMLError_FunctionNotFound):
            return False  # a GPU (or driver) without MIG
        return current == getattr(self.nv, "NVML_DEVICE_MIG_ENABLE", 1)

    def describe(self, device: Device) -> dict:
        """The agent's description of a device: index, uuid, name, memory_mib, mig, compute_mode."""
        nv, handle = self.nv, device.handle
        gpu = {"index": device.index, "uuid": text(nv.nvmlDeviceGetUUID(handle)),
               "name": text(nv.nvmlDeviceGetName(handle)),
               "memory_mib": int(nv.nvmlDeviceGetMemoryInfo(handle).total) // MIB, "mig": device.mig}
        mode = self.optional(getattr(nv, "nvmlDeviceGetComputeMode", None), handle)
        if mode is not None:  # sharing a GPU needs Default (0); MIG devices have none
            gpu["compute_mode"] = int(mode)
        return gpu

    def system(self, first: Device | None) -> dict[str, str]:
        """Driver, CUDA version (NVML encodes 13.0 as 13000) and the first GPU's compute capability."""
        nv, out = self.nv, {}
        driver = self.optional(nv.nvmlSystemGetDriverVersion)
        if driver:
            out["driver"] = text(driver)
        cuda = (self.optional(getattr(nv, "nvmlSystemGetCudaDriverVersion_v2", None))
                or self.optional(nv.nvmlSystemGetCudaDriverVersion))
        if cuda:
            out["cuda"] = f"{int(cuda) // 1000}.{int(cuda) % 1000 // 10}"
        if first is not None:
            capability = self.optional(nv.nvmlDeviceGetCudaComputeCapability,
                                       nv.nvmlDeviceGetHandleByIndex(first.index))
            if capability:
                out["compute"] = f"{capability[0]}.{capability[1]}"
        return out

    def by_uuid(self, uuid: str):
        return self.nv.nvmlDeviceGetHandleByUUID(uuid)

    def uuid(self, handle) -> str:
        return text(self.nv.nvmlDeviceGetUUID(handle))

    def parent(self, handle):
        """A MIG device's GPU (where its events, ECC and clocks live); a GPU is its own."""
        try:
            if self.nv.nvmlDeviceIsMigDeviceHandle(handle):
                return self.nv.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(handle)
        except (AttributeError, self.nv.NVMLError):
            pass  # a pynvml or driver without MIG: every handle is a GPU
        return handle

    # ---------------------------------------------------------------- health (the watcher's check)
    def pending_repairs(self, parent) -> tuple[bool, bool]:
        """(pages pending retirement, rows pending remapping): the GPU needs a reset to repair memory."""
        rows = self.optional(self.nv.nvmlDeviceGetRemappedRows, parent)  # (corr, unc, isPending, failure)
        pending = self.optional(self.nv.nvmlDeviceGetRetiredPagesPendingStatus, parent)
        return pending == getattr(self.nv, "NVML_FEATURE_ENABLED", 1), bool(rows and rows[2])

    # ---------------------------------------------------------------- events (XID, ECC)
    def event_set(self):
        return self.nv.nvmlEventSetCreate()

    def register(self, parent, event_set, kinds=("xid", "ecc_double", "ecc_single")) -> list[str]:
        """Register the event kinds the GPU supports; returns those registered. Asking for a type
        the device lacks fails the whole registration, so it asks first."""
        mask = sum(self.bits[k] for k in kinds)
        wanted = self.nv.nvmlDeviceGetSupportedEventTypes(parent) & mask
        if wanted:
            self.nv.nvmlDeviceRegisterEvents(parent, wanted, event_set)
        return [kind for kind in kinds if wanted & self.bits[kind]]

    def wait(self, event_set, seconds: float):
        """The next event (device, kind, xid) or None on timeout; blocks in the driver meanwhile."""
        nv = self.nv
        wait = getattr(nv, "nvmlEventSetWait_v2", None) or nv.nvmlEventSetWait
        try:
            data = wait(event_set, max(int(seconds * 1000), 0))
        except nv.NVMLError_Timeout:
            return None
        kind = next((kind for kind, bit in self.bits.items() if data.eventType & bit), None)
        return data.device, kind, int(data.eventData) if kind == "xid" else None

    def free(self, event_set) -> None:
        self.optional(self.nv.nvmlEventSetFree, event_set)

    # ---------------------------------------------------------------- metrics (the exporter)
    def sample(self, handle, parent) -> tuple[dict, list[str]]:
        """What the exporter reports of one device, and the NVML errors that kept a value from it.

        A value the device does not support is left out without an error (MIG devices have no
        utilization, consumer GPUs no ECC); any other failure is an error, and the device's
        other values are still read, so that one broken call does not hide the rest."""
        nv, values, errors = self.nv, {}, []

        def read(name, call, *args):
            if call is None:
                return  # a pynvml without the call: the value is not reported, and that is no error
            try:
                values[name] = call(*args)
            except (nv.NVMLError_NotSupported, nv.NVMLError_FunctionNotFound, AttributeError):
                pass
            except nv.NVMLError as e:
                errors.append(f"{name}: {e}")

        read("memory", nv.nvmlDeviceGetMemoryInfo, handle)
        read("utilization", getattr(nv, "nvmlDeviceGetUtilizationRates", None), handle)
        read("power_mw", getattr(nv, "nvmlDeviceGetPowerUsage", None), parent)
        read("temperature_c", getattr(nv, "nvmlDeviceGetTemperature", None), parent,
             getattr(nv, "NVML_TEMPERATURE_GPU", 0))
        read("sm_clock_mhz", getattr(nv, "nvmlDeviceGetClockInfo", None), parent, getattr(nv, "NVML_CLOCK_SM", 1))
        reasons = (getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None)
                   or getattr(nv, "nvmlDeviceGetCurrentClocksThrottleReasons", None))
        read("throttle_reasons", reasons, parent)
        for kind, error_type in (("corrected", "NVML_MEMORY_ERROR_TYPE_CORRECTED"),
                                 ("uncorrected", "NVML_MEMORY_ERROR_TYPE_UNCORRECTED")):
            read(f"ecc_{kind}", getattr(nv, "nvmlDeviceGetTotalEccErrors", None), parent,
                 getattr(nv, error_type, kind == "uncorrected"), getattr(nv, "NVML_VOLATILE_ECC", 0))
        read("processes", getattr(nv, "nvmlDeviceGetComputeRunningProcesses", None), handle)
        # Under MPS the compute processes are the MPS server (the GPU's one context); its clients,
        # each a task's process with its own memory, are listed here (nvidia-smi's M+C rows).
        read("mps_processes", getattr(nv, "nvmlDeviceGetMPSComputeRunningProcesses", None), handle)
        for key in ("processes", "mps_processes"):
            if key in values:
                # usedGpuMemory is None where the driver cannot say (Windows WDDM, some vGPUs)
                values[key] = [(int(p.pid), int(p.usedGpuMemory or 0)) for p in values[key]]
        samples = self.process_samples(handle, errors)
        if samples is not None:
            values["process_utilization"] = samples
        return values, errors

    def process_samples(self, handle, errors: list[str]) -> dict[int, int] | None:
        """{pid: SM utilization %} of each process's latest sample in NVML's buffer (the last few
        seconds); {} when no process ran a kernel (NVML says NotFound); None when not supported."""
        nv = self.nv
        call = getattr(nv, "nvmlDeviceGetProcessUtilization", None)
        if call is None:
            return None
        try:
            samples = call(handle, 0)
        except getattr(nv, "NVMLError_NotFound", ()):
            return {}
        except (nv.NVMLError_NotSupported, nv.NVMLError_FunctionNotFound, AttributeError):
            return None
        except nv.NVMLError as e:
            if getattr(e, "value", None) == 0:
                return {}  # pynvml raises NVML_SUCCESS itself when the first call finds no sample
            errors.append(f"process_utilization: {e}")
            return None
        latest: dict[int, tuple[int, int]] = {}
        for s in samples:
            if int(s.pid) not in latest or int(s.timeStamp) >= latest[int(s.pid)][0]:
                latest[int(s.pid)] = (int(s.timeStamp), int(s.smUtil))
        return {pid: sm for pid, (_, sm) in latest.items()}
