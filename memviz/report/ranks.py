"""The merged report of a distributed run: one trace per rank, side by side.

``memviz report run.rank*.memviz`` reads every rank's trace (each written by
``memviz run -o`` or ``track(trace=...)`` under a launcher, see
memviz/capture/ranks.py) and :func:`rank_report` puts them together:

* a table of the ranks: host, device, peak (the largest device peak, as
  ``peak_bytes()`` gives it), when the peak was reached (seconds after the
  rank started tracking), live bytes at the end, and the bytes by category
  at the peak and at the end (as the recording tracker named them: PyTorch
  runs only);
* the imbalance: the highest rank peak over the median rank peak, and the
  lines whose bytes at each rank's peak differ most between the ranks;
* the steps side by side (each rank's peak and live bytes at the end of
  every step index);
* the findings of ``diagnose()`` per rank, and those that hold on every
  rank (the same kind on each; the lines they all name).

:func:`check_ranks` decides whether the files are the ranks of one run.
They are not, and the report is refused (:class:`memviz.InvalidArgument`),
when a file records no rank, two files claim one rank, or the files record
different world sizes or launcher run ids: the figures would mix runs and
the imbalance would compare unrelated processes. Ranks missing from the
world size, different commands (some launchers pass ``--local-rank=N``) and
files cut short are noted in the report instead: they are what one run
that went wrong leaves, which is when the merged view is most wanted.

:func:`rank_text` is the text; memviz/report/ranks_html.py the HTML page;
the JSON document is :func:`rank_report`'s (its layout is in
memviz/cli/report_ranks.py). Imports the analysis floor and below and
memviz/report/summary.py (docs/architecture.md).
"""

from __future__ import annotations

import re
import statistics
import textwrap
from typing import Any, Dict, List, Optional, Sequence, Tuple

from memviz._errors import InvalidArgument
from memviz._units import format_size
from memviz.model.pytorch import END_KEY
from memviz.report.summary import (device_items, device_name, finding_records, short_path,
                                   step_records)

__all__ = ["check_ranks", "rank_report", "rank_text", "REPORT_VERSION"]

REPORT_VERSION = 1
WIDTH = 99  # as memviz/report/text.py: a 100-column terminal
_LABEL = 34  # the first column of the tables with one column per rank
_CELL = 10
_LOCAL_RANK_ARG = re.compile(r"\s--local[-_]rank(=|\s+)\d+")


def _name(trace: Any) -> str:
    return str(getattr(trace, "path", None) or "<trace>")


def _wrap(text: str, indent: str = "  ", first: Optional[str] = None) -> List[str]:
    return textwrap.wrap(text, WIDTH, initial_indent=indent if first is None else first,
                         subsequent_indent=indent, break_on_hyphens=False) or [indent.rstrip()]


def check_ranks(traces: Sequence[Any]) -> Tuple[List[Any], List[str]]:
    """The traces in rank order and the notes about them; raises
    :class:`memviz.InvalidArgument` when they are not the ranks of one run
    (see the module docstring for which and why)."""
    if len(traces) < 2:
        raise InvalidArgument("a merged report needs the traces of two ranks or more; "
                              f"{len(traces)} given. What to do: give every rank's file, e.g. "
                              "`memviz report run.rank*.memviz`, or one file for its own report.")
    unranked = [t for t in traces if getattr(t, "rank", None) is None]
    if unranked:
        raise InvalidArgument(
            f"{_name(unranked[0])} records no rank: it was not recorded under a launcher "
            "(torchrun sets RANK and WORLD_SIZE), or by a memviz that did not record ranks, so it cannot "
            "be merged with other ranks. What to do: report it alone (`memviz report FILE`), compare two "
            "runs with `memviz diff A B`, or record the run under torchrun "
            "(`torchrun ... -m memviz run -o run.memviz train.py`).")
    by_rank: Dict[int, Any] = {}
    for t in traces:
        if t.rank in by_rank:
            raise InvalidArgument(
                f"{_name(by_rank[t.rank])} and {_name(t)} are both rank {t.rank}: they come "
                "from two runs (or one file was given twice), and one run has one file per rank. What to "
                "do: give the files of one run, e.g. `memviz report run.rank*.memviz` in that run's folder.")
        by_rank[t.rank] = t
    ordered = [by_rank[r] for r in sorted(by_rank)]
    for field, what in (("world_size", "world sizes"), ("run_id", "launcher run ids")):
        values = {getattr(t, field, None) for t in ordered} - {None}
        if len(values) > 1:
            listed = "; ".join(f"rank {t.rank}: {getattr(t, field, None)}" for t in ordered)
            raise InvalidArgument(
                f"the files record different {what} ({listed}), so they are not the ranks "
                "of one run. What to do: give the files of one run (its ranks were written together, "
                "each named run.rankN.memviz after the -o path).")
    notes: List[str] = []
    world = next((t.world_size for t in ordered if t.world_size is not None), None)
    if world is not None:
        missing = [r for r in range(world) if r not in by_rank]
        beyond = [r for r in by_rank if r >= world]
        if missing:
            notes.append(f"{len(missing)} of the {world} ranks have no file here "
                         f"(rank{'s' if len(missing) > 1 else ''} {_ranges(missing)}): the figures are those "
                         "of the ranks given.")
        if beyond:
            notes.append(f"rank{'s' if len(beyond) > 1 else ''} {_ranges(beyond)} "
                         f"{'are' if len(beyond) > 1 else 'is'} not below the world size {world}.")
    commands = {_LOCAL_RANK_ARG.sub("", t.command or "") for t in ordered}
    if len(commands) > 1:
        notes.append("the ranks ran different commands: " + "; ".join(
            f"rank {t.rank}: {t.command}" for t in ordered) + ".")
    for t in ordered:
        if getattr(t, "truncated", False):
            notes.append(f"rank {t.rank}'s trace is incomplete ({t.error}): its figures go up to where "
                         "it ends.")
    return ordered, notes


def _ranges(ns: Sequence[int]) -> str:
    out: List[List[int]] = []
    for n in sorted(ns):
        if out and n == out[-1][1] + 1:
            out[-1][1] = n
        else:
            out.append([n, n])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in out)


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


def _rank_row(trace: Any) -> Dict[str, Any]:
    totals = trace.totals()
    gpus = {d: t for d, t in totals.items() if d >= 0}
    main = max(gpus, key=lambda d: (gpus[d].get("peak", 0), -d)) if gpus else None
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
        "current": trace.current_bytes(), "failed": sum(t.get("failed", 0) for t in gpus.values()),
        "per_device": per_device,
        "categories_at_peak": _recorded(trace, main, "categories") if main is not None else None,
        "categories_at_end": _recorded(trace, main, "categories_at_end") if main is not None else None,
        "steps": len(step_records(trace)), "findings": found, "findings_error": why,
    }


def _imbalance(rows: List[Dict[str, Any]]) -> Dict[str, Any]:
    peaks = [r["peak"] for r in rows]
    high = max(rows, key=lambda r: r["peak"])
    low = min(rows, key=lambda r: r["peak"])
    median = statistics.median(peaks)
    return {"max_rank": high["rank"], "max_peak": high["peak"], "min_rank": low["rank"],
            "min_peak": low["peak"], "median_peak": median,
            "ratio": high["peak"] / median if median else None}


def _line_spread(traces: List[Any], rows: List[Dict[str, Any]], top: int) -> List[Dict[str, Any]]:
    """The lines whose bytes at each rank's peak differ most between ranks."""
    per_rank: List[Dict[Tuple[str, int], int]] = []
    names: Dict[Tuple[str, int], str] = {}
    for t, row in zip(traces, rows):
        sizes: Dict[Tuple[str, int], int] = {}
        if row["device"] is not None and row["peak"] > 0:
            for s in t.peak_snapshot(row["device"]).statistics("lineno"):
                key = (getattr(s.key, "filename", str(s.key)), getattr(s.key, "lineno", 0) or 0)
                sizes[key] = sizes.get(key, 0) + s.size
                names.setdefault(key, getattr(s.key, "name", "") or "")
        per_rank.append(sizes)
    out = []
    for key in set().union(*per_rank):
        values = [sizes.get(key, 0) for sizes in per_rank]
        spread = max(values) - min(values)
        if spread > 0:
            out.append({"file": key[0], "line": key[1], "function": names.get(key, ""),
                        "spread": spread,
                        "bytes": {str(r["rank"]): v for r, v in zip(rows, values)}})
    out.sort(key=lambda x: (-x["spread"], -max(x["bytes"].values()), x["file"], x["line"]))
    return out[:top]


def _steps_side_by_side(traces: List[Any], rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    table: Dict[int, Dict[str, Dict[str, Optional[int]]]] = {}
    for t, row in zip(traces, rows):
        for rec in step_records(t):
            dev = rec.devices.get(row["device"]) if row["device"] is not None else None
            table.setdefault(rec.index, {})[str(row["rank"])] = {
                "peak": getattr(dev, "peak", None), "current": getattr(dev, "current", None)}
    out = []
    for index in sorted(table):
        ranks = table[index]
        peaks = [v["peak"] for v in ranks.values() if isinstance(v["peak"], int)]
        median = statistics.median(peaks) if peaks else 0
        out.append({"step": index, "ranks": ranks,
                    "imbalance": max(peaks) / median if peaks and median else None})
    return out


def _common_findings(rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The kinds of finding every rank has, with the lines all of them name."""
    kinds = [{f["kind"] for f in r["findings"]} for r in rows]
    common = set.intersection(*kinds) if kinds else set()
    out = []
    for kind in sorted(common):
        mine = [[f for f in r["findings"] if f["kind"] == kind] for r in rows]
        places = [{ln["location"] for f in fs for ln in f["lines"] if ln["location"]} for fs in mine]
        first = mine[0][0]
        out.append({"kind": kind, "ranks": [r["rank"] for r in rows], "message": first["message"],
                    "message_rank": rows[0]["rank"], "lines": sorted(set.intersection(*places)),
                    "fix": first["fix"]})
    return out


def rank_report(traces: Sequence[Any], top: int = 10) -> Dict[str, Any]:
    """The merged report of the traces of one run's ranks (LoadedTraces with
    ``rank``; see :func:`check_ranks`) as a JSON-ready dict."""
    ordered, notes = check_ranks(traces)
    rows = [_rank_row(t) for t in ordered]
    commands = [r["command"] for r in rows if r["command"]]
    return {
        "memviz_rank_report": REPORT_VERSION,
        "traces": [r["trace"] for r in rows],
        "command": commands[0] if commands else None,
        "world_size": next((r["world_size"] for r in rows if r["world_size"] is not None), None),
        "notes": notes,
        "ranks": rows,
        "imbalance": _imbalance(rows),
        "lines": _line_spread(ordered, rows, top),
        "steps": _steps_side_by_side(ordered, rows),
        "common_findings": _common_findings(rows),
    }


# ---- text ---------------------------------------------------------------------------


def _size(v: Any) -> str:
    return format_size(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else "-"


def _at(v: Optional[float]) -> str:
    return f"{v:.2f} s" if isinstance(v, float) else "-"


def _rank_chunks(ranks: List[int]) -> List[List[int]]:
    per = max(1, (WIDTH - _LABEL) // _CELL)
    return [ranks[i:i + per] for i in range(0, len(ranks), per)] or [[]]


def _per_rank_table(title: str, label: str, rows: List[Tuple[str, Dict[str, Any]]], ranks: List[int],
                    fmt=_size) -> List[str]:
    """Rows of (label, {rank: value}) with one column per rank (in chunks)."""
    lines = ["", title]
    for chunk in _rank_chunks(ranks):
        lines.append(f"  {label:<{_LABEL - 2}}" + "".join(f"{'rank ' + str(r):>{_CELL}}" for r in chunk))
        for name, values in rows:
            shown = name if len(name) <= _LABEL - 3 else "..." + name[-(_LABEL - 6):]
            lines.append(f"  {shown:<{_LABEL - 2}}" + "".join(f"{fmt(values.get(str(r))):>{_CELL}}"
                                                                for r in chunk))
    return lines


def by_category(rows: List[Dict[str, Any]], key: str) -> List[Tuple[str, Dict[str, Any]]]:
    """(category, {rank: bytes}) of the rank rows' ``key`` ("categories_at_peak"
    or "categories_at_end"), the largest first (the text and HTML tables)."""
    cats: Dict[str, Dict[str, Any]] = {}
    for r in rows:
        for cat, n in (r[key] or {}).items():
            cats.setdefault(cat, {})[str(r["rank"])] = n
    return [(c, cats[c]) for c in sorted(cats, key=lambda c: -max(cats[c].values()))]


def _location(file: str, line: int) -> str:
    return f"{short_path(file)}:{line}" if line > 0 else short_path(file)


def _short_location(location: str) -> str:
    """``file:line`` with the file as the reports show it."""
    head, sep, tail = location.rpartition(":")
    return f"{short_path(head)}:{tail}" if sep and head else location


def rank_text(doc: Dict[str, Any], steps_shown: int = 10) -> str:
    """The text of :func:`rank_report`'s document (lines of at most 99 columns)."""
    rows, ranks = doc["ranks"], [r["rank"] for r in doc["ranks"]]
    head = f"memviz report: {len(rows)} ranks" + (f" of {doc['world_size']}" if doc["world_size"] else "")
    lines = _wrap(head + (f": {doc['command']}" if doc["command"] else ""), first="", indent="    ")
    lines.append("=" * 60)
    for note in doc["notes"]:
        lines += _wrap(f"note: {note}", indent="    ", first="  ")
    lines += ["", "Ranks" + " " * 9 + f"{'host':<16}{'device':<9}{'peak':>10}{'peak at':>10}{'at end':>10}"
              f"{'failed':>8}{'steps':>7}"]
    for r in rows:
        host = (r["host"] or "-")[:15]
        dev = device_name(r["device"]) if r["device"] is not None else "-"
        lines.append(f"  rank {r['rank']:<7}{host:<16}{dev:<9}{_size(r['peak']):>10}{_at(r['peak_at_s']):>10}"
                     f"{_size(r['current']):>10}{r['failed']:>8,}{r['steps']:>7,}")
    lines += _wrap("peak: the rank's largest device peak; peak at: seconds after the rank started "
                   "tracking; at end: live when it stopped.", indent="  ")
    imb = doc["imbalance"]
    if imb["ratio"] is not None:
        lines += [""] + _wrap(
            f"Imbalance: {imb['ratio']:.2f}x (rank {imb['max_rank']}'s peak {_size(imb['max_peak'])} over the "
            f"median peak {_size(imb['median_peak'])}; the lowest is rank {imb['min_rank']}'s "
            f"{_size(imb['min_peak'])}).", first="", indent="  ")
    else:
        lines += ["", "Imbalance: no rank allocated GPU memory."]
    for key, title in (("categories_at_peak", "By category at each rank's peak:"),
                       ("categories_at_end", "By category at the end:")):
        cats = by_category(rows, key)
        if cats:
            lines += _per_rank_table(title, "category", cats, ranks)
    if doc["lines"]:
        lines += _per_rank_table("Lines whose bytes at the peak differ most between ranks:", "line",
                                 [(_location(x["file"], x["line"]), x["bytes"]) for x in doc["lines"]], ranks)
    lines += _steps_text(doc["steps"], ranks, steps_shown)
    lines += _findings_text(doc)
    return "\n".join(lines) + "\n"


def _steps_text(steps: List[Dict[str, Any]], ranks: List[int], shown: int) -> List[str]:
    if not steps:
        return ["", "Steps: no rank recorded steps (t.step() or memviz.watch(optimizer))."]
    picked = steps if len(steps) <= 2 * shown else steps[:shown] + steps[-shown:]
    rows = [(f"step {s['step']}" + (f"  ({s['imbalance']:.2f}x)" if s["imbalance"] else ""),
             {r: v.get("peak") for r, v in s["ranks"].items()}) for s in picked]
    lines = _per_rank_table(f"Steps side by side ({len(steps):,}; each rank's peak inside the step, "
                            "and max over median):", "step", rows, ranks)
    if len(picked) < len(steps):
        lines += _wrap(f"{len(steps) - len(picked):,} steps between step {steps[shown - 1]['step']} and "
                       f"step {steps[-shown]['step']} left out (--format json has all, with the live bytes "
                       "at each step's end).", indent="  ")
    return lines


def _findings_text(doc: Dict[str, Any]) -> List[str]:
    rows, common = doc["ranks"], doc["common_findings"]
    lines = ["", f"Findings on every rank (memviz.diagnose): {len(common) or 'none'}"]
    for f in common:
        lines += _wrap(f"[{f['kind']}] rank {f['message_rank']}: {f['message']}", indent="      ", first="  ")
        if f["lines"]:
            lines += _wrap("on every rank at " + ", ".join(map(_short_location, f["lines"])),
                           indent="        ", first="      ")
        if f["fix"]:
            lines += _wrap(f"fix: {f['fix']}", indent="        ", first="      ")
    kinds = {f["kind"] for f in common}
    lines += ["", "Findings on some ranks only:"]
    any_left = False
    for r in rows:
        if r["findings_error"]:
            lines += _wrap(f"rank {r['rank']}: none shown, {r['findings_error']}.", indent="    ", first="  ")
            any_left = True
        for f in r["findings"]:
            if f["kind"] in kinds:
                continue
            any_left = True
            lines += _wrap(f"rank {r['rank']} [{f['kind']}] {f['message']}", indent="      ", first="  ")
            for ln in f["lines"][:3]:
                lines += _wrap(ln["text"], indent="        ", first="      ")
    if not any_left:
        lines.append("  none")
    return lines
