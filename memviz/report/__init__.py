"""Reports of what memviz recorded: a self-contained HTML page and notebook views.

    import memviz
    with memviz.track() as t:
        ...
    memviz.report.write(t, "memviz.html")       # one file, opens offline
    html = memviz.report.render(t, title="run 3")

Works on a :class:`~memviz.Tracker` (running or stopped) and on anything with
the same reading API (a trace loaded with ``memviz.load``).
"""

from memviz.report.html import render, write
from memviz.report.notebook import findings_repr_html, snapshot_repr_html, tracker_repr_html

__all__ = ["render", "write", "tracker_repr_html", "snapshot_repr_html", "findings_repr_html"]
