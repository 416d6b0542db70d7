"""``memviz report`` of several trace files: the ranks of one distributed run
merged (memviz/report/ranks.py). memviz/cli/report.py hands several files
here; one file keeps its own report.

``python -m memviz report run.rank*.memviz [--format text|json|html] [-o OUT]``.
A path with ``*``, ``?`` or ``[`` that names no file is expanded here, so
the pattern may be quoted (as ``memviz run`` prints it) or given on a shell
that does not expand it.

JSON report (``--format json``), version 1::

    {"memviz_rank_report": 1, "traces": [path, ...] (in rank order),
     "command": str|null, "world_size": int|null, "notes": [str, ...],
     "ranks": [{"rank": int, "local_rank": int|null, "world_size": int|null,
                "host": str|null, "pid": int|null, "trace": path, "command": str|null,
                "truncated": bool, "truncated_reason": str|null, "duration_s": float|null,
                "device": int|null (the GPU of its peak), "devices": [int, ...],
                "peak": int, "peak_at_s": float|null (after the rank started tracking),
                "current": int (live at the end), "failed": int,
                "per_device": [{"device", "name", "peak", "peak_at_s", "current",
                                "allocs", "frees", "failed"}, ...],
                "categories_at_peak": {category: bytes}|null,
                "categories_at_end": {category: bytes}|null,
                "steps": int, "findings": [FINDING, ...], "findings_error": str|null}, ...],
     "imbalance": {"ratio": float|null (max over median peak), "max_rank", "max_peak",
                   "median_peak", "min_rank", "min_peak"},
     "lines": [{"file", "line", "function", "spread": int (max - min over the ranks),
                "bytes": {rank: bytes at that rank's peak}}, ...],
     "steps": [{"step": int, "imbalance": float|null,
                "ranks": {rank: {"peak": int|null, "current": int|null}}}, ...],
     "common_findings": [{"kind", "ranks": [int, ...], "message", "message_rank",
                          "lines": [location, ...], "fix"}, ...]}

FINDING is as in ``memviz report``'s JSON (memviz/cli/report.py). Ranks are
JSON object keys as strings. Sizes are bytes; NaN is written as null.
"""

from __future__ import annotations

import glob
import os
import sys
from typing import Any, List

from memviz._errors import InvalidArgument, TraceError
from memviz.cli.common import EXIT_USAGE, dumps, load_trace, refuse_output, write_text

__all__ = ["expand", "report_ranks"]

_PATTERN = ("*", "?", "[")


def expand(paths: List[str]) -> List[str]:
    """The files named: a path with a wildcard that is no file is expanded
    (sorted); raises InvalidArgument when such a pattern matches nothing."""
    out: List[str] = []
    for p in paths:
        if any(c in p for c in _PATTERN) and not os.path.exists(p):
            found = sorted(glob.glob(p))
            if not found:
                raise InvalidArgument(f"no file matches {p!r}. What to do: check the folder and the "
                                      "name (memviz run -o run.memviz under torchrun writes "
                                      "run.rank0.memviz, run.rank1.memviz ...).")
            out += found
        else:
            out.append(p)
    return out


def report_ranks(paths: List[str], opts: Any, prog: str) -> int:
    """The merged report of several traces (``opts``: memviz report's options)."""
    inputs = tuple(("a trace being reported", p) for p in paths)
    what = {"text": "the report", "json": "the JSON report", "html": "the HTML report"}[opts.format]
    refused = refuse_output(opts.output, inputs, what, prog)
    if refused is not None:
        return refused
    try:
        traces = [load_trace(p, opts.recover, prog) for p in paths]
        from memviz.report.ranks import rank_report, rank_text
        doc = rank_report(traces, opts.top)
        if opts.format == "text":
            text = rank_text(doc, steps_shown=opts.top)
        elif opts.format == "json":
            text = dumps(doc)
        else:
            from memviz.report.ranks_html import render
            text = render(doc)
    except (TraceError, InvalidArgument) as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return EXIT_USAGE
    return write_text(text, opts.output, prog, what, inputs)
