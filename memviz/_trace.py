"""The .memviz trace file: format, the streaming writer, and ``save()``.

A trace is written while tracking (``memviz.track(trace="run.memviz")``,
``python -m memviz run -o run.memviz script.py``) or afterwards from a
tracker's data (``t.save("run.memviz")``), and read back with
:func:`memviz.load` (see :mod:`memviz._trace_load`).

File format, version 1 (all integers little-endian)::

    file    = header chunk*
    header  = MAGIC (8 bytes, b"MEMVIZ\\0\\1")  version:u32
    chunk   = type:u8  length:u32  payload[length]  crc:u32

``crc`` is the CRC-32 of the type, length and payload bytes, so a torn or
damaged chunk is detected and everything before it still loads. ``type``
bits 0-5 are the chunk kind, bit 6 (0x40) marks a chunk a reader may skip
when it does not know the kind, bit 7 (0x80) says the payload is
zlib-compressed. Kinds:

=========  ==  ===========================================================
META        1  JSON object, always the first chunk: format, memviz and
               Python versions, pid, start wall time and monotonic ns,
               command line, the tracker's settings and capture_info()
STRINGS     2  JSON list of str, appended to the string table (filenames,
               function names); ids count from 0 across the whole file
FRAMES      3  JSON list of [filename string id, lineno, name string id],
               appended to the frame table
STACKS      4  JSON list of [stack id, [frame id, ...]], innermost first;
               each stack is written once, lines resolved when written
THREADS     5  JSON object {thread index: [native id, ident, name]};
               later entries replace earlier ones
LABELS      6  JSON object {label id: label}
EVENTS      7  count:u32, layout:u8, then count 32-byte event records,
               ``EVENT`` below; layout 0 = records one after another,
               layout 1 = byte planes (byte k of every record, then byte
               k+1, ...), which compresses 3-5x better
STEPS       8  JSON list of step records (Tracker.steps), appended
END         9  JSON object written when tracking stops: totals, failure
               count, memviz's own counters, memory outside the tracked
               allocations, PyTorch's figures ("pytorch_peak": categories
               and segments at the peak, memory_stats; memviz._cli_diff);
               a trace without it was cut short
TIMELINE   10  JSON list of [timestamp_ns, device, live bytes] (saved
               traces only: streamed traces derive it from the events)
CALLS      11  JSON object {stack id: call name}: what the stack's innermost
               frame was calling (``Allocation.op``); written with the
               skippable bit, so readers that predate it load the rest
=========  ==  ===========================================================

An event record is the C core's ``struct.Struct("<IBBbBIHHQQ")``: ts_delta
(ns since the previous event), op, kind, device (-1 host), flags, stack id,
thread index, label id, address, size. Ops: 1 ALLOC, 2 FREE (size is the
freed allocation's), 3 FAILED (address = CUresult, size = requested),
4 TIME (address = absolute monotonic ns; every drain starts with one),
5 GAP (address = events dropped because the ring was full). Flags bit 7
marks events the Python writer made up (the live set when tracing began,
and everything in a saved trace).

The streaming writer drains the core's event ring every 0.5 s and appends
the chunks with one ``os.write`` per flush (no user-space buffer), so a
process killed with SIGKILL leaves a file that loads up to the last flush.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import struct
import sys
import threading
import time
import traceback
import warnings
import weakref
import zlib
from typing import Any, Dict, Iterable, List, Optional

from . import _callsite, _core
from ._errors import TraceError
from ._frames import warning_site

__all__ = ["TraceWriter", "save", "load", "TraceWarning", "MAGIC", "FORMAT_VERSION", "EVENT"]

MAGIC = b"MEMVIZ\x00\x01"
FORMAT_VERSION = 1
HEADER = struct.Struct("<8sI")
CHUNK_HEAD = struct.Struct("<BI")
CRC = struct.Struct("<I")
EVENT = struct.Struct("<IBBbBIHHQQ")
EVENTS_HEAD = struct.Struct("<IB")

META, STRINGS, FRAMES, STACKS, THREADS, LABELS, EVENTS, STEPS, END, TIMELINE, CALLS = range(1, 12)
CHUNK_NAMES = {META: "META", STRINGS: "STRINGS", FRAMES: "FRAMES", STACKS: "STACKS",
               THREADS: "THREADS", LABELS: "LABELS", EVENTS: "EVENTS", STEPS: "STEPS",
               END: "END", TIMELINE: "TIMELINE", CALLS: "CALLS"}
KIND_MASK, OPTIONAL, COMPRESSED = 0x3F, 0x40, 0x80

OP_ALLOC, OP_FREE, OP_FAILED, OP_TIME, OP_GAP = 1, 2, 3, 4, 5
FLAG_SYNTHETIC = 0x80
LAYOUT_ROWS, LAYOUT_PLANES = 0, 1

#: events the C ring holds between drains (drained every 0.5 s)
DEFAULT_CAPACITY = 1 << 20
DEFAULT_INTERVAL = 0.5
#: zlib level of event chunks (1 is ~2x faster than 6 and ~10% larger)
EVENT_LEVEL = 6


class TraceWarning(UserWarning):
    """A trace file was cut short, or the writer had to stop; the message says why."""


# ---- encoding -----------------------------------------------------------------


def chunk(kind: int, payload: bytes, *, compress: Optional[int] = 6) -> bytes:
    """One framed chunk; the payload is zlib-compressed at level ``compress``
    when that makes it smaller (``None``: never)."""
    ctype = kind
    if compress is not None and len(payload) > 64:
        packed = zlib.compress(payload, compress)
        if len(packed) < len(payload):
            payload, ctype = packed, kind | COMPRESSED
    head = CHUNK_HEAD.pack(ctype, len(payload))
    return head + payload + CRC.pack(zlib.crc32(payload, zlib.crc32(head)))


def json_bytes(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), default=_jsonable).encode("utf-8",
                                                                             "surrogatepass")


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, (set, frozenset, tuple)):
        return list(obj)
    if isinstance(obj, bytes):
        return obj.decode("utf-8", "replace")
    return repr(obj)


def events_payload(rows: bytes, layout: int = LAYOUT_PLANES) -> bytes:
    """The EVENTS payload of packed 32-byte records."""
    n = len(rows) // EVENT.size
    if layout == LAYOUT_PLANES:
        data = b"".join(rows[k::EVENT.size] for k in range(EVENT.size))
    else:
        data = bytes(rows)
    return EVENTS_HEAD.pack(n, layout) + data


def header() -> bytes:
    return HEADER.pack(MAGIC, FORMAT_VERSION)


def step_dict(step: Any) -> Any:
    """A JSON-able form of a step record: to_dict(), a dict, a dataclass, a
    named tuple, or its attributes; anything else as its repr."""
    for attempt in (lambda s: s.to_dict(), lambda s: dict(s) if isinstance(s, dict) else None,
                    lambda s: dataclasses.asdict(s) if dataclasses.is_dataclass(s) else None,
                    lambda s: s._asdict(), lambda s: dict(vars(s))):
        try:
            out = attempt(step)
        except Exception:  # noqa: BLE001 - be lenient with foreign records
            continue
        if out is not None:
            return out
    return {"repr": repr(step)}


def _meta(tracker: Any, mode: str) -> Dict[str, Any]:
    from . import __version__

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
        },
        "capture": capture,
    }


def _outside() -> Dict[str, List[Any]]:
    try:
        from ._device import process_device_memory
        return {str(d): [b, s] for d, (b, s) in process_device_memory().items()}
    except Exception:  # noqa: BLE001 - optional information
        return {}


def _thread_names(threads: Dict[int, tuple]) -> Dict[str, List[Any]]:
    """{idx: [native id, ident, name]} with the names a snapshot would show now."""
    from ._snapshot import _python_thread_names, _thread_info

    py = _python_thread_names()
    return {str(idx): [e[0], e[1], _thread_info(idx, e, py).name] for idx, e in threads.items()}


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


def _label_ids(rows: bytes) -> set:
    """Label ids used by packed event records (bytes 14-15 of each)."""
    lo, hi = rows[14::EVENT.size], rows[15::EVENT.size]
    return {a | (b << 8) for a, b in set(zip(lo, hi))} - {0}


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


# ---- the streaming writer -------------------------------------------------------

_writers: "weakref.WeakSet[TraceWriter]" = weakref.WeakSet()


class TraceWriter:
    """Streams a tracker's events into a trace file (a Tracker plugin).

    ``Tracker(trace=path)`` creates one. :meth:`on_start` writes the header and
    starts a daemon thread that drains the C core's event ring every
    ``interval`` seconds and appends the new strings, frames, stacks, threads,
    labels, events and step records; :meth:`on_stop` drains the rest and
    writes the END chunk. A failure in the thread (disk full, ...) never
    reaches the user's code: the writer stops, and :meth:`on_stop` warns
    (:class:`TraceWarning`) saying what happened and how far the file goes.
    """

    def __init__(self, tracker: Any, path: str, *, interval: float = DEFAULT_INTERVAL,
                 capacity: int = DEFAULT_CAPACITY) -> None:
        self.tracker = tracker
        self.path = os.fspath(path)
        self.interval = interval
        self.capacity = capacity
        self.events_written = 0
        self.bytes_written = 0
        self.dropped = 0
        self.error: Optional[str] = None
        self._fd: Optional[int] = None
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._tables = _Tables()
        self._next_stack = 1
        self._threads: Dict[str, List[Any]] = {}
        self._steps_written = 0

    # -- plugin hooks

    def on_start(self, tracker: Any) -> None:
        """Open the file, write the header and start draining (raises TraceError
        when the file cannot be created)."""
        try:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        except OSError as e:
            raise TraceError(f"cannot create the trace file: {e.strerror or e}", self.path,
                             hint="check that the folder exists and is writable, or choose "
                                  "another trace path") from e
        try:
            self._write(header() + chunk(META, json_bytes(_meta(tracker, "stream"))))
            _core.trace_enable(self.capacity)
            # Allocations the core saw between clear() and trace_enable(): a
            # duplicate of a ring event is harmless (an ALLOC at a live
            # address replaces it when the trace is read).
            self._write_rows(_core.live(), synthetic=True)
        except BaseException as e:
            self._close()
            if isinstance(e, OSError):  # the first write: a full disk, /dev/full, ...
                raise TraceError(f"cannot write the trace file: {e.strerror or e}", self.path,
                                 hint="free some disk space, or choose another trace path "
                                      "(on a disk with room, in a folder you may write to)") from e
            raise
        _writers.add(self)
        self._thread = threading.Thread(target=self._run, name="memviz-trace-writer",
                                        daemon=True)
        self._thread.start()

    def on_stop(self, tracker: Any) -> None:
        """Drain the rest, write the END chunk and close; never raises."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)
        with self._lock:
            if self._fd is not None and self.error is None and os.getpid() == self._pid:
                try:
                    if tracker.gpu_enabled and _core.active():
                        _core.flush()  # pending activity records (static memory)
                    _core.trace_disable()
                    self._tick()
                    self._write(chunk(END, json_bytes(self._end(tracker))))
                except Exception:  # noqa: BLE001 - stopping must not fail
                    self._failed()
            else:
                _core.trace_disable()
            self._close()
        if self.error is not None:
            warnings.warn(f"memviz: the trace file {self.path!r} is incomplete: {self.error} "
                          "It loads up to the last complete flush (memviz.load reports it as "
                          "truncated).", TraceWarning, stacklevel=warning_site()[0])

    def on_freeze(self, tracker: Any) -> None:
        """Nothing to do: the file already holds everything."""

    def flush(self) -> None:
        """Drain and write now (the thread does it every ``interval`` seconds)."""
        with self._lock:
            if self._fd is not None and self.error is None:
                try:
                    self._tick()
                except Exception:  # noqa: BLE001
                    self._failed()

    # -- internals

    def _run(self) -> None:
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
        self.bytes_written += len(data)

    def _close(self) -> None:
        if self._fd is not None and os.getpid() == self._pid:
            try:
                os.close(self._fd)
            except OSError:
                pass
        self._fd = None

    def _tick(self) -> None:
        """One flush: drain the ring and append everything new, in one write."""
        rows = _core.trace_drain()
        out = self._stack_chunks()  # after the drain: covers every drained event's stack
        n = len(rows) // EVENT.size
        counted = 0
        if n > 1 or (n == 1 and rows[4] != OP_TIME):
            labels = {i: _core.label_name(i) for i in _label_ids(rows)
                      if i not in self._tables.labels}
            out += self._tables.label_chunk({i: s for i, s in labels.items() if s is not None})
            gaps = rows[4::EVENT.size].count(OP_GAP)
            if gaps:
                for k in range(n):
                    if rows[k * EVENT.size + 4] == OP_GAP:
                        self.dropped += EVENT.unpack_from(rows, k * EVENT.size)[8]
            out.append(chunk(EVENTS, events_payload(rows), compress=EVENT_LEVEL))
            counted = n
        out += self._threads_chunk() + self._steps_chunk()
        if out:
            self._write(b"".join(out))
        self.events_written += counted  # once written: an error message says what the file holds

    def _stack_chunks(self) -> List[bytes]:
        """Strings, frames and stacks interned since the last call."""
        count = _core.stack_count()
        if count <= self._next_stack:
            return []
        resolved = _callsite.resolve(range(self._next_stack, count))
        self._next_stack = count
        return self._tables.stack_chunks(resolved)

    def _threads_chunk(self) -> List[bytes]:
        names = _thread_names(_core.threads())
        new = {k: v for k, v in names.items() if self._threads.get(k) != v}
        if not new:
            return []
        self._threads.update(new)
        return [chunk(THREADS, json_bytes(new))]

    def _steps_chunk(self) -> List[bytes]:
        steps = list(getattr(self.tracker, "steps", None) or [])
        new = steps[self._steps_written:]
        if not new:
            return []
        self._steps_written = len(steps)
        return [chunk(STEPS, json_bytes([step_dict(s) for s in new]))]

    def _write_rows(self, rows: List[tuple], *, synthetic: bool) -> None:
        """Live-allocation rows as ALLOC events, with their stacks and labels."""
        if not rows:
            return
        label_ids: Dict[Optional[str], int] = {None: 0}
        for r in rows:
            if r[6] not in label_ids:
                label_ids[r[6]] = _core.label_intern(r[6])
        head = self._stack_chunks() + self._tables.label_chunk(
            {i: s for s, i in label_ids.items() if s is not None}) + self._threads_chunk()
        # Before any ring event: a FREE drained later must follow its ALLOC.
        packed = _alloc_events(sorted(rows, key=lambda r: r[7]), label_ids, synthetic)
        self._write(b"".join(head) + chunk(EVENTS, events_payload(packed), compress=EVENT_LEVEL))
        self.events_written += len(packed) // EVENT.size

    def _end(self, tracker: Any) -> Dict[str, Any]:
        totals = _core.totals()
        return {
            "stopped_monotonic_ns": time.monotonic_ns(), "stopped_wall_time": time.time(),
            "totals": {str(d): v for d, v in totals.items()},
            "failures": sum(v.get("failed", 0) for v in totals.values()),
            "stats": _core.stats(), "outside": _outside(),
            "events": self.events_written, "dropped_events": self.dropped,
            **_pytorch_peak(tracker),
        }


def _pytorch_peak(tracker: Any) -> Dict[str, Any]:
    """END's "pytorch_peak": categories, segments and PyTorch's own figures
    (memviz._cli_diff.pytorch_figures; absent without PyTorch)."""
    from ._cli_diff import END_KEY, pytorch_figures
    figures = pytorch_figures(tracker)
    return {END_KEY: figures} if figures else {}


def _alloc_events(rows: List[tuple], label_ids: Dict[Optional[str], int], synthetic: bool,
                  start_ts: Optional[int] = None) -> bytes:
    """Packed TIME + ALLOC records of raw rows (address, size, device, kind,
    stream, thread, label, timestamp, stack, seq), timestamps non-decreasing."""
    flags = FLAG_SYNTHETIC if synthetic else 0
    out = bytearray()
    prev = start_ts if start_ts is not None else (rows[0][7] if rows else 0)
    out += EVENT.pack(0, OP_TIME, 0, 0, flags, 0, 0, 0, prev, 0)
    for addr, size, dev, kind, _stream, tidx, label, ts, sid, _seq in rows:
        out += _event(OP_ALLOC, ts, prev, kind, dev, flags, sid, tidx, label_ids[label], addr, size)
        prev = max(prev, ts)
    return bytes(out)


def _event(op: int, ts: int, prev: int, kind: int, dev: int, flags: int, sid: int, tidx: int,
           label: int, addr: int, size: int) -> bytes:
    """One record; a TIME record first when ts is earlier than prev or too far after it."""
    delta = ts - prev
    pre = b""
    if delta < 0 or delta > 0xFFFFFFFF:
        pre, delta = EVENT.pack(0, OP_TIME, 0, 0, flags, 0, 0, 0, max(ts, 0), 0), 0
    return pre + EVENT.pack(delta, op, kind & 0xFF, max(-128, min(127, dev)), flags,
                            sid & 0xFFFFFFFF, min(tidx, 0xFFFF), min(label, 0xFFFF),
                            addr & 0xFFFFFFFFFFFFFFFF, size & 0xFFFFFFFFFFFFFFFF)


# ---- save() and load() --------------------------------------------------------


def save(tracker: Any, path: str) -> None:
    """Write a trace file from a tracker's current data (``Tracker.save``);
    see :func:`memviz._trace_save.save`."""
    from ._trace_save import save as _save
    _save(tracker, path)


def load(path: str, *, recover: bool = False) -> Any:
    """Read a .memviz trace file; returns a :class:`memviz._trace_load.LoadedTrace`
    with the reading API of a Tracker (snapshot(), peak_snapshot(), totals(),
    failures, timeline(), steps, capture_info(), diagnose()).

    Raises :class:`memviz.TraceError` (naming the file and byte offset) for a
    file that is not a trace or is corrupted; with ``recover=True`` a
    corrupted chunk ends the trace there instead, as a cut-off tail does.
    """
    from ._trace_load import load as _load
    return _load(path, recover=recover)


def _after_fork_in_child() -> None:
    for w in list(_writers):
        w._fd = None  # the parent's file: never written nor closed here
        w._stop.set()


os.register_at_fork(after_in_child=_after_fork_in_child)
