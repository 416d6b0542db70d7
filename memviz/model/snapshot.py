"""Snapshots of live GPU allocations, shaped like :mod:`tracemalloc`'s API.

A :class:`Snapshot` holds :class:`Allocation` objects, each tied to the Python
:class:`Traceback` that made it. ``Snapshot.statistics()`` groups them the way
``tracemalloc.Snapshot.statistics()`` does, and ``compare_to()`` diffs two
snapshots.

Differences from tracemalloc, on purpose:

* A :class:`Traceback` is, as in tracemalloc, a tuple of :class:`Frame` from
  the oldest frame to the most recent (``tb[-1]`` is the line that
  allocated). ``str(traceback)`` and the ``"lineno"`` key use the *user's*
  frame (the innermost non-library frame, see :mod:`memviz.model.frame_filter`), not
  the innermost frame.
* Allocations made by threads with no Python frames (e.g. PyTorch's autograd
  threads) have an empty traceback. ``"lineno"`` and ``"filename"`` group
  them by the rule of :mod:`memviz.model.lines`: inside an autograd node,
  under the forward line that made the node, one row per node (a
  :class:`~memviz.model.lines.BackwardFrame`, shown
  ``train.py:15 (backward: AddmmBackward0)``; ``"filename"``: the forward
  line's file); else under a pseudo-frame ``<thread NAME>``. ``"traceback"``
  keeps the raw frames: ``<thread NAME>`` for every frameless allocation.
* Every :class:`Statistic` carries ``.key``, the value it groups by: a
  :class:`Frame` (``"lineno"``), a file name str (``"filename"``), a
  :class:`Traceback` (``"traceback"``), a label str (``"label"``), a device
  index int (``"device"``), a kind str (``"kind"``) or a thread name str
  (``"thread"``). For the frame-based key types ``.traceback`` is the matching
  traceback (1 frame for ``"lineno"``/``"filename"``); for the others it is an
  empty Traceback and ``.key`` is what to look at.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Any, Callable, Dict, Iterable, Iterator, List, Mapping, NamedTuple, Optional, Sequence, Tuple

import memviz._core as _core
from memviz._args import bad_type, flag, whole
from memviz._errors import InvalidArgument
from memviz._units import format_size
from memviz.model import display
from memviz.model.frame_filter import FrameFilter, frames as _default_filter
from memviz.model.lines import pseudo_frame, thread_frame, where as _where
from memviz.model.statistics import (_CUMULATIVE_KEYS, _SIMPLE_KEYS, KEY_TYPES, Statistic, StatisticDiff,
                                     _key_str)
from memviz.model.traceback import _FRAME_KEYS, EMPTY_TRACEBACK, Frame, Traceback

#: Labels set by the autograd integration start with this character and
#: carry "node\x1fforward line"; everything else is a user label. Labels the
#: C callback makes itself (src/nodes.c) carry "#<stack id>" as the forward
#: line, resolved to the stack's user line when a snapshot is built.
AUTOGRAD_LABEL = "\x01"


def encode_node_label(node: str, forward: Optional[str]) -> str:
    return f"{AUTOGRAD_LABEL}{node}\x1f{forward or ''}"


def decode_label(label: Optional[str]) -> Tuple[Optional[str], Optional[str], Optional[str]]:
    """(user label, autograd node, forward line) of a raw label."""
    if not label or label[0] != AUTOGRAD_LABEL:
        return label, None, None
    head, _, tail = label[1:].partition("\x1f")
    return None, head or None, tail or None

__all__ = [
    "ThreadInfo", "Allocation", "Snapshot", "KIND_NAMES", "Segment",
]

#: kind_code of a raw row -> Allocation.kind, from the C core's MVZ_KIND_*
#: (src/types.h; _core.KIND_DEVICE, ...): "device", "host", "managed",
#: "static", "physical", "block"
KIND_NAMES: Tuple[str, ...] = tuple(
    name[len("KIND_"):].lower()
    for name, _ in sorted(((n, getattr(_core, n)) for n in dir(_core) if n.startswith("KIND_")),
                          key=lambda kv: kv[1]))



@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cyclic collector off while a snapshot's objects are built
    (then on again, if it was): they hold no cycles, yet every few thousand
    new tuples trigger a collection that walks all of them. A million rows
    took three times as long with it on (benchmarks/RESULTS.md, "Snapshots
    at scale"). Process-wide for that while: other threads' cycles wait."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


class ThreadInfo(NamedTuple):
    """The thread that made an allocation.

    ``native_id`` is the OS thread id, ``ident`` the ``threading.get_ident()``
    value (pthread id), ``name`` the Python thread name when the thread has a
    ``threading.Thread`` object, else the OS thread name.
    """

    native_id: Optional[int]
    ident: Optional[int]
    name: str


class Allocation(NamedTuple):
    """One live GPU allocation.

    Attributes:
        address: device (or host, for pinned memory) address.
        size: bytes.
        device: CUDA device index.
        kind: ``"device"``, ``"host"`` (pinned), ``"managed"``, ``"static"``
            (module globals), ``"physical"`` (``cuMemCreate`` handle) or
            ``"block"`` (a block PyTorch's caching allocator handed out: a
            tensor's storage, or raw memory such as a cuBLAS workspace; it
            lies inside a segment, a ``"device"`` allocation).
        stream: the stream handle for stream-ordered allocations, else 0.
        thread: :class:`ThreadInfo` of the allocating thread.
        label: the label active when it was made (``memviz`` labels), or None.
        timestamp_ns: when it was made.
        traceback: the Python stack (empty when the thread had no Python frames).
        seq: capture sequence number (orders allocations).
        autograd_node: the backward node running when it was made
            (``"MmBackward0"``), or None outside backward.
        forward: for backward allocations, the forward line that created the
            node (``"train.py:42"``), when known.
        category: what the memory is (``"parameter"``, ``"gradient"``,
            ``"optimizer_state"``, ``"activation"``, ``"temporary"``,
            ``"other_pytorch"``, ``"outside_pytorch"``...), when the PyTorch
            integration could tell; else None.
        op: what the innermost Python frame was calling when it was made:
            ``"torch.nn.functional.linear"``, ``"torch.matmul"``, ``"x.float"``
            (as written), ``"operator @"``; None with no Python frames (backward
            on the engine's threads), on Python 3.10, or where the source
            cannot be read. Named when the snapshot is built, from the
            frame's instruction (no cost while the program runs).
        segment: for a ``"block"``, the address of the segment it lies in,
            when known.
        before_tracking: made before tracking started (read from PyTorch's
            own ``memory_snapshot()`` when tracking started: no line unless
            PyTorch's memory history was on then).
        requested: the bytes asked for (``size`` less, for a block, PyTorch's
            rounding and the remainder it did not split off), when known.
        size_estimated: a block whose size PyTorch's rules could not fix
            exactly (expandable segments): ``size`` is then the rounded request.
    """

    address: int
    size: int
    device: int
    kind: str
    stream: int
    thread: ThreadInfo
    label: Optional[str]
    timestamp_ns: int
    traceback: Traceback
    seq: int = 0
    autograd_node: Optional[str] = None
    forward: Optional[str] = None
    category: Optional[str] = None
    op: Optional[str] = None
    segment: Optional[int] = None
    before_tracking: bool = False
    requested: Optional[int] = None
    size_estimated: bool = False

    @property
    def user_frame(self) -> Optional[Frame]:
        """Shortcut for ``self.traceback.user_frame``."""
        return self.traceback.user_frame

    def __repr__(self) -> str:
        where = _where(self)
        return (
            f"<Allocation {format_size(self.size)} {self.kind} on cuda:{self.device} "
            f"at {self.address:#x} from {where}>"
        )


class Segment(NamedTuple):
    """A segment of PyTorch's caching allocator and the blocks live in it.

    Attributes:
        device: CUDA device index.
        address, size: the segment's range.
        allocated: bytes of its live blocks.
        unused: ``size - allocated``: reserved by PyTorch, held by no block.
        largest_free: the largest gap between live blocks (what the next
            allocation in this segment can get at most).
        free_gaps: how many gaps there are.
        blocks: the live blocks (``Allocation`` of kind ``"block"``), by address.
        traceback: where the segment was made (empty before tracking).
        before_tracking: made before tracking started.
        expandable: an expandable segment (``expandable_segments:True``).
        timestamp_ns: when memviz saw it made (None: not seen made).
    """

    device: int
    address: int
    size: int
    allocated: int
    unused: int
    largest_free: int
    free_gaps: int
    blocks: Tuple["Allocation", ...]
    traceback: "Traceback"
    before_tracking: bool = False
    expandable: bool = False
    timestamp_ns: Optional[int] = None


class Snapshot:
    """A set of live allocations at one moment.

    Args:
        allocations: :class:`Allocation` objects (kept in the given order).
        timestamp_ns: when the snapshot was taken, if known.
        devices: device metadata: a mapping ``{index: info}`` or an iterable
            of indices. Defaults to the devices the allocations are on.
        frame_filter: decides the user's frame for ``"lineno"``/``"filename"``
            statistics; the default filter ``memviz.frames`` if None.
    """

    def __init__(
        self,
        allocations: Iterable[Allocation],
        *,
        timestamp_ns: Optional[int] = None,
        devices: "Mapping[int, Any] | Iterable[int] | None" = None,
        frame_filter: Optional[FrameFilter] = None,
    ) -> None:
        self.allocations: Tuple[Allocation, ...] = tuple(allocations)
        self.timestamp_ns = timestamp_ns
        #: which peak this snapshot holds: "device" or "tensor" (peak_snapshot()), else None
        self.peak: Optional[str] = None
        #: why some block sizes may differ from PyTorch's, when they may (else None)
        self.size_note: Optional[str] = None
        if devices is None:
            self.devices: Dict[int, Any] = {d: None for d in sorted({a.device for a in self.allocations})}
        elif isinstance(devices, Mapping):
            self.devices = dict(devices)
        else:
            self.devices = {d: None for d in devices}
        self.frame_filter = frame_filter

    #: a snapshot of groups (memviz.model.rows.snapshot_from_groups, for
    #: Tracker.top): how many allocations each of ``allocations`` stands for
    _weights: Optional[Sequence[int]] = None

    #: tensors autograd graphs held when the snapshot was taken (PyTorch
    #: integration with graph residency on); None: not recorded
    graph_records: Optional[list] = None
    #: PyTorch's own figures per device (allocated, reserved, active), when known
    torch_stats: dict = {}
    #: PyTorch's caching-allocator segments with their live blocks (the
    #: allocator route), or None where memviz saw no blocks
    segments: Optional[List[Segment]] = None
    #: how memviz saw PyTorch's memory: {"route": ..., "reason": ...}, or None
    pytorch: Optional[dict] = None

    def as_groups(self, weights: Sequence[int]) -> "Snapshot":
        """This snapshot, marked as one of groups: ``weights[i]`` is how many
        allocations ``allocations[i]`` stands for (its statistics count them).
        Returns the snapshot itself."""
        if len(weights) != len(self.allocations):
            raise ValueError(f"{len(weights)} weights for {len(self.allocations)} groups")
        self._weights = list(weights)
        return self

    def fragmentation(self, device: Optional[int] = None) -> Dict[int, Dict[str, int]]:
        """Per device: ``reserved``, ``allocated``, ``unused`` bytes of
        PyTorch's segments, the ``largest_free`` gap and the number of
        ``free_gaps``, and ``segments``; {} without segments."""
        out: Dict[int, Dict[str, int]] = {}
        for seg in self.segments or ():
            if device is not None and seg.device != device:
                continue
            d = out.setdefault(seg.device, {"segments": 0, "reserved": 0, "allocated": 0, "unused": 0,
                                            "largest_free": 0, "free_gaps": 0})
            d["segments"] += 1
            d["reserved"] += seg.size
            d["allocated"] += seg.allocated
            d["unused"] += seg.unused
            d["largest_free"] = max(d["largest_free"], seg.largest_free)
            d["free_gaps"] += seg.free_gaps
        return out

    def _repr_html_(self) -> Optional[str]:
        return display.html("snapshot", self)

    def graph_resident(self) -> list:
        """Tensors the autograd graph keeps for backward (any device, CPU too),
        each with its size and the line that saved it; see memviz.torch.graph.

        Raises GraphNotRecorded when the tracker did not record them
        (``graph=True``, or ``autograd=True``, turns that on)."""
        if self.graph_records is None:
            from memviz._errors import GraphNotRecorded
            raise GraphNotRecorded()
        return list(self.graph_records)

    # -- container protocol ------------------------------------------------

    def __len__(self) -> int:
        return len(self.allocations)

    def __iter__(self) -> Iterator[Allocation]:
        return iter(self.allocations)

    def __repr__(self) -> str:
        devs = sorted({a.device for a in self.allocations})
        where = ", ".join(f"cuda:{d}" for d in devs) if devs else "no device"
        return f"<Snapshot {len(self.allocations)} allocation(s), {format_size(self.total_bytes())} on {where}>"

    # -- simple queries ----------------------------------------------------

    def total_bytes(self, device: Optional[int] = None) -> int:
        """Sum of allocation sizes, on one device index or on all (None)."""
        if device is None:
            return sum(a.size for a in self.allocations)
        whole(device, "Snapshot.total_bytes(device=...)", none=True)
        return sum(a.size for a in self.allocations if a.device == device)

    def by_device(self) -> Dict[int, "Snapshot"]:
        """Split into one Snapshot per device index, in device order."""
        groups: Dict[int, List[Allocation]] = {}
        for a in self.allocations:
            groups.setdefault(a.device, []).append(a)
        return {
            d: Snapshot(groups[d], timestamp_ns=self.timestamp_ns,
                        devices={d: self.devices.get(d)}, frame_filter=self.frame_filter)
            for d in sorted(groups)
        }

    def filter(self, predicate: Callable[[Allocation], bool]) -> "Snapshot":
        """A new Snapshot with the allocations for which ``predicate(a)`` is true.

        Example: ``snap.filter(lambda a: a.kind == "device" and a.size >= 1 << 20)``.
        """
        if not callable(predicate):
            raise bad_type("Snapshot.filter(predicate)", predicate,
                           "a function taking an Allocation and returning true to keep it")
        return Snapshot([a for a in self.allocations if predicate(a)], timestamp_ns=self.timestamp_ns,
                        devices=self.devices, frame_filter=self.frame_filter)

    def filter_traces(self, filters: Iterable[Any]) -> "Snapshot":
        """A new Snapshot with the allocations that ``filters`` keep, like
        :meth:`tracemalloc.Snapshot.filter_traces`.

        ``filters`` is a list of :class:`memviz.Filter` and
        :class:`memviz.DomainFilter` (domain: the CUDA device index). An
        allocation is kept when an inclusive filter matches it (or there is
        none) and no exclusive filter matches it; an empty list keeps all.
        ``Filter`` matches the user's frame (the ``"lineno"`` key), or every
        frame with ``all_frames=True``; see :mod:`memviz.model.filters`.

        Example: ``snap.filter_traces([memviz.Filter(False, "*/site-packages/*", all_frames=True)])``.
        """
        from memviz.model.filters import filter_allocations
        kept = filter_allocations(self.allocations, filters, self._filter().pick)
        return Snapshot(kept, timestamp_ns=self.timestamp_ns, devices=self.devices,
                        frame_filter=self.frame_filter)

    # -- grouping ----------------------------------------------------------

    def _filter(self) -> FrameFilter:
        return self.frame_filter if self.frame_filter is not None else _default_filter

    def _group(self, key_type: str, cumulative: bool) -> Dict[Any, list]:
        """key -> [size, count, traceback] for the given key type."""
        if key_type not in KEY_TYPES:
            raise InvalidArgument(f"unknown key_type {key_type!r}; use one of {', '.join(KEY_TYPES)}")
        flag(cumulative, "cumulative")
        if cumulative and key_type not in _CUMULATIVE_KEYS:
            raise InvalidArgument(
                f"cumulative mode cannot be used with key_type {key_type!r}; "
                f"use it with 'lineno' or 'filename'"
            )
        groups: Dict[Any, list] = {}
        if self._weights is not None:
            return self._group_weighted(key_type, cumulative)
        if key_type not in _FRAME_KEYS:
            key_of = _SIMPLE_KEYS[key_type]
            for a in self.allocations:
                key = key_of(a)
                g = groups.get(key)
                if g is None:
                    groups[key] = [a.size, 1, EMPTY_TRACEBACK]
                else:
                    g[0] += a.size
                    g[1] += 1
            return groups

        # Stage 1: bucket by traceback object (interned, so cheap) or, for
        # frameless allocations, by the frame they stand under
        # (memviz/model/lines.py: the thread, or the autograd node's forward
        # line; "traceback" keeps the raw <thread NAME>).
        raw = key_type == "traceback"
        buckets: Dict[Any, list] = {}
        for a in self.allocations:
            tb = a.traceback
            bkey = id(tb) if tb else (thread_frame(a.thread.name) if raw else pseudo_frame(a))
            b = buckets.get(bkey)
            if b is None:
                buckets[bkey] = [a.size, 1, tb, bkey]
            else:
                b[0] += a.size
                b[1] += 1

        return self._merge_buckets(buckets, key_type, cumulative)

    def _group_weighted(self, key_type: str, cumulative: bool) -> Dict[Any, list]:
        """_group for a snapshot of groups (``_weights[i]``: the allocations
        that allocations[i] stands for, its size their sum)."""
        groups: Dict[Any, list] = {}
        pairs = zip(self.allocations, self._weights)
        if key_type not in _FRAME_KEYS:
            key_of = _SIMPLE_KEYS[key_type]
            for a, w in pairs:
                key = key_of(a)
                g = groups.get(key)
                if g is None:
                    groups[key] = [a.size, w, EMPTY_TRACEBACK]
                else:
                    g[0] += a.size
                    g[1] += w
            return groups
        raw = key_type == "traceback"
        buckets: Dict[Any, list] = {}
        for a, w in pairs:
            tb = a.traceback
            bkey = id(tb) if tb else (thread_frame(a.thread.name) if raw else pseudo_frame(a))
            b = buckets.get(bkey)
            if b is None:
                buckets[bkey] = [a.size, w, tb, bkey]
            else:
                b[0] += a.size
                b[1] += w
        return self._merge_buckets(buckets, key_type, cumulative)

    def _merge_buckets(self, buckets: Dict[Any, list], key_type: str, cumulative: bool) -> Dict[Any, list]:
        groups: Dict[Any, list] = {}
        # Stage 2: map each bucket to its key(s) and merge.
        flt = self._filter()
        one_frame: Dict[Frame, Traceback] = {}

        def tb_of(frame: Frame) -> Traceback:
            t = one_frame.get(frame)
            if t is None:
                t = one_frame[frame] = Traceback((frame,), flt)
            return t

        for size, count, tb, bkey in buckets.values():
            if not tb:
                tb = tb_of(bkey)
            if key_type == "traceback":
                items = [(tb, tb)]
            elif key_type == "lineno":
                if cumulative:
                    items = [(f, tb_of(f)) for f in dict.fromkeys(tb)]
                else:
                    f = flt.pick(tb)
                    items = [(f, tb_of(f))]
            else:  # filename
                if cumulative:
                    names = dict.fromkeys(f.filename for f in tb)
                else:
                    names = (flt.pick(tb).filename,)
                items = [(fn, tb_of(Frame(fn, 0, ""))) for fn in names]
            for key, key_tb in items:
                g = groups.get(key)
                if g is None:
                    groups[key] = [size, count, key_tb]
                else:
                    g[0] += size
                    g[1] += count
        return groups

    def statistics(self, key_type: str = "lineno", cumulative: bool = False) -> List[Statistic]:
        """Group allocations by ``key_type`` into :class:`Statistic` objects.

        Key types: ``"lineno"`` (the user's frame; for allocations made with
        no Python frames inside an autograd node, the node's forward line and
        the node, ``train.py:15 (backward: AddmmBackward0)``, one row per node:
        see :mod:`memviz.model.lines`), ``"filename"`` (that frame's file),
        ``"traceback"`` (the full stack, raw), ``"label"`` (the label,
        ``"<no label>"``, or ``"<thread NAME>"`` for unlabelled allocations from
        threads without Python frames), ``"device"``, ``"kind"``, ``"thread"``.

        With ``cumulative=True`` (``"lineno"`` and ``"filename"`` only) each
        allocation counts under every distinct frame / file of its stack, as in
        tracemalloc. Sorted by size, then count, largest first.
        """
        with gc_paused():
            groups = self._group(key_type, cumulative)
            stats = [Statistic(size, count, tb, key) for key, (size, count, tb) in groups.items()]
            stats.sort(key=lambda s: (-s.size, -s.count, _key_str(s.key)))
        return stats

    def compare_to(
        self, old_snapshot: "Snapshot", key_type: str = "lineno", cumulative: bool = False
    ) -> List[StatisticDiff]:
        """Differences from ``old_snapshot`` to this one, per key.

        Keys present in only one snapshot appear with size/count 0 on the other
        side. Keys are those of :meth:`statistics`: a backward line
        (forward line + node) is its own key on both sides. Sorted by the
        absolute size difference, then size, absolute count difference and
        count, largest first.
        """
        if not isinstance(old_snapshot, Snapshot):
            raise bad_type("Snapshot.compare_to(old_snapshot)", old_snapshot, "a memviz Snapshot")
        new = self._group(key_type, cumulative)
        old = old_snapshot._group(key_type, cumulative)
        diffs: List[StatisticDiff] = []
        for key, (size, count, tb) in new.items():
            o = old.get(key)
            osize, ocount = (o[0], o[1]) if o is not None else (0, 0)
            diffs.append(StatisticDiff(size, size - osize, count, count - ocount, tb, key))
        for key, (osize, ocount, tb) in old.items():
            if key not in new:
                diffs.append(StatisticDiff(0, -osize, 0, -ocount, tb, key))
        diffs.sort(key=lambda d: (-abs(d.size_diff), -d.size, -abs(d.count_diff), -d.count, _key_str(d.key)))
        return diffs


