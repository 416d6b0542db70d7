"""What autograd attribution costs per step, on the CPU (no GPU needed).

    python benchmarks/bench_autograd_hooks.py

Builds the GPT-style model of bench_train_step.py (small sequence, CPU) and,
for one training step, counts backward nodes and saved tensors and times
memviz's Python hooks alone, interleaved: node labels only (precise mode's
default: the graph walk that puts a pre-hook on every node, and the pre-hook
calls during backward), and labels plus graph residency (the pack hook per
saved tensor and the unpack hook); each is a step with the hooks minus the
same step without, median of several; and the graph walk alone. On the GPU the step is shorter but these costs are the same
Python work, so they bound what autograd attribution adds there.
"""

import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main():
    import torch

    from bench_train_step import build

    torch.manual_seed(0)
    model = build(torch)(vocab=1000, d=768, layers=12, heads=12, ctx=64)
    data = torch.randint(0, 1000, (1, 65))

    def step():
        logits = model(data[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), data[:, 1:].reshape(-1))
        loss.backward()
        model.zero_grad(set_to_none=True)
        return loss

    import memviz

    # Count nodes and saved tensors of one step.
    loss = model(data[:, :-1]).sum()
    seen, stack = set(), [loss.grad_fn]
    while stack:
        n = stack.pop()
        if n is None or n in seen:
            continue
        seen.add(n)
        stack.extend(f for f, _ in n.next_functions)
    nodes = len(seen)
    saved = [0]
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.__setitem__(0, saved[0] + 1) or t, lambda t: t):
        model(data[:, :-1]).sum()
    del loss

    def timed(n=15):
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            step()
            out.append(time.perf_counter() - t0)
        return statistics.median(out) * 1e3

    for _ in range(3):
        step()
    # Interleaved: no tracking; node labels only (precise mode's default:
    # one pre-hook per node, forward lines from node numbers); labels plus
    # graph residency (saved-tensor hooks, autograd=True).
    plain, labels, graph = [], [], []
    for _ in range(5):
        plain.append(timed())
        with memviz.track(gpu=False, autograd=True, graph=False):
            labels.append(timed())
        with memviz.track(gpu=False, autograd=True, graph=True):
            graph.append(timed())
    # The graph walk alone (fresh graph each time), median of 20.
    walks = []
    with memviz.track(gpu=False, autograd=True, graph=False) as t:
        for _ in range(20):
            loss = model(data[:, :-1]).sum()
            t0 = time.perf_counter()
            t.torch._hook_graph([loss.grad_fn])
            walks.append((time.perf_counter() - t0) * 1e3)
            del loss
    walk_ms = statistics.median(walks)
    p, lab, g = statistics.median(plain), statistics.median(labels), statistics.median(graph)
    print(json.dumps({
        "nodes_per_step": nodes, "saved_tensors_per_step": saved[0],
        "cpu_step_ms": p, "labels_ms_per_step": lab - p, "labels_and_graph_ms_per_step": g - p,
        "spread_plain_ms": [min(plain), max(plain)], "spread_labels_ms": [min(labels), max(labels)],
        "spread_graph_ms": [min(graph), max(graph)],
        "graph_walk_ms": walk_ms, "graph_walk_us_per_node": walk_ms * 1e3 / nodes,
    }, indent=1))


if __name__ == "__main__":
    main()
