"""How long track() takes to attach when PyTorch already holds many blocks
(issue 22: under 0.5 s with 100,000 live blocks).

On a GPU: N small tensors are made before tracking, then track() starts and
the allocator route attaches, reading PyTorch's memory_snapshot() once and
recording every block as "before tracking" (memviz/torch/before.py). The
time is split into PyTorch's own memory_snapshot() (read alone, before) and
the whole attach. Each configuration runs in a fresh process.

Usage: python benchmarks/bench_attach.py [--blocks 0,100000] [--repeat 5]
Prints one JSON object: per block count, the processes' figures (the
counts take turns, so each pair of processes is side by side).
"""

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = r"""
import json, sys, time
sys.path.insert(0, {root!r})
import torch
torch.cuda.init()
n = {n}
keep = [torch.empty(256, dtype=torch.uint8, device="cuda") for _ in range(n)]
torch.cuda.synchronize()
t0 = time.perf_counter()
snap = torch.cuda.memory_snapshot()
t_snapshot = time.perf_counter() - t0
import memviz
t0 = time.perf_counter()
t = memviz.track().start()
t_attach = time.perf_counter() - t0
seeded = t.torch.before_tracking or {{}}
blocks = sum(1 for a in t.snapshot().allocations if a.kind == "block" and a.before_tracking)
t.stop()
print("RESULT " + json.dumps({{"snapshot_s": t_snapshot, "attach_s": t_attach,
                              "seeded_blocks": seeded.get("blocks"), "live_before": blocks,
                              "seed_s": seeded.get("seconds"),
                              "route": memviz.capture_info().get("pytorch", {{}}).get("route")}}))
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", default="0,100000", help="block counts, comma-separated")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    try:
        import torch
        if not torch.cuda.is_available():
            raise ImportError
    except ImportError:
        print(json.dumps({"skipped": "needs PyTorch with a CUDA GPU"}))
        return
    counts = [int(x) for x in args.blocks.split(",")]
    runs = {n: [] for n in counts}
    for i in range(args.repeat):
        for n in (counts if i % 2 == 0 else counts[::-1]):
            code = CHILD.format(root=ROOT, n=n)
            p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
            res = [json.loads(line[7:]) for line in p.stdout.splitlines() if line.startswith("RESULT ")]
            if p.returncode or not res:
                print(p.stdout[-2000:], p.stderr[-4000:], file=sys.stderr)
                sys.exit(1)
            runs[n].append(res[0])
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    out = {"date": time.strftime("%Y-%m-%d"), "per_count": {}}
    for n, rs in runs.items():
        out["per_count"][n] = {"attach_median_s": med([r["attach_s"] for r in rs]),
                               "attach_min_s": min(r["attach_s"] for r in rs),
                               "seed_median_s": med([r["seed_s"] or 0 for r in rs]),
                               "memory_snapshot_median_s": med([r["snapshot_s"] for r in rs]),
                               "runs": rs}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
