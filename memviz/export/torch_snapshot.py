"""memviz data in the format of ``torch.cuda.memory._dump_snapshot``.

The pickle holds ``{"segments": [...], "device_traces": [[...] per device]}``
as ``torch.cuda.memory._snapshot()`` documents it, so PyTorch's viewer
(``torch.cuda._memory_viz``, the memory_viz web page) shows memviz's data,
including what PyTorch's own snapshot cannot see: CuPy, NCCL, cuBLAS
workspaces, static module memory, and allocations made during backward
(frameless ones get a pseudo frame ``<thread NAME>`` naming the autograd node,
label or kind).

Mapping: memviz records driver allocations, so each allocation live at the
end is a segment holding one ``active_allocated`` block of the same size.
The trace has ``segment_alloc`` + ``alloc`` for each allocation and
``free_requested`` + ``free_completed`` + ``segment_free`` for each free; on
PyTorch's allocator route (a history with blocks) a block is an ``alloc``
and ``free_requested`` + ``free_completed`` only, and the device allocation
it lies in a ``segment_alloc`` and ``segment_free`` only, so the Active
Memory Timeline shows the blocks and the Cached one the segments. With
a recorded history (a loaded trace, or ``track(trace=...)``) that is every
event; a plain tracker keeps no history, so its trace lists the allocations
live at the end, in the order they were made. Pinned host memory has no
device in torch's format and is left out, and so are failed allocations
(torch's ``oom`` entry needs the free device memory at that moment, which
memviz does not record); :func:`build` reports both counts.
"""

from __future__ import annotations

import os
import pickle
from typing import Any, Dict, List, Mapping, Tuple

from memviz.report import read

__all__ = ["build", "write"]

_LARGE = 1 << 20  # torch calls segments over 1 MiB "large"


class _Frames:
    """Frame lists shared between entries with the same stack (pickle memoizes them)."""

    def __init__(self) -> None:
        self.cache: Dict[Any, List[Dict[str, Any]]] = {}

    def __call__(self, a: Any) -> List[Dict[str, Any]]:
        tb = getattr(a, "traceback", None)
        if tb:
            key: Any = id(tb)
        else:
            thread = getattr(getattr(a, "thread", None), "name", None) or getattr(a, "thread", None)
            key = (thread, getattr(a, "autograd_node", None), getattr(a, "forward", None),
                   getattr(a, "label", None), getattr(a, "kind", None))
        got = self.cache.get(key)
        if got is None:
            got = self.cache[key] = _frame_list(a)
        return got


def _frame_list(a: Any) -> List[Dict[str, Any]]:
    tb = getattr(a, "traceback", None)
    if tb and not all(hasattr(f, "filename") for f in tb):
        out = []
        for f in tb:  # mappings or (filename, line, name) tuples from a history
            if isinstance(f, Mapping):
                out.append({"filename": str(f.get("filename", "?")),
                            "line": int(f.get("line", f.get("lineno", 0)) or 0),
                            "name": str(f.get("name", "?"))})
            else:
                filename, line, name = (tuple(f) + ("?", 0, "?"))[:3]
                out.append({"filename": str(filename), "line": int(line or 0), "name": str(name)})
        return out
    return read.frame_dicts(a)


def _segment(a: Any, frames: List[Dict[str, Any]]) -> Dict[str, Any]:
    size = int(a.size)
    requested = int(getattr(a, "requested", None) or size)  # what was asked for, when known
    return {
        "device": a.device, "address": a.address, "total_size": size, "allocated_size": size,
        "active_size": size, "requested_size": requested, "stream": a.stream or 0,
        "segment_type": "large" if size > _LARGE else "small", "segment_pool_id": (0, 0),
        "is_expandable": False, "frames": frames,
        "blocks": [{"address": a.address, "size": size, "requested_size": requested,
                    "state": "active_allocated", "frames": frames}],
    }


def _entry(action: str, addr: int, size: int, stream: int, frames: list, ts: int,
           category: Any = None) -> Dict[str, Any]:
    e = {"action": action, "addr": addr, "size": size, "stream": stream or 0, "frames": frames,
         "time_us": ts // 1000}
    if category is not None:
        e["category"] = category
    return e


def _pools(history: List[Any]) -> set:
    """(device, address) of the non-block allocations of a history that held
    one of PyTorch's blocks (its segments)."""
    import bisect

    blocks: Dict[int, List[int]] = {}
    for e in history:
        if e.op == "alloc" and e.kind == "block":
            blocks.setdefault(e.device, []).append(e.address)
    for v in blocks.values():
        v.sort()
    out = set()
    for e in history:
        got = blocks.get(e.device)
        if got and e.op == "alloc" and e.kind != "block":
            i = bisect.bisect_left(got, e.address)
            if i < len(got) and got[i] < e.address + e.size:
                out.add((e.device, e.address))
    return out


def build(tracker: Any) -> Dict[str, Any]:
    """The snapshot dict (see the module docstring), plus ``"memviz"``:
    counts of what could not be written."""
    frames_of = _Frames()
    end = tracker.snapshot()
    peak = tracker.peak_snapshot()
    live = [a for a in end.allocations if a.device >= 0]
    host_left_out = len(end) - len(live)
    known = {(a.device, a.address, a.timestamp_ns): a for a in
             list(peak.allocations) + list(end.allocations)}
    with_categories = any(a.category for a in known.values())
    segments = [_segment(a, frames_of(a)) for a in sorted(live, key=lambda a: (a.device, a.address))]
    traces: Dict[int, List[Dict[str, Any]]] = {}

    def cat(a: Any) -> Any:
        return (getattr(a, "category", None) or "unknown") if with_categories else None

    history = read.events(tracker)
    if history is None:
        for a in sorted(live, key=lambda a: a.timestamp_ns):
            fr, c = frames_of(a), cat(a)
            trace = traces.setdefault(a.device, [])
            trace.append(_entry("segment_alloc", a.address, a.size, a.stream, fr, a.timestamp_ns, c))
            trace.append(_entry("alloc", a.address, a.size, a.stream, fr, a.timestamp_ns, c))
    else:
        history = [e for e in history if e.device >= 0 and e.op != "failed"]
        pools = _pools(history)
        open_: Dict[Tuple[int, int, str], Tuple[int, int, list, Any]] = {}
        for e in history:
            trace = traces.setdefault(e.device, [])
            # On PyTorch's allocator route a block lies inside a segment (a
            # device allocation that held blocks): blocks are torch's allocs,
            # segments its segment_allocs. Anything else is both.
            seg = e.kind != "block"
            block = not seg or (e.device, e.address) not in pools
            if e.op == "alloc":
                a = known.get((e.device, e.address, e.timestamp_ns), e.allocation)
                fr = frames_of(a)
                c = getattr(a, "category", None) or e.category or ("unknown" if with_categories else None)
                open_[(e.device, e.address, e.kind)] = (e.size, e.stream, fr, c)
                for action in ("segment_alloc",) * seg + ("alloc",) * block:
                    trace.append(_entry(action, e.address, e.size, e.stream, fr, e.timestamp_ns, c))
            else:
                got = open_.pop((e.device, e.address, e.kind), None)
                if got is None:  # allocated before the history starts
                    continue
                size, stream, fr, c = got
                for action in ("free_requested", "free_completed") * block + ("segment_free",) * seg:
                    trace.append(_entry(action, e.address, size, stream, fr, e.timestamp_ns, c))
    for dev, trace in traces.items():
        cats = {e["category"] for e in trace if "category" in e}
        if cats and "unknown" not in cats:
            # PyTorch's viewer expects an "unknown" category once any is used.
            last = trace[-1]["time_us"] if trace else 0
            trace.append({"action": "snapshot", "addr": 0, "size": 0, "stream": 0, "frames": [],
                          "time_us": last, "category": "unknown"})
    ndev = max([d + 1 for d in traces] + [s["device"] + 1 for s in segments] + [0])
    return {
        "segments": segments,
        "device_traces": [traces.get(d, []) for d in range(ndev)],
        "memviz": {"pinned_host_left_out": host_left_out,
                   "failed_left_out": len(getattr(tracker, "failures", None) or ()),
                   "history": history is not None},
    }


def write(tracker: Any, path: "str | os.PathLike[str]") -> Dict[str, Any]:
    """Pickle :func:`build`'s snapshot to ``path`` (as ``_dump_snapshot`` does).

    Open it with PyTorch's memory viewer (drag the file onto the memory_viz
    page, or ``python -m torch.cuda._memory_viz trace_plot FILE -o out.html``).
    Returns what :func:`build` returned. Raises :class:`memviz.OutputError`
    (an OSError) when ``path`` cannot be written; an existing file stays as it was."""
    from memviz._output_files import output_file, own_files

    data = build(tracker)
    with output_file(path, "the torch snapshot", binary=True, inputs=own_files(tracker)) as f:
        pickle.dump(data, f, protocol=4)
    return data
