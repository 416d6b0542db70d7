"""A tracker's reading API over the C store: snapshots, peak snapshots,
totals, failures, timeline and threads (and reset_peak(), which restarts
what peak_snapshot() reads), read from the view that holds this
tracker's data (memviz/capture/store.py): the whole store while the tracker
is the latest, its window while nested, or its frozen copy once the store
went on without it.

:class:`StoreReading` is a mixin of :class:`memviz.Tracker`; it reads these
attributes of it: ``_frozen``, ``_view``, ``started_ns``, ``_running``,
``gpu_enabled``, ``frame_filter`` and, where present, ``torch`` (the PyTorch
integration) and ``graph``.

Imports the bottom floor, the model, capture/store.py and capture/running.py only
(docs/architecture.md: the capture floor).
"""

from __future__ import annotations

import time
from typing import Any, Dict, List, Optional

import memviz._args as _args
import memviz._core as _core
from memviz._errors import NotTracking
from memviz.capture.running import lock
from memviz.capture.store import NoGpuWindow, Store, Window
from memviz.model.failures import FailedAllocation, failed_allocations
from memviz.model.recording import TotalsReads, thread_table
from memviz.model.rows import snapshot_from_raw
from memviz.model.snapshot import Snapshot

__all__ = ["StoreReading"]


class StoreReading(TotalsReads):
    """Mixin: the reading methods of a Tracker (see the module's docstring)."""

    _frozen: Any
    _view: Optional[Window]

    def _source(self):
        """The frozen copy or nested window of this tracker, or None: the
        store itself. Raises NotTracking for a tracker that never started."""
        if self._frozen is not None:
            return self._frozen
        if self.started_ns is None:
            raise NotTracking("this tracker never started: use `with memviz.track() as t:` or t.start().")
        return self._view

    def _reader(self):
        """The view this tracker's figures are read from (never None)."""
        src = self._source()
        return src if src is not None else Store(flush=self._running and self.gpu_enabled)

    def snapshot_raw(self) -> Snapshot:
        """The live allocations, without the PyTorch integration's categories."""
        src = self._reader()
        return snapshot_from_raw(src.live, src.resolve, src.threads, self.frame_filter,
                                 timestamp_ns=time.monotonic_ns())

    def snapshot(self) -> Snapshot:
        """The allocations live now (or when the tracker stopped).

        With the PyTorch integration each allocation carries its category,
        the snapshot carries PyTorch's own figures (``snap.torch_stats``) and
        ``snap.graph_resident()`` lists what autograd graphs keep."""
        return self._decorate(self.snapshot_raw(), live_now=True)

    def _decorate(self, snap: Snapshot, live_now: bool) -> Snapshot:
        integ = getattr(self, "torch", None)
        if integ is not None and self._frozen is None:
            snap = integ.categorize(snap, live_now=live_now)
        graph = getattr(self, "graph", None)
        snap.graph_records = graph.resident() if graph is not None else None
        return snap

    def peak_snapshot(self, device: Optional[int] = None) -> Snapshot:
        """The allocations live at the moment of a device's peak.

        With ``device=None``: every device, each at its own peak.
        """
        _args.whole(device, "peak_snapshot(device=...)", none=True)
        src = self._reader()
        totals = src.totals
        devices = [device] if device is not None else sorted(totals)
        rows: List[tuple] = []
        for dev in devices:
            rows.extend(src.peak_rows(dev))
        ts = max((totals[d]["peak_timestamp_ns"] for d in devices if d in totals), default=None)
        snap = snapshot_from_raw(rows, src.resolve, src.threads, self.frame_filter, timestamp_ns=ts)
        return self._decorate(snap, live_now=False)

    def totals(self) -> Dict[int, Dict[str, int]]:
        """Per device (-1: pinned host memory): current, peak, allocs, frees, failed, ..."""
        return dict(self._reader().totals)

    @property
    def failures(self) -> List[FailedAllocation]:
        """Allocations the driver refused (the last 256), oldest first."""
        src = self._reader()
        return failed_allocations(src.failures, src.resolve, src.threads, self.frame_filter)

    def reset_peak(self) -> None:
        """Restart this running tracker's peaks at the current figures, like
        :func:`tracemalloc.reset_peak`: from now on ``peak_bytes()``,
        ``totals()`` and ``peak_snapshot()`` (whose peak set becomes what is
        live now) report the highest memory since this call, on every device.

        A nested tracker resets its own peaks only; the enclosing tracker keeps
        its own. Step records are not affected (each step has its own peak),
        and a trace file keeps every event, so ``memviz.load()`` of it finds
        the whole run's peak. Raises NotTracking when the tracker is not
        running."""
        with lock:
            if not self._running:
                raise NotTracking(
                    "reset_peak() restarts the peak of a running tracker, and this tracker is not "
                    "running. What to do: call it inside the `with memviz.track() as t:` block; a "
                    "stopped tracker's peak is what it was when it stopped.")
            if self._view is not None:
                if not isinstance(self._view, NoGpuWindow):
                    _core.reset_peak(self._view.id)
            elif self._frozen is None:
                if self.gpu_enabled:
                    _core.flush()
                _core.reset_peak()

    def timeline(self) -> List[tuple]:
        """(timestamp_ns, device, live bytes) points; bounded, peaks kept."""
        return list(self._reader().timeline)

    def threads(self) -> Dict[int, tuple]:
        """{thread index: (native id, ident, name)} of the threads that allocated."""
        return thread_table(self._reader().threads)
