"""Chrome trace JSON (Trace Event Format) for Perfetto and chrome://tracing.

One process per device (``cuda:0``, ..., ``pinned host``), each with:

* counter tracks (``"C"`` events): ``live bytes`` (memviz's timeline: the
  device memory it recorded, PyTorch's segments and memory outside PyTorch,
  each byte once), ``PyTorch tensors`` (the allocator route's blocks: bytes
  inside those segments, never added to them), one ``category: NAME`` track
  per category when categories are known (they add up to ``live bytes``;
  exact with a recorded history, otherwise exact at the peak and at the end
  and a lower bound between: memviz/report/_categories.py), and the step
  records' ``torch allocated`` / ``torch reserved`` (PyTorch's figures) and
  ``device memory (memviz) at step ends`` (memviz's own bytes; a record that
  gives a device total of its own has a ``device total`` track);
* allocations: with a recorded history (a loaded trace, or a tracker that
  streamed one), an async span (``"b"``/``"e"``) from each allocation to its
  free, on one track per allocating line; from a plain tracker, spans for the
  allocations still live at the end (to the end of the run) and instant
  events (``"i"``) for those live at the peak and freed later (when is not
  recorded). Each carries size, kind, label, category, address, stream,
  thread and the user's line in ``args``;
* failed allocations and steps as instant events.

Times are microseconds from the start of the run.
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, Iterator, List, Optional, TextIO

from memviz._units import escape_surrogates, format_size
from memviz.model.traceback import innermost_first
from memviz.report import read
from memviz.report._categories import TENSORS, memory_series

__all__ = ["write", "events"]

_HOST_PID = 1000
_META_PID = 999  # steps and run-wide marks


def _pid(device: int) -> int:
    return _HOST_PID if device < 0 else device + 1


def _us(ts: int, t0: int) -> float:
    return round((ts - t0) / 1000.0, 3)


def _alloc_args(a: Any, size: int) -> Dict[str, Any]:
    tb = getattr(a, "traceback", None)
    args: Dict[str, Any] = {
        "size": size, "size_str": format_size(size), "kind": getattr(a, "kind", "device"),
        "address": hex(getattr(a, "address", 0) or 0), "stream": getattr(a, "stream", 0) or 0,
        "line": read.where(a),
    }
    thread = getattr(a, "thread", None)
    if thread is not None:
        args["thread"] = getattr(thread, "name", None) or str(thread)
    for key in ("label", "category", "autograd_node", "forward", "op"):
        v = getattr(a, key, None)
        if v:
            args[key] = v
    if tb:
        args["stack"] = [f"{f.filename}:{f.lineno} {f.name}" for f in innermost_first(tb)][:16]
    return args


def _meta_events(devices: List[int]) -> Iterator[Dict[str, Any]]:
    for i, dev in enumerate(sorted(devices, key=lambda d: (d < 0, d))):
        pid = _pid(dev)
        yield {"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
               "args": {"name": f"{read.device_name(dev)} (memviz)"}}
        yield {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": i}}


def events(obj: Any) -> Iterator[Dict[str, Any]]:
    """The trace events of a Tracker or a loaded trace, one dict each."""
    totals = {int(d): t for d, t in obj.totals().items()}
    timeline = list(obj.timeline())
    t0, t1 = read.time_range(obj, timeline, totals)
    devices = sorted(set(totals) | {p[1] for p in timeline})
    yield from _meta_events(devices)
    yield {"ph": "M", "name": "process_name", "pid": _META_PID, "tid": 0,
           "args": {"name": "memviz: steps and failures"}}

    # Counters: memviz's timeline (bounded, peaks kept), starting from zero.
    started = set()
    for ts, dev, live in timeline:
        if dev not in started:
            started.add(dev)
            yield {"ph": "C", "name": "live bytes", "pid": _pid(dev), "ts": 0.0, "args": {"bytes": 0}}
        yield {"ph": "C", "name": "live bytes", "pid": _pid(dev), "ts": _us(ts, t0), "args": {"bytes": live}}
    for dev, t in totals.items():
        yield {"ph": "C", "name": "live bytes", "pid": _pid(dev), "ts": _us(t1, t0),
               "args": {"bytes": t.get("current", 0)}}
        if t.get("peak_timestamp_ns"):
            yield {"ph": "i", "s": "p", "name": f"peak {format_size(t.get('peak', 0))}",
                   "pid": _pid(dev), "tid": 0, "ts": _us(t["peak_timestamp_ns"], t0),
                   "args": {"bytes": t.get("peak", 0)}}

    end = obj.snapshot()
    peak = obj.peak_snapshot()
    end_keys = {(a.device, a.address, a.timestamp_ns) for a in end.allocations}
    peak_only = [a for a in peak.allocations if (a.device, a.address, a.timestamp_ns) not in end_keys]
    known = {(a.device, a.address, a.timestamp_ns): a for a in list(end.allocations) + peak_only}
    if any(a.category or a.kind == "block" for a in known.values()):
        peak_ts = {d: t.get("peak_timestamp_ns") or t1 for d, t in totals.items()}
        # at most 65,536 points a series (each the highest of its bucket): exact below that
        segments = [g for snap in (peak, end) for g in getattr(snap, "segments", None) or ()]
        mem = memory_series(obj, list(end.allocations), list(peak.allocations), peak_ts, t1,
                            points=1 << 16, segments=segments)
        tracks = [(dev, TENSORS, pts) for dev, pts in mem.tensors.items()]
        tracks += [(dev, f"category: {cat}", pts) for dev, cats in mem.categories.items()
                   for cat, pts in cats.items()]
        for dev, name, (ts_list, values) in tracks:
            for ts, v in zip(ts_list, values):
                yield {"ph": "C", "name": name, "pid": _pid(dev), "ts": _us(ts, t0),
                       "args": {"bytes": v}}
    history = read.events(obj)
    if history is not None:
        yield from _from_history(history, known, t0)
    else:
        yield from _from_snapshots(end.allocations, peak_only, t0, t1, totals)

    for f in getattr(obj, "failures", None) or ():
        args = _alloc_args(f, f.size)
        args["cuda_error"] = getattr(f, "result", None)
        yield {"ph": "i", "s": "p", "name": f"failed allocation {format_size(f.size)}",
               "cat": "failure", "pid": _pid(f.device), "tid": 0, "ts": _us(f.timestamp_ns, t0),
               "args": args}
    yield from _steps(obj, t0)


def _span(a: Any, size: int, begin: int, end: Optional[int], uid: int, t0: int,
          extra: Optional[Dict[str, Any]] = None) -> Iterator[Dict[str, Any]]:
    args = _alloc_args(a, size)
    if extra:
        args.update(extra)
    common = {"cat": "allocation", "name": args["line"], "pid": _pid(a.device), "tid": 0,
              "id": f"0x{uid:x}"}
    yield dict(common, ph="b", ts=_us(begin, t0), args=args)
    if end is not None:
        yield dict(common, ph="e", ts=_us(end, t0))


def _from_snapshots(end_allocs: Any, peak_only: List[Any], t0: int, t1: int,
                    totals: Dict[int, Dict[str, int]]) -> Iterator[Dict[str, Any]]:
    uid = 0
    for a in end_allocs:
        uid += 1
        yield from _span(a, a.size, a.timestamp_ns, t1, uid, t0, {"live_at_end": True})
    for a in peak_only:
        args = _alloc_args(a, a.size)
        args["freed"] = "after the peak; when is not recorded (record a trace for full lifetimes)"
        yield {"ph": "i", "s": "t", "cat": "allocation", "name": f"{args['line']} {format_size(a.size)}",
               "pid": _pid(a.device), "tid": 0, "ts": _us(a.timestamp_ns, t0), "args": args}


def _from_history(history: Iterator[Any], known: Dict[tuple, Any], t0: int
                  ) -> Iterator[Dict[str, Any]]:
    open_: Dict[tuple, tuple] = {}
    uid = 0
    last_ts = t0
    for e in history:
        last_ts = max(last_ts, e.timestamp_ns)
        if e.op == "alloc":
            uid += 1
            a = known.get((e.device, e.address, e.timestamp_ns), e.allocation)  # (op: the call, not "alloc")
            open_[(e.device, e.address, e.kind)] = (uid, read.where(a))
            yield from _span(a, e.size, e.timestamp_ns, None, uid, t0)
        elif e.op == "free":
            got = open_.pop((e.device, e.address, e.kind), None)  # a block may start its segment
            if got is not None:
                yield {"ph": "e", "cat": "allocation", "name": got[1], "pid": _pid(e.device),
                       "tid": 0, "id": f"0x{got[0]:x}", "ts": _us(e.timestamp_ns, t0)}
    for (dev, _addr, _kind), (uid_a, name) in open_.items():
        yield {"ph": "e", "cat": "allocation", "name": name, "pid": _pid(dev), "tid": 0,
               "id": f"0x{uid_a:x}", "ts": _us(last_ts, t0), "args": {"live_at_end": True}}


def _steps(obj: Any, t0: int) -> Iterator[Dict[str, Any]]:
    for s in read.steps(obj):
        ts = s["timestamp_ns"]
        if ts is None:
            continue
        yield {"ph": "i", "s": "g", "name": f"step {s['index']}", "cat": "step", "pid": _META_PID,
               "tid": 0, "ts": _us(ts, t0),
               "args": {k: v for k, v in s["fields"].items() if isinstance(v, (int, float, str))}}
        for name, per in s["series"].items():
            for dev, value in per.items():
                pid = _pid(dev) if dev is not None else _META_PID
                yield {"ph": "C", "name": name, "pid": pid, "ts": _us(ts, t0), "args": {"bytes": value}}


def _dump(obj: Any, f: TextIO) -> int:
    f.write('{"displayTimeUnit":"ms","otherData":{"generator":"memviz"},"traceEvents":[\n')
    n = 0
    for ev in events(obj):
        if n:
            f.write(",\n")
        text = json.dumps(ev, separators=(",", ":"), ensure_ascii=False, default=str)
        f.write(escape_surrogates(text, in_json=True))  # file names that are not UTF-8
        n += 1
    f.write("\n]}\n")
    return n


def write(tracker: Any, path: "str | os.PathLike[str]") -> int:
    """Write the Chrome trace JSON of a Tracker or loaded trace to ``path``.

    Open it in https://ui.perfetto.dev (Open trace file) or chrome://tracing.
    Returns the number of trace events written. Raises :class:`memviz.OutputError`
    (an OSError) when ``path`` cannot be written; an existing file stays as it was."""
    from memviz._output_files import output_file, own_files

    with output_file(path, "the Perfetto trace", inputs=own_files(tracker)) as f:
        return _dump(tracker, f)
