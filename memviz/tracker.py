"""track() / Tracker: start and stop capture, and the module-level API
(memviz.track, start, stop, get_traced_memory, reset_peak, capture_info).

The C store is one per process. A Tracker reads it while it is the latest
tracker; when a newer tracker starts, the older one's data is first copied
into Python (``_freeze``), so every Tracker stays readable after its block.

Nesting. A tracker started while another runs (in any thread) is nested: it
shares the running capture (CUPTI subscription, depth, precise mode) and
reads a window of the store (src/window.h) opened when it started: what was
allocated after that, its own peak, peak set, timeline, failures and step
marks, as if tracking had started there. Memory already live then is known
(``baseline``; its frees are not the nested tracker's). The enclosing
tracker keeps everything. A tracker that stops while others run copies its
figures into Python at once (the store goes on without it); capture ends
when the last running tracker stops. So stopping an outer tracker while a
nested one runs is allowed: the outer keeps what it saw until then, the
nested one goes on. AlreadyTracking remains for what cannot be shared: a
nested tracker asking for another depth, for precise mode the outer did not
choose, or for its own streamed trace, and more than MAX_WINDOWS nested
trackers at once.

This module composes the capture floor (docs/architecture.md): the views of
the store and the reading methods (capture/store.py, capture/reading.py),
thread names (capture/threads.py), the hints and the fork rule
(capture/availability.py), labels (capture/labels.py), the options
(capture/options.py) and what nested trackers share (capture/nesting.py).
It owns the tracker state: ``_shared``, ``_latest``, ``_active`` and
``_forked_views``; the running list and its lock are capture/running.py's.
One concern, a Tracker's life, takes these little over 500 lines.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
import weakref
from typing import Any, Dict, Iterator, List, Optional

import memviz._core as _core
from memviz._errors import AlreadyTracking, CaptureConflict, InvalidArgument, NotTracking
from memviz._interrupts import deferred_interrupt
from memviz._package import PACKAGE_DIR
from memviz._units import format_size
from memviz.capture import availability as _hints, cupti as _capture, store as _store, threads as _threads
from memviz.capture.availability import CaptureWarning, available
from memviz.capture.labels import label
from memviz.capture.nesting import (open_window as _open_window, refuse_nesting as _refuse_nesting,
                                    share_marks as _share_marks,
                                    share_torch_features as _share_torch_features)
from memviz.capture.options import check_options as _check_options, torch_installed as _torch_installed
from memviz.capture.rank_files import rank_path as _rank_path
from memviz.capture.reading import StoreReading
from memviz.capture.running import active_tracker, lock as _state_lock, running as _running
from memviz.capture.store import Frozen as _Frozen, NoGpuWindow as _NoGpuWindow, Window as _Window
from memviz.capture.traced import get_traced_memory, reset_peak
from memviz.model.failures import FailedAllocation
from memviz.model.frame_filter import FrameFilter
from memviz.outputs import Outputs

__all__ = ["Tracker", "track", "start", "stop", "label", "available", "capture_info",
           "CaptureWarning", "FailedAllocation", "active_tracker", "get_traced_memory", "reset_peak"]

_DEFAULT_DEPTH = 32
_active: Optional["Tracker"] = None  # the latest started of the running trackers
#: how the running capture was set up by the first tracker (nested ones share it)
_shared: Dict[str, Any] = {}
_latest: Optional["weakref.ReferenceType[Tracker]"] = None  # owns the C store's data
#: in a fork()ed child: the parent's nested trackers, frozen before the store is reused
_forked_views: List["weakref.ReferenceType[Tracker]"] = []


class Tracker(StoreReading, Outputs):
    """Captures GPU allocations between :meth:`start` and :meth:`stop`.

    Args:
        gpu: capture GPU allocations through CUPTI. With ``gpu=False`` (or on
            a machine without an NVIDIA driver) the tracker still works for
            the features that need no GPU, and says so in its report.
        depth: Python frames kept per allocation (1-256, default 32; a
            nested tracker shares its outer tracker's depth).
        activity: also read CUPTI activity records (static module memory).
            Default: on, except in precise mode, where the driver would emit a
            record for every tensor (measured to cost more than the capture).
        frame_filter: decides "the user's line" in statistics; defaults to
            ``memviz.frames``.
        trace: a path: stream a .memviz trace file there while tracking
            (flushed at least every second; readable with memviz.load()).
            Under a launcher (``torchrun``: RANK set) each rank writes its
            own file, ``run.memviz`` -> ``run.rank0.memviz``, or where
            ``{rank}`` in the path says (memviz.capture.rank_files.rank_path);
            ``trace_path`` is the file written.
        flight_recorder: a memory budget (``"256 MiB"``): keep the latest
            events in memory, within it, and write them as a trace file only
            when an allocation fails, an exception leaves ``track()``, on
            SIGUSR1, or on ``dump()`` (memviz/trace/flight.py).
        flight_dir: the folder for those dumps (default: the working folder);
            made, with its parents, when tracking starts if it is missing.
        precise: put PyTorch's allocator on the driver's stream-ordered pool
            (``backend:cudaMallocAsync``) so every tensor is a driver call;
            must be chosen before CUDA initialises.
        torch: install the PyTorch integration (categories, PyTorch's own
            figures, out-of-memory reports) when torch is imported; None means
            "if torch is installed". False turns it off.
        autograd: label backward allocations with their autograd node and
            the forward line that made it (read by the capture callback from
            PyTorch's engine, or a pre-hook per node where PyTorch's layout
            does not check out). Default: on with PyTorch, where the callback
            can name nodes itself (no cost measured); the pre-hooks, which cost
            time, only with ``autograd=True`` or in precise mode (see
            benchmarks/RESULTS.md).
        graph: record what autograd graphs keep for backward, and from which
            line (saved-tensor hooks, a cost per saved tensor): needed by
            ``snapshot.graph_resident()`` and the graph-leak evidence of
            ``diagnose``. Default: on when ``autograd=True`` is passed, off
            when autograd is only implied by precise mode.

    Started while another tracker runs, a tracker is nested in it (see the
    module's docstring): ``outer`` is that tracker, ``baseline`` the bytes
    per device already live when it started.
    """

    #: a recording of this process (memviz.model.recording.Recording): its
    #: PyTorch and device figures can be asked now
    is_live = True

    def __init__(self, *, gpu: bool = True, depth: Optional[int] = None,
                 activity: Optional[bool] = None, frame_filter: Optional[FrameFilter] = None,
                 trace: Optional[str] = None, precise: bool = False,
                 torch: Optional[bool] = None, autograd: Optional[bool] = None,
                 graph: Optional[bool] = None, flight_recorder: Any = None,
                 flight_dir: Optional[str] = None, cupti: Optional[bool] = None) -> None:
        self._depth_given = depth is not None
        if depth is None:
            depth = _DEFAULT_DEPTH
        _check_options(gpu=gpu, depth=depth, activity=activity, frame_filter=frame_filter,
                       trace=trace, precise=precise, torch=torch, autograd=autograd, graph=graph,
                       flight_recorder=flight_recorder, flight_dir=flight_dir, cupti=cupti)
        self.gpu_requested = bool(gpu)
        #: cupti= as given: None (use CUPTI where it can be had, else go on without it, warning),
        #: True (CUPTI or CaptureConflict), False (never CUPTI)
        self.cupti_requested = cupti
        #: whether memviz's CUPTI subscription records now (False: the allocator route
        #: and NVML only; see cupti_off_reason)
        self.cupti_enabled = False
        self.cupti_off_reason: Optional[str] = None
        #: CUPTI's multi-subscriber mode: the other subscriber memviz shares CUPTI with
        self.cupti_shared_with: Optional[str] = None
        self.depth = depth
        self.activity = (not precise) if activity is None else bool(activity)
        self.frame_filter = frame_filter
        self.gpu_enabled = False
        self.gpu_off_reason: Optional[str] = None
        self.activity_enabled = False
        self.activity_error: Optional[str] = None
        self.started_ns: Optional[int] = None
        self.stopped_ns: Optional[int] = None
        self._running = False
        self._frozen: Optional[_Frozen] = None
        self._forked = False
        self._view: Optional[_Window] = None  # a nested tracker's window of the store
        self._kept_changes: Dict[int, tuple] = {}  # see _share_marks
        self._thread: Optional[int] = None
        #: the tracker this one is nested in (None: it started the capture)
        self.outer: Optional["Tracker"] = None
        #: bytes per device live when this tracker started ({} when it started the capture)
        self.baseline: Dict[int, int] = {}
        self.trace_path = _rank_path(os.fspath(trace)) if trace is not None else None
        #: the flight recorder's budget in bytes (None: no recorder)
        self.flight_budget: Optional[int] = None
        if flight_recorder is not None:
            from memviz.trace.flight import parse_budget
            self.flight_budget = parse_budget(flight_recorder)
        self.flight_dir = os.fspath(flight_dir) if flight_dir is not None else None
        #: the running flight recorder (memviz.trace.flight.FlightRecorder) or None
        self.flight_recorder: Any = None
        self.precise = bool(precise)
        self.torch_integration = torch
        if graph is None:
            graph = autograd is True
        #: autograd=True asked for: per-node pre-hooks where the callback
        #: cannot name nodes itself (a cost); by default only the callback's
        #: own naming, which costs nothing measurable
        self.autograd_requested = autograd is True or bool(precise)
        if autograd is None:
            autograd = torch is not False
        self.autograd = bool(autograd)
        self.record_graph = bool(graph)
        if self.autograd and torch is False:
            raise InvalidArgument("autograd=True needs the PyTorch integration; do not pass torch=False with it")
        if self.record_graph and torch is False:
            raise InvalidArgument("graph=True needs the PyTorch integration; do not pass torch=False with it")
        #: per-step records (see step()); filled by memviz.analysis.steps
        self.steps: List[Any] = []
        #: objects with on_start(tracker) / on_stop(tracker) / on_freeze(tracker)
        self._plugins: List[Any] = []
        self._started_plugins: List[Any] = []
        self.precise_how: Optional[str] = None

    # -- lifecycle --------------------------------------------------------

    def start(self) -> "Tracker":
        """Start capturing; nested in the running tracker if there is one."""
        global _latest
        with _state_lock:
            if self._running:
                raise AlreadyTracking("this tracker is already running; stop() it before starting it again.")
            if self.started_ns is not None:
                raise AlreadyTracking("a Tracker can run once; create a new one with memviz.track().")
            _store.ensure_core()
            if _running:
                self._start_nested(active_tracker())
            else:
                self._start_first()
                _latest = weakref.ref(self)
            self._thread = threading.get_ident()
            _running.append(self)
            _sync_active()
        return self

    def _start_first(self) -> None:
        # The store is about to be reused: keep the previous tracker readable.
        prev = _latest() if _latest is not None else None
        if prev is not None and prev is not self:
            prev._freeze()
        while _forked_views:  # a fork()ed child: the parent's nested trackers, as at the fork
            t = _forked_views.pop()()
            if t is not None and t._frozen is None:
                t._frozen = _Frozen(t._view)
        _core.clear()
        self._started_where = _caller_location()
        _threads.forget()
        self._start_gpu()
        _shared.clear()
        _shared.update(depth=self.depth, precise=self.precise, gpu_enabled=self.gpu_enabled,
                        gpu_off_reason=self.gpu_off_reason, activity_enabled=self.activity_enabled,
                        activity_error=self.activity_error, where=self._started_where,
                        cupti_enabled=self.cupti_enabled, cupti_off_reason=self.cupti_off_reason,
                        cupti_shared_with=self.cupti_shared_with)
        _threads.watch(True)
        self.started_ns = time.monotonic_ns()
        self._running = True
        try:
            self._start_plugins()
            _shared["precise_how"] = self.precise_how
        except BaseException:
            # Undo what did start: plugins, thread watching, the CUPTI subscription.
            self._stop_started_plugins()
            self._running = False
            _threads.watch(False)
            if self.gpu_enabled:
                _core.stop()
            _shared.clear()
            raise

    def _start_nested(self, outer: "Tracker") -> None:
        where = _shared["where"]
        _refuse_nesting(self, _shared)
        view: _Window = _NoGpuWindow()
        if self.gpu_requested:
            view, self.baseline = _open_window()  # its step marks start here
            if _shared["gpu_enabled"]:
                self.gpu_enabled = True
                self.activity_enabled = _shared["activity_enabled"]
                self.activity_error = _shared["activity_error"]
                self.cupti_enabled = _shared["cupti_enabled"]
                self.cupti_off_reason = _shared["cupti_off_reason"]
                self.cupti_shared_with = _shared["cupti_shared_with"]
            else:
                self.gpu_off_reason = (f"it is nested in the tracker started at {where}, which does not "
                                       f"capture GPU allocations ({_shared['gpu_off_reason']})")
        else:
            self.gpu_off_reason = "gpu=False was passed"
        self.depth = _shared["depth"]
        self.outer = outer
        self._view = view
        self._started_where = _caller_location()
        self.started_ns = time.monotonic_ns()
        self._running = True
        try:
            self._start_plugins()
        except BaseException:
            self._stop_started_plugins()
            self._running = False
            self._view = None
            _core.window_close(view.id)
            raise

    def _stop_started_plugins(self) -> None:
        for plugin in reversed(self._started_plugins):
            try:
                plugin.on_stop(self)
            except Exception:  # noqa: BLE001 - the first error is the one to report
                pass

    def _start_gpu(self) -> None:
        if not self.gpu_requested:
            self.gpu_off_reason = "gpu=False was passed"
            return
        forked = _hints.fork_reason()
        if forked is not None:  # never call CUPTI here: its state belongs to the parent
            self.gpu_off_reason = forked
            _hints.warn_forked(forked)
            return
        explicit = os.environ.get(_capture.ENV_LIBRARY)
        present, why = _capture.gpu_present()
        if not explicit and not present:
            self.gpu_off_reason = why
            _hints.warn_gpu_off(why)
            return
        with_torch = self.torch_integration or (self.torch_integration is None and _torch_installed())
        if self.cupti_requested is False:
            if not with_torch:
                self.gpu_off_reason = ("cupti=False was passed without the PyTorch integration, "
                                       "the only other way memviz sees GPU memory")
                return
            self._start_without_cupti("cupti=False was passed")
            return
        try:
            started = _hints.subscribe(self.depth, self.activity)
        except CaptureConflict as e:
            if self.cupti_requested:  # cupti=True: CUPTI or nothing
                raise
            reason = _hints.conflict_reason(e)
            if not with_torch:  # nothing else to see GPU memory through
                self.gpu_off_reason = (f"{reason}, and without the PyTorch integration "
                                       f"({'torch=False was passed' if self.torch_integration is False else 'PyTorch is not installed'}) "
                                       "memviz has no other way to see GPU memory")
                _hints.warn_gpu_off(self.gpu_off_reason)
                return
            self._start_without_cupti(reason)
            _hints.warn_without_cupti(reason)
            return
        self.gpu_enabled = True
        self.cupti_enabled = True
        self.cupti_shared_with = started.shared_with
        self.activity_enabled = started.activity
        self.activity_error = started.activity_error

    def _start_without_cupti(self, reason: str) -> None:
        """GPU capture on the wrappers alone: PyTorch's blocks (the allocator
        route) and segments (its cudaMalloc/cudaFree), no CUPTI."""
        _core.start(depth=self.depth, activity=False, cupti=False)
        self.gpu_enabled = True
        self.cupti_enabled = False
        self.cupti_off_reason = reason
        self.activity_enabled = False
        self.activity_error = f"CUPTI is not used ({reason})"

    def _release_cupti(self, reason: str) -> bool:
        """Give CUPTI up now (another tool, torch.profiler, is about to
        subscribe) and go on without it: PyTorch's segments from its
        cudaMalloc first, so none is missed. True if CUPTI was held."""
        with _state_lock:
            root = _running[0] if _running else None
            if root is None or not root.cupti_enabled:
                return False
            integ = getattr(root, "torch", None)
            if integ is not None:
                integ.wrap_segments()
            if not _core.release_cupti():
                return False
            root._cupti_released(reason)
        _hints.warn_cupti_released(reason)
        return True

    def _cupti_released(self, reason: str) -> None:
        """CUPTI was given up while this (running, outermost) tracker ran:
        record why, for it and the trackers nested in it."""
        self.cupti_enabled = False
        self.cupti_off_reason = reason
        self.activity_enabled = False
        self.activity_error = f"CUPTI is not used ({reason})"
        for t in _running:
            t.cupti_enabled, t.cupti_off_reason = False, reason
            t.activity_enabled, t.activity_error = False, self.activity_error
        _shared.update(cupti_enabled=False, cupti_off_reason=reason, activity_enabled=False,
                       activity_error=self.activity_error)

    def stop(self) -> "Tracker":
        """Stop capturing. The last running tracker to stop unsubscribes from
        CUPTI (so torch.profiler can run); one that stops while others run
        keeps a copy of what it saw until now."""
        with _state_lock:
            if not self._running:
                if self._forked:
                    return self
                raise NotTracking("this tracker is not running: start() it first, or use `with memviz.track() as t:`.")
            last = len(_running) == 1 and _running[0] is self
            try:
                try:
                    if last:
                        _threads.watch(False)
                    _threads.note_running_threads()
                finally:  # a Ctrl-C above: capture stops all the same
                    if last and _shared.get("gpu_enabled") and not self._forked:
                        _core.stop()  # first, so plugins (the trace writer) see every event
            finally:
                errors = []
                for plugin in reversed(self._plugins):
                    try:
                        plugin.on_stop(self)
                    except BaseException as e:  # noqa: BLE001 - stop every plugin, then raise
                        errors.append(e)
                try:
                    if self._view is not None or not last:
                        self._freeze()  # the store goes on without this tracker
                finally:
                    with deferred_interrupt():  # a Ctrl-C here: raised once this tracker is off the list
                        if self._view is not None:
                            _core.window_close(self._view.id)
                            self._view = None
                        self._running = False
                        self.stopped_ns = time.monotonic_ns()
                        if self in _running:
                            _running.remove(self)
                        if not _running:
                            _shared.clear()
                        _sync_active()
                if errors:
                    raise errors[0]
        return self

    def _step_mark(self):
        """The store's step mark (memviz.analysis.steps), or this nested tracker's:
        ({device: _core.StepTotals}, the _core.StepChange of each stack changed
        since this tracker's previous mark)."""
        mark = self._view.step_mark() if self._view is not None else _core.step_mark()
        return mark.devices, _share_marks(self, mark.changes)

    def _start_plugins(self) -> None:
        # Precise mode must act before PyTorch loads its allocator: first.
        if self.precise and self.outer is None:
            from memviz.torch import precise
            self.precise_how = precise.enable()
        elif self.precise:
            self.precise_how = _shared.get("precise_how")
        if self.torch_integration or (self.torch_integration is None and _torch_installed()):
            from memviz.torch import integration
            integ = integration.attach(self)
            if self.outer is not None:
                _share_torch_features(self, integ)
        if self.trace_path is not None:
            from memviz.trace.writer import TraceWriter
            self._plugins.append(TraceWriter(self, self.trace_path))
        if self.flight_budget is not None:
            from memviz.trace.flight import FlightRecorder
            self.flight_recorder = FlightRecorder(self, self.flight_budget, self.flight_dir)
            self._plugins.append(self.flight_recorder)
        for plugin in self._plugins:
            if hasattr(plugin, "on_start"):
                plugin.on_start(self)
            self._started_plugins.append(plugin)

    # -- integrations (each lives in its own module) ----------------------

    def step(self, **info: Any) -> Any:
        """Mark the end of a training step; returns its record (see memviz.StepRecord)."""
        from memviz.analysis.steps import record_step
        return record_step(self, **info)

    def on_step(self, **sinks: Any) -> Any:
        """Where step records go: callback=, log=, print_every=, jsonl=, csv=,
        tensorboard= (see memviz.analysis.steps.on_step); returns a handle with remove()."""
        from memviz.analysis.steps import on_step
        return on_step(self, **sinks)

    def diagnose(self) -> List[Any]:
        """Findings about this run (growth, fragmentation, spikes, ...)."""
        from memviz.analysis.diagnose import diagnose
        return diagnose(self)

    def save(self, path: str) -> str:
        """Write what this tracker recorded to a .memviz trace file; returns
        the file written (one per rank under a launcher, as for ``trace=``)."""
        from memviz.trace.save import save
        return save(self, path)

    def dump(self, path: Optional[str] = None) -> str:
        """Write the flight recorder's memory to a .memviz file now (``path``,
        or a new file named with the time, pid and rank in ``flight_dir``);
        returns its path. Needs ``track(flight_recorder=...)``."""
        if path is not None:
            from memviz._args import path as _path_arg
            path = _path_arg(path, "tracker.dump(path)")
        if self.flight_recorder is None or not self._running:
            raise NotTracking("dump() writes a flight recorder's memory: start the tracker with "
                              "memviz.track(flight_recorder='256 MiB') (to write what a tracker "
                              "holds without one, use save(path))")
        return self.flight_recorder.dump(path)

    def events(self) -> Optional[Iterator[Any]]:
        """The allocation events of the trace this tracker streamed
        (``track(trace=path)``), read back once it stopped, as
        ``memviz.load(path).events()`` gives them; None while it runs, and
        without a trace (a tracker keeps totals and live sets, not a history)."""
        path = self.trace_path
        if not path or self._running or not os.path.exists(path):
            return None
        from memviz.loaded import load
        try:
            return load(path).events()
        except Exception:  # noqa: BLE001 - an unreadable file: no history
            return None

    def _known_in_trace(self, known: Dict[Any, Any]) -> Dict[Any, Any]:
        """The report's known categories ({(device, address, made at, kind):
        category}, from this tracker's snapshots) keyed as the events of the
        trace it streamed date them: the store dates a block when it was
        asked for, the trace when it was made (memviz/report/_categories.py)."""
        path = self.trace_path
        if not path or self._running or not os.path.exists(path):
            return known
        from memviz.loaded import load
        from memviz.report._categories import known_in_trace
        try:
            return known_in_trace(load(path), known)
        except Exception:  # noqa: BLE001 - an unreadable file: no history, nothing to key
            return known

    def _category_series(self, known: Dict[Any, Any], end_ns: int, points: Optional[int] = None) -> Any:
        """The HTML report's category series of a stopped tracker that streamed
        a trace: the loaded trace's pass in C over its events (as
        memviz/report/_categories.py asks a loaded trace); None otherwise, and
        the report sums the events itself."""
        path = self.trace_path
        if not path or self._running or not os.path.exists(path):
            return None
        from memviz.loaded import load
        try:
            return load(path)._category_series(known, end_ns, points)
        except Exception:  # noqa: BLE001 - an unreadable file: the report's own way
            return None

    def __enter__(self) -> "Tracker":
        return self.start()

    def __exit__(self, *exc) -> None:
        try:
            if self._running and exc[0] is not None and self.flight_recorder is not None \
                    and not issubclass(exc[0], (GeneratorExit,)):
                self.flight_recorder.dump_quietly(f"{exc[0].__name__} left memviz.track()")
        finally:  # a Ctrl-C during that dump: stopped all the same
            if self._running:
                self.stop()

    @property
    def running(self) -> bool:
        return self._running

    # -- reading (the rest: memviz/capture/reading.py) --------------------

    @property
    def oom_report(self):
        """What memory looked like when an allocation failed inside the block
        (PyTorch's out-of-memory, or a failed driver call), or None."""
        integ = getattr(self, "torch", None)
        if integ is not None and integ.oom_report is not None:
            return integ.oom_report
        from memviz.torch.oom import from_failure
        return from_failure(self)

    def capture_info(self) -> Dict[str, Any]:
        """What this tracker captured with, and memviz's own memory.

        Loads nothing: a tracker that ran without GPU capture reports the
        library state as it is (capture_info() at module level probes)."""
        info = capture_info(probe=False)
        src = self._reader() if self.started_ns is not None else None
        stats = src.stats if src is not None else (_core.stats() if _store.initialized() else {})
        info.update(
            gpu_enabled=self.gpu_enabled,
            gpu_off_reason=self.gpu_off_reason,
            activity_enabled=self.activity_enabled,
            activity_error=self.activity_error,
            depth=self.depth,
            store=stats,
        )
        info["sources"] = _hints.capture_sources(self, info.get("pytorch"))
        return info

    def _whatif_source(self):
        """The trace this tracker wrote (what-if replays every request)."""
        if self.trace_path is None:
            raise InvalidArgument("what-if replays every request PyTorch made, which only a trace holds: "
                                  "track with trace='run.memviz', then call whatif() (or run `memviz whatif "
                                  "run.memviz`)")
        if self._running:
            raise InvalidArgument("stop the tracker first: its trace is complete once it stops "
                                  "(t.stop(), or leave the `with` block)")
        from memviz.loaded import load
        return load(self.trace_path)

    def _freeze(self) -> None:
        if self._frozen is None:
            # A nested tracker freezes only when it stops: its window closes in the same instant.
            self._frozen = _Frozen(self._view, close=self._view is not None)
            for plugin in self._plugins:
                if hasattr(plugin, "on_freeze"):
                    plugin.on_freeze(self)

    def __repr__(self) -> str:
        state = "running" if self._running else ("stopped" if self.started_ns else "new")
        gpu = "gpu" if self.gpu_enabled else f"gpu off: {self.gpu_off_reason}"
        try:
            cur = format_size(self.current_bytes()) if self.started_ns else "-"
            peak = format_size(self.peak_bytes()) if self.started_ns else "-"
        except Exception:  # noqa: BLE001 - repr must not raise
            cur = peak = "?"
        return f"<memviz.Tracker {state}, {gpu}, current={cur}, peak={peak}>"


def _sync_active() -> None:
    global _active
    _active = _running[-1] if _running else None


def _caller_location() -> str:
    f = sys._getframe(1)
    here = PACKAGE_DIR
    while f is not None and f.f_code.co_filename.startswith(here):
        f = f.f_back
    return f"{f.f_code.co_filename}:{f.f_lineno}" if f is not None else "?"


def track(**kwargs: Any) -> Tracker:
    """A tracker to use as ``with memviz.track() as t:``; see :class:`Tracker`
    for the options (gpu, depth, activity, frame_filter, trace, precise, torch, autograd,
    graph, flight_recorder, flight_dir)."""
    _check_options(**kwargs)
    return Tracker(**kwargs)


def start(**kwargs) -> Tracker:
    """Start and return a tracker (stop it with :func:`stop` or ``t.stop()``)."""
    _check_options(**kwargs)
    return Tracker(**kwargs).start()


def stop() -> Tracker:
    """Stop the running tracker (see :func:`active_tracker`) and return it."""
    t = active_tracker()
    if t is None:
        raise NotTracking("no memviz tracker is running: call memviz.start() first.")
    return t.stop()


def capture_info(probe: bool = True) -> Dict[str, Any]:
    """Whether CUPTI loaded, which file, which version, and why not.

    With ``probe`` (the default) this tries to load libcupti when a GPU is
    present and it is not loaded yet, so the answer is definite."""
    info = _hints.library_info(probe)
    t = _active or (_latest() if _latest is not None else None)
    info["pytorch"] = _hints.pytorch_route(t)
    if t is not None:  # how the running (or last) tracker saw each source
        info["sources"] = _hints.capture_sources(t, info["pytorch"])
    return info


def _at_exit() -> None:
    for t in reversed(list(_running)):
        if t._running:
            try:
                t.stop()
            except Exception:  # noqa: BLE001 - never fail interpreter exit
                pass


def _after_fork_in_child() -> None:
    _hints.after_fork(bool(_shared.get("gpu_enabled")))
    for t in _running:
        t._forked = True
        t._running = False
        if t._view is not None:
            _forked_views.append(weakref.ref(t))
    _running.clear()
    _shared.clear()
    _sync_active()


atexit.register(_at_exit)
os.register_at_fork(after_in_child=_after_fork_in_child)
