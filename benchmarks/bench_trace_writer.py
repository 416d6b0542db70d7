"""Where a streamed trace's cost goes, and the native writer against the
Python one, through the libcupti test double.

    python benchmarks/bench_trace_writer.py [--procs 5] [--steps 40] [--out F.json]

(1) breakdown: one flush of the Python writer as it was before the native
    writer (memviz/trace/writer.py, MEMVIZ_TRACE_WRITER=python; its label
    scan, since replaced by naming labels by count, is repeated here) over
    60,000 events (half a second of a GPT
    step's events on the allocator route), stage by stage, with the GIL held
    for each: the ring's drain, the byte planes, the label scan, zlib, the
    write. That is the time the training thread cannot run Python.
(2) a GIL-bound "training step": the main thread runs Python between
    allocations (as PyTorch's dispatcher does, the allocator called with the
    GIL held), 3,700 events a step. Each fresh process runs, in turn and
    rotated every cycle: untracked, tracked, tracked with a trace by the
    Python writer, with a trace by the native writer, and with a 256 MiB
    flight recorder. Per configuration: the median of the per-process
    medians, their spread, the minimum of the process minimums, and the
    median paired ratio to "tracked" (the trace's own cost).

Prints one JSON object (and a table on stderr).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
CONFIGS = ["untracked", "tracked", "trace_python", "trace_native", "flight"]


def _setup():
    sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
    from fake_cupti import FakeCupti, build

    os.environ["MEMVIZ_CUPTI_LIBRARY"] = build()
    import memviz

    return memviz, FakeCupti().with_gil()


def breakdown():
    memviz, fake = _setup()
    import zlib

    from fake_cupti import CBID_cuMemAlloc_v2, CBID_cuMemFree_v2
    from memviz.trace import format as F

    def label_ids(rows):  # the old writer's label scan: every event's label id, as a set
        lo, hi = rows[14::F.EVENT.size], rows[15::F.EVENT.size]
        return {a | (b << 8) for a, b in set(zip(lo, hi))} - {0}

    out = {}
    os.environ["MEMVIZ_TRACE_WRITER"] = "python"
    with tempfile.TemporaryDirectory() as d:
        with memviz.track(trace=os.path.join(d, "t.memviz"), torch=False) as t:
            writer = t.subscribers[-1]
            writer._stop.set()  # this benchmark drains by hand
            reps = []
            for _ in range(5):
                for i in range(30000):
                    fake.free(CBID_cuMemFree_v2, fake.alloc(CBID_cuMemAlloc_v2, 4096 + (i % 97) * 512))
                stages = {}
                t0 = time.perf_counter()
                rows = memviz._core.trace_drain()
                t1 = time.perf_counter()
                payload = F.events_payload(rows)
                t2 = time.perf_counter()
                label_ids(rows)
                t3 = time.perf_counter()
                packed = zlib.compress(payload, F.EVENT_LEVEL)
                t4 = time.perf_counter()
                os.write(writer._fd, packed)
                t5 = time.perf_counter()
                n = len(rows) // F.EVENT.size
                stages = {"events": n, "drain_ms": (t1 - t0) * 1e3, "planes_ms": (t2 - t1) * 1e3,
                          "labels_ms": (t3 - t2) * 1e3, "zlib_ms": (t4 - t3) * 1e3, "write_ms": (t5 - t4) * 1e3}
                reps.append(stages)
    for k in reps[0]:
        out[k] = statistics.median(r[k] for r in reps)
    gil = out["drain_ms"] + out["planes_ms"] + out["labels_ms"]
    out["gil_held_ns_per_event"] = gil * 1e6 / out["events"]
    out["zlib_ns_per_event"] = out["zlib_ms"] * 1e6 / out["events"]
    print(json.dumps(out))


def step_child(steps, cycles):
    memviz, fake = _setup()
    from fake_cupti import CBID_cuMemAlloc_v2, CBID_cuMemFree_v2

    def work(n):  # Python between allocations, as a dispatcher's
        x = 0
        for i in range(n):
            x += i * i
        return x

    def step():
        live = []
        for i in range(1850):
            work(200)
            live.append(fake.alloc(CBID_cuMemAlloc_v2, 4096 + (i % 61) * 4096))
            if len(live) > 64:
                fake.free(CBID_cuMemFree_v2, live.pop(0))
        for a in live:
            fake.free(CBID_cuMemFree_v2, a)

    times = {c: [] for c in CONFIGS}
    d = tempfile.mkdtemp()
    for _ in range(3):
        step()
    for cycle in range(cycles):
        order = CONFIGS[cycle % len(CONFIGS):] + CONFIGS[:cycle % len(CONFIGS)]
        for c in order:
            t = None
            if c != "untracked":
                if c.startswith("trace"):
                    os.environ["MEMVIZ_TRACE_WRITER"] = c.split("_")[1]
                kw = {"trace": os.path.join(d, "t.memviz")} if c.startswith("trace") else {}
                if c == "flight":
                    kw = {"flight_recorder": "256 MiB", "flight_dir": d}
                t = memviz.track(torch=False, **kw).start()
            for i in range(steps):
                t0 = time.perf_counter()
                step()
                if i >= 2:
                    times[c].append((time.perf_counter() - t0) * 1e3)
            if t is not None:
                t.stop()
    print(json.dumps({"times_ms": times, "medians_ms": {c: statistics.median(v) for c, v in times.items()}}))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--procs", type=int, default=5)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--cycles", type=int, default=4)
    ap.add_argument("--out")
    ap.add_argument("--child", choices=["breakdown", "steps"])
    a = ap.parse_args()
    if a.child == "breakdown":
        return breakdown()
    if a.child == "steps":
        return step_child(a.steps, a.cycles)
    me = [sys.executable, os.path.abspath(__file__)]
    b = json.loads(subprocess.run(me + ["--child", "breakdown"], capture_output=True, text=True,
                                  check=True).stdout.strip().splitlines()[-1])
    print(f"Python writer, one flush of {b['events']:,} events: drain {b['drain_ms']:.1f} ms, planes "
          f"{b['planes_ms']:.1f} ms, label scan {b['labels_ms']:.1f} ms (GIL held: "
          f"{b['gil_held_ns_per_event']:.0f} ns/event); zlib {b['zlib_ms']:.1f} ms "
          f"({b['zlib_ns_per_event']:.0f} ns/event, GIL released), write {b['write_ms']:.2f} ms",
          file=sys.stderr)
    runs = []
    for i in range(a.procs):
        p = subprocess.run(me + ["--child", "steps", "--steps", str(a.steps), "--cycles", str(a.cycles)],
                           capture_output=True, text=True, timeout=900)
        if p.returncode:
            print(p.stderr[-3000:], file=sys.stderr)
            continue
        runs.append(json.loads(p.stdout.strip().splitlines()[-1]))
        print(f"process {i}: " + "  ".join(f"{c} {m:.2f}" for c, m in runs[-1]["medians_ms"].items()),
              file=sys.stderr)
    summary = {}
    for c in CONFIGS:
        meds = [r["medians_ms"][c] for r in runs]
        ratios = [r["medians_ms"][c] / r["medians_ms"]["tracked"] for r in runs]
        summary[c] = {"median_ms": statistics.median(meds), "spread_ms": [min(meds), max(meds)],
                      "min_of_min_ms": min(min(r["times_ms"][c]) for r in runs),
                      "ratio_to_tracked": statistics.median(ratios), "ratio_spread": [min(ratios), max(ratios)]}
        s = summary[c]
        print(f"{c:13s} median {s['median_ms']:6.2f} ms  spread {min(meds):.2f}-{max(meds):.2f}  "
              f"min-of-min {s['min_of_min_ms']:.2f}  vs tracked {s['ratio_to_tracked']:.3f} "
              f"({min(ratios):.3f}-{max(ratios):.3f})", file=sys.stderr)
    result = {"breakdown": b, "summary": summary, "runs": runs}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
    print(json.dumps({"breakdown": b, "summary": summary}))


if __name__ == "__main__":
    main()
