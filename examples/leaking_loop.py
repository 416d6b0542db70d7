"""A training loop whose memory grows every step, and memviz naming why.

    python examples/leaking_loop.py            # the leak, and memviz's finding
    python examples/leaking_loop.py --fixed    # the same loop keeping loss.item(): no finding

The loop trains a small MLP and, after each step, evaluates a validation loss
with autograd still on and keeps it in a list::

    val_loss = model(x_val).pow(2).mean()
    history.append(val_loss)            # the bug: keeps the tensor, and with it its graph

Each kept tensor keeps its autograd graph, and the graph keeps every
activation it saved for a backward pass that never comes: PyTorch's allocated
memory rises every step. ``memviz.diagnose()`` reports it as a ``growth``
finding naming ``list `history` in module __main__``, the line that appends
to it, and the forward line whose tensors the graphs hold. The fix is
``history.append(val_loss.item())`` (and evaluating under ``torch.no_grad()``).

Without a CUDA GPU the script says so and shows the autograd-graph part on
CPU tensors (memviz records what graphs keep through saved-tensor hooks).
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

history = []


def cuda_torch():
    """(torch, None) when PyTorch can use a CUDA GPU, else (torch or None, why not)."""
    try:
        import torch
    except ImportError:
        return None, "PyTorch is not installed (pip install torch)"
    if not torch.cuda.is_available():
        return torch, f"PyTorch {torch.__version__} found no usable CUDA GPU"
    return torch, None


def train(torch, t, device, steps, hidden, fixed):
    """The training loop; ``fixed`` keeps plain numbers instead of tensors."""
    torch.manual_seed(0)
    nn = torch.nn
    model = nn.Sequential(nn.Linear(1024, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                          nn.Linear(hidden, 1)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x_val = torch.randn(256, 1024, device=device)
    for _ in range(steps):
        x = torch.randn(256, 1024, device=device)
        loss = model(x).pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if fixed:
            with torch.no_grad():
                history.append(model(x_val).pow(2).mean().item())
        else:
            val_loss = model(x_val).pow(2).mean()  # autograd on: this builds a graph
            history.append(val_loss)  # the bug: keeps the tensor and its graph
        t.step(batch_shape=tuple(x.shape))


def report(findings, as_json, where):
    if as_json:
        print("RESULT " + json.dumps({"where": where, "kinds": [f.kind for f in findings],
                                      "findings": [f.to_dict() for f in findings]}), flush=True)
        return
    if not findings:
        print(f"memviz found nothing wrong with this loop ({where}).")
    for f in findings:
        print(f)


def main(argv=None):
    ap = argparse.ArgumentParser(description="A training loop that keeps its graphs alive.")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--fixed", action="store_true", help="keep loss.item() instead of the tensor")
    ap.add_argument("--json", action="store_true", help="print the findings as one RESULT line")
    a = ap.parse_args(argv)
    torch, why_not = cuda_torch()
    if why_not is not None:
        print(f"leaking_loop.py: the GPU part needs a CUDA GPU, and {why_not}.")
        if torch is None:
            return 0
        # The autograd-graph part works on CPU tensors too.
        from memviz.torch.graph import GraphRecorder

        rec = GraphRecorder().start()
        try:
            with memviz.track(gpu=False) as t:
                train(torch, t, "cpu", min(a.steps, 20), 256, a.fixed)
        finally:
            rec.stop()
        report(memviz.diagnose(t, graph=rec), a.json, "cpu")
        return 0
    # autograd=True also records what the graphs keep (saved tensors and their lines)
    with memviz.track(autograd=True) as t:
        train(torch, t, "cuda", a.steps, 4096, a.fixed)
    report(memviz.diagnose(t), a.json, "cuda")
    return 0


if __name__ == "__main__":
    sys.exit(main())
