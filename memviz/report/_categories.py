"""Live bytes per category over time (weights, gradients, optimizer state,
activations, unused pool ...) for the HTML report's timeline and the Perfetto
export: exact from a recording's events, else bounded from the allocations
live at the peak and at the end.

Imports the model floor and below and memviz.report._source
(docs/architecture.md).
"""

from __future__ import annotations

import bisect
from typing import Any, Dict, List, Optional, Tuple

from memviz.report import _source as src

__all__ = ["category_series"]


def category_series(obj: Any, allocs: List[Any], peak_only: List[Any], peak_ts: Dict[int, int],
                    end_ns: int, *, points: Optional[int] = None
                    ) -> Tuple[Dict[int, Dict[str, Tuple[List[int], List[int]]]], str]:
    """{device: {category: (timestamps, live bytes)}} and a note on how exact
    it is. A loaded trace sums its events itself, in C (``_category_series``,
    the same rules), keeping at most ``points`` points per series (the
    highest of each bucket; None: all)."""
    changes: Dict[int, Dict[str, List[Tuple[int, int]]]] = {}
    fast = getattr(obj, "_category_series", None)
    if callable(fast):
        known = {(a.device, a.address, a.timestamp_ns): a.category for a in allocs + peak_only}
        out = fast(known, end_ns, points)
        if out is not None:
            return out, "from the recorded events"
    evs = src.events(obj)
    if evs is not None:
        known = {(a.device, a.address, a.timestamp_ns): a.category for a in allocs + peak_only}
        # Every byte once, as snapshots count them: a PyTorch block (kind "block")
        # lies inside a segment (a "device" allocation); from the first block seen
        # in it, the segment counts as unused_pool, less the blocks it holds.
        live: Dict[Tuple[int, int, str], Tuple[str, int]] = {}
        segs: Dict[int, List[List[Any]]] = {}  # device -> sorted [address, end, category, pool?, ts]
        starts: Dict[int, List[int]] = {}

        def add(dev, cat, ts, size):
            changes.setdefault(dev, {}).setdefault(cat, []).append((ts, size))

        def segment_of(dev, addr):
            i = bisect.bisect_right(starts.get(dev, []), addr) - 1
            return segs[dev][i] if i >= 0 and addr < segs[dev][i][1] else None

        for e in evs:
            ts = e.timestamp_ns
            if e.op == "alloc":
                cat = e.category or known.get((e.device, e.address, ts)) or "<unknown>"
                if e.kind == "block":
                    seg = segment_of(e.device, e.address)
                    if seg is not None:
                        # A block is dated when it was asked for, maybe before the
                        # segment made for it: move the bytes once both exist.
                        at = max(ts, seg[4])
                        if not seg[3]:  # the segment's first block: its bytes are the pool's
                            add(e.device, seg[2], at, -(seg[1] - seg[0]))
                            add(e.device, "unused_pool", at, seg[1] - seg[0])
                            seg[2], seg[3] = "unused_pool", True
                        add(e.device, "unused_pool", at, -e.size)
                elif e.kind == "device":
                    lst, st = segs.setdefault(e.device, []), starts.setdefault(e.device, [])
                    i = bisect.bisect_left(st, e.address)
                    st.insert(i, e.address)
                    lst.insert(i, [e.address, e.address + e.size, cat, False, ts])
                live[(e.device, e.address, e.kind)] = (cat, e.size)
                add(e.device, cat, ts, e.size)
            elif e.op == "free":
                cat_size = live.pop((e.device, e.address, e.kind), None)
                if cat_size is None:
                    continue
                if e.kind == "device":
                    st = starts.get(e.device, [])
                    i = bisect.bisect_left(st, e.address)
                    if i < len(st) and st[i] == e.address:
                        seg = segs[e.device].pop(i)
                        st.pop(i)
                        if seg[3]:  # what is left of a pool segment is unused pool
                            cat_size = ("unused_pool", cat_size[1])
                elif e.kind == "block":
                    seg = segment_of(e.device, e.address)
                    if seg is not None and seg[3]:
                        add(e.device, "unused_pool", ts, cat_size[1])
                add(e.device, cat_size[0], ts, -cat_size[1])
        note = "from the recorded events"
    else:
        for a in allocs + peak_only:  # live at the end, or at the peak only (freed after it)
            per = changes.setdefault(a.device, {}).setdefault(a.category or "<unknown>", [])
            per.append((a.timestamp_ns, a.size))
        for a in peak_only:
            changes[a.device][a.category or "<unknown>"].append(
                (peak_ts.get(a.device, end_ns) + 1, -a.size))
        note = ("from the allocations live at the peak or at the end: exact at the peak and "
                "at the end, a lower bound elsewhere (record a trace for exact lines)")
    out: Dict[int, Dict[str, Tuple[List[int], List[int]]]] = {}
    for dev, cats in changes.items():
        for cat, ch in cats.items():
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
            out.setdefault(dev, {})[cat] = (ts, vs)
    return out, note
