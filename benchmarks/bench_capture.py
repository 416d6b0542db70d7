"""Capture cost per allocation event, through the libcupti test double.

    python benchmarks/bench_capture.py [--depth 30] [--keep 32] [--n 200000] [--procs 5]
                                       [--library] [--cpu] [--burst K] [--against DIR]

Each fresh process fires n cuMemAlloc_v2 + cuMemFree_v2 pairs from C (the
double's fake_alloc_free_loop, so no ctypes in the loop) at the bottom of a
Python stack `depth` frames deep, once with memviz not subscribed (the
double's own cost) and once inside memviz.track(); the difference is what
memviz adds. Runs alternate A/B inside each process and processes repeat.

``--library``: the recursion that makes the stack deep runs in a file the
frame filter counts as a library's (a ``<frozen ...>`` pseudo-file), as
Inductor's and dynamo's frames are under a compile, and the allocating
calls are C-level (no frame of this file below it): a stack deeper than the
32 frames kept then has its user's frames only at the outer end, and the
walk looks past the innermost frames for them (src/frames.c).

``--keep``: the frames a stack keeps (``track(depth=...)``, default 32).
``--cpu``: time the loop in the calling thread's CPU time, not wall time,
so that time spent descheduled on a shared machine does not count.
``--burst K``: the pairs come in bursts of K with a 1 ms pause between (a
real step's rate: the allocation-bound step makes about 100 events a
millisecond), so the capture queue's drainer thread (src/store.c) keeps up
as it does inside a step; without it the loop makes events ten times
faster than any step and the queue fills. Either way, ``process_*`` also
gives the whole process's CPU time (every thread: the drainer's included).
``--gap BYTES``: between one event and the next the loop writes that many
bytes of a buffer of its own (a cache line every 64), as an operation's
work would between two allocations, so that memviz's lines are cold as
inside a step; the untracked loop does the same writes, so the difference
is still memviz's. ``--against unshared``: this build again, with every
frame written into the queue (``_core._share_frames(False)``), in
alternating processes.
``--against DIR``: another checkout (its extension built): fresh processes
of the two take turns, this one first in odd rounds, the other first in
even ones, and the result is per checkout plus the per-round ratio.
Per event: a pair is two events (the allocation walks the stack, the free
does not). ``memviz_own_ns_per_event`` leaves the double's own callback
dispatch out (measured in the same process, subscribed with the callback
returning at once: ``_core._callback_profile("noop")``), which is CUPTI's part on a
real GPU; ``memviz_added_ns_per_event`` keeps it in.
"""

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


_RECURSE = """
def at_depth(k, fn):
    return at_depth(k - 1, fn) if k > 0 else fn()
"""


def _callback_profile(memviz, mode):
    """The callback's profile for the next start: the _core hook, or in a
    checkout built before it (--against DIR), the environment variable
    that build read."""
    hook = getattr(memviz._core, "_callback_profile", None)
    if hook is not None:
        hook(mode)
    elif mode == "off":
        os.environ.pop("MEMVIZ_CALLBACK_PROFILE", None)
    else:
        os.environ["MEMVIZ_CALLBACK_PROFILE"] = mode


def child(depth, n, reps, library=False, keep=32, cpu=False, root=ROOT, burst=0, gap=0, unshared=False):
    sys.path[:0] = [root, os.path.join(root, "tests")]
    from fake_cupti import FakeCupti, build

    path = build()
    os.environ["MEMVIZ_CUPTI_LIBRARY"] = path
    import memviz

    fake = FakeCupti(path)

    def at_depth(k, fn):
        return at_depth(k - 1, fn) if k > 0 else fn()

    if library:
        ns = {}
        exec(compile(_RECURSE, "<frozen bench recursion>", "exec"), ns)
        at_depth = ns["at_depth"]  # noqa: F811

    here = len(__import__("inspect").stack())
    loop = (lambda: fake.alloc_free_loop_cpu(n)) if cpu else (lambda: fake.alloc_free_loop(n))  # noqa: E731
    probe = lambda: memviz._core._capture_depth(64)  # noqa: E731
    if library:  # no frame of this file below the recursion: C-level callables
        from fake_cupti import CBID_cuMemAlloc_v2, CBID_cuMemFree_v2

        loop = functools.partial(fake._c.fake_alloc_free_loop_cpu if cpu else fake._c.fake_alloc_free_loop,
                                 CBID_cuMemAlloc_v2, CBID_cuMemFree_v2, n, 4096)
        probe = functools.partial(memviz._core._capture_depth, 64)
        here -= 1  # the recursion is one frame deeper for want of the two Python wrappers
    if unshared:  # every frame written into the queue, as before it left shared ones out
        memviz._core._share_frames(False)
    if gap:
        from fake_cupti import CBID_cuMemAlloc_v2, CBID_cuMemFree_v2

        if burst:
            raise SystemExit("--gap and --burst are two rhythms: give one")
        loop = functools.partial(fake._c.fake_alloc_free_loop_gap_cpu, CBID_cuMemAlloc_v2,  # noqa: F811
                                 CBID_cuMemFree_v2, n, 4096, gap)
        if not library:  # a C-level callable, as the probe: both at the depth asked for
            probe = functools.partial(memviz._core._capture_depth, 64)
            here -= 1
    if burst:
        import time

        one = fake._c.fake_alloc_free_loop_cpu if cpu else fake._c.fake_alloc_free_loop
        from fake_cupti import CBID_cuMemAlloc_v2, CBID_cuMemFree_v2

        def loop():  # noqa: F811
            total = 0
            for _ in range(n // burst):
                total += one(CBID_cuMemAlloc_v2, CBID_cuMemFree_v2, burst, 4096)
                time.sleep(0.001)
            return total

        n = n // burst * burst
    import time as _time

    def timed(fn):
        p0 = _time.process_time_ns()
        r = fn()
        return r, _time.process_time_ns() - p0

    base, tracked, pbase, ptracked, noop = [], [], [], [], []
    for _ in range(reps):
        r, p = timed(lambda: at_depth(depth - here - 1, loop))
        base.append(r / n)
        pbase.append(p / n)
        # The double's callback dispatch alone (CUPTI's part, not memviz's):
        # subscribed, the callback returning at once (src/capture.c).
        _callback_profile(memviz, "noop")
        try:
            with memviz.track(depth=keep):
                r, p = timed(lambda: at_depth(depth - here - 1, loop))
                noop.append(r / n)
        finally:
            _callback_profile(memviz, "off")
        with memviz.track(depth=keep) as t:
            frames = at_depth(depth - here - 1, probe)
            r, p = timed(lambda: at_depth(depth - here - 1, loop))
            tracked.append(r / n)
            ptracked.append(p / n)
        assert t.capture_info()["store"]["calls"]["alloc"] == n
        full = t.capture_info()["store"].get("queue_full", 0)
        kicks = t.capture_info()["store"].get("queue_kicks", 0)
    print(json.dumps({"base_ns": statistics.median(base), "tracked_ns": statistics.median(tracked),
                      "dispatch_ns": statistics.median(noop),
                      "process_base_ns": statistics.median(pbase),
                      "process_tracked_ns": statistics.median(ptracked),
                      "queue_full": full, "queue_kicks": kicks, "frames": frames}))


def _run(root, a, unshared=False):
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--depth", str(a.depth), "--n", str(a.n),
           "--reps", str(a.reps), "--keep", str(a.keep), "--root", root]
    cmd += (["--library"] if a.library else []) + (["--cpu"] if a.cpu else [])
    cmd += ["--burst", str(a.burst)] if a.burst else []
    cmd += ["--gap", str(a.gap)] if a.gap else []
    cmd += ["--unshared"] if unshared else []
    p = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(p.stdout.strip().splitlines()[-1])


def _summary(rows, a):
    added = [r["tracked_ns"] - r["base_ns"] for r in rows]
    return {
        "python_frames_at_callback": rows[0]["frames"],
        "double_alone_ns_per_pair": statistics.median(r["base_ns"] for r in rows),
        "tracked_ns_per_pair": statistics.median(r["tracked_ns"] for r in rows),
        "memviz_added_ns_per_alloc_free_pair": statistics.median(added),
        "memviz_added_ns_per_event": statistics.median(added) / 2,
        "spread_added_ns": [min(added), max(added)],
        "min_added_ns": min(added),
        "double_dispatch_ns_per_event": statistics.median(r["dispatch_ns"] - r["base_ns"] for r in rows) / 2,
        "memviz_own_ns_per_event": statistics.median(r["tracked_ns"] - r["dispatch_ns"] for r in rows) / 2,
        "memviz_own_spread_ns": [min(r["tracked_ns"] - r["dispatch_ns"] for r in rows) / 2,
                                 max(r["tracked_ns"] - r["dispatch_ns"] for r in rows) / 2],
        "process_added_ns_per_event": statistics.median(
            r["process_tracked_ns"] - r["process_base_ns"] for r in rows) / 2,
        "queue_full": [r.get("queue_full", 0) for r in rows],
        "queue_kicks": [r.get("queue_kicks", 0) for r in rows],
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--depth", type=int, default=30)
    ap.add_argument("--keep", type=int, default=32)
    ap.add_argument("--n", type=int, default=200000)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--procs", type=int, default=5)
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--library", action="store_true")
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--root", default=ROOT)
    ap.add_argument("--against", default=None)
    ap.add_argument("--burst", type=int, default=0)
    ap.add_argument("--gap", type=int, default=0,
                    help="bytes written between one event and the next (a line every 64), as an "
                         "operation's work would: the capture path's lines are then cold, as in a step")
    ap.add_argument("--unshared", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child(a.depth, a.n, a.reps, a.library, a.keep, a.cpu, a.root, a.burst, a.gap, a.unshared)
    # --against unshared: this build with every frame written (_core._share_frames(False))
    unshared_run = a.against == "unshared"
    roots = [ROOT] + (["unshared"] if unshared_run else [os.path.abspath(a.against)] if a.against else [])
    rows = {r: [] for r in roots}
    for k in range(a.procs):
        for r in (roots if k % 2 == 0 else roots[::-1]):
            rows[r].append(_run(ROOT, a, unshared=True) if r == "unshared" else _run(r, a))
    out = {"processes": a.procs, "depth": a.depth, "keep": a.keep, "library": a.library, "cpu_time": a.cpu,
           "burst": a.burst, "gap_bytes": a.gap}
    out.update(_summary(rows[ROOT], a))
    if a.against:
        out["against"] = {"root": roots[1], **_summary(rows[roots[1]], a)}
        ratios = [(x["tracked_ns"] - x["base_ns"]) / (y["tracked_ns"] - y["base_ns"])
                  for x, y in zip(rows[ROOT], rows[roots[1]])]
        out["added_ratio_this_over_against_per_round"] = {
            "median": statistics.median(ratios), "spread": [min(ratios), max(ratios)]}
        own = [(x["tracked_ns"] - x["dispatch_ns"]) / (y["tracked_ns"] - y["dispatch_ns"])
               for x, y in zip(rows[ROOT], rows[roots[1]])]
        out["own_ratio_this_over_against_per_round"] = {
            "median": statistics.median(own), "spread": [min(own), max(own)]}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
