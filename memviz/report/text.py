"""The plain-text report ``python -m memviz run`` prints when the script ends.

:func:`text_report` reads a (running or stopped) :class:`~memviz.Tracker` and
returns lines that fit a 100-column terminal: the capture source, per-device
totals, the lines that held the most memory at each device's peak, failed
allocations, the steps and what ``diagnose()`` found in them (when the run
recorded steps), memory the process holds outside the tracked allocations, and
memviz's own cost.

:func:`step_summary` and :func:`finding_records` (the steps and findings
every report shows) live in memviz/report/summary.py and are read here.
Imports the capture floor and below, and memviz.report.summary
(docs/architecture.md).
"""

from __future__ import annotations

import textwrap
import time
from typing import Any, Dict, List, Optional, Tuple

import memviz._core as _core
from memviz._args import given, recording as _recording_arg
from memviz._errors import InvalidArgument
from memviz._units import escape_controls, format_size
from memviz.capture.device import process_device_memory
from memviz.capture.availability import sources_line
from memviz.model.lines import line_frame, location as _written
from memviz.report.summary import (STEP_SERIES, before_tracking, device_name as _device_name, finding_records,
                                   flight_sentences, recorded_source, sample_of, sample_sentence, sample_title,
                                   shown_library, tensor_peaks, trace_loss_sentences, trace_losses,
                                   rank_fields, rank_name, short_path as _short_path, source_line as _source,
                                   step_series_label, step_summary)

__all__ = ["text_report", "summary", "GPU_OFF_SENTENCE", "NO_GPU_SENTENCE"]

WIDTH = 99  # a 100-column terminal, minus the cursor column
SOURCE_WIDTH = 60

#: printed (wrapped) when GPU capture is off because the machine has no usable GPU
NO_GPU_SENTENCE = (
    "GPU capture needs an NVIDIA GPU with its driver and CUPTI; on this machine memviz could "
    "only run the script: no GPU allocation was recorded, so this report has no GPU numbers."
)
#: printed when GPU capture was turned off on purpose (--no-gpu, gpu=False)
GPU_OFF_SENTENCE = (
    "GPU capture was turned off (--no-gpu or gpu=False): no GPU allocation was recorded."
)

_CUDA_ERRORS = {1: "invalid value", 2: "out of memory", 3: "not initialized", 201: "invalid context"}


def _wrap(text: str, indent: str = "  ", first: Optional[str] = None) -> List[str]:
    return textwrap.wrap(text, WIDTH, initial_indent=indent if first is None else first,
                         subsequent_indent=indent, break_on_hyphens=False) or [indent.rstrip()]


def _location(frame: Any) -> Tuple[str, str, int]:
    """(shown location, file name, line number) of a statistic's key frame."""
    filename = getattr(frame, "filename", str(frame))
    lineno = getattr(frame, "lineno", 0) or 0
    return _written(frame, _short_path), filename, lineno


def _count(n: int, word: str = "alloc") -> str:
    return f"{n:,} {word}" + ("" if n == 1 else "s")


def _header(tracker: Any, info: Dict[str, Any], command: Optional[str]) -> List[str]:
    sample = sample_of(tracker)
    if sample is not None:  # headed as a sample, not by the recording machine's command line
        lines = _wrap(sample_title(sample), first="", indent="    ")
        lines += _wrap(sample_sentence(sample) + ".", indent="    ", first="  ")
    else:  # a long command (a trace's, recorded under pytest) wraps like every other line
        lines = _wrap("memviz report" + (f": {command}" if command else ""), first="", indent="    ")
    lines.append("=" * min(WIDTH, 60))
    rank = rank_name(rank_fields(tracker))
    if rank is not None:  # one process of a distributed run (torchrun)
        lines += _wrap(rank, indent="    ", first="  ")
    if tracker.started_ns is not None:
        end = tracker.stopped_ns if tracker.stopped_ns is not None else time.monotonic_ns()
        seconds = (end - tracker.started_ns) / 1e9
        state = "" if tracker.stopped_ns is not None else " (still running)"
        lines.append(f"  tracked for {seconds:.2f} s{state}; Python frames ABI "
                     f"{info.get('python_frames_abi', '?')}; up to {tracker.depth} frames kept "
                     "per allocation")
    sources = info.get("sources") if isinstance(info.get("sources"), dict) else None
    how = sources_line(sources)
    if tracker.gpu_enabled and sources is not None and not (sources.get("cupti") or {}).get("used"):
        lines += _wrap(f"capture: {how or 'without CUPTI'}", indent="    ", first="  ")
    elif tracker.gpu_enabled:
        version = info.get("version")
        cuda = f", CUDA {info['cuda_major']}" if info.get("cuda_major") else ""
        found = f"; found by: {info['found_by']}" if info.get("found_by") else ""
        library = shown_library(info.get("library"), sample)
        lines += _wrap(f"capture: CUPTI {library} (version {version}{cuda}{found})"
                       + (f"; {how}" if how else ""), indent="    ", first="  ")
        if tracker.activity_error:
            lines += _wrap(f"activity records off (static module memory not seen): "
                           f"{tracker.activity_error}", indent="    ", first="  ")
    else:
        reason = tracker.gpu_off_reason or info.get("reason") or "unknown reason"
        lines += _wrap(f"GPU capture off: {reason.rstrip('.')}.", indent="    ", first="  ")
        sentence = NO_GPU_SENTENCE if tracker.gpu_requested else GPU_OFF_SENTENCE
        lines += _wrap(sentence, indent="    ", first="  ")
    for sentence in flight_sentences(tracker):
        lines += _wrap(sentence, indent="    ", first="  ")
    return lines


def _devices(totals: Dict[int, Dict[str, int]]) -> List[str]:
    lines = ["", "Devices" + " " * 13 + f"{'current':>12}{'peak':>12}{'allocs':>12}"
             f"{'frees':>12}{'failed':>9}"]
    if not totals:
        lines.append("  no GPU allocation was recorded")
        return lines
    for dev in sorted(totals, key=lambda d: (d < 0, d)):
        t = totals[dev]
        lines.append(f"  {_device_name(dev):<18}{format_size(t['current']):>12}"
                     f"{format_size(t['peak']):>12}{t['allocs']:>12,}{t['frees']:>12,}"
                     f"{t['failed']:>9,}")
    return lines


def _line_rows(stats: List[Any], top: int, none: str) -> List[str]:
    """The first ``top`` line statistics, each with its source, and what the
    rest hold; ``none`` when there are none."""
    if not stats:
        return [f"  ({none})"]
    lines: List[str] = []
    rows = [(format_size(s.size), _count(s.count), *_location(s.key)) for s in stats[:top]]
    loc_width = min(max(len(r[2]) for r in rows), 44)
    for size, count, loc, filename, lineno in rows:
        left = f"  {size:>10}  {count:<11} {loc:<{loc_width}}"
        src = _source(filename, lineno, min(SOURCE_WIDTH, WIDTH - len(left) - 2))
        lines.append(f"{left}  {src}".rstrip())
    rest = stats[top:]
    if rest:
        lines.append(f"  ... {len(rest):,} more line(s) holding "
                     f"{format_size(sum(s.size for s in rest))}")
    return lines


def _top_lines(tracker: Any, totals: Dict[int, Dict[str, int]], top: int) -> List[str]:
    lines: List[str] = []
    for dev in sorted(totals, key=lambda d: (d < 0, d)):
        if totals[dev]["peak"] <= 0:
            continue
        snap = tracker.peak_snapshot(dev)
        stats = snap.statistics("lineno")
        lines += ["", f"Top lines at the peak of {_device_name(dev)} "
                      f"({format_size(totals[dev]['peak'])}):"]
        lines += _line_rows(stats, top, "no allocation was live at the peak")
        if not stats:
            continue
        calls = [s for s in snap.statistics("op") if s.key != "<no call>"][:top]
        if calls:
            lines += ["", f"By call at the peak of {_device_name(dev)} (what the innermost Python "
                          f"frame was calling):"]
            lines += [f"  {format_size(s.size):>10}  {_count(s.count):<11} {s.key}" for s in calls]
    return lines


def _tensor_peaks(tracker: Any, top: int) -> List[str]:
    """The tensor peak of each device (PyTorch's blocks alone, its
    max_memory_allocated()) and the lines live then: what to shrink. The
    device's peak above is what an out-of-memory error is about."""
    lines: List[str] = []
    for dev, t in sorted(tensor_peaks(tracker).items()):
        try:
            snap = tracker.peak_snapshot(dev, peak="tensor")
        except Exception:  # noqa: BLE001 - a report comes out without it
            continue
        stats = [s for s in snap.statistics("lineno") if s.size]
        lines += ["", f"Top lines at the tensor peak of {_device_name(dev)} ({format_size(t['peak'])}: "
                      f"PyTorch's max_memory_allocated()):"]
        lines += _line_rows(stats, top, "no allocation was live at the tensor peak")
        if snap.size_note:
            lines += _wrap(f"Note: {snap.size_note}.", indent="  ")
    return lines


def _before(tracker: Any) -> List[str]:
    """What PyTorch held when tracking started, by category."""
    found = before_tracking(tracker)
    if not found:
        return []
    lines = ["", "Before tracking started (read from PyTorch then; every view above includes it):"]
    for dev, d in sorted(found.items()):
        if d["bytes"]:
            cats = ", ".join(f"{c} {format_size(v)}" for c, v in
                             sorted(d["categories"].items(), key=lambda kv: -kv[1]))
            lines += _wrap(f"{format_size(d['bytes'])} held by PyTorch "
                           f"({_count(d['count'], 'allocation')}): {cats}",
                           indent=" " * 13, first=f"  {_device_name(dev):<8} ")
        if d.get("outside_at_start") is not None:
            lines.append(f"  {_device_name(dev):<8} {format_size(d['outside_at_start']):>10} in use on "
                         f"the device beyond PyTorch's pool then (the CUDA context,")
            lines.append(f"{'':22}other libraries; the driver's count)")
    return lines


def _failures(tracker: Any, top: int) -> List[str]:
    failures = tracker.failures
    if not failures:
        return []
    lines = ["", f"Failed allocations ({len(failures):,}"
                 + (f", the last {top} shown" if len(failures) > top else "") + "):"]
    for f in failures[-top:]:
        loc, filename, lineno = _location(line_frame(f))
        why = _CUDA_ERRORS.get(f.result)
        err = f"CUDA error {f.result}" + (f": {why}" if why else "")
        lines.append(f"  {format_size(f.size):>10} on {_device_name(f.device):<11} {loc}  ({err})")
        src = _source(filename, lineno, WIDTH - 14)
        if src:
            lines.append(f"{'':13}{src}")
    return lines


def _seconds(s: float) -> str:
    if s >= 1:
        return f"{s:.3g} s"
    return f"{s * 1e3:.3g} ms" if s >= 1e-3 else f"{s * 1e6:.3g} us"


def _steps(tracker: Any, summary: Optional[Dict[str, Any]]) -> List[str]:
    if summary is None:
        return []
    n, first, last = summary["count"], summary["first_step"], summary["last_step"]
    head = f"Steps: {n:,} recorded (" + (f"steps {first} to {last}" if n > 1 else f"step {first}") + ")"
    if summary["median_step_s"] is not None:
        head += f", {_seconds(summary['median_step_s'])} per step (median)"
    lines = ["", head + ":"]
    if summary["devices"]:
        lines.append(f"  {'':<26}{'first':>11}{'last':>11}{'min':>11}{'max':>11}{'trend/step':>13}")
    for d in summary["devices"]:
        for name in STEP_SERIES:
            s = d.get(name)
            if s is None:
                continue
            trend = s["trend_per_step"]
            lines.append(f"  {step_series_label(d['name'], name):<26}" + "".join(
                f"{format_size(s[k]):>11}" for k in ("first", "last", "min", "max"))
                + f"{format_size(trend, sign=True) if trend is not None else '-':>13}")
    if not summary["devices"]:
        lines.append("  no GPU memory was seen at the steps")
    elif n > 1:
        lines += _wrap(f"current: memviz's bytes at the step's end; peak: the highest level inside "
                       f"the step; trend: the least-squares slope from step "
                       f"{summary['trend_from_step']} to step {last}"
                       + (" (after the warm-up)." if summary["trend_from_step"] != first else "."))
    return lines


def _findings(tracker: Any, summary: Optional[Dict[str, Any]]) -> List[str]:
    found, why = finding_records(tracker)
    if summary is None and not found:
        return []  # no steps: nothing to diagnose, nothing to say
    head = "Findings (memviz.diagnose)"
    if why is not None:
        return [""] + _wrap(f"{head}: none shown, {why}.", first="", indent="  ")
    if not found:
        from memviz.analysis.findings import MIN_STEPS, _warmup
        n = summary["count"] if summary is not None else 0
        need = _warmup(n, None) + MIN_STEPS
        if n < need:
            text = (f"none; {n} step{' is' if n == 1 else 's are'} too few for its trend rules, which "
                    f"skip {need - MIN_STEPS} warm-up steps and need {MIN_STEPS} more.")
        else:
            text = ("none; the steps show no growth, fragmentation, spike, cache churn or memory "
                    "outside PyTorch.")
        return [""] + _wrap(f"{head}: {text}", first="", indent="  ")
    lines = ["", f"{head}: {len(found)}"]
    for f in found:
        lines += _wrap(f"[{f['kind']}] {f['message']}", indent="      ", first="  ")
        for ln in f["lines"]:
            shown = ln["text"]
            if ln["file"] and ln["location"] and shown.startswith(ln["location"]):
                where = _location(_Loc(ln["file"], ln["line"]))[0] if ln["line"] else ln["location"]
                shown = where + shown[len(ln["location"]):]
            lines += _wrap(shown, indent="        ", first="      ")
            src = _source(ln["file"], ln["line"], WIDTH - 10)
            if src:
                lines.append(f"          {src}")
        if f["fix"]:
            lines += _wrap(f"fix: {f['fix']}", indent="        ", first="      ")
    return lines


class _Loc:
    """A frame-like (filename, lineno) for :func:`_location`."""

    def __init__(self, filename: str, lineno: int) -> None:
        self.filename, self.lineno = filename, lineno


def _outside(tracker: Any, totals: Dict[int, Dict[str, int]],
             outside: Dict[int, Tuple[int, str]], before_tracking: Any = None) -> List[str]:
    from memviz.report.outside import outside_section, section_lines

    section = outside_section(tracker, outside, before_tracking=before_tracking)
    lines = ["", "Memory outside the tracked allocations (held by the process, not seen by memviz):"]
    for indent, text in section_lines(section, format_size):
        lines += _wrap(text, indent=indent)
    return lines


def _pytorch(tracker: Any, totals: Dict[int, Dict[str, int]]) -> List[str]:
    """Categories at each device's peak, PyTorch's own figures, and the
    out-of-memory report, when the PyTorch integration was attached."""
    if getattr(tracker, "torch", None) is None:
        return []
    lines: List[str] = []
    route = getattr(tracker.torch, "route", None)
    if route is not None:
        lines += [""] + _wrap(f"PyTorch memory seen through: {route.route}"
                              + (f" ({route.reason})" if route.reason else " (every block of its caching allocator)")
                              + ".", first="", indent="  ")
    for dev in sorted(d for d in totals if d >= 0):
        try:
            snap = tracker.peak_snapshot(dev)
        except Exception:  # noqa: BLE001 - a report must come out
            continue
        cats = [s for s in snap.statistics("category") if s.key != "<unknown>"]
        if cats:
            lines += ["", f"By category at the peak of {_device_name(dev)}:"]
            lines += [f"  {format_size(s.size):>10}  {_count(s.count):<10}  {s.key}" for s in cats]
        frag = snap.fragmentation(dev).get(dev)
        if frag:
            lines.append(f"  PyTorch's segments then: {frag['segments']} holding {format_size(frag['reserved'])}, "
                         f"{format_size(frag['unused'])} unused in {frag['free_gaps']} gaps "
                         f"(largest {format_size(frag['largest_free'])})")
        stats = getattr(snap, "torch_stats", {}).get(dev)
        if stats:
            lines.append(f"  PyTorch now: {format_size(stats['allocated'])} allocated, "
                         f"{format_size(stats['reserved'])} reserved, {format_size(stats['active'])} active "
                         f"(peak allocated {format_size(stats['peak_allocated'])})")
            if stats.get("graph_pools_reserved"):
                lines.append(f"  CUDA graph pools: {format_size(stats['graph_pools_reserved'])} reserved, "
                             f"{format_size(stats.get('graph_pools_allocated', 0))} held by their blocks "
                             f"(replays allocate nothing)")
            if getattr(tracker, "precise", False):
                # Precise mode: memviz's tensors are the allocations; the pool's growth
                # beyond them is the driver's, reported apart.
                trims = tracker.capture_info().get("store", {}).get("calls", {}).get("pool_trim", 0)
                lines.append(f"  stream-ordered pool: {format_size(max(0, stats['reserved'] - stats['allocated']))}"
                             f" held by the pool beyond live tensors; {trims} pool trims")
    oom = getattr(tracker, "oom_report", None)
    if oom is not None:
        lines.append("")
        for line in str(oom).splitlines():
            lead = line[: len(line) - len(line.lstrip())]
            lines += [line] if len(line) <= WIDTH else _wrap(line.strip(), indent=lead + "    ", first=lead)
    return lines


def _own(info: Dict[str, Any], loss: Optional[Dict[str, Any]] = None) -> List[str]:
    store = info.get("store")
    if store is None:
        lines = ["", "memviz itself: GPU capture was off, so memviz recorded nothing."]
        for sentence in trace_loss_sentences(loss) if loss else ():
            lines += _wrap(sentence)
        return lines
    calls = dict(store.get("calls") or {})
    records = calls.pop("activity_records", 0)
    seen = sum(calls.values())
    dropped = store.get("dropped_allocs", 0) + store.get("dropped_stacks", 0)
    lost = (loss or {}).get("lost", 0)
    text = (f"memviz itself: {format_size(store.get('bytes_used', 0))} of host memory; "
            f"{seen:,} driver calls seen" + (f", {records:,} activity records" if records else "")
            + f", {store.get('unmatched_frees', 0):,} unmatched frees, {dropped:,} dropped by "
            "the store" + (f", {lost:,} events lost by the trace" if lost else "") + ".")
    lines = [""] + _wrap(text, first="", indent="  ")
    for sentence in trace_loss_sentences(loss) if lost else ():
        lines += _wrap(sentence)
    if store.get("unmatched_frees"):
        lines += _wrap("Unmatched frees release memory allocated before tracking started.")
    if dropped:
        lines += _wrap(f"memviz's store was full: {store.get('dropped_allocs', 0):,} allocations "
                       f"and {store.get('dropped_stacks', 0):,} stacks were not recorded, so "
                       "the numbers above are too low.")
    return lines


def text_report(tracker: Any, top: int = 10, outside: Optional[Dict[int, Tuple[int, str]]] = None,
                *, command: Optional[str] = None, before_tracking: Any = None) -> str:
    """The plain-text report of a tracker, lines at most 99 characters wide.

    Args:
        tracker: a started :class:`~memviz.Tracker` (running or stopped).
        top: how many lines to list per device at its peak (and failures).
        outside: ``{device: (bytes, source)}`` of what the process holds per
            device; ``None`` asks :func:`memviz.capture.device.process_device_memory`.
        command: what ran (shown in the title), e.g. ``"python train.py"``;
            the sample trace shipped with memviz (``tracker.sample``: see
            memviz.loaded.LoadedTrace) is headed as a sample instead, its
            lines read as recorded and no path of its machine shown.
        before_tracking: ``{device: {category: bytes}}`` of allocations
            recorded as made before tracking, for the outside section
            (memviz/report/outside.py); None: not known.

    Raises :class:`~memviz.NotTracking` for a tracker that never started.
    """
    if isinstance(top, bool) or not isinstance(top, int) or top < 1:
        raise InvalidArgument(f"top must be a positive int, got {given(top)}")
    totals = tracker.totals()
    if tracker.gpu_enabled:
        info = tracker.capture_info()
    else:
        # Tracker.capture_info() would try to load libcupti (to say which one
        # would be used); a report must not change the process, so skip it.
        info = {"python_frames_abi": _core.FRAMES_ABI, "store": None}
    if outside is None:
        outside = process_device_memory()
    with recorded_source(sample_of(tracker)):  # the sample's lines as recorded
        lines = _header(tracker, info, command)
        lines += _devices(totals)
        lines += _top_lines(tracker, totals, top)
        lines += _tensor_peaks(tracker, top)
        lines += _before(tracker)
        lines += _failures(tracker, top)
        lines += _pytorch(tracker, totals)
        summary = step_summary(tracker)
        lines += _steps(tracker, summary)
        lines += _findings(tracker, summary)
        lines += _outside(tracker, totals, outside, before_tracking)
        lines += _own(info, trace_losses(tracker))
    # File names that are not UTF-8 (surrogates), and control characters and
    # bidirectional overrides of any name (a file name that clears the screen
    # or writes the clipboard), are shown escaped: the report can be printed
    # or written anywhere.
    return escape_controls("\n".join(lines) + "\n")


def summary(recording: Any = None, top: int = 10) -> str:
    """The text report of a recording, as ``memviz run`` prints it (what
    ``torch.cuda.memory_summary()`` is to PyTorch): of a tracker, running
    or stopped, or of a loaded trace; of the running tracker when None.

    Raises :class:`~memviz.NotTracking` when None is given and no tracker
    runs (pass the tracker: ``memviz.summary(t)``)."""
    from memviz._errors import NotTracking
    from memviz.capture.session import active_tracker

    if recording is None:
        recording = active_tracker()
        if recording is None:
            raise NotTracking("memviz.summary() reports the running tracker, and none runs. What to do: "
                              "pass a tracker or a loaded trace, memviz.summary(t) (a stopped tracker "
                              "keeps its figures), or call it inside `with memviz.track() as t:`")
    _recording_arg(recording, "memviz.summary()")
    if getattr(recording, "is_live", True) is False:  # a trace read back: its own record of outside
        return text_report(recording, top=top, outside=getattr(recording, "outside", None),
                           command=getattr(recording, "command", None))
    return text_report(recording, top=top)
