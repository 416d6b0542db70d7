"""What PyTorch held when tracking started, put into the record.

Tracking usually starts after the model was built (a notebook's second
cell, a training loop's warm-up): the parameters, the optimizer's state
and whatever PyTorch's caching allocator had cached are already there, and
no driver call or allocation memviz sees will ever name them. So when the
allocator route attaches, PyTorch's own ``memory_snapshot()`` is read once
and every segment and every allocated block in it enters the C store as a
live allocation flagged "before tracking" (``_core.FLAG_BEFORE``): at
PyTorch's own block size, with the bytes it asked for and, when
``torch.cuda.memory._record_memory_history`` was on, PyTorch's own Python
frames. From then on every view includes them (live and peak snapshots,
``snapshot(at_ns)``, the timeline, categories, traces, the flight
recorder's base, ``diff``), and their frees match when the route sees
them; a block freed unseen (its tensor carried PyTorch's deleter, not
memviz's) is retired when its address is handed out again, and a live
snapshot drops it by PyTorch's own view.

Memory outside PyTorch at that moment (the CUDA context, cuBLAS's and other
libraries' buffers) has no allocation to name: it is kept as one figure,
the device's used bytes less what PyTorch reserved (``summary()["outside"]``).

With the GIL, once per tracker that attaches the route; never on the
capture path.
"""

from __future__ import annotations

import time
from typing import Any, Dict, List, Optional, Tuple

import memviz._core as _core

__all__ = ["seed", "read_snapshot"]


def read_snapshot(answers) -> Optional[List[Dict[str, Any]]]:
    """PyTorch's memory_snapshot() through the answers object (the stand-in's
    in the tests), shaped as torch.cuda.memory_snapshot() returns it; None
    when it cannot be read."""
    take = getattr(answers, "snapshot", None)
    try:
        if take is not None:
            return list(take())
        return [{"device": v.device, "address": v.address, "total_size": v.size, "stream": 0,
                 "is_expandable": v.expandable,
                 "blocks": [{"address": a, "size": s, "requested_size": s, "state": st}
                            for a, s, st in v.blocks]}
                for v in answers.view()]
    except Exception:  # noqa: BLE001 - a figure for later views, never the user's error
        return None


def _frames(block: Dict[str, Any], interned: Dict[tuple, tuple]) -> Optional[Tuple[tuple, ...]]:
    """PyTorch's recorded Python frames of a block, innermost first, when
    its memory history was on: (filename, lineno, name, None) tuples, the
    same object for the same frame (``interned``), so that the C store
    interns equal stacks once."""
    frames = block.get("frames")
    if not frames:
        return None
    out = []
    for f in frames:
        try:
            name = str(f.get("filename", ""))
            if not (name.endswith(".py") or (name.startswith("<") and name.endswith(">"))):
                continue  # C++ frames of a "stacks=all" history (sources, libraries, "??")
            key = (name, int(f.get("line", 0)), str(f.get("name", "")), None)
        except (AttributeError, TypeError, ValueError):
            continue
        out.append(interned.setdefault(key, key))
    return tuple(out) or None


def seed(answers, snap: Optional[List[Dict[str, Any]]] = None) -> Dict[str, Any]:
    """Record what PyTorch holds now as live "before tracking" allocations
    (the module docstring); returns what was added: ``{"blocks", "block_bytes",
    "segments", "segment_bytes", "outside", "by_device"}`` (``outside``: the
    device's used bytes beyond PyTorch's reserved ones then, or None;
    ``seconds``: how long reading and recording took). ``snap``: PyTorch's
    memory_snapshot() when the caller read it already."""
    t0 = time.perf_counter()
    out: Dict[str, Any] = {"blocks": 0, "block_bytes": 0, "segments": 0, "segment_bytes": 0,
                           "outside": None, "by_device": {}, "seconds": 0.0}
    if snap is None:
        snap = read_snapshot(answers)
    if snap is None:
        return out
    known = {(r.kind, r.address) for r in _core.live()}  # recorded since capture started
    KB, KD, BEFORE = _core.KIND_BLOCK, _core.KIND_DEVICE, _core.FLAG_BEFORE
    segments: Dict[int, list] = {}  # flags -> rows
    blocks: list = []
    interned: Dict[tuple, tuple] = {}
    for seg in snap:
        dev, base, size = int(seg.get("device", 0)), int(seg["address"]), int(seg["total_size"])
        stream = int(seg.get("stream", 0) or 0)
        per = out["by_device"].setdefault(dev, {"blocks": 0, "block_bytes": 0, "segment_bytes": 0})
        if (KD, base) not in known:
            flags = BEFORE | (_core.FLAG_ESTIMATED if seg.get("is_expandable") else 0)
            segments.setdefault(flags, []).append((base, size, size, stream, dev, KD, None))
            out["segments"] += 1
            out["segment_bytes"] += size
            per["segment_bytes"] += size
        n = nbytes = 0
        for b in seg.get("blocks", ()):  # the hot loop: 100,000 blocks in about 0.1 s
            # A block "active_pending_free" was freed by its tensor and waits on
            # another stream (the route's own check leaves one): its free is
            # past, and PyTorch's, when that stream is done, would never be seen.
            if b.get("state") != "active_allocated":
                continue
            addr, bsize = b["address"], b["size"]
            if known and (KB, addr) in known:
                continue
            blocks.append((addr, bsize, b.get("requested_size") or bsize, stream, dev, KB,
                           _frames(b, interned) if b.get("frames") else None))
            n += 1
            nbytes += bsize
        out["blocks"] += n
        out["block_bytes"] += nbytes
        per["blocks"] += n
        per["block_bytes"] += nbytes
    for flags, rows in sorted(segments.items()):
        _core.seed(rows, flags)
    _core.seed(blocks, BEFORE)
    used = getattr(answers, "device_used", None)
    if used is not None:
        try:
            dev = int(getattr(answers, "device", 0) or 0)
            reserved = sum(int(s["total_size"]) for s in snap if int(s.get("device", 0)) == dev)
            out["outside"] = max(0, int(used()) - reserved)
            out["outside_device"] = dev
        except Exception:  # noqa: BLE001
            out["outside"] = None
    out["seconds"] = time.perf_counter() - t0
    return out
