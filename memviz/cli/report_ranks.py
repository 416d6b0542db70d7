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
     "lines": [{"file", "line", "function", "backward": str|null (a backward line's node,
                as in memviz report's JSON), "spread": int (max - min over the ranks),
                "bytes": {rank: bytes at that rank's peak}}, ...],
     "steps": [{"step": int, "imbalance": float|null,
                "ranks": {rank: {"peak": int|null, "current": int|null}}}, ...],
     "common_findings": [{"kind", "ranks": [int, ...], "message", "message_rank",
                          "lines": [location, ...], "fix"}, ...],
     "skipped": [{"trace": path, "reason": str}, ...] (files left out: unreadable, or of another run),
     "top_peaks": [{"rank", "host", "device", "peak", "peak_at_s", "peak_step": int|null}, ...],
     "growing_ranks": {"median_trend_per_step": int|float|null, "ranks_with_steps": int,
                       "all_grow": bool, "ranks": [{"rank", "host", "trend_per_step", "grown",
                                                    "steps"}, ...]},
     "findings_by_kind": [{"kind", "count", "ranks": [int, ...], "common": bool, "outlier": bool}, ...],
     "clocks": {"steps_used": int, "why_none": str|null, "max_offset_s": float|null,
                "hosts": [{"host", "ranks": [int, ...], "offset_s", "late_spread_s"}, ...],
                "ranks": {rank: offset_s}},
     "engine": "python"|"duckdb", "workers": int}

Each rank row also has "peak_step" (the step its peak fell in) and
"trend_per_step" (its live bytes per step after the warm-up); "imbalance"
also has "mean_peak", "stdev_peak", "cv" (stdev over mean) and "spread"
(highest less lowest peak). memviz/report/ranks_questions.py says how each
answer is worked out.

The files are read by ``--jobs`` worker processes (default: the machine's
cores), each holding one trace at a time and handing back its summary
(memviz/report/ranks_summary.py). ``--engine duckdb`` (``auto``: from
DUCKDB_FROM ranks, when DuckDB and pyarrow are installed) has the workers
write their ranks' tables as Parquet into a temporary folder and runs the
merge's queries on DuckDB over them (memviz/export/ranks_sql.py).

FINDING is as in ``memviz report``'s JSON (memviz/cli/report.py). Ranks are
JSON object keys as strings. Sizes are bytes; NaN is written as null.
"""

from __future__ import annotations

import glob
import os
import shutil
import sys
import tempfile
from typing import Any, Dict, List, Optional, Tuple

import memviz._progress as _progress

from memviz._errors import InvalidArgument, TraceError
from memviz.cli.common import EXIT_USAGE, dumps, refuse_output, write_text

__all__ = ["expand", "report_ranks", "summaries", "jobs_default", "DUCKDB_FROM"]

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


def _summarise(path: str, recover: bool, parquet: Optional[str], index: int = 0) -> Tuple[str, Any, List[str]]:
    """One rank's file, in a worker process: ("ok", its RankSummary, the
    warnings said while reading), or ("skip", why it could not be read, [])."""
    import warnings

    from memviz.trace.format import TraceWarning

    _progress.in_worker()  # a worker draws no progress line of its own
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", TraceWarning)
            from memviz.loaded import load
            trace = load(path, recover=recover)
            from memviz.report.ranks_summary import summarise
            summary = summarise(trace)
            if parquet is not None and summary.rank is not None:
                from memviz.export.parquet import write_summary
                summary.part = f"file-{index:07d}.parquet"  # one per file given: a foreign one stays apart
                write_summary(summary, parquet, summary.part)
                summary.lines = {}  # in the Parquet now: the merge reads them there
            del trace
        return "ok", summary, [str(w.message) for w in caught]
    except MemoryError:
        return "skip", "not enough memory to read it", []
    except (TraceError, InvalidArgument) as e:
        return "skip", _reason(e), []
    except Exception as e:  # noqa: BLE001 - one bad file must not cost the report of the others
        return "skip", f"{type(e).__name__}: {e}", []


def _reason(e: Exception) -> str:
    text = str(e)
    return text.split(". What to do")[0] if len(text) > 300 else text


def jobs_default(n: int) -> int:
    """Worker processes for ``n`` files: the cores this process may use, at most ``n``."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(cores, n))


def summaries(paths: List[str], recover: bool, jobs: int, prog: str,
              parquet: Optional[str] = None) -> Tuple[List[Any], List[Dict[str, str]]]:
    """(the RankSummary of each file that could be read, in the order given;
    ``{"trace", "reason"}`` of each that could not), read by ``jobs`` worker
    processes (in this one when 1). Each worker holds one trace at a time and
    hands back its summary, so memory is bounded by ``jobs`` traces being
    read, whatever the number of files. ``parquet``: a folder each worker
    also writes its rank's summary tables into (the DuckDB merge reads them)."""
    results: List[Any] = [None] * len(paths)
    if jobs <= 1 or len(paths) < 3:
        for i, p in enumerate(paths):
            _progress.update(i, len(paths), "reading the ranks' files")
            results[i] = _summarise(p, recover, parquet, i)
    else:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor, as_completed
        from concurrent.futures.process import BrokenProcessPool

        methods = multiprocessing.get_all_start_methods()
        ctx = multiprocessing.get_context("fork" if "fork" in methods else None)
        try:
            with ProcessPoolExecutor(max_workers=min(jobs, len(paths)), mp_context=ctx) as pool:
                futures = {pool.submit(_summarise, p, recover, parquet, i): i for i, p in enumerate(paths)}
                for done, f in enumerate(as_completed(futures)):
                    _progress.update(done, len(paths), "reading the ranks' files")
                    results[futures[f]] = f.result()
        except BrokenProcessPool:  # a worker killed (out of memory): the rest one at a time, here
            for i, p in enumerate(paths):
                if results[i] is None:
                    results[i] = _summarise(p, recover, parquet, i)
    out, skipped = [], []
    for p, (status, value, said) in zip(paths, results):
        if status == "ok":
            out.append(value)
            for w in said:
                print(f"{prog}: warning: {w}", file=sys.stderr)
        else:
            skipped.append({"trace": p, "reason": value})
    return out, skipped


def _foreign(found: List[Any]) -> Tuple[List[Any], List[Dict[str, str]]]:
    """The summaries of the run most files belong to, and the others (no
    rank, or another run id or world size than a strict majority's), told why."""
    kept, left = [], []
    for s in found:
        if s.rank is None:
            left.append({"trace": s.path, "reason": "it records no rank (not recorded under a launcher)"})
        else:
            kept.append(s)
    for field, what in (("run_id", "launcher run id"), ("world_size", "world size")):
        counts: Dict[Any, int] = {}
        for s in kept:
            counts[getattr(s, field)] = counts.get(getattr(s, field), 0) + 1
        if len(counts) < 2:
            continue
        best, n = max(counts.items(), key=lambda kv: kv[1])
        if best is None or 2 * n <= len(kept):
            continue  # no strict majority: check_ranks refuses the mix, saying why
        for s in [s for s in kept if getattr(s, field) != best]:
            kept.remove(s)
            left.append({"trace": s.path, "reason": f"it is from another run: its {what} is "
                                                    f"{getattr(s, field)!r}, the others' {best!r}"})
    return kept, left


def report_ranks(paths: List[str], opts: Any, prog: str) -> int:
    """The merged report of several traces (``opts``: memviz report's options).
    Files that cannot be read (missing, cut short before their first
    events, not traces) and files of another run are left out, and the
    report says which; it is refused only when fewer than two ranks are left."""
    inputs = tuple(("a trace being reported", p) for p in paths)
    what = {"text": "the report", "json": "the JSON report", "html": "the HTML report"}[opts.format]
    refused = refuse_output(opts.output, inputs, what, prog, getattr(opts, "force", False))
    if refused is not None:
        return refused
    engine = getattr(opts, "engine", "auto")
    jobs = getattr(opts, "jobs", None) or jobs_default(len(paths))
    try:
        from memviz.report.ranks import merge, rank_text
        use_sql = _use_duckdb(engine, len(paths))
        tmp = tempfile.mkdtemp(prefix="memviz-ranks-") if use_sql else None
        try:
            found, skipped = summaries(paths, opts.recover, jobs, prog, parquet=tmp)
            found, foreign = _foreign(found)
            skipped += foreign
            if len(found) < 2 and skipped:
                raise InvalidArgument(
                    f"{len(found)} of the {len(paths):,} files could be read as ranks of one run, and a "
                    "merged report needs two or more: " + "; ".join(
                        f"{x['trace']}: {x['reason']}" for x in skipped[:10]) + ". What to do: check the "
                    "files (memviz report FILE reports one alone).")
            computed = None
            if use_sql:
                from memviz.export.ranks_sql import merged_sections
                try:
                    computed = merged_sections(tmp, [s.rank for s in found], opts.top, [s.part for s in found])
                except Exception as e:  # noqa: BLE001 - the Python merge gives the same answers
                    print(f"{prog}: warning: the DuckDB merge failed ({type(e).__name__}: {e}); merging "
                          "in Python instead", file=sys.stderr)
                    found, skipped = summaries(paths, opts.recover, jobs, prog)
                    found, foreign = _foreign(found)
                    skipped += foreign
        finally:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
        for x in skipped:
            print(f"{prog}: warning: left out {x['trace']}: {x['reason']}", file=sys.stderr)
        doc = merge(found, opts.top, skipped, computed)
        doc["workers"] = min(jobs, len(paths))
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


#: ``--engine auto`` merges on DuckDB (when installed) from this many ranks.
#: Measured (benchmarks/RESULTS.md, "Hundreds of ranks"): the Python merge of
#: the summaries takes well under a second for hundreds of ranks, while the
#: DuckDB merge pays for each worker writing its rank's Parquet and for reading
#: them back (about 2 s for 128 ranks on 2 cores); it is for runs too large for
#: that to matter, and for `--engine duckdb`.
DUCKDB_FROM = 1024


def _use_duckdb(engine: str, n: int) -> bool:
    if engine == "python":
        return False
    from memviz.export.parquet import missing
    absent = missing("duckdb", "pyarrow")
    if engine == "duckdb" and absent:
        raise InvalidArgument(f"--engine duckdb needs {' and '.join(absent)}, which "
                              f"{'are' if len(absent) > 1 else 'is'} not installed. What to do: "
                              "pip install 'memviz-gpu[duckdb]' (or pip install duckdb pyarrow), "
                              "or use --engine python.")
    return engine == "duckdb" or (not absent and n >= DUCKDB_FROM)
