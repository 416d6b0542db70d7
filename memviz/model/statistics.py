"""Statistics: what ``Snapshot.statistics()`` and ``compare_to()`` return
(:class:`Statistic`, :class:`StatisticDiff`, tracemalloc's shapes) and the
keys they group by.

The model floor (docs/architecture.md): reads an allocation's fields and
imports nothing above the model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Tuple

from memviz._units import format_size
from memviz.model.traceback import Traceback

#: key types accepted by Snapshot.statistics() and compare_to()
KEY_TYPES: Tuple[str, ...] = ("lineno", "filename", "traceback", "label", "device", "kind", "thread",
                               "category", "autograd_node", "op")


_CUMULATIVE_KEYS = ("lineno", "filename")


def _key_str(key: Any) -> str:
    if isinstance(key, int) and not isinstance(key, bool):
        return f"cuda:{key}" if key >= 0 else f"device {key}"
    return str(key)


@dataclass(frozen=True, slots=True)
class Statistic:
    """Total size and count of the allocations that share a key.

    ``str()`` reads like tracemalloc:
    ``train.py:3: size=256 MiB, count=1, average=256 MiB``.
    """

    size: int
    count: int
    traceback: Traceback
    key: Any = None

    def __str__(self) -> str:
        text = f"{_key_str(self.key)}: size={format_size(self.size)}, count={self.count}"
        if self.count:
            text += f", average={format_size(self.size / self.count)}"
        return text


@dataclass(frozen=True, slots=True)
class StatisticDiff:
    """The difference of one key's :class:`Statistic` between two snapshots.

    ``size``/``count`` are the new snapshot's values, ``*_diff`` new minus old.
    """

    size: int
    size_diff: int
    count: int
    count_diff: int
    traceback: Traceback
    key: Any = None

    def __str__(self) -> str:
        text = (
            f"{_key_str(self.key)}: size={format_size(self.size)} "
            f"({format_size(self.size_diff, sign=True)}), "
            f"count={self.count} ({self.count_diff:+d})"
        )
        if self.count:
            text += f", average={format_size(self.size / self.count)}"
        return text


def _label_key(a: Any) -> str:
    if a.label is not None:
        return a.label
    return "<no label>" if a.traceback else f"<thread {a.thread.name}>"


#: the key functions of the keys that are an allocation's own field (an Allocation -> key)
_SIMPLE_KEYS: Dict[str, Callable[[Any], Any]] = {
    "label": _label_key,
    "device": lambda a: a.device,
    "kind": lambda a: a.kind,
    "thread": lambda a: a.thread.name,
    "category": lambda a: a.category or "<unknown>",
    "autograd_node": lambda a: (f"{a.autograd_node} ({a.forward})" if a.forward else a.autograd_node)
    if a.autograd_node else "<not in backward>",
    "op": lambda a: getattr(a, "op", None) or "<no call>",  # duck-typed report sources may lack it
}
