"""A loaded trace's replay: the C store's rules (_core.replay) against the
Python copy of them that memviz's trace reader had before.

    python benchmarks/bench_replay.py [--events 2000000] [--procs 5]

Replay is the pass every loaded trace makes once, before its first snapshot,
peak or total: which ALLOC each FREE ends, the live set at the end, each
device's peak. The columns are synthetic but shaped like a training run's:
allocations from a size-class pool with addresses reused, frees mostly in
reverse order, 2 devices, 1 in 8 allocations a PyTorch block inside a
segment. Each configuration runs in ``--procs`` fresh processes, interleaved
(C, Python, C, Python, ...); a process builds the columns, checks that both
replays agree, and times its own configuration 3 times (its minimum counts).

Prints one JSON object: per configuration the median of the process
minimums, their spread (min..max) and the minimum; and the ratio of medians.
"""

import argparse
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from array import array

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
BLOCK = 5  # the kind code of PyTorch's blocks


def columns(n: int):
    """(op, address, size, kind, device) of ``n`` events."""
    import random

    rnd = random.Random(7)
    op, addr, size, kind, dev = bytearray(), array("Q"), array("Q"), bytearray(), array("b")
    live = []
    free_addrs = {c: [] for c in range(12)}
    nxt = 1 << 32
    while len(op) < n:
        if live and (len(live) > 4000 or rnd.random() < 0.45):
            a, s, k, d, c = live.pop() if rnd.random() < 0.9 else live.pop(rnd.randrange(len(live)))
            op.append(2), addr.append(a), size.append(s), kind.append(k), dev.append(d)
            free_addrs[c].append(a)
            continue
        c = rnd.randrange(12)
        s = 512 << c
        if free_addrs[c]:
            a = free_addrs[c].pop()
        else:
            a, nxt = nxt, nxt + s
        k = BLOCK if rnd.random() < 0.125 else 0
        d = rnd.randrange(2)
        op.append(1), addr.append(a), size.append(s), kind.append(k), dev.append(d)
        live.append((a, s, k, d, c))
    return bytes(op), addr, size, bytes(kind), dev


def python_replay(op, addr, size, kind, dev):
    """The rules as the trace reader had them in Python (memviz before the
    C replay): the baseline."""
    n = len(op)
    end = array("q", bytes(8 * n))
    live = {}
    cur, peak, peak_i = [0] * 256, [0] * 256, [-1] * 256
    i = -1
    for o, a, k, s, d in zip(op, addr, kind, size, dev):
        i += 1
        if o == 1:
            key = (a << 8) | k
            j = live.get(key)
            if j is not None:
                end[j] = i
                if k != BLOCK:
                    cur[dev[j]] -= size[j]
            live[key] = i
            if k == BLOCK:
                continue
            c = cur[d] + s
            cur[d] = c
            if c > peak[d]:
                peak[d] = c
                peak_i[d] = i
        elif o == 2:
            j = live.pop((a << 8) | k, None)
            if j is not None:
                end[j] = i
                if k != BLOCK:
                    cur[dev[j]] -= size[j]
    alloc = bytes(1 if o == 1 else 0 for o in range(256))
    alloc_idx = list(itertools.compress(range(n), op.translate(alloc)))
    devices = sorted(set(dev[j] for j in alloc_idx))
    return {"end": end, "live": sorted(live.values()), "peak": {d: peak[d] for d in devices},
            "peak_i": {d: peak_i[d] for d in devices}, "cur": {d: cur[d] for d in devices}}


def child(which: str, n: int) -> None:
    sys.path.insert(0, ROOT)
    from memviz import _core

    cols = columns(n)
    c, p = _core.replay(*cols), python_replay(*cols)
    assert c["end"].tolist() == p["end"].tolist() and c["live"] == p["live"], "the replays disagree"
    assert c["peak"] == p["peak"] and c["peak_i"] == p["peak_i"] and c["cur"] == p["cur"]
    fn = _core.replay if which == "c" else python_replay
    times = []
    for _ in range(3):
        t = time.perf_counter()
        fn(*cols)
        times.append(time.perf_counter() - t)
    print(json.dumps({"min_s": min(times)}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--events", type=int, default=2_000_000)
    ap.add_argument("--procs", type=int, default=5)
    ap.add_argument("--child")
    args = ap.parse_args()
    if args.child:
        child(args.child, args.events)
        return
    mins = {"c": [], "python": []}
    for _ in range(args.procs):
        for which in ("c", "python"):
            out = subprocess.run([sys.executable, __file__, "--child", which, "--events", str(args.events)],
                                 capture_output=True, text=True, check=True).stdout
            mins[which].append(json.loads(out)["min_s"])
    res = {"events": args.events, "procs": args.procs, "machine": platform.node(),
           "python_version": platform.python_version(), "date": time.strftime("%Y-%m-%d")}
    for which, xs in mins.items():
        res[which] = {"median_ms": round(statistics.median(xs) * 1e3, 1),
                      "spread_ms": [round(min(xs) * 1e3, 1), round(max(xs) * 1e3, 1)],
                      "min_ms": round(min(xs) * 1e3, 1)}
    res["python_over_c"] = round(statistics.median(mins["python"]) / statistics.median(mins["c"]), 1)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
