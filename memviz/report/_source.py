"""Reading a Tracker or a loaded trace, duck-typed, for reports and exports.

Everything here works on any object with the Tracker's reading API
(``snapshot()``, ``peak_snapshot()``, ``totals()``, ``timeline()``,
``failures``, ``capture_info()``, ``steps``, ``diagnose()``) and uses the
optional extras when they exist:

* ``events()``: an iterable of allocation events (a loaded ``.memviz`` trace
  has them). Each event may be a mapping, a named tuple or an object; the
  fields read are ``op`` (``"alloc"``/``"free"``/``"failed"``, or the codes 1,
  2, 3 of the trace format), ``timestamp_ns``, ``device``, ``address``,
  ``size`` and, when present, ``kind``, ``stream``, ``category``,
  ``traceback``, ``label``, ``thread``, ``autograd_node`` and ``forward``.
  :func:`events` turns each into an :class:`Event`.
* ``started_ns`` / ``stopped_ns``: the time range of the run.

Nothing here changes the object it reads.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Dict, Iterable, Iterator, List, Mapping, NamedTuple, Optional, Tuple

from .._snapshot import KIND_NAMES

__all__ = ["Event", "events", "steps", "findings", "time_range", "device_name", "where",
           "frame_dicts", "downsample", "call"]


class Event(NamedTuple):
    """One allocation event, normalized from whatever ``events()`` yields."""

    op: str  # "alloc", "free" or "failed"
    timestamp_ns: int
    device: int
    address: int
    size: int
    kind: str = "device"
    stream: int = 0
    category: Optional[str] = None
    traceback: Any = None
    label: Optional[str] = None
    thread: Optional[str] = None
    autograd_node: Optional[str] = None
    forward: Optional[str] = None


_OPS = {1: "alloc", 2: "free", 3: "failed", "alloc": "alloc", "malloc": "alloc",
        "allocate": "alloc", "free": "free", "release": "free", "failed": "failed",
        "fail": "failed", "oom": "failed"}
_MISSING = object()


def _field(obj: Any, names: Tuple[str, ...], default: Any = None) -> Any:
    if isinstance(obj, Mapping):
        for n in names:
            if n in obj:
                return obj[n]
        return default
    for n in names:
        v = getattr(obj, n, _MISSING)
        if v is not _MISSING:
            return v
    return default


def _normalize(ev: Any) -> Optional[Event]:
    op = _field(ev, ("op", "action", "event", "type"))
    kind = _field(ev, ("alloc_kind", "memory_kind", "kind"))
    if op is None and kind in _OPS:  # some formats name the operation "kind"
        op, kind = kind, _field(ev, ("alloc_kind", "memory_kind"))
    op = _OPS.get(op.lower() if isinstance(op, str) else op)
    if op is None:  # time marks, gaps and unknown records carry no memory
        return None
    if isinstance(kind, int) and 0 <= kind < len(KIND_NAMES):
        kind = KIND_NAMES[kind]
    thread = _field(ev, ("thread", "thread_name"))
    if thread is not None and not isinstance(thread, str):
        thread = getattr(thread, "name", None) or str(thread)
    return Event(
        op=op,
        timestamp_ns=int(_field(ev, ("timestamp_ns", "timestamp", "ts", "time_ns"), 0) or 0),
        device=int(_field(ev, ("device", "slot"), 0) or 0),
        address=int(_field(ev, ("address", "addr"), 0) or 0),
        size=int(_field(ev, ("size", "bytes"), 0) or 0),
        kind=kind if isinstance(kind, str) else "device",
        stream=int(_field(ev, ("stream",), 0) or 0),
        category=_field(ev, ("category",)),
        traceback=_field(ev, ("traceback", "frames", "stack")),
        label=_field(ev, ("label",)),
        thread=thread,
        autograd_node=_field(ev, ("autograd_node", "node")),
        forward=_field(ev, ("forward",)),
    )


def events(obj: Any) -> Optional[Iterator[Event]]:
    """The object's allocation events as :class:`Event`, in order; None when
    it keeps none (a plain Tracker keeps totals, not a history).

    A stopped Tracker that streamed a trace file (``track(trace=path)``) is
    read back through ``memviz.load`` when that is available."""
    fn = getattr(obj, "events", None)
    if not callable(fn):
        path = getattr(obj, "trace_path", None)
        if not path or getattr(obj, "running", False) or not os.path.exists(path):
            return None
        try:
            import memviz
            fn = memviz.load(path).events  # type: ignore[attr-defined]
        except Exception:  # noqa: BLE001 - no reader, or an unreadable file: no history
            return None
    return (e for e in (_normalize(raw) for raw in fn()) if e is not None)


def call(obj: Any, name: str, *args: Any, default: Any = None) -> Any:
    """``obj.name(*args)`` if the object has it, else ``default``."""
    fn = getattr(obj, name, None)
    return fn(*args) if callable(fn) else default


def time_range(obj: Any, timeline: List[tuple], totals: Mapping[int, Mapping[str, int]]
               ) -> Tuple[int, int]:
    """(start, end) in the store's nanoseconds: the run's range if known,
    else the range of the timeline points and peaks."""
    stamps = [p[0] for p in timeline[:1]] + [p[0] for p in timeline[-1:]]
    stamps += [t.get("peak_timestamp_ns") or 0 for t in totals.values()]
    stamps = [s for s in stamps if s]
    start = getattr(obj, "started_ns", None) or (min(stamps) if stamps else 0)
    end = getattr(obj, "stopped_ns", None)
    if end is None:
        import time
        end = time.monotonic_ns() if getattr(obj, "running", False) else max(stamps, default=start)
    return int(start), int(max(end, start))


def device_name(dev: int) -> str:
    return "pinned host" if dev < 0 else f"cuda:{dev}"


def where(a: Any) -> str:
    """The user's line of an allocation (or failure), or its thread and node."""
    tb = getattr(a, "traceback", None)
    if tb:
        return str(tb)
    thread = getattr(getattr(a, "thread", None), "name", None) or "?"
    node = getattr(a, "autograd_node", None)
    return f"<thread {thread}>" + (f" {node}" if node else "")


def frame_dicts(a: Any) -> List[Dict[str, Any]]:
    """Frames of an allocation as torch's snapshot writes them (innermost
    first); a frameless one gets a pseudo frame naming its thread and what
    it was doing (autograd node, label, kind)."""
    tb = getattr(a, "traceback", None) or ()
    out = [{"filename": f.filename, "line": int(f.lineno or 0), "name": f.name or "?"}
           for f in tb]
    if out:
        return out
    thread = getattr(getattr(a, "thread", None), "name", None) or getattr(a, "thread", None) or "?"
    node = getattr(a, "autograd_node", None)
    forward = getattr(a, "forward", None)
    what = []
    if node:
        what.append(f"{node}" + (f" (forward {forward})" if forward else ""))
    if getattr(a, "label", None):
        what.append(f"label {a.label}")
    kind = getattr(a, "kind", "device")
    if kind != "device":
        what.append(f"{kind} memory")
    return [{"filename": f"<thread {thread}>", "line": 0,
             "name": "; ".join(what) or "no Python frames"}]


def _as_dict(rec: Any) -> Dict[str, Any]:
    if isinstance(rec, Mapping):
        return dict(rec)
    fn = getattr(rec, "to_dict", None)
    if callable(fn):
        return dict(fn())
    if dataclasses.is_dataclass(rec) and not isinstance(rec, type):
        return dataclasses.asdict(rec)
    if hasattr(rec, "_asdict"):
        return dict(rec._asdict())
    return {k: v for k, v in vars(rec).items() if not k.startswith("_")} if hasattr(rec, "__dict__") else {}


_STEP_INDEX = ("step", "index", "step_index", "i")
_STEP_TIME = ("timestamp_ns", "timestamp", "time_ns", "ts")
#: step series drawn on the timeline: (name shown, keys tried)
STEP_SERIES = (
    ("torch allocated", ("allocated", "torch_allocated", "allocated_bytes")),
    ("torch reserved", ("reserved", "torch_reserved", "reserved_bytes")),
    ("device total", ("device_total", "device_totals", "device_used", "nvml", "process_total")),
)


def _per_device(value: Any) -> Optional[Dict[Optional[int], float]]:
    """A step number as {device: value}; None (the key) for all devices."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        return {None: value}
    if isinstance(value, Mapping):
        out: Dict[Optional[int], float] = {}
        for k, v in value.items():
            try:
                dev = int(k)
            except (TypeError, ValueError):
                continue
            if isinstance(v, Mapping):
                v = _field(v, ("current", "allocated", "total", "bytes", "used"))
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                out[dev] = v
        return out or None
    return None


def _scalar(v: Any) -> Any:
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    if isinstance(v, Mapping):
        nums = [x for x in (_per_device(v) or {}).values()]
        return sum(nums) if nums else None
    return str(v)


def steps(obj: Any) -> List[Dict[str, Any]]:
    """Step records as dicts: ``index``, ``timestamp_ns``, ``series``
    ({name: {device or None: value}}) and ``fields`` (scalars for a table)."""
    out = []
    for i, rec in enumerate(getattr(obj, "steps", None) or ()):
        try:
            d = _as_dict(rec)
        except Exception:  # noqa: BLE001 - one odd record must not break a report
            continue
        index = _field(d, _STEP_INDEX, i)
        ts = _field(d, _STEP_TIME)
        series = {}
        for name, keys in STEP_SERIES:
            per = _per_device(_field(d, keys))
            if per:
                series[name] = per
        fields = {k: _scalar(v) for k, v in d.items() if k not in _STEP_INDEX and k not in _STEP_TIME}
        fields = {k: v for k, v in fields.items() if v is not None and not isinstance(v, (list, tuple))}
        out.append({"index": index, "timestamp_ns": int(ts) if isinstance(ts, (int, float)) else None,
                    "series": series, "fields": fields})
    return out


def findings(obj: Any) -> Tuple[Optional[List[Dict[str, Any]]], Optional[str]]:
    """(findings as dicts, None) or (None, why there are none to show)."""
    fn = getattr(obj, "diagnose", None)
    if not callable(fn):
        return None, "this object cannot diagnose"
    try:
        raw = fn()
    except ImportError:
        return None, "diagnoses are not available in this memviz build"
    except Exception as e:  # noqa: BLE001 - a failed diagnosis must not break the report
        return None, f"diagnose() failed: {type(e).__name__}: {e}"
    return [normalize_finding(f) for f in raw or ()], None


def normalize_finding(f: Any) -> Dict[str, Any]:
    """kind, message, numbers ({name: value}), lines (list of str) and fix of a finding."""
    d = _as_dict(f) if not isinstance(f, str) else {"message": f}
    numbers = d.get("numbers") or {}
    if not isinstance(numbers, Mapping):
        numbers = {"value": numbers}
    lines = d.get("lines") or []
    if isinstance(lines, (str, bytes)) or not isinstance(lines, Iterable):
        lines = [lines]
    return {
        "kind": str(d.get("kind") or "finding"),
        "severity": str(d.get("severity") or ""),
        "message": str(d.get("message") or ""),
        "numbers": {str(k): (v if isinstance(v, (int, float)) and not isinstance(v, bool) else str(v))
                    for k, v in numbers.items()},
        "lines": [str(x) for x in lines],
        "fix": str(d.get("fix") or ""),
    }


def downsample(ts: List[int], vs: List[float], n: int) -> Tuple[List[int], List[float]]:
    """At most about ``n`` points of a series, keeping each time bucket's
    maximum (so peaks survive), the first and the last point."""
    if len(ts) <= n:
        return list(ts), list(vs)
    t0, t1 = ts[0], ts[-1]
    span = max(t1 - t0, 1)
    out_t, out_v = [ts[0]], [vs[0]]
    bucket, best_i = None, -1
    for i in range(1, len(ts) - 1):
        b = (ts[i] - t0) * n // span
        if b != bucket:
            if best_i >= 0:
                out_t.append(ts[best_i])
                out_v.append(vs[best_i])
            bucket, best_i = b, i
        elif vs[i] > vs[best_i]:
            best_i = i
    if best_i >= 0:
        out_t.append(ts[best_i])
        out_v.append(vs[best_i])
    out_t.append(ts[-1])
    out_v.append(vs[-1])
    return out_t, out_v
