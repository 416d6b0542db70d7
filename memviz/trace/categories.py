"""Live bytes over time per category, summed by the C core.

The rules (which category each byte counts under at every moment, each byte
once) have one owner: src/replay_categories.c, run as a replay's visitor
(``_core.Replayer.start_categories``, ``feed_categories``,
``categories``). memviz/report/_categories.py states them and calls this
module; here are the two ways in:

* :func:`summed`: EVENTS chunks fed to a replayer (a loaded trace's second
  pass over its file, memviz/trace/reader.py);
* :func:`events_summed`: any recording's events() (the reading API's event
  objects: ``op``, ``timestamp_ns``, ``device``, ``address``, ``size``,
  ``kind``, ``thread``, ``category``), encoded into records by the C core
  (``_core.encode_events``) and replayed the same way.

Both return ``{device: {category: (timestamps, live bytes)}}``, PyTorch's
tensors (its blocks' bytes) under ``TENSORS``, each series' last point at
``end_ns``; None where the recording does not fit the C pass (more than
``_core.REPLAY_CATEGORIES_MAX`` categories, or events no trace record can
hold).
"""

from __future__ import annotations

import struct
from typing import Any, Dict, Iterable, List, Optional, Tuple

import memviz._core as _core
from memviz.model.segments import TENSORS, UNUSED_POOL
from memviz.model.snapshot import KIND_NAMES
from memviz.trace import format as F

__all__ = ["summed", "events_summed", "UNKNOWN"]

UNKNOWN = "<unknown>"

Series = Dict[int, Dict[str, Tuple[List[int], List[int]]]]
#: (device, address, made at, kind) -> category
Known = Dict[Tuple[int, int, int, str], Any]


def _table(known: Known, codes: Dict[str, int]) -> Optional[Tuple[List[Any], List[tuple]]]:
    """The category names (0: <unknown>, 1: unused pool, 2: the tensors) and
    the (device, address, ts, kind code, category id) entries the C pass
    takes; None for too many categories."""
    names: List[Any] = [UNKNOWN, UNUSED_POOL, None]  # 2: the tensors, not a category
    ids = {n: i for i, n in enumerate(names)}
    entries = []
    for (dev, addr, ts, kind), cat in known.items():
        code = codes.get(kind)
        if not cat or code is None or not (F.DEVICE_MIN <= dev <= F.DEVICE_MAX
                                           and 0 <= addr < 1 << 64 and 0 <= ts < 1 << 64):
            continue  # no category, or no event of the file can be it
        i = ids.get(cat)
        if i is None:
            i = ids[cat] = len(names)
            names.append(cat)
        entries.append((dev, addr, ts, code, i))
    if len(names) > _core.REPLAY_CATEGORIES_MAX:
        return None
    names[2] = TENSORS
    return names, entries


def summed(chunks: Iterable[Tuple[Any, Any, int, int, int]], known: Known, end_ns: int,
           points: Optional[int] = None, *, codes: Optional[Dict[str, int]] = None,
           tensors: Optional[Dict[int, Tuple[List[int], List[int]]]] = None) -> Optional[Series]:
    """The series of the events of ``chunks``: (replayer, buffer, offset,
    count, layout) of each EVENTS chunk in turn, all of one fresh
    ``_core.Replayer``. ``known``: {(device, address, made at, kind):
    category} of the allocations the snapshots gave one; ``points``: at most
    that many points per series (each the highest of its bucket), None for
    all; ``codes``: kind name -> the records' kind code (KIND_NAMES');
    ``tensors``: a dict that takes the tensors' series instead, by device in
    the order they began."""
    table = _table(known, codes if codes is not None else {k: i for i, k in enumerate(KIND_NAMES)})
    if table is None:
        return None
    names, entries = table
    rp = None
    for rp, buf, offset, count, layout in chunks:
        if not rp.events:
            rp.start_categories(len(names), entries, max(0, points or 0))
        rp.feed_categories(buf, offset, count, layout)
    out: Series = {}
    for _order, dev, cat, cur, pts in sorted(rp.categories()) if rp is not None else ():
        series = ([p[0] for p in pts] + [end_ns], [p[1] for p in pts] + [cur])
        if tensors is not None and cat == 2:
            tensors[dev] = series
        else:
            out.setdefault(dev, {})[names[cat]] = series
    return out


_OPS = {"alloc": F.OP_ALLOC, "free": F.OP_FREE}
#: threads a record tells apart (its thread field's width)
_THREADS = 1 << 8 * struct.calcsize("<" + _core.EVENT_FORMAT[1 + F.EV["thread_idx"]])


def events_summed(evs: Iterable[Any], known: Known, end_ns: int
                  ) -> Optional[Tuple[Series, Dict[int, Tuple[List[int], List[int]]]]]:
    """The series of a recording's events, in their order (every point): the
    categories', and the tensors' by device (summed()'s ``tensors``). An
    alloc event's own category comes first, then ``known``'s. A kind no
    trace has gets a code of its own (its key space: a device allocation's);
    threads are told apart by value. None for events no record holds
    (a device beyond the record's, a negative time, a size or address beyond
    64 bits) or too many kinds or threads."""
    codes = {k: i for i, k in enumerate(KIND_NAMES)}
    known = dict(known)
    threads: Dict[Any, int] = {}
    rows = []
    for e in evs:
        op = _OPS.get(e.op)
        if op is None:
            continue
        code = codes.get(e.kind)
        if code is None:
            code = codes[e.kind] = len(codes)
        thread = threads.setdefault(_hashable(e.thread), len(threads))
        dev, ts, addr, size = e.device, e.timestamp_ns, e.address, e.size
        if not (F.DEVICE_MIN <= dev <= F.DEVICE_MAX and 0 <= ts < 1 << 64 and 0 <= addr < 1 << 64
                and 0 <= size < 1 << 64):
            return None  # a value no record holds
        if op == F.OP_ALLOC and e.category:
            known[(dev, addr, ts, e.kind)] = e.category
        rows.append((op, ts, code, dev, 0, 0, thread, 0, addr, size, 0, 0))
    if len(codes) > 256 or len(threads) > _THREADS:
        return None  # more kinds or threads than a record tells apart
    data = _core.encode_events(rows, rows[0][1] if rows else 0, 0)
    rp = _core.Replayer(0, False, F.EVENT.size)
    tensors: Dict[int, Tuple[List[int], List[int]]] = {}
    out = summed([(rp, data, 0, len(data) // F.EVENT.size, F.LAYOUT_ROWS)], known, end_ns, codes=codes,
                 tensors=tensors)
    return None if out is None else (out, tensors)


def _hashable(v: Any) -> Any:
    try:
        hash(v)
        return v
    except TypeError:
        return repr(v)
