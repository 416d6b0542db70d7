"""``Snapshot.filter_traces()`` filters, shaped like tracemalloc's.

A :class:`Filter` names a set of allocations: made at a file (an
:mod:`fnmatch` pattern) and, optionally, a line, on a device (tracemalloc's
"domain" is memviz's CUDA device index, ``-1`` for pinned host memory). An
inclusive filter keeps that set, an exclusive one drops it.
:meth:`Snapshot.filter_traces` keeps an allocation when at least one
inclusive filter keeps it (or there is none) and no exclusive filter drops it,
as :meth:`tracemalloc.Snapshot.filter_traces` does.

Which frame is matched: tracemalloc matches the most recent frame; memviz
matches the *user's* frame (:attr:`Traceback.user_frame`, the frame
``statistics("lineno")`` groups by), so ``Filter(True, "*/train.py", 42)``
keeps exactly what ``statistics("lineno")`` lists as ``train.py:42``. With
``all_frames=True`` every frame of the traceback is tried, as in tracemalloc.
An allocation made by a thread with no Python frames matches through the
frame the statistics show it under (memviz/model/lines.py): inside an
autograd node, its forward line (so ``Filter(True, "*/train.py", 42)`` keeps
``train.py:42`` and its backward lines ``train.py:42 (backward: ...)``), else
the pseudo-frame ``<thread NAME>`` (line 0); with ``all_frames=True`` the
thread's pseudo-frame is tried too.
"""

from __future__ import annotations

import fnmatch
import os
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

from memviz._args import bad_type, flag, whole

__all__ = ["Filter", "DomainFilter", "filter_allocations"]


def _normalize(filename: str) -> str:
    filename = os.path.normcase(filename)
    return filename[:-1] if filename.endswith(".pyc") else filename


class _BaseFilter:
    __slots__ = ("_inclusive",)

    def __init__(self, inclusive: bool) -> None:
        self._inclusive = flag(inclusive, f"{type(self).__name__}(inclusive)")

    @property
    def inclusive(self) -> bool:
        """True: keep the allocations the filter names; False: drop them."""
        return self._inclusive

    def _names(self, frames: Optional[Tuple[Any, ...]], device: int) -> bool:
        raise NotImplementedError

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_"):
            object.__setattr__(self, name, value)
        else:
            raise AttributeError(f"memviz.{type(self).__name__} is read-only; make a new one")

    def _key(self) -> tuple:
        raise NotImplementedError

    def __eq__(self, other: Any) -> bool:
        return type(other) is type(self) and other._key() == self._key()

    def __hash__(self) -> int:
        return hash((type(self).__name__,) + self._key())


class Filter(_BaseFilter):
    """Keep (``inclusive=True``) or drop the allocations made at a file and line.

    Args:
        inclusive: keep the allocations that match (True) or drop them (False).
        filename_pattern: an :mod:`fnmatch` pattern of the file name
            (``"*/train.py"``, ``"/home/me/proj/*"``); ``.pyc`` is read as ``.py``.
        lineno: the line; None: any line of the file.
        all_frames: try every frame of the traceback, not only the user's frame.
        domain: the CUDA device index (``-1``: pinned host memory); None: any.
    """

    __slots__ = ("_pattern", "_lineno", "_all_frames", "_domain")

    def __init__(self, inclusive: bool, filename_pattern: str, lineno: Optional[int] = None,
                 all_frames: bool = False, domain: Optional[int] = None) -> None:
        super().__init__(inclusive)
        if not isinstance(filename_pattern, str):
            raise bad_type("Filter(filename_pattern)", filename_pattern,
                           "a file name or an fnmatch pattern as a str, e.g. '*/train.py'")
        self._pattern = _normalize(filename_pattern)
        self._lineno = whole(lineno, "Filter(lineno=...)", 0, none=True)
        self._all_frames = flag(all_frames, "Filter(all_frames=...)")
        self._domain = whole(domain, "Filter(domain=...)", -1, none=True)

    filename_pattern = property(lambda self: self._pattern, doc="The file name pattern (normalised).")
    lineno = property(lambda self: self._lineno, doc="The line, or None for any line.")
    all_frames = property(lambda self: self._all_frames, doc="Whether every frame is tried.")
    domain = property(lambda self: self._domain, doc="The device index, or None for any device.")

    def _frame_matches(self, frame: Any) -> bool:
        if not fnmatch.fnmatch(_normalize(frame.filename), self._pattern):
            return False
        return self._lineno is None or frame.lineno == self._lineno

    def _names(self, frames: Tuple[Any, ...], device: int) -> bool:
        # frames: the user's frame alone, or every frame with all_frames
        if self._domain is not None and device != self._domain:
            return False
        return any(self._frame_matches(f) for f in frames)

    def _key(self) -> tuple:
        return (self._inclusive, self._pattern, self._lineno, self._all_frames, self._domain)

    def __repr__(self) -> str:
        return (f"memviz.Filter({self._inclusive!r}, {self._pattern!r}, lineno={self._lineno!r}, "
                f"all_frames={self._all_frames!r}, domain={self._domain!r})")


class DomainFilter(_BaseFilter):
    """Keep (``inclusive=True``) or drop the allocations of one device.

    ``domain`` is the CUDA device index (``-1``: pinned host memory), as
    tracemalloc's ``DomainFilter`` takes a domain."""

    __slots__ = ("_domain",)

    def __init__(self, inclusive: bool, domain: int) -> None:
        super().__init__(inclusive)
        self._domain = whole(domain, "DomainFilter(domain)", -1)

    domain = property(lambda self: self._domain, doc="The device index.")

    def _names(self, frames: Optional[Tuple[Any, ...]], device: int) -> bool:
        return device == self._domain

    def _key(self) -> tuple:
        return (self._inclusive, self._domain)

    def __repr__(self) -> str:
        return f"memviz.DomainFilter({self._inclusive!r}, {self._domain!r})"


def _checked(filters: Any) -> List[_BaseFilter]:
    if isinstance(filters, _BaseFilter) or isinstance(filters, (str, bytes)) or not isinstance(filters, Iterable):
        raise bad_type("Snapshot.filter_traces(filters)", filters,
                       "a list of memviz.Filter / memviz.DomainFilter objects: "
                       "for one filter f, call filter_traces([f])")
    out = list(filters)
    for f in out:
        if not isinstance(f, _BaseFilter):
            raise bad_type("Snapshot.filter_traces(filters)", f,
                           "memviz.Filter or memviz.DomainFilter objects (for a function of an "
                           "Allocation, use Snapshot.filter(predicate))")
    return out


def filter_allocations(allocations: Iterable[Any], filters: Any, pick: Callable[[Any], Any]) -> List[Any]:
    """The allocations that ``filters`` keep; ``pick(traceback)`` is the
    snapshot's choice of the user's frame."""
    flts = _checked(filters)
    allocations = list(allocations)
    if not flts:
        return allocations
    include = [f for f in flts if f.inclusive]
    exclude = [f for f in flts if not f.inclusive]
    from memviz.model.lines import pseudo_frame, thread_frame

    frames_of: Dict[Any, Tuple[tuple, tuple]] = {}  # traceback (or pseudo-frame) -> (user frame, all frames)

    def frames(a: Any) -> Tuple[tuple, tuple]:
        tb = a.traceback
        key = id(tb) if tb else (pseudo_frame(a), a.thread.name)
        got = frames_of.get(key)
        if got is None:
            if tb:
                got = ((pick(tb),), tuple(tb))
            else:
                pseudo, thread = key[0], thread_frame(key[1])
                got = ((pseudo,), tuple(dict.fromkeys((pseudo, thread))))
            frames_of[key] = got
        return got

    def names(f: _BaseFilter, a: Any) -> bool:
        user, every = frames(a)
        return f._names(every if getattr(f, "_all_frames", False) else user, a.device)

    return [a for a in allocations
            if (not include or any(names(f, a) for f in include))
            and not any(names(f, a) for f in exclude)]
