"""Fresh processes of `bench_train_step.py --mode alternate`: each process
runs untracked, memviz (started after the model) and PyTorch's
_record_memory_history in turn, so every process gives paired ratios.

    python benchmarks/run_alternate_bench.py [--procs 5] [--cycles 6] [--block 12]
                                             [--model gpt|alloc_bound] --out F.json

Prints, per configuration: the median of the per-process medians, their
spread, the minimum of each process's minimum, the median (and spread)
of the per-process ratios to untracked, and the median (and quartiles) of
the per-block ratios: each block's median step against the untracked
block of the same cycle and process, the pairs closest in time.

    python benchmarks/run_alternate_bench.py --resummarize F.json

prints the same for a file written before (the per-block ratios included).
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
    ap.add_argument("--procs", type=int, default=5)
    ap.add_argument("--cycles", type=int, default=6)
    ap.add_argument("--block", type=int, default=12)
    ap.add_argument("--out", default="alternate_bench.json")
    ap.add_argument("--configs", default="none,memviz_after,torch_history")
    ap.add_argument("--model", default="gpt", choices=["gpt", "alloc_bound"],
                    help="bench_train_step.py's model (alloc_bound: issue 27's allocation-bound step)")
    ap.add_argument("--resummarize", metavar="FILE", help="summarize a file written before; run nothing")
    a = ap.parse_args()
    if a.resummarize:
        with open(a.resummarize) as f:
            saved = json.load(f)
        summarize(saved["runs"], saved.get("block"))
        return
    runs = []
    for i in range(a.procs):
        res = fresh_process([os.path.join(HERE, "bench_train_step.py"), "--mode", "alternate",
                             "--cycles", str(a.cycles), "--block", str(a.block), "--configs", a.configs,
                             "--model", a.model], i)
        if res is None:
            continue
        runs.append(res)
        print(f"process {i}: " + "  ".join(f"{c} {m:.2f}" for c, m in res["medians_ms"].items())
              + f"  routes {res['routes']}", flush=True)
    if not runs:
        sys.exit("no process finished")
    summary, rates = summarize(runs, a.block)
    with open(a.out, "w") as f:
        json.dump({"model": a.model, "block": a.block, "summary": summary, "untracked_allocs_per_s": rates,
                   "runs": runs}, f, indent=1)


def fresh_process(args, i):
    """One fresh Python process running `args`; its last stdout line as
    JSON, or None (its error printed) when it failed."""
    p = subprocess.run([sys.executable] + args, capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        print(f"process {i} failed:\n{p.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(p.stdout.strip().splitlines()[-1])


def block_ratios(run, c, timed):
    """Each block's median step of configuration c over the untracked
    block of the same cycle: `timed` steps a block (bench_train_step drops
    the first 2 of each)."""
    t, base = run["times_ms"][c], run["times_ms"]["none"]
    return [statistics.median(t[i:i + timed]) / statistics.median(base[i:i + timed])
            for i in range(0, min(len(t), len(base)) - timed + 1, timed)]


def summarize(runs, block):
    configs = list(runs[0]["times_ms"])
    timed = (block or 12) - 2
    summary = {}
    for c in configs:
        meds = [r["medians_ms"][c] for r in runs]
        ratios = [r["medians_ms"][c] / r["medians_ms"]["none"] for r in runs]
        mins = [min(r["times_ms"][c]) for r in runs]
        base_min = min(min(r["times_ms"]["none"]) for r in runs)
        summary[c] = {"per_process_median_ms": meds, "median_ms": statistics.median(meds),
                      "spread_ms": [min(meds), max(meds)], "min_of_min_ms": min(mins),
                      "min_ratio": min(mins) / base_min, "per_process_ratio": ratios,
                      "median_ratio": statistics.median(ratios), "ratio_spread": [min(ratios), max(ratios)]}
        blocks = sorted(x for r in runs for x in block_ratios(r, c, timed))
        q = statistics.quantiles(blocks, n=4) if len(blocks) > 1 else blocks * 3
        summary[c]["per_block_ratio"] = {"median": statistics.median(blocks), "quartiles": [q[0], q[2]],
                                         "blocks": len(blocks)}
        s = summary[c]
        print(f"{c:14s} median {s['median_ms']:6.2f} ms  spread {min(meds):.2f}-{max(meds):.2f}  "
              f"min-of-min {s['min_of_min_ms']:.2f} ({s['min_ratio']:.3f})  paired ratio "
              f"{s['median_ratio']:.3f} ({min(ratios):.3f}-{max(ratios):.3f})  per block "
              f"{s['per_block_ratio']['median']:.3f} ({q[0]:.3f}-{q[2]:.3f}, {len(blocks)} blocks)")
    for c in configs:
        stats = [x for r in runs for x in r.get("trace_stats", {}).get(c, [])]
        if stats and "bytes" in stats[0]:
            b, e = sum(x["bytes"] for x in stats), sum(x["events"] for x in stats)
            summary[c]["bytes_per_event"] = b / max(e, 1)
            summary[c]["dropped_events"] = sum(x["dropped"] for x in stats)
            print(f"{c:14s} trace: {b / max(e, 1):.2f} bytes per event over {e:,} events, "
                  f"{summary[c]['dropped_events']} dropped")
        elif stats and "drain_cpu_ns" in stats[0]:  # the drainer thread's CPU time a step
            per_step = [x["drain_cpu_ns"] / max(x["steps"], 1) / 1e3 for x in stats]
            summary[c]["drain_cpu_us_per_step"] = statistics.median(per_step)
            print(f"{c:14s} the drainer thread: {statistics.median(per_step):.0f} us of CPU a step "
                  f"(median over {len(per_step)} blocks)")
        elif stats:
            summary[c]["dropped_events"] = sum(x["dropped"] for x in stats)
    rates = [r["untracked_allocs_per_s"] for r in runs if r.get("untracked_allocs_per_s")]
    if rates:  # issue 27's allocation-bound step is meant to make at least 100,000 a second
        print(f"untracked: {statistics.median(rates):,.0f} PyTorch allocations a second (and as many frees)")
    return summary, rates


if __name__ == "__main__":
    main()
