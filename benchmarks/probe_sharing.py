"""What happens when memviz and another CUPTI user (torch.profiler) share a
process, in each order; and which CUDA runtime calls PyTorch's allocator
library imports (the segment path memviz can wrap without CUPTI).

Each scenario runs in a fresh process. Usage: python benchmarks/probe_sharing.py
"""
from __future__ import annotations

import json
import os
import struct
import subprocess
import sys

SCENARIOS = {
    "memviz_then_profiler": r'''
import torch, memviz, json
x = torch.randn(1024, 1024, device="cuda")
out = {}
with memviz.track() as t:
    a = torch.randn(2048, 2048, device="cuda")
    from torch.profiler import profile, ProfilerActivity
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], profile_memory=True) as prof:
        b = a @ a
        torch.cuda.synchronize()
    out["profiler_cuda_events"] = sum(1 for e in prof.events() if str(e.device_type).endswith("CUDA"))
    out["profiler_kernels"] = sum(1 for e in prof.events() if "gemm" in e.name.lower() or "sgemm" in e.name.lower())
    c = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    s = t.snapshot()
    out["memviz_blocks"] = sum(a.size for a in s.allocations if a.kind == "block")
    out["memory_allocated"] = torch.cuda.memory_allocated()
    out["capture"] = {k: v for k, v in t.capture_info().items() if k in ("gpu_enabled", "activity_enabled", "activity_error")}
print("RESULT", json.dumps(out))
''',
    "profiler_then_memviz": r'''
import torch, memviz, json
from torch.profiler import profile, ProfilerActivity
x = torch.randn(1024, 1024, device="cuda")
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    y = x @ x; torch.cuda.synchronize()
out = {}
try:
    with memviz.track() as t:
        a = torch.randn(2048, 2048, device="cuda")
    out["ok"] = True
except Exception as e:
    out["error"] = f"{type(e).__name__}: {e}"[:400]
print("RESULT", json.dumps(out))
''',
    "profiler_inside_twice": r'''
import torch, memviz, json
from torch.profiler import profile, ProfilerActivity
out = {}
with memviz.track() as t:
    for i in range(2):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            a = torch.randn(1024, 1024, device="cuda") @ torch.randn(1024, 1024, device="cuda")
            torch.cuda.synchronize()
        out[f"run{i}_cuda_events"] = sum(1 for e in prof.events() if str(e.device_type).endswith("CUDA"))
    s = t.snapshot()
    out["memviz_allocs"] = len(s.allocations)
print("RESULT", json.dumps(out))
''',
}


def undefined_symbols(path: str, wanted: set) -> list:
    """The names in `wanted` that the ELF file imports (undefined in .dynsym)."""
    with open(path, "rb") as f:
        data = f.read()
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, = struct.unpack_from("<HH", data, 0x3A)
    secs = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    out = []
    for s in secs:
        if s[1] != 11:  # SHT_DYNSYM
            continue
        strtab = secs[s[6]]
        for k in range(s[5] // 24):
            name_off, info, other, shndx, value, size = struct.unpack_from("<IBBHQQ", data, s[4] + k * 24)
            end = data.index(b"\0", strtab[4] + name_off)
            name = data[strtab[4] + name_off:end].decode()
            if shndx == 0 and name in wanted:
                out.append(name)
    return sorted(out)


def main() -> None:
    results = {}
    try:
        import torch
        lib = os.path.join(os.path.dirname(torch.__file__), "lib")
        wanted = {"cudaMalloc", "cudaFree", "cudaMallocAsync", "cudaFreeAsync", "cudaMallocHost",
                  "cudaHostAlloc", "cudaFreeHost", "cuMemAlloc_v2", "cuMemCreate", "cudaGetDriverEntryPoint",
                  "cudaGetDriverEntryPointByVersion"}
        for name in ("libc10_cuda.so", "libtorch_cuda.so"):
            p = os.path.join(lib, name)
            if os.path.exists(p):
                results[f"imports:{name}"] = undefined_symbols(p, wanted)
        results["torch"] = torch.__version__
    except Exception as e:  # noqa: BLE001
        results["imports_error"] = repr(e)
    for name, code in SCENARIOS.items():
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
        line = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
        results[name] = {"rc": p.returncode, "result": json.loads(line[-1][7:]) if line else None,
                         "stderr_tail": p.stderr[-1500:]}
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
