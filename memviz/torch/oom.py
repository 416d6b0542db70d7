"""What memory looked like when an allocation failed."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from memviz._units import format_size
from memviz.capture.callsite import call_name
from memviz.model.lines import location, where
from memviz.torch.graph import _MEMVIZ_DIR, user_line

__all__ = ["OomReport", "capture_oom", "from_failure"]


@dataclass
class OomReport:
    """The moment an allocation failed: what was asked, by which line, and
    what held the device's memory."""

    requested: int
    device: int
    line: Optional[str]
    source: str  # "PyTorch out-of-memory observer" or "failed driver call"
    timestamp_ns: int
    by_category: Dict[str, int] = field(default_factory=dict)
    by_line: List[Tuple[str, int]] = field(default_factory=list)
    torch_allocated: Optional[int] = None
    torch_reserved: Optional[int] = None
    reserved_unused: Optional[int] = None
    largest_free_block: Optional[int] = None
    outside_pytorch: Optional[int] = None
    device_total: Optional[int] = None
    device_free: Optional[int] = None
    #: what the innermost Python frame was calling (``torch.nn.functional.linear``)
    call: Optional[str] = None
    #: the gaps between live blocks in PyTorch's segments (allocator route), and
    #: the segment whose gap is the largest, with the line that made it
    free_gaps: Optional[int] = None
    segments: Optional[int] = None
    largest_gap_segment: Optional[str] = None

    def to_dict(self) -> dict:
        return dict(self.__dict__)

    def __str__(self) -> str:
        fs = format_size
        lines = [f"Out of memory on cuda:{self.device}: {fs(self.requested)} requested at "
                 f"{self.line or '<unknown line>'}" + (f" by {self.call}" if self.call else "")
                 + f" ({self.source})"]
        if self.device_total is not None:
            lines.append(f"  device: {fs(self.device_total)} total, {fs(self.device_free or 0)} free")
        if self.torch_reserved is not None:
            lines.append(f"  PyTorch: {fs(self.torch_allocated or 0)} allocated, "
                         f"{fs(self.torch_reserved)} reserved, {fs(self.reserved_unused or 0)} reserved but unused"
                         + (f", largest free block {fs(self.largest_free_block)}"
                            if self.largest_free_block is not None else "")
                         + (f" ({self.free_gaps} gaps in {self.segments} segments"
                            + (f"; the largest in the segment made at {self.largest_gap_segment}"
                               if self.largest_gap_segment else "") + ")"
                            if self.free_gaps is not None else ""))
        if self.outside_pytorch is not None:
            lines.append(f"  outside PyTorch's pool: {fs(self.outside_pytorch)}")
        if self.by_category:
            lines.append("  live by category: " + ", ".join(
                f"{k} {fs(v)}" for k, v in sorted(self.by_category.items(), key=lambda kv: -kv[1])))
        for where, size in self.by_line[:10]:
            lines.append(f"    {fs(size):>10}  {where}")
        if self.reserved_unused and self.requested and self.reserved_unused >= self.requested:
            lines.append("  The pool had enough reserved-but-unused memory for this request: it is "
                         "fragmented. PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True usually helps.")
        return "\n".join(lines)


def _fill(report: OomReport, snap) -> None:
    for stat in snap.statistics("category"):
        report.by_category[str(stat.key)] = stat.size
    for stat in snap.statistics("lineno")[:10]:
        report.by_line.append((location(stat.key), stat.size))


def _segments(report: OomReport, snap, device: int) -> None:
    """Fragmentation from the live blocks (memviz.model.segments), where the
    allocator route saw them: the same figures as PyTorch's snapshot."""
    frag = snap.fragmentation(device).get(device) if getattr(snap, "segments", None) else None
    if not frag:
        return
    report.largest_free_block = frag["largest_free"]
    report.free_gaps, report.segments = frag["free_gaps"], frag["segments"]
    best = max((sg for sg in snap.segments if sg.device == device), key=lambda sg: sg.largest_free)
    uf = best.traceback.user_frame if best.traceback else None
    report.largest_gap_segment = ("before tracking" if best.before_tracking else
                                  f"{uf.filename}:{uf.lineno}" if uf else None)


def _torch_pool(report: OomReport, device: int) -> None:
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return
    try:
        report.torch_allocated = torch.cuda.memory_allocated(device)
        report.torch_reserved = torch.cuda.memory_reserved(device)
        report.reserved_unused = report.torch_reserved - report.torch_allocated
        if report.free_gaps is not None:  # known from the live blocks already
            return
        largest = 0
        for seg in torch.cuda.memory.memory_snapshot():
            if seg.get("device") != device:
                continue
            for b in seg.get("blocks", ()):
                if b.get("state") == "inactive":
                    largest = max(largest, b.get("size", 0))
        report.largest_free_block = largest
    except Exception:  # noqa: BLE001 - e.g. the cudaMallocAsync backend has no snapshot
        pass


def capture_oom(tracker, integ, device, alloc, device_total, device_free) -> OomReport:
    """Called from PyTorch's out-of-memory observer (the failing thread, with
    the GIL): copy what is live now, before the user's handler frees it."""
    uf = user_line(2)
    f = sys._getframe(1)
    while f is not None and f.f_code.co_filename.startswith(_MEMVIZ_DIR):
        f = f.f_back  # the op's caller: the innermost frame that is not memviz's observer
    report = OomReport(alloc, device, f"{uf.filename}:{uf.lineno}" if uf else None,
                       "PyTorch out-of-memory observer", time.monotonic_ns(),
                       device_total=device_total, device_free=device_free,
                       call=call_name(f.f_code, f.f_lasti) if f is not None else None)
    snap = integ.categorize(tracker.snapshot_raw(), live_now=True)
    _fill(report, snap.filter(lambda a: a.device == device))
    _segments(report, snap, device)
    _torch_pool(report, device)
    seen = snap.filter(lambda a: a.device == device).total_bytes()
    if report.torch_reserved is not None:
        report.outside_pytorch = max(0, seen - report.torch_reserved)
    return report


def from_failure(tracker) -> Optional[OomReport]:
    """A report for the last failed driver allocation (e.g. from CuPy),
    built when asked: live memory is the peak set of that device."""
    failures = tracker.failures
    if not failures:
        return None
    f = failures[-1]
    report = OomReport(f.size, f.device, where(f) if f.traceback or f.autograd_node else None,
                       "failed driver call", f.timestamp_ns, call=f.op)
    peak = tracker.peak_snapshot(f.device)
    _fill(report, peak)
    _segments(report, peak, f.device)
    _torch_pool(report, f.device)
    return report
