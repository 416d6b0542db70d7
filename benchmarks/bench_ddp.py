"""DDP on two GPUs, tracked against untracked: does tracking each rank cost
anything per step?

    python benchmarks/bench_ddp.py [--runs 5] [--steps 40] [--warmup 10] [--modes none,memviz] --out F.json

Each run is one fresh ``torch.distributed.run --nproc-per-node 2`` launch
(NCCL, one GPU per rank) of the GPT-style model of bench_train_step.py in
DistributedDataParallel (bf16 autocast, AdamW); the modes alternate launch by
launch (A B A B ...), at least 5 launches each. ``memviz`` starts
``memviz.track()`` in every rank before torch is imported (what ``torchrun
... -m memviz run train.py`` does); ``memviz_trace`` also streams each
rank's trace (run.rank0.memviz, run.rank1.memviz in a temporary folder).
Tracked ranks mark every step (``tracker.step()``, as ``memviz.watch`` does),
so the step records a merged report shows are part of the cost measured.
Rank 0 times every step after the warm-up (``torch.cuda.synchronize()``
before and after; the all-reduce makes both ranks' steps equal).

Prints and writes, per mode: each launch's median step, the median of those
medians, their spread, the minimum of the launches' minimum steps, and the
median (and spread) of the per-pair ratio to ``none`` (launch i of a mode
against launch i of ``none``). Needs two CUDA GPUs: with fewer it says so
and measures nothing (exit status 0, no --out file).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MODES = ("none", "memviz", "memviz_trace")


def _gpus() -> int:
    """CUDA devices visible here, asked in a child (the driver stays clean)."""
    code = "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)"
    try:
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        return int(p.stdout.strip().splitlines()[-1]) if p.returncode == 0 else 0
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return 0


def worker(a) -> None:
    """One rank of one launch."""
    rank, local = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    tracker = None
    if a.mode.startswith("memviz"):
        sys.path.insert(0, ROOT)
        import memviz  # before torch, as `memviz run` does
        trace = os.path.join(a.trace_dir, "run.memviz") if a.mode == "memviz_trace" else None
        tracker = memviz.track(trace=trace).start()  # trace: run.rank<N>.memviz
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    sys.path.insert(0, HERE)
    from bench_train_step import make_step

    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    step = make_step(torch, "gpt", a.batch, a.seq, wrap=lambda m: DDP(m, device_ids=[local]))

    times = []
    for i in range(a.warmup + a.steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        if i >= a.warmup:
            times.append((time.perf_counter() - t0) * 1e3)
        if tracker is not None:
            tracker.step()
    dist.barrier()
    peak = torch.cuda.max_memory_allocated()
    dist.destroy_process_group()
    if tracker is not None:
        tracker.stop()
    if rank == 0:
        with open(a.out, "w") as f:
            json.dump({"mode": a.mode, "times_ms": times, "max_memory_allocated": peak,
                       "gpu": torch.cuda.get_device_name(local)}, f)


def launch(a, mode: str, folder: str) -> dict:
    out = os.path.join(folder, f"{mode}.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.abspath(__file__), "--worker", "--mode", mode, "--steps", str(a.steps),
           "--warmup", str(a.warmup), "--batch", str(a.batch), "--seq", str(a.seq), "--out", out,
           "--trace-dir", folder]
    env = dict(os.environ)
    env.pop("MEMVIZ_CUPTI_LIBRARY", None)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, env=env, cwd=folder)
    if p.returncode != 0:
        raise RuntimeError(f"{mode} launch failed (rc={p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}")
    with open(out) as f:
        return json.load(f)


def summarise(runs: dict) -> dict:
    base = [statistics.median(r["times_ms"]) for r in runs["none"]] if "none" in runs else None
    out = {}
    for mode, rs in runs.items():
        meds = [statistics.median(r["times_ms"]) for r in rs]
        s = {"per_launch_median_ms": meds, "median_ms": statistics.median(meds),
             "spread_ms": [min(meds), max(meds)], "min_of_min_ms": min(min(r["times_ms"]) for r in rs),
             "max_memory_allocated": [r["max_memory_allocated"] for r in rs]}
        if base is not None and mode != "none":
            ratios = [m / b for m, b in zip(meds, base)]
            s.update(per_pair_ratio=ratios, median_ratio=statistics.median(ratios),
                     ratio_spread=[min(ratios), max(ratios)])
        out[mode] = s
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="none", choices=MODES, help=argparse.SUPPRESS)
    ap.add_argument("--trace-dir", default=tempfile.gettempdir(), help=argparse.SUPPRESS)
    ap.add_argument("--modes", default="none,memviz", help="comma-separated, from " + ", ".join(MODES))
    ap.add_argument("--runs", type=int, default=5, help="launches per mode (at least 5)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--out", default="bench_ddp.json")
    a = ap.parse_args()
    if a.worker:
        return worker(a)
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        sys.exit(f"bench_ddp: unknown mode {bad[0] if bad else '(none given)'}; choose from {', '.join(MODES)}")
    if a.runs < 5:
        sys.exit("bench_ddp: --runs must be at least 5 (a median of fewer launches says little)")
    n = _gpus()
    if n < 2:
        print(f"bench_ddp: DDP on two GPUs needs 2 CUDA GPUs; this machine has {n}. Nothing was measured.")
        return
    runs = {m: [] for m in modes}
    with tempfile.TemporaryDirectory(prefix="bench_ddp_") as folder:
        for i in range(a.runs):
            for mode in modes:  # A B A B: drift in the machine falls on every mode alike
                r = launch(a, mode, folder)
                runs[mode].append(r)
                print(f"launch {i} {mode:13s} median {statistics.median(r['times_ms']):7.2f} ms  "
                      f"min {min(r['times_ms']):7.2f} ms", flush=True)
    summary = summarise(runs)
    for mode, s in summary.items():
        ratio = (f"  ratio to none {s['median_ratio']:.3f} ({s['ratio_spread'][0]:.3f}-{s['ratio_spread'][1]:.3f})"
                 if "median_ratio" in s else "")
        print(f"{mode:13s} median {s['median_ms']:7.2f} ms  spread {s['spread_ms'][0]:.2f}-{s['spread_ms'][1]:.2f}"
              f"  min-of-min {s['min_of_min_ms']:.2f}{ratio}")
    gpu = runs[modes[0]][0].get("gpu")
    with open(a.out, "w") as f:
        json.dump({"gpu": gpu, "gpus": n, "args": vars(a), "summary": summary, "runs": runs}, f, indent=1)
    print(f"bench_ddp: wrote {a.out}")


if __name__ == "__main__":
    main()
