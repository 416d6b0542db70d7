"""What saved-tensor hooks cost per saved tensor, in PyTorch itself (CPU).

    python benchmarks/bench_saved_hooks.py

A small GPT-style model (bench_train_step.py's, CPU, one thread): forward +
backward with no hooks, with identity pack/unpack hooks (PyTorch's own cost
of calling Python per saved tensor), with a pack hook that detaches, and
with memviz's GraphRecorder. Prints microseconds per saved tensor over the
plain step, three rounds; the numbers behind precise mode leaving
saved-tensor hooks off (benchmarks/RESULTS.md).
"""
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, ".."))

import torch  # noqa: E402

from bench_train_step import build  # noqa: E402
from memviz.torch.graph import GraphRecorder  # noqa: E402


def main():
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = build(torch)(vocab=1000, d=64, layers=12, heads=4, ctx=64)
    data = torch.randint(0, 1000, (1, 65))

    def fwd():
        return model(data[:, :-1]).sum()

    def med(n=30):
        ts = []
        for _ in range(n):
            t0 = time.perf_counter()
            fwd().backward()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts) * 1e3

    count = [0]

    def counting(t):
        count[0] += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(counting, lambda t: t):
        fwd()
    n = count[0]
    rounds = []
    for _ in range(3):
        base = med()
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            ident = med()
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t.detach(), lambda t: t):
            det = med()
        g = GraphRecorder().start()
        try:
            ours = med()
        finally:
            g.stop()
        rounds.append({"step_ms": base, "identity_us": (ident - base) * 1e3 / n,
                       "detach_us": (det - base) * 1e3 / n, "graph_recorder_us": (ours - base) * 1e3 / n})
    print(json.dumps({"saved_tensors_per_step": n, "rounds": rounds}, indent=1))


if __name__ == "__main__":
    main()
