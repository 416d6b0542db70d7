"""The options of ``memviz.track()`` / ``Tracker()`` / ``memviz.start()``:
names, types and ranges, checked once, before anything starts, into a
frozen :class:`CaptureOptions` (the capture session keeps the running
capture's; memviz/capture/session.py).

Imports the bottom floor and the model only (docs/architecture.md: the
capture floor).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, Optional

import memviz._args as _args
import memviz._core as _core
from memviz._errors import InvalidArgument, InvalidArgumentType
from memviz.capture.rank_files import rank_path
from memviz.model.frame_filter import FrameFilter

__all__ = ["OPTIONS", "DEFAULT_DEPTH", "CaptureOptions", "check_options", "torch_installed"]

#: Python frames kept per allocation when depth= is not given
DEFAULT_DEPTH = 32

OPTIONS = ("gpu", "depth", "activity", "frame_filter", "trace", "precise", "torch", "autograd",
           "graph", "flight_recorder", "flight_dir", "cupti")


def check_options(**options: Any) -> None:
    """Tracker()/track()/start() options: names, types and ranges."""
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise InvalidArgumentType(f"memviz.track() has no option {unknown[0]!r} (given "
                                  f"{_args.given(options[unknown[0]])}); its options are "
                                  + ", ".join(OPTIONS))
    for name in ("gpu", "precise"):
        if name in options:
            _args.flag(options[name], f"memviz.track({name}=...)")
    for name in ("activity", "torch", "autograd", "graph", "cupti"):
        if name in options:
            _args.flag(options[name], f"memviz.track({name}=...)", none=True)
    if "depth" in options:
        _args.whole(options["depth"], "memviz.track(depth=...)", 1, _core.MAX_DEPTH)
    flt = options.get("frame_filter")
    if flt is not None and not isinstance(flt, FrameFilter):
        raise _args.bad_type("memviz.track(frame_filter=...)", flt,
                             "a memviz.FrameFilter (such as memviz.frames) or None")
    if options.get("trace") is not None:
        _args.path(options["trace"], "memviz.track(trace=...)")
    if options.get("flight_dir") is not None:
        _args.path(options["flight_dir"], "memviz.track(flight_dir=...)")
        if options.get("flight_recorder") is None:
            raise InvalidArgument("memviz.track(flight_dir=...) is where flight-recorder dumps go; "
                                  "give flight_recorder='256 MiB' too (or leave flight_dir out)")
    if options.get("flight_recorder") is not None and options.get("trace") is not None:
        raise InvalidArgument("memviz.track() takes trace=... or flight_recorder=..., not both: a trace "
                              "keeps every event in a file; the flight recorder keeps the latest in "
                              "memory and writes them only when something goes wrong")


def torch_installed() -> bool:
    """Whether PyTorch can be imported here (torch=None: "if torch is installed")."""
    if "torch" in sys.modules:
        return True
    import importlib.util
    try:
        return importlib.util.find_spec("torch") is not None
    except (ImportError, ValueError):
        return False


@dataclass(frozen=True)
class CaptureOptions:
    """A tracker's options, checked and with their defaults worked out;
    frozen (a capture's options cannot change once checked). See
    memviz.Tracker for what each means."""

    gpu: bool = True
    depth: int = DEFAULT_DEPTH
    #: depth= was given (a nested tracker may then not differ from its capture's)
    depth_given: bool = False
    activity: bool = True
    frame_filter: Optional[FrameFilter] = None
    #: the trace file this process writes (per rank: capture/rank_files.py), or None
    trace_path: Optional[str] = None
    precise: bool = False
    torch: Optional[bool] = None
    autograd: bool = True
    #: autograd=True (or precise mode) asked for the per-node pre-hooks
    autograd_requested: bool = False
    graph: bool = False
    #: the flight recorder's budget in bytes, or None
    flight_budget: Optional[int] = None
    flight_dir: Optional[str] = None
    cupti: Optional[bool] = None

    @classmethod
    def parse(cls, parse_budget: Optional[Callable[[Any], int]] = None, **options: Any) -> "CaptureOptions":
        """Check ``options`` (as ``memviz.track(**options)`` takes them) and
        work out their defaults; ``parse_budget`` reads flight_recorder=
        (memviz.trace.flight.parse_budget: the trace floor's, above this one)."""
        check_options(**options)
        depth = options.get("depth")
        precise = bool(options.get("precise", False))
        torch = options.get("torch")
        autograd = options.get("autograd")
        graph = options.get("graph")
        activity = options.get("activity")
        if graph is None:
            graph = autograd is True
        autograd_requested = autograd is True or precise
        if autograd is None:
            autograd = torch is not False
        if autograd and torch is False:
            raise InvalidArgument("autograd=True needs the PyTorch integration; do not pass torch=False with it")
        if graph and torch is False:
            raise InvalidArgument("graph=True needs the PyTorch integration; do not pass torch=False with it")
        budget = options.get("flight_recorder")
        if budget is not None and parse_budget is not None:
            budget = parse_budget(budget)
        trace = options.get("trace")
        flight_dir = options.get("flight_dir")
        return cls(gpu=bool(options.get("gpu", True)), depth=DEFAULT_DEPTH if depth is None else depth,
                   depth_given=depth is not None,
                   activity=(not precise) if activity is None else bool(activity),
                   frame_filter=options.get("frame_filter"),
                   trace_path=(os.path.abspath(rank_path(os.fspath(trace)))  # the folder now:
                               if trace is not None else None),  # read back after a chdir
                   precise=precise, torch=torch, autograd=bool(autograd),
                   autograd_requested=autograd_requested, graph=bool(graph), flight_budget=budget,
                   flight_dir=os.fspath(flight_dir) if flight_dir is not None else None,
                   cupti=options.get("cupti"))

    @property
    def with_torch(self) -> bool:
        """Whether the PyTorch integration is to be installed (torch=None: if torch is installed)."""
        return bool(self.torch) or (self.torch is None and torch_installed())
