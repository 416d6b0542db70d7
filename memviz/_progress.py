"""Progress on stderr for work that takes a while (reading a big trace,
writing a report or an export): one line, redrawn in place.

The work reports into it from any floor (``update(done, total, what)``:
the trace reader says how many bytes of the file it has read); it costs a
global read when nobody shows it. Only a command turns it on, around its
work (``shown(prog)``: ``memviz report``, ``memviz diff``, the exports),
and then the line appears only when stderr is a terminal and the work has
run for more than a second; it is cleared when the work ends, before the
command prints its result. So nothing appears when stderr is a pipe or a
file, and nothing for short work.

At the bottom of the house (docs/architecture.md): imports nothing of memviz.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from typing import IO, Iterable, Iterator, Optional

__all__ = ["shown", "update", "DELAY_S"]

#: work shorter than this shows nothing
DELAY_S = 1.0
#: the line is redrawn at most this often
INTERVAL_S = 0.1


class _Line:
    """The progress line of one command on ``stream`` (a terminal)."""

    def __init__(self, prog: str, stream: IO[str], delay: float) -> None:
        self.prog, self.stream = prog, stream
        self.start = time.monotonic()
        self.delay = delay
        self.last = 0.0
        self.drawn = False
        self.thread = threading.get_ident()

    def update(self, done: int, total: Optional[int], what: str) -> None:
        if threading.get_ident() != self.thread:  # one writer: the command's own thread
            return
        now = time.monotonic()
        if now - self.start < self.delay or now - self.last < INTERVAL_S:
            return
        self.last = now
        if total:
            pct = min(100, max(0, done * 100 // total))
            text = f"{self.prog}: {what}: {pct}% of {_mb(total)}"
        else:
            text = f"{self.prog}: {what}..."
        self._write("\r" + text[:200] + "\x1b[K")
        self.drawn = True

    def clear(self) -> None:
        if self.drawn:
            self._write("\r\x1b[K")
            self.drawn = False

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):  # stderr closed or gone: no progress, no failure
            self.drawn = False


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB" if n >= 1e5 else f"{n:,} bytes"


_line: Optional[_Line] = None


def in_worker() -> None:
    """In a worker process (fork()ed from one that shows a line): forget the
    parent's line, so that the worker draws none of its own."""
    global _line
    _line = None


def update(done: int, total: Optional[int], what: str) -> None:
    """``done`` of ``total`` (bytes; None or 0: no measure) of the work
    ``what`` ("reading run.memviz"); drawn only inside :func:`shown`."""
    line = _line
    if line is not None:
        line.update(done, total, what)


def _is_terminal(stream: IO[str]) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


class _Clearing:
    """A stream that clears the progress line before anything else is
    written to it (an error, a warning, the report itself on stdout), while
    the line is shown."""

    def __init__(self, stream: IO[str], line: _Line) -> None:
        self._stream, self._line = stream, line

    def write(self, text: str) -> int:
        self._line.clear()
        return self._stream.write(text)

    def writelines(self, lines: Iterable[str]) -> None:
        self._line.clear()
        self._stream.writelines(lines)

    def __getattr__(self, name: str) -> object:
        return getattr(self._stream, name)


@contextlib.contextmanager
def shown(prog: str, stream: Optional[IO[str]] = None,
          delay: Optional[float] = None) -> Iterator[None]:
    """Show the progress reported inside the block on ``stream`` (stderr),
    when it is a terminal, once the block has run ``delay`` seconds
    (DELAY_S); the
    line is cleared when the block ends, and before anything else is
    printed on stdout or stderr inside it. Nested blocks leave the outer
    one's line in charge."""
    global _line
    stream = sys.stderr if stream is None else stream
    if _line is not None or stream is None or not _is_terminal(stream):
        yield
        return
    line = _line = _Line(prog, stream, DELAY_S if delay is None else delay)
    saved = sys.stdout, sys.stderr
    sys.stdout = _Clearing(sys.stdout, line) if sys.stdout is not None else None  # type: ignore
    sys.stderr = _Clearing(sys.stderr, line) if sys.stderr is not None else None  # type: ignore
    try:
        yield
    finally:
        _line = None
        if isinstance(sys.stdout, _Clearing) and sys.stdout._stream is saved[0]:
            sys.stdout = saved[0]
        if isinstance(sys.stderr, _Clearing) and sys.stderr._stream is saved[1]:
            sys.stderr = saved[1]
        line.clear()
