"""``memviz export``: traces into files other tools read.

``python -m memviz export --parquet OUT/ run.rank*.memviz [--jobs N] [--recover]``
writes the traces' tables as Parquet into the folder OUT (memviz/export/parquet.py;
the schema is docs/parquet.md): one file per table for all the traces
(``ranks-00000-00511.parquet``), but for the events of a large trace, in a
file of the rank's own; read as one table by DuckDB, Polars or Spark. The
files are read by worker processes (up to the machine's cores), each
holding one trace at a time and streaming a large trace's events to its
file; this process writes the shared files, the traces' rows in the order
the files were given. A file that cannot be read is said and left out.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
from typing import Any, Dict, Iterator, List, Optional, Tuple

import memviz._progress as _progress
from memviz._interrupts import deferred_interrupt
from memviz._errors import InvalidArgument, OutputError, TraceError
from memviz.cli.common import EXIT_USAGE, add_force, parse, positive, with_progress

__all__ = ["main", "export_parser"]


def export_parser(prog: str = "memviz export") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description="Write .memviz traces as tables other tools read: Parquet (events, stacks, "
                               "steps, peaks and what was live at each, findings, one row per rank) for "
                               "DuckDB, Polars or Spark. Needs pyarrow (pip install 'memviz-gpu[parquet]').",
        epilog="Example: memviz export --parquet out/ run.rank*.memviz; then in DuckDB: "
               "SELECT rank, max(peak) FROM 'out/ranks/*.parquet' GROUP BY rank", allow_abbrev=False)
    parser.add_argument("trace", nargs="+", help="the .memviz files (a quoted pattern such as "
                                                 "'run.rank*.memviz' is expanded)")
    parser.add_argument("--parquet", metavar="OUT", required=True,
                        help="the folder to write into (made if needed; with --force, a file of the same "
                             "name, of the same ranks, is replaced)")
    parser.add_argument("--jobs", type=positive, default=None, metavar="N",
                        help="worker processes (default: the machine's cores)")
    parser.add_argument("--recover", action="store_true",
                        help="read a corrupted file up to the damaged part")
    add_force(parser)
    return parser


def _export_one(path: str, out: str, recover: bool) -> Tuple[str, Any]:
    """In a worker: ("ok", the trace's parts: memviz.export.parquet.trace_parts)
    or ("skip", why)."""
    import warnings

    _progress.in_worker()  # a worker draws no progress line of its own
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from memviz.export.parquet import trace_parts
            from memviz.loaded import load
            return "ok", trace_parts(load(path, recover=recover), out)
    except (TraceError, InvalidArgument) as e:
        return "skip", str(e)
    except MemoryError:
        return "skip", "not enough memory to read it"
    except Exception as e:  # noqa: BLE001 - one bad file must not cost the others' export
        return "skip", f"{type(e).__name__}: {e}"


def _results(paths: List[str], out: str, jobs: int, recover: bool) -> Iterator[Tuple[str, Any]]:
    """Each file's (status, value), in the order of ``paths`` (a result that
    comes early waits for those before it)."""
    if jobs <= 1 or len(paths) < 2:
        for i, p in enumerate(paths):
            _progress.update(i, len(paths), "exporting")
            yield _export_one(p, out, recover)
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    methods = multiprocessing.get_all_start_methods()
    ctx = multiprocessing.get_context("fork" if "fork" in methods else None)
    with ProcessPoolExecutor(max_workers=min(jobs, len(paths)), mp_context=ctx) as pool:
        futures = {pool.submit(_export_one, p, out, recover): i for i, p in enumerate(paths)}
        early: Dict[int, Tuple[str, Any]] = {}
        nxt = 0
        for done, f in enumerate(as_completed(futures)):
            _progress.update(done, len(paths), "exporting")
            early[futures[f]] = f.result()
            while nxt in early:
                yield early.pop(nxt)
                nxt += 1


def export_parquet(paths: List[str], out: str, jobs: int, recover: bool, prog: str, force: bool = False) -> int:
    from memviz.cli.report_ranks import jobs_default
    from memviz.export.parquet import Pool, make_folder, require, write_manifest

    require()
    paths = list(dict.fromkeys(paths))  # a file given twice is exported once
    if not force and os.path.isdir(out) and any(
            os.path.exists(os.path.join(out, t)) for t in ("memviz_parquet.json", "events", "ranks")):
        raise InvalidArgument(f"--parquet {out}: it already holds an export, whose files of the same ranks "
                              "would be replaced. What to do: pass --force (-f) to replace them, or choose "
                              "another folder.")
    # --force replaces the export there: none of its files may stay beside ours. They
    # are set aside first and removed once this one is written, or put back if it
    # fails (removed first, a run that then failed, no file readable or a Ctrl-C,
    # had destroyed the earlier export)
    make_folder(out)
    earlier = None
    if force:
        aside = os.path.join(out, f".memviz-earlier-export-{os.getpid()}")
        with deferred_interrupt():  # the moves whole, or none of them
            try:
                earlier = aside if _set_aside(out, aside) else None
            except OSError:
                _put_back(out, aside)
                raise
    jobs = jobs or jobs_default(len(paths))
    skipped: List[Tuple[str, str]] = []
    try:
        pool = Pool(out)
        try:
            for p, (status, value) in zip(paths, _results(paths, out, jobs, recover)):
                if status == "ok":
                    pool.add(value)
                else:
                    skipped.append((p, value))
            pool.close()
        except BaseException:
            pool.abort()
            raise
        good = len(pool.ranks)
        if good:
            write_manifest(out)
    except BaseException:
        if earlier is not None:
            with deferred_interrupt():
                _put_back(out, earlier)
        raise
    if earlier is not None:
        if good:
            shutil.rmtree(earlier, ignore_errors=True)
        else:
            _put_back(out, earlier)
    for p, why in skipped:
        print(f"{prog}: warning: left out {p}: {why}", file=sys.stderr)
    unranked = sum(1 for r in pool.ranks if r is None)
    if unranked > 1:
        print(f"{prog}: warning: {unranked:,} of the traces were recorded without a launcher's rank: "
              "their rows all have rank null, so a query cannot tell them apart (their events' own "
              "files are kept apart: single.parquet, single.1.parquet ...). What to do: export each "
              "into a folder of its own, or record them under a launcher (torchrun sets RANK).",
              file=sys.stderr)
    if not good:
        print(f"{prog}: none of the {len(paths):,} files could be exported"
              + (" (the export already there is left as it was)" if earlier else "")
              + ". What to do: check the files (memviz report FILE says what is wrong with one).",
              file=sys.stderr)
        return EXIT_USAGE
    print(f"{prog}: wrote {good:,} trace{'s' if good > 1 else ''} as Parquet into {out}"
          + (f" ({len(skipped):,} left out)" if skipped else ""), file=sys.stderr)
    return 0


#: the names memviz's export gives its files (memviz.export.parquet): --force removes these only
_EXPORT_FILE = re.compile(r"(rank-\d{5}|ranks-\d{5}-\d{5}|single)(\.\d+)?\.parquet")


def _set_aside(out: str, aside: str) -> bool:
    """--force: move the Parquet files of an earlier export in ``out`` (in
    its tables' folders, by the names memviz gives them, and its manifest)
    into the hidden folder ``aside`` there; nothing else: a file of the
    user's own stays. Whether there was anything to move."""
    from memviz.export.parquet import TABLES

    moved = False
    for table in TABLES:
        folder = os.path.join(out, table)
        if os.path.isdir(folder):
            for name in os.listdir(folder):
                if _EXPORT_FILE.fullmatch(name):
                    os.makedirs(os.path.join(aside, table), exist_ok=True)
                    os.replace(os.path.join(folder, name), os.path.join(aside, table, name))
                    moved = True
    manifest = os.path.join(out, "memviz_parquet.json")
    if os.path.exists(manifest):
        os.makedirs(aside, exist_ok=True)
        os.replace(manifest, os.path.join(aside, "memviz_parquet.json"))
        moved = True
    return moved


def _put_back(out: str, aside: str) -> None:
    """The earlier export's files back where they were (over what the failed
    run wrote under the same names), and the hidden folder gone."""
    if not os.path.isdir(aside):
        return
    for root, _dirs, files in os.walk(aside):
        rel = os.path.relpath(root, aside)
        for name in files:
            target = os.path.join(out, rel, name) if rel != "." else os.path.join(out, name)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            os.replace(os.path.join(root, name), target)
    shutil.rmtree(aside, ignore_errors=True)


@with_progress
def main(argv: Optional[List[str]] = None, prog: str = "memviz export") -> int:
    """Entry point of ``memviz export``; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    opts = parse(export_parser(prog), argv)
    if isinstance(opts, int):
        return opts
    from memviz.cli.report_ranks import expand
    try:
        paths = expand(opts.trace)
        return export_parquet(paths, opts.parquet, opts.jobs, opts.recover, prog, opts.force)
    except (TraceError, InvalidArgument, OutputError) as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return EXIT_USAGE
