"""The face of a recording read back from a file: :class:`LoadedTrace` and
:func:`load` (``memviz.load``).

The trace layer (memviz/trace/reader.py) reads the file into a
:class:`~memviz.trace.reader.TraceReader`; this module, on the top floor
beside the tracker, adds what needs the floors above the trace layer: the
diagnoses and the outputs (HTML report, exports, notebook display).
"""

from __future__ import annotations

import os
from typing import Any, List, Optional

import memviz._args as _args
from memviz._errors import TraceError
from memviz.outputs import Outputs
from memviz.trace.reader import TraceReader

__all__ = ["LoadedTrace", "load"]


class LoadedTrace(TraceReader, Outputs):
    """A trace file read back (``memviz.load``), with the reading API of a
    Tracker (a :class:`memviz.model.recording.Recording`, as a Tracker is):
    snapshot(), peak_snapshot(), totals(), failures, timeline(), threads(),
    steps, events(), capture_info(), diagnose(), and the outputs."""

    def diagnose(self) -> List[Any]:
        """Findings about the recorded run (see :func:`memviz.diagnose`)."""
        from memviz.analysis.diagnose import diagnose
        return diagnose(self)


def load(path: str, *, recover: bool = False) -> LoadedTrace:
    """Read a .memviz trace file; returns a :class:`LoadedTrace` with the
    reading API of a Tracker (snapshot(), peak_snapshot(), totals(),
    failures, timeline(), steps, capture_info(), diagnose()).

    Raises :class:`memviz.TraceError` (naming the file and byte offset) for a
    file that is not a trace or is corrupted; with ``recover=True`` a
    corrupted chunk ends the trace there instead, as a cut-off tail does.
    """
    path = _args.path(path, "memviz.load(path)")
    _args.flag(recover, "memviz.load(recover=...)")
    try:
        # Non-blocking: opening a FIFO must not wait for a writer; the mode is
        # read from the open file, so what is checked is what is read.
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        if isinstance(e, IsADirectoryError) or os.path.isdir(path):
            raise _special_file("a directory", path) from e
        raise TraceError(f"cannot read the file: {e.strerror or e}", path,
                         hint="check the path and that you may read it") from e
    try:
        what = _not_a_file(os.fstat(fd).st_mode)
    except OSError:
        what = None
    if what is not None:
        os.close(fd)
        raise _special_file(what, path)
    # Read where it lies, a chunk at a time (the reader keeps the descriptor
    # to read the events again, and closes it when it goes).
    return LoadedTrace.from_fd(fd, path, recover=recover)


def _special_file(what: str, path: str) -> TraceError:
    """The error for a path that is not a regular file, said before reading."""
    if what == "a directory":
        return TraceError("it is a directory, not a trace file", path,
                          hint="give the .memviz file inside it (memviz.track(trace=...), "
                               "Tracker.save() or `memviz run -o` write one)")
    return TraceError(f"it is {what}, not a trace file: memviz reads only regular files, "
                      "since reading this could block or never end", path,
                      hint="give the .memviz file written by memviz.track(trace=...), "
                           "Tracker.save() or `memviz run -o`; to read a trace from a pipe, "
                           "save it to a file first")


def _not_a_file(mode: int) -> Optional[str]:
    """What a file of ``mode`` is, when it is not a regular file."""
    import stat

    for test, what in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return what
    return None if stat.S_ISREG(mode) else "not a regular file"
