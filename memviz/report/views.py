"""memray's other views of a recording, as plain text: ``memviz report
--format table|stats|summary``.

Each reads the reading API a Tracker and a loaded trace share (``totals()``,
``peak_snapshot(device)`` and its ``statistics()``), one section per device
(``cuda:N``, then ``pinned host``) at that device's peak, as memray's
reporters read the high-water mark:

* :func:`table_report` (memray's ``table``): the allocations live at the
  peak grouped by line, one row a line: size, share of what was live then,
  allocation count, and the line (``file:line in function``).
* :func:`stats_report` (memray's ``stats``): the whole run's counts
  (allocations made and their bytes, frees, failed allocations, the peak and
  what was live at the end), then at the peak: the live allocations, a
  histogram of their sizes on a log scale, their bytes by kind (memviz's
  allocation kinds stand for memray's allocators) and by PyTorch category
  where known, and the top lines by size and by count.
* :func:`summary_report` (memray's ``summary``): one row a line of code:
  ``total``, the bytes live at the peak that were allocated under it (by it,
  or by anything it called: every allocation whose stack passes through it),
  and ``own``, those shown under it in the other reports (it is their user
  line), each with its share, and the allocations under it. Rows are the
  lines that own bytes and the user's lines that called them, sorted by
  total (``statistics("lineno", cumulative=True)`` and ``statistics("lineno")``).

``top`` rows per list (``--top``); what is left is summed up. Names from the
trace (files, functions, threads) are shown with control characters
escaped, as in the text report.
"""

from __future__ import annotations

import math
import textwrap
from typing import Any, Dict, List, Sequence, Tuple

from memviz._args import given
from memviz._errors import InvalidArgument
from memviz._units import escape_controls, format_size
from memviz.model.lines import location
from memviz.model.traceback import innermost_first
from memviz.report.summary import device_name, short_path
from memviz.report.text import WIDTH

__all__ = ["table_report", "stats_report", "summary_report", "VIEWS"]

#: the views, as ``memviz report --format`` names them
VIEWS = ("table", "stats", "summary")

_BINS = 10  # memray's histogram: ten bins on a log scale
_BAR = 25


def _check_top(top: Any) -> None:
    if isinstance(top, bool) or not isinstance(top, int) or top < 1:
        raise InvalidArgument(f"top must be a positive int, got {given(top)}")


def _devices(recording: Any) -> Tuple[Dict[int, Dict[str, int]], List[int]]:
    totals = recording.totals()
    return totals, sorted((d for d in totals if totals[d].get("peak", 0) > 0), key=lambda d: (d < 0, d))


def _line(frame: Any) -> str:
    """``file:line in function`` (the reports' short paths)."""
    text = location(frame, short_path)
    name = getattr(frame, "name", "") or ""
    return f"{text} in {name}" if name and getattr(frame, "lineno", 0) else text


def _allocs(n: int, word: str = "allocation") -> str:
    return f"{n:,} {word}" + ("" if n == 1 else "s")


def _share(part: int, whole: int) -> str:
    return f"{100.0 * part / whole:.1f}%" if whole > 0 else "-"


def _wrap(text: str, indent: str = "") -> List[str]:
    return textwrap.wrap(text, WIDTH, subsequent_indent=indent, break_on_hyphens=False,
                         break_long_words=False) or [""]


def _head(view: str, recording: Any, what: str) -> List[str]:
    command = getattr(recording, "command", None)
    lines = _wrap(f"memviz {view}" + (f": {command}" if command else ""), "    ")
    lines += ["=" * 60] + _wrap(what)
    if getattr(recording, "truncated", False):
        lines = _wrap(f"(incomplete trace: {getattr(recording, 'error', None)})") + lines
    return lines


def _done(lines: List[str]) -> str:
    return escape_controls("\n".join(lines) + "\n")


def _none(lines: List[str], devices: List[int]) -> None:
    if not devices:
        lines += ["", "No GPU allocation was recorded."]


# ---- table --------------------------------------------------------------------------------


def table_report(recording: Any, top: int = 10) -> str:
    """The allocations live at each device's peak, by line: size, share,
    count and line, ``top`` rows a device (memray's table view)."""
    _check_top(top)
    totals, devices = _devices(recording)
    lines = _head("table", recording, "Allocations live at each device's peak, by line, largest first.")
    for dev in devices:
        snap = recording.peak_snapshot(dev)
        stats = snap.statistics("lineno")
        live = sum(s.size for s in stats)
        lines += ["", f"{device_name(dev)} at its peak, {format_size(totals[dev]['peak'])} "
                      f"({_allocs(sum(s.count for s in stats))} live):"]
        if not stats:
            lines.append("  (no allocation was live at the peak)")
            continue
        lines.append(f"  {'size':>10}  {'share':>6}  {'allocations':>11}  line")
        for s in stats[:top]:
            lines.append(f"  {format_size(s.size):>10}  {_share(s.size, live):>6}  {s.count:>11,}  "
                         f"{_line(s.key)}")
        rest = stats[top:]
        if rest:
            size = sum(s.size for s in rest)
            lines.append(f"  {format_size(size):>10}  {_share(size, live):>6}  "
                         f"{sum(s.count for s in rest):>11,}  ({len(rest):,} more lines)")
    _none(lines, devices)
    return _done(lines)


# ---- stats --------------------------------------------------------------------------------


def _histogram(sizes: Sequence[int]) -> List[str]:
    """memray's histogram of allocation sizes: ``_BINS`` bins between the
    smallest and the largest on a log scale, each ``< upper bound`` but the
    last, ``<=`` the largest."""
    lo, hi = min(sizes), max(sizes)
    lines = [f"min: {format_size(lo)}"]
    if lo == hi:
        edges = [hi]
    else:
        base = max(lo, 1)
        ratio = hi / base
        edges = sorted({math.ceil(base * ratio ** (k / _BINS)) for k in range(1, _BINS + 1)} | {hi})
        edges = [e for e in edges if e <= hi]
    counts = [0] * len(edges)
    for n in sizes:
        for i, edge in enumerate(edges):
            if n < edge or i == len(edges) - 1:
                counts[i] += 1
                break
    labels = [("<=" if i == len(edges) - 1 else "< ") + format_size(e) for i, e in enumerate(edges)]
    width = max(len(x) for x in labels)
    cwidth = len(f"{max(counts):,}")
    rule = "-" * (width + cwidth + _BAR + 5)
    lines.append(rule)
    most = max(counts)
    for label, count in zip(labels, counts):
        bar = "#" * (max(1, round(_BAR * count / most)) if count else 0)
        lines.append(f"{label:<{width}} : {count:>{cwidth},} {bar}".rstrip())
    lines += [rule, f"max: {format_size(hi)}"]
    return lines


def stats_report(recording: Any, top: int = 10) -> str:
    """Totals and allocation counts of the run, then at each device's peak a
    histogram of the live allocations' sizes, their bytes by kind and
    category, and the top ``top`` lines by size and by count (memray's stats)."""
    _check_top(top)
    totals, devices = _devices(recording)
    lines = _head("stats", recording, "The whole run's counts, then what was live at each device's peak.")
    for dev in devices:
        t = totals[dev]
        name = device_name(dev)
        made = _allocs(t.get("allocs", 0)) + " made"
        if t.get("alloc_bytes"):
            made += f" ({format_size(t['alloc_bytes'])} in all)"
        lines += ["", f"{name}:",
                  f"  Whole run: {made}, {t.get('frees', 0):,} freed, {t.get('failed', 0):,} failed.",
                  f"  Peak: {format_size(t['peak'])}; live at the end: {format_size(t.get('current', 0))}"
                  + (f" ({_allocs(t['live_count'])})" if t.get("live_count") is not None else "") + "."]
        snap = recording.peak_snapshot(dev)
        sizes = [a.size for a in snap]
        if not sizes:
            lines.append("  At the peak: no allocation was live.")
            continue
        lines += ["", f"  At the peak: {_allocs(len(sizes))} live, {format_size(sum(sizes))}.",
                  "  Histogram of allocation size:"]
        lines += ["    " + x for x in _histogram(sizes)]
        lines += ["", "  By kind:"]
        lines += [f"    {format_size(s.size):>10}  {s.count:>9,}  {s.key}" for s in snap.statistics("kind")]
        cats = [s for s in snap.statistics("category") if s.key != "<unknown>"]
        if cats:
            lines += ["", "  By category (PyTorch):"]
            lines += [f"    {format_size(s.size):>10}  {s.count:>9,}  {s.key}" for s in cats]
        by_line = snap.statistics("lineno")
        lines += ["", f"  Top {_allocs(min(top, len(by_line)), 'line')} by size:"]
        lines += [f"    - {_line(s.key)} -> {format_size(s.size)}" for s in by_line[:top]]
        by_count = sorted(by_line, key=lambda s: (-s.count, -s.size))
        lines += ["", f"  Top {_allocs(min(top, len(by_count)), 'line')} by number of allocations:"]
        lines += [f"    - {_line(s.key)} -> {s.count:,}" for s in by_count[:top]]
    _none(lines, devices)
    return _done(lines)


# ---- summary ------------------------------------------------------------------------------


def _frame_filter(snap: Any) -> Any:
    """The snapshot's frame filter (a trace's own settings), else memviz.frames."""
    flt = getattr(snap, "frame_filter", None)
    if flt is None:
        from memviz.model.frame_filter import frames as flt
    return flt


def _launcher_lines(snap: Any) -> set:
    """(file, line) of the frames above the script in the snapshot's stacks:
    runpy's, ``memviz run``'s, a script's that ran it with runpy.run_path
    (as the HTML report's icicle leaves them out)."""
    from memviz.report._data import _script_starts

    out, seen = set(), set()
    for a in snap.allocations:
        tb = a.traceback
        if not tb or id(tb) in seen:
            continue
        seen.add(id(tb))
        frames = list(reversed(innermost_first(tb)))  # root first
        out.update((f.filename, f.lineno) for f in frames[:_script_starts(frames)])
    return out


def _summary_rows(snap: Any) -> List[Tuple[Any, int, int, int]]:
    """(line, total bytes, own bytes, allocations under it) of a snapshot."""
    own = {s.key: s for s in snap.statistics("lineno")}
    total = {s.key: s for s in snap.statistics("lineno", cumulative=True)}
    flt = _frame_filter(snap)
    launchers = _launcher_lines(snap)
    rows = []
    for key, s in total.items():
        mine = own.get(key)
        filename = getattr(key, "filename", "")
        if mine is None and not (isinstance(filename, str) and flt.is_user(filename)):
            continue  # a library's frame that owns nothing: not the user's line
        if mine is None and (filename, getattr(key, "lineno", None)) in launchers:
            continue  # what ran the script (runpy, memviz run): every byte is under it
        rows.append((key, s.size, mine.size if mine else 0, s.count))
    for key, s in own.items():
        if key not in total:  # every own line is in its own stack; kept whole if not
            rows.append((key, s.size, s.size, s.count))
    rows.sort(key=lambda r: (-r[1], -r[2], -r[3], str(r[0])))
    return rows


def summary_report(recording: Any, top: int = 10) -> str:
    """At each device's peak, the lines sorted by the bytes allocated under
    them (their own and their callees'), with their own bytes and shares,
    ``top`` rows a device (memray's summary)."""
    _check_top(top)
    totals, devices = _devices(recording)
    lines = _head("summary", recording, "At each device's peak, by line: total, the bytes allocated by "
                                        "the line or what it called; own, those it is the user line of.")
    for dev in devices:
        snap = recording.peak_snapshot(dev)
        live = snap.total_bytes()
        rows = _summary_rows(snap)
        lines += ["", f"{device_name(dev)} at its peak, {format_size(totals[dev]['peak'])}:"]
        if not rows:
            lines.append("  (no allocation was live at the peak)")
            continue
        lines.append(f"  {'total':>10}  {'total%':>6}  {'own':>10}  {'own%':>6}  {'allocations':>11}  line")
        for key, size, mine, count in rows[:top]:
            lines.append(f"  {format_size(size):>10}  {_share(size, live):>6}  {format_size(mine):>10}  "
                         f"{_share(mine, live):>6}  {count:>11,}  {_line(key)}")
        rest = rows[top:]
        if rest:
            left = sum(r[2] for r in rest)
            lines.append(f"  ... {len(rest):,} more lines, owning {format_size(left)} "
                         f"({_share(left, live)})")
    _none(lines, devices)
    return _done(lines)
