"""Capture cost per tensor event on the allocator route, from C.

    python benchmarks/bench_allocator_route.py [--depth 30] [--n 200000] [--procs 5]

Each fresh process runs n tensor allocations and frees of PyTorch's shape
through the stand-in caching allocator (tests/stand_in_allocator: a loop in
C, so no ctypes per event) at the bottom of a Python stack `depth` frames
deep: once with the stand-in's own vtable (its cost alone) and once with
memviz attached through the real probe and wrappers, inside memviz.track()
(with the libcupti test double). The difference per event (an allocation
and its free) is what memviz adds. A and B alternate inside each process.

``--gap BYTES``: between one tensor and the next the loop writes that many
bytes of a buffer of its own (a cache line every 64), so that the capture
path's lines (the Python frames it walks, the queue) are cold, as inside a
step; both loops do the writes, in the thread's CPU time.
``--split``: also the allocations and the frees timed apart (batches of
32 tensors: their allocations, then their frees), so that what an
allocation adds and what a free adds are reported each on its own.
``--against DIR``: memviz imported from another checkout (its extension
built) in alternating processes, the stand-in from this one.
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


def child(depth, n, reps, gap=0, root=None, split=False):
    sys.path[:0] = [root or ROOT, os.path.join(ROOT, "tests")]
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
    c = __import__("ctypes")
    ans.lib.sa_loop_gap.restype, ans.lib.sa_loop_gap.argtypes = c.c_uint64, [c.c_int, c.c_size_t, c.c_size_t]
    loop = (lambda: ans.lib.sa_loop_gap(n, 4096, gap)) if gap else (lambda: ans.lib.sa_loop(n, 4096))
    ans.lib.sa_loop_split.restype, ans.lib.sa_loop_split.argtypes = None, [c.c_int, c.c_size_t, c.c_uint64 * 2]

    def split_loop():
        out = (c.c_uint64 * 2)()
        ans.lib.sa_loop_split(n, 4096, out)
        return [out[0] / n, out[1] / n]

    def at_depth(k, fn):
        return at_depth(k - 1, fn) if k > 0 else fn()

    here = len(__import__("inspect").stack())
    base, tracked, base_split, tracked_split = [], [], [], []
    frames = None
    for _ in range(reps):
        base.append(at_depth(depth - here - 1, loop) / n)
        if split:
            base_split.append(at_depth(depth - here - 1, split_loop))
        with memviz.track(depth=32) as t:
            r = t.torch.use_answers(ans)
            assert r.route == "allocator", r.reason
            frames = at_depth(depth - here - 1, lambda: memviz._core._capture_depth(64))
            tracked.append(at_depth(depth - here - 1, loop) / n)
            if split:
                tracked_split.append(at_depth(depth - here - 1, split_loop))
            assert memviz._core.block_totals()[0]["allocs"] >= n
    print(json.dumps({"base_ns": base, "tracked_ns": tracked, "frames": frames,
                      "base_split_ns": base_split, "tracked_split_ns": tracked_split}))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--depth", type=int, default=30)
    ap.add_argument("--n", type=int, default=200000)
    ap.add_argument("--procs", type=int, default=5)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--gap", type=int, default=0, help="bytes written between tensors (cold lines)")
    ap.add_argument("--split", action="store_true", help="also time allocations and frees apart")
    ap.add_argument("--against", help="another checkout (its extension built), in alternating processes")
    ap.add_argument("--root", help=argparse.SUPPRESS)
    ap.add_argument("--child", action="store_true")
    a = ap.parse_args()
    if a.child:
        child(a.depth, a.n, a.reps, a.gap, a.root, a.split)
        return
    roots = {"this": None}
    if a.against:
        roots["against"] = os.path.abspath(a.against)
    added = {k: [] for k in roots}
    split = {k: ([], []) for k in roots}
    frames = None
    for i in range(a.procs):
        order = list(roots) if i % 2 == 0 else list(roots)[::-1]
        for k in order:
            cmd = [sys.executable, __file__, "--child", "--depth", str(a.depth), "--n", str(a.n),
                   "--reps", str(a.reps), "--gap", str(a.gap)] + (["--root", roots[k]] if roots[k] else []) + \
                (["--split"] if a.split else [])
            p = subprocess.run(cmd, capture_output=True, text=True, check=True)
            r = json.loads(p.stdout.strip().splitlines()[-1])
            frames = r["frames"]
            added[k].append(min(t - b for t, b in zip(r["tracked_ns"], r["base_ns"])))
            for w in (0, 1):  # the least any repetition added, per allocation and per free
                if r["base_split_ns"]:
                    split[k][w].append(min(t[w] - b[w] for t, b in zip(r["tracked_split_ns"], r["base_split_ns"])))
    out = {"depth_frames_seen": frames, "n": a.n, "procs": a.procs, "gap": a.gap}
    for k, xs in added.items():
        out[k] = {"added_ns_per_pair_min_per_process": [round(x, 1) for x in xs],
                  "median_ns": round(statistics.median(xs), 1), "spread_ns": [round(min(xs), 1), round(max(xs), 1)]}
        for w, name in ((0, "allocation"), (1, "free")):
            ys = split[k][w]
            if ys:
                out[k][f"added_ns_per_{name}"] = {"median": round(statistics.median(ys), 1),
                                                 "spread": [round(min(ys), 1), round(max(ys), 1)]}
    if a.against:
        ratios = [x / y for x, y in zip(added["this"], added["against"])]
        out["this_over_against"] = {"median": round(statistics.median(ratios), 3),
                                    "spread": [round(min(ratios), 3), round(max(ratios), 3)]}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
