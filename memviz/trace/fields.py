"""What each decoded field of a .memviz trace may hold, checked when it is read.

:mod:`memviz.trace.parse` frames the chunks and decodes their JSON; the
functions here check the fields of the META, STEPS and END chunks (and give
the small checks the other chunk handlers use): every field memviz reads
has a type and a range, a field it does not read (one of a newer memviz)
must be plain JSON of a few levels. A wrong one raises :class:`_Bad`, which
the parser turns into :class:`memviz.TraceError` naming the chunk, the
field and the byte offset; so the reports, diagnose() and the exports only
ever see values of the types they expect.
"""

from __future__ import annotations

import json
import math
from typing import Any, Dict, Optional, Tuple

import memviz._core as _core
from memviz.trace.format import DEVICE_MAX, DEVICE_MIN

__all__ = ["check_meta", "check_step", "check_end"]


class _Bad(Exception):
    """A structural problem inside one chunk (turned into TraceError with its offset)."""


#: every device's totals have these keys (0 when the file lacks one)
_TOTAL_KEYS = dict.fromkeys(("current", "peak", "peak_timestamp_ns", "allocs", "frees", "failed",
                             "alloc_bytes", "live_count", "peak_count", "window_peak"), 0)

_U64 = (1 << 64) - 1
_I64_LO = -(1 << 63)


def _r(v: Any) -> str:
    """A value for a message: its repr, cut to 40 characters."""
    try:
        text = repr(v)
    except ValueError:  # an int with more digits than repr allows
        text = f"<an int of {v.bit_length():,} bits>"
    return text if len(text) <= 40 else text[:37] + "..."


def _kind(v: Any) -> str:
    """The JSON name of a decoded value's type."""
    return {dict: "object", list: "array", str: "string", bool: "boolean", int: "number",
            float: "number", type(None): "null"}.get(type(v), type(v).__name__)


def _int(v: Any, lo: int, hi: int, what: str) -> int:
    if type(v) is not int or not lo <= v <= hi:
        raise _Bad(f"{what} {_r(v)} is not a whole number between {lo} and {hi}")
    return v


def _opt_int(v: Any, what: str) -> Optional[int]:
    return None if v is None else _int(v, _I64_LO, _U64, what)


def _key(k: str, lo: int, hi: int, what: str) -> int:
    try:
        return _int(int(k), lo, hi, what)
    except ValueError:
        raise _Bad(f"{what} {_r(k)} is not a number") from None


def _field(name: str) -> str:
    return f"its field {name!r}"


def _check(v: Any, rule: Any, what: str) -> Any:
    """``v`` checked against ``rule``: a type (str, bool, dict, list), a
    (lo, hi) range of whole numbers, "number" (a finite int or float), or a
    tuple of rules ending in None (the value may also be null)."""
    if isinstance(rule, tuple) and rule and rule[-1] is None:
        return None if v is None else _check(v, rule[0], what)
    if isinstance(rule, tuple):
        return _int(v, rule[0], rule[1], what)
    if rule == "number":
        if type(v) is int and _I64_LO <= v <= _U64 or type(v) is float and math.isfinite(v):
            return v
        raise _Bad(f"{what} {_r(v)} is not a finite number")
    if type(v) is not rule:
        want = _kind(rule())
        raise _Bad(f"{what} is a JSON {_kind(v)}, not a{'n' if want[0] in 'aeiou' else ''} {want}")
    return v


def _plain(v: Any, what: str, depth: int) -> Any:
    """A JSON value no deeper than ``depth`` levels of arrays and objects,
    with whole numbers in 64 bits and finite floats: what a field memviz
    does not read may hold, so that printing or re-encoding it is safe."""
    todo = [(v, depth, what)]
    while todo:
        x, d, w = todo.pop()
        if isinstance(x, (dict, list)):
            if d <= 0:
                raise _Bad(f"{w} is nested deeper than {depth} levels")
            items = x.items() if isinstance(x, dict) else enumerate(x)
            todo += [(y, d - 1, f"{w}[{_r(k)}]") for k, y in items]
        elif type(x) is int:
            _int(x, _I64_LO, _U64, w)
        elif type(x) is float and not math.isfinite(x):
            raise _Bad(f"{w} {_r(x)} is not a finite number")
    return v


def _record(obj: Any, rules: Dict[str, Any], what: str, *, unknown: int = 0,
            required: Tuple[str, ...] = ()) -> Dict[str, Any]:
    """A JSON object with known fields checked by :func:`_check`; other
    fields must be :func:`_plain` no deeper than ``unknown`` (0: left out)."""
    if type(obj) is not dict:
        raise _Bad(f"{what} is a JSON {_kind(obj)}, not an object")
    out = {}
    for name, v in obj.items():
        rule = rules.get(name)
        if rule is not None:
            out[name] = _check(v, rule, f"{what}: {_field(name)}")
        elif unknown:
            out[name] = _plain(v, f"{what}: {_field(name)}", unknown)
    for name in required:
        if name not in obj:
            raise _Bad(f"{what} has no field {name!r}")
    return out


_OPT_STR = (str, None)
_OPT_U64 = ((0, _U64), None)
_OPT_BOOL = (bool, None)

#: META, and its 'tracker' and 'capture' objects (other fields: plain JSON)
_META = {"format": str, "format_version": (0, _U64), "mode": str, "memviz_version": str,
         "python_version": str, "platform": str, "pid": (0, _U64), "start_wall_time": "number",
         "start_monotonic_ns": _OPT_U64, "written_monotonic_ns": _OPT_U64, "command": _OPT_STR,
         "argv": list, "tracker": dict, "capture": dict, "ranks": dict}
_TRACKER = {"gpu_requested": bool, "gpu_enabled": bool, "activity_enabled": bool, "precise": bool,
            "gpu_off_reason": _OPT_STR, "activity_error": _OPT_STR}
_CAPTURE = {"available": _OPT_BOOL, "gpu_present": _OPT_BOOL, "gpu_enabled": _OPT_BOOL,
            "activity_enabled": _OPT_BOOL, "reason": _OPT_STR, "gpu_detail": _OPT_STR,
            "library": _OPT_STR, "found_by": _OPT_STR, "python_frames_abi": _OPT_STR,
            "gpu_off_reason": _OPT_STR, "activity_error": _OPT_STR, "error": _OPT_STR,
            "version": ((_I64_LO, _U64), None), "cuda_major": ((_I64_LO, _U64), None),
            "depth": ((0, _U64), None), "tried": list, "store": dict}
#: META's 'ranks' (memviz.capture.rank_files.rank_meta): None where not known
_RANKS = {"rank": _OPT_U64, "local_rank": _OPT_U64, "world_size": _OPT_U64, "host": _OPT_STR,
          "run_id": _OPT_STR, "cuda_visible_devices": _OPT_STR, "cuda_device": _OPT_U64}
#: END (totals, outside and stats are checked on their own)
_END = {"stopped_monotonic_ns": (0, _U64), "stopped_wall_time": "number", "failures": (0, _U64),
        "events": (0, _U64), "dropped_events": (0, _U64), "totals": dict, "outside": dict,
        "stats": dict}
#: a memviz step record (StepRecord.to_dict()); fields of a newer memviz are left out
_STEP = {"index": (0, _U64), "timestamp_ns": (0, _U64), "duration_ns": _OPT_U64,
         "devices": dict, "lines": list, "info": dict, "autograd_seq": ((_I64_LO, _U64), None)}
_DEVICE_STEP = {"current": _OPT_U64, "peak": _OPT_U64, "live_count": _OPT_U64,
                "growth": ((-_U64, _U64), None), "segment_allocs": (0, _U64),
                "segment_frees": (0, _U64), "segment_alloc_bytes": (0, _U64),
                "allocated": _OPT_U64, "reserved": _OPT_U64, "allocated_peak": _OPT_U64}
_GROWTH_LINE = {"location": str, "name": str, "bytes": (-_U64, _U64), "count": (-_U64, _U64),
                "live_bytes": (0, _U64), "live_count": (0, _U64), "block_bytes": ((-_U64, _U64), None),
                "block_live_bytes": _OPT_U64}
#: a trace of an older memviz has no block figures
_GROWTH_LINE_REQUIRED = ("location", "name", "bytes", "count", "live_bytes", "live_count")


def _stats(stats: Dict[str, Any], what: str) -> Dict[str, Any]:
    """memviz's own counters: whole numbers >= 0, the str 'frames_abi' and
    the {call: count} object 'calls'."""
    out: Dict[str, Any] = {}
    for k, v in stats.items():
        w = f"{what}: {_field(k)}"
        if k == "frames_abi":
            out[k] = _check(v, str, w)
        elif k == "calls":
            out[k] = {str(c): _int(n, 0, _U64, f"{w}[{_r(c)}]")
                      for c, n in _check(v, dict, w).items()}
        else:
            out[k] = _int(v, 0, _U64, w)
    return out


def _info_value(v: Any, what: str) -> Any:
    """A step's info value as memviz writes it: null, a boolean, a number
    (NaN and infinities too: a loss can be NaN; whole numbers of any size,
    as the program passed them), a string or a shape (an array of whole
    numbers)."""
    if v is None or type(v) in (bool, str, float, int):
        return v
    if type(v) is list:
        for x in v:
            if type(x) is not int:
                raise _Bad(f"{what} (a shape) holds {_r(x)}, not a whole number")
        return v
    raise _Bad(f"{what} is a JSON {_kind(v)}, not a number, string or shape")


def _shallow(v: Any, depth: int) -> Any:
    """``v`` with every array or object nested deeper than ``depth`` levels
    replaced by its JSON text (so printing it needs no deep recursion)."""
    if not isinstance(v, (dict, list)):
        return v
    root: Any = {} if isinstance(v, dict) else []
    todo = [(v, root, depth)]
    while todo:
        src, out, d = todo.pop()
        items = src.items() if isinstance(src, dict) else enumerate(src)
        for k, x in items:
            if isinstance(x, (dict, list)):
                if d <= 1:
                    x = _deep_json(x)
                else:
                    child: Any = {} if isinstance(x, dict) else []
                    todo.append((x, child, d - 1))
                    x = child
            if isinstance(out, dict):
                out[k] = x
            else:
                out.append(x)
    return root


def _deep_json(v: Any) -> str:
    try:
        return json.dumps(v)
    except (ValueError, RecursionError):
        return f"<a JSON {_kind(v)} nested too deep to show>"


def check_step(entry: Any, n: int) -> Any:
    """One STEPS entry: a memviz step record (it has 'index' and
    'timestamp_ns'), checked field by field; or another object (a record
    the program appended to ``tracker.steps`` itself), kept as it is, with
    what is nested deeper than 4 levels as its JSON text."""
    what = f"step entry {n}"
    if type(entry) is not dict:
        raise _Bad(f"{what} is a JSON {_kind(entry)}, not an object")
    if "index" not in entry or "timestamp_ns" not in entry:
        return _shallow(entry, 4)
    d = _record(entry, _STEP, what)
    devices = {}
    for k, v in d.get("devices", {}).items():
        dev = _key(k, DEVICE_MIN, DEVICE_MAX, f"{what}: a device")
        devices[str(dev)] = _record(v, _DEVICE_STEP, f"{what}: {_field('devices')}[{k!r}]")
    lines = [_record(g, _GROWTH_LINE, f"{what}: {_field('lines')}[{i}]",
                     required=_GROWTH_LINE_REQUIRED)
             for i, g in enumerate(d.get("lines", []))]
    info = {k: _info_value(v, f"{what}: {_field('info')}[{k!r}]")
            for k, v in d.get("info", {}).items()}
    d.update(devices=devices, lines=lines, info=info)
    return d


def check_meta(meta: Dict[str, Any]) -> Dict[str, Any]:
    """The META chunk's object, checked (see the module docstring)."""
    meta = _record(meta, _META, "its metadata", unknown=4)
    for i, a in enumerate(meta.get("argv", [])):
        _check(a, str, f"its metadata: {_field('argv')}[{i}]")
    tracker = _record(meta.get("tracker", {}), dict(_TRACKER, depth=(0, _core.MAX_DEPTH)),
                      f"its metadata: {_field('tracker')}", unknown=2)
    capture = _record(meta.get("capture", {}), _CAPTURE, f"its metadata: {_field('capture')}",
                      unknown=3)
    for i, a in enumerate(capture.get("tried", [])):
        _check(a, str, f"its metadata: {_field('capture')}: {_field('tried')}[{i}]")
    if "store" in capture:
        capture["store"] = _stats(capture["store"],
                                  f"its metadata: {_field('capture')}: {_field('store')}")
    meta.update(tracker=tracker, capture=capture)
    if "ranks" in meta:
        meta["ranks"] = _record(meta["ranks"], _RANKS, f"its metadata: {_field('ranks')}",
                                unknown=2)
    return meta


def check_end(end: Any) -> Dict[str, Any]:
    """The END chunk's object, checked; totals and 'outside' keyed by device."""
    end = _record(end, _END, "the end record", unknown=3)
    totals: Dict[int, Dict[str, int]] = {}
    for k, v in end.get("totals", {}).items():
        if type(v) is not dict:
            raise _Bad(f"the totals of device {_r(k)} are a JSON {_kind(v)}, not an object")
        totals[_key(k, DEVICE_MIN, DEVICE_MAX, "device")] = dict(_TOTAL_KEYS, **{
            str(name): _int(x, 0, _U64, f"total {name!r} of device {_r(k)}")
            for name, x in v.items()})
    outside: Dict[int, Tuple[int, str]] = {}
    for k, v in end.get("outside", {}).items():
        if type(v) is not list or len(v) != 2 or type(v[1]) is not str:
            raise _Bad(f"outside entry {_r(v)} is not [bytes, source]")
        outside[_key(k, DEVICE_MIN, DEVICE_MAX, "device")] = (_int(v[0], 0, _U64, "bytes"), v[1])
    end["totals"], end["outside"] = totals, outside
    end["stats"] = _stats(end.get("stats", {}), f"the end record: {_field('stats')}")
    return end
