"""Finding and loading libcupti, and deciding whether GPU capture can run.

docs/architecture.md, rule 5: prefer the copy already mapped in the process, then the
CUDA wheels' folders, then ``CUDA_HOME``; never map two different files.
``MEMVIZ_CUPTI_LIBRARY=/path/to/libcupti.so`` overrides the search (the test
suite points it at its libcupti test double).
"""

from __future__ import annotations

import glob
import os
import sys
import threading
from dataclasses import dataclass, field
from typing import List, Optional

import memviz._core as _core
from memviz._errors import CaptureUnavailable

ENV_LIBRARY = "MEMVIZ_CUPTI_LIBRARY"

_lock = threading.Lock()
_loaded: Optional["CuptiLibrary"] = None
_tried: List[str] = []


@dataclass
class CuptiLibrary:
    path: str
    version: int
    how: str  # "MEMVIZ_CUPTI_LIBRARY", "already mapped", "wheel", "CUDA_HOME", "system"
    tried: List[str] = field(default_factory=list)

    @property
    def cuda_major(self) -> Optional[int]:
        if self.version >= 130000:
            return self.version // 10000
        # CUPTI 12.x reported API versions 19 (12.0) to 28 (12.9 Update 1).
        return 12 if 19 <= self.version < 130000 else None


def gpu_present() -> "tuple[bool, str]":
    """Whether an NVIDIA driver and GPU are visible, without touching CUDA.

    Calling cuInit here would create driver state before the user's program
    does (and break their fork-based data loaders), so this only looks at the
    driver's device files.
    """
    gpus = glob.glob("/proc/driver/nvidia/gpus/*")
    if gpus:
        return True, f"{len(gpus)} NVIDIA GPU(s) under /proc/driver/nvidia/gpus"
    if os.path.exists("/dev/nvidiactl"):
        return True, "/dev/nvidiactl exists"
    return False, "no NVIDIA driver or GPU found (no /dev/nvidiactl, no /proc/driver/nvidia/gpus)"


def _wheel_candidates() -> List[str]:
    out = []
    for entry in sys.path:
        if not entry or not os.path.isdir(entry):
            continue
        for rel in (
            "nvidia/cu13/lib/libcupti.so.13",
            "nvidia/cuda_cupti/lib/libcupti.so.13",
            "nvidia/cuda_cupti/lib/libcupti.so.12",
            "nvidia/cu12/lib/libcupti.so.12",
        ):
            p = os.path.join(entry, rel)
            if os.path.exists(p):
                out.append(p)
    return out


def _cuda_home_candidates() -> List[str]:
    homes = [os.environ.get(v) for v in ("CUDA_HOME", "CUDA_PATH")] + ["/usr/local/cuda"]
    out = []
    for home in homes:
        if not home:
            continue
        for rel in (
            "extras/CUPTI/lib64/libcupti.so*",
            "targets/x86_64-linux/lib/libcupti.so*",
            "targets/sbsa-linux/lib/libcupti.so*",
            "lib64/libcupti.so*",
        ):
            out.extend(sorted(glob.glob(os.path.join(home, rel)), reverse=True))
    return out


def _usable(path: str) -> bool:
    # Triton ships a private libcupti for its own profiler; never map it.
    return "/triton/" not in path.replace(os.sep, "/")


def load() -> CuptiLibrary:
    """Load libcupti once per process; raise CaptureUnavailable with what was tried."""
    global _loaded
    with _lock:
        if _loaded is not None:
            return _loaded
        tried: List[str] = []

        def attempt(path: Optional[str], how: str) -> Optional[CuptiLibrary]:
            try:
                real, version = _core.cupti_load(path)
            except OSError as e:
                tried.append(f"{path or 'the libcupti mapped in this process'} ({how}): {e}")
                return None
            return CuptiLibrary(real, version, how, tried)

        explicit = os.environ.get(ENV_LIBRARY)
        if explicit:
            lib = attempt(explicit, ENV_LIBRARY)
            if lib is None:
                _tried[:] = tried
                raise CaptureUnavailable(
                    f"{ENV_LIBRARY}={explicit} could not be loaded",
                    tried,
                    hint=f"Point {ENV_LIBRARY} at an existing libcupti.so file, or unset it to let memviz search.",
                )
            _loaded = lib
            return lib

        mapped = _core.cupti_mapped()
        if mapped:
            lib = attempt(None, "already mapped")
            if lib is not None:
                _loaded = lib
                return lib
        seen = set()
        for how, paths in (("wheel", _wheel_candidates()), ("CUDA_HOME", _cuda_home_candidates())):
            for p in paths:
                real = os.path.realpath(p)
                if real in seen or not _usable(real):
                    continue
                seen.add(real)
                lib = attempt(p, how)
                if lib is not None:
                    _loaded = lib
                    return lib
        for soname in ("libcupti.so.13", "libcupti.so.12", "libcupti.so"):
            lib = attempt(soname, "system search path")
            if lib is not None:
                _loaded = lib
                return lib
        _tried[:] = tried
        raise CaptureUnavailable("libcupti was not found or could not be loaded", tried)


def loaded() -> Optional[CuptiLibrary]:
    return _loaded


def last_tried() -> List[str]:
    return list(_tried)
