"""Build and drive the stand-in for PyTorch's caching allocator
(allocator.c, which follows the native allocator's rules for rounding,
pools, best fit, splitting, merging and segment sizes): the answers object
the allocator route's probe asks, the same questions
memviz.torch.allocator.TorchAnswers puts to PyTorch, and what tests read
of its state (snapshot(), shaped like torch.cuda.memory_snapshot())."""

from __future__ import annotations

import ctypes
import os
import shlex
import subprocess
from pathlib import Path
from typing import Optional

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


# The process's libc10_standin.so: the first one built.
_c10: Optional[Path] = None


def base_library(lib: Path) -> Path:
    """The libc10_standin.so that the allocator library `lib` loads."""
    return _c10 if _c10 is not None else lib.parent.parent / "libc10_standin.so"


def build(outdir: Path, **defines) -> Path:
    """libc10_cuda.so in outdir (a folder per layout), linked to the
    process's one libc10_standin.so; returns the allocator library's path."""
    global _c10
    outdir.mkdir(parents=True, exist_ok=True)
    # Not named libc10.so: torch's own (same soname) would be used instead.
    # One for all layouts and all test modules of a process, beside the first
    # build's folder: a second file of the same name would not be loaded
    # (the loader reuses the first), and the probe checks where slot 3 lives.
    if _c10 is None:
        c10 = outdir.parent / "libc10_standin.so"
        if not c10.exists():
            _cc([str(HERE / "c10.c"), "-o", str(c10)])
        # the stand-in runtime (cudart.c): its symbols versioned, so that the
        # stand-in binds to them even beside a real libcudart in the global scope
        rt = outdir.parent / "libcudart_standin.so"
        if not rt.exists():
            vmap = outdir.parent / "cudart_standin.map"
            vmap.write_text("STANDIN_CUDART_1 { global: *; };\n")
            _cc([str(HERE / "cudart.c"), "-o", str(rt), f"-Wl,--version-script={vmap}"])
        _c10 = c10
    lib = outdir / "libc10_cuda.so"
    flags = [f"-D{k}={v}" for k, v in sorted(defines.items())]
    # -Bsymbolic: the stand-in's own holder, even where a real libc10_cuda
    # (torch's CUDA build) exports the same symbol in the global scope.
    _cc([*flags, str(HERE / "allocator.c"), "-o", str(lib), f"-L{_c10.parent}", "-lc10_standin",
         "-lcudart_standin", f"-Wl,-rpath,{_c10.parent}", "-Wl,-Bsymbolic", "-lpthread"])
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
        self.base_library = str(base_library(path))
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
            ("sa_blocks2", ctypes.c_int, [ctypes.c_void_p, ctypes.c_int]),
            ("sa_segments2", ctypes.c_int, [ctypes.c_void_p, ctypes.c_int]),
            ("sa_configure", ctypes.c_int, [ctypes.c_size_t, ctypes.c_size_t]),
            ("sa_set_stream", None, [ctypes.c_uint64]),
            ("sa_round_size", ctypes.c_size_t, [ctypes.c_size_t]),
            ("sa_reset", None, []),
            ("sa_reserved", ctypes.c_size_t, []),
            ("sa_native_thread", None, [ctypes.c_int, ctypes.c_int, ctypes.c_size_t]),
            ("sa_native_free_kept", None, []),
            ("sa_init", None, [ctypes.c_void_p]),
            ("sa_empty_cache", ctypes.c_int, [ctypes.c_void_p]),
        ]:
            f = getattr(lib, name)
            f.restype, f.argtypes = res, args
        lib.sa_init(ctypes.cast(driver_alloc, ctypes.c_void_p))
        self._driver_free = driver_free

    # -- settings and state, for tests --
    def configure(self, max_split_size: int = 0, roundup_power2_divisions: int = 0) -> None:
        """PYTORCH_CUDA_ALLOC_CONF's max_split_size_mb (here in bytes; 0: none;
        PyTorch wants over 20 MiB) and roundup_power2_divisions (0 or a power
        of two, one value for every size)."""
        if self.lib.sa_configure(max_split_size, roundup_power2_divisions) != 0:
            raise ValueError(f"PyTorch refuses max_split_size={max_split_size}, "
                             f"roundup_power2_divisions={roundup_power2_divisions}")

    def set_stream(self, stream: int) -> None:
        """The current stream: the one alloc() and raw_alloc() use from now on."""
        self.lib.sa_set_stream(stream)

    def round_size(self, n: int) -> int:
        return self.lib.sa_round_size(n)

    def reserved(self) -> int:
        """torch.cuda.memory_reserved(): the segments' bytes."""
        return self.lib.sa_reserved()

    def reset(self) -> None:
        """A fresh allocator (nothing goes back to the driver); only with no
        tensor or raw block of it still in use."""
        self.lib.sa_reset()

    def snapshot(self):
        """torch.cuda.memory_snapshot()'s shape: segments in address order,
        each with its blocks in address order."""
        cap = self.lib.sa_blocks2(None, 0)
        buf = (ctypes.c_uint64 * (4 * cap))()
        n = self.lib.sa_blocks2(buf, cap)
        blocks = [{"address": buf[4 * i], "size": buf[4 * i + 1], "requested_size": buf[4 * i + 2],
                   "state": STATES[buf[4 * i + 3]]} for i in range(n)]
        cap = self.lib.sa_segments2(None, 0)
        sbuf = (ctypes.c_uint64 * (4 * cap))()
        m = self.lib.sa_segments2(sbuf, cap)
        out, k = [], 0
        for i in range(m):
            base, size, stream, small = sbuf[4 * i:4 * i + 4]
            inside = []
            while k < len(blocks) and base <= blocks[k]["address"] < base + size:
                inside.append(blocks[k])
                k += 1
            active = [b for b in inside if b["state"] != "inactive"]
            out.append({"device": self.device, "address": base, "total_size": size, "stream": stream,
                        "segment_type": "small" if small else "large", "is_expandable": False,
                        "allocated_size": sum(b["size"] for b in inside if b["state"] == "active_allocated"),
                        "active_size": sum(b["size"] for b in active),
                        "requested_size": sum(b["requested_size"] for b in active),
                        "blocks": inside})
        return out

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
        return [PoolView(s["device"], s["address"], s["total_size"],
                         tuple((b["address"], b["size"], b["state"]) for b in s["blocks"]))
                for s in self.snapshot()]
