"""Memory the process holds beyond memviz's record, as the text, JSON and HTML
reports show it.

What the driver says the process holds (NVML, or cuMemGetInfo for the whole
device: memviz/capture/device.py) less what memviz recorded live then (its
totals: driver allocations, PyTorch's segments among them) is split into:

* what memviz can name: PyTorch's reserved memory that is not in memviz's
  record (segments PyTorch made before tracking started: PyTorch's own
  ``memory_stats`` less the segments memviz recorded), or, where a caller
  passes it, the allocations recorded as made before tracking, by category
  (``before_tracking``: the finer account of the same memory, so it takes
  the PyTorch figure's place);
* an unexplained remainder, given as a number: memory no allocation call
  that memviz saw made. memviz cannot say what it is; the CUDA context and
  loaded kernels are usually part of it, never PyTorch's memory (named
  above).

Imports the capture floor and below (docs/architecture.md).
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Tuple

from memviz.capture import cupti as _capture
from memviz.capture import device as _device
from memviz.capture.device import SOURCE_CUMEMGETINFO

__all__ = ["outside_section", "held_by_process", "section_lines", "PYTORCH_UNSEEN", "UNEXPLAINED_NOTE"]

#: the named part: PyTorch's reserved memory memviz has no record of
PYTORCH_UNSEEN = "PyTorch's pool outside memviz's record (segments made before tracking)"
UNEXPLAINED_NOTE = ("unexplained: memory no allocation call that memviz saw made; memviz cannot "
                    "say what it is (the CUDA context and loaded kernels are usually part of it)")


def held_by_process(recording: Any) -> Dict[int, Tuple[int, str]]:
    """{device: (bytes, source)} the process held: as recorded when tracking
    stopped (a loaded trace's ``outside``), else the driver's figure now."""
    held = getattr(recording, "outside", None)
    if held is None:
        held = _device.process_device_memory()
    return dict(held or {})


def _name(dev: int) -> str:
    return "pinned host" if dev < 0 else f"cuda:{dev}"


def _reserved(recording: Any) -> Dict[int, int]:
    """PyTorch's reserved bytes per device when the held figure was taken:
    the END record's (a loaded trace), or PyTorch's now (a live tracker)."""
    end = getattr(recording, "end", None)
    if isinstance(end, Mapping):
        from memviz.model.pytorch import END_KEY

        out = {}
        for dev, entry in (end.get(END_KEY) or {}).items():
            stats = entry.get("memory_stats") if isinstance(entry, Mapping) else None
            value = stats.get("reserved") if isinstance(stats, Mapping) else None
            if isinstance(value, int) and not isinstance(value, bool) and str(dev).lstrip("-").isdigit():
                out[int(dev)] = value
        return out
    if getattr(recording, "is_live", False) and getattr(recording, "torch", None) is not None:
        from memviz.model.pytorch import memory_stats

        return {d: s["reserved"] for d, s in memory_stats().items() if "reserved" in s}
    return {}


def _recorded_segments(end: Any) -> Dict[int, int]:
    """Bytes of PyTorch's segments in memviz's record (made while it
    tracked), per device, of a snapshot."""
    out: Dict[int, int] = {}
    for seg in getattr(end, "segments", None) or ():
        if not seg.before_tracking:
            out[seg.device] = out.get(seg.device, 0) + seg.size
    return out


def outside_section(recording: Any, outside: Mapping[int, Tuple[int, str]], *, end: Any = None,
                    before_tracking: Optional[Mapping[int, Mapping[str, int]]] = None
                    ) -> Dict[str, Any]:
    """The section, as JSON-able data::

        {"devices": [{"device": int, "name": "cuda:0", "held": int, "source": str,
                      "recorded": int, "beyond": int,
                      "named": [{"what": str, "bytes": int}, ...],
                      "before_tracking": {category: int},   # only when passed in
                      "unexplained": int}, ...],
         "why_none": str | null, "notes": [str, ...]}

    ``outside``: {device: (bytes held, source)}; ``end``: the recording's
    snapshot() when the caller has it (else read when PyTorch's figures need
    it); ``before_tracking``: {device: {category: bytes}} of allocations
    recorded as made before tracking, when something provides them."""
    totals = recording.totals()
    gpu = bool(getattr(recording, "gpu_enabled", True))
    section: Dict[str, Any] = {"devices": [], "why_none": None, "notes": []}
    if not outside:
        if gpu or _capture.gpu_present()[0]:
            section["why_none"] = ("no source could tell: NVML does not list this process (it may "
                                   "hold no GPU memory, or run in a container, where NVML shows "
                                   "host PIDs) and no CUDA context is active")
        else:
            section["why_none"] = "needs an NVIDIA GPU and its driver (NVML); nothing to compare on this machine"
        return section
    reserved = _reserved(recording) if before_tracking is None else {}
    segments: Dict[int, int] = {}
    if reserved:
        if end is None:
            try:
                end = recording.snapshot()
            except Exception:  # noqa: BLE001 - a report must come out
                end = None
        segments = _recorded_segments(end)
    for dev in sorted(outside):
        held, source = outside[dev]
        recorded = int(totals.get(dev, {}).get("current", 0))
        beyond = max(int(held) - recorded, 0)
        entry: Dict[str, Any] = {"device": dev, "name": _name(dev), "held": int(held), "source": source,
                                 "recorded": recorded, "beyond": beyond, "named": []}
        named = 0
        if before_tracking is not None:
            cats = {str(k): int(v) for k, v in (before_tracking.get(dev) or {}).items() if v}
            entry["before_tracking"] = cats
            named = sum(cats.values())
        elif dev in reserved:
            unseen = max(reserved[dev] - segments.get(dev, 0), 0)
            entry["named"].append({"what": PYTORCH_UNSEEN, "bytes": unseen})
            named = unseen
        entry["unexplained"] = max(beyond - named, 0)
        section["devices"].append(entry)
    if not gpu:
        section["notes"].append("GPU capture was off, so memviz recorded nothing and all of it is "
                                "beyond its record")
    if any(source == SOURCE_CUMEMGETINFO for _, source in outside.values()):
        section["notes"].append("cuMemGetInfo counts the whole device: every other process on it "
                                "is in the unexplained part too")
    cupti = (_sources(recording).get("cupti") or {}) if gpu else {}
    if cupti and not cupti.get("used"):
        section["notes"].append(f"memviz tracked without CUPTI ({str(cupti.get('reason') or 'not used').rstrip('.')}), "
                                "so what libraries other than PyTorch allocated (CuPy, JAX, NCCL) is in "
                                "the unexplained part, not seen allocation by allocation")
    return section


def _sources(recording: Any) -> Dict[str, Any]:
    """How the recording captured each source (capture_info()'s "sources"), or {}."""
    try:
        info = recording.capture_info() or {}
    except Exception:  # noqa: BLE001 - a report must come out
        return {}
    sources = info.get("sources")
    return sources if isinstance(sources, dict) else {}


def section_lines(section: Mapping[str, Any], fmt: Any) -> List[Tuple[str, str]]:
    """(indent, text) lines of the section for a text report; ``fmt``
    formats a byte count."""
    if section["why_none"]:
        return [("  ", section["why_none"] + ".")]
    out: List[Tuple[str, str]] = []
    for d in section["devices"]:
        what = "device in use" if d["source"] == SOURCE_CUMEMGETINFO else "process holds"
        out.append(("  ", f"{d['name']:<8} {fmt(d['beyond']):>10} outside   ({what} {fmt(d['held'])}, "
                          f"memviz saw {fmt(d['recorded'])})"))
        out.append(("             ", f"source: {d['source']}"))
        for n in d["named"]:
            out.append(("             ", f"{fmt(n['bytes']):>10}  {n['what']}"))
        for cat, size in sorted((d.get("before_tracking") or {}).items(), key=lambda kv: -kv[1]):
            out.append(("             ", f"{fmt(size):>10}  made before tracking: {cat}"))
        out.append(("             ", f"{fmt(d['unexplained']):>10}  unexplained"))
    out.append(("  ", "Unexplained: " + UNEXPLAINED_NOTE.split(": ", 1)[1] + "."))
    out += [("  ", n[0].upper() + n[1:] + ".") for n in section["notes"]]
    return out
