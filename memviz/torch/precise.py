"""Precise mode: PyTorch on the driver's stream-ordered pool, so every tensor
allocation and free is a driver call that memviz sees.

PyTorch picks its allocator backend from ``PYTORCH_ALLOC_CONF`` /
``PYTORCH_CUDA_ALLOC_CONF`` when its CUDA library loads (at ``import torch``),
so precise mode has to be chosen before that.
"""

from __future__ import annotations

import os
import sys

from .._errors import MemvizError

__all__ = ["PreciseModeTooLate", "enable", "merged_conf", "active"]

BACKEND = "cudaMallocAsync"
_ENV_NAMES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")


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
    for name in _ENV_NAMES:
        if os.environ.get(name):
            return name
    return "PYTORCH_CUDA_ALLOC_CONF"


def active() -> bool:
    """Whether PyTorch (imported) uses the stream-ordered allocator."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    try:
        return torch.cuda.get_allocator_backend() == BACKEND
    except Exception:  # noqa: BLE001 - CPU-only builds
        return False


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
