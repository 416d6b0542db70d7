"""Step records: what ``Tracker.step()`` records at the end of a training
step (made by memviz/analysis/steps.py, read back by the trace reader)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, Dict, List, Optional

from memviz._units import escape_controls, format_size


_NAMES: Dict[type, tuple] = {}


def _flat(obj: Any) -> Dict[str, Any]:
    """``dataclasses.asdict`` of a dataclass of plain values (DeviceStep,
    GrowthLine), without its deep copy of each value: a notebook view reads
    every step's record (30,000 steps: a second of asdict alone)."""
    names = _NAMES.get(type(obj))
    if names is None:
        names = _NAMES[type(obj)] = tuple(f.name for f in fields(obj))
    out = {n: getattr(obj, n) for n in names}
    if any(isinstance(v, (list, dict, tuple, set)) for v in out.values()):
        return asdict(obj)  # a value that asdict would copy: as it would
    return out


@dataclass
class DeviceStep:
    """One device's memory at the end of a step.

    ``current``/``peak``/``growth``/``live_count`` are driver-level (what
    memviz captures; None when memviz did not capture this device);
    ``allocated``/``reserved``/``allocated_peak`` are PyTorch's caching
    allocator's numbers (None unless PyTorch had initialised CUDA).
    ``segment_*`` count the driver allocations and frees during the step.
    """

    current: Optional[int] = None
    peak: Optional[int] = None
    growth: Optional[int] = None
    live_count: Optional[int] = None
    segment_allocs: int = 0
    segment_frees: int = 0
    segment_alloc_bytes: int = 0
    allocated: Optional[int] = None
    reserved: Optional[int] = None
    allocated_peak: Optional[int] = None


@dataclass
class GrowthLine:
    """A user line whose surviving allocations changed during a step."""

    location: str  # "file:line"
    name: str  # function name
    bytes: int  # net growth of its live bytes during the step
    count: int  # net growth of its live allocation count
    live_bytes: int  # its live bytes at the end of the step
    live_count: int
    #: of those, PyTorch's blocks (growth and live at the end): what a finding
    #: about PyTorch's allocated memory reads, since the segments a line made
    #: hold blocks counted at their own lines (None in a trace of an older memviz)
    block_bytes: Optional[int] = None
    block_live_bytes: Optional[int] = None

    def __str__(self) -> str:
        return f"{self.location}: {format_size(self.bytes, sign=True)} (live {format_size(self.live_bytes)})"


@dataclass
class StepRecord:
    """What one training step did to GPU memory (see the module docstring).

    ``index`` counts from 0; ``duration_ns`` is the time since the previous
    step (or since the tracker started); ``info`` is what was passed to
    ``t.step(**info)`` (shapes become tuples of ints); ``autograd_seq`` is the
    autograd sequence number at the step's end (lets diagnose() find graphs
    that outlive their step).
    """

    index: int
    timestamp_ns: int
    duration_ns: int
    devices: Dict[int, DeviceStep] = field(default_factory=dict)
    lines: List[GrowthLine] = field(default_factory=list)
    info: Dict[str, Any] = field(default_factory=dict)
    autograd_seq: Optional[int] = None

    # -- totals over the GPUs (device >= 0) -----------------------------------

    def _sum(self, attr: str) -> Optional[int]:
        vals = [getattr(d, attr) for k, d in self.devices.items() if k >= 0]
        vals = [v for v in vals if v is not None]
        return sum(vals) if vals else None

    @property
    def current(self) -> Optional[int]:
        """Driver-level bytes on all GPUs at the step's end."""
        return self._sum("current")

    @property
    def peak(self) -> Optional[int]:
        """Sum of each GPU's highest level inside the step."""
        return self._sum("peak")

    @property
    def growth(self) -> Optional[int]:
        return self._sum("growth")

    @property
    def allocated(self) -> Optional[int]:
        return self._sum("allocated")

    @property
    def reserved(self) -> Optional[int]:
        return self._sum("reserved")

    def to_dict(self) -> Dict[str, Any]:
        """A JSON-ready dict (device keys become strings); see :meth:`from_dict`."""
        return {
            "index": self.index,
            "timestamp_ns": self.timestamp_ns,
            "duration_ns": self.duration_ns,
            "devices": {str(k): _flat(v) for k, v in self.devices.items()},
            "lines": [_flat(line) for line in self.lines],
            "info": {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.info.items()},
            "autograd_seq": self.autograd_seq,
        }

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "StepRecord":
        """Rebuild a record from :meth:`to_dict` output (e.g. from a trace file)."""
        info = {k: (tuple(v) if isinstance(v, list) else v) for k, v in d.get("info", {}).items()}
        return cls(
            index=int(d["index"]), timestamp_ns=int(d["timestamp_ns"]),
            duration_ns=int(d.get("duration_ns") or 0),
            devices={int(k): DeviceStep(**v) for k, v in d.get("devices", {}).items()},
            lines=[GrowthLine(**g) for g in d.get("lines", [])],
            info=info, autograd_seq=d.get("autograd_seq"))

    def summary(self) -> str:
        """One line: the step, its time, each GPU's numbers and the top growing line."""
        parts = []
        for dev in sorted(k for k in self.devices if k >= 0):
            d = self.devices[dev]
            text = f"cuda:{dev}"
            if d.current is not None:
                text += (f" current {format_size(d.current)} ({format_size(d.growth or 0, sign=True)}),"
                         f" peak {format_size(d.peak or 0)}")
            if d.allocated is not None:
                text += f", allocated {format_size(d.allocated)}, reserved {format_size(d.reserved or 0)}"
            parts.append(text)
        text = f"memviz step {self.index} ({self.duration_ns / 1e9:.3f} s): " + ("; ".join(parts) or "no GPU memory seen")
        grew = [g for g in self.lines if g.bytes > 0]
        if grew:
            text += f"; grew: {grew[0].location} ({format_size(grew[0].bytes, sign=True)})"
        return escape_controls(text)  # a file name that is not UTF-8 or with controls, shown escaped

    __str__ = summary
