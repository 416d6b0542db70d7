"""The text of ``memviz diff``: :func:`render` lays a :func:`~memviz.cli.diff_compare.compare`
document out in columns (A, B, B - A, B / A) per device, and :func:`diff_text`
compares two traces and renders them in one call.

Imports memviz.cli.diff_compare and the floors below memviz.cli (docs/architecture.md).
"""

from __future__ import annotations

import time
from typing import Any, Dict, Optional, Tuple

from memviz._units import escape_controls, format_size
from memviz.cli.diff_compare import FIGURES, compare

__all__ = ["render", "diff_text"]

#: the width of the label column, and of the A, B, B - A and B / A columns
LABEL = 36
COLS = (11, 11, 12, 8)


def _value(v: Optional[int], unit: str, sign: bool = False) -> str:
    if v is None:
        return "-"
    if unit == "bytes":
        return format_size(v, sign=sign)
    return f"{v:+,}" if sign else f"{v:,}"


def _ratio(r: Optional[float]) -> str:
    return "-" if r is None else f"{r:.2f}x"


def _cells(row: Dict[str, Any]) -> str:
    unit = row["unit"]
    cells = (_value(row["a"], unit), _value(row["b"], unit), _value(row["diff"], unit, sign=True),
             _ratio(row["ratio"]))
    return "".join(f"{c:>{w}}" for c, w in zip(cells, COLS))


def _head(title: str, indent: str = "") -> str:
    return f"{indent}{title:<{LABEL - len(indent)}}" + "".join(
        f"{c:>{w}}" for c, w in zip(("A", "B", "B - A", "B / A"), COLS))


def _when(info: Dict[str, Any]) -> str:
    parts = []
    wall = info.get("start_wall_time")
    if isinstance(wall, (int, float)):
        try:
            parts.append("recorded " + time.strftime("%Y-%m-%d %H:%M", time.localtime(wall)))
        except (OverflowError, OSError, ValueError):  # a date no clock of this machine can show
            parts.append(f"recorded at {wall!r} s of the epoch")
    if isinstance(info.get("duration_s"), (int, float)):
        parts.append(f"{info['duration_s']:.1f} s")
    if info.get("route"):
        parts.append(f"PyTorch through {info['route']}")
    return f" ({', '.join(parts)})" if parts else ""


def render(doc: Dict[str, Any], names: Optional[Tuple[str, str]] = None) -> str:
    """The text of a :func:`compare` document (``names``: what to call the
    traces; default their paths)."""
    if names is None:
        names = (doc["a"].get("path") or "A", doc["b"].get("path") or "B")
    lines = ["memviz diff"]
    for tag, name, side in (("A", names[0], doc["a"]), ("B", names[1], doc["b"])):
        what = side.get("command") or ""
        lines.append(f"  {tag}  {name}" + (f": {what}" if what else "") + _when(side))
    lines.append("=" * (LABEL + sum(COLS)))
    for dev in doc["devices"]:
        lines += ["", _head(dev["name"])]
        for name, label, _unit in FIGURES:
            row = dev["figures"].get(name)
            if row is not None and (row["a"] is not None or row["b"] is not None):
                lines.append(f"  {label:<{LABEL - 2}}{_cells(row)}")
        if dev["categories"]:
            lines += ["", _head("By category at the peak", "  ")]
            lines += [f"    {c['category'][:LABEL - 5]:<{LABEL - 4}}{_cells(c)}" for c in dev["categories"]]
        title = "Top lines at the peak by change" if doc["key"] == "lineno" else f"Top by {doc['key']} at the peak"
        lines += ["", _head(title, "  ")]
        if not dev["lines"]:
            lines.append("    no change")
        for r in dev["lines"]:
            if len(r["key"]) <= LABEL - 5:  # the location in the label column, else on a line of its own
                lines.append(f"    {r['key']:<{LABEL - 4}}{_cells(r)}")
            else:
                lines += [f"    {r['key']}", f"    {'':<{LABEL - 4}}{_cells(r)}"]
        more = dev["more_lines"]
        if more["count"]:
            lines.append(f"    ... {more['count']:,} more changed line(s), "
                         f"{format_size(more['diff'], sign=True)} in all")
    if not doc["devices"]:
        lines += ["", "No allocations in either trace."]
    if doc["notes"]:
        lines.append("")
        lines += [f"Note: {n}" for n in doc["notes"]]
    return escape_controls("\n".join(line.rstrip() for line in lines) + "\n")


def diff_text(a: Any, b: Any, names: Optional[Tuple[str, str]] = None, top: int = 10,
              key: str = "lineno") -> str:
    """The text diff of two loaded traces (or trackers)."""
    doc = compare(a, b, names=(f"A ({names[0]})", f"B ({names[1]})") if names else ("A", "B"),
                  top=top, key=key)
    return render(doc, names)
