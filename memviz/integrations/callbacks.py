"""What the Lightning and Hugging Face callbacks share: a step record per
training step, the sinks, the framework metrics (:func:`step_metrics`) and
the findings at the end of training (see memviz/integrations/__init__.py)."""

from __future__ import annotations

import atexit
import logging
import weakref
from typing import Any, Dict, Iterable, List, Optional, Tuple

MiB = float(1 << 20)


def batch_shape(batch: Any) -> Optional[tuple]:
    """The shape of a batch's main tensor, cheaply: the batch itself, the first
    item of a tuple/list, or ``input_ids`` / the first tensor of a dict."""
    if hasattr(batch, "shape"):
        return tuple(batch.shape)
    if isinstance(batch, (list, tuple)) and batch and hasattr(batch[0], "shape"):
        return tuple(batch[0].shape)
    if isinstance(batch, dict):
        first = batch.get("input_ids")
        if first is None:
            first = next((v for v in batch.values() if hasattr(v, "shape")), None)
        if first is not None and hasattr(first, "shape"):
            return tuple(first.shape)
    return None


def step_metrics(records: List[Any], prefix: str = "memviz", sep: str = "/") -> Dict[str, float]:
    """The framework metrics of step records (the steps since the previous
    logging step; see the module docstring). {} without records."""
    if not records:
        return {}
    out: Dict[str, float] = {}
    last = records[-1]
    for dev in sorted({d for r in records for d in r.devices if d >= 0}):
        steps = [r.devices[dev] for r in records if dev in r.devices]
        base = f"{prefix}{sep}cuda{dev}{sep}"
        end = last.devices.get(dev) or steps[-1]
        peaks = [d.peak for d in steps if d.peak is not None]
        growth = [d.growth for d in steps if d.growth is not None]
        for name, value in (("current", end.current), ("peak", max(peaks) if peaks else None),
                            ("growth", sum(growth) if growth else None),
                            ("allocated", end.allocated), ("reserved", end.reserved)):
            if value is not None:
                out[f"{base}{name}_MiB"] = value / MiB
    out[f"{prefix}{sep}step_time_ms"] = sum(r.duration_ns for r in records) / len(records) / 1e6
    return out


class CoreViews:
    """What the framework callbacks share on their face: the arguments they
    take (each makes its ``_core``, a :class:`StepCallbackCore`, of them) and
    what they show of the run they track.

    A framework's ``MemvizCallback`` derives from this class first and from
    the framework's callback class second, so that ``super().__init__()``
    here reaches the framework's ``__init__``."""

    def __init__(self, tracker=None, *, diagnose: bool = True, metrics: bool = True,
                 prefix: str = "memviz", **sinks: Any) -> None:
        super().__init__()
        self._core = StepCallbackCore(tracker, diagnose=diagnose, metrics=metrics, prefix=prefix,
                                      **sinks)

    @property
    def tracker(self):
        return self._core.current() or self._core.tracker

    @property
    def findings(self):
        """``memviz.diagnose()``'s findings, once training ended (or failed)."""
        return self._core.findings

    @property
    def oom_report(self):
        """The out-of-memory report of a training that failed, or None."""
        return self._core.oom_report

    @property
    def error(self):
        """The exception that ended the last training (Lightning's
        ``on_exception``; for transformers, the one given to
        ``callback.finish(exc)``: no callback hears of an exception escaping
        ``Trainer.train()``), or None."""
        return self._core.error


class StepCallbackCore:
    """What the framework callbacks share: start/own a tracker, record steps,
    diagnose at the end, and finish the tracker it started when training fails.

    When training raises (Lightning's ``on_exception``, :meth:`fail`) the
    tracker this callback started is stopped: it keeps what it saw
    (``callback.tracker``), and its findings and out-of-memory report are
    logged on the ``memviz`` logger and kept in ``callback.findings`` /
    ``callback.oom_report``; the exception is in ``callback.error`` and goes
    on unchanged. Where no event says training ended (transformers: an
    exception escaping ``Trainer.train()``, see huggingface.py), the same is
    done at the next :meth:`begin`, when the callback is garbage-collected,
    or at exit. A tracker the user started or passed is never stopped by the
    callback.
    """

    def __init__(self, tracker=None, *, diagnose: bool = True, metrics: bool = True,
                 prefix: str = "memviz", **sinks: Any) -> None:
        from memviz._errors import InvalidArgument, InvalidArgumentType
        from memviz.analysis.sinks import _refuse_same_files, make_sinks

        if not isinstance(metrics, bool):
            raise InvalidArgumentType(
                f"MemvizCallback(metrics=...) takes True (send the steps to the framework's "
                f"logging, the default) or False, got {metrics!r} ({type(metrics).__name__})")
        if not isinstance(prefix, str) or not prefix or any(c in prefix for c in ":\n"):
            raise (InvalidArgument if isinstance(prefix, str) else InvalidArgumentType)(
                f"MemvizCallback(prefix=...) takes the start of the metric names, a non-empty string "
                f"without ':' or newlines (default 'memviz'), got {prefix!r}")
        self.tracker = tracker
        self.diagnose = diagnose
        self.metrics, self.prefix = metrics, prefix
        self.pending: List[Any] = []  # step records not yet handed to the framework's logging
        #: whether this process logs the findings (False on the ranks other than zero, where
        #: the framework says so: one copy of each finding, as its own messages)
        self.log_here = True
        _refuse_same_files(tracker, sinks)  # jsonl=/csv=: not the trace, nor each other
        self.sinks = make_sinks(**sinks)
        self.findings: List[Any] = []
        self.oom_report: Any = None
        self.error: Optional[BaseException] = None
        self._passed = tracker
        self._own = False
        self._exit_hook = False
        #: finishes the tracker this callback started if the callback is
        #: garbage-collected before training ends (not at exit: _finish_at_exit)
        self._orphan: Optional[weakref.finalize] = None

    def begin(self) -> None:
        from memviz.capture.session import active_tracker
        from memviz.tracker import start

        if self._own and self.tracker is not None and self.tracker.running:
            # The previous training raised where no framework event reported it.
            self.fail(None, "the previous training did not end before this one began")
        self.error = None
        self.pending = []
        for s in self.sinks:  # closed when the last training ended: this one's steps follow
            s.reopen()
        if self._passed is not None:
            self.tracker, self._own = self._passed, False
            if not self._passed.running:
                import warnings
                warnings.warn("memviz: the tracker given to the callback is not running, so no step "
                              "of this training is recorded; start it first (tracker.start(), or a with "
                              "block of it around the training), or give the callback no tracker "
                              "and it starts and stops one itself", RuntimeWarning, stacklevel=2)
        elif active_tracker() is None:
            self.tracker, self._own = start(), True
            self._orphan = weakref.finalize(self, _finish_orphan, self.tracker, self.diagnose,
                                            self.log_here)
            self._orphan.atexit = False
            if not self._exit_hook:
                # Registered after memviz.tracker's own exit hook, which stops every tracker:
                # atexit runs the later first, so this one still finds the tracker running.
                self._exit_hook = True
                atexit.register(_finish_at_exit, weakref.ref(self))
        else:  # the running tracker, looked up at each step
            self.tracker, self._own = None, False

    def current(self):
        from memviz.capture.session import active_tracker

        t = self.tracker if self.tracker is not None else active_tracker()
        return t if t is not None and t.running else None

    def step(self, **info: Any):
        from memviz.analysis.steps import _record, send_step

        t = self.current()
        if t is None:
            return None
        rec = _record(t, {k: v for k, v in info.items() if v is not None})
        if self.metrics:
            self.pending.append(rec)
        send_step(t, rec, self.sinks)  # a step file's write error after every sink had it
        return rec

    def take_metrics(self, seps: Iterable[str] = ("/",)) -> Dict[str, Dict[str, float]]:
        """{separator: metrics} of the steps since the last call (each
        separator a logger uses), and forget those steps; {} when none."""
        records, self.pending = self.pending, []
        if not records:
            return {}
        return {sep: step_metrics(records, self.prefix, sep) for sep in dict.fromkeys(seps)}

    def end(self) -> None:
        from memviz.analysis.diagnose import diagnose
        from memviz.capture.session import active_tracker

        t = self.tracker if self.tracker is not None else active_tracker()
        try:
            if t is not None and self.diagnose:
                self.findings = diagnose(t)
                log = logging.getLogger("memviz")
                for f in self.findings if self.log_here else ():
                    log.warning("%s", f)
        finally:
            self._forget_orphan()
            if self._own and t is not None and t.running:
                t.stop()
            for s in self.sinks:
                s.close()

    def _forget_orphan(self) -> None:
        if self._orphan is not None:
            self._orphan.detach()
            self._orphan = None

    def fail(self, exc: Optional[BaseException], why: Optional[str] = None) -> None:
        """Training raised ``exc`` (None: it ended without telling, ``why``
        says how): stop the tracker this callback started, then log its
        findings and out-of-memory report. Never raises."""
        if exc is not None:
            self.error = exc
        t = self.tracker
        if not self._own or t is None or not t.running:
            return
        self._forget_orphan()
        if why is None:
            why = (f"training raised {type(exc).__name__}: {exc}" if exc is not None
                   else "training did not end")
        findings, self.oom_report = _finish(t, why, self.diagnose, self.log_here)
        if findings is not None:
            self.findings = findings


def _finish(t: Any, why: str, diagnose: bool, log_here: bool) -> Tuple[Optional[List[Any]], Any]:
    """Stop the running tracker ``t`` a callback started, log why, its
    findings (``diagnose``; where ``log_here``) and out-of-memory report;
    returns (findings or None, oom report). Never raises."""
    log = logging.getLogger("memviz")
    try:
        t.stop()
    except Exception as e:  # noqa: BLE001 - never replace the training's own exception
        log.warning("memviz: could not stop the tracker cleanly: %r", e)
    log.warning("memviz: %s; the tracker this callback started is stopped and keeps what it saw "
                "(callback.tracker, callback.findings, callback.oom_report).", why)
    findings, oom = None, None
    try:
        if diagnose:
            from memviz.analysis.diagnose import diagnose as run_diagnose

            findings = run_diagnose(t)
            for f in findings if log_here else ():
                log.warning("%s", f)
        oom = t.oom_report
        if oom is not None:
            log.warning("%s", oom)
    except Exception as e:  # noqa: BLE001
        log.warning("memviz: could not diagnose the failed training: %r", e)
    return findings, oom


def _finish_orphan(t: Any, diagnose: bool, log_here: bool) -> None:
    """weakref.finalize of a callback whose tracker still ran when it was collected."""
    if t.running:
        _finish(t, "the callback was garbage-collected before training ended", diagnose, log_here)


def _finish_at_exit(ref) -> None:
    core = ref()
    if core is not None:
        core.fail(None, "training did not end before the process exited")
