"""PyTorch's figures kept with a recording: what ``memviz diff`` needs that
the events do not hold (categories and fragmentation at the peak, PyTorch's
own ``memory_stats``). The trace writer stores them in the END chunk under
:data:`END_KEY`."""

from __future__ import annotations

import sys
from typing import Any, Dict, Mapping, Optional

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


#: at most this many allocations' categories are kept per moment (peak, end)
ALLOCATION_CATEGORIES_MAX = 1 << 20


def pytorch_figures(tracker: Any) -> Dict[str, Dict[str, Any]]:
    """``{device: {"categories", "category_counts", "fragmentation",
    "categories_at_end", "allocation_categories", "memory_stats",
    "route"}}`` (device as str): what ``memviz diff``, the merged rank report
    and a loaded trace's snapshots need that the events do not hold.
    Categories and fragmentation are those of the tracker's peak snapshot,
    categories_at_end those of what was live when it stopped,
    allocation_categories_peak, allocation_categories_end and
    allocation_categories_tensor_peak each allocation's category then (see :func:`_allocation_categories`),
    memory_stats PyTorch's own figures now. {} without the PyTorch
    integration. Never raises: a figure for later reports must not stop
    tracking."""
    try:
        scan = getattr(getattr(tracker, "torch", None), "one_scan", None)
        if scan is None:
            return _pytorch_figures(tracker)
        with scan():  # the three snapshots below share one pass over the heap
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
    try:  # the tensor peak (PyTorch's blocks' own), where it differs
        tensor = tracker.peak_snapshot(peak="tensor").by_device()
    except Exception:  # noqa: BLE001 - a figure for later reports
        tensor = {}
    for moment, parts in (("peak", snap.by_device()), ("end", end), ("tensor_peak", tensor)):
        for dev, part in parts.items():
            flat = _allocation_categories(part.allocations)
            if dev >= 0 and flat:
                out.setdefault(str(dev), {})[f"allocation_categories_{moment}"] = flat
    start = getattr(tracker.torch, "before_tracking", None) or {}
    if start.get("outside") is not None:  # beyond PyTorch's reserved memory when tracking started
        dev = start.get("outside_device", 0)
        out.setdefault(str(dev), {})["outside_at_start"] = int(start["outside"])
    for dev, stats in _memory_stats().items():
        out.setdefault(str(dev), {})["memory_stats"] = stats
        out[str(dev)].update(_allocator_config(dev))
    return {d: e for d, e in out.items() if e}


#: the variables PyTorch reads its allocator settings from, in the order it joins them
ALLOC_CONF_NAMES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")


def alloc_conf(environ: Optional[Mapping[str, str]] = None) -> str:
    """PyTorch's allocator settings as this process's environment gives them
    (PYTORCH_ALLOC_CONF and PYTORCH_CUDA_ALLOC_CONF, joined as PyTorch reads
    them): the one place memviz reads those variables (the capture session
    asks it whether PyTorch runs on the driver's pool, memviz.torch.rules for
    the block rules, this module for a trace's record)."""
    import os
    environ = os.environ if environ is None else environ
    return ",".join(v for v in (environ.get(n) for n in ALLOC_CONF_NAMES) if v)


def conf_backend(conf: str) -> Optional[str]:
    """The ``backend:`` an allocator settings string chooses, or None."""
    for part in conf.split(","):
        key, _, value = part.partition(":")
        if key.strip() == "backend" and value.strip():
            return value.strip()
    return None


def _allocator_config(dev: int) -> Dict[str, Any]:
    """What the allocator ran with on ``dev`` (memviz whatif replays it):
    ``alloc_conf`` (PYTORCH_ALLOC_CONF and PYTORCH_CUDA_ALLOC_CONF, as PyTorch
    read them when CUDA started) and the card's ``total_memory``."""
    torch = sys.modules.get("torch")
    out: Dict[str, Any] = {"alloc_conf": alloc_conf()}
    try:
        out["total_memory"] = int(torch.cuda.get_device_properties(dev).total_memory)
    except Exception:  # noqa: BLE001 - a figure for later reports
        pass
    return out


def _allocation_categories(allocations: Any) -> list:
    """The categories of the allocations memviz recorded (those read from
    PyTorch when tracking started among them), flat, as the END record's fields may nest
    no deeper: ``[category, address, kind code, address, kind code, ...,
    category, ...]`` (kind codes of memviz.model.snapshot.KIND_NAMES);
    unused_pool, which a reader works out from the blocks, and <unknown>
    left out. [] past ALLOCATION_CATEGORIES_MAX allocations."""
    from memviz.model.snapshot import KIND_NAMES

    codes = {k: i for i, k in enumerate(KIND_NAMES)}
    per: Dict[str, list] = {}
    n = 0
    for a in allocations:
        cat = a.category
        # (what a live snapshot adds from PyTorch's own view has no record: time 0)
        if not cat or cat == "unused_pool" or (a.before_tracking and not a.timestamp_ns) \
                or a.kind not in codes:
            continue
        n += 1
        if n > ALLOCATION_CATEGORIES_MAX:
            return []
        per.setdefault(str(cat), []).extend((a.address, codes[a.kind]))
    return [x for cat, places in per.items() for x in [cat, *places]]


def memory_stats() -> Dict[int, Dict[str, int]]:
    """PyTorch's own figures per device now (:data:`_MEMORY_STATS`'s names:
    allocated, reserved, ...); {} when PyTorch has not initialised CUDA."""
    return _memory_stats()


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
