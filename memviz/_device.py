"""How much GPU memory this process holds, according to the driver.

memviz sees the allocations made through the CUDA driver's allocation calls.
A process holds more than that: the CUDA context itself, kernel images,
library workspaces, memory mapped by other means. :func:`process_device_memory`
asks the best source available, without ever creating CUDA state:

1. NVML (``libnvidia-ml.so.1``): the ``usedGpuMemory`` of this process in
   ``nvmlDeviceGetComputeRunningProcesses``. Counts only this process.
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
from typing import Dict, List, Optional, Set, Tuple

__all__ = ["process_device_memory"]

NVML_SUCCESS = 0
NVML_ERROR_INSUFFICIENT_SIZE = 7
NVML_VALUE_NOT_AVAILABLE = (1 << 64) - 1
CUDA_SUCCESS = 0

SOURCE_NVML = "NVML, this process only"
SOURCE_CUMEMGETINFO = "cuMemGetInfo, whole device: counts other processes too"

# Layouts of the array nvmlDeviceGetComputeRunningProcesses* fills, LP64:
#   nvmlProcessInfo_v1_t: {uint pid; ulonglong usedGpuMemory}                      16 bytes
#   nvmlProcessInfo_v2_t: v1 + {uint gpuInstanceId; uint computeInstanceId}        24 bytes
# The _v3 function takes nvmlProcessInfo_t, which is the 24-byte v2 layout in the
# NVML headers since CUDA 12.3 (and in NVIDIA's nvidia-ml-py). The CUDA 12.2-era
# header briefly added `ulonglong usedGpuCcProtectedMemory` to it (32 bytes), and
# the drivers of that time (they export nvmlDeviceGetConfComputeMemSizeInfo but
# not nvmlDeviceGetRunningProcessDetailList) write 32-byte entries. Entry 0 sits
# at the same place in every layout; for the others we guess the stride from the
# exported symbols and, if this process's pid is not found, try the other stride.
_PID_OFFSET = 0
_USED_OFFSET = 8
_STRIDE_V1 = 16
_STRIDE_V2 = 24
_STRIDE_V3_CC = 32


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


def _parse_processes(buf: bytes, count: int, stride: int) -> List[Tuple[int, int]]:
    """(pid, usedGpuMemory) of ``count`` entries of ``stride`` bytes in ``buf``."""
    out = []
    for i in range(count):
        base = i * stride
        if base + _USED_OFFSET + 8 > len(buf):
            break
        pid = int.from_bytes(buf[base + _PID_OFFSET:base + _PID_OFFSET + 4], "little")
        used = int.from_bytes(buf[base + _USED_OFFSET:base + _USED_OFFSET + 8], "little")
        out.append((pid, used))
    return out


def _find_own(buf: bytes, count: int, strides: List[int], pids: Set[int]) -> Optional[int]:
    """usedGpuMemory of this process, trying each stride in order; None if absent."""
    for stride in strides:
        for pid, used in _parse_processes(buf, count, stride):
            if pid in pids:
                return None if used == NVML_VALUE_NOT_AVAILABLE else used
    return None


class _Nvml:
    """The few NVML calls needed, through ctypes; construction raises OSError."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libnvidia-ml.so.1")
        self.initialised = False

    def has(self, name: str) -> bool:
        try:
            getattr(self.lib, name)
            return True
        except AttributeError:
            return False

    def init(self) -> bool:
        fn = self.lib.nvmlInit_v2 if self.has("nvmlInit_v2") else self.lib.nvmlInit
        fn.restype = c_int
        self.initialised = fn() == NVML_SUCCESS
        return self.initialised

    def shutdown(self) -> None:
        if self.initialised:
            self.lib.nvmlShutdown.restype = c_int
            self.lib.nvmlShutdown()
            self.initialised = False

    def count(self) -> int:
        n = c_uint(0)
        fn = self.lib.nvmlDeviceGetCount_v2
        fn.restype = c_int
        return n.value if fn(byref(n)) == NVML_SUCCESS else 0

    def handle_by_index(self, index: int) -> Optional[int]:
        h = c_void_p()
        fn = self.lib.nvmlDeviceGetHandleByIndex_v2
        fn.restype = c_int
        fn.argtypes = [c_uint, ctypes.POINTER(c_void_p)]
        return h.value if fn(index, byref(h)) == NVML_SUCCESS and h.value else None

    def handle_by_bus_id(self, bus_id: bytes) -> Optional[int]:
        if not self.has("nvmlDeviceGetHandleByPciBusId_v2"):
            return None
        h = c_void_p()
        fn = self.lib.nvmlDeviceGetHandleByPciBusId_v2
        fn.restype = c_int
        fn.argtypes = [c_char_p, ctypes.POINTER(c_void_p)]
        return h.value if fn(bus_id, byref(h)) == NVML_SUCCESS and h.value else None

    def _layouts(self) -> List[Tuple[str, List[int]]]:
        """(function, strides to try) from the newest function the driver exports."""
        out = []
        if self.has("nvmlDeviceGetComputeRunningProcesses_v3"):
            old_cc_layout = (self.has("nvmlDeviceGetConfComputeMemSizeInfo")
                             and not self.has("nvmlDeviceGetRunningProcessDetailList"))
            strides = [_STRIDE_V3_CC, _STRIDE_V2] if old_cc_layout else [_STRIDE_V2, _STRIDE_V3_CC]
            out.append(("nvmlDeviceGetComputeRunningProcesses_v3", strides))
        if self.has("nvmlDeviceGetComputeRunningProcesses_v2"):
            out.append(("nvmlDeviceGetComputeRunningProcesses_v2", [_STRIDE_V2]))
        if self.has("nvmlDeviceGetComputeRunningProcesses"):
            out.append(("nvmlDeviceGetComputeRunningProcesses", [_STRIDE_V1]))
        return out

    def process_used(self, handle: int, pids: Set[int]) -> Optional[int]:
        """usedGpuMemory of this process on the device, or None when not listed."""
        for name, strides in self._layouts():
            fn = getattr(self.lib, name)
            fn.restype = c_int
            fn.argtypes = [c_void_p, ctypes.POINTER(c_uint), c_void_p]
            count = c_uint(0)
            rc = fn(handle, byref(count), None)
            if rc == NVML_SUCCESS:
                return None  # no compute process on this device
            if rc != NVML_ERROR_INSUFFICIENT_SIZE:
                continue  # e.g. NOT_SUPPORTED / FUNCTION_NOT_FOUND: try an older one
            for _ in range(3):  # processes may appear between the two calls
                capacity = count.value * 2 + 8
                buf = ctypes.create_string_buffer(capacity * max(strides))
                count = c_uint(capacity)
                rc = fn(handle, byref(count), buf)
                if rc != NVML_ERROR_INSUFFICIENT_SIZE:
                    break
            if rc != NVML_SUCCESS:
                continue
            return _find_own(buf.raw, count.value, strides, pids)
        return None


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


def _from_nvml(cuda: Optional[_Cuda]) -> Dict[int, Tuple[int, str]]:
    try:
        nvml = _Nvml()
    except OSError:
        return {}
    out: Dict[int, Tuple[int, str]] = {}
    if not nvml.init():
        return out
    try:
        pids = _pids()
        # CUDA ordinal -> NVML handle. With CUDA initialised, match by PCI bus id
        # (CUDA's order can differ from NVML's: CUDA_DEVICE_ORDER, CUDA_VISIBLE_DEVICES).
        # Without it this process has no CUDA context, and we assume the same order.
        handles: Dict[int, Optional[int]] = {}
        if cuda is not None:
            for ordinal in range(cuda.device_count()):
                bus = cuda.bus_id(ordinal)
                handles[ordinal] = nvml.handle_by_bus_id(bus) if bus else None
        else:
            for index in range(nvml.count()):
                handles[index] = nvml.handle_by_index(index)
        for ordinal, handle in handles.items():
            if handle is None:
                continue
            used = nvml.process_used(handle, pids)
            if used is not None:
                out[ordinal] = (used, SOURCE_NVML)
    finally:
        nvml.shutdown()
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
