"""Build and drive the stand-in for PyTorch's caching allocator
(allocator.c): the answers object the allocator route's probe asks, the same
questions memviz.torch.allocator.TorchAnswers puts to PyTorch."""

from __future__ import annotations

import ctypes
import os
import shlex
import subprocess
from pathlib import Path

from memviz.torch.allocator import HOLDER
from memviz.model.segments import PoolView

HERE = Path(__file__).resolve().parent
STATES = {0: "inactive", 1: "active_allocated", 2: "active_pending_free"}


def _cc(args):
    cc = shlex.split(os.environ.get("CC") or "cc")
    extra = shlex.split(os.environ.get("CFLAGS_EXTRA", ""))
    p = subprocess.run([*cc, "-std=c11", "-O1", "-fPIC", "-shared", "-Wall", "-Werror", *extra, *args],
                       capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(p.stderr)


def build(outdir: Path, **defines) -> Path:
    """libc10_standin.so and libc10_cuda.so in outdir (a folder per layout);
    returns the allocator library's path."""
    outdir.mkdir(parents=True, exist_ok=True)
    # Not named libc10.so: torch's own (same soname) would be used instead;
    # one for all layouts, beside their folders: a second copy of the same
    # soname would not be loaded either.
    c10 = outdir.parent / "libc10_standin.so"
    if not c10.exists():
        _cc([str(HERE / "c10.c"), "-o", str(c10)])
    lib = outdir / "libc10_cuda.so"
    flags = [f"-D{k}={v}" for k, v in sorted(defines.items())]
    # -Bsymbolic: the stand-in's own holder, even where a real libc10_cuda
    # (torch's CUDA build) exports the same symbol in the global scope.
    _cc([*flags, str(HERE / "allocator.c"), "-o", str(lib), f"-L{outdir.parent}", "-lc10_standin",
         f"-Wl,-rpath,{outdir.parent}", "-Wl,-Bsymbolic", "-lpthread"])
    return lib


class Tensor:
    """A stand-in tensor: owns a DataPtr; freed when the last reference goes."""

    def __init__(self, lib, handle):
        self.lib, self.handle = lib, handle

    def data_ptr(self) -> int:
        return self.lib.sa_tensor_data(self.handle)

    def __del__(self):
        if self.handle:
            self.lib.sa_tensor_free(self.handle)
            self.handle = None


class StandInAnswers:
    def __init__(self, path: Path, driver_alloc, driver_free=None) -> None:
        self.library = str(path)
        self.base_library = str(path.parent.parent / "libc10_standin.so")
        self.device = 0
        lib = self.lib = ctypes.CDLL(str(path))
        for name, res, args in [
            ("sa_tensor_new", ctypes.c_void_p, [ctypes.c_size_t]),
            ("sa_tensor_data", ctypes.c_uint64, [ctypes.c_void_p]),
            ("sa_tensor_deleter", ctypes.c_uint64, [ctypes.c_void_p]),
            ("sa_tensor_free", None, [ctypes.c_void_p]),
            ("sa_tensor_record_stream", None, [ctypes.c_void_p]),
            ("sa_raw_alloc", ctypes.c_uint64, [ctypes.c_size_t]),
            ("sa_raw_free", None, [ctypes.c_uint64]),
            ("sa_raw_deallocate", None, [ctypes.c_uint64]),
            ("sa_has_standard_deleter", ctypes.c_int, [ctypes.c_void_p]),
            ("sa_allocated", ctypes.c_size_t, []),
            ("sa_state", ctypes.c_int, [ctypes.c_uint64]),
            ("sa_process_events", None, []),
            ("sa_blocks", ctypes.c_int, [ctypes.c_void_p, ctypes.c_int]),
            ("sa_segments", ctypes.c_int, [ctypes.c_void_p, ctypes.c_int]),
            ("sa_native_thread", None, [ctypes.c_int, ctypes.c_int, ctypes.c_size_t]),
            ("sa_native_free_kept", None, []),
            ("sa_init", None, [ctypes.c_void_p]),
            ("sa_empty_cache", ctypes.c_int, [ctypes.c_void_p]),
        ]:
            f = getattr(lib, name)
            f.restype, f.argtypes = res, args
        lib.sa_init(ctypes.cast(driver_alloc, ctypes.c_void_p))
        self._driver_free = driver_free

    def empty_cache(self) -> int:
        """torch.cuda.empty_cache(): free segments go back to the driver."""
        return self.lib.sa_empty_cache(ctypes.cast(self._driver_free, ctypes.c_void_p))

    # -- the probe's questions (as memviz.torch.allocator.TorchAnswers) --
    def holder(self) -> int:
        return ctypes.addressof(ctypes.c_void_p.in_dll(self.lib, HOLDER))

    def alloc(self, n: int):
        t = Tensor(self.lib, self.lib.sa_tensor_new(n))
        return t, t.data_ptr()

    def allocated(self) -> int:
        return self.lib.sa_allocated()

    def raw_alloc(self, n: int) -> int:
        return self.lib.sa_raw_alloc(n)

    def raw_free(self, ptr: int) -> None:
        self.lib.sa_raw_free(ptr)

    def record_stream(self, tensor) -> None:
        self.lib.sa_tensor_record_stream(tensor.handle)

    def stream_use_holds(self, make) -> bool:
        tensor, addr = make()
        self.record_stream(tensor)
        del tensor
        state = self.lib.sa_state(addr)
        self.lib.sa_process_events()
        return state == 2

    def view(self):
        buf = (ctypes.c_uint64 * (3 * 65536))()
        n = self.lib.sa_blocks(buf, 65536)
        blocks = [(buf[3 * i], buf[3 * i + 1], STATES[buf[3 * i + 2]]) for i in range(n)]
        sbuf = (ctypes.c_uint64 * 2048)()
        m = self.lib.sa_segments(sbuf, 1024)
        out = []
        for i in range(m):
            base, size = sbuf[2 * i], sbuf[2 * i + 1]
            inside = tuple(b for b in blocks if base <= b[0] < base + size)
            out.append(PoolView(0, base, size, inside))
        return out
