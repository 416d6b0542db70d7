"""Precise mode: PyTorch on the driver's stream-ordered pool, so every tensor
allocation and free is a driver call that memviz sees.

PyTorch picks its allocator backend from ``PYTORCH_ALLOC_CONF`` /
``PYTORCH_CUDA_ALLOC_CONF`` when its CUDA library loads (at ``import torch``),
so precise mode has to be chosen before that.
"""

from __future__ import annotations

import ctypes
import os
import sys
from typing import Any, Optional

import memviz._core as _core
from memviz._errors import MemvizError
from memviz.capture.session import PRECISE_BACKEND, allocator_backend
from memviz.model.pytorch import ALLOC_CONF_NAMES

__all__ = ["PreciseModeTooLate", "enable", "merged_conf", "active", "attach_wrappers", "detach_wrappers"]

BACKEND = PRECISE_BACKEND


class PreciseModeTooLate(MemvizError):
    """Precise mode was asked for after PyTorch chose its allocator."""

    def __init__(self, backend: str) -> None:
        super().__init__(
            f"memviz precise mode needs PyTorch's backend:{BACKEND} allocator, but PyTorch already "
            f"chose the {backend!r} allocator when it was imported. What to do: choose precise mode "
            f"before `import torch` — run `python -m memviz run --precise script.py`, or call "
            f"memviz.track(precise=True) (or memviz.torch.precise.enable()) before importing torch, "
            f"or start Python with PYTORCH_CUDA_ALLOC_CONF=backend:{BACKEND}.")
        self.backend = backend


def merged_conf(conf: str) -> str:
    """``conf`` with backend:cudaMallocAsync, keeping the user's other settings."""
    parts = [p.strip() for p in conf.split(",") if p.strip()]
    parts = [p for p in parts if p.split(":", 1)[0].strip() != "backend"]
    return ",".join([f"backend:{BACKEND}"] + parts)


def _env_name() -> str:
    for name in ALLOC_CONF_NAMES:
        if os.environ.get(name):
            return name
    return "PYTORCH_CUDA_ALLOC_CONF"


def active() -> bool:
    """Whether PyTorch (imported) uses the stream-ordered allocator (asked
    through the capture session, which reads precise mode for everyone)."""
    return "torch" in sys.modules and allocator_backend() == BACKEND


def enable() -> str:
    """Choose precise mode; returns how ("environment set", "already active").

    Raises PreciseModeTooLate when torch already loaded another backend."""
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            backend = torch.cuda.get_allocator_backend()
        except Exception:  # noqa: BLE001 - a CPU build has no CUDA allocator
            backend = None
        if backend == BACKEND:
            return "already active"
        if backend is not None:
            raise PreciseModeTooLate(backend)
    name = _env_name()
    os.environ[name] = merged_conf(os.environ.get(name, ""))
    return f"{name}={os.environ[name]}"


#: The library whose stream-ordered calls memviz wraps in precise mode.
LIBRARY = "/libc10_cuda.so"


def attach_wrappers(library: Optional[str] = None) -> str:
    """See PyTorch's cudaMallocAsync/cudaFreeAsync at the call instead of
    through CUPTI's callbacks (src/interpose.h): the callbacks' dispatch is
    most of precise mode's cost. ``library`` (PyTorch's allocator; default
    LIBRARY) must be
    wrapped; PyTorch's other loaded libraries that call these functions are
    wrapped too. Returns how allocations are captured: "wrappers (...)" or
    "CUPTI callbacks (reason)". CUPTI keeps everything else;
    MEMVIZ_PRECISE_CAPTURE=cupti keeps the CUPTI route for these calls too
    (then other libraries' plain cuMemAllocAsync calls are seen as well)."""
    if os.environ.get("MEMVIZ_PRECISE_CAPTURE", "").strip().lower() == "cupti":
        return "CUPTI callbacks (MEMVIZ_PRECISE_CAPTURE=cupti)"
    library = library or LIBRARY
    n, reason = _core.interpose_attach(library)
    if not n:
        return f"CUPTI callbacks ({reason})"
    names = [library.rsplit("/", 1)[-1]]
    torch = sys.modules.get("torch")
    libdir = os.path.join(os.path.dirname(getattr(torch, "__file__", "") or ""), "lib")
    for name in sorted(os.listdir(libdir)) if torch is not None and os.path.isdir(libdir) else ():
        if name.endswith(".so") and name != names[0]:
            more, why = _core.interpose_attach(f"/torch/lib/{name}")
            if more:
                n += more
                names.append(name)
            elif "imports neither" not in why and "no loaded library" not in why:
                # It calls them but cannot be wrapped: its calls would be lost
                # once CUPTI's callbacks are off, so keep CUPTI for all.
                _core.interpose_detach()
                return f"CUPTI callbacks ({why})"
    if not _core.interpose_commit():
        return "CUPTI callbacks (CUPTI would not switch its stream-ordered callbacks off)"
    return f"wrappers around cudaMallocAsync/cudaFreeAsync in {', '.join(names)} ({n} GOT slots)"


def detach_wrappers() -> None:
    """Undo attach_wrappers (a no-op when nothing is attached)."""
    _core.interpose_detach()


_CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE = 17  # CUDA 11.3 on
_cu_pointer_get_attribute: Any = None


def from_stream_ordered_pool(address: int) -> Optional[bool]:
    """Whether the driver says ``address`` lies in a stream-ordered memory
    pool (as every allocation of PyTorch's cudaMallocAsync backend does), or
    None where the driver cannot say (no libcuda, freed memory, no context on
    this thread). With the GIL, outside any CUPTI callback: a driver query."""
    global _cu_pointer_get_attribute
    if _cu_pointer_get_attribute is None:
        try:
            # Only the driver this process already loaded (RTLD_NOLOAD): never load it.
            lib = ctypes.CDLL("libcuda.so.1", mode=getattr(os, "RTLD_NOLOAD", 0) | ctypes.RTLD_LOCAL)
            fn = lib.cuPointerGetAttribute
            fn.restype, fn.argtypes = ctypes.c_int, [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64]
        except (OSError, AttributeError):  # not loaded (yet): ask again next time
            return None
        _cu_pointer_get_attribute = fn
    pool = ctypes.c_void_p()
    if _cu_pointer_get_attribute(ctypes.byref(pool), _CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE, address) != 0:
        return None
    return bool(pool.value)
