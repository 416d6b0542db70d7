"""How much GPU memory this process holds, according to the driver.

memviz sees the allocations made through the CUDA driver's allocation calls.
A process holds more than that: the CUDA context itself, kernel images,
library workspaces, memory mapped by other means. :func:`process_device_memory`
asks the best source available, without ever creating CUDA state:

1. NVML, through NVIDIA's own bindings (``nvidia-ml-py``, imported as
   ``pynvml``, a dependency of memviz): the ``usedGpuMemory`` of this process
   in ``nvmlDeviceGetComputeRunningProcesses``. Counts only this process.
   NVIDIA's bindings keep the structure layouts in step with the driver;
   without them (a source tree run without installing) this source is
   skipped.
2. The CUDA driver's ``cuMemGetInfo``, only when ``libcuda.so.1`` is already
   loaded, CUDA is initialised, and a context of the device already exists
   (current on this thread, or the device's primary context is active).
   It reports total minus free memory of the *whole device*, so it counts
   other processes too.

Nothing here calls ``cuInit`` or creates a context: ``libcuda`` is opened with
``RTLD_NOLOAD`` (only if the process already mapped it), and a primary context
is retained only when ``cuDevicePrimaryCtxGetState`` says it is active.
"""

from __future__ import annotations

import ctypes
import os
from ctypes import byref, c_char_p, c_int, c_size_t, c_uint, c_void_p
from typing import Dict, Optional, Set, Tuple

__all__ = ["process_device_memory"]

CUDA_SUCCESS = 0

SOURCE_NVML = "NVML, this process only"
SOURCE_CUMEMGETINFO = "cuMemGetInfo, whole device: counts other processes too"


def _pids() -> Set[int]:
    """This process's pid, in every PID namespace /proc shows (NSpid)."""
    pids = {os.getpid()}
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("NSpid:"):
                    pids.update(int(p) for p in line.split()[1:] if p.isdigit())
                    break
    except OSError:
        pass
    return pids


class _Cuda:
    """The CUDA driver, only if this process already loaded and initialised it."""

    def __init__(self) -> None:
        # RTLD_NOLOAD: succeed only if libcuda is already mapped; never load it.
        self.lib = ctypes.CDLL("libcuda.so.1", mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        for name, argtypes in (
            ("cuDeviceGetCount", [ctypes.POINTER(c_int)]),
            ("cuDeviceGet", [ctypes.POINTER(c_int), c_int]),
            ("cuDeviceGetPCIBusId", [c_char_p, c_int, c_int]),
            ("cuCtxGetCurrent", [ctypes.POINTER(c_void_p)]),
            ("cuCtxGetDevice", [ctypes.POINTER(c_int)]),
            ("cuDevicePrimaryCtxGetState", [c_int, ctypes.POINTER(c_uint), ctypes.POINTER(c_int)]),
            ("cuDevicePrimaryCtxRetain", [ctypes.POINTER(c_void_p), c_int]),
            ("cuDevicePrimaryCtxRelease_v2", [c_int]),
            ("cuCtxPushCurrent_v2", [c_void_p]),
            ("cuCtxPopCurrent_v2", [ctypes.POINTER(c_void_p)]),
            ("cuMemGetInfo_v2", [ctypes.POINTER(c_size_t), ctypes.POINTER(c_size_t)]),
        ):
            fn = getattr(self.lib, name)
            fn.restype = c_int
            fn.argtypes = argtypes

    def device_count(self) -> int:
        """Visible devices; 0 when cuInit was never called (CUDA_ERROR_NOT_INITIALIZED)."""
        n = c_int(0)
        return n.value if self.lib.cuDeviceGetCount(byref(n)) == CUDA_SUCCESS else 0

    def bus_id(self, ordinal: int) -> Optional[bytes]:
        dev = c_int(0)
        if self.lib.cuDeviceGet(byref(dev), ordinal) != CUDA_SUCCESS:
            return None
        buf = ctypes.create_string_buffer(64)
        if self.lib.cuDeviceGetPCIBusId(buf, 64, dev.value) != CUDA_SUCCESS:
            return None
        return buf.value or None

    def _used_current(self) -> Optional[int]:
        free, total = c_size_t(0), c_size_t(0)
        if self.lib.cuMemGetInfo_v2(byref(free), byref(total)) != CUDA_SUCCESS:
            return None
        return max(total.value - free.value, 0)

    def used(self, ordinal: int) -> Optional[int]:
        """total - free of the device, through an existing context only."""
        ctx = c_void_p()
        if self.lib.cuCtxGetCurrent(byref(ctx)) == CUDA_SUCCESS and ctx.value:
            current = c_int(-1)
            if self.lib.cuCtxGetDevice(byref(current)) == CUDA_SUCCESS and current.value == ordinal:
                return self._used_current()
        dev = c_int(0)
        if self.lib.cuDeviceGet(byref(dev), ordinal) != CUDA_SUCCESS:
            return None
        flags, active = c_uint(0), c_int(0)
        if self.lib.cuDevicePrimaryCtxGetState(dev.value, byref(flags), byref(active)) != CUDA_SUCCESS:
            return None
        if not active.value:
            return None  # retaining it now would create a context: do not
        primary = c_void_p()
        if self.lib.cuDevicePrimaryCtxRetain(byref(primary), dev.value) != CUDA_SUCCESS:
            return None
        try:
            if self.lib.cuCtxPushCurrent_v2(primary) != CUDA_SUCCESS:
                return None
            try:
                return self._used_current()
            finally:
                popped = c_void_p()
                self.lib.cuCtxPopCurrent_v2(byref(popped))
        finally:
            self.lib.cuDevicePrimaryCtxRelease_v2(dev.value)


def _open_cuda() -> Optional[_Cuda]:
    try:
        cuda = _Cuda()
    except (OSError, AttributeError):
        return None
    return cuda if cuda.device_count() > 0 else None


def _nvml_processes(nvml, handle) -> list:
    """The compute processes on a device, from the newest call the driver has."""
    calls = [getattr(nvml, n, None) for n in ("nvmlDeviceGetComputeRunningProcesses_v3",
                                               "nvmlDeviceGetComputeRunningProcesses_v2",
                                               "nvmlDeviceGetComputeRunningProcesses")]
    last: Optional[Exception] = None
    for call in calls:
        if call is None:
            continue
        try:
            return list(call(handle))
        except nvml.NVMLError as e:  # e.g. a driver without this version: try an older one
            last = e
    if last is not None:
        raise last
    return []


def _from_nvml(cuda: Optional[_Cuda]) -> Dict[int, Tuple[int, str]]:
    try:
        import pynvml as nvml  # nvidia-ml-py
    except ImportError:
        return {}
    try:
        nvml.nvmlInit()
    except nvml.NVMLError:  # no driver, no GPU
        return {}
    out: Dict[int, Tuple[int, str]] = {}
    try:
        pids = _pids()
        # CUDA ordinal -> NVML handle. With CUDA initialised, match by PCI bus id
        # (CUDA's order can differ from NVML's: CUDA_DEVICE_ORDER, CUDA_VISIBLE_DEVICES).
        # Without it this process has no CUDA context, and we assume the same order.
        handles: Dict[int, object] = {}
        if cuda is not None:
            for ordinal in range(cuda.device_count()):
                bus = cuda.bus_id(ordinal)
                try:
                    handles[ordinal] = nvml.nvmlDeviceGetHandleByPciBusId(bus) if bus else None
                except nvml.NVMLError:
                    handles[ordinal] = None
        else:
            for index in range(nvml.nvmlDeviceGetCount()):
                try:
                    handles[index] = nvml.nvmlDeviceGetHandleByIndex(index)
                except nvml.NVMLError:
                    handles[index] = None
        for ordinal, handle in handles.items():
            if handle is None:
                continue
            try:
                procs = _nvml_processes(nvml, handle)
            except nvml.NVMLError:
                continue
            for proc in procs:
                used = getattr(proc, "usedGpuMemory", None)  # None: not available (e.g. no permission)
                if getattr(proc, "pid", None) in pids and used is not None:
                    out[ordinal] = (int(used), SOURCE_NVML)
                    break
    finally:
        try:
            nvml.nvmlShutdown()
        except nvml.NVMLError:
            pass
    return out


def process_device_memory() -> Dict[int, Tuple[int, str]]:
    """Device memory this process holds: ``{cuda_index: (bytes, source)}``.

    ``source`` names where the number comes from (see the module docstring).
    Devices no source can tell about are left out; on a machine without an
    NVIDIA GPU the result is ``{}``. Never raises, never initialises CUDA.

    NVML lists processes by their pid in the host's PID namespace: inside a
    container with its own PID namespace this process is usually not found,
    and the cuMemGetInfo fallback (device-wide) is used where possible.
    """
    try:
        cuda = _open_cuda()
    except Exception:  # noqa: BLE001 - must never raise
        cuda = None
    try:
        out = _from_nvml(cuda)
    except Exception:  # noqa: BLE001
        out = {}
    if cuda is None:
        return out
    try:
        for ordinal in range(cuda.device_count()):
            if ordinal in out:
                continue
            used = cuda.used(ordinal)
            if used is not None:
                out[ordinal] = (used, SOURCE_CUMEMGETINFO)
    except Exception:  # noqa: BLE001
        pass
    return out
