"""How a model object shows itself in a notebook, without the model knowing HTML.

The report layer registers one renderer per kind when it is imported
(memviz/report/html.py registers "snapshot"), and the package face imports
the report, so a renderer is there whenever memviz is. The model asks here
and never imports a floor above it.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional

__all__ = ["register", "html"]

_renderers: Dict[str, Callable[[Any], str]] = {}


def register(kind: str, render: Callable[[Any], str]) -> None:
    """Draw objects of ``kind`` ("snapshot") with ``render(obj) -> str``."""
    _renderers[kind] = render


def html(kind: str, obj: Any) -> Optional[str]:
    """The HTML of ``obj``, or None (IPython then shows its repr) when no
    renderer is registered for ``kind``."""
    render = _renderers.get(kind)
    return render(obj) if render is not None else None
