"""track() / Tracker: a window of the process's capture plus the reading
API, and the module-level API (memviz.track, start, stop,
get_traced_memory, reset_peak, capture_info).

The process's capture is the capture session's (memviz/capture/session.py):
it owns the options of the running capture, the CUPTI subscription, the
running trackers and their windows of the C store, the fork and exit hooks,
and the events the PyTorch integration, the trace writer, the flight
recorder and the step sinks hear. A Tracker checks its options once
(capture/options.py, frozen), asks the session to start and stop it, hands
it what the floors above build for it (``_attach``), and reads what it
captured (capture/reading.py) from its Run: the whole store while it is the
latest tracker, its window while nested, its frozen copy once the store
went on without it.

Nesting (the session's docstring says what is shared): a tracker started
while another runs is nested in it; ``outer`` is that tracker and
``baseline`` the bytes per device already live when it started. Stopping an
outer tracker while a nested one runs is allowed: the outer keeps what it
saw until then, the nested one goes on.
"""

from __future__ import annotations

import os
from typing import Any, Dict, Iterator, List, Optional

import memviz._core as _core
from memviz._errors import InvalidArgument, NotTracking
from memviz._units import format_size
from memviz.capture import availability as _avail, events as _events, session as _capture_session, store as _store
from memviz.capture.availability import CaptureWarning, available
from memviz.capture.labels import label
from memviz.capture.options import CaptureOptions
from memviz.capture.reading import StoreReading
from memviz.capture.events import Trigger
from memviz.capture.session import active_tracker
from memviz.capture.traced import get_traced_memory, reset_peak
from memviz.model.failures import FailedAllocation
from memviz.model.frame_filter import FrameFilter
from memviz.outputs import Outputs

__all__ = ["Tracker", "track", "start", "stop", "label", "available", "capture_info",
           "CaptureWarning", "FailedAllocation", "active_tracker", "get_traced_memory", "reset_peak"]

_session = _capture_session.current()


def _parse_budget(value: Any) -> int:
    from memviz.trace.flight import parse_budget
    return parse_budget(value)


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
            ``trace_path`` is the file written, as an absolute path (the
            folder it was started in: a later os.chdir() moves nothing).
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
        given = dict(gpu=gpu, activity=activity, frame_filter=frame_filter, trace=trace, precise=precise,
                     torch=torch, autograd=autograd, graph=graph, flight_recorder=flight_recorder,
                     flight_dir=flight_dir, cupti=cupti)
        if depth is not None:  # Tracker(depth=None): the default (memviz.track() takes none)
            given["depth"] = depth
        self._setup(CaptureOptions.parse(_parse_budget, **given))

    @classmethod
    def _from_options(cls, options: CaptureOptions) -> "Tracker":
        t = cls.__new__(cls)
        t._setup(options)
        return t

    def _setup(self, opts: CaptureOptions) -> None:
        #: the options, checked and frozen (memviz.capture.options.CaptureOptions)
        self.options = opts
        self.gpu_requested = opts.gpu
        #: cupti= as given: None (use CUPTI where it can be had, else go on without it, warning),
        #: True (CUPTI or CaptureConflict), False (never CUPTI)
        self.cupti_requested = opts.cupti
        #: whether memviz's CUPTI subscription records now (False: the allocator route
        #: and NVML only; see cupti_off_reason)
        self.cupti_enabled = False
        self.cupti_off_reason: Optional[str] = None
        #: CUPTI's multi-subscriber mode: the other subscriber memviz shares CUPTI with
        self.cupti_shared_with: Optional[str] = None
        self.depth = opts.depth
        self.activity = opts.activity
        self.frame_filter = opts.frame_filter
        self.gpu_enabled = False
        self.gpu_off_reason: Optional[str] = None
        self.activity_enabled = False
        self.activity_error: Optional[str] = None
        self.started_ns: Optional[int] = None
        self.stopped_ns: Optional[int] = None
        #: the tracker this one is nested in (None: it started the capture)
        self.outer: Optional["Tracker"] = None
        #: bytes per device live when this tracker started ({} when it started the capture)
        self.baseline: Dict[int, int] = {}
        self.trace_path = opts.trace_path
        #: the flight recorder's budget in bytes (None: no recorder)
        self.flight_budget: Optional[int] = opts.flight_budget
        self.flight_dir = opts.flight_dir
        #: the running flight recorder (memviz.trace.flight.FlightRecorder) or None
        self.flight_recorder: Any = None
        self.precise = opts.precise
        self.torch_integration = opts.torch
        #: autograd=True asked for: per-node pre-hooks where the callback
        #: cannot name nodes itself (a cost); by default only the callback's
        #: own naming, which costs nothing measurable
        self.autograd_requested = opts.autograd_requested
        self.autograd = opts.autograd
        self.record_graph = opts.graph
        #: per-step records (see step()); filled by memviz.analysis.steps
        self.steps: List[Any] = []
        self.precise_how: Optional[str] = None
        self._run = _session.register(self)  # written by the session, read here

    # -- lifecycle --------------------------------------------------------

    def start(self) -> "Tracker":
        """Start capturing; nested in the running tracker if there is one."""
        _session.start(self, self._attach)
        return self

    def _attach(self, session: "_capture_session.CaptureSession") -> None:
        """What this tracker's capture needs from the floors above, built and
        subscribed to the session as it starts."""
        # Precise mode must act before PyTorch loads its allocator: first.
        if self.precise and self.outer is None:
            from memviz.torch import precise
            session.set_precise_how(precise.enable())
        if self.precise and session.capture is not None:
            self.precise_how = session.capture.precise_how
        if self.options.with_torch:
            from memviz.torch.integration import TorchIntegration
            self.torch = TorchIntegration(self, session)
            if self.torch.graph_kept is not None:
                self.graph = self.torch.graph_kept
            session.subscribe(self, self.torch, first=True)
        if self.trace_path is not None:
            from memviz.trace.writer import TraceWriter
            session.subscribe(self, TraceWriter(self, self.trace_path))
        if self.flight_budget is not None:
            from memviz.trace.flight import FlightRecorder
            self.flight_recorder = FlightRecorder(self, self.flight_budget, self.flight_dir)
            session.subscribe(self, self.flight_recorder)

    @property
    def subscribers(self) -> tuple:
        """What listens to this tracker's events (memviz.capture.session.CaptureEvents):
        the PyTorch integration, the trace writer, the flight recorder, the step sinks."""
        return _session.subscribers(self)

    def stop(self) -> "Tracker":
        """Stop capturing. The last running tracker to stop unsubscribes from
        CUPTI (so torch.profiler can run); one that stops while others run
        keeps a copy of what it saw until now."""
        _session.stop(self)
        return self

    def _step_mark(self):
        """The store's step mark (memviz.analysis.steps), or this nested tracker's:
        ({device: _core.StepTotals}, the _core.StepChange of each stack changed
        since this tracker's previous mark)."""
        return _session.step_mark(self)

    # -- the window: what the reading API reads (capture/reading.py) -------

    @property
    def _running(self) -> bool:
        return self._run.running

    @property
    def _view(self):
        return self._run.view

    @property
    def _frozen(self):
        return self._run.frozen

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
        if self.flight_recorder is None:
            raise NotTracking("dump() writes a flight recorder's memory: start the tracker with "
                              "memviz.track(flight_recorder='256 MiB') (to write what a tracker "
                              "holds without one, use save(path))")
        if not self._running:
            from memviz.trace.flight import not_recording
            raise NotTracking(not_recording(self._run.forked))
        # Stopped on another thread since: the recorder raises NotTracking too
        return _session.failure(self, Trigger(_events.REQUEST, "tracker.dump()", path))

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
            if self._running and exc[0] is not None and not issubclass(exc[0], (GeneratorExit,)):
                _session.failure(self, Trigger(_events.EXCEPTION,
                                               f"{exc[0].__name__} left memviz.track()"))
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
        info["sources"] = _session.routes(self, info.get("pytorch"))["sources"]
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

    def __repr__(self) -> str:
        state = "running" if self._running else ("stopped" if self.started_ns else "new")
        gpu = "gpu" if self.gpu_enabled else f"gpu off: {self.gpu_off_reason}"
        try:
            cur = format_size(self.current_bytes()) if self.started_ns else "-"
            peak = format_size(self.peak_bytes()) if self.started_ns else "-"
        except Exception:  # noqa: BLE001 - repr must not raise
            cur = peak = "?"
        return f"<memviz.Tracker {state}, {gpu}, current={cur}, peak={peak}>"


def track(**kwargs: Any) -> Tracker:
    """A tracker to use as ``with memviz.track() as t:``; see :class:`Tracker`
    for the options (gpu, depth, activity, frame_filter, trace, precise, torch, autograd,
    graph, flight_recorder, flight_dir)."""
    return Tracker._from_options(CaptureOptions.parse(_parse_budget, **kwargs))


def start(**kwargs) -> Tracker:
    """Start and return a tracker (stop it with :func:`stop` or ``t.stop()``)."""
    return Tracker._from_options(CaptureOptions.parse(_parse_budget, **kwargs)).start()


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
    info = _avail.library_info(probe)
    t = _session.active() or _session.latest()
    info.update(_session.routes(t))  # how the running (or last) tracker saw each source
    return info
