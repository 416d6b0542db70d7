"""One memory remedy, measured both ways with memviz diff.

    python examples/remedy_compare.py                      # activation checkpointing
    python examples/remedy_compare.py --remedy amp         # bf16 autocast
    python examples/remedy_compare.py --remedy accumulate  # 4 micro-batches, same batch
    python examples/remedy_compare.py --remedy expandable  # expandable_segments:True

A small GPT-style model (token embedding, pre-norm transformer blocks with
causal attention and an MLP, a tied output layer) trains a few AdamW steps
twice, each in a fresh Python process under ``memviz.track(trace=...)``:
once plainly (A) and once with the remedy (B). The script then prints
``python -m memviz diff A.memviz B.memviz``: the peak per device, PyTorch's
reserved against allocated, the fragmentation figures, the bytes per category
and the lines at the peak, with B - A and B / A, and a one-line result.

Remedies:

* ``checkpoint``: ``torch.utils.checkpoint`` around each block, so the
  forward keeps only the blocks' inputs and backward recomputes the rest.
* ``amp``: the forward and loss under ``torch.autocast(dtype=torch.bfloat16)``.
* ``accumulate``: the same batch as 4 micro-batches, gradients accumulated.
* ``expandable``: ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` in the
  child's environment before PyTorch starts (changes reserved and the
  fragmentation figures rather than what the tensors need).

The traces are kept (``--out DIR``, default a new temporary folder); the
script needs a CUDA GPU, and without one it says so and exits with 0.
``--json`` prints ``RESULT {...}`` with the two peaks and their ratio.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
REMEDIES = ("checkpoint", "amp", "accumulate", "expandable")
MICRO_BATCHES = 4


def _memviz():
    try:
        import memviz
    except ImportError:  # run from a source checkout without installing
        sys.path.insert(0, ROOT)
        import memviz
    return memviz


# ---- the model (the child process) -------------------------------------------------


def build_model(torch, cfg):
    nn, F = torch.nn, torch.nn.functional

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            d = cfg["dim"]
            self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x):
            b, n, d = x.shape
            h = cfg["heads"]
            q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, h, d // h).permute(2, 0, 3, 1, 4)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(y.transpose(1, 2).reshape(b, n, d))
            return x + self.down(F.gelu(self.up(self.norm2(x))))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(cfg["vocab"], cfg["dim"])
            self.pos = nn.Parameter(torch.zeros(cfg["seq"], cfg["dim"]))
            self.blocks = nn.ModuleList(Block() for _ in range(cfg["layers"]))
            self.norm = nn.LayerNorm(cfg["dim"])

        def forward(self, tokens, checkpoint=False):
            x = self.embed(tokens) + self.pos[: tokens.shape[1]]
            for block in self.blocks:
                if checkpoint:
                    x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
                else:
                    x = block(x)
            return self.norm(x) @ self.embed.weight.T  # tied output layer

    return GPT()


def child(remedy, on, trace, cfg):
    """One run: build, train cfg["steps"] steps, all under memviz.track(trace=...)."""
    import torch

    memviz = _memviz()
    torch.manual_seed(0)
    use = remedy if on else None
    with memviz.track(trace=trace) as t:
        model = build_model(torch, cfg).cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        for step in range(cfg["steps"]):
            tokens = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"] + 1), device="cuda")
            parts = tokens.chunk(MICRO_BATCHES) if use == "accumulate" else (tokens,)
            for part in parts:
                with torch.autocast("cuda", dtype=torch.bfloat16, enabled=use == "amp"):
                    logits = model(part[:, :-1], checkpoint=use == "checkpoint")
                    loss = torch.nn.functional.cross_entropy(
                        logits.flatten(0, 1).float(), part[:, 1:].flatten())
                (loss / len(parts)).backward()
                del logits, loss
            opt.step()
            opt.zero_grad(set_to_none=True)
            t.step(step=step)
        torch.cuda.synchronize()
    gpus = sorted(d for d in t.totals() if d >= 0)
    print("CHILD " + json.dumps({"gpus": gpus, "peak": t.peak_bytes(),
                                 "gpu_off_reason": t.gpu_off_reason}), flush=True)


# ---- the parent ----------------------------------------------------------------------


def gpu_or_reason():
    try:
        import torch
    except ImportError:
        return "PyTorch is not installed (pip install torch)"
    if not torch.cuda.is_available():
        return f"PyTorch {torch.__version__} found no usable CUDA GPU"
    return None


def run_child(args, remedy, on, trace):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    if remedy == "expandable" and on:
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    elif remedy == "expandable":
        env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    cfg = {k: getattr(args, k) for k in ("vocab", "dim", "heads", "layers", "seq", "batch", "steps")}
    cmd = [sys.executable, os.path.abspath(__file__), "--child", remedy, "on" if on else "off", trace,
           json.dumps(cfg)]
    start = time.monotonic()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    took = time.monotonic() - start
    info = next((json.loads(line[6:]) for line in p.stdout.splitlines() if line.startswith("CHILD ")), None)
    if p.returncode != 0 or info is None:
        sys.stderr.write(p.stdout + p.stderr)
        raise SystemExit(f"remedy_compare: the run {'with' if on else 'without'} {remedy} failed "
                         f"(exit status {p.returncode}); its output is above.")
    return info, took


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--remedy", choices=REMEDIES, default="checkpoint")
    parser.add_argument("--out", metavar="DIR", help="where the two traces go (default: a new temporary folder)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--json", action="store_true", help="print RESULT {...} at the end")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        remedy, on, trace, cfg = args.child
        child(remedy, on == "on", trace, json.loads(cfg))
        return 0
    why = gpu_or_reason()
    if why is not None:
        print(f"remedy_compare: this example needs a CUDA GPU, and {why}. Nothing to compare; exiting.")
        return 0
    out = args.out or tempfile.mkdtemp(prefix="memviz-remedy-")
    os.makedirs(out, exist_ok=True)
    traces, infos = [], []
    for on in (False, True):
        trace = os.path.join(out, f"{args.remedy}-{'on' if on else 'off'}.memviz")
        info, took = run_child(args, args.remedy, on, trace)
        print(f"remedy_compare: {'with' if on else 'without'} {args.remedy}: "
              f"{took:.1f} s, trace {trace}", flush=True)
        if not info["gpus"]:
            print(f"remedy_compare: memviz captured no GPU memory ({info['gpu_off_reason']}); "
                  "see python -c 'import memviz; print(memviz.capture_info())'. Exiting.")
            return 0
        traces.append(trace)
        infos.append(info)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    diff = [sys.executable, "-m", "memviz", "diff", *traces]
    print("\n$ python -m memviz diff " + " ".join(traces) + "\n", flush=True)
    p = subprocess.run(diff, env=env, capture_output=True, text=True)
    sys.stdout.write(p.stdout)
    sys.stderr.write(p.stderr)
    if p.returncode != 0:
        return p.returncode
    doc = json.loads(subprocess.run(diff + ["--json"], env=env, capture_output=True, text=True,
                                    check=True).stdout)
    memviz = _memviz()
    for dev in doc["devices"]:
        f = dev["figures"]
        peak, res = f["peak"], f.get("torch_reserved_peak", {})
        line = (f"\nResult on {dev['name']}: {args.remedy} takes the peak from "
                f"{memviz.format_size(peak['a'])} to {memviz.format_size(peak['b'])}"
                + (f" ({peak['ratio']:.2f}x)" if peak["ratio"] else ""))
        if res.get("a") is not None and res.get("b") is not None:
            line += (f"; PyTorch's peak reserved {memviz.format_size(res['a'])} -> "
                     f"{memviz.format_size(res['b'])}")
        print(line + ".")
    if args.json:
        print("RESULT " + json.dumps({"remedy": args.remedy, "traces": traces,
                                      "devices": [{"name": d["name"], **{k: d["figures"][k] for k in
                                                   ("peak", "torch_reserved_peak", "torch_allocated_peak")
                                                   if k in d["figures"]}}
                                                  for d in doc["devices"]]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
