"""``memviz diff A B``: two runs of one script, side by side.

``python -m memviz diff A.memviz B.memviz [--json] [--top N] [--key lineno]
[--devices 0:1] [-o OUT]`` compares two traces of the same script run two
ways (with and without AMP, activation checkpointing, gradient accumulation,
``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``...). For each device it
shows A, B, B - A and B / A of:

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
                             "function": str, "count_a": int, "count_b": int,
                             **ROW}, ...],
                  "more_lines": {"count": int, "diff": int}}, ...],
     "notes": [str, ...]}

    SIDE = {"path", "command", "start_wall_time", "duration_s", "truncated",
            "gpu_enabled", "gpu_off_reason", "route"}
    ROW  = {"a": int|null, "b": int|null, "diff": int|null,
            "ratio": float|null, "unit": "bytes"|"count", "source": str}

``peaks`` keeps the shape of version 1. null: not in that trace. ``ratio``
is B / A (null when A is 0 or either is null).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from memviz._errors import InvalidArgument, MemvizError, OutputError
from memviz._units import escape_surrogates, format_size
from memviz.model.pytorch import END_KEY, pytorch_figures

__all__ = ["main", "diff_main", "compare", "render", "diff_text"]

EXIT_USAGE = 2


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


# ---- what the recording tracker stores (called by the trace writer) -----------


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
    out: Dict[int, Dict[str, Any]] = {}
    if not isinstance(raw, dict):
        return out
    for k, v in raw.items():
        try:
            dev = int(k)
        except (TypeError, ValueError):
            continue
        if isinstance(v, dict):
            out[dev] = v
    return out


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


def _name(dev: int) -> str:
    return "pinned host" if dev < 0 else f"cuda:{dev}"


def _pairs(a: _Side, b: _Side, devices: Optional[Sequence[Tuple[int, int]]]) -> List[Tuple[int, int]]:
    """The (device of A, device of B) pairs to compare; InvalidArgument when
    the traces cannot be put side by side."""
    if devices:
        for side, devs in ((a, [p[0] for p in devices]), (b, [p[1] for p in devices])):
            missing = [d for d in devs if d not in side.gpus]
            if missing:
                have = ", ".join(_name(d) for d in side.gpus) or "no GPU allocations"
                raise InvalidArgument(
                    f"memviz diff --devices: trace {side.name} has no allocations on {_name(missing[0])} "
                    f"(it has {have}). What to do: give pairs A:B of devices the traces have "
                    f"({a.name}: {', '.join(map(_name, a.gpus)) or 'none'}; "
                    f"{b.name}: {', '.join(map(_name, b.gpus)) or 'none'}).")
        return list(devices)
    for side, other in ((a, b), (b, a)):
        if not side.gpus and other.gpus and not side.trace.gpu_enabled:
            why = side.trace.gpu_off_reason or "GPU capture was off"
            raise InvalidArgument(
                f"memviz diff: trace {side.name} has no GPU allocations ({why}) while trace "
                f"{other.name} has {', '.join(_name(d) for d in other.gpus)}, so there is nothing "
                f"to put side by side. What to do: record both runs on a GPU with capture on "
                f"(memviz.track(trace=...) or memviz run -o), then compare them.")
    if a.gpus and b.gpus and not set(a.gpus) & set(b.gpus):
        raise InvalidArgument(
            f"memviz diff: the traces were recorded on different devices: {a.name} on "
            f"{', '.join(map(_name, a.gpus))}, {b.name} on {', '.join(map(_name, b.gpus))}. "
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
            where = {"key": shown, "file": filename, "line": lineno, "function": k.name or ""}
        else:
            where = {"key": str(k), "file": "", "line": 0, "function": ""}
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
    names = sorted(set(ca or {}) | set(cb or {}),
                   key=lambda n: -max((ca or {}).get(n, (0, 0))[0], (cb or {}).get(n, (0, 0))[0]))
    src = "the tracker's peak snapshot"
    return [{"category": n, **_row(None if ca is None else ca.get(n, (0, 0))[0],
                                   None if cb is None else cb.get(n, (0, 0))[0], "bytes", src)}
            for n in names]


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
    from memviz.model.snapshot import KEY_TYPES

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


# ---- text ---------------------------------------------------------------------

LABEL = 36
COLS = (11, 11, 12, 8)


def _value(v: Optional[int], unit: str, sign: bool = False) -> str:
    if v is None:
        return "-"
    if unit == "bytes":
        return format_size(v, sign=sign)
    return f"{v:+,}" if sign else f"{v:,}"


def _ratio(r: Optional[float]) -> str:
    return "-" if r is None else f"{r:.2f}x"


def _cells(row: Dict[str, Any]) -> str:
    unit = row["unit"]
    cells = (_value(row["a"], unit), _value(row["b"], unit), _value(row["diff"], unit, sign=True),
             _ratio(row["ratio"]))
    return "".join(f"{c:>{w}}" for c, w in zip(cells, COLS))


def _head(title: str, indent: str = "") -> str:
    return f"{indent}{title:<{LABEL - len(indent)}}" + "".join(
        f"{c:>{w}}" for c, w in zip(("A", "B", "B - A", "B / A"), COLS))


def _when(info: Dict[str, Any]) -> str:
    parts = []
    wall = info.get("start_wall_time")
    if isinstance(wall, (int, float)):
        try:
            parts.append("recorded " + time.strftime("%Y-%m-%d %H:%M", time.localtime(wall)))
        except (OverflowError, OSError, ValueError):  # a date no clock of this machine can show
            parts.append(f"recorded at {wall!r} s of the epoch")
    if isinstance(info.get("duration_s"), (int, float)):
        parts.append(f"{info['duration_s']:.1f} s")
    if info.get("route"):
        parts.append(f"PyTorch through {info['route']}")
    return f" ({', '.join(parts)})" if parts else ""


def render(doc: Dict[str, Any], names: Optional[Tuple[str, str]] = None) -> str:
    """The text of a :func:`compare` document (``names``: what to call the
    traces; default their paths)."""
    if names is None:
        names = (doc["a"].get("path") or "A", doc["b"].get("path") or "B")
    lines = ["memviz diff"]
    for tag, name, side in (("A", names[0], doc["a"]), ("B", names[1], doc["b"])):
        what = side.get("command") or ""
        lines.append(f"  {tag}  {name}" + (f": {what}" if what else "") + _when(side))
    lines.append("=" * (LABEL + sum(COLS)))
    for dev in doc["devices"]:
        lines += ["", _head(dev["name"])]
        for name, label, _unit in FIGURES:
            row = dev["figures"].get(name)
            if row is not None and (row["a"] is not None or row["b"] is not None):
                lines.append(f"  {label:<{LABEL - 2}}{_cells(row)}")
        if dev["categories"]:
            lines += ["", _head("By category at the peak", "  ")]
            lines += [f"    {c['category'][:LABEL - 5]:<{LABEL - 4}}{_cells(c)}" for c in dev["categories"]]
        title = "Top lines at the peak by change" if doc["key"] == "lineno" else f"Top by {doc['key']} at the peak"
        lines += ["", _head(title, "  ")]
        if not dev["lines"]:
            lines.append("    no change")
        for r in dev["lines"]:
            if len(r["key"]) <= LABEL - 5:  # the location in the label column, else on a line of its own
                lines.append(f"    {r['key']:<{LABEL - 4}}{_cells(r)}")
            else:
                lines += [f"    {r['key']}", f"    {'':<{LABEL - 4}}{_cells(r)}"]
        more = dev["more_lines"]
        if more["count"]:
            lines.append(f"    ... {more['count']:,} more changed line(s), "
                         f"{format_size(more['diff'], sign=True)} in all")
    if not doc["devices"]:
        lines += ["", "No allocations in either trace."]
    if doc["notes"]:
        lines.append("")
        lines += [f"Note: {n}" for n in doc["notes"]]
    return escape_surrogates("\n".join(line.rstrip() for line in lines) + "\n")


def diff_text(a: Any, b: Any, names: Optional[Tuple[str, str]] = None, top: int = 10,
              key: str = "lineno") -> str:
    """The text diff of two loaded traces (or trackers)."""
    doc = compare(a, b, names=(f"A ({names[0]})", f"B ({names[1]})") if names else ("A", "B"),
                  top=top, key=key)
    return render(doc, names)


# ---- the command ------------------------------------------------------------------


def _device_pairs(text: str) -> List[Tuple[int, int]]:
    pairs = []
    for part in text.split(","):
        a, sep, b = part.strip().partition(":")
        try:
            pair = (int(a), int(b if sep else a))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected DEVICE_OF_A:DEVICE_OF_B (e.g. 0:1, or 0:0,1:1), got {text!r}") from None
        if min(pair) < 0:
            raise argparse.ArgumentTypeError(f"device numbers are 0 or more, got {text!r}")
        pairs.append(pair)
    return pairs


def diff_parser(prog: str = "memviz diff") -> argparse.ArgumentParser:
    from memviz.cli.run import _positive
    from memviz.model.snapshot import KEY_TYPES

    parser = argparse.ArgumentParser(
        prog=prog, description="Compare two .memviz traces of one script run two ways (with and "
                               "without AMP, activation checkpointing, expandable segments, ...): "
                               "per device, the peak, PyTorch's reserved against allocated, the "
                               "fragmentation figures, the bytes per category and the lines at the "
                               "peak, side by side with B - A and B / A.",
        epilog="Example: memviz diff plain.memviz checkpointed.memviz --top 20", allow_abbrev=False)
    parser.add_argument("a", help="trace A (e.g. the run without the remedy)")
    parser.add_argument("b", help="trace B (e.g. the run with it)")
    parser.add_argument("--json", action="store_const", const="json", dest="format",
                        help="write JSON (the same as --format json)")
    parser.add_argument("--format", choices=("text", "json"), default="text")
    parser.add_argument("--top", type=_positive, default=10, metavar="N",
                        help="lines listed per device (default 10)")
    parser.add_argument("--key", choices=KEY_TYPES, default="lineno",
                        help="group the lines by (default lineno: the user's line)")
    parser.add_argument("--devices", type=_device_pairs, metavar="A:B",
                        help="compare device A of the first trace with device B of the second "
                             "(e.g. 0:1; several: 0:0,1:1); default: the same numbers")
    parser.add_argument("--recover", action="store_true",
                        help="read corrupted files up to the damaged part")
    parser.add_argument("-o", "--output", metavar="PATH", help="write here instead of stdout")
    return parser


def main(argv: Optional[List[str]] = None, prog: str = "memviz diff") -> int:
    """Entry point of ``memviz diff``; returns the exit status (2: an error,
    said on stderr)."""
    from memviz.cli.report import _dumps, _load, _write
    from memviz._outputs import refuse_inputs

    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        opts = diff_parser(prog).parse_args(argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    inputs = (("the older trace (A)", opts.a), ("the newer trace (B)", opts.b))
    if opts.output is not None:
        try:  # before reading anything: -o must not name a trace it compares
            refuse_inputs(opts.output, inputs, "the diff", hint="choose another -o path")
        except OutputError as e:
            print(f"{prog}: {e}", file=sys.stderr)
            return EXIT_USAGE
    names = (os.path.basename(opts.a), os.path.basename(opts.b))
    if names[0] == names[1]:
        names = (opts.a, opts.b)
    try:
        a, b = _load(opts.a, opts.recover, prog), _load(opts.b, opts.recover, prog)
        doc = compare(a, b, names=(f"A ({names[0]})", f"B ({names[1]})"), top=opts.top, key=opts.key, devices=opts.devices)
    except MemvizError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return EXIT_USAGE
    text = _dumps(doc) if opts.format == "json" else render(doc, names)
    return _write(text, opts.output, prog, "the diff", inputs)


diff_main = main
