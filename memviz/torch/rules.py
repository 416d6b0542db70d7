"""PyTorch's caching-allocator settings, as memviz needs them to size blocks.

The C store sizes each block PyTorch hands out by PyTorch's own rules
(src/blocks.h): its rounding (``roundup_power2_divisions``), when it splits
a free block (``max_split_size_mb``, ``expandable_segments``). Those come
from ``PYTORCH_CUDA_ALLOC_CONF`` (or ``PYTORCH_ALLOC_CONF``), read when the
allocator route attaches: PyTorch reads them once, when CUDA starts, so the
environment then is what it runs with. (A change made later through
``torch.cuda.memory._set_allocator_settings`` is not seen.)

With the GIL, at attach; never on the capture path.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import memviz._core as _core
from memviz.model.pytorch import alloc_conf

__all__ = ["Settings", "parse", "from_environment", "apply"]

MiB = 1 << 20
INTERVALS = 16  # roundup_power2_divisions' size intervals: 1 MiB .. 64 GiB


class Settings:
    """What the block rules need: max_split_size in bytes (None: not set),
    16 roundup_power2_divisions (0: none) and expandable_segments."""

    def __init__(self, max_split: Optional[int] = None, divisions: Optional[List[int]] = None,
                 expandable: bool = False) -> None:
        self.max_split = max_split
        self.divisions = list(divisions or [0] * INTERVALS)
        self.expandable = expandable

    def as_dict(self) -> Dict[str, object]:
        return {"max_split_size": self.max_split, "roundup_power2_divisions": self.divisions,
                "expandable_segments": self.expandable}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Settings) and self.as_dict() == other.as_dict()

    def __repr__(self) -> str:
        return f"Settings({self.as_dict()})"


def _split(conf: str) -> List[Tuple[str, str]]:
    """key:value pairs, split at commas outside brackets."""
    out, depth, cur = [], 0, ""
    for ch in conf + ",":
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if ch == "," and depth == 0:
            if cur.strip():
                key, _, value = cur.partition(":")
                out.append((key.strip(), value.strip()))
            cur = ""
        else:
            cur += ch
    return out


def _divisions(value: str) -> List[int]:
    """roundup_power2_divisions: one number for every interval, or a list
    [MiB:divisions, ..., >:divisions], as PyTorch reads it (a key names the
    interval of sizes from that many MiB; the first also fills the intervals
    below it; ">" fills the rest)."""
    div = [0] * INTERVALS
    value = value.strip()
    if not value.startswith("["):
        return [int(value)] * INTERVALS
    last, first = 0, True
    for item in value.strip("[]").split(","):
        key, _, v = item.partition(":")
        key, n = key.strip(), int(v)
        if key == ">":
            for k in range(last, INTERVALS):
                div[k] = n
            continue
        mib = int(key)
        if mib <= 0 or mib & (mib - 1):
            raise ValueError(f"roundup_power2_divisions: {mib} is not a power of two")
        index = min(mib.bit_length() - 1, INTERVALS - 1)
        if first:
            for k in range(0, index):
                div[k] = n
            first = False
        div[index] = n
        last = index + 1
    return div


def parse(conf: str) -> Settings:
    """Settings from a PYTORCH_CUDA_ALLOC_CONF string (what memviz does not
    need is ignored; what it cannot read is left at PyTorch's default)."""
    s = Settings()
    for key, value in _split(conf or ""):
        try:
            if key == "max_split_size_mb":
                s.max_split = int(float(value) * MiB) or None
            elif key == "roundup_power2_divisions":
                s.divisions = _divisions(value)
            elif key == "expandable_segments":
                s.expandable = value.strip().lower() == "true"
        except ValueError:
            continue
    return s


def from_environment(environ=None) -> Settings:
    """The settings PyTorch reads from its environment variables
    (memviz.model.pytorch.alloc_conf: where memviz reads them)."""
    return parse(alloc_conf(environ))


def apply(settings: Settings) -> None:
    """Hand the settings to the C store (src/blocks.h)."""
    _core.block_rules(settings.max_split or 0, settings.divisions, settings.expandable)
