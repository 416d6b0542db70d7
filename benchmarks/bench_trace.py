"""Trace file cost: bytes per event on disk, load time, report time.

    python benchmarks/bench_trace.py [--steps 200] [--events 1000000] [--reps 3]

(a) bytes per event: a training-like run streamed to a trace through the
    libcupti test double (tests/fake_cupti): a 24-layer model whose forward
    pass allocates activations from a dozen different lines, a backward pass
    that frees them in reverse and allocates gradient temporaries, and an
    optimizer step; addresses are recycled by a size-class pool, as with the
    stream-ordered allocator, and a label marks the phases. "bytes per event"
    is the file size (header, stacks, strings, threads, labels and TIME
    records included) divided by the ALLOC/FREE/FAILED events in it.
(a2) the same for a run that is hard to compress: random sizes up to 1 GiB,
    addresses never reused, frees in random order (200,000 events).
(b) load + peak snapshot time of a trace with ``--events`` events (the same
    run, more steps), in a fresh process: memviz.load(), then
    peak_snapshot().statistics("lineno"), best of ``--reps`` processes.
(c) ``python -m memviz report TRACE --format text`` wall time (fresh process).

Prints one JSON object.
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
MiB = 1 << 20
#: alloc/free helpers live in a pseudo-file that the loader treats as library
#: code, so each allocation is reported at the model line that called them
HELPERS_FILE = "<memviz-bench-helpers>"
HELPERS = """
def make(lib, pool, count, cbid_alloc, cbid_free):
    def alloc(size):
        addr = lib.fake_alloc_at(cbid_alloc, pool.get(size), size)
        count[0] += 1
        return addr, size

    def free(a):
        lib.fake_free(cbid_free, a[0], 0, 0)
        pool.put(a[0], a[1])
        count[0] += 1
    return alloc, free
"""


class Pool:
    """Size-class address recycling, as the driver's stream-ordered pool does."""

    def __init__(self):
        self.free = {}
        self.next = 0x7F00_0000_0000

    def get(self, size):
        lst = self.free.get(size)
        if lst:
            return lst.pop()
        addr = self.next
        self.next += (size + 511) & ~511
        return addr

    def put(self, addr, size):
        self.free.setdefault(size, []).append(addr)


def record(path, steps):
    """Stream a training-like run to path; returns the number of driver events."""
    sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
    from fake_cupti import CBID_cuMemAlloc_v2, CBID_cuMemFree_v2, FakeCupti, build

    lib_path = build()
    os.environ["MEMVIZ_CUPTI_LIBRARY"] = lib_path
    import memviz

    fake = FakeCupti(lib_path)
    lib = fake.lib
    pool = Pool()
    count = [0]

    ns = {}
    exec(compile(HELPERS, HELPERS_FILE, "exec"), ns)
    alloc, free = ns["make"](lib, pool, count, CBID_cuMemAlloc_v2, CBID_cuMemFree_v2)

    hidden, batch = 2048, 8

    def linear(x, out):  # weights stay; the output is an activation
        return alloc(batch * 512 * out * 2)

    def attention(x):
        q = linear(x, hidden)
        k = linear(x, hidden)
        v = linear(x, hidden)
        scores = alloc(batch * 16 * 512 * 512 * 2)
        probs = alloc(batch * 16 * 512 * 512 * 2)
        free(scores)
        o = linear(probs, hidden)
        return [q, k, v, probs, o]

    def mlp(x):
        h = linear(x, 4 * hidden)
        g = alloc(batch * 512 * 4 * hidden * 2)  # gelu
        o = linear(g, hidden)
        return [h, g, o]

    def layer(i, x):
        acts = attention(x)
        acts += mlp(acts[-1])
        acts.append(alloc(batch * 512 * hidden * 2))  # layernorm
        return acts

    def forward():
        acts = []
        with memviz.label("forward"):
            for i in range(24):
                acts.append(layer(i, None))
        return acts

    def backward(acts):
        with memviz.label("backward"):
            for layer_acts in reversed(acts):
                for a in reversed(layer_acts):
                    tmp = alloc(a[1])  # gradient of the activation
                    free(a)
                    free(tmp)

    def optimizer():
        with memviz.label("optimizer"):
            for _ in range(8):
                free(alloc(64 * MiB))

    with memviz.track(trace=path, torch=False):
        weights = [alloc(hidden * hidden * 2) for _ in range(96)]  # noqa: F841 - kept live
        for _ in range(steps):
            backward(forward())
            optimizer()
    return count[0]


def record_random(path, n):
    """The hard case for compression: random sizes up to 1 GiB, addresses
    never reused, frees in random order, uneven gaps between events."""
    import random

    sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
    from fake_cupti import CBID_cuMemAlloc_v2, CBID_cuMemFree_v2, FakeCupti, build

    lib_path = build()
    os.environ["MEMVIZ_CUPTI_LIBRARY"] = lib_path
    import memviz

    lib = FakeCupti(lib_path).lib
    rnd = random.Random(1)
    sites = [lambda size: lib.fake_alloc(CBID_cuMemAlloc_v2, size, 0, 0),
             lambda size: lib.fake_alloc(CBID_cuMemAlloc_v2, size, 0, 0),
             lambda size: lib.fake_alloc(CBID_cuMemAlloc_v2, size, 0, 0)]
    live = []
    with memviz.track(trace=path, torch=False):
        for i in range(n):
            if live and rnd.random() < 0.5:
                lib.fake_free(CBID_cuMemFree_v2, live.pop(rnd.randrange(len(live))), 0, 0)
            else:
                live.append(sites[i % 3](rnd.randrange(1, 1 << 30)))
            if i % 100 == 0:
                sum(range(rnd.randrange(2000)))
    print(json.dumps({"driver_events": n}))


def child_record(path, steps):
    n = record(path, steps)
    print(json.dumps({"driver_events": n}))


def child_load(path):
    sys.path[:0] = [ROOT]
    import memviz

    memviz.frames.add_library_path(HELPERS_FILE)

    t0 = time.perf_counter()
    trace = memviz.load(path)
    t1 = time.perf_counter()
    stats = trace.peak_snapshot().statistics("lineno")
    t2 = time.perf_counter()
    snap = trace.snapshot()
    t3 = time.perf_counter()
    print(json.dumps({"load_s": t1 - t0, "peak_snapshot_s": t2 - t1, "end_snapshot_s": t3 - t2,
                      "events": trace.event_count, "peak_lines": len(stats),
                      "peak_allocations": sum(s.count for s in stats), "end_live": len(snap)}))


def run_child(*args):
    p = subprocess.run([sys.executable, __file__, *args],
                       capture_output=True, text=True, check=True)
    return json.loads(p.stdout.strip().splitlines()[-1])


def event_counts(path):
    sys.path[:0] = [ROOT]
    import memviz

    t = memviz.load(path)
    return {"records": t.event_count, "alloc_free_failed": sum(1 for _ in t.events())}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--child", choices=["record", "record-random", "load"])
    ap.add_argument("--path")
    a = ap.parse_args()
    if a.child == "record":
        return child_record(a.path, a.steps)
    if a.child == "record-random":
        return record_random(a.path, a.steps)
    if a.child == "load":
        return child_load(a.path)
    out = {"machine": platform.machine(), "cpus": os.cpu_count(),
           "python": platform.python_version()}
    with tempfile.TemporaryDirectory() as tmp:
        small = os.path.join(tmp, "train.memviz")
        t0 = time.perf_counter()
        run_child("--child", "record", "--path", small, "--steps", str(a.steps))
        rec_s = time.perf_counter() - t0
        counts = event_counts(small)
        size = os.path.getsize(small)
        out["a_bytes_per_event"] = {
            "steps": a.steps, "file_bytes": size, **counts,
            "bytes_per_event": round(size / counts["alloc_free_failed"], 2),
            "record_wall_s": round(rec_s, 2)}
        hard = os.path.join(tmp, "random.memviz")
        run_child("--child", "record-random", "--path", hard, "--steps", "200000")
        counts_hard = event_counts(hard)
        out["a2_bytes_per_event_random"] = {
            "file_bytes": os.path.getsize(hard), **counts_hard,
            "bytes_per_event": round(os.path.getsize(hard) / counts_hard["alloc_free_failed"], 2)}
        per_step = counts["alloc_free_failed"] / a.steps
        big = os.path.join(tmp, "big.memviz")
        steps = max(1, round(a.events / per_step))
        run_child("--child", "record", "--path", big, "--steps", str(steps))
        counts = event_counts(big)
        loads = [run_child("--child", "load", "--path", big) for _ in range(a.reps)]
        best = min(loads, key=lambda r: r["load_s"] + r["peak_snapshot_s"])
        out["b_load_and_peak"] = {
            "file_bytes": os.path.getsize(big), **counts,
            "bytes_per_event": round(os.path.getsize(big) / counts["alloc_free_failed"], 2),
            **{k: (round(v, 3) if isinstance(v, float) else v) for k, v in best.items()},
            "load_plus_peak_s": round(best["load_s"] + best["peak_snapshot_s"], 3)}
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
        times = []
        for _ in range(a.reps):
            t0 = time.perf_counter()
            subprocess.run([sys.executable, "-m", "memviz", "report", big, "--format", "text"],
                           capture_output=True, text=True, check=True, env=env)
            times.append(time.perf_counter() - t0)
        out["c_report_text_s"] = round(min(times), 3)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
