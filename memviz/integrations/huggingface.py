"""Hugging Face transformers: ``attach(trainer)``, a ``TrainerCallback``.

::

    from memviz.integrations.huggingface import attach
    trainer = transformers.Trainer(model=..., args=..., train_dataset=...)
    callback = attach(trainer)       # options as MemvizCallback's: attach(trainer, jsonl="steps.jsonl")
    trainer.train()

Records a memviz step at the end of every optimizer step (with
``global_step``), and logs ``memviz.diagnose()`` findings when training ends.
Arguments: ``tracker`` (default: the running one, else one the callback starts
and stops), ``diagnose=True``, ``metrics=True``, ``prefix="memviz"``, and the
step sinks of ``memviz.watch`` (``callback=``, ``log=``, ``print_every=``,
``jsonl=``, ``csv=``, ``tensorboard=``), which work with or without metrics.

It uses transformers' public callback API only: the ``TrainerCallback``
events, ``Trainer.add_callback`` / ``pop_callback``, and reads of
``trainer.callback_handler.callbacks`` (the order the events go in, which
transformers' own integrations read too), ``args``, ``state`` and ``logs``.
It sets no attribute of the Trainer and wraps none of its methods.

Metrics in the Trainer's logs (``metrics=True``). Every ``logging_steps``
``Trainer.log(logs)`` appends a copy of ``logs`` to ``state.log_history``,
then calls each callback's ``on_log`` with ``logs`` itself, in the order of
the callback list. The Trainer builds that list as: its flow callback, the
``report_to`` integrations (TensorBoard, W&B, MLflow, ...), the callbacks
given to ``Trainer(callbacks=[...])``, then the progress bar or printer.
The callback's ``on_log`` adds memviz's metrics of the steps since the
previous log (names in memviz.integrations) to ``logs``, for every callback
after it, and to the ``log_history`` entry just made. So where it sits
decides who gets them:

* ``attach(trainer)`` (or ``MemvizCallback(...).attach(trainer)``) adds it
  just before the first callback that reads the logs (whose class has its own
  ``on_log``: the ``report_to`` integrations, a logger of yours, the progress
  bar), by popping that callback and every one after it and adding them back
  after memviz's, in their order: so the metrics reach every ``report_to``
  integration, ``log_history`` and the printed logs, and the other callbacks
  keep their order. Call it before ``train()``; callbacks added later come
  after memviz's, and get the metrics too.
* ``Trainer(callbacks=[MemvizCallback()])`` puts it after the ``report_to``
  integrations, too late for them: their ``on_log`` has run before memviz's.
  The metrics still reach ``state.log_history`` (so the saved
  ``trainer_state.json``) and the callbacks after it (the progress bar or
  printer), and the callback says so once, on the ``memviz`` logger, when
  ``args.report_to`` names integrations. ``attach`` is the way to reach them.
* Or name the reporting callbacks yourself, after memviz's:
  ``Trainer(..., report_to="none", callbacks=[MemvizCallback(),
  TensorBoardCallback()])``.

``metrics=False`` leaves the logs alone.

When training fails. transformers has no exception event: an exception that
escapes ``Trainer.train()`` (a dataset that raises, an out-of-memory error)
reaches no callback, and ``on_train_end`` does not come. The tracker the
callback started then keeps running, until the first of:

* the next ``on_train_begin`` of this callback (``trainer.train()`` again,
  or transformers' ``auto_find_batch_size`` retrying after an out-of-memory
  error): it stops that tracker, which keeps what it saw, logs its findings
  and out-of-memory report, and starts a new one;
* ``callback.finish(exc)``, in your ``except`` around ``trainer.train()``,
  which does the same at once and keeps ``exc`` in ``callback.error``;
* the callback being garbage-collected (the Trainer dropped), or the
  process exiting: the same, logged then.

A tracker the user started or passed is never stopped by the callback.
Findings are logged on the world's process zero only (``state.
is_world_process_zero``); every process keeps its own in ``callback.findings``.
"""

from __future__ import annotations

import logging
from typing import Any, List, Optional

from memviz.integrations.callbacks import CoreViews

try:
    from transformers import TrainerCallback
except ImportError as e:
    raise ImportError(
        "memviz.integrations.huggingface needs transformers, which is not installed: "
        "pip install transformers. Without it, call tracker.step() at the end of each step or "
        "use memviz.watch(optimizer).") from e

__all__ = ["MemvizCallback", "attach"]


class MemvizCallback(CoreViews, TrainerCallback):
    """A transformers TrainerCallback recording a memviz step per optimizer
    step; ``attach(trainer)`` adds it where its metrics reach ``report_to``."""

    #: set by attach(): the callback sits before the callbacks that read the logs
    _placed = False
    #: whether the callback said that report_to runs before it (once)
    _said_late = False

    def attach(self, trainer: Any) -> "MemvizCallback":
        """Add this callback to ``trainer`` (or move it, if it is there
        already) just before the first callback that reads the logs, with
        the Trainer's public ``pop_callback`` and ``add_callback``; the other
        callbacks keep their order. Returns the callback. Call it before
        ``trainer.train()``."""
        from memviz._errors import InvalidArgumentType

        if not all(callable(getattr(trainer, m, None)) for m in ("add_callback", "pop_callback")):
            raise InvalidArgumentType(
                f"MemvizCallback.attach(trainer) takes a transformers Trainer (with add_callback and "
                f"pop_callback), got {type(trainer).__name__}")
        before = _callbacks(trainer)
        if before is None:  # no list to read: added at the end, as add_callback does
            trainer.add_callback(self)
            logging.getLogger("memviz").warning(
                "memviz: could not read the order of this Trainer's callbacks "
                "(trainer.callback_handler.callbacks); memviz's callback was added at the end, after "
                "any report_to integration, which will not get its metrics.")
            return self
        if any(cb is self for cb in before):
            trainer.pop_callback(self)
            before = [cb for cb in before if cb is not self]
        at = next((i for i, cb in enumerate(before) if _reads_logs(cb)), len(before))
        tail = before[at:]
        for cb in tail:
            trainer.pop_callback(cb)
        trainer.add_callback(self)
        for cb in tail:
            trainer.add_callback(cb)
        now = _callbacks(trainer) or []
        want = before[:at] + [self] + tail
        if len(now) != len(want) or any(a is not b for a, b in zip(now, want)):
            logging.getLogger("memviz").warning(
                "memviz: the Trainer's callbacks did not come out in the order asked for (%s); "
                "callbacks before memviz's may not get its metrics.", _names(now))
        self._placed = True
        return self

    def finish(self, error: Optional[BaseException] = None) -> None:
        """Training raised ``error`` (transformers tells no callback): stop
        the tracker this callback started, which keeps what it saw, and log
        its findings and out-of-memory report now, rather than at the next
        ``train()`` or at exit. ``callback.error`` keeps ``error``. Nothing
        to do when the training ended, or the tracker was not this callback's.
        """
        self._core.fail(error, None if error is not None else "training did not end")

    # -- the events ------------------------------------------------------------

    def on_train_begin(self, args, state, control, **kwargs) -> None:
        self._core.log_here = bool(getattr(state, "is_world_process_zero", True))
        self._core.begin()
        if self._core.metrics and not self._placed and not self._said_late and self._core.log_here:
            names = _reporting(args)
            if names:
                self._said_late = True
                logging.getLogger("memviz").warning(
                    "memviz: this MemvizCallback was not placed with attach(trainer): given to "
                    "Trainer(callbacks=...), it comes after report_to %s, which runs before it and "
                    "so does not get memviz's metrics (trainer.state.log_history and the callbacks "
                    "after it do). What to do: add it with "
                    "memviz.integrations.huggingface.attach(trainer), or call "
                    "callback.attach(trainer), which puts it before them.", names)

    def on_step_end(self, args, state, control, **kwargs) -> None:
        self._core.step(global_step=getattr(state, "global_step", None))

    def on_train_end(self, args, state, control, **kwargs) -> None:
        self._core.end()

    def on_log(self, args, state, control, logs=None, **kwargs) -> None:
        """The metrics of the steps since the previous log into ``logs``
        (for the callbacks after this one) and into the ``log_history``
        entry ``Trainer.log`` has just made of it."""
        if not self._core.metrics or not isinstance(logs, dict):
            return
        metrics = self._core.take_metrics().get("/")
        if not metrics:
            return
        added = {k: v for k, v in metrics.items() if k not in logs}  # never over a value already logged
        logs.update(added)
        history = getattr(state, "log_history", None)
        entry = history[-1] if isinstance(history, list) and history else None
        if isinstance(entry, dict) and entry.get("step") == getattr(state, "global_step", None) and \
                all(entry[k] is v for k, v in logs.items() if k in entry and k not in added):
            for k, v in added.items():
                entry.setdefault(k, v)


def attach(trainer: Any, tracker: Any = None, **options: Any) -> MemvizCallback:
    """A new :class:`MemvizCallback` (``tracker`` and ``options`` as its
    arguments) added to ``trainer`` before the callbacks that read the logs,
    so that its metrics reach every ``report_to`` integration (see the module
    docstring). Returns the callback. A Trainer that has a MemvizCallback
    already is refused: ``callback.attach(trainer)`` moves that one."""
    from memviz._errors import InvalidArgument

    for cb in _callbacks(trainer) or ():
        if isinstance(cb, MemvizCallback):
            raise InvalidArgument(
                "attach(trainer): this Trainer has a MemvizCallback already (two would record every "
                "step twice). What to do: call that_callback.attach(trainer), which moves it before "
                "the report_to integrations, or trainer.pop_callback(that_callback) first.")
    return MemvizCallback(tracker, **options).attach(trainer)


def _callbacks(trainer: Any) -> Optional[List[Any]]:
    """The trainer's callbacks, in the order their events are called, or None."""
    callbacks = getattr(getattr(trainer, "callback_handler", None), "callbacks", None)
    return list(callbacks) if isinstance(callbacks, (list, tuple)) else None


def _reads_logs(callback: Any) -> bool:
    """Whether the callback's class has an on_log of its own (and is not memviz's)."""
    return not isinstance(callback, MemvizCallback) and \
        getattr(type(callback), "on_log", None) is not getattr(TrainerCallback, "on_log", None)


def _reporting(args: Any) -> List[str]:
    """The integrations ``args.report_to`` names ([] for none)."""
    report_to = getattr(args, "report_to", None)
    if isinstance(report_to, str):
        report_to = [report_to]
    if not isinstance(report_to, (list, tuple)):
        return []
    return [str(r) for r in report_to if r not in (None, "none")]


def _names(callbacks: List[Any]) -> str:
    return ", ".join(type(cb).__name__ for cb in callbacks)
