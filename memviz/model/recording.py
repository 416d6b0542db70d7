"""What a recording offers its readers: :class:`Recording`, the reading API
that a live :class:`~memviz.Tracker` and a :class:`~memviz.LoadedTrace` (a
trace file read back) both implement, so that the report, the analyses and
the exports read either one the same way; and :class:`TotalsReads`, the
readings both derive the same way from ``totals()``.

Imports the bottom floor and memviz/model/snapshot.py only
(docs/architecture.md: the model floor).
"""

from __future__ import annotations

import inspect
from typing import Any, Dict, Iterator, List, Mapping, Optional, Protocol, Sequence, Tuple, runtime_checkable

import memviz._args as _args
from memviz._errors import InvalidArgument
from memviz.model.failures import FailedAllocation
from memviz.model.snapshot import Snapshot
from memviz.model.threads import _python_thread_names, _thread_info

__all__ = ["Recording", "TotalsReads", "thread_table", "check_peak", "PEAKS", "size_note"]

_MISSING = object()



PEAKS = ("device", "tensor")


def size_note(stream_frees: int) -> Optional[str]:
    """What a snapshot says when PyTorch's block sizes could not all be
    followed: blocks freed while another stream's use was recorded on them
    (recordStream) go back to PyTorch only once that stream is done, which
    memviz does not see; it takes them back at once."""
    if not stream_frees:
        return None
    return (f"{stream_frees:,} block(s) were freed while another stream's use was recorded on them "
            "(recordStream); PyTorch takes such a block back only when that stream is done, memviz "
            "at once, so a block made soon after next to one may be shown smaller than PyTorch's")


def check_peak(peak: str) -> str:
    """``peak=`` of peak_snapshot(): "device" or "tensor"."""
    if peak not in PEAKS:
        raise InvalidArgument(f"peak_snapshot(peak={peak!r}): say peak=\"device\" (the moment the "
                              "device held the most) or peak=\"tensor\" (PyTorch's blocks' peak, as "
                              "max_memory_allocated())")
    return peak


class _StaticCheck(type(Protocol)):  # type: ignore[misc]
    """isinstance() looks the members up without running them (as Python
    3.12 does): ``failures`` is a property, and a tracker that never started
    raises NotTracking when it is read."""

    def __instancecheck__(cls, obj: Any) -> bool:
        if cls is not Recording:
            return super().__instancecheck__(obj)
        return all(inspect.getattr_static(obj, name, _MISSING) is not _MISSING for name in _MEMBERS)


@runtime_checkable
class Recording(Protocol, metaclass=_StaticCheck):
    """A recording of allocations: a running or stopped Tracker, or a loaded trace.

    Attributes:
        is_live: True for a Tracker (its process is this one: PyTorch's and
            the device's figures can be asked now), False for a loaded trace.
        steps: the step records (memviz.StepRecord), oldest first.
        failures: the allocations the driver refused, oldest first.
    """

    is_live: bool
    steps: List[Any]

    @property
    def failures(self) -> List[FailedAllocation]: ...

    def snapshot(self) -> Snapshot:
        """The allocations live now (a Tracker) or at the end (a trace)."""

    def peak_snapshot(self, device: Optional[int] = None) -> Snapshot:
        """The allocations live at a device's peak; each device at its own with None."""

    def totals(self) -> Dict[int, Dict[str, int]]:
        """Per device (-1: pinned host memory): current, peak, allocs, frees, failed, ..."""

    def timeline(self) -> List[tuple]:
        """(timestamp_ns, device, live bytes) points; bounded, peaks kept.
        Live bytes are the totals': each byte once, so PyTorch's blocks
        (kind "block"), which lie inside the segments the totals hold, are
        no change (a Tracker's store and a trace's replay alike)."""

    def events(self) -> Optional[Iterator[Any]]:
        """Every allocation event in order, or None where none were kept."""

    def capture_info(self) -> Dict[str, Any]:
        """What the recording was captured with, and memviz's own counters."""

    def threads(self) -> Dict[int, Tuple[Optional[int], Optional[int], str]]:
        """{thread index: (native id, ident, name)} of the threads that allocated."""

    def current_bytes(self, device: Optional[int] = None) -> int:
        """Bytes live now (or at the end); all devices, not host memory, with None."""

    def peak_bytes(self, device: Optional[int] = None) -> int:
        """Highest live bytes of a device; with None, the largest device peak."""


#: what isinstance(x, Recording) looks for: the Protocol's own members
_MEMBERS = tuple(Recording.__annotations__) + tuple(
    name for name in vars(Recording) if not name.startswith("_") and name not in Recording.__annotations__)


class TotalsReads:
    """Mixin: current_bytes() and peak_bytes(), read from ``self.totals()``
    (a Tracker's and a loaded trace's alike)."""

    def totals(self) -> Dict[int, Dict[str, int]]:  # pragma: no cover - the recording's own
        raise NotImplementedError

    def current_bytes(self, device: Optional[int] = None) -> int:
        """Bytes live now (a trace: at the end); all devices (not host memory)
        when device is None."""
        _args.whole(device, "current_bytes(device=...)", none=True)
        t = self.totals()
        if device is not None:
            return t.get(device, {}).get("current", 0)
        return sum(v.get("current", 0) for d, v in t.items() if d >= 0)

    def peak_bytes(self, device: Optional[int] = None) -> int:
        """Highest live bytes of a device; with None, the largest device peak."""
        _args.whole(device, "peak_bytes(device=...)", none=True)
        t = self.totals()
        if device is not None:
            return t.get(device, {}).get("peak", 0)
        return max((v.get("peak", 0) for d, v in t.items() if d >= 0), default=0)


def thread_table(raw: Mapping[int, Sequence]) -> Dict[int, Tuple[Optional[int], Optional[int], str]]:
    """The C core's thread table (``{idx: (native id, ident, native name[,
    serial])}``) as a recording's threads(): ``{idx: (native id, ident,
    name)}`` with the names a snapshot shows now (Python's, where known)."""
    py = _python_thread_names()
    return {idx: (e.native_id, e.ident, _thread_info(idx, e, py).name) for idx, e in raw.items()}
