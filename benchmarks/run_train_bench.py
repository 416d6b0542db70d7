"""Interleaved fresh-process runs of bench_train_step.py (A B C A B C ...).

    python benchmarks/run_train_bench.py [--rounds 3] [--modes none,memviz,torch_history] --out F.json

Prints a table: per mode, the median step time of each process, the median
of those, the spread (min-max across processes) and the ratio to "none".
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--modes", default="none,memviz,torch_history")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--out", default="train_bench.json")
    a = ap.parse_args()
    modes = a.modes.split(",")
    runs = {m: [] for m in modes}
    for r in range(a.rounds):
        for m in modes:
            p = subprocess.run([sys.executable, os.path.join(HERE, "bench_train_step.py"), "--mode", m,
                                "--steps", str(a.steps)], capture_output=True, text=True, timeout=600)
            if p.returncode != 0:
                print(f"{m} round {r} failed:\n{p.stderr[-2000:]}", file=sys.stderr)
                continue
            res = json.loads(p.stdout.strip().splitlines()[-1])
            runs[m].append(res)
            print(f"round {r} {m}: median {res['median_ms']:.2f} ms", flush=True)
    base = statistics.median([x["median_ms"] for x in runs[modes[0]]]) if runs[modes[0]] else None
    summary = {}
    for m in modes:
        meds = [x["median_ms"] for x in runs[m]]
        if not meds:
            continue
        med = statistics.median(meds)
        mins = [min(x["times_ms"]) for x in runs[m]]
        base_min = min(min(x["times_ms"]) for x in runs[modes[0]]) if runs[modes[0]] else None
        summary[m] = {"per_process_median_ms": meds, "median_ms": med, "spread_ms": [min(meds), max(meds)],
                      "ratio_to_" + modes[0]: (med / base) if base else None,
                      "min_of_min_ms": min(mins),
                      "min_ratio_to_" + modes[0]: (min(mins) / base_min) if base_min else None}
        print(f"{m:16s} median {med:7.2f} ms  spread {min(meds):.2f}-{max(meds):.2f}  "
              f"ratio {med / base:.3f}  min-of-min {min(mins):.2f} ({min(mins) / base_min:.3f})"
              if base else m)
    with open(a.out, "w") as f:
        json.dump({"summary": summary, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
