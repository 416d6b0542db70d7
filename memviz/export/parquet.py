"""Parquet tables of traces, for DuckDB, Polars, Spark and the like
(``memviz export --parquet OUT/ run.rank*.memviz``, ``LoadedTrace.to_parquet``).

Through pyarrow, an optional dependency (``pip install 'memviz-gpu[parquet]'``);
:func:`require` says what to install when it is absent. The schema
(:data:`SCHEMA_VERSION`, :data:`TABLES`) is in docs/parquet.md; every file
carries it in its metadata (``memviz_schema_version``, ``memviz_table``).

A folder ``OUT`` holds one folder per table (``OUT/events``, ``OUT/ranks``
...). ``LoadedTrace.to_parquet`` writes one file per table for its rank
(``rank-00003.parquet``; a trace recorded without a launcher:
``single.parquet``). ``memviz export`` of several traces writes one file
per table for all of them (:class:`Pool`, named after their ranks:
``ranks-00000-00511.parquet``), but for the events of a trace of
:data:`POOL_BELOW` events or more, which get the rank's own file: a
Parquet file's footer and page headers cost a few KB, which a rank's small
tables would otherwise pay over and over. Every row has its ``rank``, so
``read_parquet('OUT/events/*.parquet')`` (DuckDB), ``pl.scan_parquet``
(Polars) or ``spark.read.parquet('OUT/events')`` read all ranks as one
table. ``OUT/memviz_parquet.json`` says the version and the tables.

Sizes: each column in the encoding that keeps it smallest (measured on
benchmarks/bench_ranks_scale.py's traces; :data:`_EVENT_ENCODING`), zstd,
no Arrow schema in the footer (Parquet's own types say the same but for
which strings were dictionaries), statistics only where a reader can skip
row groups with them (rank, time, alloc_id).

The events stream: the file is read again one EVENTS chunk at a time
(memviz/trace/reader.py), decoded by the C replayer straight into columns
(``feed_columns``: packed values, the allocations numbered) and written a
row group at a time, so the memory used does not grow with the trace.

Imports the report floor and below (docs/architecture.md).
"""

from __future__ import annotations

import array
import importlib.util
import io
import json
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

from memviz._errors import InvalidArgument, OutputError

__all__ = ["SCHEMA_VERSION", "TABLES", "POOL_BELOW", "missing", "require", "write_trace", "write_summary",
           "write_manifest", "file_name", "trace_parts", "Pool"]

SCHEMA_VERSION = 2
#: events decoded and written at a time (one row group each)
_BATCH = 1 << 17
#: ``memviz export``: a trace of fewer events (records) than this has its
#: events in the export's shared file; from this many, in a file of its own
#: (written by the worker that reads it, and so in parallel)
POOL_BELOW = 1 << 16

#: table -> what a row is (docs/parquet.md has the columns)
TABLES: Dict[str, str] = {
    "ranks": "one row per rank: where it ran, its peak and when, its steps' trend",
    "events": "one row per alloc, free or failed allocation",
    "stacks": "one row per call stack: its frames, oldest first, and the user's line",
    "steps": "one row per step and device",
    "peaks": "one row per device and peak (the device's, PyTorch's tensors')",
    "peak_lines": "what was live at each peak, by line of code",
    "findings": "one row per finding of memviz.diagnose()",
}


def missing(*modules: str) -> List[str]:
    """The modules of ``modules`` that are not installed."""
    return [m for m in modules if importlib.util.find_spec(m) is None]


def require() -> Any:
    """pyarrow.parquet, or InvalidArgument saying what to install."""
    if missing("pyarrow"):
        raise InvalidArgument("the Parquet export needs pyarrow, which is not installed. What to do: "
                              "pip install 'memviz-gpu[parquet]' (or pip install pyarrow).")
    import pyarrow.parquet as pq
    return pq


def file_name(rank: Optional[int]) -> str:
    return "single.parquet" if rank is None else f"rank-{rank:05d}.parquet"


def pool_name(ranks: Sequence[Optional[int]]) -> str:
    """The name of an export's shared files, after the ranks in it:
    ``ranks-00000-00511.parquet`` (the lowest and the highest rank), the
    rank's own name for one trace."""
    known = sorted({r for r in ranks if r is not None})
    if len(ranks) == 1 or not known:
        return file_name(known[0] if known else None)
    return f"ranks-{known[0]:05d}-{known[-1]:05d}.parquet"


def _schemas() -> Dict[str, Any]:
    import pyarrow as pa

    s, i8, i16, i32, i64, u64, f64 = pa.string(), pa.int8(), pa.int16(), pa.int32(), pa.int64(), pa.uint64(), \
        pa.float64()
    d = pa.dictionary(pa.int32(), pa.string())
    line = [("file", s), ("line", i32), ("function", s), ("backward", s)]
    return {
        "ranks": [("rank", i32), ("local_rank", i32), ("world_size", i32), ("host", s), ("run_id", s),
                  ("pid", i64), ("trace", s), ("command", s), ("truncated", pa.bool_()), ("truncated_reason", s),
                  ("start_wall_time", f64), ("start_monotonic_ns", i64), ("duration_s", f64),
                  ("events", i64), ("peak_device", i16), ("peak", i64), ("peak_at_s", f64), ("peak_step", i64),
                  ("current", i64), ("failed", i64), ("steps", i64), ("trend_per_step", i64),
                  ("findings_error", s)],
        "events": [("rank", i32), ("op", d), ("timestamp_ns", i64), ("alloc_id", i64), ("device", i16),
                   ("kind", d), ("stream", u64), ("address", u64), ("size", i64), ("requested", i64),
                   ("stack_id", i64), ("thread", i32), ("label", d), ("autograd_node", d), ("category", d),
                   ("flags", pa.uint8())],
        "stacks": [("rank", i32), ("stack_id", i64),
                   ("frames", pa.list_(pa.struct([("file", s), ("line", i32), ("function", s)]))),
                   ("user_file", s), ("user_line", i32), ("user_function", s), ("call", s)],
        "steps": [("rank", i32), ("step", i64), ("timestamp_ns", i64), ("duration_ns", i64), ("device", i16),
                  ("peak", i64), ("current", i64), ("allocated", i64), ("reserved", i64), ("main_device", pa.bool_())],
        "peaks": [("rank", i32), ("device", i16), ("peak_kind", s), ("bytes", i64), ("timestamp_ns", i64),
                  ("at_s", f64), ("live", i64)],
        "peak_lines": [("rank", i32), ("device", i16), ("peak_kind", s), *line, ("bytes", i64), ("count", i64)],
        "findings": [("rank", i32), ("kind", s), ("message", s), ("device", i16), ("fix", s),
                     ("locations", pa.list_(s)), ("numbers_json", s)],
        "_": [("x", i8)],
    }


def schema(table: str) -> Any:
    import pyarrow as pa
    from memviz._package import __version__

    return pa.schema(_schemas()[table], metadata={"memviz_schema_version": str(SCHEMA_VERSION),
                                                  "memviz_table": table, "memviz_version": __version__})


#: The events' columns, each in the encoding that keeps it smallest (measured
#: on benchmarks/bench_ranks_scale.py's traces, zstd level 9 on top): times
#: as deltas (DELTA_BINARY_PACKED: the deltas' own entropy, which the .memviz
#: file pays too), the strings and the rank as dictionaries, the other
#: integers plain (zstd finds their repeats). alloc_id and address are
#: written as byte planes (BYTE_STREAM_SPLIT: varied, as in a training loop)
#: or as deltas (an allocation freed at once), whichever is smaller on the
#: file's first row group (:func:`_pick_encoding`).
_EVENT_ENCODING = {"timestamp_ns": "DELTA_BINARY_PACKED", "alloc_id": "BYTE_STREAM_SPLIT",
                   "address": "BYTE_STREAM_SPLIT", "device": "PLAIN", "stream": "PLAIN", "size": "PLAIN",
                   "requested": "PLAIN", "stack_id": "PLAIN", "thread": "PLAIN", "flags": "PLAIN"}
_EVENT_DICTIONARY = ["rank", "op", "kind", "label", "autograd_node", "category"]
_EVENT_STATISTICS = ["rank", "timestamp_ns", "alloc_id"]
_PICKED = ("alloc_id", "address")
_LEVEL = 9


def _options(table: str, encoding: Optional[Dict[str, str]] = None) -> Dict[str, Any]:
    """The ParquetWriter's options for ``table``: the small tables plain
    under zstd (zstd finds the repeats a dictionary would: smaller for these),
    without statistics (one row group: nothing to skip)."""
    import pyarrow.parquet as pq

    # the Arrow schema only where this pyarrow cannot write the metadata alone
    common = dict(compression="zstd", compression_level=_LEVEL,
                  store_schema=not hasattr(pq.ParquetWriter, "add_key_value_metadata"))
    if table != "events":
        return dict(common, use_dictionary=False, write_statistics=False)
    return dict(common, use_dictionary=_EVENT_DICTIONARY, write_statistics=_EVENT_STATISTICS,
                column_encoding=dict(encoding or _EVENT_ENCODING))


def _parquet_bytes(table: Any, **options: Any) -> int:
    """The size of ``table`` written with ``options`` (in memory)."""
    import pyarrow.parquet as pq

    buf = io.BytesIO()
    with pq.ParquetWriter(buf, table.schema, **options) as w:
        w.write_table(table)
    return len(buf.getvalue())


def _pick_encoding(table: Any) -> Dict[str, str]:
    """The events' encodings for a file whose first row group is ``table``:
    alloc_id and address each in the smaller of byte planes and deltas;
    plain where this pyarrow has no byte planes for integers."""
    enc = dict(_EVENT_ENCODING)
    if not table.num_rows:
        return enc
    for name in _PICKED:
        col = table.select([name])
        sizes = {}
        for way in ("BYTE_STREAM_SPLIT", "DELTA_BINARY_PACKED"):
            try:
                sizes[way] = _parquet_bytes(col, compression="zstd", compression_level=_LEVEL, store_schema=False,
                                            use_dictionary=False, write_statistics=False,
                                            column_encoding={name: way})
            except (ValueError, NotImplementedError, TypeError, OSError):  # an older pyarrow
                pass
        enc[name] = min(sizes, key=sizes.__getitem__) if sizes else "PLAIN"
    return enc


class _Writer:
    """One table's file, written through a temporary name; the ParquetWriter
    is made on the first row group (the events' encodings are picked on it)."""

    def __init__(self, out: str, table: str, name: str) -> None:
        require()
        folder = os.path.join(out, table)
        os.makedirs(folder, exist_ok=True)
        self.table = table
        self.path = os.path.join(folder, name)
        self.tmp = os.path.join(folder, f".{name}.tmp-{os.getpid()}")
        self.schema = schema(table)
        self.rows = 0
        self._w: Any = None

    def _open(self, first: Any) -> None:
        import pyarrow.parquet as pq

        encoding = _pick_encoding(first) if self.table == "events" else None
        try:
            self._w = pq.ParquetWriter(self.tmp, self.schema, **_options(self.table, encoding))
        except (ValueError, NotImplementedError, TypeError):  # a pyarrow without byte planes for integers
            encoding = {k: ("PLAIN" if v == "BYTE_STREAM_SPLIT" else v) for k, v in (encoding or {}).items()}
            self._w = pq.ParquetWriter(self.tmp, self.schema, **_options(self.table, encoding))
        if hasattr(self._w, "add_key_value_metadata"):  # without the Arrow schema, its metadata is not written
            self._w.add_key_value_metadata({k.decode(): v.decode() for k, v in self.schema.metadata.items()})

    def write(self, data: Any) -> None:
        """A row group: a Table of the table's schema, or {column: values}."""
        table = data if hasattr(data, "schema") else _table(self.table, data)
        if self._w is None:
            self._open(table)
        self._w.write_table(table)
        self.rows += table.num_rows

    def close(self, name: Optional[str] = None, exclusive: bool = False) -> str:
        """Finish the file (an empty one has the schema) as ``name`` (default:
        the name given). ``exclusive``: never over a file already there (two
        traces of one export with the same rank, or none, would share a
        name): the first free ``NAME.1.parquet``, ``NAME.2.parquet``... then."""
        if self._w is None:
            self._open(self.schema.empty_table())
        self._w.close()
        if name is not None:
            self.path = os.path.join(os.path.dirname(self.path), name)
        if not exclusive:
            os.replace(self.tmp, self.path)
            return self.path
        stem, n = self.path[:-len(".parquet")] if self.path.endswith(".parquet") else self.path, 0
        while True:
            target = self.path if n == 0 else f"{stem}.{n}.parquet"
            try:
                os.link(self.tmp, target)  # atomic: fails where the name is taken
            except FileExistsError:
                n += 1
                continue
            except OSError:  # a file system without hard links: a check, then the rename
                if os.path.exists(target):
                    n += 1
                    continue
                os.replace(self.tmp, target)
                self.path = target
                return target
            os.unlink(self.tmp)
            self.path = target
            return target

    def abort(self) -> None:
        try:
            if self._w is not None:
                self._w.close()
        finally:
            try:
                os.unlink(self.tmp)
            except OSError:
                pass


def _table(table: str, columns: Dict[str, Any]) -> Any:
    """An Arrow table of ``table``'s schema from {column: values}."""
    import pyarrow as pa

    sch = schema(table)
    arrays = []
    for f in sch:
        v = columns[f.name]
        arrays.append(v if isinstance(v, (pa.Array, pa.ChunkedArray)) else pa.array(v, type=f.type))
    return pa.Table.from_arrays(arrays, schema=sch)


def _write(out: str, table: str, name: str, data: Any) -> str:
    w = _Writer(out, table, name)
    try:
        w.write(data)
    except BaseException:
        w.abort()
        raise
    return w.close()


def _rows(table: str, rows: Sequence[Sequence[Any]]) -> Dict[str, List[Any]]:
    names = [n for n, _t in _schemas()[table]]
    cols = list(zip(*rows)) if rows else [() for _ in names]
    return {n: list(c) for n, c in zip(names, cols)}


# ---- the small tables: from a rank's summary --------------------------------------


def _summary_tables(summary: Any) -> Dict[str, Dict[str, List[Any]]]:
    r, row = summary.rank, summary.row
    ranks = [(r, row["local_rank"], row["world_size"], row["host"], summary.run_id, row["pid"], row["trace"],
              row["command"], row["truncated"], row["truncated_reason"], summary.start_wall_time,
              summary.start_monotonic_ns, row["duration_s"], summary.events, row["device"], row["peak"],
              row["peak_at_s"], row.get("peak_step"), row["current"], row["failed"], row["steps"],
              row.get("trend_per_step"), row["findings_error"])]
    steps = [(r, i, ts, dur, row["device"], peak, cur, None, None, True) for i, ts, dur, peak, cur in summary.steps]
    lines = [(r, row["device"], "device", k[0], k[1], v[2] if len(v) > 2 else "", k[2], v[0],
              v[1] if len(v) > 2 else None) for k, v in summary.lines.items()]
    findings = [(r, f["kind"], f["message"], f["device"], f["fix"],
                 [ln["location"] for ln in f["lines"] if ln.get("location")],
                 json.dumps(f["numbers"], default=str)) for f in row["findings"]]
    return {"ranks": _rows("ranks", ranks), "steps": _rows("steps", steps), "peak_lines": _rows("peak_lines", lines),
            "findings": _rows("findings", findings)}


def write_summary(summary: Any, out: str, name: Optional[str] = None) -> List[str]:
    """The tables the merge reads (ranks, steps on the peak device, lines at
    the peak, findings) of one rank's summary (memviz/report/ranks_summary.py);
    ``name``: the files' name in each table's folder (default: the rank's)."""
    return [_write(out, table, name or file_name(summary.rank), cols)
            for table, cols in _summary_tables(summary).items()]


# ---- a whole trace ------------------------------------------------------------------


def _peaks(trace: Any, rank: Optional[int]) -> Tuple[List[tuple], List[tuple], Dict[tuple, str]]:
    """(peaks rows, peak_lines rows, {(device, address, made at, kind): category})."""
    from memviz.report.ranks_summary import peak_lines

    peaks, lines, known = [], [], {}
    totals, tensor = trace.totals(), trace.tensor_totals()
    start = getattr(trace, "started_ns", None)
    for dev in sorted(totals):
        for which, figures in (("device", totals[dev]), ("tensor", tensor.get(dev))):
            if not figures or not figures.get("peak"):
                continue
            snap = trace.peak_snapshot(dev, peak=which)
            ts = figures.get("peak_timestamp_ns") or None
            peaks.append((rank, dev, which, figures["peak"], ts,
                          (ts - start) / 1e9 if ts and start is not None and ts >= start else None,
                          len(snap.allocations)))
            for (file, line, backward), (size, count, function) in peak_lines(snap).items():
                lines.append((rank, dev, which, file, line, function, backward, size, count))
            for a in snap.allocations:
                if a.category:
                    known[(a.device, a.address, a.seq, a.kind)] = a.category
    for a in trace.snapshot().allocations:
        if a.category:
            known[(a.device, a.address, a.seq, a.kind)] = a.category
    return peaks, lines, known


def _stacks(trace: Any, rank: Optional[int]) -> List[tuple]:
    from memviz.model.traceback import Frame, Traceback

    rows = []
    for sid, ids in sorted(trace._stacks.items()):
        frames = [trace._frames[i] for i in ids][::-1]  # innermost first in the file; oldest first here
        tb = Traceback([Frame(f or "<unknown>", max(int(n or 0), 0), name or "") for f, n, name in frames],
                       trace.frame_filter)
        u = tb.user_frame
        rows.append((rank, sid, [{"file": f.filename, "line": f.lineno, "function": f.name} for f in tb],
                     u.filename if u else None, u.lineno if u else None, u.name if u else None,
                     trace._calls.get(sid)))
    return rows


def _small_tables(trace: Any, rank: Optional[int]) -> Tuple[Dict[str, Any], Dict[tuple, str]]:
    """({table: Arrow table} of the tables but the events, the categories
    known by allocation (for the events))."""
    from memviz.report.ranks_summary import summarise

    summary = summarise(trace)
    summary.rank = rank
    summary.row["rank"] = rank
    tables: Dict[str, Any] = _summary_tables(summary)
    tables.pop("peak_lines")  # every peak's below, not only the main device's
    steps = []  # every device's, not only the peak device's
    for rec in trace.steps:
        devices = getattr(rec, "devices", None)
        if not isinstance(devices, dict):
            continue
        for dev, d in sorted(devices.items()):
            steps.append((rank, rec.index, rec.timestamp_ns, rec.duration_ns, dev, d.peak, d.current, d.allocated,
                          d.reserved, dev == summary.row["device"]))
    tables["steps"] = _rows("steps", steps)
    peaks, lines, known = _peaks(trace, rank)
    tables["peaks"] = _rows("peaks", peaks)
    tables["peak_lines"] = _rows("peak_lines", lines)
    tables["stacks"] = _rows("stacks", _stacks(trace, rank))
    return {t: _table(t, cols) for t, cols in tables.items()}, known


def _mark_times(trace: Any) -> List[int]:
    """The times of the trace's step marks."""
    times = []
    for rec in getattr(trace, "steps", None) or ():
        ts = rec.get("timestamp_ns") if isinstance(rec, dict) else getattr(rec, "timestamp_ns", None)
        if type(ts) is int and 0 <= ts < 1 << 64:
            times.append(ts)
    return times


def _event_batches(trace: Any, rank: Optional[int], known: Dict[tuple, str]) -> Any:
    """The events as Arrow tables of the events' schema, one per _BATCH
    records, decoded in C (the replayer's feed_columns)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from memviz.model.snapshot import KIND_NAMES, decode_label
    from memviz.trace import format as F

    sch = schema("events")
    string = pa.string()
    ops = pa.array(["?", "alloc", "free", "failed"], type=string)  # the ops feed_columns gives: 1, 2, 3
    kinds = pa.array(list(KIND_NAMES), type=string)
    by_made = {(made, addr): cat for (_dev, addr, made, _kind), cat in known.items()}
    made_keys = pa.array(sorted({m for m, _a in by_made if isinstance(m, int) and m > 0}), type=pa.uint64())
    named: Dict[int, Tuple[Optional[str], Optional[str]]] = {}

    def names(lid: int) -> Tuple[Optional[str], Optional[str]]:
        got = named.get(lid)
        if got is None:
            user, node, _fwd = decode_label(trace._labels.get(lid) if lid else None)
            got = named[lid] = (user, node)
        return got

    def strings(values: List[Optional[str]], at: Any) -> Any:
        """A dictionary column: values[at[i]] for row i (at: int32)."""
        words = sorted({v for v in values if v is not None})
        if not words:
            return pa.nulls(len(at), sch.field("label").type)
        index = {w: k for k, w in enumerate(words)}
        which = pa.array([index.get(v) if v is not None else None for v in values], type=pa.int32())
        return pa.DictionaryArray.from_arrays(pc.take(which, at), pa.array(words, type=string))

    marks = array.array("Q", sorted(_mark_times(trace)))
    numbered = None
    for rp, payload, count, layout in trace._again("exporting"):
        if rp is not numbered:  # each step's allocations numbered from (marks before it) << 32
            rp.number_by_steps(marks.tobytes())
            numbered = rp
        for lo in range(0, count, _BATCH):
            (n, op, ts, ids, valid, addr, size, dev, kind, thread, lab, made, sid, req, flags, stream,
             nulls) = rp.feed_columns(payload, F.EVENTS_HEAD.size, count, layout, lo, lo + _BATCH)
            if not n:
                continue

            def col(typ: Any, data: bytes, validity: Any = None, null_count: int = 0) -> Any:
                return pa.Array.from_buffers(typ, n, [validity, pa.py_buffer(data)], null_count=null_count)

            kind_at = col(pa.uint8(), kind)
            if pc.max(kind_at).as_py() >= len(kinds):  # a kind this memviz does not know: "?"-like first name
                kind_at = pc.if_else(pc.less(kind_at, len(kinds)), kind_at, pa.scalar(0, pa.uint8()))
            labels = col(pa.uint32(), lab)
            uniq = pc.unique(labels)
            at = pc.index_in(labels, value_set=uniq)
            pairs = [names(v) for v in uniq.to_pylist()]
            address = col(pa.uint64(), addr)
            if len(made_keys):
                made_at = col(pa.uint64(), made)
                hits = pc.indices_nonzero(pc.is_in(made_at, value_set=made_keys))
                if len(hits):
                    cats: List[Optional[str]] = [None] * n
                    for k, m, a in zip(hits.to_pylist(), made_at.take(hits).to_pylist(),
                                       address.take(hits).to_pylist()):
                        cats[k] = by_made.get((m, a))
                    category = pa.array(cats, type=string).dictionary_encode()
                else:
                    category = pa.nulls(n, sch.field("category").type)
            else:
                category = pa.nulls(n, sch.field("category").type)
            columns = {
                "rank": pa.repeat(pa.scalar(rank, pa.int32()), n),
                "op": pa.DictionaryArray.from_arrays(col(pa.uint8(), op).cast(pa.int32()), ops),
                "timestamp_ns": col(pa.int64(), ts),
                "alloc_id": col(pa.int64(), ids, pa.py_buffer(valid) if nulls else None, nulls),
                "device": col(pa.int16(), dev),
                "kind": pa.DictionaryArray.from_arrays(kind_at.cast(pa.int32()), kinds),
                "stream": col(pa.uint64(), stream), "address": address, "size": col(pa.int64(), size),
                "requested": col(pa.int64(), req), "stack_id": col(pa.int64(), sid),
                "thread": col(pa.int32(), thread),
                "label": strings([p[0] for p in pairs], at), "autograd_node": strings([p[1] for p in pairs], at),
                "category": category, "flags": col(pa.uint8(), flags)}
            yield pa.Table.from_arrays([columns[f.name] for f in sch], schema=sch)


def _event_records(trace: Any) -> int:
    """The trace's records (at least its events: the pool's measure)."""
    n = getattr(trace, "event_count", None)
    return n if isinstance(n, int) else sum(c[2] for c in getattr(trace, "_event_chunks", ()))


def _events_file(trace: Any, out: str, rank: Optional[int], known: Dict[tuple, str],
                 exclusive: bool = False) -> str:
    """The trace's events into their own file (events/rank-NNNNN.parquet),
    streamed; ``exclusive``: see :meth:`_Writer.close`."""
    w = _Writer(out, "events", file_name(rank))
    try:
        for batch in _event_batches(trace, rank, known):
            w.write(batch)
    except BaseException:
        w.abort()
        raise
    return w.close(exclusive=exclusive)


def write_trace(trace: Any, out: str, rank: Any = "auto", force: bool = False) -> List[str]:
    """Every table of one loaded trace into the folder ``out`` (made if
    needed), one file per table named after the rank; returns the files
    written. ``rank``: the ``rank`` column and file name (default: the
    trace's rank, None without a launcher). Files of that rank already
    there are replaced only with ``force``."""
    require()
    rank = getattr(trace, "rank", None) if rank == "auto" else rank
    taken = [os.path.join(out, t, file_name(rank)) for t in TABLES
             if os.path.exists(os.path.join(out, t, file_name(rank)))]
    if taken and not force:
        raise InvalidArgument(f"{out} already holds the tables of "
                              f"{'rank ' + str(rank) if rank is not None else 'a trace without a rank'} "
                              f"({taken[0]}). What to do: pass force=True to replace them, rank=N to "
                              "write them under another rank, or choose another folder.")
    make_folder(out)
    tables, known = _small_tables(trace, rank)
    written = [_write(out, table, file_name(rank), t) for table, t in tables.items()]
    written.append(_events_file(trace, out, rank, known))
    write_manifest(out)
    return written


def trace_parts(trace: Any, out: str, rank: Any = "auto", pool_below: Optional[int] = None) -> Dict[str, Any]:
    """One trace's share of an export (in a worker): {"rank", "tables":
    {table: Arrow table} for the :class:`Pool`, "events": an Arrow table
    for the pool, or None when the trace had :data:`POOL_BELOW` events or
    more and they went to ``out/events/rank-NNNNN.parquet``, "files": the
    files written}."""
    import pyarrow as pa

    require()
    rank = getattr(trace, "rank", None) if rank == "auto" else rank
    tables, known = _small_tables(trace, rank)
    if _event_records(trace) < (POOL_BELOW if pool_below is None else pool_below):
        batches = list(_event_batches(trace, rank, known))
        events = pa.concat_tables(batches) if batches else schema("events").empty_table()
        return {"rank": rank, "tables": tables, "events": events, "files": []}
    return {"rank": rank, "tables": tables, "events": None,
            "files": [_events_file(trace, out, rank, known, exclusive=True)]}


class Pool:
    """The files an export of several traces shares, one per table: the
    parts of :func:`trace_parts` added in turn (their rows in that order),
    a row group written each :data:`_BATCH` rows, the files named after the
    ranks at :meth:`close`."""

    def __init__(self, out: str) -> None:
        require()
        self.out = out
        self.ranks: List[Optional[int]] = []
        self._writers: Dict[str, _Writer] = {}
        self._held: Dict[str, List[Any]] = {t: [] for t in TABLES}
        self._rows: Dict[str, int] = {t: 0 for t in TABLES}
        self._any_events = False

    def add(self, parts: Dict[str, Any]) -> None:
        self.ranks.append(parts["rank"])
        tables = dict(parts["tables"])
        if parts.get("events") is not None:
            tables["events"] = parts["events"]
        for table, t in tables.items():
            if table == "events":
                self._any_events = True
            if not t.num_rows:
                continue
            self._held[table].append(t)
            self._rows[table] += t.num_rows
            if self._rows[table] >= _BATCH:
                self._flush(table)

    def _flush(self, table: str) -> None:
        import pyarrow as pa

        held = self._held[table]
        if not held:
            return
        w = self._writers.get(table)
        if w is None:
            w = self._writers[table] = _Writer(self.out, table, f"pool-{os.getpid()}.parquet")
        rows = pa.concat_tables(held)
        try:  # one dictionary per column in the row group
            rows = rows.combine_chunks()
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):  # a pyarrow that cannot unify them
            pass
        w.write(rows)
        self._held[table], self._rows[table] = [], 0

    def close(self) -> List[str]:
        """Write what is held; returns the files (none when nothing was added)."""
        if not self.ranks:
            self.abort()
            return []
        name = pool_name(self.ranks)
        written = []
        for table in TABLES:
            if table == "events" and not self._any_events:
                continue  # every trace's events have a file of their own
            self._flush(table)
            w = self._writers.get(table) or _Writer(self.out, table, name)
            self._writers.pop(table, None)
            written.append(w.close(name))
        return written

    def abort(self) -> None:
        for w in self._writers.values():
            w.abort()
        self._writers.clear()


def make_folder(out: str) -> None:
    """The export's folder, made if needed (with its parents); an OutputError
    that says what to do where it cannot be (a file on the way, no
    permission, a read-only file system)."""
    from memviz._output_files import output_error

    if os.path.lexists(out) and not os.path.isdir(out):
        raise OutputError("the Parquet export", out, "it is a file, not a folder",
                          hint="give a folder (it is made if needed), or remove the file")
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        raise output_error("the Parquet export", out, e,
                           hint="give a folder that can be made here: every part of its path "
                                "a folder, in a place you may write to") from e


def write_manifest(out: str) -> str:
    """``OUT/memviz_parquet.json``: the schema version and the tables."""
    from memviz._output_files import write_output
    from memviz._package import __version__

    path = os.path.join(out, "memviz_parquet.json")
    doc = {"memviz_parquet": SCHEMA_VERSION, "memviz_version": __version__,
           "tables": {t: {"what": what, "files": f"{t}/*.parquet"} for t, what in TABLES.items()},
           "schema": "docs/parquet.md"}
    write_output(path, json.dumps(doc, indent=1) + "\n", "the export's manifest")
    return path
