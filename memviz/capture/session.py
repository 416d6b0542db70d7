"""The capture session: one per process (:func:`current`), the owner of
everything capture keeps per process.

It owns:

* the running capture's options (each tracker's frozen, checked
  :class:`memviz.capture.options.CaptureOptions`; the first tracker's set
  up the capture: :class:`Capture`) and ``precise``, read here for
  everyone (:meth:`CaptureSession.precise`, :func:`allocator_backend`);
* the CUPTI subscription (:func:`subscribe`, started by the first tracker,
  given up at the last stop or for torch.profiler: :meth:`release_cupti`)
  and, without CUPTI, the allocator route the capture runs on;
* the running trackers, in start order, under :data:`lock`, each with its
  :class:`Run`: its window of the C store (src/window.h) while nested, its
  frozen copy once the store went on without it, its subscribers;
* the fork and exit hooks.

Nesting. A tracker started while another runs (in any thread) is nested:
it shares the running capture (CUPTI subscription, depth, precise mode) and
reads a window of the store opened when it started. AlreadyTracking remains
for what cannot be shared (another depth, precise mode the outer did not
choose, its own streamed trace, more than MAX_WINDOWS at once). The store
keeps one step mark per stack for all trackers: the changes one tracker's
mark takes are kept here for every other running tracker until its own
next mark.

Events. What listens to a tracker (the PyTorch integration, the trace
writer, the flight recorder, the step sinks) subclasses
:class:`memviz.capture.events.CaptureEvents` and subscribes to the session for that tracker
(:meth:`CaptureSession.subscribe`); the session tells them, in the order
they subscribed, when it starts, steps, fails (:class:`Trigger`: every
flight-recorder dump goes through :meth:`CaptureSession.failure`), is
frozen and stops (stop in reverse order). Nothing writes a tracker's
private state: the session keeps it in the tracker's :class:`Run`.

Imports the bottom floor, the model and the capture floor only
(docs/architecture.md); the floors above hand it what they build (the
tracker's ``attach`` callback). One concern, the process's capture (what
tracker.py, capture/running.py and capture/nesting.py kept between them),
takes these some 700 lines.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple, Type, TypeVar

import memviz._core as _core
from memviz._errors import AlreadyTracking, CaptureConflict, CaptureUnavailable, NotTracking
from memviz._interrupts import deferred_interrupt
from memviz._package import PACKAGE_DIR
from memviz.capture import availability as _avail, cupti as _cupti, store as _store, threads as _threads
from memviz.capture.events import REQUEST, CaptureEvents, Trigger
from memviz.capture.options import CaptureOptions
from memviz.capture.store import Frozen, NoGpuWindow, Window
from memviz.model.pytorch import alloc_conf, conf_backend

__all__ = ["CaptureSession", "Capture", "Run", "Started", "current", "active_tracker", "lock", "subscribe",
           "allocator_backend", "PRECISE_BACKEND"]

#: PyTorch's allocator backend on the driver's stream-ordered pool (precise mode)
PRECISE_BACKEND = "cudaMallocAsync"

class Started(NamedTuple):
    """What :func:`subscribe` got: activity records on (and why not), and the
    other subscriber CUPTI is shared with (its multi-subscriber mode), if any."""
    activity: bool
    activity_error: Optional[str]
    shared_with: Optional[str]


def subscribe(depth: int, activity: bool) -> Started:
    """Load libcupti and start the C core's capture, beside another
    subscriber where CUPTI allows it (13.5's multi-subscriber mode). Raises
    CaptureUnavailable (with what was tried and what to do) or
    CaptureConflict (another tool holds CUPTI and does not share it)."""
    lib = _cupti.load()  # raises CaptureUnavailable with what it tried
    st = _core.start(depth=depth, activity=activity, cupti=True, shared=True)
    result, step, error, holder = st.result, st.step, st.error, st.holder
    # 39 on CUPTI 12+; older CUPTI answered a second subscriber with 12.
    if result == _core.ERROR_MULTIPLE_SUBSCRIBERS or (result == 12 and step == "cuptiSubscribe"):
        raise CaptureConflict(holder or None, detail=f"{step} returned {error} ({result})")
    if result != 0:
        raise CaptureUnavailable(
            f"{step} failed with {error} ({result}) using {lib.path} (CUPTI version {lib.version})",
            lib.tried + [f"{lib.path}: loaded ({lib.how})", f"{step}: {error} ({result})"],
            hint=_avail.hint_for(result),
        )
    return Started(bool(st.activity), st.activity_error or None, st.shared_with or None)


def allocator_backend() -> Optional[str]:
    """PyTorch's allocator backend: asked of PyTorch where it is imported
    (None on a build without CUDA), else the one its settings will choose
    (memviz.model.pytorch.alloc_conf; None where they choose none)."""
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            return torch.cuda.get_allocator_backend()
        except Exception:  # noqa: BLE001 - a CPU build has no CUDA allocator
            return None
    return conf_backend(alloc_conf())


@dataclass
class Capture:
    """How the running capture was set up by the tracker that started it
    (the trackers nested in it share it)."""
    options: CaptureOptions
    where: str
    gpu_enabled: bool = False
    gpu_off_reason: Optional[str] = None
    activity_enabled: bool = False
    activity_error: Optional[str] = None
    cupti_enabled: bool = False
    cupti_off_reason: Optional[str] = None
    cupti_shared_with: Optional[str] = None
    #: how precise mode was switched on (memviz.torch.precise.enable), or None
    precise_how: Optional[str] = None

    @property
    def depth(self) -> int:
        return self.options.depth

    @property
    def precise(self) -> bool:
        return self.options.precise


class Run:
    """One tracker's part of the session: written by the session only, read
    by the tracker (its window and reading API, memviz/capture/reading.py)."""

    def __init__(self, tracker: Any) -> None:
        self._ref = weakref.ref(tracker)  # a stopped tracker goes when the program drops it
        self._held: Any = None  # and a running one stays while it runs
        #: a nested tracker's window of the store (None: the whole store, or stopped)
        self.view: Optional[Window] = None
        #: its figures copied into Python once the store went on without it
        self.frozen: Optional[Frozen] = None
        self.running = False
        #: the thread stopping it, while stop() runs (None otherwise)
        self.stopping: Optional[int] = None
        #: stopped by a fork(): in the child, the parent's tracker
        self.forked = False
        #: the thread that started it (active_tracker prefers the caller's own)
        self.thread: Optional[int] = None
        #: where in the program it started
        self.where: Optional[str] = None
        #: step-mark changes other trackers' marks took since this one's last (see step_mark)
        self.kept_changes: Dict[int, Any] = {}
        #: what listens to it, in subscription order, and which of those started
        self.subscribers: List[CaptureEvents] = []
        self.started: List[CaptureEvents] = []

    @property
    def tracker(self) -> Any:
        """The tracker this Run is of (None once it is gone)."""
        return self._held if self._held is not None else self._ref()


_S = TypeVar("_S", bound=CaptureEvents)

#: the trackers' state lock (reentrant: a subscriber may read other trackers),
#: held while any tracker starts, stops or shares its step marks
lock = threading.RLock()

_session: Optional["CaptureSession"] = None


class CaptureSession:
    """The process's capture session (see the module's docstring); get it
    with :func:`current`: a second one cannot be made."""

    def __init__(self) -> None:
        global _session
        if _session is not None:
            raise RuntimeError("memviz keeps one capture session per process: use "
                               "memviz.capture.session.current()")
        _session = self
        self.lock = lock
        #: how the running capture was set up (None: none runs)
        self.capture: Optional[Capture] = None
        self._running: List[Run] = []  # start order, all threads
        self._runs: "weakref.WeakKeyDictionary[Any, Run]" = weakref.WeakKeyDictionary()
        self._latest: Optional["weakref.ReferenceType[Run]"] = None  # owns the C store's data
        #: in a fork()ed child: the parent's nested trackers, frozen before the store is reused
        self._forked_views: List["weakref.ReferenceType[Run]"] = []

    # -- the trackers ------------------------------------------------------

    def register(self, tracker: Any) -> Run:
        """A new tracker's Run (the tracker keeps it; the session writes it)."""
        run = Run(tracker)
        self._runs[tracker] = run
        return run

    def run_of(self, tracker: Any) -> Optional[Run]:
        """``tracker``'s Run, or None for an object the session does not know."""
        try:
            return self._runs.get(tracker)
        except TypeError:  # unhashable: not a tracker
            return None

    def running(self) -> List[Any]:
        """The running trackers, in start order (a copy: no lock needed)."""
        return [r.tracker for r in list(self._running)]

    def active(self) -> Optional[Any]:
        """The latest started of the running trackers, or None."""
        now = list(self._running)
        return now[-1].tracker if now else None

    def active_tracker(self) -> Optional[Any]:
        """The running tracker: the latest one this thread started, else the
        latest one started (trackers nest, also across threads); None if none runs."""
        now = list(self._running)
        me = threading.get_ident()
        for r in reversed(now):
            if r.thread == me:
                return r.tracker
        return now[-1].tracker if now else None

    def latest(self) -> Optional[Any]:
        """The tracker whose data the C store holds (the last outermost one started)."""
        run = self._latest() if self._latest is not None else None
        return run.tracker if run is not None else None

    # -- precise mode and the routes: read here for everyone -----------------

    def precise(self, tracker: Any = None) -> bool:
        """Whether PyTorch's allocations are driver calls here (precise
        mode: PyTorch on the driver's stream-ordered pool): ``tracker`` (or
        the running capture) asked for it, or PyTorch runs (or its settings
        choose) the cudaMallocAsync backend."""
        run = self.run_of(tracker) if tracker is not None else None
        if run is not None and run.tracker.options.precise:
            return True
        capture = self.capture
        if capture is not None and capture.precise:
            return True
        return allocator_backend() == PRECISE_BACKEND

    def routes(self, tracker: Any, pytorch: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
        """How ``tracker`` (the running or last one, or None) saw memory:
        {"pytorch": PyTorch's route (allocator, cudaMallocAsync or segments,
        and why; ``pytorch`` where already asked), "sources": the route of
        each source, with the gaps, where a tracker is given} (the words are
        capture/availability.py's)."""
        out: Dict[str, Any] = {"pytorch": pytorch if pytorch is not None else _avail.pytorch_route(tracker)}
        if tracker is not None:
            out["sources"] = _avail.capture_sources(tracker, out["pytorch"])
        return out

    def set_precise_how(self, how: Optional[str]) -> None:
        """How precise mode was switched on for the running capture (its first tracker's)."""
        if self.capture is not None:
            self.capture.precise_how = how

    def holds_cupti(self) -> bool:
        """Whether the running capture records through CUPTI now."""
        return bool(self.capture is not None and self.capture.cupti_enabled and self._running)

    # -- subscribers ---------------------------------------------------------

    def subscribe(self, tracker: Any, subscriber: CaptureEvents, first: bool = False) -> None:
        """``subscriber`` hears ``tracker``'s events from now on (``first``:
        before those already subscribed: precise mode acts before PyTorch
        loads its allocator)."""
        if not isinstance(subscriber, CaptureEvents):
            raise TypeError(f"a capture session subscriber is a CaptureEvents, not {type(subscriber).__name__}")
        run = self._runs[tracker]
        with self.lock:
            if subscriber not in run.subscribers:
                run.subscribers.insert(0, subscriber) if first else run.subscribers.append(subscriber)

    def subscribers(self, tracker: Any, kind: Optional[Type[_S]] = None) -> Tuple[Any, ...]:
        """``tracker``'s subscribers (those of type ``kind``), in order; ()
        for an object the session does not know."""
        run = self.run_of(tracker)
        subs = tuple(run.subscribers) if run is not None else ()
        return subs if kind is None else tuple(s for s in subs if isinstance(s, kind))

    def started(self, tracker: Any) -> Tuple[CaptureEvents, ...]:
        """The subscribers whose on_start ran (and that stop with ``tracker``)."""
        run = self.run_of(tracker)
        return tuple(run.started) if run is not None else ()

    def running_subscribers(self, kind: Type[_S]) -> List[_S]:
        """The subscribers of type ``kind`` of every running tracker, in start order."""
        return [s for r in list(self._running) for s in list(r.subscribers) if isinstance(s, kind)]

    def step(self, tracker: Any, record: Any) -> None:
        """Send a step record to ``tracker``'s subscribers (each hears it;
        the first error is raised after)."""
        error: Optional[BaseException] = None
        for sub in self.subscribers(tracker):
            try:
                sub.on_step(tracker, record)
            except Exception as e:  # noqa: BLE001 - every subscriber hears the step
                error = error or e
        if error is not None:
            raise error

    def failure(self, tracker: Any, trigger: Trigger) -> Optional[str]:
        """Send ``trigger`` to ``tracker``'s subscribers: the flight
        recorder's every dump comes through here. Returns the first file a
        subscriber wrote. Never raises, except for a REQUEST (tracker.dump)."""
        written = None
        for sub in self.subscribers(tracker):
            if trigger.kind == REQUEST:
                got = sub.on_failure(tracker, trigger)
            else:
                try:
                    got = sub.on_failure(tracker, trigger)
                except Exception:  # noqa: BLE001 - an automatic trigger never changes what the program does
                    got = None
            written = written or got
        return written

    # -- start ---------------------------------------------------------------

    def start(self, tracker: Any, attach: Callable[["CaptureSession"], None]) -> None:
        """Start ``tracker``: the capture (the first tracker) or a window of
        it (nested); ``attach(session)`` then subscribes what the floors above
        build for it, and each subscriber hears on_start."""
        run = self._runs[tracker]
        with self.lock:
            if run.running:
                raise AlreadyTracking("this tracker is already running; stop() it before starting it again.")
            if tracker.started_ns is not None:
                raise AlreadyTracking("a Tracker can run once; create a new one with memviz.track().")
            _store.ensure_core()
            if self._running:
                self._start_nested(run, self.active_tracker(), attach)
            else:
                self._start_first(run, attach)
                self._latest = weakref.ref(run)
            run.thread = threading.get_ident()
            run._held = tracker
            self._running.append(run)

    def _start_first(self, run: Run, attach: Callable[["CaptureSession"], None]) -> None:
        tracker = run.tracker
        # The store is about to be reused: keep the previous tracker readable.
        prev = self._latest() if self._latest is not None else None
        if prev is not None and prev is not run:
            self._freeze(prev)
        while self._forked_views:  # a fork()ed child: the parent's nested trackers, as at the fork
            r = self._forked_views.pop()()
            if r is not None and r.frozen is None:
                r.frozen = Frozen(r.view)
        _core.clear()
        run.where = _caller_location()
        _threads.forget()
        self._start_gpu(tracker)
        self.capture = Capture(
            options=tracker.options, where=run.where, gpu_enabled=tracker.gpu_enabled,
            gpu_off_reason=tracker.gpu_off_reason, activity_enabled=tracker.activity_enabled,
            activity_error=tracker.activity_error, cupti_enabled=tracker.cupti_enabled,
            cupti_off_reason=tracker.cupti_off_reason, cupti_shared_with=tracker.cupti_shared_with)
        _threads.watch(True)
        tracker.started_ns = time.monotonic_ns()
        run.running = True
        try:
            self._start_subscribers(run, attach)
        except BaseException:
            # Undo what did start: subscribers, thread watching, the CUPTI subscription;
            # all of it (a Ctrl-C meanwhile is raised after: cut short, the rollback
            # left the capture half on)
            with deferred_interrupt():
                self._stop_started(run)
                run.running = False
                _threads.watch(False)
                if tracker.gpu_enabled:
                    _core.stop()
                self.capture = None
            raise

    def _start_nested(self, run: Run, outer: Any, attach: Callable[["CaptureSession"], None]) -> None:
        tracker, capture = run.tracker, self.capture
        assert capture is not None
        _refuse_nesting(tracker.options, capture)
        view: Window = NoGpuWindow()
        if tracker.gpu_requested:
            view, tracker.baseline = self._open_window()  # its step marks start here
            if capture.gpu_enabled:
                tracker.gpu_enabled = True
                tracker.activity_enabled = capture.activity_enabled
                tracker.activity_error = capture.activity_error
                tracker.cupti_enabled = capture.cupti_enabled
                tracker.cupti_off_reason = capture.cupti_off_reason
                tracker.cupti_shared_with = capture.cupti_shared_with
            else:
                tracker.gpu_off_reason = (f"it is nested in the tracker started at {capture.where}, which does "
                                          f"not capture GPU allocations ({capture.gpu_off_reason})")
        else:
            tracker.gpu_off_reason = "gpu=False was passed"
        tracker.depth = capture.depth
        tracker.outer = outer
        run.view = view
        run.where = _caller_location()
        tracker.started_ns = time.monotonic_ns()
        run.running = True
        try:
            self._start_subscribers(run, attach)
        except BaseException:
            with deferred_interrupt():  # all of the rollback, as _start_first's
                self._stop_started(run)
                run.running = False
                run.view = None
                _core.window_close(view.id)
            raise

    def _start_subscribers(self, run: Run, attach: Callable[["CaptureSession"], None]) -> None:
        attach(self)
        for sub in list(run.subscribers):
            # A Ctrl-C inside a subscriber's start is raised once the subscriber is on
            # the started list, so the caller's rollback stops it: raised halfway, it
            # left a trace's native writer running, and every later trace or flight
            # recorder of the process was refused.
            with deferred_interrupt():
                sub.on_start(run.tracker)
                run.started.append(sub)

    def _stop_started(self, run: Run) -> None:
        for sub in reversed(run.started):
            try:
                sub.on_stop(run.tracker)
            except Exception:  # noqa: BLE001 - the first error is the one to report
                pass

    # -- the CUPTI subscription and the allocator route ----------------------

    def _start_gpu(self, tracker: Any) -> None:
        opts: CaptureOptions = tracker.options
        if not opts.gpu:
            tracker.gpu_off_reason = "gpu=False was passed"
            return
        forked = _avail.fork_reason()
        if forked is not None:  # never call CUPTI here: its state belongs to the parent
            tracker.gpu_off_reason = forked
            _avail.warn_forked(forked)
            return
        explicit = os.environ.get(_cupti.ENV_LIBRARY)
        present, why = _cupti.gpu_present()
        if not explicit and not present:
            tracker.gpu_off_reason = why
            _avail.warn_gpu_off(why)
            return
        with_torch = opts.with_torch
        if opts.cupti is False:
            if not with_torch:
                tracker.gpu_off_reason = ("cupti=False was passed without the PyTorch integration, "
                                          "the only other way memviz sees GPU memory")
                return
            self._start_without_cupti(tracker, "cupti=False was passed")
            return
        try:
            started = subscribe(opts.depth, opts.activity)
        except CaptureConflict as e:
            if opts.cupti:  # cupti=True: CUPTI or nothing
                raise
            reason = _avail.conflict_reason(e)
            if not with_torch:  # nothing else to see GPU memory through
                tracker.gpu_off_reason = (
                    f"{reason}, and without the PyTorch integration "
                    f"({'torch=False was passed' if opts.torch is False else 'PyTorch is not installed'}) "
                    "memviz has no other way to see GPU memory")
                _avail.warn_gpu_off(tracker.gpu_off_reason)
                return
            self._start_without_cupti(tracker, reason)
            _avail.warn_without_cupti(reason)
            return
        tracker.gpu_enabled = True
        tracker.cupti_enabled = True
        tracker.cupti_shared_with = started.shared_with
        tracker.activity_enabled = started.activity
        tracker.activity_error = started.activity_error

    def _start_without_cupti(self, tracker: Any, reason: str) -> None:
        """GPU capture on the wrappers alone: PyTorch's blocks (the allocator
        route) and segments (its cudaMalloc/cudaFree), no CUPTI."""
        _core.start(depth=tracker.options.depth, activity=False, cupti=False)
        tracker.gpu_enabled = True
        tracker.cupti_enabled = False
        tracker.cupti_off_reason = reason
        tracker.activity_enabled = False
        tracker.activity_error = f"CUPTI is not used ({reason})"

    def release_cupti(self, reason: str, before: Optional[Callable[[], Any]] = None) -> bool:
        """Give CUPTI up now (another tool, torch.profiler, is about to
        subscribe) and go on without it; ``before()`` runs first, under the
        lock (the PyTorch integration wraps PyTorch's segments then, so none
        is missed). True if CUPTI was held."""
        with self.lock:
            root = self._running[0].tracker if self._running else None
            if root is None or not root.cupti_enabled:
                return False
            if before is not None:
                before()
            if not _core.release_cupti():
                return False
            activity_error = f"CUPTI is not used ({reason})"
            for r in self._running:  # the outermost tracker and those nested in it
                t = r.tracker
                t.cupti_enabled, t.cupti_off_reason = False, reason
                t.activity_enabled, t.activity_error = False, activity_error
            if self.capture is not None:
                self.capture.cupti_enabled, self.capture.cupti_off_reason = False, reason
                self.capture.activity_enabled, self.capture.activity_error = False, activity_error
        _avail.warn_cupti_released(reason)
        return True

    # -- stop and freeze -------------------------------------------------------

    def stop(self, tracker: Any) -> None:
        """Stop ``tracker``. The last running tracker to stop unsubscribes
        from CUPTI (so torch.profiler can run); one that stops while others
        run keeps a copy of what it saw until now."""
        run = self._runs[tracker]
        with self.lock:
            if not run.running:
                if run.forked:
                    return
                raise NotTracking("this tracker is not running: start() it first, or use "
                                  "`with memviz.track() as t:`.")
            if run.stopping is not None:
                # A stop inside this stop, on the same thread (the session's lock is
                # reentrant): a signal handler's or a finaliser's. The stop under way
                # finishes when it returns; run again, it waited on the trace writer's
                # lock its own outer frame held, for ever.
                return
            run.stopping = threading.get_ident()
            last = len(self._running) == 1 and self._running[0] is run
            try:
                try:
                    if last:
                        _threads.watch(False)
                    _threads.note_running_threads()
                finally:  # a Ctrl-C above: capture stops all the same
                    if last and self.capture is not None and self.capture.gpu_enabled and not run.forked:
                        _core.stop()  # first, so subscribers (the trace writer) see every event
            finally:
                errors = []
                for sub in reversed(run.subscribers):
                    try:
                        sub.on_stop(tracker)
                    except BaseException as e:  # noqa: BLE001 - stop every subscriber, then raise
                        errors.append(e)
                try:
                    if run.view is not None or not last:
                        self._freeze(run)  # the store goes on without this tracker
                finally:
                    with deferred_interrupt():  # a Ctrl-C here: raised once this tracker is off the list
                        if run.view is not None:
                            _core.window_close(run.view.id)
                            run.view = None
                        run.running = False
                        tracker.stopped_ns = time.monotonic_ns()
                        if run in self._running:
                            self._running.remove(run)
                        run._held = None
                        run.stopping = None
                        if not self._running:
                            self.capture = None
                if errors:
                    raise errors[0]

    def freeze(self, tracker: Any) -> None:
        """Copy ``tracker``'s figures into Python now (see _freeze)."""
        run = self._runs[tracker]
        with self.lock:
            self._freeze(run)

    def _freeze(self, run: Run) -> None:
        if run.frozen is None and run.tracker is not None:  # a tracker gone needs no copy
            # A nested tracker freezes only when it stops: its window closes in the same instant.
            run.frozen = Frozen(run.view, close=run.view is not None)
            for sub in list(run.subscribers):
                sub.on_freeze(run.tracker)

    # -- nesting: windows and step marks --------------------------------------

    def _open_window(self) -> Tuple[Window, Dict[int, int]]:
        """A new window of the store and the bytes per device live as it
        opens; AlreadyTracking when MAX_WINDOWS are open. Its step marks
        start now (the other trackers keep theirs)."""
        opened = _core.window_open()
        if opened is None:
            raise AlreadyTracking(
                f"{_core.MAX_WINDOWS} nested trackers are already running in this process, the "
                "most memviz keeps figures for at once. Stop one of them first, or read the "
                "figures of the tracker they are nested in.")
        view = Window(opened.id, opened.start_ns)
        self._share_marks(None, view.step_mark().changes)
        return view, opened.live

    def step_mark(self, tracker: Any):
        """The store's step mark, or a nested tracker's: ({device:
        _core.StepTotals}, the _core.StepChange of each stack changed since
        this tracker's previous mark)."""
        run = self._runs[tracker]
        mark = run.view.step_mark() if run.view is not None else _core.step_mark()
        return mark.devices, self._share_marks(run, mark.changes)

    def _share_marks(self, me: Optional[Run], changed: List[Any]) -> List[Any]:
        """The store keeps one step mark per stack for all trackers: the
        changes one tracker's mark takes are kept for every other running
        tracker until its own next mark (so each sees the changes since its
        own previous mark, or its start). Returns ``me``'s changes, its kept
        ones included."""
        with self.lock:
            for r in self._running:
                if r is not me and changed and not isinstance(r.view, NoGpuWindow):
                    _absorb(r.kept_changes, changed)
            mine = me.kept_changes if me is not None else {}
            if me is not None:
                me.kept_changes = {}
        if not mine:
            return changed
        _absorb(mine, changed)
        return list(mine.values())

    # -- the process's exit and fork() ----------------------------------------

    def at_exit(self) -> None:
        """Stop every running tracker (never fails interpreter exit). A Ctrl-C
        meanwhile is held until all have stopped (a trace left without its END
        record, the trackers after it left running), then dropped: the
        process is ending; a SIGTERM then takes its course."""
        try:
            with deferred_interrupt():
                for r in reversed(list(self._running)):
                    if r.running:
                        try:
                            r.tracker.stop()
                        except BaseException:  # noqa: BLE001 - never fail interpreter exit
                            pass
        except KeyboardInterrupt:
            pass

    def after_fork_in_child(self) -> None:
        """In a fork()ed child: the parent's trackers stop here without
        touching the capture (its state is the parent's); nested ones are
        frozen, as at the fork, before the store is reused."""
        _avail.after_fork(bool(self.capture is not None and self.capture.gpu_enabled))
        # The lock as new: a thread of the parent's that held it at the fork (a step, a
        # stop) does not exist here, and the child's first tracker waited on it for ever.
        # Reset in place: other modules hold the same object (memviz/capture/reading.py)
        reinit = getattr(self.lock, "_at_fork_reinit", None)
        if reinit is not None:
            reinit()
        for r in self._running:
            r.forked = True
            r.running = False
            r._held = None
            if r.view is not None:
                self._forked_views.append(weakref.ref(r))
        self._running.clear()
        self.capture = None


def _refuse_nesting(opts: CaptureOptions, capture: Capture) -> None:
    """Raise AlreadyTracking where a tracker with ``opts`` asks for what the
    running capture cannot share with it."""
    where = capture.where
    if opts.trace_path is not None:
        raise AlreadyTracking(
            f"this tracker would be nested in the one started at {where}, and a nested tracker "
            "cannot stream its own trace (trace=): the event stream serves one trace file per "
            "process. Leave out trace= and call t.save(path) after the block, or stream from the "
            "outermost tracker (memviz run -o FILE).")
    if opts.depth_given and opts.depth != capture.depth:
        raise AlreadyTracking(
            f"this tracker asks for depth={opts.depth}, but it would be nested in the tracker "
            f"started at {where}, whose capture keeps depth={capture.depth} frames, shared by "
            f"the trackers nested in it. Pass depth={capture.depth} or leave depth out, or "
            "start the outer tracker with the depth you need.")
    if opts.precise and not capture.precise:
        raise AlreadyTracking(
            f"precise mode must be chosen by the outer tracker (started at {where}) before CUDA "
            "initialises; a tracker nested in it cannot switch it on. Start the outer tracker "
            "with precise=True (memviz run --precise), or leave precise out here.")


def _absorb(kept: Dict[int, Any], changed: List[Any]) -> None:
    """Add step-mark changes (``_core.StepChange``) into ``kept``, per stack."""
    for c in changed:
        old = kept.get(c.stack_id)
        if old is not None:
            c = _core.StepChange((c.stack_id, c.live_bytes, c.live_count,
                                  c.delta_bytes + old.delta_bytes, c.delta_count + old.delta_count,
                                  c.block_bytes, c.block_delta + old.block_delta))
        kept[c.stack_id] = c


def _caller_location() -> str:
    """The first frame outside memviz: where the program started a tracker;
    or memviz's pytest plugin, where it started one for a marked test (the
    frame outside memviz is then pytest's own, which names nothing the user
    wrote)."""
    f, last = sys._getframe(1), None
    while f is not None and f.f_code.co_filename.startswith(PACKAGE_DIR):
        f, last = f.f_back, f
    if last is not None and last.f_code.co_filename.endswith(os.path.join("integrations", "pytest_plugin.py")):
        return "memviz's pytest plugin, for the test's @pytest.mark.memviz marker"
    return f"{f.f_code.co_filename}:{f.f_lineno}" if f is not None else "?"


def current() -> CaptureSession:
    """This process's capture session."""
    assert _session is not None
    return _session


def active_tracker() -> Optional[Any]:
    """The running tracker: the latest one this thread started, else the
    latest one started (trackers nest, also across threads); None if none runs."""
    return current().active_tracker()


CaptureSession()
atexit.register(current().at_exit)
os.register_at_fork(after_in_child=current().after_fork_in_child)
