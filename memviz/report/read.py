"""Reading a Tracker or a loaded trace, duck-typed, for reports and exports.

Everything here works on any object with the Tracker's reading API
(``snapshot()``, ``peak_snapshot()``, ``totals()``, ``timeline()``,
``failures``, ``capture_info()``, ``steps``, ``diagnose()``) and uses the
optional extras when they exist:

* ``events()``: the allocation events of the recording (a loaded ``.memviz``
  trace, or a stopped Tracker that streamed one): see :func:`events`.
* ``started_ns`` / ``stopped_ns``: the time range of the run.

Nothing here changes the object it reads. Imported as ``read``
(``read.events(obj)``, ``read.steps(obj)``) by the HTML and notebook reports
(``_data.py``, ``notebook.py``), the category series (``_categories.py``) and
the exports (memviz/export/).
"""

from __future__ import annotations

import collections.abc
import dataclasses
import math
import re
from typing import Any, Dict, Iterable, Iterator, List, Mapping, Optional, Tuple

from memviz._units import format_size
from memviz.model.lines import where as _where
from memviz.model.traceback import innermost_first
from memviz.report.summary import device_items, device_name, finding_steps

__all__ = ["events", "steps", "findings", "normalize_finding", "time_range",
           "device_name", "device_items", "where", "frame_dicts", "downsample", "call", "is_bytes_key"]


_MISSING = object()


def _field(obj: Any, names: Tuple[str, ...], default: Any = None) -> Any:
    if isinstance(obj, _Map):
        for n in names:
            if n in obj:
                return obj[n]
        return default
    for n in names:
        v = getattr(obj, n, _MISSING)
        if v is not _MISSING:
            return v
    return default


def events(obj: Any) -> Optional[Iterator[Any]]:
    """The recording's allocation events, in order: ``obj.events()``, which a
    loaded trace has and a stopped Tracker reads back from the trace it
    streamed (``track(trace=path)``); each a
    :class:`~memviz.trace.reader.TraceEvent` (``op``: ``"alloc"``, ``"free"``
    or ``"failed"``, ``timestamp_ns``, ``device``, ``address``, ``size``,
    ``kind``, ``stream``, ``category``, ``traceback``, ``thread``, ``label``,
    ``autograd_node``, ``forward``). None when it keeps none (a Tracker
    without a streamed trace keeps totals and live sets, not a history)."""
    fn = getattr(obj, "events", None)
    return fn() if callable(fn) else None


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


def where(a: Any) -> str:
    """The line of an allocation (or failure) as every report writes it: its
    user frame, its autograd node's forward line ``file:line (backward:
    NODE)``, or ``<thread NAME>`` (the rule of memviz/model/lines.py)."""
    return _where(a)


def frame_dicts(a: Any) -> List[Dict[str, Any]]:
    """Frames of an allocation as torch's snapshot writes them (innermost
    first); a frameless one gets a pseudo frame naming its thread and what
    it was doing (autograd node, label, kind)."""
    tb = getattr(a, "traceback", None) or ()
    out = [{"filename": f.filename, "line": int(f.lineno or 0), "name": f.name or "?"}
           for f in innermost_first(tb)]
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
    if isinstance(rec, _Map):
        return dict(rec)
    fn = getattr(rec, "to_dict", None)
    if callable(fn):
        return dict(fn())
    if dataclasses.is_dataclass(rec) and not isinstance(rec, type):
        return dataclasses.asdict(rec)
    if hasattr(rec, "_asdict"):
        return dict(rec._asdict())
    return {k: v for k, v in vars(rec).items() if not k.startswith("_")} if hasattr(rec, "__dict__") else {}


#: Mapping for isinstance (typing's alias checks through typing, several times slower)
_Map = collections.abc.Mapping

_STEP_INDEX = ("step", "index", "step_index", "i")
_STEP_TIME = ("timestamp_ns", "timestamp", "time_ns", "ts")
#: the step series of memviz's own bytes at each step's end (a memviz
#: StepRecord's per-device "current"): the timeline's device memory line,
#: read at the steps; not the device's total, which memviz does not see
STEP_CURRENT = "device memory (memviz) at step ends"
#: step series drawn on the timeline: (name shown, keys tried at the top of a
#: record, key tried in each entry of its per-device "devices" mapping). Each
#: name says what the line is: PyTorch's figures, a device total that another
#: recorder's records give as such, and memviz's own bytes.
STEP_SERIES = (
    ("torch allocated", ("allocated", "torch_allocated", "allocated_bytes"), "allocated"),
    ("torch reserved", ("reserved", "torch_reserved", "reserved_bytes"), "reserved"),
    ("device total", ("device_total", "device_totals", "device_used", "process_total"), None),
    (STEP_CURRENT, (), "current"),
)
#: keys whose numbers are bytes (steps and findings), unless _NOT_BYTES matches
_BYTES = re.compile(r"byte|size|alloc|reserv|peak|grow|memory|live|rise|current|total|^start$|^end$|"
                    r"^used$|^free$", re.I)
_NOT_BYTES = re.compile(r"count|step|device|seq|index|_ns$|ratio|fraction|percent|share", re.I)


def is_bytes_key(key: str) -> bool:
    """Whether a number under this name is a byte count (a heuristic on the name)."""
    if re.search(r"byte|size", key, re.I):
        return True
    return bool(_BYTES.search(key)) and not _NOT_BYTES.search(key)


def _number(v: Any) -> bool:
    """A whole or finite number (NaN and infinities have no place on a chart)."""
    if isinstance(v, float):
        return math.isfinite(v)
    return isinstance(v, int) and not isinstance(v, bool)


def _per_device(value: Any) -> Optional[Dict[Optional[int], float]]:
    """A step number as {device: value}; None (the key) for all devices."""
    if value is None or isinstance(value, bool):
        return None
    if _number(value):
        return {None: value}
    if isinstance(value, _Map):
        out: Dict[Optional[int], float] = {}
        for dev, v in device_items(value):
            if isinstance(v, _Map):
                v = _field(v, ("current", "allocated", "total", "bytes", "used"))
            if _number(v):
                out[dev] = v
        return out or None
    return None


def _step_fields(d: Mapping[str, Any], devices: Optional[Mapping]) -> Tuple[Dict[str, Any], Dict[str, str]]:
    """Scalar columns of a step for the table, and their types."""
    fields: Dict[str, Any] = {}
    types: Dict[str, str] = {}
    for k, v in d.items():
        if k in _STEP_INDEX or k in _STEP_TIME or k in ("devices", "lines", "info"):
            continue
        if k.endswith("_ns") and _number(v):
            fields[k[:-3]], types[k[:-3]] = v // 1000, "time"
        elif isinstance(v, _Map):
            nums = list((_per_device(v) or {}).values())
            if nums:
                fields[k], types[k] = sum(nums), "bytes" if is_bytes_key(k) else "num"
        elif _number(v) or isinstance(v, str):
            fields[k] = v
            types[k] = ("bytes" if is_bytes_key(k) else "num") if _number(v) else "text"
        elif isinstance(v, float):  # NaN or infinite: shown as written
            fields[k], types[k] = str(v), "num"
    if devices:  # memviz StepRecord: per-device numbers, summed over the GPUs
        for key in ("current", "peak", "growth", "allocated", "reserved"):
            vals = [dv.get(key) for dk, dv in devices.items()
                    if isinstance(dv, _Map) and _number(dv.get(key)) and int(dk) >= 0]
            if vals:
                fields[key], types[key] = sum(vals), "bytes"
    lines = d.get("lines")
    if isinstance(lines, list) and lines and isinstance(lines[0], _Map) and "location" in lines[0]:
        top = lines[0]
        grew = top.get("bytes")
        fields["top growing line"] = str(top["location"]) + (
            f" ({format_size(grew, sign=True)})" if _number(grew) else "")
        types["top growing line"] = "text"
    info = d.get("info")
    if isinstance(info, _Map):
        for k, v in info.items():
            if _number(v) or isinstance(v, str):
                fields[k], types[k] = v, "text" if isinstance(v, str) else "num"
            elif isinstance(v, float):  # a NaN loss: shown as written
                fields[k], types[k] = str(v), "num"
            elif isinstance(v, (list, tuple)):
                fields[k], types[k] = str(tuple(v)), "text"
    return fields, types


def steps(obj: Any) -> List[Dict[str, Any]]:
    """Step records as dicts: ``index``, ``timestamp_ns``, ``series``
    ({name: {device or None: value}}), ``fields`` (scalars for a table) and
    ``types`` (each field's type: bytes, num, time in microseconds, text)."""
    out = []
    for i, rec in enumerate(getattr(obj, "steps", None) or ()):
        try:
            d = _as_dict(rec)
        except Exception:  # noqa: BLE001 - one odd record must not break a report
            continue
        index = _field(d, _STEP_INDEX, i)
        ts = _field(d, _STEP_TIME)
        devices = d.get("devices") if isinstance(d.get("devices"), _Map) else None
        series = {}
        for name, keys, per_device_key in STEP_SERIES:
            per = _per_device(_field(d, keys)) if keys else None
            if not per and devices and per_device_key:
                per = _per_device({k: v.get(per_device_key) for k, v in devices.items()
                                   if isinstance(v, _Map)})
            if per:
                series[name] = per
        try:
            fields, types = _step_fields(d, devices)
        except Exception:  # noqa: BLE001 - odd fields: show the step without them
            fields, types = {}, {}
        out.append({"index": index, "timestamp_ns": int(ts) if _number(ts) else None,
                    "series": series, "fields": fields, "types": types})
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


def _line_text(x: Any) -> str:
    if isinstance(x, _Map) and "location" in x:
        grew = x.get("bytes")
        text = str(x["location"]) + (f": {format_size(grew, sign=True)}" if _number(grew) else "")
        return text + (f" ({x['note']})" if x.get("note") else "")
    return str(x)


def normalize_finding(f: Any) -> Dict[str, Any]:
    """kind, device (or None), step_ranges ([[first, last], ...] of the steps
    it concerns), message, numbers ({name: value}), numbers_text ({name:
    shown}), lines (list of str) and fix of a finding (object or mapping)."""
    if isinstance(f, str):
        d: Mapping[str, Any] = {"message": f}
    elif isinstance(f, _Map):
        d = f
    else:  # read the object itself: its lines may be richer than a dict's
        d = {k: getattr(f, k, None) for k in ("kind", "severity", "message", "numbers", "lines", "fix")}
    numbers = d.get("numbers") or {}
    if not isinstance(numbers, _Map):
        numbers = {"value": numbers}
    lines = d.get("lines") or []
    if isinstance(lines, (str, bytes, Mapping)) or not isinstance(lines, Iterable):
        lines = [lines]
    nums = {str(k): (v if _number(v) else str(v)) for k, v in numbers.items()}
    device = numbers.get("device")
    return {
        "kind": str(d.get("kind") or "finding"),
        "device": device if isinstance(device, int) and not isinstance(device, bool) else None,
        "step_ranges": finding_steps(numbers),
        "severity": str(d.get("severity") or ""),
        "message": str(d.get("message") or ""),
        "numbers": nums,
        "numbers_text": {k: (format_size(v) if _number(v) and is_bytes_key(k)
                             else f"{v:,}" if isinstance(v, int) else str(v)) for k, v in nums.items()},
        "lines": [_line_text(x) for x in lines],
        "fix": str(d.get("fix") or ""),
    }


def downsample(ts: List[int], vs: List[float], n: int, *, low: bool = False
               ) -> Tuple[List[int], List[float]]:
    """At most about ``n`` time buckets of a series, keeping each bucket's
    maximum (so peaks survive), the first and the last point. With ``low``,
    each bucket's minimum too, in time order with its maximum (so a sawtooth
    of steps stays a sawtooth, not a flat line at its tops)."""
    if len(ts) <= (2 * n if low else n):
        return list(ts), list(vs)
    t0, t1 = ts[0], ts[-1]
    span = max(t1 - t0, 1)
    out_t, out_v = [ts[0]], [vs[0]]
    bucket, hi, lo = None, -1, -1

    def keep() -> None:
        for i in ((min(lo, hi), max(lo, hi)) if low and lo != hi else (hi,)):
            out_t.append(ts[i])
            out_v.append(vs[i])

    for i in range(1, len(ts) - 1):
        b = (ts[i] - t0) * n // span
        if b != bucket:
            if hi >= 0:
                keep()
            bucket, hi, lo = b, i, i
        elif vs[i] > vs[hi]:
            hi = i
        elif vs[i] < vs[lo]:
            lo = i
    if hi >= 0:
        keep()
    out_t.append(ts[-1])
    out_v.append(vs[-1])
    return out_t, out_v
