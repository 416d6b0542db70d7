"""Hugging Face transformers: ``Trainer(..., callbacks=[MemvizCallback()])``.

Records a memviz step at the end of every optimizer step (with
``global_step``), and logs ``memviz.diagnose()`` findings when training ends.
Arguments: ``tracker`` (default: the running one, else one the callback starts
and stops), ``diagnose=True``, and the step sinks of ``memviz.watch``
(``callback=``, ``log=``, ``print_every=``, ``jsonl=``, ``csv=``, ``tensorboard=``).

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
from typing import Any

from . import CoreViews, StepCallbackCore

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

    def __init__(self, tracker=None, *, diagnose: bool = True, **sinks: Any) -> None:
        super().__init__()
        self._core = StepCallbackCore(tracker, diagnose=diagnose, **sinks)

    @property
    def error(self):
        """The exception that escaped the last ``train()``, or None."""
        return self._core.error

    def on_init_end(self, args, state, control, **kwargs) -> None:
        self._wrap_trainer()

    def on_train_begin(self, args, state, control, **kwargs) -> None:
        self._wrap_trainer()
        self._core.begin()

    def on_step_end(self, args, state, control, **kwargs) -> None:
        self._core.step(global_step=getattr(state, "global_step", None))

    def on_train_end(self, args, state, control, **kwargs) -> None:
        self._core.end()

    # -- the exception path -------------------------------------------------

    def _wrap_trainer(self) -> None:
        trainer = self._find_trainer()
        if trainer is None:
            return
        current = trainer.__dict__.get("train")
        cores = getattr(current, "_memviz_cores", None)
        if cores is not None:
            if self._core not in cores:
                cores.append(self._core)
            return
        original = trainer.train

        @functools.wraps(original)
        def train(*args, **kwargs):
            try:
                return original(*args, **kwargs)
            except BaseException as e:
                for core in list(train._memviz_cores):
                    core.fail(e)
                raise

        train._memviz_cores = [self._core]
        try:
            trainer.train = train
        except (AttributeError, TypeError):  # a Trainer that refuses attributes: begin() cleans up
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
