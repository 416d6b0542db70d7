"""PyTorch Lightning: ``trainer = Trainer(callbacks=[MemvizCallback()])``.

Records a memviz step after every training batch (with the batch's shape,
``batch_idx`` and ``global_step``), and logs ``memviz.diagnose()`` findings
when training ends. When training raises, Lightning calls ``on_exception``: the
tracker the callback started is stopped, keeping what it saw, and its findings
and out-of-memory report are logged (``callback.error`` holds the exception).

The steps go to the trainer's loggers as ``DeviceStatsMonitor``'s figures do:
when the trainer has a logger (``trainer.loggers``), at each logging step
(``Trainer(log_every_n_steps=...)``) the callback calls
``logger.log_metrics(metrics, step=...)`` on each, with the step Lightning's
own ``self.log`` uses, and memviz's metrics of the steps since the previous
logging step (names in memviz.integrations, joined with the logger's
``group_separator``). ``metrics=False`` leaves the loggers alone.

Arguments: ``tracker`` (default: the running one, else one the callback
starts and stops), ``diagnose=True``, ``metrics=True``, ``prefix="memviz"``,
and the step sinks of ``memviz.watch`` (``callback=``, ``log=``,
``print_every=``, ``jsonl=``, ``csv=``, ``tensorboard=``), which work with or
without the loggers.
"""

from __future__ import annotations

from memviz.integrations.callbacks import CoreViews, batch_shape

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

    def on_train_start(self, trainer, pl_module) -> None:
        # findings logged once, on rank zero, as Lightning's own messages (rank_zero_info); every
        # rank keeps its own in callback.findings
        self._core.log_here = bool(getattr(trainer, "is_global_zero", True))
        self._core.begin()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        rec = self._core.step(batch_shape=batch_shape(batch), batch_idx=batch_idx,
                              global_step=getattr(trainer, "global_step", None))
        if rec is not None and self._core.metrics:
            self._log_metrics(trainer)

    def _log_metrics(self, trainer) -> None:
        """The pending steps' metrics to each of the trainer's loggers, at a
        logging step (as DeviceStatsMonitor and LightningModule.log do)."""
        loggers = getattr(trainer, "loggers", None)
        if loggers is None:  # a Lightning older than trainer.loggers
            loggers = [trainer.logger] if getattr(trainer, "logger", None) is not None else []
        if not loggers:
            self._core.pending.clear()  # Trainer(logger=False): nowhere to send them
            return
        connector = getattr(trainer, "_logger_connector", None)
        if connector is not None and not getattr(connector, "should_update_logs", True):
            return  # not a logging step (log_every_n_steps): these steps go with the next one
        loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
        step = getattr(loop, "_batches_that_stepped", None)
        if step is None:
            step = getattr(trainer, "global_step", None)
        seps = [getattr(lg, "group_separator", "/") or "/" for lg in loggers]
        metrics = self._core.take_metrics(seps)
        if not metrics:
            return
        for lg, sep in zip(loggers, seps):
            lg.log_metrics(dict(metrics[sep]), step=step)

    def on_train_end(self, trainer, pl_module) -> None:
        self._core.end()

    def on_exception(self, trainer, pl_module, exception) -> None:
        self._core.fail(exception)
