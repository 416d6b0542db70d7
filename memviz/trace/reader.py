"""Reading .memviz trace files: :class:`TraceReader` (memviz.load gives a
:class:`memviz.loaded.LoadedTrace`, which adds the outputs and diagnoses).

The format is described in :mod:`memviz.trace.format`; memviz/trace/parse.py
checks every chunk's CRC and structure. Each EVENTS chunk, once inflated,
streams through the C store's own rules (``_core.Replayer``, src/replay.c)
and is let go: the reader keeps no per-event columns, only what the replay
keeps (the live allocations, each device's totals and peak, the
allocations live at each peak, the failures, a bounded timeline). What
needs the whole history (``events()``, ``snapshot(at_ns=...)``) reads the
file again, chunk by chunk. A 20,000,000-event trace loads in about a
second, in under 100 MB (benchmarks/RESULTS.md, "A bounded reader").

One concern, a little over 500 lines: the reading API of a recording over
the replay (snapshots at any time and at each peak, totals, failures, the
timeline, the events themselves, and the passes that read the file again).
"""

from __future__ import annotations

import bisect
import functools
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, Iterator, List, NamedTuple, Optional, Tuple

import memviz._args as _args
import memviz._core as _core
import memviz._progress as _progress
from memviz._package import PACKAGE_DIR
from memviz.capture.callsite import Resolved
from memviz.model.failures import failed_allocations
from memviz.model.recording import TotalsReads, check_peak, size_note
from memviz.model.rows import snapshot_from_raw
from memviz.model.snapshot import Allocation, Snapshot
from memviz.trace import format as F
from memviz.trace.parse import TraceFile, _Bytes, _File

__all__ = ["TraceReader", "TraceEvent"]

_TIMELINE_POINTS = _core.TIMELINE_POINTS

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
_MISSING = object()


def _LEVEL(point: tuple) -> int:
    return point[2]


#: chunks of fewer events are replayed at once, in the caller's thread
_BACKGROUND_EVENTS = 1 << 14


class _Background:
    """One worker thread that replays the chunks in order, one at a time,
    while the reader reads and inflates the next: the replay and zlib let
    the GIL go, so on two cores the two overlap."""

    def __init__(self) -> None:
        self._pool: Optional[ThreadPoolExecutor] = None
        self._job: Any = None

    def run(self, fn: Any, *args: Any) -> None:
        self.wait()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="memviz-reader")
        self._job = self._pool.submit(fn, *args)

    def wait(self) -> None:
        job, self._job = self._job, None
        if job is not None:
            job.result()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None


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
        self._rp: Any = None  # the replay of every event (_core.Replayer), from the first chunk
        self._derived: Optional[Dict[int, Dict[str, int]]] = None
        self._timeline_cache: Optional[List[tuple]] = None
        self._blocks_cache: Optional[Dict[int, List[int]]] = None
        self._devices_cache: Optional[Dict[int, Dict[str, int]]] = None
        self._bg = _Background()

    @classmethod
    def from_bytes(cls, data: bytes, path: Optional[str] = None, *,
                   recover: bool = False) -> "TraceReader":
        """Parse a whole trace held in memory (``path`` only names it in errors)."""
        self = cls(path)
        try:
            self._parse(_Bytes(data), recover)
        finally:
            self._bg.close()
        self._finish()
        return self

    @classmethod
    def from_fd(cls, fd: int, path: Optional[str] = None, *,
                recover: bool = False) -> "TraceReader":
        """Read the trace file open as ``fd`` (a regular file) where it lies,
        a chunk at a time; the reader owns ``fd`` from then on (it keeps it
        to read the events again, and closes it when it goes)."""
        try:
            source = _File(fd, path)
        except BaseException:
            os.close(fd)
            raise
        self = cls(path)
        try:
            self._parse(source, recover)
        finally:
            self._bg.close()
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
        # and the recording's own frame settings (memviz.frames.add_library_path ...), so the
        # user lines are those the recording tracker picked: END's (at stop), else META's
        rec = (self.end or {}).get("frames") or (self.meta.get("tracker") or {}).get("frames") or {}
        lib = [p for p in rec.get("library_paths", ()) if isinstance(p, str)] if isinstance(rec, dict) else []
        usr = [p for p in rec.get("user_paths", ()) if isinstance(p, str)] if isinstance(rec, dict) else []
        if roots or lib or usr:
            from memviz.model.frame_filter import FrameFilter, frames

            self.frame_filter = FrameFilter(library_paths=(*frames.library_paths, *lib, *sorted(roots)),
                                            user_paths=(*frames.user_paths, *usr))

    def _start_ns(self) -> int:
        v = self.meta.get("start_monotonic_ns")
        return v if type(v) is int else 0

    def _events(self, payload: Any, offset: int, count: int, layout: int) -> None:
        if self._rp is None:
            self._rp = _core.Replayer(self._start_ns(), True, self.event_width)
        if count >= _BACKGROUND_EVENTS:
            self._bg.run(self._rp.feed, payload, offset, count, layout)
        else:
            self._bg.wait()
            self._rp.feed(payload, offset, count, layout)

    def _finish(self) -> None:
        """The figures of the whole run, from the replay."""
        self._recording_memviz()
        if self._rp is None:
            self._rp = _core.Replayer(self._start_ns(), True, self.event_width)
        rp = self._rp
        self.event_count = rp.events
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
            self.stopped_ns = max(rp.ts, self.started_ns) if rp.events else self.started_ns
        self.steps = _step_records(self.steps)
        self.dropped_events = rp.dropped
        self._reconcile()

    def _reconcile(self) -> None:
        """A trace that lost events (GAP) and ends with its live set (LIVE):
        what the replay holds live beyond that set lost its free in a gap,
        and is freed at the end; what it lacks was made in a gap, and is
        added as it was made. So a lost free never shows as a leak; the
        peak and the history between the first gap and the end are what
        the events say (reports say so). Sets ``gap_freed`` and ``gap_added``."""
        self.gap_freed = self.gap_added = 0
        self._reconciled: Optional[Tuple[bytes, int, int]] = None
        if self._live_end is None or not self._rp.dropped or self.event_width != F.EVENT.size:
            return
        payload, count, layout = self._live_end
        end = _core.Replayer(self._start_ns(), False, self.event_width)
        end.feed(payload, F.EVENTS_HEAD.size, count, layout)
        truth = {(r[0], r[2], r[3], r[7]): r for r in end.live()}
        live = self._rp.live()
        have = {(r[0], r[2], r[3], r[7]) for r in live}
        ghosts = [r for r in live if (r[0], r[2], r[3], r[7]) not in truth]
        added = sorted((r for k, r in truth.items() if k not in have), key=lambda r: r[7])
        if not ghosts and not added:
            return
        syn = F.FLAG_SYNTHETIC
        stopped = self.stopped_ns if type(self.stopped_ns) is int else self._rp.ts
        at = max(stopped, self._rp.ts)
        # (address, size, device, kind, stream, thread, label, ts, stack, seq, requested, flags)
        # as encode_events' rows: (op, ts, kind, device, flags, stack, thread, label, address,
        # size, slack, stream)
        events = [(F.OP_ALLOC, r[7], r[3], r[2], r[11] | syn, r[8], r[5], r[6], r[0], r[1],
                   max(0, r[1] - r[10]), r[4]) for r in added]
        events += [(F.OP_FREE, at, r[3], r[2], syn, r[8], r[5], r[6], r[0], r[1], 0, r[4]) for r in ghosts]
        out = _core.encode_events(events, events[0][1], syn)
        rows = F.events_payload(out, F.LAYOUT_ROWS)
        n = len(out) // F.EVENT.size
        self._reconciled = (rows, n, F.LAYOUT_ROWS)
        self._rp.feed(rows, F.EVENTS_HEAD.size, n, F.LAYOUT_ROWS)
        self.gap_freed, self.gap_added = len(ghosts), len(added)

    # -- replay ------------------------------------------------------------

    def _devices(self) -> Dict[int, Dict[str, int]]:
        """{device: the replay's figures} of every device an ALLOC or FAILED
        event names (see _core.Replayer.devices)."""
        if self._devices_cache is None:
            self._devices_cache = self._rp.devices()
        return self._devices_cache

    def _again(self, what: str) -> Iterator[Tuple[Any, Any, int, int]]:
        """A second pass over the file: (replayer, payload, count, layout) of
        each EVENTS chunk in turn, through a fresh replayer without the
        summary (only the live table: what events() and snapshot(at_ns)
        need), the chunk's checksum checked again."""
        rp = _core.Replayer(self._start_ns(), False, self.event_width)
        chunks = list(self._event_chunks)
        total = sum(c[1] for c in chunks)
        done = 0
        label = f"{what} {os.path.basename(self.path or 'the trace')}"
        # The next chunk is read and inflated in a worker thread while this one
        # is replayed (zlib and the replay let the GIL go).
        pool = ThreadPoolExecutor(1, thread_name_prefix="memviz-reader") if len(chunks) > 1 \
            else None
        try:
            nxt = None
            for k, (offset, length, _count) in enumerate(chunks):
                _progress.update(done, total, label)
                got = nxt.result() if nxt is not None else self._reread_events(offset, length)
                if pool is not None and k + 1 < len(chunks):
                    nxt = pool.submit(self._reread_events, *chunks[k + 1][:2])
                yield (rp, *got)
                done += length
            if getattr(self, "_reconciled", None) is not None:  # the gaps' frees and allocations
                yield (rp, *self._reconciled)
        finally:
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)
        _progress.update(total, total, label)

    def _named(self, rows: List[tuple]) -> List[tuple]:
        """The replay's rows with their label ids named (model/rows.py's
        ROW_FIELDS order)."""
        labels = self._labels
        names: Dict[int, Optional[str]] = {0: None}
        out = []
        for r in rows:
            lab = r[6]
            name = names.get(lab, _MISSING)
            if name is _MISSING:
                name = names[lab] = labels.get(lab, f"<label {lab}>")
            out.append(r[:6] + (name,) + r[7:])
        return out

    def _derived_totals(self) -> Dict[int, Dict[str, int]]:
        """Totals replayed from the events (for a trace without an END chunk)."""
        out = {}
        for d, v in self._devices().items():
            out[d] = {"current": v["current"], "peak": v["peak"],
                      "peak_timestamp_ns": v["peak_ts"] if v["peak_index"] >= 0 else 0,
                      "allocs": v["allocs"], "frees": v["frees"], "failed": v["failed"],
                      "alloc_bytes": v["alloc_bytes"], "live_count": v["live"],
                      "peak_count": len(self._rp.peak(d)), "window_peak": v["peak"]}
        return out

    def _resolve(self, ids: set) -> Resolved:
        frames, calls = self._frames, self._calls
        return Resolved({i: tuple(frames[f] for f in self._stacks[i]) for i in ids if i in self._stacks},
                        {i: calls[i] for i in ids if i in calls})

    def _thread_map(self) -> Dict[int, tuple]:
        # ident None: the recording process's idents mean nothing in this one,
        # so the stored name is used as is.
        return {i: _core.ThreadRow((n, None, name, None)) for i, (n, _ident, name) in self._threads.items()}

    def _snapshot(self, rows: List[tuple], ts: Optional[int], moment: Optional[str] = None) -> Snapshot:
        snap = snapshot_from_raw(self._named(rows), self._resolve, self._thread_map(),
                                 self.frame_filter, timestamp_ns=ts)
        cats = self._recorded_categories(moment) if moment else None
        if cats:  # the categories the recording tracker gave them then
            snap = Snapshot([a._replace(category=cats[(a.device, a.address, a.kind)])
                             if a.category is None and (a.device, a.address, a.kind) in cats else a
                             for a in snap.allocations],
                            timestamp_ns=snap.timestamp_ns, devices=snap.devices,
                            frame_filter=snap.frame_filter)
        if not any(self._block_addresses().values()):
            return snap
        note = size_note(self._rp.stream_frees)
        # Recorded on the allocator route: PyTorch's blocks lie inside its segments
        # (those that held a block at some time, even with none live now).
        # As a live tracker's snapshot does, count each byte once: the blocks, and
        # of each segment only what no block holds (unused_pool).
        from memviz.model.segments import reconcile  # imports no torch

        allocations, segments = reconcile(list(snap.allocations), None, self._pools(snap))
        out = Snapshot(allocations, timestamp_ns=snap.timestamp_ns, devices=snap.devices,
                       frame_filter=snap.frame_filter)
        out.segments = segments
        out.size_note = note
        return out

    def _recorded_categories(self, moment: str) -> Dict[Tuple[int, int, str], str]:
        """{(device, address, kind): category} of the allocations live at the
        peaks (``moment`` "peak") or at the end ("end"), as the recording
        tracker's snapshots gave them (END's "pytorch_peak", flat:
        memviz.model.pytorch._allocation_categories); {} where it kept none."""
        from memviz.model.pytorch import END_KEY
        from memviz.model.snapshot import KIND_NAMES

        out: Dict[Tuple[int, int, str], str] = {}
        figures = (self.end or {}).get(END_KEY)
        if not isinstance(figures, dict):
            return out
        for dev, entry in figures.items():
            flat = entry.get(f"allocation_categories_{moment}") if isinstance(entry, dict) else None
            if not isinstance(flat, list) or not (isinstance(dev, str) and dev.lstrip("-").isdigit()):
                continue
            cat, i = None, 0
            while i < len(flat):
                x = flat[i]
                if isinstance(x, str):
                    cat, i = x, i + 1
                    continue
                kind = flat[i + 1] if i + 1 < len(flat) else None
                if cat is None or type(x) is not int or type(kind) is not int or \
                        not 0 <= kind < len(KIND_NAMES):
                    return {}  # not what memviz writes: none rather than wrong ones
                out[(int(dev), x, KIND_NAMES[kind])] = cat
                i += 2
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
            self._blocks_cache = self._rp.blocks()
        return self._blocks_cache

    # -- the Tracker reading API ------------------------------------------

    def snapshot(self, at_ns: Optional[int] = None) -> Snapshot:
        """The allocations live at the end of the trace, or at ``at_ns`` (a
        timestamp on the recording process's monotonic clock, as
        ``Allocation.timestamp_ns`` and timeline() use)."""
        _args.whole(at_ns, "snapshot(at_ns=...)", none=True)
        if at_ns is None:
            return self._snapshot(self._rp.live(), self.stopped_ns, "end")
        if at_ns < 0:  # before anything: nothing was live
            return self._snapshot([], at_ns)
        at = min(at_ns, (1 << 64) - 1)
        rp = None
        for rp, payload, count, layout in self._again("reading again"):
            rp.feed_at(payload, F.EVENTS_HEAD.size, count, layout, at)
        return self._snapshot(rp.at() if rp is not None else [], at_ns)

    def peak_snapshot(self, device: Optional[int] = None, *, peak: str = "device") -> Snapshot:
        """The allocations live at a device's peak; every device at its own
        peak when ``device`` is None. ``peak="tensor"``: at the peak of
        PyTorch's blocks instead (``max_memory_allocated()``); ``snap.peak``
        says which (as the live tracker's)."""
        _args.whole(device, "peak_snapshot(device=...)", none=True)
        which = check_peak(peak)
        devices = self._devices()
        pre = "" if which == "device" else "tensor_"
        chosen = [device] if device is not None else sorted(devices)
        when = max((devices[d][pre + "peak_ts"] for d in chosen
                    if d in devices and devices[d][pre + "peak_index"] >= 0), default=None)
        rows = [] if device is not None and device not in devices else \
            self._rp.peak(device, which == "tensor")
        snap = self._snapshot(rows, when, "peak" if which == "device" else "tensor_peak")
        snap.peak = which
        return snap

    def tensor_totals(self) -> Dict[int, Dict[str, int]]:
        """Per device, PyTorch's blocks alone: current, peak (the tensor
        peak) and peak_timestamp_ns, replayed from the events."""
        return {d: {"current": v["tensor_current"], "peak": v["tensor_peak"],
                    "peak_timestamp_ns": v["tensor_peak_ts"]}
                for d, v in self._devices().items() if v["tensor_peak"]}

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
                for addr, size, dev, kind, _stream, thread, label, ts, sid, _seq, _req, _flags
                in self._named(self._rp.failures())]
        return failed_allocations(rows, self._resolve, self._thread_map(), self.frame_filter)

    def events(self) -> Iterator[TraceEvent]:
        """Every alloc, free and failed allocation in the file, in the order
        recorded, as :class:`TraceEvent` (lazily, a batch at a time, reading
        the file again chunk by chunk).

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
        for rp, payload, count, layout in self._again("reading again"):
            for lo in range(0, count, _EVENT_BATCH):
                batch = rp.feed_events(payload, F.EVENTS_HEAD.size, count, layout, lo,
                                       lo + _EVENT_BATCH)
                if not batch:
                    continue
                rows = self._named([(b[3], b[4], b[5], b[6], b[13], b[7], b[8], b[9], b[10], b[9], b[11], b[12])
                                    for b in batch])
                snap = snapshot_from_raw(rows, self._resolve, self._thread_map(),
                                         self.frame_filter)
                for b, a in zip(batch, snap.allocations):
                    yield TraceEvent(_EVENT_OPS[b[0]], b[1], b[2], a)

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
        keeping the highest point of each bucket. The replay keeps each
        device's changes while they fit 16,384 points, then the highest of
        each bucket of consecutive changes; here the devices share the
        16,384 points by their numbers of changes."""
        series = self._rp.timeline()
        counts = {d: changes for d, (changes, _pts) in series.items()}
        total = sum(counts.values())
        points: List[tuple] = []
        for d in sorted(series):
            pts, m = series[d][1], counts[d]
            budget = max(16, _TIMELINE_POINTS * m // max(total, 1))
            if m > budget:
                step = -(-len(pts) // (budget // 2))
                pts = [max(pts[lo:lo + step], key=_LEVEL) for lo in range(0, len(pts), step)]
            points += [(i, d, level, ts) for i, ts, level in pts]
        points.sort()
        return [(ts, d, level) for _i, d, level, ts in points]

    def _category_series(self, known: Dict[Tuple[int, int, int, str], Any], end_ns: int,
                         points: Optional[int] = None
                         ) -> Optional[Dict[int, Dict[str, Tuple[List[int], List[int]]]]]:
        """memviz/report/_categories.py's series from this trace's events,
        summed in C (memviz/trace/categories.py) in a second pass over the
        file (no Python object per event): ``{device: {category: (timestamps, live bytes)}}``, PyTorch's
        tensors (its blocks' bytes) under ``_categories.TENSORS``, the last
        point at ``end_ns``. ``known``: {(device, address, made at, kind):
        category} of the allocations the snapshots gave one. ``points``: at
        most that many points per series (each the highest of its bucket),
        None for all. None when the categories do not fit the C pass."""
        from memviz.trace.categories import summed
        return summed(((rp, payload, F.EVENTS_HEAD.size, count, layout)
                       for rp, payload, count, layout in self._again("reading again")), known, end_ns, points)

    def capture_info(self) -> Dict[str, Any]:
        """What the recording tracker captured with (from the file's header),
        with memviz's own counters as of when tracking stopped."""
        info = dict(self.meta.get("capture") or {})
        stats = (self.end or {}).get("stats")
        info.update(gpu_enabled=self.gpu_enabled, gpu_off_reason=self.gpu_off_reason,
                    activity_enabled=self.activity_enabled, activity_error=self.activity_error,
                    depth=self.depth, store=stats if isinstance(stats, dict) else None)
        sources = (self.end or {}).get("sources")
        if isinstance(sources, dict):  # how each source was captured (memviz.capture.availability.capture_sources)
            info["sources"] = sources
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
