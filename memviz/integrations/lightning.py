"""PyTorch Lightning: ``trainer = Trainer(callbacks=[MemvizCallback()])``.

Records a memviz step after every training batch (with the batch's shape,
``batch_idx`` and ``global_step``), and logs ``memviz.diagnose()`` findings
when training ends. When training raises, Lightning calls ``on_exception``: the
tracker the callback started is stopped, keeping what it saw, and its findings
and out-of-memory report are logged (``callback.error`` holds the exception).
Arguments: ``tracker`` (default: the running one, else one
the callback starts and stops), ``diagnose=True``, and the step sinks of
``memviz.watch`` (``callback=``, ``log=``, ``print_every=``, ``jsonl=``,
``csv=``, ``tensorboard=``).
"""

from __future__ import annotations

from typing import Any

from . import CoreViews, StepCallbackCore, batch_shape

try:
    from lightning.pytorch.callbacks import Callback
except ImportError:
    try:
        from pytorch_lightning.callbacks import Callback
    except ImportError as e:
        raise ImportError(
            "memviz.integrations.lightning needs PyTorch Lightning, which is not installed: "
            "pip install lightning (or pytorch-lightning). Without it, call tracker.step() at the "
            "end of each step or use memviz.watch(optimizer).") from e

__all__ = ["MemvizCallback"]


class MemvizCallback(CoreViews, Callback):
    """A Lightning callback recording a memviz step per training batch."""

    def __init__(self, tracker=None, *, diagnose: bool = True, **sinks: Any) -> None:
        super().__init__()
        self._core = StepCallbackCore(tracker, diagnose=diagnose, **sinks)

    @property
    def error(self):
        """The exception that ended the last training, or None."""
        return self._core.error

    def on_train_start(self, trainer, pl_module) -> None:
        self._core.begin()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._core.step(batch_shape=batch_shape(batch), batch_idx=batch_idx,
                        global_step=getattr(trainer, "global_step", None))

    def on_train_end(self, trainer, pl_module) -> None:
        self._core.end()

    def on_exception(self, trainer, pl_module, exception) -> None:
        self._core.fail(exception)
