"""Frames and tracebacks: where an allocation was made, oldest frame first
(the shape of :mod:`tracemalloc`'s ``Frame`` and ``Traceback``)."""

from __future__ import annotations

import linecache
from typing import Any, Iterable, List, NamedTuple, Optional, Sequence

from memviz._args import flag, whole
from memviz.model.frame_filter import FrameFilter, frames as _default_filter

_FRAME_KEYS = ("lineno", "filename", "traceback")


class Frame(NamedTuple):
    """One Python frame: file name, line number and function name.

    ``lineno`` is 0 when the line is unknown; ``str()`` then shows ``file:?``.
    """

    filename: str
    lineno: int
    name: str = ""

    #: the autograd node of a backward line (:class:`memviz.model.lines.BackwardFrame`); None here
    autograd_node = None
    #: what compiled code did on a model's line (:class:`memviz.model.lines.CompiledFrame`); None here
    compiled = None

    def __str__(self) -> str:
        lineno = self.lineno
        if lineno is None or lineno <= 0:
            if self.filename.startswith("<thread "):
                return self.filename
            return f"{self.filename}:?"
        return f"{self.filename}:{lineno}"

    def __repr__(self) -> str:
        return f"<Frame {self.filename}:{self.lineno} in {self.name or '?'}>"


class Traceback(tuple):
    """The Python stack of an allocation: a tuple of :class:`Frame`, oldest to
    most recent, as :class:`tracemalloc.Traceback` (``tb[-1]`` is the frame
    that asked for the memory, ``tb[0]`` the outermost one memviz kept).

    Args:
        frames: the frames, oldest first.
        frame_filter: decides :attr:`user_frame` (``memviz.frames`` if None).
        total_nframe: how many frames the stack had before memviz kept only
            its ``depth`` most recent ones; ``len(frames)`` when not given.

    Empty when the allocating thread had no Python frames. Equal tracebacks
    compare and hash equal whatever filter they carry.
    """

    #: read by FrameFilter.pick: this sequence runs oldest to most recent
    _oldest_first = True

    def __new__(cls, frames: Iterable[Frame] = (), frame_filter: Optional[FrameFilter] = None,
                total_nframe: Optional[int] = None):
        self = tuple.__new__(cls, frames)
        if total_nframe is not None:
            whole(total_nframe, "Traceback(total_nframe=...)", len(self))
        self._filter = frame_filter
        self._total = total_nframe
        self._user = None  # (filter, generation, frame) cache
        return self

    @property
    def total_nframe(self) -> int:
        """The number of frames the stack had before memviz truncated it to
        its capture depth (``track(depth=...)``).

        memviz's capture keeps at most ``depth`` frames and does not count
        the others, so this is ``len(self)`` unless the traceback was built
        with a known total: exact for every stack shorter than the depth,
        and a lower bound for one exactly as deep. A deeper stack keeps its
        innermost frames and, when none of them is the user's, gives the
        last quarter to the first user frame beyond them and its callers
        (src/frames.c): the frames in between are missing."""
        return len(self) if self._total is None else self._total

    @property
    def frame_filter(self) -> FrameFilter:
        """The filter used by :attr:`user_frame` (the default ``frames`` if none given)."""
        return self._filter if self._filter is not None else _default_filter

    @property
    def user_frame(self) -> Optional[Frame]:
        """The innermost non-library frame (the innermost frame if all are library
        frames); ``None`` for an empty traceback."""
        flt = self.frame_filter
        cached = self._user
        if cached is not None and cached[0] is flt and cached[1] == flt.generation:
            return cached[2]
        frame = flt.pick(self)
        self._user = (flt, flt.generation, frame)
        return frame

    def format(self, limit: Optional[int] = None, most_recent_first: bool = False) -> List[str]:
        """Format like :meth:`tracemalloc.Traceback.format`: a list of lines.

        Frames are listed oldest first unless ``most_recent_first``. A positive
        ``limit`` keeps the ``limit`` most recent frames, a negative one the
        ``-limit`` oldest (the frames are chosen before the order is applied).
        Source lines come from :mod:`linecache` when the file is readable.
        """
        whole(limit, "Traceback.format(limit=...)", none=True)
        flag(most_recent_first, "Traceback.format(most_recent_first=...)")
        chosen = list(self)
        if limit is not None:
            chosen = chosen[-limit:] if limit > 0 else chosen[:limit]
        if most_recent_first:
            chosen.reverse()
        lines: List[str] = []
        for frame in chosen:
            lineno = frame.lineno if frame.lineno and frame.lineno > 0 else None
            head = f'  File "{frame.filename}", line {lineno if lineno else "?"}'
            if frame.name:
                head += f", in {frame.name}"
            lines.append(head)
            if lineno:
                try:
                    source = linecache.getline(frame.filename, lineno).strip()
                except ValueError:  # a name no path can be: a lone surrogate, a NUL
                    source = ""
                if source:
                    lines.append(f"    {source}")
        return lines

    def __str__(self) -> str:
        frame = self.user_frame
        return str(frame) if frame is not None else "<no Python frames>"

    def __repr__(self) -> str:
        return f"<Traceback {len(self)} frame(s), user frame {self}>"

    def __reduce__(self):
        return (Traceback, (tuple(self), None, self._total))


def innermost_first(frames: Sequence[Any]) -> Sequence[Any]:
    """The frames of a stack, most recent first: a :class:`Traceback`
    reversed; any other sequence (a raw stack of the C core, a duck-typed
    report source's frames) as given, since those run innermost first."""
    return frames[::-1] if getattr(frames, "_oldest_first", False) else frames


EMPTY_TRACEBACK = Traceback()
