"""Allocations the driver refused, built from failure rows: the one builder
of :class:`~memviz.model.snapshot.FailedAllocation` lists, for a live tracker
(the C core's failure rows) and a loaded trace (rows made from its FAILED
events) alike.

A failure row is the C core's ``_core.FailureRow`` (size, device, kind,
stream, thread, label, timestamp_ns, stack_id, result), read by name.

Imports the model floor only (docs/architecture.md: the model floor).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, List, Mapping, Optional, Sequence

from memviz._units import format_size
from memviz.model.frame_filter import FrameFilter
from memviz.model.lines import where as _where
from memviz.model.rows import resolve_rows
from memviz.model.snapshot import KIND_NAMES
from memviz.model.traceback import Traceback

__all__ = ["FailedAllocation", "failed_allocations"]


def failed_allocations(rows: Sequence[Sequence], resolve_stacks: Callable[[set], Mapping[int, Any]],
                       threads: Mapping[int, Sequence],
                       frame_filter: Optional[FrameFilter] = None) -> List[FailedAllocation]:
    """A :class:`FailedAllocation` per failure row, in the rows' order, with
    each traceback, thread name and label resolved as a snapshot resolves
    them (``resolve_stacks`` and ``threads`` as for snapshot_from_raw)."""
    labels, tracebacks, calls, thread_map = resolve_rows(
        {r.label for r in rows}, {r.stack_id for r in rows}, resolve_stacks, threads, frame_filter)
    return [FailedAllocation(r.size, r.device, _kind_name(r.kind), r.stream, thread_map[r.thread],
                             labels[r.label][0], r.timestamp_ns, tracebacks[r.stack_id], r.result,
                             calls.get(r.stack_id), labels[r.label][1], labels[r.label][2])
            for r in rows]


def _kind_name(code: int) -> str:
    return KIND_NAMES[code] if 0 <= code < len(KIND_NAMES) else f"unknown({code})"


@dataclass(frozen=True)
class FailedAllocation:
    """An allocation the driver refused (out of memory or another error)."""

    size: int
    device: int
    kind: str
    stream: int
    thread: Any
    label: Optional[str]
    timestamp_ns: int
    traceback: Traceback
    result: int
    #: what the innermost Python frame was calling (see ``Allocation.op``)
    op: Optional[str] = None
    #: the backward node running when it was asked for, and the forward line
    #: that made the node (see ``Allocation.autograd_node``, ``Allocation.forward``)
    autograd_node: Optional[str] = None
    forward: Optional[str] = None

    def __str__(self) -> str:
        where = _where(self)
        if self.op:
            where += f" ({self.op})"
        return (f"{where}: failed to allocate {format_size(self.size)} on "
                f"{'host' if self.device < 0 else f'cuda:{self.device}'} (CUDA error {self.result})")
