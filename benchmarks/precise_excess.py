"""What precise mode counts beyond torch.cuda.memory_allocated() (one process).

    python benchmarks/precise_excess.py [--route precise|allocator]

A 6-layer MLP (Linear(1024, 2048), ReLU, Linear(2048, 1024)) trains a step
under track(); at a synchronised point memviz's PyTorch bytes are compared
with memory_allocated(), and what memviz holds beyond it is listed by size,
category, call, node and thread. Then PyTorch's cuBLAS workspaces are
cleared (torch._C._cuda_clearCublasWorkspaces) and both are read again.
Prints one JSON line.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--route", default="precise", choices=["precise", "allocator"])
    a = ap.parse_args()
    import memviz

    t = memviz.track(precise=True).start() if a.route == "precise" else None
    import torch

    torch.manual_seed(0)
    layers = []
    for _ in range(6):
        layers += [torch.nn.Linear(1024, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 1024)]
    model = torch.nn.Sequential(*layers).cuda()
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(4096, 1024, device="cuda")
    if t is None:
        torch.cuda.synchronize()
        t = memviz.track().start()

    def pytorch_bytes(snap):
        return sum(al.size for al in snap.allocations
                   if al.kind == "block" or (a.route == "precise" and not al.category.startswith(
                       ("outside_pytorch", "pinned_host")) and al.category != "pytorch_pool"))

    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    torch.cuda.synchronize()
    snap = t.snapshot()
    before = {"memviz": pytorch_bytes(snap), "allocated": torch.cuda.memory_allocated(),
              "categories": {str(s.key): s.size for s in snap.statistics("category")}}
    big = sorted((al for al in snap.allocations if al.size >= 64 << 10
                  and al.category in ("workspace/cublas", "other_pytorch", "temporary")),
                 key=lambda al: -al.size)[:20]
    rows = [{"size": al.size, "category": al.category, "op": al.op, "node": al.autograd_node,
             "thread": str(al.thread.name if al.thread else None), "kind": al.kind} for al in big]
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.synchronize()
    snap2 = t.snapshot()
    after = {"memviz": pytorch_bytes(snap2), "allocated": torch.cuda.memory_allocated(),
             "categories": {str(s.key): s.size for s in snap2.statistics("category")}}
    info = t.capture_info()["pytorch"]
    t.stop()
    print(json.dumps({"route": info, "backend": torch.cuda.get_allocator_backend(), "before": before,
                      "largest": rows, "after_clearing_cublas_workspaces": after}))


if __name__ == "__main__":
    main()
