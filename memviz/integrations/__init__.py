"""Training-framework integrations: a step record per training step.

* ``memviz.integrations.lightning.MemvizCallback`` for PyTorch Lightning;
* ``memviz.integrations.huggingface.MemvizCallback`` for the transformers Trainer.

Both record ``tracker.step()`` after each training step (on the tracker you
pass, else the running one, else one they start and stop themselves), send
the records to the sinks you ask for (see ``memviz.watch``), and at the end
of training log ``memviz.diagnose()``'s findings on the ``memviz`` logger and
keep them in ``callback.findings``.
"""

from __future__ import annotations

import logging
from typing import Any, List, Optional

__all__ = ["StepCallbackCore", "batch_shape"]


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


class StepCallbackCore:
    """What the framework callbacks share: start/own a tracker, record steps,
    diagnose at the end."""

    def __init__(self, tracker=None, *, diagnose: bool = True, **sinks: Any) -> None:
        from .._steps import make_sinks

        self.tracker = tracker
        self.diagnose = diagnose
        self.sinks = make_sinks(**sinks)
        self.findings: List[Any] = []
        self._own = False

    def begin(self) -> None:
        import memviz

        if self.tracker is None and memviz.active_tracker() is None:
            self.tracker = memviz.start()
            self._own = True

    def current(self):
        import memviz

        t = self.tracker if self.tracker is not None else memviz.active_tracker()
        return t if t is not None and t.running else None

    def step(self, **info: Any):
        from .._steps import record_step

        t = self.current()
        if t is None:
            return None
        rec = record_step(t, **{k: v for k, v in info.items() if v is not None})
        for s in self.sinks:
            s.emit(rec)
        return rec

    def end(self) -> None:
        import memviz

        t = self.tracker if self.tracker is not None else memviz.active_tracker()
        try:
            if t is not None and self.diagnose:
                self.findings = memviz.diagnose(t)
                log = logging.getLogger("memviz")
                for f in self.findings:
                    log.warning("%s", f)
        finally:
            if self._own and t is not None and t.running:
                t.stop()
            for s in self.sinks:
                s.close()
