"""One rank's trace in a few plain figures: what the merged report of a
run's ranks (memviz/report/ranks.py) needs of each rank, and nothing more.

:func:`summarise` reads a loaded trace (or a Tracker) once and gives a
:class:`RankSummary`: the rank's row of the merged report (its peak and
when, per device, the categories, the findings), the bytes of each line
live at its peak, and each step's figures on its peak device. A summary is
small and made of plain values, so the merge can build one per rank in
worker processes (memviz/cli/report_ranks.py) and let each trace go as soon
as it is summed up: the merge of N ranks holds N summaries, never N traces.

Imports the analysis floor and below and memviz/report/summary.py
(docs/architecture.md).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from memviz.model.pytorch import END_KEY
from memviz.report.summary import (_slope, _trend_start, device_items, device_name, finding_records,
                                   step_records)

__all__ = ["RankSummary", "summarise", "LineKey", "StepRow"]

#: a line of code as the merge groups bytes by it: (file, line, backward node or None)
LineKey = Tuple[str, int, Optional[str]]
#: one step of a rank, on its peak device: (index, timestamp_ns, duration_ns, peak, current)
StepRow = Tuple[int, int, int, Optional[int], Optional[int]]


class RankSummary:
    """What the merged report knows of one rank (plain values: picklable).

    ``rank``, ``local_rank``, ``world_size``, ``host``, ``run_id``, ``path``,
    ``command``, ``truncated`` and ``error`` are the trace's (as
    :class:`memviz.loaded.LoadedTrace` names them, so :func:`memviz.report.ranks.check_ranks`
    reads a summary as it reads a trace); ``row`` is the rank's row of the
    report's JSON; ``lines`` ``{(file, line, backward): [bytes, function]}``
    at the peak of its peak device; ``steps`` its :data:`StepRow` list;
    ``start_wall_time`` and ``start_monotonic_ns`` tie its clock to the
    wall clock of its host (the clock alignment, memviz/report/ranks_questions.py);
    ``part`` the name of the Parquet files its tables were written to, if any
    (memviz/cli/report_ranks.py, for the DuckDB merge).
    """

    __slots__ = ("rank", "local_rank", "world_size", "host", "run_id", "path", "command", "truncated",
                 "error", "row", "lines", "steps", "start_wall_time", "start_monotonic_ns", "events",
                 "part")

    def __init__(self, **kw: Any) -> None:
        for k in self.__slots__:
            setattr(self, k, kw.get(k))

    def __getstate__(self) -> Dict[str, Any]:
        return {k: getattr(self, k) for k in self.__slots__}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        for k in self.__slots__:
            setattr(self, k, state.get(k))

    def __repr__(self) -> str:
        return f"<RankSummary rank {self.rank} of {self.world_size}: {self.path}>"


def _name(trace: Any) -> str:
    return str(getattr(trace, "path", None) or "<trace>")


def _recorded(trace: Any, dev: int, key: str) -> Optional[Dict[str, int]]:
    """The END chunk's figures of ``dev`` (memviz.model.pytorch.pytorch_figures)."""
    end = getattr(trace, "end", None)
    raw = end.get(END_KEY) if isinstance(end, dict) else None
    if not isinstance(raw, dict):
        return None
    for d, entry in device_items(raw):
        if d == dev and isinstance(entry, dict) and isinstance(entry.get(key), dict):
            vals = {str(k): v for k, v in entry[key].items() if type(v) is int and v >= 0}
            return dict(sorted(vals.items(), key=lambda kv: -kv[1])) or None
    return None


def _seconds_after_start(trace: Any, ts: int) -> Optional[float]:
    start = getattr(trace, "started_ns", None)
    return (ts - start) / 1e9 if start is not None and ts and ts >= start else None


def _peak_step(steps: List[StepRow], ts: int) -> Optional[int]:
    """The step the time ``ts`` fell in: the first whose end is at or after it."""
    if not ts:
        return None
    for index, end_ns, _dur, _peak, _cur in steps:
        if end_ns >= ts:
            return index
    return None


def _trend(steps: List[StepRow]) -> Optional[int]:
    """Bytes per step of the rank's live bytes at each step's end, after the
    warm-up (as the single report's step summary reads it)."""
    points = [(s[0], s[4]) for s in steps if isinstance(s[4], int)]
    if len(points) < 2:
        return None
    start = points[_trend_start(len(points))][0]
    return _slope([p for p in points if p[0] >= start])


def _rank_row(trace: Any, main: Optional[int], steps: List[StepRow]) -> Dict[str, Any]:
    totals = trace.totals()
    gpus = {d: t for d, t in totals.items() if d >= 0}
    per_device = []
    for d in sorted(totals, key=lambda d: (d < 0, d)):
        t = totals[d]
        per_device.append({"device": d, "name": device_name(d), "peak": t.get("peak", 0),
                           "peak_at_s": _seconds_after_start(trace, t.get("peak_timestamp_ns", 0)),
                           "current": t.get("current", 0), "allocs": t.get("allocs", 0),
                           "frees": t.get("frees", 0), "failed": t.get("failed", 0)})
    found, why = finding_records(trace)
    started, stopped = trace.started_ns, trace.stopped_ns
    meta = getattr(trace, "meta", {}) or {}
    peak = gpus[main] if main is not None else {}
    return {
        "rank": trace.rank, "local_rank": trace.local_rank, "world_size": trace.world_size,
        "host": trace.host, "pid": meta.get("pid"), "trace": _name(trace), "command": trace.command,
        "truncated": bool(trace.truncated), "truncated_reason": trace.error,
        "duration_s": (stopped - started) / 1e9 if started is not None and stopped else None,
        "device": main, "devices": trace.devices,
        "peak": trace.peak_bytes(), "peak_at_s": _seconds_after_start(trace, peak.get("peak_timestamp_ns", 0)),
        "peak_step": _peak_step(steps, peak.get("peak_timestamp_ns", 0)),
        "current": trace.current_bytes(), "failed": sum(t.get("failed", 0) for t in gpus.values()),
        "per_device": per_device,
        "categories_at_peak": _recorded(trace, main, "categories") if main is not None else None,
        "categories_at_end": _recorded(trace, main, "categories_at_end") if main is not None else None,
        "steps": len(steps), "trend_per_step": _trend(steps),
        "findings": found, "findings_error": why,
    }


def peak_lines(snap: Any) -> Dict[LineKey, List[Any]]:
    """``{(file, line, backward): [bytes, count, function]}`` of a snapshot,
    by the line each allocation is shown under (memviz/model/lines.py)."""
    out: Dict[LineKey, List[Any]] = {}
    for s in snap.statistics("lineno"):
        # a line and its backward lines (memviz/model/lines.py) stay apart
        key = (getattr(s.key, "filename", str(s.key)), getattr(s.key, "lineno", 0) or 0,
               getattr(s.key, "autograd_node", None))
        got = out.get(key)
        if got is None:
            out[key] = [s.size, s.count, getattr(s.key, "name", "") or ""]
        else:
            got[0] += s.size
            got[1] += s.count
    return out


def summarise(trace: Any) -> RankSummary:
    """The :class:`RankSummary` of one rank's trace (a LoadedTrace with ``rank``)."""
    totals = trace.totals()
    gpus = {d: t for d, t in totals.items() if d >= 0}
    main = max(gpus, key=lambda d: (gpus[d].get("peak", 0), -d)) if gpus else None
    steps: List[StepRow] = []
    for rec in step_records(trace):
        dev = rec.devices.get(main) if main is not None else None
        steps.append((rec.index, rec.timestamp_ns, rec.duration_ns, getattr(dev, "peak", None),
                      getattr(dev, "current", None)))
    row = _rank_row(trace, main, steps)
    lines = peak_lines(trace.peak_snapshot(main)) if main is not None and row["peak"] > 0 else {}
    meta = getattr(trace, "meta", {}) or {}
    wall, mono = meta.get("start_wall_time"), meta.get("start_monotonic_ns")
    return RankSummary(
        rank=trace.rank, local_rank=trace.local_rank, world_size=trace.world_size, host=trace.host,
        run_id=getattr(trace, "run_id", None), path=_name(trace), command=trace.command,
        truncated=bool(getattr(trace, "truncated", False)), error=getattr(trace, "error", None),
        row=row, lines=lines, steps=steps,
        start_wall_time=wall if isinstance(wall, (int, float)) and not isinstance(wall, bool) else None,
        start_monotonic_ns=mono if type(mono) is int else None,
        events=getattr(trace, "event_count", None))
