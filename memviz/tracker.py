"""track() / Tracker: start and stop capture, and read what was captured.

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
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
import warnings
import weakref
from typing import Any, Dict, Iterator, List, Optional, Tuple

from memviz._package import PACKAGE_DIR
from memviz import _args, _core
from memviz.capture import callsite as _callsite, cupti as _capture
from memviz._errors import AlreadyTracking, CaptureConflict, CaptureUnavailable, InvalidArgument, InvalidArgumentType, NotTracking
from memviz.model.frame_filter import FrameFilter, warning_site
from memviz.outputs import Outputs
from memviz.model.snapshot import KIND_NAMES, SEEN_RUNNING, SEEN_THREADS, Snapshot, snapshot_from_raw
from memviz._units import format_size
from memviz.capture.running import active_tracker, running as _running
from memviz.model.snapshot import FailedAllocation

__all__ = ["Tracker", "track", "start", "stop", "label", "available", "capture_info",
           "CaptureWarning", "FailedAllocation", "active_tracker", "get_traced_memory", "reset_peak"]

_DEFAULT_DEPTH = 32
_state_lock = threading.RLock()
_active: Optional["Tracker"] = None  # the latest started of the running trackers
#: how the running capture was set up by the first tracker (nested ones share it)
_shared: Dict[str, Any] = {}
_latest: Optional["weakref.ReferenceType[Tracker]"] = None  # owns the C store's data
_warned_gpu_off = False
_initialized = False
#: in a fork()ed child of a process that had loaded CUPTI: why GPU capture is off here
_forked_after_cupti: Optional[str] = None
#: in a fork()ed child: the parent's nested trackers, frozen before the store is reused
_forked_views: List["weakref.ReferenceType[Tracker]"] = []
_warned_fork = False


class CaptureWarning(UserWarning):
    """GPU capture is off for this tracker; the message says why."""


def _thread_entry(t: threading.Thread) -> tuple:
    return (t.name, getattr(t, "native_id", None), isinstance(t, getattr(threading, "_DummyThread", ())),
            t.ident)


def _note_thread(t: threading.Thread) -> None:
    """Remember a running thread's name, from any thread."""
    if t.ident is not None:
        SEEN_RUNNING[(t.ident, getattr(t, "native_id", None))] = _thread_entry(t)


_SEEN_KEEP = 2 * _core.MAX_THREADS  # SEEN_THREADS may hold this many entries before pruning
_seen_prune_at = _SEEN_KEEP


def _note_this_thread() -> None:
    """Remember the calling thread's name under its serial. Entries of ended
    threads that the C core's table does not hold are dropped as they pile
    up (a process may start threads without end)."""
    global _seen_prune_at
    SEEN_THREADS[_core.thread_serial()] = _thread_entry(threading.current_thread())
    if len(SEEN_THREADS) > _seen_prune_at:
        try:
            keep = {row[3] for row in _core.threads().values()}
        except RuntimeError:  # the store is not set up: keep everything
            return
        alive = {(t.ident, getattr(t, "native_id", None)) for t in threading.enumerate()}
        for serial, entry in list(SEEN_THREADS.items()):
            if serial not in keep and (entry[3], entry[1]) not in alive:
                SEEN_THREADS.pop(serial, None)
        _seen_prune_at = max(_SEEN_KEEP, 2 * len(SEEN_THREADS))


def _thread_start_hook(frame, event, arg):
    """threading.setprofile hook while tracking: runs once in each new thread
    to remember its name (threads often end before a snapshot is taken),
    then removes itself, so the thread's calls cost nothing afterwards."""
    sys.setprofile(None)
    _note_this_thread()


def _watch_threads(on: bool) -> None:
    if on:
        for t in threading.enumerate():
            _note_thread(t)
        if getattr(threading, "_profile_hook", None) is None:
            threading.setprofile(_thread_start_hook)
    elif getattr(threading, "_profile_hook", None) is _thread_start_hook:
        threading.setprofile(None)


def _ensure_core() -> None:
    global _initialized
    if not _initialized:
        _core.init()
        _initialized = True


class _Window:
    """A nested tracker's view of the store: what was allocated after `start`
    (window `wid` of src/window.h keeps its totals, peaks and timeline)."""

    def __init__(self, wid: int, start: int) -> None:
        self.id, self.start = wid, start

    @property
    def live(self):
        if _core.active():
            _core.flush()
        return [r for r in _core.live() if r[7] > self.start]

    @property
    def totals(self):
        return _core.totals(self.id)

    @property
    def peaks(self):
        return {dev: _core.peak_live(dev, self.id) for dev in _core.totals(self.id)}

    @property
    def failures(self):
        return [r for r in _core.failures() if r[6] > self.start]

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


class _NoGpuWindow(_Window):
    """A nested tracker with gpu=False: it sees no GPU memory."""

    def __init__(self) -> None:
        super().__init__(-1, 0)

    live = failures = timeline = property(lambda self: [])
    totals = peaks = property(lambda self: {})

    def step_mark(self):
        return {}, []


class _Frozen:
    """A copy of the store's data (or of a nested tracker's window), taken
    before the store is reused. Live allocations, totals, peak sets and the
    timeline are copied at one instant (``_core.copy``), so the copy adds up
    even while other trackers' threads go on allocating."""

    def __init__(self, src: Optional[_Window] = None, *, close: bool = False) -> None:
        if _core.active():
            _core.flush()
        if isinstance(src, _NoGpuWindow):
            self.live, self.totals, self.peaks, self.timeline, self.failures = [], {}, {}, [], []
        else:
            wid = -1 if src is None else src.id
            self.live, self.totals, peak_rows, self.timeline, when = _core.copy(wid, close)
            self.peaks = {dev: [r for r in peak_rows if r[2] == dev] for dev in self.totals}
            after = 0 if src is None else src.start
            self.failures = [r for r in _core.failures() if after < r[6] <= when]
        self.threads = _core.threads()
        self.stats = _core.stats()
        ids = {r[8] for r in self.live} | {r[7] for r in self.failures}
        for rows in self.peaks.values():
            ids |= {r[8] for r in rows}
        ids.discard(0)
        self.stacks = _callsite.resolve(ids) if ids else _callsite.Resolved()

    def resolve(self, ids):
        calls = self.stacks.calls
        return _callsite.Resolved({i: self.stacks[i] for i in ids if i in self.stacks},
                                  {i: calls[i] for i in ids if i in calls})


class Tracker(Outputs):
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

    #: a recording of this process (memviz/model/recording.py): its PyTorch and
    #: device figures can be asked now
    is_live = True


    def __init__(self, *, gpu: bool = True, depth: Optional[int] = None,
                 activity: Optional[bool] = None, frame_filter: Optional[FrameFilter] = None,
                 trace: Optional[str] = None, precise: bool = False,
                 torch: Optional[bool] = None, autograd: Optional[bool] = None,
                 graph: Optional[bool] = None) -> None:
        self._depth_given = depth is not None
        if depth is None:
            depth = _DEFAULT_DEPTH
        _check_options(gpu=gpu, depth=depth, activity=activity, frame_filter=frame_filter,
                       trace=trace, precise=precise, torch=torch, autograd=autograd, graph=graph)
        self.gpu_requested = bool(gpu)
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
        self.trace_path = os.fspath(trace) if trace is not None else None
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
            _ensure_core()
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
        SEEN_THREADS.clear()
        SEEN_RUNNING.clear()
        self._start_gpu()
        _shared.clear()
        _shared.update(depth=self.depth, precise=self.precise, gpu_enabled=self.gpu_enabled,
                        gpu_off_reason=self.gpu_off_reason, activity_enabled=self.activity_enabled,
                        activity_error=self.activity_error, where=self._started_where)
        _watch_threads(True)
        self.started_ns = time.monotonic_ns()
        self._running = True
        try:
            self._start_plugins()
            _shared["precise_how"] = self.precise_how
        except BaseException:
            # Undo what did start: plugins, thread watching, the CUPTI subscription.
            self._stop_started_plugins()
            self._running = False
            _watch_threads(False)
            if self.gpu_enabled:
                _core.stop()
            _shared.clear()
            raise

    def _start_nested(self, outer: "Tracker") -> None:
        where = _shared["where"]
        if self.trace_path is not None:
            raise AlreadyTracking(
                f"this tracker would be nested in the one started at {where}, and a nested tracker "
                "cannot stream its own trace (trace=): the event stream serves one trace file per "
                "process. Leave out trace= and call t.save(path) after the block, or stream from the "
                "outermost tracker (memviz run -o FILE).")
        if self._depth_given and self.depth != _shared["depth"]:
            raise AlreadyTracking(
                f"this tracker asks for depth={self.depth}, but it would be nested in the tracker "
                f"started at {where}, whose capture keeps depth={_shared['depth']} frames, shared by "
                f"the trackers nested in it. Pass depth={_shared['depth']} or leave depth out, or "
                "start the outer tracker with the depth you need.")
        if self.precise and not _shared["precise"]:
            raise AlreadyTracking(
                f"precise mode must be chosen by the outer tracker (started at {where}) before CUDA "
                "initialises; a tracker nested in it cannot switch it on. Start the outer tracker "
                "with precise=True (memviz run --precise), or leave precise out here.")
        view: _Window = _NoGpuWindow()
        if self.gpu_requested:
            opened = _core.window_open()
            if opened is None:
                raise AlreadyTracking(
                    f"{_core.MAX_WINDOWS} nested trackers are already running in this process, the "
                    "most memviz keeps figures for at once. Stop one of them first, or read the "
                    "figures of the tracker they are nested in.")
            wid, start, self.baseline = opened
            view = _Window(wid, start)
            # Step marks start here for this tracker; the others keep theirs.
            _share_marks(None, view.step_mark()[1])
            if _shared["gpu_enabled"]:
                self.gpu_enabled = True
                self.activity_enabled = _shared["activity_enabled"]
                self.activity_error = _shared["activity_error"]
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
        global _warned_gpu_off, _warned_fork
        if not self.gpu_requested:
            self.gpu_off_reason = "gpu=False was passed"
            return
        forked = _fork_reason()
        if forked is not None:  # never call CUPTI here: its state belongs to the parent
            self.gpu_off_reason = forked
            if not _warned_fork:
                _warned_fork = True
                level, _ = warning_site()
                warnings.warn(f"memviz: GPU capture is off: {forked}", CaptureWarning, stacklevel=level)
            return
        explicit = os.environ.get(_capture.ENV_LIBRARY)
        present, why = _capture.gpu_present()
        if not explicit and not present:
            self.gpu_off_reason = why
            if not _warned_gpu_off:
                _warned_gpu_off = True
                level, entry = warning_site()
                warnings.warn(
                    f"memviz: GPU capture is off: {why}. Tracking still works for the "
                    f"features that need no GPU; {_silence_hint(entry)}.",
                    CaptureWarning, stacklevel=level)
            return
        lib = _capture.load()  # raises CaptureUnavailable with what it tried
        result, step, error, holder, activity_on, activity_error = _core.start(
            depth=self.depth, activity=self.activity)
        # 39 on CUPTI 12+; older CUPTI answered a second subscriber with 12.
        if result == _core.ERROR_MULTIPLE_SUBSCRIBERS or (result == 12 and step == "cuptiSubscribe"):
            raise CaptureConflict(holder or None, detail=f"{step} returned {error} ({result})")
        if result != 0:
            raise CaptureUnavailable(
                f"{step} failed with {error} ({result}) using {lib.path} (CUPTI version {lib.version})",
                lib.tried + [f"{lib.path}: loaded ({lib.how})", f"{step}: {error} ({result})"],
                hint=_hint_for(result),
            )
        self.gpu_enabled = True
        self.activity_enabled = bool(activity_on)
        self.activity_error = activity_error or None

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
                if last:
                    _watch_threads(False)
                for t in threading.enumerate():
                    _note_thread(t)
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
        ({device: (current, window peak, live count)}, changed stacks since
        this tracker's previous mark)."""
        devs, changed = self._view.step_mark() if self._view is not None else _core.step_mark()
        return devs, _share_marks(self, changed)

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

    def save(self, path: str) -> None:
        """Write what this tracker recorded to a .memviz trace file."""
        from memviz.trace.save import save
        save(self, path)

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

    def __enter__(self) -> "Tracker":
        return self.start()

    def __exit__(self, *exc) -> None:
        if self._running:
            self.stop()

    @property
    def running(self) -> bool:
        return self._running

    # -- reading ----------------------------------------------------------

    def _source(self):
        if self._frozen is not None:
            return self._frozen
        if self.started_ns is None:
            raise NotTracking("this tracker never started: use `with memviz.track() as t:` or t.start().")
        return self._view  # None: the store itself

    def _live_rows(self):
        src = self._source()
        if src is not None:
            return src.live, src.resolve, src.threads
        if self._running and self.gpu_enabled:
            _core.flush()
        return _core.live(), _callsite.resolve, _core.threads()

    def snapshot_raw(self) -> Snapshot:
        """The live allocations, without the PyTorch integration's categories."""
        rows, resolve, threads = self._live_rows()
        return snapshot_from_raw(rows, resolve, threads, self.frame_filter,
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

    @property
    def oom_report(self):
        """What memory looked like when an allocation failed inside the block
        (PyTorch's out-of-memory, or a failed driver call), or None."""
        integ = getattr(self, "torch", None)
        if integ is not None and integ.oom_report is not None:
            return integ.oom_report
        from memviz.torch.oom import from_failure
        return from_failure(self)

    def peak_snapshot(self, device: Optional[int] = None) -> Snapshot:
        """The allocations live at the moment of a device's peak.

        With ``device=None``: every device, each at its own peak.
        """
        _args.whole(device, "peak_snapshot(device=...)", none=True)
        src = self._source()
        totals = src.totals if src is not None else _core.totals()
        devices = [device] if device is not None else sorted(totals)
        rows: List[tuple] = []
        for dev in devices:
            rows.extend(src.peaks.get(dev, []) if src is not None else _core.peak_live(dev))
        resolve = src.resolve if src is not None else _callsite.resolve
        threads = src.threads if src is not None else _core.threads()
        ts = max((totals[d]["peak_timestamp_ns"] for d in devices if d in totals), default=None)
        snap = snapshot_from_raw(rows, resolve, threads, self.frame_filter, timestamp_ns=ts)
        return self._decorate(snap, live_now=False)

    def totals(self) -> Dict[int, Dict[str, int]]:
        """Per device (-1: pinned host memory): current, peak, allocs, frees, failed, ..."""
        src = self._source()
        return dict(src.totals) if src is not None else _core.totals()

    def current_bytes(self, device: Optional[int] = None) -> int:
        """Bytes live now; all devices (not host memory) when device is None."""
        _args.whole(device, "current_bytes(device=...)", none=True)
        t = self.totals()
        if device is not None:
            return t.get(device, {}).get("current", 0)
        return sum(v["current"] for d, v in t.items() if d >= 0)

    def peak_bytes(self, device: Optional[int] = None) -> int:
        """Highest live bytes of a device; with None, the largest device peak."""
        _args.whole(device, "peak_bytes(device=...)", none=True)
        t = self.totals()
        if device is not None:
            return t.get(device, {}).get("peak", 0)
        return max((v["peak"] for d, v in t.items() if d >= 0), default=0)

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
        with _state_lock:
            if not self._running:
                raise NotTracking(
                    "reset_peak() restarts the peak of a running tracker, and this tracker is not "
                    "running. What to do: call it inside the `with memviz.track() as t:` block; a "
                    "stopped tracker's peak is what it was when it stopped.")
            if self._view is not None:
                if not isinstance(self._view, _NoGpuWindow):
                    _core.reset_peak(self._view.id)
            elif self._frozen is None:
                if self.gpu_enabled:
                    _core.flush()
                _core.reset_peak()

    @property
    def failures(self) -> List[FailedAllocation]:
        """Allocations the driver refused (the last 256), oldest first."""
        src = self._source()
        rows = src.failures if src is not None else _core.failures()
        resolve = src.resolve if src is not None else _callsite.resolve
        threads = src.threads if src is not None else _core.threads()
        ids = {r[7] for r in rows} - {0}
        stacks = resolve(ids) if ids else {}
        # Build tracebacks through the snapshot machinery for the same interning.
        fake = [(0, r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[7], 0) for r in rows]
        snap = snapshot_from_raw(fake, lambda _ids: stacks, threads, self.frame_filter)
        return [FailedAllocation(r[0], r[1], KIND_NAMES[r[2]], r[3], a.thread, a.label, r[6],
                                 a.traceback, r[8], a.op) for r, a in zip(rows, snap.allocations)]

    def timeline(self) -> List[tuple]:
        """(timestamp_ns, device, live bytes) points; bounded, peaks kept."""
        src = self._source()
        return list(src.timeline) if src is not None else _core.timeline()

    def capture_info(self) -> Dict[str, Any]:
        """What this tracker captured with, and memviz's own memory.

        Loads nothing: a tracker that ran without GPU capture reports the
        library state as it is (capture_info() at module level probes)."""
        info = capture_info(probe=False)
        src = self._source() if self.started_ns is not None else None
        stats = src.stats if src is not None else (_core.stats() if _initialized else {})
        info.update(
            gpu_enabled=self.gpu_enabled,
            gpu_off_reason=self.gpu_off_reason,
            activity_enabled=self.activity_enabled,
            activity_error=self.activity_error,
            depth=self.depth,
            store=stats,
        )
        return info

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


def _share_marks(me: Optional["Tracker"], changed: List[tuple]) -> List[tuple]:
    """The store keeps one step mark per stack for all trackers: the changes
    one tracker's mark takes are kept for every other running tracker until
    its own next mark (so each sees the changes since its own previous mark,
    or its start). Returns ``me``'s changes, its kept ones included."""
    with _state_lock:
        for t in _running:
            if t is not me and changed and not isinstance(t._view, _NoGpuWindow):
                _absorb(t._kept_changes, changed)
        mine = me._kept_changes if me is not None else {}
        if me is not None:
            me._kept_changes = {}
    if not mine:
        return changed
    _absorb(mine, changed)
    return list(mine.values())


def _absorb(kept: Dict[int, tuple], changed: List[tuple]) -> None:
    for sid, live_bytes, live_count, d_bytes, d_count in changed:
        old = kept.get(sid)
        if old is not None:
            d_bytes += old[3]
            d_count += old[4]
        kept[sid] = (sid, live_bytes, live_count, d_bytes, d_count)


def _sync_active() -> None:
    global _active
    _active = _running[-1] if _running else None


def _share_torch_features(tracker: "Tracker", integ: Any) -> None:
    """A nested tracker's PyTorch integration: autograd labels and graph
    recording are installed once per process (PyTorch has one node-counter
    hook and one saved-tensor hook stack), so a nested tracker uses the ones
    a running tracker installed, and installs them itself only where none
    did. They end when the tracker that installed them stops. Precise mode's
    wrappers and the allocator route belong to the first tracker."""
    integ._precise = False
    providers = [t.torch for t in _running if getattr(t, "torch", None) is not None and t.torch._active]
    route_owner = next((p for p in providers if p.route is not None), None)
    if route_owner is not None:
        integ.route_from = route_owner  # one vtable swap per process: the allocator route too
    if integ.autograd and any(p.autograd for p in providers):
        integ.autograd = False  # the capture already carries the labels
    if integ.record_graph:
        owner = next((p for p in providers if p.record_graph), None)
        if owner is not None:
            integ.record_graph = False
            tracker.graph = owner.graph


_FORK_ADVICE = ("CUDA and CUPTI cannot be used in a fork()ed child (their state belongs to the "
                "parent), so GPU capture is off in this process; memviz's CPU-side features "
                "(labels, steps, the PyTorch integration on CPU) still work. To capture GPU memory "
                "in a worker process, start it with the 'spawn' or 'forkserver' method "
                "(multiprocessing.set_start_method('spawn'), or DataLoader(multiprocessing_context="
                "'spawn')).")


def _silence_hint(entry: Optional[str]) -> str:
    """How to turn GPU capture off, and so silence CaptureWarning, from the
    entry point that started the tracker (``entry``: the file of the outermost
    memviz frame, see memviz.model.frame_filter.warning_site)."""
    where = os.path.relpath(entry, PACKAGE_DIR).replace(os.sep, "/") if entry else ""
    if where == "integrations/ipython.py":
        return "add --no-gpu to the magic's line (%%memviz --no-gpu) to silence this warning"
    if where == "integrations/pytest_plugin.py":
        return "run pytest with -W ignore::memviz.CaptureWarning to silence this warning"
    if where.startswith("integrations/"):
        return ("the training callback started this tracker and has no option for it: to silence this "
                "warning, run the training inside `with memviz.track(gpu=False):` (the callback then "
                "records on that tracker), or call "
                "`warnings.filterwarnings('ignore', category=memviz.CaptureWarning)` before it")
    if where == "cli/run.py":
        return "pass --no-gpu to memviz run to silence this warning"
    return "pass gpu=False (`memviz.track(gpu=False)`) to silence this warning"


def _fork_reason() -> Optional[str]:
    """Why this process must not use CUPTI because it is a fork()ed child, or None."""
    if _forked_after_cupti is not None:
        return _forked_after_cupti
    cuda = getattr(sys.modules.get("torch"), "cuda", None)
    try:
        bad = bool(cuda._is_in_bad_fork()) if cuda is not None and hasattr(cuda, "_is_in_bad_fork") else False
    except Exception:  # noqa: BLE001 - a check, never an error for the user
        bad = False
    if bad:
        return ("this process is a fork()ed child of a process that had initialised CUDA "
                "(PyTorch says so). " + _FORK_ADVICE)
    return None


def _torch_installed() -> bool:
    if "torch" in sys.modules:
        return True
    import importlib.util
    try:
        return importlib.util.find_spec("torch") is not None
    except (ImportError, ValueError):
        return False


def _hint_for(result: int) -> str:
    if result == 35:
        return ("The driver restricts profiling to administrators: run as root or with "
                "CAP_SYS_ADMIN, or set the nvidia module option NVreg_RestrictProfilingToAdminUsers=0.")
    if result in (14, 15):
        return ("This libcupti does not work with the installed driver (a CUPTI newer than the "
                "driver is the usual cause): use the CUPTI of the CUDA version your framework was "
                "built with (e.g. the nvidia-cuda-cupti wheel), or update the driver.")
    return CaptureUnavailable.DEFAULT_HINT


def _caller_location() -> str:
    f = sys._getframe(1)
    here = PACKAGE_DIR
    while f is not None and f.f_code.co_filename.startswith(here):
        f = f.f_back
    return f"{f.f_code.co_filename}:{f.f_lineno}" if f is not None else "?"


_OPTIONS = ("gpu", "depth", "activity", "frame_filter", "trace", "precise", "torch", "autograd",
            "graph")


def _check_options(**options: Any) -> None:
    """Tracker()/track()/start() options: names, types and ranges."""
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        raise InvalidArgumentType(f"memviz.track() has no option {unknown[0]!r} (given "
                                  f"{_args.given(options[unknown[0]])}); its options are "
                                  + ", ".join(_OPTIONS))
    for name in ("gpu", "precise"):
        if name in options:
            _args.flag(options[name], f"memviz.track({name}=...)")
    for name in ("activity", "torch", "autograd", "graph"):
        if name in options:
            _args.flag(options[name], f"memviz.track({name}=...)", none=True)
    if "depth" in options:
        _args.whole(options["depth"], "memviz.track(depth=...)", 1, _core.MAX_DEPTH)
    flt = options.get("frame_filter")
    if flt is not None and not isinstance(flt, FrameFilter):
        raise _args.bad_type("memviz.track(frame_filter=...)", flt,
                             "a memviz.FrameFilter (such as memviz.frames) or None")
    if options.get("trace") is not None:
        _args.path(options["trace"], "memviz.track(trace=...)")


def track(**kwargs: Any) -> Tracker:
    """A tracker to use as ``with memviz.track() as t:``; see :class:`Tracker`
    for the options (gpu, depth, activity, frame_filter, trace, precise, torch, autograd,
    graph)."""
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


def _running_tracker(call: str) -> Tracker:
    t = active_tracker()
    if t is None:
        raise NotTracking(
            f"memviz.{call} reads the running tracker, and no memviz tracker is running. What to do: "
            f"call it inside a `with memviz.track() as t:` block (or after memviz.start()); a "
            "stopped tracker keeps its figures: t.current_bytes(), t.peak_bytes(), t.totals().")
    return t


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
    what was allocated after it started). Raises :class:`NotTracking` when no
    tracker runs; :func:`reset_peak` restarts the peak."""
    _args.whole(device, "memviz.get_traced_memory(device=...)", none=True)
    t = _running_tracker("get_traced_memory()")
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

    Raises :class:`NotTracking` when no tracker runs."""
    _running_tracker("reset_peak()").reset_peak()


_label_overflow_warned = False


def _user_label_id(name: str) -> int:
    """The C core's id of a label a user named. Past the label table's size
    (65,534 labels, 4 MiB of text: labels are never forgotten) new names all
    get the overflow label, with one warning per process."""
    global _label_overflow_warned
    from memviz._errors import InvalidArgument

    if "\0" in name:
        raise InvalidArgument(f"memviz.label() names cannot contain NUL characters ('\\0'), got {name!r}: "
                              "remove them or replace them, e.g. name.replace('\\0', ' ').")
    try:
        name.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidArgument(f"memviz.label() names must be text that UTF-8 can encode; {name!r} has a "
                              f"lone surrogate at index {e.start}: pass "
                              "name.encode('utf-8', 'backslashreplace').decode() to keep it visible.") from None
    lid = _core.label_intern(name)
    if _core.label_name(lid) == _core.LABEL_OVERFLOW and name != _core.LABEL_OVERFLOW:
        if not _label_overflow_warned:
            _label_overflow_warned = True
            warnings.warn(CaptureWarning(
                f"memviz's label table is full (65,534 labels or 4 MiB of text); "
                f"{name if len(name) <= 60 else name[:57] + '...'!r} and every new "
                f"label after it are recorded as {_core.LABEL_OVERFLOW!r} (capture_info()['store']"
                "['labels_overflowed'] counts them). Use a few labels that repeat (e.g. 'train step', "
                "not f'step {i}'): memviz.watch(optimizer) records memory per step."),
                stacklevel=warning_site()[0])
    return lid


class label:
    """Attach a name to every allocation this thread makes inside the block.

    ``with memviz.label("data loading"): ...`` or as a decorator. Labels nest;
    the innermost wins. Thread-local: other threads are not affected.

    Label names are kept for the life of the process: past 65,534 distinct
    names (or 4 MiB of their text) new ones are recorded as
    ``"<labels overflowed>"``, said once in a :class:`CaptureWarning` and
    counted in ``capture_info()["store"]["labels_overflowed"]``. A name
    cannot contain NUL characters or lone surrogates
    (:class:`~memviz.MemvizError`).
    """

    def __init__(self, name: str) -> None:
        if not isinstance(name, str) or not name:
            raise _args.bad_type("memviz.label(name)", name, "a non-empty str")
        self.name = name
        self._id = _user_label_id(name)
        self._saved = threading.local()

    def __enter__(self) -> "label":
        stack = getattr(self._saved, "stack", None)
        if stack is None:
            stack = self._saved.stack = []
        stack.append(_core.label_get())
        _core.label_set(self._id)
        return self

    def __exit__(self, *exc) -> None:
        _core.label_set(self._saved.stack.pop())

    def __call__(self, fn):
        import functools

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with self:
                return fn(*args, **kwargs)
        return wrapper


def available() -> bool:
    """Whether GPU capture can run here (a GPU is present and CUPTI loads)."""
    if _fork_reason() is not None:
        return False
    if not os.environ.get(_capture.ENV_LIBRARY) and not _capture.gpu_present()[0]:
        return False
    try:
        _capture.load()
    except CaptureUnavailable:
        return False
    return True


def capture_info(probe: bool = True) -> Dict[str, Any]:
    """Whether CUPTI loaded, which file, which version, and why not.

    With ``probe`` (the default) this tries to load libcupti when a GPU is
    present and it is not loaded yet, so the answer is definite."""
    present, why = _capture.gpu_present()
    lib = _capture.loaded()
    reason = _fork_reason()
    if reason is not None:
        lib = None
    elif lib is None:
        if not probe:
            reason = "libcupti is not loaded (no tracker has captured GPU allocations yet)"
        elif os.environ.get(_capture.ENV_LIBRARY) or present:
            try:
                lib = _capture.load()
            except CaptureUnavailable as e:
                reason = e.reason
        else:
            reason = why
    info: Dict[str, Any] = {
        "available": lib is not None,
        "reason": reason,
        "gpu_present": present,
        "gpu_detail": why,
        "library": lib.path if lib else None,
        "version": lib.version if lib else None,
        "cuda_major": lib.cuda_major if lib else None,
        "found_by": lib.how if lib else None,
        "tried": (lib.tried if lib else _capture.last_tried()),
        "python_frames_abi": _core.FRAMES_ABI,
    }
    core = _core.cupti_info()
    if core:
        info["subscribe_v2"] = core["subscribe_v2"]
    info["pytorch"] = _pytorch_route()
    return info


def _pytorch_route() -> Dict[str, Any]:
    """How the running (or last) tracker sees PyTorch's memory: "route" is
    "allocator" (every block of its caching allocator), "cudaMallocAsync"
    (PyTorch on the driver's pool) or "segments", with "reason" whenever it
    is not "allocator"."""
    t = _active or (_latest() if _latest is not None else None)
    integ = getattr(t, "torch", None) if t is not None else None
    route = getattr(integ, "route", None)
    if route is None:
        alloc = sys.modules.get("memviz.torch.allocator")
        route = alloc.last_route() if alloc is not None else None
    if route is None:
        why = ("no tracker has attached to PyTorch yet" if "torch" in sys.modules
               else "PyTorch is not imported")
        return {"route": None, "reason": why}
    return route.as_dict()


def _at_exit() -> None:
    for t in reversed(list(_running)):
        if t._running:
            try:
                t.stop()
            except Exception:  # noqa: BLE001 - never fail interpreter exit
                pass


def _after_fork_in_child() -> None:
    global _forked_after_cupti, _warned_fork
    if _capture.loaded() is not None or _forked_after_cupti is not None:
        was = "was capturing GPU allocations" if _shared.get("gpu_enabled") else "had loaded CUPTI"
        _forked_after_cupti = (f"this process (pid {os.getpid()}) is a fork()ed child of process "
                               f"{os.getppid()}, which {was}. " + _FORK_ADVICE)
        _warned_fork = False
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
