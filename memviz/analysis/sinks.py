"""Where step records go: a callback, the ``memviz`` logger, a print every N
steps, a JSON-lines file, a CSV file, a TensorBoard ``SummaryWriter``.

One concern: building the sinks from ``on_step()`` / ``watch()`` arguments,
refusing step files that would overwrite the tracker's own files, and writing
each :class:`~memviz.model.steps.StepRecord` to them. The records themselves
are made in memviz/analysis/steps.py. Imports the model floor and below and
memviz.capture.rank_files (docs/architecture.md); the tracker only as an object
passed in.
"""

from __future__ import annotations

import csv as _csv
import json
import logging
import sys
import threading
from typing import Any, Callable, Dict, Iterable, List, Optional

from memviz._args import path as _path_arg
from memviz._errors import InvalidArgument, InvalidArgumentType, OutputError
from memviz._units import escape_surrogates, json_finite
from memviz.capture.rank_files import rank_path
from memviz.model.steps import DeviceStep, StepRecord

LOGGER_NAME = "memviz"


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

    def reopen(self) -> None:
        """Ready for steps again after close() (a callback's next training)."""


class _File(_Sink):
    """A step file. The first write error (a full disk) closes it and raises
    an OutputError; the steps stay in ``tracker.steps``."""

    what = "step"
    newline: Optional[str] = None  # open()'s newline=

    def _opened(self, f) -> None:
        self.f, self.path = f, f.name
        #: a record's check-and-write, and the close, each whole: a tracker stopped on
        #: another thread closed the file between a step's check and its write
        #: (ValueError: I/O operation on closed file, in that thread's t.step()).
        #: A leaf lock: no other lock, no user code, under it.
        self.lock = threading.Lock()

    def close(self):
        with self.lock:
            self.f.close()

    def reopen(self) -> None:
        """The same file again, appended to (a callback's next training: the
        first training's steps stay, the next ones follow them)."""
        with self.lock:
            if not self.f.closed:
                return
            try:
                f = open(self.path, "a", encoding="utf-8", newline=self.newline)
            except OSError as e:
                raise OutputError(f"the {self.what} step file", self.path, e.strerror or str(e),
                                  hint="pass a path in a writable directory", errno=e.errno) from e
            self.f = f
            self._reopened()

    def _reopened(self) -> None:
        pass

    def failed(self, rec: Optional[StepRecord], e: OSError) -> OutputError:
        try:
            self.f.close()  # retries the flush once more; the file is closed either way
        except OSError:
            pass
        from memviz._output_files import output_error
        err = output_error(f"the {self.what} step file", self.path, e)
        when = f"step {rec.index} and later steps" if rec is not None else "the steps"
        return OutputError(err.what, err.path, err.reason, errno=err.errno, hint=(
            f"{err.hint or 'free some disk space, or choose another path'}. {when.capitalize()} "
            f"are not written to this file (it stops here) but are kept in t.steps: save them with "
            f"t.save(PATH), or attach a new file with t.on_step({self.what}=PATH)"))


class _JsonLines(_File):
    what = "jsonl"

    def __init__(self, path) -> None:
        self._opened(_open(path, "jsonl"))

    def emit(self, rec):
        line = json.dumps(json_finite(rec.to_dict()), default=str, allow_nan=False) + "\n"
        with self.lock:
            if self.f.closed:  # stopped (or failed) before this step came: it is in t.steps
                return
            try:
                self.f.write(line)
                self.f.flush()
            except OSError as e:
                raise self.failed(rec, e) from e


CSV_COLUMNS = ["step", "timestamp_ns", "duration_s", "device", "current", "peak", "growth",
               "allocated", "reserved", "segment_allocs", "segment_frees", "top_line", "top_line_bytes",
               "info"]


class _Csv(_File):
    """One row per step and device (long format, so the header never changes)."""

    what = "csv"
    newline = ""

    def __init__(self, path) -> None:
        self._opened(_open(path, "csv", newline=""))
        self._reopened()

    def _reopened(self) -> None:
        self.w = _csv.writer(self.f)
        try:
            if self.f.tell() == 0:  # the header once, at the top (not again when appended to)
                self.w.writerow(CSV_COLUMNS)
                self.f.flush()
        except OSError as e:
            raise self.failed(None, e) from e

    def emit(self, rec):
        top = rec.lines[0] if rec.lines else None
        info = (json.dumps(json_finite(rec.to_dict()["info"]), default=str, allow_nan=False)
                if rec.info else "")
        devs = sorted(rec.devices) or [None]
        with self.lock:
            if self.f.closed:  # stopped (or failed) before this step came: it is in t.steps
                return
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


def _step_path(value: Any, what: str) -> str:
    """The step file of ``what=value``: one per rank under a launcher
    (``steps.jsonl`` -> ``steps.rank0.jsonl``, as trace files; memviz.capture.rank_files)."""
    return rank_path(_path_arg(value, f"{what}="))


def _open(path: str, what: str, newline=None):
    """The step file, written as steps come (so not through a temporary file)."""
    path = _step_path(path, what)
    try:
        return open(path, "w", encoding="utf-8", newline=newline)
    except OSError as e:
        raise OutputError(f"the {what} step file", path, e.strerror or str(e),
                          hint="pass a path in a writable directory", errno=e.errno) from e


SINK_NAMES = ("callback", "log", "print_every", "jsonl", "csv", "tensorboard")


def console_write(text: str) -> None:
    """A line for the terminal that keeps progress bars whole: through
    tqdm.write while a tqdm bar is open, through rich's console while a rich
    Live display (a Progress) runs, else print. Neither library is imported
    here: only one the program already uses is asked."""
    tqdm_mod = sys.modules.get("tqdm")
    bar = getattr(tqdm_mod, "tqdm", None)
    if bar is not None and getattr(bar, "_instances", None):
        try:
            bar.write(text)
            return
        except Exception:  # noqa: BLE001 - a progress bar must not lose the line
            pass
    rich_mod = sys.modules.get("rich")
    if rich_mod is not None:
        try:
            console = rich_mod.get_console()
            if getattr(console, "_live_stack", None) or getattr(console, "_live", None):
                console.print(text, markup=False, highlight=False, soft_wrap=True)
                return
        except Exception:  # noqa: BLE001
            pass
    print(text, flush=True)


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
        Under a launcher (RANK set) each rank writes its own step files,
        named as trace files are (``steps.jsonl`` -> ``steps.rank0.jsonl``).
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
        sinks.append(_Sink(console_write, every=print_every))
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


def _refuse_same_files(tracker, sinks: Dict[str, Any], existing: Iterable["_Sink"] = ()) -> None:
    """Before anything is opened: a jsonl=/csv= path must not be the tracker's
    trace file, a step file the tracker writes already (one of its
    ``existing`` sinks), or the other of the two (one file by device and
    inode, through links)."""
    from memviz._output_files import own_files, refuse_inputs

    taken = own_files(tracker) if tracker is not None else []
    for s in list(existing):
        if isinstance(s, _File) and not s.f.closed:
            taken.append((f"the {s.what} step file this tracker writes already", s.path))
    for what in ("jsonl", "csv"):
        if sinks.get(what) is not None:
            path = _step_path(sinks[what], what)
            refuse_inputs(path, taken, f"the {what} step file", hint=f"choose another {what}= path")
            taken.append((f"the {what} step file ({what}=)", path))


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
