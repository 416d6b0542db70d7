"""Views of the C store (one per process, src/store.h), as the tracker reads it.

* :class:`Store`: the whole store, read as it is now.
* :class:`Window`: a nested tracker's window of it (src/window.h): what was
  allocated after the window opened, with its own totals, peaks and timeline.
* :class:`NoGpuWindow`: a nested tracker with gpu=False, which sees nothing.
* :class:`Frozen`: a copy in Python of the store or of a window, taken at
  one instant before the store is reused or the window closes.

All four offer the same attributes: live, totals, block_totals, peaks,
failures, timeline, threads, stats, peak_rows(dev), tensor_peak_rows(dev),
resolve(ids). Rows are the C core's (read by index). Two peaks: a device's
(``totals``: everything the process holds there) and its tensor peak
(``block_totals``: PyTorch's blocks alone, as ``max_memory_allocated()``).

Imports the C core and capture/callsite.py only (docs/architecture.md: the
capture floor).
"""

from __future__ import annotations

from typing import Optional

import memviz._core as _core
from memviz.capture import callsite as _callsite

__all__ = ["ensure_core", "initialized", "Window", "NoGpuWindow", "Store", "Frozen"]

_initialized = False  # written here only (ensure_core)


def ensure_core() -> None:
    """Set the C store up, once per process."""
    global _initialized
    if not _initialized:
        _core.init()
        _initialized = True


def initialized() -> bool:
    """Whether the C store was set up (its counters can be read)."""
    return _initialized


class Window:
    """A nested tracker's view of the store: what was allocated after `start`
    (window `wid` of src/window.h keeps its totals, peaks and timeline)."""

    def __init__(self, wid: int, start: int) -> None:
        self.id, self.start = wid, start

    @property
    def live(self):
        if _core.active():
            _core.flush()
        return [r for r in _core.live() if r.timestamp_ns > self.start]

    @property
    def totals(self):
        return _core.totals(self.id)

    @property
    def peaks(self):
        return {dev: _core.peak_live(dev, self.id) for dev in _core.totals(self.id)}

    @property
    def block_totals(self):
        return _core.block_totals(self.id)

    def peak_rows(self, dev):
        """The rows live at device ``dev``'s peak (of this window)."""
        return _core.peak_live(dev, self.id) if dev in _core.totals(self.id) else []

    def tensor_peak_rows(self, dev):
        """The rows live at the peak of PyTorch's blocks on ``dev`` (of this window)."""
        return _core.tensor_peak_live(dev, self.id) if dev in _core.block_totals(self.id) else []

    @property
    def failures(self):
        return [r for r in _core.failures() if r.timestamp_ns > self.start]

    @property
    def timeline(self):
        return _core.timeline(self.id)

    @property
    def threads(self):
        return _core.threads()

    @property
    def stats(self):
        return _core.stats()

    def resolve(self, ids):
        return _callsite.resolve(ids)

    def step_mark(self):
        return _core.step_mark(self.id)


class NoGpuWindow(Window):
    """A nested tracker with gpu=False: it sees no GPU memory."""

    def __init__(self) -> None:
        super().__init__(-1, 0)

    live = failures = timeline = property(lambda self: [])
    totals = peaks = block_totals = property(lambda self: {})

    def peak_rows(self, dev):
        return []

    def tensor_peak_rows(self, dev):
        return []

    def step_mark(self):
        return _core.StepMark(({}, []))


class Store(Window):
    """The whole store (window -1), for the tracker that owns it. ``flush``:
    the capture runs for this tracker, so pending events are drained before
    the live set is read (a forked child's copy of the capture is not)."""

    def __init__(self, flush: bool) -> None:
        super().__init__(-1, 0)
        self._flush = flush

    @property
    def live(self):
        if self._flush:
            _core.flush()
        return _core.live()

    def peak_rows(self, dev):
        return _core.peak_live(dev)

    def tensor_peak_rows(self, dev):
        return _core.tensor_peak_live(dev)

    @property
    def failures(self):
        return _core.failures()


class Frozen:
    """A copy of the store's data (or of a nested tracker's window), taken
    before the store is reused. Live allocations, totals, peak sets and the
    timeline are copied at one instant (``_core.copy``), so the copy adds up
    even while other trackers' threads go on allocating."""

    def __init__(self, src: Optional[Window] = None, *, close: bool = False) -> None:
        if _core.active():
            _core.flush()
        if isinstance(src, NoGpuWindow):
            self.live, self.totals, self.peaks, self.timeline, self.failures = [], {}, {}, [], []
            self.block_totals, self.tensor_peaks = {}, {}
        else:
            wid = -1 if src is None else src.id
            c = _core.copy(wid, close)
            self.live, self.totals, self.timeline, when = c.live, c.totals, c.timeline, c.when_ns
            self.peaks = {dev: [r for r in c.peaks if r.device == dev] for dev in self.totals}
            self.block_totals = c.block_totals
            self.tensor_peaks = {dev: [r for r in c.tensor_peaks if r.device == dev]
                                 for dev in self.block_totals}
            after = 0 if src is None else src.start
            self.failures = [r for r in _core.failures() if after < r.timestamp_ns <= when]
        self.threads = _core.threads()
        self.stats = _core.stats()
        ids = {r.stack_id for r in self.live} | {f.stack_id for f in self.failures}
        for rows in list(self.peaks.values()) + list(self.tensor_peaks.values()):
            ids |= {r.stack_id for r in rows}
        ids.discard(0)
        self.stacks = _callsite.resolve(ids) if ids else _callsite.Resolved()

    def peak_rows(self, dev):
        return self.peaks.get(dev, [])

    def tensor_peak_rows(self, dev):
        return self.tensor_peaks.get(dev, [])

    def resolve(self, ids):
        calls = self.stacks.calls
        return _callsite.Resolved({i: self.stacks[i] for i in ids if i in self.stacks},
                                  {i: calls[i] for i in ids if i in calls})
