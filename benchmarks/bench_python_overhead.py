"""Pure-Python, call-heavy code that allocates nothing: untracked vs inside track().

    python benchmarks/bench_python_overhead.py [--procs 6]

Fresh processes alternate A (untracked) and B (memviz.track() through the
libcupti test double, so capture is really on). Each process times the same
workload 5 times and reports its median; the summary gives the median of the
process medians, the spread, and the ratio B/A.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def workload():
    def fib(n):
        return n if n < 2 else fib(n - 1) + fib(n - 2)

    class P:
        __slots__ = ("x",)

        def __init__(self, x):
            self.x = x

        def bump(self):
            self.x += 1
            return self

    total = fib(27)
    p = P(0)
    for _ in range(1000000):
        p.bump()
    return total + sum(len(str(i)) for i in range(100000)) + p.x


def child(mode):
    sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
    from fake_cupti import build

    os.environ["MEMVIZ_CUPTI_LIBRARY"] = build()
    import memviz

    times = []
    for _ in range(5):
        if mode == "tracked":
            with memviz.track() as t:
                t0 = time.perf_counter()
                workload()
                times.append(time.perf_counter() - t0)
            assert t.gpu_enabled
        else:
            t0 = time.perf_counter()
            workload()
            times.append(time.perf_counter() - t0)
    print(statistics.median(times))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--procs", type=int, default=6)
    ap.add_argument("--child")
    a = ap.parse_args()
    if a.child:
        return child(a.child)
    res = {"untracked": [], "tracked": []}
    for _ in range(a.procs):
        for mode in ("untracked", "tracked"):
            out = subprocess.run([sys.executable, __file__, "--child", mode], capture_output=True,
                                 text=True, check=True).stdout
            res[mode].append(float(out.strip().splitlines()[-1]) * 1e3)
    mu, mt = statistics.median(res["untracked"]), statistics.median(res["tracked"])
    print(json.dumps({"untracked_ms": res["untracked"], "tracked_ms": res["tracked"],
                      "median_untracked_ms": mu, "median_tracked_ms": mt, "ratio": mt / mu,
                      "spread_untracked_ms": [min(res["untracked"]), max(res["untracked"])],
                      "spread_tracked_ms": [min(res["tracked"]), max(res["tracked"])]}, indent=1))


if __name__ == "__main__":
    main()
