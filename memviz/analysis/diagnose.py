"""``memviz.diagnose(tracker)``: practitioners' rules of thumb, applied with evidence.

Each rule reads the step records (``tracker.steps``, see memviz.analysis.steps), skips
a warm-up (the first steps allocate parameters, optimizer state and the
allocator's cache), and fires only on a consistent pattern with thresholds
relative to the memory in use, so run-to-run noise never fires:

* ``growth``: live memory rises steadily (a linear trend over at least 5 steps,
  most of them increasing, the rise at least 5% of the level). With PyTorch it
  reads the allocator's *allocated* bytes (tensors), else the driver-level bytes.
  When autograd graphs made in many different steps are still reachable, it
  names the holder (``list `history` in module __main__``) and the line that
  keeps them. This part also works on CPU.
* ``fragmentation``: PyTorch's *reserved* bytes keep growing while *allocated*
  (and the allocated peak) do not; or a failed allocation happened while the
  cache held enough unused bytes; or reserved nears the card with much unused.
* ``spike``: the memory a step needs jumps only on steps with long inputs (an
  input size passed to ``t.step(batch_shape=..., tokens=...)``).
* ``cache_churn``: segments are freed and re-allocated in most steps
  (``torch.cuda.empty_cache()`` in the loop), with the time it costs when some
  steps do not churn.
* ``outside_pytorch``: memory memviz sees that PyTorch's allocator does not
  hold is large (over 25% and over 256 MiB), broken down by category, kind and
  label.

Everything works on a loaded trace too: diagnose() reads ``steps``,
``failures``, ``peak_snapshot()`` and ``snapshot()``, whichever exist.
This module holds the API, the shared helpers and the growth and
fragmentation rules; memviz.analysis.rules holds the other three.
"""

from __future__ import annotations

import bisect
import math
import sys
from typing import Any, Dict, List, Optional

from memviz._errors import InvalidArgumentType
from memviz._units import format_size
from memviz.analysis.findings import (FRAG_REL, GRAPH_FIX, GROWTH_FLOOR, GROWTH_REL, MIN_STEPS, Finding,
                                      FindingLine, MiB, _as_records, _dev, _devices, _is_live_tracker,
                                      _long_input_positions, _series, _steady_rise, _torch_cuda, _warmup)

__all__ = ["Finding", "FindingLine", "diagnose"]



# ---- helpers ------------------------------------------------------------------


# ---- entry point ------------------------------------------------------------------


def diagnose(tracker, *, warmup: Optional[int] = None, graph=None) -> List[Finding]:
    """Findings about a tracker's (or a loaded trace's) steps, in rule order.

    Args:
        tracker: a :class:`memviz.Tracker`, or any object with ``steps`` (and
            optionally ``failures``, ``peak_snapshot()``, ``snapshot()``).
        warmup: steps to ignore at the start (default: 3, or a tenth of the
            steps up to 10).
        graph: a ``memviz.torch.graph.GraphRecorder`` to read graph residency
            from (default: ``tracker.graph`` when the torch integration set one).
    """
    if not hasattr(tracker, "steps"):
        raise InvalidArgumentType(f"memviz.diagnose() takes a memviz Tracker or a loaded trace (an object with "
                        f"`steps`), got {type(tracker).__name__}")
    if hasattr(tracker, "started_ns") and tracker.started_ns is None:
        return []  # a tracker never started recorded nothing: nothing to find (its rules would fail)
    steps = _as_records(tracker.steps)
    warm = _warmup(len(steps), warmup)
    graph = graph if graph is not None else getattr(tracker, "graph", None)
    if graph is not None and not callable(getattr(graph, "resident", None)):
        graph = None
    from memviz.analysis import rules as more

    findings: List[Finding] = []
    for rule in (_growth, _fragmentation, more.spike, more.churn, more.outside):
        try:
            findings.extend(rule(tracker, steps, warm, graph))
        except Exception as e:  # noqa: BLE001 - one rule's trouble must not hide the others
            import warnings

            from memviz.model.frame_filter import warning_site
            warnings.warn(f"memviz.diagnose(): the {rule.__name__.strip('_')} rule failed ({e!r}); "
                          "the other findings are unaffected. Please report this.", RuntimeWarning,
                          stacklevel=warning_site()[0])
    return findings


# ---- growth ---------------------------------------------------------------------------


def _growth(obj, steps, warm, graph) -> List[Finding]:
    post = steps[warm:]
    out: List[Finding] = []
    evidence = _graph_evidence(obj, steps, warm, graph) if len(post) >= MIN_STEPS else None
    for dev in _devices(post):
        alloc = _series(post, dev, "allocated")
        name, ys = ("allocated", alloc) if alloc is not None else ("current", _series(post, dev, "current"))
        if ys is None:
            continue
        tr = _steady_rise(ys, GROWTH_REL, GROWTH_FLOOR)
        outside = None
        if tr is None and alloc is not None:
            cur, res = _series(post, dev, "current"), _series(post, dev, "reserved")
            if cur is not None and res is not None:
                tr = _steady_rise([c - r for c, r in zip(cur, res)], GROWTH_REL, GROWTH_FLOOR)
                name, outside = "outside PyTorch", True
        if tr is None:
            continue
        numbers = {"device": dev, "series": name, "bytes_per_step": tr["slope"], "rise": tr["rise"],
                   "steps": tr["steps"], "first_step": post[0].index, "last_step": post[-1].index,
                   "start": tr["start"], "end": tr["end"], "steps_increasing": tr["ups"]}
        lines = _grown_lines(post, blocks=name == "allocated")
        what = ("memory PyTorch does not hold" if outside else
                "PyTorch's allocated memory" if name == "allocated" else "live GPU memory")
        msg = (f"{what[0].upper() + what[1:]} on {_dev(dev)} rises {format_size(tr['slope'])} per step "
               f"({format_size(tr['start'])} to {format_size(tr['end'])} over {tr['steps']} steps after warm-up)")
        fix = ("Find what these lines keep from step to step (a list or cache that grows, a tensor "
               "stored with its graph) and drop it, detach it or bound it.")
        if evidence is not None and not outside:
            msg += ", because " + evidence["clause"]
            lines = evidence["lines"] + lines
            numbers.update(evidence["numbers"])
            fix = GRAPH_FIX
            evidence = None
        out.append(Finding("growth", msg + ".", numbers, lines[:8], fix))
    if evidence is not None:  # graphs leak, but no GPU series shows it (CPU tensors, no capture)
        out.append(Finding("growth", f"Autograd graphs accumulate: {evidence['clause']}.",
                           evidence["numbers"], evidence["lines"][:8], GRAPH_FIX))
    return out


def _grown_lines(post, blocks: bool = False) -> List[FindingLine]:
    """Net growth per line over the steps: live at its last appearance minus
    live before its first. With ``blocks`` (a finding about PyTorch's
    allocated memory), PyTorch's blocks only, where the steps recorded them:
    the segments a line made hold blocks counted at their own lines."""
    first: Dict[str, int] = {}
    last: Dict[str, int] = {}
    seen: Dict[str, int] = {}
    # blocks were recorded (the allocator route): a line without one of its own
    # grew by segments, which hold blocks counted at those blocks' lines
    blocks = blocks and any(g.block_live_bytes for s in post for g in s.lines)
    for s in post:
        step: Dict[str, List[int]] = {}  # a location listed twice in one step is one line
        for g in s.lines:
            grew, live = (g.block_bytes or 0, g.block_live_bytes or 0) if blocks else (g.bytes, g.live_bytes)
            if blocks and not (grew or live):
                continue
            agg = step.setdefault(g.location, [0, 0])
            agg[0] += grew
            agg[1] += live
        for loc, (grew, live) in step.items():
            if loc not in first:
                first[loc] = live - grew
            last[loc] = live
            seen[loc] = seen.get(loc, 0) + 1
    net = sorted(((last[k] - first[k], k) for k in last), reverse=True)
    return [FindingLine(k, b, f"grew in {seen[k]} of {len(post)} steps") for b, k in net[:5] if b > 0]


def _graph_evidence(obj, steps, warm, graph) -> Optional[Dict[str, Any]]:
    """Autograd graphs made in many post-warm-up steps that are still reachable."""
    post = steps[warm:]
    need = max(3, math.ceil(0.5 * len(post)))
    start_ts = steps[warm - 1].timestamp_ns if warm > 0 else (getattr(obj, "started_ns", None) or 0)
    bounds_ts = [s.timestamp_ns for s in post]
    records = []
    rec_intervals = set()
    # A graph belongs to the step whose end is the first at or after it was
    # made; one made after the last step's end belongs to no recorded step
    # (bisect gives len(post) there), so it is not counted as one.
    if graph is not None:
        records = [r for r in graph.resident() if r.timestamp_ns > start_ts]
        rec_intervals = {bisect.bisect_left(bounds_ts, r.timestamp_ns) for r in records} - {len(post)}
    roots, root_intervals = [], set()
    seqs = [s.autograd_seq for s in post]
    start_seq = steps[warm - 1].autograd_seq if warm > 0 else None
    if (_is_live_tracker(obj) and "torch" in sys.modules and start_seq is not None
            and all(q is not None for q in seqs)):
        from memviz.torch.graph import GraphRecorder

        roots = GraphRecorder.roots_since(start_seq, limit=100_000)
        root_intervals = {bisect.bisect_left(seqs, r.grad_fn._sequence_nr()) for r in roots} - {len(post)}
    if max(len(rec_intervals), len(root_intervals)) < need:
        return None
    nsteps = max(len(rec_intervals), len(root_intervals))
    nbytes = sum(r.nbytes for r in records)
    numbers: Dict[str, Any] = {"graph_steps_alive": nsteps, "graph_roots": len(roots)}
    lines: List[FindingLine] = []
    holder_text = ""
    if roots:
        from memviz.torch.graph import holders

        # The oldest root outlived the most steps: what holds it is the leak
        # (the newest is often also held by the loop's own variable).
        saved_at = next((r.line for r in records if r.line is not None), None)
        found = holders(roots[-1], exclude=[roots],
                        near=(saved_at.filename, saved_at.lineno) if saved_at else None)
        found.sort(key=lambda h: h.location is None)
        if found:
            h = found[0]
            holder_text = f" through {h.description}"
            numbers["holder"] = h.description
            if h.location:
                holder_text += f" (kept at {h.location})"
                numbers["kept_at"] = h.location
                lines.append(FindingLine(h.location, nbytes, f"keeps the graphs alive: {h.description}",
                                         sign=False))
    if records:
        numbers["graph_bytes"] = nbytes
        by_line: Dict[str, int] = {}
        for r in records:
            key = f"{r.line.filename}:{r.line.lineno}" if r.line else "<no Python frame>"
            by_line[key] = by_line.get(key, 0) + r.nbytes
        for loc, b in sorted(by_line.items(), key=lambda kv: -kv[1])[:4]:
            lines.append(FindingLine(loc, b, "saved for backward by this line, still held", sign=False))
    held = f", holding {format_size(nbytes)} of saved tensors" if records else ""
    clause = (f"the autograd graphs of {nsteps} of the last {len(post)} steps are still reachable"
              f"{holder_text}{held}")
    return {"clause": clause, "numbers": numbers, "lines": lines}


# ---- fragmentation ----------------------------------------------------------------


def _fragmentation(obj, steps, warm, graph) -> List[Finding]:
    post = steps[warm:]
    out: List[Finding] = []
    done = set()
    long_steps = _long_input_positions(post)
    for dev in _devices(post):
        res, alloc = _series(post, dev, "reserved"), _series(post, dev, "allocated")
        if res is None or alloc is None:
            continue
        tr = _steady_rise(res, FRAG_REL, GROWTH_FLOOR, skip=long_steps)
        if tr is None or tr["ups"] < max(3, 0.3 * (len(res) - 1)):
            high = _stays_high(res, alloc, _series(post, dev, "allocated_peak"))
            if high is not None:
                high["device"] = dev
                _note_largest_free(high, obj, post, dev)
                msg = (f"PyTorch's reserved memory on {_dev(dev)} stays at {format_size(res[-1])} while "
                       f"allocated stays near {format_size(alloc[-1])} and the most ever allocated at "
                       f"once is {format_size(high['allocated_peak'])}: {format_size(high['never_used'])} "
                       "is reserved but served no request — the cached blocks do not fit the sizes asked for.")
                out.append(_frag_finding(msg, high, post, obj))
                done.add(dev)
            continue
        rise_a = alloc[-1] - alloc[0]
        apeak = _series(post, dev, "allocated_peak")
        rise_p = (apeak[-1] - apeak[0]) if apeak is not None else 0
        if rise_a > 0.25 * tr["rise"] or rise_p > 0.5 * tr["rise"]:
            continue
        unused = res[-1] - alloc[-1]
        numbers = {"device": dev, "reserved_start": res[0], "reserved_end": res[-1],
                   "allocated_start": alloc[0], "allocated_end": alloc[-1], "reserved_unused": unused,
                   "allocated_peak_rise": rise_p, "steps": len(res)}
        largest = _note_largest_free(numbers, obj, post, dev)
        msg = (f"PyTorch's reserved memory on {_dev(dev)} grew from {format_size(res[0])} to "
               f"{format_size(res[-1])} over {len(res)} steps while allocated stayed near "
               f"{format_size(alloc[-1])}, so {format_size(unused)} is reserved but unused"
               + (f" (largest free block {format_size(largest)})" if largest is not None else "")
               + ": the cached blocks do not fit the new sizes.")
        out.append(_frag_finding(msg, numbers, post, obj))
        done.add(dev)
    out.extend(_failed_with_free(obj, steps, done))
    out.extend(_near_full(obj, post, done))
    return out


FRAG_NEVER_USED = 256 * MiB  # reserved beyond the highest allocation ever ...
FRAG_NEVER_USED_REL = 0.30   # ... and this share of reserved


def _stays_high(res, alloc, apeak) -> Optional[dict]:
    """Reserved stays well above the most PyTorch ever had allocated at once
    (so it is not the cache of a step's activations) while allocated is flat."""
    if apeak is None or len(res) < 5:
        return None
    gaps = [r - p for r, p in zip(res, apeak)]
    high = sum(1 for r, g in zip(res, gaps) if g >= max(FRAG_NEVER_USED, FRAG_NEVER_USED_REL * r))
    if high < 0.8 * len(res) or abs(alloc[-1] - alloc[0]) > 0.25 * min(gaps):
        return None
    return {"reserved_start": res[0], "reserved_end": res[-1], "allocated_start": alloc[0],
            "allocated_end": alloc[-1], "allocated_peak": apeak[-1],
            "never_used": gaps[-1], "reserved_unused": res[-1] - alloc[-1], "steps": len(res)}


FRAG_FIX = ("Set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before CUDA starts, so the allocator "
            "grows its segments instead of caching blocks that fit no request.")


def _note_largest_free(numbers: dict, obj, post, dev) -> Optional[int]:
    """The largest free block on ``dev`` (see _largest_free), also put into a
    finding's ``numbers`` as ``largest_free_block`` when known."""
    largest = _largest_free(obj, post, dev)
    if largest is not None:
        numbers["largest_free_block"] = largest
    return largest


def _frag_finding(msg, numbers, post, obj=None) -> Finding:
    figures = _pool_figures(obj, numbers.get("device")) if obj is not None else None
    if figures is not None:  # where the free memory lies: how many gaps between live blocks
        numbers["free_gaps"] = figures["free_gaps"]
        numbers["segments"] = figures["segments"]
        msg += (f" Its {figures['segments']} segments hold {figures['free_gaps']} gaps between live "
                f"blocks, the largest {format_size(figures['largest_free'])}.")
    return Finding("fragmentation", msg, numbers, _grown_lines(post)[:3], FRAG_FIX)


def _pool_figures(obj, dev) -> Optional[dict]:
    """The live tracker's own figures for PyTorch's segments on ``dev``
    (the allocator route: from the live blocks; memviz.Snapshot.fragmentation),
    or None."""
    if not _is_live_tracker(obj):
        return None
    try:
        snap = obj.snapshot()
        return snap.fragmentation(dev).get(dev) if snap.segments else None
    except Exception:  # noqa: BLE001 - evidence only
        return None


def _largest_free(obj, post, dev) -> Optional[int]:
    for s in reversed(post):
        v = s.info.get("largest_free_block")
        if isinstance(v, int):
            return v
    figures = _pool_figures(obj, dev)
    if figures is not None:
        return figures["largest_free"]
    torch = _torch_cuda() if _is_live_tracker(obj) else None
    if torch is None:
        return None
    try:
        best = 0
        for seg in torch.cuda.memory_snapshot():
            if seg.get("device") != dev:
                continue
            for b in seg.get("blocks", []):
                if b.get("state") == "inactive":
                    best = max(best, b.get("size", 0))
        return best
    except Exception:  # noqa: BLE001
        return None


def _failed_with_free(obj, steps, done) -> List[Finding]:
    out = []
    failures = list(getattr(obj, "failures", None) or [])
    ts = [s.timestamp_ns for s in steps]
    for f in failures:
        dev = getattr(f, "device", None)
        if dev is None or dev < 0 or dev in done:
            continue
        i = bisect.bisect_right(ts, f.timestamp_ns) - 1
        d = steps[i].devices.get(dev) if i >= 0 else None
        if d is None or d.reserved is None or d.allocated is None:
            continue
        unused = d.reserved - d.allocated
        if unused < f.size:
            continue
        where = str(f.traceback) if getattr(f, "traceback", None) else "<no Python frame>"
        numbers = {"device": dev, "failed_size": f.size, "reserved": d.reserved, "allocated": d.allocated,
                   "reserved_unused": unused, "failed_at": where}
        msg = (f"An allocation of {format_size(f.size)} on {_dev(dev)} failed at {where} although "
               f"PyTorch held {format_size(unused)} reserved but unused: no cached block was large enough.")
        out.append(Finding("fragmentation", msg, numbers, [FindingLine(where, f.size, "failed", sign=False)],
                           FRAG_FIX))
        done.add(dev)
    return out


def _near_full(obj, post, done) -> List[Finding]:
    """Reserved stays near the card's size with much of it unused (live PyTorch only)."""
    torch = _torch_cuda() if _is_live_tracker(obj) else None
    if torch is None or len(post) < MIN_STEPS:
        return []
    out = []
    for dev in _devices(post):
        res, alloc = _series(post, dev, "reserved"), _series(post, dev, "allocated")
        if dev in done or res is None or alloc is None:
            continue
        try:
            total = torch.cuda.get_device_properties(dev).total_memory
        except Exception:  # noqa: BLE001
            continue
        high = sum(1 for r in res if r >= 0.85 * total)
        unused = res[-1] - alloc[-1]
        if high >= 0.6 * len(res) and unused >= 0.3 * res[-1]:
            numbers = {"device": dev, "reserved_end": res[-1], "allocated_end": alloc[-1],
                       "reserved_unused": unused, "device_total": total}
            msg = (f"PyTorch's reserved memory on {_dev(dev)} stays at {format_size(res[-1])} of the "
                   f"card's {format_size(total)} while only {format_size(alloc[-1])} is allocated.")
            out.append(_frag_finding(msg, numbers, post, obj))
    return out


# ---- input sizes (spike and fragmentation) ----------------------------------------


