"""What the autograd graph keeps alive, through saved-tensor hooks.

Every tensor an autograd graph saves for backward passes through the pack
hook at the moment it is saved, on the forward line that saved it. The hook
records the tensor's storage (bytes, device, dtype, shape), the user's line
and the time, and returns a small :class:`_Packed` wrapper that the graph
then holds in place of the tensor; the unpack hook, called when backward
needs it, returns the tensor. So:

* a record is *graph-resident* while its wrapper is alive (the graph that
  holds it has not been freed or run);
* a wrapper still alive after a test returned and ``gc.collect()`` ran means
  a graph made inside the test is still reachable: a graph leak;
* the unpack hook runs on the thread that executes the backward node (the
  autograd engine's thread for CUDA tensors), which is where the PyTorch
  integration labels that thread with the node and its forward line.

This works on any device, CPU included.
"""

from __future__ import annotations

import sys
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

from .._frames import frames as _default_filter
from .._snapshot import Frame
from .._units import format_size

__all__ = ["SavedRecord", "GraphRecorder"]

_MEMVIZ_DIR = __file__.rsplit("/", 2)[0]


@dataclass
class SavedRecord:
    """One tensor saved by an autograd graph for backward."""

    nbytes: int
    device: str
    dtype: str
    shape: tuple
    data_ptr: int
    line: Optional[Frame]  # the user's line that saved it
    timestamp_ns: int
    seq: int

    def __str__(self) -> str:
        where = f"{self.line.filename}:{self.line.lineno}" if self.line else "<no Python frame>"
        return (f"{where}: {format_size(self.nbytes)} {self.dtype}{list(self.shape)} on "
                f"{self.device} held by the autograd graph")


class _Packed:
    """What the graph holds instead of the tensor (weak-referenceable)."""

    __slots__ = ("tensor", "record", "__weakref__")

    def __init__(self, tensor, record):
        self.tensor = tensor
        self.record = record


def user_line(depth: int = 2, flt=None) -> Optional[Frame]:
    """The innermost non-library frame of the calling thread (cheap)."""
    flt = flt or _default_filter
    f = sys._getframe(1)
    for _ in range(depth - 1):
        if f.f_back is None:
            break
        f = f.f_back
    first = None
    while f is not None:
        code = f.f_code
        fn = code.co_filename
        if first is None:
            first = f
        if not fn.startswith(_MEMVIZ_DIR) and not flt.is_library(fn):
            return Frame(fn, f.f_lineno, code.co_qualname if hasattr(code, "co_qualname") else code.co_name)
        f = f.f_back
    if first is not None:
        return Frame(first.f_code.co_filename, first.f_lineno, first.f_code.co_name)
    return None


class GraphRecorder:
    """Records what autograd graphs save, while started.

    ``on_unpack(record)`` (optional) is called in the unpack hook, on the
    thread running the backward node, with the GIL held.
    """

    def __init__(self, on_unpack: Optional[Callable[[SavedRecord], None]] = None, frame_filter=None):
        self.on_unpack = on_unpack
        self.frame_filter = frame_filter
        self._live: Dict[int, "weakref.ref[_Packed]"] = {}
        self._lock = threading.Lock()
        self._seq = 0
        self._ctx = None

    # -- hooks (called by autograd, with the GIL) --------------------------

    def _pack(self, tensor):
        try:
            storage = tensor.untyped_storage()
            nbytes = storage.nbytes()
            ptr = storage.data_ptr()
        except Exception:  # noqa: BLE001 - sparse, meta, tensor subclasses
            nbytes, ptr = tensor.numel() * tensor.element_size(), 0
        with self._lock:
            self._seq += 1
            seq = self._seq
        rec = SavedRecord(nbytes, str(tensor.device), str(tensor.dtype).replace("torch.", ""),
                          tuple(tensor.shape), ptr, user_line(2, self.frame_filter),
                          time.monotonic_ns(), seq)
        packed = _Packed(tensor, rec)
        live = self._live

        def gone(_ref, seq=seq, live=live):
            live.pop(seq, None)

        live[seq] = weakref.ref(packed, gone)
        return packed

    def _unpack(self, packed):
        if type(packed) is not _Packed:  # saved before we started
            return packed
        if self.on_unpack is not None:
            try:
                self.on_unpack(packed.record)
            except Exception:  # noqa: BLE001 - never break the user's backward
                pass
        return packed.tensor

    # -- control --------------------------------------------------------------

    def start(self) -> "GraphRecorder":
        import torch

        if self._ctx is not None:
            return self
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._ctx.__enter__()
        return self

    def stop(self) -> None:
        if self._ctx is not None:
            ctx, self._ctx = self._ctx, None
            ctx.__exit__(None, None, None)

    @property
    def running(self) -> bool:
        return self._ctx is not None

    # -- reading --------------------------------------------------------------

    def resident(self) -> List[SavedRecord]:
        """Tensors that autograd graphs still hold, oldest first; a storage
        saved several times is listed once."""
        out, seen = [], set()
        for seq in sorted(list(self._live)):
            ref = self._live.get(seq)
            p = ref() if ref is not None else None
            if p is None:
                continue
            key = (p.record.device, p.record.data_ptr) if p.record.data_ptr else ("seq", seq)
            if key in seen:
                continue
            seen.add(key)
            out.append(p.record)
        return out

    def mark(self) -> int:
        """A point to compare against with :meth:`resident_since`."""
        return self._seq

    def resident_since(self, mark: int) -> List[SavedRecord]:
        """Graph-resident tensors saved after ``mark``."""
        return [r for r in self.resident() if r.seq > mark]

    @staticmethod
    def autograd_mark() -> int:
        """The calling thread's autograd sequence number now: nodes created
        later have larger numbers (used to find graphs made after a point)."""
        import torch

        with torch.enable_grad():
            return torch.ones(1, requires_grad=True).mul(1).grad_fn._sequence_nr()

    @staticmethod
    def roots_since(seq_nr: int, limit: int = 20) -> list:
        """Live tensors whose grad_fn was created after ``seq_nr``: the tensors
        through which a graph made after that point is still reachable."""
        import gc

        import torch

        out = []
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # isinstance() on deprecated torch aliases warns
            objs = gc.get_objects()
            for obj in objs:
                if isinstance(obj, torch.Tensor) and obj.grad_fn is not None:
                    try:
                        if obj.grad_fn._sequence_nr() <= seq_nr:
                            continue
                    except Exception:  # noqa: BLE001
                        continue
                    # Tensors a graph saved are inside it, not what keeps it alive.
                    if all(isinstance(r, _Packed) or r is objs for r in gc.get_referrers(obj)):
                        continue
                    out.append(obj)
        del objs
        # Keep roots: drop tensors that are inputs of another kept tensor's graph
        # is expensive; the largest sequence numbers are the outputs.
        out.sort(key=lambda t: -t.grad_fn._sequence_nr())
        return out[:limit]


def describe_holders(tensor, limit: int = 3, exclude=()) -> List[str]:
    """Who refers to ``tensor``: 'list `history` in module test_x' and the like.

    ``exclude``: containers of the caller's own (e.g. its list of roots)."""
    import gc
    import types

    skip = {id(x) for x in exclude}
    out = []
    for ref in gc.get_referrers(tensor):
        if id(ref) in skip or isinstance(ref, (_Packed, types.CellType)):
            continue
        if isinstance(ref, types.FrameType):
            code = ref.f_code
            names = [k for k, v in ref.f_locals.items() if v is tensor]
            out.append(f"local `{names[0] if names else '?'}` of {code.co_qualname if hasattr(code, 'co_qualname') else code.co_name}"
                       f" ({code.co_filename}:{ref.f_lineno})")
        elif isinstance(ref, (list, dict, set, tuple)):
            owner = _owner_name(ref)
            out.append(f"{type(ref).__name__} {owner}" if owner else f"a {type(ref).__name__}")
        else:
            out.append(f"a {type(ref).__name__} object")
        if len(out) >= limit:
            break
    return out


def _owner_name(container) -> str:
    import gc
    import types

    for ref in gc.get_referrers(container):
        if isinstance(ref, dict):
            for k, v in ref.items():
                if v is container and isinstance(k, str):
                    mod = ref.get("__name__") if isinstance(ref.get("__name__"), str) else None
                    return f"`{k}`" + (f" in module {mod}" if mod else "")
        elif isinstance(ref, types.FrameType):
            for k, v in ref.f_locals.items():
                if v is container:
                    return f"`{k}` (a local of {ref.f_code.co_name})"
    return ""
