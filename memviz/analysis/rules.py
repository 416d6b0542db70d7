"""The ``spike``, ``cache_churn`` and ``outside_pytorch`` rules of
:func:`memviz.diagnose` (see memviz.analysis.diagnose for the rules' contract)."""

from __future__ import annotations

import statistics
from typing import Any, Dict, List, Optional

from memviz._units import format_size
from memviz.analysis.findings import (CHURN_SHARE, GROWTH_FLOOR, MIN_STEPS, OUTLIER, OUTSIDE_ABS, OUTSIDE_REL,
                                      SPIKE_REL, Finding, FindingLine, _dev, _devices, _input_keys,
                                      _input_size, _is_live_tracker, _torch_cuda)
from memviz.capture import session as _session

__all__ = ["spike", "churn", "outside"]


# ---- spike ------------------------------------------------------------------------------


def spike(obj, steps, warm, graph) -> List[Finding]:
    post = steps[warm:]
    if len(post) < MIN_STEPS or warm < 1:
        return []
    out = []
    for dev in _devices(post):
        best = None
        for key in _input_keys(post):
            r = _spike_for(steps, warm, dev, key)
            if r is not None and (best is None or r["excess"] > best["excess"]):
                best = r
        if best is None:
            continue
        s = steps[best["step_pos"]]
        shape = s.info.get(best["key"])
        numbers = {"device": dev, "input": best["key"], "input_value": list(shape) if isinstance(shape, tuple) else shape,
                   "step": s.index, "input_vs_median": round(best["ratio"], 2), "step_needed": best["need"],
                   "typical_step_needed": best["base"], "spike_steps": best["spikes"],
                   "long_input_steps": best["long"]}
        lines = []
        peak_line = _peak_line(obj, dev)
        if peak_line is not None:
            lines.append(peak_line)
            numbers["line_at_peak"] = peak_line.location
        msg = (f"The memory a step needs on {_dev(dev)} jumps only on long inputs: step {s.index} with "
               f"{best['key']}={_fmt_value(shape)} ({best['ratio']:.1f}x the median input) needed "
               f"{format_size(best['need'])} above what was live before it, against "
               f"{format_size(best['base'])} for a typical step"
               + (f"; at the peak the largest line is {peak_line.location}" if peak_line is not None else "")
               + ".")
        fix = ("Split long inputs into chunks (or cap or bucket their length) so that a long input's "
               "step needs no more than a typical one.")
        out.append(Finding("spike", msg, numbers, lines, fix))
    return out


def _fmt_value(v) -> str:
    return "(" + ", ".join(str(e) for e in v) + ")" if isinstance(v, tuple) else str(v)


def _spike_for(steps, warm, dev, key) -> Optional[Dict[str, Any]]:
    post_pos = range(warm, len(steps))
    xs, needs, before = {}, {}, {}
    for p in post_pos:
        x = _input_size(steps[p].info.get(key))
        d, prev = steps[p].devices.get(dev), steps[p - 1].devices.get(dev)
        if x is None or d is None or prev is None or d.peak is None or prev.current is None:
            continue
        xs[p], needs[p], before[p] = x, d.peak - prev.current, prev.current
    if len(xs) < MIN_STEPS:
        return None
    med = statistics.median(xs.values())
    if med <= 0:
        return None
    long = [p for p in xs if xs[p] >= OUTLIER * med]
    if not long or len(long) > max(1, 0.34 * len(xs)):
        return None
    normal = [p for p in xs if p not in long]
    base = statistics.median(needs[p] for p in normal)

    def jumps(p):
        return needs[p] - base >= max(SPIKE_REL * before[p], GROWTH_FLOOR)

    spikes = [p for p in long if jumps(p)]
    quiet = [p for p in normal if jumps(p)]
    if not spikes or len(quiet) > len(spikes) // 3:
        return None
    top = max(spikes, key=lambda p: needs[p])
    return {"key": key, "step_pos": top, "need": int(needs[top]), "base": int(max(base, 0)),
            "ratio": xs[top] / med, "excess": needs[top] - base,
            "spikes": [steps[p].index for p in spikes], "long": [steps[p].index for p in long]}


def _peak_line(obj, dev) -> Optional[FindingLine]:
    fn = getattr(obj, "peak_snapshot", None)
    if fn is None:
        return None
    # What to shrink is about tensors: the tensor peak (PyTorch's blocks'
    # own, max_memory_allocated()) where the recording has one, else the
    # device's peak.
    stats, what = None, "largest line at the peak"
    try:
        snap = fn(dev, peak="tensor")
        if any(a.kind == "block" for a in snap.allocations):
            stats, what = snap.statistics("lineno"), "largest line at the tensor peak"
    except Exception:  # noqa: BLE001 - an older recording: no tensor peak
        stats = None
    try:
        stats = stats if stats is not None else fn(dev).statistics("lineno")
    except Exception:  # noqa: BLE001 - no capture, or a trace without peaks
        return None
    # A Python line (a backward one, "file:line (backward: NODE)", counts:
    # memviz/model/lines.py), not the "<thread ...>" group of frameless
    # allocations outside autograd nodes.
    real = [st for st in stats if not str(getattr(st.key, "filename", st.key)).startswith("<")]
    if not real:
        return None
    return FindingLine(str(real[0].key), real[0].size, what, sign=False)


# ---- cache churn ------------------------------------------------------------------------


def _precise(obj) -> bool:
    """Whether PyTorch's allocations were driver calls in ``obj``'s run: a
    recording that says so, or a live tracker's (the capture session says)."""
    if getattr(obj, "precise", False):
        return True
    return _is_live_tracker(obj) and _session.current().precise(obj)


def churn(obj, steps, warm, graph) -> List[Finding]:
    post = steps[warm:]
    if len(post) < MIN_STEPS or _precise(obj):
        return []
    out = []
    for dev in _devices(post):
        rows = [(s, s.devices.get(dev)) for s in post]
        rows = [(s, d) for s, d in rows if d is not None and d.current is not None]
        if len(rows) < MIN_STEPS:
            continue
        churn = [(s, d) for s, d in rows if d.segment_frees > 0 and d.segment_allocs > 0]
        if len(churn) < CHURN_SHARE * len(rows):
            continue
        level = statistics.median(d.current for _, d in rows)
        realloc = statistics.median(d.segment_alloc_bytes for _, d in churn)
        if realloc < max(0.05 * level, GROWTH_FLOOR):
            continue
        numbers = {"device": dev, "steps": len(rows), "churn_steps": len(churn),
                   "segment_allocs_per_step": statistics.median(d.segment_allocs for _, d in churn),
                   "segment_frees_per_step": statistics.median(d.segment_frees for _, d in churn),
                   "reallocated_bytes_per_step": int(realloc)}
        calm = [s.duration_ns for s, d in rows if not (d.segment_frees > 0 and d.segment_allocs > 0)]
        cost = ""
        if len(calm) >= 2:
            t_churn = statistics.median(s.duration_ns for s, _ in churn)
            t_calm = statistics.median(calm)
            if t_calm > 0:
                numbers["slowdown"] = round(t_churn / t_calm - 1, 3)
                numbers["step_time_churn_s"] = t_churn / 1e9
                numbers["step_time_calm_s"] = t_calm / 1e9
                cost = f"; those steps take {100 * (t_churn / t_calm - 1):.0f}% longer than the others"
        msg = (f"GPU memory on {_dev(dev)} is returned to the driver and allocated again in "
               f"{len(churn)} of {len(rows)} steps ({format_size(realloc)} re-allocated per step){cost}.")
        fix = ("Remove torch.cuda.empty_cache() (or whatever frees the cache) from the loop; call it at "
               "most once outside it, so steps reuse the cached memory.")
        out.append(Finding("cache_churn", msg, numbers, [], fix))
    return out


# ---- outside PyTorch ----------------------------------------------------------------------


def outside(obj, steps, warm, graph) -> List[Finding]:
    latest: Dict[int, tuple] = {}
    for s in steps:
        for dev, d in s.devices.items():
            if dev >= 0 and d.current is not None and d.reserved is not None:
                latest[dev] = (d.current, d.reserved)
    if not latest and _is_live_tracker(obj) and getattr(obj, "started_ns", None):
        torch = _torch_cuda()
        if torch is not None:
            for dev, tot in obj.totals().items():
                if dev >= 0:
                    try:
                        latest[dev] = (tot["current"], torch.cuda.memory_reserved(dev))
                    except Exception:  # noqa: BLE001
                        pass
    out = []
    for dev, (cur, res) in sorted(latest.items()):
        outside = cur - res
        if outside <= OUTSIDE_ABS or outside <= OUTSIDE_REL * cur:
            continue
        numbers: Dict[str, Any] = {"device": dev, "memviz_bytes": cur, "torch_reserved": res,
                                   "outside_bytes": outside}
        lines: List[FindingLine] = []
        mostly = ""
        snap = None
        try:
            snap = obj.snapshot() if hasattr(obj, "snapshot") else None
        except Exception:  # noqa: BLE001
            snap = None
        if snap is not None:
            allocs = [a for a in snap.allocations if a.device == dev]
            if any(a.category for a in allocs):
                allocs = [a for a in allocs if a.category in (None, "outside_pytorch")]
            from memviz.model.snapshot import Snapshot

            sub = Snapshot(allocs, frame_filter=getattr(snap, "frame_filter", None))
            for key in ("category", "kind", "label"):
                numbers[f"by_{key}"] = {str(st.key): st.size for st in sub.statistics(key)[:6]}
            kinds = sub.statistics("kind")
            labels = [st for st in sub.statistics("label") if st.key != "<no label>"]
            if labels:
                mostly = f"; the largest part is labelled {labels[0].key!r} ({format_size(labels[0].size)})"
            elif kinds:
                mostly = f"; the largest kind is {kinds[0].key} ({format_size(kinds[0].size)})"
            lines = [FindingLine(str(st.key), st.size, sign=False) for st in sub.statistics("lineno")[:5]]
        msg = (f"memviz sees {format_size(outside)} on {_dev(dev)} that PyTorch's allocator does not hold "
               f"({100 * outside / cur:.0f}% of the {format_size(cur)} it sees){mostly}.")
        fix = ("Free or bound that memory where it is made (other libraries' pools such as CuPy or JAX, "
               "NCCL buffers, cuBLAS workspaces); torch.cuda.memory_* numbers do not include it.")
        out.append(Finding("outside_pytorch", msg, numbers, lines, fix))
    return out
