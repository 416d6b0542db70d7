"""Exports of what memviz recorded to viewers that already exist.

* :func:`memviz.export.perfetto.write`: Chrome trace JSON (Trace Event Format)
  for Perfetto and chrome://tracing: counters of live memory per device and
  category, allocation spans carrying size, kind, label and line.
* :func:`memviz.export.torch_snapshot.write`: a pickle in the format of
  ``torch.cuda.memory._dump_snapshot``, for PyTorch's memory_viz.

Both take a :class:`~memviz.Tracker` (running or stopped) or a loaded trace;
``Tracker.to_perfetto(path)`` and ``Tracker.to_torch_snapshot(path)`` call them.
"""

from memviz.export import perfetto, torch_snapshot

__all__ = ["perfetto", "torch_snapshot"]
