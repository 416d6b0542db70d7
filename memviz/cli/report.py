"""``memviz report``: read a .memviz trace file (``memviz diff`` is
memviz.cli.diff).

``python -m memviz report run.memviz [--format text|json|html] [-o OUT]``
prints the report of a trace: the same text report ``memviz run`` prints,
a JSON document (:func:`json_report`), or the HTML page of
``memviz.report.html.render``. Several files (``run.rank*.memviz``, the
ranks of one torchrun run) give their merged report instead
(memviz/cli/report_ranks.py).

JSON report (``--format json``), version 1::

    {"memviz_report": 1, "trace": path, "command": str|null,
     "memviz_version": str|null, "saved": bool, "truncated": bool,
     "truncated_reason": str|null, "start_wall_time": float|null,
     "duration_s": float|null, "events": int, "dropped_events": int,
     "devices": [{"device": int (-1: pinned host), "name": "cuda:0",
                  "current": int, "peak": int, "peak_timestamp_ns": int,
                  "allocs": int, "frees": int, "failed": int,
                  "top_lines_at_peak": [LINE, ...],
                  "top_lines_at_end": [LINE, ...]}, ...],
     "failures": [{"size", "device", "kind", "result", "timestamp_ns",
                   "thread", "label", "file", "line", "function"}, ...],
     "steps": [step record, ...],
     "step_summary": STEPS|null,
     "findings": [FINDING, ...], "findings_error": str|null}

    LINE = {"file": str, "line": int, "function": str, "size": int, "count": int}

    STEPS = {"count": int, "first_step": int, "last_step": int,
             "median_step_s": float|null, "trend_from_step": int,
             "devices": [{"device": int, "name": "cuda:0",
                          "current": SERIES, "peak": SERIES,
                          "allocated": SERIES, "reserved": SERIES}, ...]}
    SERIES = {"first": int, "last": int, "min": int, "min_step": int,
              "max": int, "max_step": int, "trend_per_step": int|null}

    FINDING = {"kind": str, "message": str, "device": int|null,
               "step_ranges": [[first, last], ...], "numbers": {name: value},
               "lines": [{"location": "file:line", "file": str, "line": int,
                          "bytes": int|null, "note": str, "text": str}, ...],
               "fix": str}

``step_summary`` is null when the run recorded no step (``t.step()`` or
``memviz.watch(optimizer)``). Its per-device series are memviz's bytes at
each step's end (``current``) and the highest level inside the step
(``peak``), and PyTorch's ``allocated``/``reserved`` bytes where the steps
have them (a series the steps lack is left out). ``trend_per_step`` is the
least-squares slope in bytes per step from ``trend_from_step`` (after the
warm-up ``diagnose()`` skips) to the last step. ``findings`` are what
``memviz.diagnose()`` finds (``[]`` when nothing; ``findings_error`` says why
when it could not run): ``kind`` is growth, fragmentation, spike,
cache_churn or outside_pytorch; ``step_ranges`` the steps it concerns
(``[]``: the run as a whole); ``lines`` its evidence, each a line of code
and the bytes it grew by or holds.

Sizes are bytes. ``file`` of allocations made by threads without Python
frames is ``"<thread NAME>"`` with line 0. NaN and infinities (a step's
``loss=float("nan")``) are written as null.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Dict, List, Optional

from memviz._errors import InvalidArgument, TraceError
from memviz.cli.common import (EXIT_USAGE, device_name, dumps, load_trace, parse, positive, refuse_output,
                               with_progress, write_text)
from memviz.report.summary import finding_records, flight_window, step_summary
from memviz.trace.format import step_dict

__all__ = ["main", "json_report", "report_parser"]

FORMATS = ("text", "json", "html")


def _line(stat: Any) -> Dict[str, Any]:
    key = stat.key
    return {"file": getattr(key, "filename", str(key)), "line": getattr(key, "lineno", 0) or 0,
            "function": getattr(key, "name", "") or "", "size": stat.size, "count": stat.count}


def json_report(trace: Any, top: int = 10) -> Dict[str, Any]:
    """The JSON report of a loaded trace (or a Tracker); see the module docstring."""
    totals = trace.totals()
    end_snap = trace.snapshot().by_device()
    devices = []
    for dev in sorted(totals, key=lambda d: (d < 0, d)):
        t = totals[dev]
        at_end = end_snap.get(dev)
        devices.append({
            "device": dev, "name": device_name(dev),
            **{k: t.get(k, 0) for k in ("current", "peak", "peak_timestamp_ns", "allocs",
                                        "frees", "failed")},
            "top_lines_at_peak": [_line(s) for s in
                                  trace.peak_snapshot(dev).statistics("lineno")[:top]],
            "top_lines_at_end": [_line(s) for s in at_end.statistics("lineno")[:top]]
            if at_end is not None else [],
        })
    failures = []
    for f in trace.failures:
        frame = f.traceback.user_frame if f.traceback else None
        failures.append({
            "size": f.size, "device": f.device, "kind": f.kind, "result": f.result,
            "timestamp_ns": f.timestamp_ns, "thread": f.thread.name, "label": f.label,
            "file": frame.filename if frame else f"<thread {f.thread.name}>",
            "line": frame.lineno if frame else 0, "function": frame.name if frame else ""})
    found, why = finding_records(trace)
    meta = getattr(trace, "meta", {}) or {}
    started, stopped = trace.started_ns, trace.stopped_ns
    return {
        "memviz_report": 1,
        "trace": getattr(trace, "path", None),
        "command": getattr(trace, "command", None),
        "memviz_version": meta.get("memviz_version"),
        "saved": bool(getattr(trace, "saved", False)),
        "truncated": bool(getattr(trace, "truncated", False)),
        "truncated_reason": getattr(trace, "error", None),
        "start_wall_time": meta.get("start_wall_time"),
        "duration_s": (stopped - started) / 1e9 if started is not None and stopped else None,
        "events": getattr(trace, "event_count", None),
        "dropped_events": getattr(trace, "dropped_events", 0),
        "flight_recorder": flight_window(trace),
        "devices": devices,
        "failures": failures,
        "steps": [step_dict(s) for s in trace.steps],
        "step_summary": step_summary(trace),
        "findings": found,
        "findings_error": why,
    }


def _html(trace: Any) -> str:
    try:
        from memviz.report import html
    except ModuleNotFoundError as e:
        if e.name and e.name.startswith("memviz"):
            raise TraceError(
                "HTML reports need memviz.report.html, which this memviz installation does not "
                "have", getattr(trace, "path", None),
                hint="use --format text or --format json, or install a memviz with HTML "
                     "reports") from None
        raise
    return html.render(trace)


def report_parser(prog: str = "memviz report") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description="Print the memory report of a .memviz trace file, or the merged "
                                "report of several: the ranks of one torchrun run.",
        epilog="Example: memviz report run.memviz --format html -o run.html", allow_abbrev=False)
    parser.add_argument("trace", nargs="+",
                        help="the .memviz file (from `memviz run -o`, track(trace=...) or "
                             "Tracker.save()); several, the ranks of one torchrun run "
                             "(run.rank*.memviz), give their merged report")
    parser.add_argument("--format", choices=FORMATS, default="text",
                        help="text (default), json or html")
    parser.add_argument("-o", "--output", metavar="PATH", help="write here instead of stdout")
    parser.add_argument("--top", type=positive, default=10, metavar="N",
                        help="lines listed per device (default 10)")
    parser.add_argument("--recover", action="store_true",
                        help="read a corrupted file up to the damaged part")
    return parser


@with_progress  # on stderr, when it is a terminal and the work takes a while
def main(argv: Optional[List[str]] = None, prog: str = "memviz report") -> int:
    """Entry point of ``memviz report``; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    opts = parse(report_parser(prog), argv)
    if isinstance(opts, int):
        return opts
    from memviz.cli.report_ranks import expand, report_ranks
    try:
        paths = expand(opts.trace)  # a quoted run.rank*.memviz too
    except InvalidArgument as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return EXIT_USAGE
    if len(paths) > 1:  # the ranks of one run, merged
        return report_ranks(paths, opts, prog)
    opts.trace = paths[0]
    inputs = (("the trace being reported", opts.trace),)
    what = {"text": "the report", "json": "the JSON report", "html": "the HTML report"}[opts.format]
    refused = refuse_output(opts.output, inputs, what, prog)  # -o must not name the trace it reports
    if refused is not None:
        return refused
    try:
        trace = load_trace(opts.trace, opts.recover, prog)
        if opts.format == "text":
            from memviz.report.text import text_report
            text = text_report(trace, top=opts.top, outside=trace.outside,
                               command=trace.command)
            if trace.truncated:
                text = f"(incomplete trace: {trace.error})\n" + text
        elif opts.format == "json":
            text = dumps(json_report(trace, opts.top))
        else:
            text = _html(trace)
    except TraceError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return EXIT_USAGE
    return write_text(text, opts.output, prog, what, inputs)
