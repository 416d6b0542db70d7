"""``Tracker.save()``: a trace file from what a tracker holds.

A tracker that did not stream keeps no event history, only its live set, the
allocations live at each device's peak, the last failures and a bounded
timeline. :func:`save` writes those in the trace format of
:mod:`memviz.trace.format` as made-up events that replay to the same peak and the
same end state.
"""

from __future__ import annotations

import time
from typing import Any, Dict, List, Optional

import memviz._args as _args
import memviz._core as _core
from memviz._errors import OutputError, TraceError
from memviz._output_files import own_files, refuse_inputs, write_output
from memviz.capture import callsite as _callsite
from memviz.capture.rank_files import rank_path
from memviz.trace.format import (END, EVENT, EVENT_LEVEL, EVENTS, FLAG_SYNTHETIC, META, OP_ALLOC, OP_FAILED,
                                 OP_FREE, STEPS, THREADS, TIMELINE, chunk, events_payload, header, json_bytes,
                                 step_dict)
from memviz.trace.writer import _meta, _pytorch_peak, _row, _Tables, _thread_names

__all__ = ["save"]


def save(tracker: Any, path: str) -> str:
    """Write a trace file from a tracker's current data (``Tracker.save``).

    A tracker that did not stream (no ``trace=``) keeps no event history, so
    the file holds what the tracker holds: the allocations live at each
    device's peak and the ones live now (as ALLOC/FREE events that replay to
    the same peak and the same end state), the failed allocations, the
    bounded timeline, step records and totals. ``load()`` of it gives the
    same snapshot(), peak_snapshot(), totals(), failures and timeline();
    ``snapshot(at_ns=...)`` between the peak and the end is approximate.
    Each allocation's stream is stored with its events (``events()`` give
    it back; a loaded trace's snapshots read 0, src/replay.h).

    The data goes to a temporary file created exclusively in ``path``'s
    folder, renamed over ``path`` once complete: a failed save leaves the
    old file as it was. Raises TraceError saying why and what to do.

    Under a launcher (RANK set) each rank writes its own file, named as
    ``track(trace=...)`` names it (memviz.capture.rank_files.rank_path);
    returns the path written.
    """
    path = rank_path(_args.path(path, "Tracker.save(path)"))
    try:
        refuse_inputs(path, own_files(tracker), "the trace")
    except OutputError as e:
        raise TraceError(f"cannot write the trace file: {e.reason}", path, hint=e.hint) from None
    src = tracker._source()  # raises NotTracking for a tracker that never started
    if src is None and tracker.running and tracker.gpu_enabled:
        _core.flush()
    live = src.live if src is not None else _core.live()
    totals = dict(src.totals) if src is not None else _core.totals()
    peaks = {d: (src.peaks.get(d, []) if src is not None else _core.peak_live(d)) for d in totals}
    failures = src.failures if src is not None else _core.failures()
    timeline = src.timeline if src is not None else _core.timeline()
    threads = src.threads if src is not None else _core.threads()
    stats = src.stats if src is not None else _core.stats()
    resolve = src.resolve if src is not None else _callsite.resolve

    labels: Dict[Optional[str], int] = {None: 0}
    all_rows = list(live) + [r for rows in peaks.values() for r in rows]
    for lab in [r.label for r in all_rows] + [f.label for f in failures]:
        if lab not in labels:
            labels[lab] = len(labels)
    ids = {r.stack_id for r in all_rows} | {f.stack_id for f in failures}
    ids.discard(0)
    tables = _Tables()
    out = [header(), chunk(META, json_bytes(_meta(tracker, "saved")))]
    out += tables.stack_chunks(resolve(ids) if ids else {})
    out += tables.label_chunk({i: s for s, i in labels.items() if s is not None})
    out.append(chunk(THREADS, json_bytes(_thread_names(threads))))
    events = _saved_events(live, peaks, failures, labels)
    out.append(chunk(EVENTS, events_payload(events), compress=EVENT_LEVEL))
    if tracker.steps:
        out.append(chunk(STEPS, json_bytes([step_dict(s) for s in tracker.steps])))
    out.append(chunk(TIMELINE, json_bytes([list(p) for p in timeline])))
    end_ns = tracker.stopped_ns if tracker.stopped_ns is not None else time.monotonic_ns()
    out.append(chunk(END, json_bytes({
        "stopped_monotonic_ns": end_ns, "stopped_wall_time": time.time(),
        "totals": {str(d): v for d, v in totals.items()},
        "failures": sum(v.get("failed", 0) for v in totals.values()), "stats": stats,
        "outside": {}, "events": len(events) // EVENT.size, "dropped_events": 0,
        **_pytorch_peak(tracker)})))
    try:  # a temporary file made exclusively next to the target, then renamed over it
        write_output(path, b"".join(out), "the trace", inputs=own_files(tracker))
    except OutputError as e:
        raise TraceError(f"cannot write the trace file: {e.reason}", path, hint=e.hint) from e
    return path


def _saved_events(live: List[tuple], peaks: Dict[int, List[tuple]], failures: List[tuple],
                  labels: Dict[Optional[str], int]) -> bytes:
    """Per device: ALLOC its peak set, FREE what is not live any more, ALLOC
    the rest of the live set; then the failures. Replays to the same peak.
    Encoded by the C core (_core.encode_events)."""
    flags = FLAG_SYNTHETIC
    rows: List[tuple] = []
    key = lambda r: (r.address, r.kind, r.seq)  # noqa: E731 - address, kind, seq
    live_by_dev: Dict[int, List[tuple]] = {}
    for r in live:
        live_by_dev.setdefault(r.device, []).append(r)
    for dev in sorted(set(peaks) | set(live_by_dev)):
        peak_rows = sorted(peaks.get(dev, []), key=lambda r: r.timestamp_ns)
        now = live_by_dev.get(dev, [])
        now_keys = {key(r) for r in now}
        peak_keys = {key(r) for r in peak_rows}
        rows += [_row(OP_ALLOC, r.timestamp_ns, r, flags, labels) for r in peak_rows]
        prev = peak_rows[-1].timestamp_ns if peak_rows else 0
        later = sorted((r for r in now if key(r) not in peak_keys), key=lambda r: r.timestamp_ns)
        free_ts = max(prev + 1, later[0].timestamp_ns if later else prev + 1)
        rows += [_row(OP_FREE, free_ts, r, flags, labels) for r in peak_rows if key(r) not in now_keys]
        rows += [_row(OP_ALLOC, r.timestamp_ns, r, flags, labels) for r in later]
    rows += [(OP_FAILED, f.timestamp_ns, f.kind, f.device, flags, f.stack_id, f.thread, labels[f.label],
              f.result, f.size, 0, 0) for f in failures]
    return _core.encode_events(rows, rows[0][1], flags) if rows else b""
