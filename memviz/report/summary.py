"""What the text, JSON and HTML reports share: the steps and findings every
report shows, and how a line of source is named and shown.

:func:`step_summary` and :func:`finding_records` are the steps and findings
of a Tracker or a loaded trace as the text report (memviz/report/text.py),
the JSON report (memviz/cli/report.py) and the HTML page and notebook views
(memviz/report/html.py, notebook.py) give them. Imports the analysis floor
and below (docs/architecture.md); the rest of memviz/report reads it.
"""

from __future__ import annotations

import contextlib
import linecache
import os
import statistics
from collections.abc import Mapping
from typing import Any, Dict, Iterator, List, Optional, Tuple

from memviz._units import format_size

__all__ = ["STEP_SERIES", "step_records", "step_summary", "finding_steps", "finding_dict",
           "finding_records", "step_series_label", "short_path", "source_line", "device_name", "device_items",
           "flight_window", "flight_sentences", "rank_fields", "rank_name", "tensor_peaks",
           "before_tracking", "before_tracking_allocations", "sample_of", "sample_title", "sample_sentence",
           "shown_library", "recorded_source"]


def device_name(dev: int) -> str:
    """``cuda:N``, or ``pinned host`` for the host's page-locked memory (device -1)."""
    return "pinned host" if dev < 0 else f"cuda:{dev}"


def short_path(filename: str, limit: int = 40) -> str:
    """A path relative to the working directory when inside it, else shortened."""
    if filename.startswith("<"):
        return filename
    try:
        rel = os.path.relpath(filename)
        if not rel.startswith(".." + os.sep) and rel != "..":
            filename = rel
    except ValueError:  # pragma: no cover - other drive on Windows
        pass
    if len(filename) > limit:
        parts = filename.split(os.sep)
        filename = os.sep.join(["..."] + parts[-2:]) if len(parts) > 2 else filename
    return filename


def sample_of(recording: Any) -> Optional[Mapping]:
    """The description of memviz's shipped sample ("machine", "date",
    "script", "script_source") when ``recording`` is that trace
    (memviz.loaded.LoadedTrace.sample), else None."""
    sample = getattr(recording, "sample", None)
    return sample if isinstance(sample, Mapping) else None


def sample_title(sample: Mapping) -> str:
    """A sample report's title, in place of the recording's command line:
    ``SAMPLE (recorded on 2026-12-01, not on this machine): examples/basic.py``."""
    return (f"SAMPLE (recorded on {sample.get('date') or 'an unknown date'}, not on this machine): "
            f"{sample.get('script') or 'memviz/data/sample.memviz'}")


def sample_sentence(sample: Mapping) -> str:
    """What the sample is, in a sentence (without a final stop)."""
    return (f"a recording shipped with memviz as an example, made on "
            f"{sample.get('machine') or 'another machine'}: not this machine's data")


def shown_library(library: Any, sample: Optional[Mapping]) -> Any:
    """The capture library as a report names it: its path, or only its file
    name in the sample's report (the recording machine's paths are not
    shown)."""
    if sample is not None and isinstance(library, str):
        return os.path.basename(library)
    return library


@contextlib.contextmanager
def recorded_source(sample: Optional[Mapping]) -> Iterator[None]:
    """Within it, the sample's lines read as they were when it was recorded
    (its "script_source" put in linecache under its "script" name), not as
    that file reads now, if it exists here at all. Does nothing for None or
    a description without the script's text."""
    name = (sample or {}).get("script")
    text = (sample or {}).get("script_source")
    if not (isinstance(name, str) and name and isinstance(text, str) and text):
        yield
        return
    saved = linecache.cache.get(name)
    lines = text.splitlines(keepends=True)
    linecache.cache[name] = (len(text), None, lines, name)  # no mtime: never re-read
    try:
        yield
    finally:
        if saved is None:
            linecache.cache.pop(name, None)
        else:
            linecache.cache[name] = saved


def source_line(filename: str, lineno: int, width: int) -> str:
    """The stripped source text of a line, cut to ``width`` characters ("" when unknown)."""
    if lineno <= 0 or (filename.startswith("<") and filename not in linecache.cache):
        return ""  # a pseudo-file: none, but an IPython cell's (IPython puts its source in linecache)
    try:
        text = linecache.getline(filename, lineno).strip()
    except Exception:  # noqa: BLE001 - an odd loader must not break the report
        return ""
    width = max(width, 12)
    return text if len(text) <= width else text[: width - 3].rstrip() + "..."


#: the per-device numbers of a step the reports summarise: memviz's bytes at
#: the step's end (current) and its highest level inside the step (peak), and
#: PyTorch's allocated/reserved bytes (only when PyTorch had initialised CUDA)
STEP_SERIES = ("current", "peak", "allocated", "reserved")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def step_records(obj: Any) -> List[Any]:
    """The memviz step records (StepRecords) of a Tracker or a loaded trace;
    records the program appended to ``steps`` itself are left out."""
    steps = getattr(obj, "steps", None)
    if not steps:
        return []
    from memviz.analysis.findings import _as_records
    return _as_records(steps)


def _trend_start(n: int) -> int:
    """Position of the first step the trend reads: after diagnose()'s default
    warm-up (the first steps allocate weights and caches), if two are left."""
    from memviz.analysis.findings import _warmup
    warm = _warmup(n, None)
    return warm if n - warm >= 2 else 0


def _slope(points: List[Tuple[int, int]]) -> Optional[int]:
    """Bytes per step of the least-squares line through (step index, bytes)."""
    if len(points) < 2:
        return None
    mx = sum(p[0] for p in points) / len(points)
    my = sum(p[1] for p in points) / len(points)
    sxx = sum((p[0] - mx) ** 2 for p in points)
    if not sxx:
        return None
    return round(sum((p[0] - mx) * (p[1] - my) for p in points) / sxx)


def _series_summary(points: List[Tuple[int, int]], trend_from: int) -> Dict[str, Any]:
    low = min(points, key=lambda p: p[1])
    high = max(points, key=lambda p: p[1])
    return {"first": points[0][1], "last": points[-1][1], "min": low[1], "min_step": low[0],
            "max": high[1], "max_step": high[0],
            "trend_per_step": _slope([p for p in points if p[0] >= trend_from])}


def step_summary(obj: Any) -> Optional[Dict[str, Any]]:
    """The steps of a Tracker or a loaded trace in a few numbers, or None
    when it recorded no step.

    ``{"count", "first_step", "last_step", "median_step_s", "trend_from_step",
    "devices": [{"device", "name", SERIES: {"first", "last", "min", "min_step",
    "max", "max_step", "trend_per_step"}, ...}]}`` with SERIES each of
    :data:`STEP_SERIES` that the steps have for the device. Sizes are bytes;
    ``trend_per_step`` is the least-squares slope from ``trend_from_step`` (after
    the warm-up diagnose() skips) to the last step, None with fewer than two.
    """
    recs = step_records(obj)
    if not recs:
        return None
    trend_from = recs[_trend_start(len(recs))].index
    durations = [r.duration_ns for r in recs if r.duration_ns and r.duration_ns > 0]
    devices = []
    for dev in sorted({d for r in recs for d in r.devices}, key=lambda d: (d < 0, d)):
        entry: Dict[str, Any] = {"device": dev, "name": device_name(dev)}
        for name in STEP_SERIES:
            points = [(r.index, v) for r in recs
                      for v in (getattr(r.devices.get(dev), name, None),) if _is_int(v)]
            if points:
                entry[name] = _series_summary(points, trend_from)
        if len(entry) > 2:
            devices.append(entry)
    return {"count": len(recs), "first_step": recs[0].index, "last_step": recs[-1].index,
            "median_step_s": statistics.median(durations) / 1e9 if durations else None,
            "trend_from_step": trend_from, "devices": devices}


def finding_steps(numbers: Any) -> List[List[int]]:
    """The steps a finding concerns, as ``[first, last]`` index ranges, from
    its numbers: a spike's ``spike_steps``, a trend's ``first_step`` to
    ``last_step``, or one ``step``; [] when it names none (it concerns the run)."""
    if not isinstance(numbers, Mapping):
        return []
    spikes = numbers.get("spike_steps")
    if isinstance(spikes, (list, tuple)) and spikes and all(_is_int(s) for s in spikes):
        out: List[List[int]] = []
        for s in sorted(set(spikes)):
            if out and s == out[-1][1] + 1:
                out[-1][1] = s
            else:
                out.append([s, s])
        return out
    first, last = numbers.get("first_step"), numbers.get("last_step")
    if _is_int(first) and _is_int(last) and first <= last:
        return [[first, last]]
    step = numbers.get("step")
    return [[step, step]] if _is_int(step) else []


def _split_location(location: str) -> Tuple[str, int]:
    """("file", line) of a ``file:line`` location (line 0 when unknown)."""
    head, sep, tail = location.rpartition(":")
    if sep and head:
        if tail.isdigit():
            return head, int(tail)
        if tail == "?":
            return head, 0
    return location, 0


def _finding_line(x: Any) -> Dict[str, Any]:
    if isinstance(x, Mapping):
        location = str(x.get("location", ""))
        nbytes, note = x.get("bytes"), str(x.get("note") or "")
        text = str(x.get("text") or "") or location + (
            f": {format_size(nbytes, sign=True)}" if _is_int(nbytes) else "") + (f" ({note})" if note else "")
    elif hasattr(x, "location"):  # memviz.analysis.findings.FindingLine: "file:line: +72 MiB (note)"
        location, nbytes, note, text = str(x.location), getattr(x, "bytes", None), \
            str(getattr(x, "note", "") or ""), str(x)
    else:
        location, nbytes, note, text = str(x), None, "", str(x)
    filename, lineno = _split_location(location)
    return {"location": location, "file": filename, "line": lineno,
            "bytes": nbytes if _is_int(nbytes) else None, "note": note, "text": text}


def finding_dict(f: Any) -> Dict[str, Any]:
    """One finding (a memviz Finding, its dict, or a string) as the reports
    give it: ``{"kind", "message", "device", "step_ranges", "numbers", "lines":
    [{"location", "file", "line", "bytes", "note", "text"}], "fix"}``."""
    if isinstance(f, Mapping):
        d: Mapping[str, Any] = f
    elif isinstance(f, str):
        d = {"message": f}
    else:
        d = {k: getattr(f, k, None) for k in ("kind", "message", "numbers", "lines", "fix")}
    numbers = dict(d["numbers"]) if isinstance(d.get("numbers"), Mapping) else {}
    lines = d.get("lines") or []
    if isinstance(lines, (str, bytes, Mapping)) or not hasattr(lines, "__iter__"):
        lines = [lines]
    device = numbers.get("device")
    return {"kind": str(d.get("kind") or "finding"), "message": str(d.get("message") or ""),
            "device": device if _is_int(device) else None, "step_ranges": finding_steps(numbers),
            "numbers": numbers, "lines": [_finding_line(x) for x in lines],
            "fix": str(d.get("fix") or "")}


def finding_records(obj: Any) -> Tuple[List[Dict[str, Any]], Optional[str]]:
    """(``obj.diagnose()``'s findings as :func:`finding_dict` gives them, None),
    or ([], why there are none to show) when diagnosing failed."""
    fn = getattr(obj, "diagnose", None)
    if not callable(fn):
        return [], None
    try:
        raw = fn()
    except ImportError:
        return [], "diagnoses are not available in this memviz build"
    except Exception as e:  # noqa: BLE001 - a failed diagnosis must not cost the report
        return [], f"diagnose() failed: {type(e).__name__}: {e}"
    try:
        return [finding_dict(f) for f in raw or ()], None
    except Exception as e:  # noqa: BLE001 - an odd object from a duck-typed diagnose()
        return [], f"diagnose() gave what memviz cannot read: {type(e).__name__}: {e}"


def step_series_label(dev_name: str, series: str) -> str:
    """``cuda:0 current``, ``cuda:0 torch allocated``: a step series' name."""
    return f"{dev_name} {'torch ' + series if series in ('allocated', 'reserved') else series}"


def device_items(mapping: Mapping[Any, Any]) -> Iterator[Tuple[int, Any]]:
    """(device, value) of a mapping keyed by device number (``0`` or ``"0"``,
    as JSON writes it); keys that are not a number are skipped."""
    for k, v in mapping.items():
        try:
            dev = int(k)
        except (TypeError, ValueError):
            continue
        yield dev, v


def _u64(v: Any) -> int:
    return v if _is_int(v) and v >= 0 else 0


def flight_window(obj: Any) -> Optional[Dict[str, Any]]:
    """What a flight recorder's dump covers (its END record's
    "flight_recorder"), with times in seconds since tracking started; None
    for anything else (a live tracker, a streamed or saved trace)."""
    end = getattr(obj, "end", None)
    fr = end.get("flight_recorder") if isinstance(end, dict) else None
    if not isinstance(fr, dict):
        return None
    origin = _u64(fr.get("recording_started_ns")) or _u64(getattr(obj, "started_ns", None))

    def since(key: str) -> Optional[float]:
        ns = _u64(fr.get(key))
        return (ns - origin) / 1e9 if ns and origin and ns >= origin else None

    return {"reason": fr.get("reason") if isinstance(fr.get("reason"), str) else None,
            "budget": _u64(fr.get("budget")), "window_start_s": since("window_start_ns"),
            "window_end_s": since("window_end_ns"), "dumped_at_s": since("dumped_at_ns"),
            "events_kept": _u64(fr.get("events_kept")), "events_folded": _u64(fr.get("events_folded")),
            "folded_until_s": since("folded_until_ns"),
            "allocations_before_window": _u64(fr.get("allocations_before_window")),
            "events_dropped": _u64(fr.get("events_dropped"))}


def flight_sentences(obj: Any) -> List[str]:
    """The flight-recorder dump's coverage in words (empty for other recordings)."""
    w = flight_window(obj)
    if w is None:
        return []

    def at(s: Optional[float]) -> str:
        return f"{s:.2f} s" if s is not None else "?"

    out = [f"Flight-recorder dump ({w['reason'] or 'reason not recorded'}), budget "
           f"{format_size(w['budget'])}: it holds the {w['events_kept']:,} events from {at(w['window_start_s'])} "
           f"to {at(w['window_end_s'])} after tracking started."]
    if w["events_folded"]:
        out.append(f"The {w['events_folded']:,} events before them (up to {at(w['folded_until_s'])}) were "
                   "dropped from the ring to stay within the budget; what they left live, "
                   f"{w['allocations_before_window']:,} allocations, is kept with its lines, so the "
                   "live set and the snapshots are whole, but peaks before the window are not in it.")
    elif not w["events_dropped"]:
        out.append("No event was dropped from the ring: it covers the whole recording.")
    else:  # nothing folded away, but not whole either
        out.append("No event was folded away to stay within the budget: it starts when tracking "
                   "started, but it does not hold every event (below).")
    if w["events_dropped"]:
        out.append(f"{w['events_dropped']:,} events were lost because the capture ring was full "
                   "(GAP records).")
    return out


def rank_fields(obj: Any) -> Dict[str, Any]:
    """``{"rank", "local_rank", "world_size", "host"}`` of a recording: a
    loaded trace's from its file, a live Tracker's from this process's
    launcher (memviz.capture.rank_files); None where not known."""
    if getattr(obj, "is_live", False) is True:
        from memviz.capture.rank_files import rank_info, rank_of
        return dict(rank_info(), rank=rank_of())
    return {k: getattr(obj, k, None) for k in ("rank", "local_rank", "world_size", "host")}


def rank_name(fields: Mapping[str, Any]) -> Optional[str]:
    """``rank 1 of 4 (local rank 1 on gpu-node-3)``, or None outside a distributed run."""
    rank = fields.get("rank")
    if not _is_int(rank):
        return None
    world, local, host = fields.get("world_size"), fields.get("local_rank"), fields.get("host")
    text = f"rank {rank}" + (f" of {world}" if _is_int(world) else "")
    where = [f"local rank {local}"] if _is_int(local) else []
    if host:
        where.append(f"on {host}")
    return text + (f" ({' '.join(where)})" if where else "")


# ---- the past: two peaks, and what was there before tracking ------------------------


def tensor_peaks(obj: Any) -> Dict[int, Dict[str, int]]:
    """{device: {"current", "peak", "peak_timestamp_ns"}} of PyTorch's blocks
    alone (the tensor peak, ``max_memory_allocated()``) of a Tracker or a
    loaded trace; {} without the allocator route or where the recording
    cannot tell."""
    read = getattr(obj, "tensor_totals", None)
    try:
        return {int(d): dict(v) for d, v in (read() if read else {}).items() if v.get("peak")}
    except Exception:  # noqa: BLE001 - a figure for a report: the report comes out without it
        return {}


def before_tracking_allocations(*snaps: Any) -> List[Any]:
    """The allocations flagged ``before_tracking`` in any of the snapshots
    (None ones skipped), each once."""
    seen: Dict[Tuple[int, int, str], Any] = {}
    for snap in snaps:
        for a in (snap.allocations if snap is not None else ()):
            if a.before_tracking:
                seen.setdefault((a.device, a.address, a.kind), a)
    return list(seen.values())


def before_tracking(obj: Any) -> Dict[int, Dict[str, Any]]:
    """What PyTorch held when tracking started (memviz/torch/before.py), per
    device: ``{"bytes", "count", "categories": {category: bytes}}`` of the
    allocations flagged ``before_tracking`` (those live at the device's peak
    or at the end: a block freed unseen before both is not counted), and
    ``outside_at_start``, the device's used bytes beyond PyTorch's reserved
    ones then (the CUDA context, other libraries), where it was read. {}
    when nothing was there."""
    snaps = []
    for read in (lambda: obj.peak_snapshot(), lambda: obj.snapshot()):
        try:
            snaps.append(read())
        except Exception:  # noqa: BLE001
            continue
    out: Dict[int, Dict[str, Any]] = {}
    for a in before_tracking_allocations(*snaps):
        d = out.setdefault(a.device, {"bytes": 0, "count": 0, "categories": {}})
        d["bytes"] += a.size
        d["count"] += 1
        cat = a.category or "<unknown>"
        d["categories"][cat] = d["categories"].get(cat, 0) + a.size
    integ = getattr(obj, "torch", None)
    start = getattr(integ, "before_tracking", None) if integ is not None else None
    outside = (start or {}).get("outside")
    if outside is None:  # a loaded trace: its END record keeps it
        end = getattr(obj, "end", None) or {}
        for dev, entry in ((end.get("pytorch_peak") or {}).items() if isinstance(end, dict) else ()):
            if isinstance(entry, dict) and entry.get("outside_at_start") is not None:
                out.setdefault(int(dev), {"bytes": 0, "count": 0, "categories": {}})[
                    "outside_at_start"] = int(entry["outside_at_start"])
    else:
        dev = (start or {}).get("outside_device", 0)
        out.setdefault(int(dev), {"bytes": 0, "count": 0, "categories": {}})["outside_at_start"] = int(outside)
    return {d: v for d, v in out.items() if v["bytes"] or v.get("outside_at_start")}


def trace_losses(recording: Any) -> Optional[Dict[str, Any]]:
    """Events a streamed trace lost because its ring was full, and what that
    affects: {"lost", "capacity" (a live tracker's ring, else None),
    "live": whether the recording is the live tracker (its own figures come
    from the store, whole), "reconciled": whether the live set at the end
    was set right (LIVE chunk), "freed", "added"}; None when it lost none
    (or is a flight dump: memviz/report/summary.py's flight sentences say it)."""
    lost = getattr(recording, "dropped_events", None)
    if isinstance(lost, int):  # a loaded trace
        end = getattr(recording, "end", None) or {}
        if not lost or "flight_recorder" in end:
            return None
        return {"lost": lost, "capacity": None, "live": False,
                "reconciled": getattr(recording, "_reconciled", None) is not None or
                getattr(recording, "_live_end", None) is not None,
                "freed": getattr(recording, "gap_freed", 0), "added": getattr(recording, "gap_added", 0)}
    from memviz.trace.writer import TraceWriter

    for sub in getattr(recording, "subscribers", ()):  # a live tracker's: the capture session's
        if isinstance(sub, TraceWriter) and sub.dropped:
            return {"lost": sub.dropped, "capacity": sub.capacity, "live": True,
                    "reconciled": True, "freed": 0, "added": 0}
    return None


def trace_loss_sentences(loss: Dict[str, Any]) -> List[str]:
    """What trace_losses() found, in words: which figures it affects and
    which it does not."""
    from memviz.trace.format import RING_ENV

    n = loss["lost"]
    out = [f"The trace lost {n:,} events: its ring was full (the program allocated faster than "
           f"the writer drained it; set {RING_ENV}, e.g. {RING_ENV}=16M, before tracking for a "
           "bigger one)."]
    if loss["live"]:
        out.append("This tracker's own figures come from its store and are whole; the trace file's "
                   "peak, timeline, steps and events after the first loss miss the lost events.")
        return out
    out.append("Affected: the lines at each peak, the timeline, the step figures, "
               "snapshot(at_ns) and the events between the first loss and the end (allocations "
               "made while events were lost are missing there; ones freed then stay counted "
               "until the end)" + ("." if loss["reconciled"] else
                                   ", and the devices' totals and peaks, replayed from the events."))
    if loss["reconciled"]:
        out.append(f"Not affected: the devices' totals and peaks (the tracker's own, when it "
                   f"stopped) and the live set at the end, set right from the tracker's: "
                   f"{loss['freed']:,} allocations whose frees were lost are shown freed at the "
                   f"end (none of them is a leak), {loss['added']:,} made while events were lost "
                   "are added.")
    else:
        out.append("The trace has no live set from when tracking stopped (the process was killed "
                   "before): allocations live at the end may be ones whose frees were lost, so "
                   "they are not necessarily leaks.")
    return out

