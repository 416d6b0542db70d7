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
* on SIGUSR1 (``kill -USR1 <pid>``);
* on ``tracker.dump(path)``.

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
import signal
import sys
import threading
import time
from typing import Any, Dict, List, Optional

import memviz._core as _core
from memviz._errors import InvalidArgument, TraceError
from memviz._outputs import output_file
from memviz._units import format_size, parse_size
from memviz.capture.ranks import timestamped_name
from memviz.trace.format import END, EVENT_LEVEL, META, chunk, header, json_bytes
from memviz.trace.writer import _meta, _NewTables, _outside, _pytorch_peak

__all__ = ["FlightRecorder", "parse_budget", "MIN_BUDGET"]

#: the smallest budget: the ring and one chunk must fit, with room for history
MIN_BUDGET = 16 << 20
#: bytes a raw ring entry takes (src/trace_ring.h, mvz_raw_event)
_RAW_EVENT = 40
#: what the writer thread takes at a time (src/trace_writer.c, CHUNK_EVENTS)
_TAKE_BUFFER = 65536 * _RAW_EVENT
#: how often the recorder names new stacks and looks for failed allocations
_INTERVAL = 0.25
#: dumps a failed driver call may cause: the first, then at most one a minute
_FAILURE_DUMP_GAP_S = 60.0
_MAX_FAILURE_DUMPS = 3
#: tests: the bytes the chunks may take, whatever the budget (None: from the budget)
_TEST_CHUNK_BUDGET: Optional[int] = None


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


class FlightRecorder:
    """The recorder of one tracker (a Tracker plugin; see the module doc)."""

    def __init__(self, tracker: Any, budget: int, folder: Optional[str] = None) -> None:
        self.tracker = tracker
        self.budget = int(budget)
        self.folder = os.fspath(folder) if folder is not None else None
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
        self._handler_installed = False
        self._pid = os.getpid()
        capacity = max(16384, min(1 << 20, self.budget // 8 // _RAW_EVENT))
        self.capacity = capacity
        self._chunk_budget = (self.budget - capacity * _RAW_EVENT - _TAKE_BUFFER
                              if _TEST_CHUNK_BUDGET is None else _TEST_CHUNK_BUDGET)

    # -- plugin hooks

    def on_start(self, tracker: Any) -> None:
        if _core.trace_writer_stats()["running"]:
            raise InvalidArgument("another tracker's trace or flight recorder is running: one per "
                                  "process; give trace= or flight_recorder= to the outermost tracker only")
        folder = self.folder if self.folder is not None else os.getcwd()
        if not os.path.isdir(folder) or not os.access(folder, os.W_OK | os.X_OK):
            why = "is not a folder" if not os.path.isdir(folder) else "is not writable"
            raise TraceError(f"the flight recorder's folder {why}, so no dump could be written",
                             folder, hint="give flight_dir= (or --flight-dir) a folder that exists "
                                          "and that you may write to")
        self._meta = _meta(tracker, "flight")
        self._failures_seen = self._failed_now()  # an outer tracker's earlier failures are not this one's
        _core.trace_enable(self.capacity)
        try:
            _core.trace_writer_start(-1, self.capacity, EVENT_LEVEL, _INTERVAL, self._chunk_budget)
        except OSError as e:
            _core.trace_disable()
            raise TraceError(f"the flight recorder could not start its writer thread: {e.strerror or e}",
                             None, hint="the process may be out of threads or memory; try a smaller "
                                        "budget, or run without the flight recorder") from e
        self._running = True
        self._install_signal()
        self._thread = threading.Thread(target=self._run, name="memviz-flight-recorder", daemon=True)
        self._thread.start()

    def on_stop(self, tracker: Any) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)
        self._restore_signal()
        with self._lock:
            if self._running:
                self._running = False
                _core.trace_writer_stop()
                _core.trace_disable()
                _core.trace_writer_release()

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
                "memory": self.capacity * _RAW_EVENT + _TAKE_BUFFER + s["kept_bytes"] + s["base_bytes"],
                "compressed": s["compressed"], "dumps": list(self.dumps)}

    # -- dumps

    def dump(self, path: Optional[str] = None, reason: str = "tracker.dump()") -> str:
        """Write what the recorder holds to ``path`` (or a new file named with
        the time, pid and rank in the recorder's folder); returns the path."""
        with self._lock:
            if not self._running:
                raise TraceError("the flight recorder is not running, so there is nothing to dump",
                                 path, hint="call dump() while the tracker runs, before it stops")
            target = path if path is not None else self._new_path()
            self._name_new()  # the failing allocation's stack among them
            started = time.monotonic_ns()
            with output_file(target, "the flight recorder's dump", binary=True,
                             hint="choose a folder you may write to (flight_dir=... or "
                                  "--flight-dir), with room for the dump") as f:
                f.write(header() + chunk(META, json_bytes(dict(self._meta, dumped_because=reason)))
                        + b"".join(self._tables))
                f.flush()
                try:
                    _core.trace_writer_dump(f.fileno())
                except OSError as e:
                    raise TraceError(f"cannot write the flight recorder's dump: {e.strerror or e}",
                                     target, hint="free some disk space, or choose another folder") from e
                s = _core.trace_writer_stats()
                last = self._name_new()  # stacks of the last events, taken by the dump
                f.write(b"".join(last) + chunk(END, json_bytes(self._end(s, reason, started))))
            self.dumps.append(os.fspath(target))
            self._failures_seen = max(self._failures_seen, self._failed_now())
            return os.fspath(target)

    def dump_quietly(self, reason: str) -> Optional[str]:
        """dump() for the automatic triggers: never raises; says on stderr
        where the file went (or why none could be written)."""
        if os.getpid() != self._pid:
            return None
        try:
            path = self.dump(reason=reason)
        except Exception as e:  # noqa: BLE001 - a dump must never change what the program does
            self.error = f"{type(e).__name__}: {e}"
            print(f"memviz: the flight recorder could not write its dump ({reason}): {self.error}",
                  file=sys.stderr)
            return None
        print(f"memviz: flight recorder dump ({reason}) written to {path}; read it with "
              f"`python -m memviz report {path}`", file=sys.stderr)
        return path

    def on_failure(self, tracker: Any, reason: str) -> None:
        """An allocation failed where PyTorch raises: dump now, on the failing
        thread, before the exception reaches the program."""
        self.dump_quietly(reason)

    # -- internals

    def _new_path(self) -> str:
        folder = self.folder if self.folder is not None else os.getcwd()
        name = timestamped_name("memviz-flight")
        path = os.path.join(folder, name)
        n = 1
        while os.path.exists(path):
            path = os.path.join(folder, name[:-len(".memviz")] + f"-{n}.memviz")
            n += 1
        return path

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
            "stats": _core.stats(), "outside": _outside(),
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

    def _run(self) -> None:
        ticks = 0
        while not self._stop.wait(_INTERVAL):
            ticks += 1
            try:
                with self._lock:
                    if not self._running:
                        return
                    if ticks % 4 == 0:  # names once a second; a dump names the rest itself
                        self._name_new()
                failed = self._failed_now()
                if failed > self._failures_seen:
                    self._failures_seen = failed
                    now = time.monotonic()
                    if (self._failure_dumps < _MAX_FAILURE_DUMPS
                            and (not self._failure_dumps or now - self._last_failure_dump >= _FAILURE_DUMP_GAP_S)):
                        self._failure_dumps += 1
                        self._last_failure_dump = now
                        self.dump_quietly("a driver allocation call failed")
            except Exception as e:  # noqa: BLE001 - never kill the program
                self.error = f"{type(e).__name__}: {e}"
                return

    def _install_signal(self) -> None:
        """SIGUSR1 asks for a dump (only from the main thread, and only where
        nobody else handles it: a program's own handler is kept, and called)."""
        if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "SIGUSR1"):
            return
        try:
            old = signal.getsignal(signal.SIGUSR1)
            recorder = self

            def on_usr1(signum, frame):
                if recorder._running:  # stopped on another thread: the handler could not be given back
                    recorder.dump_quietly("SIGUSR1")
                if callable(old) and old not in (signal.SIG_DFL, signal.SIG_IGN):
                    old(signum, frame)

            signal.signal(signal.SIGUSR1, on_usr1)
            self._old_handler, self._handler_installed = old, True
        except (ValueError, OSError):
            pass

    def _restore_signal(self) -> None:
        if self._handler_installed and threading.current_thread() is threading.main_thread():
            try:
                signal.signal(signal.SIGUSR1, self._old_handler if self._old_handler is not None
                              else signal.SIG_DFL)
            except (ValueError, OSError, TypeError):
                pass
            self._handler_installed = False
