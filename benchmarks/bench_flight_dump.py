"""How long an out-of-memory dump of a full flight recorder takes (issue 27,
item 4), through the test doubles on this machine.

    python benchmarks/bench_flight_dump.py [--budget "256 MiB"] [--procs 3]

Each fresh process runs the stand-in caching allocator's churn (mixed
sizes, a live set, from 64 Python call sites at different depths) under
``memviz.track(flight_recorder=budget)`` until the recorder is full (it has
folded events out of its window), then calls the recorder's failure
trigger, as PyTorch's out-of-memory hook does, and times it: that call is
what the failing thread waits for before the exception reaches the
program (it freezes the dump and waits at most 0.1 s for the recorder's
thread to write it); then the time until the dump is on disk. Prints one JSON object:
per process, the dump's seconds, its size, the events it holds, and the
recorder's memory.
"""

import argparse
import json
import os
import subprocess
import sys
import statistics

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")

CHILD = r"""
import ctypes, json, os, sys, tempfile, time
from pathlib import Path
sys.path[:0] = [{root!r}, {tests!r}]
from fake_cupti import FakeCupti, build
lib_path = build(); os.environ["MEMVIZ_CUPTI_LIBRARY"] = lib_path
import torch  # noqa: F401  (the integration attaches with torch imported)
import memviz
from memviz.capture.events import OOM, Trigger
import stand_in_allocator as sa
fake = FakeCupti(lib_path); fake.reset()
ans = sa.StandInAnswers(sa.build(Path(tempfile.mkdtemp()) / "bench"), fake.lib.fake_alloc, fake.lib.fake_free)
ans.lib.sa_churn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_uint]
ns = {{}}
exec(compile("".join(f"def site{{i}}(d, fn):\n    return site{{i}}(d - 1, fn) if d else fn()\n" for i in range(64)),
             "<sites>", "exec"), ns)
sites = [ns[f"site{{i}}"] for i in range(64)]
folder = tempfile.mkdtemp()
with memviz.track(flight_recorder={budget!r}, flight_dir=folder) as t:
    t.torch.use_answers(ans)
    fr = t.flight_recorder
    k, t0 = 0, time.monotonic()
    while fr.stats()["folded_events"] == 0 and time.monotonic() - t0 < 600:
        sites[k % 64](k % 7, lambda: ans.lib.sa_churn(20000, 500, k))
        k += 1
        time.sleep(0.001)  # the writer compresses as a program's steps would let it
    st = fr.stats()
    t1 = time.perf_counter()
    fr.on_failure(t, Trigger(OOM, "bench: a planted out-of-memory"))
    blocked = time.perf_counter() - t1
    fr.wait_for_dumps()
    on_disk = time.perf_counter() - t1
    path = fr.dumps[-1]
out = dict(blocked_s=blocked, on_disk_s=on_disk, dump_bytes=os.path.getsize(path), kept_events=st["kept_events"],
           kept_bytes=st["kept_bytes"], recorder_memory=st["memory"], budget=st["budget"],
           fill_s=time.monotonic() - t0, churn_calls=k)
t2 = time.perf_counter(); loaded = memviz.load(path); out["load_s"] = time.perf_counter() - t2
out["events_in_dump"] = loaded.event_count
print("RESULT " + json.dumps(out))
"""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget", default="256 MiB")
    ap.add_argument("--procs", type=int, default=3)
    a = ap.parse_args()
    rows = []
    for _ in range(a.procs):
        code = CHILD.format(root=ROOT, tests=os.path.join(ROOT, "tests"), budget=a.budget)
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1800)
        if p.returncode:
            sys.exit(p.stderr[-3000:])
        rows.append(json.loads([x for x in p.stdout.splitlines() if x.startswith("RESULT ")][-1][7:]))
    print(json.dumps({"budget": a.budget, "processes": rows,
                      "blocked_s_median": statistics.median(r["blocked_s"] for r in rows),
                      "blocked_s_max": max(r["blocked_s"] for r in rows),
                      "on_disk_s_median": statistics.median(r["on_disk_s"] for r in rows),
                      "on_disk_s_max": max(r["on_disk_s"] for r in rows)}, indent=1))


if __name__ == "__main__":
    main()
