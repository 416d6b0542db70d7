"""Reading .memviz trace files: :class:`TraceReader` (memviz.load gives a
:class:`memviz.loaded.LoadedTrace`, which adds the outputs and diagnoses).

The format is described in :mod:`memviz.trace.format`; memviz/trace/parse.py
checks every chunk's CRC and structure. Events are kept as columns
(``array``/``bytearray``, built with C-speed slicing, no per-event Python
work) and replayed once, on first use, through the C store's own rules
(``_core.replay``). A 1,000,000-event trace loads and gives its peak
snapshot in about a second on one core.

One concern, a little over 500 lines: the reading API of a recording over
the event columns (snapshots at any time and at each peak, totals,
failures, the timeline, the events themselves).
"""

from __future__ import annotations

import bisect
import functools
import itertools
import operator
import os
import sys
from array import array
from typing import Any, Dict, Iterator, List, NamedTuple, Optional, Tuple

import memviz._args as _args
import memviz._core as _core
from memviz._package import PACKAGE_DIR
from memviz.capture.callsite import Resolved
from memviz.model.failures import failed_allocations
from memviz.model.recording import TotalsReads
from memviz.model.rows import snapshot_from_raw
from memviz.model.snapshot import KIND_NAMES, Allocation, Snapshot
from memviz.trace import format as F
from memviz.trace.parse import TraceFile

__all__ = ["TraceReader", "TraceEvent"]

_U32, _U64 = ("I" if array("I").itemsize == 4 else "L"), "Q"
_BIG = sys.byteorder != "little"
_TIMELINE_POINTS = 16384


def _table(*ops: int) -> bytes:
    return bytes(1 if i in ops else 0 for i in range(256))


_IS_ALLOC, _IS_FREE, _IS_FAILED = _table(F.OP_ALLOC), _table(F.OP_FREE), _table(F.OP_FAILED)
_IS_ALLOC_OR_FAILED = _table(F.OP_ALLOC, F.OP_FAILED)
_SIGN = (0, 1, -1) + (0,) * 253


def _eq_mask(col: array, value: int) -> bytes:
    """1 where a signed byte column equals value, else 0."""
    return col.tobytes().translate(_table(value & 0xFF))


def _and(a: bytes, b: bytes) -> bytes:
    """Byte-wise AND of two 0/1 masks of the same length."""
    n = len(a)
    return (int.from_bytes(a, "little") & int.from_bytes(b, "little")).to_bytes(n, "little")


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


_KIND_BLOCK = KIND_NAMES.index("block")
#: how many allocations after a peak to look through for blocks asked for before it
#: (another thread's events may come between a segment and its block)
_BLOCK_LOOKAHEAD = 64


class TraceEvent(NamedTuple):
    """One allocation event of a trace (:meth:`LoadedTrace.events`).

    Attributes:
        op: ``"alloc"``, ``"free"`` or ``"failed"`` (a driver call that failed).
        timestamp_ns: when it happened, on the recording process's monotonic
            clock (as ``Allocation.timestamp_ns``).
        seq: the allocation it concerns, by its ``Allocation.seq``: the
            timestamp of its allocation, which is what a live tracker's
            snapshots give (so ``(device, address, seq)`` joins an event to
            the Allocation a live ``Tracker`` or a loaded trace shows). For an
            alloc or failed event it equals ``timestamp_ns``; a free has its
            allocation's. None for a free whose allocation is not in the file
            (made before the trace began or lost in a gap).
        allocation: the :class:`~memviz.Allocation` made, freed (as it was
            made: size, line, thread, label) or refused.

    ``device``, ``address``, ``size``, ``kind``, ``stream``, ``thread``,
    ``label``, ``traceback``, ``autograd_node``, ``forward`` and
    ``category`` read the allocation's.
    """

    op: str
    timestamp_ns: int
    seq: Optional[int]
    allocation: Allocation

    device = property(lambda self: self.allocation.device)
    address = property(lambda self: self.allocation.address)
    size = property(lambda self: self.allocation.size)
    kind = property(lambda self: self.allocation.kind)
    stream = property(lambda self: self.allocation.stream)
    thread = property(lambda self: self.allocation.thread)
    label = property(lambda self: self.allocation.label)
    traceback = property(lambda self: self.allocation.traceback)
    autograd_node = property(lambda self: self.allocation.autograd_node)
    forward = property(lambda self: self.allocation.forward)
    category = property(lambda self: self.allocation.category)


_EVENT_OPS = {F.OP_ALLOC: "alloc", F.OP_FREE: "free", F.OP_FAILED: "failed"}
#: events turned into Allocation objects at a time (events() is lazy)
_EVENT_BATCH = 1 << 16


class TraceReader(TraceFile, TotalsReads):
    """A trace file read back, with the reading API of a stopped Tracker
    (memviz/model/recording.py; current_bytes() and peak_bytes() are the
    TotalsReads mixin's, as a Tracker's are).

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
            memviz.analysis.steps can rebuild them).
        outside: ``{device: (bytes, source)}`` the process held outside the
            tracked allocations when tracking stopped.
    """

    #: read back from a file: nothing of the recording process can be asked now
    is_live = False


    def __init__(self, path: Optional[str]) -> None:
        super().__init__(path)
        self._replayed: Optional[Dict[str, Any]] = None
        self._ts_cache: Optional[List[int]] = None
        self._derived: Optional[Dict[int, Dict[str, int]]] = None
        self._timeline_cache: Optional[List[tuple]] = None
        self._blocks_cache: Optional[Dict[int, List[int]]] = None

    @classmethod
    def from_bytes(cls, data: bytes, path: Optional[str] = None, *,
                   recover: bool = False) -> "TraceReader":
        """Parse a whole trace held in memory (``path`` only names it in errors)."""
        self = cls(path)
        self._parse(memoryview(data).toreadonly(), recover)
        self._finish()
        return self

    def _recording_memviz(self) -> None:
        """memviz's own frames in a trace recorded elsewhere (another checkout
        or machine: the sample shipped with memviz) are library code here
        too: find the recording's memviz folder from the frames that end in
        one of this memviz's own files, and hide it as this process hides its
        own."""
        here, own = _own_files()
        roots = set()
        for filename, _line, _name in self._frames:
            if not filename or "/memviz/" not in filename or filename.startswith(here + os.sep):
                continue
            head, _, rel = filename.rpartition("/memviz/")
            if rel in own:
                roots.add(head + "/memviz")
        if roots:
            from memviz.model.frame_filter import FrameFilter, frames

            self.frame_filter = FrameFilter(library_paths=(*frames.library_paths, *sorted(roots)),
                                            user_paths=frames.user_paths)

    def _finish(self) -> None:
        """Columns of all events (the per-chunk planes are released)."""
        self._recording_memviz()
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
        """One pass over the events through the C store's own rules
        (``_core.replay``: its live table and its totals and peak
        bookkeeping, on a private table): which ALLOC each FREE ends, the
        live set at the end, and each device's peak. As in a live store, a
        FREE of an unknown address is ignored, an ALLOC at a live address
        retires it, and PyTorch's blocks (which lie inside segments) count
        in no device total."""
        if self._replayed is None:
            self._replayed = _core.replay(self._op, self._addr, self._size, self._kind, self._dev)
        return self._replayed

    def _peak_rows(self, d: int) -> List[int]:
        r = self._replay()
        p = r["peak_i"].get(d, -1)
        if p < 0:
            return []
        end, dev, alloc_idx = r["end"], self._dev, r["alloc_idx"]
        cut = bisect.bisect_right(alloc_idx, p)
        rows = [j for j in alloc_idx[:cut] if dev[j] == d and (end[j] == 0 or end[j] > p)]
        # The store dates a block when it was asked for, before the segment made
        # for it, but the file has the block after that segment. So when the peak
        # is a segment, the block its thread asked for, which lies inside it, is
        # live at the peak (as in the live tracker's peak).
        kind, addr, thread = self._kind, self._addr, self._thread
        if kind[p] != _KIND_BLOCK:
            lo, hi = addr[p], addr[p] + self._size[p]
            for j in alloc_idx[cut:cut + _BLOCK_LOOKAHEAD]:
                if kind[j] == _KIND_BLOCK and thread[j] == thread[p] and lo <= addr[j] < hi:
                    rows.append(j)
                    break
        return rows

    def _derived_totals(self) -> Dict[int, Dict[str, int]]:
        """Totals replayed from the events (for a trace without an END chunk)."""
        r, ts = self._replay(), self._ts()
        op, dev, size = self._op, self._dev, self._size
        is_alloc, is_free = op.translate(_IS_ALLOC), op.translate(_IS_FREE)
        out = {}
        for d in r["peak"]:
            on_d = _eq_mask(dev, d)
            a_mask = _and(is_alloc, on_d)
            live_end = sum(1 for j in r["live"] if dev[j] == d)
            out[d] = {"current": r["cur"][d], "peak": r["peak"][d],
                      "peak_timestamp_ns": ts[r["peak_i"][d]] if r["peak_i"][d] >= 0 else 0,
                      "allocs": a_mask.count(1), "frees": _and(is_free, on_d).count(1),
                      "failed": _and(op.translate(_IS_FAILED), on_d).count(1),
                      "alloc_bytes": sum(itertools.compress(size, a_mask)),
                      "live_count": live_end, "peak_count": len(self._peak_rows(d)),
                      "window_peak": r["peak"][d]}
        return out

    def _rows(self, idx: List[int]) -> List[tuple]:
        ts, labels = self._ts(), self._labels
        a, s, d, k, t, lab, st = (self._addr, self._size, self._dev, self._kind, self._thread,
                                  self._label, self._stack)
        return [(a[j], s[j], d[j], k[j], 0, t[j],
                 (labels.get(lab[j], f"<label {lab[j]}>") if lab[j] else None), ts[j], st[j], ts[j])
                for j in idx]

    def _resolve(self, ids: set) -> Resolved:
        frames, calls = self._frames, self._calls
        return Resolved({i: tuple(frames[f] for f in self._stacks[i]) for i in ids if i in self._stacks},
                        {i: calls[i] for i in ids if i in calls})

    def _thread_map(self) -> Dict[int, tuple]:
        # ident None: the recording process's idents mean nothing in this one,
        # so the stored name is used as is.
        return {i: _core.ThreadRow((n, None, name, None)) for i, (n, _ident, name) in self._threads.items()}

    def _snapshot(self, idx: List[int], ts: Optional[int]) -> Snapshot:
        snap = snapshot_from_raw(self._rows(idx), self._resolve, self._thread_map(),
                                 self.frame_filter, timestamp_ns=ts)
        if not any(a.kind == "block" for a in snap.allocations):
            return snap
        # Recorded on the allocator route: PyTorch's blocks lie inside its segments.
        # As a live tracker's snapshot does, count each byte once: the blocks, and
        # of each segment only what no block holds (unused_pool).
        from memviz.model.segments import reconcile  # imports no torch

        allocations, segments = reconcile(list(snap.allocations), None, self._pools(snap))
        out = Snapshot(allocations, timestamp_ns=snap.timestamp_ns, devices=snap.devices,
                       frame_filter=snap.frame_filter)
        out.segments = segments
        return out

    def _pools(self, snap: Snapshot) -> set:
        """(device, address) of the device allocations live in ``snap`` that
        held one of PyTorch's blocks at some time in the trace: segments, even
        when none of their blocks is live then (as a live tracker remembers
        the segments PyTorch showed)."""
        blocks = self._block_addresses()
        found = set()
        for a in snap.allocations:
            addrs = blocks.get(a.device) if a.kind == "device" else None
            if addrs:
                i = bisect.bisect_left(addrs, a.address)
                if i < len(addrs) and addrs[i] < a.address + a.size:
                    found.add((a.device, a.address))
        return found

    def _block_addresses(self) -> Dict[int, List[int]]:
        """{device: sorted addresses of every block the trace allocated} (once)."""
        if self._blocks_cache is None:
            per: Dict[int, set] = {}
            for j in self._replay()["alloc_idx"]:
                if self._kind[j] == _KIND_BLOCK:
                    per.setdefault(self._dev[j], set()).add(self._addr[j])
            self._blocks_cache = {d: sorted(v) for d, v in per.items()}
        return self._blocks_cache

    # -- the Tracker reading API ------------------------------------------

    def snapshot(self, at_ns: Optional[int] = None) -> Snapshot:
        """The allocations live at the end of the trace, or at ``at_ns`` (a
        timestamp on the recording process's monotonic clock, as
        ``Allocation.timestamp_ns`` and timeline() use)."""
        _args.whole(at_ns, "snapshot(at_ns=...)", none=True)
        r = self._replay()
        if at_ns is None:
            return self._snapshot(r["live"], self.stopped_ns)
        ts, end = self._ts(), r["end"]
        idx = [j for j in r["alloc_idx"] if ts[j] <= at_ns and (end[j] == 0 or ts[end[j]] > at_ns)]
        return self._snapshot(idx, at_ns)

    def peak_snapshot(self, device: Optional[int] = None) -> Snapshot:
        """The allocations live at a device's peak; every device at its own
        peak when ``device`` is None."""
        _args.whole(device, "peak_snapshot(device=...)", none=True)
        peaks = self._replay()["peak_i"]
        devices = [device] if device is not None else sorted(peaks)
        idx: List[int] = []
        for d in devices:
            idx += self._peak_rows(d)
        ts = self._ts()
        when = max((ts[peaks[d]] for d in devices if peaks.get(d, -1) >= 0), default=None)
        return self._snapshot(sorted(idx), when)

    def totals(self) -> Dict[int, Dict[str, int]]:
        """Per device (-1: pinned host): current, peak, allocs, frees, failed, ...
        (as recorded when tracking stopped; replayed from the events when the
        trace was cut short)."""
        if self.end is not None and self.end.get("totals"):
            return {d: dict(v) for d, v in self.end["totals"].items()}
        if self._derived is None:
            self._derived = self._derived_totals()
        return {d: dict(v) for d, v in self._derived.items()}

    @property
    def failures(self) -> List[Any]:
        """Allocations the driver refused, oldest first (every one in the file)."""
        # The C core's failure records (a FAILED event's address holds the result).
        rows = [_core.FailureRow((size, dev, kind, 0, thread, label, ts, sid,
                                  addr - (1 << 64) if addr >= 1 << 63 else addr))
                for addr, size, dev, kind, _stream, thread, label, ts, sid, _seq
                in self._rows(self._replay()["fail_idx"])]
        return failed_allocations(rows, self._resolve, self._thread_map(), self.frame_filter)

    def events(self) -> Iterator[TraceEvent]:
        """Every alloc, free and failed allocation in the file, in the order
        recorded, as :class:`TraceEvent` (lazily, a batch at a time).

        ``seq`` means what it means in a live Tracker's snapshots: the
        allocation's ``Allocation.seq``, the timestamp of its allocation (the
        C store numbers allocations by that timestamp; an index into this
        file would not survive a ring that drops old events). A free carries
        the allocation it ended, found as the store finds it (by address and
        kind). A trace written by ``Tracker.save()`` keeps no history: its
        events are each device's peak set, frees (at a made-up time) of what
        was not live any more, then the rest of the live set.
        Blocks of PyTorch's allocator (kind ``"block"``) are events of their
        own, as recorded: they lie inside segments (kind ``"device"``)."""
        r = self._replay()
        end, op, n = r["end"], self._op, self.event_count
        freed = {end[j]: j for j in r["alloc_idx"] if end[j] and op[end[j]] == F.OP_FREE}
        idx = list(itertools.compress(range(n), op.translate(
            _table(F.OP_ALLOC, F.OP_FREE, F.OP_FAILED))))
        ts = self._ts()
        for lo in range(0, len(idx), _EVENT_BATCH):
            chunk = idx[lo:lo + _EVENT_BATCH]
            made = [freed.get(i, i) for i in chunk]  # a free: the allocation it ended
            snap = snapshot_from_raw(self._rows(made), self._resolve, self._thread_map(),
                                     self.frame_filter)
            for i, j, a in zip(chunk, made, snap.allocations):
                o = op[i]
                yield TraceEvent(_EVENT_OPS[o], ts[i], None if o == F.OP_FREE and i == j
                                 else a.seq, a)

    def timeline(self) -> List[tuple]:
        """(timestamp_ns, device, live bytes) points; at most 16,384, peaks kept."""
        if self._timeline is not None:
            return list(self._timeline)
        if self._timeline_cache is None:
            self._timeline_cache = self._derived_timeline()
        return list(self._timeline_cache)

    def _derived_timeline(self) -> List[tuple]:
        """Live bytes per device after each ALLOC/FREE, from the events' sizes
        (a FREE record carries the freed allocation's size), downsampled by
        keeping the highest point of each bucket."""
        op, dev, n = self._op, self._dev, self.event_count
        ts = self._ts()
        signed = list(map(operator.mul, self._size, map(_SIGN.__getitem__, op)))
        is_af = op.translate(_table(F.OP_ALLOC, F.OP_FREE))
        per_dev = []
        for d in sorted(set(itertools.compress(dev, is_af))):
            mask = _and(is_af, _eq_mask(dev, d))
            per_dev.append((d, list(itertools.compress(range(n), mask)),
                            list(itertools.accumulate(itertools.compress(signed, mask)))))
        total = sum(len(idx) for _, idx, _ in per_dev)
        points: List[tuple] = []
        for d, idx, curs in per_dev:
            m = len(curs)
            budget = max(16, _TIMELINE_POINTS * m // max(total, 1))
            picks: Any = range(m)
            if m > budget:
                step = -(-m // (budget // 2))
                picks = [max(range(lo, min(lo + step, m)), key=curs.__getitem__)
                         for lo in range(0, m, step)]
            points += [(idx[k], d, curs[k]) for k in picks]
        points.sort()
        return [(ts[i], d, c) for i, d, c in points]

    def capture_info(self) -> Dict[str, Any]:
        """What the recording tracker captured with (from the file's header),
        with memviz's own counters as of when tracking stopped."""
        info = dict(self.meta.get("capture") or {})
        stats = (self.end or {}).get("stats")
        info.update(gpu_enabled=self.gpu_enabled, gpu_off_reason=self.gpu_off_reason,
                    activity_enabled=self.activity_enabled, activity_error=self.activity_error,
                    depth=self.depth, store=stats if isinstance(stats, dict) else None)
        return info

    def threads(self) -> Dict[int, tuple]:
        """{thread index: (native id, ident in the recording process, name)}."""
        return dict(self._threads)

    def __repr__(self) -> str:
        state = "truncated" if self.truncated else ("saved" if self.saved else "complete")
        from memviz._units import format_size
        return (f"<memviz.LoadedTrace {self.path!r} {state}, {self.event_count:,} events, "
                f"peak={format_size(self.peak_bytes())}>")


def _step_records(steps: List[Any]) -> List[Any]:
    """StepRecords of the memviz step records (checked field by field when
    the STEPS chunk was read); other entries (records the program appended
    itself) stay dicts."""
    try:
        from memviz.model.steps import StepRecord
    except ImportError:
        return steps
    return [StepRecord.from_dict(s) if "index" in s and "timestamp_ns" in s else s for s in steps]


#: memviz's files before the package took its floors (docs/architecture.md):
#: traces recorded then (the shipped sample among them) carry these names
_EARLIER_FILES = frozenset((
    "_callsite.py", "_capture.py", "_cli_diff.py", "_cli_report.py", "_cli_run.py", "_device.py",
    "_diagnose.py", "_diagnose_rules.py", "_filters.py", "_frames.py", "_ipython.py", "_report.py",
    "_snapshot.py", "_steps.py", "_trace.py", "_trace_fields.py", "_trace_load.py",
    "_trace_parse.py", "_trace_save.py", "_tracker.py", "pytest_plugin.py", "torch/segments.py"))


@functools.lru_cache(maxsize=1)
def _own_files() -> Tuple[str, frozenset]:
    """This memviz's folder, and its Python files relative to it
    ("torch/allocator.py"), with the names they had in earlier layouts."""
    here = PACKAGE_DIR
    return here, _EARLIER_FILES | frozenset(
        os.path.relpath(os.path.join(d, f), here).replace(os.sep, "/")
        for d, _dirs, files in os.walk(here) for f in files if f.endswith(".py"))
