"""What memviz adds to a kernel launch that allocates nothing.

    python benchmarks/bench_launch.py [--procs 5] [--cycles 6] [--n 20000] [--out F.json]

Issue 27's GPT step (fewer allocations a second, a longer step) showed the
same paired ratio under ``track()`` as the allocation-bound step, which
suggests a cost that does not scale with allocations: CUPTI's dispatch on
every driver call while memviz is subscribed (a kernel launch included),
though memviz enables only the memory calls' callbacks. This times the
launch alone: each fresh process launches ``n`` in-place additions on a
one-element tensor (no allocation, no free) per block, in three
configurations in turn, the order rotated each cycle: untracked,
``track()`` (CUPTI subscribed and the allocator route), and
``track(cupti=False)`` (the allocator route alone). The difference between
the last two is CUPTI's share of a launch; between the second and the
first, memviz's. Per process: the median block of each configuration in
nanoseconds a launch; over processes: the median of those and of the
paired differences.

Without a CUDA GPU it says so and does nothing.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

CONFIGS = ("none", "track", "track_nocupti")


def child(n, cycles):
    import torch

    import memviz

    x = torch.zeros(1, device="cuda")
    for _ in range(2000):  # the launch path warm, the caching allocator's block made
        x.add_(1)
    torch.cuda.synchronize()
    times = {c: [] for c in CONFIGS}
    for cycle in range(cycles):
        order = CONFIGS[cycle % 3:] + CONFIGS[:cycle % 3]
        for c in order:
            tracker = None
            if c != "none":
                tracker = memviz.track(cupti=False if c == "track_nocupti" else None).start()
            torch.cuda.synchronize()
            t0 = time.perf_counter_ns()
            for _ in range(n):
                x.add_(1)
            torch.cuda.synchronize()
            times[c].append((time.perf_counter_ns() - t0) / n)
            if tracker is not None:
                tracker.stop()
    print(json.dumps({"ns_per_launch": times}))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--procs", type=int, default=5)
    ap.add_argument("--cycles", type=int, default=6)
    ap.add_argument("--n", type=int, default=20000)
    ap.add_argument("--out", default="launch_bench.json")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a.n, a.cycles)
        return
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if not has_cuda:
        print("bench_launch.py times CUDA kernel launches: it needs a CUDA GPU and PyTorch built for it.")
        return
    runs = []
    for i in range(a.procs):
        p = subprocess.run([sys.executable, __file__, "--child", "--n", str(a.n), "--cycles", str(a.cycles)],
                           capture_output=True, text=True, timeout=600)
        if p.returncode != 0:
            print(f"process {i} failed:\n{p.stderr[-2000:]}", file=sys.stderr)
            continue
        runs.append(json.loads(p.stdout.strip().splitlines()[-1])["ns_per_launch"])
        print(f"process {i}: " + "  ".join(f"{c} {statistics.median(runs[-1][c]):.0f} ns" for c in CONFIGS),
              flush=True)
    if not runs:
        sys.exit("no process finished")
    summary = {}
    for c in CONFIGS:
        meds = [statistics.median(r[c]) for r in runs]
        summary[c] = {"ns_per_launch": statistics.median(meds), "spread": [min(meds), max(meds)]}
    for c, base in (("track", "none"), ("track_nocupti", "none"), ("track", "track_nocupti")):
        diffs = [statistics.median(r[c]) - statistics.median(r[base]) for r in runs]
        summary[f"{c}_minus_{base}_ns"] = {"median": statistics.median(diffs), "spread": [min(diffs), max(diffs)]}
    for k, v in summary.items():
        key = "ns_per_launch" if "ns_per_launch" in v else "median"
        print(f"{k:32s} {v[key]:8.1f} ns  ({v['spread'][0]:.1f} to {v['spread'][1]:.1f})")
    with open(a.out, "w") as f:
        json.dump({"n": a.n, "cycles": a.cycles, "summary": summary, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
