"""The autograd graph walk that labels backward nodes, per node (CPU).

    python benchmarks/bench_graph_walk.py

Builds the GPT-style model of bench_train_step.py (small, CPU), and times
memviz's walk (TorchIntegration._hook_graph) on fresh graphs, then its
parts with PyTorch's own APIs: traversal (next_functions), node numbers,
names, and register_prehook through PyTorch's machinery (a RemovableHandle
per hook, which memviz's walk avoids). Medians of 30, microseconds per node.
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
import memviz  # noqa: E402
from bench_train_step import build  # noqa: E402
torch.manual_seed(0)
model = build(torch)(vocab=1000, d=64, layers=12, heads=4, ctx=64)
data = torch.randint(0, 1000, (1, 65))
def walk_once(t):
    loss = model(data[:, :-1]).sum()
    t0 = time.perf_counter(); t.torch._hook_graph([loss.grad_fn]); return time.perf_counter() - t0
def parts():
    loss = model(data[:, :-1]).sum()
    seen=set(); st=[loss.grad_fn]; nodes=[]
    t0=time.perf_counter()
    while st:
        n=st.pop()
        if n in seen: continue
        seen.add(n); nodes.append(n)
        for f,_ in n.next_functions:
            if f is not None and f not in seen: st.append(f)
    t1=time.perf_counter()
    _seqs=[n._sequence_nr() for n in nodes]
    t2=time.perf_counter()
    _names=[n.name() for n in nodes]
    t3=time.perf_counter()
    h=lambda g: None
    for n in nodes: n.register_prehook(h)
    t4=time.perf_counter()
    k=len(nodes)
    return [(t1-t0)*1e6/k, (t2-t1)*1e6/k, (t3-t2)*1e6/k, (t4-t3)*1e6/k]
with memviz.track(gpu=False, autograd=True, graph=False) as t:
    walk = statistics.median(walk_once(t) for _ in range(30)) * 1e6 / 530
    ps = [parts() for _ in range(30)]
    med = [statistics.median(p[i] for p in ps) for i in range(4)]
    t0 = time.perf_counter()
    for _ in range(100):
        memviz._core.seqmap_lookup(list(range(530)))
    lookup_ms = (time.perf_counter() - t0) * 10
print(json.dumps({"nodes": 530, "memviz_walk_us_per_node": walk, "traverse_us": med[0], "sequence_nr_us": med[1],
                  "name_us": med[2], "torch_register_prehook_us": med[3], "node_number_lookup_ms": lookup_ms},
                 indent=1))
