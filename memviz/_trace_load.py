"""Reading .memviz trace files: :func:`load` and :class:`LoadedTrace`.

The format is described in :mod:`memviz._trace`. Loading checks every chunk's
CRC and structure; events are kept as columns (``array``/``bytearray``,
built with C-speed slicing, no per-event Python work) and replayed once, on
first use, in a single Python loop. A 1,000,000-event trace loads and gives
its peak snapshot in about a second on one core.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import warnings
import zlib
from array import array
from typing import Any, Dict, List, Optional, Tuple

from . import _trace as F
from ._errors import TraceError
from ._snapshot import Snapshot, snapshot_from_raw

__all__ = ["load", "LoadedTrace"]

_U32, _U64 = ("I" if array("I").itemsize == 4 else "L"), "Q"
_BIG = sys.byteorder != "little"
#: deflate expands at most ~1032x; anything claiming more is damaged
_MAX_RATIO = 1100
_TIMELINE_POINTS = 16384


class _Bad(Exception):
    """A structural problem inside one chunk (turned into TraceError with its offset)."""


def _inflate(payload: bytes) -> bytes:
    d = zlib.decompressobj()
    try:
        out = d.decompress(payload, len(payload) * _MAX_RATIO + 4096)
    except zlib.error as e:
        raise _Bad(f"its compressed payload is damaged ({e})") from None
    if not d.eof or d.unconsumed_tail or d.unused_data:
        raise _Bad("its compressed payload is incomplete or has extra bytes")
    return out


def _json(payload: bytes, kind: type) -> Any:
    try:
        obj = json.loads(payload.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise _Bad(f"its JSON payload cannot be read ({type(e).__name__})") from None
    if not isinstance(obj, kind):
        raise _Bad(f"its payload is a JSON {type(obj).__name__}, not a {kind.__name__}")
    return obj


def _int(v: Any, lo: int, hi: int, what: str) -> int:
    if type(v) is not int or not lo <= v <= hi:
        raise _Bad(f"{what} {v!r} is not a whole number between {lo} and {hi}")
    return v


def _opt_int(v: Any, what: str) -> Optional[int]:
    return None if v is None else _int(v, -(1 << 63), (1 << 64) - 1, what)


def _key(k: str, lo: int, hi: int, what: str) -> int:
    try:
        return _int(int(k), lo, hi, what)
    except ValueError:
        raise _Bad(f"{what} {k!r} is not a number") from None


def _column(planes: List[bytes], lo: int, width: int, code: str) -> array:
    """Values of bytes lo..lo+width-1 of each record, from byte planes."""
    n = len(planes[0])
    buf = bytearray(n * width)
    for k in range(width):
        buf[k::width] = planes[lo + k]
    col = array(code)
    col.frombytes(buf)
    if _BIG:
        col.byteswap()
    return col


class LoadedTrace:
    """A trace file read back, with the reading API of a stopped Tracker.

    Attributes:
        path: the file.
        meta: the header metadata (versions, pid, command line, settings).
        truncated: the file ended early (no END chunk, or a cut-off or,
            with ``recover=True``, damaged chunk); what came before loaded.
        error: why it was truncated, or None.
        saved: written by ``Tracker.save()`` (live set and timeline) rather
            than streamed (every event).
        event_count: events in the file; dropped_events: events lost
            because the ring was full (GAP records).
        steps: step records (dicts, or memviz StepRecord objects when
            memviz._steps can rebuild them).
        outside: ``{device: (bytes, source)}`` the process held outside the
            tracked allocations when tracking stopped.
    """

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
        self._threads: Dict[int, Tuple[Optional[int], Optional[int], str]] = {}
        self._labels: Dict[int, str] = {}
        self._timeline: Optional[List[tuple]] = None
        self._planes: List[List[bytes]] = []
        self._replayed: Optional[Dict[str, Any]] = None
        self._ts_cache: Optional[List[int]] = None

    # -- reading the file --------------------------------------------------

    @classmethod
    def from_bytes(cls, data: bytes, path: Optional[str] = None, *,
                   recover: bool = False) -> "LoadedTrace":
        """Parse a whole trace held in memory (``path`` only names it in errors)."""
        self = cls(path)
        self._parse(memoryview(data).toreadonly(), recover)
        self._finish()
        return self

    def _fail(self, reason: str, offset: Optional[int], hint: Optional[str] = None) -> TraceError:
        return TraceError(reason, self.path, offset, hint)

    def _parse(self, data: memoryview, recover: bool) -> None:
        n = len(data)
        head = bytes(data[:F.HEADER.size])
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
        if version != F.FORMAT_VERSION:
            raise self._fail(f"it uses trace format {version}; this memviz reads format "
                             f"{F.FORMAT_VERSION}", 8,
                             "read it with the memviz version that wrote it (upgrade memviz)")
        pos = F.HEADER.size
        events = 0
        while pos < n:
            start = pos
            if n - pos < F.CHUNK_HEAD.size + F.CRC.size:
                self._cut(start, "the file ends inside a chunk header")
                break
            ctype, length = F.CHUNK_HEAD.unpack_from(data, pos)
            kind = ctype & F.KIND_MASK
            name = F.CHUNK_NAMES.get(kind, f"type-{kind}")
            end = pos + F.CHUNK_HEAD.size + length
            if end + F.CRC.size > n:
                self._cut(start, f"the file ends inside a {name} chunk of {length:,} bytes")
                break
            crc = F.CRC.unpack_from(data, end)[0]
            if zlib.crc32(data[pos:end]) != crc:
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
                payload = bytes(data[start + F.CHUNK_HEAD.size:end])
                if ctype & F.COMPRESSED:
                    payload = _inflate(payload)
                handler = self._HANDLERS.get(kind)
                if handler is not None:
                    handler(self, payload)
                elif not ctype & F.OPTIONAL:
                    raise _Bad(f"its type {kind} is unknown (written by a newer memviz?)")
            except _Bad as e:
                if not self._bad(start, recover, f"the {name} chunk is invalid: {e}"):
                    break
                continue
            events += 1 if kind == F.EVENTS else 0
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
                          F.TraceWarning, stacklevel=4)

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
        for key in ("tracker", "capture"):
            if not isinstance(meta.get(key, {}), dict):
                raise _Bad(f"its {key!r} entry is not an object")
        self.meta = meta

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
                raise _Bad(f"frame {f!r} is not [file, line, name]")
            fi, line, ni = (_int(f[0], 0, ns - 1, "string id"), _int(f[1], -1, 1 << 31, "line"),
                            _int(f[2], 0, ns - 1, "string id"))
            out.append((strings[fi], max(line, 0), strings[ni]))
        self._frames += out

    def _h_stacks(self, payload: bytes) -> None:
        nf = len(self._frames)
        for s in _json(payload, list):
            if type(s) is not list or len(s) != 2 or type(s[1]) is not list:
                raise _Bad(f"stack {str(s)[:40]} is not [id, [frame ids]]")
            sid = _int(s[0], 1, 0xFFFFFFFF, "stack id")
            self._stacks[sid] = tuple(_int(i, 0, nf - 1, "frame id") for i in s[1])

    def _h_threads(self, payload: bytes) -> None:
        for k, v in _json(payload, dict).items():
            idx = _key(k, 0, 0xFFFF, "thread index")
            if type(v) is not list or len(v) != 3 or type(v[2]) is not str:
                raise _Bad(f"thread entry {str(v)[:40]} is not [native id, ident, name]")
            self._threads[idx] = (_opt_int(v[0], "thread id"), _opt_int(v[1], "thread ident"),
                                  v[2])

    def _h_labels(self, payload: bytes) -> None:
        for k, v in _json(payload, dict).items():
            if type(v) is not str:
                raise _Bad(f"label {v!r} is not a string")
            self._labels[_key(k, 1, 0xFFFF, "label id")] = v

    def _h_events(self, payload: bytes) -> None:
        if len(payload) < F.EVENTS_HEAD.size:
            raise _Bad("it is shorter than its own header")
        count, layout = F.EVENTS_HEAD.unpack_from(payload)
        data = memoryview(payload)[F.EVENTS_HEAD.size:]
        size = F.EVENT.size
        if len(data) != count * size:
            raise _Bad(f"it says {count:,} events but holds {len(data):,} bytes "
                       f"(not {count * size:,})")
        if layout == F.LAYOUT_PLANES:
            planes = [bytes(data[k * count:(k + 1) * count]) for k in range(size)]
        elif layout == F.LAYOUT_ROWS:
            raw = bytes(data)
            planes = [raw[k::size] for k in range(size)]
        else:
            raise _Bad(f"its event layout {layout} is unknown")
        bad = planes[4].translate(None, bytes(range(1, 6)))
        if bad:
            raise _Bad(f"an event has the unknown operation {bad[0]}")
        if count:
            self._planes.append(planes)

    def _h_steps(self, payload: bytes) -> None:
        self.steps += _json(payload, list)

    def _h_end(self, payload: bytes) -> None:
        end = _json(payload, dict)
        totals = end.get("totals", {})
        if not isinstance(totals, dict):
            raise _Bad("its totals are not an object")
        clean: Dict[int, Dict[str, int]] = {}
        for k, v in totals.items():
            if not isinstance(v, dict):
                raise _Bad(f"the totals of device {k} are not an object")
            clean[_key(k, -128, 127, "device")] = {
                str(name): _int(x, -(1 << 63), (1 << 64) - 1, f"total {name!r}")
                for name, x in v.items()}
        outside = end.get("outside", {})
        if not isinstance(outside, dict):
            raise _Bad("its 'outside' entry is not an object")
        out: Dict[int, Tuple[int, str]] = {}
        for k, v in outside.items():
            if type(v) is not list or len(v) != 2 or type(v[1]) is not str:
                raise _Bad(f"outside entry {str(v)[:40]} is not [bytes, source]")
            out[_key(k, -128, 127, "device")] = (_int(v[0], 0, (1 << 64) - 1, "bytes"), v[1])
        for key in ("stopped_monotonic_ns", "dropped_events"):
            if key in end:
                _int(end[key], 0, (1 << 64) - 1, key)
        if not isinstance(end.get("stats", {}), dict):
            raise _Bad("its 'stats' entry is not an object")
        end["totals"], end["outside"] = clean, out
        self.end = end

    def _h_timeline(self, payload: bytes) -> None:
        points = []
        for p in _json(payload, list):
            if type(p) is not list or len(p) != 3:
                raise _Bad(f"timeline point {str(p)[:40]} is not [timestamp, device, bytes]")
            points.append((_int(p[0], 0, (1 << 64) - 1, "timestamp"),
                           _int(p[1], -128, 127, "device"), _int(p[2], 0, (1 << 64) - 1, "bytes")))
        self._timeline = points

    _HANDLERS = {F.META: _h_meta, F.STRINGS: _h_strings, F.FRAMES: _h_frames,
                 F.STACKS: _h_stacks, F.THREADS: _h_threads, F.LABELS: _h_labels,
                 F.EVENTS: _h_events, F.STEPS: _h_steps, F.END: _h_end,
                 F.TIMELINE: _h_timeline}

    def _finish(self) -> None:
        """Columns of all events (the per-chunk planes are released)."""
        planes = [b"".join(p[k] for p in self._planes) for k in range(F.EVENT.size)] \
            if self._planes else [b""] * F.EVENT.size
        self._planes = []
        self.event_count = len(planes[0])
        self._op = planes[4]
        self._kind = planes[5]
        self._dev = array("b", planes[6])
        self._delta = _column(planes, 0, 4, _U32)
        self._stack = _column(planes, 8, 4, _U32)
        self._thread = _column(planes, 12, 2, "H")
        self._label = _column(planes, 14, 2, "H")
        self._addr = _column(planes, 16, 8, _U64)
        self._size = _column(planes, 24, 8, _U64)
        m, t, e = self.meta, self.meta.get("tracker", {}), self.end or {}
        self.started_ns = m.get("start_monotonic_ns") if type(
            m.get("start_monotonic_ns")) is int else None
        self.gpu_requested = bool(t.get("gpu_requested", True))
        self.gpu_enabled = bool(t.get("gpu_enabled", False))
        self.gpu_off_reason = t.get("gpu_off_reason") if isinstance(
            t.get("gpu_off_reason"), str) else None
        self.activity_enabled = bool(t.get("activity_enabled", False))
        self.activity_error = t.get("activity_error") if isinstance(
            t.get("activity_error"), str) else None
        depth = t.get("depth")
        self.depth = depth if type(depth) is int else 0
        self.saved = m.get("mode") == "saved"
        self.command = m.get("command") if isinstance(m.get("command"), str) else None
        self.outside: Dict[int, Tuple[int, str]] = e.get("outside", {})
        self.stopped_ns = e.get("stopped_monotonic_ns")
        if self.stopped_ns is None and self.started_ns is not None:
            ts = self._ts()
            self.stopped_ns = max(ts[-1], self.started_ns) if ts else self.started_ns
        self.steps = _step_records(self.steps)
        dropped, i = 0, self._op.find(F.OP_GAP)
        while i >= 0:
            dropped += self._addr[i]
            i = self._op.find(F.OP_GAP, i + 1)
        self.dropped_events = dropped

    # -- replay ------------------------------------------------------------

    def _ts(self) -> List[int]:
        """Absolute timestamp of every event (TIME records restart the count)."""
        if self._ts_cache is None:
            op, delta, addr, n = self._op, self._delta, self._addr, self.event_count
            out: List[int] = []
            base, start = (self.started_ns or 0), 0
            while True:
                i = op.find(F.OP_TIME, start)
                stop = n if i < 0 else i
                if stop > start:
                    seg = itertools.accumulate(delta[start:stop], initial=base)
                    next(seg)  # the base itself
                    out += seg
                    base = out[-1]
                if i < 0:
                    break
                base = addr[i]
                out.append(base)
                start = i + 1
            self._ts_cache = out
        return self._ts_cache

    def _replay(self) -> Dict[str, Any]:
        if self._replayed is not None:
            return self._replayed
        op, addr, size, kind, dev = self._op, self._addr, self._size, self._kind, self._dev
        n = self.event_count
        end = array("q", bytes(8 * n))  # alloc index -> the index that ended it (0: never)
        live: Dict[int, int] = {}
        cur, peak, peak_i = [0] * 256, [0] * 256, [-1] * 256
        nlive, peak_n = [0] * 256, [0] * 256
        allocs, frees, failed, abytes = [0] * 256, [0] * 256, [0] * 256, [0] * 256
        alloc_idx: List[int] = []
        fail_idx: List[int] = []
        tl_i, tl_d, tl_c = array("q"), array("b"), array("q")
        unmatched = 0
        for i, o in enumerate(op):
            if o == 1:
                d, s, k = dev[i], size[i], (addr[i] << 8) | kind[i]
                j = live.get(k)
                if j is not None:  # its free was not seen: retire it, as the core does
                    end[j] = i
                    dj = dev[j]
                    cur[dj] -= size[j]
                    nlive[dj] -= 1
                live[k] = i
                alloc_idx.append(i)
                c = cur[d] + s
                cur[d] = c
                nlive[d] += 1
                allocs[d] += 1
                abytes[d] += s
                if c > peak[d]:
                    peak[d], peak_i[d], peak_n[d] = c, i, nlive[d]
                tl_i.append(i)
                tl_d.append(d)
                tl_c.append(c)
            elif o == 2:
                j = live.pop((addr[i] << 8) | kind[i], None)
                if j is None:
                    unmatched += 1
                    continue
                end[j] = i
                d = dev[j]
                c = cur[d] - size[j]
                cur[d] = c
                nlive[d] -= 1
                frees[d] += 1
                tl_i.append(i)
                tl_d.append(d)
                tl_c.append(c)
            elif o == 3:
                failed[dev[i]] += 1
                fail_idx.append(i)
        ts = self._ts()
        devices = sorted({d for d in range(-128, 128) if allocs[d] or failed[d]})
        totals = {d: {"current": cur[d], "peak": peak[d],
                      "peak_timestamp_ns": ts[peak_i[d]] if peak_i[d] >= 0 else 0,
                      "allocs": allocs[d], "frees": frees[d], "failed": failed[d],
                      "alloc_bytes": abytes[d], "live_count": nlive[d], "peak_count": peak_n[d],
                      "window_peak": peak[d]} for d in devices}
        self._replayed = {"end": end, "live": sorted(live.values()), "alloc_idx": alloc_idx,
                          "fail_idx": fail_idx, "peak_i": {d: peak_i[d] for d in devices},
                          "totals": totals, "timeline": (tl_i, tl_d, tl_c),
                          "unmatched": unmatched}
        return self._replayed

    def _rows(self, idx: List[int]) -> List[tuple]:
        ts, labels = self._ts(), self._labels
        a, s, d, k, t, lab, st = (self._addr, self._size, self._dev, self._kind, self._thread,
                                  self._label, self._stack)
        return [(a[j], s[j], d[j], k[j], 0, t[j],
                 (labels.get(lab[j], f"<label {lab[j]}>") if lab[j] else None), ts[j], st[j], j)
                for j in idx]

    def _resolve(self, ids: set) -> Dict[int, tuple]:
        frames = self._frames
        return {i: tuple(frames[f] for f in self._stacks[i]) for i in ids if i in self._stacks}

    def _thread_map(self) -> Dict[int, tuple]:
        # ident None: the recording process's idents mean nothing in this one,
        # so the stored name is used as is.
        return {i: (n, None, name) for i, (n, _ident, name) in self._threads.items()}

    def _snapshot(self, idx: List[int], ts: Optional[int]) -> Snapshot:
        return snapshot_from_raw(self._rows(idx), self._resolve, self._thread_map(),
                                 self.frame_filter, timestamp_ns=ts)

    # -- the Tracker reading API ------------------------------------------

    def snapshot(self, at_ns: Optional[int] = None) -> Snapshot:
        """The allocations live at the end of the trace, or at ``at_ns`` (a
        timestamp on the recording process's monotonic clock, as
        ``Allocation.timestamp_ns`` and timeline() use)."""
        r = self._replay()
        if at_ns is None:
            return self._snapshot(r["live"], self.stopped_ns)
        ts, end = self._ts(), r["end"]
        idx = [j for j in r["alloc_idx"] if ts[j] <= at_ns and (end[j] == 0 or ts[end[j]] > at_ns)]
        return self._snapshot(idx, at_ns)

    def peak_snapshot(self, device: Optional[int] = None) -> Snapshot:
        """The allocations live at a device's peak; every device at its own
        peak when ``device`` is None."""
        r = self._replay()
        peaks = r["peak_i"]
        devices = [device] if device is not None else sorted(peaks)
        end, dev = r["end"], self._dev
        idx: List[int] = []
        for d in devices:
            p = peaks.get(d, -1)
            if p >= 0:
                idx += [j for j in r["alloc_idx"]
                        if j <= p and dev[j] == d and (end[j] == 0 or end[j] > p)]
        ts = self._ts()
        when = max((ts[peaks[d]] for d in devices if peaks.get(d, -1) >= 0), default=None)
        return self._snapshot(sorted(idx), when)

    def totals(self) -> Dict[int, Dict[str, int]]:
        """Per device (-1: pinned host): current, peak, allocs, frees, failed, ...
        (as recorded when tracking stopped; replayed from the events when the
        trace was cut short)."""
        if self.end is not None and self.end.get("totals"):
            return {d: dict(v) for d, v in self.end["totals"].items()}
        return {d: dict(v) for d, v in self._replay()["totals"].items()}

    def current_bytes(self, device: Optional[int] = None) -> int:
        """Bytes live at the end; all devices (not host memory) when device is None."""
        t = self.totals()
        if device is not None:
            return t.get(device, {}).get("current", 0)
        return sum(v.get("current", 0) for d, v in t.items() if d >= 0)

    def peak_bytes(self, device: Optional[int] = None) -> int:
        """Highest live bytes of a device; with None, the largest device peak."""
        t = self.totals()
        if device is not None:
            return t.get(device, {}).get("peak", 0)
        return max((v.get("peak", 0) for d, v in t.items() if d >= 0), default=0)

    @property
    def failures(self) -> List[Any]:
        """Allocations the driver refused, oldest first (every one in the file)."""
        from ._tracker import FailedAllocation

        idx = self._replay()["fail_idx"]
        snap = self._snapshot(idx, None)
        out = []
        for j, a in zip(idx, snap.allocations):
            result = self._addr[j]
            result = result - (1 << 64) if result >= 1 << 63 else result
            out.append(FailedAllocation(a.size, a.device, a.kind, 0, a.thread, a.label,
                                        a.timestamp_ns, a.traceback, result))
        return out

    def timeline(self) -> List[tuple]:
        """(timestamp_ns, device, live bytes) points; at most 16,384, peaks kept."""
        if self._timeline is not None:
            return list(self._timeline)
        tl_i, tl_d, tl_c = self._replay()["timeline"]
        ts, m = self._ts(), len(tl_i)
        if m <= _TIMELINE_POINTS:
            return [(ts[i], d, c) for i, d, c in zip(tl_i, tl_d, tl_c)]
        step = -(-m // (_TIMELINE_POINTS // 2))
        out = []
        for lo in range(0, m, step):
            k = max(range(lo, min(lo + step, m)), key=tl_c.__getitem__)
            out.append((ts[tl_i[k]], tl_d[k], tl_c[k]))
        return out

    def capture_info(self) -> Dict[str, Any]:
        """What the recording tracker captured with (from the file's header),
        with memviz's own counters as of when tracking stopped."""
        info = dict(self.meta.get("capture") or {})
        stats = (self.end or {}).get("stats")
        info.update(gpu_enabled=self.gpu_enabled, gpu_off_reason=self.gpu_off_reason,
                    activity_enabled=self.activity_enabled, activity_error=self.activity_error,
                    depth=self.depth, store=stats if isinstance(stats, dict) else None)
        return info

    def diagnose(self) -> List[Any]:
        """Findings about the run (memviz._diagnose), or [] where it is absent."""
        try:
            from ._diagnose import diagnose
        except ModuleNotFoundError as e:
            if e.name and e.name.startswith("memviz"):
                return []
            raise
        return diagnose(self)

    def threads(self) -> Dict[int, tuple]:
        """{thread index: (native id, ident in the recording process, name)}."""
        return dict(self._threads)

    def to_perfetto(self, path: str) -> None:
        """Chrome trace JSON for Perfetto / chrome://tracing (memviz.export)."""
        from .export.perfetto import write
        write(self, path)

    def to_torch_snapshot(self, path: str) -> None:
        """A pickle in torch.cuda.memory._dump_snapshot's format (memviz.export)."""
        from .export.torch_snapshot import write
        write(self, path)

    def _repr_html_(self) -> str:
        from .report.html import render
        return render(self)

    def __repr__(self) -> str:
        state = "truncated" if self.truncated else ("saved" if self.saved else "complete")
        from ._units import format_size
        return (f"<memviz.LoadedTrace {self.path!r} {state}, {self.event_count:,} events, "
                f"peak={format_size(self.peak_bytes())}>")


def _step_records(steps: List[Any]) -> List[Any]:
    try:
        from ._steps import StepRecord
        make = getattr(StepRecord, "from_dict")
    except (ImportError, AttributeError):
        return steps
    out = []
    for s in steps:
        try:
            out.append(make(s) if isinstance(s, dict) else s)
        except Exception:  # noqa: BLE001 - keep what cannot be rebuilt as a dict
            out.append(s)
    return out


def load(path: str, *, recover: bool = False) -> LoadedTrace:
    """Read a trace file (see :func:`memviz._trace.load`)."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise TraceError(f"cannot read the file: {e.strerror or e}", path,
                         hint="check the path and that you may read it") from e
    return LoadedTrace.from_bytes(data, path, recover=recover)
