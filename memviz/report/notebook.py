"""Notebook views of memviz data: compact HTML with no script at all.

:func:`tracker_repr_html`, :func:`snapshot_repr_html` and
:func:`findings_repr_html` are what a Tracker, a Snapshot and diagnose()'s
findings show in a notebook. The timeline and the memory per step are static
inline SVGs, so the views show in any notebook front end, trusted or not. The
full page with its script is memviz/report/html.py. Imports the model floor
and below and the rest of memviz/report (docs/architecture.md).
"""

from __future__ import annotations

import html
from typing import Any, Iterable, List, Optional

from memviz._args import given
from memviz._errors import InvalidArgument
from memviz._units import escape_controls, format_size
from memviz.model.lines import location
from memviz.report import _data, read
from memviz.report.summary import (STEP_SERIES, before_tracking, short_path as _short_path, source_line,
                                   step_series_label, step_summary, tensor_peaks)

__all__ = ["tracker_repr_html", "snapshot_repr_html", "findings_repr_html"]


_NB_STYLE = (
    "<style>.mvz-nb{font:13px/1.4 system-ui,-apple-system,'Segoe UI',Roboto,Arial,sans-serif;"
    "max-width:980px}.mvz-nb table{border-collapse:collapse;margin:4px 0 8px}"
    ".mvz-nb th,.mvz-nb td{padding:2px 8px;border-bottom:1px solid #e3e7ee;text-align:left}"
    ".mvz-nb td.n{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}"
    ".mvz-nb .m{color:#5b6472}.mvz-nb code{font-size:12px}.mvz-nb .bad{color:#c0392b}"
    ".mvz-nb .card{border-left:3px solid #b7791f;padding:2px 10px;margin:6px 0}</style>")


def _e(x: Any) -> str:
    """Text for the page: HTML-escaped, with control characters and
    bidirectional overrides (from a trace's names) shown as escapes."""
    return html.escape(escape_controls(str(x), keep="\n\t"), quote=True)


def _sparkline(points: List[tuple], peak: int, peak_ts: Optional[int], t0: int, t1: int,
               width: int = 420, height: int = 56) -> str:
    """A static SVG of one device's live bytes over time, peak marked; each of
    its 200 time buckets keeps its lowest and highest point, so the steps of
    a training loop show as a sawtooth."""
    if not points or peak <= 0 or t1 <= t0:
        return ""
    ts, vs = read.downsample([p[0] for p in points], [p[1] for p in points], 200, low=True)
    span, top = t1 - t0, peak * 1.08

    def xy(t: int, v: float) -> str:
        return f"{(t - t0) * width / span:.1f},{height - 2 - v * (height - 4) / top:.1f}"

    coords = [xy(t0, 0)]
    prev = 0
    for t, v in zip(ts, vs):
        coords += [xy(t, prev), xy(t, v)]
        prev = v
    coords += [xy(t1, prev), xy(t1, 0)]
    dot = ""
    if peak_ts is not None:
        px, py = xy(peak_ts, peak).split(",")
        dot = (f'<circle cx="{px}" cy="{py}" r="3" fill="#c0392b"><title>peak '
               f'{_e(format_size(peak))} at {(peak_ts - t0) / 1e9:.3f} s</title></circle>')
    return (f'<svg width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
            f'style="background:#f7f9fc;border-radius:3px">'
            f'<polygon points="{" ".join(coords)}" fill="#4e79a7" fill-opacity="0.3" '
            f'stroke="#4e79a7" stroke-width="1"/>{dot}</svg>')


def _lines_table(stats: List[Any], top: int, total: int) -> str:
    if not stats:
        return '<p class="m">no allocation was live</p>'
    rows = []
    for s in stats[:top]:
        f = s.key
        lineno = getattr(f, "lineno", 0) or 0
        filename = getattr(f, "filename", str(f))
        shown = location(f, _short_path)
        if getattr(f, "name", ""):
            shown += f" in {f.name}"
        source = source_line(filename, lineno, 120)
        share = f"{100 * s.size / total:.1f}%" if total else ""
        rows.append(f'<tr><td class="n">{_e(format_size(s.size))}</td><td class="n">{s.count:,}</td>'
                    f'<td class="n">{share}</td><td title="{_e(filename)}">{_e(shown)}</td>'
                    f'<td><code>{_e(source)}</code></td></tr>')
    more = len(stats) - top
    tail = (f'<tr><td colspan="5" class="m">... {more:,} more line(s) holding '
            f'{_e(format_size(sum(s.size for s in stats[top:])))}</td></tr>') if more > 0 else ""
    return ('<table><tr><th>size</th><th>count</th><th>share</th><th>line</th><th>source</th></tr>'
            + "".join(rows) + tail + "</table>")


def tracker_repr_html(tracker: Any, top: int = 10, name: str = "t") -> str:
    """Compact HTML for a notebook: state, per-device totals with a small
    timeline each, the top lines at the peak, the steps (a summary and memory
    per step, the findings' steps shaded) and findings when the run recorded
    steps, and the failures count.

    ``name`` is the variable that holds the tracker in the notebook, for the
    code the view suggests (``t`` as in ``with memviz.track() as t:``; the
    ``%%memviz`` magic keeps its tracker as ``_memviz``)."""
    if isinstance(top, bool) or not isinstance(top, int) or top < 1:
        raise InvalidArgument(f"top must be a positive int, got {given(top)}")
    if not isinstance(name, str) or not name.isidentifier():
        raise InvalidArgument(f"name must be a Python variable name, got {given(name)}")
    if getattr(tracker, "started_ns", 0) is None:
        return (f'{_NB_STYLE}<div class="mvz-nb"><b>memviz tracker</b> <span class="m">not started: '
                "use <code>with memviz.track() as t:</code> and run your code in the block</span></div>")
    totals = tracker.totals()
    timeline = list(tracker.timeline())
    t0, t1 = read.time_range(tracker, timeline, totals)
    state = "running" if getattr(tracker, "running", False) else "stopped"
    if getattr(tracker, "gpu_enabled", True):
        gpu = "GPU capture on"
        if getattr(tracker, "cupti_enabled", True) is False:  # a live tracker that went on without CUPTI
            gpu += f" without CUPTI ({getattr(tracker, 'cupti_off_reason', None) or 'not used'})"
    else:
        gpu = f"GPU capture off: {getattr(tracker, 'gpu_off_reason', None) or 'unknown reason'}"
    parts = [f'{_NB_STYLE}<div class="mvz-nb"><div><b>memviz</b> <span class="m">{_e(state)} · '
             f'{(t1 - t0) / 1e9:.2f} s · {_e(gpu)}</span></div>']
    if not totals:
        parts.append('<p class="m">No GPU allocation was recorded.</p>')
    else:
        rows = []
        for dev in sorted(totals, key=lambda d: (d < 0, d)):
            t = totals[dev]
            pts = [(ts, live) for ts, d, live in timeline if d == dev]
            spark = _sparkline(pts, t.get("peak", 0), t.get("peak_timestamp_ns"), t0, t1)
            rows.append(f'<tr><td>{_e(read.device_name(dev))}</td><td class="n">'
                        f'{_e(format_size(t["current"]))}</td><td class="n">{_e(format_size(t["peak"]))}'
                        f'</td><td class="n">{t["allocs"]:,}</td><td class="n">{t["frees"]:,}</td>'
                        f'<td class="n">{t.get("failed", 0):,}</td><td>{spark}</td></tr>')
        parts.append('<table><tr><th>device</th><th>current</th><th>peak</th><th>allocs</th>'
                     '<th>frees</th><th>failed</th><th>live memory over time</th></tr>'
                     + "".join(rows) + "</table>")
        peak = tracker.peak_snapshot()
        parts.append(f"<div><b>Top lines at the peak</b> <span class=\"m\">"
                     f"({_e(format_size(peak.total_bytes()))} live)</span></div>")
        parts.append(_lines_table(peak.statistics("lineno"), top, peak.total_bytes()))
        if tensor_peaks(tracker):  # what to shrink: PyTorch's blocks' own peak
            tensor = tracker.peak_snapshot(peak="tensor")
            held = sum(a.size for a in tensor.allocations if a.kind == "block")
            parts.append(f"<div><b>Top lines at the tensor peak</b> <span class=\"m\">"
                         f"({_e(format_size(held))} of PyTorch tensors, as max_memory_allocated())"
                         f"</span></div>")
            parts.append(_lines_table(tensor.statistics("lineno"), top, tensor.total_bytes()))
        before = before_tracking(tracker)
        if before:
            said = "; ".join(f"{read.device_name(d)}: {format_size(v['bytes'])}" for d, v in sorted(before.items())
                             if v["bytes"])
            if said:
                parts.append(f'<p class="m">Held by PyTorch when tracking started: {_e(said)} '
                             f'(included above)</p>')
    parts.append(_steps_view(tracker))
    failures = list(getattr(tracker, "failures", None) or ())
    if failures:
        last = failures[-1]
        parts.append(f'<p class="bad">{len(failures):,} failed allocation(s); the last: '
                     f'{_e(format_size(last.size))} at {_e(read.where(last))}</p>')
    # a method of the tracker: runs as written where the tracker is, with no import
    parts.append(f'<p class="m">Full report: <code>{name}.to_html("report.html")</code></p></div>')
    return "".join(parts)


_STEP_COLORS = {"current": "#4e79a7", "peak": "#9c755f", "allocated": "#e15759", "reserved": "#f28e2c"}


def _step_svg(plot: dict, dv: dict, found: List[dict], width: int = 420, height: int = 72) -> str:
    """A static SVG of one device's memory per step (current solid, peak
    dashed, PyTorch's numbers when present), the findings' steps shaded."""
    xs = plot["steps"]
    n = len(xs)
    top = max((v for vals in dv["series"].values() for v in vals if v is not None), default=0) * 1.08
    if not n or top <= 0:
        return ""
    lo, span = min(xs), max(max(xs) - min(xs), 1)
    half = max(width / span / 2 * plot["bucket"], 1.5) if n > 1 else 6

    def x(i: int) -> float:
        return (i - lo) * (width - 8) / span + 4 if n > 1 else width / 2

    def y(v: float) -> float:
        return height - 2 - v * (height - 14) / top

    marks = []
    for f in found:
        if not f.get("step_ranges") or f.get("device") not in (None, dv["device"]):
            continue
        for a, b in f["step_ranges"]:
            x0, x1 = max(x(a) - half, 0), min(x(b) + half, width)
            marks.append(f'<g class="finding-mark"><rect x="{x0:.1f}" y="10" width="{max(x1 - x0, 2):.1f}" '
                         f'height="{height - 12}" fill="#c0392b" fill-opacity="0.12" stroke="#c0392b" '
                         f'stroke-opacity="0.4"/><text x="{x0 + 2:.1f}" y="9" font-size="9" fill="#c0392b">'
                         f'{_e(f["kind"])}</text><title>{_e(f["kind"])}: {_e(f["message"])}</title></g>')
    lines = []
    for name, vals in dv["series"].items():
        pts = " ".join(f"{x(i):.1f},{y(v):.1f}" for i, v in zip(xs, vals) if v is not None)
        dash = ' stroke-dasharray="4 2"' if name == "peak" else ""
        lines.append(f'<polyline points="{pts}" fill="none" stroke="{_STEP_COLORS.get(name, "#555")}" '
                     f'stroke-width="1.4"{dash}><title>{_e(name)}</title></polyline>')
    return (f'<svg class="mvz-steps" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
            f'style="background:#f7f9fc;border-radius:3px">{"".join(marks)}{"".join(lines)}</svg>')


def _steps_view(obj: Any) -> str:
    """The notebook view's steps (a summary table, memory per step with the
    findings' steps shaded) and findings; "" when there are no steps."""
    summary = step_summary(obj)
    rows = read.steps(obj)
    if summary is None and not rows:
        return ""
    found, why = read.findings(obj)
    parts = []
    plot = _data._step_plot(obj, rows, points=200)
    if summary is not None:
        head = (f"{summary['count']:,} recorded (steps {summary['first_step']} to {summary['last_step']}); "
                f"trend: least-squares slope from step {summary['trend_from_step']}")
    else:
        head = f"{len(rows):,} recorded"
    parts.append(f'<div><b>Steps</b> <span class="m">{_e(head)}</span></div>')
    table = []
    for d in (summary or {}).get("devices", []):
        for name in STEP_SERIES:
            st = d.get(name)
            if st is None:
                continue
            trend = st["trend_per_step"]
            table.append(f'<tr><td>{_e(step_series_label(d["name"], name))}</td>'
                         + "".join(f'<td class="n">{_e(format_size(st[k]))}</td>'
                                   for k in ("first", "last", "min", "max"))
                         + f'<td class="n">{_e(format_size(trend, sign=True)) if trend is not None else "-"}'
                         "</td></tr>")
    if table:
        parts.append("<table><tr><th>series</th><th>first</th><th>last</th><th>min</th><th>max</th>"
                     "<th>trend per step</th></tr>" + "".join(table) + "</table>")
    for dv in (plot or {}).get("devices", []):
        svg = _step_svg(plot, dv, found or [])
        if svg:
            parts.append(f'<div class="m">{_e(dv["name"])} per step: current (solid), peak (dashed)'
                         f'{", findings shaded" if any(f.get("step_ranges") for f in found or []) else ""}'
                         f'</div>{svg}')
    if found is None:
        parts.append(f'<p class="m">Findings: {_e(why)}.</p>')
    elif found:
        parts.append(f"<div><b>memviz findings</b> ({len(found)})</div>{_finding_cards(found)}")
    else:
        parts.append('<p class="m">memviz.diagnose() found no problem in these steps.</p>')
    return "".join(parts)


def _finding_cards(items: List[dict]) -> str:
    cards = []
    for f in items:
        nums = " · ".join(f"{_e(k)}: {_e(v)}" for k, v in f["numbers_text"].items())
        lines = "".join(f"<div><code>{_e(x)}</code></div>" for x in f["lines"][:10])
        fix = f'<div><b>Fix:</b> {_e(f["fix"])}</div>' if f["fix"] else ""
        cards.append(f'<div class="card"><div class="m">{_e(f["kind"])}</div><div>{_e(f["message"])}</div>'
                     f'{"<div class=m>" + nums + "</div>" if nums else ""}{lines}{fix}</div>')
    return "".join(cards)


def snapshot_repr_html(snapshot: Any, top: int = 10) -> str:
    """Compact HTML of a Snapshot: size per device and the top lines."""
    total = snapshot.total_bytes()
    devs = ", ".join(f"{read.device_name(d)} {format_size(s.total_bytes())}"
                     for d, s in snapshot.by_device().items())
    return (f'{_NB_STYLE}<div class="mvz-nb"><div><b>memviz snapshot</b> <span class="m">'
            f"{len(snapshot):,} allocation(s), {_e(format_size(total))}"
            f"{' (' + _e(devs) + ')' if devs else ''}</span></div>"
            f"{_lines_table(snapshot.statistics('lineno'), top, total)}</div>")


def findings_repr_html(findings: Iterable[Any]) -> str:
    """Compact HTML of diagnose() findings: kind, message, numbers, lines, fix."""
    items = [read.normalize_finding(f) for f in findings or ()]
    if not items:
        return f'{_NB_STYLE}<div class="mvz-nb"><b>memviz</b> <span class="m">no problem found</span></div>'
    return f'{_NB_STYLE}<div class="mvz-nb"><b>memviz findings</b> ({len(items)}){_finding_cards(items)}</div>'
