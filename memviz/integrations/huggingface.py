"""Hugging Face transformers: ``Trainer(..., callbacks=[MemvizCallback()])``.

Records a memviz step at the end of every optimizer step (with
``global_step``), and logs ``memviz.diagnose()`` findings when training ends.
Arguments: ``tracker`` (default: the running one, else one the callback starts
and stops), ``diagnose=True``, and the step sinks of ``memviz.watch``
(``callback=``, ``log=``, ``print_every=``, ``jsonl=``, ``csv=``, ``tensorboard=``).
"""

from __future__ import annotations

from typing import Any

from . import StepCallbackCore

try:
    from transformers import TrainerCallback
except ImportError as e:
    raise ImportError(
        "memviz.integrations.huggingface needs transformers, which is not installed: "
        "pip install transformers. Without it, call tracker.step() at the end of each step or "
        "use memviz.watch(optimizer).") from e

__all__ = ["MemvizCallback"]


class MemvizCallback(TrainerCallback):
    """A transformers TrainerCallback recording a memviz step per optimizer step."""

    def __init__(self, tracker=None, *, diagnose: bool = True, **sinks: Any) -> None:
        super().__init__()
        self._core = StepCallbackCore(tracker, diagnose=diagnose, **sinks)

    @property
    def tracker(self):
        return self._core.current() or self._core.tracker

    @property
    def findings(self):
        """``memviz.diagnose()``'s findings, once training ended."""
        return self._core.findings

    def on_train_begin(self, args, state, control, **kwargs) -> None:
        self._core.begin()

    def on_step_end(self, args, state, control, **kwargs) -> None:
        self._core.step(global_step=getattr(state, "global_step", None))

    def on_train_end(self, args, state, control, **kwargs) -> None:
        self._core.end()
