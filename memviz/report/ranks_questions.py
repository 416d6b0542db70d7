"""What the user of a big job asks of its ranks, answered from their
summaries (memviz/report/ranks_summary.py) for the merged report
(memviz/report/ranks.py):

* :func:`top_peaks`: which ranks peak highest, and when (seconds after each
  started tracking, and in which step);
* :func:`imbalance`: the highest rank peak over the median, with the spread
  of all the peaks;
* :func:`line_spread`: the lines whose bytes at each rank's peak differ most
  between the ranks;
* :func:`steps_side_by_side`: each step's peak and live bytes per rank;
* :func:`growing_ranks`: ranks whose live bytes grow from step to step while
  the others' do not (one rank's leak);
* :func:`findings_by_kind`: each kind of finding and the ranks that have it,
  so that what every rank has stands apart from a few outliers;
* :func:`clocks`: how far each host's clock is from the others', read from
  the step marks (a synchronous job ends each step on every rank at about
  the same moment).

Each function reads plain values only, so the same questions can be put as
SQL over the exported Parquet (memviz/export/ranks_sql.py gives the same
answers for the big tables). Imports nothing above the report floor.
"""

from __future__ import annotations

import statistics
from typing import Any, Dict, List, Optional, Sequence

__all__ = ["top_peaks", "imbalance", "line_spread", "steps_side_by_side", "growing_ranks",
           "findings_by_kind", "clocks", "GROWTH_FLOOR", "GROWTH_OVER_MEDIAN", "OUTLIER_SHARE"]

MiB = 1 << 20
#: a rank grows alone when its live bytes rose by at least this much over its steps ...
GROWTH_FLOOR = 1 * MiB
#: ... and its trend per step is at least this many times the median rank's
GROWTH_OVER_MEDIAN = 4
#: a kind of finding is an outlier's when at most this share of the ranks have it (at least one rank)
OUTLIER_SHARE = 0.1


def top_peaks(rows: List[Dict[str, Any]], top: int) -> List[Dict[str, Any]]:
    """The ``top`` ranks of highest peak: rank, host, device, peak, when."""
    ordered = sorted(rows, key=lambda r: (-r["peak"], r["rank"]))[:top]
    return [{"rank": r["rank"], "host": r["host"], "device": r["device"], "peak": r["peak"],
             "peak_at_s": r["peak_at_s"], "peak_step": r.get("peak_step")} for r in ordered]


def imbalance(rows: List[Dict[str, Any]]) -> Dict[str, Any]:
    """max over median peak, the highest and lowest rank, the mean and spread."""
    peaks = [r["peak"] for r in rows]
    high = min(rows, key=lambda r: (-r["peak"], r["rank"]))
    low = min(rows, key=lambda r: (r["peak"], r["rank"]))
    median = statistics.median(peaks)
    mean = statistics.fmean(peaks)
    stdev = statistics.pstdev(peaks) if len(peaks) > 1 else 0.0
    return {"max_rank": high["rank"], "max_peak": high["peak"], "min_rank": low["rank"],
            "min_peak": low["peak"], "median_peak": median,
            "ratio": high["peak"] / median if median else None,
            "mean_peak": mean, "stdev_peak": stdev, "cv": stdev / mean if mean else None,
            "spread": high["peak"] - low["peak"]}


def line_spread(per_rank: Sequence[Dict[Any, List[Any]]], ranks: List[int], top: int) -> List[Dict[str, Any]]:
    """The lines whose bytes at each rank's peak differ most between ranks
    (``per_rank``: each rank's ``{(file, line, backward): [bytes, count, function]}``;
    a line a rank does not have counts 0 there)."""
    names: Dict[Any, str] = {}
    for lines in per_rank:
        for key, v in lines.items():
            names.setdefault(key, v[2] if len(v) > 2 else "")
    out = []
    for key in names:
        values = [lines[key][0] if key in lines else 0 for lines in per_rank]
        spread = max(values) - min(values)
        if spread > 0:
            out.append({"file": key[0], "line": key[1], "function": names[key], "backward": key[2],
                        "spread": spread, "bytes": {str(r): v for r, v in zip(ranks, values)}})
    out.sort(key=lambda x: (-x["spread"], -max(x["bytes"].values()), x["file"], x["line"],
                            x["backward"] or ""))
    return out[:top]


def steps_side_by_side(steps: Sequence[Sequence[Any]], ranks: List[int]) -> List[Dict[str, Any]]:
    """Per step index: each rank's peak and live bytes at its end, and the
    step's max over median peak (``steps``: each rank's StepRows)."""
    table: Dict[int, Dict[str, Dict[str, Optional[int]]]] = {}
    for rank, rows in zip(ranks, steps):
        for index, _ts, _dur, peak, current in rows:
            table.setdefault(index, {})[str(rank)] = {"peak": peak, "current": current}
    out = []
    for index in sorted(table):
        by_rank = table[index]
        peaks = [v["peak"] for v in by_rank.values() if isinstance(v["peak"], int)]
        median = statistics.median(peaks) if peaks else 0
        out.append({"step": index, "ranks": by_rank,
                    "imbalance": max(peaks) / median if peaks and median else None})
    return out


def growing_ranks(rows: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Ranks whose live bytes at each step's end grow while the others' do
    not: a trend per step (after the warm-up) of at least
    :data:`GROWTH_OVER_MEDIAN` times the median rank's, adding up to
    :data:`GROWTH_FLOOR` or more over the rank's steps."""
    trends = {r["rank"]: r.get("trend_per_step") for r in rows}
    known = [t for t in trends.values() if isinstance(t, int)]
    median = statistics.median(known) if known else None
    out = []
    if median is not None:
        for r in rows:
            t = trends[r["rank"]]
            if not isinstance(t, int) or t <= 0:
                continue
            grown = t * max(r["steps"] - 1, 0)
            if grown >= GROWTH_FLOOR and t >= GROWTH_OVER_MEDIAN * max(median, 0) and t > median:
                out.append({"rank": r["rank"], "host": r["host"], "trend_per_step": t, "grown": grown,
                            "steps": r["steps"]})
    out.sort(key=lambda x: (-x["trend_per_step"], x["rank"]))
    every = bool(out) and len(out) == len(known)
    return {"median_trend_per_step": median, "ranks_with_steps": len(known), "ranks": [] if every else out,
            "all_grow": every}


def findings_by_kind(rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Each kind of finding with the ranks that have it: ``common`` when every
    rank does, ``outlier`` when at most :data:`OUTLIER_SHARE` of them do."""
    n = len(rows)
    kinds: Dict[str, List[int]] = {}
    for r in rows:
        for kind in sorted({f["kind"] for f in r["findings"]}):
            kinds.setdefault(kind, []).append(r["rank"])
    out = []
    for kind, ranks in kinds.items():
        out.append({"kind": kind, "count": len(ranks), "ranks": sorted(ranks), "common": len(ranks) == n,
                    "outlier": len(ranks) < n and len(ranks) <= max(1, int(n * OUTLIER_SHARE))})
    out.sort(key=lambda x: (-x["count"], x["kind"]))
    return out


def clocks(summaries: Sequence[Any]) -> Dict[str, Any]:
    """How far each host's clock is from the others', from the step marks.

    Each step mark's time on its host's wall clock is the trace's start
    wall time plus the monotonic time since the start. The ranks of a
    synchronous job end a step at about the same moment (the gradients'
    all-reduce waits for every rank), so the median over the steps of how
    far a rank's step ends lie from the median rank's is its clock's
    offset, plus how late that rank ends its steps. The ranks of one host
    share a clock: their offsets differ only by lateness, and the host's
    offset is their median. ``None`` values where the ranks have no step
    or no start time in common."""
    ends: Dict[int, Dict[int, float]] = {}
    for s in summaries:
        if s.start_wall_time is None or s.start_monotonic_ns is None or not s.steps:
            continue
        ends[s.rank] = {index: s.start_wall_time + (ts - s.start_monotonic_ns) / 1e9
                        for index, ts, _d, _p, _c in s.steps}
    shared = set.intersection(*(set(v) for v in ends.values())) if len(ends) > 1 else set()
    if not shared:
        why = ("fewer than two ranks recorded steps" if len(ends) < 2
               else "the ranks have no step index in common")
        return {"steps_used": 0, "why_none": why, "hosts": [], "ranks": {}, "max_offset_s": None}
    used = sorted(shared)
    if len(used) > 1000:  # enough to read a median from; evenly spread
        used = used[:: -(-len(used) // 1000)]
    offsets: Dict[int, List[float]] = {r: [] for r in ends}
    for index in used:
        mid = statistics.median(ends[r][index] for r in ends)
        for r in ends:
            offsets[r].append(ends[r][index] - mid)
    rank_offset = {r: statistics.median(v) for r, v in offsets.items()}
    hosts: Dict[str, List[int]] = {}
    host_of = {s.rank: s.host or "?" for s in summaries}
    for r in rank_offset:
        hosts.setdefault(host_of[r], []).append(r)
    host_rows = []
    for host, ranks in hosts.items():
        vals = [rank_offset[r] for r in ranks]
        host_rows.append({"host": host, "ranks": sorted(ranks), "offset_s": statistics.median(vals),
                          "late_spread_s": max(vals) - min(vals)})
    host_rows.sort(key=lambda h: (-abs(h["offset_s"]), h["host"]))
    return {"steps_used": len(used), "why_none": None, "hosts": host_rows,
            "ranks": {str(r): v for r, v in sorted(rank_offset.items())},
            "max_offset_s": max(abs(h["offset_s"]) for h in host_rows)}


# ---- which ranks the tables show, and the text of the answers ----------------------

#: with more ranks than this, the tables with a column per rank show a few
#: (the highest peaks, the median and the lowest); the JSON has every rank
COLUMNS_SHOWN = 12


def shown_ranks(rows: List[Dict[str, Any]], limit: int = COLUMNS_SHOWN) -> List[int]:
    """The ranks given a column: every rank when there are at most ``limit``,
    else the 3 highest peaks, the median rank and the 2 lowest (rank order:
    six columns, one table's width of text)."""
    if len(rows) <= limit:
        return [r["rank"] for r in rows]
    by_peak = sorted(rows, key=lambda r: (-r["peak"], r["rank"]))
    lowest = sorted(rows, key=lambda r: (r["peak"], r["rank"]))[:2]
    picked = by_peak[:3] + [by_peak[len(by_peak) // 2]] + lowest
    return sorted({r["rank"] for r in picked})


def _mib(v: Any) -> str:
    from memviz._units import format_size
    return format_size(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else "-"


def questions_text(doc: Dict[str, Any], wrap: Any, top: int) -> List[str]:
    """The text of the answers above (``wrap(text, indent=, first=)`` as
    memviz/report/ranks.py wraps its lines)."""
    lines: List[str] = []
    tops = doc.get("top_peaks") or []
    if tops:
        lines += ["", f"Highest peaks (of {len(doc['ranks']):,} ranks):"]
        for t in tops[:top]:
            when = (f"{t['peak_at_s']:.2f} s after its start" if isinstance(t["peak_at_s"], float) else "at -")
            step = f", in step {t['peak_step']}" if t.get("peak_step") is not None else ""
            lines.append(f"  rank {t['rank']:<7}{(t['host'] or '-')[:15]:<16}{_mib(t['peak']):>10}  {when}{step}")
    imb = doc["imbalance"]
    if imb.get("ratio") is not None and imb.get("cv") is not None:
        lines += wrap(f"Spread of the peaks: mean {_mib(imb['mean_peak'])}, standard deviation "
                      f"{_mib(imb['stdev_peak'])} ({imb['cv']:.0%} of the mean), highest less lowest "
                      f"{_mib(imb['spread'])}.", indent="  ", first="  ")
    g = doc.get("growing_ranks") or {}
    if g.get("ranks"):
        lines += [""] + wrap(f"Ranks whose memory grows while the others' does not ({len(g['ranks'])}; the "
                             f"median rank's trend is {_mib(g['median_trend_per_step'])} per step):",
                             indent="  ", first="")
        for x in g["ranks"][:top]:
            lines.append(f"  rank {x['rank']:<7}{_mib(x['trend_per_step']):>10} per step, "
                         f"{_mib(x['grown'])} over {x['steps']:,} steps")
    elif g.get("all_grow"):
        lines += ["", "Every rank's memory grows from step to step (see the growth findings)."]
    kinds = doc.get("findings_by_kind") or []
    if kinds:
        lines += ["", "Findings by kind (memviz.diagnose), ranks that have each:"]
        for k in kinds:
            tag = "every rank" if k["common"] else ("outliers" if k["outlier"] else "some ranks")
            listed = _ranges(k["ranks"])
            lines += wrap(f"{k['kind']:<16}{k['count']:>6,}  {tag}" + ("" if k["common"] else f": {listed}"),
                          indent="                        ", first="  ")
    c = doc.get("clocks") or {}
    if c.get("hosts") and len(c["hosts"]) > 1:
        lines += [""] + wrap(f"Clocks between hosts (from {c['steps_used']:,} step marks; a host's offset is how far "
                             "its ranks' step ends lie from the median rank's):", indent="  ", first="")
        for h in c["hosts"][:top]:
            lines.append(f"  {h['host'][:30]:<32}{h['offset_s']:+10.3f} s  ({len(h['ranks'])} ranks; late spread "
                         f"{h['late_spread_s']:.3f} s)")
    return lines


def _ranges(ns: Sequence[int]) -> str:
    out: List[List[int]] = []
    for n in sorted(ns):
        if out and n == out[-1][1] + 1:
            out[-1][1] = n
        else:
            out.append([n, n])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in out)
