"""memviz's own time inside a real training step, per event and per thread,
read from the capture path itself rather than from the step's wall time.

    python benchmarks/bench_in_step.py [--procs 4] [--steps 200] [--model alloc_bound|gpt]
                                       [--against DIR] --out F.json

Each fresh process builds the model (torch, CUDA and the model first, as
``memviz_after`` in bench_train_step.py), warms up untracked, then runs
``--steps`` steps under ``memviz.track()`` with the allocator route's
capture path timed (``_core._callback_profile("time")``: two reads of the
capture path's clock around ``mvz_capture_block``, added per thread into a
slot of its own; src/capture.c). What it gives:

- ns per allocation and per free, on the training thread and on the
  autograd engine's thread;
- memviz's capture-path time per step, and its share of the step's wall
  time (the timed steps' total): memviz's *direct* cost inside the step.

The share leaves out what the timer cannot see: the route's wrappers
around PyTorch's call (a stamp read, one counted add per block), CUPTI's
dispatch, the drain thread (another core), and the cache lines memviz
evicts from PyTorch's own working set. The paired wall-time protocol
(run_alternate_bench.py) sees those, at a resolution of a few per cent on
the H200's host; this sees the direct part at well under one.

``--against DIR``: another checkout (its extension built, with this
script) runs in alternating fresh processes, order rotated, reported as
``against`` beside ``this``.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))


def child(a):
    import torch

    from bench_train_step import make_step

    step = make_step(torch, a.model)
    for _ in range(10):
        step()
    torch.cuda.synchronize()

    import memviz
    import memviz._core as core

    stages = a.stages and core._stage_timings() is not None
    if a.stages and not stages:
        raise SystemExit("--stages: this build has no stage points (build it with CFLAGS=-DMVZ_STAGES)")
    if not stages:  # the stage points time the same path, finer: not both at once
        core._callback_profile("time")
    tracker = memviz.track().start()
    for _ in range(5):  # the route's first blocks and the stacks' first sight
        step()
    torch.cuda.synchronize()
    before = {r[0]: r[1:] for r in core._capture_timings()}
    stages_before = dict(core._stage_timings() or [])
    times = []
    for _ in range(a.steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter_ns()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter_ns() - t0)
    after = {r[0]: r[1:] for r in core._capture_timings()}
    stages_after = dict(core._stage_timings() or [])
    stats = core.stats()
    tracker.stop()
    main_tid = threading.get_native_id()
    threads = []
    for tid, (na, ta, nf, tf) in after.items():
        b = before.get(tid, (0, 0.0, 0, 0.0))
        threads.append({"main": tid == main_tid, "allocs": na - b[0], "alloc_ns": ta - b[1],
                        "frees": nf - b[2], "free_ns": tf - b[3]})
    if stages:  # per thread and stage: points and ns in the timed steps
        threads = []
        for tid, d in stages_after.items():
            b = stages_before.get(tid, {})
            st = {k: (n - b.get(k, (0, 0))[0], ns - b.get(k, (0, 0))[1]) for k, (n, ns) in d.items()}
            # allocations: one a_enter each; frees: one f_enter each
            threads.append({"main": tid == main_tid, "allocs": st["a_enter"][0], "frees": st["f_enter"][0],
                            "alloc_ns": sum(v[1] for k, v in st.items() if k.startswith("a_")),
                            "free_ns": sum(v[1] for k, v in st.items() if k.startswith("f_")),
                            "stages": st})
    print(json.dumps({"model": a.model, "step_ns": times, "threads": threads,
                      "queue_full": stats.get("queue_full"), "queue_kicks": stats.get("queue_kicks")}))


def summarize_one(r):
    wall = sum(r["step_ns"])
    ev = sum(t["allocs"] + t["frees"] for t in r["threads"])
    ns = sum(t["alloc_ns"] + t["free_ns"] for t in r["threads"])
    out = {"step_ms": statistics.median(r["step_ns"]) / 1e6, "events_per_step": ev / len(r["step_ns"]),
           "ns_per_event": ns / max(ev, 1), "share": ns / wall}
    for who, main in (("main", True), ("autograd", False)):
        ts = [t for t in r["threads"] if t["main"] == main]
        na, nf = sum(t["allocs"] for t in ts), sum(t["frees"] for t in ts)
        out[f"{who}_ns_per_alloc"] = sum(t["alloc_ns"] for t in ts) / max(na, 1)
        out[f"{who}_ns_per_free"] = sum(t["free_ns"] for t in ts) / max(nf, 1)
        out[f"{who}_events"] = na + nf
        for t in ts:  # a stage build: ns per point of each stage
            for k, (n, ns) in t.get("stages", {}).items():
                if n:
                    out[f"{who}_{k}"] = ns / n
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--procs", type=int, default=4, help="fresh processes per build")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--model", default="alloc_bound", choices=["alloc_bound", "gpt"])
    ap.add_argument("--variant", help=argparse.SUPPRESS)  # the first version's scripts want one
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--against", help="another checkout, its extension built: its own bench_in_step.py")
    ap.add_argument("--out", default="in_step.json")
    ap.add_argument("--stages", action="store_true",
                    help="a stage build's points (CFLAGS=-DMVZ_STAGES, src/clock.h): ns per stage, per thread; "
                         "every process must be such a build")
    a = ap.parse_args()
    if a.child:
        return child(a)
    scripts = {"this": os.path.abspath(__file__)}
    if a.against:
        scripts["against"] = os.path.join(os.path.abspath(a.against), "benchmarks", "bench_in_step.py")
    runs = {v: [] for v in scripts}
    for i in range(a.procs):
        order = list(scripts) if i % 2 == 0 else list(scripts)[::-1]
        for v in order:
            p = subprocess.run([sys.executable, scripts[v], "--child", "--variant", "base", "--model", a.model,
                                "--steps", str(a.steps)] + (["--stages"] if a.stages else []),
                               capture_output=True, text=True, timeout=600)
            if p.returncode != 0:
                print(f"{v}: process failed:\n{p.stderr[-2000:]}", file=sys.stderr)
                continue
            r = json.loads(p.stdout.strip().splitlines()[-1])
            r["summary"] = summarize_one(r)
            runs[v].append(r)
            s = r["summary"]
            print(f"{v:8s} step {s['step_ms']:.2f} ms  {s['events_per_step']:.0f} events  "
                  f"{s['ns_per_event']:.1f} ns/event  share {100 * s['share']:.3f}%  main alloc/free "
                  f"{s['main_ns_per_alloc']:.0f}/{s['main_ns_per_free']:.0f}  autograd "
                  f"{s['autograd_ns_per_alloc']:.0f}/{s['autograd_ns_per_free']:.0f}  "
                  f"queue_full {r['queue_full']}", flush=True)
    summary = {}
    for v, rs in runs.items():
        if not rs:
            continue
        keys = rs[0]["summary"].keys()
        summary[v] = {k: statistics.median(r["summary"][k] for r in rs) for k in keys}
        summary[v]["share_spread"] = [min(r["summary"]["share"] for r in rs),
                                      max(r["summary"]["share"] for r in rs)]
        s = summary[v]
        print(f"{v:8s} median: {s['ns_per_event']:.1f} ns/event, share {100 * s['share']:.3f}% "
              f"({100 * s['share_spread'][0]:.3f}-{100 * s['share_spread'][1]:.3f}), step {s['step_ms']:.2f} ms")
        if a.stages:
            for who in ("main", "autograd"):
                print(f"  {who}: " + "  ".join(f"{k[len(who) + 1:]} {s[k]:.1f}" for k in s
                                               if k.startswith(who + "_") and k[len(who) + 1:][:2] in ("nu", "a_", "f_")))
    with open(a.out, "w") as f:
        json.dump({"model": a.model, "steps": a.steps, "summary": summary, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
