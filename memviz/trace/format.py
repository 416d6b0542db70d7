"""The .memviz trace file's format: its layout, its constants and the
framing of its chunks.

A trace is written while tracking (``memviz.track(trace="run.memviz")``,
``python -m memviz run -o run.memviz script.py``: memviz/trace/writer.py),
by the flight recorder when it dumps (memviz/trace/flight.py), or afterwards
from a tracker's data (``t.save("run.memviz")``: memviz/trace/save.py), and
read back with :func:`memviz.load` (memviz/trace/parse.py and
memviz/trace/reader.py). The event records and the EVENTS and LIVE chunks
that hold them are encoded and framed by the C core alone, for every
writer (src/trace_ring.c's mvz_ring_encode_from, src/trace_writer.c's
mvz_tw_events_payload and mvz_tw_frame_events; from Python
``_core.encode_events``, ``events_payload()`` and ``chunk()`` below); the
JSON chunks are framed here.

File format, version 2 (all integers little-endian; version 1 differs only
in its shorter event records, below)::

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
               command line, the tracker's settings and capture_info(),
               the process's place in a distributed run ("ranks": rank,
               local_rank, world_size, host, run_id, cuda_device,
               cuda_visible_devices; memviz/capture/rank_files.py)
STRINGS     2  JSON list of str, appended to the string table (filenames,
               function names); ids count from 0 across the whole file
FRAMES      3  JSON list of [filename string id, lineno, name string id],
               appended to the frame table
STACKS      4  JSON list of [stack id, [frame id, ...]], innermost first;
               each stack is written once, lines resolved when written
THREADS     5  JSON object {thread index: [native id, ident, name]};
               later entries replace earlier ones
LABELS      6  JSON object {label id: label}
EVENTS      7  count:u32, layout:u8, then count event records,
               ``EVENT`` below; layout 0 = records one after another,
               layout 1 = byte planes (byte k of every record, then byte
               k+1, ...), which compresses 3-5x better; memviz writes
               planes, or rows where planes do not compress within the
               reader's ratio
STEPS       8  JSON list of step records (Tracker.steps), appended
END         9  JSON object written when tracking stops: totals, failure
               count, memviz's own counters, memory outside the tracked
               allocations, PyTorch's figures ("pytorch_peak": categories
               and segments at the peak, each allocation's category at the
               peak and at the end, memory_stats: memviz/model/pytorch.py;
               read by memviz diff and a loaded trace's snapshots);
               a trace without it was cut short
TIMELINE   10  JSON list of [timestamp_ns, device, live bytes] (saved
               traces only: streamed traces derive it from the events)
CALLS      11  JSON object {stack id: call name}: what the stack's innermost
               frame was calling (``Allocation.op``); written with the
               skippable bit, so readers that predate it load the rest
LIVE       12  an EVENTS payload of ALLOC records: the live set when tracking
               stopped, written (skippable, before END) only when the trace
               lost events (GAP): a reader frees, at the end, what its
               replay holds live beyond it (allocations whose frees were
               lost) and adds what it lacks (made while events were lost),
               so a lost free never shows as a leak
=========  ==  ===========================================================

An event record is the C core's allocation record (src/record.h, the one
place its fields are written; ``EVENT_FIELDS`` and ``EVENT`` below come
from it): ts_delta (ns since the previous event), op, kind, device (-1
host), flags, stack id, thread index, label id, address, size, slack (size
less the bytes asked for: a block's rounding and the remainder PyTorch did
not split off) and stream; 48 bytes. Format 1's records are the first 32
bytes (through size); fields past a file's record width read as 0. Ops:
1 ALLOC, 2 FREE (size is the freed allocation's), 3 FAILED (address =
CUresult, size = requested), 4 TIME (address = absolute monotonic ns; every
run of records the C core encodes starts with one, and one comes before an
event that goes back in time or more than 2**32 ns on), 5 GAP (address = events dropped because the ring was
full). Flags: bit 0 an allocation live when tracking started (read from
PyTorch then), bit 1 a block whose size PyTorch's rules could not fix, bit 2
memviz's own memory, bit 3 a block another stream's use was recorded on, bit 7
events made up rather than seen (the live set when
tracing began, a flight recorder's base, everything in a saved trace).

The streaming writer's C thread (src/trace_writer.c) drains the core's event
ring every 0.5 s (sooner while it fills fast) and appends each EVENTS chunk
with ``write(2)``; Python appends the chunks that name new stacks, labels,
threads and steps every 0.5 s, through the same lock. An event is written
only once the file names its stack and its label (the C thread holds it
until Python's names are written, or 3 s where Python cannot run), so a
process killed with SIGKILL leaves a file that loads up to the last flush,
every event in it named. A reader still resolves names once every chunk is
read (a file of an older memviz may name a stack after the events that use
it). Events the ring had no room for are counted (GAP records), the writer
warns once while tracking, and the text report says which figures they
affect; the LIVE chunk keeps the live set at the end exact. The flight recorder
(memviz/trace/flight.py) writes the same chunks, kept in memory, only when it
dumps; its END record has a "flight_recorder" object saying what it covers.
"""

from __future__ import annotations

import dataclasses
import json
import struct
import zlib
from typing import Any, Optional

import memviz._core as _core

__all__ = ["TraceWarning", "MAGIC", "FORMAT_VERSION", "EVENT"]

MAGIC = b"MEMVIZ\x00\x01"
FORMAT_VERSION = 2
HEADER = struct.Struct("<8sI")
CHUNK_HEAD = struct.Struct("<BI")
CRC = struct.Struct("<I")
#: the event record's field names and struct, from the C core's schema
EVENT_FIELDS = tuple(_core.EVENT_FIELDS)
EVENT = struct.Struct(_core.EVENT_FORMAT)
EVENTS_HEAD = struct.Struct("<IB")
#: a field's position in an unpacked record
EV = {name: i for i, name in enumerate(EVENT_FIELDS)}
#: the devices a record holds (its device field's width; -1 is pinned host memory)
_DEVICE_BITS = 8 * struct.calcsize("<" + _core.EVENT_FORMAT[1 + EV["device"]])
DEVICE_MIN, DEVICE_MAX = -(1 << (_DEVICE_BITS - 1)), (1 << (_DEVICE_BITS - 1)) - 1


def event_width(version: int) -> int:
    """Bytes of an event record in a file of format ``version``."""
    return _core.EVENT_V1_SIZE if version == 1 else EVENT.size


def pack_event(**fields: int) -> bytes:
    """One record from its fields by name; the rest are 0."""
    values = [0] * len(EVENT_FIELDS)
    for name, value in fields.items():
        values[EV[name]] = value
    return EVENT.pack(*values)

#: chunk kinds; EVENTS is also the native writer's, so its number, the
#: compressed bit and the two layouts come from it (src/trace_writer.h)
META, STRINGS, FRAMES, STACKS, THREADS, LABELS, STEPS, END, TIMELINE, CALLS, LIVE = \
    1, 2, 3, 4, 5, 6, 8, 9, 10, 11, 12
EVENTS = _core.CHUNK_KIND_EVENTS
CHUNK_NAMES = {META: "META", STRINGS: "STRINGS", FRAMES: "FRAMES", STACKS: "STACKS",
               THREADS: "THREADS", LABELS: "LABELS", EVENTS: "EVENTS", STEPS: "STEPS",
               END: "END", TIMELINE: "TIMELINE", CALLS: "CALLS", LIVE: "LIVE"}
KIND_MASK, OPTIONAL, COMPRESSED = 0x3F, 0x40, _core.CHUNK_COMPRESSED

#: a record's op (src/record.h)
OP_ALLOC, OP_FREE, OP_FAILED, OP_TIME, OP_GAP = \
    _core.OP_ALLOC, _core.OP_FREE, _core.OP_FAILED, _core.OP_TIME, _core.OP_GAP
FLAG_SYNTHETIC = _core.FLAG_SYNTHETIC
FLAG_BEFORE, FLAG_ESTIMATED, FLAG_MEMVIZ = _core.FLAG_BEFORE, _core.FLAG_ESTIMATED, _core.FLAG_MEMVIZ
LAYOUT_ROWS, LAYOUT_PLANES = _core.LAYOUT_ROWS, _core.LAYOUT_PLANES

#: events the C ring holds between drains (drained every 0.5 s); the
#: environment variable RING_ENV sets another number (a trace that lost
#: events because the ring was full says so, and to set it)
DEFAULT_CAPACITY = 1 << 20
RING_ENV = "MEMVIZ_TRACE_RING"
DEFAULT_INTERVAL = 0.5
#: zlib level of event chunks (1 is ~2x faster than 6 and ~10% larger)
EVENT_LEVEL = 6

#: How far a compressed chunk may inflate, by kind: its payload may be at most
#: its compressed size times the kind's ratio plus INFLATE_SLACK bytes. The
#: reader refuses more (deflate itself allows about 1032x, which a crafted
#: file uses to make a small file take gigabytes); every writer keeps under
#: it (chunk() here for the JSON chunks; src/trace_writer.c for EVENTS and
#: LIVE, MVZ_MAX_RATIO, whoever writes them): an EVENTS payload that would
#: compress further is written as event rows instead of byte planes (which
#: compress less), any payload otherwise uncompressed. So
#: nothing memviz writes is refused, and a file inflates at most 64 times its
#: size. The tables (strings, frames, stacks, call names, labels, threads)
#: cost the reader the most per byte, as Python objects, and memviz's own
#: inflate 3x at most: they get 16x; the JSON records 32x (20,000 empty
#: steps inflate 27x). What this bounds the reader's memory to:
#: memviz/trace/parse.py (READER_MEMORY_FACTOR).
MAX_RATIO = _core.MAX_RATIO
_RATIOS = {STRINGS: 16, FRAMES: 16, STACKS: 16, CALLS: 16, LABELS: 16, THREADS: 16,
           EVENTS: MAX_RATIO, LIVE: MAX_RATIO}
_RATIO_OTHER = 32
INFLATE_SLACK = _core.INFLATE_SLACK


def max_ratio(kind: int) -> int:
    """How many times its compressed size a chunk of ``kind`` may inflate."""
    return _RATIOS.get(kind & KIND_MASK, _RATIO_OTHER)


def max_inflated(kind: int, compressed: int) -> int:
    """The most bytes a ``kind`` chunk's payload of ``compressed`` bytes may
    inflate to."""
    return compressed * max_ratio(kind) + INFLATE_SLACK


class TraceWarning(UserWarning):
    """A trace file was cut short, or the writer had to stop; the message says why."""


# ---- encoding -----------------------------------------------------------------


def chunk(kind: int, payload: bytes, *, compress: Optional[int] = 6) -> bytes:
    """One framed chunk; the payload is zlib-compressed at level ``compress``
    when that makes it smaller (``None``: never) and it inflates no more
    than the reader allows (max_ratio()). EVENTS and LIVE chunks are framed
    by the C core, as its writer frames them (``_core.events_chunk``: a
    payload in byte planes that does not compress so is tried as rows)."""
    if kind & KIND_MASK in (EVENTS, LIVE):
        return _core.events_chunk(kind, payload, compress or 0)
    ctype = kind
    if compress is not None and len(payload) > 64:
        packed = zlib.compress(payload, compress)
        if len(packed) < len(payload) and len(payload) <= max_inflated(kind, len(packed)):
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
    """The EVENTS payload of packed records (``EVENT``), by the C core
    (``_core.events_payload``)."""
    return _core.events_payload(rows, layout)


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

