"""PyTorch's figures kept with a recording: what ``memviz diff`` needs that
the events do not hold (categories and fragmentation at the peak, PyTorch's
own ``memory_stats``). The trace writer stores them in the END chunk under
:data:`END_KEY`."""

from __future__ import annotations

import sys
from typing import Any, Dict

#: the END chunk's field with the recording tracker's PyTorch figures
END_KEY = "pytorch_peak"


#: memory_stats keys kept when tracking stops (name in the trace -> PyTorch's key)
_MEMORY_STATS = {
    "allocated": "allocated_bytes.all.current", "reserved": "reserved_bytes.all.current",
    "allocated_peak": "allocated_bytes.all.peak", "reserved_peak": "reserved_bytes.all.peak",
    "active_peak": "active_bytes.all.peak", "inactive_split": "inactive_split_bytes.all.current",
    "alloc_retries": "num_alloc_retries", "ooms": "num_ooms",
}


_FRAGMENTATION = ("segments", "reserved", "allocated", "unused", "largest_free", "free_gaps")


def pytorch_figures(tracker: Any) -> Dict[str, Dict[str, Any]]:
    """``{device: {"categories", "category_counts", "fragmentation",
    "categories_at_end", "memory_stats", "route"}}`` (device as str): what
    ``memviz diff`` and the merged rank report need that the events do not
    hold. Categories and fragmentation are those of the tracker's peak
    snapshot, categories_at_end those of what was live when it stopped,
    memory_stats PyTorch's own figures now. {} without
    the PyTorch integration. Never raises: a figure for later reports must not
    stop tracking."""
    try:
        return _pytorch_figures(tracker)
    except Exception:  # noqa: BLE001
        return {}


def _pytorch_figures(tracker: Any) -> Dict[str, Dict[str, Any]]:
    if getattr(tracker, "torch", None) is None or "torch" not in sys.modules:
        return {}
    out: Dict[str, Dict[str, Any]] = {}
    snap = tracker.peak_snapshot()
    route = (getattr(snap, "pytorch", None) or {}).get("route")
    frag = snap.fragmentation()
    for dev, part in snap.by_device().items():
        if dev < 0:
            continue
        cats = [s for s in part.statistics("category") if s.key != "<unknown>"]
        entry: Dict[str, Any] = {}
        if cats:
            entry["categories"] = {str(s.key): s.size for s in cats}
            entry["category_counts"] = {str(s.key): s.count for s in cats}
        if dev in frag:
            entry["fragmentation"] = {k: int(frag[dev][k]) for k in _FRAGMENTATION}
        if isinstance(route, str):
            entry["route"] = route
        out[str(dev)] = entry
    try:  # what was live when tracking stopped, by category (the merged rank report's)
        end = tracker.snapshot().by_device()
    except Exception:  # noqa: BLE001 - a figure for later reports
        end = {}
    for dev, part in end.items():
        cats = [s for s in part.statistics("category") if s.key != "<unknown>"]
        if dev >= 0 and cats:
            out.setdefault(str(dev), {})["categories_at_end"] = {str(s.key): s.size for s in cats}
    for dev, stats in _memory_stats().items():
        out.setdefault(str(dev), {})["memory_stats"] = stats
    return {d: e for d, e in out.items() if e}


def _memory_stats() -> Dict[int, Dict[str, int]]:
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return {}
    out = {}
    for d in range(torch.cuda.device_count()):
        try:
            st = torch.cuda.memory_stats(d)
        except Exception:  # noqa: BLE001
            continue
        if st:
            out[d] = {name: int(st.get(key, 0)) for name, key in _MEMORY_STATS.items()}
    return out
