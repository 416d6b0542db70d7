"""The comparison of two traces for ``memviz diff``: :func:`compare` reads
each side (a loaded trace or a live tracker), pairs their devices and
returns one document; memviz.cli.diff_render writes its text, memviz.cli.diff
is the command.

For each pair of devices the document holds A, B, B - A and B / A of:

* the peak memviz saw (driver level), what was live at the end, the number of
  allocations and failed allocations;
* PyTorch's reserved against allocated: its own peaks
  (``torch.cuda.memory_stats``: ``reserved_bytes.all.peak``,
  ``allocated_bytes.all.peak`` and ``num_alloc_retries``, read when tracking
  stopped; from the step records where the trace has no such figures), and
  at memviz's peak the caching allocator's segments (reserved), the blocks in
  them (allocated), the unused pool, the largest free block and the number of
  gaps, as ``Snapshot.fragmentation()`` gives them;
* the bytes per category at the peak (parameter, gradient, activation, ...);
* the lines whose bytes at the peak differ most.

The PyTorch figures and categories are what the recording tracker knew when
it stopped: the trace writer stores them in the END chunk under
``"pytorch_peak"`` (see :func:`memviz.model.pytorch.pytorch_figures`). Traces without them (no
PyTorch, or recorded by an older memviz) show "-" there; the segment figures
are then rebuilt from the events when PyTorch's blocks are in the trace.

JSON (``--json``), version 2::

    {"memviz_diff": 2, "key": "lineno",
     "a": SIDE, "b": SIDE,
     "peaks": [{"device": int, "a": int, "b": int}, ...],
     "devices": [{"device_a": int, "device_b": int, "name": "cuda:0",
                  "figures": {NAME: ROW, ...},
                  "categories": [{"category": str, **ROW}, ...] | null,
                  "lines": [{"key": str, "file": str, "line": int,
                             "function": str, "backward": str|null,
                             "count_a": int, "count_b": int, **ROW}, ...],
                  "more_lines": {"count": int, "diff": int}}, ...],
     "notes": [str, ...]}

    SIDE = {"path", "command", "start_wall_time", "duration_s", "truncated",
            "gpu_enabled", "gpu_off_reason", "route"}
    ROW  = {"a": int|null, "b": int|null, "diff": int|null,
            "ratio": float|null, "unit": "bytes"|"count", "source": str}

A line's ``key`` is written as every report writes it
(memviz/model/lines.py): ``file:line``, or for the allocations a backward
node made with no Python frames ``file:line (backward: NODE)`` (the forward
line that made the node; ``backward`` holds the node, each node its own row).
``peaks`` keeps the shape of version 1. null: not in that trace. ``ratio``
is B / A (null when A is 0 or either is null).

Imports memviz.cli.common and the floors below memviz.cli (docs/architecture.md).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

from memviz._errors import InvalidArgument
from memviz.cli.common import device_name as _name
from memviz.model.pytorch import END_KEY, pytorch_figures
from memviz.report.summary import device_items

__all__ = ["compare", "FIGURES"]


#: (name, label, unit) of the figure rows, in the order shown
FIGURES: Tuple[Tuple[str, str, str], ...] = (
    ("peak", "peak (memviz, driver level)", "bytes"),
    ("current", "live at the end", "bytes"),
    ("torch_reserved_peak", "PyTorch's peak reserved", "bytes"),
    ("torch_allocated_peak", "PyTorch's peak allocated", "bytes"),
    ("reserved_at_peak", "at the peak: reserved (segments)", "bytes"),
    ("allocated_at_peak", "at the peak: allocated (blocks)", "bytes"),
    ("unused_pool", "at the peak: unused pool", "bytes"),
    ("largest_free", "at the peak: largest free block", "bytes"),
    ("free_gaps", "at the peak: gaps between blocks", "count"),
    ("segments", "at the peak: segments", "count"),
    ("allocs", "allocations", "count"),
    ("alloc_retries", "PyTorch's allocation retries", "count"),
    ("failed", "failed allocations", "count"),
)


# ---- reading one side ---------------------------------------------------------


def _count(v: Any) -> Optional[int]:
    """A whole number >= 0 from a trace's plain JSON, else None."""
    return v if type(v) is int and v >= 0 else None


def _recorded(trace: Any) -> Dict[int, Dict[str, Any]]:
    """The figures pytorch_figures() stored: from the END chunk of a loaded
    trace, computed now for a tracker."""
    end = getattr(trace, "end", None)
    raw = end.get(END_KEY) if isinstance(end, dict) else (
        None if hasattr(trace, "end") else pytorch_figures(trace))
    if not isinstance(raw, dict):
        return {}
    return {dev: v for dev, v in device_items(raw) if isinstance(v, dict)}


def _numbers(d: Any) -> Dict[str, int]:
    """The whole-number entries of a recorded dict ({} for anything else)."""
    if not isinstance(d, dict):
        return {}
    return {str(k): v for k, v in d.items() if _count(v) is not None}


class _Side:
    """One trace (or tracker), what the diff reads of it."""

    def __init__(self, trace: Any, name: str) -> None:
        self.trace, self.name = trace, name
        self.totals = trace.totals()
        self.recorded = _recorded(trace)
        self._peaks: Dict[int, Any] = {}

    @property
    def gpus(self) -> List[int]:
        return sorted(d for d in self.totals if d >= 0)

    def peak(self, dev: int):
        """The peak snapshot of ``dev``: a loaded trace puts PyTorch's blocks
        inside their segments (every byte once, as a live tracker's is)."""
        snap = self._peaks.get(dev)
        if snap is None:
            snap = self._peaks[dev] = self.trace.peak_snapshot(dev)
        return snap

    def figures(self, dev: int) -> Dict[str, Tuple[Optional[int], str]]:
        """name -> (value or None, where it comes from)."""
        tot = self.totals.get(dev, {})
        out: Dict[str, Tuple[Optional[int], str]] = {
            name: (int(tot.get(name, 0)), "memviz") for name in ("peak", "current", "allocs", "failed")}
        if dev < 0:
            return out
        rec = self.recorded.get(dev, {})
        stats = _numbers(rec.get("memory_stats"))
        src = "torch.cuda.memory_stats when tracking stopped"
        if stats:
            out["torch_reserved_peak"] = (stats.get("reserved_peak"), src)
            out["torch_allocated_peak"] = (stats.get("allocated_peak"), src)
            out["alloc_retries"] = (stats.get("alloc_retries"), src)
        else:
            res, alloc = self._from_steps(dev)
            out["torch_reserved_peak"] = (res, "the step records (highest reserved)" if res is not None else "")
            out["torch_allocated_peak"] = (alloc, "the step records (highest allocated peak)"
                                           if alloc is not None else "")
        frag, fsrc = _numbers(rec.get("fragmentation")), "the tracker's peak snapshot"
        if not frag:
            frag = self.peak(dev).fragmentation(dev).get(dev, {})
            fsrc = "the trace's blocks and segments at the peak"
        for name, key in (("reserved_at_peak", "reserved"), ("allocated_at_peak", "allocated"),
                          ("unused_pool", "unused"), ("largest_free", "largest_free"),
                          ("free_gaps", "free_gaps"), ("segments", "segments")):
            out[name] = (frag.get(key), fsrc) if frag else (None, "")
        return out

    def _from_steps(self, dev: int) -> Tuple[Optional[int], Optional[int]]:
        res, alloc = [], []
        for s in getattr(self.trace, "steps", None) or ():
            d = getattr(s, "devices", {}).get(dev) if hasattr(s, "devices") else None
            if d is None:
                continue
            if _count(getattr(d, "reserved", None)) is not None:
                res.append(d.reserved)
            peak = getattr(d, "allocated_peak", None)
            if _count(peak) is not None:
                alloc.append(peak)
        return (max(res) if res else None), (max(alloc) if alloc else None)

    def categories(self, dev: int) -> Optional[Dict[str, Tuple[int, int]]]:
        """category -> (bytes, count) at the peak, or None where not recorded."""
        rec = self.recorded.get(dev, {})
        sizes, counts = _numbers(rec.get("categories")), _numbers(rec.get("category_counts"))
        if not sizes:
            return None
        return {k: (v, counts.get(k, 0)) for k, v in sizes.items()}

    def route(self) -> Optional[str]:
        routes = {r.get("route") for r in self.recorded.values() if isinstance(r.get("route"), str)}
        return routes.pop() if len(routes) == 1 else (", ".join(sorted(routes)) or None)

    def info(self) -> Dict[str, Any]:
        t = self.trace
        meta = getattr(t, "meta", {}) or {}
        started, stopped = getattr(t, "started_ns", None), getattr(t, "stopped_ns", None)
        return {
            "path": getattr(t, "path", None), "command": getattr(t, "command", None),
            "start_wall_time": meta.get("start_wall_time"),
            "duration_s": (stopped - started) / 1e9 if started is not None and stopped else None,
            "truncated": bool(getattr(t, "truncated", False)),
            "gpu_enabled": bool(getattr(t, "gpu_enabled", False)),
            "gpu_off_reason": getattr(t, "gpu_off_reason", None),
            "route": self.route(),
        }


# ---- the comparison -------------------------------------------------------------


def _row(a: Optional[int], b: Optional[int], unit: str, source: str = "") -> Dict[str, Any]:
    both = a is not None and b is not None
    return {"a": a, "b": b, "diff": b - a if both else None,
            "ratio": b / a if both and a else None, "unit": unit, "source": source}


def _listed(devs: Sequence[int], none: str = "none") -> str:
    """``cuda:0, cuda:1`` (``none`` for no device)."""
    return ", ".join(map(_name, devs)) or none


def _pairs(a: _Side, b: _Side, devices: Optional[Sequence[Tuple[int, int]]]) -> List[Tuple[int, int]]:
    """The (device of A, device of B) pairs to compare; InvalidArgument when
    the traces cannot be put side by side."""
    if devices:
        for side, devs in ((a, [p[0] for p in devices]), (b, [p[1] for p in devices])):
            missing = [d for d in devs if d not in side.gpus]
            if missing:
                raise InvalidArgument(
                    f"memviz diff --devices: trace {side.name} has no allocations on {_name(missing[0])} "
                    f"(it has {_listed(side.gpus, 'no GPU allocations')}). What to do: give pairs A:B of "
                    f"devices the traces have ({a.name}: {_listed(a.gpus)}; {b.name}: {_listed(b.gpus)}).")
        return list(devices)
    for side, other in ((a, b), (b, a)):
        if not side.gpus and other.gpus and not side.trace.gpu_enabled:
            why = side.trace.gpu_off_reason or "GPU capture was off"
            raise InvalidArgument(
                f"memviz diff: trace {side.name} has no GPU allocations ({why}) while trace "
                f"{other.name} has {_listed(other.gpus)}, so there is nothing "
                f"to put side by side. What to do: record both runs on a GPU with capture on "
                f"(memviz.track(trace=...) or memviz run -o), then compare them.")
    if a.gpus and b.gpus and not set(a.gpus) & set(b.gpus):
        raise InvalidArgument(
            f"memviz diff: the traces were recorded on different devices: {a.name} on "
            f"{_listed(a.gpus)}, {b.name} on {_listed(b.gpus)}. "
            f"What to do: pass --devices {a.gpus[0]}:{b.gpus[0]} to compare {_name(a.gpus[0])} of "
            f"{a.name} with {_name(b.gpus[0])} of {b.name}, or record both runs on the same device "
            f"(CUDA_VISIBLE_DEVICES).")
    devs = sorted(set(a.totals) | set(b.totals), key=lambda d: (d < 0, d))
    return [(d, d) for d in devs]


def _lines(a: _Side, b: _Side, da: int, db: int, key: str, top: int):
    from memviz.report.text import _location

    old, new = a.peak(da), b.peak(db)
    if da != db:  # a Frame key holds no device; a "device" key would never match
        new = _renumbered(new, da)
    diffs = [d for d in new.compare_to(old, key) if d.size_diff or d.count_diff]
    rows = []
    for d in diffs[:top]:
        k = d.key
        if hasattr(k, "filename"):
            shown, filename, lineno = _location(k)
            where = {"key": shown, "file": filename, "line": lineno, "function": k.name or "",
                     "backward": k.autograd_node}
        else:
            where = {"key": str(k), "file": "", "line": 0, "function": "", "backward": None}
        rows.append({**where, "count_a": d.count - d.count_diff, "count_b": d.count,
                     **_row(d.size - d.size_diff, d.size, "bytes", "peak snapshots")})
    rest = diffs[top:]
    return rows, {"count": len(rest), "diff": sum(d.size_diff for d in rest)}


def _renumbered(snap: Any, dev: int):
    from memviz.model.snapshot import Snapshot

    new = Snapshot([x._replace(device=dev) for x in snap.allocations], timestamp_ns=snap.timestamp_ns,
                   frame_filter=snap.frame_filter)
    new.segments = snap.segments
    return new


def _categories(a: _Side, b: _Side, da: int, db: int) -> Optional[List[Dict[str, Any]]]:
    ca, cb = a.categories(da), b.categories(db)
    if ca is None and cb is None:
        return None

    def size(cats: Optional[Dict[str, Tuple[int, int]]], name: str) -> Optional[int]:
        return None if cats is None else cats.get(name, (0, 0))[0]

    names = sorted(set(ca or {}) | set(cb or {}), key=lambda n: -max(size(ca, n) or 0, size(cb, n) or 0))
    src = "the tracker's peak snapshot"
    return [{"category": n, **_row(size(ca, n), size(cb, n), "bytes", src)} for n in names]


def _notes(a: _Side, b: _Side) -> List[str]:
    notes = []
    for s in (a, b):
        if getattr(s.trace, "truncated", False):
            notes.append(f"{s.name} is incomplete ({getattr(s.trace, 'error', None) or 'cut short'}): "
                         "its figures go up to where it stops.")
        if not s.gpus:
            why = getattr(s.trace, "gpu_off_reason", None)
            notes.append(f"{s.name} has no GPU allocations" + (f" (GPU capture was off: {why})." if why else "."))
    ia, ib = a.info(), b.info()
    sa, sb = _script(a.trace), _script(b.trace)
    if sa and sb and sa != sb:
        notes.append(f"A and B ran different scripts ({sa} and {sb}): lines match only where the files do.")
    if ia["route"] and ib["route"] and ia["route"] != ib["route"]:
        notes.append(f"PyTorch's memory was seen through different routes (A: {ia['route']}, "
                     f"B: {ib['route']}): the figures at the peak differ in kind.")
    if not (a.recorded or b.recorded) and (a.gpus or b.gpus):
        notes.append("Neither trace holds PyTorch's own figures or categories (recorded without "
                     "PyTorch, or by an older memviz), so those rows are left out.")
    return notes


def _script(trace: Any) -> Optional[str]:
    argv = (getattr(trace, "meta", None) or {}).get("argv")
    return argv[0] if isinstance(argv, list) and argv and isinstance(argv[0], str) else None


def compare(a: Any, b: Any, *, names: Tuple[str, str] = ("A", "B"), top: int = 10,
            key: str = "lineno", devices: Optional[Sequence[Tuple[int, int]]] = None) -> Dict[str, Any]:
    """The comparison of two loaded traces (or trackers) as the JSON document
    of the module docstring. Raises InvalidArgument when they cannot be put
    side by side (different devices, one recorded without GPU capture)."""
    from memviz.model.statistics import KEY_TYPES

    if key not in KEY_TYPES:
        raise InvalidArgument(f"memviz diff: key {key!r} is not one of {', '.join(KEY_TYPES)}")
    sa, sb = _Side(a, names[0]), _Side(b, names[1])
    pairs = _pairs(sa, sb, devices)
    out_devices = []
    for da, db in pairs:
        fa, fb = sa.figures(da), sb.figures(db)
        figures = {}
        for name, _label, unit in FIGURES:
            if name in fa or name in fb:
                va, src_a = fa.get(name, (None, ""))
                vb, src_b = fb.get(name, (None, ""))
                figures[name] = _row(va, vb, unit, src_a if src_a == src_b or not src_b else
                                     (f"A: {src_a}; B: {src_b}" if src_a else src_b))
        lines, more = _lines(sa, sb, da, db, key, top)
        out_devices.append({"device_a": da, "device_b": db,
                            "name": _name(da) if da == db else f"{_name(da)} / {_name(db)}",
                            "figures": figures,
                            "categories": _categories(sa, sb, da, db) if da >= 0 else None,
                            "lines": lines, "more_lines": more})
    return {
        "memviz_diff": 2, "key": key, "a": sa.info(), "b": sb.info(),
        "peaks": [{"device": da, "a": sa.totals.get(da, {}).get("peak", 0),
                   "b": sb.totals.get(db, {}).get("peak", 0)} for da, db in pairs],
        "devices": out_devices, "notes": _notes(sa, sb),
    }
