"""The charts of the merged page of a run's ranks (memviz/report/ranks_html.py):
each rank's peak, and the memory over the steps of the highest and lowest
ranks against the median rank.

Drawn here, as inline SVG, in the look of the single report's charts
(memviz/report/assets/report.js draws those in the browser; the classes
and colours of assets/report.css are the same): the merged page runs no
script (its Content-Security-Policy allows none), so its charts are
drawn when the page is written, and a bar's or point's figures are in its
``<title>`` (the browser's tooltip). Nothing is fetched; nothing but the
page is needed.
"""

from __future__ import annotations

import html
import statistics
from typing import Any, Dict, List, Sequence, Tuple

from memviz._units import escape_surrogates, format_size

__all__ = ["peaks_chart", "steps_chart"]

W, H = 960, 240
LEFT, RIGHT, TOP, BOTTOM = 64, 12, 12, 28
ACCENT, BAD, MUTED, MEDIAN = "#3b6fb6", "#c0392b", "#9aa3b0", "#1d2430"
_POINTS = 600  # points per series at most (each the highest of its bucket)


def _e(v: Any) -> str:
    return html.escape(escape_surrogates(str(v)), quote=True)


def _ticks(high: float, n: int = 4) -> List[float]:
    if high <= 0:
        return [0.0]
    raw = high / n
    mag = 1 << max(0, int(raw).bit_length() - 1)
    step = next(m * mag for m in (1, 2, 4, 8, 16) if m * mag >= raw)
    return [step * i for i in range(int(high // step) + 1)]


def _frame(high: float, x_label: str) -> List[str]:
    ph = H - TOP - BOTTOM
    out = ['<g class="axis">']
    for t in _ticks(high):
        y = TOP + ph - (t / high * ph if high else 0)
        out.append(f'<line class="grid" x1="{LEFT}" x2="{W - RIGHT}" y1="{y:.1f}" y2="{y:.1f}"></line>'
                   f'<text x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">{_e(format_size(int(t)))}</text>')
    out.append(f'<text x="{(LEFT + W - RIGHT) / 2:.0f}" y="{H - 6}" text-anchor="middle">{_e(x_label)}</text></g>')
    return out


def _svg(body: List[str], label: str) -> str:
    return (f'<svg class="mvz-chart" viewBox="0 0 {W} {H}" width="100%" role="img" aria-label="{_e(label)}" '
            f'preserveAspectRatio="none" style="max-width:{W}px;height:auto">' + "".join(body) + "</svg>")


def peaks_chart(doc: Dict[str, Any]) -> str:
    """A bar per rank (in rank order) of its peak; the highest and lowest
    peaks coloured, the median peak a dashed line."""
    rows = doc["ranks"]
    if not rows:
        return ""
    high = max(r["peak"] for r in rows) or 1
    top = {t["rank"] for t in (doc.get("top_peaks") or [])[:3]}
    low = {r["rank"] for r in sorted(rows, key=lambda r: (r["peak"], r["rank"]))[:3]}
    pw, ph = W - LEFT - RIGHT, H - TOP - BOTTOM
    bw = pw / len(rows)
    body = _frame(high, f"ranks 0 to {rows[-1]['rank']} (bar: the rank's peak; dashed: the median peak)")
    for i, r in enumerate(rows):
        h = r["peak"] / high * ph
        color = ACCENT if r["rank"] in top else (BAD if r["rank"] in low else MUTED)
        at = f" at {r['peak_at_s']:.2f} s" if isinstance(r["peak_at_s"], float) else ""
        body.append(f'<rect x="{LEFT + i * bw:.2f}" y="{TOP + ph - h:.2f}" width="{max(bw * 0.85, 0.5):.2f}" '
                    f'height="{h:.2f}" fill="{color}"><title>rank {_e(r["rank"])}: {_e(format_size(r["peak"]))}'
                    f'{_e(at)}</title></rect>')
    med = doc["imbalance"].get("median_peak") or 0
    y = TOP + ph - med / high * ph
    body.append(f'<line x1="{LEFT}" x2="{W - RIGHT}" y1="{y:.1f}" y2="{y:.1f}" stroke="{MEDIAN}" '
                f'stroke-dasharray="4 3"><title>median peak {_e(format_size(med))}</title></line>')
    return _svg(body, "each rank's peak")


def _series(steps: List[Dict[str, Any]], rank: int) -> List[Tuple[int, int]]:
    key = str(rank)
    return [(s["step"], s["ranks"][key]["peak"]) for s in steps
            if key in s["ranks"] and isinstance(s["ranks"][key].get("peak"), int)]


def _thin(points: List[Tuple[int, float]]) -> List[Tuple[int, float]]:
    if len(points) <= _POINTS:
        return points
    step = -(-len(points) // _POINTS)
    return [max(points[i:i + step], key=lambda p: p[1]) for i in range(0, len(points), step)]


def steps_chart(doc: Dict[str, Any]) -> str:
    """Each step's peak of the highest-peak rank and of the lowest-peak
    rank, against the median over the ranks of each step's peak."""
    steps = doc.get("steps") or []
    rows = doc["ranks"]
    if not steps or len(rows) < 2:
        return ""
    hi = min(rows, key=lambda r: (-r["peak"], r["rank"]))["rank"]
    lo = min(rows, key=lambda r: (r["peak"], r["rank"]))["rank"]
    median = []
    for s in steps:
        vals = [v["peak"] for v in s["ranks"].values() if isinstance(v.get("peak"), int)]
        if vals:
            median.append((s["step"], statistics.median(vals)))
    series: List[Tuple[str, str, Sequence[Tuple[int, float]]]] = [
        (f"rank {hi} (highest peak)", ACCENT, _thin(_series(steps, hi))),
        ("median rank", MEDIAN, _thin(median)),
        (f"rank {lo} (lowest peak)", BAD, _thin(_series(steps, lo)))]
    pts = [p for _n, _c, s in series for p in s]
    if not pts:
        return ""
    high = max(p[1] for p in pts) or 1
    first, last = min(p[0] for p in pts), max(p[0] for p in pts)
    pw, ph = W - LEFT - RIGHT, H - TOP - BOTTOM

    def xy(p: Tuple[int, float]) -> str:
        x = LEFT + ((p[0] - first) / (last - first) * pw if last > first else pw / 2)
        return f"{x:.1f},{TOP + ph - p[1] / high * ph:.1f}"

    body = _frame(high, f"steps {first} to {last} (each rank's peak inside the step)")
    legend = []
    for name, color, s in series:
        if not s:
            continue
        dash = ' stroke-dasharray="4 3"' if color == MEDIAN else ""
        body.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.6"{dash} '
                    f'points="{" ".join(xy(p) for p in s)}"><title>{_e(name)}</title></polyline>')
        legend.append(f'<span><span style="color:{color}">&#9632;</span> {_e(name)}</span>')
    return f'<div class="legend">{"".join(legend)}</div>' + _svg(body, "memory over the steps")
