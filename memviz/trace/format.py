"""The .memviz trace file: format, the streaming writer, and ``save()``.

A trace is written while tracking (``memviz.track(trace="run.memviz")``,
``python -m memviz run -o run.memviz script.py``) or afterwards from a
tracker's data (``t.save("run.memviz")``), and read back with
:func:`memviz.load` (see :mod:`memviz.trace.reader`).

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
               command line, the tracker's settings and capture_info(),
               the process's place in a distributed run ("ranks": rank,
               local_rank, world_size, host, run_id, cuda_device,
               cuda_visible_devices; memviz/capture/ranks.py)
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
               and segments at the peak, memory_stats: memviz/model/pytorch.py;
               read by memviz diff);
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

The streaming writer's C thread (src/trace_writer.c) drains the core's event
ring every 0.5 s (sooner while it fills fast) and appends each EVENTS chunk
with ``write(2)``; Python appends the chunks that name new stacks, labels,
threads and steps once a second, through the same lock. Nothing is buffered
in user space, so a process killed with SIGKILL leaves a file that loads up to
the last flush. A file's chunks may name a stack after the events that use it
(a reader resolves names once every chunk is read). The flight recorder
(memviz/trace/flight.py) writes the same chunks, kept in memory, only when it
dumps; its END record has a "flight_recorder" object saying what it covers.
"""

from __future__ import annotations

import dataclasses
import json
import struct
import zlib
from typing import Any, Optional

__all__ = ["TraceWarning", "MAGIC", "FORMAT_VERSION", "EVENT"]

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


# ---- the streaming writer -------------------------------------------------------
