"""Tensors inside segments: a snapshot's two levels put together.

Under the allocator route a snapshot holds PyTorch's blocks (kind "block",
with lines) and, from CUPTI, the segments they live in (kind "device"). So
that every byte counts once, each segment is shown by what its blocks leave
unused (category ``unused_pool``), and ``Snapshot.segments`` lists every
segment with its blocks, unused bytes, largest free gap and gap count.

A live snapshot is reconciled with PyTorch's own ``memory_snapshot()``
(through the route's answers object): blocks take PyTorch's block sizes
(the wrappers see requested sizes; PyTorch rounds and may not split), a block
PyTorch no longer holds is dropped, and blocks and segments PyTorch made
before tracking started are added, marked ``before_tracking`` (the store
already holds those it read from PyTorch when tracking started:
memviz/torch/before.py). A past snapshot (the peak, ``snapshot(at_ns)``, a
trace) has no such view: segments are the driver allocations that hold
blocks, and block sizes are PyTorch's own, worked out by its rules when each
block was made (src/blocks.h); a block flagged ``size_estimated`` could not
be sized exactly (expandable segments).
"""

from __future__ import annotations

import bisect
from typing import Dict, Iterable, List, NamedTuple, Optional, Tuple

from memviz.model.snapshot import Allocation, Segment, ThreadInfo
from memviz.model.traceback import EMPTY_TRACEBACK

__all__ = ["PoolView", "reconcile", "segment_figures", "UNUSED_POOL", "TENSORS"]

BEFORE = ThreadInfo(None, None, "before tracking")
#: the category of what PyTorch's segments hold that no block does
UNUSED_POOL = "unused_pool"
#: the name of the series of PyTorch's blocks over time (the reports' and the
#: Perfetto export's): bytes inside the segments, never added to them
TENSORS = "PyTorch tensors"


class PoolView(NamedTuple):
    """PyTorch's own view of one segment: (address, size, state) blocks,
    state "active_allocated", "active_pending_free" or "inactive"."""

    device: int
    address: int
    size: int
    blocks: Tuple[Tuple[int, int, str], ...]
    expandable: bool = False


def torch_view(torch) -> List[PoolView]:
    """PoolViews from torch.cuda.memory_snapshot()."""
    out = []
    for seg in torch.cuda.memory.memory_snapshot():
        out.append(PoolView(seg["device"], seg["address"], seg["total_size"],
                            tuple((b["address"], b["size"], b["state"]) for b in seg.get("blocks", ())),
                            bool(seg.get("is_expandable", False))))
    return out



def segment_figures(address: int, size: int, blocks: Iterable[Allocation]) -> Tuple[int, int, int]:
    """(allocated, largest free gap, free gaps) of a segment from its live
    blocks (each clipped to the segment)."""
    end, pos, allocated, largest, gaps = address + size, address, 0, 0, 0
    for b in sorted(blocks, key=lambda a: a.address):
        lo, hi = max(b.address, pos), min(b.address + b.size, end)
        if lo > pos:
            gaps += 1
            largest = max(largest, lo - pos)
        if hi > lo:
            allocated += hi - lo
            pos = hi
    if end > pos:
        gaps += 1
        largest = max(largest, end - pos)
    return allocated, largest, gaps


def _segment(device, address, size, blocks, traceback, before, expandable, made=None) -> Segment:
    blocks = tuple(sorted(blocks, key=lambda a: a.address))
    allocated, largest, gaps = segment_figures(address, size, blocks)
    return Segment(device, address, size, allocated, size - allocated, largest, gaps, blocks,
                   traceback, before, expandable, made)


def reconcile(allocations: List[Allocation], view: Optional[List[PoolView]],
              known: Optional[set] = None) -> Tuple[List[Allocation], List[Segment]]:
    """(allocations, segments) as the module docstring says.
    ``known``: (device, address) of segments an earlier view showed, which
    count as segments without a view even when no block is live in them;
    views add theirs to it."""
    blocks = [a for a in allocations if a.kind == "block"]
    others = [a for a in allocations if a.kind != "block"]
    if view is None:
        return _from_own(blocks, others, known or set())
    if known is not None:
        known.update((seg.device, seg.address) for seg in view)
    held: Dict[int, Tuple[int, PoolView]] = {}
    for seg in view:
        for addr, size, state in seg.blocks:
            if state == "active_allocated":
                held[addr] = (size, seg)
    ours: Dict[int, Allocation] = {}
    for a in blocks:
        h = held.get(a.address)
        if h is None:  # PyTorch no longer holds it: its free was not seen
            continue
        ours[a.address] = a._replace(size=h[0], segment=h[1].address, device=h[1].device)
    for addr, (size, seg) in held.items():
        if addr not in ours:
            ours[addr] = Allocation(addr, size, seg.device, "block", 0, BEFORE, None, 0, EMPTY_TRACEBACK,
                                    segment=seg.address, before_tracking=True)
    by_base = {(seg.device, seg.address): seg for seg in view}
    out: List[Allocation] = list(ours.values())
    members: Dict[Tuple[int, int], List[Allocation]] = {}  # segment -> its blocks, in one pass
    for b in out:
        members.setdefault((b.device, b.segment), []).append(b)
    segments: List[Segment] = []
    seen = set()
    for a in others:
        seg = by_base.get((a.device, a.address)) if a.kind == "device" else None
        if seg is None or seg.expandable:
            out.append(a)
            continue
        seen.add((seg.device, seg.address))
        inside = members.get((seg.device, seg.address), [])
        s = _segment(seg.device, seg.address, seg.size, inside, a.traceback, a.before_tracking, False,
                     a.timestamp_ns)
        segments.append(s)
        if s.unused:
            out.append(a._replace(size=s.unused, category=UNUSED_POOL))
    for key, seg in by_base.items():
        if key in seen:
            continue
        inside = members.get(key, [])
        # Not seen made: before tracking, except an expandable segment, whose
        # memory CUPTI sees as cuMemCreate handles rather than at this address.
        s = _segment(seg.device, seg.address, seg.size, inside, EMPTY_TRACEBACK, not seg.expandable,
                     seg.expandable)
        segments.append(s)
        if s.unused and not seg.expandable:  # an expandable segment's memory is CUPTI's handles
            out.append(Allocation(seg.address, s.unused, seg.device, "device", 0, BEFORE, None, 0,
                                  EMPTY_TRACEBACK, category=UNUSED_POOL, before_tracking=True))
    segments.sort(key=lambda s: (s.device, s.address))
    return out, segments


def _from_own(blocks: List[Allocation], others: List[Allocation], known: set
              ) -> Tuple[List[Allocation], List[Segment]]:
    """No PyTorch view (a past moment): segments are the device allocations
    that hold blocks."""
    cands = sorted((a for a in others if a.kind == "device"), key=lambda a: (a.device, a.address))
    keys = [(a.device, a.address) for a in cands]
    inside: Dict[int, List[Allocation]] = {}
    placed = []
    for b in blocks:
        i = bisect.bisect_right(keys, (b.device, b.address)) - 1
        if i >= 0 and cands[i].device == b.device and b.address < cands[i].address + cands[i].size:
            inside.setdefault(i, []).append(b)
            b = b._replace(segment=cands[i].address)
        placed.append(b)
    out: List[Allocation] = placed
    members: Dict[Tuple[int, Optional[int]], List[Allocation]] = {}
    for b in placed:
        members.setdefault((b.device, b.segment), []).append(b)
    segments = []
    for i, a in enumerate(cands):
        if i not in inside and (a.device, a.address) not in known:
            continue
        blks = members.get((a.device, a.address), [])
        s = _segment(a.device, a.address, a.size, blks, a.traceback, a.before_tracking,
                     a.size_estimated, a.timestamp_ns)
        segments.append(s)
    held = {(s.device, s.address): s for s in segments}
    for a in others:
        s = held.get((a.device, a.address)) if a.kind == "device" else None
        if s is None:
            out.append(a)
        elif s.unused:
            out.append(a._replace(size=s.unused, category=UNUSED_POOL))
    return out, segments
