"""Snapshots from the C core's rows: labels decoded, stacks resolved and
interned into tracebacks, threads named, once per set of rows
(:func:`resolve_rows`), then an :class:`~memviz.model.snapshot.Allocation`
per row (:func:`snapshot_from_raw`).

The model floor (docs/architecture.md): imports nothing above it."""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, Mapping, Optional, Sequence, Tuple

from memviz.model.frame_filter import FrameFilter
from memviz.model.snapshot import KIND_NAMES, Allocation, Snapshot, decode_label
from memviz.model.threads import _python_thread_names, _ThreadMap
from memviz.model.traceback import EMPTY_TRACEBACK, Frame, Traceback


class _KindMap(dict):
    def __missing__(self, code):
        name = self[code] = f"unknown({code})"
        return name


_UNRESOLVED = Traceback((Frame("<unresolved stack>", 0, ""),))


#: the allocation record's fields in the order snapshot_from_raw unpacks them
#: (src/records.c defines the record; tests/test_snapshot.py checks the two agree)
ROW_FIELDS = ("address", "size", "device", "kind", "stream", "thread", "label", "timestamp_ns",
              "stack_id", "seq")


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
    for sid in stack_ids:
        raw_frames = resolved.get(sid)
        if raw_frames is None:
            tb_by_id[sid] = _UNRESOLVED
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
            stack_id, seq; kind 0=device, 1=host, 2=managed, 3=static,
            4=physical, 5=block), or plain tuples in that field order (the
            trace reader builds those: a tuple costs half a record). This is
            the one place that unpacks a row by position; tests/test_snapshot.py
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
    rows = raw_allocs if isinstance(raw_allocs, (list, tuple)) else list(raw_allocs)
    labels, stack_ids = set(), set()
    for _addr, _size, _dev, _kind, _stream, _thread, label, _ts, sid, _seq in rows:
        labels.add(label)
        stack_ids.add(sid)
    decoded, tb_by_id, calls, thread_map = resolve_rows(labels, stack_ids, resolve_stacks, threads,
                                                        frame_filter)
    kind_map = _KindMap(enumerate(KIND_NAMES))
    new = tuple.__new__
    A = Allocation
    allocations = [
        new(A, (addr, size, dev, kind_map[kc], stream, thread_map[tidx], decoded[label][0], ts,
                tb_by_id[sid], seq, decoded[label][1], decoded[label][2], None, calls.get(sid),
                None, False))
        for addr, size, dev, kc, stream, tidx, label, ts, sid, seq in rows
    ]
    return Snapshot(allocations, timestamp_ns=timestamp_ns, devices=devices, frame_filter=frame_filter)
