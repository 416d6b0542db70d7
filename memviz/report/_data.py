"""What the HTML report shows, aggregated in Python into a small JSON-able dict.

The page gets only aggregates: each timeline series is cut to a few thousand
points (bucket maxima kept), the flame graph is the peak's stacks merged into
a tree with tiny branches folded, and tables keep their top rows. So a run
with millions of events still gives a page of a few hundred kilobytes that
opens at once.
"""

from __future__ import annotations

import os
import time
from typing import Any, Dict, List, Optional, Tuple

from memviz.model.statistics import _SIMPLE_KEYS
from memviz.model.traceback import innermost_first
from memviz.report import _source as src
from memviz.report._categories import category_series
from memviz.report.summary import short_path as _short_path, source_line

__all__ = ["collect"]

TIMELINE_POINTS = 4000
TABLE_ROWS = 300
FLAME_MIN_FRACTION = 0.0005  # branches under 0.05% of the root are folded
FLAME_MAX_NODES = 20000


def _us(ts: Optional[int], t0: int) -> Optional[int]:
    return None if ts is None else (int(ts) - t0) // 1000


# -- timeline ---------------------------------------------------------------


def _series(name: str, kind: str, ts: List[int], vs: List[float], t0: int,
            points: int, note: str = "") -> Dict[str, Any]:
    ts, vs = src.downsample(ts, vs, points)
    return {"name": name, "kind": kind, "t": [(t - t0) // 1000 for t in ts],
            "v": [int(v) for v in vs], "note": note}


def _timeline(obj: Any, totals: Dict[int, Dict[str, int]], timeline: List[tuple], t0: int,
              t1: int, steps: List[Dict[str, Any]], allocs: List[Any], peak_only: List[Any],
              points: int) -> Dict[str, Any]:
    per_dev: Dict[int, Tuple[List[int], List[int]]] = {}
    for ts, dev, live in timeline:
        t, v = per_dev.setdefault(dev, ([], []))
        t.append(ts)
        v.append(live)
    peak_ts = {d: tot.get("peak_timestamp_ns") or t1 for d, tot in totals.items()}
    cats: Dict[int, Dict[str, Tuple[List[int], List[int]]]] = {}
    cat_note = ""
    if any(a.category for a in allocs) or any(a.category for a in peak_only):
        cats, cat_note = category_series(obj, allocs, peak_only, peak_ts, t1, points=4 * points)
    gpus = sorted(d for d in set(totals) | set(per_dev) if d >= 0)
    devices = gpus + sorted(d for d in set(totals) | set(per_dev) if d < 0)
    charts = []
    for dev in devices:
        ts, vs = per_dev.get(dev, ([], []))
        ts, vs = list(ts), list(vs)
        if not ts or ts[0] > t0:
            ts.insert(0, t0)
            vs.insert(0, 0)
        tot = totals.get(dev, {})
        if ts[-1] < t1:
            ts.append(t1)
            vs.append(tot.get("current", vs[-1]))
        series = [_series("live (memviz)", "total", ts, vs, t0, points)]
        for cat, (cts, cvs) in sorted(cats.get(dev, {}).items()):
            series.append(_series(cat, "category", cts, cvs, t0, points, cat_note))
        for name, _keys, _dev_key in src.STEP_SERIES:
            for key, label in ((dev, name), (None, f"{name} (all devices)")):
                if key is None and (not gpus or dev != gpus[0]):
                    continue
                pts = [(s["timestamp_ns"], s["series"][name][key]) for s in steps
                       if s["timestamp_ns"] is not None and key in s["series"].get(name, {})]
                if pts:
                    series.append(_series(label, "step", [p[0] for p in pts],
                                          [p[1] for p in pts], t0, points))
        charts.append({"device": dev, "name": src.device_name(dev),
                       "peak": {"t": _us(peak_ts.get(dev), t0), "v": tot.get("peak", max(vs))},
                       "series": series})
    return {"t0_ns": t0, "end": _us(t1, t0), "charts": charts, "category_note": cat_note}


# -- flame graph --------------------------------------------------------------


class _Names:
    def __init__(self) -> None:
        self.index: Dict[tuple, int] = {}
        self.table: List[list] = []

    def __call__(self, entry: tuple) -> int:
        i = self.index.get(entry)
        if i is None:
            i = self.index[entry] = len(self.table)
            self.table.append(list(entry))
        return i


def _buckets(allocs: Any) -> List[list]:
    """One pass over a snapshot: [bytes, count, a sample allocation] per
    (stack, device, label, autograd node, forward line, category, thread,
    kind). The flame graph and the simple tables are built from these."""
    buckets: Dict[tuple, list] = {}
    for a in allocs:
        tb = a.traceback
        key = (id(tb) if tb else 0, a.device, a.label, a.autograd_node, a.forward, a.category,
               a.thread.name, a.kind)
        b = buckets.get(key)
        if b is None:
            buckets[key] = [a.size, 1, a]
        else:
            b[0] += a.size
            b[1] += 1
    return list(buckets.values())


def _flame(buckets: List[list], names: _Names, depth: Optional[int] = None) -> list:
    """The icicle tree: [name index, bytes, count, children], root first.

    A stack as deep as the capture depth lost its outer frames; it hangs
    under a marker node saying so, rather than looking like another root."""
    root: list = [names(("all", "", 0)), 0, 0, {}]
    for size, count, a in buckets:
        if a.traceback:
            path = [names((f.name or "?", f.filename, f.lineno))
                    for f in reversed(innermost_first(a.traceback))]  # root first
            if depth and len(a.traceback) >= depth:
                path.insert(0, names((f"[outer frames not kept: stack deeper than {depth}]", "", 0)))
        else:
            path = [names((f"<thread {a.thread.name}>", "", 0))]
            if a.autograd_node:
                fwd = f" (forward {a.forward})" if a.forward else ""
                path.append(names((f"[backward {a.autograd_node}{fwd}]", "", 0)))
            if a.label:
                path.append(names((f"[label {a.label}]", "", 0)))
            if a.kind != "device":
                path.append(names((f"[{a.kind} memory]", "", 0)))
        node = root
        node[1] += size
        node[2] += count
        for n in path:
            child = node[3].get(n)
            if child is None:
                child = node[3][n] = [n, 0, 0, {}]
            child[1] += size
            child[2] += count
            node = child
    return _pack(root, names, root[1] * FLAME_MIN_FRACTION)


def _pack(root: list, names: _Names, min_value: float) -> list:
    """The tree as nested lists, children largest first, branches under
    ``min_value`` (and past FLAME_MAX_NODES nodes, depth first) folded into
    one "[N smaller]" node per parent.

    A loop over an explicit stack, not recursion: a stack is as deep as the
    capture depth (256 frames) or, in a trace file, deeper."""
    budget = FLAME_MAX_NODES

    def enter(node: list) -> list:
        nonlocal budget
        budget -= 1
        return [node, sorted(node[3].values(), key=lambda c: -c[1]), 0, [], 0, 0, 0]

    stack = [enter(root)]
    while True:
        top = stack[-1]  # [node, kids, next kid, packed kids, small bytes, small count, small n]
        node, kids, i = top[0], top[1], top[2]
        if i < len(kids):
            c = kids[i]
            top[2] = i + 1
            if c[1] >= min_value and budget > 0:
                stack.append(enter(c))
            else:
                top[4] += c[1]
                top[5] += c[2]
                top[6] += 1
            continue
        stack.pop()
        out = top[3]
        if top[6]:
            out.append([names((f"[{top[6]} smaller]", "", 0)), top[4], top[5]])
        packed = [node[0], node[1], node[2], out] if out else [node[0], node[1], node[2]]
        if not stack:
            return packed
        stack[-1][3].append(packed)


# -- tables -------------------------------------------------------------------


def _table(stats: List[tuple], total: int, key_name: str, rows: int) -> Dict[str, Any]:
    cols = [{"key": key_name, "type": "text"}, {"key": "size", "type": "bytes"},
            {"key": "count", "type": "int"}, {"key": "average", "type": "bytes"},
            {"key": "share", "type": "pct"}]
    data = [[str(key), size, count, size // max(count, 1),
             round(100.0 * size / total, 2) if total else 0.0] for key, size, count in stats[:rows]]
    return {"columns": cols, "rows": data, "more": max(len(stats) - rows, 0)}


def _grouped(buckets: List[list], key_type: str) -> List[tuple]:
    """(key, bytes, count) as Snapshot.statistics(key_type) groups them, sorted the same way."""
    key_of = _SIMPLE_KEYS[key_type]
    groups: Dict[Any, list] = {}
    for size, count, a in buckets:
        g = groups.setdefault(key_of(a), [0, 0])
        g[0] += size
        g[1] += count
    out = [(k, v[0], v[1]) for k, v in groups.items()]
    out.sort(key=lambda s: (-s[1], -s[2], str(s[0])))
    return out


def _line_table(snap: Any, total: int, rows: int) -> Dict[str, Any]:
    """Lines of a snapshot, per device when it spans several (each device's
    lines are grouped on their own, as the devices peak at different times)."""
    per_dev = snap.by_device()
    cols = [{"key": "line", "type": "text"}, {"key": "function", "type": "text"},
            {"key": "source", "type": "code"}, {"key": "size", "type": "bytes"},
            {"key": "count", "type": "int"}, {"key": "average", "type": "bytes"},
            {"key": "share", "type": "pct"}]
    if len(per_dev) > 1:
        cols.insert(1, {"key": "device", "type": "text"})
    stats = [(s, dev) for dev, part in per_dev.items() for s in part.statistics("lineno")]
    stats.sort(key=lambda sd: (-sd[0].size, -sd[0].count))
    data = []
    for s, dev in stats[:rows]:
        f = s.key
        lineno = f.lineno or 0
        shown = (f.filename if f.filename.startswith("<")
                 else f"{_short_path(f.filename)}:{lineno if lineno > 0 else '?'}")
        row = [shown, f.name, source_line(f.filename, lineno, 120), s.size, s.count,
               s.size // max(s.count, 1), round(100.0 * s.size / total, 2) if total else 0.0]
        if len(per_dev) > 1:
            row.insert(1, src.device_name(dev))
        data.append(row + [f.filename])
    return {"columns": cols, "rows": data, "more": max(len(stats) - rows, 0),
            "title_col": len(cols)}


def _tables(peak: Any, buckets: List[list], total: int, end: Any, rows: int) -> Dict[str, Any]:
    out = {"lines": _line_table(peak, total, rows)}
    for name, key in (("autograd nodes", "autograd_node"), ("calls", "op"), ("categories", "category"),
                      ("labels", "label"), ("threads", "thread"), ("kinds", "kind")):
        out[name] = _table(_grouped(buckets, key), total, key.replace("_", " "), rows)
    if end is not None:
        out["live at end"] = _line_table(end, end.total_bytes(), rows)
    return out


# -- the rest -------------------------------------------------------------------


def _failures(obj: Any, t0: int) -> List[list]:
    rows = []
    for f in list(getattr(obj, "failures", None) or ())[-TABLE_ROWS:]:
        frame = f.traceback.user_frame if f.traceback else None
        source = source_line(frame.filename, frame.lineno or 0, 120) if frame is not None else ""
        rows.append([_us(f.timestamp_ns, t0), f.size, src.device_name(f.device), f.kind,
                     src.where(f), source, f"CUDA error {getattr(f, 'result', '?')}",
                     getattr(f.thread, "name", str(f.thread)), f.label or "",
                     "\n".join(f.traceback.format()) if f.traceback else ""])
    return rows


def _steps_table(steps: List[Dict[str, Any]], t0: int) -> Dict[str, Any]:
    keys: List[str] = []
    types: Dict[str, str] = {}
    for s in steps:
        for k in s["fields"]:
            if k not in keys and len(keys) < 14:
                keys.append(k)
                types[k] = s["types"].get(k, "text")
    cols = [{"key": "step", "type": "text"}, {"key": "time", "type": "time"}]
    cols += [{"key": k, "type": types[k]} for k in keys]
    rows = [[str(s["index"]), _us(s["timestamp_ns"], t0) if s["timestamp_ns"] else None]
            + [s["fields"].get(k) if types[k] != "text" or k not in s["fields"] else str(s["fields"][k])
               for k in keys]
            for s in steps[-2000:]]
    return {"columns": cols, "rows": rows, "more": max(len(steps) - 2000, 0)}


STEP_PLOT_POINTS = 2000
#: the timeline's step series (memviz.report._source.STEP_SERIES) as the step plot names them
_PLOT_NAMES = {"device total": "current", "torch allocated": "allocated", "torch reserved": "reserved"}


def _step_plot(obj: Any, rows: List[Dict[str, Any]], points: int = STEP_PLOT_POINTS
               ) -> Optional[Dict[str, Any]]:
    """Memory per step for the steps view: ``{"steps": [index, ...], "bucket":
    steps per point, "devices": [{"device", "name", "series": {name: [bytes or
    None per step]}}], "summary": memviz.report.summary.step_summary()}``; series
    are current and peak (memviz's) and allocated/reserved (PyTorch's) where
    the steps have them. More than ``points`` steps are drawn in buckets of
    consecutive steps, each the highest of its steps."""
    from memviz.report.summary import STEP_SERIES, step_records, step_summary

    recs = step_records(obj)
    devices: List[Dict[str, Any]] = []
    if recs:
        index = [r.index for r in recs]
        for dev in sorted({d for r in recs for d in r.devices}, key=lambda d: (d < 0, d)):
            series = {}
            for name in STEP_SERIES:
                vals = [getattr(r.devices.get(dev), name, None) for r in recs]
                vals = [v if isinstance(v, int) and not isinstance(v, bool) else None for v in vals]
                if any(v is not None for v in vals):
                    series[name] = vals
            if series:
                devices.append({"device": dev, "name": src.device_name(dev), "series": series})
    elif rows:  # steps of another kind of recorder: what the timeline draws of them
        ints = all(isinstance(r["index"], int) and not isinstance(r["index"], bool) for r in rows)
        index = [r["index"] if ints else i for i, r in enumerate(rows)]
        per: Dict[Any, Dict[str, List[Any]]] = {}
        for i, r in enumerate(rows):
            for shown, name in _PLOT_NAMES.items():
                for dev, v in (r["series"].get(shown) or {}).items():
                    vals = per.setdefault(dev, {}).setdefault(name, [None] * len(rows))
                    vals[i] = int(v)
        for dev in sorted(per, key=lambda d: (d is None, d is not None and d < 0, d or 0)):
            devices.append({"device": dev, "name": "all devices" if dev is None else src.device_name(dev),
                            "series": per[dev]})
    else:
        return None
    if not devices:
        return None
    bucket = -(-len(index) // max(points, 1))
    if bucket > 1:
        def highest(vals: List[Any]) -> Any:
            got = [v for v in vals if v is not None]
            return max(got) if got else None

        index = index[::bucket]
        for d in devices:
            d["series"] = {k: [highest(v[i:i + bucket]) for i in range(0, len(v), bucket)]
                           for k, v in d["series"].items()}
    return {"steps": index, "bucket": bucket, "devices": devices,
            "summary": step_summary(obj) if recs else None}


def _meta(obj: Any, title: Optional[str], t0: int, t1: int) -> Dict[str, Any]:
    try:
        info = src.call(obj, "capture_info", default={}) or {}
    except Exception:  # noqa: BLE001 - the header must not break the report
        info = {}
    gpu = getattr(obj, "gpu_enabled", info.get("gpu_enabled"))
    reason = getattr(obj, "gpu_off_reason", None) or info.get("gpu_off_reason") or info.get("reason")
    store = info.get("store") or {}
    path = getattr(obj, "path", None)
    return {
        "title": title or (f"memviz report: {os.path.basename(str(path))}" if path else "memviz report"),
        "generated": time.strftime("%Y-%m-%d %H:%M:%S"),
        "duration_s": round((t1 - t0) / 1e9, 3),
        "running": bool(getattr(obj, "running", False)),
        "gpu_enabled": gpu,
        "gpu_off_reason": None if gpu else reason,
        "library": info.get("library"),
        "cupti_version": info.get("version"),
        "depth": getattr(obj, "depth", info.get("depth")),
        "dropped": int(store.get("dropped_allocs", 0) or 0) + int(store.get("dropped_stacks", 0) or 0),
        "unmatched_frees": int(store.get("unmatched_frees", 0) or 0),
        "pytorch": _route(info.get("pytorch")),
    }


def _route(route: Any) -> Optional[Dict[str, Optional[str]]]:
    """How PyTorch's memory was seen ({"route", "reason"}), or None."""
    if not isinstance(route, dict) or not isinstance(route.get("route"), str):
        return None
    reason = route.get("reason")
    return {"route": route["route"], "reason": reason if isinstance(reason, str) else None}


def collect(obj: Any, title: Optional[str] = None, *, points: int = TIMELINE_POINTS,
            rows: int = TABLE_ROWS, live_at_end: bool = True) -> Dict[str, Any]:
    """Everything the HTML report draws, from a Tracker or a loaded trace."""
    totals = {int(d): dict(t) for d, t in obj.totals().items()}
    timeline = list(obj.timeline())
    t0, t1 = src.time_range(obj, timeline, totals)
    peak = obj.peak_snapshot()
    end = obj.snapshot() if live_at_end else None
    buckets = _buckets(peak.allocations)
    total = sum(b[0] for b in buckets)
    allocs = list(end.allocations) if end is not None else []
    peak_only: List[Any] = []
    if any(b[2].category for b in buckets) or any(a.category for a in allocs):
        seen = {(a.device, a.address, a.timestamp_ns) for a in allocs}
        peak_only = [a for a in peak.allocations if (a.device, a.address, a.timestamp_ns) not in seen]
    steps = src.steps(obj)
    found, why_none = src.findings(obj)
    names = _Names()
    by_dev: Dict[int, List[list]] = {}
    for b in buckets:
        by_dev.setdefault(b[2].device, []).append(b)
    depth = getattr(obj, "depth", None)
    flames = [{"device": d, "name": src.device_name(d), "tree": _flame(by_dev[d], names, depth)}
              for d in sorted(by_dev, key=lambda d: (d < 0, d))]
    return {
        "meta": _meta(obj, title, t0, t1),
        "devices": [dict(device=d, name=src.device_name(d), peak_t=_us(t.get("peak_timestamp_ns"), t0),
                         **{k: t.get(k, 0) for k in ("current", "peak", "allocs", "frees", "failed")})
                    for d, t in sorted(totals.items(), key=lambda kv: (kv[0] < 0, kv[0]))],
        "timeline": _timeline(obj, totals, timeline, t0, t1, steps, allocs, peak_only, points),
        "names": names.table,
        "flames": flames,
        "tables": _tables(peak, buckets, total, end, rows),
        "steps": _steps_table(steps, t0) if steps else None,
        "step_plot": _step_plot(obj, steps),
        "findings": found,
        "findings_note": why_none,
        "failures": _failures(obj, t0),
        "segments": _segments(end if end is not None and end.segments else peak,
                              "at the end" if end is not None and end.segments else "at the peak"),
    }


SEGMENTS_SHOWN = 200
BLOCKS_PER_SEGMENT = 400


def _segments(snap: Any, when: str) -> Optional[Dict[str, Any]]:
    """PyTorch's segments with their live blocks (the allocator route), each
    a bar: [device, address, size, unused, largest free, gaps, made at,
    [[offset, size, line, category], ...], blocks left out]; the largest
    SEGMENTS_SHOWN segments."""
    segs = getattr(snap, "segments", None)
    if not segs:
        return None
    rows = []
    for seg in sorted(segs, key=lambda s: -s.size)[:SEGMENTS_SHOWN]:
        uf = seg.traceback.user_frame if seg.traceback else None
        made = "before tracking" if seg.before_tracking else (f"{uf.filename}:{uf.lineno}" if uf else None)
        blocks = []
        for b in sorted(seg.blocks, key=lambda b: -b.size)[:BLOCKS_PER_SEGMENT]:
            bf = b.user_frame
            where = ("before tracking" if b.before_tracking else f"{bf.filename}:{bf.lineno}" if bf
                     else (b.autograd_node or b.thread.name))
            blocks.append([b.address - seg.address, b.size, where, b.category])
        rows.append([seg.device, f"{seg.address:#x}", seg.size, seg.unused, seg.largest_free, seg.free_gaps,
                     made, blocks, max(0, len(seg.blocks) - BLOCKS_PER_SEGMENT)])
    return {"when": when, "rows": rows, "more": max(0, len(segs) - SEGMENTS_SHOWN)}

