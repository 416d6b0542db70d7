"""A small GPT trained for a few steps, with a leak: the run memviz ships as its sample.

    python -m memviz run examples/train_sample.py     # the report of this run
    python examples/record_sample.py --example examples/train_sample.py --warmup   # re-record the sample

A two-layer GPT (token and position embeddings, attention, an MLP, a tied
head) trains with AdamW on random tokens. Memory a newcomer should see, by
line: the parameters (where the model is built), the gradients and AdamW's
two states (made by the first backward and the first step), the activations
of the forward and what the backward makes for each forward line, one
record per step, and a finding. The leak: each step evaluates a validation
loss with autograd on and keeps the tensor, and with it the graph and every
activation it saved, so PyTorch's allocated memory rises step after step.
The fix is ``val_losses.append(val_loss.item())`` under ``torch.no_grad()``.

Without a CUDA GPU the script says so and stops.
"""

import math
import os
import sys

try:
    import memviz
except ImportError:  # run from a source checkout without installing
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    import memviz

VOCAB, WIDTH, HEADS, LAYERS, SEQ, BATCH, STEPS = 8192, 512, 8, 2, 256, 16, 12
val_losses = []


def cuda_torch():
    """(torch, None) when PyTorch can use a CUDA GPU, else (torch or None, why not)."""
    try:
        import torch
    except ImportError:
        return None, "PyTorch is not installed (pip install torch)"
    if not torch.cuda.is_available():
        return torch, f"PyTorch {torch.__version__} found no usable CUDA GPU"
    return torch, None


def build(torch):
    nn, F = torch.nn, torch.nn.functional

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
            self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
            self.proj = nn.Linear(WIDTH, WIDTH)
            self.up = nn.Linear(WIDTH, 4 * WIDTH)
            self.down = nn.Linear(4 * WIDTH, WIDTH)

        def forward(self, x):
            b, t, c = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, HEADS, c // HEADS).transpose(1, 3).unbind(2)
            att = (q @ k.transpose(-2, -1)) / math.sqrt(c // HEADS)
            att = att.masked_fill(torch.ones(t, t, device=x.device, dtype=torch.bool).triu(1), float("-inf"))
            y = att.softmax(-1) @ v
            x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
            h = F.gelu(self.up(self.ln2(x)))
            return x + self.down(h)

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(VOCAB, WIDTH)
            self.pos = nn.Embedding(SEQ, WIDTH)
            self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
            self.ln = nn.LayerNorm(WIDTH)

        def forward(self, idx):
            x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
            for block in self.blocks:
                x = block(x)
            return self.ln(x) @ self.tok.weight.t()  # the head shares the embedding

    return GPT().cuda()


def train(torch, t):
    torch.manual_seed(0)
    model = build(torch)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    val = torch.randint(0, VOCAB, (BATCH, SEQ + 1), device="cuda")
    for _ in range(STEPS):
        batch = torch.randint(0, VOCAB, (BATCH, SEQ + 1), device="cuda")
        logits = model(batch[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        val_loss = torch.nn.functional.cross_entropy(model(val[:, :-1]).flatten(0, 1), val[:, 1:].flatten())
        val_losses.append(val_loss)  # the leak: keeps the tensor and its graph
        t.step(batch_shape=tuple(batch.shape))


def main():
    torch, why_not = cuda_torch()
    if why_not is not None:
        print(f"train_sample.py: this example needs a CUDA GPU, and {why_not}.")
        return 0
    t = memviz.active_tracker()  # under `memviz run` or record_sample.py: theirs, and their report
    if t is not None:
        train(torch, t)
        return 0
    with memviz.track() as t:
        train(torch, t)
    print(f"train_sample.py: {STEPS} steps; PyTorch holds {torch.cuda.memory_allocated() / 2**20:.0f} MiB "
          f"({len(val_losses)} validation losses kept with their graphs).")
    for finding in memviz.diagnose(t):
        print(finding)
    return 0


if __name__ == "__main__":
    sys.exit(main())
