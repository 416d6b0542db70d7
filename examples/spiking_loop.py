"""A training loop whose peak jumps on a few long inputs, and memviz naming them.

    python examples/spiking_loop.py

Most batches hold 256-token sequences; steps 12, 25 and 33 get 2048 tokens.
Self-attention's score matrix grows with the square of the length, so a long
batch needs far more memory than a typical one: the peak jumps only on those
steps. Each step passes its input's shape to memviz (``t.step(batch_shape=...)``),
so ``memviz.diagnose()`` can tie the jump to the input and reports a
``spike`` finding with the step, the shape, what it needed against a typical
step, and the largest line at the peak. The usual fix is to split long inputs
into chunks (or cap or bucket their lengths).

Needs a CUDA GPU; without one the script says so and exits.
``--json`` prints the findings as one ``RESULT {...}`` line (for tests).
"""

import argparse
import json
import math
import os
import sys

try:
    import memviz
except ImportError:  # run from a source checkout without installing
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    import memviz

LONG_STEPS = (12, 25, 33)


def cuda_torch():
    """(torch, None) when PyTorch can use a CUDA GPU, else (None, why not)."""
    try:
        import torch
    except ImportError:
        return None, "PyTorch is not installed (pip install torch)"
    if not torch.cuda.is_available():
        return None, f"PyTorch {torch.__version__} found no usable CUDA GPU"
    return torch, None


def train_step(torch, qkv, out, opt, x):
    """Self-attention on x (batch, length, dim): the scores are (batch, length, length)."""
    q, k, v = qkv(x).chunk(3, dim=-1)
    scores = q @ k.transpose(-2, -1) / math.sqrt(x.shape[-1])
    y = out(scores.softmax(dim=-1) @ v)
    loss = y.pow(2).mean()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()


def train(torch, t, steps, batch=8, dim=512, short=256, long=2048):
    torch.manual_seed(0)
    qkv = torch.nn.Linear(dim, 3 * dim).cuda()
    out = torch.nn.Linear(dim, dim).cuda()
    opt = torch.optim.SGD(list(qkv.parameters()) + list(out.parameters()), lr=1e-3)
    for step in range(steps):
        length = long if step in LONG_STEPS else short
        x = torch.randn(batch, length, dim, device="cuda")
        train_step(torch, qkv, out, opt, x)
        t.step(batch_shape=tuple(x.shape))
        del x


def main(argv=None):
    ap = argparse.ArgumentParser(description="A training loop with occasional long inputs.")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--json", action="store_true", help="print the findings as one RESULT line")
    a = ap.parse_args(argv)
    torch, why_not = cuda_torch()
    if torch is None:
        print(f"spiking_loop.py: this example needs a CUDA GPU, and {why_not}.")
        return 0
    with memviz.track() as t:
        train(torch, t, a.steps)
    findings = memviz.diagnose(t)
    if a.json:
        print("RESULT " + json.dumps({"kinds": [f.kind for f in findings],
                                      "findings": [f.to_dict() for f in findings]}), flush=True)
        return 0
    if not findings:
        print("memviz found nothing wrong with this loop.")
    for f in findings:
        print(f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
