"""Per-step memory records: ``tracker.step(**info)`` and ``memviz.watch(optimizer)``.

Call ``t.step()`` at the end of each training step (or let
``memviz.watch(optimizer)`` do it after every ``optimizer.step()``). Each call
appends a :class:`StepRecord` to ``tracker.steps`` with, per device: the
driver-level bytes memviz sees, the highest level inside the step, the growth
since the previous step, PyTorch's allocated/reserved bytes (when PyTorch has
initialised CUDA), the segments allocated and freed during the step, and the
lines whose surviving allocations grew. ``memviz.diagnose()`` reads them.

Cost: one ``_core.step_mark()`` (O(call sites), not O(live allocations)), one
``_core.totals()``, a few dictionary look-ups; line resolutions are cached per
call site. ``benchmarks/bench_step.py`` measures it.

Sinks receive every record: a callback, the ``memviz`` logger, a print every N
steps, a JSON-lines file, a CSV file, a TensorBoard ``SummaryWriter``; they
live in memviz/analysis/sinks.py. Imports the model and capture floors and
below (docs/architecture.md).
"""

from __future__ import annotations

import heapq
import numbers
import sys
import threading
import time
import warnings
import weakref
from typing import Any, Dict, List, Optional, Tuple

import memviz._core as _core
from memviz._errors import InvalidArgumentType, NotTracking
from memviz.analysis.sinks import _check_sink_names, _emit, _refuse_same_files, _Sink, make_sinks
from memviz.capture import events as _events, session as _session
from memviz.model import compiled as _compiled
from memviz.model.frame_filter import frames as _default_filter, warning_site
from memviz.model.steps import DeviceStep, GrowthLine, StepRecord
from memviz.model.traceback import Frame

__all__ = ["StepRecord", "DeviceStep", "GrowthLine", "record_step", "send_step", "on_step", "watch",
           "WatchHandle", "TOP_LINES"]

#: lines kept per step (largest growth first)
TOP_LINES = 5
_NO_FRAMES = Frame("<no Python frames>", 0, "")


# ---- recording ----------------------------------------------------------------


class _StepState(_events.CaptureEvents):
    """Per-tracker state: previous totals, cached line resolutions, sinks;
    subscribed to the capture session for its tracker, it hears the steps
    (and sends them to the sinks) and the stop (and closes them)."""

    def __init__(self, tracker) -> None:
        self.lock = threading.Lock()
        self.raw: Dict[int, Tuple[Frame, ...]] = {}  # stack id -> frames (innermost first)
        self.picked: Dict[int, Frame] = {}  # stack id -> the user's frame
        self.filter_gen = None
        self.last_ts = tracker.started_ns or time.monotonic_ns()
        self.last_current: Dict[int, int] = {}
        self.last_counts: Dict[int, Tuple[int, int, int]] = {}
        self.sinks: List[_Sink] = []
        self.torch_devices: Optional[int] = None

    def on_step(self, tracker, record) -> None:
        """Send the record to the sinks."""
        with self.lock:
            sinks = list(self.sinks)
        _emit(sinks, record)

    def on_stop(self, tracker) -> None:
        """Close the file sinks (each waits for a record it is writing). Not
        under self.lock: the session holds its lock here, and a step holds
        self.lock while it takes the session's (step_mark)."""
        for s in list(self.sinks):
            s.close()

    def user_frames(self, flt, ids: List[int]) -> Dict[int, Frame]:
        gen = flt.generation
        if gen != self.filter_gen:
            self.picked.clear()
            self.filter_gen = gen
        missing = [i for i in ids if i not in self.raw and i != 0]
        if missing:
            compiled = _compiled.active()
            for sid, frames in _core.resolve(missing).items():
                done = _compiled.expand(frames) if compiled else None  # the model's lines (as snapshots)
                self.raw[sid] = tuple(done[0]) if done else tuple(
                    Frame(fn or "<unknown>", ln if ln and ln > 0 else 0, nm or "") for fn, ln, nm in frames)
        out = {}
        for i in ids:
            f = self.picked.get(i)
            if f is None:
                frames = self.raw.get(i)
                f = (flt.pick(frames) if frames else None) or _NO_FRAMES
                self.picked[i] = f
            out[i] = f
        return out


def _state(tracker) -> _StepState:
    """``tracker``'s step state, subscribed to the capture session the first time."""
    session = _session.current()
    with session.lock:
        found = session.subscribers(tracker, _StepState)
        if found:
            return found[0]
        st = _StepState(tracker)
        session.subscribe(tracker, st)
        return st


def _norm_info(value: Any) -> Any:
    """Keep info JSON-friendly and cheap: shapes become tuples of ints, and a
    0-d tensor or array (``loss=loss``, ``tokens=n``) its number (a CUDA
    tensor's waits for the GPU, as ``float(loss)`` does)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, (tuple, list)) and all(isinstance(v, numbers.Integral) for v in value):
        return tuple(int(v) for v in value)
    shape = getattr(value, "shape", None)
    if shape is not None:
        try:
            dims = tuple(int(s) for s in shape)
        except (TypeError, ValueError):
            dims = None
        if dims == () and callable(getattr(value, "item", None)):
            try:
                number = value.item()
            except Exception:  # noqa: BLE001 - a value that cannot say its number: its text below
                number = None
            if isinstance(number, bool):
                return number
            if isinstance(number, numbers.Integral):
                return int(number)
            if isinstance(number, numbers.Real):
                return float(number)
        elif dims is not None:
            return dims
    text = str(value)
    return text if len(text) <= 200 else text[:197] + "..."


def _torch_numbers(st: _StepState, devices) -> Dict[int, Tuple[int, int, int]]:
    """{device: (allocated, reserved, allocated_peak)} from PyTorch, or {}.

    Only when torch is imported and has initialised CUDA; one call per device
    of ``torch._C._cuda_memoryStats`` (the nested dict, without the Python
    flattening that torch.cuda.memory_allocated() does)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return {}
    cuda = getattr(torch, "cuda", None)
    try:
        if cuda is None or not cuda.is_initialized():
            return {}
        if st.torch_devices is None:
            st.torch_devices = cuda.device_count()
        devs = {d for d in devices if 0 <= d < st.torch_devices}
        devs.add(cuda.current_device())
        fn = getattr(torch._C, "_cuda_memoryStats", None)
        out = {}
        for d in devs:
            if fn is not None:
                s = fn(d)
                a, r = s["allocated_bytes"]["all"], s["reserved_bytes"]["all"]
                out[d] = (a["current"], r["current"], a["peak"])
            else:  # pragma: no cover - older/newer torch without the private call
                out[d] = (cuda.memory_allocated(d), cuda.memory_reserved(d), cuda.max_memory_allocated(d))
        return out
    except Exception:  # noqa: BLE001 - a step record must never break training
        return {}


def _autograd_seq() -> Optional[int]:
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    fn = getattr(getattr(getattr(torch, "_C", None), "_autograd", None), "_get_sequence_nr", None)
    try:
        return fn() - 1 if fn is not None else None
    except Exception:  # noqa: BLE001
        return None


def record_step(tracker, **info: Any) -> StepRecord:
    """Record the end of a step on ``tracker``: append a :class:`StepRecord`
    to ``tracker.steps``, send it to the sinks and return it."""
    rec = _record(tracker, info)
    send_step(tracker, rec)
    return rec


def send_step(tracker, rec: StepRecord, sinks: Optional[List[_Sink]] = None) -> None:
    """Send a new step record to ``tracker``'s subscribers (through the
    capture session: its step state's sinks hear it) and then to ``sinks``;
    a step file's write error comes after every sink had the record."""
    try:
        _session.current().step(tracker, rec)
    finally:
        if sinks:
            _emit(sinks, rec)


def _record(tracker, info: Dict[str, Any]) -> StepRecord:
    """The new record, appended to ``tracker.steps``."""
    if not getattr(tracker, "running", False):
        raise NotTracking(
            "t.step() needs a running tracker: call it inside `with memviz.track() as t:` "
            "(or between memviz.start() and memviz.stop()).")
    st = _state(tracker)
    with st.lock:
        now = time.monotonic_ns()
        devs, changed = tracker._step_mark()  # a nested tracker's own window
        totals = tracker.totals()
        seq = _autograd_seq()
        torch_nums = _torch_numbers(st, devs)
        devices: Dict[int, DeviceStep] = {}
        for dev, mark in devs.items():
            cur, wpeak, live = mark.current, mark.window_peak, mark.live_count
            tot = totals.get(dev)
            counts = (tot["allocs"], tot["frees"], tot["alloc_bytes"]) if tot else (0, 0, 0)
            prev = st.last_counts.get(dev, (0, 0, 0))
            st.last_counts[dev] = counts
            devices[dev] = DeviceStep(cur, wpeak, cur - st.last_current.get(dev, 0), live,
                                      counts[0] - prev[0], counts[1] - prev[1], counts[2] - prev[2])
            st.last_current[dev] = cur
        for dev, (alloc, res, apeak) in torch_nums.items():
            d = devices.get(dev)
            if d is None:
                d = devices[dev] = DeviceStep()
            d.allocated, d.reserved, d.allocated_peak = alloc, res, apeak
        rec = StepRecord(len(tracker.steps), now, now - st.last_ts, devices,
                         _growth_lines(st, tracker, changed),
                         {k: _norm_info(v) for k, v in info.items()}, seq)
        st.last_ts = now
        tracker.steps.append(rec)
    return rec


def _growth_lines(st: _StepState, tracker, changed) -> List[GrowthLine]:
    """The lines whose live memory grew in the step: the most by all their
    bytes, and the most by PyTorch's blocks alone (on the allocator route a
    line's segments hold blocks counted at their own lines: a finding about
    PyTorch's allocated memory reads the blocks)."""
    grew = [c for c in changed if c.delta_bytes > 0 or c.block_delta > 0]
    if not grew:
        return []
    if len(grew) > 4 * TOP_LINES:
        grew = list({id(c): c for c in heapq.nlargest(4 * TOP_LINES, grew, key=lambda c: c.delta_bytes)
                     + heapq.nlargest(4 * TOP_LINES, grew, key=lambda c: c.block_delta)}.values())
    flt = tracker.frame_filter or _default_filter
    frames = st.user_frames(flt, [c.stack_id for c in grew])
    # One entry per location ("file:line"): two functions on one line (a
    # lambda and its caller) are one line, named after the one that grew more.
    by_line: Dict[str, list] = {}
    for c in grew:
        d_b, d_n, live_b, live_n = c.delta_bytes, c.delta_count, c.live_bytes, c.live_count
        f = frames[c.stack_id]
        loc = str(f)
        agg = by_line.get(loc)
        if agg is None:
            by_line[loc] = [d_b, d_n, live_b, live_n, {f.name: d_b}, c.block_delta, c.block_bytes]
        else:
            agg[0] += d_b
            agg[1] += d_n
            agg[2] += live_b
            agg[3] += live_n
            agg[4][f.name] = agg[4].get(f.name, 0) + d_b
            agg[5] += c.block_delta
            agg[6] += c.block_bytes
    items = list(by_line.items())
    top = {loc: a for loc, a in sorted(items, key=lambda kv: -kv[1][0])[:TOP_LINES]}
    for loc, a in sorted(items, key=lambda kv: -kv[1][5])[:TOP_LINES]:
        if a[5] > 0:
            top.setdefault(loc, a)
    return [GrowthLine(loc, max(a[4], key=a[4].__getitem__), a[0], a[1], a[2], a[3], a[5], a[6])
            for loc, a in top.items()]


# ---- on_step ----------------------------------------------------------------------


class _SinkHandle:
    """Returned by :func:`on_step`: ``remove()`` detaches (and closes) its sinks."""

    def __init__(self, state: _StepState, sinks: List[_Sink]) -> None:
        self._state, self.sinks = state, sinks

    def remove(self) -> None:
        with self._state.lock:
            self._state.sinks[:] = [s for s in self._state.sinks if s not in self.sinks]
        for s in self.sinks:
            s.close()


def on_step(tracker, **sinks) -> _SinkHandle:
    """Send every step ``tracker`` records to the given sinks (see :func:`make_sinks`
    for callback=, log=, print_every=, jsonl=, csv=, tensorboard=). File sinks
    are closed when the tracker stops or the returned handle's ``remove()``."""
    _check_sink_names(sinks, "Tracker.on_step()")
    st = _state(tracker)
    _refuse_same_files(tracker, sinks, st.sinks)
    built = make_sinks(**sinks)
    with st.lock:
        st.sinks.extend(built)
    return _SinkHandle(st, built)


# ---- memviz.watch(optimizer) ----------------------------------------------------------


class WatchHandle:
    """Returned by :func:`watch`. ``remove()`` stops recording and closes its
    file sinks; usable as a context manager. ``records`` are the steps this
    handle recorded."""

    def __init__(self, optimizer, tracker, sinks: List[_Sink], info) -> None:
        self.tracker = tracker
        self.sinks = sinks
        self.info = info
        self.records: List[StepRecord] = []
        self._warned = False
        self._hook = optimizer.register_step_post_hook(self._after_step)

    def _after_step(self, optimizer, args, kwargs) -> None:
        from memviz.capture.session import active_tracker

        t = self.tracker if self.tracker is not None else active_tracker()
        if t is None or not t.running:
            if not self._warned:
                self._warned = True
                warnings.warn("memviz.watch(): the optimizer stepped but no memviz tracker is running, "
                              "so the step was not recorded; start one (memviz.start() or "
                              "`with memviz.track():`) around the training loop.", RuntimeWarning,
                              stacklevel=warning_site()[0])
            return
        extra = self.info() if callable(self.info) else (self.info or {})
        rec = _record(t, {**extra})  # (a TypeError for a non-mapping, as t.step(**extra))
        self.records.append(rec)
        send_step(t, rec, self.sinks)

    def remove(self) -> None:
        """Stop recording steps and close this handle's file sinks."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        for s in self.sinks:
            s.close()

    def __enter__(self) -> "WatchHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def watch(optimizer, tracker=None, *, info=None, **sinks) -> WatchHandle:
    """Record a step after every ``optimizer.step()``.

    Args:
        optimizer: a ``torch.optim.Optimizer`` (anything with
            ``register_step_post_hook``).
        tracker: the tracker to record on; None means the one running when
            the optimizer steps.
        info: a dict, or a function returning one, passed to each step as
            ``t.step(**info)`` (e.g. ``lambda: {"batch_shape": x.shape}``).
        **sinks: callback=, log=, print_every=, jsonl=, csv=, tensorboard=
            (see :func:`make_sinks`); they receive the steps this handle records.

    Returns a :class:`WatchHandle`; call ``remove()`` to stop.
    """
    if not callable(getattr(optimizer, "register_step_post_hook", None)):
        raise InvalidArgumentType(
            f"memviz.watch() needs a torch.optim.Optimizer (an object with register_step_post_hook), "
            f"got {type(optimizer).__name__}; for other loops call tracker.step() at the end of each step.")
    if info is not None and not callable(info) and not isinstance(info, dict):
        raise InvalidArgumentType(f"memviz.watch(info=...) takes a dict or a function returning one, "
                                  f"got {type(info).__name__}")
    _check_sink_names(sinks, "memviz.watch()")
    # A second watch of this optimizer for the same tracker (a notebook cell run
    # again) replaces the first: both recorded every step, twice, and the step
    # findings halved their rates
    earlier = [h for h in _watching(optimizer) if h._hook is not None and h.tracker is tracker]
    if sinks.get("jsonl") is not None or sinks.get("csv") is not None:
        from memviz.capture.session import active_tracker
        t = tracker if tracker is not None else active_tracker()
        states = _session.current().subscribers(t, _StepState) if t is not None else ()
        _refuse_same_files(t, sinks, [s for st in states for s in st.sinks])
    handle = WatchHandle(optimizer, tracker, make_sinks(**sinks), info)
    for h in earlier:
        h.remove()
    if earlier:
        warnings.warn("memviz.watch(): this optimizer was already watched for the same tracker; the "
                      "earlier watch is removed, so that each step is recorded once (call "
                      "handle.remove() before watching again to say so)", RuntimeWarning,
                      stacklevel=warning_site()[0])
    try:
        _watches.setdefault(optimizer, []).append(weakref.ref(handle))
    except TypeError:  # an optimizer that takes no weak reference: not remembered
        pass
    return handle


#: optimizer -> weak references to the handles watching it
_watches: "weakref.WeakKeyDictionary[Any, list]" = weakref.WeakKeyDictionary()


def _watching(optimizer) -> list:
    try:
        refs = _watches.get(optimizer) or []
    except TypeError:
        return []
    live = [h for h in (r() for r in refs) if h is not None]
    if len(live) != len(refs):
        _watches[optimizer] = [weakref.ref(h) for h in live]
    return live
