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
steps, a JSON-lines file, a CSV file, a TensorBoard ``SummaryWriter``.
"""

from __future__ import annotations

import csv as _csv
import heapq
import json
import logging
import numbers
import sys
import threading
import time
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

from memviz import _core
from memviz._args import path as _path_arg
from memviz._errors import InvalidArgument, InvalidArgumentType, NotTracking, OutputError
from memviz.model.frame_filter import frames as _default_filter, warning_site
from memviz.model.traceback import Frame
from memviz._units import escape_surrogates, json_finite
from memviz.model.steps import DeviceStep, GrowthLine, StepRecord

__all__ = ["StepRecord", "DeviceStep", "GrowthLine", "record_step", "on_step", "watch",
           "WatchHandle", "TOP_LINES"]

#: lines kept per step (largest growth first)
TOP_LINES = 5
_NO_FRAMES = Frame("<no Python frames>", 0, "")
LOGGER_NAME = "memviz"


# ---- records ------------------------------------------------------------------


# ---- recording ----------------------------------------------------------------


class _StepState:
    """Per-tracker state: previous totals, cached line resolutions, sinks."""

    def __init__(self, tracker) -> None:
        self.lock = threading.Lock()
        self.raw: Dict[int, Tuple[Frame, ...]] = {}  # stack id -> frames (innermost first)
        self.picked: Dict[int, Frame] = {}  # stack id -> the user's frame
        self.filter_gen = None
        self.last_ts = tracker.started_ns or time.monotonic_ns()
        self.last_current: Dict[int, int] = {}
        self.last_counts: Dict[int, Tuple[int, int, int]] = {}
        self.sinks: List["_Sink"] = []
        self.closer_added = False
        self.torch_devices: Optional[int] = None

    def on_stop(self, tracker) -> None:
        """Tracker plugin hook: close the file sinks."""
        for s in self.sinks:
            s.close()

    def user_frames(self, flt, ids: List[int]) -> Dict[int, Frame]:
        gen = flt.generation
        if gen != self.filter_gen:
            self.picked.clear()
            self.filter_gen = gen
        missing = [i for i in ids if i not in self.raw and i != 0]
        if missing:
            for sid, frames in _core.resolve(missing).items():
                self.raw[sid] = tuple(Frame(fn or "<unknown>", ln if ln and ln > 0 else 0, nm or "")
                                      for fn, ln, nm in frames)
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
    st = tracker.__dict__.get("_memviz_steps")
    if st is None:
        st = tracker.__dict__.setdefault("_memviz_steps", _StepState(tracker))
    return st


def _norm_info(value: Any) -> Any:
    """Keep info JSON-friendly and cheap: shapes become tuples of ints."""
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
            return tuple(int(s) for s in shape)
        except (TypeError, ValueError):
            pass
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
    rec, sinks = _record(tracker, info)
    _emit(sinks, rec)
    return rec


def _record(tracker, info: Dict[str, Any]) -> Tuple[StepRecord, List["_Sink"]]:
    """The new record, appended to ``tracker.steps``, and the tracker's sinks."""
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
        for dev, (cur, wpeak, live) in devs.items():
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
        sinks = list(st.sinks)
    return rec, sinks


def _emit(sinks: List["_Sink"], rec: StepRecord) -> None:
    """Send ``rec`` to every sink; a step file that cannot be written does
    not keep the record from the sinks after it: its OutputError comes after."""
    error = None
    for s in sinks:
        try:
            s.emit(rec)
        except OutputError as e:
            error = error or e
    if error is not None:
        raise error


def _growth_lines(st: _StepState, tracker, changed) -> List[GrowthLine]:
    grew = [c for c in changed if c[3] > 0]
    if not grew:
        return []
    if len(grew) > 4 * TOP_LINES:
        grew = heapq.nlargest(4 * TOP_LINES, grew, key=lambda c: c[3])
    flt = tracker.frame_filter or _default_filter
    frames = st.user_frames(flt, [c[0] for c in grew])
    # One entry per location ("file:line"): two functions on one line (a
    # lambda and its caller) are one line, named after the one that grew more.
    by_line: Dict[str, list] = {}
    for sid, live_b, live_n, d_b, d_n in grew:
        f = frames[sid]
        loc = str(f)
        agg = by_line.get(loc)
        if agg is None:
            by_line[loc] = [d_b, d_n, live_b, live_n, {f.name: d_b}]
        else:
            agg[0] += d_b
            agg[1] += d_n
            agg[2] += live_b
            agg[3] += live_n
            agg[4][f.name] = agg[4].get(f.name, 0) + d_b
    top = sorted(by_line.items(), key=lambda kv: -kv[1][0])[:TOP_LINES]
    return [GrowthLine(loc, max(a[4], key=a[4].__getitem__), a[0], a[1], a[2], a[3])
            for loc, a in top]


# ---- sinks ----------------------------------------------------------------------


class _Sink:
    """Calls ``fn(record)`` (or ``fn(record.summary())`` every N steps)."""

    def __init__(self, fn: Callable[[Any], Any], every: int = 0) -> None:
        self.fn, self.every = fn, every

    def emit(self, rec: StepRecord) -> None:
        if not self.every:
            self.fn(rec)
        elif (rec.index + 1) % self.every == 0:
            self.fn(rec.summary())

    def close(self) -> None:
        pass


class _File(_Sink):
    """A step file. The first write error (a full disk) closes it and raises
    an OutputError; the steps stay in ``tracker.steps``."""

    what = "step"

    def failed(self, rec: Optional[StepRecord], e: OSError) -> OutputError:
        try:
            self.f.close()  # retries the flush once more; the file is closed either way
        except OSError:
            pass
        from memviz._outputs import _error
        err = _error(f"the {self.what} step file", self.path, e)
        when = f"step {rec.index} and later steps" if rec is not None else "the steps"
        return OutputError(err.what, err.path, err.reason, errno=err.errno, hint=(
            f"{err.hint or 'free some disk space, or choose another path'}. {when.capitalize()} "
            f"are not written to this file (it stops here) but are kept in t.steps: save them with "
            f"t.save(PATH), or attach a new file with t.on_step({self.what}=PATH)"))


class _JsonLines(_File):
    what = "jsonl"

    def __init__(self, path) -> None:
        self.f = _open(path, "jsonl")
        self.path = self.f.name

    def emit(self, rec):
        if not self.f.closed:
            line = json.dumps(json_finite(rec.to_dict()), default=str, allow_nan=False) + "\n"
            try:
                self.f.write(line)
                self.f.flush()
            except OSError as e:
                raise self.failed(rec, e) from e

    def close(self):
        self.f.close()


CSV_COLUMNS = ["step", "timestamp_ns", "duration_s", "device", "current", "peak", "growth",
               "allocated", "reserved", "segment_allocs", "segment_frees", "top_line", "top_line_bytes",
               "info"]


class _Csv(_File):
    """One row per step and device (long format, so the header never changes)."""

    what = "csv"

    def __init__(self, path) -> None:
        self.f = _open(path, "csv", newline="")
        self.path = self.f.name
        self.w = _csv.writer(self.f)
        try:
            self.w.writerow(CSV_COLUMNS)
            self.f.flush()
        except OSError as e:
            raise self.failed(None, e) from e

    def emit(self, rec):
        if self.f.closed:
            return
        top = rec.lines[0] if rec.lines else None
        info = (json.dumps(json_finite(rec.to_dict()["info"]), default=str, allow_nan=False)
                if rec.info else "")
        devs = sorted(rec.devices) or [None]
        try:
            self._rows(rec, top, info, devs)
            self.f.flush()
        except OSError as e:
            raise self.failed(rec, e) from e

    def _rows(self, rec, top, info, devs):
        for dev in devs:
            d = rec.devices.get(dev) if dev is not None else DeviceStep()
            self.w.writerow([rec.index, rec.timestamp_ns, f"{rec.duration_ns / 1e9:.6f}",
                             *("" if v is None else v for v in (dev, d.current, d.peak, d.growth,
                                                                d.allocated, d.reserved)),
                             d.segment_allocs, d.segment_frees,
                             escape_surrogates(top.location) if top else "",
                             top.bytes if top else "", info])

    def close(self):
        self.f.close()


class _TensorBoard(_Sink):
    """Scalars in MiB under memviz/cuda:N/..., the step time in ms."""

    def __init__(self, writer) -> None:
        self.writer = writer

    def emit(self, rec):
        add = self.writer.add_scalar
        for dev, d in sorted(rec.devices.items()):
            if dev < 0:
                continue
            for name in ("current", "peak", "allocated", "reserved"):
                v = getattr(d, name)
                if v is not None:
                    add(f"memviz/cuda:{dev}/{name}_MiB", v / (1 << 20), rec.index)
        add("memviz/step_time_ms", rec.duration_ns / 1e6, rec.index)


def _open(path: str, what: str, newline=None):
    """The step file, written as steps come (so not through a temporary file)."""
    path = _path_arg(path, f"{what}=")
    try:
        return open(path, "w", encoding="utf-8", newline=newline)
    except OSError as e:
        raise OutputError(f"the {what} step file", path, e.strerror or str(e),
                          hint="pass a path in a writable directory", errno=e.errno) from e


SINK_NAMES = ("callback", "log", "print_every", "jsonl", "csv", "tensorboard")


def _check_sink_names(sinks: Dict[str, Any], where: str) -> None:
    unknown = sorted(set(sinks) - set(SINK_NAMES))
    if unknown:
        raise InvalidArgumentType(f"{where} has no option {unknown[0]!r}; its step sinks are "
                                  + ", ".join(f"{n}=" for n in SINK_NAMES))


def make_sinks(callback=None, log=False, print_every=None, jsonl=None, csv=None,
               tensorboard=None) -> List[_Sink]:
    """Validate the sink arguments and build the sinks.

    Args:
        callback: called with each :class:`StepRecord`.
        log: True (INFO), a logging level, or a ``logging.Logger``: one line
            per step on the ``memviz`` logger (or the given one).
        print_every: print a one-line summary every N steps.
        jsonl: path of a JSON-lines file (one ``StepRecord.to_dict()`` a line).
        csv: path of a CSV file (one row per step and device).
        tensorboard: a ``SummaryWriter`` (anything with ``add_scalar``).
    """
    sinks: List[_Sink] = []
    if callback is not None:
        if not callable(callback):
            raise InvalidArgumentType(f"memviz: callback= must be a function taking a StepRecord, "
                                      f"got {type(callback).__name__}")
        sinks.append(_Sink(callback))
    if log is not False and log is not None:
        if isinstance(log, logging.Logger):
            logger, level = log, logging.INFO
        elif log is True:
            logger, level = logging.getLogger(LOGGER_NAME), logging.INFO
        elif isinstance(log, int):
            logger, level = logging.getLogger(LOGGER_NAME), log
        else:
            raise InvalidArgumentType(f"memviz: log= takes True, a logging level or a logging.Logger, got {log!r}")
        sinks.append(_Sink(lambda text, lg=logger, lv=level: lg.log(lv, text), every=1))
    if print_every is not None:
        if isinstance(print_every, bool) or not isinstance(print_every, int) or print_every < 1:
            raise InvalidArgument(f"memviz: print_every= must be a whole number of steps >= 1, got {print_every!r}")
        sinks.append(_Sink(lambda text: print(text, flush=True), every=print_every))
    if tensorboard is not None:
        if not callable(getattr(tensorboard, "add_scalar", None)):
            raise InvalidArgumentType(f"memviz: tensorboard= needs a SummaryWriter (an object with "
                                      f"add_scalar(tag, value, step)), got {type(tensorboard).__name__}")
        sinks.append(_TensorBoard(tensorboard))
    if jsonl is not None:
        sinks.append(_JsonLines(jsonl))
    if csv is not None:
        sinks.append(_Csv(csv))
    return sinks


def _refuse_same_files(tracker, sinks: Dict[str, Any]) -> None:
    """Before anything is opened: a jsonl=/csv= path must not be the tracker's
    trace file, a step file the tracker writes already, or the other of the two
    (one file by device and inode, through links)."""
    from memviz._outputs import own_files, refuse_inputs

    taken = own_files(tracker) if tracker is not None else []
    st = tracker.__dict__.get("_memviz_steps") if tracker is not None else None
    for s in list(st.sinks) if st is not None else ():
        if isinstance(s, _File) and not s.f.closed:
            taken.append((f"the {s.what} step file this tracker writes already", s.path))
    for what in ("jsonl", "csv"):
        if sinks.get(what) is not None:
            path = _path_arg(sinks[what], f"{what}=")
            refuse_inputs(path, taken, f"the {what} step file", hint=f"choose another {what}= path")
            taken.append((f"the {what} step file ({what}=)", path))


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
    _refuse_same_files(tracker, sinks)
    built = make_sinks(**sinks)
    st = _state(tracker)
    with st.lock:
        st.sinks.extend(built)
        if not st.closer_added and hasattr(tracker, "_plugins"):
            tracker._plugins.append(st)
            st.closer_added = True
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
        from memviz.capture.running import active_tracker

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
        rec, sinks = _record(t, {**extra})  # (a TypeError for a non-mapping, as t.step(**extra))
        self.records.append(rec)
        _emit(sinks + self.sinks, rec)

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
    if sinks.get("jsonl") is not None or sinks.get("csv") is not None:
        from memviz.capture.running import active_tracker
        _refuse_same_files(tracker if tracker is not None else active_tracker(), sinks)
    return WatchHandle(optimizer, tracker, make_sinks(**sinks), info)
