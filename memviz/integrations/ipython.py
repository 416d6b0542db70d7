"""IPython / Jupyter integration: ``%load_ext memviz``, the ``%%memviz`` cell
magic and the ``%memviz`` line magic.

::

    %load_ext memviz

    %%memviz --top 5
    x = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")

    %memviz --top 5 y = model(x)      # one statement, as %timeit takes one

runs the cell under :func:`memviz.track`, shows the compact report under the
cell (summary, a small timeline per device, the top lines at the peak) and
keeps the tracker in the notebook as ``_memviz`` for more questions
(``_memviz.peak_snapshot().statistics("lineno")``, ``_memviz.to_html("report.html")``).
Nothing is fetched from the network; the report is static HTML.

Options: ``--no-gpu`` (track without GPU capture), ``--top N`` (lines shown,
default 10), ``--depth N`` (Python frames kept per allocation, at most
memviz._core.MAX_DEPTH, as for ``memviz run``).
"""

from __future__ import annotations

import argparse
import shlex
from typing import Any, List, Optional

import memviz._core as _core
from memviz._args import whole_option

__all__ = ["load_ipython_extension", "unload_ipython_extension", "memviz_cell", "memviz_line", "split_line",
           "parse_options"]

USAGE = "%%memviz [--no-gpu] [--top N] [--depth N] (a cell), or %memviz [options] STATEMENT (a line)"
_top = whole_option(1)
_depth = whole_option(1, _core.MAX_DEPTH)  # as memviz run --depth


class MagicUsageError(ValueError):
    """The %%memviz line had options memviz does not know; the message says which."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # raise instead of exiting the kernel
        raise MagicUsageError(f"%%memviz: {message}. Usage: {USAGE}")


def parse_options(line: str) -> argparse.Namespace:
    """The options of a ``%%memviz`` line; MagicUsageError says what is wrong."""
    p = _Parser(prog="%%memviz", add_help=False)
    p.add_argument("--no-gpu", action="store_true", dest="no_gpu")
    p.add_argument("--top", type=_top, default=10)
    p.add_argument("--depth", type=_depth, default=None)
    try:
        words: List[str] = shlex.split(line or "")
    except ValueError as e:
        raise MagicUsageError(f"%%memviz: cannot read the options {line!r} ({e}). Usage: {USAGE}") from None
    return p.parse_args(words)


def memviz_cell(line: str, cell: str, ipython: Optional[Any] = None) -> Any:
    """Run ``cell`` under memviz.track() in ``ipython`` and display the report.

    Returns the tracker (also stored as ``_memviz`` in the user namespace)."""
    from IPython.display import HTML, display

    from memviz.report.notebook import tracker_repr_html
    from memviz.tracker import track

    if ipython is None:
        from IPython import get_ipython
        ipython = get_ipython()
    if ipython is None:
        raise RuntimeError("%%memviz needs a running IPython shell or Jupyter kernel.")
    try:
        opts = parse_options(line)
    except MagicUsageError as e:
        display(HTML(f"<pre style='color:#c0392b'>{_escape(str(e))}</pre>"))
        return None
    kwargs = {"gpu": not opts.no_gpu}
    if opts.depth is not None:
        kwargs["depth"] = opts.depth
    tracker = track(**kwargs)
    ipython.user_ns["_memviz"] = tracker
    with tracker:
        # run_cell shows the cell's own output and exceptions like any cell;
        # the tracker stops whatever the cell does.
        ipython.run_cell(cell, store_history=False)
    display(HTML(tracker_repr_html(tracker, top=opts.top, name="_memviz")))
    return tracker


def split_line(line: str) -> "tuple[str, str]":
    """(options, statement) of a ``%memviz`` line: the leading options, then
    the statement to run, kept as written (as ``%timeit`` reads its line)."""
    rest = (line or "").lstrip()
    opts: List[str] = []
    while rest.startswith("--"):
        word, _, after = rest.partition(" ")
        takes = word in ("--top", "--depth")
        if takes:
            value, _, after = after.lstrip().partition(" ")
            word += " " + value
        opts.append(word)
        rest = after.lstrip()
    return " ".join(opts), rest


def memviz_line(line: str, ipython: Optional[Any] = None) -> Any:
    """``%memviz [options] STATEMENT``: run one statement as ``%%memviz`` runs
    a cell. With no statement, say how it is used."""
    options, statement = split_line(line)
    if not statement.strip():
        from IPython.display import HTML, display
        display(HTML(f"<pre>{_escape('Usage: ' + USAGE)}</pre>"))
        return None
    return memviz_cell(options, statement, ipython)


def _escape(text: str) -> str:
    import html
    return html.escape(text)


def load_ipython_extension(ipython: Any) -> None:
    """Register ``%%memviz`` and ``%memviz`` (called by ``%load_ext memviz``)."""

    def memviz(line: str, cell: Optional[str] = None) -> None:
        if cell is None:
            memviz_line(line, ipython)
        else:
            memviz_cell(line, cell, ipython)

    memviz.__doc__ = __doc__
    ipython.register_magic_function(memviz, magic_kind="line_cell", magic_name="memviz")


def unload_ipython_extension(ipython: Any) -> None:
    """Nothing to undo: the magic stays registered until the kernel restarts."""
