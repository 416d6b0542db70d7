"""memviz: every GPU allocation in the process, tied to the Python line that made it.

Quick start::

    import memviz
    with memviz.track() as t:
        ...                                   # your GPU code
    for stat in t.peak_snapshot().statistics("lineno")[:10]:
        print(stat)

See README.md for the command line (``python -m memviz run script.py``).
"""

from memviz._errors import (AlreadyTracking, CaptureConflict, CaptureUnavailable, GraphNotRecorded,
                            InvalidArgument, InvalidArgumentType, MemvizError, NotTracking, OutputError,
                            TraceError)
from memviz._package import __version__  # noqa: F401  (memviz.__version__)
from memviz._units import format_size, parse_size
from memviz.capture.session import active_tracker
from memviz.model import display as _display
from memviz.model.failures import FailedAllocation
from memviz.model.filters import DomainFilter, Filter
from memviz.model.frame_filter import FrameFilter, frames
from memviz.model.lines import BackwardFrame, CompiledFrame
from memviz.model.snapshot import Allocation, Snapshot, ThreadInfo
from memviz.model.statistics import Statistic, StatisticDiff
from memviz.model.traceback import Frame, Traceback
from memviz.tracker import (CaptureWarning, Tracker, available, capture_info, get_traced_memory, label,
                            reset_peak, start, stop, track)

__all__ = [
    "track", "start", "stop", "label", "available", "capture_info", "active_tracker",
    "get_traced_memory", "reset_peak",
    "Tracker", "Snapshot", "Statistic", "StatisticDiff", "Allocation", "Frame", "BackwardFrame",
    "CompiledFrame",
    "Traceback", "ThreadInfo", "FailedAllocation", "FrameFilter", "frames", "Filter", "DomainFilter",
    "MemvizError", "CaptureUnavailable", "CaptureConflict", "AlreadyTracking", "NotTracking",
    "CaptureWarning", "format_size", "parse_size", "load", "TraceError", "GraphNotRecorded",
    "watch", "StepRecord", "diagnose", "Finding", "summary",
    "InvalidArgument", "InvalidArgumentType", "OutputError",
]
from memviz.integrations.ipython import load_ipython_extension  # noqa: E402,F401  (%load_ext memviz)

#: public names imported on first use (module under memviz), so that `import memviz` stays cheap
_LAZY = {"load": "loaded", "diagnose": "analysis.diagnose", "Finding": "analysis.findings",
         "watch": "analysis.steps", "StepRecord": "model.steps", "summary": "report.text"}
#: subpackages reachable as memviz.torch, memviz.report, ... after `import memviz`
#: (memviz.torch imports no torch: PyTorch is imported only where it is used)
_SUBPACKAGES = ("torch", "report", "export", "integrations")


def _snapshot_html(snapshot):
    """A Snapshot's notebook display (memviz/model/display.py): the report
    floor is imported only when a snapshot is first shown."""
    from memviz.report.notebook import snapshot_repr_html
    return snapshot_repr_html(snapshot)


_display.register("snapshot", _snapshot_html)


def __getattr__(name):
    """memviz.diagnose / Finding / watch / StepRecord and the subpackages
    memviz.torch / report / export / integrations, imported on first use so
    that `import memviz` (and the pytest plugin) stays cheap."""
    import importlib

    if name in _SUBPACKAGES:
        return importlib.import_module(f"{__name__}.{name}")  # also sets the attribute
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'memviz' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY) | set(_SUBPACKAGES))
