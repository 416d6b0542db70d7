"""The PyTorch integration of memviz (imported lazily; torch is optional).

``memviz.track()`` attaches it when torch is imported: backward allocations
carry the autograd node and its forward line, snapshots carry a category per
allocation and PyTorch's own figures, ``snapshot.graph_resident()`` lists the
tensors autograd graphs keep, and an out-of-memory inside ``track()`` leaves
``tracker.oom_report``. ``track(precise=True)`` puts PyTorch on the driver's
stream-ordered pool so every tensor is seen.
"""

from memviz.torch.graph import GraphRecorder, SavedRecord
from memviz.torch.oom import OomReport
from memviz.torch.precise import PreciseModeTooLate

__all__ = ["GraphRecorder", "SavedRecord", "OomReport", "PreciseModeTooLate"]
