"""Hugging Face transformers: ``Trainer(..., callbacks=[MemvizCallback()])``.

Records a memviz step at the end of every optimizer step (with
``global_step``), and logs ``memviz.diagnose()`` findings when training ends.
Arguments: ``tracker`` (default: the running one, else one the callback starts
and stops), ``diagnose=True``, ``metrics=True``, ``prefix="memviz"``, and the
step sinks of ``memviz.watch`` (``callback=``, ``log=``, ``print_every=``,
``jsonl=``, ``csv=``, ``tensorboard=``), which work with or without metrics.

Metrics in the Trainer's logs. Every ``logging_steps`` the Trainer calls
``Trainer.log(logs)``, which appends a copy of ``logs`` to
``state.log_history`` and then calls every callback's ``on_log`` with
``logs``; the ``report_to`` callbacks (TensorBoard, W&B, MLflow...) come first
in the callback list. A user callback's ``on_log`` is therefore too late to
add to what they report, or to ``log_history``. So, as ``train`` below, the
callback wraps ``log`` on its Trainer instance: the wrapper adds memviz's
metrics of the steps since the previous log (names in memviz.integrations) to
``logs``, then calls the original, so they reach ``log_history``, every
``report_to`` integration and every ``on_log``. Where it could not wrap
``log`` (a Trainer that refuses instance attributes), its ``on_log`` adds
them to ``logs`` and to the ``log_history`` entry just made, which the
callbacks after it see. ``metrics=False`` leaves the logs alone.

When training fails. transformers has no exception event: an exception
(a dataset that raises, an out-of-memory error) escapes ``Trainer.train()``
and no callback hears of it, so the tracker the callback started would keep
running. The callback therefore wraps ``train`` on the Trainer instance it
belongs to: at ``on_init_end`` (the callback was passed to ``Trainer(...)``)
it finds that Trainer among its callers (the frame whose ``self`` has this
callback in ``callback_handler.callbacks``) and sets an instance attribute
``train`` that calls the original and, when it raises, stops the tracker the
callback started (keeping what it saw, logging its findings and
out-of-memory report, ``callback.error`` = the exception) before the
exception goes on unchanged. A callback added later with
``trainer.add_callback`` first sees ``on_train_begin``, too late for that
call: it wraps ``train`` for the next calls, and a run that raised before is
finished (and logged) at the next ``on_train_begin``, or when the process
exits. A tracker the user started or passed is never stopped.
"""

from __future__ import annotations

import functools
import sys

from memviz.integrations.callbacks import CoreViews

try:
    from transformers import TrainerCallback
except ImportError as e:
    raise ImportError(
        "memviz.integrations.huggingface needs transformers, which is not installed: "
        "pip install transformers. Without it, call tracker.step() at the end of each step or "
        "use memviz.watch(optimizer).") from e

__all__ = ["MemvizCallback"]

_CALLERS_SEARCHED = 12  # Trainer.__init__ is 3 frames up (handler.on_init_end, call_event)


class MemvizCallback(CoreViews, TrainerCallback):
    """A transformers TrainerCallback recording a memviz step per optimizer step."""

    def on_init_end(self, args, state, control, **kwargs) -> None:
        self._wrap_trainer()

    def on_train_begin(self, args, state, control, **kwargs) -> None:
        self._wrap_trainer()
        self._core.begin()

    def on_step_end(self, args, state, control, **kwargs) -> None:
        self._core.step(global_step=getattr(state, "global_step", None))

    def on_train_end(self, args, state, control, **kwargs) -> None:
        self._core.end()

    def on_log(self, args, state, control, logs=None, **kwargs) -> None:
        """Where ``Trainer.log`` is not wrapped: the metrics into ``logs``
        (for the callbacks after this one) and the log_history entry just made."""
        if not self._core.metrics or not isinstance(logs, dict) or \
                any(k.startswith(self._core.prefix + "/") for k in logs):
            return  # off, or the wrapped Trainer.log put them in already
        metrics = self._core.take_metrics().get("/")
        if not metrics:
            return
        logs.update(metrics)
        history = getattr(state, "log_history", None)
        if history and isinstance(history[-1], dict) and \
                history[-1].get("step") == getattr(state, "global_step", None):
            history[-1].update(metrics)

    # -- wrapping train (the exception path) and log (the metrics) -----------

    def _wrap_trainer(self) -> None:
        trainer = self._find_trainer()
        if trainer is None:
            return
        self._wrap(trainer, "train", _train_wrapper)
        self._wrap(trainer, "log", _log_wrapper)

    def _wrap(self, trainer, name: str, make) -> None:
        current = trainer.__dict__.get(name)
        cores = getattr(current, "_memviz_cores", None)
        if cores is not None:
            if self._core not in cores:
                cores.append(self._core)
            return
        original = getattr(trainer, name, None)
        if not callable(original):
            return
        wrapper = make(original)
        wrapper._memviz_cores = [self._core]
        try:
            setattr(trainer, name, wrapper)
        except (AttributeError, TypeError):  # a Trainer that refuses attributes: begin() / on_log
            pass

    def _find_trainer(self):
        """The Trainer whose callback handler holds this callback, among the callers."""
        f = sys._getframe(2)
        for _ in range(_CALLERS_SEARCHED):
            if f is None:
                return None
            obj = f.f_locals.get("self") if "self" in f.f_code.co_varnames else None
            handler = getattr(obj, "callback_handler", None)
            if any(cb is self for cb in getattr(handler, "callbacks", ())) and callable(
                    getattr(obj, "train", None)):
                return obj
            f = f.f_back
        return None


def _train_wrapper(original):
    @functools.wraps(original)
    def train(*args, **kwargs):
        try:
            return original(*args, **kwargs)
        except BaseException as e:
            for core in list(train._memviz_cores):
                core.fail(e)
            raise
    return train


def _log_wrapper(original):
    @functools.wraps(original)
    def log(logs, *args, **kwargs):
        if isinstance(logs, dict):
            for core in list(log._memviz_cores):
                if core.metrics:
                    logs.update(core.take_metrics().get("/", {}))
        return original(logs, *args, **kwargs)
    return log
