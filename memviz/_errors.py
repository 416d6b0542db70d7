"""Exceptions raised by memviz.

Every message says what happened and what to do about it. All exceptions
derive from :class:`MemvizError`, so ``except memviz.MemvizError`` catches
everything memviz raises on purpose.
"""

from __future__ import annotations

from typing import Iterable, Optional

__all__ = [
    "MemvizError",
    "CaptureUnavailable",
    "CaptureConflict",
    "AlreadyTracking",
    "NotTracking",
    "TraceError",
    "InvalidArgument",
    "InvalidArgumentType",
    "OutputError",
]


class MemvizError(Exception):
    """Base class of all errors memviz raises deliberately."""


class CaptureUnavailable(MemvizError):
    """A GPU is present but memviz cannot capture allocations through CUPTI.

    Raised when libcupti cannot be found or loaded, is too old for the driver,
    or the process is not allowed to use the profiling interface.

    Attributes:
        reason: one line saying what went wrong.
        tried: what memviz tried, in order (library paths, calls and their
            results), as human-readable strings.
        hint: what to do about it.
    """

    DEFAULT_HINT = (
        "Install the CUPTI library that matches your CUDA driver (it ships with "
        "the CUDA toolkit and with the nvidia-cuda-cupti pip packages) and make "
        "sure it can be found, e.g. by adding its directory to LD_LIBRARY_PATH. "
        "If CUPTI loads but reports insufficient privileges, the driver restricts "
        "profiling to administrators: run as root or with CAP_SYS_ADMIN, or set "
        "the nvidia module option NVreg_RestrictProfilingToAdminUsers=0."
    )

    def __init__(
        self,
        reason: str = "CUPTI could not be initialised",
        tried: Optional[Iterable[str]] = None,
        hint: Optional[str] = None,
    ) -> None:
        self.reason = reason
        self.tried = list(tried) if tried is not None else []
        self.hint = hint if hint is not None else self.DEFAULT_HINT
        lines = [f"memviz cannot capture GPU allocations: {reason.rstrip('.')}."]
        if self.tried:
            lines.append("Tried:")
            lines.extend(f"  - {item}" for item in self.tried)
        lines.append(f"What to do: {self.hint}")
        super().__init__("\n".join(lines))

    def __reduce__(self):
        return (type(self), (self.reason, self.tried, self.hint))


class CaptureConflict(MemvizError):
    """Another CUPTI subscriber already holds this process.

    CUPTI allows a single callback subscriber per process; when a profiler such
    as Nsight Systems, Nsight Compute, ``torch.profiler`` (Kineto) or DCGM
    profiling got there first, memviz cannot subscribe.

    Attributes:
        holder: who holds the subscription, when memviz could tell (e.g.
            ``"torch.profiler (Kineto)"``), else ``None``.
    """

    def __init__(self, holder: Optional[str] = None, detail: Optional[str] = None) -> None:
        self.holder = holder
        self.detail = detail
        who = holder if holder else "another tool (unknown)"
        message = (
            f"memviz cannot capture GPU allocations: CUPTI is already in use in this "
            f"process by {who}, and CUPTI allows only one subscriber per process."
        )
        if detail:
            message += f" ({detail})"
        if holder and "memviz" in holder.lower():
            message += (
                " That subscriber is memviz itself: another copy of memviz in this process "
                "(two installs, or a vendored copy), or the parent process this one was "
                "fork()ed from while it tracked. What to do: use one memviz and stop its "
                "tracker first; in a fork()ed child, use the 'spawn' or 'forkserver' start "
                "method to capture GPU memory."
            )
        else:
            message += (
                " What to do: leave cupti= out (or pass cupti=False): memviz then goes on "
                "without CUPTI, seeing PyTorch's memory through its allocator; or stop the other "
                "profiler before starting memviz (leave the torch.profiler context, or do not "
                "run under nsys/ncu); or run memviz in a separate process."
            )
        super().__init__(message)

    def __reduce__(self):
        return (type(self), (self.holder, self.detail))


class AlreadyTracking(MemvizError):
    """A tracker was started twice, or a nested tracker asked for something the
    running capture fixed.

    Trackers nest (``memviz.track()`` inside a running tracker sees its own
    window of the shared capture); what cannot be shared is refused: another
    ``depth``, ``precise=True`` when the outer tracker is not precise, a
    nested tracker's own ``trace=`` file, and more nested trackers than memviz
    keeps figures for at once. The message says which and what to do.
    """

    def __init__(self, message: Optional[str] = None) -> None:
        if message is None:
            message = (
                "this memviz tracker cannot start here. What to do: create a new tracker "
                "with memviz.track() for each block, and start nested trackers without "
                "options that differ from the running one (depth, precise, trace)."
            )
        super().__init__(message)


class NotTracking(MemvizError):
    """``stop()`` (or a call that needs a session) ran while nothing is tracking."""

    def __init__(self, message: Optional[str] = None) -> None:
        if message is None:
            message = (
                "memviz is not tracking GPU allocations, so there is nothing to stop. "
                "What to do: call start() (or enter a memviz.track() block) first, "
                "and call stop() once per start()."
            )
        super().__init__(message)


class GraphNotRecorded(MemvizError):
    """``snapshot.graph_resident()`` on a snapshot whose tracker did not
    record what autograd graphs keep (no saved-tensor hooks were installed)."""

    def __init__(self, message: Optional[str] = None) -> None:
        if message is None:
            message = (
                "this snapshot has no record of what autograd graphs keep for backward: its tracker "
                "did not install saved-tensor hooks (they need PyTorch, and are off unless asked for). "
                "What to do: track with memviz.track(graph=True) (or autograd=True; precise mode "
                "leaves them off because they cost several microseconds per saved tensor). Tensors "
                "that live graphs keep are still in snapshot.statistics('category') as 'activation'."
            )
        super().__init__(message)


class TraceError(MemvizError):
    """A .memviz trace file cannot be read (or written).

    Raised for a file that is not a memviz trace, was written by a newer
    memviz, or is corrupted; the message names the file and the byte offset
    where reading stopped. A trace whose *tail* is missing (the process was
    killed while writing) is not an error: :func:`memviz.load` returns what was
    complete and sets ``.truncated``.

    Attributes:
        path: the file (``None`` when reading bytes in memory).
        offset: the byte offset of the problem in the file, or ``None`` when
            it concerns the whole file (e.g. it cannot be opened).
        reason: the problem, without the file name and offset.
    """

    def __init__(self, reason: str, path: Optional[str] = None, offset: Optional[int] = None,
                 hint: Optional[str] = None) -> None:
        self.reason = reason
        self.path = path
        self.offset = offset
        self.hint = hint
        where = f"memviz trace {path!r}" if path is not None else "memviz trace"
        if offset is not None:
            where += f" at byte {offset:,}"
        message = f"{where}: {reason.rstrip('.')}."
        if hint:
            message += f" What to do: {hint}"
        super().__init__(message)

    def __reduce__(self):
        return (type(self), (self.reason, self.path, self.offset, self.hint))


class InvalidArgument(MemvizError, ValueError):
    """An argument memviz cannot use: the message names the argument, what
    was given and what is accepted. Also a :class:`ValueError`, so code that
    catches ``ValueError`` keeps working."""

    def __init__(self, message: str) -> None:
        super().__init__(message)

    def __reduce__(self):
        return (type(self), (str(self),))


class InvalidArgumentType(InvalidArgument, TypeError):
    """An argument of a type memviz does not accept (a :class:`TypeError`
    too, and an :class:`InvalidArgument`)."""


class OutputError(MemvizError, OSError):
    """memviz cannot write an output file (a report, an export, a step log).

    Also an :class:`OSError` (``errno`` is the system's error number when
    there is one), so code that catches ``OSError`` keeps working. Nothing is
    left half-written: a file memviz replaces stays as it was.

    Attributes:
        what: what was being written (e.g. ``"the HTML report"``).
        path: the output path.
        reason: the problem, without the path.
        hint: what to do about it.
    """

    def __init__(self, what: str, path: Optional[str], reason: str, hint: Optional[str] = None,
                 errno: Optional[int] = None) -> None:
        self.what, self.path, self.reason = what, path, reason
        self.hint = hint if hint is not None else (
            "check that the folder exists and that you may write there, that the disk is not "
            "full, or choose another path")
        message = f"memviz cannot write {what} to {path!r}: {reason.rstrip('.')}. What to do: {self.hint}"
        super().__init__(message)
        self.errno, self.filename = errno, path
        self.strerror = reason
        self._message = message

    def __str__(self) -> str:
        return self._message

    def __reduce__(self):
        return (type(self), (self.what, self.path, self.reason, self.hint, self.errno))
