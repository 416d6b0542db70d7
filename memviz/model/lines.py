"""The line an allocation is shown under: the one owner of the rule that
``Snapshot.statistics("lineno")`` / ``"filename"``, ``compare_to``,
``filter_traces``, every report (text, JSON, HTML, notebook, the merged
report of ranks), ``memviz diff``, the diagnoses and the pytest plugin's
messages follow, so that none of them can group differently.

* An allocation with Python frames: its user frame (the innermost
  non-library frame, :attr:`Traceback.user_frame`).
* An allocation with no Python frames made inside an autograd node
  (PyTorch's backward runs on its engine threads, which have none): the
  forward line that made the node, with the node, as a
  :class:`BackwardFrame`: ``train.py:15 (backward: AddmmBackward0)``. Two
  nodes of one forward line are two lines (the user sees which backward op
  holds the memory), and neither is the forward line's own ``train.py:15``.
  When the forward line is unknown it is ``<forward line unknown>``.
* Any other allocation with no Python frames: the pseudo-frame
  ``<thread NAME>`` of its thread.
* An allocation made by ``torch.compile``'s generated code: the model's
  own line that made the FX node, as a :class:`CompiledFrame`
  (``model.py:42 (compiled: aten.addmm)``), put into its traceback when the
  snapshot is built (memviz.model.compiled); the generated frame stays one
  level down.

The ``"traceback"`` key keeps the raw frames: a frameless allocation stands
there under ``<thread NAME>`` whatever node it ran.

Everything here reads allocations duck-typed (``Allocation``,
``FailedAllocation``, a trace's event, a test's stand-in): a missing field
counts as absent. The model floor (docs/architecture.md)."""

from __future__ import annotations

from functools import lru_cache
from operator import itemgetter
from typing import Any, Callable, Optional, Tuple

from memviz.model.traceback import Frame

__all__ = ["BackwardFrame", "CompiledFrame", "UNKNOWN_FORWARD", "line_frame", "pseudo_frame", "thread_frame",
           "backward_frame", "location", "where"]

#: the file name of a backward line whose forward line memviz could not tell
UNKNOWN_FORWARD = "<forward line unknown>"


class _FrameWithNote(Frame):
    """A :class:`Frame` with a fourth item (its ``_NOTE``): it never equals a
    plain Frame of the same line, and two notes of one line differ."""

    __slots__ = ()
    _NOTE = ""

    def __getnewargs__(self):
        return tuple(self)

    def _replace(self, **kw):
        values = [kw.pop(f, v) for f, v in zip(("filename", "lineno", "name", self._NOTE), self)]
        if kw:
            raise ValueError(f"Got unexpected field names: {list(kw)!r}")
        return type(self)(*values)

    def __str__(self) -> str:
        return location(self)


class BackwardFrame(_FrameWithNote):
    """The line of a backward allocation made with no Python frames: the
    forward line that made its autograd node (``filename``, ``lineno``; no
    function ``name``) and the node (``autograd_node``).

    A :class:`Frame` with a fourth item: it never equals a plain Frame (the
    forward line's own allocations), and two nodes of one line differ.
    ``str()``: ``train.py:15 (backward: AddmmBackward0)``."""

    __slots__ = ()
    _NOTE = "autograd_node"

    def __new__(cls, filename: str, lineno: int, name: str = "", autograd_node: str = ""):
        return tuple.__new__(cls, (filename, lineno, name, autograd_node))

    autograd_node = property(itemgetter(3), doc="the autograd node (``AddmmBackward0``)")

    def __repr__(self) -> str:
        return f"<BackwardFrame {self.filename}:{self.lineno} backward {self.autograd_node}>"


class CompiledFrame(_FrameWithNote):
    """A model's line that ``torch.compile`` compiled, as the line of a buffer
    the generated code allocated: the file, line and function of the FX
    node's source (``filename``, ``lineno``, ``name``) and what the
    generated code did there (``compiled``: ``compiled: aten.addmm``,
    ``compiled: aten.mul, fused with 2 more``, ``compiled backward:
    aten.mm``; memviz.model.compiled).

    A :class:`Frame` with a fourth item: it never equals a plain Frame (the
    same line run eagerly), and two ops of one line differ.
    ``str()``: ``model.py:42 (compiled: aten.addmm)``."""

    __slots__ = ()
    _NOTE = "compiled"

    def __new__(cls, filename: str, lineno: int, name: str = "", compiled: str = "compiled"):
        return tuple.__new__(cls, (filename, lineno, name, compiled))

    compiled = property(itemgetter(3), doc="what the compiled code did there (``compiled: aten.mm``)")

    def __repr__(self) -> str:
        return f"<CompiledFrame {self.filename}:{self.lineno} in {self.name or '?'} ({self.compiled})>"


def _forward_parts(forward: str) -> Tuple[str, int]:
    """(file, line) of a forward line as labels carry it: ``"file:line"``."""
    head, sep, tail = forward.rpartition(":")
    if sep and head and tail.isdigit():
        return head, int(tail)
    return forward, 0


@lru_cache(maxsize=4096)
def backward_frame(node: str, forward: Optional[str]) -> BackwardFrame:
    """The line of backward memory: autograd ``node``'s ``forward`` line
    (``"file:line"`` as labels carry it; None: not known)."""
    filename, lineno = _forward_parts(forward) if forward else (UNKNOWN_FORWARD, 0)
    return BackwardFrame(filename, lineno, "", node)


@lru_cache(maxsize=1024)
def thread_frame(thread_name: str) -> Frame:
    """The pseudo-frame ``<thread NAME>`` (line 0) of a frameless allocation."""
    return Frame(f"<thread {thread_name}>", 0, "")


def _thread_name(a: Any) -> str:
    thread = getattr(a, "thread", None)
    name = getattr(thread, "name", None)
    return name if isinstance(name, str) else (thread if isinstance(thread, str) else "?")


def pseudo_frame(a: Any) -> Frame:
    """The frame a frameless allocation is shown under: its node's forward
    line (:class:`BackwardFrame`) when it ran in an autograd node, else its
    thread's ``<thread NAME>``."""
    node = getattr(a, "autograd_node", None)
    if node:
        return backward_frame(node, getattr(a, "forward", None) or None)
    return thread_frame(_thread_name(a))


def line_frame(a: Any, pick: Optional[Callable[[Any], Any]] = None) -> Frame:
    """The frame an allocation (or failure) is shown and grouped under (the
    module docstring's rule). ``pick(traceback)`` chooses the user's frame
    (a snapshot's filter); the traceback's own choice when None."""
    tb = getattr(a, "traceback", None)
    if tb:
        frame = pick(tb) if pick is not None else tb.user_frame
        if frame is not None:
            return frame
    return pseudo_frame(a)


def location(frame: Any, path: Callable[[str], str] = str) -> str:
    """How a line is written: ``file:line``, ``file:?`` (line unknown), a
    pseudo-frame's name (``<thread NAME>``), each followed by
    `` (backward: NODE)`` for a backward line; ``path`` shortens the file
    name (the reports' relative paths)."""
    filename = getattr(frame, "filename", None)
    if filename is None:
        return str(frame)
    lineno = getattr(frame, "lineno", 0) or 0
    if lineno > 0:
        text = f"{path(filename)}:{lineno}"
    elif filename.startswith("<") and filename.endswith(">"):  # <thread NAME>, <forward line unknown>
        text = filename
    else:
        text = f"{path(filename)}:?"
    node = getattr(frame, "autograd_node", None)
    if node:
        return f"{text} (backward: {node})"
    compiled = getattr(frame, "compiled", None)
    return f"{text} ({compiled})" if isinstance(compiled, str) and compiled else text


def where(a: Any, path: Callable[[str], str] = str) -> str:
    """The line of an allocation or failure as text (:func:`line_frame`, :func:`location`)."""
    return location(line_frame(a), path)
