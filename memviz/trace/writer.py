"""The streaming trace writer: drains the C ring into a .memviz file while
tracking (``track(trace=path)``); the format is in memviz/trace/format.py."""

from __future__ import annotations

import errno
import os
import shlex
import stat
import sys
import threading
import time
import traceback
import warnings
import weakref
from typing import Any, Dict, Iterable, List, Optional

try:
    import fcntl
except ImportError:  # not POSIX: no lock
    fcntl = None  # type: ignore[assignment]

import memviz._core as _core
from memviz._errors import InvalidArgument, TraceError
from memviz._interrupts import deferred_interrupt
from memviz.capture import callsite as _callsite
from memviz.capture.rank_files import rank_meta
from memviz.capture.events import CaptureEvents
from memviz.model.frame_filter import warning_site
from memviz.trace.format import (CALLS, DEFAULT_CAPACITY, DEFAULT_INTERVAL, END, EV, EVENT, EVENT_LEVEL,
                                 EVENTS, FLAG_SYNTHETIC, FORMAT_VERSION, FRAMES, LABELS, LIVE, META, OP_ALLOC,
                                 OP_GAP, OP_TIME, OPTIONAL, RING_ENV, STACKS, STEPS, STRINGS, THREADS,
                                 TraceWarning, chunk, events_payload, header, json_bytes, step_dict)


def _meta(tracker: Any, mode: str) -> Dict[str, Any]:
    from memviz._package import __version__

    try:
        capture = tracker.capture_info()
    except Exception as e:  # noqa: BLE001 - metadata must not stop tracking
        capture = {"error": f"{type(e).__name__}: {e}"}
    return {
        "format": "memviz-trace", "format_version": FORMAT_VERSION, "mode": mode,
        "memviz_version": __version__, "python_version": sys.version.split()[0],
        "platform": sys.platform, "pid": os.getpid(),
        "start_wall_time": time.time(), "start_monotonic_ns": tracker.started_ns,
        "written_monotonic_ns": time.monotonic_ns(),
        "command": shlex.join(getattr(sys, "orig_argv", sys.argv)),
        "argv": list(sys.argv),
        "tracker": {
            "gpu_requested": tracker.gpu_requested, "gpu_enabled": tracker.gpu_enabled,
            "gpu_off_reason": tracker.gpu_off_reason, "activity_enabled": tracker.activity_enabled,
            "activity_error": tracker.activity_error, "depth": tracker.depth,
            "precise": getattr(tracker, "precise", False),
            "frames": frame_settings(tracker),
        },
        "capture": capture,
        "ranks": rank_meta(),  # rank, world size, host, CUDA device (memviz/capture/rank_files.py)
    }


def _outside() -> Dict[str, List[Any]]:
    try:
        from memviz.capture.device import process_device_memory
        return {str(d): [b, s] for d, (b, s) in process_device_memory().items()}
    except Exception:  # noqa: BLE001 - optional information
        return {}


def _thread_names(threads: Dict[int, Any]) -> Dict[str, List[Any]]:
    """{idx: [native id, ident, name]} with the names a snapshot would show now."""
    from memviz.model.recording import thread_table

    return {str(idx): list(entry) for idx, entry in thread_table(threads).items()}


class _Tables:
    """Strings, frames and stacks written so far, and the chunks of new ones."""

    def __init__(self) -> None:
        self.strings: Dict[str, int] = {}
        self.frames: Dict[tuple, int] = {}
        self.labels: Dict[int, str] = {}
        self._new_strings: List[str] = []
        self._new_frames: List[List[int]] = []

    def _sid(self, s: Any) -> int:
        s = s if isinstance(s, str) else ("" if s is None else str(s))
        i = self.strings.get(s)
        if i is None:
            i = self.strings[s] = len(self.strings)
            self._new_strings.append(s)
        return i

    def frame_id(self, frame: tuple) -> int:
        i = self.frames.get(frame)
        if i is None:
            filename, lineno, name = frame
            lineno = lineno if isinstance(lineno, int) and lineno >= 0 else -1
            i = self.frames[frame] = len(self.frames)
            self._new_frames.append([self._sid(filename), lineno, self._sid(name)])
        return i

    def stack_chunks(self, resolved: Dict[int, Iterable[tuple]]) -> List[bytes]:
        stacks = [[sid, [self.frame_id(tuple(f)) for f in frames]]
                  for sid, frames in sorted(resolved.items())]
        out = []
        if self._new_strings:
            out.append(chunk(STRINGS, json_bytes(self._new_strings)))
            self._new_strings = []
        if self._new_frames:
            out.append(chunk(FRAMES, json_bytes(self._new_frames)))
            self._new_frames = []
        if stacks:
            out.append(chunk(STACKS, json_bytes(stacks)))
        calls = getattr(resolved, "calls", None)
        if calls:
            out.append(chunk(CALLS | OPTIONAL, json_bytes({str(k): v for k, v in sorted(calls.items())})))
        return out

    def label_chunk(self, names: Dict[int, str]) -> List[bytes]:
        new = {str(i): n for i, n in names.items() if i not in self.labels}
        self.labels.update(names)
        return [chunk(LABELS, json_bytes(new))] if new else []


class _NewTables:
    """The chunks that name what the events refer to (strings, frames,
    stacks, call names, labels, threads, step records), for what is new
    since the last call: work proportional to what is new, none per event.
    The native writer's Python side (and the flight recorder's)."""

    def __init__(self, tracker: Any) -> None:
        self.tracker = tracker
        self.tables = _Tables()
        self._next_stack = 1
        self._next_label = 1
        self._threads: Dict[str, List[Any]] = {}
        self._steps_written = 0

    def chunks(self) -> List[bytes]:
        return self.stacks() + self.labels() + self.threads() + self.steps()

    @property
    def named(self) -> tuple:
        """(stack ids below this, label ids up to this) the chunks so far name."""
        return self._next_stack, self._next_label - 1

    def stacks(self) -> List[bytes]:
        count = _core.stack_count()
        if count <= self._next_stack:
            return []
        resolved = _callsite.resolve(range(self._next_stack, count))
        self._next_stack = count
        return self.tables.stack_chunks(resolved)

    def labels(self) -> List[bytes]:
        count = _core.label_count()
        names = {i: _core.label_name(i) for i in range(self._next_label, count + 1)}
        self._next_label = count + 1
        if _LABEL_OVERFLOW not in self.tables.labels and count >= _LABEL_OVERFLOW - 1:
            names[_LABEL_OVERFLOW] = _core.label_name(_LABEL_OVERFLOW)
        return self.tables.label_chunk({i: n for i, n in names.items() if n is not None})

    def threads(self) -> List[bytes]:
        names = _thread_names(_core.threads())
        new = {k: v for k, v in names.items() if self._threads.get(k) != v}
        if not new:
            return []
        self._threads.update(new)
        return [chunk(THREADS, json_bytes(new))]

    def steps(self) -> List[bytes]:
        steps = list(getattr(self.tracker, "steps", None) or [])
        new = steps[self._steps_written:]
        if not new:
            return []
        self._steps_written = len(steps)
        return [chunk(STEPS, json_bytes([step_dict(s) for s in new]))]


#: the label every label past the table's 65,534th gets (src/labels.h)
_LABEL_OVERFLOW = _core.LABEL_OVERFLOW_ID


def native_writer() -> bool:
    """Whether traces are written by the C core's own thread (zlib found, and
    not turned off with MEMVIZ_TRACE_WRITER=python)."""
    choice = os.environ.get("MEMVIZ_TRACE_WRITER", "").strip().lower()
    if choice == "python":
        return False
    return bool(_core.zlib_available())


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


_writers: "weakref.WeakSet[TraceWriter]" = weakref.WeakSet()

#: the fewest and the most events a ring may hold (src/trace_ring.h)
_RING_MIN, _RING_MAX = _core.TRACE_RING_MIN, _core.TRACE_RING_MAX


def ring_capacity() -> int:
    """Events the trace ring holds: MEMVIZ_TRACE_RING (a number of events,
    "4M", "16m" or "2**22"), else DEFAULT_CAPACITY; a value that cannot be
    read is said once and the default used."""
    text = os.environ.get(RING_ENV, "").strip()
    if not text:
        return DEFAULT_CAPACITY
    try:
        scale = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}.get(text[-1].lower(), 1)
        body = text[:-1] if scale > 1 else text
        n = 2 ** int(body[3:]) if body.startswith("2**") else int(body.replace("_", ""))
        n *= scale
    except ValueError:
        n = -1
    if not _RING_MIN <= n <= _RING_MAX:
        warnings.warn(f"memviz: {RING_ENV}={text!r} is not a number of events between {_RING_MIN} and "
                      f"{_RING_MAX:,} (e.g. 4M); the trace ring holds {DEFAULT_CAPACITY:,}.",
                      TraceWarning, stacklevel=warning_site()[0])
        return DEFAULT_CAPACITY
    return n


def lost_events_advice(dropped: int, capacity: int) -> str:
    """What a trace that lost ``dropped`` events lost, and what to do."""
    bigger = min(_RING_MAX, max(4 * capacity, 1 << 22))
    return (f"{dropped:,} events were lost because the trace ring ({capacity:,} events) was full: "
            "the program allocated faster than the writer drained it. The peak, the timeline and "
            "the events after the first loss may miss allocations made then and keep ones freed "
            "then (the live set at the end is set right when tracking stops). For a bigger ring, "
            f"set the environment variable {RING_ENV} (e.g. {RING_ENV}={bigger // (1 << 20)}M, "
            f"{_core.RAW_EVENT_SIZE} bytes an event) before tracking starts.")


class TraceWriter(CaptureEvents):
    """Streams a tracker's events into a trace file (a subscriber to the
    capture session for that tracker).

    ``Tracker(trace=path)`` creates one. :meth:`on_start` writes the header and
    starts a daemon thread that drains the C core's event ring every
    ``interval`` seconds and appends the new strings, frames, stacks, threads,
    labels, events and step records; :meth:`on_stop` drains the rest and
    writes the END chunk. A failure in the thread (disk full, ...) never
    reaches the user's code: the writer stops, and :meth:`on_stop` warns
    (:class:`TraceWarning`) saying what happened and how far the file goes.
    """

    def __init__(self, tracker: Any, path: str, *, interval: float = DEFAULT_INTERVAL,
                 capacity: Optional[int] = None) -> None:
        self.tracker = tracker
        self.path = os.fspath(path)
        self.interval = interval
        self.capacity = capacity if capacity is not None else ring_capacity()
        self._warned_lost = False
        self._events_written = 0
        self._dropped = 0
        self.error: Optional[str] = None
        self._fd: Optional[int] = None
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._new = _NewTables(tracker)
        self._tables = self._new.tables
        #: events go from the C ring to the file on the C core's own thread,
        #: without the GIL (False: this module's thread drains and writes them)
        self.native = native_writer()
        self._python_bytes = 0
        self._synthetic = 0

    @property
    def events_written(self) -> int:
        """Events in the file so far."""
        if self.native:
            return self._synthetic + _core.trace_writer_stats()["events"]
        return self._events_written

    @property
    def dropped(self) -> int:
        """Events lost because the ring was full (GAP records)."""
        if self.native:
            return _core.trace_writer_stats()["dropped"]
        return self._dropped

    # -- the capture session's events

    def on_start(self, tracker: Any) -> None:
        """Open the file, write the header and start draining (raises TraceError
        when the file cannot be created)."""
        if self.native:
            refuse_running_writer()
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        except OSError as e:
            raise TraceError(f"cannot create the trace file: {e.strerror or e}", self.path,
                             hint="check that the folder exists and is writable, or choose "
                                  "another trace path") from e
        # Locked for as long as this process writes it, and emptied only once locked:
        # a second process given the same path truncated the file under the first
        # one's writes, and neither file loaded (both exited 0, with no warning)
        if not _lock(fd):
            os.close(fd)
            raise TraceError("another process is writing this trace file", self.path,
                             hint="give each process its own trace path (under a launcher memviz "
                                  "names one per rank), or wait until that process stops tracking")
        self._fd = fd
        try:
            if stat.S_ISREG(os.fstat(fd).st_mode):  # as O_TRUNC: a device or a pipe is left as it is
                os.ftruncate(fd, 0)
            self._write(header() + chunk(META, json_bytes(_meta(tracker, "stream"))))
            _core.trace_enable(self.capacity)
            # Allocations the core saw between clear() and trace_enable(): a
            # duplicate of a ring event is harmless (an ALLOC at a live
            # address replaces it when the trace is read). Written before
            # the writer thread takes any ring event: a FREE follows its ALLOC.
            self._write_rows(_core.live(), synthetic=True)
            if self.native:
                _core.trace_writer_start(self._fd, self.capacity, EVENT_LEVEL, self.interval, 0)
                self._tick()  # how far the file names stacks and labels: its events may follow
            _writers.add(self)
            self._thread = threading.Thread(target=self._run, name="memviz-trace-writer",
                                            daemon=True)
            self._thread.start()
        except BaseException as e:
            # Whatever had started, stopped: the native writer (else it held the ring,
            # and the fd of a closed file, for the rest of the process; no other one
            # ran, checked above), the ring, the file
            with deferred_interrupt():
                self._stop.set()
                with self._lock:  # a thread already started ticks under it
                    self._shut()
            if isinstance(e, OSError):  # the first write: a full disk, /dev/full, ...
                raise TraceError(f"cannot write the trace file: {e.strerror or e}", self.path,
                                 hint="free some disk space, or choose another trace path "
                                      "(on a disk with room, in a folder you may write to)") from e
            raise

    def on_stop(self, tracker: Any) -> None:
        """Drain the rest, write the END chunk and close; raises nothing but a
        KeyboardInterrupt, and that only once the writer has stopped and the
        file is closed: a Ctrl-C while it closes is held until then (memviz/_interrupts.py),
        one while it waits for its thread cuts the wait short."""
        try:
            self._stop.set()
            if self._thread is not None and self._thread is not threading.current_thread():
                self._thread.join(timeout=10)
        finally:
            try:
                with deferred_interrupt():
                    with self._lock:
                        try:
                            self._finish(tracker)
                        finally:
                            self._shut()  # whatever failed: the thread stopped, the file closed
            finally:
                if self._fd is not None:  # interrupted before the lock was taken
                    self._shut()
        if self.error is not None:
            warnings.warn(f"memviz: the trace file {self.path!r} is incomplete: {self.error} "
                          "It loads up to the last complete flush (memviz.load reports it as "
                          "truncated).", TraceWarning, stacklevel=warning_site()[0])

    def _finish(self, tracker: Any) -> None:
        """The rest of the events, the names they need and the END chunk."""
        if self._fd is None or self.error is not None or os.getpid() != self._pid:
            return
        try:
            if tracker.gpu_enabled and _core.active():
                _core.flush()  # pending activity records (static memory)
            if self.native:
                self._tick()  # names first: the last events need few after them
                _core.trace_writer_stop()  # the rest of the ring, then the thread ends
                self._native_error()
                if self.error is None:
                    live = self._live_chunk()
                    self._write(b"".join(self._new.chunks()) + live
                                + chunk(END, json_bytes(self._end(tracker))))
            else:
                _core.trace_disable()
                self._tick()
                live = self._live_chunk()
                self._write(b"".join(self._new.chunks()) + live + chunk(END, json_bytes(self._end(tracker))))
        except Exception:  # noqa: BLE001 - stopping must not fail
            self._failed()

    def _shut(self) -> None:
        """The native thread stopped, the ring off, the file closed (each
        harmless when already done). A stop that did not get to write the
        END leaves a file that loads as truncated."""
        try:
            if self.native:
                _core.trace_writer_stop()  # not running (a fork()ed child, done): nothing
        finally:
            try:
                _core.trace_disable()
            finally:
                self._close()

    def on_freeze(self, tracker: Any) -> None:
        """Nothing to do: the file already holds everything."""

    def flush(self) -> None:
        """Drain and write now (the thread does it every ``interval`` seconds)."""
        with self._lock:
            if self._fd is not None and self.error is None:
                try:
                    if self.native:  # events follow their names: the names, then the events
                        self._tick()
                        _core.trace_writer_flush()
                        self._tick()
                        _core.trace_writer_flush(True)
                    self._tick()
                except Exception:  # noqa: BLE001
                    self._failed()

    # -- internals

    def _run(self) -> None:
        # Native: events need no Python, but wait in C for their stacks' and
        # labels' names, which this thread writes every interval.
        while not self._stop.wait(self.interval):
            with self._lock:
                if self._fd is None or self.error is not None:
                    return
                try:
                    self._tick()
                except Exception:  # noqa: BLE001 - never kill the user's program
                    self._failed()
                    return

    def _failed(self) -> None:
        exc = sys.exc_info()[1]
        where = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
        self.error = (f"writing stopped after {self.events_written:,} events because of "
                      f"{type(exc).__name__}: {exc}"
                      + (f" (at {os.path.basename(where.filename)}:{where.lineno})." if where
                         else "."))
        try:
            _core.trace_disable()
        except Exception:  # noqa: BLE001
            pass

    def _write(self, data: bytes) -> None:
        if os.getpid() != self._pid:  # a fork()ed child must not touch the parent's file
            return
        _write_all(self._fd, data)
        self._python_bytes += len(data)

    def _close(self) -> None:
        if self._fd is not None and os.getpid() == self._pid:
            try:
                os.close(self._fd)
            except OSError:
                pass
        self._fd = None

    def _native_error(self) -> None:
        """The native writer's failed write, as this writer's error."""
        err = _core.trace_writer_stats()["error"]
        if err and self.error is None:
            e = OSError(err, os.strerror(err))
            self.error = (f"writing stopped after {self.events_written:,} events because of "
                          f"OSError: {e}.")
            _core.trace_disable()

    def _tick(self) -> None:
        """One flush. Native: the names of what is new (stacks, labels,
        threads, steps), between the C thread's event chunks, which then
        write the events that waited for these names (an event is never
        written before its stack's and label's names, so a SIGKILL loses
        the events not written yet, never the names of those that were);
        else drain the ring and append everything new, in one write."""
        if self.native:
            self._native_error()
            if self.error is None:
                data = b"".join(self._new.chunks())
                _core.trace_writer_write(data, *self._new.named)
                self._python_bytes += len(data)
                self._warn_lost()
            return
        rows = _core.trace_drain()
        out = self._new.stacks() + self._new.labels()  # after the drain: every drained event's names
        n = len(rows) // EVENT.size
        counted = 0
        if n > 1 or (n == 1 and rows[4] != OP_TIME):
            gaps = rows[4::EVENT.size].count(OP_GAP)
            if gaps:
                for k in range(n):
                    if rows[k * EVENT.size + 4] == OP_GAP:
                        self._dropped += EVENT.unpack_from(rows, k * EVENT.size)[EV["address"]]
            out.append(chunk(EVENTS, events_payload(rows), compress=EVENT_LEVEL))
            counted = n
        out += self._new.threads() + self._new.steps()
        if out:
            self._write(b"".join(out))
        self._events_written += counted  # once written: an error message says what the file holds
        self._warn_lost()

    def _warn_lost(self) -> None:
        """Once per trace, while tracking: events were lost, and what to do."""
        if self._warned_lost or not self.dropped:
            return
        self._warned_lost = True
        warnings.warn(f"memviz: the trace {self.path!r} is missing events: "
                      + lost_events_advice(self.dropped, self.capacity), TraceWarning,
                      stacklevel=warning_site()[0])

    def _live_chunk(self) -> bytes:
        """The LIVE chunk (memviz/trace/format.py) when the trace lost events,
        with the names it needs written first; b"" when it lost none."""
        if not self.dropped:
            return b""
        self._warn_lost()
        rows = sorted(_core.live(), key=lambda r: r.timestamp_ns)
        label_ids = {r.label: (_core.label_intern(r.label) if r.label is not None else 0) for r in rows}
        head = self._new.stacks() + self._tables.label_chunk(
            {i: s for s, i in label_ids.items() if s is not None})
        packed = _alloc_events(rows, label_ids, synthetic=True) if rows else b""
        return b"".join(head) + chunk(LIVE | OPTIONAL, events_payload(packed), compress=EVENT_LEVEL)

    def _write_rows(self, rows: List[tuple], *, synthetic: bool) -> None:
        """Live-allocation rows as ALLOC events, with their stacks and labels."""
        if not rows:
            return
        label_ids: Dict[Optional[str], int] = {None: 0}
        for r in rows:
            if r.label not in label_ids:
                label_ids[r.label] = _core.label_intern(r.label)
        head = self._new.stacks() + self._tables.label_chunk(
            {i: s for s, i in label_ids.items() if s is not None}) + self._new.threads()
        # Before any ring event: a FREE drained later must follow its ALLOC.
        packed = _alloc_events(sorted(rows, key=lambda r: r.timestamp_ns), label_ids, synthetic)
        self._write(b"".join(head) + chunk(EVENTS, events_payload(packed), compress=EVENT_LEVEL))
        self._events_written += len(packed) // EVENT.size
        self._synthetic += len(packed) // EVENT.size

    def _end(self, tracker: Any) -> Dict[str, Any]:
        totals = _core.totals()
        return {
            "stopped_monotonic_ns": time.monotonic_ns(), "stopped_wall_time": time.time(),
            "totals": {str(d): v for d, v in totals.items()},
            "failures": sum(v.get("failed", 0) for v in totals.values()),
            "stats": _core.stats(), "outside": _outside(), "sources": _sources(tracker),
            "frames": frame_settings(tracker),
            "events": self.events_written, "dropped_events": self.dropped,
            **_pytorch_peak(tracker),
        }


def _pytorch_peak(tracker: Any) -> Dict[str, Any]:
    """END's "pytorch_peak": categories, segments and PyTorch's own figures
    (memviz.model.pytorch.pytorch_figures; absent without PyTorch)."""
    from memviz.model.pytorch import END_KEY, pytorch_figures
    figures = pytorch_figures(tracker)
    return {END_KEY: figures} if figures else {}


def _alloc_events(rows: List[tuple], label_ids: Dict[Optional[str], int], synthetic: bool,
                  start_ts: Optional[int] = None) -> bytes:
    """Packed TIME + ALLOC records of the C core's allocation rows
    (_core.AllocationRow), by the C core's encoding (_core.encode_events)."""
    flags = FLAG_SYNTHETIC if synthetic else 0
    start = start_ts if start_ts is not None else (rows[0].timestamp_ns if rows else 0)
    return _core.encode_events([_row(OP_ALLOC, r.timestamp_ns, r, flags, label_ids) for r in rows], start,
                               flags)


def _row(op: int, ts: int, r: Any, flags: int, label_ids: Dict[Optional[str], int]) -> tuple:
    """_core.encode_events' row of allocation row ``r`` (an ALLOC or FREE of it at ``ts``)."""
    return (op, ts, r.kind, r.device, flags | r.flags, r.stack_id, r.thread, label_ids[r.label], r.address,
            r.size, r.size - r.requested, r.stream)


def refuse_running_writer() -> None:
    """InvalidArgument where the native writer runs already: another
    tracker's trace or flight recorder (one per process)."""
    if _core.trace_writer_stats()["running"]:
        raise InvalidArgument("another tracker's trace or flight recorder is running: one per "
                              "process; give trace= or flight_recorder= to the outermost tracker only")


def _lock(fd: int) -> bool:
    """An exclusive lock on the trace file (flock); False when another
    process holds one. True where the file system has no locks."""
    if fcntl is None:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        return e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN)
    return True


def _after_fork_in_child() -> None:
    for w in list(_writers):
        # The parent's file: never written here. This copy of its descriptor is
        # closed (never unlocked: the lock is the parent's too), so that a child
        # living on (a DataLoader's worker) does not hold the lock after the parent
        # closed the file
        fd, w._fd = w._fd, None
        reinit = getattr(w._lock, "_at_fork_reinit", None)
        if reinit is not None:  # held at the fork by a thread that is not here
            reinit()
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass
        w._stop.set()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _sources(tracker: Any) -> Optional[Dict[str, Any]]:
    """How each source was captured (the tracker's capture_info()["sources"])."""
    try:
        return tracker.capture_info().get("sources")
    except Exception:  # noqa: BLE001 - optional information
        return None


def frame_settings(tracker: Any) -> Dict[str, List[str]]:
    """The frame settings a reader needs to pick the same user lines: the
    library and user paths configured (memviz.frames.add_library_path, or the
    tracker's own frame_filter), written at start and again at stop."""
    from memviz.model.frame_filter import frames
    flt = getattr(tracker, "frame_filter", None) or frames
    return {"library_paths": list(flt.library_paths), "user_paths": list(flt.user_paths)}
