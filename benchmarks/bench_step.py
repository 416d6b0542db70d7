"""Cost of ``t.step()`` with 100,000 live allocations tracked.

    python benchmarks/bench_step.py [--live 100000] [--sites 8] [--calls 2000]

A tracker runs on the libcupti test double (so capture is really on); the C
capture path makes ``--live`` live allocations from ``--sites`` call sites
(``memviz._core._synthetic``). Then it times ``t.step()``:

* ``quiet``: nothing changed since the previous step;
* ``changed``: a few call sites (``--changed``) allocated one block each
  since the previous step (the allocation is made outside the timed region);
* ``changed_new_sites``: the first step that sees new call sites (their
  lines are resolved once and cached);
* ``changed_torch_imported``: ``changed`` with torch imported (the step also
  reads the autograd sequence number).

With PyTorch's CUDA initialised (on a GPU machine, ``--torch-cuda``) each
step also reads PyTorch's allocated/reserved numbers; that case is timed too.

Prints one JSON object: medians, p90 and min in microseconds. The budget is
100 us per step.
"""

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]


def _site_fns(n):
    """n distinct call sites (each its own code object and line)."""
    from memviz import _core

    fns = []
    for i in range(n):
        ns = {"_core": _core}
        exec(compile(f"def site_{i}(addr, size, count):\n    _core._synthetic(addr, size, False, count)\n",
                     f"<site {i}>", "exec"), ns)
        fns.append(ns[f"site_{i}"])
    return fns


def _time(fn, calls, prepare=None):
    out = []
    for _ in range(calls):
        if prepare is not None:
            prepare()
        t0 = time.perf_counter_ns()
        fn()
        out.append(time.perf_counter_ns() - t0)
    out.sort()
    return {"median_us": statistics.median(out) / 1e3, "p90_us": out[int(len(out) * 0.9)] / 1e3,
            "min_us": out[0] / 1e3, "calls": calls}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--live", type=int, default=100_000)
    ap.add_argument("--sites", type=int, default=8)
    ap.add_argument("--changed", type=int, default=3)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--torch-cuda", action="store_true", help="also time with PyTorch's CUDA initialised")
    a = ap.parse_args()

    from fake_cupti import build

    os.environ["MEMVIZ_CUPTI_LIBRARY"] = build()
    import memviz

    if a.torch_cuda:
        import torch

        torch.cuda.init()
        keep = torch.empty(1 << 20, device="cuda")  # noqa: F841 - something for the stats
    fns = _site_fns(a.sites + a.changed + a.calls)
    base_sites, extra = fns[:a.sites], fns[a.sites:]
    with memviz.track(torch=False) as t:
        assert t.gpu_enabled, "capture is not on: the test double did not load"
        per = a.live // a.sites
        addr = 1 << 40
        for fn in base_sites:
            fn(addr, 4096, per)
            addr += per * 256 + (1 << 20)
        t.step()  # first step: resolves the base sites
        live = t.totals()[0]["live_count"]
        quiet = _time(t.step, a.calls)

        changed_fns = base_sites[:a.changed]
        state = {"addr": addr}

        def grow_some():
            for fn in changed_fns:
                fn(state["addr"], 4096, 1)
                state["addr"] += 256

        changed = _time(t.step, a.calls, grow_some)

        it = iter(extra)

        def new_site():
            next(it)(state["addr"], 4096, 1)
            state["addr"] += 256

        new_sites = _time(t.step, min(a.calls, len(extra)), new_site)
        rec = t.steps[-1]
        result = {
            "live_allocations": live,
            "sites": a.sites,
            "changed_sites_per_step": a.changed,
            "quiet": quiet,
            "changed": changed,
            "changed_new_sites": new_sites,
            "budget_us": 100,
            "last_record_lines": [str(g) for g in rec.lines],
            "python": sys.version.split()[0],
        }
        try:  # torch imported (CPU or CUDA): each step also reads the autograd sequence number
            import torch  # noqa: F401

            result["changed_torch_imported"] = _time(t.step, a.calls, grow_some)
        except ImportError:
            pass
        if a.torch_cuda:
            result["torch_cuda"] = _time(t.step, a.calls, grow_some)
            result["torch_fields"] = {k: getattr(t.steps[-1].devices.get(0), k, None)
                                      for k in ("allocated", "reserved")}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
