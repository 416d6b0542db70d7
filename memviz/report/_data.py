"""What the HTML report shows, aggregated in Python into a small JSON-able dict.

The page gets only aggregates: each timeline series is cut to a few thousand
points (bucket maxima kept), the flame graph is the peak's stacks merged into
a tree with tiny branches folded, and tables keep their top rows. So a run
with millions of events still gives a page of a few hundred kilobytes that
opens at once.
"""

from __future__ import annotations

import bisect
import os
import time
from typing import Any, Dict, List, Optional, Tuple

from memviz.capture.availability import sources_line
from memviz.model.lines import location
from memviz.model.statistics import _SIMPLE_KEYS
from memviz.model.traceback import innermost_first
from memviz.report import read
from memviz.report._categories import TENSORS, MemorySeries, memory_series
from memviz.report.outside import held_by_process, outside_section
from memviz.report.summary import before_tracking_allocations, recorded_source, sample_of, sample_sentence
from memviz.report.summary import sample_title, short_path as _short_path, shown_library, source_line, tensor_peaks

__all__ = ["collect"]

TIMELINE_POINTS = 4000
#: the timeline's line of memviz's totals: PyTorch's segments and memory outside PyTorch
DEVICE_MEMORY = "device memory (memviz)"
TABLE_ROWS = 300
FLAME_MIN_FRACTION = 0.0005  # branches under 0.05% of the root are folded
FLAME_MAX_NODES = 20000
#: frames a flame graph shows of one stack, the innermost (the capture keeps
#: 256; a trace file may hold deeper stacks): the page's JSON stays shallow
#: enough for a plain json.loads (html.JSON_MAX_DEPTH)
FLAME_MAX_FRAMES = 300


def _us(ts: Optional[int], t0: int) -> Optional[int]:
    return None if ts is None else (int(ts) - t0) // 1000


# -- timeline ---------------------------------------------------------------


def _at(ts: List[int], vs: List[float], t: Optional[int]) -> Optional[int]:
    """A series' value at time t (ns): its last point not after t."""
    if t is None:
        return None
    i = bisect.bisect_right(ts, t) - 1
    return int(vs[i]) if i >= 0 else None


def _series(name: str, kind: str, ts: List[int], vs: List[float], t0: int,
            points: int, note: str = "") -> Dict[str, Any]:
    ts, vs = read.downsample(ts, vs, points)
    return {"name": name, "kind": kind, "t": [(t - t0) // 1000 for t in ts],
            "v": [int(v) for v in vs], "note": note}


def _timeline(obj: Any, totals: Dict[int, Dict[str, int]], timeline: List[tuple], t0: int,
              t1: int, steps: List[Dict[str, Any]], allocs: List[Any], peak_allocs: List[Any],
              points: int, segments: List[Any]) -> Dict[str, Any]:
    """One chart per device. Each byte counts once at every moment: "device
    memory" is memviz's totals (PyTorch's segments and what lies outside
    PyTorch); "PyTorch tensors" are its blocks, inside those segments, never
    added to them; the category lines add up to the device memory
    (memviz/report/_categories.py)."""
    per_dev: Dict[int, Tuple[List[int], List[int]]] = {}
    for ts, dev, live in timeline:
        t, v = per_dev.setdefault(dev, ([], []))
        t.append(ts)
        v.append(live)
    peak_ts = {d: tot.get("peak_timestamp_ns") or t1 for d, tot in totals.items()}
    mem = MemorySeries({}, {}, "")
    if any(a.category or a.kind == "block" for a in allocs) or \
            any(a.category or a.kind == "block" for a in peak_allocs):
        mem = memory_series(obj, allocs, peak_allocs, peak_ts, t1, points=4 * points, segments=segments)
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
        series = [_series(DEVICE_MEMORY, "total", ts, vs, t0, points)]
        # each line's value at the peak, read at the nanosecond: the drawn series count
        # in microseconds, in which the peak and a free right after it can fall together
        at_peak = {DEVICE_MEMORY: _at(ts, vs, peak_ts.get(dev))}
        if dev in mem.tensors:
            tts, tvs = mem.tensors[dev]
            series.append(_series(TENSORS, "tensors", tts, tvs, t0, points, mem.note))
            at_peak[TENSORS] = _at(tts, tvs, peak_ts.get(dev))
        for cat, (cts, cvs) in sorted(mem.categories.get(dev, {}).items()):
            series.append(_series(cat, "category", cts, cvs, t0, points, mem.note))
            at_peak[cat] = _at(cts, cvs, peak_ts.get(dev))
        for name, _keys, _dev_key in read.STEP_SERIES:
            for key, label in ((dev, name), (None, f"{name} (all devices)")):
                if key is None and (not gpus or dev != gpus[0]):
                    continue
                pts = [(s["timestamp_ns"], s["series"][name][key]) for s in steps
                       if s["timestamp_ns"] is not None and key in s["series"].get(name, {})]
                if pts:
                    series.append(_series(label, "step", [p[0] for p in pts],
                                          [p[1] for p in pts], t0, points))
        peak_v = tot.get("peak", max(vs))
        charts.append({"device": dev, "name": read.device_name(dev),
                       "peak": {"t": _us(peak_ts.get(dev), t0), "v": peak_v,
                                "values": {k: v for k, v in at_peak.items() if v is not None}},
                       # the most the chart holds: its height follows it
                       "held": max([peak_v] + vs),
                       "series": series, "recorded_categories": _recorded_only(obj, dev)})
    return {"t0_ns": t0, "end": _us(t1, t0), "charts": charts, "category_note": mem.note,
            "window": _window(timeline, steps, totals, t0, t1)}


#: the window the timeline opens on is widened by this share of its span on each side
WINDOW_PAD = 0.04
#: a window covering at least this share of the run opens on the whole run
WINDOW_MOST = 0.8


def _window(timeline: List[tuple], steps: List[Dict[str, Any]], totals: Dict[int, Dict[str, int]],
            t0: int, t1: int) -> Optional[Dict[str, Any]]:
    """What the timeline opens on: ``{"start", "end"}`` (microseconds from
    the start, as the series) and ``"why"``: ``"steps"`` from the first
    step's start (not before memory first moved) to the last step's mark,
    when the run recorded steps, else ``"memory moves"``: from the first
    allocation or free to the last; each device's peak inside, a little
    room on each side. None (the whole run) when that is most of the run,
    or nothing happened: a run that imports for 3 s and allocates in its
    last 30 ms opens on those 30 ms."""
    moves = [p[0] for p in timeline]
    marks = [s for s in steps if isinstance(s.get("timestamp_ns"), int)]
    if marks:
        first = marks[0]["timestamp_ns"]
        took = marks[0]["fields"].get("duration") if marks[0]["types"].get("duration") == "time" else None
        if isinstance(took, (int, float)) and not isinstance(took, bool) and took >= 0:
            start = first - int(took * 1000)  # the field is in microseconds
        elif len(marks) > 1:  # a step's length: the marks' median spacing
            gaps = sorted(b["timestamp_ns"] - a["timestamp_ns"] for a, b in zip(marks, marks[1:]))
            start = first - max(gaps[len(gaps) // 2], 0)
        else:
            start = first
        lo = max(start, min(first, min(moves))) if moves else start  # not in the quiet before
        hi, why = marks[-1]["timestamp_ns"], "steps"
    elif moves:
        lo, hi, why = min(moves), max(moves), "memory moves"
    else:
        return None
    for t in totals.values():
        p = t.get("peak_timestamp_ns")
        if isinstance(p, int) and t0 <= p <= t1:
            lo, hi = min(lo, p), max(hi, p)
    run = max(t1 - t0, 1)
    pad = max((hi - lo) * WINDOW_PAD, run * 0.0005)
    lo, hi = max(t0, int(lo - pad)), min(t1, int(hi + pad))
    if hi <= lo or hi - lo >= run * WINDOW_MOST:
        return None
    return {"start": _us(lo, t0), "end": _us(hi, t0), "why": why}


def _recorded_only(obj: Any, dev: int) -> Optional[Dict[str, int]]:
    """The recording tracker's bytes per category at the peak, of a trace
    that keeps them only as totals (written by a memviz that did not keep
    each allocation's category): its lines say <unknown> for those bytes,
    as its snapshots do, and the page shows these beside them. None
    otherwise."""
    from memviz.model.pytorch import END_KEY

    end = getattr(obj, "end", None)
    entry = (end.get(END_KEY) or {}).get(str(dev)) if isinstance(end, dict) else None
    if not isinstance(entry, dict) or "allocation_categories_peak" in entry:
        return None
    cats = entry.get("categories")
    if not isinstance(cats, dict):
        return None
    return {str(k): v for k, v in sorted(cats.items(), key=lambda kv: -kv[1] if type(kv[1]) is int else 0)
            if type(v) is int and v > 0} or None


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


def _frame_name(f: Any) -> str:
    """An icicle node's name: the function, and on a model's line that
    torch.compile compiled what the compiled code did there (the generated
    frame under it names the buffer and the kernel)."""
    compiled = getattr(f, "compiled", None)
    return f"{f.name or '?'} ({compiled})" if compiled else (f.name or "?")


def _is_runpy(filename: str) -> bool:
    return filename == "<frozen runpy>" or os.path.basename(filename) == "runpy.py"


def _launcher_name(filename: str) -> str:
    """A launcher's file as the page names it: runpy, memviz/cli/run.py, record_sample.py."""
    if _is_runpy(filename):
        return "runpy"
    _head, sep, rest = filename.rpartition("/memviz/")
    return "memviz/" + rest if sep else os.path.basename(filename)


def _script_starts(frames: List[Any]) -> int:
    """Where the script starts in a stack (root first): the frame after the
    innermost runpy ``_run_code``, through which ``python -m``, ``memviz
    run`` and runpy.run_path run a script as ``__main__``; 0 when no
    launcher ran it (``python script.py``)."""
    for i in range(len(frames) - 2, -1, -1):
        f = frames[i]
        if f.name == "_run_code" and _is_runpy(f.filename or ""):
            return i + 1
    return 0


def _flame(buckets: List[list], names: _Names, depth: Optional[int] = None,
           launchers: Optional[List[str]] = None) -> list:
    """The icicle tree: [name index, bytes, count, children], root first.

    Each stack starts at the user's script: the launcher's frames above it
    (runpy's, memviz run's, a script that ran it with runpy.run_path) are
    left out, and their files added to ``launchers`` when it is given.
    A stack as deep as the capture depth lost its outer frames; it hangs
    under a marker node saying so, rather than looking like another root."""
    root: list = [names(("all", "", 0)), 0, 0, {}]
    for size, count, a in buckets:
        if a.traceback:
            frames = list(reversed(innermost_first(a.traceback)))  # root first
            start = _script_starts(frames)
            if start and launchers is not None:
                for f in frames[:start]:
                    shown = _launcher_name(f.filename or "?")
                    if shown not in launchers:
                        launchers.append(shown)
            path = [names((_frame_name(f), f.filename, f.lineno)) for f in frames[start:]]
            if depth and len(a.traceback) >= depth and not start:
                path.insert(0, names((f"[outer frames not kept: stack deeper than {depth}]", "", 0)))
            if len(path) > FLAME_MAX_FRAMES:
                path = [names((f"[outer frames not shown: stack deeper than {FLAME_MAX_FRAMES}]", "", 0))] \
                    + path[-FLAME_MAX_FRAMES:]
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
        shown = location(f, _short_path)
        row = [shown, f.name, source_line(f.filename, lineno, 120), s.size, s.count,
               s.size // max(s.count, 1), round(100.0 * s.size / total, 2) if total else 0.0]
        if len(per_dev) > 1:
            row.insert(1, read.device_name(dev))
        data.append(row + [f.filename])
    return {"columns": cols, "rows": data, "more": max(len(stats) - rows, 0),
            "title_col": len(cols)}


def _tables(peak: Any, buckets: List[list], total: int, end: Any, rows: int,
            tensor: Any = None) -> Dict[str, Any]:
    out = {"lines": _line_table(peak, total, rows)}
    if tensor is not None:  # the tensor peak's lines: what to shrink
        out["lines at the tensor peak"] = _line_table(tensor, tensor.total_bytes(), rows)
    for name, key in (("autograd nodes", "autograd_node"), ("calls", "op"), ("categories", "category"),
                      ("labels", "label"), ("threads", "thread"), ("kinds", "kind")):
        out[name] = _table(_grouped(buckets, key), total, key.replace("_", " "), rows)
    if end is not None:
        out["live at end"] = _line_table(end, end.total_bytes(), rows)
    held = before_tracking_allocations(peak, end)
    if held:  # what PyTorch held when tracking started, by category
        before = _buckets(held)
        out["before tracking"] = _table(_grouped(before, "category"), sum(b[0] for b in before),
                                        "category", rows)
    return out


# -- the rest -------------------------------------------------------------------


def _failures(obj: Any, t0: int) -> List[list]:
    rows = []
    for f in list(getattr(obj, "failures", None) or ())[-TABLE_ROWS:]:
        frame = f.traceback.user_frame if f.traceback else None
        source = source_line(frame.filename, frame.lineno or 0, 120) if frame is not None else ""
        rows.append([_us(f.timestamp_ns, t0), f.size, read.device_name(f.device), f.kind,
                     read.where(f), source, f"CUDA error {getattr(f, 'result', '?')}",
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
#: the timeline's step series (memviz.report.read.STEP_SERIES) as the step plot names them
_PLOT_NAMES = {read.STEP_CURRENT: "current", "device total": "device total", "torch allocated": "allocated",
               "torch reserved": "reserved"}


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
                devices.append({"device": dev, "name": read.device_name(dev), "series": series})
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
            devices.append({"device": dev, "name": "all devices" if dev is None else read.device_name(dev),
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
        info = read.call(obj, "capture_info", default={}) or {}
    except Exception:  # noqa: BLE001 - the header must not break the report
        info = {}
    gpu = getattr(obj, "gpu_enabled", info.get("gpu_enabled"))
    reason = getattr(obj, "gpu_off_reason", None) or info.get("gpu_off_reason") or info.get("reason")
    store = info.get("store") or {}
    path = getattr(obj, "path", None)
    sample = sample_of(obj)
    if title is None and sample is not None:
        title = sample_title(sample)
    return {
        "title": title or (f"memviz report: {os.path.basename(str(path))}" if path else "memviz report"),
        # the shipped sample: said at the top; no path of the machine it was recorded on
        "sample": None if sample is None else {"machine": sample.get("machine"), "date": sample.get("date"),
                                               "script": sample.get("script"),
                                               "sentence": sample_sentence(sample)},
        "generated": time.strftime("%Y-%m-%d %H:%M:%S"),
        "duration_s": round((t1 - t0) / 1e9, 3),
        "running": bool(getattr(obj, "running", False)),
        "gpu_enabled": gpu,
        "gpu_off_reason": None if gpu else reason,
        "library": shown_library(info.get("library"), sample),
        "cupti_version": info.get("version"),
        "depth": getattr(obj, "depth", info.get("depth")),
        "dropped": int(store.get("dropped_allocs", 0) or 0) + int(store.get("dropped_stacks", 0) or 0),
        "unmatched_frees": int(store.get("unmatched_frees", 0) or 0),
        "pytorch": _route(info.get("pytorch")),
        # how each source was captured, in one line, where CUPTI did not see it all
        "capture": sources_line(info.get("sources")) if gpu else None,
    }


def _route(route: Any) -> Optional[Dict[str, Optional[str]]]:
    """How PyTorch's memory was seen ({"route", "reason"}), or None."""
    if not isinstance(route, dict) or not isinstance(route.get("route"), str):
        return None
    reason = route.get("reason")
    return {"route": route["route"], "reason": reason if isinstance(reason, str) else None}


def _tensor_peak(obj: Any) -> Any:
    """The tensor peak's snapshot (PyTorch's blocks' own), or None where the
    recording has none."""
    if not tensor_peaks(obj):
        return None
    try:
        return obj.peak_snapshot(peak="tensor")
    except Exception:  # noqa: BLE001 - a report comes out without it
        return None


def collect(obj: Any, title: Optional[str] = None, *, points: int = TIMELINE_POINTS,
            rows: int = TABLE_ROWS, live_at_end: bool = True,
            outside: Optional[Dict[int, Tuple[int, str]]] = None,
            before_tracking: Optional[Dict[int, Dict[str, int]]] = None) -> Dict[str, Any]:
    """Everything the HTML report draws, from a Tracker or a loaded trace.
    ``outside``: {device: (bytes, source)} the process held (None: the
    trace's record, or the driver's figure now); ``before_tracking``:
    {device: {category: bytes}} made before tracking, when known
    (memviz/report/outside.py). The sample shipped with memviz has its
    lines read as recorded."""
    with recorded_source(sample_of(obj)):
        return _collect(obj, title, points=points, rows=rows, live_at_end=live_at_end, outside=outside,
                        before_tracking=before_tracking)


def _collect(obj: Any, title: Optional[str], *, points: int, rows: int, live_at_end: bool,
             outside: Optional[Dict[int, Tuple[int, str]]],
             before_tracking: Optional[Dict[int, Dict[str, int]]]) -> Dict[str, Any]:
    totals = {int(d): dict(t) for d, t in obj.totals().items()}
    timeline = list(obj.timeline())
    t0, t1 = read.time_range(obj, timeline, totals)
    peak = obj.peak_snapshot()
    end = obj.snapshot() if live_at_end else None
    buckets = _buckets(peak.allocations)
    total = sum(b[0] for b in buckets)
    allocs = list(end.allocations) if end is not None else []
    steps = read.steps(obj)
    found, why_none = read.findings(obj)
    names = _Names()
    by_dev: Dict[int, List[list]] = {}
    for b in buckets:
        by_dev.setdefault(b[2].device, []).append(b)
    depth = getattr(obj, "depth", None)
    flames = []
    for d in sorted(by_dev, key=lambda d: (d < 0, d)):
        launchers: List[str] = []
        flames.append({"device": d, "name": read.device_name(d),
                       "tree": _flame(by_dev[d], names, depth, launchers), "launchers": launchers})
    if sample_of(obj) is not None:  # no path of the machine the sample was recorded on
        for entry in names.table:
            entry[1] = _no_machine_path(entry[1])
    return {
        "meta": _meta(obj, title, t0, t1),
        "devices": [dict(device=d, name=read.device_name(d), peak_t=_us(t.get("peak_timestamp_ns"), t0),
                         **{k: t.get(k, 0) for k in ("current", "peak", "allocs", "frees", "failed")})
                    for d, t in sorted(totals.items(), key=lambda kv: (kv[0] < 0, kv[0]))],
        "timeline": _timeline(obj, totals, timeline, t0, t1, steps, allocs, list(peak.allocations), points,
                              [g for snap in (peak, end) for g in getattr(snap, "segments", None) or ()]),
        "names": names.table,
        "flames": flames,
        "tables": _tables(peak, buckets, total, end, rows, _tensor_peak(obj)),
        "steps": _steps_table(steps, t0) if steps else None,
        "step_plot": _step_plot(obj, steps),
        "findings": found,
        "findings_note": why_none,
        "failures": _failures(obj, t0),
        "segments": _segments(end if end is not None and end.segments else peak,
                              "at the end" if end is not None and end.segments else "at the peak"),
        "outside": outside_section(obj, held_by_process(obj) if outside is None else outside, end=end,
                                   before_tracking=before_tracking),
    }


def _no_machine_path(path: str) -> str:
    """A file of the sample's stacks as its page names it: a relative path
    as it is, an installed package's from its package folder, any other
    absolute path by its last two parts."""
    if not path.startswith("/"):
        return path
    _head, sep, rest = path.rpartition("/site-packages/")
    if sep:
        return rest
    parts = [p for p in path.split("/") if p]
    return "/".join([".."] + parts[-2:]) if len(parts) > 2 else path


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
            where = "before tracking" if b.before_tracking else read.where(b)
            blocks.append([b.address - seg.address, b.size, where, b.category])
        rows.append([seg.device, f"{seg.address:#x}", seg.size, seg.unused, seg.largest_free, seg.free_gaps,
                     made, blocks, max(0, len(seg.blocks) - BLOCKS_PER_SEGMENT)])
    return {"when": when, "rows": rows, "more": max(0, len(segs) - SEGMENTS_SHOWN)}

