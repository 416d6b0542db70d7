"""The flight recorder: ``memviz.track(flight_recorder="256 MiB")`` and
``python -m memviz run --flight-recorder 256MiB``.

It keeps what a trace would hold, in memory and bounded: the C core's
writer thread (src/trace_writer.c) compresses the events into chunks kept
in a budget; when the budget is full the oldest chunk is folded into the
live set at the start of what is kept (so every allocation live then is
still known, with its line), and freed. Nothing is written until a dump,
which is a normal .memviz file (``memviz report``, ``memviz.load``):

* when an allocation fails: PyTorch's out-of-memory error (from its
  observer, before the exception reaches the program), or a failed driver
  call (seen by the recorder's thread within a fraction of a second);
* when an exception leaves ``track()`` or the script ``memviz run`` runs;
* on SIGUSR1 (``kill -USR1 <pid>``): the handler only notes the request
  and wakes the recorder's thread, which writes the dump (a handler runs
  between two bytecodes of the main thread, maybe inside memviz's own dump
  or a library holding its lock: it takes no lock and writes no file).
  Signals coalesce (any number during a dump ask for one more) and are
  rate-limited: the first at once, then at most one a minute
  (``_SIGNAL_DUMP_GAP_S``), a request inside the gap written when it ends;
* on ``tracker.dump(path)``.

Every trigger goes through the capture session (memviz/capture/session.py,
``failure``, with a ``Trigger`` saying which): the PyTorch integration's
out-of-memory observer, the tracker's ``__exit__`` and ``dump()``, ``memviz
run``, and the recorder's own thread for a failed driver call and SIGUSR1;
the recorder hears them as a subscriber (``on_failure``).

A dump that cannot be written says so on stderr at most once a minute
(``_WARN_GAP_S``, with the count of the failures not said), and never
raises into the program. Hidden temporary files that dumps of killed
processes left in the recorder's folder are removed when a recorder starts
and before each dump, once no process holds them (memviz._output_files.remove_stale_temps).

A dump's file name carries the time, the pid and the rank
(``memviz-flight-20261201T142800123Z-pid4242-rank0.memviz``); its END
record says what it covers ("flight_recorder": from when to when, how many
events were folded away, why it was written).

The budget counts the recorder's own memory: the ring the capture path
writes into, the compressed chunks and the folded live set. The capture
path's cost is the trace ring's (one record per event); compressing runs on
the writer thread, without the GIL.
"""

from __future__ import annotations

import os
import select
import signal
import sys
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

import memviz._core as _core
from memviz._errors import InvalidArgument, NotTracking, TraceError
from memviz._interrupts import deferred_interrupt
from memviz._output_files import output_file, remove_stale_temps
from memviz._units import format_size, parse_size
from memviz.capture import events as _events, session as _session
from memviz.capture.rank_files import timestamped_name
from memviz.trace.format import END, EVENT_LEVEL, META, chunk, header, json_bytes
from memviz.trace.writer import _meta, _NewTables, _outside, _pytorch_peak, frame_settings, refuse_running_writer

__all__ = ["FlightRecorder", "parse_budget", "MIN_BUDGET"]

#: the smallest budget: the ring and one chunk must fit, with room for history
#: (src/trace_writer.h, which splits the budget: _core.flight_split)
MIN_BUDGET = _core.FLIGHT_MIN_BUDGET
#: how often the recorder names new stacks and looks for failed allocations
_INTERVAL = 0.25
#: dumps a failed driver call may cause: the first, then at most one a minute
_FAILURE_DUMP_GAP_S = 60.0
_MAX_FAILURE_DUMPS = 3
#: SIGUSR1 dumps: the first at once, then at most one in this many seconds
_SIGNAL_DUMP_GAP_S = 60.0
#: "could not write its dump" on stderr: at most once in this many seconds
_WARN_GAP_S = 60.0
#: seconds the failing thread is held at most, at an out-of-memory error, the
#: freeze included, waiting for its dump to be on disk before PyTorch raises
#: (a larger dump is finished by the recorder's thread; the recorder's stop,
#: at exit too, waits for it)
_FAILURE_WAIT_S = 0.09


def not_recording(forked: bool) -> str:
    """What dump() says when the tracker's flight recorder is not recording."""
    if forked:
        return ("dump() in a fork()ed child: the flight recorder records in the parent process, "
                "which alone can dump it; call dump() there, or start a tracker with its own "
                "flight recorder in this process")
    return ("dump() writes a flight recorder's memory while its tracker runs, and this tracker "
            "has stopped (its recorder's memory went with it); call dump() before stop(), or "
            "use save(path) to write what the stopped tracker holds")


def parse_budget(value: Any, where: str = "memviz.track(flight_recorder=...)") -> int:
    """The budget in bytes (a size: ``"256 MiB"``, ``268435456``), checked."""
    try:
        budget = parse_size(value)
    except (ValueError, TypeError) as e:
        raise InvalidArgument(f"{where} takes a memory budget such as '256 MiB', got {value!r}: {e}") from None
    if budget < MIN_BUDGET:
        raise InvalidArgument(f"{where}: a flight recorder needs at least {format_size(MIN_BUDGET)} "
                              f"(given {format_size(budget)}); give '256 MiB' or more to keep "
                              "minutes of a training run")
    return budget


class _Job:
    """A dump frozen on the failing thread, for the recorder's thread to write."""

    __slots__ = ("target", "head", "frozen", "tail", "reason", "done")

    def __init__(self, target: str, head: bytes, frozen: Any, tail: bytes, reason: str) -> None:
        self.target, self.head, self.frozen, self.tail, self.reason = target, head, frozen, tail, reason
        self.done = threading.Event()


#: the pipe SIGUSR1's handler wakes the recorder's thread through, (read, write),
#: both non-blocking; made once and never closed, so that a handler left
#: installed (a recorder stopped off the main thread) never writes into a
#: descriptor closed and reused since
_wake_fds: Optional[Tuple[int, int]] = None
_wake_lock = threading.Lock()


def _wake_pipe() -> Tuple[int, int]:
    global _wake_fds
    with _wake_lock:
        if _wake_fds is None:
            r, w = os.pipe()
            os.set_blocking(r, False)
            os.set_blocking(w, False)
            _wake_fds = (r, w)
        return _wake_fds


def _after_fork_in_child() -> None:
    """A child makes its own pipe (the parent's thread reads the inherited
    one; the inherited descriptors stay open, never written by the child:
    its handler checks the pid first)."""
    global _wake_fds, _wake_lock
    _wake_fds = None
    _wake_lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _say(text: str) -> None:
    """A line on stderr; nothing when stderr is gone, closed or full."""
    stream = sys.stderr
    if stream is None:
        return
    try:
        print(text, file=stream, flush=True)
    except Exception:  # noqa: BLE001 - a message must never change what the program does
        pass


class FlightRecorder(_events.CaptureEvents):
    """The recorder of one tracker (a subscriber to the capture session; see the module doc)."""

    def __init__(self, tracker: Any, budget: int, folder: Optional[str] = None) -> None:
        self.tracker = tracker
        self.budget = int(budget)
        self.folder = os.fspath(folder) if folder is not None else None
        self._where: Optional[str] = None  # the folder, absolute, fixed at start
        #: files written, oldest first
        self.dumps: List[str] = []
        self.error: Optional[str] = None
        self._new = _NewTables(tracker)
        self._tables: List[bytes] = []  # every table chunk so far (a dump writes them all)
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._running = False
        self._failures_seen = 0
        self._failure_dumps = 0
        self._last_failure_dump = 0.0
        self._old_handler: Any = None
        self._handler: Any = None  # memviz's SIGUSR1 handler while installed
        self._handler_installed = False
        self._pid = os.getpid()
        #: a SIGUSR1 asked for a dump that the thread has not begun (set by the
        #: handler, cleared by the thread as it begins one: a plain attribute, no lock)
        self._signal_pending = False
        self._next_signal_dump = 0.0  # monotonic: no SIGUSR1 dump before this
        self._deferral_said = False
        self._warned_at: Optional[float] = None  # monotonic: the last "could not write" said
        self._unsaid_failures = 0
        self._jobs: List[_Job] = []  # frozen dumps the thread has not written yet (under _lock)
        # the budget split between the capture ring (its events), the chunks
        # kept with their base, and the ring's and the writer's fixed memory
        # (src/trace_writer.h, mvz_tw_flight_split)
        self.capacity, self._chunk_budget, self._fixed_memory = _core.flight_split(self.budget)

    # -- the capture session's events

    def on_start(self, tracker: Any) -> None:
        refuse_running_writer()
        # Fixed now: a script that changes its folder later must not send the
        # dumps elsewhere (or fail them: the folder checked here is not there)
        folder = self._where = os.path.abspath(self.folder if self.folder is not None else os.getcwd())
        if os.path.lexists(folder) and not os.path.isdir(folder):
            raise TraceError("the flight recorder's folder exists and is not a folder (a file or a "
                             "broken link is there), so no dump could be written", folder,
                             hint="give flight_dir= (or --flight-dir) a folder, or a path where "
                                  "memviz may make one; or move what is there out of the way")
        if not os.path.isdir(folder):  # missing: made, with its parents, as mkdir -p does
            try:
                os.makedirs(folder, exist_ok=True)
            except OSError as e:
                raise TraceError(f"the flight recorder's folder could not be made: {e.strerror or e}",
                                 folder, hint="give flight_dir= (or --flight-dir) a folder you may "
                                              "write to, or make it first") from e
        if not os.access(folder, os.W_OK | os.X_OK):
            raise TraceError("the flight recorder's folder is not writable, so no dump could be "
                             "written", folder, hint="give flight_dir= (or --flight-dir) a folder "
                                                     "you may write to")
        remove_stale_temps(folder)
        # What a dump's END reads, imported now: not on the failing thread at an out-of-memory error
        import memviz.capture.device  # noqa: F401
        import memviz.model.pytorch  # noqa: F401
        self._meta = _meta(tracker, "flight")
        self._failures_seen = self._failed_now()  # an outer tracker's earlier failures are not this one's
        try:
            _core.trace_enable(self.capacity)
            try:
                _core.trace_writer_start(-1, self.capacity, EVENT_LEVEL, _INTERVAL, self._chunk_budget)
            except OSError as e:
                raise TraceError(f"the flight recorder could not start its writer thread: {e.strerror or e}",
                                 None, hint="the process may be out of threads or memory; try a smaller "
                                            "budget, or run without the flight recorder") from e
            self._running = True
            self._thread = threading.Thread(target=self._run, name="memviz-flight-recorder", daemon=True)
            self._thread.start()
            self._install_signal()
        except BaseException:
            # Whatever had started, stopped (else the native writer kept the ring, and
            # every later flight recorder or trace of the process was refused)
            with deferred_interrupt():
                self._stop.set()
                self._wake()
                self._restore_signal()
                with self._lock:  # as on_stop: a thread already started writes under it
                    self._shut(started=True)  # or not: no other writer ran (checked above)
            raise

    def on_stop(self, tracker: Any) -> None:
        """Stop the thread (it writes a SIGUSR1 dump still asked for), the
        native writer, and give SIGUSR1 back. A Ctrl-C while it waits for the
        thread cuts the wait short; one while it stops the writer is held
        until it has (memviz/_interrupts.py)."""
        try:
            self._stop.set()
            self._wake()
            if self._thread is not None and self._thread is not threading.current_thread():
                self._thread.join(timeout=10)
            if self._thread is None or not self._thread.is_alive():
                self._write_jobs()  # frozen as the thread ended: written here, before the writer stops
        finally:
            try:
                with deferred_interrupt():
                    self._restore_signal()
                    with self._lock:
                        self._shut()
            finally:
                self._restore_signal()
                if self._running:  # interrupted before the lock was taken
                    self._shut()

    def on_freeze(self, tracker: Any) -> None:
        """Nothing to keep: a stopped recorder's memory is given back."""

    # -- what it holds

    def stats(self) -> Dict[str, Any]:
        """What the recorder holds now: events kept and folded, bytes, the
        window it covers (monotonic ns), and its budget."""
        s = _core.trace_writer_stats()
        return {"budget": self.budget, "ring_events": self.capacity,
                "kept_events": s["kept_events"], "kept_bytes": s["kept_bytes"],
                "folded_events": s["evicted"], "folded_until_ns": s["evicted_until"] or None,
                "base_allocations": s["base_count"], "base_bytes": s["base_bytes"],
                "window_start_ns": s["window_start"] or None, "window_end_ns": s["window_end"] or None,
                "dropped_events": s["dropped"], "events": s["events"],
                "memory": self._fixed_memory + s["kept_bytes"] + s["base_bytes"],
                "compressed": s["compressed"], "dumps": list(self.dumps)}

    # -- dumps

    def dump(self, path: Optional[str] = None, reason: str = "tracker.dump()") -> str:
        """Write what the recorder holds to ``path`` (or a new file named with
        the time, pid and rank in the recorder's folder); returns the path."""
        with self._lock:
            if not self._running:
                raise NotTracking(not_recording(os.getpid() != self._pid))
            job = self._freeze(reason, path)
            try:
                self._write(job)
            finally:
                _core.trace_writer_frozen_free(job.frozen)
            return job.target

    def dump_quietly(self, reason: str) -> Optional[str]:
        """dump() for the automatic triggers: never raises; says on stderr
        where the file went, or why none could be written (that at most once
        a minute)."""
        if os.getpid() != self._pid:
            return None
        try:
            path = self.dump(reason=reason)
        except Exception as e:  # noqa: BLE001 - a dump must never change what the program does
            self.error = f"{type(e).__name__}: {e}"
            self._warn_failed(reason)
            return None
        _say(f"memviz: flight recorder dump ({reason}) written to {path}; read it with "
             f"`python -m memviz report {path}`")
        return path

    def on_failure(self, tracker: Any, trigger: "_events.Trigger") -> Optional[str]:
        """A trigger, through the capture session: a dump asked for
        (REQUEST: written now, errors raised), an allocation failed where
        PyTorch raises (OOM: see _hold_for_failure), or another (an
        exception, SIGUSR1, a failed driver call: written now, never raising).
        Returns the file written (None for OOM: the recorder's thread writes it)."""
        if trigger.kind == _events.REQUEST:
            return self.dump(trigger.path, reason=trigger.reason)
        if trigger.kind == _events.OOM:
            self._hold_for_failure(trigger.reason)
            return None
        return self.dump_quietly(trigger.reason)

    def _hold_for_failure(self, reason: str) -> None:
        """An allocation failed where PyTorch raises. The failing thread
        freezes the dump (the names so far, the END record of this moment,
        and a reference to every chunk the recorder keeps: milliseconds,
        whatever the budget) and the recorder's thread writes it; the
        failing thread is held at most _FAILURE_WAIT_S in all, so a
        small dump is on disk before the exception reaches the program and a
        large one a moment later (the recorder's stop waits for it, at exit
        too). Never raises."""
        began = time.monotonic()
        job = self._freeze_quietly(reason)
        if job is not None:  # the freeze counts against the wait
            job.done.wait(max(0.0, _FAILURE_WAIT_S - (time.monotonic() - began)))

    def wait_for_dumps(self, timeout: Optional[float] = None) -> bool:
        """Wait until every dump frozen so far is written (or failed);
        False if ``timeout`` seconds passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                jobs = list(self._jobs)
            if not jobs:
                return True
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            jobs[0].done.wait(left)

    def _freeze_quietly(self, reason: str) -> Optional[_Job]:
        """The failing thread's half of a dump (on_failure); None when there
        is none to write (said on stderr as dump_quietly says it), or when
        the recorder's thread is not there, which then dumps here, whole."""
        if os.getpid() != self._pid:
            return None
        if self._thread is None or not self._thread.is_alive():
            self.dump_quietly(reason)
            return None
        try:
            with self._lock:
                if not self._running:
                    return None
                job = self._freeze(reason)
                self._jobs.append(job)
        except Exception as e:  # noqa: BLE001 - a dump must never change what the program does
            self.error = f"{type(e).__name__}: {e}"
            self._warn_failed(reason)
            return None
        self._wake()
        return job

    def _write_jobs(self) -> None:
        """The recorder's thread: write the dumps frozen on failing threads."""
        while True:
            with self._lock:
                if not self._jobs:
                    return
                job = self._jobs[0]
            try:
                self._write(job)
                _say(f"memviz: flight recorder dump ({job.reason}) written to {job.target}; read it "
                     f"with `python -m memviz report {job.target}`")
            except Exception as e:  # noqa: BLE001 - a dump must never change what the program does
                self.error = f"{type(e).__name__}: {e}"
                self._warn_failed(job.reason)
            finally:
                _core.trace_writer_frozen_free(job.frozen)
                with self._lock:
                    self._jobs.remove(job)
                job.done.set()

    def _freeze(self, reason: str, path: Optional[str] = None) -> _Job:
        """A dump as the recorder holds it now (self._lock held): the names
        so far, a reference to every chunk kept and the base
        (_core.trace_writer_freeze: milliseconds, whatever the budget), and
        the END record of this moment; _write writes it."""
        if path is None:
            remove_stale_temps(self._folder())
        target = os.fspath(path) if path is not None else self._new_path()
        self._name_new()  # the failing allocation's stack among them
        started = time.monotonic_ns()
        head = (header() + chunk(META, json_bytes(dict(self._meta, dumped_because=reason)))
                + b"".join(self._tables))
        try:
            frozen = _core.trace_writer_freeze()
        except OSError as e:
            raise TraceError(f"the flight recorder's events could not be taken for a dump: {e.strerror or e}",
                             target, hint="the process may be out of memory; free some, or use a smaller "
                                          "flight_recorder budget") from e
        try:
            s = _core.trace_writer_stats()
            last = self._name_new()  # stacks of the last events, taken by the freeze
            tail = b"".join(last) + chunk(END, json_bytes(self._end(s, reason, started)))
        except BaseException:
            _core.trace_writer_frozen_free(frozen)
            raise
        self._failures_seen = max(self._failures_seen, self._failed_now())
        return _Job(target, head, frozen, tail, reason)

    def _write(self, job: _Job) -> None:
        """Write a frozen dump to its file (a temporary name, fsync, then the
        name): on the caller's thread for dump(), on the recorder's for the
        failing thread's."""
        with output_file(job.target, "the flight recorder's dump", binary=True,
                         hint="choose a folder you may write to (flight_dir=... or "
                              "--flight-dir), with room for the dump") as f:
            f.write(job.head)
            f.flush()
            try:
                _core.trace_writer_frozen_write(job.frozen, f.fileno())
            except OSError as e:
                raise TraceError(f"cannot write the flight recorder's dump: {e.strerror or e}",
                                 job.target, hint="free some disk space, or choose another folder") from e
            f.write(job.tail)
        self.dumps.append(job.target)

    # -- internals

    def _folder(self) -> str:
        if self._where is not None:
            return self._where
        return self.folder if self.folder is not None else os.getcwd()

    def _new_path(self) -> str:
        folder = self._folder()
        name = timestamped_name("memviz-flight")
        path = os.path.join(folder, name)
        n = 1
        pending = {j.target for j in self._jobs}
        while os.path.exists(path) or path in pending:
            path = os.path.join(folder, name[:-len(".memviz")] + f"-{n}.memviz")
            n += 1
        return path

    def _warn_failed(self, reason: str) -> None:
        now = time.monotonic()
        if self._warned_at is not None and now - self._warned_at < _WARN_GAP_S:
            self._unsaid_failures += 1
            return
        more = (f" ({self._unsaid_failures} more dumps failed since the last such message)"
                if self._unsaid_failures else "")
        self._warned_at, self._unsaid_failures = now, 0
        _say(f"memviz: the flight recorder could not write its dump ({reason}): {self.error}{more}; "
             f"memviz says this at most once a minute")

    def _name_new(self) -> List[bytes]:
        """Name what is new (stacks, labels, threads, steps), keep it, and
        return those chunks."""
        new = self._new.chunks()
        self._tables += new
        return new

    def _failed_now(self) -> int:
        return sum(v.get("failed", 0) for v in _core.totals().values())

    def _end(self, s: Dict[str, Any], reason: str, started: int) -> Dict[str, Any]:
        totals = _core.totals()
        return {
            "stopped_monotonic_ns": time.monotonic_ns(), "stopped_wall_time": time.time(),
            "failures": sum(v.get("failed", 0) for v in totals.values()),
            "stats": _core.stats(), "outside": _outside(), "sources": _sources(self.tracker),
            "frames": frame_settings(self.tracker),
            "events": s["kept_events"], "dropped_events": s["dropped"],
            "flight_recorder": {
                "reason": reason, "budget": self.budget, "dumped_at_ns": started,
                "window_start_ns": s["window_start"], "window_end_ns": s["window_end"],
                "events_kept": s["kept_events"], "events_folded": s["evicted"],
                "folded_until_ns": s["evicted_until"], "allocations_before_window": s["base_count"],
                "events_dropped": s["dropped"], "recording_started_ns": self.tracker.started_ns or 0,
                "run_peak": {str(d): v.get("peak", 0) for d, v in totals.items()},
            },
            **_pytorch_peak(self.tracker),
        }

    def _shut(self, started: bool = False) -> None:
        """The native writer stopped and its memory given back (once; with
        started, whether or not this recorder knew it had begun)."""
        if not (self._running or started):
            return
        self._running = False
        try:
            _core.trace_writer_stop()
        finally:
            _core.trace_disable()
            _core.trace_writer_release()

    def _wake(self) -> None:
        try:
            os.write(_wake_pipe()[1], b"\0")
        except OSError:  # full: the thread has bytes to wake it already
            pass

    def _run(self) -> None:
        """The recorder's thread: the dumps frozen at out-of-memory errors,
        SIGUSR1's when woken; names new stacks once a second; a failed
        driver call's dump."""
        try:
            poller: Any = select.poll()
            rfd = _wake_pipe()[0]
            poller.register(rfd, select.POLLIN)
        except (AttributeError, OSError):
            poller = None
        last_named = time.monotonic()
        while True:
            if poller is None:
                self._stop.wait(_INTERVAL)
            else:
                try:
                    if poller.poll(int(_INTERVAL * 1000)):
                        while os.read(rfd, 4096):
                            pass
                except (BlockingIOError, InterruptedError):
                    pass
                except OSError:
                    poller = None
            try:
                self._write_jobs()  # an out-of-memory error's dump first: its thread may be waiting
                if self._signal_pending:
                    self._signal_dump()
                if self._stop.is_set():
                    return
                now = time.monotonic()
                if now - last_named >= 1.0:  # names once a second; a dump names the rest itself
                    last_named = now
                    with self._lock:
                        if not self._running:
                            return
                        self._name_new()
                failed = self._failed_now()
                if failed > self._failures_seen:
                    self._failures_seen = failed
                    if (self._failure_dumps < _MAX_FAILURE_DUMPS
                            and (not self._failure_dumps or now - self._last_failure_dump >= _FAILURE_DUMP_GAP_S)):
                        self._failure_dumps += 1
                        self._last_failure_dump = now
                        _session.current().failure(self.tracker, _events.Trigger(
                            _events.DRIVER, "a driver allocation call failed"))
            except Exception as e:  # noqa: BLE001 - never kill the program
                self.error = f"{type(e).__name__}: {e}"
                return

    def _signal_dump(self) -> None:
        """The dump SIGUSR1 asked for, unless one was written less than
        _SIGNAL_DUMP_GAP_S ago (then it waits, and is written when the gap ends)."""
        now = time.monotonic()
        if now < self._next_signal_dump:
            if not self._deferral_said:
                self._deferral_said = True
                _say(f"memviz: SIGUSR1: the flight recorder writes at most one dump a minute on "
                     f"signals; the next in {self._next_signal_dump - now:.0f} s")
            return
        self._signal_pending = False  # a signal from now on asks for one more
        self._deferral_said = False
        try:
            if self._running:
                _session.current().failure(self.tracker, _events.Trigger(_events.SIGNAL, "SIGUSR1"))
        finally:
            self._next_signal_dump = time.monotonic() + _SIGNAL_DUMP_GAP_S

    def _install_signal(self) -> None:
        """SIGUSR1 asks for a dump (only from the main thread, and only where
        nobody else handles it: a program's own handler is kept, and called)."""
        if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "SIGUSR1"):
            return
        try:
            wfd = _wake_pipe()[1]
            old = signal.getsignal(signal.SIGUSR1)
            recorder = self

            def on_usr1(signum, frame):
                # Between two bytecodes of the main thread, maybe inside a dump or a
                # library holding its lock: no lock, no file, no print; the thread dumps.
                if recorder._running and not recorder._signal_pending and os.getpid() == recorder._pid:
                    recorder._signal_pending = True
                    try:
                        os.write(wfd, b"\0")
                    except OSError:
                        pass
                if callable(old) and old not in (signal.SIG_DFL, signal.SIG_IGN):
                    old(signum, frame)

            signal.signal(signal.SIGUSR1, on_usr1)
            self._old_handler, self._handler_installed = old, True
            self._handler = on_usr1
        except (ValueError, OSError):
            pass

    def _restore_signal(self) -> None:
        """The handler from before, where memviz's is still SIGUSR1's: one the
        program installed meanwhile is its own and stays (putting the old one
        back left SIG_DFL, and the program's next SIGUSR1 killed it); memviz's,
        replaced, does nothing once the recorder stopped."""
        if self._handler_installed and threading.current_thread() is threading.main_thread():
            try:
                if signal.getsignal(signal.SIGUSR1) is self._handler:
                    signal.signal(signal.SIGUSR1, self._old_handler if self._old_handler is not None
                                  else signal.SIG_DFL)
            except (ValueError, OSError, TypeError):
                pass
            self._handler_installed = False
            self._handler = None


def _sources(tracker: Any) -> Optional[Dict[str, Any]]:
    """How each source was captured (the tracker's capture_info()["sources"])."""
    try:
        return tracker.capture_info().get("sources")
    except Exception:  # noqa: BLE001 - optional information
        return None
