"""Tensor capture under PyTorch's native caching allocator ("the allocator
route"), attached at any time after ``import torch`` and detached leaving
PyTorch as it was.

The C side (src/allocator.h) swaps the allocator object's vtable for a copy
with a few wrapped slots. Which slots and which words of a DataPtr mean what
is probed here, once per process, with tripwires on the copy, and checked
against PyTorch's own answers (a tensor's data_ptr, memory_allocated(),
raw_alloc/raw_delete through caching_allocator_alloc/delete, a stream use
seen by memory_snapshot()) before anything is recorded. Any failed check
detaches and leaves memviz on segments, with the reason.

The probe talks to PyTorch through an *answers* object (TorchAnswers), so the
CPU tests drive the same probe and the same C code against a stand-in
library shaped like PyTorch's allocator.
"""

from __future__ import annotations

import ctypes
import os
import threading
from typing import Any, Dict, List, Optional, Tuple

import memviz._core as _core

__all__ = ["HOLDER", "TorchAnswers", "Route", "attach", "detach", "last_route"]

#: c10::cuda::CUDACachingAllocator::allocator: std::atomic<CUDAAllocator*>
HOLDER = "_ZN3c104cuda20CUDACachingAllocator9allocatorE"
_CUDA = 1  # c10::DeviceType::CUDA
_FIRST_PROBED_SLOT = 5  # 0-1 destructors, 2 allocate, 3 is_simple_data_ptr, 4 raw_deleter
_REPEAT = 3


class ProbeFailed(Exception):
    """A check of the allocator route failed: the reason is the message."""


class TorchAnswers:
    """What the probe asks PyTorch (see the module docstring)."""

    def __init__(self, torch, device: Optional[int] = None) -> None:
        self.torch = torch
        libdir = os.path.join(os.path.dirname(torch.__file__), "lib")
        self.library = os.path.join(libdir, "libc10_cuda.so")
        self.base_library = os.path.join(libdir, "libc10.so")
        self.device = torch.cuda.current_device() if device is None else device
        self._side = None

    def holder(self) -> int:
        # The library PyTorch loaded (RTLD_NOLOAD: never a second copy), in its own
        # symbol scope as it is (RTLD_LOCAL: its symbols are not made global).
        lib = ctypes.CDLL(self.library, mode=getattr(os, "RTLD_NOLOAD", 0) | ctypes.RTLD_LOCAL)
        return ctypes.addressof(ctypes.c_void_p.in_dll(lib, HOLDER))

    def alloc(self, n: int):
        t = self.torch.empty(n, dtype=self.torch.uint8, device=f"cuda:{self.device}")
        return t, t.data_ptr()

    def allocated(self) -> int:
        # PyTorch's own counter, read from C: memory_allocated() answers 0 until
        # torch.cuda.is_initialized(), which is still False while PyTorch's lazy
        # init runs the calls queued on it (where this probe runs when tracking
        # started before CUDA was first used).
        stats = getattr(self.torch._C, "_cuda_memoryStats", None)
        if stats is None:
            return self.torch.cuda.memory_allocated(self.device)
        return int(stats(self.device)["allocated_bytes"]["all"]["current"])  # a nested dict

    def raw_alloc(self, n: int) -> int:
        return self.torch.cuda.caching_allocator_alloc(n, self.device)

    def raw_free(self, ptr: int) -> None:
        self.torch.cuda.caching_allocator_delete(ptr)

    def _stream(self):
        if self._side is None:
            self._side = self.torch.cuda.Stream(self.device)
        return self._side

    def record_stream(self, handle) -> None:
        handle.record_stream(self._stream())

    def view(self):
        """PyTorch's own segments and blocks now (memviz.model.segments)."""
        from memviz.model.segments import torch_view
        return torch_view(self.torch)

    def snapshot(self):
        """torch.cuda.memory_snapshot(), as PyTorch gives it."""
        return self.torch.cuda.memory.memory_snapshot()

    def device_used(self) -> int:
        """Bytes in use on the device, by the driver's count (every process's)."""
        free, total = self.torch.cuda.mem_get_info(self.device)
        return int(total) - int(free)

    def stream_use_holds(self, make) -> bool:
        """Whether a block whose use on another stream was recorded (by
        ``make``'s tensor) waits for that stream once freed, as PyTorch
        promises: memory_snapshot() shows it "active_pending_free"."""
        torch = self.torch
        side = self._stream()
        with torch.cuda.stream(side):
            torch.cuda._sleep(2_000_000)  # keep the side stream busy: the event stays pending
        handle, addr = make()
        handle.record_stream(side)
        del handle
        state = None
        for seg in torch.cuda.memory.memory_snapshot():
            for b in seg.get("blocks", ()):
                if b["address"] == addr:
                    state = b.get("state")
        side.synchronize()
        return state == "active_pending_free"


class Route:
    """How memviz sees PyTorch's CUDA memory in one tracker: ``route`` is
    "allocator" (every block, tensor-level), "cudaMallocAsync" (PyTorch on
    the driver's pool: every tensor is a driver call) or "segments" (only the
    caching allocator's segments), with ``reason`` when not "allocator"."""

    def __init__(self, route: Optional[str], reason: Optional[str] = None, **detail) -> None:
        self.route, self.reason, self.detail = route, reason, detail

    def as_dict(self) -> Dict[str, Any]:
        d = {"route": self.route, "reason": self.reason}
        d.update(self.detail)
        return d

    def __repr__(self) -> str:
        return f"<Route {self.route}{' (' + self.reason + ')' if self.reason else ''}>"


_lock = threading.Lock()
_probed: Optional[Dict[str, Any]] = None  # the committed layout, once found
_failed: Optional[str] = None             # why the probe failed in this process
_last: Optional[Route] = None


def last_route() -> Optional[Route]:
    return _last


def _set_last(route: Route) -> Route:
    global _last
    _last = route
    return route


def _library_of(addr: int) -> Optional[str]:
    class _Info(ctypes.Structure):
        _fields_ = [("fname", ctypes.c_char_p), ("fbase", ctypes.c_void_p),
                    ("sname", ctypes.c_char_p), ("saddr", ctypes.c_void_p)]
    libc = ctypes.CDLL(None)
    libc.dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_Info)]
    info = _Info()
    if not addr or not libc.dladdr(ctypes.c_void_p(addr), ctypes.byref(info)) or not info.fname:
        return None
    return os.path.realpath(os.fsdecode(info.fname))


def _same(path_a: Optional[str], path_b: str) -> bool:
    return path_a is not None and os.path.realpath(path_a) == os.path.realpath(path_b)


def _layout(words: Tuple[int, ...], data: int, device: int, library: str) -> Tuple[int, int, int, int]:
    """(data, deleter, ctx, device) word indices of a DataPtr, from one
    sample whose data pointer is known."""
    data_w = [i for i, w in enumerate(words) if w == data]
    if not data_w:
        raise ProbeFailed(f"the DataPtr allocate() returned does not hold the tensor's address "
                          f"({[hex(w) for w in words]} vs {data:#x})")
    dev_word = _CUDA | (device << 8)
    device_w = [i for i, w in enumerate(words) if w & 0xFFFF == dev_word and w >> 16 == 0]
    deleter_w = [i for i, w in enumerate(words) if w and w != data and _same(_library_of(w), library)]
    if len(device_w) != 1 or len(deleter_w) != 1:
        raise ProbeFailed(f"the DataPtr's device and deleter words are not where memviz can tell "
                          f"({[hex(w) for w in words]})")
    # For this allocator the context is the data pointer itself (the
    # allocator's free() takes it): two words hold the address, and which
    # is which cannot matter while they are equal (checked per block by
    # nothing else: the deleter gets the context, the store the address).
    if len(data_w) != 2:
        raise ProbeFailed("the DataPtr's context is not its data pointer")
    return data_w[0], deleter_w[0], data_w[1], device_w[0]


def _tripped(answers, action, nslots: int) -> List[int]:
    """Slots (from _FIRST_PROBED_SLOT on) called exactly _REPEAT times while
    ``action`` ran _REPEAT times, with tripwires on all of them."""
    _core.allocator_trip(_FIRST_PROBED_SLOT, nslots, True)
    try:
        before = _core.allocator_hits()
        for _ in range(_REPEAT):
            action()
        after = _core.allocator_hits()
    finally:
        _core.allocator_trip(_FIRST_PROBED_SLOT, nslots, False)
    return [i for i in range(_FIRST_PROBED_SLOT, nslots) if after[i] - before[i] == _REPEAT]


def _probe(answers) -> Dict[str, Any]:
    """Find the layout (vtable attached by the caller, nothing recorded yet)."""
    state = _core.allocator_state()
    nslots = state["slots"]
    if not _same(_library_of(_core.allocator_entry(2)), answers.library):
        raise ProbeFailed("slot 2 of the allocator's vtable (allocate) is not PyTorch's "
                          "native caching allocator")
    if not _same(_library_of(_core.allocator_entry(3)), answers.base_library):
        raise ProbeFailed("slot 3 of the allocator's vtable is not c10::Allocator's "
                          "is_simple_data_ptr: the vtable is not laid out as memviz expects")
    _core.allocator_sample(True)
    handle, data = answers.alloc(4096)
    words = _core.allocator_sample(False)
    del handle
    if words is None:
        raise ProbeFailed("allocating a tensor did not call the allocator's allocate()")
    data_w, deleter_w, ctx_w, device_w = _layout(words, data, answers.device, answers.library)
    if _core.allocator_call_raw_deleter() != words[deleter_w]:
        raise ProbeFailed("the allocator's raw_deleter() is not the deleter of its DataPtrs")
    held = [answers.alloc(4096)[0] for _ in range(_REPEAT)]
    streams = _tripped(answers, lambda: answers.record_stream(held.pop()), nslots)
    if not 1 <= len(streams) <= 2:
        raise ProbeFailed(f"recordStream could not be told among the allocator's slots ({streams})")
    ptrs: List[int] = []
    raw_alloc = _tripped(answers, lambda: ptrs.append(answers.raw_alloc(4096)), nslots)
    raw_delete = _tripped(answers, lambda: answers.raw_free(ptrs.pop()), nslots)
    while ptrs:
        answers.raw_free(ptrs.pop())
    # A slot both calls go through (PyTorch asks initialized() on each) is neither.
    common = set(raw_alloc) & set(raw_delete)
    raw_alloc = [s for s in raw_alloc if s not in common]
    raw_delete = [s for s in raw_delete if s not in common]
    if len(raw_alloc) != 1 or len(raw_delete) != 1 or set(raw_alloc) & set(raw_delete) \
            or set(raw_alloc + raw_delete) & set(streams):
        raise ProbeFailed(f"raw_alloc_with_stream/raw_delete could not be told among the "
                          f"allocator's slots ({raw_alloc}, {raw_delete})")
    rs = (streams + [-1])[:2]
    return {"words": (data_w, deleter_w, ctx_w, device_w), "record_stream": tuple(rs),
            "raw_alloc": raw_alloc[0], "raw_delete": raw_delete[0], "slots": nslots}


def _commit(layout: Dict[str, Any]) -> None:
    dw, lw, cw, vw = layout["words"]
    _core.allocator_commit(dw, lw, cw, vw, layout["record_stream"], layout["raw_alloc"],
                           layout["raw_delete"])


def _verify(answers) -> None:
    """End to end, recording: the bytes memviz sees against PyTorch's count,
    raw memory both ways, and a stream use that still reaches PyTorch."""
    dev = answers.device
    for attempt in range(3):  # another thread allocating meanwhile can move the counts
        seen0 = _core.block_totals().get(dev, {}).get("current", 0)
        torch0 = answers.allocated()
        held = [answers.alloc(n) for n in (4096, 8192, 1536)]
        raw = answers.raw_alloc(2048)
        seen1 = _core.block_totals().get(dev, {}).get("current", 0)
        torch1 = answers.allocated()
        answers.raw_free(raw)
        held.clear()
        seen2 = _core.block_totals().get(dev, {}).get("current", 0)
        torch2 = answers.allocated()
        if seen1 - seen0 == torch1 - torch0 == 4096 + 8192 + 1536 + 2048 and \
                seen2 - seen0 == torch2 - torch0 == 0:
            break
    else:
        raise ProbeFailed(f"memviz saw {seen1 - seen0} B allocated and {seen1 - seen2} B freed where "
                          f"PyTorch counted {torch1 - torch0} B and {torch1 - torch2} B")
    if not answers.stream_use_holds(lambda: answers.alloc(4096)):
        raise ProbeFailed("a stream use recorded on a tensor memviz saw did not reach PyTorch")


def attach(answers) -> Route:
    """Attach the allocator route (probing it first in this process).
    Needs capture running (the check records). Returns the Route. What the
    probe and its check allocate is memviz's own (``_core.own``): never on a
    user's line."""
    was = _core.own(True)
    try:
        return _attach(answers)
    finally:
        _core.own(was)


def _attach(answers) -> Route:
    global _probed, _failed
    if not _core.allocator_state()["supported"]:
        return _set_last(Route("segments", "the allocator route needs x86-64 Linux with glibc"))
    if os.environ.get("MEMVIZ_PYTORCH_ROUTE", "").strip().lower() == "segments":
        return _set_last(Route("segments", "MEMVIZ_PYTORCH_ROUTE=segments"))
    with _lock:
        if _failed is not None:
            return _set_last(Route("segments", _failed))
        if _core.allocator_state()["attached"]:  # by another (running) tracker: it owns the route
            return _last or Route("allocator", None)
        try:
            _core.allocator_attach(answers.holder())
        except (OSError, ValueError, AttributeError, RuntimeError) as e:
            _failed = f"cannot attach to PyTorch's allocator: {e}"
            return _set_last(Route("segments", _failed))
        try:
            if _probed is None:
                layout = _probe(answers)
                _commit(layout)
                _verify(answers)
                _probed = layout
        except ProbeFailed as e:
            _core.allocator_detach()
            _failed = str(e)
            return _set_last(Route("segments", _failed))
        except Exception as e:  # noqa: BLE001 - never the user's error: fall back
            _core.allocator_detach()
            _failed = f"probing PyTorch's allocator failed: {type(e).__name__}: {e}"
            return _set_last(Route("segments", _failed))
    return _set_last(Route("allocator", None, slots=_probed["slots"], record_stream=_probed["record_stream"],
                           raw=(_probed["raw_alloc"], _probed["raw_delete"])))


def detach() -> None:
    _core.allocator_detach()


def _reset_for_tests() -> None:
    """Forget the probe's result, here and in C (tests probe several
    stand-in allocators; every block made while attached must be gone)."""
    global _probed, _failed, _last
    with _lock:
        _core.allocator_detach()
        _core.allocator_reset()
        _probed = _failed = _last = None
