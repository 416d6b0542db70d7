"""The HTML page of a distributed run's merged report (memviz/report/ranks.py).

One self-contained file in the style of the report page (memviz/report/html.py:
its stylesheet, inlined): the ranks, the imbalance, the categories, the lines
that differ most between ranks, the steps side by side and the findings, as
plain tables, so it needs no script (its Content-Security-Policy lets none
run and nothing load). The report's JSON document is embedded too
(``<script type="application/json" class="memviz-rank-data">``, data only).

Imports memviz/report/html.py (its stylesheet and script-safe JSON) and
memviz/report/ranks.py (docs/architecture.md).
"""

from __future__ import annotations

import html
from typing import Any, Dict, Iterable, List, Optional

from memviz._units import escape_controls, format_size
from memviz.report.html import _asset, json_for_script
from memviz.report import ranks_questions as Q
from memviz.report.ranks import _location, _short_location, by_category
from memviz.report.ranks_charts import peaks_chart, steps_chart
from memviz.report.summary import device_name

__all__ = ["render"]

_STEPS_SHOWN = 500  # first and last steps in the page (all are in its JSON)
_CARDS_SHOWN = 200  # findings of some ranks only shown in the page (all are in its JSON)

_PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; style-src 'unsafe-inline'">
<meta name="generator" content="memviz {version}">
<title>{title}</title>
<style>{css}</style>
</head>
<body>
<div class="mvz">
<header><h1>{title}</h1><div class="sub">{sub}</div></header>
<main class="mvz-main">
{body}
</main>
</div>
<script type="application/json" class="memviz-rank-data">{data}</script>
</body>
</html>
"""


def _e(v: Any) -> str:
    return html.escape(escape_controls(str(v), keep="\n\t"))


def _size(v: Any) -> str:
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return f'<td class="num" title="{int(v):,} bytes">{_e(format_size(v))}</td>'
    return '<td class="num">-</td>'


def _num(v: Any, fmt: str = "{:,}") -> str:
    return f'<td class="num">{_e(fmt.format(v)) if v is not None else "-"}</td>'


def _table(head: Iterable[str], rows: List[str], narrow: bool = True) -> str:
    cls = ' class="narrow"' if narrow else ""
    return (f"<table{cls}><thead><tr>" + "".join(f"<th>{_e(h)}</th>" for h in head) + "</tr></thead><tbody>"
            + "".join(f"<tr>{r}</tr>" for r in rows) + "</tbody></table>")


def _per_rank(title: str, label: str, rows: List[tuple], ranks: List[int], note: str = "") -> str:
    body = [f"<td class=\"code\"><code>{_e(name)}</code></td>" + "".join(_size(vals.get(str(r))) for r in ranks)
            for name, vals in rows]
    out = f"<h2>{_e(title)}</h2>" + _table([label] + [f"rank {r}" for r in ranks], body)
    return out + (f'<p class="note">{_e(note)}</p>' if note else "")


def _findings(doc: Dict[str, Any]) -> str:
    common = doc["common_findings"]
    kinds = {f["kind"] for f in common}
    parts = ["<h2>Findings on every rank</h2>"]
    if not common:
        parts.append('<p class="note">none</p>')
    cards = []
    for f in common:
        where = (f'<div class="kv">on every rank at {", ".join(_e(_short_location(x)) for x in f["lines"])}</div>'
                 if f["lines"] else "")
        fix = f'<div class="fix">{_e(f["fix"])}</div>' if f["fix"] else ""
        cards.append(f'<div class="card"><div class="kind">{_e(f["kind"])}, ranks '
                     f'{_e(", ".join(map(str, f["ranks"])))}</div><div>rank {_e(f["message_rank"])}: '
                     f'{_e(f["message"])}</div>{where}{fix}</div>')
    parts.append(f'<div class="cards">{"".join(cards)}</div>')
    parts.append("<h2>Findings on some ranks only</h2>")
    cards = []
    for r in doc["ranks"]:
        if r["findings_error"]:
            cards.append(f'<div class="card"><div class="kind">rank {_e(r["rank"])}</div>'
                         f'<div>none shown: {_e(r["findings_error"])}</div></div>')
        for f in r["findings"]:
            if f["kind"] in kinds:
                continue
            lines = "".join(f"<div><code>{_e(ln['text'])}</code></div>" for ln in f["lines"][:5])
            fix = f'<div class="fix">{_e(f["fix"])}</div>' if f["fix"] else ""
            cards.append(f'<div class="card"><div class="kind">{_e(f["kind"])}, rank {_e(r["rank"])}</div>'
                         f'<div>{_e(f["message"])}</div>{lines}{fix}</div>')
    shown = cards[:_CARDS_SHOWN]
    parts.append(f'<div class="cards">{"".join(shown)}</div>' if cards else '<p class="note">none</p>')
    if len(shown) < len(cards):
        parts.append(f'<p class="note">{len(cards) - len(shown):,} more left out (see Findings by kind; the JSON '
                     "data below has all).</p>")
    return "".join(parts)


def _questions(doc: Dict[str, Any]) -> str:
    """The highest peaks, the ranks growing alone, the kinds of findings,
    the clocks between hosts and the files left out."""
    parts = []
    tops = doc.get("top_peaks") or []
    if tops:
        parts.append(f"<h2>Highest peaks (of {len(doc['ranks']):,} ranks)</h2>" + _table(
            ["rank", "host", "peak", "peak at", "in step"],
            [f"<td>rank {_e(t['rank'])}</td><td>{_e(t['host'] or '-')}</td>" + _size(t["peak"]) + _at(t["peak_at_s"])
             + _num(t.get("peak_step")) for t in tops]))
    imb = doc["imbalance"]
    if imb.get("cv") is not None:
        parts.append(f'<p class="note">mean peak {_e(format_size(imb["mean_peak"]))}, standard deviation '
                     f'{_e(format_size(imb["stdev_peak"]))} ({imb["cv"]:.0%} of the mean), highest less lowest '
                     f'{_e(format_size(imb["spread"]))}.</p>')
    g = doc.get("growing_ranks") or {}
    if g.get("ranks"):
        parts.append("<h2>Ranks whose memory grows while the others' does not</h2>" + _table(
            ["rank", "host", "per step", "grown", "steps"],
            [f"<td>rank {_e(x['rank'])}</td><td>{_e(x['host'] or '-')}</td>" + _size(x["trend_per_step"])
             + _size(x["grown"]) + _num(x["steps"]) for x in g["ranks"]])
            + f'<p class="note">the median rank\'s trend: {_e(format_size(g["median_trend_per_step"] or 0))} per '
              "step (live bytes at each step's end, after the warm-up)</p>")
    kinds = doc.get("findings_by_kind") or []
    if kinds:
        parts.append("<h2>Findings by kind</h2>" + _table(
            ["kind", "ranks", "", "which"],
            [f"<td>{_e(k['kind'])}</td>" + _num(k["count"])
             + f"<td>{'every rank' if k['common'] else ('outliers' if k['outlier'] else 'some ranks')}</td>"
             f"<td class=\"wrap\">{'' if k['common'] else _e(Q._ranges(k['ranks']))}</td>" for k in kinds]))
    c = doc.get("clocks") or {}
    if c.get("hosts") and len(c["hosts"]) > 1:
        parts.append("<h2>Clocks between hosts</h2>" + _table(
            ["host", "ranks", "offset", "late spread"],
            [f"<td>{_e(h['host'])}</td>" + _num(len(h["ranks"])) + _num(h["offset_s"], "{:+.3f} s")
             + _num(h["late_spread_s"], "{:.3f} s") for h in c["hosts"]])
            + f'<p class="note">from {c["steps_used"]:,} step marks: a host\'s offset is how far its ranks\' '
              "step ends lie from the median rank's (synchronous steps end together on every rank).</p>")
    skipped = doc.get("skipped") or []
    if skipped:
        parts.append(f"<h2>Files left out ({len(skipped):,})</h2>" + _table(
            ["file", "why"], [f'<td class="wrap"><code>{_e(x["trace"])}</code></td><td>{_e(x["reason"])}</td>'
                              for x in skipped], narrow=False))
    return "".join(parts)


def _at(v: Optional[float]) -> str:
    return _num(v, "{:.2f} s")


def render(doc: Dict[str, Any], title: Optional[str] = None) -> str:
    """The page of :func:`memviz.report.ranks.rank_report`'s document."""
    from memviz._package import __version__

    rows, ranks = doc["ranks"], Q.shown_ranks(doc["ranks"])
    title = title or f"memviz: {len(rows)} ranks" + (f" of {doc['world_size']}" if doc["world_size"] else "")
    sub = _e(doc["command"] or "")
    body: List[str] = []
    body += [f'<p class="warn">note: {_e(n)}</p>' for n in doc["notes"]]
    table = []
    for r in rows:
        dev = device_name(r["device"]) if r["device"] is not None else "-"
        table.append(f"<td>rank {_e(r['rank'])}</td><td>{_e(r['host'] or '-')}</td><td>{_e(dev)}</td>"
                     + _size(r["peak"]) + _at(r["peak_at_s"]) + _size(r["current"]) + _num(r["failed"])
                     + _num(r["steps"]) + f'<td class="wrap"><code>{_e(r["trace"])}</code></td>')
    body.append("<h2>Ranks</h2>" + '<div class="scroll">' + _table(
        ["rank", "host", "device", "peak", "peak at", "at end", "failed", "steps", "trace"], table,
        narrow=False) + "</div>")
    body.append('<p class="note">peak: the rank\'s largest device peak; peak at: seconds after the rank '
                'started tracking; at end: live when it stopped.</p>')
    body.append("<h2>Peaks of the ranks</h2>" + peaks_chart(doc))
    chart = steps_chart(doc)
    if chart:
        body.append("<h2>Memory over the steps: the highest and lowest ranks against the median</h2>" + chart)
    body.append(_questions(doc))
    if len(ranks) < len(rows):
        body.append(f'<p class="note">The tables below have a column for {len(ranks)} of the {len(rows):,} ranks: '
                    "the 3 highest peaks, the median rank and the 2 lowest (the JSON data below has every "
                    "rank).</p>")
    imb = doc["imbalance"]
    if imb["ratio"] is not None:
        body.append(f"<h2>Imbalance: {imb['ratio']:.2f}x</h2><p>rank {_e(imb['max_rank'])}'s peak "
                    f"{_e(format_size(imb['max_peak']))} over the median peak "
                    f"{_e(format_size(imb['median_peak']))}; the lowest is rank {_e(imb['min_rank'])}'s "
                    f"{_e(format_size(imb['min_peak']))}.</p>")
    for key, title_ in (("categories_at_peak", "By category at each rank's peak"),
                        ("categories_at_end", "By category at the end")):
        cats = by_category(rows, key)
        if cats:
            body.append(_per_rank(title_, "category", cats, ranks))
    if doc["lines"]:
        body.append(_per_rank("Lines whose bytes at the peak differ most between ranks", "line",
                              [(_location(x["file"], x["line"], x.get("backward"))
                                + (f"  {x['function']}" if x["function"] else ""),
                                x["bytes"]) for x in doc["lines"]], ranks))
    if doc["steps"]:
        all_steps = doc["steps"]
        picked = all_steps if len(all_steps) <= 2 * _STEPS_SHOWN else (
            all_steps[:_STEPS_SHOWN] + all_steps[-_STEPS_SHOWN:])
        steps = [(f"step {s['step']}" + (f" ({s['imbalance']:.2f}x)" if s["imbalance"] else ""),
                  {r: v.get("peak") for r, v in s["ranks"].items()}) for s in picked]
        note = "each rank's peak inside the step" + (
            f"; {len(all_steps) - len(picked):,} steps between step {all_steps[_STEPS_SHOWN - 1]['step']} and "
            f"step {all_steps[-_STEPS_SHOWN]['step']} left out (the JSON data below has all)"
            if len(picked) < len(all_steps) else "")
        body.append(_per_rank(f"Steps side by side ({len(all_steps):,})", "step (max over median)", steps,
                              ranks, note))
    body.append(_findings(doc))
    return _PAGE.format(title=_e(title), version=_e(__version__), css=_asset("report.css"), sub=sub,
                        body="\n".join(body), data=json_for_script(doc))
