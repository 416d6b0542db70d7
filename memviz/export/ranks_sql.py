"""The merge of a run's ranks as SQL on DuckDB (embedded, no server), over
the ranks' tables in Parquet (memviz/export/parquet.py: ranks, steps,
peak_lines, findings): ``memviz report --engine duckdb`` (and ``auto`` from
memviz/cli/report_ranks.py's DUCKDB_FROM ranks, when DuckDB is installed).

:func:`merged_sections` gives the sections of the merged report that read
every rank's lines and steps (the highest peaks, the imbalance, the lines
that differ most, the steps side by side, the kinds of findings, the ranks
growing alone) exactly as memviz/report/ranks_questions.py works them out
in Python; tests/integration/test_ranks_scale.py holds the two to the same answers. The
per-rank summaries then need not hold their lines: each worker writes them
to Parquet and lets them go.

Imports the report floor and below (docs/architecture.md).
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional

from memviz.report import ranks_questions as Q

__all__ = ["merged_sections"]


def _median(row_count: int, value: Any) -> Any:
    """DuckDB's quantile_cont as Python's statistics.median gives it: the
    middle element itself (an int) for an odd count."""
    if value is None:
        return None
    return int(value) if row_count % 2 == 1 and float(value).is_integer() else float(value)


def merged_sections(folder: str, ranks: List[int], top: int, parts: Optional[List[str]] = None) -> Dict[str, Any]:
    """The merged report's sections from the Parquet tables under ``folder``
    (``folder/TABLE/*.parquet``, or only the files named ``parts`` in each
    table's folder: those of the files kept, not of a file left out) of the
    ranks ``ranks``."""
    import duckdb

    con = duckdb.connect(":memory:")
    try:
        con.execute("SET threads TO %d" % max(1, min(os.cpu_count() or 1, 16)))
        for table in ("ranks", "steps", "peak_lines", "findings"):
            if parts is None:
                files = [os.path.join(folder, table, "*.parquet")]
            else:
                files = [os.path.join(folder, table, p) for p in parts]
            listed = ", ".join("'" + f.replace("'", "''") + "'" for f in files)
            con.execute(f"CREATE VIEW {table} AS SELECT * FROM read_parquet([{listed}], union_by_name=true)")
        con.execute("CREATE TEMP TABLE wanted AS SELECT unnest(?::INTEGER[]) AS rank", [ranks])
        con.execute("CREATE TEMP TABLE r AS SELECT ranks.* FROM ranks JOIN wanted USING (rank)")
        n = len(ranks)
        return {"engine": "duckdb", "top_peaks": _top_peaks(con, top), "imbalance": _imbalance(con),
                "lines": _lines(con, ranks, n, top), "steps": _steps(con), "findings_by_kind": _kinds(con, n),
                "growing_ranks": _growing(con)}
    finally:
        con.close()


def _top_peaks(con: Any, top: int) -> List[Dict[str, Any]]:
    rows = con.execute("SELECT rank, host, peak_device, peak, peak_at_s, peak_step FROM r "
                       "ORDER BY peak DESC, rank LIMIT ?", [top]).fetchall()
    return [{"rank": a, "host": h, "device": d, "peak": p, "peak_at_s": at, "peak_step": s}
            for a, h, d, p, at, s in rows]


def _imbalance(con: Any) -> Dict[str, Any]:
    n, med, mean, sd, hi_rank, hi, lo_rank, lo = con.execute(
        "SELECT count(*), quantile_cont(peak, 0.5), avg(peak), stddev_pop(peak), "
        "arg_min(rank, (-peak, rank)), max(peak), arg_min(rank, (peak, rank)), min(peak) FROM r").fetchone()
    median = _median(n, med)
    return {"max_rank": hi_rank, "max_peak": hi, "min_rank": lo_rank, "min_peak": lo, "median_peak": median,
            "ratio": hi / median if median else None, "mean_peak": float(mean),
            "stdev_peak": float(sd) if n > 1 and sd is not None else 0.0,
            "cv": (float(sd) if n > 1 and sd is not None else 0.0) / float(mean) if mean else None,
            "spread": hi - lo}


def _lines(con: Any, ranks: List[int], n: int, top: int) -> List[Dict[str, Any]]:
    con.execute(
        "CREATE TEMP TABLE l AS SELECT file, line, backward, rank, sum(bytes) AS b, "
        "first(function) AS fn FROM peak_lines JOIN wanted USING (rank) WHERE peak_kind = 'device' "
        "GROUP BY file, line, backward, rank")
    picked = con.execute(
        "SELECT file, line, backward, arg_min(fn, rank) AS function, max(b) AS mx, "
        "CASE WHEN count(*) < ? THEN least(min(b), 0) ELSE min(b) END AS mn FROM l "
        "GROUP BY file, line, backward HAVING mx - mn > 0 "
        "ORDER BY mx - mn DESC, mx DESC, file, line, coalesce(backward, '') LIMIT ?", [n, top]).fetchall()
    if not picked:
        return []
    con.execute("CREATE TEMP TABLE picked (file VARCHAR, line INTEGER, backward VARCHAR, k INTEGER)")
    con.executemany("INSERT INTO picked VALUES (?, ?, ?, ?)",
                    [(f, ln, bw, k) for k, (f, ln, bw, _fn, _mx, _mn) in enumerate(picked)])
    got = con.execute("SELECT p.k, l.rank, l.b FROM l JOIN picked p ON l.file = p.file AND l.line = p.line "
                      "AND l.backward IS NOT DISTINCT FROM p.backward").fetchall()
    values: List[Dict[int, int]] = [{} for _ in picked]
    for k, rank, b in got:
        values[k][rank] = b
    return [{"file": f, "line": ln, "function": fn or "", "backward": bw, "spread": mx - mn,
             "bytes": {str(r): values[k].get(r, 0) for r in ranks}}
            for k, (f, ln, bw, fn, mx, mn) in enumerate(picked)]


def _steps(con: Any) -> List[Dict[str, Any]]:
    stats = {s: (n, mx, med) for s, n, mx, med in con.execute(
        "SELECT step, count(peak), max(peak), quantile_cont(peak, 0.5) FROM steps JOIN wanted USING (rank) "
        "WHERE main_device GROUP BY step").fetchall()}
    out: List[Dict[str, Any]] = []
    current: Dict[str, Any] = {}
    for step, rank, peak, cur in con.execute(
            "SELECT step, rank, peak, current FROM steps JOIN wanted USING (rank) WHERE main_device "
            "ORDER BY step, rank").fetchall():
        if not out or out[-1]["step"] != step:
            n, mx, med = stats[step]
            median = _median(n, med) if n else 0
            current = {}
            out.append({"step": step, "ranks": current,
                        "imbalance": mx / median if n and median else None})
        current[str(rank)] = {"peak": peak, "current": cur}
    return out


def _kinds(con: Any, n: int) -> List[Dict[str, Any]]:
    rows = con.execute("SELECT kind, list(DISTINCT rank ORDER BY rank) FROM findings JOIN wanted USING (rank) "
                       "GROUP BY kind").fetchall()
    out = [{"kind": kind, "count": len(rs), "ranks": list(rs), "common": len(rs) == n,
            "outlier": len(rs) < n and len(rs) <= max(1, int(n * Q.OUTLIER_SHARE))} for kind, rs in rows]
    out.sort(key=lambda x: (-x["count"], x["kind"]))
    return out


def _growing(con: Any) -> Dict[str, Any]:
    n, med = con.execute("SELECT count(trend_per_step), quantile_cont(trend_per_step, 0.5) FROM r").fetchone()
    median = _median(n, med) if n else None
    if median is None:
        return {"median_trend_per_step": None, "ranks_with_steps": 0, "ranks": [], "all_grow": False}
    rows = con.execute(
        "SELECT rank, host, trend_per_step, trend_per_step * greatest(steps - 1, 0) AS grown, steps FROM r "
        "WHERE trend_per_step > 0 AND trend_per_step * greatest(steps - 1, 0) >= ? "
        "AND trend_per_step >= ? * greatest(?, 0) AND trend_per_step > ? "
        "ORDER BY trend_per_step DESC, rank", [Q.GROWTH_FLOOR, Q.GROWTH_OVER_MEDIAN, median, median]).fetchall()
    found = [{"rank": r, "host": h, "trend_per_step": t, "grown": g, "steps": s} for r, h, t, g, s in rows]
    every = bool(found) and len(found) == n
    return {"median_trend_per_step": median, "ranks_with_steps": n, "ranks": [] if every else found,
            "all_grow": every}
