"""The self-contained HTML report page of memviz data.

:func:`render` returns one HTML file that works offline: the data is
aggregated in Python (see :mod:`memviz.report._data`) and embedded as JSON in
a ``<script type="application/json">`` element, drawn by a small vanilla-JS
script (``assets/report.js``) that is inlined along with its stylesheet. A
Content-Security-Policy lets nothing load from the network and lets only that
script run.

The notebook views (no script) are memviz/report/notebook.py. Imports the
model floor and below and the rest of memviz/report (docs/architecture.md).
"""

from __future__ import annotations

import base64
import hashlib
import html
import json
import math
import os
from functools import lru_cache
from importlib import resources
from typing import Any, List, Optional

from memviz._args import given, recording
from memviz._errors import InvalidArgumentType
from memviz._units import escape_controls
from memviz.report import _data

__all__ = ["render", "write", "json_for_script"]


@lru_cache(maxsize=None)
def _asset(name: str) -> str:
    try:
        text = resources.files(__package__).joinpath("assets", name).read_text(encoding="utf-8")
    except (FileNotFoundError, OSError) as e:  # pragma: no cover - a broken install
        raise RuntimeError(
            f"memviz's report asset {name!r} is missing ({e}); reinstall memviz "
            "(pip install --force-reinstall memviz-gpu) so its package data is present.") from None
    if "</" in text.replace("<\\/", ""):  # would end the inline <script>/<style> early
        raise RuntimeError(f"memviz's report asset {name!r} contains '</'; it cannot be inlined.")
    return text


#: containers nested deeper than this are written piece by piece (json.dumps
#: recurses once per level, and a flame graph is as deep as its stacks)
_DUMPS_DEPTH = 48
#: containers nested deeper than this are not written: a string saying so
#: stands in their place, so that a plain json.loads reads the page's data
#: back at its default limits (3.12's C recursion limit stops near 1,450
#: levels, 3.10's and 3.11's Python limit near 1,000 less the caller's
#: frames). A flame graph keeps at most _data.FLAME_MAX_FRAMES frames a stack:
#: about 2 levels a frame, well within.
JSON_MAX_DEPTH = 800
JSON_CUT = f"[left out: nested deeper than {JSON_MAX_DEPTH} levels]"
_CONTAINERS = (dict, list, tuple)
_JSON_LEAVES = (str, int, float, bool, type(None))


def json_for_script(data: Any) -> str:
    """JSON that is safe inside an HTML ``<script>`` element.

    ``<``, ``>`` and ``&`` are written as ``\\u003c``-style escapes (still
    valid JSON, parsed back to the same strings), so no string in the data -
    a file name like ``</script><script>alert(1)</script>`` - can close the
    element or open a comment; U+2028/U+2029 are escaped for old parsers.
    NaN and infinities become null. Any nesting depth can be passed; a
    container nested deeper than JSON_MAX_DEPTH levels is written as the
    string JSON_CUT, so the text reads back with a plain json.loads."""
    return _script_json(*_clean(data))


def _script_json(clean: Any, heights: dict) -> str:
    text = _dumps(clean, heights)
    return (text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
            .replace("\u2028", "\\u2028").replace("\u2029", "\\u2029"))


def _leaf(v: Any) -> Any:
    if isinstance(v, str):
        # a file name that is not UTF-8, a control character or a
        # bidirectional override (U+202E) from a trace: shown escaped
        return escape_controls(v, keep="\n\t")
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if not isinstance(v, _JSON_LEAVES):
        return escape_controls(str(v), keep="\n\t")
    return v


def _clean(data: Any) -> "tuple[Any, dict]":
    """A copy of ``data`` as JSON-ready lists, dicts and leaves (see
    :func:`_leaf`), and ``{id(container): nesting height}`` of the copy.

    A loop over an explicit stack, not recursion, so any depth works;
    containers deeper than JSON_MAX_DEPTH become the string JSON_CUT."""
    heights: dict = {}
    if not isinstance(data, _CONTAINERS):
        return _leaf(data), heights

    def opened(src: Any) -> list:
        if isinstance(src, dict):
            return [{}, iter(src.items()), 0, True]
        return [[], iter(src), 0, False]

    root = opened(data)
    stack = [root]
    while stack:
        top = stack[-1]  # [copy, items left, height of its tallest child, is a dict]
        out, items, is_dict = top[0], top[1], top[3]
        for item in items:
            key, v = item if is_dict else (None, item)
            if isinstance(v, _CONTAINERS) and len(stack) >= JSON_MAX_DEPTH:
                v = JSON_CUT
            if isinstance(v, _CONTAINERS):
                child = opened(v)
                if is_dict:
                    out[_leaf(key)] = child[0]
                else:
                    out.append(child[0])
                stack.append(child)
                break
            if is_dict:
                out[_leaf(key)] = _leaf(v)
            else:
                out.append(_leaf(v))
        else:
            stack.pop()
            h = top[2] + 1
            heights[id(out)] = h
            if stack and stack[-1][2] < h:
                stack[-1][2] = h
    return root[0], heights


def _dumps(data: Any, heights: dict) -> str:
    """``json.dumps`` of :func:`_clean`'s copy; subtrees deeper than
    _DUMPS_DEPTH are opened here, level by level, instead of by json."""
    def dumps(v: Any) -> str:
        return json.dumps(v, separators=(",", ":"), ensure_ascii=False, allow_nan=False)

    if heights.get(id(data), 0) <= _DUMPS_DEPTH:
        return dumps(data)
    parts: List[str] = []

    def opened(v: Any) -> list:
        is_dict = isinstance(v, dict)
        parts.append("{" if is_dict else "[")
        return [iter(v.items()) if is_dict else iter(v), is_dict, True]

    stack = [opened(data)]
    while stack:
        top = stack[-1]  # [items left, is a dict, nothing written yet]
        item = next(top[0], _END)
        if item is _END:
            parts.append("}" if top[1] else "]")
            stack.pop()
            continue
        if not top[2]:
            parts.append(",")
        top[2] = False
        if top[1]:
            key, item = item
            parts.append(dumps({key: 0})[1:-2])  # the key as json writes it, and ':'
        if isinstance(item, (dict, list)) and heights.get(id(item), 0) > _DUMPS_DEPTH:
            stack.append(opened(item))
        else:
            parts.append(dumps(item))
    return "".join(parts)


_END = object()


_PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; img-src data:; style-src 'unsafe-inline'; script-src '{script_hash}'">
<meta name="generator" content="memviz {version}">
<title>{title}</title>
<style>{css}</style>
</head>
<body>
<div class="mvz">
<header><h1>{title}</h1></header>
<noscript><p>This report draws its charts and tables with JavaScript, which is turned off here.
The data is in the <code>memviz-data</code> script element of this file as JSON.</p></noscript>
<main class="mvz-main"></main>
</div>
<script type="application/json" class="memviz-data">{data}</script>
<script>{js}</script>
</body>
</html>
"""


def render(tracker_or_trace: Any, title: Optional[str] = None, *, before_tracking: Any = None,
           whatif: Any = None) -> str:
    """One self-contained HTML page about a Tracker or a loaded trace.

    The page has the memory timeline per device (peak marked; per category
    and the step records' allocated/reserved lines when present; drag to zoom,
    double-click to reset), an icicle graph of what was live at the peak by
    stack, sortable tables by line, autograd node, category, label, thread and
    kind, the steps (memory per step with the steps each finding concerns
    shaded, a summary, the records), diagnoses, failed allocations and the
    memory the process held beyond memviz's record (``before_tracking``:
    {device: {category: bytes}} made before tracking, when known;
    memviz/report/outside.py), and, given ``whatif`` (rows of
    memviz.analysis.whatif.whatif), the what-if table. It loads nothing from
    the network.

    Raises :class:`~memviz.NotTracking` for a tracker that never started.
    """
    recording(tracker_or_trace, "memviz.report.render()")
    if title is not None and not isinstance(title, str):
        raise InvalidArgumentType(f"title must be a str or None, got {given(title)}")
    collected = _data.collect(tracker_or_trace, title, before_tracking=before_tracking)
    if whatif:
        from memviz.analysis.whatif import rows_json
        collected["whatif"] = rows_json(whatif)
    data, heights = _clean(collected)
    js = _asset("report.js")
    digest = base64.b64encode(hashlib.sha256(js.encode("utf-8")).digest()).decode("ascii")
    from memviz._package import __version__
    return _PAGE.format(
        title=html.escape(data["meta"]["title"]), version=html.escape(__version__),
        script_hash=f"sha256-{digest}", css=_asset("report.css"), data=_script_json(data, heights),
        js=js)


def write(tracker_or_trace: Any, path: "str | os.PathLike[str]", title: Optional[str] = None) -> str:
    """Write :func:`render`'s page to ``path`` (UTF-8); returns the path.

    Written to a temporary file in the same folder, then renamed over
    ``path``; raises :class:`memviz.OutputError` (an OSError) saying why and
    what to do when it cannot be written, leaving an existing file as it was."""
    from memviz._output_files import own_files, write_output

    recording(tracker_or_trace, "memviz.report.write()")
    page = render(tracker_or_trace, title)
    write_output(path, page, "the HTML report", inputs=own_files(tracker_or_trace))
    return os.fspath(path)
