"""Live bytes over time per category (weights, gradients, optimizer state,
activations, unused pool ...), and of PyTorch's tensors, for the HTML
report's timeline and the Perfetto export: exact from a recording's events,
else bounded from the allocations live at the peak and at the end.

The rules over a recording's events, stated here, have one owner:
src/replay_categories.c sums them in C, for a loaded trace's file and for
any recording's events() alike (memviz/trace/categories.py calls it). Every
byte counts once at every moment, as snapshots count them
(memviz/model/segments.py) and as the device totals do:

* a segment (a "device" allocation) that ever holds one of PyTorch's blocks
  (kind "block") counts, from when it was made, as ``unused_pool`` less the
  blocks it holds; each block counts under its own category;
* the block a segment was made for (the first block of the segment's
  thread inside it, among the ``_core.REPLAY_LOOKAHEAD`` allocations after
  it) counts from the segment's time: the store dates a block when it was
  asked for, before the segment made for it, and a peak's set holds it
  (src/replay.c); any other block counts from its own time;
* the PyTorch-tensors series is the blocks' bytes: inside the segments,
  never added to them.

An allocation's category is the one the snapshots gave it (``known``: those
live at the end or at a peak), else ``<unknown>``. So the category lines
equal ``Snapshot.statistics("category")`` at the peak and at the end. A
recording without events (a tracker without a trace) gets the two
snapshots' allocations instead: exact at the peak and at the end, a lower
bound elsewhere (that bound, from two sets of allocations, is summed here).

Imports the model floor and below, memviz.trace.categories and
memviz.report.read (docs/architecture.md).
"""

from __future__ import annotations

import bisect
from typing import Any, Dict, Iterable, List, NamedTuple, Optional, Tuple

from memviz.model.segments import TENSORS, UNUSED_POOL
from memviz.report import read
from memviz.trace.categories import UNKNOWN, events_summed

__all__ = ["category_series", "memory_series", "known_categories", "known_in_trace", "MemorySeries",
           "TENSORS", "UNKNOWN", "POOL"]

POOL = UNUSED_POOL

Series = Tuple[List[int], List[int]]
Changes = Dict[Any, Dict[Any, List[Tuple[int, int]]]]
#: (device, address, made at, kind) -> category
Known = Dict[Tuple[int, int, int, str], str]


class MemorySeries(NamedTuple):
    """``categories``: {device: {category: (timestamps, live bytes)}};
    ``tensors``: {device: (timestamps, live bytes of PyTorch's blocks)};
    ``note``: how exact they are."""

    categories: Dict[int, Dict[str, Series]]
    tensors: Dict[int, Series]
    note: str


EXACT = "from the recorded events"
AFTER_PEAK_NS = 1000
BOUNDED = ("from the allocations live at the peak or at the end: exact at the peak and "
           "at the end, a lower bound elsewhere (record a trace for exact lines)")


def known_categories(allocs: Iterable[Any]) -> Known:
    """{(device, address, made at, kind): category} of the allocations a
    snapshot gave one (the later of two with the same key, as a dict keeps)."""
    return {(a.device, a.address, a.timestamp_ns, a.kind): a.category for a in allocs if a.category}


def memory_series(obj: Any, end_allocs: List[Any], peak_allocs: List[Any], peak_ts: Dict[int, int],
                  end_ns: int, *, points: Optional[int] = None, segments: Iterable[Any] = ()
                  ) -> MemorySeries:
    """The category and tensor series of a recording. ``end_allocs``: the
    allocations live at the end (its snapshot()); ``peak_allocs``: those live
    at the peaks (its peak_snapshot()); ``peak_ts``: {device: its peak's
    time}. A loaded trace has the C pass sum its file's events
    (``_category_series``), keeping at most ``points`` points per series
    (the highest of each bucket; None: all); another recording's events()
    go through the same pass (every point). Without events (or with events
    the pass cannot hold: memviz/trace/categories.py), the series are the
    two snapshots': exact at the peak and at the end, a lower bound
    elsewhere (a block counts from when its segment was made at the
    earliest: ``segments``, the snapshots' Segments)."""
    known = known_categories(list(peak_allocs))
    known.update(known_categories(end_allocs))
    rekey = getattr(obj, "_known_in_trace", None)  # a Tracker's snapshots, its trace's events
    if callable(rekey):
        known = rekey(known)
    fast = getattr(obj, "_category_series", None)
    out = fast(known, end_ns, points) if callable(fast) else None
    if out is not None:
        tensors = {dev: cats.pop(TENSORS) for dev, cats in out.items() if TENSORS in cats}
        return MemorySeries({d: c for d, c in out.items() if c}, tensors, EXACT)
    evs = read.events(obj)
    both = events_summed(evs, known, end_ns) if evs is not None else None
    if both is not None:
        return MemorySeries(both[0], both[1], EXACT)
    cats, tensors = {}, {}  # tensors: {TENSORS: {device: changes}}, the categories' shape
    made = {(g.device, g.address): g.timestamp_ns for g in segments if g.timestamp_ns is not None}

    def live(a: Any, start: int, stop: Optional[int]) -> None:
        if a.kind == "block":  # dated when asked for, maybe before the segment made for it
            start = max(start, made.get((a.device, a.segment), start))
        series = [(cats, a.device, a.category or UNKNOWN)]
        if a.kind == "block":
            series.append((tensors, TENSORS, a.device))
        for ch, first, second in series:
            _add(ch, first, second, start, a.size)
            if stop is not None:
                _add(ch, first, second, stop, -a.size)

    # When what was live at the peak was freed is not recorded: it leaves the
    # lines a microsecond (the charts' resolution) after the peak.
    after = {d: max(min(t + AFTER_PEAK_NS, end_ns), t) for d, t in peak_ts.items()}
    at_peak = set()
    for a in peak_allocs:  # live from when made to just after the peak ...
        at_peak.add((a.device, a.address, a.timestamp_ns, a.kind))
        live(a, a.timestamp_ns, after.get(a.device, end_ns))
    for a in end_allocs:  # ... then as the end has it
        was = (a.device, a.address, a.timestamp_ns, a.kind) in at_peak
        live(a, after.get(a.device, end_ns) if was else a.timestamp_ns, None)
    return MemorySeries(_levels(cats, end_ns), _levels(tensors, end_ns).get(TENSORS, {}), BOUNDED)


def known_in_trace(trace: Any, known: Known) -> Known:
    """``known`` from a live tracker's snapshots, keyed as the events of the
    trace it streamed (``trace``, loaded) date them. The store dates a block
    when it was asked for, before the segment made for it; the trace dates
    it when it was made. So a block's key takes the time of the trace's
    block at its address, live at the end or at a peak, made the soonest
    not before it; other keys are the same in both."""
    made: Dict[Tuple[int, int], List[int]] = {}
    for snap in (trace.snapshot(), trace.peak_snapshot()):
        for a in snap.allocations:
            if a.kind == "block":
                made.setdefault((a.device, a.address), []).append(a.timestamp_ns)
    for times in made.values():
        times.sort()
    out: Known = {}
    for (dev, addr, ts, kind), cat in known.items():
        times = made.get((dev, addr)) if kind == "block" else None
        if times:
            i = bisect.bisect_left(times, ts)
            if i < len(times):
                ts = times[i]
        out[(dev, addr, ts, kind)] = cat
    return out


def category_series(obj: Any, allocs: List[Any], peak_allocs: List[Any], peak_ts: Dict[int, int],
                    end_ns: int, *, points: Optional[int] = None
                    ) -> Tuple[Dict[int, Dict[str, Series]], str]:
    """{device: {category: (timestamps, live bytes)}} and a note on how exact
    it is: memory_series() without the tensors."""
    m = memory_series(obj, allocs, peak_allocs, peak_ts, end_ns, points=points)
    return m.categories, m.note


def _add(changes: Changes, first: Any, second: Any, ts: int, delta: int) -> None:
    changes.setdefault(first, {}).setdefault(second, []).append((ts, delta))


def _levels(changes: Changes, end_ns: int) -> Dict[Any, Dict[Any, Series]]:
    """Changes summed in time order (a stable sort: at one time, the last
    level counts), each series ending at ``end_ns``."""
    out: Dict[Any, Dict[Any, Series]] = {}
    for first, per in changes.items():
        for second, ch in per.items():
            ch.sort(key=lambda c: c[0])
            ts, vs, cur = [], [], 0
            for t, d in ch:
                cur += d
                if ts and ts[-1] == t:
                    vs[-1] = cur
                else:
                    ts.append(t)
                    vs.append(cur)
            ts.append(end_ns)
            vs.append(cur)
            out.setdefault(first, {})[second] = (ts, vs)
    return out
