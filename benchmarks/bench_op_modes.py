"""What naming the aten op / torch function of each forward allocation would
cost: PyTorch's Python-level interception (a no-op TorchFunctionMode or
TorchDispatchMode) per op, and how many ops the GPT step of
bench_train_step.py runs (CPU, small sizes; the op count does not depend on
the sizes).

    python benchmarks/bench_op_modes.py [--out F.json]

The per-op figure times a loop of small CPU additions with and without the
mode (and with memviz's own torch-function labels, memviz/torch/ops.py), in
alternating repeats (median). The step estimate is calls per forward x added
time per call (torch-function calls for the function modes, aten ops for the
dispatch mode), compared with the untracked H200 step (about 28 ms,
benchmarks/RESULTS.md).
"""

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--repeats", type=int, default=7)
    a = ap.parse_args()
    import torch
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    from bench_train_step import build

    class NoOpFunction(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    class CountCalls(TorchFunctionMode):
        n = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            CountCalls.n += 1
            return func(*args, **(kwargs or {}))

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    class NoOpDispatch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    x, y = torch.ones(8), torch.ones(8)
    N = 20000

    def loop():
        t0 = time.perf_counter()
        for _ in range(N):
            torch.add(x, y)
        return (time.perf_counter() - t0) / N * 1e6

    from memviz.torch.ops import OpLabels

    base, fn, disp, ours = [], [], [], []
    for _ in range(a.repeats):
        base.append(loop())
        with NoOpFunction():
            fn.append(loop())
        with NoOpDispatch():
            disp.append(loop())
        labels = OpLabels()  # memviz's own mode: labels each call (ops=True)
        assert labels.install()
        ours.append(loop())
        assert labels.remove() is None

    torch.manual_seed(0)
    GPT = build(torch)
    model = GPT()
    data = torch.randint(0, 50257, (1, 17))
    with CountCalls():
        model(data[:, :-1])
    with Count():
        logits = model(data[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), data[:, 1:].reshape(-1))
        forward_ops = Count.n
        loss.backward()
    result = {
        "per_op_us": {"plain": statistics.median(base), "torch_function_mode": statistics.median(fn),
                      "torch_dispatch_mode": statistics.median(disp), "memviz_ops": statistics.median(ours)},
        "torch_function_calls_forward": CountCalls.n,
        "aten_ops_forward": forward_ops,
        "aten_ops_forward_and_backward": Count.n,
        "torch": torch.__version__,
    }
    step_ms = 28.0
    for mode in ("torch_function_mode", "torch_dispatch_mode", "memviz_ops"):
        extra_us = result["per_op_us"][mode] - result["per_op_us"]["plain"]
        calls = forward_ops if mode == "torch_dispatch_mode" else CountCalls.n
        result[f"{mode}_forward_cost_of_28ms_step"] = calls * extra_us / 1e3 / step_ms
    print(json.dumps(result, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
