"""Capture cost per allocation event, through the libcupti test double.

    python benchmarks/bench_capture.py [--depth 30] [--n 200000] [--procs 5]

Each fresh process fires n cuMemAlloc_v2 + cuMemFree_v2 pairs from C (the
double's fake_alloc_free_loop, so no ctypes in the loop) at the bottom of a
Python stack `depth` frames deep, once with memviz not subscribed (the
double's own cost) and once inside memviz.track(); the difference is what
memviz adds. Runs alternate A/B inside each process and processes repeat.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def child(depth, n, reps):
    sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
    from fake_cupti import FakeCupti, build

    path = build()
    os.environ["MEMVIZ_CUPTI_LIBRARY"] = path
    import memviz

    fake = FakeCupti(path)

    def at_depth(k, fn):
        return at_depth(k - 1, fn) if k > 0 else fn()

    here = len(__import__("inspect").stack())
    base, tracked = [], []
    for _ in range(reps):
        base.append(at_depth(depth - here - 1, lambda: fake.alloc_free_loop(n)) / n)
        with memviz.track(depth=32) as t:
            frames = at_depth(depth - here - 1, lambda: memviz._core._capture_depth(64))
            tracked.append(at_depth(depth - here - 1, lambda: fake.alloc_free_loop(n)) / n)
        assert t.capture_info()["store"]["calls"]["alloc"] == n
    print(json.dumps({"base_ns": statistics.median(base), "tracked_ns": statistics.median(tracked),
                      "frames": frames}))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--depth", type=int, default=30)
    ap.add_argument("--n", type=int, default=200000)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--procs", type=int, default=5)
    ap.add_argument("--child", action="store_true")
    a = ap.parse_args()
    if a.child:
        return child(a.depth, a.n, a.reps)
    rows = []
    for _ in range(a.procs):
        p = subprocess.run([sys.executable, __file__, "--child", "--depth", str(a.depth), "--n", str(a.n),
                            "--reps", str(a.reps)], capture_output=True, text=True, check=True)
        rows.append(json.loads(p.stdout.strip().splitlines()[-1]))
    added = [r["tracked_ns"] - r["base_ns"] for r in rows]
    print(json.dumps({
        "python_frames_at_callback": rows[0]["frames"],
        "double_alone_ns_per_pair": statistics.median(r["base_ns"] for r in rows),
        "tracked_ns_per_pair": statistics.median(r["tracked_ns"] for r in rows),
        "memviz_added_ns_per_alloc_free_pair": statistics.median(added),
        "spread_added_ns": [min(added), max(added)],
        "processes": a.procs,
    }, indent=1))


if __name__ == "__main__":
    main()
