"""What naming calls (Allocation.op) costs when a snapshot or trace is made.

    python benchmarks/bench_callsite.py [--procs 3]

Naming costs nothing while the program runs (the capture path already keeps
each frame's code object and instruction offset); it is paid once per new
call site when memviz builds a snapshot or writes a trace. This takes every
CALL instruction in torch.nn's and torch.optim's modules (real call sites,
thousands of them), names each one cold (fresh caches: source read, column
positions, parse) and again warm (cached), in fresh processes, and prints
JSON: microseconds per site, medians over processes.
"""

import argparse
import dis
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def _codes(code):
    yield code
    for c in code.co_consts:
        if hasattr(c, "co_code"):
            yield from _codes(c)


def child():
    sys.path.insert(0, ROOT)
    import importlib
    import pkgutil

    import torch.nn
    import torch.optim
    from memviz.capture import callsite as _callsite

    sites = []
    for pkg in (torch.nn.modules, torch.optim):
        for info in pkgutil.iter_modules(pkg.__path__, pkg.__name__ + "."):
            try:
                mod = importlib.import_module(info.name)
            except Exception:  # noqa: BLE001 - optional parts of torch
                continue
            for obj in vars(mod).values():
                members = list(vars(obj).values()) if isinstance(obj, type) else [obj]
                for code in [getattr(m, "__code__", None) for m in members]:
                    if code is None or getattr(code, "co_filename", "") != getattr(mod, "__file__", None):
                        continue
                    for c in _codes(code):
                        sites += [(c, i.offset) for i in dis.get_instructions(c) if i.opname.startswith("CALL")]
    sites = list(dict.fromkeys(sites))
    _callsite._names.clear()
    _callsite._positions.clear()
    t0 = time.perf_counter()
    names = [_callsite.call_name(c, o) for c, o in sites]
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    for c, o in sites:
        _callsite.call_name(c, o)
    warm = time.perf_counter() - t0
    named = sum(1 for n in names if n)
    print(json.dumps({"sites": len(sites), "named": named, "cold_us": cold / len(sites) * 1e6,
                      "warm_us": warm / len(sites) * 1e6,
                      "examples": sorted({n for n in names if n and n.startswith("torch.")})[:8]}))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--procs", type=int, default=3)
    ap.add_argument("--child", action="store_true")
    a = ap.parse_args()
    if a.child:
        return child()
    runs = []
    for _ in range(a.procs):
        p = subprocess.run([sys.executable, __file__, "--child"], capture_output=True, text=True, check=True)
        runs.append(json.loads(p.stdout.strip().splitlines()[-1]))
    print(json.dumps({"python": sys.version.split()[0], "sites": runs[0]["sites"], "named": runs[0]["named"],
                      "cold_us_per_site": statistics.median(r["cold_us"] for r in runs),
                      "cold_spread": [min(r["cold_us"] for r in runs), max(r["cold_us"] for r in runs)],
                      "warm_us_per_site": statistics.median(r["warm_us"] for r in runs),
                      "examples": runs[0]["examples"]}, indent=1))


if __name__ == "__main__":
    main()
