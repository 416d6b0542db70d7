"""The capture path of two checkouts side by side, in one run: fresh
processes of each checkout's `bench_train_step.py --mode alternate`, the
checkouts taking turns (order rotated), each process pairing a tracked
configuration with untracked. The question is whether a change made the
capture path slower: the ratio tracked/untracked of the new checkout
against the old one's.

    python benchmarks/run_versions_bench.py --old DIR --new DIR [--procs 5]
        [--configs none,memviz_after] [--out F.json]

Each DIR is a checkout with its C core built in place. Prints, per
checkout and configuration, the median of the per-process paired ratios to
untracked, their spread and the minimum of each process's minimum, then the
median of (new ratio / old ratio) over rounds.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def one(checkout, configs, cycles, block):
    p = subprocess.run([sys.executable, os.path.join(checkout, "benchmarks", "bench_train_step.py"),
                        "--mode", "alternate", "--cycles", str(cycles), "--block", str(block),
                        "--configs", configs], capture_output=True, text=True, timeout=600, cwd=checkout)
    if p.returncode != 0:
        raise RuntimeError(f"{checkout}: {p.stderr[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", required=True)
    ap.add_argument("--new", required=True)
    ap.add_argument("--procs", type=int, default=5)
    ap.add_argument("--cycles", type=int, default=6)
    ap.add_argument("--block", type=int, default=12)
    ap.add_argument("--configs", default="none,memviz_after")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    names = {"old": os.path.abspath(a.old), "new": os.path.abspath(a.new)}
    runs = {"old": [], "new": []}
    for i in range(a.procs):
        order = ["old", "new"] if i % 2 == 0 else ["new", "old"]
        for which in order:
            r = one(names[which], a.configs, a.cycles, a.block)
            runs[which].append(r)
            print(f"round {i} {which}: " + "  ".join(f"{c} {m:.2f}" for c, m in r["medians_ms"].items()),
                  flush=True)
    tracked = [c for c in a.configs.split(",") if c != "none"]
    summary = {}
    for which, rs in runs.items():
        for c in tracked:
            ratios = [r["medians_ms"][c] / r["medians_ms"]["none"] for r in rs]
            summary[f"{which}:{c}"] = {
                "median_ratio": statistics.median(ratios), "ratio_spread": [min(ratios), max(ratios)],
                "min_of_min_ms": min(min(r["times_ms"][c]) for r in rs),
                "untracked_min_of_min_ms": min(min(r["times_ms"]["none"]) for r in rs),
                "per_process_ratio": ratios}
    for c in tracked:
        pairs = [n["medians_ms"][c] / n["medians_ms"]["none"] / (o["medians_ms"][c] / o["medians_ms"]["none"])
                 for n, o in zip(runs["new"], runs["old"])]
        summary[f"new/old:{c}"] = {"median": statistics.median(pairs), "spread": [min(pairs), max(pairs)],
                                   "per_round": pairs}
    for k, v in summary.items():
        if "median_ratio" in v:
            print(f"{k:24s} paired ratio {v['median_ratio']:.3f} ({v['ratio_spread'][0]:.3f}-"
                  f"{v['ratio_spread'][1]:.3f})  min-of-min {v['min_of_min_ms']:.2f} ms "
                  f"(untracked {v['untracked_min_of_min_ms']:.2f})")
        else:
            print(f"{k:24s} {v['median']:.3f} ({v['spread'][0]:.3f}-{v['spread'][1]:.3f})")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d"), "checkouts": names, "summary": summary,
                       "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
