"""A training loop whose reserved memory keeps growing while allocated stays
flat: fragmentation of PyTorch's caching allocator, and memviz naming it.

    python examples/fragmenting_loop.py
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python examples/fragmenting_loop.py

The batches have variable lengths that creep upwards (as with curriculum
learning or length-grouped batching). Every batch needs activation blocks a
little larger than any the allocator has cached, so with the default
allocator it reserves new segments each step and keeps the old, now too
small, ones: PyTorch's *reserved* memory grows step after step towards the
card's size while *allocated* (what tensors hold between steps) stays flat.
``memviz.diagnose()`` reports a ``fragmentation`` finding with the reserved
and allocated numbers, the reserved-but-unused bytes and the largest free
block, and recommends ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``;
with that setting the segments grow in place and the finding goes away.

Needs a CUDA GPU; without one the script says so and exits.
``--json`` prints the findings as one ``RESULT {...}`` line (for tests).
"""

import argparse
import json
import os
import sys

try:
    import memviz
except ImportError:  # run from a source checkout without installing
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    import memviz


def cuda_torch():
    """(torch, None) when PyTorch can use a CUDA GPU, else (None, why not)."""
    try:
        import torch
    except ImportError:
        return None, "PyTorch is not installed (pip install torch)"
    if not torch.cuda.is_available():
        return None, f"PyTorch {torch.__version__} found no usable CUDA GPU"
    return torch, None


def train_step(torch, model, opt, length, batch, dim):
    """One step on a (batch, length, dim) batch; its tensors are freed on return."""
    x = torch.randn(batch, length, dim, device="cuda")
    loss = model(x).pow(2).mean()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return tuple(x.shape)


def train(torch, t, steps, batch=4, dim=1024, first=1024, creep=32):
    torch.manual_seed(0)
    nn = torch.nn
    model = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    for step in range(steps):
        # each batch a little longer than any before: its activations fit no cached block
        shape = train_step(torch, model, opt, first + creep * step, batch, dim)
        t.step(batch_shape=shape)


def main(argv=None):
    ap = argparse.ArgumentParser(description="A training loop that fragments the allocator's cache.")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--json", action="store_true", help="print the findings as one RESULT line")
    a = ap.parse_args(argv)
    torch, why_not = cuda_torch()
    if torch is None:
        print(f"fragmenting_loop.py: this example needs a CUDA GPU, and {why_not}.")
        return 0
    with memviz.track() as t:
        train(torch, t, a.steps)
    findings = memviz.diagnose(t)
    last = t.steps[-1].devices.get(torch.cuda.current_device())
    if a.json:
        print("RESULT " + json.dumps({
            "kinds": [f.kind for f in findings], "findings": [f.to_dict() for f in findings],
            "reserved": [s.reserved for s in t.steps], "allocated": [s.allocated for s in t.steps],
            "conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")}), flush=True)
        return 0
    if not findings:
        print("memviz found nothing wrong with this loop"
              + (f" (reserved {memviz.format_size(last.reserved)})." if last and last.reserved else "."))
    for f in findings:
        print(f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
