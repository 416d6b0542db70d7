"""The tracemalloc-shaped functions of the running tracker:
``memviz.get_traced_memory()`` and ``memviz.reset_peak()``.

They read :func:`memviz.capture.session.active_tracker` (duck-typed: its
``totals()`` and ``reset_peak()``), under the trackers' state lock. Imports
the bottom floor and capture/session.py only (docs/architecture.md: the
capture floor).
"""

from __future__ import annotations

from typing import Optional, Tuple

import memviz._args as _args
from memviz.capture.session import active_tracker, lock as _state_lock

__all__ = ["get_traced_memory", "reset_peak"]




def get_traced_memory(device: Optional[int] = None) -> Tuple[int, int]:
    """``(current, peak)`` bytes of the running tracker, like
    :func:`tracemalloc.get_traced_memory`.

    With ``device=None``, summed over the CUDA devices (pinned host memory is
    left out): ``current`` is the sum of the bytes live on each device, and
    ``peak`` the sum of each device's own peak. Devices may peak at different
    moments, so with several devices ``peak`` is an upper bound of what was
    live on all of them at once (never below ``current``); with one device it
    is that device's peak. ``device=N`` gives CUDA device ``N`` alone and
    ``device=-1`` pinned host memory. ``(0, 0)`` where nothing was allocated,
    or when the tracker does not capture GPU memory (``gpu=False``).

    The running tracker is :func:`active_tracker`'s (a nested tracker counts
    what was allocated after it started). ``(0, 0)`` when no tracker runs, as
    tracemalloc answers when it is not tracing (a stopped tracker keeps its
    figures: ``t.current_bytes()``, ``t.peak_bytes()``); :func:`reset_peak`
    restarts the peak."""
    _args.whole(device, "memviz.get_traced_memory(device=...)", none=True)
    t = active_tracker()
    if t is None:
        return 0, 0
    with _state_lock:
        totals = t.totals()
    if device is not None:
        got = totals.get(device, {})
        return got.get("current", 0), got.get("peak", 0)
    cuda = [v for d, v in totals.items() if d >= 0]
    return sum(v["current"] for v in cuda), sum(v["peak"] for v in cuda)


def reset_peak() -> None:
    """Restart the running tracker's peak at the current figures, on every
    device, like :func:`tracemalloc.reset_peak` (see :meth:`Tracker.reset_peak`).

    Does nothing when no tracker runs, as tracemalloc does when it is not
    tracing."""
    t = active_tracker()
    if t is not None:
        t.reset_peak()
