"""Parsing .memviz trace files: framing, checksums and chunk contents.

:class:`TraceFile` reads the chunks of :mod:`memviz.trace.format`'s format into
tables (strings, frames, stacks, threads, labels), step records and the END
and TIMELINE chunks, checking every CRC and every value it keeps, and hands
each EVENTS chunk on as soon as it is inflated and checked (``_events``: the
reader replays it, and nothing per event is kept);
:class:`memviz.loaded.LoadedTrace` builds the reading API on top. A file is
read where it lies, a window and a chunk at a time, and read again, chunk by
chunk, for what needs the whole history (``_reread_events``). Problems raise
:class:`memviz.TraceError` with the file and the byte offset of the chunk.
"""

from __future__ import annotations

import json
import os
import warnings
import zlib
from typing import Any, Dict, List, Optional, Tuple

import memviz._progress as _progress
from memviz._errors import TraceError
from memviz.model.frame_filter import warning_site
from memviz.trace import format as F
from memviz.trace.fields import _Bad, _int, _key, _opt_int, _r, check_end, check_meta, check_step

__all__ = ["TraceFile"]

#: How many bytes of memory reading a file takes (``memviz.load``: the
#: tables, the replay's live allocations, peaks and failures) at most, per
#: byte of the file, whatever the file declares. Each chunk inflates at most
#: its kind's cap (memviz/trace/format.py, max_ratio: 64x for events, 16x for
#: the tables), so a file of S bytes holds at most 1.4 S events, each at most
#: one live allocation of the replay (about 100 bytes), and tables of at most
#: 16 S bytes of JSON (Python objects: up to 12 bytes each). Measured on the
#: worst crafted files of 1.2 MB (every event a new live allocation at 58x;
#: two-letter strings and frames at 13-15x): 145-175 bytes per byte
#: (tests/integration/test_trace_limits.py). A report builds the snapshots of those
#: live allocations as Python objects besides: about 1,300 bytes per byte
#: for the file of events (benchmarks/RESULTS.md).
READER_MEMORY_FACTOR = 256


def _inflate(payload: bytes, limit: int, over: str) -> bytes:
    """The inflated payload, refused past ``limit`` bytes (``over`` says why
    that is the limit)."""
    d = zlib.decompressobj()
    try:
        out = d.decompress(payload, limit + 1)
    except zlib.error as e:
        raise _Bad(f"its compressed payload is damaged ({e})") from None
    if len(out) > limit:
        raise _Bad(f"it would inflate to more than {limit:,} bytes, {over}: memviz writes "
                   "nothing like it, so the file is damaged or crafted")
    if not d.eof or d.unconsumed_tail or d.unused_data:
        raise _Bad("its compressed payload is incomplete or has extra bytes")
    return out


def _inflate_chunk(payload: Any, kind: int) -> bytes:
    """A compressed chunk's payload inflated, within its kind's cap. Capped
    per chunk, so the whole file inflates at most that many times its size
    too."""
    return _inflate(payload, F.max_inflated(kind, len(payload)),
                    f"over {F.max_ratio(kind)} times its {len(payload):,} compressed bytes")


def _json(payload: bytes, kind: type) -> Any:
    try:
        obj = json.loads(payload.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise _Bad(f"its JSON payload cannot be read ({type(e).__name__})") from None
    if not isinstance(obj, kind):
        raise _Bad(f"its payload is a JSON {type(obj).__name__}, not a {kind.__name__}")
    return obj


class _Bytes:
    """A trace held in memory (``from_bytes``): reads are slices, no copies."""

    def __init__(self, data: Any) -> None:
        self.data = memoryview(data).toreadonly().cast("B")
        self.size = len(self.data)

    def read(self, offset: int, n: int) -> memoryview:
        return self.data[offset:offset + n]


class _File:
    """A trace file read where it lies, a window at a time (``memviz.load``):
    the file's bytes are never all in memory. Owns ``fd`` (closed when the
    reader goes); ``size`` is the file's size when it was opened."""

    WINDOW = 1 << 20

    def __init__(self, fd: int, path: Optional[str]) -> None:
        import weakref

        self.fd, self.path = fd, path
        self._closer = weakref.finalize(self, os.close, fd)
        self.size = os.fstat(fd).st_size

    def read(self, offset: int, n: int) -> bytes:
        out = []
        try:
            while n > 0:
                got = os.pread(self.fd, n, offset)
                if not got:
                    break
                out.append(got)
                offset += len(got)
                n -= len(got)
        except OSError as e:
            raise TraceError(f"cannot read the file: {e.strerror or e}", self.path, offset,
                             "check the path and that you may read it") from e
        return out[0] if len(out) == 1 else b"".join(out)

    def close(self) -> None:
        self._closer()


class _Window:
    """Sequential reads of a source through a window of at least
    ``_File.WINDOW`` bytes, so that small chunks cost no read each."""

    def __init__(self, source: Any) -> None:
        self.source = source
        self.lo, self.buf = 0, memoryview(b"")

    def get(self, offset: int, n: int) -> memoryview:
        """Bytes [offset, offset + n), fewer where the source ends."""
        if isinstance(self.source, _Bytes):
            return self.source.read(offset, n)
        if not (self.lo <= offset and offset + n <= self.lo + len(self.buf)):
            self.buf = memoryview(self.source.read(offset, max(n, _File.WINDOW)))
            self.lo = offset
        return self.buf[offset - self.lo:offset - self.lo + n]


class TraceFile:
    """The parsed chunks of a trace file (see :class:`LoadedTrace` for the API)."""

    def __init__(self, path: Optional[str]) -> None:
        self.path = path
        self.meta: Dict[str, Any] = {}
        self.truncated = False
        self.error: Optional[str] = None
        self.end: Optional[Dict[str, Any]] = None
        self.steps: List[Any] = []
        self.frame_filter = None
        self.trace_path = path
        self.running = False
        self._strings: List[str] = []
        self._frames: List[Tuple[str, int, str]] = []
        self._stacks: Dict[int, Tuple[int, ...]] = {}
        self._calls: Dict[int, str] = {}
        self._threads: Dict[int, Tuple[Optional[int], Optional[int], str]] = {}
        self._labels: Dict[int, str] = {}
        self._timeline: Optional[List[tuple]] = None
        self._source: Any = None
        #: (offset, length with header and CRC, events) of each EVENTS chunk read
        self._event_chunks: List[Tuple[int, int, int]] = []
        #: the LIVE chunk's (payload, count, layout): the live set at the end of a trace that lost events
        self._live_end: Optional[Tuple[bytes, int, int]] = None
        self._chunk_at: Tuple[int, int] = (0, 0)

    def _fail(self, reason: str, offset: Optional[int], hint: Optional[str] = None) -> TraceError:
        return TraceError(reason, self.path, offset, hint)

    def _parse(self, source: Any, recover: bool) -> None:
        """Every chunk of ``source`` (:class:`_Bytes` or :class:`_File`), in
        order, a chunk at a time: EVENTS chunks go to ``_events`` as they
        are inflated, so no more than one chunk's events is ever in memory."""
        self._source = source
        data = _Window(source)
        n = source.size
        head = bytes(data.get(0, F.HEADER.size))
        if n == 0:
            raise self._fail("the file is empty, so it is not a memviz trace (a trace starts "
                             "with a header written when tracking starts)", 0,
                             "check the path; a trace comes from memviz.track(trace=...), "
                             "Tracker.save() or `memviz run -o`")
        if head[:8] != F.MAGIC[:min(8, n)]:
            raise self._fail(f"not a memviz trace: it starts with {head[:8]!r}, not memviz's "
                             f"signature {F.MAGIC!r}", 0,
                             "give the .memviz file written by memviz.track(trace=...), "
                             "Tracker.save() or `memviz run -o`")
        if n < F.HEADER.size:
            raise self._fail("the file ends inside its header: there is nothing to load", n,
                             "the recording process was stopped before it wrote anything")
        version = F.HEADER.unpack(head)[1]
        if version > F.FORMAT_VERSION:
            raise self._fail(f"it uses trace format {version}, written by a newer memviz; this "
                             f"memviz reads format {F.FORMAT_VERSION}", 8,
                             "upgrade memviz (pip install -U memviz-gpu) to read it")
        if version not in (1, F.FORMAT_VERSION):
            raise self._fail(f"its header names trace format {version}, which no memviz "
                             "writes: the file is corrupted", 8,
                             "record the trace again")
        self.format_version = version
        self.event_width = F.event_width(version)
        pos = F.HEADER.size
        events = 0
        label = f"reading {os.path.basename(self.path or 'the trace')}"
        while pos < n:
            _progress.update(pos, n, label)
            start = pos
            if n - pos < F.CHUNK_HEAD.size + F.CRC.size:
                self._cut(start, "the file ends inside a chunk header")
                break
            ctype, length = F.CHUNK_HEAD.unpack_from(data.get(pos, F.CHUNK_HEAD.size))
            kind = ctype & F.KIND_MASK
            name = F.CHUNK_NAMES.get(kind, f"type-{kind}")
            end = pos + F.CHUNK_HEAD.size + length
            if end + F.CRC.size > n:
                self._cut(start, f"the file ends inside a {name} chunk of {length:,} bytes")
                break
            raw = data.get(pos, end + F.CRC.size - pos)
            if len(raw) < end + F.CRC.size - pos:  # the file shrank while it was read
                self._cut(start, f"the file ends inside a {name} chunk of {length:,} bytes")
                break
            crc = F.CRC.unpack_from(raw, end - pos)[0]
            if zlib.crc32(raw[:end - pos]) != crc:
                if not self._bad(start, recover, f"the {name} chunk's checksum does not match: "
                                                 "the file is corrupted"):
                    break
                continue
            pos = end + F.CRC.size
            try:
                if not self.meta and kind != F.META:
                    raise _Bad("the first chunk is not the header metadata (META)")
                if self.end is not None:
                    raise _Bad("it comes after the end-of-trace chunk")
                payload: Any = raw[F.CHUNK_HEAD.size:end - start]
                if ctype & F.COMPRESSED:
                    payload = _inflate_chunk(payload, kind)
                elif kind != F.EVENTS:
                    payload = bytes(payload)
                handler = self._HANDLERS.get(kind)
                self._chunk_at = (start, pos - start)
                if handler is not None:
                    handler(self, payload)
                elif not ctype & F.OPTIONAL:
                    raise _Bad(f"its type {kind} is unknown (written by a newer memviz?)")
            except _Bad as e:
                if not self._bad(start, recover, f"the {name} chunk is invalid: {e}"):
                    break
                continue
            events += 1 if kind == F.EVENTS else 0
        _progress.update(n, n, label)
        if not self.meta:
            raise self._fail("the file ends before its header metadata: there is nothing to "
                             "load", n, "the recording process was stopped before it wrote "
                                        "anything")
        if self.end is None and not self.truncated:
            self.truncated = True
            self.error = ("it has no end-of-trace record: the recording process stopped before "
                          "tracking ended (killed?); everything up to the last flush loaded")
        if self.truncated:
            warnings.warn(f"memviz trace {self.path!r} is incomplete: {self.error}.",
                          F.TraceWarning, stacklevel=warning_site()[0])

    def _reread_events(self, offset: int, length: int) -> Tuple[Any, int, int]:
        """(payload, count, layout) of the EVENTS chunk read at ``offset``
        before, read again (a second pass over the file: events(),
        snapshot(at_ns=...)), its checksum checked again."""
        raw = self._source.read(offset, length)
        ok = len(raw) == length and zlib.crc32(memoryview(raw)[:length - F.CRC.size]) == \
            F.CRC.unpack_from(raw, length - F.CRC.size)[0]
        if not ok:
            raise self._fail("the file changed after it was loaded: an EVENTS chunk read again "
                             "is not what was read the first time", offset,
                             "load the trace again (memviz.load) once nothing writes to it")
        payload: Any = memoryview(raw)[F.CHUNK_HEAD.size:length - F.CRC.size]
        if raw[0] & F.COMPRESSED:
            try:
                payload = _inflate_chunk(payload, F.EVENTS)
            except _Bad as e:  # it inflated the first time: the file changed
                raise self._fail(f"the file changed after it was loaded ({e})", offset,
                                 "load the trace again (memviz.load)") from None
        count, layout = F.EVENTS_HEAD.unpack_from(payload)
        return payload, count, layout

    def _cut(self, offset: int, why: str) -> None:
        self.truncated = True
        self.error = (f"{why} at byte {offset:,} (the recording process was probably killed "
                      "while writing); everything before it loaded")

    def _bad(self, offset: int, recover: bool, why: str) -> bool:
        if not recover:
            raise self._fail(why, offset, "pass recover=True to memviz.load() to read the "
                                          "part before it")
        self.truncated = True
        self.error = f"{why} (at byte {offset:,}); everything before it loaded"
        return False

    # -- chunk handlers

    def _h_meta(self, payload: bytes) -> None:
        meta = _json(payload, dict)
        if meta.get("format") != "memviz-trace":
            raise _Bad("its metadata does not say format 'memviz-trace'")
        if self.meta:
            raise _Bad("the file has two header metadata chunks")
        self.meta = check_meta(meta)

    def _h_strings(self, payload: bytes) -> None:
        items = _json(payload, list)
        if not all(type(s) is str for s in items):
            raise _Bad("a string table entry is not a string")
        self._strings += items

    def _h_frames(self, payload: bytes) -> None:
        strings, ns = self._strings, len(self._strings)
        out = []
        for f in _json(payload, list):
            if type(f) is not list or len(f) != 3:
                raise _Bad(f"frame {_r(f)} is not [file, line, name]")
            fi, line, ni = (_int(f[0], 0, ns - 1, "string id"), _int(f[1], -1, 1 << 31, "line"),
                            _int(f[2], 0, ns - 1, "string id"))
            out.append((strings[fi], max(line, 0), strings[ni]))
        self._frames += out

    def _h_stacks(self, payload: bytes) -> None:
        nf = len(self._frames)
        for s in _json(payload, list):
            if type(s) is not list or len(s) != 2 or type(s[1]) is not list:
                raise _Bad(f"stack {_r(s)} is not [id, [frame ids]]")
            sid = _int(s[0], 1, 0xFFFFFFFF, "stack id")
            self._stacks[sid] = tuple(_int(i, 0, nf - 1, "frame id") for i in s[1])

    def _h_calls(self, payload: bytes) -> None:
        for k, v in _json(payload, dict).items():
            if type(v) is not str:
                raise _Bad(f"call name {_r(v)} is not a string")
            self._calls[_key(k, 1, 0xFFFFFFFF, "stack id")] = v

    def _h_threads(self, payload: bytes) -> None:
        for k, v in _json(payload, dict).items():
            idx = _key(k, 0, 0xFFFF, "thread index")
            if type(v) is not list or len(v) != 3 or type(v[2]) is not str:
                raise _Bad(f"thread entry {_r(v)} is not [native id, ident, name]")
            self._threads[idx] = (_opt_int(v[0], "thread id"), _opt_int(v[1], "thread ident"),
                                  v[2])

    def _h_labels(self, payload: bytes) -> None:
        for k, v in _json(payload, dict).items():
            if type(v) is not str:
                raise _Bad(f"label {_r(v)} is not a string")
            self._labels[_key(k, 1, 0xFFFF, "label id")] = v

    def _h_events(self, payload: Any) -> None:
        if len(payload) < F.EVENTS_HEAD.size:
            raise _Bad("it is shorter than its own header")
        count, layout = F.EVENTS_HEAD.unpack_from(payload)
        data = memoryview(payload)[F.EVENTS_HEAD.size:]
        size = self.event_width
        if len(data) != count * size:
            raise _Bad(f"it says {count:,} events but holds {len(data):,} bytes "
                       f"(not {count * size:,})")
        if layout == F.LAYOUT_PLANES:
            ops = bytes(data[4 * count:5 * count])
        elif layout == F.LAYOUT_ROWS:
            ops = bytes(data[4::size])
        else:
            raise _Bad(f"its event layout {layout} is unknown")
        bad = ops.translate(None, bytes(range(1, 6)))
        if bad:
            raise _Bad(f"an event has the unknown operation {bad[0]}")
        if count:
            self._event_chunks.append(self._chunk_at + (count,))
            self._events(payload, F.EVENTS_HEAD.size, count, layout)

    def _h_live(self, payload: Any) -> None:
        if len(payload) < F.EVENTS_HEAD.size:
            raise _Bad("it is shorter than its own header")
        count, layout = F.EVENTS_HEAD.unpack_from(payload)
        size = self.event_width
        data = memoryview(payload)[F.EVENTS_HEAD.size:]
        if len(data) != count * size or layout not in (F.LAYOUT_ROWS, F.LAYOUT_PLANES):
            raise _Bad(f"it says {count:,} events in layout {layout} but holds {len(data):,} bytes")
        ops = bytes(data[4 * count:5 * count]) if layout == F.LAYOUT_PLANES else bytes(data[4::size])
        if ops.translate(None, bytes((F.OP_ALLOC, F.OP_TIME))):
            raise _Bad("it holds an event that is not an allocation")
        self._live_end = (bytes(payload), count, layout)

    def _events(self, payload: Any, offset: int, count: int, layout: int) -> None:
        """The ``count`` checked event records of one EVENTS chunk, at
        ``payload[offset:]`` in ``layout`` (the reader replays them)."""

    def _h_steps(self, payload: bytes) -> None:
        start = len(self.steps)
        self.steps += [check_step(e, start + i) for i, e in enumerate(_json(payload, list))]

    def _h_end(self, payload: bytes) -> None:
        self.end = check_end(_json(payload, dict))

    def _h_timeline(self, payload: bytes) -> None:
        points = []
        for p in _json(payload, list):
            if type(p) is not list or len(p) != 3:
                raise _Bad(f"timeline point {_r(p)} is not [timestamp, device, bytes]")
            points.append((_int(p[0], 0, (1 << 64) - 1, "timestamp"),
                           _int(p[1], F.DEVICE_MIN, F.DEVICE_MAX, "device"),
                           _int(p[2], 0, (1 << 64) - 1, "bytes")))
        self._timeline = points

    _HANDLERS = {F.META: _h_meta, F.STRINGS: _h_strings, F.FRAMES: _h_frames,
                 F.STACKS: _h_stacks, F.THREADS: _h_threads, F.LABELS: _h_labels,
                 F.EVENTS: _h_events, F.STEPS: _h_steps, F.END: _h_end,
                 F.TIMELINE: _h_timeline, F.CALLS: _h_calls, F.LIVE: _h_live}
