"""Whether GPU capture can run in this process, and what to tell the user
when it cannot: :class:`CaptureWarning`, the fork()ed-child rule, the hint
for a failed CUPTI call, :func:`available`, and what ``capture_info()``
says of the library, of PyTorch's route and of each capture source. (The
CUPTI subscription itself is the capture session's: capture/session.py.)

Owns the fork flags (``_forked_after_cupti``, ``_warned_fork``) and the
"GPU capture is off" warning flag; the capture session calls
:func:`after_fork` from its own at-fork handler, so the order of the two is
fixed.

Imports the bottom floor, the model and capture/cupti.py only
(docs/architecture.md: the capture floor).
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any, Dict, List, Optional

import memviz._core as _core
from memviz._errors import CaptureConflict, CaptureUnavailable
from memviz._package import PACKAGE_DIR
from memviz.capture import cupti as _capture
from memviz.model.frame_filter import warning_site

__all__ = ["CaptureWarning", "FORK_ADVICE", "fork_reason", "after_fork", "warn_forked", "warn_gpu_off",
           "conflict_reason", "warn_without_cupti", "warn_cupti_released", "capture_sources",
           "sources_line", "hint_for", "silence_hint", "available", "library_info", "pytorch_route"]


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


def conflict_reason(e: CaptureConflict) -> str:
    """Why CUPTI is not used, after ``e``: who holds it."""
    who = e.holder or "another tool (Nsight Systems, or torch.profiler run earlier in this process)"
    return f"CUPTI is held by {who}, which does not share it"


_warned_without_cupti = False


def warn_without_cupti(reason: str) -> None:
    """CaptureWarning, once per process: tracking goes on without CUPTI
    (``reason``); what that costs and what to do."""
    global _warned_without_cupti
    if _warned_without_cupti:
        return
    _warned_without_cupti = True
    level, _ = warning_site()
    warnings.warn(
        f"memviz: tracking without CUPTI: {reason.rstrip('.')}. PyTorch's memory is still seen "
        "through its caching allocator (every block and segment); what other libraries allocate "
        "(CuPy, JAX, NCCL, the CUDA context) is not seen allocation by allocation: it is counted "
        "in the memory outside PyTorch, from NVML's figure for this process. To see it all, start "
        "memviz before the other tool, or run the other tool in another process; pass "
        "cupti=False (`memviz.track(cupti=False)`, `memviz run --no-cupti`) to say this is meant "
        "and silence this warning.",
        CaptureWarning, stacklevel=level)


def warn_cupti_released(reason: str) -> None:
    """CaptureWarning: memviz gave CUPTI up while tracking (``reason``)."""
    level, _ = warning_site()
    warnings.warn(
        f"memviz: {reason.rstrip('.')}: memviz gave CUPTI up so that it works, and goes on without "
        "it. PyTorch's memory is still seen through its caching allocator (every block and segment); "
        "what other libraries allocate from now on is counted in the memory outside PyTorch, from "
        "NVML's figure for this process. To keep CUPTI for memviz, run the profiler outside the "
        "tracker (or in another process); pass cupti=False to track without CUPTI from the start.",
        CaptureWarning, stacklevel=level)


def _nvml_state() -> "tuple[bool, Optional[str]]":
    import importlib.util
    try:
        found = importlib.util.find_spec("pynvml") is not None
    except (ImportError, ValueError):
        found = False
    if found:
        return True, None
    return False, ("pynvml (nvidia-ml-py) is not importable: the memory outside PyTorch comes from "
                   "cuMemGetInfo's whole-device figure, which counts other processes too")


def capture_sources(t: Any, pytorch: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """The capture route of each source for tracker ``t`` and the reason for
    each gap: {"cupti": {...}, "allocator": {...}, "nvml": {...}, "gaps": [...]}.

    - cupti: the driver's memory calls of every library (and, with activity
      records, static module memory); "used", "reason" (why not), "shared_with".
    - allocator: PyTorch's caching allocator, wrapped: "used" (its blocks),
      "segments" ("cupti", "allocator" or None: how PyTorch's segments are seen), "reason".
    - nvml: the process's total on the device, which stands for what is not
      seen one by one (the CUDA context, other libraries without CUPTI).
    """
    gpu = bool(getattr(t, "gpu_enabled", False))
    cupti_on = gpu and bool(getattr(t, "cupti_enabled", False))
    cupti_why = None if cupti_on else (getattr(t, "cupti_off_reason", None) or getattr(t, "gpu_off_reason", None)
                                        or "GPU capture is off")
    route = pytorch if isinstance(pytorch, dict) else {}
    blocks_on = gpu and route.get("route") == "allocator"
    owner = t  # a nested tracker reads the capture of the one it is nested in
    while getattr(owner, "outer", None) is not None:
        owner = owner.outer
    segments = getattr(getattr(owner, "torch", None), "segments_route", None)
    if gpu and cupti_on:
        segments = "cupti"
    seg_why = getattr(getattr(owner, "torch", None), "segments_reason", None)
    if not gpu:
        alloc_why = getattr(t, "gpu_off_reason", None) or "GPU capture is off"
    elif not blocks_on:
        alloc_why = route.get("reason") or "PyTorch's allocator is not attached"
    else:
        alloc_why = None
    nvml_ok, nvml_why = _nvml_state()
    gaps: List[str] = []
    if gpu and not cupti_on:
        gaps.append(f"No CUPTI ({cupti_why}): allocations outside PyTorch (CuPy, JAX, NCCL, the CUDA "
                    "context) are not seen one by one; the memory outside PyTorch is the process's "
                    "total on the device minus PyTorch's segments.")
        if segments is None:
            gaps.append("PyTorch's segments are not seen as they come and go"
                        + (f" ({seg_why})" if seg_why else "") + "; the reserved total is PyTorch's own figure.")
    if gpu and not blocks_on and route.get("route") is not None:
        gaps.append(f"PyTorch's blocks are not seen one by one: {alloc_why}.")
    if gpu and not nvml_ok:
        gaps.append(nvml_why + ".")
    return {
        "cupti": {"used": cupti_on, "reason": cupti_why,
                  "shared_with": getattr(t, "cupti_shared_with", None) if cupti_on else None},
        "allocator": {"used": blocks_on, "segments": segments if gpu else None, "reason": alloc_why},
        "nvml": {"used": gpu and nvml_ok, "reason": nvml_why if gpu else None},
        "gaps": gaps,
    }


def sources_line(sources: Optional[Dict[str, Any]]) -> Optional[str]:
    """The reports' one line on how memory was captured, where CUPTI was not
    used or was shared (None where CUPTI saw everything)."""
    if not isinstance(sources, dict):
        return None
    cupti = sources.get("cupti") or {}
    alloc = sources.get("allocator") or {}
    if cupti.get("used"):
        shared = cupti.get("shared_with")
        return f"CUPTI shared with {shared} (its multi-subscriber mode)" if shared else None
    if alloc.get("used"):
        seen = ("PyTorch's blocks and segments through its allocator" if alloc.get("segments") == "allocator"
                else "PyTorch's blocks through its allocator (its segments only as PyTorch's own total)")
    else:
        seen = f"PyTorch's allocator not attached ({str(alloc.get('reason') or 'unknown reason').rstrip('.')})"
    nvml = "NVML's figure for this process" if (sources.get("nvml") or {}).get("used") else "the driver's figure"
    return (f"without CUPTI ({str(cupti.get('reason') or 'not used').rstrip('.')}): {seen}; memory outside "
            f"PyTorch from {nvml}, not allocation by allocation")


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
