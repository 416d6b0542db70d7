"""What-if replay speed (issue 30): events per second on one core, and a
trace of ~20 million events through 4 settings.

    python benchmarks/bench_whatif.py [--tensors 10000000] [--live 2000]
        [--keep /tmp/churn.memviz | --trace /tmp/churn.memviz] [--repeat 2] [--only 1|4]

Records a trace of a churn of tensors (the stand-in caching allocator's
sa_churn: a loop in C, mixed sizes, a live set; with the libcupti test
double, as the CPU tests do), then times `whatif` over it with 1 and with 4
settings in one process, each --repeat times, and reports each run's wall
and CPU time (all threads), the best and the median wall time (events/s
from the best), and the process's peak memory (ru_maxrss) once the trace
is loaded (what `memviz report` holds) and at the end. With the default
ring (MEMVIZ_TRACE_RING) the writer drops events at C speed: a trace with
gaps (whose lost frees leave blocks live until its end); a ring as large as
the run (MEMVIZ_TRACE_RING=32M for 10 M tensors) keeps every event. On one
core: `taskset -c 0 python benchmarks/bench_whatif.py ...`.
"""

import argparse
import ctypes
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
SETTINGS = ["expandable_segments:True", "max_split_size_mb:128", "roundup_power2_divisions:4",
            "garbage_collection_threshold:0.8"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tensors", type=int, default=10_000_000)
    ap.add_argument("--live", type=int, default=2000)
    ap.add_argument("--trace", help="reuse this trace instead of recording one")
    ap.add_argument("--keep", metavar="PATH", help="record the trace to PATH (kept, for --trace)")
    ap.add_argument("--repeat", type=int, default=2, help="timed runs of each (default 2)")
    ap.add_argument("--only", choices=["1", "4"], help="time only 1 setting, or only 4")
    opts = ap.parse_args()
    sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
    import memviz

    path = opts.trace
    out = {}
    if path is None:
        from fake_cupti import FakeCupti, build
        lib_path = build()
        os.environ["MEMVIZ_CUPTI_LIBRARY"] = lib_path
        import torch  # noqa: F401  (the integration attaches with torch imported)
        import stand_in_allocator as sa
        fake = FakeCupti(lib_path)
        fake.reset()
        ans = sa.StandInAnswers(sa.build(Path(tempfile.mkdtemp()) / "bench"), fake.lib.fake_alloc,
                                fake.lib.fake_free)
        ans.lib.sa_churn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_uint]
        path = opts.keep or os.path.join(tempfile.mkdtemp(), "churn.memviz")
        t0 = time.perf_counter()
        with memviz.track(trace=path, depth=8) as t:
            t.torch.use_answers(ans)
            ans.lib.sa_churn(opts.tensors, opts.live, 7)
        out["record_s"] = round(time.perf_counter() - t0, 1)
    t0 = time.perf_counter()
    trace = memviz.load(path)
    out.update(events=trace.event_count, file_mb=round(os.path.getsize(path) / 1e6, 1),
               load_s=round(time.perf_counter() - t0, 1), dropped=trace.dropped_events,
               loaded_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024)
    for label, settings in (("1 setting", []), ("4 settings", SETTINGS)):
        if opts.only and label[0] != opts.only:
            continue
        walls, cpus = [], []
        for _ in range(max(1, opts.repeat)):
            t0, c0 = time.perf_counter(), time.process_time()
            rows = trace.whatif(*settings)
            walls.append(time.perf_counter() - t0)
            cpus.append(time.process_time() - c0)
        best = min(walls)
        out[label] = {"s": round(best, 2), "median_s": round(statistics.median(walls), 2),
                      "runs_s": [round(w, 2) for w in walls], "cpu_s": [round(c, 2) for c in cpus],
                      "events_per_s": int(trace.event_count / best),
                      "reserved_peaks_mib": [r.reserved_peak >> 20 for r in rows]}
    out["max_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
