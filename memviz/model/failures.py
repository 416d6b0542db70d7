"""Allocations the driver refused, built from failure rows: the one builder
of :class:`~memviz.model.snapshot.FailedAllocation` lists, for a live tracker
(the C core's failure rows) and a loaded trace (rows made from its FAILED
events) alike.

A failure row is ``(size, device, kind_code, stream, thread_idx, label,
timestamp_ns, stack_id, result)``, read by index as the C core gives it.

Imports memviz/model/snapshot.py only (docs/architecture.md: the model floor).
"""

from __future__ import annotations

from typing import Any, Callable, List, Mapping, Optional, Sequence

from memviz.model.frame_filter import FrameFilter
from memviz.model.rows import resolve_rows
from memviz.model.snapshot import KIND_NAMES, FailedAllocation

__all__ = ["failed_allocations"]


def failed_allocations(rows: Sequence[Sequence], resolve_stacks: Callable[[set], Mapping[int, Any]],
                       threads: Mapping[int, Sequence],
                       frame_filter: Optional[FrameFilter] = None) -> List[FailedAllocation]:
    """A :class:`FailedAllocation` per failure row, in the rows' order, with
    each traceback, thread name and label resolved as a snapshot resolves
    them (``resolve_stacks`` and ``threads`` as for snapshot_from_raw)."""
    labels, tracebacks, calls, thread_map = resolve_rows(
        {r[5] for r in rows}, {r[7] for r in rows}, resolve_stacks, threads, frame_filter)
    return [FailedAllocation(r[0], r[1], _kind_name(r[2]), r[3], thread_map[r[4]], labels[r[5]][0], r[6],
                             tracebacks[r[7]], r[8], calls.get(r[7]))
            for r in rows]


def _kind_name(code: int) -> str:
    return KIND_NAMES[code] if 0 <= code < len(KIND_NAMES) else f"unknown({code})"
