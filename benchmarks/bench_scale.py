"""Snapshots at scale (issue 24, item 11): snapshot(), statistics("lineno")
and the top lines (Tracker.top) over a store of millions of live
allocations or a million distinct call sites, through the real C path with
the libcupti test double (no GPU).

    python benchmarks/bench_scale.py live 10000000     # 10^7 allocations, one line
    python benchmarks/bench_scale.py sites 1000000     # 10^6 lines, one allocation each
    python benchmarks/bench_scale.py sites 1000000 --skip-snapshot

* ``live N``: N allocations kept live from one Python line, made in C
  (the double's fake_alloc_loop: each goes through CUPTI's callback and the
  capture path as a driver call would). The store keeps 8,388,608 live
  allocations (MAX_LIVE) and counts the rest as dropped.
* ``sites N``: N distinct call sites: generated functions of 100 lines each
  (real files, so call names read their source), each line one allocation.

Each phase is timed (wall clock, and the process's CPU time: the machine
may be shared) and its peak RSS measured on its own (the kernel's
high-water mark, VmHWM, reset before each phase through
/proc/self/clear_refs), as the growth over the RSS before it. One JSON line
of results on stdout.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

import memviz  # noqa: E402
from fake_cupti import CBID_cuMemAlloc_v2, FakeCupti, build  # noqa: E402


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _phase(results: dict, name: str, fn):
    gc.collect()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the RSS now
        resettable = True
    except OSError:
        resettable = False
    before = _status("VmRSS")
    t0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    peak = _status("VmHWM") if resettable else 0
    results[name] = {"s": round(dt, 2), "cpu_s": round(cpu, 2), "peak_growth_mb": round((peak - before) / 2**20) if peak else None,
                     "rss_before_mb": round(before / 2**20)}
    print(f"{name}: {dt:.2f} s ({cpu:.2f} s CPU), peak +{results[name]['peak_growth_mb']} MB",
          file=sys.stderr, flush=True)
    return out


#: lines of each generated function: PyCode_Addr2Line reads a code object's
#: line table from its start, so 1,000-line functions make resolving a line
#: cost ten times what it costs in functions of a common size
LINES_PER_FUNCTION = 100


def _sites_modules(n: int, folder: str, alloc) -> list:
    """Functions whose lines each allocate once: n lines in all."""
    fns = []
    per = LINES_PER_FUNCTION
    for m in range((n + per - 1) // per):
        lines = min(per, n - m * per)
        path = os.path.join(folder, f"sites_{m}.py")
        with open(path, "w") as f:
            # the docstring makes each function's code its own: code objects
            # compare equal by bytecode and constants, file aside
            f.write(f"def run(a, c, s):\n    'sites {m}'\n")
            for i in range(lines):
                f.write(f"    a(c, s + {i}, 0, 0)\n")
        ns: dict = {}
        with open(path) as f:
            exec(compile(f.read(), path, "exec"), ns)
        fns.append(ns["run"])
    return fns


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=("live", "sites"))
    ap.add_argument("n", type=int)
    ap.add_argument("--skip-snapshot", action="store_true", help="time only the top lines and statistics")
    ap.add_argument("--skip-top", action="store_true", help="time only snapshot() and its statistics")
    ap.add_argument("--top", type=int, default=20)
    opts = ap.parse_args()

    path = build()
    os.environ["MEMVIZ_CUPTI_LIBRARY"] = path
    fake = FakeCupti(path)
    fake.reset()
    memviz.frames.add_library_path(os.path.join(ROOT, "tests", "fake_cupti"))
    results: dict = {"what": opts.what, "n": opts.n, "python": sys.version.split()[0]}
    folder = tempfile.mkdtemp(prefix="memviz-scale-")
    fns = _sites_modules(opts.n, folder, None) if opts.what == "sites" else []

    t = memviz.track(torch=False)
    t.start()
    try:
        if opts.what == "live":
            _phase(results, "record", lambda: fake.alloc_loop(opts.n, 4096))
        else:
            alloc = fake._c.fake_alloc

            def record():
                for fn in fns:
                    fn(alloc, CBID_cuMemAlloc_v2, 4096)
            _phase(results, "record", record)
    finally:
        t.stop()
    results["live"] = t.capture_info()["store"]["live"]
    top = getattr(t, "top", None)
    if top is not None and not opts.skip_top:
        rows = _phase(results, f"top({opts.top})", lambda: top(opts.top))
        results["top_first"] = [str(rows[0])] if rows else []
    if not opts.skip_snapshot:
        snap = _phase(results, "snapshot", t.snapshot)
        results["allocations"] = len(snap)
        stats = _phase(results, "statistics_lineno", lambda: snap.statistics("lineno"))
        results["statistics"] = len(stats)
        del snap, stats
    print(json.dumps(results))


if __name__ == "__main__":
    main()
