"""A tracker's reading API over the C store: snapshots, peak snapshots,
totals, failures, timeline and threads (and reset_peak(), which restarts
what peak_snapshot() reads), read from the view that holds this
tracker's data (memviz/capture/store.py): the whole store while the tracker
is the latest, its window while nested, or its frozen copy once the store
went on without it.

:class:`StoreReading` is a mixin of :class:`memviz.Tracker`; it reads these
attributes of it: ``_frozen``, ``_view`` and ``_running`` (the tracker's
window: its Run in the capture session, memviz/capture/session.py),
``started_ns``, ``gpu_enabled``, ``frame_filter`` and, where present,
``torch`` (the PyTorch integration) and ``graph``.

Imports the bottom floor, the model, capture/store.py and capture/session.py only
(docs/architecture.md: the capture floor).
"""

from __future__ import annotations

import heapq
import time
from typing import Any, Dict, List, Optional

import memviz._args as _args
import memviz._core as _core
from memviz._errors import NotTracking
from memviz.capture.session import lock
from memviz.capture.store import Frozen, NoGpuWindow, Store, Window
from memviz.model.failures import FailedAllocation, failed_allocations
from memviz.model.recording import TotalsReads, check_peak, size_note, thread_table
from memviz.model.rows import gc_paused, grouped_rows, snapshot_from_groups, snapshot_from_raw
from memviz.model.frame_filter import frames as _default_filter
from memviz.model.snapshot import Snapshot
from memviz.model.statistics import Statistic, _key_str
from memviz.model.traceback import Frame, Traceback

__all__ = ["StoreReading"]



#: innermost frames read first for each stack by Tracker.top (src/module_store.c's resolve)
_TOP_FRAMES = 12


def _top_lines(groups, resolve, threads, frame_filter, n: Optional[int], limit_ok: bool) -> List[Statistic]:
    """``statistics("lineno")[:n]`` of groups of live allocations, with no
    object per group where it can: a group's line is its stack's user frame
    (FrameFilter.pick over the C core's frames), summed under a plain
    (filename, lineno, name) tuple, which equals the Frame that
    statistics() keys it by. Groups without frames (backward memory,
    threads without Python frames, memviz's own) go through a snapshot of
    groups, which knows their pseudo lines."""
    flt = frame_filter if frame_filter is not None else _default_filter
    framed, rest = [], []
    for g in groups:
        row = g[0]
        (framed if row[8] and not row[11] & _core.FLAG_MEMVIZ else rest).append(g)
    sids = {g[0][8] for g in framed}
    if not sids:
        raw = {}
    elif limit_ok:
        # The user frame is near the innermost end: read that end first, and
        # the whole stack only where every frame read was the library's.
        raw = _core.resolve(list(sids), _TOP_FRAMES)
        deep = [sid for sid, fr in raw.items()
                if len(fr) == _TOP_FRAMES and all(flt.is_library(f.filename) for f in fr)]
        if deep:
            raw.update(_core.resolve(deep))
    else:
        raw = resolve(sids)
    pick, is_library, cache = flt.pick, flt.is_library, flt._cache
    acc: Dict[Any, list] = {}
    for g in framed:
        frames = raw.get(g[0][8])
        if not frames:
            rest.append(g)
            continue
        f = frames[0]
        lib = cache.get(f.filename)
        if lib is None:
            lib = is_library(f.filename)
        if lib:
            f = pick(frames)
        lineno = f.lineno
        key = (f.filename or "<unknown>", lineno if lineno is not None and lineno > 0 else 0, f.name or "")
        a = acc.get(key)
        if a is None:
            acc[key] = [g[0][1], g[1]]
        else:
            a[0] += g[0][1]
            a[1] += g[1]
    by_key: Dict[Any, Statistic] = {}
    if rest:
        for st in snapshot_from_groups(rest, resolve, threads, frame_filter).statistics("lineno"):
            by_key[st.key] = st
    for key, (size, count) in acc.items():
        st = by_key.get(key)
        if st is not None:
            size, count = size + st.size, count + st.count
            del by_key[key]
        acc[key] = [size, count]
    if n is None or len(acc) <= n:
        order = list(acc.items())
    elif n == 0:
        order = []
    else:  # the n largest, and whatever ties the last of them: statistics() orders ties by name
        last = heapq.nlargest(n, acc.values())[-1]
        order = [kv for kv in acc.items() if kv[1] >= last]
    stats = list(by_key.values())
    for key, (size, count) in order:
        f = Frame(*key)
        stats.append(Statistic(size, count, Traceback((f,), flt), f))
    stats.sort(key=lambda s: (-s.size, -s.count, _key_str(s.key)))
    return stats if n is None else stats[:n]


class StoreReading(TotalsReads):
    """Mixin: the reading methods of a Tracker (see the module's docstring)."""

    _frozen: Any
    _view: Optional[Window]

    def _source(self):
        """The frozen copy or nested window of this tracker, or None: the
        store itself. Raises NotTracking for a tracker that never started."""
        if self._frozen is not None:
            return self._frozen
        if self.started_ns is None:
            raise NotTracking("this tracker never started: use `with memviz.track() as t:` or t.start().")
        return self._view

    def _reader(self):
        """The view this tracker's figures are read from (never None)."""
        src = self._source()
        return src if src is not None else Store(flush=self._running and self.gpu_enabled)

    def snapshot_raw(self) -> Snapshot:
        """The live allocations, without the PyTorch integration's categories."""
        src = self._reader()
        return snapshot_from_raw(src.live, src.resolve, src.threads, self.frame_filter,
                                 timestamp_ns=time.monotonic_ns())

    def top(self, n: Optional[int] = 10, key_type: str = "lineno") -> list:
        """The ``n`` largest groups of live allocations by ``key_type`` (as
        ``snapshot().statistics(key_type)[:n]``; ``n=None``: all of them),
        without an object per allocation.

        ``snapshot()`` builds an :class:`Allocation` for each live
        allocation: about 2 s of CPU and 0.5 GB a million
        (benchmarks/RESULTS.md), 16 s and 4.2 GB for the 8.4 million the
        store can hold, and names each line's call. ``top()`` has the C core group them
        first (by stack, label, device, kind, thread: one row a group), so
        it costs what the distinct call sites cost: 8 million allocations
        from one line take a few seconds, and what each line was calling is
        not named (``Allocation.op``: a parse of its source per line). Key
        types as :meth:`Snapshot.statistics`; no PyTorch categories."""
        if n is not None:
            n = _args.whole(n, "top(n)", 0)
        with gc_paused():
            return self._top(n, key_type)

    def _top(self, n: Optional[int], key_type: str) -> list:
        src = self._reader()
        groups = _core.live_groups() if type(src) is Store else grouped_rows(src.live)
        # frames only: what each line was calling (Allocation.op) is not a statistic's
        resolve = src.resolve if isinstance(src, Frozen) else (lambda ids: _core.resolve(list(ids)))
        if key_type != "lineno":
            stats = snapshot_from_groups(groups, resolve, src.threads, self.frame_filter).statistics(key_type)
            return stats if n is None else stats[:n]
        return _top_lines(groups, resolve, src.threads, self.frame_filter, n, not isinstance(src, Frozen))

    def snapshot(self) -> Snapshot:
        """The allocations live now (or when the tracker stopped).

        With the PyTorch integration each allocation carries its category,
        the snapshot carries PyTorch's own figures (``snap.torch_stats``) and
        ``snap.graph_resident()`` lists what autograd graphs keep."""
        return self._decorate(self.snapshot_raw(), live_now=True)

    def _decorate(self, snap: Snapshot, live_now: bool) -> Snapshot:
        integ = getattr(self, "torch", None)
        if integ is not None and self._frozen is None:
            snap = integ.categorize(snap, live_now=live_now)
        graph = getattr(self, "graph", None)
        snap.graph_records = graph.resident() if graph is not None else None
        snap.size_note = size_note(int(self._reader().stats.get("stream_frees", 0) or 0))
        return snap

    def peak_snapshot(self, device: Optional[int] = None, *, peak: str = "device") -> Snapshot:
        """The allocations live at a peak, every device at its own with
        ``device=None``. Two peaks (``snap.peak`` says which):

        * ``peak="device"``: the moment the device held the most, everything
          the process has there (PyTorch's segments and the memory outside
          PyTorch): what an out-of-memory error is about;
        * ``peak="tensor"``: the moment PyTorch's blocks held the most, its
          ``max_memory_allocated()``: what to shrink.
        """
        _args.whole(device, "peak_snapshot(device=...)", none=True)
        which = check_peak(peak)
        src = self._reader()
        totals = src.totals if which == "device" else src.block_totals
        take = src.peak_rows if which == "device" else src.tensor_peak_rows
        devices = [device] if device is not None else sorted(totals)
        rows: List[tuple] = []
        for dev in devices:
            rows.extend(take(dev))
        ts = max((totals[d]["peak_timestamp_ns"] for d in devices if d in totals), default=None)
        snap = snapshot_from_raw(rows, src.resolve, src.threads, self.frame_filter, timestamp_ns=ts)
        snap = self._decorate(snap, live_now=False)
        snap.peak = which
        return snap

    def tensor_totals(self) -> Dict[int, Dict[str, int]]:
        """Per device, PyTorch's blocks alone: current, peak (the tensor peak,
        ``max_memory_allocated()`` since tracking started), peak_timestamp_ns,
        ... as :meth:`totals`; empty without the allocator route."""
        return {d: v for d, v in dict(self._reader().block_totals).items() if v.get("peak")}

    def totals(self) -> Dict[int, Dict[str, int]]:
        """Per device (-1: pinned host memory): current, peak, allocs, frees, failed, ..."""
        return dict(self._reader().totals)

    @property
    def failures(self) -> List[FailedAllocation]:
        """Allocations the driver refused (the last 256), oldest first."""
        src = self._reader()
        return failed_allocations(src.failures, src.resolve, src.threads, self.frame_filter)

    def reset_peak(self) -> None:
        """Restart this running tracker's peaks at the current figures, like
        :func:`tracemalloc.reset_peak`: from now on ``peak_bytes()``,
        ``totals()`` and ``peak_snapshot()`` (whose peak set becomes what is
        live now) report the highest memory since this call, on every device.

        A nested tracker resets its own peaks only; the enclosing tracker keeps
        its own. Step records are not affected (each step has its own peak),
        and a trace file keeps every event, so ``memviz.load()`` of it finds
        the whole run's peak. Raises NotTracking when the tracker is not
        running."""
        with lock:
            if not self._running:
                raise NotTracking(
                    "reset_peak() restarts the peak of a running tracker, and this tracker is not "
                    "running. What to do: call it inside the `with memviz.track() as t:` block; a "
                    "stopped tracker's peak is what it was when it stopped.")
            if self._view is not None:
                if not isinstance(self._view, NoGpuWindow):
                    _core.reset_peak(self._view.id)
            elif self._frozen is None:
                if self.gpu_enabled:
                    _core.flush()
                _core.reset_peak()

    def timeline(self) -> List[tuple]:
        """(timestamp_ns, device, live bytes) points; bounded, peaks kept."""
        return list(self._reader().timeline)

    def threads(self) -> Dict[int, tuple]:
        """{thread index: (native id, ident, name)} of the threads that allocated."""
        return thread_table(self._reader().threads)
