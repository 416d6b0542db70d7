"""Findings and what the diagnosis rules share: :class:`Finding`,
:class:`FindingLine`, the thresholds and the step-series helpers
(memviz/analysis/diagnose.py and rules.py build on them)."""

from __future__ import annotations

import math
import re
import statistics
import sys
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

from memviz._args import whole
from memviz._units import format_size

MiB = 1 << 20


MIN_STEPS = 5  # post-warm-up steps a trend needs


GROWTH_REL = 0.05  # a rise of at least 5% of the level ...


GROWTH_FLOOR = 1 * MiB  # ... and at least this much


FRAG_REL = 0.10


OUTLIER = 1.5  # an input this many times the median input is "long"


SPIKE_REL = 0.25  # a step needing 25% more than what was live before it


CHURN_SHARE = 0.6
OUTSIDE_REL, OUTSIDE_ABS = 0.25, 256 * MiB


GRAPH_FIX = ("Keep loss.item() (or loss.detach()) instead of the tensor, and evaluate under "
             "torch.no_grad(), so each step's autograd graph is freed.")


class FindingLine(str):
    """A ``"file:line: +480 MiB (note)"`` string with ``.location``, ``.bytes``, ``.note``."""

    location: str
    bytes: int
    note: str

    def __new__(cls, location: str, nbytes: int, note: str = "", sign: bool = True):
        text = f"{location}: {format_size(nbytes, sign=sign)}" + (f" ({note})" if note else "")
        self = super().__new__(cls, text)
        self.location, self.bytes, self.note = location, int(nbytes), note
        return self

    def to_dict(self) -> Dict[str, Any]:
        return {"location": self.location, "bytes": self.bytes, "note": self.note}


@dataclass
class Finding:
    """One diagnosis: what happened (``message``, one sentence), the evidence
    (``numbers``, ``lines``), and what to do (``fix``, one sentence)."""

    kind: str
    message: str
    numbers: Dict[str, Any] = field(default_factory=dict)
    lines: List[FindingLine] = field(default_factory=list)
    fix: str = ""

    def __str__(self) -> str:
        out = [f"[{self.kind}] {self.message}"]
        out += [f"    {line}" for line in self.lines]
        if self.fix:
            out.append(f"  fix: {self.fix}")
        return "\n".join(out)

    def to_dict(self) -> Dict[str, Any]:
        return {"kind": self.kind, "message": self.message, "numbers": dict(self.numbers),
                "lines": [ln.to_dict() if isinstance(ln, FindingLine) else str(ln) for ln in self.lines],
                "fix": self.fix}


def _fit(ys: Sequence[float]):
    """(slope, r^2) of a least-squares line through (i, ys[i])."""
    n = len(ys)
    mx = (n - 1) / 2
    my = sum(ys) / n
    sxx = sum((i - mx) ** 2 for i in range(n))
    sxy = sum((i - mx) * (y - my) for i, y in enumerate(ys))
    syy = sum((y - my) ** 2 for y in ys)
    slope = sxy / sxx if sxx else 0.0
    r2 = (sxy * sxy) / (sxx * syy) if sxx and syy else 0.0
    return slope, r2


def _steady_rise(ys: Sequence[int], rel: float, floor: int, skip=()) -> Optional[Dict[str, Any]]:
    """The trend of ``ys`` if it rises steadily and enough, else None.

    Enough: the rise, end to end and along the fitted line, is at least
    ``rel`` of the highest value and ``floor``. Steady: most steps increase
    (>= 60%, twice as many ups as downs) along a straight-ish line (r^2 >=
    0.6), or it climbs in stairs (no step down, at least 3 up, r^2 >= 0.8). ``skip``: step positions whose change does not count."""
    n = len(ys)
    if n < MIN_STEPS:
        return None
    slope, r2 = _fit(ys)
    rise = ys[-1] - ys[0]
    scale = max(max(ys), 1)
    if min(rise, slope * (n - 1)) < max(rel * scale, floor):
        return None
    diffs = [ys[i] - ys[i - 1] for i in range(1, n) if i not in skip]
    ups = sum(1 for d in diffs if d > 0)
    downs = sum(1 for d in diffs if d < 0)
    steady = ((ups >= 0.6 * len(diffs) and ups >= 2 * downs and r2 >= 0.6)
              or (downs == 0 and ups >= 3 and r2 >= 0.8))
    if not steady:
        return None
    return {"rise": int(rise), "slope": int(slope), "ups": ups, "downs": downs, "r2": round(r2, 3),
            "steps": n, "start": int(ys[0]), "end": int(ys[-1])}


def _series(steps, dev: int, attr: str) -> Optional[List[int]]:
    out = []
    for s in steps:
        d = s.devices.get(dev)
        v = getattr(d, attr, None) if d is not None else None
        if v is None:
            return None
        out.append(v)
    return out


def _as_records(steps) -> list:
    """The memviz step records among ``steps`` (StepRecords, or their dicts);
    anything else (a record the program appended itself) says nothing here."""
    from memviz.model.steps import StepRecord

    out = []
    for s in steps or []:
        if isinstance(s, dict) and "index" in s and "timestamp_ns" in s:
            try:
                s = StepRecord.from_dict(s)
            except (TypeError, ValueError, KeyError, AttributeError, OverflowError):
                continue
        if isinstance(s, StepRecord):
            out.append(s)
    return out


def _warmup(n: int, warmup: Optional[int]) -> int:
    if warmup is not None:
        return whole(warmup, "memviz.diagnose(warmup=...)", low=0)  # steps to skip
    return max(3, min(10, n // 10))


def _dev(d: int) -> str:
    return f"cuda:{d}"


def _is_live_tracker(obj) -> bool:
    """A recording of this process (a Tracker), whose PyTorch and device
    figures can be asked now, not one read back from a file."""
    return getattr(obj, "is_live", False) is True


def _torch_cuda():
    torch = sys.modules.get("torch")
    try:
        if torch is not None and torch.cuda.is_initialized():
            return torch
    except Exception:  # noqa: BLE001
        pass
    return None


def _devices(steps) -> List[int]:
    return sorted({d for s in steps for d in s.devices if d >= 0})


#: numbers in step info that are not input sizes (counters, rates, losses)
_NOT_SIZES = re.compile(r"(^|_)(step|steps|idx|index|epoch|iter|iteration|lr|rate|loss|time|seed|rank)s?$")


def _input_size(v) -> Optional[float]:
    """A step-info value as an input size: a number, or a shape's element count."""
    if isinstance(v, bool) or v is None:
        return None
    try:
        if isinstance(v, (int, float)):
            x = float(v)
        elif isinstance(v, (tuple, list)) and v and all(isinstance(e, int) for e in v):
            x = float(math.prod(v))
        else:
            return None
    except OverflowError:  # beyond any float: no input has that many elements
        return None
    return x if math.isfinite(x) else None


def _input_keys(post) -> List[str]:
    """Step-info keys that describe the input's size and vary across steps."""
    keys = []
    for k in dict.fromkeys(k for s in post for k in s.info):
        if _NOT_SIZES.search(k.lower()) and not any(isinstance(s.info.get(k), tuple) for s in post):
            continue
        xs = [_input_size(s.info.get(k)) for s in post]
        if sum(x is not None for x in xs) >= 0.8 * len(post) and len({x for x in xs if x is not None}) > 1:
            keys.append(k)
    return keys


def _long_input_positions(post) -> set:
    """Positions (in ``post``) of steps whose input is a long outlier."""
    out = set()
    for k in _input_keys(post):
        xs = [_input_size(s.info.get(k)) for s in post]
        med = statistics.median([x for x in xs if x is not None])
        out |= {i for i, x in enumerate(xs) if x is not None and med > 0 and x >= OUTLIER * med}
    return out



