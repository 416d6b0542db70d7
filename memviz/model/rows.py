"""Snapshots from the C core's rows: labels decoded, stacks resolved and
interned into tracebacks, threads named, once per set of rows
(:func:`resolve_rows`), then an :class:`~memviz.model.snapshot.Allocation`
per row (:func:`snapshot_from_raw`).

The model floor (docs/architecture.md): imports nothing above it."""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, Mapping, Optional, Sequence, Tuple

import memviz._core as _core
from memviz.model import compiled as _compiled
from memviz.model.frame_filter import FrameFilter
from memviz.model.snapshot import KIND_NAMES, Allocation, Snapshot, ThreadInfo, decode_label, gc_paused
from memviz.model.threads import _python_thread_names, _ThreadMap
from memviz.model.traceback import EMPTY_TRACEBACK, Frame, Traceback


class _KindMap(dict):
    def __missing__(self, code):
        name = self[code] = f"unknown({code})"
        return name


_UNRESOLVED = Traceback((Frame("<unresolved stack>", 0, ""),))


_FLAG_BEFORE, _FLAG_ESTIMATED, _FLAG_MEMVIZ = _core.FLAG_BEFORE, _core.FLAG_ESTIMATED, _core.FLAG_MEMVIZ
#: the thread of what existed before tracking started (read from PyTorch then)
_BEFORE_THREAD = ThreadInfo(None, None, "before tracking")
#: the line of what memviz allocated itself (the allocator route's probe): never the
#: user's; its category is what the memory is (the probe's segment is PyTorch's pool)
_MEMVIZ_TB = Traceback((Frame("<memviz>", 0, "memviz's own memory (the allocator route's probe)"),))

#: the allocation record's fields in the order snapshot_from_raw unpacks them
#: (src/rows.c defines the record; tests/unit/test_snapshot.py checks the two agree)
ROW_FIELDS = ("address", "size", "device", "kind", "stream", "thread", "label", "timestamp_ns",
              "stack_id", "seq", "requested", "flags")


def resolve_rows(labels: Iterable[Optional[str]], stack_ids: Iterable[int],
                 resolve_stacks: Callable[[set], Mapping[int, Sequence[Tuple[str, Optional[int], str]]]],
                 threads: Mapping[int, Sequence], frame_filter: Optional[FrameFilter] = None):
    """What the C core's rows name, resolved once for a set of rows (live
    allocations, failures): ``(labels, tracebacks, calls, threads)``, where
    ``labels[label] = (user label, autograd node, forward line)``,
    ``tracebacks[stack_id]`` is an interned :class:`Traceback` (0: none),
    ``calls[stack_id]`` what the innermost frame was calling, and
    ``threads[thread_idx]`` a :class:`ThreadInfo`. Arguments as for
    :func:`snapshot_from_raw`."""
    decoded: Dict[Optional[str], Tuple[Optional[str], Optional[str], Optional[str]]] = {}
    forward_stacks = set()
    for lab in labels:
        if lab not in decoded:
            d = decoded[lab] = decode_label(lab)
            if d[2] and d[2][0] == "#":  # labelled in the callback: the forward line's stack id
                forward_stacks.add(int(d[2][1:]))
    stack_ids = set(stack_ids) | forward_stacks
    stack_ids.discard(0)
    resolved = resolve_stacks(set(stack_ids)) if stack_ids else {}
    calls = getattr(resolved, "calls", None) or {}

    frame_cache: Dict[tuple, Frame] = {}
    tb_by_id: Dict[int, Traceback] = {0: EMPTY_TRACEBACK}
    compiled = _compiled.active()
    for sid in stack_ids:
        raw_frames = resolved.get(sid)
        if raw_frames is None:
            tb_by_id[sid] = _UNRESOLVED
            continue
        if compiled:  # torch.compile's generated code: the model's own lines (memviz.model.compiled)
            done = _compiled.expand(raw_frames)
            if done is not None:
                frames, op = done
                frames.reverse()
                tb_by_id[sid] = Traceback(frames, frame_filter)
                if op:
                    if not isinstance(calls, dict) or calls is getattr(resolved, "calls", None):
                        calls = dict(calls)
                    calls[sid] = op
                continue
        out = []
        for rf in raw_frames:
            if type(rf) is not tuple:
                rf = tuple(rf)
            frame = frame_cache.get(rf)
            if frame is None:
                filename, lineno, name = rf
                if lineno is None or lineno < 0:
                    lineno = 0
                frame = frame_cache[rf] = Frame(filename or "<unknown>", lineno, name or "")
            out.append(frame)
        out.reverse()  # the C core walks from the innermost frame; a Traceback runs oldest first
        tb_by_id[sid] = Traceback(out, frame_filter)

    thread_map = _ThreadMap(threads, _python_thread_names())
    for label, (user, node, forward) in list(decoded.items()):
        if forward and forward[0] == "#":
            tb = tb_by_id.get(int(forward[1:]))
            uf = tb.user_frame if tb is not None and tb is not _UNRESOLVED else None
            decoded[label] = (user, node, f"{uf.filename}:{uf.lineno}" if uf else None)
    return decoded, tb_by_id, calls, thread_map


def snapshot_from_raw(
    raw_allocs: Iterable[Sequence],
    resolve_stacks: Callable[[set], Mapping[int, Sequence[Tuple[str, Optional[int], str]]]],
    threads: Mapping[int, Sequence],
    frame_filter: Optional[FrameFilter] = None,
    timestamp_ns: Optional[int] = None,
    *,
    devices: "Mapping[int, Any] | Iterable[int] | None" = None,
) -> Snapshot:
    """Build a :class:`Snapshot` from the C core's raw data.

    Args:
        raw_allocs: the C core's allocation records (``_core.AllocationRow``:
            address, size, device, kind, stream, thread, label, timestamp_ns,
            stack_id, seq, requested, flags; kind 0=device, 1=host, 2=managed, 3=static,
            4=physical, 5=block), or plain tuples in that field order (the
            trace reader builds those: a tuple costs half a record). This is
            the one place that unpacks a row by position; tests/unit/test_snapshot.py
            holds the order against the record type.
        resolve_stacks: called once with the set of non-zero stack ids; returns
            ``{stack_id: ((filename, lineno, name), ...)}`` innermost first, as
            the C core's ``resolve`` returns them (each :class:`Traceback`
            built from them runs oldest first).
            Stack id 0 means "no Python frames". A missing id becomes the
            pseudo-frame ``<unresolved stack>``. lineno None/-1 becomes 0.
            A ``calls`` attribute on the result (``{stack_id: name}``,
            :class:`memviz.capture.callsite.Resolved`) gives ``Allocation.op``.
        threads: ``{thread_idx: (native_tid, pthread_ident, native_name[, serial])}``.
            Names of live Python threads (``threading``) are preferred.
        frame_filter: stored on the snapshot and its tracebacks.
        timestamp_ns: when the snapshot was taken.
        devices: device metadata passed on to :class:`Snapshot`.

    Frames and tracebacks are interned: rows with the same stack id share one
    :class:`Traceback` object.
    """
    with gc_paused():
        return _snapshot_from_raw(raw_allocs, resolve_stacks, threads, frame_filter, timestamp_ns, devices)


def _snapshot_from_raw(raw_allocs, resolve_stacks, threads, frame_filter, timestamp_ns, devices) -> Snapshot:
    rows = raw_allocs if isinstance(raw_allocs, (list, tuple)) else list(raw_allocs)
    labels, stack_ids = set(), set()
    for row in rows:
        labels.add(row[6])
        stack_ids.add(row[8])
    decoded, tb_by_id, calls, thread_map = resolve_rows(labels, stack_ids, resolve_stacks, threads,
                                                        frame_filter)
    kind_map = _KindMap(enumerate(KIND_NAMES))
    new = tuple.__new__
    A = Allocation
    allocations = [
        new(A, (addr, size, dev, kind_map[kc], stream,
                _BEFORE_THREAD if flags & _FLAG_BEFORE else thread_map[tidx], decoded[label][0], ts,
                _MEMVIZ_TB if flags & _FLAG_MEMVIZ else tb_by_id[sid], seq, decoded[label][1],
                decoded[label][2],
                None, calls.get(sid), None,
                bool(flags & _FLAG_BEFORE), requested, bool(flags & _FLAG_ESTIMATED)))
        for addr, size, dev, kc, stream, tidx, label, ts, sid, seq, requested, flags in rows
    ]
    return Snapshot(allocations, timestamp_ns=timestamp_ns, devices=devices, frame_filter=frame_filter)


def grouped_rows(rows: Iterable[Sequence]) -> list:
    """Rows in :data:`ROW_FIELDS` order grouped as ``_core.live_groups()``
    groups the store's (device, kind, thread, label, stack, flags):
    ``[(row, count)]``, sizes summed. For views whose rows are already in
    Python (a nested tracker's window, a frozen copy)."""
    groups: Dict[tuple, list] = {}
    for r in rows:
        key = (r[8], r[6], r[2], r[3], r[5], r[11])
        g = groups.get(key)
        if g is None:
            groups[key] = [r[1], r[10], 1, r]
        else:
            g[0] += r[1]
            g[1] += r[10]
            g[2] += 1
    return [((0, size, r[2], r[3], 0, r[5], r[6], 0, r[8], 0, requested, r[11]), n)
            for size, requested, n, r in groups.values()]


def snapshot_from_groups(groups: Sequence[Tuple[Sequence, int]], resolve_stacks, threads,
                         frame_filter: Optional[FrameFilter] = None) -> Snapshot:
    """A snapshot of groups of allocations (``[(row, count)]``, from
    ``_core.live_groups()`` or :func:`grouped_rows`): one
    :class:`Allocation` a group, its size the group's sum; its statistics
    count the allocations each group stands for. Not a snapshot of
    allocations: only its statistics are meant to be read."""
    snap = snapshot_from_raw([g[0] for g in groups], resolve_stacks, threads, frame_filter)
    return snap.as_groups([g[1] for g in groups])
