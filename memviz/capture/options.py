"""The options of ``memviz.track()`` / ``Tracker()`` / ``memviz.start()``:
names, types and ranges, checked before anything starts.

Imports the bottom floor and the model only (docs/architecture.md: the
capture floor).
"""

from __future__ import annotations

import sys
from typing import Any

import memviz._args as _args
import memviz._core as _core
from memviz._errors import InvalidArgument, InvalidArgumentType
from memviz.model.frame_filter import FrameFilter

__all__ = ["OPTIONS", "check_options", "torch_installed"]

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
