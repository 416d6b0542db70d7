"""Tests of the libcupti test double itself (tests/fake_cupti), without memviz.

A ctypes callback subscribed through the double's own cuptiSubscribe stands in
for memviz, so these tests pin down exactly what memviz will see: callback IDs,
parameter structs, callback data, activity record layouts and error codes.
"""

import ctypes
import os
import re
import subprocess
import sys
import threading
import time
from ctypes import POINTER, byref, c_char, c_char_p, c_size_t, c_uint8, c_uint32, c_uint64, c_void_p
from pathlib import Path

import pytest

import fake_cupti as fc

ROOT = Path(__file__).resolve().parents[2]
ABI_HEADER = ROOT / "src" / "cupti_abi.h"


@pytest.fixture(scope="session")
def lib_path():
    return fc.build()


@pytest.fixture(params=["cdll", "pydll"])
def fake(request, lib_path):
    """The double, reset, with control calls made with the GIL released or held."""
    f = fc.FakeCupti(lib_path, hold_gil=request.param == "pydll")
    f.reset()
    yield f
    f.reset()


@pytest.fixture
def cfake(lib_path):
    """Like `fake`, CDLL only: for tests where the GIL mode makes no difference."""
    f = fc.FakeCupti(lib_path)
    f.reset()
    yield f
    f.reset()


def _decode_params(cbid, addr):
    """Copy a driver parameter struct, dereferencing its out-pointers now (they
    point into the caller's stack frame and die with the callback)."""
    p = fc.PARAMS[cbid].from_address(addr)
    out = {}
    for name, ctype in p._fields_:
        value = getattr(p, name)
        if isinstance(value, ctypes._Pointer):
            out[name] = value.contents.value if value else None
            out[name + "_addr"] = ctypes.cast(value, c_void_p).value
        else:
            out[name] = value
    return out


class Subscriber:
    """A stand-in for memviz: records every callback it receives."""

    def __init__(self, fake, on_callback=None):
        self.fake = fake
        self.events = []
        self.lock = threading.Lock()
        self.handle = c_void_p()
        self.on_callback = on_callback
        self.cfunc = fc.CallbackFunc(self._callback)  # kept alive by self

    def _callback(self, userdata, domain, cbid, cbdata):
        d = fc.CallbackData.from_address(cbdata)
        ev = {
            "userdata": userdata,
            "domain": domain,
            "cbid": cbid,
            "site": d.callbackSite,
            "name": d.functionName.decode(),
            "params_addr": d.functionParams,
            "params": _decode_params(cbid, d.functionParams),
            "ret": ctypes.c_int.from_address(d.functionReturnValue).value,
            "symbol": d.symbolName,
            "context": d.context,
            "context_uid": d.contextUid,
            "corr_data_addr": ctypes.cast(d.correlationData, c_void_p).value,
            "corr_data": d.correlationData[0],
            "corr_id": d.correlationId,
            "tid": threading.get_native_id(),
        }
        if self.on_callback:
            self.on_callback(ev, d)
        with self.lock:
            self.events.append(ev)

    def subscribe(self, userdata=None):
        return self.fake.lib.cuptiSubscribe(byref(self.handle), self.cfunc, userdata)

    def subscribe_v2(self, name=None, old_size=fc.OLD_SUBSCRIBER_NAME_MIN_LEN, struct_size=None):
        self.old_name = ctypes.create_string_buffer(b"\xee" * (old_size + 8))
        params = fc.SubscriberParams(
            structSize=ctypes.sizeof(fc.SubscriberParams) if struct_size is None else struct_size,
            subscriberName=name.encode() if name else None,
            oldSubscriberName=ctypes.cast(self.old_name, POINTER(c_char)),
            oldSubscriberSize=old_size,
        )
        return self.fake.lib.cuptiSubscribe_v2(byref(self.handle), self.cfunc, None, byref(params))

    def enable(self, *cbids, domain=fc.DOMAIN_DRIVER_API, on=1):
        for cbid in cbids:
            assert self.fake.lib.cuptiEnableCallback(on, self.handle, domain, cbid) == fc.CUPTI_SUCCESS

    def unsubscribe(self):
        return self.fake.lib.cuptiUnsubscribe(self.handle)


def _alloc_free_cbids():
    return list(fc.ALLOC_CBIDS) + list(fc.FREE_CBIDS) + [fc.CBID_cuMemMap, fc.CBID_cuMemUnmap]


# ---- the double matches the ABI header -------------------------------------------


def _our_name(abi_name):
    """MVZ_<abi_name> in cupti_abi.h -> the constant's name in fake_cupti."""
    renames = [("CUPTI_ACTIVITY_MEMORY_", "MEMORY_"), ("CUPTI_ACTIVITY_", "ACTIVITY_"),
               ("CUPTI_CB_", ""), ("CUPTI_API_", "API_"), ("CUPTI_OLD_", "OLD_")]
    for old, new in renames:
        if abi_name.startswith(old):
            return new + abi_name[len(old):]
    return abi_name


def test_constants_match_abi_header():
    text = ABI_HEADER.read_text()
    cbids = {m[1]: int(m[2]) for m in re.finditer(r"MVZ_CBID_(\w+)\s*=\s*(\d+)", text)}
    assert cbids == {name: cbid for cbid, name in fc.CBID_NAMES.items()}
    consts = dict(re.findall(r"\bMVZ_(\w+)\s*=\s*(\d+)", text))
    consts.update(re.findall(r"#define MVZ_(\w+)\s+(\d+)u?\b", text))
    checked = 0
    for name, value in consts.items():
        if not name.startswith("CBID_"):
            assert getattr(fc, _our_name(name)) == int(value), name
            checked += 1
    assert checked >= 30


def test_struct_sizes_match_lp64_abi():
    assert ctypes.sizeof(fc.CallbackData) == 72
    assert ctypes.sizeof(fc.SubscriberParams) == 32
    assert ctypes.sizeof(fc.ActivityMemory3) == 120
    assert ctypes.sizeof(fc.ActivityMemory4) == 128
    assert fc.ActivityMemory4.source.offset == 120
    assert fc.ActivityMemory3.memoryPoolConfig.offset == 80
    assert fc.ActivityMemory3.name.offset == 64


def test_exports_are_the_cupti_subset(lib_path):
    out = subprocess.run(["nm", "-D", "--defined-only", lib_path], capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip("nm not available")
    names = {line.split()[-1] for line in out.stdout.splitlines() if " T " in line}
    # (sanitizer or coverage builds may add their own symbols; ignore those)
    assert {n for n in names if n.startswith(("cupti", "fake_"))} == set(fc._SIGNATURES)


# ---- versions, results, misc --------------------------------------------------------


def test_version_default_set_and_reset(fake):
    assert fake.version() == 130001
    fake.set_version(28)  # CUDA 12.9 Update 1
    assert fake.version() == 28
    fake.reset()
    assert fake.version() == 130001
    assert fake.lib.cuptiGetVersion(None) == fc.CUPTI_ERROR_INVALID_PARAMETER


@pytest.mark.parametrize(
    "code, text",
    [
        (0, "CUPTI_SUCCESS"),
        (1, "CUPTI_ERROR_INVALID_PARAMETER"),
        (12, "CUPTI_ERROR_MAX_LIMIT_REACHED"),
        (14, "CUPTI_ERROR_NOT_COMPATIBLE"),
        (15, "CUPTI_ERROR_NOT_INITIALIZED"),
        (18, "CUPTI_ERROR_QUEUE_EMPTY"),
        (27, "CUPTI_ERROR_NOT_SUPPORTED"),
        (35, "CUPTI_ERROR_INSUFFICIENT_PRIVILEGES"),
        (39, "CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED"),
        (46, "CUPTI_ERROR_INVALID_CHIP_NAME"),
        (999, "CUPTI_ERROR_UNKNOWN"),
    ],
)
def test_result_strings(cfake, code, text):
    s = c_char_p()
    assert cfake.lib.cuptiGetResultString(code, byref(s)) == 0
    assert s.value.decode() == text


def test_result_string_of_non_result(cfake):
    s = c_char_p(b"untouched")
    assert cfake.lib.cuptiGetResultString(12345, byref(s)) == fc.CUPTI_ERROR_INVALID_PARAMETER
    assert cfake.lib.cuptiGetResultString(-1, byref(s)) == fc.CUPTI_ERROR_INVALID_PARAMETER
    assert s.value == b"untouched"


def test_timestamp_is_clock_monotonic_ns(cfake):
    ts = c_uint64()
    before = time.monotonic_ns()
    assert cfake.lib.cuptiGetTimestamp(byref(ts)) == 0
    after = time.monotonic_ns()
    assert before <= ts.value <= after


def test_get_device_id(fake):
    dev = c_uint32()
    assert fake.lib.cuptiGetDeviceId(c_void_p(0x1000 + 5), byref(dev)) == 0
    assert dev.value == 5
    fake.set_device(3)
    assert fake.lib.cuptiGetDeviceId(None, byref(dev)) == 0  # NULL: current context
    assert dev.value == 3
    assert fake.lib.cuptiGetDeviceId(c_void_p(0xDEAD0000), byref(dev)) == fc.CUPTI_ERROR_INVALID_DEVICE


# ---- subscription ------------------------------------------------------------------------


def test_subscribe_and_unsubscribe(fake):
    sub = Subscriber(fake)
    assert not fake.is_subscribed()
    assert sub.subscribe() == fc.CUPTI_SUCCESS
    assert sub.handle.value
    assert fake.is_subscribed()
    assert sub.unsubscribe() == fc.CUPTI_SUCCESS
    assert not fake.is_subscribed()
    assert sub.unsubscribe() == fc.CUPTI_ERROR_INVALID_PARAMETER  # stale handle
    assert sub.subscribe() == fc.CUPTI_SUCCESS  # and again after unsubscribing
    assert fake.lib.cuptiSubscribe(None, sub.cfunc, None) == fc.CUPTI_ERROR_INVALID_PARAMETER


def test_single_subscriber_per_process(fake):
    first, second = Subscriber(fake), Subscriber(fake)
    assert first.subscribe_v2("first tool") == 0
    assert second.subscribe() == fc.CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED
    assert second.subscribe_v2("memviz") == fc.CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED
    # Real CUPTI names subscribers "CUPTI for <name>".
    assert second.old_name.value == b"CUPTI for first tool"
    assert first.unsubscribe() == 0
    assert second.subscribe_v2("memviz") == 0


def test_conflict_reports_holder(fake):
    fake.set_conflict("Nsight Systems 2025.3")
    sub = Subscriber(fake)
    assert sub.subscribe_v2("memviz") == fc.CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED
    assert sub.old_name.value == b"Nsight Systems 2025.3"
    assert sub.subscribe() == fc.CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED
    assert not fake.is_subscribed()
    fake.set_conflict(None)
    assert sub.subscribe_v2("memviz") == fc.CUPTI_SUCCESS


def test_conflict_holder_is_bounded_and_terminated(fake):
    fake.set_conflict("a-very-long-profiler-name")
    sub = Subscriber(fake)
    assert sub.subscribe_v2(old_size=8) == fc.CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED
    raw = sub.old_name.raw
    assert raw[:8] == b"a-very-\0"
    assert raw[8:-1] == b"\xee" * (len(raw) - 9)  # nothing written past oldSubscriberSize


def test_conflict_without_name_buffer(fake):
    fake.set_conflict("ncu")
    handle = c_void_p()
    cb = fc.CallbackFunc(lambda *a: None)
    params = fc.SubscriberParams(structSize=ctypes.sizeof(fc.SubscriberParams))
    rc = fake.lib.cuptiSubscribe_v2(byref(handle), cb, None, byref(params))
    assert rc == fc.CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED
    rc = fake.lib.cuptiSubscribe_v2(byref(handle), cb, None, None)
    assert rc == fc.CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED


def test_v2_rejects_unset_struct_size(fake):
    assert Subscriber(fake).subscribe_v2("memviz", struct_size=0) == fc.CUPTI_ERROR_INVALID_PARAMETER
    assert not fake.is_subscribed()


@pytest.mark.parametrize(
    "code", [fc.CUPTI_ERROR_NOT_INITIALIZED, fc.CUPTI_ERROR_INSUFFICIENT_PRIVILEGES, fc.CUPTI_ERROR_UNKNOWN]
)
def test_configured_subscribe_error(fake, code):
    fake.set_subscribe_error(code)
    sub = Subscriber(fake)
    assert sub.subscribe() == code
    assert sub.subscribe_v2("memviz") == code
    assert not fake.is_subscribed()
    fake.set_subscribe_error(0)
    assert sub.subscribe() == 0


def test_enable_callback_bookkeeping(fake):
    sub = Subscriber(fake)
    assert fake.lib.cuptiEnableCallback(1, None, 1, fc.CBID_cuMemAlloc_v2) == fc.CUPTI_ERROR_INVALID_PARAMETER
    sub.subscribe()
    sub.enable(fc.CBID_cuMemAlloc_v2, fc.CBID_cuMemFree_v2)
    assert fake.enabled_count() == 2
    assert fake.is_enabled(fc.DOMAIN_DRIVER_API, fc.CBID_cuMemAlloc_v2)
    assert not fake.is_enabled(fc.DOMAIN_RUNTIME_API, fc.CBID_cuMemAlloc_v2)
    sub.enable(fc.CBID_cuMemAlloc_v2)  # idempotent
    assert fake.enabled_count() == 2
    sub.enable(fc.CBID_cuMemFree_v2, on=0)
    assert fake.enabled_count() == 1
    assert not fake.is_enabled(fc.DOMAIN_DRIVER_API, fc.CBID_cuMemFree_v2)
    assert fake.lib.cuptiEnableCallback(1, c_void_p(0x1234), 1, 243) == fc.CUPTI_ERROR_INVALID_PARAMETER
    assert fake.lib.cuptiEnableCallback(1, sub.handle, 99, 243) == fc.CUPTI_ERROR_INVALID_PARAMETER
    assert fake.lib.cuptiEnableCallback(1, sub.handle, 1, 100000) == fc.CUPTI_ERROR_INVALID_PARAMETER
    assert fake.domain_enable_calls() == 0
    sub.unsubscribe()  # enable state belongs to the subscriber
    assert fake.enabled_count() == 0


def test_domain_enables_are_counted(fake):
    sub = Subscriber(fake)
    sub.subscribe()
    assert fake.lib.cuptiEnableDomain(1, sub.handle, fc.DOMAIN_DRIVER_API) == 0
    assert fake.is_enabled(fc.DOMAIN_DRIVER_API, fc.CBID_cuMemAlloc_v2)
    assert fake.lib.cuptiEnableAllDomains(0, sub.handle) == 0
    assert fake.enabled_count() == 0
    assert fake.domain_enable_calls() == 2


# ---- fake driver calls -----------------------------------------------------------------------


def test_callbacks_need_subscription_and_enable(fake):
    assert fake.alloc(fc.CBID_cuMemAlloc_v2, 1024)  # the "driver" works regardless
    sub = Subscriber(fake)
    sub.subscribe()
    fake.alloc(fc.CBID_cuMemAlloc_v2, 1024)
    sub.enable(fc.CBID_cuMemFree_v2)
    fake.alloc(fc.CBID_cuMemAlloc_v2, 1024)
    assert sub.events == [] and fake.callback_count() == 0
    sub.enable(fc.CBID_cuMemAlloc_v2)
    fake.alloc(fc.CBID_cuMemAlloc_v2, 1024)
    assert [e["site"] for e in sub.events] == [fc.API_ENTER, fc.API_EXIT]
    assert fake.callback_count() == 2
    sub.unsubscribe()
    fake.alloc(fc.CBID_cuMemAlloc_v2, 1024)
    assert fake.callback_count() == 2


OUT_FIELD = {
    fc.CBID_cuMemHostAlloc: "pp",
    fc.CBID_cuMemAllocHost_v2: "pp",
    fc.CBID_cuMemCreate: "handle",
    fc.CBID_cuMemAddressReserve: "ptr",
}
SIZE_FIELD = {
    fc.CBID_cuMemAllocPitch_v2: "WidthInBytes",
    fc.CBID_cuMemCreate: "size",
    fc.CBID_cuMemAddressReserve: "size",
}


@pytest.mark.parametrize("cbid", fc.ALLOC_CBIDS, ids=lambda c: fc.CBID_NAMES[c])
def test_alloc_callback_data(fake, cbid):
    props = []  # cuMemCreate's prop lives only as long as the call

    def on_callback(ev, d):
        if cbid == fc.CBID_cuMemCreate:
            props.append(list((ctypes.c_int * 4).from_address(ev["params"]["prop"])))

    sub = Subscriber(fake, on_callback)
    assert sub.subscribe(userdata=0xABC) == 0
    sub.enable(cbid)
    fake.set_device(2)
    addr = fake.alloc(cbid, 3000, stream=0x77)
    assert addr and addr % 256 == 0
    enter, exit_ = sub.events
    out, size = OUT_FIELD.get(cbid, "dptr"), SIZE_FIELD.get(cbid, "bytesize")
    for ev in (enter, exit_):
        assert ev["userdata"] == 0xABC
        assert ev["domain"] == fc.DOMAIN_DRIVER_API
        assert ev["cbid"] == cbid
        assert ev["name"] == fc.CBID_NAMES[cbid]
        assert ev["params"][size] == 3000
        assert ev["context"] == 0x1002 and ev["context_uid"] == 3
        assert ev["symbol"] is None
    assert (enter["site"], exit_["site"]) == (fc.API_ENTER, fc.API_EXIT)
    assert enter["params"][out] in (0, None)  # not yet written at ENTER
    assert exit_["params"][out] == addr
    assert enter["params_addr"] == exit_["params_addr"]
    assert enter["params"][out + "_addr"] == exit_["params"][out + "_addr"]
    assert enter["corr_id"] == exit_["corr_id"] > 0
    assert enter["corr_data_addr"] == exit_["corr_data_addr"] != 0
    assert exit_["ret"] == fc.CUDA_SUCCESS
    p = exit_["params"]
    if cbid == fc.CBID_cuMemAllocPitch_v2:
        assert (p["Height"], p["pPitch"], p["ElementSizeBytes"]) == (1, 3000, 4)
    if cbid in (fc.CBID_cuMemAllocAsync, fc.CBID_cuMemAllocAsync_ptsz):
        assert p["hStream"] == 0x77
    if cbid in (fc.CBID_cuMemAllocFromPoolAsync, fc.CBID_cuMemAllocFromPoolAsync_ptsz):
        assert (p["pool"], p["hStream"]) == (fc.FAKE_POOL, 0x77)
    if cbid == fc.CBID_cuMemCreate:
        # a CUmemAllocationProp: type PINNED, no handle types, location DEVICE, id = device
        assert props == [[1, 0, 1, 2]] * 2
    if cbid == fc.CBID_cuMemAllocManaged:
        assert p["flags"] == 1  # CU_MEM_ATTACH_GLOBAL


def test_failed_alloc(fake):
    sub = Subscriber(fake)
    sub.subscribe()
    sub.enable(fc.CBID_cuMemAlloc_v2)
    assert fake.alloc(fc.CBID_cuMemAlloc_v2, 1 << 40, result=fc.CUDA_ERROR_OUT_OF_MEMORY) == 0
    enter, exit_ = sub.events
    assert exit_["ret"] == fc.CUDA_ERROR_OUT_OF_MEMORY
    assert exit_["params"]["dptr"] == 0


def test_correlation_data_travels_from_enter_to_exit(fake):
    seen = []

    def on_callback(ev, d):
        if d.callbackSite == fc.API_ENTER:
            d.correlationData[0] = 0xC0FFEE + d.correlationId
        else:
            seen.append((d.correlationData[0], d.correlationId))

    sub = Subscriber(fake, on_callback)
    sub.subscribe()
    sub.enable(fc.CBID_cuMemAlloc_v2)
    fake.alloc(fc.CBID_cuMemAlloc_v2, 1)
    fake.alloc(fc.CBID_cuMemAlloc_v2, 1)
    assert [v for v, cid in seen] == [0xC0FFEE + cid for v, cid in seen]
    assert seen[1][1] > seen[0][1]  # correlation ids increase
    assert [e["corr_data"] for e in sub.events if e["site"] == fc.API_ENTER] == [0, 0]


def test_addresses_are_unique_and_non_overlapping(cfake):
    spans = []
    for size in (1, 255, 256, 257, 1 << 20, 0):
        addr = cfake.alloc(fc.CBID_cuMemAlloc_v2, size)
        assert addr % 256 == 0
        spans.append((addr, addr + size))
    spans.sort()
    assert all(a_end < b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))


FREE_FIELD = {
    fc.CBID_cuMemFree_v2: "dptr",
    fc.CBID_cuMemFreeAsync: "dptr",
    fc.CBID_cuMemFreeAsync_ptsz: "dptr",
    fc.CBID_cuMemFreeHost: "p",
    fc.CBID_cuMemRelease: "handle",
    fc.CBID_cuMemAddressFree: "ptr",
}


@pytest.mark.parametrize("cbid", fc.FREE_CBIDS, ids=lambda c: fc.CBID_NAMES[c])
@pytest.mark.parametrize("result", [0, 1])
def test_free_callback_data(fake, cbid, result):
    sub = Subscriber(fake)
    sub.subscribe()
    sub.enable(cbid)
    fake.free(cbid, 0x7F0000001000, stream=0x99, result=result)
    enter, exit_ = sub.events
    assert enter["name"] == exit_["name"] == fc.CBID_NAMES[cbid]
    assert enter["params"][FREE_FIELD[cbid]] == exit_["params"][FREE_FIELD[cbid]] == 0x7F0000001000
    assert exit_["ret"] == result
    if cbid in (fc.CBID_cuMemFreeAsync, fc.CBID_cuMemFreeAsync_ptsz):
        assert exit_["params"]["hStream"] == 0x99
    if cbid == fc.CBID_cuMemAddressFree:
        assert exit_["params"]["size"] == 0


def test_map_unmap_and_pool_trim(fake):
    sub = Subscriber(fake)
    sub.subscribe()
    sub.enable(fc.CBID_cuMemMap, fc.CBID_cuMemUnmap, fc.CBID_cuMemPoolTrimTo)
    fake.map(fc.CBID_cuMemMap, 0x7F0000200000, 2 << 20, 0x42)
    fake.map(fc.CBID_cuMemUnmap, 0x7F0000200000, 2 << 20)
    fake.pool_trim(fc.FAKE_POOL, 4096)
    names = [e["name"] for e in sub.events if e["site"] == fc.API_EXIT]
    assert names == ["cuMemMap", "cuMemUnmap", "cuMemPoolTrimTo"]
    m, u, t = (e["params"] for e in sub.events if e["site"] == fc.API_EXIT)
    assert (m["ptr"], m["size"], m["offset"], m["handle"], m["flags"]) == (0x7F0000200000, 2 << 20, 0, 0x42, 0)
    assert (u["ptr"], u["size"]) == (0x7F0000200000, 2 << 20)
    assert (t["pool"], t["minBytesToKeep"]) == (fc.FAKE_POOL, 4096)


def test_unsupported_cbid_is_ignored(fake, capfd):
    sub = Subscriber(fake)
    sub.subscribe()
    sub.enable(fc.CBID_cuMemFree_v2)
    assert fake.alloc(fc.CBID_cuMemFree_v2, 10) == 0
    fake.free(fc.CBID_cuMemAlloc_v2, 10)
    fake.map(fc.CBID_cuMemFree_v2, 0, 0, 0)
    assert sub.events == []
    assert "unsupported cbid" in capfd.readouterr().err


def test_device_per_thread_in_callbacks(fake):
    sub = Subscriber(fake)
    sub.subscribe()
    sub.enable(fc.CBID_cuMemAlloc_v2)
    fake.set_device(1)
    t = threading.Thread(target=fake.alloc, args=(fc.CBID_cuMemAlloc_v2, 8))
    t.start()
    t.join()
    fake.alloc(fc.CBID_cuMemAlloc_v2, 8)
    ctx = [e["context"] for e in sub.events if e["site"] == fc.API_EXIT]
    assert ctx == [0x1000, 0x1001]  # the other thread still has device 0
    fake.reset()
    sub = Subscriber(fake)
    sub.subscribe()
    sub.enable(fc.CBID_cuMemAlloc_v2)
    fake.alloc(fc.CBID_cuMemAlloc_v2, 8)
    assert sub.events[-1]["context"] == 0x1000  # reset put this thread back on device 0


def _comm(tid):
    return Path(f"/proc/self/task/{tid}/comm").read_text().strip()


@pytest.mark.parametrize(
    "name, expected", [("mvz-worker", "mvz-worker"), ("a-much-longer-thread-name", "a-much-longer-t")]
)
def test_alloc_in_native_thread(fake, name, expected):
    comms = []
    sub = Subscriber(fake, lambda ev, d: comms.append(_comm(ev["tid"])))
    sub.subscribe()
    sub.enable(fc.CBID_cuMemAllocManaged)
    addr = fake.alloc_in_native_thread(fc.CBID_cuMemAllocManaged, 4096, device=2, thread_name=name)
    assert addr
    enter, exit_ = sub.events
    assert enter["tid"] == exit_["tid"] != threading.get_native_id()
    assert comms == [expected, expected]
    assert exit_["context"] == 0x1002 and exit_["params"]["dptr"] == addr


def test_alloc_in_unnamed_native_thread(cfake):
    assert cfake.alloc_in_native_thread(fc.CBID_cuMemAlloc_v2, 16)


def test_many_native_threads(cfake):
    sub = Subscriber(cfake)
    sub.subscribe()
    sub.enable(fc.CBID_cuMemAlloc_v2, fc.CBID_cuMemFree_v2)
    assert cfake.alloc_many_in_native_threads(8, 50, 1 << 16) == 0
    assert cfake.callback_count() == len(sub.events) == 8 * 50 * 4
    exits = [e for e in sub.events if e["site"] == fc.API_EXIT]
    addrs = [e["params"]["dptr"] for e in exits if e["cbid"] == fc.CBID_cuMemAlloc_v2]
    frees = [e["params"]["dptr"] for e in exits if e["cbid"] == fc.CBID_cuMemFree_v2]
    assert len(set(addrs)) == 400 and set(addrs) == set(frees)
    assert len({e["tid"] for e in sub.events}) > 1
    assert cfake.alloc_many_in_native_threads(0, 1, 1) == -1


def test_python_threads_concurrently(fake):
    sub = Subscriber(fake)
    sub.subscribe()
    sub.enable(fc.CBID_cuMemAlloc_v2)
    results = [[] for _ in range(8)]

    def work(out):
        for _ in range(200):
            out.append(fake.alloc(fc.CBID_cuMemAlloc_v2, 512))

    threads = [threading.Thread(target=work, args=(r,)) for r in results]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    addrs = [a for r in results for a in r]
    assert len(set(addrs)) == 1600 and 0 not in addrs
    assert fake.callback_count() == 3200
    ids = [e["corr_id"] for e in sub.events if e["site"] == fc.API_EXIT]
    assert len(set(ids)) == 1600


def test_callbacks_may_reenter_the_library(fake):
    def on_callback(ev, d):
        if ev["cbid"] == fc.CBID_cuMemAlloc_v2 and d.callbackSite == fc.API_ENTER:
            # A callback calling back into CUPTI/the driver must not deadlock.
            assert fake.lib.fake_is_subscribed() == 1
            fake.lib.cuptiEnableCallback(1, sub.handle, 1, fc.CBID_cuMemFree_v2)
            fake.lib.fake_free(fc.CBID_cuMemFree_v2, 0x100, 0, 0)
            fake.lib.fake_emit_memory2(1, 3, 0x100, 1, 0, 0, None, None)

    sub = Subscriber(fake, on_callback)
    sub.subscribe()
    sub.enable(fc.CBID_cuMemAlloc_v2)
    t = threading.Thread(target=fake.lib.fake_alloc, args=(fc.CBID_cuMemAlloc_v2, 1, 0, 0), daemon=True)
    t.start()
    t.join(timeout=10)
    assert not t.is_alive(), "deadlock: a lock is held across the subscriber callback"
    assert [e["cbid"] for e in sub.events] == [fc.CBID_cuMemFree_v2, fc.CBID_cuMemFree_v2, 243, 243]


def test_callbacks_run_concurrently(cfake):
    """Two threads' callbacks must be able to be inside the subscriber at once."""
    barrier = threading.Barrier(2, timeout=10)

    def on_callback(ev, d):
        if d.callbackSite == fc.API_ENTER:
            barrier.wait()  # raises BrokenBarrierError if callbacks were serialized

    sub = Subscriber(cfake, on_callback)
    sub.subscribe()
    sub.enable(fc.CBID_cuMemAlloc_v2)
    threads = [threading.Thread(target=cfake.alloc, args=(fc.CBID_cuMemAlloc_v2, 1)) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not barrier.broken
    assert len(sub.events) == 4


# ---- activity API ----------------------------------------------------------------------------


class Buffers:
    """Client side of cuptiActivityRegisterCallbacks: hands out buffers of
    `size` bytes (or NULL) and parses each completed one."""

    def __init__(self, fake, size=8 * 1024, max_records=0, null=False):
        self.fake, self.size, self.max_records, self.null = fake, size, max_records, null
        self.alive = {}
        self.completed = []  # (context, stream, size, validSize, [records])
        self.request = fc.BuffersRequestFunc(self._request)
        self.complete = fc.BuffersCompleteFunc(self._complete)

    def _request(self, buf, size, max_records):
        if self.null:
            buf[0] = None
            size[0] = 0
            return
        arr = (c_uint64 * ((self.size + 7) // 8))()  # 8-byte aligned, as CUPTI requires
        self.alive[ctypes.addressof(arr)] = arr
        buf[0] = ctypes.cast(arr, POINTER(c_uint8))
        size[0] = self.size
        max_records[0] = self.max_records

    def _complete(self, ctx, stream, buf, size, valid):
        addr = ctypes.cast(buf, c_void_p).value
        records = self.fake.records(buf, valid)
        rec = c_void_p()
        n = 0
        while (rc := self.fake.lib.cuptiActivityGetNextRecord(buf, valid, byref(rec))) == 0:
            n += 1
        assert n == len(records)
        self.completed.append((ctx, stream, size, valid, records, rc))
        self.alive.pop(addr, None)

    def register(self):
        assert self.fake.lib.cuptiActivityRegisterCallbacks(self.request, self.complete) == 0

    @property
    def records(self):
        return [r for c in self.completed for r in c[4]]


def test_activity_enable_bookkeeping(fake):
    assert not fake.activity_enabled(fc.ACTIVITY_KIND_MEMORY2)
    assert fake.lib.cuptiActivityEnable(fc.ACTIVITY_KIND_MEMORY2) == 0
    assert fake.activity_enabled(fc.ACTIVITY_KIND_MEMORY2)
    assert not fake.activity_enabled(fc.ACTIVITY_KIND_MEMORY_POOL)
    assert fake.lib.cuptiActivityDisable(fc.ACTIVITY_KIND_MEMORY2) == 0
    assert not fake.activity_enabled(fc.ACTIVITY_KIND_MEMORY2)
    assert fake.lib.cuptiActivityEnable(100000) == fc.CUPTI_ERROR_INVALID_KIND
    fake.lib.cuptiActivityEnable(fc.ACTIVITY_KIND_MEMORY2)
    fake.reset()
    assert not fake.activity_enabled(fc.ACTIVITY_KIND_MEMORY2)


def test_flush_needs_registered_callbacks(fake):
    assert fake.flush() == fc.CUPTI_ERROR_INVALID_OPERATION


def test_records_are_dropped_unless_enabled(fake):
    bufs = Buffers(fake)
    bufs.register()
    fake.emit_memory2(1, fc.MEMORY_KIND_DEVICE, 0x1000, 10)
    assert fake.flush() == 0
    assert bufs.completed == []


@pytest.mark.parametrize("version, rtype", [(130001, fc.ActivityMemory4), (130100, fc.ActivityMemory4),
                                            (28, fc.ActivityMemory3), (24, fc.ActivityMemory3)])
def test_memory2_records(fake, version, rtype):
    fake.set_version(version)
    bufs = Buffers(fake)
    bufs.register()
    fake.lib.cuptiActivityEnable(fc.ACTIVITY_KIND_MEMORY2)
    fake.set_device(1)
    addr = fake.alloc(fc.CBID_cuMemAlloc_v2, 4096)
    fake.emit_memory2(fc.MEMORY_OPERATION_TYPE_ALLOCATION, fc.MEMORY_KIND_DEVICE, addr, 4096,
                      device=1, timestamp=123, name="cuMemAlloc_v2", source="libtorch_cuda.so")
    fake.emit_memory2(fc.MEMORY_OPERATION_TYPE_RELEASE, fc.MEMORY_KIND_MANAGED, addr, 4096,
                      device=2, timestamp=456)
    assert fake.flush(fc.ACTIVITY_FLAG_FLUSH_FORCED) == 0
    (ctx, stream, size, valid, records, end_rc), = bufs.completed
    assert (ctx, stream, size) == (None, 0, 8 * 1024)
    assert valid == 2 * ctypes.sizeof(rtype)
    assert end_rc == fc.CUPTI_ERROR_MAX_LIMIT_REACHED  # what real CUPTI returns at the end
    a, r = records
    assert isinstance(a, rtype)
    assert (a.kind, a.memoryOperationType, a.memoryKind) == (49, 1, 3)
    assert (a.address, a.bytes, a.timestamp, a.deviceId, a.contextId) == (addr, 4096, 123, 1, 2)
    assert a.processId == os.getpid()
    assert a.name == b"cuMemAlloc_v2"
    assert a.correlationId > 0  # correlated with the last driver call on this thread
    assert (r.memoryOperationType, r.memoryKind, r.deviceId, r.timestamp) == (2, 5, 2, 456)
    assert r.name is None
    if rtype is fc.ActivityMemory4:
        assert (a.source, r.source) == (b"libtorch_cuda.so", None)
    assert fake.flush() == 0 and len(bufs.completed) == 1  # the queue was drained


def test_record_strings_live_until_reset(cfake):
    bufs = Buffers(cfake)
    bufs.register()
    cfake.lib.cuptiActivityEnable(fc.ACTIVITY_KIND_MEMORY2)
    name = "x" * 100
    cfake.emit_memory2(1, 3, 0x100, 1, name=name, source="lib.so")
    name = None  # the double keeps its own copy
    cfake.flush()
    rec, = bufs.records
    assert rec.name == b"x" * 100 and rec.source == b"lib.so"


def test_timestamp_zero_means_now(cfake):
    bufs = Buffers(cfake)
    bufs.register()
    cfake.lib.cuptiActivityEnable(fc.ACTIVITY_KIND_MEMORY2)
    before = time.monotonic_ns()
    cfake.emit_memory2(1, 3, 0x100, 1)
    cfake.flush()
    assert before <= bufs.records[0].timestamp <= time.monotonic_ns()


@pytest.mark.parametrize("size, max_records, per_buffer", [(300, 0, 2), (8192, 1, 1), (128, 0, 1)])
def test_flush_splits_across_buffers(cfake, size, max_records, per_buffer):
    bufs = Buffers(cfake, size=size, max_records=max_records)
    bufs.register()
    cfake.lib.cuptiActivityEnable(fc.ACTIVITY_KIND_MEMORY2)
    for i in range(5):
        cfake.emit_memory2(1, 3, 0x1000 * (i + 1), i + 1)
    assert cfake.flush() == 0
    counts = [len(c[4]) for c in bufs.completed]
    assert sum(counts) == 5 and max(counts) == per_buffer
    assert [r.bytes for r in bufs.records] == [1, 2, 3, 4, 5]
    assert all(c[3] == len(c[4]) * 128 for c in bufs.completed)


def test_no_buffer_drops_records(cfake):
    bufs = Buffers(cfake, null=True)
    bufs.register()
    cfake.lib.cuptiActivityEnable(fc.ACTIVITY_KIND_MEMORY2)
    cfake.emit_memory2(1, 3, 0x100, 1)
    cfake.emit_memory2(2, 3, 0x100, 1)
    assert cfake.flush() == 0
    dropped = c_size_t()
    assert cfake.lib.cuptiActivityGetNumDroppedRecords(None, 0, byref(dropped)) == 0
    assert dropped.value == 2 and bufs.completed == []
    cfake.reset()
    assert cfake.lib.cuptiActivityGetNumDroppedRecords(None, 0, byref(dropped)) == 0
    assert dropped.value == 0


def test_get_next_record_edge_cases(cfake):
    buf = (c_uint64 * 32)()
    p = ctypes.cast(buf, POINTER(c_uint8))
    rec = c_void_p()
    assert cfake.lib.cuptiActivityGetNextRecord(None, 0, byref(rec)) == fc.CUPTI_ERROR_INVALID_PARAMETER
    assert cfake.lib.cuptiActivityGetNextRecord(p, 0, byref(rec)) == fc.CUPTI_ERROR_MAX_LIMIT_REACHED
    ctypes.c_int.from_buffer(buf).value = fc.ACTIVITY_KIND_MEMORY2
    assert cfake.lib.cuptiActivityGetNextRecord(p, 64, byref(rec)) == fc.CUPTI_ERROR_INVALID_KIND  # cut short
    assert cfake.lib.cuptiActivityGetNextRecord(p, 128, byref(rec)) == 0
    assert rec.value == ctypes.addressof(buf)
    ctypes.c_int.from_buffer(buf).value = 7  # a kind the double never produces
    rec = c_void_p()
    assert cfake.lib.cuptiActivityGetNextRecord(p, 128, byref(rec)) == fc.CUPTI_ERROR_INVALID_KIND


def test_reset_clears_state(fake):
    sub = Subscriber(fake)
    sub.subscribe()
    sub.enable(fc.CBID_cuMemAlloc_v2)
    fake.lib.cuptiEnableDomain(1, sub.handle, 2)
    fake.lib.cuptiActivityEnable(fc.ACTIVITY_KIND_MEMORY2)
    fake.set_conflict("x")
    fake.set_subscribe_error(15)
    fake.set_version(28)
    fake.alloc(fc.CBID_cuMemAlloc_v2, 1)
    fake.emit_memory2(1, 3, 0x100, 1)
    fake.reset()
    assert not fake.is_subscribed()
    assert fake.enabled_count() == fake.domain_enable_calls() == fake.callback_count() == 0
    assert not fake.activity_enabled(fc.ACTIVITY_KIND_MEMORY2)
    assert fake.version() == 130001
    assert fake.flush() == fc.CUPTI_ERROR_INVALID_OPERATION  # buffer callbacks forgotten too
    assert Subscriber(fake).subscribe() == 0  # neither conflict nor error remain


# ---- build ----------------------------------------------------------------------------------


def test_build_is_cached_and_concurrency_safe(tmp_path):
    code = "import sys; sys.path.insert(0, sys.argv[1]); import fake_cupti; print(fake_cupti.build(sys.argv[2]))"
    procs = [
        subprocess.Popen([sys.executable, "-c", code, str(Path(__file__).parents[1]), str(tmp_path)],
                         stdout=subprocess.PIPE, text=True)
        for _ in range(4)
    ]
    paths = {p.communicate()[0].strip() for p in procs}
    assert all(p.returncode == 0 for p in procs)
    path, = paths
    assert Path(path).is_file() and Path(path).name == "libcupti_fake.so"
    assert [f.name for f in Path(path).parent.iterdir()] == ["libcupti_fake.so"]  # no temp files left
    mtime = Path(path).stat().st_mtime_ns
    assert fc.build(tmp_path) == path and Path(path).stat().st_mtime_ns == mtime
    fc.FakeCupti(path).reset()  # loadable
