"""One training step, timed, under one tracking mode (a fresh process each).

    python benchmarks/bench_train_step.py --mode none|memviz|torch_history [--steps 60]
                                          [--model gpt|alloc_bound]

``--model gpt`` (default): 12 layers, width 768, 12 heads, sequence 512,
batch 8, vocabulary 50257, AdamW, bf16 autocast (about 26 ms on the H200).
``--model alloc_bound``: the allocation-bound step of issue 27, 48 small
Linear(256, 256) + LayerNorm + GELU layers, batch 32, AdamW: many small ops,
so PyTorch's allocations and frees per second are at their highest (about
10 ms a step; the JSON says how many allocations a second it made,
``allocs_per_s``, from PyTorch's own counter). Prints one JSON line with
per-step times in ms.
"""

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def build(torch):
    nn = torch.nn
    F = torch.nn.functional

    class Block(nn.Module):
        def __init__(self, d, h):
            super().__init__()
            self.h = h
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x):
            b, t, d = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
            q, k, v = (z.view(b, t, self.h, d // self.h).transpose(1, 2) for z in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
            return x + self.out(F.gelu(self.fc(self.ln2(x))))

    class GPT(nn.Module):
        def __init__(self, vocab=50257, d=768, layers=12, heads=12, ctx=512):
            super().__init__()
            self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
            self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
            self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

        def forward(self, idx):
            x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
            for blk in self.blocks:
                x = blk(x)
            return self.head(self.ln(x))

    return GPT


def build_alloc_bound(torch, layers=48, width=256):
    """The allocation-bound model: many small layers, each a handful of
    small tensors forward and backward."""
    nn = torch.nn
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width), nn.GELU())
                           for _ in range(layers)])


def make_step(torch, model_name: str, batch: int = 8, seq: int = 512, wrap=None):
    """The model (seeded), on the GPU (through ``wrap``, e.g. DDP, if given),
    with AdamW; returns one training step of it: ``alloc_bound_step`` or
    ``gpt_step`` (bf16 autocast), the names the profiles' ``--within`` look
    for (benchmarks/gpu_check.sh)."""
    torch.manual_seed(0)
    if model_name == "alloc_bound":
        model = build_alloc_bound(torch).cuda()
        data = torch.randn(32, 256, device="cuda")
    else:
        model = build(torch)().cuda()
        data = torch.randint(0, 50257, (batch, seq + 1), device="cuda")
    if wrap is not None:
        model = wrap(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def gpt_step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(data[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.float().view(-1, logits.shape[-1]),
                                                     data[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def alloc_bound_step():
        model(data).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return alloc_bound_step if model_name == "alloc_bound" else gpt_step


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", default="none", choices=[
        "none", "precise_untracked", "memviz", "memviz_trace", "memviz_precise_trace", "memviz_autograd", "memviz_precise",
        "memviz_precise_noautograd", "memviz_precise_nohooks", "memviz_precise_packonly",
        "memviz_precise_walkonly", "memviz_precise_cbnoop", "memviz_precise_noasync", "memviz_precise_hooks", "memviz_precise_cupti", "torch_history", "torch_profiler_memory",
        "memviz_after", "alternate"])
    ap.add_argument("--model", default="gpt", choices=["gpt", "alloc_bound"],
                    help="gpt (default) or alloc_bound: 48 small Linear+LayerNorm+GELU layers, batch 32")
    ap.add_argument("--trace-dir", default="/tmp", help="where memviz_trace / torch_history write files")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--cycles", type=int, default=6, help="alternate: rounds of the three configurations")
    ap.add_argument("--block", type=int, default=12, help="alternate: steps per configuration and round")
    ap.add_argument("--configs", default="none,memviz_after,torch_history",
                    help="alternate: the configurations, comma-separated, of none, memviz_after "
                         "(the allocator route), memviz_after_trace (route + a streamed trace), "
                         "memviz_after_flight (route + a 256 MiB flight recorder), segments_trace "
                         "(torch=False: segments only, + a trace), torch_history")
    a = ap.parse_args()

    tracker = None
    if a.mode.startswith("memviz") and a.mode != "memviz_after":
        import memviz  # started before `import torch` so precise mode can choose the allocator
        no_autograd = a.mode.endswith(("noautograd", "cbnoop", "noasync"))
        if no_autograd:  # split the precise cost: memviz's callback timed, CUPTI alone, or subscribed only
            memviz._core._callback_profile("noop" if a.mode.endswith("cbnoop") else "noasync"
                                           if a.mode.endswith("noasync") else "time")
        if a.mode.endswith("_cupti"):  # precise mode's allocations through CUPTI's callbacks, not the wrappers
            os.environ["MEMVIZ_PRECISE_CAPTURE"] = "cupti"
        if a.mode.endswith("_hooks"):  # labels from per-node pre-hooks, as before the callback named nodes
            os.environ["MEMVIZ_AUTOGRAD_LABELS"] = "hooks"
        trace = os.path.join(a.trace_dir, f"bench_{os.getpid()}.memviz") if a.mode.endswith("_trace") else None
        tracker = memviz.track(precise="precise" in a.mode, trace=trace,
                               autograd=False if no_autograd or a.mode.endswith("nohooks")
                               else (True if a.mode == "memviz_autograd" else None),
                               torch=False if no_autograd else None).start()
    elif a.mode == "precise_untracked":
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "backend:cudaMallocAsync"

    import torch

    parts = {"walk_s": 0.0, "walks": 0, "nodes": 0}
    integ = getattr(tracker, "torch", None)
    if integ is not None and integ.autograd:
        # Split the autograd hooks' cost: the saved-tensor hooks alone, or the
        # per-node pre-hooks (graph walk) alone; the walk is timed either way.
        if a.mode.endswith("packonly"):
            integ._hook_graph = lambda roots: None
        elif a.mode.endswith("walkonly"):
            integ.graph.stop()
        walk = integ._hook_graph

        def timed_walk(roots, _walk=walk):
            t0 = time.perf_counter()
            _walk(roots)
            parts["walk_s"] += time.perf_counter() - t0
            parts["walks"] += 1

        integ._hook_graph = timed_walk

    step = make_step(torch, a.model, a.batch, a.seq)
    if a.mode == "memviz_after":  # a notebook user: torch, CUDA and the model first, then track()
        import memviz
        tracker = memviz.track().start()
        integ = tracker.torch

    if a.mode == "alternate":
        return alternate(a, torch, step)

    prof = None
    if a.mode == "torch_history":
        torch.cuda.memory._record_memory_history(stacks="python")
    elif a.mode == "torch_profiler_memory":
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                  torch.profiler.ProfilerActivity.CUDA],
                                      profile_memory=True)
        prof.__enter__()

    times = []
    allocs0 = None
    for i in range(a.warmup + a.steps):
        torch.cuda.synchronize()
        if i == a.warmup:
            allocs0 = _allocs(torch)
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        if i >= a.warmup:
            times.append((time.perf_counter() - t0) * 1e3)

    extra = {"backend": torch.cuda.get_allocator_backend(), "model": a.model}
    if allocs0 is not None and times:  # PyTorch's own count of allocations (and as many frees) a second
        extra["allocs_per_s"] = (_allocs(torch) - allocs0) / (sum(times) / 1e3)
    if integ is not None and integ.route is not None:
        extra["pytorch_route"] = integ.route.as_dict()
    if integ is not None and integ.autograd:
        extra["nodes_attached"] = integ._nodes_attached  # the callback names nodes (src/nodes.h)
    if integ is not None and integ.precise_capture:
        extra["precise_capture"] = integ.precise_capture
    if parts["walks"]:
        extra["walk_ms_per_backward"] = parts["walk_s"] * 1e3 / parts["walks"]
        extra["hooked_node_kinds"] = len(integ._node_hooks)
    if prof is not None:
        prof.__exit__(None, None, None)
    if tracker is not None:
        t0 = time.perf_counter()
        tracker.stop()  # freezes the store's data: resolves stacks and names their calls
        t1 = time.perf_counter()
        peak = tracker.peak_snapshot()
        extra.update({"stop_s": t1 - t0, "peak_snapshot_s": time.perf_counter() - t1,
                      "peak_ops": [(s.key, s.size, s.count) for s in peak.statistics("op")[:8]]})
        info = tracker.capture_info()
        extra.update({"calls": info["store"]["calls"], "memviz_bytes": info["store"]["bytes_used"],
                      "live": info["store"]["live"], "peak": tracker.peak_bytes(),
                      "callback_calls": info["store"]["profile_calls"],
                      "callback_ns": info["store"]["profile_ns"]})
        if tracker.trace_path:
            extra["trace_bytes"] = os.path.getsize(tracker.trace_path)
            extra["trace_events"] = memviz.load(tracker.trace_path).event_count
            os.unlink(tracker.trace_path)
    elif a.mode == "torch_history":
        t0 = time.perf_counter()
        snap = torch.cuda.memory._snapshot()
        extra.update({"snapshot_s": time.perf_counter() - t0,
                      "trace_entries": sum(len(t) for t in snap["device_traces"])})
        dump = os.path.join(a.trace_dir, f"bench_{os.getpid()}.pickle")
        torch.cuda.memory._dump_snapshot(dump)
        extra["dump_snapshot_bytes"] = os.path.getsize(dump)
        os.unlink(dump)
        torch.cuda.memory._record_memory_history(enabled=None)
    print(json.dumps({"mode": a.mode, "median_ms": statistics.median(times), "times_ms": times,
                      "max_allocated": torch.cuda.max_memory_allocated(), **extra}))


def _allocs(torch) -> int:
    """PyTorch's count of block allocations so far (all pools, device 0)."""
    return int(torch.cuda.memory_stats().get("allocation.all.allocated", 0))


def _core_stats():
    import memviz._core
    return memviz._core.trace_writer_stats()


#: issue 27's breakdown: memviz (the allocator route) with one part left out each; and
#: memviz_noop (alternate()): track() as always, then the route's capture path returning at
#: once (_core._capture_noop), so that what is left is the route's wrappers and memviz's threads;
#: X_noop for an ablation X: that ablation, its capture path returning at once (memviz_nocupti_noop:
#: the route's wrappers alone); memviz_nodrain: track() with its drainer thread paused, so the
#: queue (4 MiB: a block's events fit) is applied at stop, outside the timed steps;
#: memviz_drainN: track() with its drainer waking every N ms (4 by default); X_nopf: configuration
#: X with the allocator route's prefetches left out (_core._prefetch(False))
ABLATIONS = {
    "memviz_noactivity": {"activity": False},  # no CUPTI activity records (MEMORY2)
    "memviz_nocupti": {"cupti": False},  # no CUPTI at all: the route and the segment wrappers
    "memviz_depth1": {"depth": 1},  # one frame kept: the frame walk, hash and intern mostly gone
    "memviz_noautograd": {"autograd": False},  # no autograd node read on the capture path
}


def _after_start(c):
    """The configurations that change one thing of track() once it has
    started: (track()'s arguments, what to do then, what to undo before
    stop), or None for any other name."""
    import memviz._core as core
    if c == "memviz_noop":  # after the route's probe, which checks what was recorded
        return {}, lambda: core._capture_noop(True), None
    if c == "memviz_nodrain":
        return {}, lambda: core._drainer(False), None
    ms = c.removeprefix("memviz_drain")
    if ms != c and ms.replace(".", "", 1).isdigit():
        return {}, lambda: core._drain_period(int(float(ms) * 1e6)), lambda: core._drain_period(0)
    base = c.removesuffix("_noop")
    if base in ABLATIONS:
        return ABLATIONS[base], (lambda: core._capture_noop(True)) if base != c else None, None
    return None


def _thread_cpu_ns(name: str) -> int:
    """CPU time (ns) of this process's threads named `name` (Linux schedstat; 0 elsewhere)."""
    total = 0
    try:
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/comm") as f:
                    if f.read().strip() != name:
                        continue
                with open(f"/proc/self/task/{tid}/schedstat") as f:
                    total += int(f.read().split()[0])
            except OSError:
                continue
    except OSError:
        return 0
    return total


def alternate(a, torch, step):
    """One process, the three configurations in turn: untracked, memviz
    started after the model (the allocator route), and PyTorch's
    _record_memory_history(stacks="python"); each for --block steps, the
    order rotated every cycle. The same process, heap and GPU state for all
    three, so a process's ratio is paired; the first 2 steps of a block
    (attach, the first allocations seen) are dropped from its times."""
    import memviz

    import memviz._core as core

    configs = a.configs.split(",")
    for c in configs:
        c = c.removesuffix("_nopf")  # X_nopf: configuration X, the route's prefetches left out
        if c not in ("none", "memviz_after", "memviz_after_trace", "memviz_after_flight", "segments_trace",
                     "torch_history") and _after_start(c) is None:
            raise SystemExit(f"unknown configuration {c!r}")
    times = {c: [] for c in configs}
    trace_stats = {c: [] for c in configs}
    allocs_s = [0, 0.0]  # PyTorch's allocations, and seconds, of the untracked steps
    n = len(configs)
    for i in range(a.warmup):
        step()
    torch.cuda.synchronize()
    routes = set()
    for cycle in range(a.cycles):
        order = configs[cycle % n:] + configs[:cycle % n]
        for cn in order:
            tracker = None
            c = cn.removesuffix("_nopf")
            split, undo = _after_start(c), None
            if split is not None:
                kwargs, then, undo = split
                tracker = memviz.track(**kwargs).start()
                if then is not None:
                    then()
            elif c.startswith(("memviz_after", "segments")):
                trace = (os.path.join(a.trace_dir, f"bench_{os.getpid()}.memviz")
                         if c.endswith("_trace") else None)
                tracker = memviz.track(trace=trace, torch=False if c.startswith("segments") else None,
                                       flight_recorder="256 MiB" if c.endswith("_flight") else None,
                                       flight_dir=a.trace_dir if c.endswith("_flight") else None).start()
            elif c == "torch_history":
                torch.cuda.memory._record_memory_history(stacks="python")
            if tracker is not None:
                integ = getattr(tracker, "torch", None)
                routes.add(integ.route.route if integ is not None and integ.route else None)
            if cn.endswith("_nopf"):
                core._prefetch(False)
            c = cn
            for i in range(a.block):
                torch.cuda.synchronize()
                n0 = _allocs(torch) if c == "none" else 0
                t0 = time.perf_counter()
                step()
                torch.cuda.synchronize()
                if i >= 2:
                    times[c].append((time.perf_counter() - t0) * 1e3)
                    if c == "none":
                        allocs_s[0] += _allocs(torch) - n0
                        allocs_s[1] += times[c][-1] / 1e3
            if c.endswith("_nopf"):
                core._prefetch(True)
            if tracker is not None:
                drain_ns = _thread_cpu_ns("memviz-drain")  # the drainer's CPU time this block
                if undo is not None:
                    undo()
                fr = tracker.flight_recorder
                tracker.stop()
                if tracker.trace_path:
                    loaded = memviz.load(tracker.trace_path)
                    events = sum(1 for _ in loaded.events())
                    trace_stats[c].append({"bytes": os.path.getsize(tracker.trace_path), "events": events,
                                           "dropped": loaded.dropped_events})
                    os.unlink(tracker.trace_path)
                elif fr is not None:
                    trace_stats[c].append({"dropped": _core_stats()["dropped"]})
                else:
                    trace_stats[c].append({"drain_cpu_ns": drain_ns, "steps": a.block})
                del tracker
            elif c == "torch_history":
                torch.cuda.memory._record_memory_history(enabled=None)
    print(json.dumps({"mode": "alternate", "model": a.model,
                      "untracked_allocs_per_s": allocs_s[0] / allocs_s[1] if allocs_s[1] else None,
                      "times_ms": times, "routes": sorted(map(str, routes)),
                      "trace_stats": trace_stats,
                      "medians_ms": {c: statistics.median(v) for c, v in times.items()}}))


if __name__ == "__main__":
    main()
