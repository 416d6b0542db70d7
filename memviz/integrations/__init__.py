"""Training-framework integrations: a step record per training step.

* ``memviz.integrations.lightning.MemvizCallback`` for PyTorch Lightning;
* ``memviz.integrations.huggingface.MemvizCallback`` for the transformers
  Trainer, added with ``memviz.integrations.huggingface.attach(trainer)``.

Both record ``tracker.step()`` after each training step (on the tracker you
pass, else the running one, else one they start and stop themselves), send
the records to the sinks you ask for (see ``memviz.watch``), and at the end
of training log ``memviz.diagnose()``'s findings on the ``memviz`` logger and
keep them in ``callback.findings``.

They also hand the steps to the framework's own logging, as its built-in
monitors do (``metrics=True``, the default): Lightning's callback calls
``log_metrics(metrics, step=...)`` on the trainer's loggers, transformers'
puts them in the ``logs`` of ``Trainer.log`` in its ``on_log``, so that they
reach ``state.log_history`` and, placed by ``attach(trainer)`` before them,
the ``report_to`` integrations (see huggingface.py). The metrics (:func:`step_metrics`)
cover the steps since the previous logging step, per GPU N::

    memviz/cudaN/current_MiB    driver-level memory at the last step's end
    memviz/cudaN/peak_MiB       the highest level inside those steps
    memviz/cudaN/growth_MiB     how much current grew over those steps
    memviz/cudaN/allocated_MiB  PyTorch's allocated and reserved at the last
    memviz/cudaN/reserved_MiB   step's end (when PyTorch has initialised CUDA)
    memviz/step_time_ms         the mean time of those steps

(``prefix="memviz"`` and the logger's separator, ``/`` by default; no colon
in the names, which some trackers refuse.)
"""

from memviz.integrations.callbacks import CoreViews, StepCallbackCore, batch_shape, step_metrics

__all__ = ["CoreViews", "StepCallbackCore", "batch_shape", "step_metrics"]
