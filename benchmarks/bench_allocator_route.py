"""Capture cost per tensor event on the allocator route, from C.

    python benchmarks/bench_allocator_route.py [--depth 30] [--n 200000] [--procs 5]

Each fresh process runs n tensor allocations and frees of PyTorch's shape
through the stand-in caching allocator (tests/stand_in_allocator: a loop in
C, so no ctypes per event) at the bottom of a Python stack `depth` frames
deep: once with the stand-in's own vtable (its cost alone) and once with
memviz attached through the real probe and wrappers, inside memviz.track()
(with the libcupti test double). The difference per event (an allocation
and its free) is what memviz adds. A and B alternate inside each process.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def child(depth, n, reps):
    sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
    from fake_cupti import FakeCupti, build

    path = build()
    os.environ["MEMVIZ_CUPTI_LIBRARY"] = path
    import torch  # noqa: F401  (the integration attaches with torch imported)
    import memviz
    import stand_in_allocator as sa

    fake = FakeCupti(path)
    fake.reset()
    lib = sa.build(Path(tempfile.mkdtemp()) / "bench")
    ans = sa.StandInAnswers(lib, fake.lib.fake_alloc)
    ans.lib.sa_loop.restype = __import__("ctypes").c_uint64
    ans.lib.sa_loop.argtypes = [__import__("ctypes").c_int, __import__("ctypes").c_size_t]

    def at_depth(k, fn):
        return at_depth(k - 1, fn) if k > 0 else fn()

    here = len(__import__("inspect").stack())
    base, tracked = [], []
    frames = None
    for _ in range(reps):
        base.append(at_depth(depth - here - 1, lambda: ans.lib.sa_loop(n, 4096)) / n)
        with memviz.track(depth=32) as t:
            r = t.torch.use_answers(ans)
            assert r.route == "allocator", r.reason
            frames = at_depth(depth - here - 1, lambda: memviz._core._capture_depth(64))
            tracked.append(at_depth(depth - here - 1, lambda: ans.lib.sa_loop(n, 4096)) / n)
            assert memviz._core.block_totals()[0]["allocs"] >= n
    print(json.dumps({"base_ns": base, "tracked_ns": tracked, "frames": frames}))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--depth", type=int, default=30)
    ap.add_argument("--n", type=int, default=200000)
    ap.add_argument("--procs", type=int, default=5)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--child", action="store_true")
    a = ap.parse_args()
    if a.child:
        child(a.depth, a.n, a.reps)
        return
    added, frames = [], None
    for _ in range(a.procs):
        p = subprocess.run([sys.executable, __file__, "--child", "--depth", str(a.depth), "--n", str(a.n),
                            "--reps", str(a.reps)], capture_output=True, text=True, check=True)
        r = json.loads(p.stdout.strip().splitlines()[-1])
        frames = r["frames"]
        added.append(min(t - b for t, b in zip(r["tracked_ns"], r["base_ns"])))
    print(json.dumps({"depth_frames_seen": frames, "n": a.n, "procs": a.procs,
                      "added_ns_per_event_min_per_process": [round(x, 1) for x in added],
                      "median_ns": round(statistics.median(added), 1),
                      "spread_ns": [round(min(added), 1), round(max(added), 1)]}))


if __name__ == "__main__":
    main()
