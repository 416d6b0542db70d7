"""What running trackers share when they nest (docs/architecture.md): the
capture's settings (what a nested tracker cannot ask for otherwise), the
store's windows, its one step mark per stack, and the PyTorch integration's
once-per-process hooks.

Reads the running trackers (memviz/capture/running.py) duck-typed: their
``_view``, ``_kept_changes`` and ``torch`` attributes; imports the capture
floor only.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Tuple

import memviz._core as _core
from memviz._errors import AlreadyTracking
from memviz.capture.running import lock, running
from memviz.capture.store import NoGpuWindow, Window

__all__ = ["refuse_nesting", "open_window", "share_marks", "share_torch_features"]


def refuse_nesting(tracker: Any, shared: Mapping[str, Any]) -> None:
    """Raise AlreadyTracking where ``tracker`` asks for what the running
    capture (set up as ``shared`` says) cannot share with it."""
    where = shared["where"]
    if tracker.trace_path is not None:
        raise AlreadyTracking(
            f"this tracker would be nested in the one started at {where}, and a nested tracker "
            "cannot stream its own trace (trace=): the event stream serves one trace file per "
            "process. Leave out trace= and call t.save(path) after the block, or stream from the "
            "outermost tracker (memviz run -o FILE).")
    if tracker._depth_given and tracker.depth != shared["depth"]:
        raise AlreadyTracking(
            f"this tracker asks for depth={tracker.depth}, but it would be nested in the tracker "
            f"started at {where}, whose capture keeps depth={shared['depth']} frames, shared by "
            f"the trackers nested in it. Pass depth={shared['depth']} or leave depth out, or "
            "start the outer tracker with the depth you need.")
    if tracker.precise and not shared["precise"]:
        raise AlreadyTracking(
            f"precise mode must be chosen by the outer tracker (started at {where}) before CUDA "
            "initialises; a tracker nested in it cannot switch it on. Start the outer tracker "
            "with precise=True (memviz run --precise), or leave precise out here.")


def open_window() -> Tuple[Window, Dict[int, int]]:
    """A new window of the store and the bytes per device live as it opens;
    AlreadyTracking when MAX_WINDOWS are open. Its step marks start now
    (the other trackers keep theirs)."""
    opened = _core.window_open()
    if opened is None:
        raise AlreadyTracking(
            f"{_core.MAX_WINDOWS} nested trackers are already running in this process, the "
            "most memviz keeps figures for at once. Stop one of them first, or read the "
            "figures of the tracker they are nested in.")
    wid, start, baseline = opened.id, opened.start_ns, opened.live
    view = Window(wid, start)
    share_marks(None, view.step_mark().changes)
    return view, baseline


def share_marks(me: Optional[Any], changed: List[tuple]) -> List[tuple]:
    """The store keeps one step mark per stack for all trackers: the changes
    one tracker's mark takes are kept for every other running tracker until
    its own next mark (so each sees the changes since its own previous mark,
    or its start). Returns ``me``'s changes, its kept ones included."""
    with lock:
        for t in running:
            if t is not me and changed and not isinstance(t._view, NoGpuWindow):
                _absorb(t._kept_changes, changed)
        mine = me._kept_changes if me is not None else {}
        if me is not None:
            me._kept_changes = {}
    if not mine:
        return changed
    _absorb(mine, changed)
    return list(mine.values())


def _absorb(kept: Dict[int, Any], changed: List[Any]) -> None:
    """Add step-mark changes (``_core.StepChange``) into ``kept``, per stack."""
    for c in changed:
        old = kept.get(c.stack_id)
        if old is not None:
            c = _core.StepChange((c.stack_id, c.live_bytes, c.live_count,
                                  c.delta_bytes + old.delta_bytes, c.delta_count + old.delta_count,
                                  c.block_bytes, c.block_delta + old.block_delta))
        kept[c.stack_id] = c


def share_torch_features(tracker: Any, integ: Any) -> None:
    """A nested tracker's PyTorch integration: autograd labels and graph
    recording are installed once per process (PyTorch has one node-counter
    hook and one saved-tensor hook stack), so a nested tracker uses the ones
    a running tracker installed, and installs them itself only where none
    did. They end when the tracker that installed them stops. Precise mode's
    wrappers and the allocator route belong to the first tracker."""
    integ._precise = False
    providers = [t.torch for t in running if getattr(t, "torch", None) is not None and t.torch._active]
    route_owner = next((p for p in providers if p.route is not None), None)
    if route_owner is not None:
        integ.route_from = route_owner  # one vtable swap per process: the allocator route too
    if integ.autograd and any(p.autograd for p in providers):
        integ.autograd = False  # the capture already carries the labels
    if integ.record_graph:
        owner = next((p for p in providers if p.record_graph), None)
        if owner is not None:
            integ.record_graph = False
            tracker.graph = owner.graph
