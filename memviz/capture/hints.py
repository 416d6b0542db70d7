"""Whether GPU capture can run in this process, and what to tell the user
when it cannot: :class:`CaptureWarning`, the fork()ed-child rule, starting
the C core's CUPTI subscription (:func:`subscribe`) and the hint for a failed
CUPTI call, :func:`available`, and what ``capture_info()`` says of the
library and of PyTorch's route.

Owns the fork flags (``_forked_after_cupti``, ``_warned_fork``) and the
"GPU capture is off" warning flag; the tracker calls :func:`after_fork` from
its own at-fork handler, so the order of the two is fixed.

Imports the bottom floor, the model and capture/cupti.py only
(docs/architecture.md: the capture floor).
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any, Dict, Optional, Tuple

import memviz._core as _core
from memviz._errors import CaptureConflict, CaptureUnavailable
from memviz._package import PACKAGE_DIR
from memviz.capture import cupti as _capture
from memviz.model.frame_filter import warning_site

__all__ = ["CaptureWarning", "FORK_ADVICE", "fork_reason", "after_fork", "warn_forked", "warn_gpu_off",
           "subscribe", "hint_for", "silence_hint", "available", "library_info", "pytorch_route"]


class CaptureWarning(UserWarning):
    """GPU capture is off for this tracker; the message says why."""


CaptureWarning.__module__ = "memviz"  # the public name (memviz.CaptureWarning)

FORK_ADVICE = ("CUDA and CUPTI cannot be used in a fork()ed child (their state belongs to the "
               "parent), so GPU capture is off in this process; memviz's CPU-side features "
               "(labels, steps, the PyTorch integration on CPU) still work. To capture GPU memory "
               "in a worker process, start it with the 'spawn' or 'forkserver' method "
               "(multiprocessing.set_start_method('spawn'), or DataLoader(multiprocessing_context="
               "'spawn')).")

#: in a fork()ed child of a process that had loaded CUPTI: why GPU capture is off here
_forked_after_cupti: Optional[str] = None
_warned_fork = False
_warned_gpu_off = False


def after_fork(was_capturing: bool) -> None:
    """In a fork()ed child (the tracker's at-fork handler calls this first):
    if the parent had loaded CUPTI, GPU capture stays off here, and says so
    once more."""
    global _forked_after_cupti, _warned_fork
    if _capture.loaded() is not None or _forked_after_cupti is not None:
        was = "was capturing GPU allocations" if was_capturing else "had loaded CUPTI"
        _forked_after_cupti = (f"this process (pid {os.getpid()}) is a fork()ed child of process "
                               f"{os.getppid()}, which {was}. " + FORK_ADVICE)
        _warned_fork = False


def fork_reason() -> Optional[str]:
    """Why this process must not use CUPTI because it is a fork()ed child, or None."""
    if _forked_after_cupti is not None:
        return _forked_after_cupti
    cuda = getattr(sys.modules.get("torch"), "cuda", None)
    try:
        bad = bool(cuda._is_in_bad_fork()) if cuda is not None and hasattr(cuda, "_is_in_bad_fork") else False
    except Exception:  # noqa: BLE001 - a check, never an error for the user
        bad = False
    if bad:
        return ("this process is a fork()ed child of a process that had initialised CUDA "
                "(PyTorch says so). " + FORK_ADVICE)
    return None


def warn_forked(reason: str) -> None:
    """CaptureWarning, once per fork()ed child: GPU capture is off for ``reason``."""
    global _warned_fork
    if not _warned_fork:
        _warned_fork = True
        level, _ = warning_site()
        warnings.warn(f"memviz: GPU capture is off: {reason}", CaptureWarning, stacklevel=level)


def warn_gpu_off(why: str) -> None:
    """CaptureWarning, once per process: no GPU here (``why``), with how to
    silence it from the entry point that started the tracker."""
    global _warned_gpu_off
    if not _warned_gpu_off:
        _warned_gpu_off = True
        level, entry = warning_site()
        warnings.warn(
            f"memviz: GPU capture is off: {why}. Tracking still works for the "
            f"features that need no GPU; {silence_hint(entry)}.",
            CaptureWarning, stacklevel=level)


def silence_hint(entry: Optional[str]) -> str:
    """How to turn GPU capture off, and so silence CaptureWarning, from the
    entry point that started the tracker (``entry``: the file of the outermost
    memviz frame, see memviz.model.frame_filter.warning_site)."""
    where = os.path.relpath(entry, PACKAGE_DIR).replace(os.sep, "/") if entry else ""
    if where == "integrations/ipython.py":
        return "add --no-gpu to the magic's line (%%memviz --no-gpu) to silence this warning"
    if where == "integrations/pytest_plugin.py":
        return "run pytest with -W ignore::memviz.CaptureWarning to silence this warning"
    if where.startswith("integrations/"):
        return ("the training callback started this tracker and has no option for it: to silence this "
                "warning, run the training inside `with memviz.track(gpu=False):` (the callback then "
                "records on that tracker), or call "
                "`warnings.filterwarnings('ignore', category=memviz.CaptureWarning)` before it")
    if where == "cli/run.py":
        return "pass --no-gpu to memviz run to silence this warning"
    return "pass gpu=False (`memviz.track(gpu=False)`) to silence this warning"


def subscribe(depth: int, activity: bool) -> Tuple[bool, Optional[str]]:
    """Load libcupti and start the C core's capture; returns (activity
    records on, why not). Raises CaptureUnavailable (with what was tried and
    what to do) or CaptureConflict (another profiler holds CUPTI)."""
    lib = _capture.load()  # raises CaptureUnavailable with what it tried
    st = _core.start(depth=depth, activity=activity)
    result, step, error, holder = st.result, st.step, st.error, st.holder
    activity_on, activity_error = st.activity, st.activity_error
    # 39 on CUPTI 12+; older CUPTI answered a second subscriber with 12.
    if result == _core.ERROR_MULTIPLE_SUBSCRIBERS or (result == 12 and step == "cuptiSubscribe"):
        raise CaptureConflict(holder or None, detail=f"{step} returned {error} ({result})")
    if result != 0:
        raise CaptureUnavailable(
            f"{step} failed with {error} ({result}) using {lib.path} (CUPTI version {lib.version})",
            lib.tried + [f"{lib.path}: loaded ({lib.how})", f"{step}: {error} ({result})"],
            hint=hint_for(result),
        )
    return bool(activity_on), activity_error or None


def pytorch_route(t: Any) -> Dict[str, Any]:
    """How tracker ``t`` (the running or last one, or None) sees PyTorch's
    memory: "route" is "allocator" (every block of its caching allocator),
    "cudaMallocAsync" (PyTorch on the driver's pool) or "segments", with
    "reason" whenever it is not "allocator"."""
    integ = getattr(t, "torch", None) if t is not None else None
    route = getattr(integ, "route", None)
    if route is None:
        alloc = sys.modules.get("memviz.torch.allocator")
        route = alloc.last_route() if alloc is not None else None
    if route is None:
        why = ("no tracker has attached to PyTorch yet" if "torch" in sys.modules
               else "PyTorch is not imported")
        return {"route": None, "reason": why}
    return route.as_dict()


def hint_for(result: int) -> str:
    """What to do about a CUPTI call that failed with ``result``."""
    if result == 35:
        return ("The driver restricts profiling to administrators: run as root or with "
                "CAP_SYS_ADMIN, or set the nvidia module option NVreg_RestrictProfilingToAdminUsers=0.")
    if result in (14, 15):
        return ("This libcupti does not work with the installed driver (a CUPTI newer than the "
                "driver is the usual cause): use the CUPTI of the CUDA version your framework was "
                "built with (e.g. the nvidia-cuda-cupti wheel), or update the driver.")
    return CaptureUnavailable.DEFAULT_HINT


def available() -> bool:
    """Whether GPU capture can run here (a GPU is present and CUPTI loads)."""
    if fork_reason() is not None:
        return False
    if not os.environ.get(_capture.ENV_LIBRARY) and not _capture.gpu_present()[0]:
        return False
    try:
        _capture.load()
    except CaptureUnavailable:
        return False
    return True


def library_info(probe: bool = True) -> Dict[str, Any]:
    """Whether CUPTI loaded, which file, which version, and why not (the
    library half of ``memviz.capture_info()``; see there for ``probe``)."""
    present, why = _capture.gpu_present()
    lib = _capture.loaded()
    reason = fork_reason()
    if reason is not None:
        lib = None
    elif lib is None:
        if not probe:
            reason = "libcupti is not loaded (no tracker has captured GPU allocations yet)"
        elif os.environ.get(_capture.ENV_LIBRARY) or present:
            try:
                lib = _capture.load()
            except CaptureUnavailable as e:
                reason = e.reason
        else:
            reason = why
    info: Dict[str, Any] = {
        "available": lib is not None,
        "reason": reason,
        "gpu_present": present,
        "gpu_detail": why,
        "library": lib.path if lib else None,
        "version": lib.version if lib else None,
        "cuda_major": lib.cuda_major if lib else None,
        "found_by": lib.how if lib else None,
        "tried": (lib.tried if lib else _capture.last_tried()),
        "python_frames_abi": _core.FRAMES_ABI,
    }
    core = _core.cupti_info()
    if core:
        info["subscribe_v2"] = core["subscribe_v2"]
    return info
