"""Python side of the libcupti test double (see fake_cupti.c).

``FakeCupti()`` builds (or reuses) libcupti_fake.so and wraps its fake_*
control API. The same shared object, loaded by path, is what memviz should be
pointed at in tests: dlopen returns one handle per path, so memviz and the
wrapper share the double's state.

Control calls go through a ctypes.CDLL handle (GIL released during the call)
by default, or a ctypes.PyDLL handle (GIL held) with ``hold_gil=True``; the
double works either way. The native-thread helpers always release the GIL:
they join a thread whose callbacks may need it.

Constants mirror src/cupti_abi.h (tests/unit/test_fake_cupti.py checks that).
"""

from __future__ import annotations

import ctypes
from ctypes import (
    CFUNCTYPE,
    POINTER,
    Structure,
    c_char,
    c_char_p,
    c_int,
    c_size_t,
    c_uint,
    c_uint8,
    c_uint32,
    c_uint64,
    c_ulonglong,
    c_void_p,
)

from .build import build

__all__ = ["FakeCupti", "build"]

# ---- CUptiResult / CUresult -------------------------------------------------
CUPTI_SUCCESS = 0
CUPTI_ERROR_INVALID_PARAMETER = 1
CUPTI_ERROR_INVALID_DEVICE = 2
CUPTI_ERROR_INVALID_OPERATION = 7
CUPTI_ERROR_MAX_LIMIT_REACHED = 12
CUPTI_ERROR_NOT_COMPATIBLE = 14
CUPTI_ERROR_NOT_INITIALIZED = 15
CUPTI_ERROR_QUEUE_EMPTY = 18
CUPTI_ERROR_INVALID_KIND = 21
CUPTI_ERROR_NOT_SUPPORTED = 27
CUPTI_ERROR_INSUFFICIENT_PRIVILEGES = 35
CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED = 39
CUPTI_ERROR_UNKNOWN = 999

CUDA_SUCCESS = 0
CUDA_ERROR_OUT_OF_MEMORY = 2

DEFAULT_VERSION = 130001
CUPTI_VERSION_13 = 130000
OLD_SUBSCRIBER_NAME_MIN_LEN = 64
#: cuptiGetVersion's number from which CUPTI honours allowMultipleSubscribers (13.5)
CUPTI_MULTI_SUBSCRIBER_VERSION = 130500

# ---- callback API -----------------------------------------------------------
API_ENTER = 0
API_EXIT = 1
DOMAIN_DRIVER_API = 1
DOMAIN_RUNTIME_API = 2

CBID_cuMemFreeHost = 38
CBID_cuMemHostAlloc = 39
CBID_cuMemAlloc_v2 = 243
CBID_cuMemAllocPitch_v2 = 244
CBID_cuMemFree_v2 = 245
CBID_cuMemAllocHost_v2 = 294
CBID_cuMemAllocManaged = 371
CBID_cuMemAddressReserve = 547
CBID_cuMemAddressFree = 548
CBID_cuMemCreate = 549
CBID_cuMemRelease = 550
CBID_cuMemMap = 551
CBID_cuMemUnmap = 552
CBID_cuMemAllocAsync = 598
CBID_cuMemAllocAsync_ptsz = 599
CBID_cuMemFreeAsync = 600
CBID_cuMemFreeAsync_ptsz = 601
CBID_cuMemPoolTrimTo = 602
CBID_cuMemAllocFromPoolAsync = 611
CBID_cuMemAllocFromPoolAsync_ptsz = 612

#: cbid -> driver function name, as reported in CallbackData.functionName
CBID_NAMES = {v: k[len("CBID_"):] for k, v in dict(globals()).items() if k.startswith("CBID_")}

ALLOC_CBIDS = (
    CBID_cuMemAlloc_v2, CBID_cuMemAllocPitch_v2, CBID_cuMemAllocAsync, CBID_cuMemAllocAsync_ptsz,
    CBID_cuMemAllocFromPoolAsync, CBID_cuMemAllocFromPoolAsync_ptsz, CBID_cuMemAllocManaged,
    CBID_cuMemHostAlloc, CBID_cuMemAllocHost_v2, CBID_cuMemCreate, CBID_cuMemAddressReserve,
)  # fmt: skip
FREE_CBIDS = (
    CBID_cuMemFree_v2, CBID_cuMemFreeAsync, CBID_cuMemFreeAsync_ptsz, CBID_cuMemFreeHost,
    CBID_cuMemRelease, CBID_cuMemAddressFree,
)  # fmt: skip

FAKE_CONTEXT_BASE = 0x1000  #: CallbackData.context == FAKE_CONTEXT_BASE + device
FAKE_POOL = 0x5000  #: the pool cuMemAllocFromPoolAsync reports

# ---- activity API -----------------------------------------------------------
ACTIVITY_KIND_MEMORY2 = 49
ACTIVITY_KIND_MEMORY_POOL = 50
MEMORY_OPERATION_TYPE_ALLOCATION = 1
MEMORY_OPERATION_TYPE_RELEASE = 2
MEMORY_KIND_UNKNOWN = 0
MEMORY_KIND_PAGEABLE = 1
MEMORY_KIND_PINNED = 2
MEMORY_KIND_DEVICE = 3
MEMORY_KIND_ARRAY = 4
MEMORY_KIND_MANAGED = 5
MEMORY_KIND_DEVICE_STATIC = 6
MEMORY_KIND_MANAGED_STATIC = 7
ACTIVITY_FLAG_FLUSH_FORCED = 1


# ---- C structures (same layouts as src/cupti_abi.h, LP64) ---------------------
class CallbackData(Structure):
    _fields_ = [
        ("callbackSite", c_int),
        ("functionName", c_char_p),
        ("functionParams", c_void_p),
        ("functionReturnValue", c_void_p),
        ("symbolName", c_char_p),
        ("context", c_void_p),
        ("contextUid", c_uint32),
        ("correlationData", POINTER(c_uint64)),
        ("correlationId", c_uint32),
    ]


class SubscriberParams(Structure):
    _fields_ = [
        ("structSize", c_size_t),
        ("subscriberName", c_char_p),
        ("oldSubscriberName", POINTER(c_char)),
        ("oldSubscriberSize", c_size_t),
    ]


def _params(name, fields):
    return type(name, (Structure,), {"_fields_": fields})


_P = POINTER(c_uint64)
PARAMS = {
    CBID_cuMemAlloc_v2: _params("cuMemAlloc_v2_params", [("dptr", _P), ("bytesize", c_size_t)]),
    CBID_cuMemAllocPitch_v2: _params("cuMemAllocPitch_v2_params", [
        ("dptr", _P), ("pPitch", POINTER(c_size_t)), ("WidthInBytes", c_size_t),
        ("Height", c_size_t), ("ElementSizeBytes", c_uint)]),
    CBID_cuMemFree_v2: _params("cuMemFree_v2_params", [("dptr", c_uint64)]),
    CBID_cuMemAllocHost_v2: _params("cuMemAllocHost_v2_params", [
        ("pp", POINTER(c_void_p)), ("bytesize", c_size_t)]),
    CBID_cuMemFreeHost: _params("cuMemFreeHost_params", [("p", c_void_p)]),
    CBID_cuMemHostAlloc: _params("cuMemHostAlloc_params", [
        ("pp", POINTER(c_void_p)), ("bytesize", c_size_t), ("Flags", c_uint)]),
    CBID_cuMemAllocManaged: _params("cuMemAllocManaged_params", [
        ("dptr", _P), ("bytesize", c_size_t), ("flags", c_uint)]),
    CBID_cuMemAddressReserve: _params("cuMemAddressReserve_params", [
        ("ptr", _P), ("size", c_size_t), ("alignment", c_size_t), ("addr", c_uint64),
        ("flags", c_ulonglong)]),
    CBID_cuMemAddressFree: _params("cuMemAddressFree_params", [("ptr", c_uint64), ("size", c_size_t)]),
    CBID_cuMemCreate: _params("cuMemCreate_params", [
        ("handle", _P), ("size", c_size_t), ("prop", c_void_p), ("flags", c_ulonglong)]),
    CBID_cuMemRelease: _params("cuMemRelease_params", [("handle", c_uint64)]),
    CBID_cuMemMap: _params("cuMemMap_params", [
        ("ptr", c_uint64), ("size", c_size_t), ("offset", c_size_t), ("handle", c_uint64),
        ("flags", c_ulonglong)]),
    CBID_cuMemUnmap: _params("cuMemUnmap_params", [("ptr", c_uint64), ("size", c_size_t)]),
    CBID_cuMemAllocAsync: _params("cuMemAllocAsync_params", [
        ("dptr", _P), ("bytesize", c_size_t), ("hStream", c_void_p)]),
    CBID_cuMemFreeAsync: _params("cuMemFreeAsync_params", [("dptr", c_uint64), ("hStream", c_void_p)]),
    CBID_cuMemAllocFromPoolAsync: _params("cuMemAllocFromPoolAsync_params", [
        ("dptr", _P), ("bytesize", c_size_t), ("pool", c_void_p), ("hStream", c_void_p)]),
    CBID_cuMemPoolTrimTo: _params("cuMemPoolTrimTo_params", [
        ("pool", c_void_p), ("minBytesToKeep", c_size_t)]),
}  # fmt: skip
# The _ptsz forms share their layouts with the plain ones.
PARAMS[CBID_cuMemAllocAsync_ptsz] = PARAMS[CBID_cuMemAllocAsync]
PARAMS[CBID_cuMemFreeAsync_ptsz] = PARAMS[CBID_cuMemFreeAsync]
PARAMS[CBID_cuMemAllocFromPoolAsync_ptsz] = PARAMS[CBID_cuMemAllocFromPoolAsync]


class MemoryPoolConfig(Structure):
    _fields_ = [
        ("memoryPoolType", c_int),
        ("pad2", c_uint32),
        ("address", c_uint64),
        ("releaseThreshold", c_uint64),
        ("size_or_pid", c_uint64),
        ("utilizedSize", c_uint64),
    ]


_MEMORY3_FIELDS = [
    ("kind", c_int),
    ("memoryOperationType", c_int),
    ("memoryKind", c_int),
    ("correlationId", c_uint32),
    ("address", c_uint64),
    ("bytes", c_uint64),
    ("timestamp", c_uint64),
    ("PC", c_uint64),
    ("processId", c_uint32),
    ("deviceId", c_uint32),
    ("contextId", c_uint32),
    ("streamId", c_uint32),
    ("name", c_char_p),
    ("isAsync", c_uint32),
    ("pad1", c_uint32),
    ("memoryPoolConfig", MemoryPoolConfig),
]


class ActivityMemory3(Structure):
    """CUpti_ActivityMemory3: MEMORY2 records from CUPTI 12.x (120 bytes)."""

    _fields_ = _MEMORY3_FIELDS


class ActivityMemory4(Structure):
    """CUpti_ActivityMemory4: MEMORY2 records from CUPTI 13.0 on (128 bytes)."""

    _fields_ = _MEMORY3_FIELDS + [("source", c_char_p)]


# ---- function types -----------------------------------------------------------
CallbackFunc = CFUNCTYPE(None, c_void_p, c_int, c_uint32, c_void_p)
BuffersRequestFunc = CFUNCTYPE(None, POINTER(POINTER(c_uint8)), POINTER(c_size_t), POINTER(c_size_t))
BuffersCompleteFunc = CFUNCTYPE(None, c_void_p, c_uint32, POINTER(c_uint8), c_size_t, c_size_t)

_SIGNATURES = {
    # CUPTI API
    "cuptiGetVersion": (c_int, [POINTER(c_uint32)]),
    "cuptiSubscribe": (c_int, [POINTER(c_void_p), CallbackFunc, c_void_p]),
    "cuptiSubscribe_v2": (c_int, [POINTER(c_void_p), CallbackFunc, c_void_p, POINTER(SubscriberParams)]),
    "cuptiUnsubscribe": (c_int, [c_void_p]),
    "cuptiEnableCallback": (c_int, [c_uint32, c_void_p, c_int, c_uint32]),
    "cuptiEnableDomain": (c_int, [c_uint32, c_void_p, c_int]),
    "cuptiEnableAllDomains": (c_int, [c_uint32, c_void_p]),
    "cuptiGetResultString": (c_int, [c_int, POINTER(c_char_p)]),
    "cuptiGetDeviceId": (c_int, [c_void_p, POINTER(c_uint32)]),
    "cuptiGetTimestamp": (c_int, [POINTER(c_uint64)]),
    "cuptiActivityRegisterCallbacks": (c_int, [BuffersRequestFunc, BuffersCompleteFunc]),
    "cuptiActivityEnable": (c_int, [c_int]),
    "cuptiActivityDisable": (c_int, [c_int]),
    "cuptiActivityFlushAll": (c_int, [c_uint32]),
    "cuptiActivityGetNextRecord": (c_int, [POINTER(c_uint8), c_size_t, POINTER(c_void_p)]),
    "cuptiActivityGetNumDroppedRecords": (c_int, [c_void_p, c_uint32, POINTER(c_size_t)]),
    # control API
    "fake_reset": (None, []),
    "fake_set_version": (None, [c_uint32]),
    "fake_set_conflict": (None, [c_char_p]),
    "fake_set_conflict_sharing": (None, [c_char_p, c_int]),
    "fake_other_tool_subscribes": (c_int, [c_char_p, c_int]),
    "fake_set_subscribe_error": (None, [c_int]),
    "fake_set_device": (None, [c_int]),
    "fake_is_subscribed": (c_int, []),
    "fake_is_enabled": (c_int, [c_int, c_int]),
    "fake_enabled_count": (c_int, []),
    "fake_domain_enable_calls": (c_int, []),
    "fake_activity_enabled": (c_int, [c_int]),
    "fake_alloc": (c_uint64, [c_int, c_uint64, c_uint64, c_int]),
    "fake_free": (None, [c_int, c_uint64, c_uint64, c_int]),
    "fake_map": (None, [c_int, c_uint64, c_uint64, c_uint64]),
    "fake_pool_trim": (None, [c_uint64, c_uint64]),
    "fake_alloc_in_native_thread": (c_uint64, [c_int, c_uint64, c_int, c_char_p]),
    "fake_alloc_in_native_thread_after": (c_uint64, [c_void_p, c_int, c_uint64, c_int, c_char_p]),
    "fake_alloc_free_loop": (c_uint64, [c_int, c_int, c_uint64, c_uint64]),
    "fake_alloc_free_loop_cpu": (c_uint64, [c_int, c_int, c_uint64, c_uint64]),
    "fake_alloc_free_loop_gap_cpu": (c_uint64, [c_int, c_int, c_uint64, c_uint64, c_uint64]),
    "fake_alloc_loop": (c_uint64, [c_int, c_uint64, c_uint64]),
    "fake_alloc_at": (c_uint64, [c_int, c_uint64, c_uint64]),
    "fake_addresses_like_driver": (None, [c_int]),
    "fake_alloc_many_in_native_threads": (c_int, [c_int, c_int, c_uint64]),
    "fake_emit_memory2": (
        None,
        [c_int, c_int, c_uint64, c_uint64, c_uint32, c_uint64, c_char_p, c_char_p],
    ),
    "fake_callback_count": (c_int, []),
}


def declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Set restype/argtypes of every exported function on a ctypes handle."""
    for name, (restype, argtypes) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype = restype
        fn.argtypes = argtypes
    return lib


def _b(s: str | bytes | None) -> bytes | None:
    return s.encode() if isinstance(s, str) else s


class FakeCupti:
    """The double's control API, plus a few CUPTI conveniences for tests.

    ``lib`` (CDLL) and ``pylib`` (PyDLL) are declared handles to the library;
    ``path`` is what memviz should dlopen.
    """

    def __init__(self, path: str | None = None, *, hold_gil: bool = False):
        self.path = path or build()
        self.lib = declare(ctypes.CDLL(self.path))
        self.pylib = declare(ctypes.PyDLL(self.path))
        self.hold_gil = hold_gil
        self._c = self.pylib if hold_gil else self.lib

    def with_gil(self, hold_gil: bool = True) -> FakeCupti:
        """Another wrapper over the same library (same state), other GIL mode."""
        return FakeCupti(self.path, hold_gil=hold_gil)

    # -- configuration
    def reset(self) -> None:
        self._c.fake_reset()

    def set_version(self, version: int) -> None:
        self._c.fake_set_version(version)

    def set_conflict(self, holder: str | bytes | None, shares: bool = False) -> None:
        """Another tool holds CUPTI (None: nobody); ``shares``: it subscribed in
        CUPTI 13.5's multi-subscriber mode, so a subscriber asking for it may join."""
        self._c.fake_set_conflict_sharing(_b(holder), int(shares))

    def other_tool_subscribes(self, name: str, shares: bool = False) -> bool:
        """A tool (torch.profiler) subscribes now: True if CUPTI let it."""
        return bool(self._c.fake_other_tool_subscribes(_b(name), int(shares)))

    def set_subscribe_error(self, code: int) -> None:
        self._c.fake_set_subscribe_error(code)

    def set_device(self, device: int) -> None:
        """Current device of the *calling* thread (thread-local in the double)."""
        self._c.fake_set_device(device)

    # -- inspection
    def is_subscribed(self) -> bool:
        return bool(self._c.fake_is_subscribed())

    def is_enabled(self, domain: int, cbid: int) -> bool:
        return bool(self._c.fake_is_enabled(domain, cbid))

    def enabled_count(self) -> int:
        return self._c.fake_enabled_count()

    def domain_enable_calls(self) -> int:
        return self._c.fake_domain_enable_calls()

    def activity_enabled(self, kind: int = ACTIVITY_KIND_MEMORY2) -> bool:
        return bool(self._c.fake_activity_enabled(kind))

    def callback_count(self) -> int:
        return self._c.fake_callback_count()

    def version(self) -> int:
        v = c_uint32()
        rc = self._c.cuptiGetVersion(ctypes.byref(v))
        assert rc == CUPTI_SUCCESS, rc
        return v.value

    # -- fake driver calls (argument order as in the C control API)
    def alloc(self, cbid: int, size: int, stream: int = 0, result: int = 0) -> int:
        """Fire an allocation; returns the new address/handle (0 if result != 0)."""
        return self._c.fake_alloc(cbid, size, stream, result)

    def free(self, cbid: int, address: int, stream: int = 0, result: int = 0) -> None:
        self._c.fake_free(cbid, address, stream, result)

    def map(self, cbid: int, ptr: int, size: int, handle: int = 0) -> None:
        """cuMemMap (cbid=CBID_cuMemMap) or cuMemUnmap (CBID_cuMemUnmap)."""
        self._c.fake_map(cbid, ptr, size, handle)

    def pool_trim(self, pool: int = FAKE_POOL, min_keep: int = 0) -> None:
        self._c.fake_pool_trim(pool, min_keep)

    def alloc_in_native_thread(
        self, cbid: int, size: int, device: int = 0, thread_name: str | None = None
    ) -> int:
        # Always through CDLL: the native thread's callbacks may need the GIL.
        return self.lib.fake_alloc_in_native_thread(cbid, size, device, _b(thread_name))

    def alloc_in_native_thread_after(
        self, before, cbid: int, size: int, device: int = 0, thread_name: str | None = None
    ) -> int:
        """Native thread runs Python `before()` (via ctypes), then allocates with no frames."""
        cb = CFUNCTYPE(None)(before)  # kept alive for the call
        return self.lib.fake_alloc_in_native_thread_after(
            ctypes.cast(cb, c_void_p), cbid, size, device, _b(thread_name))

    def alloc_at(self, address: int, size: int, cbid: int = CBID_cuMemAllocAsync) -> int:
        """An allocation the "driver" places at ``address`` (a real tensor's storage)."""
        return self._c.fake_alloc_at(cbid, address, size)

    def alloc_free_loop(self, n: int, size: int = 4096, cbid_alloc: int = CBID_cuMemAlloc_v2,
                        cbid_free: int = CBID_cuMemFree_v2) -> int:
        """n alloc+free pairs timed in C; returns nanoseconds."""
        return self._c.fake_alloc_free_loop(cbid_alloc, cbid_free, n, size)

    def alloc_free_loop_cpu(self, n: int, size: int = 4096, cbid_alloc: int = CBID_cuMemAlloc_v2,
                            cbid_free: int = CBID_cuMemFree_v2) -> int:
        """As alloc_free_loop, in the calling thread's CPU nanoseconds (benchmarks on a shared machine)."""
        return self._c.fake_alloc_free_loop_cpu(cbid_alloc, cbid_free, n, size)

    def alloc_loop(self, n: int, size: int = 4096, cbid: int = CBID_cuMemAlloc_v2) -> int:
        """``n`` allocations kept live, from this one Python line, in C; the ns taken."""
        return self._c.fake_alloc_loop(cbid, n, size)

    def alloc_many_in_native_threads(self, nthreads: int, per_thread: int, size: int = 4096) -> int:
        # Always through CDLL, as above.
        return self.lib.fake_alloc_many_in_native_threads(nthreads, per_thread, size)

    # -- activity
    def emit_memory2(
        self,
        op: int,
        memkind: int,
        address: int,
        bytes: int,
        device: int = 0,
        timestamp: int = 0,
        name: str | bytes | None = None,
        source: str | bytes | None = None,
    ) -> None:
        """Queue one MEMORY2 record (dropped unless the kind is enabled).

        ``timestamp=0`` stamps it with cuptiGetTimestamp's clock."""
        self._c.fake_emit_memory2(op, memkind, address, bytes, device, timestamp, _b(name), _b(source))

    def flush(self, flag: int = 0) -> int:
        """cuptiActivityFlushAll; returns its CUptiResult."""
        return self._c.cuptiActivityFlushAll(flag)

    def record_type(self) -> type[Structure]:
        """The MEMORY2 record layout for the configured version."""
        return ActivityMemory4 if self.version() >= CUPTI_VERSION_13 else ActivityMemory3

    def records(self, buffer, valid_size: int) -> list[Structure]:
        """Copies of the records in a delivered buffer, via cuptiActivityGetNextRecord."""
        buf = ctypes.cast(buffer, POINTER(c_uint8))
        rtype = self.record_type()
        out, rec = [], c_void_p()
        while self._c.cuptiActivityGetNextRecord(buf, valid_size, ctypes.byref(rec)) == CUPTI_SUCCESS:
            out.append(rtype.from_buffer_copy(ctypes.string_at(rec.value, ctypes.sizeof(rtype))))
        return out
