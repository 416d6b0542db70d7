"""``memviz report``: read a .memviz trace file (``memviz diff`` is
memviz.cli.diff).

``python -m memviz report run.memviz [--format text|json|html|table|stats|summary] [-o OUT]``
prints the report of a trace: the same text report ``memviz run`` prints,
a JSON document (:func:`json_report`), the HTML page of
``memviz.report.html.render``, or one of memray's other views, as plain
text (memviz/report/views.py): ``table`` (the allocations live at each
device's peak by line), ``stats`` (the run's counts, then at the peak a
size histogram, bytes by kind and category, the top lines by size and by
count) and ``summary`` (per line at the peak: the bytes under it, callees
included, and its own). Several files (``run.rank*.memviz``, the ranks of
one torchrun run) give their merged report instead
(memviz/cli/report_ranks.py), in text, json or html.

JSON report (``--format json``), version 1::

    {"memviz_report": 1, "trace": path, "command": str|null,
     "sample": {"machine": str, "date": str, "script": str}|null,
     "memviz_version": str|null, "saved": bool, "truncated": bool,
     "truncated_reason": str|null, "start_wall_time": float|null,
     "duration_s": float|null, "events": int, "dropped_events": int,
     "devices": [{"device": int (-1: pinned host), "name": "cuda:0",
                  "current": int, "peak": int, "peak_timestamp_ns": int,
                  "allocs": int, "frees": int, "failed": int,
                  "top_lines_at_peak": [LINE, ...],
                  "top_lines_at_end": [LINE, ...],
                  "tensor_peak": int|null, "tensor_peak_timestamp_ns": int|null,
                  "top_lines_at_tensor_peak": [LINE, ...]}, ...],
     "failures": [{"size", "device", "kind", "result", "timestamp_ns",
                   "thread", "label", "where", "file", "line", "function",
                   "backward"}, ...],
     "steps": [step record, ...],
     "step_summary": STEPS|null,
     "findings": [FINDING, ...], "findings_error": str|null,
     "outside": OUTSIDE,
     "before_tracking": {device: {"bytes": int, "count": int,
                                  "categories": {category: int},
                                  "outside_at_start": int}}}

    LINE = {"where": str, "file": str, "line": int, "function": str,
            "backward": str|null, "size": int, "count": int}

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

    OUTSIDE = {"devices": [{"device": int, "name": "cuda:0", "held": int,
                            "source": str, "recorded": int, "beyond": int,
                            "named": [{"what": str, "bytes": int}, ...],
                            "before_tracking": {category: int},
                            "unexplained": int}, ...],
               "why_none": str|null, "notes": [str, ...]}

``sample`` describes the sample trace shipped with memviz when the file is
that sample (or a copy): then ``command`` is its script, not the recording
machine's command line. ``outside`` is what the process held beyond memviz's record when tracking
stopped (memviz/report/outside.py): ``held`` is the driver's figure (NVML,
or cuMemGetInfo for the whole device: ``source``), ``recorded`` memviz's
live bytes then, ``beyond`` the difference, split into what memviz can name
(``named``: PyTorch's reserved memory memviz has no record of) and the
``unexplained`` rest; ``before_tracking`` (allocations recorded as made
before tracking, by category) is there only where something provides it,
and then takes the PyTorch figure's place. ``devices`` is empty and
``why_none`` says why when no source could tell.

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

Sizes are bytes. A line is where the allocations were made
(memviz/model/lines.py): ``where`` is ``"file:line"``; an allocation made
with no Python frames inside an autograd node (PyTorch's backward threads)
is under the forward line that made the node, with the node in ``backward``
(``where``: ``"file:line (backward: AddmmBackward0)"``; ``file``
``"<forward line unknown>"`` with line 0 when memviz could not tell it); any
other frameless allocation's ``file`` is ``"<thread NAME>"`` with line 0.
``backward`` is null outside backward lines. NaN and infinities (a step's
``loss=float("nan")``) are written as null.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Dict, List, Optional

from memviz._errors import InvalidArgument, TraceError
from memviz.cli.common import (EXIT_USAGE, add_force, device_name, dumps, load_trace, parse, positive, refuse_output,
                               with_progress, write_text)
from memviz.model.lines import line_frame, location
from memviz.report.outside import held_by_process, outside_section
from memviz.report.summary import before_tracking as summary_before_tracking
from memviz.report.summary import finding_records, flight_window, sample_of, step_summary, tensor_peaks
from memviz.trace.format import step_dict

__all__ = ["main", "json_report", "report_parser"]

FORMATS = ("text", "json", "html", "table", "stats", "summary")
#: the formats of one trace only (memviz/report/views.py): refused for several ranks' files
ONE_TRACE = ("table", "stats", "summary")
#: what each format writes, in messages
WHAT = {"text": "the report", "json": "the JSON report", "html": "the HTML report",
        "table": "the table", "stats": "the statistics", "summary": "the summary"}


def _frame(frame: Any) -> Dict[str, Any]:
    return {"where": location(frame), "file": getattr(frame, "filename", str(frame)),
            "line": getattr(frame, "lineno", 0) or 0, "function": getattr(frame, "name", "") or "",
            "backward": getattr(frame, "autograd_node", None), "compiled": getattr(frame, "compiled", None)}


def _line(stat: Any) -> Dict[str, Any]:
    return {**_frame(stat.key), "size": stat.size, "count": stat.count}


def json_report(trace: Any, top: int = 10, *, before_tracking: Any = None) -> Dict[str, Any]:
    """The JSON report of a loaded trace (or a Tracker); see the module
    docstring. ``before_tracking``: {device: {category: bytes}} of
    allocations recorded as made before tracking, when known."""
    totals = trace.totals()
    end = trace.snapshot()
    end_snap = end.by_device()
    tensor = tensor_peaks(trace)
    devices = []
    for dev in sorted(totals, key=lambda d: (d < 0, d)):
        t = totals[dev]
        at_end = end_snap.get(dev)
        tp = tensor.get(dev)
        devices.append({
            "device": dev, "name": device_name(dev),
            **{k: t.get(k, 0) for k in ("current", "peak", "peak_timestamp_ns", "allocs",
                                        "frees", "failed")},
            "top_lines_at_peak": [_line(s) for s in
                                  trace.peak_snapshot(dev).statistics("lineno")[:top]],
            "top_lines_at_end": [_line(s) for s in at_end.statistics("lineno")[:top]]
            if at_end is not None else [],
            "tensor_peak": tp["peak"] if tp else None,
            "tensor_peak_timestamp_ns": tp.get("peak_timestamp_ns") if tp else None,
            "top_lines_at_tensor_peak": [
                _line(s) for s in trace.peak_snapshot(dev, peak="tensor").statistics("lineno")[:top]]
            if tp else [],
        })
    failures = []
    for f in trace.failures:
        failures.append({
            "size": f.size, "device": f.device, "kind": f.kind, "result": f.result,
            "timestamp_ns": f.timestamp_ns, "thread": f.thread.name, "label": f.label,
            **_frame(line_frame(f))})
    found, why = finding_records(trace)
    meta = getattr(trace, "meta", {}) or {}
    started, stopped = trace.started_ns, trace.stopped_ns
    sample = sample_of(trace)  # the shipped sample: no path of the machine it was recorded on
    return {
        "memviz_report": 1,
        "trace": getattr(trace, "path", None),
        "command": getattr(trace, "command", None) if sample is None else sample.get("script"),
        "sample": None if sample is None else {k: sample.get(k) for k in ("machine", "date", "script")},
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
        "outside": outside_section(trace, held_by_process(trace), end=end,
                                   before_tracking=before_tracking),
        "before_tracking": {str(d): v for d, v in summary_before_tracking(trace).items()},
    }


def _html(trace: Any, whatif: Any = None) -> str:
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
    return html.render(trace, whatif=whatif)


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
                        help="text (default), json or html; or as memray's views, of one trace: table "
                             "(the allocations live at each device's peak, by line), stats (counts, "
                             "a size histogram, the top lines by size and by count) or summary (per "
                             "line: the bytes under it, callees included, and its own)")
    parser.add_argument("-o", "--output", metavar="PATH", help="write here instead of stdout (- is stdout)")
    add_force(parser)
    parser.add_argument("--top", type=positive, default=10, metavar="N",
                        help="lines listed per device, or per list (default 10)")
    parser.add_argument("--recover", action="store_true",
                        help="read a corrupted file up to the damaged part")
    parser.add_argument("--whatif", action="append", default=[], metavar="CONF",
                        help="add a what-if section: the recorded PyTorch requests replayed under this "
                             "allocator setting (PYTORCH_CUDA_ALLOC_CONF syntax); several times for "
                             "several rows (memviz whatif has the table alone)")
    parser.add_argument("--device-memory", metavar="SIZE|FRACTION",
                        help="the card's size (24GiB) or a fraction of the recorded card: the what-if "
                             "section then says whether the run fits there (the recorded settings, and "
                             "each --whatif setting)")
    ranks = parser.add_argument_group("several ranks' files (the merged report)")
    ranks.add_argument("--jobs", type=positive, default=None, metavar="N",
                       help="worker processes reading the files (default: the machine's cores)")
    ranks.add_argument("--engine", choices=("auto", "python", "duckdb"), default="auto",
                       help="where the merge's queries run: python, or duckdb over the ranks' "
                            "tables in Parquet (pip install 'memviz-gpu[duckdb]'); auto (default): "
                            "duckdb from 1,024 ranks when it is installed")
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
    if opts.format in ONE_TRACE and (opts.whatif or opts.device_memory):
        print(f"{prog}: --whatif and --device-memory add a section to the text, json and html reports, "
              f"not to --format {opts.format}. What to do: run `memviz whatif FILE --alloc-conf ...`, "
              f"which prints that table alone.", file=sys.stderr)
        return EXIT_USAGE
    if len(paths) > 1:  # the ranks of one run, merged
        if opts.format in ONE_TRACE:
            print(f"{prog}: --format {opts.format} shows one trace, and {len(paths)} files were given "
                  f"(the ranks of a run, whose merged report comes as text, json or html). What to do: "
                  f"run `memviz report FILE --format {opts.format}` on one rank's file (the merged "
                  f"report names the ranks with the highest peaks), or use --format text, json or "
                  f"html for the merged report.", file=sys.stderr)
            return EXIT_USAGE
        if opts.whatif or opts.device_memory:
            print(f"{prog}: --whatif and --device-memory replay one trace's requests, and {len(paths)} "
                  f"files were given (the ranks of a run). What to do: run `memviz whatif FILE "
                  f"--alloc-conf ...` on the rank whose memory you want to change (the merged report "
                  f"names the highest peaks).", file=sys.stderr)
            return EXIT_USAGE
        return report_ranks(paths, opts, prog)
    opts.trace = paths[0]
    inputs = (("the trace being reported", opts.trace),)
    what = WHAT[opts.format]
    refused = refuse_output(opts.output, inputs, what, prog, opts.force)  # -o must not name the trace it reports
    if refused is not None:
        return refused
    try:
        trace = load_trace(opts.trace, opts.recover, prog)
        rows = None
        if opts.whatif or opts.device_memory:
            from memviz.analysis.whatif import whatif
            rows = whatif(trace, opts.whatif, opts.device_memory)
        if opts.format == "text":
            from memviz.report.text import text_report
            text = text_report(trace, top=opts.top, outside=trace.outside,
                               command=trace.command)
            if trace.truncated:
                text = f"(incomplete trace: {trace.error})\n" + text
            if rows is not None:
                from memviz.analysis.whatif import rows_text
                text += "\n" + rows_text(rows)
        elif opts.format == "json":
            doc = json_report(trace, opts.top)
            if rows is not None:
                from memviz.analysis.whatif import rows_json
                doc["whatif"] = rows_json(rows)
            text = dumps(doc)
        elif opts.format in ONE_TRACE:
            from memviz.report import views
            view = {"table": views.table_report, "stats": views.stats_report,
                    "summary": views.summary_report}[opts.format]
            text = view(trace, top=opts.top)
        else:
            text = _html(trace, rows)
    except (TraceError, InvalidArgument) as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return EXIT_USAGE
    return write_text(text, opts.output, prog, what, inputs)
