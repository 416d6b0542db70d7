"""The merged report of a distributed run: one trace per rank, side by side.

``memviz report run.rank*.memviz`` reads every rank's trace (each written by
``memviz run -o`` or ``track(trace=...)`` under a launcher, see
memviz/capture/rank_files.py) and :func:`rank_report` puts them together:

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
import textwrap
from typing import Any, Dict, List, Optional, Sequence, Tuple

from memviz._errors import InvalidArgument
from memviz._units import escape_controls, format_size
from memviz.model.lines import BackwardFrame, location
from memviz.model.traceback import Frame
from memviz.report import ranks_questions as Q
from memviz.report.ranks_summary import summarise
from memviz.report.summary import device_name, short_path

__all__ = ["check_ranks", "merge", "rank_report", "rank_text", "REPORT_VERSION"]

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


_ranges = Q._ranges  # "0-3, 7": one owner, ranks_questions.py


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
    return merge([summarise(t) for t in traces], top)


def merge(summaries: Sequence[Any], top: int = 10, skipped: Sequence[Dict[str, str]] = (),
          computed: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """The merged report of the ranks' :class:`~memviz.report.ranks_summary.RankSummary`
    (memviz/cli/report_ranks.py makes them in parallel). ``skipped``: the
    files left out, ``{"trace", "reason"}`` each. ``computed``: sections
    already worked out elsewhere (the SQL over the ranks' Parquet,
    memviz/export/ranks_sql.py), used instead of working them out here."""
    ordered, notes = check_ranks(summaries)
    if skipped:
        notes = [f"{len(skipped):,} file{'s' if len(skipped) > 1 else ''} could not be read and "
                 f"{'were' if len(skipped) > 1 else 'was'} left out: "
                 + "; ".join(f"{x['trace']} ({x['reason']})" for x in skipped[:20])
                 + (f"; and {len(skipped) - 20:,} more (the JSON lists all)" if len(skipped) > 20 else "")
                 + "."] + notes
    rows = [s.row for s in ordered]
    ranks = [r["rank"] for r in rows]
    commands = [r["command"] for r in rows if r["command"]]
    done = computed or {}
    doc = {
        "memviz_rank_report": REPORT_VERSION,
        "traces": [r["trace"] for r in rows],
        "command": commands[0] if commands else None,
        "world_size": next((r["world_size"] for r in rows if r["world_size"] is not None), None),
        "notes": notes,
        "skipped": list(skipped),
        "ranks": rows,
        "top_peaks": done.get("top_peaks") or Q.top_peaks(rows, top),
        "imbalance": done.get("imbalance") or Q.imbalance(rows),
        "lines": done["lines"] if "lines" in done else Q.line_spread([s.lines for s in ordered], ranks, top),
        "steps": done["steps"] if "steps" in done else Q.steps_side_by_side([s.steps for s in ordered], ranks),
        "growing_ranks": done.get("growing_ranks") or Q.growing_ranks(rows),
        "findings_by_kind": done["findings_by_kind"] if "findings_by_kind" in done else Q.findings_by_kind(rows),
        "common_findings": _common_findings(rows),
        "clocks": Q.clocks(ordered),
        "engine": done.get("engine", "python"),
    }
    return doc


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
            cells = "".join(f"{fmt(values.get(str(r))):>{_CELL}}" for r in chunk)
            if len(name) <= _LABEL - 3:
                lines.append(f"  {name:<{_LABEL - 2}}" + cells)
            else:  # on a line of its own (a backward line's node is at its end): the whole name
                lines += _wrap(name, indent="      ", first="  ") + [f"  {'':<{_LABEL - 2}}" + cells]
    return lines


def by_category(rows: List[Dict[str, Any]], key: str) -> List[Tuple[str, Dict[str, Any]]]:
    """(category, {rank: bytes}) of the rank rows' ``key`` ("categories_at_peak"
    or "categories_at_end"), the largest first (the text and HTML tables)."""
    cats: Dict[str, Dict[str, Any]] = {}
    for r in rows:
        for cat, n in (r[key] or {}).items():
            cats.setdefault(cat, {})[str(r["rank"])] = n
    return [(c, cats[c]) for c in sorted(cats, key=lambda c: -max(cats[c].values()))]


def _location(file: str, line: int, backward: Optional[str] = None) -> str:
    """A line of the document as the reports write it (memviz/model/lines.py)."""
    return location(BackwardFrame(file, line, "", backward) if backward else Frame(file, line), short_path)


def _short_location(location: str) -> str:
    """``file:line`` with the file as the reports show it."""
    head, sep, tail = location.rpartition(":")
    return f"{short_path(head)}:{tail}" if sep and head else location


def rank_text(doc: Dict[str, Any], steps_shown: int = 10) -> str:
    """The text of :func:`rank_report`'s document (lines of at most 99 columns)."""
    rows = doc["ranks"]
    ranks = Q.shown_ranks(rows)
    head = f"memviz report: {len(rows)} ranks" + (f" of {doc['world_size']}" if doc["world_size"] else "")
    lines = _wrap(head + (f": {doc['command']}" if doc["command"] else ""), first="", indent="    ")
    lines.append("=" * 60)
    for note in doc["notes"]:
        lines += _wrap(f"note: {note}", indent="    ", first="  ")
    lines += ["", "Ranks" + " " * 9 + f"{'host':<16}{'device':<9}{'peak':>10}{'peak at':>10}{'at end':>10}"
              f"{'failed':>8}{'steps':>7}"]
    listed = rows if len(rows) <= 3 * Q.COLUMNS_SHOWN else [r for r in rows if r["rank"] in set(
        t["rank"] for t in doc.get("top_peaks") or ()) | set(ranks)]
    for r in listed:
        host = (r["host"] or "-")[:15]
        dev = device_name(r["device"]) if r["device"] is not None else "-"
        lines.append(f"  rank {r['rank']:<7}{host:<16}{dev:<9}{_size(r['peak']):>10}{_at(r['peak_at_s']):>10}"
                     f"{_size(r['current']):>10}{r['failed']:>8,}{r['steps']:>7,}")
    if len(listed) < len(rows):
        lines.append(f"  ... {len(rows) - len(listed):,} more ranks (the highest peaks and a few others shown; "
                     "--format json has all)")
    lines += _wrap("peak: the rank's largest device peak; peak at: seconds after the rank started "
                   "tracking; at end: live when it stopped.", indent="  ")
    if len(ranks) < len(rows):
        lines += _wrap(f"The tables below have a column for {len(ranks)} of the {len(rows):,} ranks: the 3 highest "
                       "peaks, the median rank and the 2 lowest (--format json has every rank).", indent="  ")
    imb = doc["imbalance"]
    if imb["ratio"] is not None:
        lines += [""] + _wrap(
            f"Imbalance: {imb['ratio']:.2f}x (rank {imb['max_rank']}'s peak {_size(imb['max_peak'])} over the "
            f"median peak {_size(imb['median_peak'])}; the lowest is rank {imb['min_rank']}'s "
            f"{_size(imb['min_peak'])}).", first="", indent="  ")
    else:
        lines += ["", "Imbalance: no rank allocated GPU memory."]
    lines += Q.questions_text(doc, _wrap, steps_shown)
    for key, title in (("categories_at_peak", "By category at each rank's peak:"),
                       ("categories_at_end", "By category at the end:")):
        cats = by_category(rows, key)
        if cats:
            lines += _per_rank_table(title, "category", cats, ranks)
    if doc["lines"]:
        lines += _per_rank_table("Lines whose bytes at the peak differ most between ranks:", "line",
                                 [(_location(x["file"], x["line"], x.get("backward")), x["bytes"])
                                  for x in doc["lines"]], ranks)
    lines += _steps_text(doc["steps"], ranks, steps_shown)
    lines += _findings_text(doc)
    return escape_controls("\n".join(lines) + "\n")  # names from the traces: shown escaped


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
    limit, told = (len(rows) if len(rows) <= 3 * Q.COLUMNS_SHOWN else 20), 0
    for r in rows:
        if told >= limit:
            lines.append(f"  ... and the findings of more ranks (see 'Findings by kind'; --format json has all)")
            break
        told += bool(r["findings_error"] or any(f["kind"] not in kinds for f in r["findings"]))
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
